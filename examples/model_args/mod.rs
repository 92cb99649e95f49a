//! The command line both workers of the demo's model mode share: the model's and the
//! run's sizes.

use nixl_connector::Protocol;
use nixl_rs::cli::{parse_positive, parse_protocol};
use nixl_rs::model_serving::scenario::Scenario;

/// The model and the request, the same on both workers.
#[derive(Debug, clap::Args)]
pub struct ModelArgs {
    /// Decoder layers of the seeded model (8 query heads over 4 KV heads of 16 elements).
    #[arg(long, default_value_t = 4, value_parser = parse_positive::<usize>)]
    pub layers: usize,
    /// Tokens in the prompt.
    #[arg(long, default_value_t = 256, value_parser = parse_positive::<usize>)]
    pub prompt_len: usize,
    /// Tokens the decode generates after the prefill's first.
    #[arg(long, default_value_t = 32, value_parser = parse_positive::<usize>)]
    pub steps: usize,
    /// The connector's protocol: native or vllm.
    #[arg(long, default_value = "native", value_parser = parse_protocol)]
    pub protocol: Protocol,
}

impl ModelArgs {
    /// The run these arguments describe: TP 1 → 1 in blocks of 16 tokens, packed K and V in
    /// HND, no prefix hit.
    pub fn scenario(&self) -> Scenario {
        Scenario {
            layers: self.layers,
            prompt_len: self.prompt_len,
            steps: self.steps,
            ..Scenario::tp1(self.protocol == Protocol::Vllm)
        }
    }
}

/// Runs `work` to its end on a multi-thread tokio runtime of two workers: the connector's
/// workers run their side channels on the runtime they are created in.
pub fn block_on<F: std::future::Future>(work: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(work)
}

//! The prefill engine of the demo's model mode: computes a prompt's KV with the seeded model
//! (`kv-model`) into its registered blocks, finishes the request through the connector,
//! writes the first token and the request's `kv_transfer_params` to the handoff file, and
//! waits until the decode (`model_decode`) has read the blocks.
//!
//! ```sh
//! cargo run --release --example model_prefill -- --handoff /tmp/handoff.json
//! ```

mod model_args;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use kv_model::argmax;
use nixl_rs::cli::parse_positive;
use nixl_rs::model_serving::handoff::Handoff;
use nixl_rs::model_serving::serving::PrefillEngine;

/// Model-mode prefill: computes the prompt's KV and serves it to one decode.
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Args {
    #[command(flatten)]
    model: model_args::ModelArgs,
    /// Where to write the handoff for the decode (JSON).
    #[arg(long)]
    handoff: PathBuf,
    /// Seconds to wait for the decode's read before giving up.
    #[arg(long, default_value_t = 120, value_parser = parse_positive::<u64>)]
    release_timeout_s: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    model_args::block_on(run(&args))
}

async fn run(args: &Args) -> ExitCode {
    let scenario = args.model.scenario();
    let prefill = PrefillEngine::new(&scenario);
    let start = Instant::now();
    let logits = prefill.compute();
    let prefill_compute_s = start.elapsed().as_secs_f64();
    let (params, mut scheduler) = prefill.finish();
    let handoff = Handoff {
        first_token: argmax(&logits),
        params,
        prefill_compute_s,
    };
    if let Err(err) = handoff.write(&args.handoff) {
        eprintln!("model_prefill: write {}: {err}", args.handoff.display());
        return ExitCode::FAILURE;
    }
    println!(
        "model_prefill: {} prompt tokens through {} layers in {:.1} ms; first token {}",
        scenario.prompt_len,
        scenario.layers,
        prefill_compute_s * 1e3,
        handoff.first_token
    );
    let wait = Duration::from_secs(args.release_timeout_s);
    if prefill.released(&mut scheduler, wait).await {
        println!("model_prefill: the decode read the blocks; released");
        ExitCode::SUCCESS
    } else {
        eprintln!("model_prefill: no decode read the blocks within {wait:?}");
        ExitCode::FAILURE
    }
}

//! The root README's connector example ("Using the connector"), compiled: the lines between
//! the markers below are the README's code block, word for word (`tests/docs_truth.rs`
//! checks that they are), wrapped in a function that takes what the README says the
//! engine has: its cache's `spec`, a prefill's `params` for a request to load, and the
//! params `asked` a finished request arrived with. It is built, not run (`cargo build
//! --examples`); the runnable pair is `nixl-connector/examples/kv_prefill.rs` and
//! `kv_decode.rs`.

use nixl_connector::{KvCacheSpec, KvTransferParams};

/// One engine serving as a decode, then as a prefill, as the README shows it (laid out as
/// the README's block is, hence not formatted).
#[rustfmt::skip]
async fn engine(
    spec: KvCacheSpec,
    params: KvTransferParams,
    asked: KvTransferParams,
) -> Result<(), Box<dyn std::error::Error>> {
    // README BEGIN
    use nixl::kv_config::KvTransferConfig;
    use nixl_connector::{FinishStatus, KvConnectorScheduler, KvConnectorWorker, SchedulerConfig, WorkerConfig};

    // One engine of TP 1, inside a tokio runtime: a worker per TP rank, one scheduler.
    let kv = KvTransferConfig::from_json(r#"{"kv_role": "kv_both", "kv_buffer_device": "cpu"}"#)?;
    let worker = KvConnectorWorker::new(WorkerConfig::new("engine-a", 0, 1, kv.clone()))?;
    worker.register_host_kv_caches(spec)?;          // or register_kv_caches(regions, spec)
    let port = worker.side_channel_addr()?.port();  // where the other engine's handshakes come
    let mut scheduler = KvConnectorScheduler::new(SchedulerConfig::new("engine-a", "127.0.0.1", port, 1, &kv)?);

    // As a decode: load a request's blocks from the prefill its params name.
    scheduler.on_new_request("req-1", Some(&params));
    scheduler.update_state_after_alloc("req-1", &[0, 1], &params)?;  // the blocks it lacks
    let outcome = loop {                            // the engine's steps
        let mut output = scheduler.step(std::slice::from_ref(&worker))?;
        if let Some(outcome) = output.load_outcomes.pop() { break outcome; }  // Loaded, Recompute, ...
        worker.load_ended().await;
    };

    // As a prefill: keep a finished request's blocks for a decode, and give it the params.
    let done = scheduler.request_finished("req-7", &[3, 4], 32, Some(&asked), FinishStatus::LengthCapped);
    let for_decode = done.kv_transfer_params;       // Some(params): a proxy hands them to the decode
    // README END
    let _ = (outcome, for_decode);
    Ok(())
}

fn main() {
    // Built, not run: the README's engine needs a prefill to load from.
    let _ = engine;
}

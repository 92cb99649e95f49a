//! The decode engine of a two-process KV transfer, on the public crates only (`nixl`,
//! `nixl-connector`). It takes the prefill's `kv_transfer_params` (one JSON line, as its
//! argument or on stdin), loads the request's blocks into its own over NIXL (the connector
//! runs the handshake on the prefill's side channel, which brings the prefill's agent
//! metadata), and checks every byte.
//!
//! ```sh
//! cargo run -p nixl-connector --example kv_prefill | cargo run -p nixl-connector --example kv_decode
//! ```

mod kv_pair;

use std::process::ExitCode;

use nixl_connector::{KvConnectorScheduler, KvTransferParams};

/// The request's id on this engine.
const REQUEST: &str = "decode-req-1";

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kv_decode: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let line = match std::env::args().nth(1) {
        Some(arg) => arg,
        None => std::io::stdin()
            .lines()
            .next()
            .ok_or("no params on stdin")??,
    };
    let params: KvTransferParams = serde_json::from_str(&line)?;
    let remote_blocks = params.remote_block_ids.clone();

    let spec = kv_pair::spec();
    let worker = kv_pair::worker("kv-decode", spec.clone())?;
    let mut scheduler = KvConnectorScheduler::new(kv_pair::scheduler_config("kv-decode", &worker)?);
    // This engine allocated its first blocks for the request; they are loaded in order.
    let local: Vec<usize> = (0..remote_blocks.len()).collect();
    scheduler.on_new_request(REQUEST, Some(&params));
    scheduler.update_state_after_alloc(REQUEST, &local, &params)?;
    worker.start_load_kv(&scheduler.build_connector_meta());

    let deadline = tokio::time::Instant::now() + kv_pair::WAIT;
    while !worker.finished().recving.iter().any(|r| r == REQUEST) {
        if tokio::time::timeout_at(deadline, worker.load_ended())
            .await
            .is_err()
        {
            return Err(format!(
                "the load of {REQUEST} did not end within {:?}",
                kv_pair::WAIT
            )
            .into());
        }
    }
    let failed = worker.load_errors();
    if !failed.is_empty() {
        return Err(format!("the load failed for blocks {failed:?}").into());
    }

    let cache = worker.kv_caches()?;
    let len = spec.block_len(0);
    let mut got = vec![0u8; len];
    for layer in 0..spec.num_regions() {
        for (&block, &remote) in local.iter().zip(&remote_blocks) {
            cache.read(layer, block * len, &mut got)?;
            if got != kv_pair::block_bytes(layer, remote) {
                return Err(format!(
                    "layer {layer} block {block} (prefill block {remote}) differs"
                )
                .into());
            }
        }
    }
    let bytes = spec.num_regions() * remote_blocks.len() * len;
    println!(
        "kv_decode: {bytes} bytes ({} blocks x {} layers) read from {}, every byte checked",
        remote_blocks.len(),
        spec.num_regions(),
        params.remote_engine_id.as_deref().unwrap_or("?")
    );
    Ok(())
}

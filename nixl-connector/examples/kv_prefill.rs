//! The prefill engine of a two-process KV transfer, on the public crates only (`nixl`,
//! `nixl-connector`). It writes one request's KV blocks, holds them for a remote decode, and
//! prints the request's `kv_transfer_params` as one JSON line, which is what a proxy hands
//! the decode engine. The decode reads the blocks over NIXL after a handshake on this
//! worker's side channel (which carries the agent metadata); this process exits once the
//! decode's notification frees them.
//!
//! ```sh
//! cargo run -p nixl-connector --example kv_prefill | cargo run -p nixl-connector --example kv_decode
//! ```

mod kv_pair;

use std::io::Write;
use std::process::ExitCode;

use nixl_connector::{FinishStatus, KvConnectorScheduler, KvTransferParams};

/// The request, and the prefill blocks holding its KV.
const REQUEST: &str = "prefill-req-7";
const BLOCKS: [usize; 8] = [3, 4, 5, 6, 20, 21, 22, 31];

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kv_prefill: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let spec = kv_pair::spec();
    let worker = kv_pair::worker("kv-prefill", spec.clone())?;
    let cache = worker.kv_caches()?;
    for layer in 0..spec.num_regions() {
        for block in BLOCKS {
            let at = block * spec.block_len(layer);
            cache.write(layer, at, &kv_pair::block_bytes(layer, block))?;
        }
    }

    // The request is done here; its blocks wait for the decode.
    let mut scheduler =
        KvConnectorScheduler::new(kv_pair::scheduler_config("kv-prefill", &worker)?);
    let asked = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let finished = scheduler.request_finished(
        REQUEST,
        &BLOCKS,
        BLOCKS.len() * 16,
        Some(&asked),
        FinishStatus::LengthCapped,
    );
    // The engine step that finished it (the crate docs' loop): the worker holds its blocks.
    let workers = std::slice::from_ref(&worker);
    scheduler.step(workers)?;
    let params = finished
        .kv_transfer_params
        .ok_or("the scheduler gave no params for the decode")?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", serde_json::to_string(&params)?)?;
    stdout.flush()?;
    eprintln!(
        "kv_prefill: {REQUEST} is in blocks {BLOCKS:?}, side channel {}; waiting for the decode",
        worker.side_channel_addr()?
    );

    let deadline = tokio::time::Instant::now() + kv_pair::WAIT;
    loop {
        if scheduler
            .step(workers)?
            .finished_sending
            .iter()
            .any(|r| r == REQUEST)
        {
            break;
        }
        if tokio::time::timeout_at(deadline, worker.notified())
            .await
            .is_err()
        {
            return Err(format!("no decode read {REQUEST} within {:?}", kv_pair::WAIT).into());
        }
    }
    if worker.send_stats().freed_on_notification != 1 {
        return Err(format!("{REQUEST} was released without the decode's notification").into());
    }
    eprintln!("kv_prefill: the decode read {REQUEST}; its blocks are free");
    Ok(())
}

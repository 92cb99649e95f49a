//! One prefill engine and one decode engine in one process, each with the connector's
//! scheduler and worker halves, moving one request's KV cache over NIXL (DRAM, UCX), then
//! checking a block of it. The suite runs it (tests/pd_pair_example.rs).
//!
//! ```sh
//! cargo run -p nixl-connector --example pd_pair
//! ```

mod kv_pair;

use std::time::{Duration, Instant};

use kv_pair::{scheduler_config, worker};
use nixl_connector::{
    FinishStatus, KvAttention, KvCacheSpec, KvConnectorScheduler, KvLayout, KvTransferParams,
};

/// Visible to the crate: the suite calls it (tests/pd_pair_example.rs).
#[tokio::main]
pub(crate) async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    // 4 layers of 32 blocks of 16 tokens of 8 KV heads of 128 two-byte elements.
    let heads = KvAttention::Mha { total_kv_heads: 8 };
    let block_len = 16 * 8 * 128 * 2;
    let spec = KvCacheSpec::uniform(4, 32, 16, heads, KvLayout::Hnd, block_len);

    // Prefill engine: computes request "r1" into blocks 4..8, then finishes it for a remote decode.
    let prefill = worker("prefill-engine", spec.clone())?;
    let mut prefill_scheduler =
        KvConnectorScheduler::new(scheduler_config("prefill-engine", &prefill)?);
    let cache = prefill.kv_caches()?;
    for layer in 0..spec.num_regions() {
        for block in 4..8 {
            cache.write(
                layer,
                block * block_len,
                &vec![(layer * 10 + block) as u8; block_len],
            )?;
        }
    }
    let request = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let finished = prefill_scheduler.request_finished(
        "r1",
        &[4, 5, 6, 7],
        Some(&request),
        FinishStatus::LengthCapped,
    );
    println!(
        "prefill: delay freeing the blocks: {}",
        finished.delay_free_blocks
    );
    prefill.start_load_kv(&prefill_scheduler.build_connector_meta());
    let params = finished.kv_transfer_params.expect("params for the decode");
    println!("prefill → decode params: {params:?}");

    // Decode engine: allocates blocks 0..4 for "r1" and loads them from the prefill.
    let decode = worker("decode-engine", spec)?;
    let mut decode_scheduler =
        KvConnectorScheduler::new(scheduler_config("decode-engine", &decode)?);
    assert!(KvConnectorScheduler::needs_remote_prefill(Some(&params)));
    decode_scheduler.on_new_request("r1", Some(&params));
    decode_scheduler.update_state_after_alloc("r1", &[0, 1, 2, 3], &params)?;
    decode.start_load_kv(&decode_scheduler.build_connector_meta());

    // Engine steps: poll both workers, for at most 30 s.
    let give_up = Instant::now() + Duration::from_secs(30);
    let (mut received, mut freed) = (false, false);
    while !(received && freed) {
        if Instant::now() > give_up {
            return Err(format!("not done after 30 s: received {received}, freed {freed}").into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        let d = decode.finished();
        if !d.recving.is_empty() {
            let failed = decode.load_errors();
            println!(
                "decode: done receiving {:?}, failed blocks {failed:?}",
                d.recving
            );
            for m in decode.metrics() {
                println!(
                    "decode: {} bytes in {} descriptors in {:?}",
                    m.bytes, m.descriptors, m.duration
                );
            }
            if !failed.is_empty() {
                return Err(format!("blocks {failed:?} failed to load").into());
            }
            received = true;
        }
        let p = prefill.finished();
        if !p.sending.is_empty() {
            println!(
                "prefill: done sending {:?}; its blocks can be freed",
                p.sending
            );
            freed = true;
        }
    }
    let mut block = vec![0u8; block_len];
    decode.kv_caches()?.read(3, 2 * block_len, &mut block)?;
    println!(
        "decode: layer 3 block 2 holds {} (prefill block 6)",
        block[0]
    );
    if block.iter().any(|&b| b != 36) {
        return Err("decode's layer 3 block 2 is not prefill's block 6".into());
    }
    Ok(())
}

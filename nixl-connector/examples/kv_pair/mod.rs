//! What the connector's examples share: the cache's shape, the worker and scheduler set-up,
//! and the bytes `kv_prefill` writes into each block (which `kv_decode` checks). Each example
//! uses part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use nixl::kv_config::KvTransferConfig;
use nixl::platform::BuiltinPlatform;
use nixl_connector::{
    KvAttention, KvCacheSpec, KvConnectorWorker, KvLayout, Lease, LoadFailurePolicy, Protocol,
    SchedulerConfig, WorkerConfig,
};

/// The KV cache of both engines: 4 layers of 32 blocks of 16 tokens of 4 KV heads of 64
/// two-byte elements (8 KiB).
pub fn spec() -> KvCacheSpec {
    let heads = KvAttention::Mha { total_kv_heads: 4 };
    KvCacheSpec::uniform(4, 32, 16, heads, KvLayout::Hnd, 16 * 4 * 64 * 2)
}

/// How long either side waits for the other before giving up.
pub const WAIT: Duration = Duration::from_secs(60);

/// A worker (TP 1, DRAM, UCX) with a zeroed host KV cache of `spec` registered.
pub fn worker(engine_id: &str, spec: KvCacheSpec) -> nixl_connector::Result<KvConnectorWorker> {
    let kv = KvTransferConfig::from_json(
        r#"{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}"#,
    )?;
    let mut config = WorkerConfig::new(engine_id, 0, 1, kv);
    config.platform = Arc::new(BuiltinPlatform::CPU);
    let worker = KvConnectorWorker::new(config)?;
    worker.register_host_kv_caches(spec)?;
    Ok(worker)
}

/// The scheduler half of the engine whose worker is `worker`.
pub fn scheduler_config(
    engine_id: &str,
    worker: &KvConnectorWorker,
) -> nixl_connector::Result<SchedulerConfig> {
    Ok(SchedulerConfig {
        engine_id: engine_id.into(),
        host: "127.0.0.1".into(),
        port: worker.side_channel_addr()?.port(),
        tp_size: 1,
        pp_size: 1,
        dcp_size: 1,
        // Longer than WAIT: kv_prefill's blocks are freed by the decode's notification.
        lease: Lease::new(2 * WAIT)?,
        load_failure_policy: LoadFailurePolicy::default(),
        multi_turn: nixl_connector::MultiTurn::default(),
        protocol: Protocol::Native,
        transfer_mode: nixl_connector::TransferMode::Pull,
        #[cfg(feature = "vllm")]
        vllm_side_channel: None,
    })
}

/// The bytes the prefill computes for `block` of `layer`: different in every block and
/// every position.
pub fn block_bytes(layer: usize, block: usize) -> Vec<u8> {
    (0..spec().block_len(0))
        .map(|i| (i as u8).wrapping_mul(31) ^ (layer * 64 + block) as u8 ^ (i >> 8) as u8)
        .collect()
}

//! An engine's TP ranks in this process over real NIXL (host memory, UCX), speaking the
//! native protocol or vLLM's, each with a registered KV cache of the model's spec; and the
//! engine's scheduler.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::scenario::{model, Scenario};
use nixl::kv_config::KvTransferConfig;
use nixl_connector::vllm::{MetadataServer, VllmChannelLimits};
use nixl_connector::{
    KvCacheGroups, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, Protocol, SchedulerConfig,
    WorkerConfig, KV_CACHE_GROUPS_KEY,
};

/// The total deadline of the workers' side channels.
const SERVER_DEADLINE: Duration = Duration::from_secs(5);

/// The KV cache groups of the scenario's model over blocks of `block_size` tokens.
fn kv_cache_groups(scenario: &Scenario, block_size: usize) -> KvCacheGroups {
    let model = model(scenario);
    scenario
        .group_regions()
        .kv_cache_groups(model.config(), scenario.packing(), block_size)
}

/// A host-memory `kv_transfer_config` speaking the scenario's protocol, with the model's KV
/// cache groups over blocks of `block_size` tokens when it has several, and read-backs of
/// any count of tokens when the scenario has a second turn.
fn transfer_config(scenario: &Scenario, block_size: usize) -> KvTransferConfig {
    let protocol = scenario.protocol();
    let mut config = KvTransferConfig {
        kv_buffer_device: "cpu".to_string(),
        ..Default::default()
    };
    let groups = kv_cache_groups(scenario, block_size);
    let hybrid = groups.len() > 1;
    if hybrid {
        config.kv_connector_extra_config.insert(
            KV_CACHE_GROUPS_KEY.into(),
            serde_json::to_value(groups).unwrap(),
        );
    }
    if scenario.second_turn.is_some() {
        let extra = &mut config.kv_connector_extra_config;
        extra.insert("bidirectional_kv_xfer".into(), true.into());
        extra.insert("kv_recompute_threshold".into(), 0.into());
    }
    if protocol == Protocol::Vllm {
        let extra = &mut config.kv_connector_extra_config;
        extra.insert("protocol".into(), "vllm".into());
        let model = model(scenario);
        let c = model.config();
        extra.insert(
            "vllm_compat_factors".into(),
            serde_json::json!({
                "vllm_version": "0.33.0", "model": "nixl-rs/kv-model", "dtype": "torch.float32",
                "num_kv_heads": c.kv_heads, "head_size": c.head_dim,
                "num_hidden_layers": c.layers, "attn_backend_name": "FLASH_ATTN",
                "cache_dtype": "auto", "is_hma_enabled": hybrid,
            }),
        );
    }
    config
}

/// Rank `rank`'s config of engine `engine` (TP `tp`, blocks of `block_size` tokens), its
/// side channel on `port` (0: any).
fn rank_config(
    scenario: &Scenario,
    engine: &str,
    (rank, tp): (usize, usize),
    block_size: usize,
    port: u16,
) -> WorkerConfig {
    let transfer = transfer_config(scenario, block_size);
    let mut config = WorkerConfig::new(engine, rank, tp, transfer);
    config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
    config.limits.deadline = SERVER_DEADLINE;
    config.side_channel.set_port(port);
    config
}

/// The `tp` ranks of engine `engine`, each with a zeroed registered cache of `spec`. Native:
/// rank `r` listens on rank 0's port + `r` (another run of ports is tried when one is
/// taken); vLLM: every rank publishes to the engine's one side channel.
///
/// # Panics
/// If NIXL or the connector refuses a rank's setup, or no run of free ports is found.
pub fn engine(
    scenario: &Scenario,
    engine: &str,
    spec: &KvCacheSpec,
    tp: usize,
) -> Vec<KvConnectorWorker> {
    if scenario.vllm {
        let server = Arc::new(
            MetadataServer::bind_now(
                SocketAddr::from(([127, 0, 0, 1], 0)),
                VllmChannelLimits::default(),
            )
            .unwrap(),
        );
        return (0..tp)
            .map(|rank| {
                let mut config = rank_config(scenario, engine, (rank, tp), spec.block_size, 0);
                config.vllm_side_channel = Some(server.clone());
                let worker = KvConnectorWorker::new(config).unwrap();
                worker.register_host_kv_caches(spec.clone()).unwrap();
                worker
            })
            .collect();
    }
    for _ in 0..20 {
        let rank0 =
            KvConnectorWorker::new(rank_config(scenario, engine, (0, tp), spec.block_size, 0))
                .unwrap();
        rank0.register_host_kv_caches(spec.clone()).unwrap();
        let port = rank0.side_channel_addr().unwrap().port();
        let mut ranks = vec![rank0];
        for rank in 1..tp {
            let Some(at) = port.checked_add(rank as u16) else {
                break;
            };
            let config = rank_config(scenario, engine, (rank, tp), spec.block_size, at);
            let worker = KvConnectorWorker::new(config).unwrap();
            if worker.register_host_kv_caches(spec.clone()).is_err() {
                break;
            }
            ranks.push(worker);
        }
        if ranks.len() == tp {
            return ranks;
        }
    }
    panic!("no run of {tp} free ports for engine {engine}");
}

/// The scheduler of engine `engine` (blocks of `block_size` tokens), whose ranks are
/// `ranks`.
///
/// # Panics
/// If the connector refuses the scheduler's config.
pub fn scheduler(
    scenario: &Scenario,
    engine: &str,
    block_size: usize,
    ranks: &[KvConnectorWorker],
) -> KvConnectorScheduler {
    let protocol = scenario.protocol();
    let mut config = SchedulerConfig::new(
        engine,
        "127.0.0.1",
        ranks[0].side_channel_addr().unwrap().port(),
        ranks.len(),
        &transfer_config(scenario, block_size),
    )
    .unwrap();
    assert_eq!(config.protocol, protocol);
    if protocol == Protocol::Vllm {
        config.vllm_side_channel = Some(ranks[0].vllm_side_channel().unwrap());
    }
    KvConnectorScheduler::new(config).with_kv_cache_groups(kv_cache_groups(scenario, block_size))
}

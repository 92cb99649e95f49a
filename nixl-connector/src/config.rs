//! A worker's settings, and how its agent metadata reaches peers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nixl::kv_config::KvTransferConfig;
use nixl::platform::Platform;

use crate::wire::ChannelLimits;

/// How a worker's NIXL agent metadata reaches the engines that read from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetadataExchange {
    /// Inside the side channel's handshake message.
    #[default]
    SideChannel,
    /// Through etcd with NIXL's own etcd support: published when the KV caches are
    /// registered (after checking that etcd answers), fetched by agent name during a
    /// handshake. `NIXL_ETCD_ENDPOINTS` must be set before the worker is created; see
    /// [`etcd`](crate::etcd).
    Etcd,
}

/// A worker's settings.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The engine's id (the same on all its ranks).
    pub engine_id: String,
    /// This worker's TP rank.
    pub tp_rank: usize,
    /// The engine's TP size.
    pub tp_size: usize,
    /// vLLM's `kv_transfer_config`: the kv-buffer device and the backends.
    pub kv_transfer_config: KvTransferConfig,
    /// The platform the memory type is resolved for (see [`nixl::platform`]).
    pub platform: Arc<dyn Platform>,
    /// Where this rank's side channel listens (port 0: any free port).
    pub side_channel: SocketAddr,
    /// Side-channel limits.
    pub limits: ChannelLimits,
    /// Total time one load's transfer may take once posted.
    pub transfer_timeout: Duration,
    /// Device id of the KV cache memory, as NIXL describes it.
    pub device_id: u64,
    /// The NIXL agent's name (`None`: `<engine>-rank<r>-<pid>-<n>`, unique in the process).
    pub agent_name: Option<String>,
    /// The NIXL agent's settings: its progress thread and that thread's delay, locking,
    /// telemetry.
    pub agent_config: nixl::AgentConfig,
    /// How the agent metadata reaches peers.
    pub metadata_exchange: MetadataExchange,
}

impl WorkerConfig {
    /// Defaults: the current platform (or `cpu` when none is detected), side channel on
    /// 127.0.0.1 port 0, [`ChannelLimits::default`], 30 s transfers, device 0, a generated
    /// agent name with [`nixl::AgentConfig::default`], metadata in the handshake.
    pub fn new(engine_id: &str, tp_rank: usize, tp_size: usize, kv: KvTransferConfig) -> Self {
        let platform = nixl::platform::current_platform()
            .unwrap_or_else(|_| Arc::new(nixl::platform::BuiltinPlatform::CPU));
        WorkerConfig {
            engine_id: engine_id.to_string(),
            tp_rank,
            tp_size,
            kv_transfer_config: kv,
            platform,
            side_channel: SocketAddr::from(([127, 0, 0, 1], 0)),
            limits: ChannelLimits::default(),
            transfer_timeout: Duration::from_secs(30),
            device_id: 0,
            agent_name: None,
            agent_config: nixl::AgentConfig::default(),
            metadata_exchange: MetadataExchange::default(),
        }
    }
}

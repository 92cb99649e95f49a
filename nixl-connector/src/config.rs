//! A worker's settings, and how its agent metadata reaches peers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nixl::kv_config::KvTransferConfig;
use nixl::platform::Platform;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::geometry::pipeline::PipelineRank;
use crate::lease::Lease;
use crate::transport::auth::SharedSecret;
use crate::transport::peer_networks::PeerNetworks;
use crate::transport::wire::ChannelLimits;
#[cfg(feature = "vllm")]
use crate::vllm::{MetadataServer, VllmChannelLimits};

/// What a decode's scheduler does with a request whose load failed (vLLM's
/// `kv_load_failure_policy`, a key of `kv_transfer_config`, default `fail`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFailurePolicy {
    /// `recompute`: hand the request back for local prefill of the blocks that failed.
    Recompute,
    /// `fail`: fail the request with the reason.
    #[default]
    Fail,
}

impl LoadFailurePolicy {
    /// The policy of `config` (`kv_load_failure_policy`; default [`LoadFailurePolicy::Fail`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value other than `"recompute"` or `"fail"`.
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Self> {
        match config.other.get("kv_load_failure_policy") {
            None => Ok(LoadFailurePolicy::default()),
            Some(Value::String(s)) if s == "recompute" => Ok(LoadFailurePolicy::Recompute),
            Some(Value::String(s)) if s == "fail" => Ok(LoadFailurePolicy::Fail),
            Some(other) => Err(Error::invalid(
                "read the load failure policy",
                format!("kv_load_failure_policy is {other}; use \"recompute\" or \"fail\""),
            )),
        }
    }
}

/// The `kv_connector_extra_config` key naming the [`Protocol`].
pub const PROTOCOL_KEY: &str = "protocol";

/// The protocol a worker and a scheduler speak with other engines: the side channel, the
/// handshake, the notifications and what the transfer params mean. Both engines of a pair
/// must speak the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// The connector's own (`"native"`): one side channel per rank (TP rank `r` of
    /// pipeline stage `s` at the engine's port + `s` × TP size + `r`), length-prefixed MessagePack frames carrying a
    /// [`HandshakeMessage`](crate::HandshakeMessage) both ways, each side checking the
    /// other; notifications `request:reader_tp`.
    #[default]
    Native,
    /// vLLM 0.33's NixlConnector protocol in pull mode (`"vllm"`), so that a Rust engine and
    /// a vLLM engine serve as each other's prefill or decode: one ZMQ ROUTER per engine at
    /// its port answering `get_meta_msg` for each rank by number, the compatibility hash,
    /// `NixlAgentMetadata`, notifications `request:consumers`; see [`vllm`](crate::vllm).
    /// Workers speak it only with the `vllm` feature (a default one): without it, creating
    /// a worker for it fails.
    Vllm,
}

impl Protocol {
    /// The protocol `kv_connector_extra_config.protocol` names (`"native"` or `"vllm"`;
    /// default native).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for any other value.
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Self> {
        match config.kv_connector_extra_config.get(PROTOCOL_KEY) {
            None => Ok(Protocol::default()),
            Some(Value::String(name)) => name.parse(),
            Some(other) => Err(Error::invalid(
                "read the connector protocol",
                format!("kv_connector_extra_config.{PROTOCOL_KEY} is {other}; use \"native\" or \"vllm\""),
            )),
        }
    }

    /// Its name in `kv_connector_extra_config`: `native` or `vllm`.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Native => "native",
            Protocol::Vllm => "vllm",
        }
    }
}

impl std::str::FromStr for Protocol {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self> {
        match name {
            "native" => Ok(Protocol::Native),
            "vllm" => Ok(Protocol::Vllm),
            other => Err(Error::invalid(
                "read the connector protocol",
                format!("unknown protocol {other:?}; use \"native\" or \"vllm\""),
            )),
        }
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a worker's NIXL agent metadata reaches the engines that read from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetadataExchange {
    /// Inside the side channel's handshake message.
    #[default]
    SideChannel,
    /// Through etcd: published when the KV caches are registered (after checking that etcd
    /// answers), with NIXL's own etcd support, or by the connector with etcd credentials, an
    /// `https://` endpoint or a shared secret (sealed under it); a peer's fetched by the connector from
    /// NIXL's key for its agent name during a handshake (bounded in size and time) and
    /// validated as it is loaded. `NIXL_ETCD_ENDPOINTS` (and `NIXL_ETCD_NAMESPACE`, if used)
    /// must be set before the worker is created; see [`etcd`](crate::etcd).
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
    /// This worker's pipeline stage and its engine's stages (`None`: one stage, every layer
    /// registered here). A rank of stage `s` registers the regions of its stage's layers
    /// only; in the native protocol it listens at the engine's port + `s` × TP size + TP
    /// rank, in vLLM's the engine's side channel serves it as `(s, tp_rank)`. A model of
    /// one KV cache group only (as vLLM's pull mode).
    pub pipeline: Option<PipelineRank>,
    /// The engine's decode context parallel size (vLLM's `decode_context_parallel_size`; 1:
    /// none): 1 or the TP size, with an MLA cache of one KV cache group, as vLLM 0.33's
    /// NixlConnector supports it. This rank is DCP rank `tp_rank % dcp_size` and holds the
    /// request's blocks at global positions `dcp_rank`, `dcp_rank + dcp_size`, ...: block
    /// `j` of a request's block list holds position `j * dcp_size + dcp_rank` (see
    /// [`DcpPair`](crate::DcpPair)).
    pub dcp_size: usize,
    /// The engine's prefill context parallel size (vLLM's `prefill_context_parallel_size`;
    /// 1: none), as vLLM 0.33's NixlConnector pairs it: replicated (`dcp_size` 1: each TP
    /// rank's PCP rank 0 holds whole requests and is this engine's worker for it), or
    /// sharded with DCP (`dcp_size` equal to it: the transfer ranks are the PCP ranks, each
    /// a DCP rank, so `tp_size` and `dcp_size` are the PCP size). The workers move KV as
    /// those sizes say; PCP is published in vLLM's `NixlAgentMetadata` (`pcp_size`), where
    /// vLLM's readers check it, and checked against each vLLM peer's as vLLM does (a
    /// replicated PCP engine and a DCP-sharded one do not pair, whichever reads: a prefill
    /// reads a decode's KV back in multi-turn). Above 1 only in a producer, as vLLM's
    /// connector allows it (`kv_role` `kv_consumer` or `kv_both` is refused).
    pub pcp_size: usize,
    /// vLLM's `kv_transfer_config`: the kv-buffer device and the backends.
    pub kv_transfer_config: KvTransferConfig,
    /// The platform the memory type is resolved for (see [`nixl::platform`]).
    pub platform: Arc<dyn Platform>,
    /// Where this rank's side channel listens (port 0: any free port). In vLLM mode without
    /// [`vllm_side_channel`](Self::vllm_side_channel), where the engine's ROUTER is bound.
    pub side_channel: SocketAddr,
    /// Side-channel limits.
    pub limits: ChannelLimits,
    /// Total time one load's transfer may take once posted. A load past it is reported in
    /// [`overdue_loads`](crate::KvConnectorWorker::overdue_loads), and fails with
    /// [`Error::TransferTimeout`] once NIXL has ended its READs (its blocks stay with the
    /// connector until then).
    pub transfer_timeout: Duration,
    /// Device id of the KV cache memory, as NIXL describes it.
    pub device_id: u64,
    /// The NIXL agent's name (`None`: `<engine>-rank<r>-<pid>-<n>`, unique in the process;
    /// `<engine>-pp<s>-rank<r>-<pid>-<n>` for stage `s` of several).
    pub agent_name: Option<String>,
    /// The NIXL agent's settings: its progress thread and that thread's delay, locking,
    /// telemetry.
    pub agent_config: nixl::AgentConfig,
    /// How the agent metadata reaches peers.
    pub metadata_exchange: MetadataExchange,
    /// The KV lease of requests held for a decode (`None`: from the `kv_transfer_config`,
    /// see [`Lease::from_kv_transfer_config`]).
    pub lease: Option<Lease>,
    /// The protocol spoken with other engines (`None`: from the `kv_transfer_config`, see
    /// [`Protocol::from_kv_transfer_config`]).
    pub protocol: Option<Protocol>,
    /// vLLM mode: caps and deadlines of the vLLM side channel, as a decode asking a
    /// prefill and as the ROUTER this worker binds.
    #[cfg(feature = "vllm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "vllm")))]
    pub vllm_limits: VllmChannelLimits,
    /// vLLM mode: the engine's side channel (one ROUTER per engine, as vLLM has it), shared
    /// by the engine's ranks in this process; this rank's handshake payload is published to
    /// it as `(pp_rank, tp_rank)` when the KV caches are registered, and withdrawn when
    /// the worker is dropped. `None`: the worker binds one at [`side_channel`](Self::side_channel),
    /// which [`KvConnectorWorker::vllm_side_channel`](crate::KvConnectorWorker::vllm_side_channel)
    /// gives, so that the engine's other ranks can publish to it (the payloads of ranks in
    /// other processes: [`KvConnectorWorker::vllm_handshake_payload`](crate::KvConnectorWorker::vllm_handshake_payload)).
    #[cfg(feature = "vllm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "vllm")))]
    pub vllm_side_channel: Option<Arc<MetadataServer>>,
    /// Native protocol: the secret both sides of every handshake prove (`None`: from the
    /// `kv_transfer_config` or the environment, see
    /// [`SharedSecret::from_kv_transfer_config`]; no secret there: not authenticated).
    /// vLLM's protocol has no credential and does not use it.
    pub secret: Option<SharedSecret>,
    /// The networks this rank's side channel (either protocol's) answers (`None`: from the
    /// `kv_transfer_config`, see [`PeerNetworks::from_kv_transfer_config`]; any network
    /// when it lists none).
    pub allowed_peers: Option<PeerNetworks>,
}

impl WorkerConfig {
    /// Defaults: one pipeline stage, the current platform (or `cpu` when none is detected), side channel on
    /// 127.0.0.1 port 0, [`ChannelLimits::default`], 30 s transfers, device 0, a generated
    /// agent name with [`nixl::AgentConfig::default`], metadata in the handshake, the lease
    /// and protocol of the `kv_transfer_config`, [`VllmChannelLimits::default`], no shared
    /// vLLM side channel, and the secret and allowed peers of the `kv_transfer_config`.
    pub fn new(engine_id: &str, tp_rank: usize, tp_size: usize, kv: KvTransferConfig) -> Self {
        let platform = nixl::platform::current_platform()
            .unwrap_or_else(|_| Arc::new(nixl::platform::BuiltinPlatform::CPU));
        WorkerConfig {
            engine_id: engine_id.to_string(),
            tp_rank,
            tp_size,
            pipeline: None,
            dcp_size: 1,
            pcp_size: 1,
            kv_transfer_config: kv,
            platform,
            side_channel: SocketAddr::from(([127, 0, 0, 1], 0)),
            limits: ChannelLimits::default(),
            transfer_timeout: Duration::from_secs(30),
            device_id: 0,
            agent_name: None,
            agent_config: nixl::AgentConfig::default(),
            metadata_exchange: MetadataExchange::default(),
            lease: None,
            protocol: None,
            #[cfg(feature = "vllm")]
            vllm_limits: VllmChannelLimits::default(),
            #[cfg(feature = "vllm")]
            vllm_side_channel: None,
            secret: None,
            allowed_peers: None,
        }
    }
}

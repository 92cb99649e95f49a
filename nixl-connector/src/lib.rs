//! A KV-cache connector for Rust serving engines with prefill/decode disaggregation, with
//! the semantics of vLLM's NixlConnector, on the [`nixl`] crate's async API.
//!
//! # The two halves
//! - [`KvConnectorScheduler`] (one per engine) decides which requests load their KV from a
//!   remote prefill ([`KvConnectorScheduler::update_state_after_alloc`]) and which keep
//!   their blocks for a remote decode ([`KvConnectorScheduler::request_finished`]), and
//!   hands the [`KvTransferParams`] between engines: remote engine id, host, port, block
//!   ids, request id, TP size. Each step, [`KvConnectorScheduler::build_connector_meta`]
//!   gives the workers a [`ConnectorMetadata`].
//! - [`KvConnectorWorker`] (one per TP rank) registers the KV cache
//!   ([`KvConnectorWorker::register_kv_caches`]: the regions of a [`KvCacheSpec`], each
//!   with its own block length, the memory type from the
//!   [platform registry](nixl::platform), the backends from `kv_transfer_config`),
//!   answers handshakes on its side channel, starts loads
//!   ([`KvConnectorWorker::start_load`]: one prepared READ per remote rank read from, with
//!   the remote request id as the notification), and reports [`KvConnectorWorker::finished`],
//!   [`KvConnectorWorker::load_errors`] (each failed block with its reason) and
//!   per-transfer [`TransferMetrics`].
//!
//! # A request's lifecycle
//! The prefill keeps a request's blocks under a KV lease until the decode's notification
//! arrives; a decode that still waits sends heartbeats that extend the lease. Prefix-cache
//! hits on the decode load only the blocks it lacks (a full hit only notifies), aborts on
//! either side free blocks at once or as soon as nothing can write them, and failed loads
//! follow the `kv_load_failure_policy`; see [`scheduler`] and the crate's README.
//!
//! # Metrics
//! NIXL's telemetry of every READ, failures by kind, expired leases and handshake times go
//! through the [`metrics`](https://docs.rs/metrics) facade under vLLM's `vllm:nixl_*`
//! names ([`series`]); each load runs in a `nixl_load` tracing span.
//!
//! # Handshake and side channel
//! A decode rank's first load from a prefill rank runs a handshake in the background (the
//! step is never blocked), unless [`KvConnectorWorker::handshake_with`] ran it ahead; the
//! loads after it post their READ within [`KvConnectorWorker::start_load`]. In the
//! handshake the decode rank sends its [`HandshakeMessage`] (engine id, agent metadata,
//! per-region base addresses, its [`KvCacheSpec`] with each region's block length, device
//! id, TP rank and size, protocol version) and gets the prefill's. Both sides run
//! [`check_compatible`], which refuses a mismatched peer with a message naming both values
//! (the first region that differs, for per-region geometry) and gives the [`ReadPlan`].
//! The side channel is tokio with a length-delimited codec and MessagePack (as vLLM's
//! msgspec), with a frame cap, a total deadline per exchange and a cap on concurrent
//! handshakes ([`ChannelLimits`]; past it the oldest is closed with a busy answer, which
//! clients retry, so idle peers cannot lock readers out); a peer's declared length is refused
//! before anything is allocated for it. The agent metadata travels in the handshake, or
//! through etcd ([`MetadataExchange::Etcd`]); either way it is validated as it is loaded, and
//! a remote agent is loaded again only when its metadata changed ([`RemoteStats`]). An engine's own control traffic (e.g. what a proxy hands
//! between engines) can use the same wire format: [`Channel`].
//!
//! # Heterogeneous TP and KV geometry
//! The two engines of a pair may differ in TP size and block size, as real deployments of
//! current models do (vLLM 0.33's `tp_mapping.py` and `TransferTopology`); the table in the
//! crate README's "Heterogeneous TP" section lists what is supported and what is refused.
//! - **TP.** One TP size divides the other ([`TpMapping`]). A decode of TP `k × P` reads
//!   its head slice of each block from prefill rank `d / k` (HND, [`KvLayout::Hnd`]); a
//!   decode of TP `D` below the prefill's `P` reads from the `P / D` prefill ranks holding
//!   its heads, each filling its own head slice of the local block, one READ per rank, every
//!   handshake in the background. Prefill rank `r` listens on the side-channel port + `r`,
//!   and holds a request until every decode rank reading it (or told it is not read) has
//!   notified.
//! - **MLA** ([`KvAttention::Mla`]): one latent cache per layer, the same on every rank, so
//!   a decode rank reads each block once, from one prefill rank of its group, and notifies
//!   the others so that they free the request's blocks.
//! - **Replicated KV heads** (TP above the model's KV heads): several ranks hold the same
//!   head ([`KvAttention::heads_of_rank`], vLLM's `compute_head_offset`); each head is read
//!   once, the other holders are notified.
//! - **Block sizes** where one divides the other: blocks split into units of the smaller
//!   size (vLLM's `physical_blocks_per_logical_kv_block`), read a head at a time in HND, so
//!   a prefill's smaller blocks fill whole decode blocks; [`RemoteBlocks::num_tokens`] tells
//!   a decode with smaller blocks where its blocks start in the prompt.
//! - **Regions** ([`KvRegion`]): each registered region has its own block length (K and V
//!   apart with different head sizes, layers of different sizes) and may hold K and V
//!   halves in one block (FlashInfer's blocks-first layout, [`KvRegionKind::KvHalves`]).
//!
//! The [`ReadPlan`] of each remote rank says which bytes of a local block come from where;
//! a vLLM handshake's `NixlAgentMetadata` (`block_lens`, `block_size`, `num_blocks`,
//! `kv_cache_layout`, the TP size) describes the same [`KvCacheSpec`].
//!
//! # Host-buffer mode
//! See [`host_buffer`]: KV in VRAM, staged through a registered host buffer.
//!
//! # Example
//! One prefill and one decode in one process (see `examples/pd_pair.rs` for the whole
//! flow through the scheduler):
//! ```no_run
//! # async fn demo() -> nixl_connector::Result<()> {
//! use nixl::kv_config::KvTransferConfig;
//! use nixl::HostBuffer;
//! use nixl_connector::{KvAttention, KvCacheSpec, KvConnectorWorker, KvLayout, RemoteBlocks, WorkerConfig};
//!
//! // 2 layers of 8 blocks of 16 tokens of 2 KV heads of 64 two-byte elements.
//! let heads = KvAttention::Mha { total_kv_heads: 2 };
//! let spec = KvCacheSpec::uniform(2, 8, 16, heads, KvLayout::Hnd, 16 * 2 * 64 * 2);
//! let cpu = KvTransferConfig { kv_buffer_device: "cpu".into(), ..Default::default() };
//! let layers = || (0..spec.num_regions()).map(|r| HostBuffer::zeroed(spec.region_len(r))).collect::<nixl::Result<Vec<_>>>();
//! let prefill = KvConnectorWorker::new(WorkerConfig::new("prefill", 0, 1, cpu.clone()))?;
//! prefill.register_kv_caches(layers()?, spec.clone())?;
//! let decode = KvConnectorWorker::new(WorkerConfig::new("decode", 0, 1, cpu))?;
//! decode.register_kv_caches(layers()?, spec.clone())?;
//! let remote = RemoteBlocks {
//!     engine_id: "prefill".into(), host: "127.0.0.1".into(),
//!     port: prefill.side_channel_addr()?.port(), block_ids: vec![3, 4],
//!     request_id: "req-1".into(), tp_size: 1, num_tokens: None,
//!     blocks_expiry_time: None, registration_generation: None,
//! };
//! decode.start_load("req-1", &[0, 1], &remote)?;
//! // ...later steps: decode.finished().recving lists "req-1"; decode.load_errors() is empty.
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod block_map;
mod config;
mod connect;
mod engines;
mod error;
pub mod etcd;
mod failure;
pub mod handshake;
pub mod host_buffer;
mod lease;
mod load;
mod metrics;
mod outcomes;
mod params;
pub mod pending;
mod read_plan;
mod remotes;
pub mod scheduler;
mod sending;
pub mod series;
mod shared;
pub mod side_channel;
mod spec;
mod tp_mapping;
pub mod vllm;
mod wire;
mod worker;

pub use config::{LoadFailurePolicy, MetadataExchange, Protocol, WorkerConfig, PROTOCOL_KEY};
pub use engines::{DEFAULT_ENGINE_TTL, ENGINE_TTL_KEY};
pub use error::{Error, Result};
pub use failure::{FailedBlock, FailureKind};
pub use handshake::{check_compatible, HandshakeMessage, PROTOCOL_VERSION};
pub use lease::{Lease, DEFAULT_KV_LEASE_DURATION, LEASE_KEY, MAX_HOLD_KEY, MAX_LEASE};
pub use metrics::{open_fds, RemoteStats, SendStats, TransferMetrics};
pub use outcomes::{Finished, OverdueLoad};
pub use params::{KvTransferParams, RemoteBlocks};
pub use pending::{PendingHandshakes, PendingSlot, PendingStats};
pub use read_plan::{Piece, ReadPlan, RegionPlan};
pub use scheduler::{
    ConnectorMetadata, FinishStatus, HeartbeatSpec, KvConnectorScheduler, LoadOutcome, LoadSpec,
    RequestFinished, SchedulerConfig, SendSpec,
};
pub use sending::NotificationStats;
pub use spec::{KvAttention, KvCacheSpec, KvLayout, KvRegion, KvRegionKind};
pub use tp_mapping::{RankShare, Share, TpMapping, MAX_TP_SIZE};
pub use wire::{Channel, ChannelLimits};
pub use worker::KvConnectorWorker;

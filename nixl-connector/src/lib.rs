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
//!   ([`KvConnectorWorker::register_kv_caches`]: one region per layer, the memory type
//!   from the [platform registry](nixl::platform), the backends from `kv_transfer_config`),
//!   answers handshakes on its side channel, starts loads
//!   ([`KvConnectorWorker::start_load`]: one prepared READ by block id, with the remote
//!   request id as the notification), and reports [`KvConnectorWorker::finished`],
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
//! per-layer base addresses, block count and lengths, block size, heads, layout, device id,
//! TP rank and size, dtype size, protocol version) and gets the prefill's. Both sides run
//! [`check_compatible`], which refuses a mismatched peer with a message naming both values.
//! The side channel is tokio with a length-delimited codec and MessagePack (as vLLM's
//! msgspec), with a frame cap, a total deadline per exchange and a cap on concurrent
//! handshakes ([`ChannelLimits`]; past it the oldest is closed with a busy answer, which
//! clients retry, so idle peers cannot lock readers out); a peer's declared length is refused
//! before anything is allocated for it. The agent metadata travels in the handshake, or
//! through etcd ([`MetadataExchange::Etcd`]); either way it is validated as it is loaded, and
//! a remote agent is loaded again only when its metadata changed ([`RemoteStats`]). An engine's own control traffic (e.g. what a proxy hands
//! between engines) can use the same wire format: [`Channel`].
//!
//! # Heterogeneous TP
//! A decode of TP `k × P` reads from a prefill of TP `P`: decode rank `d` reads head slice
//! `d mod k` of each block from prefill rank `d / k`, which is contiguous in the HND layout
//! ([`KvLayout::Hnd`]). Prefill rank `r` listens on the side-channel port + `r`, and holds a
//! request until all `k` decode ranks reading from it have notified. A decode with a
//! smaller TP than its prefill is not supported (refused with a clear error).
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
//! use nixl_connector::{KvCacheSpec, KvConnectorWorker, KvLayout, RemoteBlocks, WorkerConfig};
//!
//! let spec = KvCacheSpec { num_layers: 2, num_blocks: 8, block_size: 16, num_kv_heads: 2, head_dim: 64, dtype_size: 2, layout: KvLayout::Hnd };
//! let cpu = KvTransferConfig { kv_buffer_device: "cpu".into(), ..Default::default() };
//! let layers = || (0..spec.num_layers).map(|_| HostBuffer::zeroed(spec.layer_len())).collect::<nixl::Result<Vec<_>>>();
//! let prefill = KvConnectorWorker::new(WorkerConfig::new("prefill", 0, 1, cpu.clone()))?;
//! prefill.register_kv_caches(layers()?, spec)?;
//! let decode = KvConnectorWorker::new(WorkerConfig::new("decode", 0, 1, cpu))?;
//! decode.register_kv_caches(layers()?, spec)?;
//! let remote = RemoteBlocks {
//!     engine_id: "prefill".into(), host: "127.0.0.1".into(),
//!     port: prefill.side_channel_addr()?.port(), block_ids: vec![3, 4],
//!     request_id: "req-1".into(), tp_size: 1,
//! };
//! decode.start_load("req-1", &[0, 1], &remote)?;
//! // ...later steps: decode.finished().recving lists "req-1"; decode.load_errors() is empty.
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod block_map;
mod config;
mod connect;
mod error;
pub mod etcd;
mod failure;
pub mod handshake;
pub mod host_buffer;
mod load;
mod metrics;
mod outcomes;
mod params;
pub mod pending;
mod remotes;
pub mod scheduler;
mod sending;
pub mod series;
mod shared;
pub mod side_channel;
mod spec;
pub mod vllm;
mod wire;
mod worker;

pub use config::{
    Lease, LoadFailurePolicy, MetadataExchange, WorkerConfig, DEFAULT_KV_LEASE_DURATION,
    DEFAULT_MAX_HOLD,
};
pub use error::{Error, Result};
pub use failure::{FailedBlock, FailureKind};
pub use handshake::{check_compatible, HandshakeMessage, ReadPlan, PROTOCOL_VERSION};
pub use metrics::{open_fds, RemoteStats, SendStats, TransferMetrics};
pub use outcomes::Finished;
pub use params::{KvTransferParams, RemoteBlocks};
pub use pending::{PendingHandshakes, PendingSlot, PendingStats};
pub use scheduler::{
    ConnectorMetadata, FinishStatus, HeartbeatSpec, KvConnectorScheduler, LoadOutcome, LoadSpec,
    RequestFinished, SchedulerConfig, SendSpec,
};
pub use sending::NotificationStats;
pub use spec::{KvCacheSpec, KvLayout};
pub use wire::{Channel, ChannelLimits};
pub use worker::KvConnectorWorker;

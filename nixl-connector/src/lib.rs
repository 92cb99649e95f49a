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
//! - **Regions** ([`KvRegion`]): each registered region has its own block length (layers
//!   of different sizes, K and V apart with different head sizes); vLLM 0.33 registers one
//!   region per layer with K and V packed per head and token ([`KvCacheSpec::lbhnc`],
//!   `LBHNC`), which reads as one tensor in HND. A region may also hold K and V
//!   halves in one block (FlashInfer's blocks-first layout, [`KvRegionKind::KvHalves`]).
//! - **Pipeline stages** ([`PipelineRank`], [`PipelineStages`]): each rank registers its
//!   stage's layers; a decode of any PP size reads each of its layers from the prefill stage
//!   holding it, TP mapped as above inside each stage, and notifies every stage, so that a
//!   prefill rank frees once every stage's reader is done (the README's "Pipeline
//!   parallelism").
//! - **Decode context parallelism** ([`WorkerConfig::dcp_size`], [`DcpPair`]): an MLA cache
//!   sharded over the TP ranks, rank `r` holding the request's global block positions `r`,
//!   `r + dcp_size`, ...; a decode rank reads each position it holds from the prefill rank
//!   holding it, and ranks meeting none of its positions are only notified (the README's
//!   "Decode context parallelism").
//!
//! The [`ReadPlan`] of each remote rank says which bytes of a local block come from where;
//! a vLLM handshake's `NixlAgentMetadata` (`block_lens`, `block_size`, `num_blocks`,
//! `kv_cache_layout`, the TP size) describes the same [`KvCacheSpec`].
//!
//! # Host-buffer mode
//! See [`host_buffer`]: KV in VRAM, staged through a registered host buffer.
//!
//! # The engine step loop
//! The connector runs on tokio: create each [`KvConnectorWorker`] inside a runtime (its
//! handshakes, loads and notifications are tasks there; no call blocks a step), and keep
//! the runtime running while workers live; end them with
//! [`shutdown`](KvConnectorWorker::shutdown)`.await`. Each engine step runs the loop below,
//! in vLLM's order (`EngineCore.step`): the scheduler's request calls, the connector's step
//! ([`KvConnectorScheduler::step`]: metadata to every worker, every rank's output
//! aggregated), then what the engine does with the result.
//! ```no_run
//! use nixl_connector::{
//!     FinishStatus, KvConnectorScheduler, KvConnectorWorker, KvTransferParams, LoadOutcome,
//! };
//!
//! /// What the engine decided this step (its own scheduler's output).
//! struct EngineStep {
//!     /// New requests and their kv_transfer_params.
//!     arrived: Vec<(String, Option<KvTransferParams>)>,
//!     /// Requests given blocks this step: the blocks they still need.
//!     allocated: Vec<(String, Vec<usize>, KvTransferParams)>,
//!     /// Requests that finished: their blocks, computed tokens, params and status.
//!     finished: Vec<(String, Vec<usize>, usize, Option<KvTransferParams>, FinishStatus)>,
//! }
//!
//! fn engine_step(
//!     scheduler: &mut KvConnectorScheduler,
//!     workers: &[KvConnectorWorker], // every TP rank of this engine
//!     step: EngineStep,
//! ) -> nixl_connector::Result<()> {
//!     // 1. Requests: the decode learns which load KV from a remote prefill.
//!     for (id, params) in &step.arrived {
//!         scheduler.on_new_request(id, params.as_ref());
//!     }
//!     for (id, blocks, params) in &step.allocated {
//!         scheduler.update_state_after_alloc(id, blocks, params)?;
//!     }
//!     // 2. The connector's step: build_connector_meta, start_load_kv on every worker,
//!     //    every worker's finished and load_errors, aggregated, update_connector_output.
//!     let output = scheduler.step(workers)?;
//!     // 3. Prefill: every rank's blocks of these requests were read (or their lease ended).
//!     for id in &output.finished_sending {
//!         println!("free the blocks of {id}");
//!     }
//!     //    Decode: how each load ended.
//!     for outcome in output.load_outcomes {
//!         match outcome {
//!             LoadOutcome::Loaded { request_id } => println!("{request_id} can run"),
//!             LoadOutcome::Recompute { request_id, block_ids, .. } => {
//!                 println!("compute blocks {block_ids:?} of {request_id} here")
//!             }
//!             LoadOutcome::Failed { request_id, reason } => println!("fail {request_id}: {reason}"),
//!             LoadOutcome::AbortedLoadEnded { request_id } => println!("free {request_id}'s blocks"),
//!         }
//!     }
//!     // 4. Finished requests: a prefill's keeps its blocks for the decode, which gets the params.
//!     for (id, blocks, tokens, params, status) in &step.finished {
//!         let done = scheduler.request_finished(id, blocks, *tokens, params.as_ref(), *status);
//!         if let Some(for_decode) = done.kv_transfer_params {
//!             println!("hand {id}'s params to the decode: {}", serde_json::to_string(&for_decode).unwrap());
//!         }
//!         if !done.delay_free_blocks {
//!             println!("free the blocks of {id}");
//!         }
//!     }
//!     Ok(())
//! }
//! ```
//! `examples/pd_pair.rs` runs this loop for a prefill and a decode in one process. With the
//! workers in other processes (vLLM's worker processes), the metadata and each rank's output
//! cross as MessagePack ([`ConnectorMetadata::to_msgpack`], [`WorkerOutput::to_msgpack`]).
//!
//! **Across hosts.** A worker's side channel binds 127.0.0.1 by default
//! ([`WorkerConfig::side_channel`]): set it to an address the other engine reaches (or
//! `0.0.0.0` and a port), and give the scheduler that host and port
//! ([`SchedulerConfig::host`], [`SchedulerConfig::port`]): they go to the decode in the
//! `kv_transfer_params`. In vLLM mode the engine's one ROUTER binds there.
//!
//! ## Hybrid models: several KV cache groups
//! A model with full-attention and sliding-window layers (vLLM's hybrid KV cache manager,
//! `SupportsHMA`) gives each request one list of blocks per KV cache group
//! ([`KvCacheGroups`]). The loop above stays as it is (the connector's step, the load
//! outcomes, `finished_sending` freeing a request's blocks of every group together), but:
//! - the groups are named in the `kv_transfer_config` every worker gets
//!   (`kv_connector_extra_config`, under [`KV_CACHE_GROUPS_KEY`]), and handed to the
//!   scheduler ([`KvConnectorScheduler::with_kv_cache_groups`]);
//! - step 1 calls [`KvConnectorScheduler::update_state_after_alloc_groups`] with the blocks
//!   still needed, one list per group in the groups' order (vLLM's
//!   `get_unhashed_block_ids_all_groups`);
//! - step 4 calls [`KvConnectorScheduler::request_finished_all_groups`] with every group's
//!   blocks.
//!
//! Both clip a sliding-window group's list to the blocks of its window (and an SSM (Mamba)
//! group's to its state-bearing block, in either protocol; its engine's prefill then stops
//! [`KvCacheGroups::prefill_backoff_tokens`] short of the prompt, and its decode loads
//! [`KvCacheGroups::remote_prefill_tokens`]), and the params carry
//! each group's blocks ([`KvTransferParams::remote_block_group_lens`]; in vLLM's JSON, one
//! list per group):
//! ```
//! use nixl::kv_config::KvTransferConfig;
//! use nixl_connector::{
//!     FinishStatus, KvCacheGroups, KvConnectorScheduler, KvTransferParams, SchedulerConfig,
//!     KV_CACHE_GROUPS_KEY,
//! };
//!
//! # fn main() -> nixl_connector::Result<()> {
//! // Full attention, and a sliding window of 20 tokens over blocks of 16: the window
//! // needs a request's last 3 blocks (ceil(20 / 16) + 1).
//! let mut kv = KvTransferConfig::default();
//! kv.kv_connector_extra_config.insert(
//!     KV_CACHE_GROUPS_KEY.into(),
//!     serde_json::json!({"block_size": 16, "groups": [
//!         "full_attention", {"sliding_window": {"window_tokens": 20}}]}),
//! );
//! let groups = KvCacheGroups::from_kv_transfer_config(&kv)?; // each WorkerConfig gets `kv`
//! let scheduler = |engine: &str| -> nixl_connector::Result<KvConnectorScheduler> {
//!     let config = SchedulerConfig::new(engine, "127.0.0.1", 5600, 1, &kv)?;
//!     Ok(KvConnectorScheduler::new(config).with_kv_cache_groups(groups.clone()))
//! };
//! let (mut prefill, mut decode) = (scheduler("prefill")?, scheduler("decode")?);
//!
//! // The prefill's step 4: a prompt of 5 blocks (the window group's first two already
//! // freed, vLLM's null block 0). It keeps every group's blocks until the decode read them.
//! let for_decode = KvTransferParams { do_remote_decode: true, ..Default::default() };
//! let blocks = [vec![1, 2, 3, 4, 5], vec![0, 0, 13, 14, 15]];
//! let done = prefill.request_finished_all_groups(
//!     "req", &blocks, 72, Some(&for_decode), FinishStatus::LengthCapped)?;
//! assert!(done.delay_free_blocks);
//! let params = done.kv_transfer_params.expect("params for the decode");
//! assert_eq!(params.remote_block_ids, [1, 2, 3, 4, 5, 13, 14, 15]);
//! assert_eq!(params.remote_block_group_lens, [5, 3]);
//!
//! // The decode's step 1: the blocks it allocated, one list per group; the window group
//! // loads its last 3, from the prefill's.
//! decode.on_new_request("req", Some(&params));
//! let local = [vec![21, 22, 23, 24, 25], vec![31, 32, 33, 34, 35]];
//! decode.update_state_after_alloc_groups("req", &local, &params)?;
//! let load = &decode.build_connector_meta().loads[0];
//! assert_eq!(load.local_block_ids, [21, 22, 23, 24, 25, 33, 34, 35]);
//! assert_eq!(load.remote.block_ids, [1, 2, 3, 4, 5, 13, 14, 15]);
//! # Ok(())
//! # }
//! ```
//!
//! # Cargo features
//! - **`vllm`** (default): vLLM 0.33's NixlConnector protocol, [`Protocol::Vllm`]: the
//!   `vllm` module (its ZMQ side channel, msgpack payloads, compatibility hash, notifications),
//!   the vLLM fields of [`WorkerConfig`] and [`SchedulerConfig`] and the worker's vLLM
//!   methods. Without it, the native protocol only: a worker asked for vLLM's protocol
//!   refuses to start with [`Error::InvalidArgument`]. It pulls no dependency of its own
//!   (the native protocol uses the same ones): leaving it out saves its compile time. A
//!   scheduler in vLLM mode still gives vLLM's `kv_transfer_params`.
//!
//! etcd ([`MetadataExchange::Etcd`], the [`etcd`] module) is not a feature: it speaks
//! etcd's HTTP/JSON gateway over tokio with the crates the rest of the connector uses, so
//! leaving it out would build nothing less.

#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// Without the `vllm` feature, the docs of items both protocols share still name vLLM's items,
// which are then not built: those links render as plain text instead of failing the docs.
#![cfg_attr(not(feature = "vllm"), allow(rustdoc::broken_intra_doc_links))]

// The crate's folders are floors, declared here bottom up, each importing only the floors
// below it: tests/module_layers.rs names their order (CONNECTOR_FLOORS) and checks it, and
// docs/architecture.md draws them.
mod error;

mod failure;

mod metrics;

mod geometry;

mod transport;

#[cfg(feature = "vllm")]
#[cfg_attr(docsrs, doc(cfg(feature = "vllm")))]
pub mod vllm;

mod lease;
mod multi_turn;
mod transfer_mode;

mod config;

pub mod scheduler;

mod worker;

mod engine_step;

// The public modules of the floors below, at the paths they always had.
#[doc(inline)]
pub use metrics::series;
#[doc(inline)]
pub use transport::{
    auth, capability, etcd, handshake, peer_networks, pending, refusals, side_channel,
};
#[doc(inline)]
pub use worker::host_buffer;

pub use config::{LoadFailurePolicy, MetadataExchange, Protocol, WorkerConfig, PROTOCOL_KEY};
pub use error::{Error, Result};
pub use failure::{FailedBlock, FailureKind};
pub use geometry::dcp::{DcpPair, DcpSizes, MAX_DCP_SIZE};
pub use geometry::engine_layout::EngineLayout;
pub use geometry::groups::{KvCacheGroupKind, KvCacheGroups, KV_CACHE_GROUPS_KEY, SHARED_REGION};
pub use geometry::pipeline::{PipelineRank, PipelineStages, StageSource, MAX_PP_SIZE};
pub use geometry::read_plan::{Piece, ReadPlan, RegionPlan};
pub use geometry::region_layers::{LayerRoute, RegionLayer, MAX_LAYER_NAMES, MAX_LAYER_NAME_LEN};
pub use geometry::spec::{KvAttention, KvCacheSpec, KvLayout, KvRegion, KvRegionKind};
pub use geometry::ssm::SsmState;
pub use geometry::tp_mapping::{RankShare, Share, TpMapping, MAX_TP_SIZE};
pub use lease::{Lease, DEFAULT_KV_LEASE_DURATION, LEASE_KEY, MAX_HOLD_KEY, MAX_LEASE};
pub use metrics::{open_fds, RemoteStats, SendStats, TransferMetrics};
pub use multi_turn::{
    MultiTurn, BIDIRECTIONAL_KEY, DEFAULT_KEPT_TTL, DEFAULT_RECOMPUTE_THRESHOLD,
    KEPT_BLOCKS_CAP_KEY, KEPT_TTL_KEY, RECOMPUTE_THRESHOLD_KEY,
};
pub use scheduler::aggregate::{AggregatedOutput, KvOutputAggregator, WorkerOutput};
pub use scheduler::outcomes::{Finished, OverdueLoad};
pub use scheduler::{
    ConnectorMetadata, ConnectorOutput, FinishStatus, HeartbeatSpec, KvConnectorScheduler,
    LoadOutcome, LoadSpec, MultiTurnStats, RequestFinished, SchedulerConfig, SendSpec,
};
pub use transfer_mode::{
    PushSettings, TransferMode, MAX_PUSH_REGISTRATION_TIMEOUT, PUSH_CONNECTOR_NAME,
    PUSH_REGISTRATION_TIMEOUT_KEY, TRANSFER_MODE_KEY,
};
pub use transport::auth::SharedSecret;
pub use transport::capability::Capability;
pub use transport::handshake::{
    check_compatible, HandshakeMessage, MAX_BLOCKS_PER_ID, PROTOCOL_VERSION,
};
pub use transport::params::{KvTransferParams, RemoteBlocks};
pub use transport::peer_networks::{PeerNetwork, PeerNetworks};
pub use transport::pending::{PendingHandshakes, PendingSlot, PendingStats};
pub use transport::refusals::{Refusal, RefusalCounts};
pub use transport::release_marks::{ReleaseMarks, MARK_LEN, MAX_MARKS};
pub use transport::wire::{Channel, ChannelLimits};
pub use worker::engines::{
    DEFAULT_ENGINE_BACKOFF, DEFAULT_ENGINE_TTL, ENGINE_BACKOFF_KEY, ENGINE_TTL_KEY,
};
pub use worker::push_state::PushStats;
pub use worker::sending::NotificationStats;
pub use worker::KvConnectorWorker;

//! The scheduler half: which requests load KV from a remote prefill, which keep their
//! blocks for a remote decode, and the params handed between the engines; a request's
//! lifecycle as vLLM's NixlConnector has it (the crate's README draws it whole).
//!
//! # Prefill side: delayed freeing under a lease
//! A prefill request whose KV a remote decode will read (`do_remote_decode`) and that
//! stopped normally ([`FinishStatus::LengthCapped`], [`FinishStatus::Stopped`]) is finished
//! with [`RequestFinished::delay_free_blocks`] set: the engine keeps its blocks until
//! [`update_connector_output`](KvConnectorScheduler::update_connector_output) lists the
//! request in [`ConnectorOutput::finished_sending`], once every TP rank has reported it in
//! [`Finished::sending`](crate::Finished::sending). A rank reports it when the decode's notification arrives (one per decode rank reading from this
//! rank), or when the request's **KV lease** ends ([`Lease`], vLLM's `kv_lease_duration`,
//! default 30 s). A decode whose load still waits sends heartbeats that extend the lease,
//! as long as they come (or up to [`Lease::max_hold`], an opt-in cap). An aborted prefill
//! request frees its blocks at once.
//!
//! # Decode side: loads, prefix hits, aborts and failures
//! [`on_new_request`](KvConnectorScheduler::on_new_request) (required, as vLLM's scheduler
//! calls it for every request: the heartbeats that keep the prefill's lease cover the wait
//! from then on) and
//! [`update_state_after_alloc`](KvConnectorScheduler::update_state_after_alloc) take a
//! request whose KV the prefill holds. The engine passes only the local blocks it still
//! needs: with its prefix cache holding the first blocks of the prompt, they pair with the
//! tail of the remote blocks; with none (a full hit) nothing is read and the prefill is
//! only notified. Until its load ends, the request's remote engine gets a heartbeat every
//! [`Lease::heartbeat_interval`]. A request finished before its load starts (aborted)
//! notifies the prefill without reading; one finished while its READ may run keeps its
//! blocks until the load ends ([`LoadOutcome::AbortedLoadEnded`]). Each step,
//! [`update_connector_output`](KvConnectorScheduler::update_connector_output) turns what
//! every TP rank reports into a [`LoadOutcome`] per request, applying the
//! [`LoadFailurePolicy`] to failed loads.

use std::collections::HashMap;
#[cfg(feature = "vllm")]
use std::sync::Arc;
use std::time::Instant;

use nixl::kv_config::KvTransferConfig;
use serde::{Deserialize, Serialize};

use crate::config::{LoadFailurePolicy, Protocol};
use crate::error::{Error, Result};
use crate::failure::FailedBlock;
use crate::geometry::groups::KvCacheGroups;
use crate::lease::Lease;
use crate::multi_turn::MultiTurn;
use crate::scheduler::aggregate::{KvOutputAggregator, WorkerOutput};
use crate::scheduler::lease_epochs::LeaseEpochs;
use crate::transfer_mode::TransferMode;
use crate::transport::capability::Capability;
use crate::transport::params::{KvTransferParams, RemoteBlocks};
#[cfg(feature = "vllm")]
use crate::vllm::MetadataServer;

pub(crate) mod aggregate;
mod lease_epochs;
pub(crate) mod metadata;
pub(crate) mod multi_turn;
pub(crate) mod outcomes;
pub(crate) mod step_wire;

pub use metadata::{ConnectorMetadata, HeartbeatSpec, LoadSpec, SendSpec};
pub use multi_turn::MultiTurnStats;
mod hybrid;

/// How a request finished (vLLM's `RequestStatus.FINISHED_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishStatus {
    /// It reached its length cap (a prefill for a remote decode stops after one token).
    LengthCapped,
    /// It stopped on a stop token or string.
    Stopped,
    /// The client or the engine aborted it.
    Aborted,
    /// It failed.
    Error,
}

impl FinishStatus {
    /// Whether a prefill request that finished so has KV for a remote decode to read
    /// (vLLM 0.33's `request_finished`: length-capped or stopped).
    fn is_complete(self) -> bool {
        matches!(self, FinishStatus::LengthCapped | FinishStatus::Stopped)
    }
}

/// The scheduler's settings: this engine's identity as decodes will reach it, its lease,
/// its load failure policy and the protocol it speaks.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// This engine's id.
    pub engine_id: String,
    /// Host decodes reach this engine's side channel at.
    pub host: String,
    /// Side-channel port: TP rank 0's of stage 0 in the native protocol (rank `r` of stage
    /// `s` listens on port + `s` × TP size + `r`), the engine's one ROUTER in vLLM's
    /// ([`KvConnectorWorker::side_channel_addr`](crate::KvConnectorWorker::side_channel_addr)).
    pub port: u16,
    /// This engine's TP size.
    pub tp_size: usize,
    /// This engine's pipeline stages (1: none): every rank of every stage reports to
    /// [`update_connector_output`](KvConnectorScheduler::update_connector_output), and the
    /// params a decode gets say it (`pp_size`).
    pub pp_size: usize,
    /// This engine's decode context parallel size (1: none; see
    /// [`WorkerConfig::dcp_size`](crate::WorkerConfig::dcp_size)): the params a decode gets
    /// say it (`dcp_size`).
    pub dcp_size: usize,
    /// The KV lease of held requests, and the heartbeat interval of waiting loads.
    pub lease: Lease,
    /// What happens to a request whose load failed.
    pub load_failure_policy: LoadFailurePolicy,
    /// Multi-turn conversations: whether a decode keeps finished requests' blocks for the
    /// next turn's prefill to read back, and when a read is not worth making.
    pub multi_turn: MultiTurn,
    /// The protocol its workers speak: in vLLM's, the params of
    /// [`request_finished`](KvConnectorScheduler::request_finished) carry every key vLLM's
    /// do.
    pub protocol: Protocol,
    /// Which way the KV moves ([`TransferMode`]): the params a prefill hands out say it,
    /// and a decode refuses params of the other mode. The steps are the same in both.
    pub transfer_mode: TransferMode,
    /// vLLM mode: the engine's side channel, whose registration generation the params of
    /// [`request_finished`](KvConnectorScheduler::request_finished) carry (0 without it).
    #[cfg(feature = "vllm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "vllm")))]
    pub vllm_side_channel: Option<Arc<MetadataServer>>,
}

impl SchedulerConfig {
    /// The settings of engine `engine_id` (reached at `host`, its side channel on `port`,
    /// TP `tp_size`, one pipeline stage), with the lease, failure policy and protocol of
    /// `kv_transfer_config`, and no vLLM side channel.
    ///
    /// # Errors
    /// Those of [`Lease::from_kv_transfer_config`],
    /// [`LoadFailurePolicy::from_kv_transfer_config`],
    /// [`MultiTurn::from_kv_transfer_config`], [`Protocol::from_kv_transfer_config`] and
    /// [`TransferMode::from_kv_transfer_config`].
    pub fn new(
        engine_id: &str,
        host: &str,
        port: u16,
        tp_size: usize,
        kv_transfer_config: &KvTransferConfig,
    ) -> Result<Self> {
        let protocol = Protocol::from_kv_transfer_config(kv_transfer_config)?;
        let transfer_mode = TransferMode::from_kv_transfer_config(kv_transfer_config)?;
        Ok(SchedulerConfig {
            engine_id: engine_id.to_string(),
            host: host.to_string(),
            port,
            tp_size,
            pp_size: 1,
            dcp_size: 1,
            lease: Lease::from_kv_transfer_config(kv_transfer_config)?,
            load_failure_policy: LoadFailurePolicy::from_kv_transfer_config(kv_transfer_config)?,
            multi_turn: MultiTurn::from_kv_transfer_config(kv_transfer_config)?,
            protocol,
            transfer_mode,
            #[cfg(feature = "vllm")]
            vllm_side_channel: None,
        })
    }
}

/// The answer to [`KvConnectorScheduler::request_finished`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestFinished {
    /// Keep the blocks until the workers report the request: in
    /// [`ConnectorOutput::finished_sending`] on a prefill, as
    /// [`LoadOutcome::AbortedLoadEnded`] on a decode.
    pub delay_free_blocks: bool,
    /// Params for the decode engine, when a remote decode will read this request.
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// What [`KvConnectorScheduler::update_connector_output`]
/// makes of one step's outputs of every rank.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorOutput {
    /// Held prefill requests that every rank has released (every decode rank notified, or
    /// the lease ended): free their blocks now (vLLM's `finished_sending`).
    pub finished_sending: Vec<String>,
    /// How decode loads that ended on every rank came out.
    pub load_outcomes: Vec<LoadOutcome>,
}

/// How a decode request's load ended, from
/// [`KvConnectorScheduler::update_connector_output`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoadOutcome {
    /// Every block landed: the request can run.
    Loaded {
        /// The local request id.
        request_id: String,
    },
    /// The load failed under [`LoadFailurePolicy::Recompute`]: prefill exactly these local
    /// blocks locally (the others landed).
    Recompute {
        /// The local request id.
        request_id: String,
        /// The local blocks to compute, sorted.
        block_ids: Vec<usize>,
        /// Why the load failed.
        reason: String,
    },
    /// The load failed under [`LoadFailurePolicy::Fail`]: fail the request.
    Failed {
        /// The local request id.
        request_id: String,
        /// Why the load failed.
        reason: String,
    },
    /// The load of a request finished (aborted) while it ran has ended: free its blocks
    /// now (nothing writes them any more).
    AbortedLoadEnded {
        /// The local request id.
        request_id: String,
    },
}

/// Where a decode request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DecodeState {
    /// Known, no blocks allocated yet.
    Waiting,
    /// Its load is scheduled, not yet handed to the workers.
    Scheduled,
    /// Its load is with the workers; `aborted` once the request finished meanwhile.
    Loading { aborted: bool },
    /// Nothing more to load (loaded, failed, or a full prefix hit).
    Done,
}

#[derive(Debug)]
struct DecodeRequest {
    remote: RemoteBlocks,
    state: DecodeState,
    /// A prefill's request reading back a decode's kept blocks (multi-turn), not a decode's
    /// load from its prefill.
    read_back: bool,
}

/// The scheduler half of the connector.
#[derive(Debug)]
pub struct KvConnectorScheduler {
    config: SchedulerConfig,
    /// Decode requests from [`on_new_request`](Self::on_new_request) or
    /// [`update_state_after_alloc`](Self::update_state_after_alloc) until
    /// [`request_finished`](Self::request_finished) (or, for a load aborted while it ran,
    /// until the load ends).
    decodes: HashMap<String, DecodeRequest>,
    loads: HashMap<String, LoadSpec>,
    sends: HashMap<String, SendSpec>,
    aborted: Vec<String>,
    /// Failed blocks of loads whose end the workers have not reported yet.
    failed: HashMap<String, Vec<FailedBlock>>,
    last_heartbeat: Option<Instant>,
    /// Every TP rank's outputs, counted until each has reported a request.
    aggregator: KvOutputAggregator,
    /// The engine's KV cache groups (one full-attention group unless
    /// [`with_kv_cache_groups`](Self::with_kv_cache_groups) says otherwise).
    groups: KvCacheGroups,
    /// Native protocol: how many times the engine's ranks registered their KV caches again
    /// (the registration generation its params carry once above 0).
    registered_again: u64,
    /// Decode side: requests kept for the next turn's prefill.
    kept: multi_turn::Kept,
    /// What multi-turn conversations did so far.
    multi_turn: MultiTurnStats,
    /// Native protocol: numbers each hold for readers (see
    /// [`ReleaseMarks`](crate::ReleaseMarks)).
    epochs: LeaseEpochs,
}

impl KvConnectorScheduler {
    /// A scheduler for an engine with `config`.
    pub fn new(config: SchedulerConfig) -> Self {
        KvConnectorScheduler {
            decodes: HashMap::new(),
            loads: HashMap::new(),
            sends: HashMap::new(),
            aborted: Vec::new(),
            failed: HashMap::new(),
            last_heartbeat: None,
            registered_again: 0,
            kept: multi_turn::Kept::default(),
            multi_turn: MultiTurnStats::default(),
            epochs: LeaseEpochs::default(),
            aggregator: KvOutputAggregator::with_stages(config.pp_size, config.tp_size),
            groups: KvCacheGroups::default(),
            config,
        }
    }

    /// Whether a new request needs its KV from a remote prefill.
    pub fn needs_remote_prefill(params: Option<&KvTransferParams>) -> bool {
        params.is_some_and(|p| p.do_remote_prefill)
    }

    /// A new request arrived (vLLM's `on_new_request`): if a remote prefill holds its KV,
    /// the remote engine gets heartbeats for it while it waits for blocks, so its lease does
    /// not end meanwhile. Params without every remote field are left alone.
    ///
    /// Required for every request that loads from a remote prefill, before
    /// [`update_state_after_alloc`](Self::update_state_after_alloc), which refuses a request
    /// it was not told of: without it, nothing would heartbeat while the request waits in
    /// the engine's queue, and the prefill's lease could end before the load.
    ///
    /// With read-backs on ([`MultiTurn::bidirectional`]), a prefill request whose params name
    /// a decode's kept blocks is taken the same way: its load reads them back (see
    /// [`read_back_tokens`](Self::read_back_tokens)); in the native protocol the decode
    /// gets heartbeats for it meanwhile (vLLM's prefill sends none for read-backs).
    pub fn on_new_request(&mut self, request_id: &str, params: Option<&KvTransferParams>) {
        let Some(params) = params else {
            return;
        };
        let read_back = self.is_read_back(params);
        if !params.do_remote_prefill && !read_back {
            return;
        }
        let Some(remote) = params.remote_blocks() else {
            return;
        };
        self.decodes
            .entry(request_id.to_string())
            .or_insert(DecodeRequest {
                remote,
                state: DecodeState::Waiting,
                read_back,
            });
    }

    /// Records that `request_id` got `local_block_ids` and must load them from the remote
    /// prefill `params` names (vLLM's `update_state_after_alloc`); the load goes out with
    /// the next [`build_connector_meta`](Self::build_connector_meta).
    ///
    /// Pass only the blocks the engine still needs: when its prefix cache holds the first
    /// blocks of the prompt, the rest pair with the tail of `remote_block_ids` (in tokens,
    /// when the two engines' blocks differ in size; the workers check the pairing once they
    /// know the prefill's geometry). An empty list (a full prefix hit) reads nothing: the
    /// prefill is only notified, and the request can run at once (no [`LoadOutcome`]
    /// follows).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `params` lack a remote field or name what the
    /// connector cannot use ([`TransferMode::check_params`]: params of the other transfer
    /// mode among them), when
    /// [`on_new_request`](Self::on_new_request) was not called for the request, when the
    /// request's load was already scheduled (one load per request), or when local blocks
    /// come with an empty `remote_block_ids` (nothing to read them from; vLLM's
    /// `update_state_after_alloc` asserts that no external token comes without remote
    /// blocks): the request then waits for nothing, and the engine computes its blocks; and
    /// for params of several KV cache groups (see
    /// [`update_state_after_alloc_groups`](Self::update_state_after_alloc_groups)).
    pub fn update_state_after_alloc(
        &mut self,
        request_id: &str,
        local_block_ids: &[usize],
        params: &KvTransferParams,
    ) -> Result<()> {
        let groups = params.remote_block_group_lens.len();
        if groups > 1 {
            return Err(Error::invalid(
                "schedule a remote prefill",
                format!("request {request_id:?}: kv_transfer_params hold the block ids of {groups} KV cache groups; pass the local ones per group to update_state_after_alloc_groups"),
            ));
        }
        self.schedule_load(request_id, local_block_ids, params)
    }

    /// [`update_state_after_alloc`](Self::update_state_after_alloc) for `local_block_ids`
    /// paired with `params`' remote blocks as they are.
    fn schedule_load(
        &mut self,
        request_id: &str,
        local_block_ids: &[usize],
        params: &KvTransferParams,
    ) -> Result<()> {
        const OP: &str = "schedule a remote prefill";
        self.config.transfer_mode.check_params(params)?;
        let remote = params.remote_blocks().ok_or_else(|| {
            Error::invalid(OP, format!("request {request_id:?}: kv_transfer_params lack remote_engine_id, remote_host, remote_port, remote_request_id or remote_tp_size"))
        })?;
        let Some(decode) = self.decodes.get_mut(request_id) else {
            return Err(Error::invalid(
                OP,
                format!("request {request_id:?} is unknown: call on_new_request first, when the request arrives, so that its remote prefill's lease is kept while it waits"),
            ));
        };
        let read_back = decode.read_back;
        if decode.state != DecodeState::Waiting {
            return Err(Error::invalid(
                OP,
                format!("request {request_id:?}: its load was already scheduled"),
            ));
        }
        if remote.block_ids.is_empty() && !local_block_ids.is_empty() {
            decode.state = DecodeState::Done;
            return Err(Error::invalid(
                OP,
                format!("request {request_id:?}: {} local blocks to load, but kv_transfer_params have no remote_block_ids; compute them locally", local_block_ids.len()),
            ));
        }
        // A prefill that holds no block is not waiting for a notification.
        let state = if local_block_ids.is_empty() {
            if !read_back {
                crate::metrics::series::prefix_hit(&self.config.engine_id);
            }
            DecodeState::Done
        } else {
            if read_back {
                self.read_back_scheduled();
            }
            DecodeState::Scheduled
        };
        if !remote.block_ids.is_empty() {
            self.loads.insert(
                request_id.to_string(),
                LoadSpec {
                    request_id: request_id.to_string(),
                    local_block_ids: local_block_ids.to_vec(),
                    local_group_lens: Vec::new(),
                    remote: remote.clone(),
                },
            );
        }
        self.decodes.insert(
            request_id.to_string(),
            DecodeRequest {
                remote,
                state,
                read_back,
            },
        );
        Ok(())
    }

    /// Native protocol: every rank of the engine registered its KV caches again
    /// ([`KvConnectorWorker::register_kv_caches_again`](crate::KvConnectorWorker::register_kv_caches_again)),
    /// as vLLM's `set_xfer_handshake_metadata` learns after a wake-up: the params of
    /// requests finished from now on carry a newer registration generation, and a decode
    /// that handshook with the old registration handshakes again before it reads. Call it
    /// after the ranks registered again and before the engine finishes another request. In
    /// vLLM mode the engine's side channel counts the generations itself (each changed
    /// payload published to it), and this changes nothing.
    pub fn kv_caches_registered_again(&mut self) {
        self.registered_again += 1;
    }

    /// A request finished on this engine with `status` (vLLM's `request_finished`).
    ///
    /// - A prefill request for a remote decode (`do_remote_decode`) that is length-capped or
    ///   stopped keeps its `block_ids` (if any) under a lease, and the params for the decode
    ///   are returned, with `num_computed_tokens` (the request's tokens whose KV its blocks
    ///   hold) as `remote_num_tokens`, which a decode with smaller blocks needs (0: unknown).
    ///   An aborted or failed one frees its blocks at once.
    /// - A decode request whose load was not handed to the workers yet (or that was never
    ///   scheduled: aborted while it waited) notifies the prefill without reading, so that
    ///   the prefill frees at once. One whose load the workers have keeps its blocks
    ///   (`delay_free_blocks`) until [`LoadOutcome::AbortedLoadEnded`]: a READ already
    ///   posted cannot be recalled, and must not land in reused blocks.
    /// - With read-backs on ([`MultiTurn::bidirectional`]), a decode request whose load
    ///   ended (or that the prefix cache held whole) and that is length-capped or stopped
    ///   keeps its `block_ids` for the next turn's prefill, under
    ///   [`MultiTurn::kept_ttl`], and the params that name them are returned
    ///   (`do_remote_decode`, `num_computed_tokens` as `remote_num_tokens`). A prefill
    ///   request that read back (or was to) is then a prefill request as above; one that
    ///   never started its read-back tells the decode, which frees at once.
    pub fn request_finished(
        &mut self,
        request_id: &str,
        block_ids: &[usize],
        num_computed_tokens: usize,
        params: Option<&KvTransferParams>,
        status: FinishStatus,
    ) -> RequestFinished {
        let keep = |delay_free_blocks| RequestFinished {
            delay_free_blocks,
            kv_transfer_params: None,
        };
        if let Some(decode) = self.decodes.remove(request_id) {
            match decode.state {
                DecodeState::Waiting | DecodeState::Scheduled => {
                    self.loads.remove(request_id);
                    self.notify_only(request_id, decode.remote);
                    if !decode.read_back {
                        crate::metrics::series::aborted_request(&self.config.engine_id);
                        return keep(false);
                    }
                }
                DecodeState::Loading { .. } => {
                    crate::metrics::series::aborted_request(&self.config.engine_id);
                    self.aborted.push(request_id.to_string());
                    self.decodes.insert(
                        request_id.to_string(),
                        DecodeRequest {
                            remote: decode.remote,
                            state: DecodeState::Loading { aborted: true },
                            read_back: decode.read_back,
                        },
                    );
                    return keep(true);
                }
                DecodeState::Done if decode.read_back => {}
                DecodeState::Done => {
                    let kept = status
                        .is_complete()
                        .then(|| {
                            self.keep_for_read_back(request_id, block_ids, num_computed_tokens)
                        })
                        .flatten();
                    return RequestFinished {
                        delay_free_blocks: kept.is_some(),
                        kv_transfer_params: kept,
                    };
                }
            }
        } else if let Some(remote) = params
            .filter(|p| self.is_read_back(p))
            .and_then(KvTransferParams::remote_blocks)
        {
            // A read-back the engine never started: the decode frees at once.
            self.notify_only(request_id, remote);
        }
        if let Some(remote) = params
            .filter(|p| p.do_remote_prefill)
            .and_then(KvTransferParams::remote_blocks)
        {
            // Finished before the engine told us of it (vLLM's abort-immediately path).
            crate::metrics::series::aborted_request(&self.config.engine_id);
            self.notify_only(request_id, remote);
            return keep(false);
        }
        if !params.is_some_and(|p| p.do_remote_decode) || !status.is_complete() {
            return keep(false);
        }
        let Some(capability) = self.reader_capability(request_id) else {
            return keep(false);
        };
        let delay_free_blocks = !block_ids.is_empty();
        let lease_epoch = delay_free_blocks
            .then(|| {
                let deadline = Instant::now() + self.config.lease.duration();
                let held = (block_ids, num_computed_tokens);
                self.hold_for_readers(request_id, held, deadline, &capability)
            })
            .flatten();
        let num_tokens = delay_free_blocks.then_some(num_computed_tokens);
        let params = self.params_for_decode(request_id, block_ids, num_tokens);
        RequestFinished {
            delay_free_blocks,
            kv_transfer_params: Some(KvTransferParams {
                remote_capability: capability,
                remote_lease_epoch: lease_epoch,
                ..params
            }),
        }
    }

    /// The capability of `request_id`'s params for its readers: a fresh one in the native
    /// protocol, none in vLLM's; `None` when none could be drawn (logged: the request's
    /// blocks are then freed, for no reader could prove it read them).
    fn reader_capability(&self, request_id: &str) -> Option<Option<Capability>> {
        match self.config.protocol {
            Protocol::Native => match Capability::random() {
                Ok(capability) => Some(Some(capability)),
                Err(err) => {
                    tracing::error!(request = request_id, %err, "no capability for the request; its blocks are freed and no reader can read them");
                    None
                }
            },
            Protocol::Vllm => Some(None),
        }
    }

    /// Has the workers hold `request_id`'s blocks `block_ids`, of `num_tokens` computed
    /// tokens, for its readers until `deadline` (from the next metadata on), their
    /// notifications and heartbeats counted under `capability`; in the native protocol the
    /// hold's lease epoch, for the params (the workers raise the blocks' release marks to
    /// it when they release the request).
    fn hold_for_readers(
        &mut self,
        request_id: &str,
        (block_ids, num_tokens): (&[usize], usize),
        deadline: Instant,
        capability: &Option<Capability>,
    ) -> Option<u64> {
        let lease_epoch = match self.config.protocol {
            Protocol::Native => Some(self.epochs.next()),
            Protocol::Vllm => None,
        };
        self.sends.insert(
            request_id.to_string(),
            SendSpec {
                request_id: request_id.to_string(),
                deadline,
                capability: capability.clone(),
                // Push mode writes them; the native protocol raises their marks.
                block_ids: match (lease_epoch, self.config.transfer_mode) {
                    (None, TransferMode::Pull) => Vec::new(),
                    _ => block_ids.to_vec(),
                },
                lease_epoch,
                group_lens: Vec::new(),
                num_tokens: Some(num_tokens).filter(|&n| n > 0),
            },
        );
        lease_epoch
    }

    /// The params a remote decode reads `block_ids` of `request_id` with, `num_tokens` its
    /// computed tokens when its blocks are held (vLLM's `remote_num_tokens`: the request's
    /// `num_computed_tokens`; 0, unknown, is left out in the native protocol). In vLLM mode
    /// they have every key vLLM 0.33's prefill gives (see
    /// [`KvTransferParams::to_vllm_json`]; `remote_num_tokens` 0 when nothing is held, as
    /// vLLM's `request_finished`): a pull, no pipeline or decode context parallelism, no
    /// expiry time (a prefill's blocks live as long as its lease, which the decode's
    /// heartbeats extend), and the side channel's registration generation.
    fn params_for_decode(
        &self,
        request_id: &str,
        block_ids: &[usize],
        num_tokens: Option<usize>,
    ) -> KvTransferParams {
        let config = &self.config;
        let params = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_engine_id: Some(config.engine_id.clone()),
            remote_host: Some(config.host.clone()),
            remote_port: Some(config.port),
            remote_block_ids: block_ids.to_vec(),
            remote_request_id: Some(request_id.to_string()),
            remote_tp_size: Some(config.tp_size),
            remote_num_tokens: num_tokens.filter(|&n| n > 0),
            ..KvTransferParams::default()
        };
        match config.protocol {
            Protocol::Native => KvTransferParams {
                remote_registration_generation: (self.registered_again > 0)
                    .then_some(self.registered_again),
                remote_pp_size: (config.pp_size > 1).then_some(config.pp_size),
                remote_dcp_size: (config.dcp_size > 1).then_some(config.dcp_size),
                transfer_mode: (config.transfer_mode == TransferMode::Push)
                    .then(|| TransferMode::Push.to_string()),
                ..params
            },
            // vLLM's push prefill hands out neither (its blocks live as long as its lease).
            Protocol::Vllm if config.transfer_mode == TransferMode::Push => KvTransferParams {
                remote_num_tokens: Some(num_tokens.unwrap_or(0)),
                remote_dcp_size: Some(config.dcp_size),
                remote_pp_size: Some(config.pp_size),
                transfer_mode: Some(TransferMode::Push.to_string()),
                ..params
            },
            Protocol::Vllm => KvTransferParams {
                remote_num_tokens: Some(num_tokens.unwrap_or(0)),
                remote_dcp_size: Some(config.dcp_size),
                remote_pp_size: Some(config.pp_size),
                remote_registration_generation: Some(registration_generation(config)),
                transfer_mode: Some("pull".to_string()),
                vllm_extra: serde_json::Map::from_iter([(
                    "remote_blocks_expiry_time".to_string(),
                    serde_json::Value::Null,
                )]),
                ..params
            },
        }
    }

    /// Schedules a load that reads nothing and only notifies the prefill, which then frees
    /// the request's blocks (none are held for an empty list).
    fn notify_only(&mut self, request_id: &str, remote: RemoteBlocks) {
        if remote.block_ids.is_empty() {
            return;
        }
        self.loads.insert(
            request_id.to_string(),
            LoadSpec {
                request_id: request_id.to_string(),
                local_block_ids: Vec::new(),
                local_group_lens: Vec::new(),
                remote,
            },
        );
    }

    /// Takes everything scheduled since the last call, for the workers (vLLM's
    /// `build_connector_meta`), with heartbeats if [`Lease::heartbeat_interval`] has passed
    /// since the last.
    pub fn build_connector_meta(&mut self) -> ConnectorMetadata {
        self.meta_at(Instant::now())
    }

    fn meta_at(&mut self, now: Instant) -> ConnectorMetadata {
        let loads: Vec<LoadSpec> = self.loads.drain().map(|(_, load)| load).collect();
        for load in loads.iter().filter(|l| !l.local_block_ids.is_empty()) {
            if let Some(decode) = self.decodes.get_mut(&load.request_id) {
                decode.state = DecodeState::Loading { aborted: false };
            }
        }
        let due = self.last_heartbeat.map_or(true, |at| {
            now.duration_since(at) >= self.config.lease.heartbeat_interval()
        });
        let heartbeats = if due { self.heartbeats() } else { Vec::new() };
        if !heartbeats.is_empty() {
            self.last_heartbeat = Some(now);
        }
        let mut meta = ConnectorMetadata {
            loads,
            sends: self.sends.drain().map(|(_, send)| send).collect(),
            aborted: std::mem::take(&mut self.aborted),
            heartbeats,
            evict: Vec::new(),
        };
        self.evict_over_cap(&mut meta);
        meta
    }

    /// One heartbeat per remote engine, naming its requests that loads here still wait for.
    fn heartbeats(&self) -> Vec<HeartbeatSpec> {
        let mut by_engine: HashMap<&str, HeartbeatSpec> = HashMap::new();
        // vLLM's prefill sends no heartbeat for a read-back.
        let vllm = self.config.protocol == Protocol::Vllm;
        let waiting = self.decodes.values().filter(|d| {
            matches!(
                d.state,
                DecodeState::Waiting
                    | DecodeState::Scheduled
                    | DecodeState::Loading { aborted: false }
            ) && !(vllm && d.read_back)
        });
        for decode in waiting {
            let remote = &decode.remote;
            let heartbeat = by_engine
                .entry(&remote.engine_id)
                .or_insert_with(|| HeartbeatSpec {
                    engine_id: remote.engine_id.clone(),
                    host: remote.host.clone(),
                    port: remote.port,
                    tp_size: remote.tp_size,
                    pp_size: remote.pp_size,
                    dcp_size: remote.dcp_size,
                    request_ids: Vec::new(),
                    capabilities: Vec::new(),
                });
            heartbeat.request_ids.push(remote.request_id.clone());
            heartbeat.capabilities.push(remote.capability.clone());
        }
        by_engine.into_values().collect()
    }

    /// Takes what every TP rank reported in one step (vLLM's `update_connector_output`,
    /// after its `KVOutputAggregator`): one [`WorkerOutput`] per rank
    /// ([`KvConnectorWorker::output`](crate::KvConnectorWorker::output)), aggregated so
    /// that a request is finished only once every rank has reported it. Returns the
    /// prefill requests whose blocks the engine may free now, and how each decode request's
    /// load ended, applying the [`LoadFailurePolicy`] to those with failed blocks (on any
    /// rank); requests it does not track (notification only, or unknown) are skipped. A
    /// load's failed blocks may come steps before its end; they wait for it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `outputs` holds exactly one output of each rank
    /// below [`SchedulerConfig::tp_size`] (nothing is taken then).
    pub fn update_connector_output(&mut self, outputs: &[WorkerOutput]) -> Result<ConnectorOutput> {
        let step = self.aggregator.aggregate(outputs)?;
        self.kept_released(&step.finished.sending);
        Ok(ConnectorOutput {
            load_outcomes: self.loads_ended(&step.finished.recving, &step.load_errors),
            finished_sending: step.finished.sending,
        })
    }

    /// How the loads of `recving` (every rank's ended) came out, with every rank's
    /// `load_errors`.
    fn loads_ended(&mut self, recving: &[String], load_errors: &[FailedBlock]) -> Vec<LoadOutcome> {
        for failed in load_errors {
            let loading = self
                .decodes
                .get(&failed.request_id)
                .is_some_and(|d| matches!(d.state, DecodeState::Loading { .. }));
            if loading {
                self.failed
                    .entry(failed.request_id.clone())
                    .or_default()
                    .push(failed.clone());
            }
        }
        let mut outcomes = Vec::new();
        for request_id in recving {
            let Some(decode) = self.decodes.get_mut(request_id) else {
                continue;
            };
            let failed = self.failed.remove(request_id);
            let request_id = request_id.clone();
            let read_back = decode.read_back;
            match decode.state {
                DecodeState::Loading { aborted: true } => {
                    self.decodes.remove(&request_id);
                    outcomes.push(LoadOutcome::AbortedLoadEnded { request_id });
                }
                DecodeState::Loading { aborted: false } => {
                    decode.state = DecodeState::Done;
                    outcomes.push(match failed {
                        None => LoadOutcome::Loaded { request_id },
                        Some(failed) => self.on_failure(request_id, failed, read_back),
                    });
                }
                _ => {}
            }
        }
        outcomes
    }

    /// The outcome of a load with `failed` blocks under the configured policy (vLLM's
    /// `_handle_invalid_blocks`); a read-back's blocks are always recomputed.
    fn on_failure(
        &self,
        request_id: String,
        failed: Vec<FailedBlock>,
        read_back: bool,
    ) -> LoadOutcome {
        let reason = failed
            .first()
            .map_or_else(String::new, |f| format!("{} failure: {}", f.kind, f.reason));
        if self.config.load_failure_policy == LoadFailurePolicy::Fail && !read_back {
            return LoadOutcome::Failed { request_id, reason };
        }
        let mut block_ids: Vec<usize> = failed.iter().map(|f| f.block_id).collect();
        block_ids.sort_unstable();
        block_ids.dedup();
        LoadOutcome::Recompute {
            request_id,
            block_ids,
            reason,
        }
    }
}

/// The registration generation of the engine's vLLM side channel (0 without one).
#[cfg(feature = "vllm")]
fn registration_generation(config: &SchedulerConfig) -> u64 {
    config
        .vllm_side_channel
        .as_ref()
        .map_or(0, |server| server.registration_generation())
}

/// Without the `vllm` feature there is no vLLM side channel: generation 0.
#[cfg(not(feature = "vllm"))]
fn registration_generation(_config: &SchedulerConfig) -> u64 {
    0
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::failure::FailureKind;
    use crate::scheduler::outcomes::Finished;

    fn config(policy: LoadFailurePolicy) -> SchedulerConfig {
        SchedulerConfig {
            engine_id: "p".into(),
            host: "10.0.0.1".into(),
            port: 5600,
            tp_size: 2,
            pp_size: 1,
            dcp_size: 1,
            lease: Lease::new(Duration::from_secs(3)).unwrap(),
            load_failure_policy: policy,
            multi_turn: MultiTurn::default(),
            protocol: Protocol::Native,
            transfer_mode: TransferMode::Pull,
            #[cfg(feature = "vllm")]
            vllm_side_channel: None,
        }
    }

    fn scheduler() -> KvConnectorScheduler {
        KvConnectorScheduler::new(config(LoadFailurePolicy::Fail))
    }

    fn for_decode() -> KvTransferParams {
        KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        }
    }

    /// The params a prefill hands its decode for `request` in `blocks`.
    fn handed(request: &str, blocks: &[usize]) -> KvTransferParams {
        scheduler()
            .request_finished(
                request,
                blocks,
                0,
                Some(&for_decode()),
                FinishStatus::LengthCapped,
            )
            .kv_transfer_params
            .unwrap()
    }

    #[test]
    #[cfg(feature = "vllm")]
    fn in_vllm_mode_the_params_are_vllms_json() {
        let mut s = KvConnectorScheduler::new(SchedulerConfig {
            protocol: Protocol::Vllm,
            ..config(LoadFailurePolicy::Fail)
        });
        let done = s.request_finished(
            "cmpl-1",
            &[3, 4],
            20,
            Some(&for_decode()),
            FinishStatus::LengthCapped,
        );
        let json = done.kv_transfer_params.unwrap().to_vllm_json();
        // vLLM 0.33's request_finished on a prefill.
        let expect = serde_json::json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [[3, 4]], "remote_engine_id": "p",
            "remote_request_id": "cmpl-1", "remote_host": "10.0.0.1", "remote_port": 5600,
            "tp_size": 2, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 20,
            "remote_blocks_expiry_time": null,
            "remote_registration_generation": 0, "transfer_mode": "pull",
        });
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&json).unwrap(),
            expect
        );
        let back = KvTransferParams::from_vllm_json(&json).unwrap();
        assert_eq!(back.to_vllm_json(), json);
        assert_eq!(back.remote_blocks().unwrap().port, 5600);
    }

    fn failed(request: &str, block_id: usize) -> FailedBlock {
        FailedBlock {
            block_id,
            request_id: request.into(),
            kind: FailureKind::Transfer,
            reason: Arc::from("peer gone"),
        }
    }

    fn recving(ids: &[&str]) -> Finished {
        Finished {
            sending: Vec::new(),
            recving: ids.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The outcomes of a step in which both ranks of the TP 2 engine report `finished`, and
    /// rank 0 `load_errors`.
    fn both_ranks(
        s: &mut KvConnectorScheduler,
        finished: &Finished,
        load_errors: &[FailedBlock],
    ) -> Vec<LoadOutcome> {
        let outputs = [0, 1].map(|tp_rank| WorkerOutput {
            tp_rank,
            pp_rank: 0,
            finished: finished.clone(),
            load_errors: if tp_rank == 0 {
                load_errors.to_vec()
            } else {
                Vec::new()
            },
        });
        s.update_connector_output(&outputs).unwrap().load_outcomes
    }

    #[test]
    fn a_prefill_request_for_a_remote_decode_keeps_its_blocks_and_hands_its_params() {
        let mut s = scheduler();
        let before = Instant::now();
        let done = s.request_finished(
            "r",
            &[3, 4],
            7,
            Some(&for_decode()),
            FinishStatus::LengthCapped,
        );
        assert!(done.delay_free_blocks);
        let handed = done.kv_transfer_params.unwrap();
        assert!(handed.do_remote_prefill && !handed.do_remote_decode);
        let remote = handed.remote_blocks().unwrap();
        assert_eq!(remote.num_tokens, Some(7), "vLLM's num_computed_tokens");
        assert_eq!(
            (remote.engine_id.as_str(), remote.host.as_str(), remote.port),
            ("p", "10.0.0.1", 5600)
        );
        assert_eq!(
            (remote.block_ids, remote.request_id.as_str(), remote.tp_size),
            (vec![3, 4], "r", 2)
        );
        let meta = s.build_connector_meta();
        assert_eq!(meta.sends.len(), 1);
        assert!(meta.sends[0].deadline >= before + Duration::from_secs(3));
        assert_eq!(meta.sends[0].num_tokens, Some(7), "for a push's WRITE");
        assert!(
            s.build_connector_meta().sends.is_empty(),
            "handed over once"
        );

        let plain = s.request_finished("q", &[1], 0, None, FinishStatus::LengthCapped);
        assert!(!plain.delay_free_blocks && plain.kv_transfer_params.is_none());
        let stopped = s.request_finished("s", &[1], 0, Some(&for_decode()), FinishStatus::Stopped);
        assert!(stopped.delay_free_blocks, "a stopped request is read too");
        for status in [FinishStatus::Aborted, FinishStatus::Error] {
            let gone = s.request_finished("a", &[1], 0, Some(&for_decode()), status);
            assert!(!gone.delay_free_blocks && gone.kv_transfer_params.is_none());
        }
        assert_eq!(
            s.build_connector_meta().sends.len(),
            1,
            "only the stopped one"
        );
        let empty =
            s.request_finished("e", &[], 0, Some(&for_decode()), FinishStatus::LengthCapped);
        assert!(!empty.delay_free_blocks && empty.kv_transfer_params.is_some());
        assert!(s.build_connector_meta().sends.is_empty(), "nothing to hold");
    }

    #[test]
    fn a_decode_request_loads_from_the_params_or_is_refused_clearly() {
        let mut s = scheduler();
        let mut params = handed("r", &[3, 4]);
        assert!(KvConnectorScheduler::needs_remote_prefill(Some(&params)));
        let err = s
            .update_state_after_alloc("d", &[0, 1], &params)
            .unwrap_err()
            .to_string();
        assert!(err.contains("call on_new_request first"), "{err}");
        s.on_new_request("d", Some(&params));
        s.update_state_after_alloc("d", &[0, 1], &params).unwrap();
        let err = s
            .update_state_after_alloc("d", &[0, 1], &params)
            .unwrap_err()
            .to_string();
        assert!(err.contains("already scheduled"), "{err}");
        let meta = s.build_connector_meta();
        assert_eq!(meta.loads.len(), 1);
        assert_eq!(meta.loads[0].local_block_ids, [0, 1]);
        params.remote_host = None;
        let err = s
            .update_state_after_alloc("e", &[0, 1], &params)
            .unwrap_err()
            .to_string();
        assert!(err.contains("lack remote_engine_id, remote_host"), "{err}");
    }

    #[test]
    fn local_blocks_without_remote_blocks_are_refused_and_wait_for_nothing() {
        // vLLM's update_state_after_alloc asserts no external token without remote blocks.
        let mut s = scheduler();
        let params = handed("r", &[]);
        s.on_new_request("d", Some(&params));
        let err = s
            .update_state_after_alloc("d", &[0, 1], &params)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no remote_block_ids"), "{err}");
        let meta = s.build_connector_meta();
        assert!(meta.loads.is_empty(), "{meta:?}");
        assert!(meta.heartbeats.is_empty(), "it waits for nothing: {meta:?}");
        let done = s.request_finished("d", &[0, 1], 0, None, FinishStatus::Stopped);
        assert!(!done.delay_free_blocks);
        assert!(s.decodes.is_empty());
    }

    #[test]
    fn prefix_hits_load_the_rest_and_a_full_hit_only_notifies() {
        let mut s = scheduler();
        s.on_new_request("part", Some(&handed("r1", &[3, 4, 5])));
        s.update_state_after_alloc("part", &[7], &handed("r1", &[3, 4, 5]))
            .unwrap();
        s.on_new_request("full", Some(&handed("r2", &[6, 8])));
        s.update_state_after_alloc("full", &[], &handed("r2", &[6, 8]))
            .unwrap();
        let mut loads = s.build_connector_meta().loads;
        loads.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        assert_eq!(loads[0].request_id, "full");
        assert!(loads[0].local_block_ids.is_empty());
        assert_eq!(loads[1].local_block_ids, [7]);
        assert_eq!(
            loads[1].remote.block_ids,
            [3, 4, 5],
            "the worker reads the tail"
        );
        // The full hit is done at once: nothing waits for it, no heartbeat names it.
        let outcomes = both_ranks(&mut s, &recving(&["full", "part"]), &[]);
        assert_eq!(
            outcomes,
            [LoadOutcome::Loaded {
                request_id: "part".into()
            }]
        );
    }

    #[test]
    fn aborts_notify_before_the_load_and_hold_the_blocks_while_it_runs() {
        let mut s = scheduler();
        // Aborted while waiting for blocks: the prefill is notified, nothing read.
        s.on_new_request("waiting", Some(&handed("rw", &[1, 2])));
        let done = s.request_finished("waiting", &[], 0, None, FinishStatus::Aborted);
        assert!(!done.delay_free_blocks);
        // Aborted before the engine ever told of it.
        let done = s.request_finished(
            "unseen",
            &[],
            0,
            Some(&handed("ru", &[3])),
            FinishStatus::Aborted,
        );
        assert!(!done.delay_free_blocks);
        // Aborted after allocation, before the workers got the load.
        s.on_new_request("scheduled", Some(&handed("rs", &[4, 5])));
        s.update_state_after_alloc("scheduled", &[4, 5], &handed("rs", &[4, 5]))
            .unwrap();
        let done = s.request_finished("scheduled", &[4, 5], 0, None, FinishStatus::Aborted);
        assert!(!done.delay_free_blocks, "no READ was posted");
        let meta = s.build_connector_meta();
        assert_eq!(meta.loads.len(), 3);
        assert!(meta.loads.iter().all(|l| l.local_block_ids.is_empty()));
        assert!(meta.aborted.is_empty());

        // Aborted while its load runs: blocks kept until the load ends.
        s.on_new_request("running", Some(&handed("rr", &[6])));
        s.update_state_after_alloc("running", &[6], &handed("rr", &[6]))
            .unwrap();
        assert_eq!(s.build_connector_meta().loads.len(), 1);
        let done = s.request_finished("running", &[6], 0, None, FinishStatus::Aborted);
        assert!(done.delay_free_blocks);
        let meta = s.build_connector_meta();
        assert_eq!(meta.aborted, ["running"]);
        assert!(
            meta.heartbeats.is_empty(),
            "no heartbeat for an aborted load"
        );
        let outcomes = both_ranks(&mut s, &recving(&["running"]), &[failed("running", 6)]);
        assert_eq!(
            outcomes,
            [LoadOutcome::AbortedLoadEnded {
                request_id: "running".into()
            }]
        );
        assert!(
            s.decodes.is_empty() && s.failed.is_empty(),
            "nothing left behind"
        );
        assert!(
            both_ranks(&mut s, &recving(&["running"]), &[]).is_empty(),
            "once"
        );
    }

    #[test]
    fn waiting_loads_heartbeat_their_engine_every_sixth_of_the_lease() {
        let mut s = scheduler();
        let t0 = Instant::now();
        s.on_new_request("a", Some(&handed("ra", &[1])));
        s.on_new_request("b", Some(&handed("rb", &[2])));
        s.update_state_after_alloc("b", &[2], &handed("rb", &[2]))
            .unwrap();
        let meta = s.meta_at(t0);
        assert_eq!(meta.heartbeats.len(), 1);
        let mut ids = meta.heartbeats[0].request_ids.clone();
        ids.sort();
        assert_eq!(ids, ["ra", "rb"]);
        assert_eq!(meta.heartbeats[0].engine_id, "p");
        assert!(s
            .meta_at(t0 + Duration::from_millis(400))
            .heartbeats
            .is_empty());
        let meta = s.meta_at(t0 + Duration::from_millis(500));
        assert_eq!(meta.heartbeats.len(), 1, "3 s lease: every 500 ms");
        both_ranks(&mut s, &recving(&["b"]), &[]);
        s.request_finished("a", &[], 0, None, FinishStatus::Aborted);
        assert!(s.meta_at(t0 + Duration::from_secs(2)).heartbeats.is_empty());
    }

    #[test]
    fn failed_loads_follow_the_policy_with_exactly_their_blocks() {
        for policy in [LoadFailurePolicy::Recompute, LoadFailurePolicy::Fail] {
            let mut s = KvConnectorScheduler::new(config(policy));
            s.on_new_request("x", Some(&handed("rx", &[1, 2])));
            s.update_state_after_alloc("x", &[9, 3], &handed("rx", &[1, 2]))
                .unwrap();
            s.on_new_request("ok", Some(&handed("ro", &[4])));
            s.update_state_after_alloc("ok", &[5], &handed("ro", &[4]))
                .unwrap();
            s.build_connector_meta();
            // The errors come one step before the load's end.
            let early = [failed("x", 9), failed("x", 3), failed("stranger", 1)];
            assert!(both_ranks(&mut s, &recving(&[]), &early).is_empty());
            let outcomes = both_ranks(&mut s, &recving(&["ok", "x"]), &[]);
            let reason = "transfer failure: peer gone".to_string();
            let x = match policy {
                LoadFailurePolicy::Recompute => LoadOutcome::Recompute {
                    request_id: "x".into(),
                    block_ids: vec![3, 9],
                    reason,
                },
                LoadFailurePolicy::Fail => LoadOutcome::Failed {
                    request_id: "x".into(),
                    reason,
                },
            };
            assert_eq!(
                outcomes,
                [
                    LoadOutcome::Loaded {
                        request_id: "ok".into()
                    },
                    x
                ]
            );
            assert!(s.failed.is_empty());
        }
    }

    #[test]
    fn the_lease_and_policy_come_from_the_kv_transfer_config() {
        let kv = KvTransferConfig::from_json(
            r#"{"kv_load_failure_policy":"recompute","kv_connector_extra_config":{"kv_lease_duration":12}}"#,
        )
        .unwrap();
        let c = SchedulerConfig::new("e", "h", 1, 1, &kv).unwrap();
        assert_eq!(c.lease.duration(), Duration::from_secs(12));
        assert_eq!(c.lease.heartbeat_interval(), Duration::from_secs(2));
        assert_eq!(c.lease.extension(), Duration::from_secs(8));
        assert_eq!(c.load_failure_policy, LoadFailurePolicy::Recompute);
        let c = SchedulerConfig::new("e", "h", 1, 1, &KvTransferConfig::default()).unwrap();
        assert_eq!(c.lease, Lease::default());
        assert_eq!(
            c.load_failure_policy,
            LoadFailurePolicy::Fail,
            "vLLM's default"
        );
        for bad in [
            r#"{"kv_load_failure_policy":"retry"}"#,
            r#"{"kv_connector_extra_config":{"kv_lease_duration":0}}"#,
            r#"{"kv_connector_extra_config":{"kv_lease_duration":"30"}}"#,
        ] {
            let kv = KvTransferConfig::from_json(bad).unwrap();
            let err = SchedulerConfig::new("e", "h", 1, 1, &kv)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("kv_load_failure_policy") || err.contains("kv_lease_duration"),
                "{err}"
            );
        }
    }
}

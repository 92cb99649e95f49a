//! The worker half: registers the KV cache, answers handshakes, loads remote blocks and
//! tracks what is done.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use nixl::kv_config::{KvRole, NixlSetup};
use nixl::{Agent, NotificationFilter, Registration, XferOp};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::config::{MetadataExchange, Protocol, WorkerConfig};
use crate::error::{Error, Result};
use crate::failure::{FailedBlock, FailureKind};
use crate::geometry::dcp::{DcpSizes, MAX_DCP_SIZE};
use crate::geometry::engine_layout::EngineLayout;
use crate::geometry::groups::KvCacheGroups;
use crate::geometry::pipeline::MAX_PP_SIZE;
use crate::geometry::tp_mapping::TpMapping;
use crate::lease::Lease;
use crate::metrics::series::{rank_labels, Series};
use crate::metrics::{RemoteStats, SendStats, TransferMetrics};
use crate::scheduler::aggregate::WorkerOutput;
use crate::scheduler::outcomes::{Finished, OverdueLoad};
use crate::scheduler::{ConnectorMetadata, HeartbeatSpec};
use crate::transfer_mode::{PushSettings, TransferMode};
use crate::transport::auth::SharedSecret;
use crate::transport::capability::Capability;
use crate::transport::etcd::EtcdSource;
use crate::transport::handshake::HandshakeMessage;
use crate::transport::params::RemoteBlocks;
use crate::transport::peer_networks::PeerNetworks;
use crate::transport::pending::PendingStats;
use crate::transport::refusals::{RefusalCounts, Refusals};
use crate::transport::side_channel::Guard;
#[cfg(feature = "vllm")]
use crate::vllm::{Compatibility, MetadataServer, NixlHandshakePayload, VllmWorker};
use crate::worker::connect::Engine;
use crate::worker::current_caches::{Caches, CurrentCaches};
use crate::worker::decode_notes::DecodeNotes;
use crate::worker::held_sends::HeldSends;
use crate::worker::host_buffer::Staging;
use crate::worker::kept_claims::ClaimsOf;
use crate::worker::load_outcomes::LoadOutcomes;
use crate::worker::notification_format::{heartbeat_entries, heartbeat_messages};
use crate::worker::push_book::HeldBlocks;
use crate::worker::push_state::{Push, PushStats};
use crate::worker::remotes::Remotes;
use crate::worker::scratch_words::ScratchWords;
use crate::worker::sending::{Marks, NotificationStats, Sends};
use crate::worker::shared::{Context, Shared};

mod claim;
pub(crate) mod connect;
pub(crate) mod current_caches;
mod decode_notes;
pub(crate) mod engines;
pub(crate) mod held_sends;
pub mod host_buffer;
mod kept_claims;
pub(crate) mod load;
pub(crate) mod load_outcomes;
pub(crate) mod mark_words;
pub(crate) mod marks_check;
pub(crate) mod notification_format;
pub(crate) mod push;
mod push_book;
#[cfg(feature = "vllm")]
mod push_book_vllm;
mod push_outcome;
pub(crate) mod push_state;
#[cfg(feature = "vllm")]
mod push_vllm;
mod push_write;
mod registration;
pub(crate) mod remotes;
mod reregister;
pub(crate) mod scratch_words;
pub(crate) mod sending;
pub(crate) mod shared;
mod shutdown;
mod ucx_defaults;

#[cfg(all(test, not(feature = "vllm")))]
mod without_vllm;

/// The worker half of the connector: one per TP rank.
///
/// Create it inside a tokio runtime: handshakes, loads and notifications run as tasks on
/// it, so no method blocks an engine step. Dropping the worker stops its side channel and
/// its notification listener, and withdraws its published metadata. Loads already started
/// run on in their own tasks to their end (every READ done or failed in NIXL, past
/// `transfer_timeout` too), and keep the registered caches alive until then; a task dropped
/// with the runtime leaves its READs to NIXL's completion driver, which keeps their memory
/// until NIXL is done with them. To destroy the agent before going on (e.g. before
/// `std::process::exit`), call [`shutdown`](Self::shutdown) instead.
pub struct KvConnectorWorker {
    shared: Arc<Shared>,
    /// The registered caches, as the background tasks have them too (`shared.caches`); the
    /// worker's own handle lends them out by reference until a re-registration (`&mut self`).
    registered: OnceLock<Arc<Caches>>,
    staging: OnceLock<Staging>,
    runtime: Handle,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Whether decode notifications are being taken (see `listen_for_notifications`).
    listening: std::sync::Once,
    /// The decode notifications this rank takes, once it listens.
    decode_notes: Arc<DecodeNotes>,
}

impl std::fmt::Debug for KvConnectorWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvConnectorWorker")
            .field("engine_id", &self.shared.config.engine_id)
            .field("tp_rank", &self.shared.config.tp_rank)
            .field("agent", &self.shared.setup.agent().name())
            .finish()
    }
}

impl KvConnectorWorker {
    /// Creates the NIXL agent with the backends of `config.kv_transfer_config` (decode
    /// notifications are taken from the first [`hold_for_decode`](Self::hold_for_decode) on).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] outside a tokio runtime, for a TP rank not below the TP
    /// size, for etcd metadata without `NIXL_ETCD_ENDPOINTS`, for a bad `kv_lease_duration`
    /// or protocol, in vLLM mode for etcd metadata (vLLM's metadata travels in its
    /// handshake) or compatibility settings that do not read (see
    /// [`Compatibility::from_kv_transfer_config`]), or for vLLM's protocol at all when the
    /// crate is built without its `vllm` feature; the platform and backend errors of
    /// [`NixlSetup::new`].
    pub fn new(config: WorkerConfig) -> Result<Self> {
        const OP: &str = "create the connector worker";
        let runtime = Handle::try_current()
            .map_err(|_| Error::invalid(OP, "call it inside a tokio runtime"))?;
        if config.tp_size == 0 || config.tp_rank >= config.tp_size {
            return Err(Error::invalid(
                OP,
                format!("TP rank {} of TP size {}", config.tp_rank, config.tp_size),
            ));
        }
        let settings = Settings::of(&config)?;
        let context = context(config, &settings)?;
        let sends = Sends::new(
            context.config.tp_size,
            context.protocol,
            settings.lease,
            context.series.clone(),
            context.guard.readers.clone(),
        )
        .with_own_dcp(context.config.dcp_size);
        let shared = Arc::new(Shared {
            context,
            caches: CurrentCaches::default(),
            remotes: Remotes::new(settings.engine_ttl, settings.max_backoff),
            outcomes: LoadOutcomes::default(),
            sends: HeldSends::new(sends),
            scratch: ScratchWords::default(),
            push: settings
                .push
                .map(|push| Push::new(push, settings.lease.duration())),
        });
        // Subscribed first, so that push messages go to this stream and no other.
        let push_stream = match shared.push {
            Some(_) => Some(crate::worker::push::subscribe(&shared)?),
            None => None,
        };
        let claims = ClaimsOf(Arc::downgrade(&shared));
        shared.guard.kept.set(Arc::new(claims));
        // Not among `tasks`: it outlives the worker while push loads wait (see `push::take`).
        if let Some(stream) = push_stream {
            runtime.spawn(crate::worker::push::take(shared.clone(), stream));
        }
        Ok(KvConnectorWorker {
            shared,
            registered: OnceLock::new(),
            staging: OnceLock::new(),
            runtime,
            tasks: Mutex::new(Vec::new()),
            listening: std::sync::Once::new(),
            decode_notes: Arc::default(),
        })
    }

    /// Starts taking decode notifications, once: from the first request held for a decode
    /// on. A worker that only loads never polls NIXL for notifications; NIXL keeps any that
    /// arrive before this starts.
    fn listen_for_notifications(&self) {
        self.listening.call_once(|| {
            let stream = match self
                .agent()
                .notification_stream(NotificationFilter::any())
            {
                Ok(stream) => stream,
                Err(err) => {
                    tracing::error!(%err, "cannot take decode notifications; held requests will be freed when their lease ends");
                    return;
                }
            };
            self.decode_notes.set(stream);
            let shared = self.shared.clone();
            let decode_notes = self.decode_notes.clone();
            let notes = self.runtime.spawn(async move {
                loop {
                    let note = decode_notes.next().await;
                    shared
                        .sends
                        .lock()
                        .notified(&note.sender, &note.message, Instant::now());
                    shared.sends.notify_arrived();
                }
            });
            self.tasks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(notes);
        });
    }

    /// The NIXL agent.
    pub fn agent(&self) -> &Agent {
        self.shared.setup.agent()
    }

    /// The backends the KV cache is registered with (those of the `kv_transfer_config`).
    pub fn backends(&self) -> &[nixl::Backend] {
        self.shared.setup.backends()
    }

    /// The memory type the KV cache is registered as (the platform registry's answer for
    /// the kv-buffer device).
    pub fn mem_type(&self) -> nixl::MemType {
        self.shared.setup.mem_type()
    }

    /// The vLLM-mode state.
    #[cfg(feature = "vllm")]
    fn vllm(&self) -> Result<&VllmWorker> {
        self.shared.vllm.as_ref().ok_or_else(native_protocol)
    }

    /// vLLM mode: the engine's side channel and this rank's payload.
    #[cfg(feature = "vllm")]
    fn vllm_published(
        &self,
        operation: &'static str,
    ) -> Result<&(Arc<MetadataServer>, NixlHandshakePayload)> {
        self.vllm()?;
        self.caches(operation)?
            .vllm
            .as_ref()
            .ok_or_else(native_protocol)
    }

    /// Copies `block_ids` of every layer from VRAM to the host buffer (prefill, before the
    /// decode reads them).
    ///
    /// # Errors
    /// As [`stage_from_host`](Self::stage_from_host).
    pub async fn stage_to_host(&self, block_ids: &[usize]) -> Result<()> {
        self.staging("stage blocks to the host buffer")?
            .copy(&self.shared, XferOp::Write, block_ids)
            .await
    }

    /// Copies `block_ids` of every layer from the host buffer to VRAM (decode, after a
    /// load finished without errors).
    ///
    /// # Errors
    /// [`Error::NotRegistered`] unless registered in host-buffer mode;
    /// [`Error::InvalidArgument`] for a block id out of range; [`Error::TransferTimeout`];
    /// NIXL's errors.
    pub async fn stage_from_host(&self, block_ids: &[usize]) -> Result<()> {
        self.staging("stage blocks from the host buffer")?
            .copy(&self.shared, XferOp::Read, block_ids)
            .await
    }

    fn staging(&self, operation: &'static str) -> Result<&Staging> {
        self.staging.get().ok_or(Error::NotRegistered { operation })
    }

    fn caches(&self, operation: &'static str) -> Result<&Caches> {
        self.registered
            .get()
            .map(|caches| &**caches)
            .ok_or(Error::NotRegistered { operation })
    }

    /// The registered KV cache (region `r` is the spec's region `r`), e.g. to fill or check
    /// blocks.
    ///
    /// # Errors
    /// [`Error::NotRegistered`] before [`register_kv_caches`](Self::register_kv_caches).
    pub fn kv_caches(&self) -> Result<&Registration> {
        Ok(&self.caches("read the KV caches")?.registration)
    }

    /// The address this rank's side channel listens on: in vLLM mode, the engine's ROUTER
    /// (its port is the `remote_port` of the engine's transfer params).
    ///
    /// # Errors
    /// [`Error::NotRegistered`] before [`register_kv_caches`](Self::register_kv_caches).
    pub fn side_channel_addr(&self) -> Result<SocketAddr> {
        Ok(self.caches("read the side channel address")?.side_channel)
    }

    /// The protocol this worker speaks.
    pub fn protocol(&self) -> Protocol {
        self.shared.protocol
    }

    /// Whether this worker's handshakes prove a shared secret both ways (native protocol
    /// with a [`SharedSecret`]; see [`auth`](crate::auth)).
    pub fn authenticated(&self) -> bool {
        self.shared.guard.secret.is_some()
    }

    /// vLLM mode: the engine's side channel this rank's payload is published to (the
    /// config's [`vllm_side_channel`](WorkerConfig::vllm_side_channel), or the one this
    /// worker bound): publish the payloads of the engine's ranks in other processes to it,
    /// and give it to the engine's [`SchedulerConfig`](crate::SchedulerConfig).
    ///
    /// # Errors
    /// [`Error::NotRegistered`] before [`register_kv_caches`](Self::register_kv_caches);
    /// [`Error::InvalidArgument`] in the native protocol.
    #[cfg(feature = "vllm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "vllm")))]
    pub fn vllm_side_channel(&self) -> Result<Arc<MetadataServer>> {
        Ok(self.vllm_published("read the vLLM side channel")?.0.clone())
    }

    /// vLLM mode: this rank's handshake payload (vLLM's `NixlHandshakePayload`, its
    /// `NixlAgentMetadata` under the compatibility hash), for an engine whose side channel
    /// runs in another process: publish it there as `(0, tp_rank)`
    /// ([`MetadataServer::publish`]).
    ///
    /// # Errors
    /// As [`vllm_side_channel`](Self::vllm_side_channel).
    #[cfg(feature = "vllm")]
    #[cfg_attr(docsrs, doc(cfg(feature = "vllm")))]
    pub fn vllm_handshake_payload(&self) -> Result<NixlHandshakePayload> {
        Ok(self
            .vllm_published("read the vLLM handshake payload")?
            .1
            .clone())
    }

    /// This rank's handshake message.
    ///
    /// # Errors
    /// [`Error::NotRegistered`] before [`register_kv_caches`](Self::register_kv_caches).
    pub fn handshake(&self) -> Result<HandshakeMessage> {
        Ok((*self.caches("describe the KV caches")?.handshake).clone())
    }

    /// Starts reading `remote`'s blocks into `local_block_ids` and returns without waiting.
    ///
    /// `local_block_ids` may cover fewer tokens than `remote.block_ids` (the decode's prefix
    /// cache holds the first blocks of the prompt): they pair in token order with the *last*
    /// remote tokens (vLLM's `update_state_after_alloc` and `_read_blocks`; see
    /// [`crate::scheduler`]). When the two engines' blocks hold different numbers of tokens,
    /// one divides the other and blocks pair unit by unit (see
    /// [`RemoteBlocks::num_tokens`]). With no local block (a full prefix hit), nothing is
    /// read: the notifications alone tell the prefill to free its blocks, and the load is
    /// not reported in [`finished`](Self::finished).
    ///
    /// The remote ranks are those of the [`TpMapping`](crate::TpMapping) of the two TP
    /// sizes: the one rank holding this rank's heads (a decode TP that is a multiple of the
    /// prefill's), or the `remote.tp_size / tp_size` ranks holding its share of the request
    /// (a smaller decode TP), rank `r` at the side-channel port + `r`; with pipeline stages
    /// ([`RemoteBlocks::pp_size`]), those ranks of every stage (stage `s`'s at the port + `s`
    /// × TP size + `r`), each read for the layers it shares with this rank, or only
    /// notified when it holds none; with decode context parallelism on either engine
    /// ([`RemoteBlocks::dcp_size`], [`WorkerConfig::dcp_size`](crate::WorkerConfig::dcp_size)),
    /// the ranks holding positions of this rank's, each read for the positions both hold
    /// past the prefix cache ([`DcpPair`](crate::DcpPair); `local_block_ids` run to the
    /// request's end, as always), or only notified when they hold none. The handshake with each
    /// (once per remote engine and rank) runs as a task, and so do the READs until every
    /// handshake is done; after that, they are posted within this call (posts that finish
    /// the transfers end the load at once) and only their completion is awaited in a task.
    /// Each READ is one request over prepared lists, by unit and piece, with the remote
    /// request id as its notification, inside a `nixl_load` tracing span; the ranks not read
    /// from (MLA, replicated heads) get the notification alone. When the load ends the
    /// request appears in [`finished`](Self::finished)`.recving`; if it failed, its local
    /// blocks appear in [`load_errors`](Self::load_errors).
    ///
    /// # Errors
    /// [`Error::NotRegistered`]; [`Error::InvalidArgument`] for a local block id out of
    /// range, a request whose load is already under way, or a remote TP this rank cannot
    /// read from. What depends on the prefill's geometry (its block size and count) is
    /// checked when the READs are made: a failure then is a failed load.
    pub fn start_load(
        &self,
        request_id: &str,
        local_block_ids: &[usize],
        remote: &RemoteBlocks,
    ) -> Result<()> {
        self.start_load_in_groups(request_id, local_block_ids, &[], remote)
    }

    /// [`start_load`](Self::start_load) with the local blocks of each KV cache group
    /// `local_group_lens` long ([`LoadSpec::local_group_lens`](crate::LoadSpec::local_group_lens);
    /// empty: one group).
    fn start_load_in_groups(
        &self,
        request_id: &str,
        local_block_ids: &[usize],
        local_group_lens: &[usize],
        remote: &RemoteBlocks,
    ) -> Result<()> {
        const OP: &str = "start a load";
        let num_blocks = self.caches(OP)?.spec.num_blocks;
        if let Some(bad) = local_block_ids.iter().find(|&&b| b >= num_blocks) {
            return Err(Error::invalid(
                OP,
                format!("request {request_id:?}: local block {bad} of {num_blocks} blocks"),
            ));
        }
        let sizes = (remote.pp_size, remote.tp_size, remote.dcp_size);
        let ranks = self.remote_ranks(OP, remote.port, sizes)?;
        self.forget_older_registration(remote);
        let load = crate::worker::load::Load {
            request_id: request_id.to_string(),
            local_block_ids: local_block_ids.to_vec(),
            local_group_lens: local_group_lens.to_vec(),
            span: crate::worker::load::Load::span(
                request_id,
                remote,
                &ranks,
                local_block_ids.len(),
            ),
            remote: remote.clone(),
            ranks,
        };
        if self.shared.push.is_some() {
            return self.start_push(load);
        }
        if local_block_ids.is_empty() {
            self.runtime
                .spawn(crate::worker::load::notify_only(self.shared.clone(), load));
            return Ok(());
        }
        if !self.shared.outcomes.lock().start(request_id) {
            return Err(Error::invalid(
                OP,
                format!("request {request_id:?}: a load for it is already under way"),
            ));
        }
        self.shared.series.load_started();
        self.post_or_spawn(load);
        Ok(())
    }

    /// Push mode: registers `load`'s blocks with the prefill ranks that write them, in a
    /// task, or, with no block (a full prefix hit), cancels so that the prefill frees at
    /// once.
    fn start_push(&self, load: crate::worker::load::Load) -> Result<()> {
        const OP: &str = "start a push load";
        if self.shared.config.tp_size > load.remote.tp_size {
            return Err(Error::invalid(
                OP,
                format!("request {:?}: push from a prefill of TP {} into a decode of TP {}: push needs a decode TP at most the prefill's (as vLLM's push)", load.request_id, load.remote.tp_size, self.shared.config.tp_size),
            ));
        }
        if load.local_block_ids.is_empty() {
            if self.shared.protocol == Protocol::Vllm {
                // vLLM's push has no message for it: the prefill frees by its lease.
                tracing::debug!(request = %load.request_id, "nothing to push; the vLLM prefill frees the request when its lease ends");
                return Ok(());
            }
            self.runtime
                .spawn(crate::worker::push::cancel_only(self.shared.clone(), load));
            return Ok(());
        }
        if !self.shared.outcomes.lock().start(&load.request_id) {
            return Err(Error::invalid(
                OP,
                format!(
                    "request {:?}: a load for it is already under way",
                    load.request_id
                ),
            ));
        }
        self.shared.series.load_started();
        let shared = self.shared.clone();
        match self.shared.protocol {
            Protocol::Native => self.runtime.spawn(crate::worker::push::load(shared, load)),
            #[cfg(not(feature = "vllm"))]
            Protocol::Vllm => return Err(vllm_not_built(OP)),
            #[cfg(feature = "vllm")]
            Protocol::Vllm => self.runtime.spawn(async move {
                if let Some(push) = &shared.push {
                    crate::worker::push_vllm::load(shared.clone(), push, load).await;
                }
            }),
        };
        Ok(())
    }

    /// Forgets what the handshakes with `remote`'s engine learned when its params say it
    /// registered its KV cache again since (a newer registration generation), so that the
    /// load handshakes again.
    fn forget_older_registration(&self, remote: &RemoteBlocks) {
        #[cfg(feature = "vllm")]
        if self
            .shared
            .vllm
            .as_ref()
            .is_some_and(|v| v.newer_generation(remote))
        {
            tracing::info!(engine = %remote.engine_id, generation = remote.registration_generation, "the remote engine registered its KV cache again; handshaking with it again");
            self.shared.remotes.forget_engine(&remote.engine_id);
        }
        if self.shared.protocol == Protocol::Native {
            let generation = remote.registration_generation;
            if generation
                .is_some_and(|g| self.shared.remotes.newer_generation(&remote.engine_id, g))
            {
                tracing::info!(engine = %remote.engine_id, generation, "the remote engine registered its KV cache again; handshaking with it again");
            }
        }
    }

    /// Posts `load`'s READs here and now when its handshakes are done (most finish within
    /// the post), and leaves only what is left to wait for to a task; else runs it all in a
    /// task.
    fn post_or_spawn(&self, load: crate::worker::load::Load) {
        match crate::worker::load::try_now(&self.shared, load) {
            None => {}
            Some((load, Some(posted))) => {
                self.runtime.spawn(crate::worker::load::finish(
                    self.shared.clone(),
                    load,
                    posted,
                ));
            }
            Some((load, None)) => {
                self.runtime
                    .spawn(crate::worker::load::run(self.shared.clone(), load));
            }
        }
    }

    /// The request of a load under way was aborted (vLLM: a decode request finished before
    /// its load ended). If the READ is not posted yet (its handshake still runs), it never
    /// is: the prefill gets the notification alone, and frees its blocks at once. A READ
    /// already posted cannot be recalled: it ends as usual, so the engine must keep the
    /// request's blocks until the load appears in [`finished`](Self::finished)`.recving`.
    /// The load of an aborted request reports no failed blocks.
    ///
    /// Returns whether a load of `request_id` was under way.
    pub fn abort_load(&self, request_id: &str) -> bool {
        let under_way = self.shared.outcomes.lock().abort(request_id);
        if let Some(push) = &self.shared.push {
            push.wake(request_id);
        }
        under_way
    }

    /// Runs the handshakes with the ranks of a remote engine of TP `tp_size` (one pipeline
    /// stage, no DCP) this rank reads from: [`handshake_with_layout`](Self::handshake_with_layout)
    /// with [`EngineLayout::tp`].
    ///
    /// # Errors
    /// As [`handshake_with_layout`](Self::handshake_with_layout)'s.
    pub async fn handshake_with(
        &self,
        engine_id: &str,
        host: &str,
        port: u16,
        tp_size: usize,
    ) -> Result<()> {
        self.handshake_with_layout(engine_id, host, port, EngineLayout::tp(tp_size))
            .await
    }

    /// Runs the handshakes with the ranks of a remote engine of `layout` this rank reads
    /// from or notifies (in every pipeline stage; with DCP, those holding this rank's
    /// positions; see [`start_load`](Self::start_load)), now rather than at the first load
    /// (e.g. when a decode learns of a prefill, so that the first load does not wait for
    /// them, and a peer that cannot be read from is known early). Loads from the engine
    /// with the same layout reuse their outcome; a failed handshake is forgotten, so a
    /// later one tries again.
    ///
    /// # Errors
    /// [`Error::NotRegistered`]; [`Error::InvalidArgument`] for a layout this rank cannot
    /// read from (a TP or DCP size it cannot pair with, stages outside 1 to
    /// [`MAX_PP_SIZE`]); [`Error::Handshake`] with why a handshake failed (the first, in
    /// rank order).
    pub async fn handshake_with_layout(
        &self,
        engine_id: &str,
        host: &str,
        port: u16,
        layout: EngineLayout,
    ) -> Result<()> {
        const OP: &str = "handshake with a remote engine";
        self.caches(OP)?;
        let sizes = (layout.pp_size, layout.tp_size, layout.dcp_size);
        let ranks = self.remote_ranks(OP, port, sizes)?;
        let engine = Engine {
            id: engine_id,
            host,
            tp_size: layout.tp_size,
            pp_size: layout.pp_size,
        };
        connect::remotes(&self.shared, engine, &ranks)
            .await
            .map(drop)
    }

    /// The ranks of a remote engine of `pp_size` stages of TP `tp_size` and DCP size
    /// `dcp_size` that hold this rank's share of a request: in every stage, the ranks of the
    /// [`TpMapping`](crate::TpMapping) (a stage holding none of this rank's layers is only
    /// notified; with DCP, the ranks holding positions of this rank's, see
    /// [`TpMapping::with_dcp`](crate::TpMapping::with_dcp)). Each is numbered `pp_rank` ×
    /// `tp_size` + `tp_rank` (its TP rank with one stage), with the port its side channel
    /// listens on: rank 0's `port` + that number in the native protocol, the engine's
    /// `port` in vLLM's.
    fn remote_ranks(
        &self,
        operation: &'static str,
        port: u16,
        (pp_size, tp_size, dcp_size): (usize, usize, usize),
    ) -> Result<Vec<(usize, u16)>> {
        let config = &self.shared.config;
        let attention = self.caches(operation)?.spec.attention;
        let dcp = DcpSizes {
            local: config.dcp_size,
            remote: dcp_size,
        };
        let mapping = TpMapping::with_dcp(config.tp_rank, config.tp_size, tp_size, attention, dcp)?;
        if !(1..=MAX_PP_SIZE).contains(&pp_size) {
            return Err(Error::invalid(
                operation,
                format!("a remote engine of {pp_size} pipeline stages (1 to {MAX_PP_SIZE})"),
            ));
        }
        let mut ranks = Vec::with_capacity(pp_size.saturating_mul(mapping.ranks.len()));
        for stage in 0..pp_size {
            for r in &mapping.ranks {
                let rank = stage * tp_size + r.rank;
                if self.shared.protocol == Protocol::Vllm {
                    ranks.push((rank, port));
                    continue;
                }
                let at = u16::try_from(usize::from(port) + rank).map_err(|_| {
                    Error::invalid(
                        operation,
                        format!("port {port} + rank {rank} is past 65535"),
                    )
                })?;
                ranks.push((rank, at));
            }
        }
        Ok(ranks)
    }

    /// Carries out one scheduler step's `meta` (vLLM's `start_load_kv`): starts every load,
    /// aborts the loads of aborted requests, holds every send, and sends the heartbeats. A
    /// load that cannot start is reported as finished with its blocks in `load_errors`.
    /// First, at most once a second, evicts remote engines unused for longer than
    /// `kv_connector_extra_config.engine_ttl` or replaced at their address, once no load
    /// holds them (see [`RemoteStats::evicted`]).
    pub fn start_load_kv(&self, meta: &ConnectorMetadata) {
        let evicted = self.shared.remotes.sweep(self.agent(), Instant::now());
        self.shared.series.engines_evicted(evicted.len());
        #[cfg_attr(not(feature = "vllm"), allow(unused_variables))]
        for engine in evicted {
            #[cfg(feature = "vllm")]
            if let Some(vllm) = &self.shared.vllm {
                vllm.forget(&engine);
            }
        }
        for load in &meta.loads {
            if let Err(err) = self.start_load_in_groups(
                &load.request_id,
                &load.local_block_ids,
                &load.local_group_lens,
                &load.remote,
            ) {
                tracing::warn!(request = %load.request_id, %err, "load not started");
                self.shared.series.failed(FailureKind::of(&err));
                let reason: Arc<str> = err.to_string().into();
                let mut outcomes = self.shared.outcomes.lock();
                outcomes
                    .load_errors
                    .extend(load.local_block_ids.iter().map(|&block_id| FailedBlock {
                        block_id,
                        request_id: load.request_id.clone(),
                        kind: FailureKind::of(&err),
                        reason: reason.clone(),
                    }));
                outcomes.recving.push(load.request_id.clone());
            }
        }
        for request_id in &meta.aborted {
            self.abort_load(request_id);
        }
        for send in &meta.sends {
            let marks = send.lease_epoch.map(|epoch| Marks {
                epoch,
                block_ids: send.block_ids.clone(),
            });
            let capability = send.capability.clone();
            self.hold(&send.request_id, send.deadline, capability.clone(), marks);
            let Some(push) = &self.shared.push else {
                continue;
            };
            let blocks = HeldBlocks {
                block_ids: send.block_ids.clone(),
                group_lens: send.group_lens.clone(),
                num_tokens: send.num_tokens,
            };
            match (push, capability, self.shared.protocol) {
                (_, Some(capability), Protocol::Native) => {
                    crate::worker::push::ready(&self.shared, &send.request_id, blocks, capability);
                }
                #[cfg(feature = "vllm")]
                (push, None, Protocol::Vllm) => {
                    crate::worker::push_vllm::ready(&self.shared, push, &send.request_id, blocks);
                }
                _ => {}
            }
        }
        if !meta.evict.is_empty() {
            let mut sends = self.shared.sends.lock();
            for request_id in &meta.evict {
                sends.evict(request_id);
            }
            drop(sends);
            self.shared.sends.notify_arrived();
        }
        for heartbeat in &meta.heartbeats {
            self.send_heartbeat(heartbeat);
        }
    }

    /// Tells the ranks of a remote engine this rank reads from (or notifies) that its
    /// requests are still wanted (vLLM's `_send_heartbeats`): `HB:` and their ids. Before the
    /// handshake with a rank is done it starts the handshake instead, so that the next
    /// heartbeat goes. A rank handshaken again (its READs failed or passed the transfer
    /// timeout) still gets the heartbeat, at the agent its last handshake loaded: a
    /// prefill too slow or stopped to answer a new handshake at once must not end the
    /// leases its waiting requests are kept by.
    fn send_heartbeat(&self, heartbeat: &HeartbeatSpec) {
        const OP: &str = "send a heartbeat";
        let sizes = (heartbeat.pp_size, heartbeat.tp_size, heartbeat.dcp_size);
        let ranks = match self.remote_ranks(OP, heartbeat.port, sizes) {
            Ok(ranks) => ranks,
            Err(err) => {
                tracing::warn!(engine = %heartbeat.engine_id, %err, "no heartbeat sent");
                return;
            }
        };
        // vLLM push: a load that stopped waiting lets the prefill's lease end (vLLM's ids
        // carry no capability, so none is left out of line with its id).
        let silenced = |id: &str| {
            self.shared.protocol == Protocol::Vllm
                && self.shared.push.as_ref().is_some_and(|p| p.silenced(id))
        };
        let ids: Vec<&str> = heartbeat
            .request_ids
            .iter()
            .map(String::as_str)
            .filter(|id| !silenced(id))
            .collect();
        // Every id silenced: nothing to say, and the engine is not in use for them. (A
        // heartbeat of no id at all still keeps its engine in use and handshaken.)
        if ids.is_empty() && !heartbeat.request_ids.is_empty() {
            return;
        }
        let ids = ids.into_iter();
        let proofs = match self.shared.protocol {
            Protocol::Native => Some((&heartbeat.capabilities[..], self.agent().name())),
            Protocol::Vllm => None,
        };
        let messages = heartbeat_messages(&heartbeat_entries(ids, proofs));
        for (rank, port) in ranks {
            let remotes = &self.shared.remotes;
            let agent = match remotes.ready(&heartbeat.engine_id, rank) {
                Some(remote) => remote.agent.clone(),
                None => {
                    self.handshake_for_heartbeats(heartbeat, rank, port);
                    match remotes.known_agent(&heartbeat.engine_id, rank) {
                        Some(agent) => agent,
                        None => continue,
                    }
                }
            };
            for message in &messages {
                match self.agent().send_notification(&agent, message) {
                    Ok(()) => self.shared.series.heartbeat_sent(),
                    Err(err) => {
                        self.shared.series.failed_notification();
                        tracing::debug!(engine = %heartbeat.engine_id, rank, %err, "heartbeat not sent");
                    }
                }
            }
        }
    }

    /// Starts, in a task, the handshake with rank `rank` of `heartbeat`'s engine (its side
    /// channel at `port`), so that the next heartbeat to it goes.
    fn handshake_for_heartbeats(&self, heartbeat: &HeartbeatSpec, rank: usize, port: u16) {
        let (shared, id, host) = (
            self.shared.clone(),
            heartbeat.engine_id.clone(),
            heartbeat.host.clone(),
        );
        let (tp_size, pp_size) = (heartbeat.tp_size, heartbeat.pp_size);
        self.runtime.spawn(async move {
            let engine = Engine {
                id: &id,
                host: &host,
                tp_size,
                pp_size,
            };
            if let Err(err) = connect::remote(&shared, engine, rank, port).await {
                tracing::debug!(engine = %id, rank, %err, "handshake for heartbeats failed");
            }
        });
    }

    /// Holds a finished prefill request's blocks until the decode notifications arrive
    /// (one from each decode rank reading this rank or told it is not read:
    /// [`TpMapping::consumers`]) or its KV lease ends at `deadline`
    /// (heartbeats extend it; see [the scheduler's docs](crate::scheduler)). A request id
    /// must not start with `HB:` (a heartbeat's prefix) or hold a comma.
    ///
    /// In the native protocol only finish notifications and heartbeats tagged under
    /// `capability` count: draw one per request ([`Capability::random`]), hold the request
    /// with it on every rank, and hand it to the decode in the request's params
    /// ([`KvTransferParams::remote_capability`](crate::KvTransferParams::remote_capability),
    /// [`RemoteBlocks::capability`]), as the scheduler does. Held without one, a request
    /// is freed by its lease only. vLLM's protocol has none (pass `None`).
    ///
    /// Held so, the request raises no release marks when it is released: a decode reading
    /// it cannot tell whether its READ outlived the lease. The step
    /// ([`start_load_kv`](Self::start_load_kv)) holds what the scheduler's
    /// [`SendSpec`](crate::SendSpec)s say, marks included.
    pub fn hold_for_decode(
        &self,
        request_id: &str,
        deadline: Instant,
        capability: Option<&Capability>,
    ) {
        self.hold(request_id, deadline, capability.cloned(), None);
    }

    /// Push mode: [`hold_for_decode`](Self::hold_for_decode), and the request's
    /// `block_ids` (in token order; `group_lens` of them per KV cache group, empty for one)
    /// are written into the blocks a decode registers for it, proven under `capability`.
    /// `num_tokens`, the prompt's tokens it computed (a [`SendSpec`](crate::SendSpec)'s),
    /// tells where a decode's blocks start in the prompt when the two engines' blocks hold
    /// different numbers of tokens, or a block id is another number of kernel blocks on
    /// each; a WRITE between such engines is refused without it. Registrations that came
    /// first are matched now. The request is released once NIXL
    /// has ended the WRITE (its lease cannot release it while the WRITE runs), when the
    /// decode cancels before registering, or when its lease ends with no WRITE under way.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the worker is not in push mode, or speaks vLLM's
    /// protocol (which has no capabilities: hold through
    /// [`start_load_kv`](Self::start_load_kv)'s [`SendSpec`](crate::SendSpec)s, without one).
    pub fn hold_for_push(
        &self,
        request_id: &str,
        deadline: Instant,
        capability: &Capability,
        (block_ids, group_lens): (&[usize], &[usize]),
        num_tokens: Option<usize>,
    ) -> Result<()> {
        if self.shared.push.is_none() {
            return Err(Error::invalid(
                "hold a request for push",
                "the worker is in pull mode (kv_connector_extra_config.transfer_mode)",
            ));
        }
        if self.shared.protocol == Protocol::Vllm {
            return Err(Error::invalid(
                "hold a request for push",
                "vLLM's protocol has no capabilities: hold it through start_load_kv with a SendSpec of no capability, its block_ids and group_lens",
            ));
        }
        self.hold(request_id, deadline, Some(capability.clone()), None);
        let blocks = HeldBlocks {
            block_ids: block_ids.to_vec(),
            group_lens: group_lens.to_vec(),
            num_tokens,
        };
        crate::worker::push::ready(&self.shared, request_id, blocks, capability.clone());
        Ok(())
    }

    /// What push mode did on this rank so far (all zero in pull mode).
    pub fn push_stats(&self) -> PushStats {
        self.shared
            .push
            .as_ref()
            .map(|push| push.stats())
            .unwrap_or_default()
    }

    /// [`hold_for_decode`](Self::hold_for_decode), raising `marks` at the release.
    fn hold(
        &self,
        request_id: &str,
        deadline: Instant,
        capability: Option<Capability>,
        marks: Option<Marks>,
    ) {
        self.listen_for_notifications();
        let lease = (deadline, Instant::now());
        let mut sends = self.shared.sends.lock();
        sends.hold(request_id.to_string(), lease, capability, marks);
    }

    /// Requests done sending (every decode rank notified, or their lease ended) and done
    /// receiving, since the last call, on this rank only. An engine step passes
    /// [`output`](Self::output) to
    /// [`KvConnectorScheduler::update_connector_output`](crate::KvConnectorScheduler::update_connector_output)
    /// instead: with TP > 1 a request is done only once every rank reports it, and its
    /// blocks must not be freed (nor a load taken as landed) on one rank's word.
    pub fn finished(&self) -> Finished {
        let arrived = self.decode_notes.take_arrived();
        let (sending, marks) = {
            let mut sends = self.shared.sends.lock();
            // What NIXL holds counts before any lease ends (vLLM's `get_finished`).
            let now = Instant::now();
            for note in &arrived {
                sends.notified(&note.sender, &note.message, now);
            }
            sends.expire(now);
            sends.take_done()
        };
        if let Some(push) = &self.shared.push {
            push.released(&sending, &self.shared.series);
        }
        // Readers must see a release before the engine can reuse the blocks.
        if !marks.is_empty() {
            match self.shared.caches.get() {
                Some(caches) => caches.raise_marks(&marks),
                None => tracing::warn!(
                    released = marks.len(),
                    "released requests' marks not raised: no KV caches registered"
                ),
            }
        }
        let recving = std::mem::take(&mut self.shared.outcomes.lock().recving);
        if let Some(push) = &self.shared.push {
            push.loads_taken(&recving);
        }
        self.shared.series.leaks(&self.agent().leak_stats());
        Finished { sending, recving }
    }

    /// This rank's output of one step, for
    /// [`KvConnectorScheduler::update_connector_output`](crate::KvConnectorScheduler::update_connector_output)
    /// (vLLM's `KVConnectorOutput`): its rank, [`finished`](Self::finished) and
    /// [`load_errors`](Self::load_errors), both taken.
    pub fn output(&self) -> WorkerOutput {
        WorkerOutput {
            tp_rank: self.shared.config.tp_rank,
            pp_rank: self
                .shared
                .config
                .pipeline
                .as_ref()
                .map_or(0, |p| p.pp_rank()),
            finished: self.finished(),
            load_errors: self.load_errors(),
        }
    }

    /// Resolves once a load has ended since the previous call (or immediately if one ended
    /// before it), so an engine loop can sleep until [`finished`](Self::finished) has news.
    pub async fn load_ended(&self) {
        self.shared.outcomes.ended().await;
    }

    /// Resolves once a decode notification has arrived since the previous call (or
    /// immediately if one arrived before it), so a prefill loop can sleep until
    /// [`finished`](Self::finished)`.sending` may have news. Requests released by the end
    /// of their lease wake nobody: call [`finished`](Self::finished) now and then as well.
    pub async fn notified(&self) {
        self.shared.sends.arrived().await;
    }

    /// The local blocks whose load failed since the last call, each with its request and
    /// the reason (vLLM's `get_block_ids_with_load_errors`), sorted by block id; see
    /// [`KvConnectorScheduler::update_connector_output`](crate::KvConnectorScheduler::update_connector_output)
    /// for the failure policy.
    pub fn load_errors(&self) -> Vec<FailedBlock> {
        let mut failed = std::mem::take(&mut self.shared.outcomes.lock().load_errors);
        failed.sort_by_key(|f| f.block_id);
        failed
    }

    /// The loads whose READs were still in flight at the
    /// [`transfer_timeout`](WorkerConfig::transfer_timeout) since the last call, each once
    /// (the last 4096 at most; [`NUM_OVERDUE_TRANSFERS`](crate::series::NUM_OVERDUE_TRANSFERS)
    /// counts every one).
    /// Their blocks are not the engine's yet: NIXL may still write them. Each load's outcome
    /// (in [`finished`](Self::finished) and [`load_errors`](Self::load_errors)) follows once
    /// NIXL has ended its every READ; a READ stuck forever keeps its blocks forever.
    pub fn overdue_loads(&self) -> Vec<OverdueLoad> {
        self.shared.outcomes.lock().take_overdue()
    }

    /// Metrics of the loads that ended since the last call: of the last 4096 at most (an
    /// engine that never takes them holds no more; the exported series count every load).
    pub fn metrics(&self) -> Vec<TransferMetrics> {
        self.shared.outcomes.lock().take_metrics()
    }

    /// How held requests were released so far.
    pub fn send_stats(&self) -> SendStats {
        self.shared.sends.lock().stats()
    }

    /// The metadata of the remote agents this rank handshook with so far (loaded, reused,
    /// replaced) and the process's open file descriptors now.
    pub fn remote_stats(&self) -> RemoteStats {
        self.shared.remotes.stats()
    }

    /// The side channel's handshakes so far: admitted, evicted for newer ones (see
    /// [`ChannelLimits::max_sessions`](crate::ChannelLimits::max_sessions)), refused, and
    /// the most under way at once (all zero before the KV caches are registered).
    pub fn side_channel_stats(&self) -> PendingStats {
        self.registered
            .get()
            .map(|c| c.side_channel_pending.stats())
            .unwrap_or_default()
    }

    /// The connections this rank's native side channel refused so far, by kind (each kind
    /// is logged at its 1st, 2nd, 4th, 8th... refusal only). In vLLM mode see
    /// [`MetadataServer::refusals`](crate::vllm::MetadataServer::refusals).
    pub fn side_channel_refusals(&self) -> RefusalCounts {
        self.shared.guard.refusals.counts()
    }

    /// What this rank's decode notifications did so far besides releasing requests
    /// (heartbeats, late, repeated and malformed notifications).
    pub fn notification_stats(&self) -> NotificationStats {
        self.shared.sends.lock().notification_stats()
    }
}

impl Drop for KvConnectorWorker {
    fn drop(&mut self) {
        if let Some(push) = &self.shared.push {
            push.close();
        }
        for task in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            task.abort();
        }
        #[cfg(feature = "vllm")]
        if let Some((server, _)) = self.registered.get().and_then(|c| c.vllm.as_ref()) {
            let (pp_rank, tp_rank) = vllm_rank(&self.shared.config);
            server.withdraw(pp_rank, tp_rank);
        }
        if let (Some(source), Some(_)) = (&self.shared.etcd, self.registered.get()) {
            crate::transport::etcd::withdraw(self.agent(), source);
        }
    }
}

/// What a worker's config settles besides its context: the lease of held requests, the
/// engine TTL of its remotes, its protocol and where it exchanges metadata.
struct Settings {
    lease: Lease,
    engine_ttl: Option<std::time::Duration>,
    max_backoff: std::time::Duration,
    protocol: Protocol,
    etcd: Option<EtcdSource>,
    /// Push mode's settings (`None`: pull mode).
    push: Option<PushSettings>,
}

impl Settings {
    /// The settings of `config`, each from its field or else its `kv_transfer_config`.
    fn of(config: &WorkerConfig) -> Result<Self> {
        const OP: &str = "create the connector worker";
        let protocol = match config.protocol {
            Some(protocol) => protocol,
            None => Protocol::from_kv_transfer_config(&config.kv_transfer_config)?,
        };
        #[cfg(not(feature = "vllm"))]
        if protocol == Protocol::Vllm {
            return Err(vllm_not_built(OP));
        }
        let etcd = match config.metadata_exchange {
            MetadataExchange::Etcd if protocol == Protocol::Vllm => {
                return Err(Error::invalid(
                    OP,
                    "vLLM's protocol carries the agent metadata in its handshake: use MetadataExchange::SideChannel",
                ))
            }
            MetadataExchange::Etcd => Some(EtcdSource::from_env()?),
            MetadataExchange::SideChannel => None,
        };
        let kv = &config.kv_transfer_config;
        let push = match TransferMode::from_kv_transfer_config(kv)? {
            TransferMode::Pull => None,
            TransferMode::Push => Some(PushSettings::from_kv_transfer_config(kv)?),
        };
        if push.is_some()
            && kv.kv_role != Some(KvRole::Producer)
            && config
                .pipeline
                .as_ref()
                .is_some_and(|p| p.stages().pp_size() > 1)
        {
            return Err(Error::invalid(
                OP,
                "push mode with pipeline stages is a prefill's only (vLLM's push refuses a decode of several stages): set kv_role to kv_producer on a prefill of stages, or use pull mode",
            ));
        }
        Ok(Settings {
            push,
            lease: match config.lease {
                Some(lease) => lease,
                None => Lease::from_kv_transfer_config(&config.kv_transfer_config)?,
            },
            engine_ttl: crate::worker::engines::engine_ttl(&config.kv_transfer_config)?,
            max_backoff: crate::worker::engines::max_backoff(&config.kv_transfer_config)?,
            protocol,
            etcd,
        })
    }
}

/// The context of a worker of `config` and `settings`: its KV cache groups, its NIXL
/// agent with telemetry on (each READ's post and transfer durations feed the exported
/// series) and its UCX backend with the connector's defaults where the config sets none
/// (see [`ucx_defaults`]), its side channel's guard, its metrics and, in vLLM mode, its
/// vLLM side.
fn context(config: WorkerConfig, settings: &Settings) -> Result<Context> {
    let protocol = settings.protocol;
    let groups = KvCacheGroups::from_kv_transfer_config(&config.kv_transfer_config)?;
    check_pipeline(&config, &groups, settings.push.is_some())?;
    check_context_parallel(&config, &groups)?;
    #[cfg(feature = "vllm")]
    let vllm = match protocol {
        Protocol::Native => None,
        Protocol::Vllm => {
            let compat = Compatibility::from_kv_transfer_config(&config.kv_transfer_config)?;
            let mode = TransferMode::from_kv_transfer_config(&config.kv_transfer_config)?;
            compat.check_transfer_mode(mode.as_str())?;
            Some(VllmWorker::new(compat, config.vllm_limits))
        }
    };
    let name = config
        .agent_name
        .clone()
        .unwrap_or_else(|| agent_name(&config));
    let setup = NixlSetup::with_global_registry(
        Agent::builder(&name)
            .config(config.agent_config.clone())
            .telemetry(true),
        &ucx_defaults::with_ucx_defaults(&config.kv_transfer_config)?,
        config.platform.as_ref(),
    )?;
    let role = config.kv_transfer_config.kv_role;
    let series = Arc::new(Series::new(labels(&config), role));
    let guard = Arc::new(guard(&config, protocol)?);
    let etcd = settings
        .etcd
        .clone()
        .map(|source| source.sealed_with(guard.secret.clone()));
    Ok(Context {
        config,
        protocol,
        #[cfg(feature = "vllm")]
        vllm,
        groups,
        setup,
        guard,
        etcd,
        series,
    })
}

/// Refuses a pipeline of more than one stage with several KV cache groups, as vLLM's
/// pull-mode `NixlConnector` worker refuses hybrid models under pipeline parallelism, but
/// for a push prefill whose regions name their layers (vLLM's `NixlPushConnector` routes
/// them by name into the decode's): without SSM groups (vLLM's push refuses them under
/// pipeline parallelism too), and naming the stage's layers.
fn check_pipeline(config: &WorkerConfig, groups: &KvCacheGroups, push: bool) -> Result<()> {
    const OP: &str = "create the connector worker";
    let Some(pipeline) = config
        .pipeline
        .as_ref()
        .filter(|p| p.stages().pp_size() > 1)
    else {
        return Ok(());
    };
    if groups.len() <= 1 {
        return Ok(());
    }
    if !push {
        return Err(Error::invalid(
            OP,
            "NixlConnector (pull) does not support pipeline_parallel_size > 1 with hybrid KV cache layouts (HMA): vLLM 0.33 refuses it, and so does this connector; use push mode (NixlPushConnector), whose prefill writes each layer by name",
        ));
    }
    if groups.has_ssm_groups() {
        return Err(Error::invalid(
            OP,
            "push mode with pipeline stages and SSM (Mamba) groups is not supported: vLLM 0.33's push refuses Mamba/SSM hybrids under pipeline parallelism too",
        ));
    }
    let named: usize = groups.region_layers().iter().map(Vec::len).sum();
    let layers = pipeline.stages().layers(pipeline.pp_rank()).len();
    if named != layers {
        return Err(Error::invalid(
            OP,
            format!("a push prefill of pipeline stages with several KV cache groups writes each layer by name: kv_cache_groups.region_layers names {named} layers, stage {} holds {layers}", pipeline.pp_rank()),
        ));
    }
    Ok(())
}

/// Refuses a DCP size the connector does not pair (vLLM 0.33's NixlConnector's bounds): 0 or
/// more than [`MAX_DCP_SIZE`], neither 1 nor the TP size (vLLM shards
/// a cache over every TP rank or none), or several KV cache groups (not supported here);
/// and a PCP size of 0 or more than [`MAX_DCP_SIZE`], whose DCP neither is 1 nor spans
/// it (vLLM's "PCP+DCP does not span the full PCP group"), or above 1 in an engine whose
/// `kv_role` is `kv_consumer` or `kv_both` (vLLM's connector refuses it).
fn check_context_parallel(config: &WorkerConfig, groups: &KvCacheGroups) -> Result<()> {
    const OP: &str = "create the connector worker";
    let (dcp, tp, pcp) = (config.dcp_size, config.tp_size, config.pcp_size);
    if !(1..=MAX_DCP_SIZE).contains(&dcp) {
        return Err(Error::invalid(
            OP,
            format!("dcp_size {dcp}: 1 to {MAX_DCP_SIZE}"),
        ));
    }
    if !(1..=MAX_DCP_SIZE).contains(&pcp) {
        return Err(Error::invalid(
            OP,
            format!("pcp_size {pcp}: 1 to {MAX_DCP_SIZE}"),
        ));
    }
    let role = config.kv_transfer_config.kv_role;
    if pcp > 1 && matches!(role, Some(KvRole::Consumer | KvRole::Both)) {
        return Err(Error::invalid(
            OP,
            format!("pcp_size {pcp} with kv_role {role:?}: NixlConnector PCP currently supports kv_producer only (vLLM's rule); consumers and kv_both need pcp_size 1"),
        ));
    }
    if pcp > 1 && dcp != 1 && dcp != pcp {
        return Err(Error::invalid(
            OP,
            format!("pcp_size {pcp} with dcp_size {dcp}: vLLM's NixlConnector PCP+DCP must span the full PCP group (dcp_size 1 for replicated PCP, or {pcp})"),
        ));
    }
    if dcp > 1 && dcp != tp {
        return Err(Error::invalid(
            OP,
            format!("dcp_size {dcp} with TP size {tp}: vLLM's NixlConnector supports a DCP size of 1 or the TP size (a cache sharded over every TP rank or none)"),
        ));
    }
    if dcp > 1 && groups.len() > 1 {
        return Err(Error::invalid(
            OP,
            format!("dcp_size {dcp} with {} KV cache groups: decode context parallelism is supported for one group only", groups.len()),
        ));
    }
    Ok(())
}

/// The labels of the metric series of a worker of `config`: its engine, TP rank and, in an
/// engine of several pipeline stages, its stage.
fn labels(config: &WorkerConfig) -> Vec<metrics::Label> {
    let stages = config
        .pipeline
        .as_ref()
        .filter(|p| p.stages().pp_size() > 1);
    rank_labels(
        &config.engine_id,
        config.tp_rank,
        stages.map(|p| p.pp_rank()),
    )
}

/// The side channel's guard of a worker of `config` speaking `protocol`: its secret (native
/// protocol only: vLLM's has no credential), its allowed peer networks, and its refusal
/// counters.
fn guard(config: &WorkerConfig, protocol: Protocol) -> Result<Guard> {
    if protocol == Protocol::Vllm && config.secret.is_some() {
        tracing::warn!("vLLM's protocol has no credential: the shared secret is not used; set kv_connector_extra_config.allowed_peer_networks");
    }
    Ok(Guard {
        secret: match (&config.secret, protocol) {
            (_, Protocol::Vllm) => None,
            (Some(secret), Protocol::Native) => Some(secret.clone()),
            (None, Protocol::Native) => {
                SharedSecret::from_kv_transfer_config(&config.kv_transfer_config)?
            }
        },
        kept: Default::default(),
        peers: match &config.allowed_peers {
            Some(peers) => peers.clone(),
            None => PeerNetworks::from_kv_transfer_config(&config.kv_transfer_config)?,
        },
        refusals: Refusals::labelled(labels(config)),
        ..Guard::default()
    })
}

/// The refusal of a second registration through a method that registers once.
fn already_registered(operation: &'static str) -> Error {
    Error::invalid(
        operation,
        "the KV caches are already registered; to register them again (vLLM's sleep mode), call register_kv_caches_again",
    )
}

/// The error of a vLLM-mode operation on a worker speaking the native protocol.
#[cfg(feature = "vllm")]
fn native_protocol() -> Error {
    Error::invalid(
        "use vLLM's protocol",
        "this worker speaks the native protocol (set kv_connector_extra_config.protocol to \"vllm\", or WorkerConfig::protocol)",
    )
}

/// The refusal of vLLM's protocol by a connector built without the `vllm` feature.
#[cfg(not(feature = "vllm"))]
fn vllm_not_built(operation: &'static str) -> Error {
    Error::invalid(
        operation,
        "vLLM's protocol was asked for (kv_connector_extra_config.protocol or WorkerConfig::protocol), but nixl-connector was built without its \"vllm\" feature: enable it (it is a default feature), or use the native protocol",
    )
}

/// The rank of a worker of `config` as vLLM's side channel numbers it: `(pp_rank,
/// tp_rank)`.
#[cfg(feature = "vllm")]
fn vllm_rank(config: &WorkerConfig) -> (u32, u32) {
    let number = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let pp_rank = config.pipeline.as_ref().map_or(0, |p| p.pp_rank());
    (number(pp_rank), number(config.tp_rank))
}

/// A unique agent name: engine, stage (of several), rank, process and a counter.
fn agent_name(config: &WorkerConfig) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let stage = match config
        .pipeline
        .as_ref()
        .filter(|p| p.stages().pp_size() > 1)
    {
        Some(pipeline) => format!("-pp{}", pipeline.pp_rank()),
        None => String::new(),
    };
    format!(
        "{}{stage}-rank{}-{}-{}",
        config.engine_id,
        config.tp_rank,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

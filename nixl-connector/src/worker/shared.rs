//! What a worker shares with its background tasks (the loads, the handshakes with remote
//! ranks, the decode notifications and the host-buffer staging): its parts, each owning its
//! state behind its own lock and changing it only through its own methods, and the context
//! every part reads and none writes.
//!
//! | part | owns | written by |
//! | --- | --- | --- |
//! | [`CurrentCaches`] | the registered caches and what is derived from them, the release marks among them | registration (`registration.rs`, `reregister.rs`); the marks raised by the step (`worker.rs`, `mark_words.rs`) |
//! | [`Remotes`] | the remote ranks handshaken, their prepared lists, engine TTLs | handshakes (`connect.rs`), loads' failures, eviction (`engines.rs`) |
//! | [`LoadOutcomes`] | what the loads came to, and the signal that one ended | loads (`load.rs`); taken by the step (`worker.rs`) |
//! | [`HeldSends`] | the requests held for decodes, and the signal a notification arrived | the step and the decode notifications (`worker.rs`, `sending.rs`) |
//! | [`Push`] | push mode's prefill book (requests ready to be written, early registrations) and decode waits | push notifications and loads (`push.rs`, `push_vllm.rs`, `push_state.rs`); the step (`worker.rs`) |
//! | [`ScratchWords`] | registered words for the release marks a load READs, free between loads | loads (`marks_check.rs`) |
//! | [`Context`] | config, protocol, groups, the NIXL setup, the side channel's guard, etcd, metrics | nobody after creation (the guard, the vLLM worker and the metrics count through atomics and locks of their own) |
//!
//! Lock order: no part's lock is held while another part's is taken, or across an await;
//! each part's methods take and release their own. ([`Remotes`] keeps its table's lock and
//! each handshake's state apart; see `remotes.rs`.)

use std::ops::Deref;

use nixl::kv_config::NixlSetup;

use crate::config::{Protocol, WorkerConfig};
use crate::geometry::groups::KvCacheGroups;
use crate::metrics::series::Series;
use crate::transport::etcd::EtcdSource;
use crate::transport::side_channel::Guard;
#[cfg(feature = "vllm")]
use crate::vllm::VllmWorker;
use crate::worker::current_caches::CurrentCaches;
use crate::worker::held_sends::HeldSends;
use crate::worker::load_outcomes::LoadOutcomes;
use crate::worker::push_state::Push;
use crate::worker::remotes::Remotes;
use crate::worker::scratch_words::ScratchWords;

/// What every part reads and none writes, set when the worker is created.
pub(crate) struct Context {
    pub(crate) config: WorkerConfig,
    /// The protocol spoken (the config's, resolved).
    pub(crate) protocol: Protocol,
    /// vLLM mode: the compatibility hash, the side channel's limits, what handshakes
    /// learned of remote engines.
    #[cfg(feature = "vllm")]
    pub(crate) vllm: Option<VllmWorker>,
    /// The engine's KV cache groups (`kv_connector_extra_config.kv_cache_groups`): which
    /// are SSM groups and their state, the groups' block size, and, in vLLM's protocol,
    /// the regions of each.
    pub(crate) groups: KvCacheGroups,
    pub(crate) setup: NixlSetup,
    /// The secret, allowed networks, accepted readers and refusals of the side channel.
    pub(crate) guard: std::sync::Arc<Guard>,
    /// Where peers' metadata is fetched from, in etcd mode.
    pub(crate) etcd: Option<EtcdSource>,
    /// The exported metrics.
    pub(crate) series: std::sync::Arc<Series>,
}

/// The worker's parts and their context, shared with its background tasks.
pub(crate) struct Shared {
    /// What every part reads (also reached through `Deref`).
    pub(crate) context: Context,
    /// The registered caches.
    pub(crate) caches: CurrentCaches,
    /// The remote ranks.
    pub(crate) remotes: Remotes,
    /// The loads' outcomes.
    pub(crate) outcomes: LoadOutcomes,
    /// The requests held for decodes.
    pub(crate) sends: HeldSends,
    /// The registered words loads READ release marks into.
    pub(crate) scratch: ScratchWords,
    /// Push mode's registrations, waits and counts (`None` in pull mode).
    pub(crate) push: Option<Push>,
}

impl Deref for Shared {
    type Target = Context;

    fn deref(&self) -> &Context {
        &self.context
    }
}

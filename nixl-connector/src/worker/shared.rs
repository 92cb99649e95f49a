//! The state a worker shares with its background tasks: the loads, the handshakes with
//! remote ranks and the host-buffer staging all work on it, and none of them on the worker.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use nixl::kv_config::NixlSetup;
use nixl::{PreparedLocal, Registration};

use crate::config::{Protocol, WorkerConfig};
use crate::geometry::groups::KvCacheGroups;
use crate::geometry::spec::KvCacheSpec;
use crate::metrics::series::Series;
use crate::scheduler::outcomes::Outcomes;
use crate::transport::etcd::EtcdSource;
use crate::transport::handshake::HandshakeMessage;
use crate::transport::pending::PendingHandshakes;
use crate::transport::side_channel::Guard;
#[cfg(feature = "vllm")]
use crate::vllm::{MetadataServer, NixlHandshakePayload, VllmWorker};
use crate::worker::remotes::Remotes;
use crate::worker::sending::Sends;

/// The registered cache and what is derived from it.
pub(crate) struct Caches {
    /// How many times this worker registered its caches, this one included (1 for the
    /// first registration; see [`KvConnectorWorker::register_kv_caches_again`](crate::KvConnectorWorker::register_kv_caches_again)).
    pub(crate) generation: u64,
    pub(crate) registration: Registration,
    pub(crate) spec: KvCacheSpec,
    pub(crate) local: PreparedLocal,
    pub(crate) handshake: Arc<HandshakeMessage>,
    pub(crate) side_channel: SocketAddr,
    /// What the native side channel answers with (`None` while the caches are registered
    /// again); the vLLM side channel serves the payload of [`vllm`](Self::vllm).
    pub(crate) served: Arc<tokio::sync::watch::Sender<Option<Arc<HandshakeMessage>>>>,
    /// The places of the side channel's handshakes under way (native protocol).
    pub(crate) side_channel_pending: Arc<PendingHandshakes>,
    /// vLLM mode: the engine's side channel this rank's payload is published to, and the
    /// payload.
    #[cfg(feature = "vllm")]
    pub(crate) vllm: Option<(Arc<MetadataServer>, NixlHandshakePayload)>,
}

/// State shared with the background tasks.
pub(crate) struct Shared {
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
    /// The registered caches: loads and handshakes take the current ones and keep them
    /// (and NIXL's lists keep their memory) until they end, even past a re-registration.
    pub(crate) caches: Mutex<Option<Arc<Caches>>>,
    pub(crate) outcomes: Mutex<Outcomes>,
    pub(crate) sends: Mutex<Sends>,
    /// The secret, allowed networks and accepted readers of the side channel.
    pub(crate) guard: Arc<Guard>,
    pub(crate) remotes: Remotes,
    /// Where peers' metadata is fetched from, in etcd mode.
    pub(crate) etcd: Option<EtcdSource>,
    /// The exported metrics.
    pub(crate) series: Arc<Series>,
    /// Signalled whenever a load ends.
    pub(crate) load_ended: tokio::sync::Notify,
    /// Signalled whenever a decode notification arrives for this rank.
    pub(crate) notified: tokio::sync::Notify,
}

impl Shared {
    pub(crate) fn outcomes(&self) -> MutexGuard<'_, Outcomes> {
        self.outcomes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The registered caches now, if any.
    pub(crate) fn current_caches(&self) -> Option<Arc<Caches>> {
        self.caches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(crate) fn sends(&self) -> MutexGuard<'_, Sends> {
        self.sends.lock().unwrap_or_else(|p| p.into_inner())
    }
}

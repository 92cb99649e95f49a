//! The state a worker shares with its background tasks: the loads, the handshakes with
//! remote ranks and the host-buffer staging all work on it, and none of them on the worker.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use nixl::kv_config::NixlSetup;
use nixl::{PreparedLocal, Registration};

use crate::config::{Protocol, WorkerConfig};
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
    pub(crate) registration: Registration,
    pub(crate) spec: KvCacheSpec,
    pub(crate) local: PreparedLocal,
    pub(crate) handshake: Arc<HandshakeMessage>,
    pub(crate) side_channel: SocketAddr,
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
    pub(crate) setup: NixlSetup,
    pub(crate) caches: OnceLock<Caches>,
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

    pub(crate) fn sends(&self) -> MutexGuard<'_, Sends> {
        self.sends.lock().unwrap_or_else(|p| p.into_inner())
    }
}

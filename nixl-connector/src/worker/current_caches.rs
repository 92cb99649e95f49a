//! The registration part of a worker: the KV caches registered now and what is derived from
//! them. Registration sets them, registering again clears them for its duration; loads and
//! handshakes take the current ones and keep them (and NIXL's lists keep their memory)
//! until they end, even past a re-registration.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use nixl::{PreparedLocal, Registration};

use crate::geometry::spec::KvCacheSpec;
use crate::transport::handshake::HandshakeMessage;
use crate::transport::pending::PendingHandshakes;
#[cfg(feature = "vllm")]
use crate::vllm::{MetadataServer, NixlHandshakePayload};
use crate::worker::mark_words::MarkWords;
use crate::worker::sending::Marks;

/// The registered cache and what is derived from it.
pub(crate) struct Caches {
    /// How many times this worker registered its caches, this one included (1 for the
    /// first registration; see [`KvConnectorWorker::register_kv_caches_again`](crate::KvConnectorWorker::register_kv_caches_again)).
    pub(crate) generation: u64,
    pub(crate) registration: Registration,
    pub(crate) spec: KvCacheSpec,
    pub(crate) local: PreparedLocal,
    pub(crate) handshake: Arc<HandshakeMessage>,
    /// The rank's release marks (native protocol), named in `handshake`.
    pub(crate) marks: Option<MarkWords>,
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

impl Caches {
    /// Raises the release marks of `released` requests (see [`MarkWords::raise`]); no-op
    /// without marks (vLLM mode).
    pub(crate) fn raise_marks(&self, released: &[Marks]) {
        if let Some(marks) = &self.marks {
            marks.raise(released);
        }
    }
}

/// The caches registered now, if any. Its lock is held only to take or replace the `Arc`,
/// never across another lock or an await.
#[derive(Default)]
pub(crate) struct CurrentCaches {
    current: Mutex<Option<Arc<Caches>>>,
}

impl CurrentCaches {
    /// The registered caches now, if any.
    pub(crate) fn get(&self) -> Option<Arc<Caches>> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Makes `caches` the current ones (a registration).
    pub(crate) fn set(&self, caches: Arc<Caches>) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(caches);
    }

    /// No caches from now on, until the next [`set`](Self::set) (a registration again).
    pub(crate) fn clear(&self) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

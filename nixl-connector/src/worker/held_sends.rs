//! The sending part of a worker (prefill side): its requests held for decodes
//! ([`Sends`]), updated by the engine's step and by the decode notifications as they
//! arrive, and the signal that one arrived.

use std::sync::{Mutex, MutexGuard, Weak};
use std::time::Instant;

use crate::transport::handshake::KeptClaim;
use crate::transport::side_channel::KeptRequests;
use crate::worker::sending::Sends;
use crate::worker::shared::Shared;

/// The held requests and their signal. Its lock is held for one update or one take, never
/// across another lock or an await.
pub(crate) struct HeldSends {
    sends: Mutex<Sends>,
    notified: tokio::sync::Notify,
}

impl HeldSends {
    /// `sends`, held from now on.
    pub(crate) fn new(sends: Sends) -> Self {
        HeldSends {
            sends: Mutex::new(sends),
            notified: tokio::sync::Notify::new(),
        }
    }

    /// The held requests, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Sends> {
        self.sends.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tells a waiter of [`arrived`](Self::arrived) that a decode notification arrived.
    pub(crate) fn notify_arrived(&self) {
        self.notified.notify_one();
    }

    /// Waits until a decode notification arrives (one since the last wait counts).
    pub(crate) async fn arrived(&self) {
        self.notified.notified().await;
    }
}

/// The worker's held requests as its side channel reaches them to answer claims: through a
/// weak reference, so that the side channel (part of the worker) does not keep the worker's
/// parts alive.
pub(crate) struct ClaimsOf(pub(crate) Weak<Shared>);

impl KeptRequests for ClaimsOf {
    fn claim(&self, reader: &[u8], claims: &[KeptClaim]) -> Vec<String> {
        let Some(shared) = self.0.upgrade() else {
            return Vec::new();
        };
        let claimed = shared.sends.lock().claim(reader, claims, Instant::now());
        claimed
    }
}

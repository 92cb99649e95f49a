//! The sending part of a worker (prefill side): its requests held for decodes
//! ([`Sends`]), updated by the engine's step and by the decode notifications as they
//! arrive, and the signal that one arrived.

use std::sync::{Mutex, MutexGuard};

use crate::worker::sending::Sends;

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

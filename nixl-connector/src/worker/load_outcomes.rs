//! The outcomes part of a worker: what its loads came to ([`Outcomes`]), written by the
//! loads as they end and taken by the engine's step, and the signal that a load ended.

use std::sync::{Mutex, MutexGuard};

use crate::scheduler::outcomes::Outcomes;

/// The loads' outcomes and their signal. Its lock is held for one update or one take,
/// never across another lock or an await.
#[derive(Default)]
pub(crate) struct LoadOutcomes {
    outcomes: Mutex<Outcomes>,
    ended: tokio::sync::Notify,
}

impl LoadOutcomes {
    /// The outcomes, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Outcomes> {
        self.outcomes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tells a waiter of [`ended`](Self::ended) that a load ended.
    pub(crate) fn notify_ended(&self) {
        self.ended.notify_one();
    }

    /// Waits until a load ends (one that ended since the last wait counts).
    pub(crate) async fn ended(&self) {
        self.ended.notified().await;
    }
}

//! A cap on handshakes in progress that idle or slow peers cannot turn against prompt ones.
//!
//! A server admits at most `max` handshakes at once. When every place is taken, the oldest
//! handshake is evicted to make room for the newest: its owner is told
//! ([`PendingSlot::evicted`]) and gives the place back by dropping its slot, typically after
//! telling its peer it is busy. A peer that holds connections open without speaking loses
//! them to the next arrivals, so it cannot keep a prompt peer out for longer than a
//! handshake takes; a prompt peer whose own handshake was evicted (only if `max` newer
//! connections arrived while it was under way) retries. The number of places held never
//! exceeds `max`: the newcomer waits until the evicted place is given back.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// A future that resolves once a handshake is evicted ([`PendingSlot::evicted`]).
pub type Evicted = WaitForCancellationFutureOwned;

/// Counts of a [`PendingHandshakes`] since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PendingStats {
    /// Handshakes admitted.
    pub admitted: u64,
    /// Handshakes evicted to make room for a newer one.
    pub evicted: u64,
    /// Connections refused because no place came free within the grace.
    pub refused: u64,
    /// The most places held at once.
    pub peak: usize,
}

/// The places of a server's handshakes in progress; see the [module docs](self).
///
/// # Thread safety
/// `Send + Sync`: share it in an `Arc` between the accept loop and the handshakes' tasks.
#[derive(Debug)]
pub struct PendingHandshakes {
    max: usize,
    state: Mutex<State>,
    /// Woken whenever a place is given back.
    freed: Notify,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    /// Places held, oldest first.
    held: VecDeque<Place>,
    stats: PendingStats,
}

#[derive(Debug)]
struct Place {
    id: u64,
    evict: CancellationToken,
}

impl PendingHandshakes {
    /// At most `max` handshakes at once (with `max` 0, every connection is refused).
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(PendingHandshakes {
            max,
            state: Mutex::new(State::default()),
            freed: Notify::new(),
        })
    }

    /// A place for a new handshake. When all are held, evicts the oldest handshake not yet
    /// evicted and waits, at most `grace`, for a place to be given back; `None` when none
    /// was (its holder ignores eviction, or `max` is 0).
    pub async fn admit(self: &Arc<Self>, grace: Duration) -> Option<PendingSlot> {
        // A grace the clock cannot add (Duration::MAX) waits without a limit.
        let deadline = tokio::time::Instant::now().checked_add(grace);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut state = self.lock();
                if state.held.len() < self.max {
                    return Some(self.take_place(&mut state));
                }
                if let Some(oldest) = state.held.iter().find(|p| !p.evict.is_cancelled()) {
                    oldest.evict.cancel();
                    state.stats.evicted += 1;
                }
            }
            let timed_out = match deadline {
                _ if self.max == 0 => true,
                Some(deadline) => tokio::time::timeout_at(deadline, freed).await.is_err(),
                None => {
                    freed.await;
                    false
                }
            };
            if timed_out {
                self.lock().stats.refused += 1;
                return None;
            }
        }
    }

    fn take_place(self: &Arc<Self>, state: &mut State) -> PendingSlot {
        let id = state.next_id;
        state.next_id += 1;
        let evict = CancellationToken::new();
        state.held.push_back(Place {
            id,
            evict: evict.clone(),
        });
        state.stats.admitted += 1;
        state.stats.peak = state.stats.peak.max(state.held.len());
        PendingSlot {
            owner: self.clone(),
            id,
            evict,
        }
    }

    /// The most handshakes at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Places held now.
    pub fn held(&self) -> usize {
        self.lock().held.len()
    }

    /// What was admitted, evicted and refused so far.
    pub fn stats(&self) -> PendingStats {
        self.lock().stats
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One handshake's place, given back when dropped.
#[derive(Debug)]
pub struct PendingSlot {
    owner: Arc<PendingHandshakes>,
    id: u64,
    evict: CancellationToken,
}

impl PendingSlot {
    /// Resolves once this handshake is evicted for a newer one (the future does not borrow
    /// the slot, so it can be awaited beside work that owns it): stop it and drop the slot.
    pub fn evicted(&self) -> Evicted {
        self.evict.clone().cancelled_owned()
    }

    /// Whether this handshake was evicted.
    pub fn is_evicted(&self) -> bool {
        self.evict.is_cancelled()
    }
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut state = self.owner.lock();
        if let Some(at) = state.held.iter().position(|p| p.id == self.id) {
            state.held.remove(at);
        }
        drop(state);
        self.owner.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_millis(200);

    #[tokio::test]
    async fn the_oldest_is_evicted_and_the_newest_waits_for_its_place() {
        let pending = PendingHandshakes::new(2);
        let first = pending.admit(GRACE).await.unwrap();
        let second = pending.admit(GRACE).await.unwrap();
        let evicted = first.evicted();
        let owner = tokio::spawn(async move {
            evicted.await;
            drop(first);
        });
        let third = pending.admit(GRACE).await.unwrap();
        owner.await.unwrap();
        assert!(!second.is_evicted() && !third.is_evicted());
        assert_eq!(pending.held(), 2);
        let stats = pending.stats();
        assert_eq!((stats.admitted, stats.evicted, stats.refused), (3, 1, 0));
        assert_eq!(stats.peak, 2);
    }

    #[tokio::test]
    async fn a_holder_that_ignores_eviction_gets_the_newcomer_refused() {
        let pending = PendingHandshakes::new(1);
        let stubborn = pending.admit(GRACE).await.unwrap();
        assert!(pending.admit(GRACE).await.is_none());
        assert!(stubborn.is_evicted());
        // Evicted once only: the next newcomer evicts nobody new and is refused too.
        assert!(pending.admit(GRACE).await.is_none());
        assert_eq!(pending.stats().evicted, 1);
        drop(stubborn);
        assert!(pending.admit(GRACE).await.is_some());
        assert_eq!(pending.stats().refused, 2);
    }

    #[tokio::test]
    async fn a_grace_past_the_clock_waits_without_a_limit() {
        let pending = PendingHandshakes::new(1);
        let first = pending.admit(Duration::MAX).await.unwrap();
        let evicted = first.evicted();
        let owner = tokio::spawn(async move {
            evicted.await;
            drop(first);
        });
        assert!(pending.admit(Duration::MAX).await.is_some());
        owner.await.unwrap();
    }

    #[tokio::test]
    async fn no_places_refuses_everyone() {
        let pending = PendingHandshakes::new(0);
        assert!(pending.admit(GRACE).await.is_none());
        assert_eq!(pending.stats().refused, 1);
    }
}

//! Bounds on the prefill worker's pending handshakes (connections accepted whose Hello is not
//! yet answered): how many there may be at once, and how many bytes they may have received
//! together (what their frame buffers hold).
//!
//! The count is the connector's [`PendingHandshakes`]: when every place is taken, the oldest
//! pending handshake is evicted for the newest, so idle or slow connections cannot keep out
//! a decode that sends its Hello at once.
//!
//! Each pending handshake may hold [`FREE_BYTES_PER_HANDSHAKE`] without charge, so that a
//! normal Hello is never refused for bytes other connections hold; only what a frame takes
//! beyond that counts against the byte limit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nixl_connector::pending::Evicted;
use nixl_connector::{PendingHandshakes, PendingSlot, PendingStats};

/// Bytes each pending handshake may receive outside the shared byte limit (64 KiB).
pub const FREE_BYTES_PER_HANDSHAKE: usize = 64 << 10;

/// How long a new connection waits for the place of the handshake evicted for it.
pub const EVICTION_GRACE: Duration = nixl_connector::side_channel::EVICTION_GRACE;

/// The limits and what is in use of them; shared by the accept loop and the handshakes.
#[derive(Debug)]
pub struct Admission {
    places: Arc<PendingHandshakes>,
    max_bytes: usize,
    bytes: AtomicUsize,
}

impl Admission {
    /// At most `max_pending` handshakes at once, whose frames hold at most `max_bytes` beyond
    /// their free allowance.
    pub fn new(max_pending: usize, max_bytes: usize) -> Arc<Self> {
        Arc::new(Admission {
            places: PendingHandshakes::new(max_pending),
            max_bytes,
            bytes: AtomicUsize::new(0),
        })
    }

    /// A place for one more pending handshake, held until the [`Ticket`] is dropped. When
    /// `max_pending` are already pending, the oldest is evicted and this waits for its place
    /// (at most [`EVICTION_GRACE`]); `None` when it did not come free.
    pub async fn admit(self: &Arc<Self>) -> Option<Ticket> {
        let slot = self.places.admit(EVICTION_GRACE).await?;
        Some(Ticket {
            admission: self.clone(),
            slot,
            held: 0,
            charged: 0,
        })
    }

    /// Handshakes pending now.
    pub fn pending(&self) -> usize {
        self.places.held()
    }

    /// The most handshakes pending at once.
    pub fn max_pending(&self) -> usize {
        self.places.max()
    }

    /// Handshakes admitted, evicted and refused so far.
    pub fn stats(&self) -> PendingStats {
        self.places.stats()
    }

    /// Bytes charged against the limit now.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }
}

/// One pending handshake's place and the bytes its frames were charged; both go back when it
/// is dropped.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    slot: PendingSlot,
    /// Frame memory this handshake took, allowance included.
    held: usize,
    /// The part of `held` charged against the shared limit.
    charged: usize,
}

impl Ticket {
    /// Resolves once this handshake is evicted for a newer one (it does not borrow the
    /// ticket).
    pub fn evicted(&self) -> Evicted {
        self.slot.evicted()
    }

    /// Charges `bytes` more received by this handshake.
    ///
    /// # Errors
    /// Why the charge would pass the shared byte limit (nothing is charged then).
    pub fn charge(&mut self, bytes: usize) -> Result<(), String> {
        let held = self.held.saturating_add(bytes);
        let charged = held.saturating_sub(FREE_BYTES_PER_HANDSHAKE);
        let more = charged - self.charged;
        let limits = &self.admission;
        if more > 0 {
            limits
                .bytes
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                    used.checked_add(more).filter(|&n| n <= limits.max_bytes)
                })
                .map_err(|used| {
                    format!(
                        "pending handshakes hold {used} bytes of frames; {more} more would pass \
                         the limit of {} bytes",
                        limits.max_bytes
                    )
                })?;
        }
        self.held = held;
        self.charged = charged;
        Ok(())
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.admission
            .bytes
            .fetch_sub(self.charged, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn evicts_the_oldest_for_the_newest() {
        let admission = Admission::new(2, 0);
        let a = admission.admit().await.unwrap();
        let b = admission.admit().await.unwrap();
        let evicted = a.evicted();
        let owner = tokio::spawn(async move {
            evicted.await;
            drop(a);
        });
        let _c = admission.admit().await.unwrap();
        owner.await.unwrap();
        assert_eq!(admission.pending(), 2);
        assert_eq!(admission.stats().evicted, 1);
        drop(b);
        assert_eq!(admission.pending(), 1);
    }

    #[tokio::test]
    async fn charges_bytes_beyond_the_allowance() {
        let admission = Admission::new(4, 100);
        let mut a = admission.admit().await.unwrap();
        a.charge(FREE_BYTES_PER_HANDSHAKE).unwrap();
        assert_eq!(admission.bytes(), 0);
        a.charge(60).unwrap();
        assert_eq!(admission.bytes(), 60);
        let mut b = admission.admit().await.unwrap();
        b.charge(FREE_BYTES_PER_HANDSHAKE + 40).unwrap();
        let err = b.charge(1).unwrap_err();
        assert!(err.to_string().contains("limit of 100 bytes"), "{err}");
        // A handshake within its allowance is never refused.
        admission.admit().await.unwrap().charge(1000).unwrap();
        drop(a);
        assert_eq!(admission.bytes(), 40);
        b.charge(1).unwrap();
        drop(b);
        assert_eq!((admission.bytes(), admission.pending()), (0, 0));
    }
}

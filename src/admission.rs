//! Bounds on the prefill worker's pending handshakes (connections accepted whose Hello is not
//! yet answered): how many there may be at once, and how many bytes they may have received
//! together (what their frame buffers hold).
//!
//! Each pending handshake may hold [`FREE_BYTES_PER_HANDSHAKE`] without charge, so that a
//! normal Hello is never refused for bytes other connections hold; only what a frame takes
//! beyond that counts against the byte limit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Bytes each pending handshake may receive outside the shared byte limit (64 KiB).
pub const FREE_BYTES_PER_HANDSHAKE: usize = 64 << 10;

/// The limits and what is in use of them; shared by the accept loop and the handshakes.
#[derive(Debug)]
pub struct Admission {
    max_pending: usize,
    max_bytes: usize,
    pending: AtomicUsize,
    bytes: AtomicUsize,
}

impl Admission {
    /// At most `max_pending` handshakes at once, whose frames hold at most `max_bytes` beyond
    /// their free allowance.
    pub fn new(max_pending: usize, max_bytes: usize) -> Arc<Self> {
        Arc::new(Admission {
            max_pending,
            max_bytes,
            pending: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
        })
    }

    /// A place for one more pending handshake, held until the [`Ticket`] is dropped; `None`
    /// when `max_pending` are already pending.
    pub fn admit(self: &Arc<Self>) -> Option<Ticket> {
        self.pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_pending).then_some(n + 1)
            })
            .ok()?;
        Some(Ticket {
            admission: self.clone(),
            held: 0,
            charged: 0,
        })
    }

    /// Handshakes pending now.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::Acquire)
    }

    /// The most handshakes pending at once.
    pub fn max_pending(&self) -> usize {
        self.max_pending
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
    /// Frame memory this handshake took, allowance included.
    held: usize,
    /// The part of `held` charged against the shared limit.
    charged: usize,
}

impl Ticket {
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
        self.admission.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_places() {
        let admission = Admission::new(2, 0);
        let a = admission.admit().unwrap();
        let _b = admission.admit().unwrap();
        assert!(admission.admit().is_none());
        assert_eq!(admission.pending(), 2);
        drop(a);
        assert!(admission.admit().is_some());
    }

    #[test]
    fn charges_bytes_beyond_the_allowance() {
        let admission = Admission::new(4, 100);
        let mut a = admission.admit().unwrap();
        a.charge(FREE_BYTES_PER_HANDSHAKE).unwrap();
        assert_eq!(admission.bytes(), 0);
        a.charge(60).unwrap();
        assert_eq!(admission.bytes(), 60);
        let mut b = admission.admit().unwrap();
        b.charge(FREE_BYTES_PER_HANDSHAKE + 40).unwrap();
        let err = b.charge(1).unwrap_err();
        assert!(err.to_string().contains("limit of 100 bytes"), "{err}");
        // A handshake within its allowance is never refused.
        admission.admit().unwrap().charge(1000).unwrap();
        drop(a);
        assert_eq!(admission.bytes(), 40);
        b.charge(1).unwrap();
        drop(b);
        assert_eq!((admission.bytes(), admission.pending()), (0, 0));
    }
}

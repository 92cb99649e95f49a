//! Counts of what an agent's completion driver did, for a service to export.

use std::sync::atomic::{AtomicU64, Ordering};

/// What an agent's completion driver has done so far; see [`crate::Agent::driver_stats`].
///
/// A request that NIXL finished by the time its future was first polled never reaches the
/// driver, so `awaited` counts only the requests the driver actually polled for a task.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Requests that an awaiting future handed to the driver (still in flight at its first
    /// poll); the driver woke the task once each was done or failed.
    pub awaited: u64,
    /// Requests dropped while in flight, which the driver releases once NIXL reports them done.
    pub dropped_in_flight: u64,
    /// Times a future found the driver at its capacity (4096 requests) and waited for room.
    pub waited_for_room: u64,
    /// Requests the driver holds now, still in flight or not yet seen done (a request
    /// leaves this count just before its outcome is handed back).
    pub held: u64,
}

/// The live counters behind [`DriverStats`] (`held` is the driver's own count).
#[derive(Debug, Default)]
pub(crate) struct DriverCounters {
    awaited: AtomicU64,
    dropped_in_flight: AtomicU64,
    waited_for_room: AtomicU64,
}

impl DriverCounters {
    /// Counts a request handed over by an awaiting future.
    pub(crate) fn awaited(&self) {
        self.awaited.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request handed over by its drop.
    pub(crate) fn dropped_in_flight(&self) {
        self.dropped_in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a future turned away for want of room.
    pub(crate) fn waited_for_room(&self) {
        self.waited_for_room.fetch_add(1, Ordering::Relaxed);
    }

    /// A snapshot of the counters, with `held` requests held now.
    pub(crate) fn snapshot(&self, held: usize) -> DriverStats {
        DriverStats {
            awaited: self.awaited.load(Ordering::Relaxed),
            dropped_in_flight: self.dropped_in_flight.load(Ordering::Relaxed),
            waited_for_room: self.waited_for_room.load(Ordering::Relaxed),
            held: held as u64,
        }
    }
}

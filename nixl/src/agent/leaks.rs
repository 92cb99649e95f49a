//! Counts of what an agent leaked rather than free memory NIXL might still use.

use std::sync::atomic::{AtomicU64, Ordering};

/// What an agent leaked on purpose so far, for a service to export and alert on.
///
/// Each leak keeps memory allocated (and registered) for the rest of the process, because
/// NIXL might still write into it; none of them is undefined behaviour. See
/// [`crate::Agent::leak_stats`].
#[non_exhaustive]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeakStats {
    /// Transfer requests given up while they may still have been in flight (abandoned,
    /// failed at post or status, or still running when dropped after the drop timeout),
    /// each with the registrations it held.
    pub requests: u64,
    /// Registrations whose deregistration failed, kept with their memory.
    pub registrations: u64,
    /// NIXL objects (requests, prepared lists, memory views) whose release NIXL refused.
    pub failed_releases: u64,
}

/// The live counters behind [`LeakStats`].
#[derive(Debug, Default)]
pub(crate) struct LeakCounters {
    requests: AtomicU64,
    registrations: AtomicU64,
    failed_releases: AtomicU64,
}

impl LeakCounters {
    /// Counts a leaked request.
    pub(crate) fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a registration kept after a failed deregistration.
    pub(crate) fn registration(&self) {
        self.registrations.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a release NIXL refused.
    pub(crate) fn failed_release(&self) {
        self.failed_releases.fetch_add(1, Ordering::Relaxed);
    }

    /// A snapshot of the counters.
    pub(crate) fn snapshot(&self) -> LeakStats {
        LeakStats {
            requests: self.requests.load(Ordering::Relaxed),
            registrations: self.registrations.load(Ordering::Relaxed),
            failed_releases: self.failed_releases.load(Ordering::Relaxed),
        }
    }
}

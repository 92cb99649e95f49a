//! What a side channel refused, counted by kind, and logged so that no peer can flood the
//! log: each kind's 1st, 2nd, 4th, 8th... refusal is logged (with the count so far), the
//! rest only counted.

use std::sync::atomic::{AtomicU64, Ordering};

/// Why a side channel turned a connection away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// From outside the allowed peer networks (closed at accept).
    Network,
    /// No handshake place came free, or the oldest handshake under way was closed for a
    /// newer one.
    Busy,
    /// The peer did not prove the shared secret (or asked to prove one this side has none
    /// of), or sealed its handshake under other keys.
    Unauthenticated,
    /// The peer speaks another version of the authenticated exchange.
    Version,
    /// The peer's handshake was proven but its KV cache cannot be read with ours.
    Incompatible,
    /// The peer sent what is not the exchange (undecodable, out of order, too large) or
    /// closed the connection mid-way.
    Malformed,
    /// The exchange passed its deadline.
    Deadline,
}

impl Refusal {
    /// Every kind, in the order of [`RefusalCounts`]' fields.
    pub const ALL: [Refusal; 7] = [
        Refusal::Network,
        Refusal::Busy,
        Refusal::Unauthenticated,
        Refusal::Version,
        Refusal::Incompatible,
        Refusal::Malformed,
        Refusal::Deadline,
    ];

    /// The kind's name, as in logs and the `kind` label of
    /// [`NUM_SIDE_CHANNEL_REFUSALS`](crate::series::NUM_SIDE_CHANNEL_REFUSALS).
    pub fn name(self) -> &'static str {
        match self {
            Refusal::Network => "network",
            Refusal::Busy => "busy",
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::Version => "version",
            Refusal::Incompatible => "incompatible",
            Refusal::Malformed => "malformed",
            Refusal::Deadline => "deadline",
        }
    }

    fn index(self) -> usize {
        Refusal::ALL
            .iter()
            .position(|&kind| kind == self)
            .expect("ALL names every kind")
    }
}

/// How many connections a side channel refused, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RefusalCounts {
    /// [`Refusal::Network`].
    pub network: u64,
    /// [`Refusal::Busy`].
    pub busy: u64,
    /// [`Refusal::Unauthenticated`].
    pub unauthenticated: u64,
    /// [`Refusal::Version`].
    pub version: u64,
    /// [`Refusal::Incompatible`].
    pub incompatible: u64,
    /// [`Refusal::Malformed`].
    pub malformed: u64,
    /// [`Refusal::Deadline`].
    pub deadline: u64,
}

impl RefusalCounts {
    /// All refusals, of every kind.
    pub fn total(&self) -> u64 {
        self.network
            + self.busy
            + self.unauthenticated
            + self.version
            + self.incompatible
            + self.malformed
            + self.deadline
    }
}

/// The refusals of one side channel: counters, and whether each one is to be logged.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    counts: [AtomicU64; Refusal::ALL.len()],
    /// The labels of its metric series (e.g. its engine and rank).
    labels: Vec<metrics::Label>,
}

impl Refusals {
    /// Counters whose metric series carry `labels`.
    pub(crate) fn labelled(labels: Vec<metrics::Label>) -> Self {
        Refusals {
            counts: Default::default(),
            labels,
        }
    }

    /// Counts one refusal of `kind`, and says whether to log it: `Some(count so far)` for
    /// the 1st, 2nd, 4th, 8th... of its kind, `None` for the others.
    pub(crate) fn count(&self, kind: Refusal) -> Option<u64> {
        let count = self.counts[kind.index()].fetch_add(1, Ordering::Relaxed) + 1;
        crate::metrics::series::side_channel_refusal(&self.labels, kind.name());
        count.is_power_of_two().then_some(count)
    }

    /// The counts so far.
    pub(crate) fn counts(&self) -> RefusalCounts {
        let get = |kind: Refusal| self.counts[kind.index()].load(Ordering::Relaxed);
        RefusalCounts {
            network: get(Refusal::Network),
            busy: get(Refusal::Busy),
            unauthenticated: get(Refusal::Unauthenticated),
            version: get(Refusal::Version),
            incompatible: get(Refusal::Incompatible),
            malformed: get(Refusal::Malformed),
            deadline: get(Refusal::Deadline),
        }
    }
}

/// Counts one refusal of `kind` in `refusals` and, for the 1st, 2nd, 4th, 8th... of its kind,
/// logs a warning with the given fields, the count so far and the kind.
macro_rules! refused {
    ($refusals:expr, $kind:expr, $($field:tt)+) => {
        if let Some(refused) = $refusals.count($kind) {
            tracing::warn!(kind = $kind.name(), refused, $($field)+);
        }
    };
}
pub(crate) use refused;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_counted_and_logged_at_powers_of_two() {
        let refusals = Refusals::default();
        let logged: Vec<u64> = (0..100)
            .filter_map(|_| refusals.count(Refusal::Malformed))
            .collect();
        assert_eq!(logged, [1, 2, 4, 8, 16, 32, 64]);
        assert_eq!(refusals.count(Refusal::Busy), Some(1));
        let counts = refusals.counts();
        assert_eq!(
            (counts.malformed, counts.busy, counts.total()),
            (100, 1, 101)
        );
    }
}

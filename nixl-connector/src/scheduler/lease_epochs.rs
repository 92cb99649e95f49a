//! The lease epochs a scheduler numbers its holds for readers with (native protocol; see
//! [`ReleaseMarks`](crate::ReleaseMarks)).

use std::time::{SystemTime, UNIX_EPOCH};

/// Hands out lease epochs: each larger than any before it, from the wall clock's
/// nanoseconds when that is larger, so that a scheduler started again beside ranks that
/// kept their marks still numbers past every mark they hold.
#[derive(Debug, Default)]
pub(crate) struct LeaseEpochs {
    last: u64,
}

impl LeaseEpochs {
    /// The next epoch.
    pub(crate) fn next(&mut self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| {
                u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
            });
        self.last = now.max(self.last.saturating_add(1));
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_epoch_is_larger_than_the_last() {
        let mut epochs = LeaseEpochs::default();
        let mut last = 0;
        for _ in 0..1000 {
            let epoch = epochs.next();
            assert!(epoch > last, "{epoch} after {last}");
            last = epoch;
        }
    }
}

//! A rank's own release marks (native protocol; see
//! [`ReleaseMarks`](crate::ReleaseMarks)): one word per block id in DRAM
//! registered with its agent, raised as its held requests are released.

use std::sync::atomic::{fence, Ordering};
use std::sync::Mutex;

use nixl::{Agent, Backend, HostBuffer, Registration};

use crate::error::{Error, Result};
use crate::transport::release_marks::{ReleaseMarks, MARK_LEN};
use crate::worker::sending::Marks;

/// A rank's release marks: one word per block id in DRAM registered with its agent, which
/// owns it as long as the registration lives (readers may READ it at any time).
pub(crate) struct MarkWords {
    registration: Registration,
    count: usize,
    /// Held while a raise reads and writes words, so that two raises never lose one.
    raising: Mutex<()>,
}

impl MarkWords {
    /// `count` marks, one per block id, each at `floor` (the largest epoch the rank marked
    /// under an earlier registration), registered with `backends` of `agent`.
    ///
    /// # Errors
    /// Allocation or registration errors.
    pub(crate) fn register(
        agent: &Agent,
        backends: &[&Backend],
        count: usize,
        floor: u64,
    ) -> Result<Self> {
        let count = count.max(1);
        let len = count
            .checked_mul(MARK_LEN)
            .ok_or_else(|| Error::invalid("register the release marks", "too many block ids"))?;
        let registration = agent.register_memory(HostBuffer::zeroed(len)?, backends)?;
        if floor > 0 {
            let words: Vec<u8> = std::iter::repeat(floor.to_le_bytes())
                .take(count)
                .flatten()
                .collect();
            registration.write(0, 0, &words)?;
        }
        Ok(MarkWords {
            registration,
            count,
            raising: Mutex::new(()),
        })
    }

    /// Where the marks are, for the handshake.
    pub(crate) fn describe(&self) -> Option<ReleaseMarks> {
        let region = self.registration.regions().first()?;
        Some(ReleaseMarks {
            addr: region.addr as u64,
            count: self.count as u64,
        })
    }

    /// Raises the marks of each released request's blocks to its epoch (never lowering
    /// one), visible to readers before this returns. A block id without a mark (past the
    /// registered blocks) is skipped: no reader can read it either.
    pub(crate) fn raise(&self, released: &[Marks]) {
        let _raising = self.raising.lock().unwrap_or_else(|p| p.into_inner());
        for marks in released {
            for &block_id in &marks.block_ids {
                if let Err(err) = self.raise_one(block_id, marks.epoch) {
                    tracing::warn!(block_id, %err, "a released block's release mark was not raised");
                }
            }
        }
        // The engine hears of the release only after every mark is out.
        fence(Ordering::SeqCst);
    }

    fn raise_one(&self, block_id: usize, epoch: u64) -> Result<()> {
        let offset = block_id.saturating_mul(MARK_LEN);
        let mut word = [0u8; MARK_LEN];
        self.registration.read(0, offset, &mut word)?;
        if u64::from_le_bytes(word) < epoch {
            self.registration.write(0, offset, &epoch.to_le_bytes())?;
        }
        Ok(())
    }
}

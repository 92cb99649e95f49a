//! The registered words a load READs release marks into, kept for later loads: registering
//! a buffer for every load cost more than the READ itself.

use std::sync::Mutex;

use nixl::{Agent, Backend, Registration};

use crate::error::Result;
use crate::transport::release_marks::MARK_LEN;

/// Marks a kept buffer holds: a load reading more registers a buffer of its own.
const SLOT_WORDS: usize = 1024;

/// Most buffers kept (as many loads check their marks at once without registering).
const KEPT: usize = 64;

/// Registered buffers of [`SLOT_WORDS`] marks, free for the next load. Its lock is held for
/// one take or one give, never across another lock or an await.
#[derive(Default)]
pub(crate) struct ScratchWords {
    free: Mutex<Vec<Registration>>,
}

impl ScratchWords {
    /// A buffer of at least `words` marks, registered with `backends` of `agent`: a kept
    /// one when `words` fits one, else a new one.
    ///
    /// # Errors
    /// Registration errors.
    pub(crate) fn take(
        &self,
        agent: &Agent,
        backends: &[&Backend],
        words: usize,
    ) -> Result<Registration> {
        if words <= SLOT_WORDS {
            if let Some(kept) = self.lock().pop() {
                return Ok(kept);
            }
        }
        let len = words.max(SLOT_WORDS).saturating_mul(MARK_LEN);
        Ok(agent.register_memory(vec![0u8; len], backends)?)
    }

    /// Keeps `buffer` for a later load; only once no READ can write it any more. A buffer
    /// of another size, or past [`KEPT`], is dropped (deregistered).
    pub(crate) fn give(&self, buffer: Registration) {
        let slot = buffer.regions().first().map(|r| r.len) == Some(SLOT_WORDS * MARK_LEN);
        let mut free = self.lock();
        if slot && free.len() < KEPT {
            free.push(buffer);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Registration>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }
}

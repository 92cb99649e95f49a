//! The metadata each remote agent was last loaded from, on one agent, so that loading the
//! very same bytes again (NIXL's no-op reload, far cheaper than a first load) is not
//! validated a second time: identical bytes get the identical verdict. One copy per remote
//! agent, dropped when its metadata is invalidated.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use super::serdes::Fields;

/// Per remote agent name, the bytes it was last loaded from.
#[derive(Default)]
pub(crate) struct LoadedMetadata {
    by_agent: Mutex<HashMap<Vec<u8>, Box<[u8]>>>,
}

impl LoadedMetadata {
    /// Whether `metadata` is, byte for byte, what its agent was last loaded from here.
    pub(crate) fn is_loaded(&self, metadata: &[u8]) -> bool {
        let Some(name) = declared_name(metadata) else {
            return false;
        };
        let by_agent = self.by_agent.lock().unwrap_or_else(PoisonError::into_inner);
        by_agent.get(name).is_some_and(|last| **last == *metadata)
    }

    /// Records that `agent` was loaded from `metadata` (which passed validation).
    pub(crate) fn remember(&self, agent: &str, metadata: &[u8]) {
        let mut by_agent = self.by_agent.lock().unwrap_or_else(PoisonError::into_inner);
        by_agent.insert(agent.as_bytes().to_vec(), metadata.into());
    }

    /// Forgets `agent`'s metadata (it was invalidated).
    pub(crate) fn forget(&self, agent: &str) {
        let mut by_agent = self.by_agent.lock().unwrap_or_else(PoisonError::into_inner);
        by_agent.remove(agent.as_bytes());
    }
}

/// The agent name the metadata's first field declares, if it has that much structure.
fn declared_name(metadata: &[u8]) -> Option<&[u8]> {
    Fields::open(metadata)
        .ok()?
        .field("Agent")
        .ok()
        .map(|f| f.bytes)
}

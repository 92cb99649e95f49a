//! The readers a prefill rank's side channel accepted: the agents a handshake named, with
//! their engine, TP size, pipeline stages and DCP size, so that a finish notification counts only
//! from an agent that reads this engine, and only within that reader's TP (native protocol).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Most readers remembered; past it the one accepted longest ago is forgotten (its
/// notifications are then refused, and its requests end with their lease).
pub const MAX_READERS: usize = 1 << 12;

/// A reader as its accepted handshake named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reader {
    /// Its engine.
    pub(crate) engine_id: String,
    /// Its engine's TP size.
    pub(crate) tp_size: usize,
    /// Its engine's pipeline stages: each stage's ranks read (or notify) this rank.
    pub(crate) pp_size: usize,
    /// Its engine's DCP size (1: none).
    pub(crate) dcp_size: usize,
}

/// The readers accepted by one rank's side channel, by agent name.
#[derive(Debug, Default)]
pub(crate) struct Readers {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    by_agent: HashMap<Vec<u8>, Reader>,
    order: VecDeque<Vec<u8>>,
}

impl Readers {
    /// Remembers that agent `agent` of `reader` passed a handshake.
    pub(crate) fn accept(&self, agent: &str, reader: Reader) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let agent = agent.as_bytes().to_vec();
        if state.by_agent.insert(agent.clone(), reader).is_some() {
            state.order.retain(|a| *a != agent);
        } else if state.order.len() >= MAX_READERS {
            if let Some(oldest) = state.order.pop_front() {
                state.by_agent.remove(&oldest);
            }
        }
        state.order.push_back(agent);
    }

    /// The reader agent `agent` is, if a handshake named it.
    pub(crate) fn get(&self, agent: &[u8]) -> Option<Reader> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.by_agent.get(agent).cloned()
    }
}

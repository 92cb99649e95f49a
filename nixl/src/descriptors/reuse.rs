//! The state a descriptor list keeps to be prepared once when it serves more than one
//! request (the requests themselves are made in `transfer/requests.rs`).
//!
//! The second request made from a list with the same agent, peer and backends prepares the
//! list with NIXL (as [`crate::Agent::prepare_local`] / [`crate::Agent::prepare_remote`] do),
//! and that request and later ones are made from the prepared handle. NIXL then skips looking
//! up every descriptor in the registrations and building a log record per request (what that
//! saves is in the README's Benchmarks section). A list used once costs nothing extra.

use std::ffi::c_int;
use std::sync::{Arc, Mutex, PoisonError};

use crate::agent::AgentInner;
use crate::descriptors::prepared_handle::PreparedShared;
use crate::error::Result;

/// What a prepared handle is made for: the agent, the peer (empty for the local side), the
/// backends asked for, and how many backends the agent had (a new one may serve the list).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReuseKey<'a> {
    agent: usize,
    peer: &'a str,
    backends: &'a [usize],
    backend_count: usize,
}

impl<'a> ReuseKey<'a> {
    /// The key of a request on `agent` with `peer` over `backends` (raw backend handles).
    pub(crate) fn new(agent: &Arc<AgentInner>, peer: &'a str, backends: &'a [usize]) -> Self {
        let backend_count = agent
            .backends
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        ReuseKey {
            agent: Arc::as_ptr(agent) as usize,
            peer,
            backends,
            backend_count,
        }
    }

    /// The same key for the peer `peer` (the remote side of the same request).
    pub(crate) fn for_peer(self, peer: &'a str) -> Self {
        ReuseKey { peer, ..self }
    }

    fn to_owned(self) -> OwnedKey {
        OwnedKey {
            agent: self.agent,
            peer: self.peer.into(),
            backends: self.backends.into(),
            backend_count: self.backend_count,
        }
    }

    fn is(&self, owned: &OwnedKey) -> bool {
        self.agent == owned.agent
            && self.backend_count == owned.backend_count
            && *self.peer == *owned.peer
            && *self.backends == *owned.backends
    }
}

/// A [`ReuseKey`] kept by a list.
#[derive(Debug, Clone)]
struct OwnedKey {
    agent: usize,
    peer: Box<str>,
    backends: Box<[usize]>,
    backend_count: usize,
}

/// A prepared handle and the indices `0..n` of all its descriptors.
pub(crate) type Prepared = (Arc<PreparedShared>, Arc<[c_int]>);

enum State {
    Fresh,
    UsedOnce(OwnedKey),
    Prepared(OwnedKey, Prepared),
}

/// A list's memory of the requests made from it.
pub(crate) struct Reuse {
    state: Mutex<State>,
}

impl Default for Reuse {
    fn default() -> Self {
        Reuse {
            state: Mutex::new(State::Fresh),
        }
    }
}

impl Reuse {
    /// Forgets everything; called when the list changes.
    pub(crate) fn reset(&mut self) {
        *self.state.get_mut().unwrap_or_else(PoisonError::into_inner) = State::Fresh;
    }

    /// Drops a prepared handle NIXL no longer accepts (the peer's metadata changed); the
    /// next use with the same key prepares the list again.
    pub(crate) fn forget(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let State::Prepared(key, _) = &*state {
            *state = State::UsedOnce(key.clone());
        }
    }

    /// The prepared handle for `key`: `None` on the list's first use with `key`, prepared
    /// with `prepare` on the second, the same handle afterwards. A failed preparation is
    /// logged and gives `None` (the caller's plain request reports the error).
    pub(crate) fn handle(
        &self,
        key: ReuseKey<'_>,
        prepare: impl FnOnce() -> Result<Arc<PreparedShared>>,
    ) -> Option<Prepared> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match &*state {
            State::Prepared(held, prepared) if key.is(held) => Some(prepared.clone()),
            State::UsedOnce(held) if key.is(held) => match prepare() {
                Ok(handle) => {
                    let count = c_int::try_from(handle.len()).ok()?;
                    let prepared: Prepared = (handle, (0..count).collect());
                    *state = State::Prepared(key.to_owned(), prepared.clone());
                    Some(prepared)
                }
                Err(err) => {
                    tracing::debug!(%err, "could not prepare a reused descriptor list");
                    *state = State::Fresh;
                    None
                }
            },
            _ => {
                *state = State::UsedOnce(key.to_owned());
                None
            }
        }
    }
}

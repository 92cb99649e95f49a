//! The remote ranks this worker reads from (or only notifies): one handshake each, run by
//! the first load that needs it (in the background, see [`connect`](crate::connect)), then
//! their prepared descriptor lists are reused.
//!
//! A remote rank is handshaken with again after a transfer with it failed. Its agent's
//! metadata is loaded into NIXL only when it differs, byte for byte, from what that agent
//! was loaded from (then the old one is invalidated first): NIXL 1.5.1 keeps two file
//! descriptors for every load and invalidation of a live peer, so reloading a flapping peer
//! would grow the process's descriptors without bound.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::future::{BoxFuture, FutureExt, Shared};
use nixl::{Agent, PreparedLocal, PreparedRemote};

use crate::error::{Error, Result};
use crate::metrics::RemoteStats;
use crate::read_plan::ReadPlan;

/// A remote rank after a successful handshake.
#[derive(Debug)]
pub(crate) struct Remote {
    /// Its agent's name (notifications go to it).
    pub(crate) agent: String,
    /// How its blocks are read.
    pub(crate) plan: ReadPlan,
    /// The lists its READs use; `None` when it is only notified.
    pub(crate) lists: Option<ReadLists>,
    /// Its blocks per block id of the transfer params (vLLM's
    /// `physical_blocks_per_logical_kv_block`; 1 in the native protocol).
    pub(crate) blocks_per_id: usize,
}

/// The prepared lists of the READs from one remote rank (see
/// [`ReadPlan`](crate::ReadPlan) for their order).
#[derive(Debug)]
pub(crate) struct ReadLists {
    /// Its blocks' pieces.
    pub(crate) remote: PreparedRemote,
    /// The local blocks' pieces; `None` when they are whole blocks, as the registration's
    /// own list describes them.
    pub(crate) local: Option<PreparedLocal>,
}

/// A handshake under way or done, shared by every load that needs it; the error is the
/// failure's message.
type Handshake = Shared<BoxFuture<'static, std::result::Result<Arc<Remote>, String>>>;

/// Remote ranks by engine id and rank, and the metadata their agents were loaded from.
#[derive(Default)]
pub(crate) struct Remotes {
    map: Mutex<HashMap<(String, usize), Handshake>>,
    loaded: Mutex<LoadedAgents>,
}

/// The metadata each remote agent was loaded from, by agent name, and the counts.
#[derive(Default)]
struct LoadedAgents {
    by_name: HashMap<String, LoadedAgent>,
    stats: RemoteStats,
}

/// A remote agent this worker loaded.
struct LoadedAgent {
    /// The bytes it was loaded from.
    metadata: Vec<u8>,
    /// The engine id and rank whose handshake loaded it: only theirs may replace it.
    source: (String, usize),
}

impl Remotes {
    /// The remote rank `rank` of `engine`, handshaking first (the future `start` makes) if
    /// no load has yet. Loads that wait for the same handshake share its outcome; a failed
    /// one is forgotten, so a later load tries again.
    ///
    /// # Errors
    /// [`Error::Handshake`] with the reason.
    pub(crate) async fn get(
        &self,
        engine: &str,
        rank: usize,
        start: impl FnOnce() -> BoxFuture<'static, Result<Arc<Remote>>>,
    ) -> Result<Arc<Remote>> {
        let key = (engine.to_string(), rank);
        let handshake = self
            .lock()
            .entry(key.clone())
            .or_insert_with(|| {
                start()
                    .map(|remote| remote.map_err(|err| err.to_string()))
                    .boxed()
                    .shared()
            })
            .clone();
        match handshake.clone().await {
            Ok(remote) => Ok(remote),
            Err(reason) => {
                let mut map = self.lock();
                if map.get(&key).is_some_and(|h| h.ptr_eq(&handshake)) {
                    map.remove(&key);
                }
                Err(Error::Handshake {
                    engine: engine.to_string(),
                    rank,
                    reason,
                })
            }
        }
    }

    /// The remote rank `rank` of `engine` if its handshake is done, without waiting.
    pub(crate) fn ready(&self, engine: &str, rank: usize) -> Option<Arc<Remote>> {
        let key = (engine.to_string(), rank);
        self.lock()
            .get(&key)
            .and_then(|h| h.peek())
            .and_then(|done| done.as_ref().ok().cloned())
    }

    /// Forgets `remote` (after a transfer with it failed), so the next load handshakes
    /// again; a newer handshake under the same key is kept.
    pub(crate) fn forget(&self, engine: &str, rank: usize, remote: &Arc<Remote>) {
        let key = (engine.to_string(), rank);
        let mut map = self.lock();
        let same = map
            .get(&key)
            .and_then(|h| h.peek())
            .is_some_and(|done| done.as_ref().is_ok_and(|r| Arc::ptr_eq(r, remote)));
        if same {
            map.remove(&key);
        }
    }

    /// Forgets every rank of `engine` (it registered its KV cache again), so the next loads
    /// handshake again; loads holding one keep it until they end.
    pub(crate) fn forget_engine(&self, engine: &str) {
        self.lock().retain(|(name, _), _| name != engine);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, usize), Handshake>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `agent` know the remote agent `name`, named in the handshake of `source`
    /// (engine id and rank), from `metadata` (validated by [`Agent::load_remote_metadata`])
    /// and returns the name the metadata declares. Metadata identical to what `name` was
    /// loaded from reuses the loaded agent. Different metadata replaces it (invalidating the
    /// old) only when `source` loaded it: a peer cannot take over another's agent by naming it.
    pub(crate) fn load_metadata(
        &self,
        agent: &Agent,
        source: &(String, usize),
        name: &str,
        metadata: &[u8],
    ) -> Result<String> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        loaded.stats.handshakes += 1;
        let known = agent.has_remote_metadata(name)?;
        match loaded.by_name.get(name).filter(|_| known) {
            Some(last) if last.metadata == metadata => {
                loaded.stats.reused += 1;
                return Ok(name.to_string());
            }
            Some(last) if last.source != *source => {
                return Err(Error::Incompatible {
                    reader: format!("agent {:?}", agent.name()),
                    source_rank: format!("engine {:?} rank {}", source.0, source.1),
                    reason: format!(
                        "its handshake names agent {name:?}, loaded from other metadata for \
                         engine {:?} rank {}",
                        last.source.0, last.source.1
                    ),
                })
            }
            Some(_) => {
                tracing::info!(remote = %name, "the remote agent's metadata changed; invalidating the old one");
                agent.invalidate_remote_metadata(name)?;
                loaded.by_name.remove(name);
                loaded.stats.replaced += 1;
            }
            None => {}
        }
        let declared = agent.load_remote_metadata(metadata)?;
        loaded.stats.loaded += 1;
        let entry = LoadedAgent {
            metadata: metadata.to_vec(),
            source: source.clone(),
        };
        loaded.by_name.insert(declared.clone(), entry);
        Ok(declared)
    }

    /// The counts so far, with the process's open file descriptors now.
    pub(crate) fn stats(&self) -> RemoteStats {
        let loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        RemoteStats {
            open_fds: crate::metrics::open_fds(),
            ..loaded.stats
        }
    }
}

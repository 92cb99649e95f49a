//! The remote ranks this worker reads from (or only notifies): one handshake each, run by
//! the first load that needs it (in the background, see [`connect`](crate::worker::connect)), then
//! their prepared descriptor lists are reused.
//!
//! A remote rank is handshaken with again after a transfer with it failed. Its agent's
//! metadata is loaded into NIXL only when it differs, byte for byte, from what that agent
//! was loaded from, or when a transfer from that agent failed in NIXL (then the old one is
//! invalidated first): NIXL 1.5.1 keeps two file descriptors for every load and
//! invalidation of a live peer, so reloading a peer at every handshake would grow the
//! process's descriptors without bound, but UCX never reconnects an endpoint that failed
//! (a network partition, a reset): NIXL then fails every later post to that agent, and only
//! a new load of its metadata connects again.
//!
//! Engines churn: a prefill that restarts is a new engine. An engine whose handshakes or
//! transfers keep failing is backed off from, and engines idle past the TTL or replaced at
//! their address are evicted once no load holds them, their agents' metadata invalidated
//! (see [`Engines`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt, Shared};
use nixl::{Agent, PreparedLocal, PreparedRemote};

use crate::error::{Error, Result};
use crate::geometry::read_plan::ReadPlan;
use crate::geometry::ssm::SsmReads;
use crate::metrics::RemoteStats;
use crate::transport::release_marks::ReleaseMarks;
use crate::worker::engines::Engines;

/// The least time between two sweeps for engines to evict.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A remote rank after a successful handshake.
#[derive(Debug)]
pub(crate) struct Remote {
    /// Its agent's name (notifications go to it).
    pub(crate) agent: String,
    /// How its blocks are read.
    pub(crate) plan: ReadPlan,
    /// How its SSM state is read, after the attention descriptors (alone when its
    /// attention is read from another rank of its TP group); `None` without SSM groups.
    pub(crate) ssm: Option<SsmReads>,
    /// The lists its READs use; `None` when it is only notified (see
    /// [`is_read`](Self::is_read)).
    pub(crate) lists: Option<ReadLists>,
    /// Its blocks per block id of the transfer params (vLLM's
    /// `physical_blocks_per_logical_kv_block`, which its handshake says).
    pub(crate) blocks_per_id: usize,
    /// Its engine's decode context parallel size, as its handshake says (1: none).
    pub(crate) dcp_size: usize,
    /// The generation of the local registration its lists were prepared over (see
    /// [`Caches::generation`](crate::worker::current_caches::Caches)): a remote of an older one is handshaken
    /// with again.
    pub(crate) local_generation: u64,
    /// Where it keeps its release marks (native protocol), checked after a READ from it.
    pub(crate) release_marks: Option<ReleaseMarks>,
}

impl Remote {
    /// Whether a load reads from it: its attention blocks ([`ReadPlan::share`]), its SSM
    /// state, or both (vLLM's `all_source_ranks`); a rank that is not read is only
    /// notified.
    pub(crate) fn is_read(&self) -> bool {
        self.lists.is_some()
    }

    /// Whether its attention blocks are read (its SSM state, if any, is read whenever it
    /// [`is_read`](Self::is_read)).
    pub(crate) fn reads_attention(&self) -> bool {
        self.plan.share.reads()
    }
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
    book: Mutex<EngineBook>,
    /// Native protocol: the registration generation each remote engine's ranks were
    /// handshaken with at (vLLM mode keeps it with the engine's clock).
    generations: Mutex<HashMap<String, u64>>,
    /// How long an engine may stay unused before it is evicted (`None`: never).
    ttl: Option<Duration>,
}

/// The engines over time, and the ranks made for each (to tell whether a load holds one).
#[derive(Default)]
struct EngineBook {
    engines: Engines,
    made: HashMap<String, Vec<Weak<Remote>>>,
    /// Engines a failed transfer marked since their last new handshake (marked once).
    marked: HashSet<String>,
    last_sweep: Option<Instant>,
    evicted: u64,
}

/// The metadata each remote agent was loaded from, by agent name, the agents of the remote
/// ranks handshaken again after a failed or overdue READ, and the counts.
#[derive(Default)]
struct LoadedAgents {
    by_name: HashMap<String, LoadedAgent>,
    /// By engine id and rank: the agent of a rank forgotten after a failed or overdue READ,
    /// until its next handshake ends (a key of `by_name` while its metadata stays loaded).
    after_failure: HashMap<(String, usize), String>,
    /// Agents a transfer failed with in NIXL since they were loaded: their connection may be
    /// dead, so the next handshake loads their metadata again, even the same bytes.
    failed_in_nixl: HashSet<String>,
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
    /// No remote rank yet; engines unused for `ttl` are evicted (`None`: never), and those
    /// whose handshakes or transfers keep failing backed off for at most `max_backoff`.
    pub(crate) fn new(ttl: Option<Duration>, max_backoff: Duration) -> Self {
        let remotes = Remotes {
            ttl,
            ..Remotes::default()
        };
        remotes.book().engines = Engines::with_max_backoff(max_backoff);
        remotes
    }

    /// The remote rank `rank` of `engine`, handshaking first (the future `start` makes) if
    /// no load has yet. Loads that wait for the same handshake share its outcome; a failed
    /// one is forgotten, so a later load tries again, unless the engine's handshakes failed
    /// again and again: then it is backed off from, 1 s after the second failure in a row
    /// up to 60 s by default (vLLM's `_mark_remote_engine_invalid`; see
    /// [`ENGINE_BACKOFF_KEY`](crate::ENGINE_BACKOFF_KEY)).
    ///
    /// # Errors
    /// [`Error::Handshake`] with the reason.
    pub(crate) async fn get(
        &self,
        engine: &str,
        rank: usize,
        start: impl FnOnce() -> BoxFuture<'static, Result<Arc<Remote>>>,
    ) -> Result<Arc<Remote>> {
        {
            let now = Instant::now();
            let mut book = self.book();
            book.engines.touch(engine, now);
            if let Some((left, last)) = book.engines.backing_off(engine, now) {
                return Err(Error::Handshake {
                    engine: engine.to_string(),
                    rank,
                    reason: format!(
                        "not tried for another {left:.1?}: it failed again and again, the last time: {last}"
                    ),
                });
            }
        }
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
            Ok(remote) => {
                let mut book = self.book();
                let made = book.made.entry(engine.to_string()).or_default();
                let weak = Arc::downgrade(&remote);
                if !made.iter().any(|w| w.ptr_eq(&weak)) {
                    made.push(weak);
                    book.marked.remove(engine);
                }
                drop(book);
                self.loaded().after_failure.remove(&key);
                Ok(remote)
            }
            Err(reason) => {
                let mut map = self.lock();
                if map.get(&key).is_some_and(|h| h.ptr_eq(&handshake)) {
                    map.remove(&key);
                    drop(map);
                    let backoff = self.book().engines.failed(engine, Instant::now(), &reason);
                    if !backoff.is_zero() {
                        tracing::warn!(engine, rank, ?backoff, %reason, "the remote engine's handshakes keep failing; backing off");
                    }
                }
                Err(Error::Handshake {
                    engine: engine.to_string(),
                    rank,
                    reason,
                })
            }
        }
    }

    /// The remote rank `rank` of `engine` if its handshake is done, without waiting (a
    /// use of the engine, for its TTL).
    pub(crate) fn ready(&self, engine: &str, rank: usize) -> Option<Arc<Remote>> {
        let key = (engine.to_string(), rank);
        let remote = self
            .lock()
            .get(&key)
            .and_then(|h| h.peek())
            .and_then(|done| done.as_ref().ok().cloned());
        if remote.is_some() {
            self.book().engines.touch(engine, Instant::now());
        }
        remote
    }

    /// Records that the side channel at `host:port` serves `engine`; the engine it served
    /// before, if another, is evicted once no load holds it (vLLM's
    /// `_track_remote_engine_replacement`).
    pub(crate) fn serves(&self, host: &str, port: u16, engine: &str) {
        self.book().engines.serves(host, port, engine);
    }

    /// Evicts the engines that were replaced at their address or stayed unused for longer
    /// than the TTL, once no load holds any rank of theirs (vLLM's
    /// `_cleanup_remote_engines` and `_cleanup_remote_engine`): their ranks are forgotten
    /// and their agents' metadata invalidated in `agent`. Runs at most once a second; the
    /// engines evicted.
    pub(crate) fn sweep(&self, agent: &Agent, now: Instant) -> Vec<String> {
        let mut evicted = Vec::new();
        let due = {
            let mut book = self.book();
            if book
                .last_sweep
                .is_some_and(|at| now.saturating_duration_since(at) < SWEEP_EVERY)
            {
                return evicted;
            }
            book.last_sweep = Some(now);
            book.made.retain(|_, made| {
                made.retain(|w| w.strong_count() > 0);
                !made.is_empty()
            });
            book.engines.due(self.ttl, now)
        };
        for engine in due {
            {
                let mut map = self.lock();
                if map
                    .iter()
                    .any(|((e, _), h)| *e == engine && h.peek().is_none())
                {
                    continue;
                }
                map.retain(|(e, _), _| *e != engine);
            }
            let mut book = self.book();
            let held = book
                .made
                .get(&engine)
                .is_some_and(|made| made.iter().any(|w| w.strong_count() > 0));
            if held {
                continue;
            }
            book.engines.forget(&engine);
            book.made.remove(&engine);
            book.marked.remove(&engine);
            self.generations().remove(&engine);
            book.evicted += 1;
            drop(book);
            self.release_agents(agent, &engine);
            tracing::info!(%engine, "remote engine evicted (idle past its TTL, or replaced at its address)");
            evicted.push(engine);
        }
        evicted
    }

    /// Invalidates, in `agent`, the metadata of the agents `engine`'s handshakes loaded.
    fn release_agents(&self, agent: &Agent, engine: &str) {
        let mut loaded = self.loaded();
        let names: Vec<String> = loaded
            .by_name
            .iter()
            .filter(|(_, l)| l.source.0 == engine)
            .map(|(name, _)| name.clone())
            .collect();
        loaded.after_failure.retain(|(e, _), _| e != engine);
        for name in names {
            loaded.by_name.remove(&name);
            loaded.failed_in_nixl.remove(&name);
            if let Err(err) = agent.invalidate_remote_metadata(&name) {
                tracing::debug!(%engine, remote = %name, %err, "invalidating an evicted engine's agent failed");
            }
        }
    }

    fn loaded(&self) -> MutexGuard<'_, LoadedAgents> {
        self.loaded.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn book(&self) -> MutexGuard<'_, EngineBook> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets `remote` (after a transfer with it failed), so the next load handshakes
    /// again; a newer handshake under the same key is kept. Whether `remote` was the
    /// current handshake (and is now forgotten).
    pub(crate) fn forget(&self, engine: &str, rank: usize, remote: &Arc<Remote>) -> bool {
        let key = (engine.to_string(), rank);
        let mut map = self.lock();
        let same = map
            .get(&key)
            .and_then(|h| h.peek())
            .is_some_and(|done| done.as_ref().is_ok_and(|r| Arc::ptr_eq(r, remote)));
        if same {
            map.remove(&key);
        }
        same
    }

    /// Forgets `remote`, rank `rank` of `engine`, after a READ from it failed or passed the
    /// transfer timeout (as [`forget`](Self::forget)), keeping its agent for the heartbeats
    /// until the next handshake with the rank ends ([`known_agent`](Self::known_agent)).
    /// Whether `remote` was the current handshake (and is now forgotten).
    pub(crate) fn forget_after_failure(
        &self,
        engine: &str,
        rank: usize,
        remote: &Arc<Remote>,
    ) -> bool {
        if !self.forget(engine, rank, remote) {
            return false;
        }
        self.loaded()
            .after_failure
            .insert((engine.to_string(), rank), remote.agent.clone());
        true
    }

    /// Forgets `remote` after a load from it failed with `error` (as
    /// [`forget_after_failure`](Self::forget_after_failure)); a failure in NIXL itself (at
    /// the post or in the status poll) makes the next handshake load the agent's metadata
    /// again (see [`load_metadata`](Self::load_metadata)), and marks `engine` as a failed handshake does, so
    /// that an engine whose transfers keep failing is backed off from (vLLM's
    /// `_handle_failed_transfer` and `_mark_remote_engine_invalid`). vLLM marks an engine
    /// whose agent NIXL dropped on the failure; NIXL 1.5.1 keeps the agent's metadata after a peer's disconnection and its
    /// C API folds the disconnection into a backend error, so every NIXL failure counts.
    /// An engine is marked once until a new handshake with it: the other loads and ranks
    /// failing with it add nothing, as vLLM marks an engine once until it is handshaken
    /// again, and a load failing on a handshake already replaced counts for nothing.
    pub(crate) fn transfer_failed(
        &self,
        engine: &str,
        rank: usize,
        remote: &Arc<Remote>,
        error: &Error,
    ) {
        let current = self.forget_after_failure(engine, rank, remote);
        if !matches!(error, Error::Nixl(_)) {
            return;
        }
        // Also when the READ passed the transfer timeout first (which forgot the rank): its
        // agent's connection may be dead all the same.
        self.loaded().failed_in_nixl.insert(remote.agent.clone());
        if !current {
            return;
        }
        let mut book = self.book();
        if !book.marked.insert(engine.to_string()) {
            return;
        }
        let backoff = book
            .engines
            .failed(engine, Instant::now(), &error.to_string());
        drop(book);
        tracing::warn!(engine, rank, remote = %remote.agent, ?backoff, %error, "a transfer from the remote engine failed in NIXL; it is handshaken again after the backoff");
    }

    /// Forgets every rank of `engine` (it registered its KV cache again), so the next loads
    /// handshake again; loads holding one keep it until they end.
    pub(crate) fn forget_engine(&self, engine: &str) {
        self.lock().retain(|(name, _), _| name != engine);
    }

    /// Forgets every remote rank (the local KV caches were registered again, and their
    /// lists hold the old registration), so the next loads handshake again; loads holding
    /// one keep it until they end. The agents' metadata stays loaded: a handshake bringing
    /// the same metadata reuses it.
    pub(crate) fn forget_all(&self) {
        self.lock().clear();
    }

    /// Native protocol: whether `generation`, the registration generation of `engine`'s
    /// transfer params, is newer than the one its ranks were handshaken with (the first one
    /// seen counts, as in vLLM's `_read_blocks_for_req`); if so, it is recorded and every
    /// rank of `engine` forgotten, so that the next loads handshake again and never read the
    /// addresses of the registration it replaced.
    pub(crate) fn newer_generation(&self, engine: &str, generation: u64) -> bool {
        let newer = {
            let mut generations = self.generations();
            let seen = generations.entry(engine.to_string()).or_default();
            crate::transport::params::newer_generation(seen, generation)
        };
        if newer {
            self.forget_engine(engine);
        }
        newer
    }

    fn generations(&self) -> MutexGuard<'_, HashMap<String, u64>> {
        self.generations.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, usize), Handshake>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `agent` know the remote agent `name`, named in the handshake of `source`
    /// (engine id and rank), from `metadata` (validated by [`Agent::load_remote_metadata`])
    /// and returns the name the metadata declares. Metadata identical to what `name` was
    /// loaded from reuses the loaded agent, unless a transfer from it failed in NIXL since
    /// (its connection may be dead: it is loaded again, as different metadata is).
    /// Different metadata replaces it (invalidating the old) only when `source` loaded it: a
    /// peer cannot take over another's agent by naming it.
    pub(crate) fn load_metadata(
        &self,
        agent: &Agent,
        source: &(String, usize),
        name: &str,
        metadata: &[u8],
    ) -> Result<String> {
        let mut loaded = self.loaded();
        loaded.stats.handshakes += 1;
        let known = agent.has_remote_metadata(name)?;
        let failed = loaded.failed_in_nixl.contains(name);
        match loaded.by_name.get(name).filter(|_| known) {
            Some(last) if last.metadata == metadata && !failed => {
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
            Some(last) if last.metadata == metadata => {
                tracing::info!(remote = %name, "a transfer from the remote agent failed in NIXL; loading its metadata again to connect again");
                agent.invalidate_remote_metadata(name)?;
                loaded.by_name.remove(name);
                loaded.stats.reconnected += 1;
            }
            Some(_) => {
                tracing::info!(remote = %name, "the remote agent's metadata changed; invalidating the old one");
                agent.invalidate_remote_metadata(name)?;
                loaded.by_name.remove(name);
                loaded.stats.replaced += 1;
            }
            None => {}
        }
        loaded.failed_in_nixl.remove(name);
        let declared = agent.load_remote_metadata(metadata)?;
        loaded.stats.loaded += 1;
        let entry = LoadedAgent {
            metadata: metadata.to_vec(),
            source: source.clone(),
        };
        loaded.by_name.insert(declared.clone(), entry);
        Ok(declared)
    }

    /// The agent of rank `rank` of `engine` while the rank is handshaken again after a failed
    /// or overdue READ ([`forget_after_failure`](Self::forget_after_failure)) and its metadata
    /// stays loaded (until the engine is evicted); a use of the engine, for its TTL.
    /// Heartbeats go to it meanwhile: vLLM keeps an engine whose READs failed or ran long (it
    /// has no read timeout) and sends its heartbeats on (`_send_heartbeats`), and a prefill
    /// too slow or stopped to answer a new handshake at once must not end the leases of the
    /// requests that wait for it. `None` for a rank never handshaken, or handshaken again for
    /// another reason (a new registration generation): its heartbeats wait for the handshake,
    /// as vLLM's (`_ensure_handshake`).
    pub(crate) fn known_agent(&self, engine: &str, rank: usize) -> Option<String> {
        let agent = {
            let loaded = self.loaded();
            let name = loaded.after_failure.get(&(engine.to_string(), rank))?;
            loaded
                .by_name
                .get(name)
                .filter(|l| l.source.0 == engine && l.source.1 == rank)?;
            name.clone()
        };
        self.book().engines.touch(engine, Instant::now());
        Some(agent)
    }

    /// The counts so far, with the engines known and the process's open file descriptors
    /// now.
    pub(crate) fn stats(&self) -> RemoteStats {
        let (engines, evicted) = {
            let book = self.book();
            (book.engines.known() as u64, book.evicted)
        };
        let handshakes_pending = self
            .lock()
            .values()
            .filter(|handshake| handshake.peek().is_none())
            .count() as u64;
        let loaded = self.loaded();
        RemoteStats {
            engines,
            evicted,
            handshakes_pending,
            agents: loaded.by_name.len() as u64,
            open_fds: crate::metrics::open_fds(),
            ..loaded.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_newer_generation_forgets_an_engine() {
        let remotes = Remotes::default();
        assert!(remotes.newer_generation("pf", 1), "the first one seen");
        assert!(!remotes.newer_generation("pf", 1), "the same one");
        assert!(remotes.newer_generation("pf", 3));
        assert!(!remotes.newer_generation("pf", 2), "an older one");
        assert!(remotes.newer_generation("other", 1), "per engine");
        assert!(!remotes.newer_generation("new", 0), "0 is vLLM's default");
    }
}

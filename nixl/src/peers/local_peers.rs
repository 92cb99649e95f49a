//! The agents of this process: their registrations and their UCX workers. Metadata whose
//! worker is one of this process's is recognised by that worker (see `designation`), and a
//! transfer whose remote side is one of these agents holds the registrations it targets.
//!
//! NIXL knows a remote agent only through the metadata it loaded, which can be stale: an
//! agent of this process may have deregistered (and freed) memory that another agent still
//! has in its copy of the metadata. When the remote agent of a request lives in this process,
//! every remote descriptor is therefore resolved here to a live registration that covers it,
//! and the request holds that registration until NIXL is done. A descriptor that no live
//! registration covers is refused. For an agent in another process, every descriptor must
//! lie in memory its loaded metadata advertised.
//!
//! Names of agents stay known after the agents are gone (one entry per distinct name), so
//! that a request by name alone (metadata NIXL loaded itself) to a dropped agent of this
//! process is refused too.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};

use crate::error::{Error, Result};
use crate::ffi::descriptor::{RegDesc, XferDesc};
use crate::ffi::mem_type::MemType;
use crate::peers::region_index::RegionIndex;
use crate::peers::wire::{AdvertisedIndex, LoadedMetadata, PeerKind, Worker};

/// Registered memory that a transfer can target and hold.
pub(crate) trait Target: Send + Sync {
    /// The memory type of every region.
    fn mem_type(&self) -> MemType;
    /// The registered regions.
    fn regions(&self) -> &[RegDesc];
}

/// A hold on a target: while it lives, the memory stays registered and allocated.
pub(crate) type Hold = Arc<dyn Target>;

/// One live agent of this process.
struct LiveAgent {
    name: String,
    targets: Vec<Weak<dyn Target>>,
    /// The UCX workers of its UCX backends, as their addresses describe them.
    workers: Vec<Worker>,
}

#[derive(Default)]
struct Table {
    live: HashMap<u64, LiveAgent>,
    /// Counts changes to the set of UCX workers.
    generation: u64,
    /// Every agent name this process has had.
    names: HashSet<String>,
}

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

fn table() -> std::sync::MutexGuard<'static, Table> {
    TABLE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A new agent id, unique in this process.
pub(crate) fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Records that agent `id`, named `name`, lives in this process.
pub(crate) fn add_agent(id: u64, name: &str) {
    let mut table = table();
    table.names.insert(name.to_string());
    table.live.insert(
        id,
        LiveAgent {
            name: name.to_string(),
            targets: Vec::new(),
            workers: Vec::new(),
        },
    );
}

/// Records that agent `id` is gone (its workers with it).
pub(crate) fn remove_agent(id: u64) {
    let mut table = table();
    if table
        .live
        .remove(&id)
        .is_some_and(|agent| !agent.workers.is_empty())
    {
        table.generation += 1;
    }
}

/// Records a registration of agent `id`.
pub(crate) fn track(id: u64, target: Hold) {
    if let Some(agent) = table().live.get_mut(&id) {
        agent.targets.retain(|weak| weak.strong_count() > 0);
        agent.targets.push(Arc::downgrade(&target));
    }
}

/// Records the UCX worker of a UCX backend of agent `id`.
pub(crate) fn add_worker(id: u64, worker: Worker) {
    let mut table = table();
    if let Some(agent) = table.live.get_mut(&id) {
        agent.workers.push(worker);
        table.generation += 1;
    }
}

/// The generation of this process's set of UCX workers: it changes whenever a worker comes
/// or goes, so that metadata checked against one set is checked again against another.
pub(crate) fn workers_generation() -> u64 {
    table().generation
}

/// A fake agent of this process with one worker, for tests; removed when dropped.
#[cfg(test)]
pub(crate) struct FakeAgent(pub u64);

#[cfg(test)]
impl FakeAgent {
    /// Agent `name` of this process, with `worker`.
    pub(crate) fn new(name: &str, worker: Worker) -> FakeAgent {
        let id = next_id();
        add_agent(id, name);
        add_worker(id, worker);
        FakeAgent(id)
    }
}

#[cfg(test)]
impl Drop for FakeAgent {
    fn drop(&mut self) {
        remove_agent(self.0);
    }
}

/// A live agent as [`live_agents`] shows it.
pub(crate) struct AgentWorkers {
    /// The agent's id.
    pub id: u64,
    /// Its name.
    pub name: String,
    /// Its UCX workers.
    pub workers: Vec<Worker>,
}

/// Every live agent of this process with its UCX workers.
pub(crate) fn live_agents() -> Vec<AgentWorkers> {
    table()
        .live
        .iter()
        .map(|(&id, agent)| AgentWorkers {
            id,
            name: agent.name.clone(),
            workers: agent.workers.clone(),
        })
        .collect()
}

/// What a request to a remote agent reaches.
enum Reaches {
    /// Agents of this process (by id; none left alive: an agent that is gone).
    Agents(Vec<u64>),
    /// An agent elsewhere, with the memory its loaded metadata advertised (`None` when
    /// NIXL loaded its metadata itself).
    Elsewhere(Option<Arc<AdvertisedIndex>>),
}

/// What a request to `remote_agent`, whose metadata `loaded` records (or not), reaches.
fn reaches(loaded: &LoadedMetadata, remote_agent: &str) -> Reaches {
    if let Some(peer) = loaded.peer(remote_agent) {
        return match peer.kind {
            PeerKind::InProcess(ids) => Reaches::Agents(ids),
            PeerKind::Remote => Reaches::Elsewhere(Some(peer.advertised)),
        };
    }
    // Not loaded through `load_remote_metadata` (NIXL loaded it itself, or it is this
    // agent's own name): the agents of this process that have or had that name.
    let table = table();
    if !table.names.contains(remote_agent) {
        return Reaches::Elsewhere(None);
    }
    Reaches::Agents(
        table
            .live
            .iter()
            .filter(|(_, agent)| agent.name == remote_agent)
            .map(|(&id, _)| id)
            .collect(),
    )
}

/// The registrations that `descs` of `remote_agent` target when that agent lives in this
/// process (empty when it does not), one hold per registration, after checking that every
/// descriptor lies in memory the agent has registered: live registrations for an agent of
/// this process, the memory its loaded metadata advertised for an agent elsewhere.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first descriptor outside that memory.
pub(crate) fn hold_targets(
    operation: &'static str,
    loaded: &LoadedMetadata,
    remote_agent: &str,
    mem_type: MemType,
    descs: &[XferDesc],
) -> Result<Vec<Hold>> {
    match reaches(loaded, remote_agent) {
        Reaches::Agents(ids) => hold_live(operation, &ids, remote_agent, mem_type, descs),
        Reaches::Elsewhere(Some(advertised)) => {
            let outside = descs.iter().enumerate().find(|(_, d)| {
                covering(d, |dev, start, end| {
                    advertised.covering((mem_type, dev), start, end)
                })
                .is_none()
            });
            match outside {
                Some((index, desc)) => Err(Error::InvalidArgument {
                    operation,
                    reason: format!(
                        "remote descriptor {index} ({:#x}, {} bytes, device {}) lies in no \
                         {mem_type} registration that agent {remote_agent:?}'s loaded \
                         metadata advertises; describe memory the peer registered and sent \
                         metadata for",
                        desc.addr, desc.len, desc.dev_id
                    ),
                }),
                None => Ok(Vec::new()),
            }
        }
        Reaches::Elsewhere(None) => Ok(Vec::new()),
    }
}

/// What `find` answers for the device, start and end of `desc` (nothing for a descriptor
/// that runs past the end of the address space).
fn covering<T>(desc: &XferDesc, find: impl FnOnce(u64, usize, usize) -> Option<T>) -> Option<T> {
    find(desc.dev_id, desc.addr, desc.addr.checked_add(desc.len)?)
}

/// Holds the live registrations of agents `ids` of this process that `descs` target.
fn hold_live(
    operation: &'static str,
    ids: &[u64],
    remote_agent: &str,
    mem_type: MemType,
    descs: &[XferDesc],
) -> Result<Vec<Hold>> {
    let targets: Vec<Hold> = {
        let table = table();
        ids.iter()
            .filter_map(|id| table.live.get(id))
            .flat_map(|agent| agent.targets.iter().filter_map(Weak::upgrade))
            .filter(|target| target.mem_type() == mem_type)
            .collect()
    };
    let index = RegionIndex::new(targets.iter().enumerate().flat_map(|(at, target)| {
        target
            .regions()
            .iter()
            .map(move |r| (r.dev_id, r.addr, r.addr.saturating_add(r.len), at))
    }));
    let mut used = vec![false; targets.len()];
    for (index_in_list, desc) in descs.iter().enumerate() {
        match covering(desc, |dev, start, end| index.covering(dev, start, end)) {
            Some(&at) => used[at] = true,
            None => {
                return Err(Error::InvalidArgument {
                    operation,
                    reason: format!(
                        "remote descriptor {index_in_list} ({:#x}, {} bytes, device {}) lies \
                         in no live {mem_type} registration of agent {remote_agent:?}, which \
                         lives in this process: it was deregistered or never registered, so \
                         NIXL's copy of its metadata is stale; load fresh metadata and \
                         describe registered memory",
                        desc.addr, desc.len, desc.dev_id
                    ),
                })
            }
        }
    }
    Ok(targets
        .into_iter()
        .zip(used)
        .filter_map(|(target, used)| used.then_some(target))
        .collect())
}

//! Memory of the agents of this process, found by agent name, so that a transfer whose
//! remote side is one of them holds the registrations it targets.
//!
//! NIXL knows a remote agent only through the metadata it loaded, which can be stale: an
//! agent of this process may have deregistered (and freed) memory that another agent still
//! has in its copy of the metadata. When the remote agent of a request lives in this process,
//! every remote descriptor is therefore resolved here to a live registration that covers it,
//! and the request holds that registration until NIXL is done. A descriptor that no live
//! registration covers is refused. Agents in other processes are out of reach: for them
//! NIXL's own checks, against the metadata loaded, are all there is.
//!
//! Names stay known after their agent is gone, so that a request to a dropped agent of this
//! process is refused too; the table grows by one entry per distinct agent name.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};

use crate::descriptor::{RegDesc, XferDesc};
use crate::error::{Error, Result};
use crate::mem_type::MemType;

/// Registered memory that a transfer can target and hold.
pub(crate) trait Target: Send + Sync {
    /// The memory type of every region.
    fn mem_type(&self) -> MemType;
    /// The registered regions.
    fn regions(&self) -> &[RegDesc];
}

/// A hold on a target: while it lives, the memory stays registered and allocated.
pub(crate) type Hold = Arc<dyn Target>;

/// The registrations of each agent name of this process.
type Table = HashMap<String, Vec<Weak<dyn Target>>>;

/// Every agent name of this process with its registrations (dead ones pruned as new ones
/// come); a name with no live registration stays, as a dropped agent's.
static TARGETS: LazyLock<Mutex<Table>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn table() -> std::sync::MutexGuard<'static, Table> {
    TARGETS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Records that an agent named `name` lives in this process.
pub(crate) fn add_agent(name: &str) {
    table().entry(name.to_string()).or_default();
}

/// Records a registration of the agent named `agent`.
pub(crate) fn track(agent: &str, target: Hold) {
    let mut table = table();
    let targets = table.entry(agent.to_string()).or_default();
    targets.retain(|weak| weak.strong_count() > 0);
    targets.push(Arc::downgrade(&target));
}

/// The live registrations of `mem_type` of the agents of this process named `name`, or
/// `None` when no agent of this process ever had that name.
fn targets_of(name: &str, mem_type: MemType) -> Option<Vec<Hold>> {
    let table = table();
    Some(
        table
            .get(name)?
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|target| target.mem_type() == mem_type)
            .collect(),
    )
}

/// The registrations that `descs` of `remote_agent` target when that agent lives in this
/// process (empty when it does not), one hold per registration.
///
/// # Errors
/// [`Error::InvalidArgument`] for a descriptor that no live registration of the agent
/// covers (it was deregistered, or never registered).
pub(crate) fn hold_targets(
    operation: &'static str,
    remote_agent: &str,
    mem_type: MemType,
    descs: &[XferDesc],
) -> Result<Vec<Hold>> {
    let Some(targets) = targets_of(remote_agent, mem_type) else {
        return Ok(Vec::new());
    };
    // (start, end, dev_id, index into `targets`), sorted by start.
    let mut regions: Vec<(usize, usize, u64, usize)> = targets
        .iter()
        .enumerate()
        .flat_map(|(at, target)| {
            target
                .regions()
                .iter()
                .map(move |r| (r.addr, r.addr.saturating_add(r.len), r.dev_id, at))
        })
        .collect();
    regions.sort_unstable();
    let mut used = vec![false; targets.len()];
    for (index, desc) in descs.iter().enumerate() {
        let end = desc.addr.checked_add(desc.len);
        // Regions may overlap (the same memory registered twice): look at every region that
        // starts at or before the descriptor.
        let before = regions.partition_point(|r| r.0 <= desc.addr);
        let covering = regions[..before]
            .iter()
            .rev()
            .find(|r| r.2 == desc.dev_id && end.is_some_and(|end| end <= r.1));
        match covering {
            Some(region) => used[region.3] = true,
            None => {
                return Err(Error::InvalidArgument {
                    operation,
                    reason: format!(
                        "remote descriptor {index} ({:#x}, {} bytes, device {}) lies in no live \
                         {mem_type} registration of agent {remote_agent:?}, which lives in this \
                         process: it was deregistered or never registered, so NIXL's copy of \
                         its metadata is stale; load fresh metadata and describe registered memory",
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

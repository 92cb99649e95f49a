//! What one agent learned from the metadata of each remote agent it loaded: the bytes it was
//! last loaded from, so that loading the very same bytes again (NIXL's no-op reload, far
//! cheaper than a first load) is not checked a second time (identical bytes get the
//! identical verdict, as long as this process's UCX workers are the same); whether that
//! agent lives in this process; and the memory its metadata advertised. Dropped when the
//! agent's metadata is invalidated.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::peer::Advertised;
use super::serdes::Fields;
use crate::ffi::mem_type::MemType;
use crate::peers::region_index::RegionIndex;

/// Memory advertised by a remote agent's loaded metadata, keyed by memory type and device.
pub(crate) type AdvertisedIndex = RegionIndex<(MemType, u64), ()>;

/// Where a loaded remote agent lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PeerKind {
    /// In this process: the agents (by id) its UCX worker belongs to.
    InProcess(Vec<u64>),
    /// In another process (or reached without UCX).
    Remote,
}

/// What is known of one loaded remote agent.
#[derive(Debug, Clone)]
pub(crate) struct LoadedPeer {
    /// Where it lives.
    pub kind: PeerKind,
    /// The memory its metadata advertised, all loads together.
    pub advertised: Arc<AdvertisedIndex>,
}

struct Entry {
    bytes: Box<[u8]>,
    /// The generation of this process's UCX workers the bytes were checked against.
    workers: u64,
    peer: LoadedPeer,
}

/// Per remote agent name, what its loaded metadata said.
#[derive(Default)]
pub(crate) struct LoadedMetadata {
    by_agent: Mutex<HashMap<Vec<u8>, Entry>>,
}

impl LoadedMetadata {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, Entry>> {
        self.by_agent.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `metadata` is, byte for byte, what its agent was last loaded from here,
    /// checked against generation `workers` of this process's UCX workers.
    pub(crate) fn is_loaded(&self, metadata: &[u8], workers: u64) -> bool {
        let Some(name) = declared_name(metadata) else {
            return false;
        };
        self.lock()
            .get(name)
            .is_some_and(|last| last.workers == workers && *last.bytes == *metadata)
    }

    /// Records that `agent` was loaded from `metadata` (which passed the checks against
    /// generation `workers` of this process's UCX workers), found to be `kind` (`None`: the
    /// metadata had no UCX connection info, so what was known stays), advertising
    /// `regions`. Where the agent was loaded before, the regions add
    /// to those it advertised then (NIXL adds them too), and an agent once in this process
    /// stays counted as such (its connection may still be the one NIXL uses).
    pub(crate) fn remember(
        &self,
        agent: &str,
        metadata: &[u8],
        workers: u64,
        kind: Option<PeerKind>,
        regions: &[Advertised],
    ) {
        let mut by_agent = self.lock();
        let before = by_agent.remove(agent.as_bytes());
        let kind = merged(before.as_ref().map(|e| &e.peer.kind), kind);
        let mut all: Vec<((MemType, u64), usize, usize)> = before
            .iter()
            .flat_map(|e| {
                e.peer
                    .advertised
                    .regions()
                    .map(|(key, start, end, _)| (key, start, end))
            })
            .chain(regions.iter().filter_map(|r| {
                let start = usize::try_from(r.desc.addr).ok()?;
                let end = start.checked_add(usize::try_from(r.desc.len).ok()?)?;
                Some(((r.mem_type, r.desc.dev_id), start, end))
            }))
            .collect();
        all.sort_unstable();
        all.dedup();
        let advertised = Arc::new(RegionIndex::new(
            all.into_iter()
                .map(|(key, start, end)| (key, start, end, ())),
        ));
        by_agent.insert(
            agent.as_bytes().to_vec(),
            Entry {
                bytes: metadata.into(),
                workers,
                peer: LoadedPeer { kind, advertised },
            },
        );
    }

    /// The bytes `agent` was last loaded from, when it was found to live in another process
    /// against another generation of this process's UCX workers than `workers`. (An agent
    /// found in this process stays held to its agents' live registrations, whatever changes.)
    pub(crate) fn stale(&self, agent: &str, workers: u64) -> Option<Box<[u8]>> {
        self.lock()
            .get(agent.as_bytes())
            .filter(|e| e.workers != workers && e.peer.kind == PeerKind::Remote)
            .map(|e| e.bytes.clone())
    }

    /// Records that `agent`'s `metadata`, if it is still what the agent was last loaded
    /// from, passed the checks against generation `workers`, found to be `kind` (merged with
    /// what was known as [`remember`](Self::remember) does).
    pub(crate) fn rechecked(
        &self,
        agent: &str,
        metadata: &[u8],
        workers: u64,
        kind: Option<PeerKind>,
    ) {
        if let Some(entry) = self
            .lock()
            .get_mut(agent.as_bytes())
            .filter(|e| *e.bytes == *metadata)
        {
            entry.peer.kind = merged(Some(&entry.peer.kind), kind);
            entry.workers = workers;
        }
    }

    /// What is known of `agent`, if its metadata was loaded here.
    pub(crate) fn peer(&self, agent: &str) -> Option<LoadedPeer> {
        self.lock().get(agent.as_bytes()).map(|e| e.peer.clone())
    }

    /// Forgets `agent`'s metadata (it was invalidated).
    pub(crate) fn forget(&self, agent: &str) {
        self.lock().remove(agent.as_bytes());
    }
}

/// Where an agent lives, from what was known (`before`) and what its metadata now says
/// (`now`; `None`: nothing, for want of UCX connection info): once in this process, always
/// (its connection may still be the one NIXL uses), with the agents of both.
fn merged(before: Option<&PeerKind>, now: Option<PeerKind>) -> PeerKind {
    match (before, now) {
        (Some(PeerKind::InProcess(old)), Some(PeerKind::InProcess(new))) => {
            let mut ids = old.clone();
            ids.extend(new.into_iter().filter(|id| !old.contains(id)));
            PeerKind::InProcess(ids)
        }
        (Some(PeerKind::InProcess(old)), _) => PeerKind::InProcess(old.clone()),
        (_, Some(kind)) => kind,
        (Some(old), None) => old.clone(),
        (None, None) => PeerKind::Remote,
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

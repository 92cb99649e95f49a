//! Per-transfer metrics, and counts of what a worker did with its peers.

use std::time::Duration;

pub mod series;

/// One load (its NIXL READ requests, one per remote rank read from) as the worker saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferMetrics {
    /// The local request id.
    pub request_id: String,
    /// The engine read from.
    pub remote_engine: String,
    /// From the first post to the completion or failure of the last READ, handshakes
    /// excluded (zero when it failed before any READ was made).
    pub duration: Duration,
    /// Bytes moved (requested, when a READ failed; zero when none was made).
    pub bytes: u64,
    /// Descriptors in the requests, as NIXL counts them (after joining descriptors
    /// contiguous on both sides: what `vllm:nixl_num_descriptors` records); the descriptors
    /// asked for when a READ failed or NIXL kept no telemetry of it.
    pub descriptors: usize,
    /// Why it failed, or `None` when every byte landed.
    pub failure: Option<String>,
}

/// How the prefill side's held requests were released.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendStats {
    /// Released because every expected decode notification arrived.
    pub freed_on_notification: u64,
    /// Released because the KV lease ended first.
    pub freed_on_timeout: u64,
    /// Kept for a read-back and released early, unclaimed, because the kept blocks passed
    /// their cap ([`ConnectorMetadata::evict`](crate::ConnectorMetadata::evict)).
    pub freed_on_eviction: u64,
}

/// What a worker did with the agent metadata of the remote ranks it handshook with, and the
/// process's open file descriptors (NIXL 1.5.1 keeps two for every load and invalidation of a
/// live peer, so a count that grows with the handshakes shows reloads).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteStats {
    /// Handshakes that reached the metadata (each needs a load or a reuse).
    pub handshakes: u64,
    /// Metadata loaded into NIXL (first loads and replacements).
    pub loaded: u64,
    /// Handshakes whose metadata was byte for byte the one already loaded: the loaded
    /// agent was reused, NIXL was not asked.
    pub reused: u64,
    /// Loaded agents invalidated because a handshake brought different metadata for them
    /// (a peer restarted under the same name).
    pub replaced: u64,
    /// Loaded agents invalidated and loaded again from the same metadata because a transfer
    /// from them failed in NIXL (UCX does not reconnect a failed endpoint: a partition or a
    /// reset ends the connection, and only a new load connects again).
    pub reconnected: u64,
    /// Remote engines known now: used by a load or a heartbeat and not evicted.
    pub engines: u64,
    /// Remote agents loaded now (one per remote rank handshaken with).
    pub agents: u64,
    /// Handshakes started and not yet ended (loads waiting on them share each one).
    pub handshakes_pending: u64,
    /// Remote engines evicted so far, their agents invalidated: unused for longer than
    /// `kv_connector_extra_config.engine_ttl` (default 3600 s), or replaced at their
    /// side-channel address by another engine.
    pub evicted: u64,
    /// File descriptors open in this process when the stats were taken (`None` where
    /// `/proc/self/fd` cannot be read).
    pub open_fds: Option<u64>,
}

/// File descriptors open in this process now, from `/proc/self/fd` (`None` where it cannot
/// be read).
pub fn open_fds() -> Option<u64> {
    let entries = std::fs::read_dir("/proc/self/fd").ok()?;
    // The listing's own descriptor is among the entries.
    Some((entries.count() as u64).saturating_sub(1))
}

//! What the soak saw, and reports.

/// What the soak saw.
#[derive(Debug, Default)]
pub struct Report {
    pub requests: u64,
    pub loads: u64,
    pub loaded: u64,
    pub failed: u64,
    pub recompute: u64,
    pub aborted_while_waiting: u64,
    pub aborted_while_loading: u64,
    pub full_hits: u64,
    /// Refused for lacking remote blocks, and freed at once.
    pub without_remote_blocks: u64,
    pub never_read: u64,
    pub overdue: u64,
    pub blocks_verified: u64,
    pub poisoned_blocks: u64,
    pub mismatched_blocks: u64,
    pub late_writes: u64,
    pub freed_twice: u64,
    pub floods: u64,
    /// Messages of the floods that reached a prefill's stage past the first (one of two
    /// stages).
    pub floods_to_later_stages: u64,
    pub prefill_stops: u64,
    pub decode_stalls: u64,
    pub decode_stalls_past_lease: u64,
    /// Loads failed because their READ may have outlived the lease (the prefill's release
    /// marks showed a release): the lease ended in a decode stall or before the request
    /// reached the decode. Never reported loaded.
    pub lease_outlived: u64,
    /// Requests that reached the decode late outside a long stall (their leases may have
    /// ended first).
    pub arrived_late: u64,
    /// Requests that waited for blocks longer than a lease (heartbeats keeping it).
    pub waited_past_lease: u64,
    /// Of those, kept by the third agent's unsplit (vLLM) heartbeats, over 16 KiB.
    pub waited_on_vllm_heartbeats: u64,
    pub prefill_restarts: u64,
    /// Outcomes of loads from a killed prefill: loaded before it died, and not.
    pub dead_loaded: u64,
    pub dead_failed: u64,
    /// Loaded from a prefill started after a restart.
    pub loaded_after_restart: u64,
    /// Push mode: loads registered with a killed prefill that never answered, their blocks
    /// held by the decode at the end.
    pub held_by_dead: u64,
}

//! Per-transfer metrics.

use std::time::Duration;

/// One load (one NIXL READ request) as the worker saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferMetrics {
    /// The local request id.
    pub request_id: String,
    /// The engine read from.
    pub remote_engine: String,
    /// From the post to completion or failure, handshake excluded (zero when it failed
    /// before posting).
    pub duration: Duration,
    /// Bytes moved (requested, when it failed).
    pub bytes: u64,
    /// Descriptors in the request.
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
}

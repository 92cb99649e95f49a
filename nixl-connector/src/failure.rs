//! Why a load failed: the kind (for metrics and policies) and the message, given with each
//! failed block by [`KvConnectorWorker::load_errors`](crate::KvConnectorWorker::load_errors).

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// What kind of failure ended a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum FailureKind {
    /// The handshake with the remote rank failed (unreachable, refused, incompatible).
    Handshake,
    /// NIXL failed the READ, or refused to make or post it.
    Transfer,
    /// The READ did not complete within the worker's transfer timeout.
    Timeout,
    /// The load was refused before anything was posted (a block out of range, a remote TP
    /// this rank cannot read from, no registered cache).
    Invalid,
    /// The prefill's blocks expire before they could be read (vLLM mode: its
    /// `remote_blocks_expiry_time`); nothing was read.
    Expired,
    /// The READ ended, but the prefill may have released its blocks first (its lease
    /// ended): what was read may be another request's KV, so the load is not taken as
    /// loaded.
    #[serde(rename = "lease_outlived")]
    LeaseOutlived,
}

impl FailureKind {
    /// The kind of `error`.
    pub fn of(error: &Error) -> Self {
        match error {
            Error::Handshake { .. } => FailureKind::Handshake,
            Error::TransferTimeout { .. } => FailureKind::Timeout,
            Error::InvalidArgument { .. } | Error::NotRegistered { .. } => FailureKind::Invalid,
            Error::BlocksExpired { .. } | Error::KeptBlocksGone { .. } => FailureKind::Expired,
            Error::LeaseOutlived { .. } => FailureKind::LeaseOutlived,
            _ => FailureKind::Transfer,
        }
    }

    /// Its name in metric labels and logs: `handshake`, `transfer`, `timeout`, `invalid`,
    /// `expired`, `lease_outlived`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Handshake => "handshake",
            FailureKind::Transfer => "transfer",
            FailureKind::Timeout => "timeout",
            FailureKind::Invalid => "invalid",
            FailureKind::Expired => "expired",
            FailureKind::LeaseOutlived => "lease_outlived",
        }
    }
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One local block whose load failed, and why.
///
/// It compares equal to its block id, so a list of them can be checked against ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedBlock {
    /// The local block id.
    pub block_id: usize,
    /// The local request whose load wrote (or was to write) it.
    pub request_id: String,
    /// The kind of failure.
    pub kind: FailureKind,
    /// The failure's message (shared by every block of the load).
    pub reason: Arc<str>,
}

impl PartialEq<usize> for FailedBlock {
    fn eq(&self, block_id: &usize) -> bool {
        self.block_id == *block_id
    }
}

impl std::fmt::Display for FailedBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "block {} of request {:?}: {} failure: {}",
            self.block_id, self.request_id, self.kind, self.reason
        )
    }
}

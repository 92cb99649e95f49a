//! What a worker's loads came to: the requests done sending and receiving, the failed
//! blocks, the metrics, and the loads still under way.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::failure::FailedBlock;
use crate::metrics::TransferMetrics;

/// Requests that finished transferring on one rank since the last
/// [`KvConnectorWorker::finished`](crate::KvConnectorWorker::finished); the engine acts on
/// every rank's, aggregated by
/// [`KvConnectorScheduler::update_connector_output`](crate::KvConnectorScheduler::update_connector_output).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finished {
    /// Held requests whose blocks may now be freed (every decode rank notified, or their
    /// lease ended).
    pub sending: Vec<String>,
    /// Loads that ended (failed ones too; their blocks are in `load_errors`).
    pub recving: Vec<String>,
}

/// A load whose READs were still in flight when its
/// [`transfer_timeout`](crate::WorkerConfig::transfer_timeout) passed. NIXL may still write
/// its local blocks, so they stay with the connector: the load's outcome (a
/// [`TransferTimeout`](crate::Error::TransferTimeout) failure) is reported only once NIXL has
/// ended every READ, done or failed (vLLM's `_pop_done_transfers` keeps a failed request's
/// handles, and reports it, only then).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverdueLoad {
    /// The local request id.
    pub request_id: String,
    /// The engine read from.
    pub remote_engine: String,
    /// The local blocks the READs may still write.
    pub block_ids: Vec<usize>,
    /// The transfer timeout that passed.
    pub deadline: std::time::Duration,
}

/// Outcomes the background tasks report, and the loads under way.
#[derive(Debug, Default)]
pub(crate) struct Outcomes {
    pub(crate) recving: Vec<String>,
    pub(crate) overdue: Vec<OverdueLoad>,
    pub(crate) load_errors: Vec<FailedBlock>,
    pub(crate) metrics: Vec<TransferMetrics>,
    /// Loads started and not yet ended, by request id: whether their request was aborted.
    active: HashMap<String, bool>,
}

impl Outcomes {
    /// Marks a load of `request_id` as under way; `false` if one already is.
    pub(crate) fn start(&mut self, request_id: &str) -> bool {
        if self.active.contains_key(request_id) {
            return false;
        }
        self.active.insert(request_id.to_string(), false);
        true
    }

    /// How many loads are under way (started, not yet ended).
    pub(crate) fn under_way(&self) -> usize {
        self.active.len()
    }

    /// Marks the load of `request_id` as ended; whether its request was aborted.
    pub(crate) fn end(&mut self, request_id: &str) -> bool {
        self.active.remove(request_id).unwrap_or(false)
    }

    /// Whether the load of `request_id` is under way and its request was aborted.
    pub(crate) fn is_aborted(&self, request_id: &str) -> bool {
        self.active.get(request_id).copied().unwrap_or(false)
    }

    /// Marks the load of `request_id` aborted; `false` when none is under way.
    pub(crate) fn abort(&mut self, request_id: &str) -> bool {
        match self.active.get_mut(request_id) {
            Some(aborted) => {
                *aborted = true;
                true
            }
            None => false,
        }
    }
}

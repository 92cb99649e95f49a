//! What a worker's loads came to: the requests done sending and receiving, the failed
//! blocks, the metrics, and the loads still under way.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::failure::FailedBlock;
use crate::metrics::TransferMetrics;

/// Appends `item` to `kept`, dropping the oldest beyond [`KEPT_REPORTS`].
fn keep_last<T>(kept: &mut VecDeque<T>, item: T) {
    if kept.len() == KEPT_REPORTS {
        kept.pop_front();
    }
    kept.push_back(item);
}

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

/// The most load metrics, and overdue loads, kept for an engine that does not take them
/// ([`KvConnectorWorker::metrics`](crate::KvConnectorWorker::metrics),
/// [`overdue_loads`](crate::KvConnectorWorker::overdue_loads)): past it the oldest go.
pub(crate) const KEPT_REPORTS: usize = 4096;

/// Outcomes the background tasks report, and the loads under way.
#[derive(Debug, Default)]
pub(crate) struct Outcomes {
    pub(crate) recving: Vec<String>,
    overdue: VecDeque<OverdueLoad>,
    pub(crate) load_errors: Vec<FailedBlock>,
    metrics: VecDeque<TransferMetrics>,
    /// Loads started and not yet ended, by request id: whether their request was aborted.
    active: HashMap<String, bool>,
}

impl Outcomes {
    /// Keeps the metrics of a load that ended, the oldest dropped past [`KEPT_REPORTS`].
    pub(crate) fn add_metrics(&mut self, metrics: TransferMetrics) {
        keep_last(&mut self.metrics, metrics);
    }

    /// The metrics kept since the last call.
    pub(crate) fn take_metrics(&mut self) -> Vec<TransferMetrics> {
        std::mem::take(&mut self.metrics).into()
    }

    /// Keeps an overdue load, the oldest dropped past [`KEPT_REPORTS`].
    pub(crate) fn add_overdue(&mut self, load: OverdueLoad) {
        keep_last(&mut self.overdue, load);
    }

    /// The overdue loads kept since the last call.
    pub(crate) fn take_overdue(&mut self) -> Vec<OverdueLoad> {
        std::mem::take(&mut self.overdue).into()
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_that_never_takes_reports_holds_only_the_last_ones() {
        let mut outcomes = Outcomes::default();
        for n in 0..KEPT_REPORTS + 10 {
            outcomes.add_metrics(TransferMetrics {
                request_id: n.to_string(),
                remote_engine: "p".into(),
                duration: std::time::Duration::ZERO,
                bytes: 0,
                descriptors: 0,
                failure: None,
            });
            outcomes.add_overdue(OverdueLoad {
                request_id: n.to_string(),
                remote_engine: "p".into(),
                block_ids: vec![n],
                deadline: std::time::Duration::ZERO,
            });
        }
        let metrics = outcomes.take_metrics();
        assert_eq!(metrics.len(), KEPT_REPORTS);
        assert_eq!(metrics[0].request_id, "10", "the oldest went first");
        let overdue = outcomes.take_overdue();
        assert_eq!(overdue.len(), KEPT_REPORTS);
        assert_eq!(overdue.last().unwrap().block_ids, [KEPT_REPORTS + 9]);
        assert!(outcomes.take_metrics().is_empty() && outcomes.take_overdue().is_empty());
    }
}

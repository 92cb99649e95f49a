//! Every TP rank's step output, aggregated as vLLM's `KVOutputAggregator` does: a request
//! is done sending or receiving only once every rank has reported it.
//!
//! With TP > 1 each rank reads its own share of a decode request's blocks, and each rank
//! of a prefill is read by its own decode ranks, while the block ids are the engine's,
//! shared by every rank. One rank's report is therefore never enough: a decode request is
//! not loaded while another rank still reads into its blocks, and a prefill request's blocks
//! are not free while another rank's are still read.
//! [`KvConnectorScheduler::update_connector_output`](crate::KvConnectorScheduler::update_connector_output)
//! takes one [`WorkerOutput`] per rank and aggregates them with a [`KvOutputAggregator`].

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::failure::FailedBlock;
use crate::scheduler::outcomes::Finished;

/// What one TP rank reports after a step (vLLM's `KVConnectorOutput` of one worker):
/// its [`KvConnectorWorker::output`](crate::KvConnectorWorker::output). It crosses the
/// process boundary between a worker process and the scheduler's
/// ([`to_msgpack`](Self::to_msgpack)).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerOutput {
    /// The rank that reports.
    pub tp_rank: usize,
    /// Its pipeline stage (0 without pipeline parallelism).
    #[serde(default)]
    pub pp_rank: usize,
    /// The requests this rank is done sending and receiving since its last output.
    pub finished: Finished,
    /// The blocks whose load failed on this rank since its last output.
    pub load_errors: Vec<FailedBlock>,
}

impl WorkerOutput {
    /// This output as MessagePack, for the scheduler's process.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if it cannot be encoded.
    pub fn to_msgpack(&self) -> Result<Vec<u8>> {
        crate::scheduler::step_wire::encode("encode a worker output", self)
    }

    /// An output from the MessagePack of [`to_msgpack`](Self::to_msgpack).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming what does not decode.
    pub fn from_msgpack(bytes: &[u8]) -> Result<Self> {
        crate::scheduler::step_wire::decode("decode a worker output", bytes)
    }
}

/// Every rank's output of one step, aggregated: what the scheduler acts on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AggregatedOutput {
    /// Requests every rank is done with: `sending` (every rank's blocks released, the engine
    /// may free them) and `recving` (every rank's load ended).
    pub finished: Finished,
    /// Every rank's failed blocks of this step.
    pub load_errors: Vec<FailedBlock>,
}

/// Aggregates the outputs of an engine's ranks, every TP rank of every pipeline stage
/// (vLLM's `KVOutputAggregator` over the world size, with `get_finished_count` unset as in
/// vLLM's NixlConnector: every rank must report).
#[derive(Debug)]
pub struct KvOutputAggregator {
    tp_size: usize,
    pp_size: usize,
    /// Ranks still to report, by request id (vLLM's `_send_remaining_count`).
    sending: HashMap<String, usize>,
    /// Ranks still to report, by request id (vLLM's `_recv_remaining_count`).
    recving: HashMap<String, usize>,
}

impl KvOutputAggregator {
    /// An aggregator of `tp_size` ranks.
    pub fn new(tp_size: usize) -> Self {
        Self::with_stages(1, tp_size)
    }

    /// An aggregator of `pp_size` pipeline stages of `tp_size` ranks each.
    pub fn with_stages(pp_size: usize, tp_size: usize) -> Self {
        KvOutputAggregator {
            tp_size,
            pp_size,
            sending: HashMap::new(),
            recving: HashMap::new(),
        }
    }

    /// The TP size it aggregates.
    pub fn tp_size(&self) -> usize {
        self.tp_size
    }

    /// Takes one step's output of every rank (vLLM's `KVOutputAggregator.aggregate`):
    /// a request is finished once each of the `pp_size` × `tp_size` ranks has reported it,
    /// in this step or an earlier one; failed blocks pass on at once.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless `outputs` holds exactly one output of each TP rank
    /// of each stage (nothing is counted then).
    pub fn aggregate(&mut self, outputs: &[WorkerOutput]) -> Result<AggregatedOutput> {
        const OP: &str = "aggregate the workers' outputs";
        let ranks = self.pp_size.saturating_mul(self.tp_size);
        let name = |pp: usize, tp: usize| match self.pp_size {
            1 => format!("TP rank {tp}"),
            _ => format!("pp_rank {pp} TP rank {tp}"),
        };
        let mut seen = vec![false; ranks];
        for output in outputs {
            let (pp, tp) = (output.pp_rank, output.tp_rank);
            let at = (pp < self.pp_size && tp < self.tp_size).then_some(pp * self.tp_size + tp);
            match at.and_then(|at| seen.get_mut(at)) {
                Some(seen) if !*seen => *seen = true,
                Some(_) => {
                    return Err(Error::invalid(
                        OP,
                        format!("two outputs of {}", name(pp, tp)),
                    ))
                }
                None => {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "an output of {} with TP size {} and {} stages",
                            name(pp, tp),
                            self.tp_size,
                            self.pp_size
                        ),
                    ))
                }
            }
        }
        if let Some(missing) = seen.iter().position(|seen| !seen) {
            return Err(Error::invalid(
                OP,
                format!(
                    "no output of {}: pass every rank's output each step (TP size {})",
                    name(missing / self.tp_size, missing % self.tp_size),
                    self.tp_size
                ),
            ));
        }
        let mut aggregated = AggregatedOutput::default();
        for output in outputs {
            count(
                &output.finished.sending,
                &mut self.sending,
                ranks,
                &mut aggregated.finished.sending,
            );
            count(
                &output.finished.recving,
                &mut self.recving,
                ranks,
                &mut aggregated.finished.recving,
            );
            aggregated
                .load_errors
                .extend(output.load_errors.iter().cloned());
        }
        aggregated.load_errors.sort_by_key(|f| f.block_id);
        Ok(aggregated)
    }
}

/// Counts one rank's report of each of `request_ids` in `remaining`; those that every one
/// of `ranks` has reported now go to `done` (vLLM's `update_finished_set`).
fn count(
    request_ids: &[String],
    remaining: &mut HashMap<String, usize>,
    ranks: usize,
    done: &mut Vec<String>,
) {
    for request_id in request_ids {
        let left = remaining.entry(request_id.clone()).or_insert(ranks);
        *left = left.saturating_sub(1);
        if *left == 0 {
            remaining.remove(request_id);
            done.push(request_id.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::failure::FailureKind;

    fn output(tp_rank: usize, sending: &[&str], recving: &[&str]) -> WorkerOutput {
        WorkerOutput {
            tp_rank,
            pp_rank: 0,
            finished: Finished {
                sending: sending.iter().map(|s| s.to_string()).collect(),
                recving: recving.iter().map(|s| s.to_string()).collect(),
            },
            load_errors: Vec::new(),
        }
    }

    #[test]
    fn a_request_is_finished_once_every_rank_reported_it() {
        let mut a = KvOutputAggregator::new(2);
        let step = a
            .aggregate(&[output(0, &["p"], &["d"]), output(1, &[], &[])])
            .unwrap();
        assert_eq!(step, AggregatedOutput::default(), "rank 1 still works");
        let step = a
            .aggregate(&[output(1, &["p"], &["d"]), output(0, &[], &[])])
            .unwrap();
        assert_eq!(step.finished.sending, ["p"]);
        assert_eq!(step.finished.recving, ["d"]);
        assert!(a.sending.is_empty() && a.recving.is_empty());
    }

    #[test]
    fn every_rank_must_report_once() {
        let mut a = KvOutputAggregator::new(2);
        for (outputs, expect) in [
            (vec![output(0, &["p"], &[])], "no output of TP rank 1"),
            (
                vec![output(0, &["p"], &[]), output(0, &["p"], &[])],
                "two outputs of TP rank 0",
            ),
            (
                vec![output(0, &["p"], &[]), output(2, &["p"], &[])],
                "TP rank 2 with TP size 2",
            ),
        ] {
            let err = a.aggregate(&outputs).unwrap_err().to_string();
            assert!(err.contains(expect), "{err}");
        }
        assert!(a.sending.is_empty(), "nothing counted");
    }

    #[test]
    fn every_rank_of_every_stage_must_report() {
        let mut a = KvOutputAggregator::with_stages(2, 1);
        let stage = |pp_rank, sending: &[&str]| WorkerOutput {
            pp_rank,
            ..output(0, sending, &[])
        };
        let err = a.aggregate(&[stage(0, &["p"])]).unwrap_err().to_string();
        assert!(err.contains("no output of pp_rank 1 TP rank 0"), "{err}");
        let step = a.aggregate(&[stage(0, &["p"]), stage(1, &[])]).unwrap();
        assert!(step.finished.sending.is_empty(), "stage 1 still reads");
        let step = a.aggregate(&[stage(1, &["p"]), stage(0, &[])]).unwrap();
        assert_eq!(step.finished.sending, ["p"]);
    }

    #[test]
    fn a_worker_output_crosses_and_garbage_is_refused() {
        let sent = WorkerOutput {
            tp_rank: 1,
            pp_rank: 0,
            finished: Finished {
                sending: vec!["s".into()],
                recving: vec!["r".into()],
            },
            load_errors: vec![FailedBlock {
                block_id: 4,
                request_id: "r".into(),
                kind: FailureKind::Timeout,
                reason: Arc::from("too slow"),
            }],
        };
        let got = WorkerOutput::from_msgpack(&sent.to_msgpack().unwrap()).unwrap();
        assert_eq!(got, sent);
        let err = WorkerOutput::from_msgpack(b"\xc1garbage").unwrap_err();
        assert!(err.to_string().contains("decode a worker output"), "{err}");
    }
}

//! The connector's part of one engine step, in the order vLLM's engine runs it: the
//! scheduler's [`build_connector_meta`](KvConnectorScheduler::build_connector_meta), each
//! worker's [`start_load_kv`](KvConnectorWorker::start_load_kv), each worker's
//! [`output`](KvConnectorWorker::output) (vLLM's `get_finished` and
//! `get_block_ids_with_load_errors`), their aggregation and the scheduler's
//! [`update_connector_output`](KvConnectorScheduler::update_connector_output). The crate docs
//! show the whole loop around it.

use crate::error::Result;
use crate::scheduler::aggregate::WorkerOutput;
use crate::scheduler::ConnectorOutput;
use crate::scheduler::KvConnectorScheduler;
use crate::worker::KvConnectorWorker;

impl KvConnectorScheduler {
    /// Runs the connector's part of one engine step with `workers`, every TP rank of this
    /// engine in this process, in rank order or not (vLLM's `EngineCore.step` around
    /// `execute_model`: `build_connector_meta`, each worker's `start_load_kv`, then
    /// `KVOutputAggregator.aggregate` of their outputs and `update_connector_output`).
    /// Returns the prefill requests whose blocks to free now and how decode loads ended.
    ///
    /// With workers in other processes, run the same steps with the MessagePack of
    /// [`ConnectorMetadata::to_msgpack`](crate::ConnectorMetadata::to_msgpack) and
    /// [`WorkerOutput::to_msgpack`] in between.
    ///
    /// # Errors
    /// Those of [`update_connector_output`](Self::update_connector_output): `workers` is not
    /// one worker of each rank below this engine's TP size.
    pub fn step(&mut self, workers: &[KvConnectorWorker]) -> Result<ConnectorOutput> {
        let meta = self.build_connector_meta();
        for worker in workers {
            worker.start_load_kv(&meta);
        }
        let outputs: Vec<WorkerOutput> = workers.iter().map(KvConnectorWorker::output).collect();
        self.update_connector_output(&outputs)
    }
}

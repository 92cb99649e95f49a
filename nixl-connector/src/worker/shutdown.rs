//! A worker's clean end: [`KvConnectorWorker::shutdown`].

use super::KvConnectorWorker;

impl KvConnectorWorker {
    /// Shuts the worker down and destroys its NIXL agent before it returns (vLLM's
    /// `NixlConnectorWorker.shutdown`): stops the side channel and the notification
    /// listener, withdraws the published metadata (as dropping it does), then waits for the
    /// loads still running to end (each is done, failed or past `transfer_timeout`; a READ
    /// posted cannot be recalled, and its blocks stay registered until NIXL ends it) and for
    /// the agent to be destroyed. After it, nothing of this worker runs on the runtime, so
    /// the program may call `std::process::exit` at once.
    ///
    /// A READ still in flight past `transfer_timeout` stays NIXL's until the peer completes
    /// or fails it, and holds the agent until then: against a peer that does neither,
    /// `shutdown` waits as long. Bound it with `tokio::time::timeout` where that matters;
    /// the agent is then destroyed when the READ ends, or left to the process if it exits
    /// first.
    ///
    /// A push load whose blocks a prefill may still write waits likewise: its prefill
    /// ranks' ends are still taken, and the rank's side channel still answers (a prefill
    /// rank handshakes to answer), until it ends, at the latest once they answer the cancel
    /// sent past `push_registration_timeout`.
    ///
    /// Dropping the worker instead destroys the agent later, on a runtime thread, once the
    /// last load has ended; a process that exits meanwhile leaves that agent to the exit
    /// (see the crate's README, "Shutting down").
    pub async fn shutdown(self) {
        let (destroyed, agent_gone) = tokio::sync::oneshot::channel();
        self.agent().on_destroyed(move || {
            let _ = destroyed.send(());
        });
        let tasks: Vec<_> = self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for task in &tasks {
            task.abort();
        }
        // Each resolves once its future (holding the agent's notification stream, or the
        // side channel's listener) is dropped.
        for task in tasks {
            let _ = task.await;
        }
        let engine = self.shared.config.engine_id.clone();
        let rank = self.shared.config.tp_rank;
        drop(self);
        // Err: the agent was left to an exiting process (nixl's exit guard).
        if agent_gone.await.is_ok() {
            tracing::debug!(%engine, rank, "connector worker shut down, its agent destroyed");
        }
    }
}

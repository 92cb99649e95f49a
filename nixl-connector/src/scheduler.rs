//! The scheduler half: which requests load KV from a remote prefill, which keep their
//! blocks for a remote decode, and the params handed between the engines.
//!
//! # Delayed freeing
//! A prefill request whose KV a remote decode will read is finished with
//! [`RequestFinished::delay_free_blocks`] set: the engine keeps its blocks until the worker
//! reports the request in [`Finished::sending`](crate::Finished::sending). The worker
//! reports it when the decode's NIXL notification arrives (one per decode rank reading from
//! this rank), or, if none arrives, once the **abort timeout** has passed since the request
//! finished ([`SchedulerConfig::abort_timeout`], default [`DEFAULT_ABORT_TIMEOUT`]) — so a
//! decode that dies or never reads cannot pin blocks forever. A decode that reads after the
//! timeout may read reused blocks; set the timeout above any decode queueing delay.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::params::{KvTransferParams, RemoteBlocks};

/// Default abort timeout (vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` is also 480 s).
pub const DEFAULT_ABORT_TIMEOUT: Duration = Duration::from_secs(480);

/// The scheduler's settings: this engine's identity as decodes will reach it.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// This engine's id.
    pub engine_id: String,
    /// Host decodes reach this engine's side channel at.
    pub host: String,
    /// Side-channel port of TP rank 0.
    pub port: u16,
    /// This engine's TP size.
    pub tp_size: usize,
    /// How long a finished prefill request keeps its blocks without a decode notification.
    pub abort_timeout: Duration,
}

/// One load for the workers: read `remote` into `local_block_ids`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSpec {
    /// The local request id.
    pub request_id: String,
    /// Local blocks, paired in order with `remote.block_ids`.
    pub local_block_ids: Vec<usize>,
    /// Where to read.
    pub remote: RemoteBlocks,
}

/// One request whose blocks wait for a decode: freed on its notification or at `deadline`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendSpec {
    /// The request id (the notification names it).
    pub request_id: String,
    /// When the blocks are freed without a notification.
    pub deadline: Instant,
}

/// What the scheduler hands its workers each step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectorMetadata {
    /// Loads to start.
    pub loads: Vec<LoadSpec>,
    /// Requests to hold for a decode.
    pub sends: Vec<SendSpec>,
}

/// The answer to [`KvConnectorScheduler::request_finished`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFinished {
    /// Keep the blocks until the workers report the request done sending.
    pub delay_free_blocks: bool,
    /// Params for the decode engine, when a remote decode will read this request.
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// The scheduler half of the connector.
#[derive(Debug)]
pub struct KvConnectorScheduler {
    config: SchedulerConfig,
    loads: HashMap<String, LoadSpec>,
    sends: HashMap<String, SendSpec>,
}

impl KvConnectorScheduler {
    /// A scheduler for an engine with `config`.
    pub fn new(config: SchedulerConfig) -> Self {
        KvConnectorScheduler {
            config,
            loads: HashMap::new(),
            sends: HashMap::new(),
        }
    }

    /// Whether a new request needs its KV from a remote prefill.
    pub fn needs_remote_prefill(params: Option<&KvTransferParams>) -> bool {
        params.is_some_and(|p| p.do_remote_prefill)
    }

    /// Records that `request_id` got `local_block_ids` and must load them from the remote
    /// prefill `params` names; the load goes out with the next
    /// [`build_connector_meta`](Self::build_connector_meta).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `params` lack a remote field or pair a different
    /// number of blocks.
    pub fn update_state_after_alloc(
        &mut self,
        request_id: &str,
        local_block_ids: &[usize],
        params: &KvTransferParams,
    ) -> Result<()> {
        const OP: &str = "schedule a remote prefill";
        let remote = params.remote_blocks().ok_or_else(|| {
            Error::invalid(OP, format!("request {request_id:?}: kv_transfer_params lack remote_engine_id, remote_host, remote_port, remote_request_id or remote_tp_size"))
        })?;
        if remote.block_ids.len() != local_block_ids.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "request {request_id:?}: {} remote blocks for {} local blocks",
                    remote.block_ids.len(),
                    local_block_ids.len()
                ),
            ));
        }
        self.loads.insert(
            request_id.to_string(),
            LoadSpec {
                request_id: request_id.to_string(),
                local_block_ids: local_block_ids.to_vec(),
                remote,
            },
        );
        Ok(())
    }

    /// A request finished on this engine. When a remote decode will read it
    /// (`do_remote_decode`), its blocks are kept (see the module docs) and the params for
    /// the decode are returned.
    pub fn request_finished(
        &mut self,
        request_id: &str,
        block_ids: &[usize],
        params: Option<&KvTransferParams>,
    ) -> RequestFinished {
        self.loads.remove(request_id);
        if !params.is_some_and(|p| p.do_remote_decode) {
            return RequestFinished {
                delay_free_blocks: false,
                kv_transfer_params: None,
            };
        }
        self.sends.insert(
            request_id.to_string(),
            SendSpec {
                request_id: request_id.to_string(),
                deadline: Instant::now() + self.config.abort_timeout,
            },
        );
        RequestFinished {
            delay_free_blocks: !block_ids.is_empty(),
            kv_transfer_params: Some(KvTransferParams {
                do_remote_prefill: true,
                do_remote_decode: false,
                remote_engine_id: Some(self.config.engine_id.clone()),
                remote_host: Some(self.config.host.clone()),
                remote_port: Some(self.config.port),
                remote_block_ids: block_ids.to_vec(),
                remote_request_id: Some(request_id.to_string()),
                remote_tp_size: Some(self.config.tp_size),
            }),
        }
    }

    /// Takes everything scheduled since the last call, for the workers.
    pub fn build_connector_meta(&mut self) -> ConnectorMetadata {
        ConnectorMetadata {
            loads: self.loads.drain().map(|(_, load)| load).collect(),
            sends: self.sends.drain().map(|(_, send)| send).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduler() -> KvConnectorScheduler {
        KvConnectorScheduler::new(SchedulerConfig {
            engine_id: "p".into(),
            host: "10.0.0.1".into(),
            port: 5600,
            tp_size: 2,
            abort_timeout: Duration::from_secs(3),
        })
    }

    #[test]
    fn a_prefill_request_for_a_remote_decode_keeps_its_blocks_and_hands_its_params() {
        let mut s = scheduler();
        let params = KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        };
        let before = Instant::now();
        let done = s.request_finished("r", &[3, 4], Some(&params));
        assert!(done.delay_free_blocks);
        let handed = done.kv_transfer_params.unwrap();
        assert!(handed.do_remote_prefill && !handed.do_remote_decode);
        let remote = handed.remote_blocks().unwrap();
        assert_eq!(
            (remote.engine_id.as_str(), remote.host.as_str(), remote.port),
            ("p", "10.0.0.1", 5600)
        );
        assert_eq!(
            (remote.block_ids, remote.request_id.as_str(), remote.tp_size),
            (vec![3, 4], "r", 2)
        );
        let meta = s.build_connector_meta();
        assert_eq!(meta.sends.len(), 1);
        assert!(meta.sends[0].deadline >= before + Duration::from_secs(3));
        assert!(
            s.build_connector_meta().sends.is_empty(),
            "handed over once"
        );

        let plain = s.request_finished("q", &[1], None);
        assert!(!plain.delay_free_blocks && plain.kv_transfer_params.is_none());
    }

    #[test]
    fn a_decode_request_loads_from_the_params_or_is_refused_clearly() {
        let mut s = scheduler();
        let mut params = scheduler()
            .request_finished(
                "r",
                &[3, 4],
                Some(&KvTransferParams {
                    do_remote_decode: true,
                    ..Default::default()
                }),
            )
            .kv_transfer_params
            .unwrap();
        assert!(KvConnectorScheduler::needs_remote_prefill(Some(&params)));
        let err = s
            .update_state_after_alloc("d", &[0], &params)
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 remote blocks for 1 local blocks"), "{err}");
        s.update_state_after_alloc("d", &[0, 1], &params).unwrap();
        let meta = s.build_connector_meta();
        assert_eq!(meta.loads.len(), 1);
        assert_eq!(meta.loads[0].local_block_ids, [0, 1]);
        params.remote_host = None;
        let err = s
            .update_state_after_alloc("e", &[0, 1], &params)
            .unwrap_err()
            .to_string();
        assert!(err.contains("lack remote_engine_id, remote_host"), "{err}");
    }
}

//! A connector built without the `vllm` feature refuses vLLM's protocol when a worker is
//! created, whether the `kv_transfer_config` or the [`WorkerConfig`] asks for it.

use nixl::kv_config::KvTransferConfig;

use crate::config::{Protocol, WorkerConfig};
use crate::error::Error;
use crate::worker::KvConnectorWorker;

/// The reason a worker for `config` was refused; panics if it was not.
fn refusal(config: WorkerConfig) -> String {
    match KvConnectorWorker::new(config) {
        Err(Error::InvalidArgument { operation, reason }) => {
            assert_eq!(operation, "create the connector worker");
            reason
        }
        Err(other) => panic!("expected InvalidArgument, got {other}"),
        Ok(_) => panic!("a worker in vLLM mode was created without the vllm feature"),
    }
}

#[tokio::test]
async fn vllm_mode_from_the_kv_transfer_config_is_refused() {
    let kv = KvTransferConfig::from_json(r#"{"kv_connector_extra_config":{"protocol":"vllm"}}"#)
        .unwrap();
    let reason = refusal(WorkerConfig::new("e", 0, 1, kv));
    assert!(reason.contains("\"vllm\" feature"), "{reason}");
    assert!(reason.contains("native protocol"), "{reason}");
}

#[tokio::test]
async fn vllm_mode_from_the_worker_config_is_refused() {
    let mut config = WorkerConfig::new("e", 0, 1, KvTransferConfig::default());
    config.protocol = Some(Protocol::Vllm);
    let reason = refusal(config);
    assert!(reason.contains("\"vllm\" feature"), "{reason}");
}

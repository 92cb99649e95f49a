//! Worker settings a caller chooses: the agent's name (and what the worker reports of its
//! setup), and the agent settings `kv_connector_extra_config` carries.

mod common;

#[tokio::test]
async fn a_chosen_agent_name_is_the_agents() {
    let worker = common::worker_with("named", 0, 1, &common::spec(2), |config| {
        config.agent_name = Some("prefill-chosen-7".into());
    });
    assert_eq!(worker.agent().name(), "prefill-chosen-7");
    assert_eq!(worker.handshake().unwrap().agent_name, "prefill-chosen-7");
    assert_eq!(worker.mem_type(), nixl::MemType::Dram);
    let backends: Vec<_> = worker.backends().iter().map(|b| b.plugin()).collect();
    assert_eq!(backends, ["UCX"]);
}

#[tokio::test]
async fn refuse_same_host_transports_comes_from_the_extra_config() {
    let default = common::worker_with("same-host-default", 0, 1, &common::spec(2), |_| {});
    assert!(!default.agent().config().refuse_same_host_transports);
    let strict = common::worker_with("same-host-strict", 0, 1, &common::spec(2), |config| {
        config
            .kv_transfer_config
            .kv_connector_extra_config
            .insert("refuse_same_host_transports".into(), true.into());
    });
    assert!(strict.agent().config().refuse_same_host_transports);
}

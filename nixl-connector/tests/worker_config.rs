//! Worker settings a caller chooses: the agent's name (and what the worker reports of its
//! setup).

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

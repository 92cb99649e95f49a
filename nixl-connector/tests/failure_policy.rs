//! The kv_load_failure_policy with a prefill process killed mid-load: under `recompute` a
//! request whose load failed comes back with exactly its failed blocks to compute locally,
//! under `fail` it fails with the reason; `load_errors` gives each failed block its reason.

mod common;
mod prefill_process;

use std::time::{Duration, Instant};

use common::{block, pattern, spec, worker, worker_with};
use nixl::kv_config::KvTransferConfig;
use nixl_connector::{
    FailureKind, KvConnectorScheduler, KvConnectorWorker, KvTransferParams, LoadOutcome,
    SchedulerConfig,
};

const ROLE_ENV: &str = "NIXL_CONNECTOR_TEST_POLICY_PREFILL";

/// The prefill, run in a child process: fills its cache, prints its port, waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill of the policy tests, which start it"]
async fn policy_prefill_role() {
    prefill_process::serve("pf-policy", ROLE_ENV).await;
}

/// Params of prefill request `request` in `blocks` on the prefill at `port`.
fn params(port: u16, request: &str, blocks: &[usize]) -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: true,
        remote_engine_id: Some("pf-policy".into()),
        remote_host: Some("127.0.0.1".into()),
        remote_port: Some(port),
        remote_block_ids: blocks.to_vec(),
        remote_request_id: Some(request.into()),
        remote_tp_size: Some(1),
        ..Default::default()
    }
}

/// Loads one request before killing the prefill, one as it is killed and one after, under
/// `policy`; returns the outcomes of the last two by request id.
async fn killed_mid_load(policy: &str) -> Vec<LoadOutcome> {
    common::init_tracing();
    let (mut child, port) = prefill_process::start("policy_prefill_role", ROLE_ENV);
    let spec = spec(2);
    let kv = KvTransferConfig::from_json(&format!(
        r#"{{"kv_buffer_device":"cpu","kv_load_failure_policy":"{policy}"}}"#
    ))
    .unwrap();
    let decode = worker_with("dc-policy", 0, 1, &spec, |c| {
        c.kv_transfer_config = kv.clone();
        c.transfer_timeout = Duration::from_secs(8);
    });
    let config = SchedulerConfig::new("dc-policy", "127.0.0.1", 0, 1, &kv).unwrap();
    let mut scheduler = KvConnectorScheduler::new(config);
    let step = |scheduler: &mut KvConnectorScheduler| {
        decode.start_load_kv(&scheduler.build_connector_meta());
    };
    scheduler.on_new_request("first", Some(&params(port, "p1", &[4, 5])));
    scheduler
        .update_state_after_alloc("first", &[0, 1], &params(port, "p1", &[4, 5]))
        .unwrap();
    step(&mut scheduler);
    assert_eq!(
        outcomes(&decode, &mut scheduler, 1).await,
        [LoadOutcome::Loaded {
            request_id: "first".into()
        }]
    );
    let want: Vec<u8> = (0..spec.block_len(0)).map(|o| pattern(1, 5, o)).collect();
    assert_eq!(block(&decode, &spec, 1, 1), want);

    scheduler.on_new_request("during", Some(&params(port, "p2", &[6, 7, 8])));
    scheduler
        .update_state_after_alloc("during", &[2, 3, 4], &params(port, "p2", &[6, 7, 8]))
        .unwrap();
    step(&mut scheduler);
    child.kill().unwrap();
    child.wait().unwrap();
    scheduler.on_new_request("after", Some(&params(port, "p3", &[9, 10, 11])));
    scheduler
        .update_state_after_alloc("after", &[10, 12, 14], &params(port, "p3", &[9, 10, 11]))
        .unwrap();
    step(&mut scheduler);
    let got = outcomes(&decode, &mut scheduler, 2).await;
    // The load posted as the prefill died may have finished first: then its bytes are right.
    if let LoadOutcome::Loaded { .. } = outcome_of(&got, "during") {
        let want: Vec<u8> = (0..spec.block_len(0)).map(|o| pattern(2, 8, o)).collect();
        assert_eq!(block(&decode, &spec, 2, 4), want);
    }
    got
}

/// Steps the decode until its scheduler reports `n` outcomes (20 s at most), checking that
/// every failed block has a reason.
async fn outcomes(
    decode: &KvConnectorWorker,
    scheduler: &mut KvConnectorScheduler,
    n: usize,
) -> Vec<LoadOutcome> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < n && start.elapsed() < Duration::from_secs(20) {
        let output = decode.output();
        for failed in &output.load_errors {
            assert!(!failed.reason.is_empty(), "{failed}");
            assert_ne!(failed.kind, FailureKind::Invalid, "{failed}");
        }
        got.extend(
            scheduler
                .update_connector_output(&[output])
                .unwrap()
                .load_outcomes,
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    got
}

/// The outcome for request `id`.
fn outcome_of<'a>(outcomes: &'a [LoadOutcome], id: &str) -> &'a LoadOutcome {
    outcomes
        .iter()
        .find(|o| format!("{o:?}").contains(&format!("\"{id}\"")))
        .unwrap_or_else(|| panic!("no outcome for {id}: {outcomes:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recompute_hands_back_exactly_the_failed_blocks_of_a_killed_prefill() {
    let got = killed_mid_load("recompute").await;
    match outcome_of(&got, "after") {
        LoadOutcome::Recompute {
            block_ids, reason, ..
        } => {
            assert_eq!(block_ids, &[10, 12, 14]);
            assert!(reason.contains("failure"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    match outcome_of(&got, "during") {
        LoadOutcome::Loaded { .. } => {}
        LoadOutcome::Recompute { block_ids, .. } => assert_eq!(block_ids, &[2, 3, 4]),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_fails_the_request_of_a_killed_prefill_with_the_reason() {
    let got = killed_mid_load("fail").await;
    match outcome_of(&got, "after") {
        LoadOutcome::Failed { reason, .. } => assert!(reason.contains("failure"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        outcome_of(&got, "during"),
        LoadOutcome::Loaded { .. } | LoadOutcome::Failed { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_failed_block_carries_its_request_kind_and_reason() {
    common::init_tracing();
    let spec = spec(2);
    let decode = worker("dc-reasons", 0, 1, &spec);
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let kv = common::cpu_config();
    let mut scheduler = KvConnectorScheduler::new(
        SchedulerConfig::new("dc-reasons", "127.0.0.1", 0, 1, &kv).unwrap(),
    );
    scheduler.on_new_request("gone", Some(&params(port, "p", &[1, 2])));
    scheduler
        .update_state_after_alloc("gone", &[5, 3], &params(port, "p", &[1, 2]))
        .unwrap();
    decode.start_load_kv(&scheduler.build_connector_meta());
    let start = Instant::now();
    let mut errors = Vec::new();
    while errors.is_empty() && start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
        errors = decode.load_errors();
    }
    assert_eq!(errors, [3, 5], "sorted by block id");
    for failed in &errors {
        assert_eq!(failed.request_id, "gone");
        assert_eq!(failed.kind, FailureKind::Handshake);
        assert!(
            failed.reason.contains("connect to the side channel"),
            "{failed}"
        );
        assert!(failed.to_string().contains("handshake failure"), "{failed}");
    }
}

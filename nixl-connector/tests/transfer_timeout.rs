//! `transfer_timeout`: a load whose READ is still in flight when it passes is reported
//! overdue at once (`overdue_loads`, its blocks still the connector's), and fails with
//! `Error::TransferTimeout`, exactly its blocks in `load_errors`, only once NIXL has ended
//! the READ: until then NIXL may still write the blocks (#30 item 2). Meanwhile the
//! engine's other requests keep their leases: heartbeats still reach it. The source is an
//! in-process prefill whose agent makes no progress until polled, or a prefill process
//! stopped (SIGSTOP) mid-READ and resumed.

mod common;
mod prefill_process;

use std::time::{Duration, Instant};

use common::{
    all_threads_stopped, block, fill, handshake, pattern, poll_until, progress_until, remote,
    signal, spec, stalled_worker, wait_for, worker_with, WAIT,
};
use nixl_connector::{ConnectorMetadata, Error, HeartbeatSpec, KvConnectorWorker, OverdueLoad};

/// Waits until `decode` reports overdue loads, and returns them.
async fn overdue(decode: &KvConnectorWorker) -> Vec<OverdueLoad> {
    let mut overdue = Vec::new();
    wait_for("a load to be reported overdue", WAIT, || {
        overdue.extend(decode.overdue_loads());
        !overdue.is_empty()
    })
    .await;
    overdue
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_past_the_transfer_timeout_fails_its_load_once_it_ends() {
    common::init_tracing();
    const TIMEOUT: Duration = Duration::from_millis(500);
    let spec = spec(2);
    // The prefill's agent makes no progress until polled: the READ cannot finish.
    let prefill = stalled_worker("pf-stalled", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker_with("dc-timeout", 0, 1, &spec, |c| c.transfer_timeout = TIMEOUT);
    handshake(
        &decode,
        "pf-stalled",
        prefill.side_channel_addr().unwrap().port(),
    )
    .await;

    decode
        .start_load(
            "late",
            &[1, 2],
            &remote(&prefill, "pf-stalled", "late", vec![5, 6], 1),
        )
        .unwrap();
    assert_eq!(
        overdue(&decode).await,
        [OverdueLoad {
            request_id: "late".into(),
            remote_engine: "pf-stalled".into(),
            block_ids: vec![1, 2],
            deadline: TIMEOUT,
        }]
    );
    // The READ is never given up, and while it is in flight the load has no outcome.
    tokio::time::sleep(TIMEOUT).await;
    let agent = decode.agent();
    assert_eq!(agent.driver_stats().held, 1, "{:?}", agent.driver_stats());
    assert!(decode.finished().recving.is_empty(), "no outcome yet");
    assert!(decode.load_errors().is_empty(), "no blocks handed back yet");

    // Once the prefill progresses the READ finishes, and only then the load fails with the
    // timeout (nothing leaked).
    let mut done = Vec::new();
    progress_until(
        &prefill,
        "the overdue READ to finish and its load to end",
        || {
            done.extend(decode.finished().recving);
            !done.is_empty()
        },
    )
    .await;
    assert_eq!(done, ["late"]);
    assert_eq!(agent.driver_stats().held, 0, "{:?}", agent.driver_stats());
    assert_eq!(decode.load_errors(), [1, 2]);
    let metrics = decode.metrics();
    let timeout = Error::TransferTimeout {
        request_id: "late".to_string(),
        deadline: TIMEOUT,
    };
    assert_eq!(
        metrics[0].failure.as_deref(),
        Some(timeout.to_string().as_str())
    );
    assert!(metrics[0].duration >= TIMEOUT, "{:?}", metrics[0].duration);
    assert_eq!(agent.leak_stats(), nixl::LeakStats::default());
    assert!(decode.overdue_loads().is_empty(), "reported once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_still_reach_an_engine_whose_read_passed_the_timeout() {
    // Found by the chaos soak: a READ past the timeout has its remote rank handshaken again,
    // and the heartbeats of the engine's waiting requests were dropped until that handshake
    // ended; a prefill slow to answer it (stopped, here making no progress) then ended
    // their leases and reused their blocks before the decode read them.
    common::init_tracing();
    const ENGINE: &str = "pf-hb-overdue";
    const TIMEOUT: Duration = Duration::from_millis(200);
    let spec = spec(2);
    let prefill = stalled_worker(ENGINE, 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker_with("dc-hb-overdue", 0, 1, &spec, |c| {
        c.transfer_timeout = TIMEOUT
    });
    let port = prefill.side_channel_addr().unwrap().port();
    handshake(&decode, ENGINE, port).await;
    let late = remote(&prefill, ENGINE, "late", vec![5, 6], 1);
    decode.start_load("late", &[1, 2], &late).unwrap();
    overdue(&decode).await;
    // A request that a decode request still waits for (no blocks for it yet). From now on
    // the prefill's agent progresses, as it takes notifications.
    prefill.hold_for_decode(
        "p-waiting",
        Instant::now() + Duration::from_secs(60),
        Some(&common::capability()),
    );

    // One step's heartbeat for the waiting request: it goes at once, to the agent the last
    // handshake loaded, while the rank is handshaken again.
    decode.start_load_kv(&ConnectorMetadata {
        heartbeats: vec![HeartbeatSpec {
            engine_id: ENGINE.into(),
            host: "127.0.0.1".into(),
            port,
            tp_size: 1,
            pp_size: 1,
            dcp_size: 1,
            request_ids: vec!["p-waiting".into()],
            capabilities: vec![Some(common::capability())],
        }],
        ..ConnectorMetadata::default()
    });
    progress_until(
        &prefill,
        "the heartbeat to extend the waiting lease",
        || prefill.notification_stats().leases_extended == 1,
    )
    .await;
    // The overdue READ ends, and with it the load (its blocks handed back only then).
    let mut done = Vec::new();
    progress_until(&prefill, "the overdue load to end", || {
        done.extend(decode.finished().recving);
        !done.is_empty()
    })
    .await;
    assert_eq!(done, ["late"]);
    assert_eq!(decode.load_errors(), [1, 2]);
}

const ROLE_ENV: &str = "NIXL_CONNECTOR_TEST_OVERDUE_PREFILL";
/// The engine of the prefill process.
const PREFILL: &str = "pf-overdue";
/// The transfer timeout of the decode reading from the prefill process.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(1);

/// The prefill of the process test, run in a child process: fills its cache, prints its
/// port, waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill of the test here, which starts it"]
async fn prefill_role() {
    prefill_process::serve(PREFILL, ROLE_ENV).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_past_its_timeout_keeps_its_blocks_until_nixl_ends_it() {
    let (mut child, port) = prefill_process::start("prefill_role", ROLE_ENV);
    common::init_tracing();
    let spec = spec(2);
    let decode = worker_with("dc-overdue", 0, 1, &spec, |c| {
        c.transfer_timeout = PROCESS_TIMEOUT
    });
    let mut from = remote(&decode, PREFILL, "first", vec![4, 5], 1);
    from.port = port;
    // A first load handshakes (a stopped prefill could not answer) and reads.
    decode.start_load("first", &[0, 1], &from).unwrap();
    let done = poll_until(&decode, WAIT, |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["first"]);
    assert!(decode.load_errors().is_empty());
    decode.metrics();

    // The prefill stops; the next READ from it cannot end.
    signal(&child, libc::SIGSTOP);
    wait_for("the prefill to stop", WAIT, || all_threads_stopped(&child)).await;
    from.request_id = "late".to_string();
    from.block_ids = vec![6, 7];
    decode.start_load("late", &[2, 3], &from).unwrap();
    assert_eq!(
        overdue(&decode).await,
        [OverdueLoad {
            request_id: "late".into(),
            remote_engine: PREFILL.into(),
            block_ids: vec![2, 3],
            deadline: PROCESS_TIMEOUT,
        }]
    );
    // Well past the timeout, the READ is still in flight: no outcome, the blocks are not
    // the engine's.
    tokio::time::sleep(2 * PROCESS_TIMEOUT).await;
    assert!(
        decode.agent().driver_stats().held >= 1,
        "the READ in flight"
    );
    assert!(decode.finished().recving.is_empty(), "no outcome yet");
    assert!(decode.load_errors().is_empty(), "no blocks handed back yet");
    assert!(decode.overdue_loads().is_empty(), "reported once");

    // The prefill resumes: the READ ends, its bytes in the blocks, and only then the load's
    // outcome: the timeout, with exactly its blocks.
    signal(&child, libc::SIGCONT);
    let done = poll_until(&decode, WAIT, |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["late"]);
    assert_eq!(decode.load_errors(), [2, 3]);
    let failure = decode.metrics()[0]
        .failure
        .clone()
        .expect("the load failed");
    assert!(failure.contains("did not complete within 1s"), "{failure}");
    for layer in 0..spec.num_regions() {
        for (local, far) in [(2, 6), (3, 7)] {
            let want: Vec<u8> = (0..spec.block_len(layer))
                .map(|o| pattern(layer, far, o))
                .collect();
            assert!(
                block(&decode, &spec, layer, local) == want,
                "layer {layer} block {local}: the READ's bytes landed before its outcome"
            );
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

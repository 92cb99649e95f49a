//! A prefill process killed after its first load: the next load fails in NIXL itself
//! (`Error::Nixl`, well inside its transfer timeout), and exactly its blocks appear in
//! `load_errors`; the dead remote is forgotten, so the load after it handshakes again.
//! A prefill killed while a READ from it is in flight fails that READ in NIXL's status
//! poll, reported the same way (not as the transfer timeout).

mod common;
mod prefill_process;

use std::time::Duration;

use common::{block, pattern, poll_until, remote, spec, wait_for, worker_with, WAIT};
use nixl_connector::{KvCacheSpec, KvConnectorWorker, RemoteBlocks};

const ROLE_ENV: &str = "NIXL_CONNECTOR_TEST_PREFILL_ROLE";
/// The engine of the prefill process.
const PREFILL: &str = "pf-killed";

/// The tests here run one at a time: an agent another test creates meanwhile changes this
/// process's UCX workers, and the `nixl` crate then checks the dead prefill's loaded
/// metadata again at the next request, refusing it (its process is gone) before NIXL's
/// own post can fail it, which is what these tests assert.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The prefill, run in a child process: fills its cache, prints its port, waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill of the tests here, which start it"]
async fn prefill_role() {
    prefill_process::serve(PREFILL, ROLE_ENV).await;
}

/// A decode worker `engine` (tracing started, an 8 s transfer timeout) with the cache of
/// [`spec`]`(2)`, and request `request`'s blocks 4 and 5 of the prefill process whose side
/// channel is on `port`.
fn decode_of(
    engine: &str,
    port: u16,
    request: &str,
) -> (KvCacheSpec, KvConnectorWorker, RemoteBlocks) {
    common::init_tracing();
    let spec = spec(2);
    let decode = worker_with(engine, 0, 1, &spec, |c| {
        c.transfer_timeout = Duration::from_secs(8)
    });
    let mut from = remote(&decode, PREFILL, request, vec![4, 5], 1);
    from.port = port;
    (spec, decode, from)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_from_a_killed_prefill_reports_exactly_its_blocks() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let (mut child, port) = prefill_process::start("prefill_role", ROLE_ENV);
    let (spec, decode, mut from) = decode_of("dc-killed", port, "first");

    decode.start_load("first", &[0, 1], &from).unwrap();
    let done = poll_until(&decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["first"]);
    assert!(decode.load_errors().is_empty());
    let want: Vec<u8> = (0..spec.block_len(0)).map(|o| pattern(2, 5, o)).collect();
    assert_eq!(block(&decode, &spec, 2, 1), want);
    decode.metrics();

    child.kill().unwrap();
    child.wait().unwrap();
    from.block_ids = vec![6, 7, 8];
    from.request_id = "second".to_string();
    decode.start_load("second", &[10, 12, 14], &from).unwrap();
    let done = poll_until(&decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["second"]);
    assert_eq!(decode.load_errors(), [10, 12, 14]);
    let metrics = decode.metrics();
    let failure = metrics[0].failure.clone().expect("the load failed");
    // The dead prefill fails this READ at its post.
    assert_failed_in_nixl(&failure);
    assert_eq!(metrics[0].descriptors, 3 * spec.num_regions());

    // The failed remote is forgotten: the next load handshakes again, and is refused.
    from.request_id = "third".to_string();
    decode.start_load("third", &[1, 2, 3], &from).unwrap();
    poll_until(&decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
    assert_eq!(decode.load_errors(), [1, 2, 3]);
    let failure = decode.metrics()[0].failure.clone().unwrap();
    assert!(
        failure.contains("handshake") && failure.contains("connect"),
        "{failure}"
    );
}

/// Error::Nixl's message (a handshake failure or the transfer timeout reads otherwise): NIXL's
/// backend failed the READ.
fn assert_failed_in_nixl(failure: &str) {
    assert!(
        failure.starts_with("NIXL: ") && failure.ends_with("NIXL returned backend error (-2)"),
        "failed in NIXL: {failure}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_in_flight_when_its_prefill_dies_fails_in_nixl() {
    let _alone = ONE_AT_A_TIME.lock().await;
    // The prefill's agent never progresses, so the READ stays in flight until it dies.
    let (mut child, port) = prefill_process::start_stalled("prefill_role", ROLE_ENV);
    let (_, decode, from) = decode_of("dc-killed-mid", port, "mid");
    decode.start_load("mid", &[0, 1], &from).unwrap();
    // Posted and in flight: NIXL's completion driver holds the READ.
    let agent = decode.agent();
    wait_for("the READ to be in flight", WAIT, || {
        agent.driver_stats().held >= 1
    })
    .await;

    child.kill().unwrap();
    child.wait().unwrap();
    let done = poll_until(&decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["mid"]);
    assert_eq!(decode.load_errors(), [0, 1]);
    let failure = decode.metrics()[0]
        .failure
        .clone()
        .expect("the load failed");
    assert_failed_in_nixl(&failure);
}

//! What `KvConnectorWorker` promises its caller: `new` needs a tokio runtime and a rank
//! below the TP size; `start_load` refuses bad arguments without recording anything, and a
//! load pairing more local blocks than the remote tokens fill fails once they are known;
//! `load_ended` wakes once per batch of ended loads, with the news already in `finished`;
//! decode notifications that arrive before `hold_for_decode` release the request the
//! moment it is held; and a worker dropped with loads in flight frees nothing NIXL may
//! still write, and leaks nothing once NIXL is done.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use nixl::platform::BuiltinPlatform;
use nixl_connector::{Error, KvConnectorWorker, WorkerConfig};

use common::{
    cpu_config, fill, filled_prefill_and_decode, handshake, poll_until, progress_until, remote,
    spec, stalled_worker, wait_for, worker, Tracked, WAIT,
};

fn config(engine: &str, rank: usize, tp: usize) -> WorkerConfig {
    let mut config = WorkerConfig::new(engine, rank, tp, cpu_config());
    config.platform = Arc::new(BuiltinPlatform::CPU);
    config
}

/// The reason of an `Error::InvalidArgument`, or a panic naming what came instead.
fn invalid<T: std::fmt::Debug>(result: nixl_connector::Result<T>) -> String {
    match result {
        Err(Error::InvalidArgument { reason, .. }) => reason,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn a_worker_needs_a_runtime_and_a_rank_below_its_tp_size() {
    let outside = invalid(KvConnectorWorker::new(config("no-rt", 0, 1)));
    assert!(outside.contains("inside a tokio runtime"), "{outside}");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _inside = runtime.enter();
    for (rank, tp) in [(2, 2), (5, 2), (0, 0)] {
        let reason = invalid(KvConnectorWorker::new(config("bad-rank", rank, tp)));
        assert!(
            reason.contains(&format!("TP rank {rank} of TP size {tp}")),
            "{reason}"
        );
    }
    assert!(KvConnectorWorker::new(config("good-rank", 1, 2)).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_load_refuses_bad_arguments_and_records_nothing() {
    let spec = spec(2);
    let prefill = worker("pf-args", 0, 1, &spec);
    let from = |blocks: Vec<usize>| remote(&prefill, "pf-args", "r", blocks, 1);

    let unregistered = KvConnectorWorker::new(config("dc-unregistered", 0, 1)).unwrap();
    assert!(matches!(
        unregistered.start_load("r", &[0], &from(vec![0])),
        Err(Error::NotRegistered { .. })
    ));

    let decode = worker("dc-args", 0, 1, &spec);
    let reason = invalid(decode.start_load("r", &[3, spec.num_blocks], &from(vec![1, 2])));
    assert!(reason.contains("local block 16 of 16 blocks"), "{reason}");

    // A decode of TP 3 cannot read from a prefill of TP 2.
    let six_heads = common::spec_tp(6, 3);
    let tp3 = worker("dc-tp3", 0, 3, &six_heads);
    let mut tp2 = from(vec![1]);
    tp2.tp_size = 2;
    let reason = invalid(tp3.start_load("r", &[1], &tp2));
    assert!(
        reason.contains("cannot read from a peer of TP 2: one TP size must divide the other"),
        "{reason}"
    );
    // Rank 1 reads from the remote's rank 1, one port above rank 0's.
    let rank1 = worker("dc-rank1", 1, 2, &spec);
    let mut top = tp2.clone();
    top.port = u16::MAX;
    let reason = invalid(rank1.start_load("r", &[1], &top));
    assert!(
        reason.contains("port 65535 + rank 1 is past 65535"),
        "{reason}"
    );

    for worker in [&decode, &tp3, &rank1] {
        assert_eq!(worker.finished(), Default::default());
        assert!(worker.load_errors().is_empty() && worker.metrics().is_empty());
    }
}

/// How many local blocks a load may fill depends on the prefill's block size, known after
/// the handshake: more local blocks than the remote tokens fill is a failed load, with its
/// blocks in `load_errors` and nothing read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_local_blocks_than_the_remote_tokens_fill_fail_the_load() {
    let (_, prefill, decode) = filled_prefill_and_decode("pf-more", "dc-more");
    let from = remote(&prefill, "pf-more", "r", vec![1, 2], 1);
    decode.start_load("r", &[1, 2, 3], &from).unwrap();
    poll_until(&decode, WAIT, |f| !f.recving.is_empty()).await;
    assert_eq!(decode.load_errors(), [1, 2, 3]);
    let metrics = decode.metrics();
    let failure = metrics[0].failure.clone().unwrap();
    assert!(
        failure.contains("3 local blocks for 2 remote blocks"),
        "{failure}"
    );
    assert_eq!((metrics[0].bytes, metrics[0].descriptors), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_ended_wakes_once_per_batch_of_ended_loads() {
    let (_, prefill, decode) = filled_prefill_and_decode("pf-ended", "dc-ended");
    let from = |request: &str, block: usize| remote(&prefill, "pf-ended", request, vec![block], 1);
    assert!(
        decode.load_ended().now_or_never().is_none(),
        "nothing ended"
    );

    decode.start_load("one", &[0], &from("one", 4)).unwrap();
    tokio::time::timeout(WAIT, decode.load_ended())
        .await
        .unwrap();
    assert_eq!(decode.finished().recving, ["one"], "the news is there");
    assert!(decode.load_ended().now_or_never().is_none(), "woken once");

    // Two loads that end before anyone waits: one wake-up stands for both.
    decode.start_load("two", &[1], &from("two", 5)).unwrap();
    decode.start_load("three", &[2], &from("three", 6)).unwrap();
    let done = poll_until(&decode, WAIT, |f| f.recving.len() == 2).await;
    assert_eq!(done.recving.len(), 2);
    assert!(decode.load_ended().now_or_never().is_some());
    assert!(decode.load_ended().now_or_never().is_none());
    assert!(decode.load_errors().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_before_hold_for_decode_release_the_request_when_held() {
    let (_, prefill, decode) = filled_prefill_and_decode("pf-early-note", "dc-early-note");
    let far = Instant::now() + Duration::from_secs(600);
    let read = |request: &str, local: usize| {
        let from = remote(&prefill, "pf-early-note", request, vec![local + 8], 1);
        decode.start_load(request, &[local], &from).unwrap();
    };

    // Read and notified before the prefill listens for notifications at all: NIXL keeps
    // the message, and holding the request takes it.
    read("before-listening", 0);
    poll_until(&decode, WAIT, |f| !f.recving.is_empty()).await;
    prefill.hold_for_decode("before-listening", far, Some(&common::capability()));
    tokio::time::timeout(WAIT, prefill.notified())
        .await
        .unwrap();
    assert_eq!(prefill.finished().sending, ["before-listening"]);

    // Notified while the prefill listens but before it holds the request: counted, and
    // the request is released the moment it is held.
    read("before-held", 1);
    tokio::time::timeout(WAIT, prefill.notified())
        .await
        .unwrap();
    assert!(prefill.finished().sending.is_empty(), "nothing held yet");
    prefill.hold_for_decode("before-held", far, Some(&common::capability()));
    assert_eq!(prefill.finished().sending, ["before-held"]);

    let stats = prefill.send_stats();
    assert_eq!(
        (stats.freed_on_notification, stats.freed_on_timeout),
        (2, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dropped_with_loads_in_flight_frees_nothing_early_and_leaks_nothing() {
    let spec = spec(2);
    // The prefill's agent makes no progress until polled: the READs stay in flight.
    let prefill = stalled_worker("pf-drop", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = KvConnectorWorker::new(config("dc-drop", 0, 1)).unwrap();
    let layers = (0..spec.num_regions())
        .map(|_| vec![0u8; spec.region_len(0)])
        .collect();
    let (cache, freed) = Tracked::regions(layers);
    decode.register_kv_caches(cache, spec).unwrap();
    handshake(
        &decode,
        "pf-drop",
        prefill.side_channel_addr().unwrap().port(),
    )
    .await;
    for (i, request) in ["a", "b"].into_iter().enumerate() {
        let from = remote(&prefill, "pf-drop", request, vec![i], 1);
        decode.start_load(request, &[i], &from).unwrap();
    }
    let agent = decode.agent().clone();
    wait_for("both READs to be in flight", WAIT, || {
        agent.driver_stats().held >= 2
    })
    .await;

    drop(decode);
    // The prefill has not progressed, so the READs are in flight: whatever the drop set in
    // motion (given a moment to act) must not free the cache they write into.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !freed.load(Ordering::SeqCst),
        "the cache outlives its READs"
    );
    // The prefill progresses: the READs finish, and then the cache is freed.
    progress_until(&prefill, "the dropped worker's cache to be freed", || {
        freed.load(Ordering::SeqCst) && agent.driver_stats().held == 0
    })
    .await;
    assert_eq!(agent.leak_stats(), nixl::LeakStats::default());
}

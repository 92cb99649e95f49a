//! A request's lifecycle through both schedulers and workers, over real NIXL/UCX in one
//! process: prefix-cache hits on the decode, aborts on both sides, KV leases with
//! heartbeats, and hostile or racing notifications. Every test checks that no request is
//! freed twice and none is left held.

mod common;

use std::time::{Duration, Instant};

use common::{block, fill, pattern, poll_until, spec, worker, worker_with};
use nixl::kv_config::KvTransferConfig;
use nixl_connector::{
    FinishStatus, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvTransferParams,
    LoadOutcome, SchedulerConfig,
};

/// The longest any wait here may take (a guard against hangs).
const WAIT: Duration = Duration::from_secs(10);

/// A DRAM `kv_transfer_config` with a lease of `lease_s` seconds.
fn kv_with_lease(lease_s: f64) -> KvTransferConfig {
    let mut kv = common::cpu_config();
    kv.kv_connector_extra_config
        .insert("kv_lease_duration".into(), lease_s.into());
    kv
}

/// The scheduler of `worker`'s engine `engine`, with the lease and policy of `kv`.
fn scheduler(
    engine: &str,
    worker: &KvConnectorWorker,
    kv: &KvTransferConfig,
) -> KvConnectorScheduler {
    let port = worker.side_channel_addr().unwrap().port();
    KvConnectorScheduler::new(SchedulerConfig::new(engine, "127.0.0.1", port, 1, kv).unwrap())
}

/// A prefill engine: its worker (filled with the pattern) and scheduler, lease `lease_s`.
fn prefill(
    engine: &str,
    spec: &KvCacheSpec,
    lease_s: f64,
) -> (KvConnectorWorker, KvConnectorScheduler) {
    let kv = kv_with_lease(lease_s);
    let worker = worker_with(engine, 0, 1, spec, |c| c.kv_transfer_config = kv.clone());
    fill(&worker, spec);
    let scheduler = scheduler(engine, &worker, &kv);
    (worker, scheduler)
}

/// A prefill (lease `lease_s`) and a decode engine (default config), each with its worker
/// and scheduler, named after `tag`.
fn engines(
    tag: &str,
    spec: &KvCacheSpec,
    lease_s: f64,
) -> (
    KvConnectorWorker,
    KvConnectorScheduler,
    KvConnectorWorker,
    KvConnectorScheduler,
) {
    let (prefill, prefill_scheduler) = prefill(&format!("pf-{tag}"), spec, lease_s);
    let decode_engine = format!("dc-{tag}");
    let decode = worker(&decode_engine, 0, 1, spec);
    let decode_scheduler = scheduler(&decode_engine, &decode, &common::cpu_config());
    (prefill, prefill_scheduler, decode, decode_scheduler)
}

/// Finishes prefill request `request` in `blocks` for a remote decode, hands it to the
/// worker, and returns the params for the decode.
fn finish_for_decode(
    worker: &KvConnectorWorker,
    scheduler: &mut KvConnectorScheduler,
    request: &str,
    blocks: &[usize],
) -> KvTransferParams {
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let done = scheduler.request_finished(
        request,
        blocks,
        Some(&for_decode),
        FinishStatus::LengthCapped,
    );
    assert!(done.delay_free_blocks);
    worker.start_load_kv(&scheduler.build_connector_meta());
    done.kv_transfer_params.unwrap()
}

/// Whether every layer of local block `local` holds remote block `far`'s pattern.
fn holds(decode: &KvConnectorWorker, spec: &KvCacheSpec, local: usize, far: usize) -> bool {
    (0..spec.num_regions()).all(|layer| {
        let want: Vec<u8> = (0..spec.block_len(0))
            .map(|o| pattern(layer, far, o))
            .collect();
        block(decode, spec, layer, local) == want
    })
}

/// Whether local block `local` is still zero in every layer.
fn untouched(decode: &KvConnectorWorker, spec: &KvCacheSpec, local: usize) -> bool {
    (0..spec.num_regions()).all(|layer| block(decode, spec, layer, local).iter().all(|&b| b == 0))
}

/// Polls the prefill until `n` requests are released; returns them.
async fn released(prefill: &KvConnectorWorker, n: usize, limit: Duration) -> Vec<String> {
    poll_until(prefill, limit, |f| f.sending.len() >= n)
        .await
        .sending
}

/// Steps the decode engine until its scheduler reports `n` outcomes, or `limit` passes.
async fn outcomes(
    decode: &KvConnectorWorker,
    scheduler: &mut KvConnectorScheduler,
    n: usize,
    limit: Duration,
) -> Vec<LoadOutcome> {
    let start = Instant::now();
    let mut all = Vec::new();
    while all.len() < n && start.elapsed() < limit {
        let finished = decode.finished();
        all.extend(scheduler.update_connector_output(&finished, &decode.load_errors()));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_hit_loads_only_the_missing_tail_and_a_full_hit_only_notifies() {
    common::init_tracing();
    let spec = spec(2);
    let (prefill, mut prefill_scheduler, decode, mut decode_scheduler) =
        engines("hit", &spec, 30.0);

    // The decode's prefix cache holds the first two of four blocks: it loads the last two.
    let partial = finish_for_decode(&prefill, &mut prefill_scheduler, "p-part", &[5, 2, 9, 15]);
    decode_scheduler
        .update_state_after_alloc("d-part", &[10, 11], &partial)
        .unwrap();
    // It holds all three blocks of the next request: nothing is read.
    let full = finish_for_decode(&prefill, &mut prefill_scheduler, "p-full", &[1, 3, 4]);
    decode_scheduler
        .update_state_after_alloc("d-full", &[], &full)
        .unwrap();
    decode.start_load_kv(&decode_scheduler.build_connector_meta());

    let got = outcomes(&decode, &mut decode_scheduler, 1, WAIT).await;
    assert_eq!(
        got,
        [LoadOutcome::Loaded {
            request_id: "d-part".into()
        }]
    );
    assert!(holds(&decode, &spec, 10, 9) && holds(&decode, &spec, 11, 15));
    assert!(
        (0..spec.num_blocks)
            .filter(|b| ![10, 11].contains(b))
            .all(|b| untouched(&decode, &spec, b)),
        "the full hit wrote nothing"
    );
    let metrics = decode.metrics();
    assert_eq!(metrics.len(), 1, "only the partial hit read");
    assert_eq!(metrics[0].descriptors, 2 * spec.num_regions());

    // Both are freed on their notification, long before the lease ends.
    let mut freed = released(&prefill, 2, Duration::from_secs(10)).await;
    freed.sort();
    assert_eq!(freed, ["p-full", "p-part"]);
    assert_eq!(prefill.send_stats().freed_on_notification, 2);
    assert!(
        decode.finished().recving.is_empty(),
        "a full hit is not a load that ends"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_prefill_request_frees_at_once_and_a_capped_one_waits() {
    common::init_tracing();
    let spec = spec(2);
    let (prefill, mut s) = prefill("pf-abort", &spec, 30.0);
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let aborted = s.request_finished("gone", &[1, 2], Some(&for_decode), FinishStatus::Aborted);
    assert!(!aborted.delay_free_blocks && aborted.kv_transfer_params.is_none());
    let capped = s.request_finished("kept", &[3], Some(&for_decode), FinishStatus::LengthCapped);
    assert!(capped.delay_free_blocks && capped.kv_transfer_params.is_some());
    let meta = s.build_connector_meta();
    assert_eq!(meta.sends.len(), 1);
    assert_eq!(meta.sends[0].request_id, "kept");
    prefill.start_load_kv(&meta);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        prefill.finished().sending.is_empty(),
        "the capped one waits for its decode"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_aborted_before_or_during_its_load_tells_the_prefill_and_writes_nothing() {
    common::init_tracing();
    let spec = spec(2);
    // A fresh decode: no handshake yet, so a load handed to the worker waits for one.
    let (prefill, mut prefill_scheduler, decode, mut decode_scheduler) =
        engines("dabort", &spec, 30.0);

    // Aborted while it waited for blocks: notification only.
    let waiting = finish_for_decode(&prefill, &mut prefill_scheduler, "p-wait", &[1, 2]);
    decode_scheduler.on_new_request("d-wait", Some(&waiting));
    let done =
        decode_scheduler.request_finished("d-wait", &[], Some(&waiting), FinishStatus::Aborted);
    assert!(!done.delay_free_blocks);
    // Aborted right after its load went to the worker, while the handshake runs: the READ
    // is never posted.
    let running = finish_for_decode(&prefill, &mut prefill_scheduler, "p-run", &[3, 4]);
    decode_scheduler
        .update_state_after_alloc("d-run", &[6, 7], &running)
        .unwrap();
    decode.start_load_kv(&decode_scheduler.build_connector_meta());
    let done =
        decode_scheduler.request_finished("d-run", &[6, 7], Some(&running), FinishStatus::Aborted);
    assert!(
        done.delay_free_blocks,
        "a READ may run: the blocks wait for the load's end"
    );
    let meta = decode_scheduler.build_connector_meta();
    assert_eq!(meta.aborted, ["d-run"]);
    decode.start_load_kv(&meta);

    let got = outcomes(&decode, &mut decode_scheduler, 1, WAIT).await;
    assert_eq!(
        got,
        [LoadOutcome::AbortedLoadEnded {
            request_id: "d-run".into()
        }]
    );
    assert!(
        (0..spec.num_blocks).all(|b| untouched(&decode, &spec, b)),
        "no READ landed"
    );
    assert!(decode.load_errors().is_empty());
    let mut freed = released(&prefill, 2, Duration::from_secs(10)).await;
    freed.sort();
    assert_eq!(freed, ["p-run", "p-wait"]);
    assert_eq!(
        prefill.send_stats().freed_on_notification,
        2,
        "freed at once, not by the lease"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_racing_the_loads_completion_frees_each_request_once() {
    common::init_tracing();
    let spec = spec(2);
    let (prefill, mut prefill_scheduler, decode, mut decode_scheduler) =
        engines("race", &spec, 30.0);
    let port = prefill.side_channel_addr().unwrap().port();
    decode
        .handshake_with("pf-race", "127.0.0.1", port, 1)
        .await
        .unwrap();

    const N: usize = 12;
    for i in 0..N {
        let params = finish_for_decode(&prefill, &mut prefill_scheduler, &format!("p{i}"), &[i]);
        let id = format!("d{i}");
        decode_scheduler
            .update_state_after_alloc(&id, &[i], &params)
            .unwrap();
        // The READ is posted within start_load_kv and may be done before the abort.
        decode.start_load_kv(&decode_scheduler.build_connector_meta());
        if i % 3 == 1 {
            tokio::task::yield_now().await;
        }
        let done =
            decode_scheduler.request_finished(&id, &[i], Some(&params), FinishStatus::Aborted);
        assert!(done.delay_free_blocks, "request {id}");
        decode.start_load_kv(&decode_scheduler.build_connector_meta());
    }
    let got = outcomes(&decode, &mut decode_scheduler, N, WAIT).await;
    let mut ids: Vec<String> = got
        .into_iter()
        .map(|o| match o {
            LoadOutcome::AbortedLoadEnded { request_id } => request_id,
            other => panic!("{other:?}"),
        })
        .collect();
    ids.sort();
    let mut want: Vec<String> = (0..N).map(|i| format!("d{i}")).collect();
    want.sort();
    assert_eq!(ids, want, "each aborted load ends once");
    assert!(outcomes(
        &decode,
        &mut decode_scheduler,
        1,
        Duration::from_millis(200)
    )
    .await
    .is_empty());
    let freed = released(&prefill, N, Duration::from_secs(10)).await;
    assert_eq!(freed.len(), N);
    assert_eq!(prefill.send_stats().freed_on_notification, N as u64);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(prefill.finished().sending.is_empty(), "none twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_heartbeats_keeps_blocks_past_the_lease_and_one_that_stops_does_not() {
    common::init_tracing();
    let spec = spec(2);
    // A 3 s lease: heartbeats every 500 ms, each extending it to 2 s from its arrival.
    let lease_s = 3.0;
    let (prefill, mut prefill_scheduler) = prefill("pf-lease", &spec, lease_s);
    let kv = kv_with_lease(lease_s);
    let decode = worker_with("dc-lease", 0, 1, &spec, |c| {
        c.kv_transfer_config = kv.clone()
    });
    let mut decode_scheduler = scheduler("dc-lease", &decode, &kv);

    let held_at = Instant::now();
    let wanted = finish_for_decode(&prefill, &mut prefill_scheduler, "p-wanted", &[1, 2]);
    finish_for_decode(&prefill, &mut prefill_scheduler, "p-forgotten", &[3]);
    // The decode queues the first request (no blocks for it yet) and heartbeats while it
    // waits; nobody waits for the second.
    decode_scheduler.on_new_request("d-wanted", Some(&wanted));
    let mut sending = Vec::new();
    while held_at.elapsed() < Duration::from_millis(5000) {
        decode.start_load_kv(&decode_scheduler.build_connector_meta());
        sending.extend(prefill.finished().sending);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        sending,
        ["p-forgotten"],
        "the lease freed the one without heartbeats"
    );
    let notes = prefill.notification_stats();
    assert!(
        notes.heartbeats >= 5 && notes.leases_extended >= 5,
        "{notes:?}"
    );

    // The decode stops heartbeating (it still waits, but its steps stop): the lease ends.
    let stopped_at = Instant::now();
    let freed = released(&prefill, 1, Duration::from_secs(5)).await;
    assert_eq!(freed, ["p-wanted"]);
    assert!(
        stopped_at.elapsed() <= Duration::from_millis(3500),
        "freed within an extension (2 s) of the last heartbeat: {:?}",
        stopped_at.elapsed()
    );
    assert_eq!(prefill.send_stats().freed_on_timeout, 2);
    assert_eq!(prefill.send_stats().freed_on_notification, 0);
    assert!(prefill.finished().sending.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_heartbeats_and_repeated_or_late_notifications_stay_bounded() {
    common::init_tracing();
    let spec = spec(2);
    let (prefill, mut prefill_scheduler) = prefill("pf-hostile", &spec, 2.0);
    let decode = worker("dc-hostile", 0, 1, &spec);
    let port = prefill.side_channel_addr().unwrap().port();
    decode
        .handshake_with("pf-hostile", "127.0.0.1", port, 1)
        .await
        .unwrap();
    let to = prefill.agent().name().to_string();
    let send = |message: &[u8]| decode.agent().send_notification(&to, message).unwrap();

    finish_for_decode(&prefill, &mut prefill_scheduler, "held", &[1]);
    // Heartbeats for requests not held, and malformed notifications: ignored, counted.
    send(b"HB:nobody,nothing");
    for bad in [
        &b"HB:"[..],
        b"HB:a,,b",
        b"no-colon",
        b"held:0",
        b"held:x",
        b"\xff\xfe:1",
    ] {
        send(bad);
    }
    send(format!("HB:{}", "y".repeat(20 << 10)).as_bytes());
    // One reader of a TP-2 decode, twice: counted once, so the request stays held.
    send(b"held:2");
    send(b"held:2");
    let start = Instant::now();
    while prefill.notification_stats().malformed < 7 && start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let notes = prefill.notification_stats();
    assert_eq!(notes.unknown_heartbeat_ids, 2, "{notes:?}");
    assert_eq!(notes.malformed, 7, "{notes:?}");
    assert_eq!(notes.duplicate_notifications, 1, "{notes:?}");
    assert!(
        prefill.finished().sending.is_empty(),
        "one reader of two notified"
    );

    // The lease ends (2 s) before the second reader; its notification comes late.
    let freed = released(&prefill, 1, Duration::from_secs(5)).await;
    assert_eq!(freed, ["held"]);
    send(b"held:2");
    send(b"held:2");
    let start = Instant::now();
    while prefill.notification_stats().late_notifications < 2
        && start.elapsed() < Duration::from_secs(5)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(prefill.notification_stats().late_notifications, 2);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(prefill.finished().sending.is_empty(), "never freed twice");
    assert_eq!(prefill.send_stats().freed_on_timeout, 1);
    assert_eq!(prefill.send_stats().freed_on_notification, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_ends_before_the_reads_notification_counts_it_late_and_frees_once() {
    common::init_tracing();
    let spec = spec(2);
    let (prefill, mut prefill_scheduler, decode, mut decode_scheduler) =
        engines("late", &spec, 0.3);
    let params = finish_for_decode(&prefill, &mut prefill_scheduler, "p-late", &[7, 8]);
    // The decode is slow: the lease ends first, and the prefill frees the blocks.
    let freed = released(&prefill, 1, Duration::from_secs(5)).await;
    assert_eq!(freed, ["p-late"]);
    decode_scheduler
        .update_state_after_alloc("d-late", &[0, 1], &params)
        .unwrap();
    decode.start_load_kv(&decode_scheduler.build_connector_meta());
    let got = outcomes(&decode, &mut decode_scheduler, 1, WAIT).await;
    assert_eq!(
        got,
        [LoadOutcome::Loaded {
            request_id: "d-late".into()
        }]
    );
    let start = Instant::now();
    while prefill.notification_stats().late_notifications == 0
        && start.elapsed() < Duration::from_secs(5)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(prefill.notification_stats().late_notifications, 1);
    assert!(
        prefill.finished().sending.is_empty(),
        "freed once, by the lease"
    );
    assert_eq!(prefill.send_stats().freed_on_timeout, 1);
}

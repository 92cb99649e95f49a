//! A request's lifecycle through both schedulers and workers, over real NIXL/UCX: prefix-cache
//! hits on the decode, aborts on both sides, KV leases with heartbeats, and hostile or racing
//! notifications, in one process; loads of blocks released first (a lease ended and the
//! blocks reused, or params loaded again) failing as outlived; and a lease that ends while a
//! decode's READ is in flight, with that decode in a child process that the test stops and
//! resumes, whose load fails as outlived. Every test checks that no request is freed twice
//! and none is left held.

mod common;

use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{
    after_tag, block, fill, finish_for_decode, finished_for_decode, for_decode, handshake, pattern,
    poll_until, role_process, spec, stdout_lines, wait_for, worker, worker_with, ChildLines,
};
use nixl::kv_config::KvTransferConfig;
use nixl_connector::{
    FinishStatus, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvTransferParams,
    LoadOutcome, NotificationStats, SchedulerConfig, SendStats,
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

/// A prefill engine of a test (tracing started): the cache of every test here, its worker
/// (filled with the pattern, its agent running a progress thread unless `stalled`) and its
/// scheduler, lease `lease_s`.
fn prefill_engine(
    engine: &str,
    lease_s: f64,
    stalled: bool,
) -> (KvCacheSpec, KvConnectorWorker, KvConnectorScheduler) {
    common::init_tracing();
    let spec = spec(2);
    let kv = kv_with_lease(lease_s);
    let worker = worker_with(engine, 0, 1, &spec, |c| {
        c.kv_transfer_config = kv.clone();
        c.agent_config.progress_thread = !stalled;
    });
    fill(&worker, &spec);
    let scheduler = scheduler(engine, &worker, &kv);
    (spec, worker, scheduler)
}

/// [`prefill_engine`] with a progress thread: the cache, the worker and the scheduler.
fn prefill(engine: &str, lease_s: f64) -> (KvCacheSpec, KvConnectorWorker, KvConnectorScheduler) {
    prefill_engine(engine, lease_s, false)
}

/// The cache, a prefill (lease `lease_s`) and a decode engine (default config), each with
/// its worker and scheduler, named after `tag`.
fn engines(
    tag: &str,
    lease_s: f64,
) -> (
    KvCacheSpec,
    KvConnectorWorker,
    KvConnectorScheduler,
    KvConnectorWorker,
    KvConnectorScheduler,
) {
    let (spec, prefill, prefill_scheduler) = prefill(&format!("pf-{tag}"), lease_s);
    let decode_engine = format!("dc-{tag}");
    let decode = worker(&decode_engine, 0, 1, &spec);
    let decode_scheduler = scheduler(&decode_engine, &decode, &common::cpu_config());
    (spec, prefill, prefill_scheduler, decode, decode_scheduler)
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

/// Writes another request's KV (bytes of 0xEE) into every layer of the prefill's block
/// `block`, as an engine reusing it would.
fn overwrite(prefill: &KvConnectorWorker, spec: &KvCacheSpec, block: usize) {
    let reg = prefill.kv_caches().unwrap();
    for layer in 0..spec.num_regions() {
        let len = spec.block_len(layer);
        reg.write(layer, block * len, &vec![0xEE; len]).unwrap();
    }
}

/// Whether local block `local` is still zero in every layer.
fn untouched(decode: &KvConnectorWorker, spec: &KvCacheSpec, local: usize) -> bool {
    (0..spec.num_regions()).all(|layer| block(decode, spec, layer, local).iter().all(|&b| b == 0))
}

/// Polls the prefill until `n` requests are released; returns them, sorted.
async fn released(prefill: &KvConnectorWorker, n: usize, limit: Duration) -> Vec<String> {
    let mut freed = poll_until(prefill, limit, |f| f.sending.len() >= n)
        .await
        .sending;
    freed.sort();
    freed
}

/// Checks, after a while for anything in flight to arrive, that the prefill releases
/// nothing more; `why` says what that shows.
async fn assert_nothing_more_freed(prefill: &KvConnectorWorker, why: &str) {
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(prefill.finished().sending.is_empty(), "{why}");
}

/// Release counts: `on_notification` freed by their decodes' notifications, `on_timeout`
/// by the end of their lease.
fn freed(on_notification: u64, on_timeout: u64) -> SendStats {
    SendStats {
        freed_on_eviction: 0,
        freed_on_notification: on_notification,
        freed_on_timeout: on_timeout,
    }
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
        let step = scheduler.update_connector_output(&[decode.output()]);
        all.extend(step.unwrap().load_outcomes);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    all
}

/// Schedules and starts the decode's load of `params` into `local` as `request`, and
/// returns its outcome.
async fn load_outcome(
    decode: &KvConnectorWorker,
    scheduler: &mut KvConnectorScheduler,
    request: &str,
    local: &[usize],
    params: &KvTransferParams,
) -> LoadOutcome {
    scheduler.on_new_request(request, Some(params));
    scheduler
        .update_state_after_alloc(request, local, params)
        .unwrap();
    decode.start_load_kv(&scheduler.build_connector_meta());
    let mut got = outcomes(decode, scheduler, 1, WAIT).await;
    assert_eq!(got.len(), 1, "{got:?}");
    got.remove(0)
}

/// Asserts that `outcome` is a load failed because the prefill's release marks showed its
/// blocks released before the READ ended.
fn assert_outlived(outcome: &LoadOutcome) {
    match outcome {
        LoadOutcome::Failed { reason, .. } => {
            assert!(
                reason.contains("at or past the request's lease epoch"),
                "{reason}"
            )
        }
        other => panic!("the load must fail as outlived: {other:?}"),
    }
}

/// A load posted after the prefill's lease ended and its engine reused the blocks reads
/// the other request's KV, and fails as outlived, never loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_of_blocks_released_and_reused_before_its_read_fails_as_outlived() {
    let (spec, prefill, mut prefill_scheduler, decode, mut decode_scheduler) =
        engines("reused", 0.3);
    let params = finish_for_decode(&prefill, &mut prefill_scheduler, "p-reused", &HELD);
    assert_eq!(
        released(&prefill, 1, WAIT).await,
        ["p-reused"],
        "its lease ended"
    );
    for &b in &HELD {
        overwrite(&prefill, &spec, b);
    }
    let outcome = load_outcome(&decode, &mut decode_scheduler, "d-reused", &INTO, &params).await;
    assert_outlived(&outcome);
    let reused = |b: usize| {
        (0..spec.num_regions()).all(|l| block(&decode, &spec, l, b).iter().all(|&x| x == 0xEE))
    };
    assert!(
        INTO.iter().all(|&b| reused(b)),
        "the READ read the reused blocks"
    );
}

/// Params loaded again once their request was released on the first load's notification
/// fail as outlived: the release raised the marks of its blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn params_loaded_again_after_their_release_fail_as_outlived() {
    let (spec, prefill, mut prefill_scheduler, decode, mut decode_scheduler) =
        engines("twice", 30.0);
    let params = finish_for_decode(&prefill, &mut prefill_scheduler, "p-twice", &HELD);
    let first = load_outcome(&decode, &mut decode_scheduler, "d-first", &INTO, &params).await;
    assert!(matches!(first, LoadOutcome::Loaded { .. }), "{first:?}");
    assert!(INTO
        .iter()
        .zip(HELD)
        .all(|(&b, far)| holds(&decode, &spec, b, far)));
    assert_eq!(
        released(&prefill, 1, WAIT).await,
        ["p-twice"],
        "on the notification"
    );
    assert_eq!(prefill.send_stats(), freed(1, 0));
    let again = load_outcome(&decode, &mut decode_scheduler, "d-again", &[2, 3], &params).await;
    assert_outlived(&again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_hit_loads_only_the_missing_tail_and_a_full_hit_only_notifies() {
    let (spec, prefill, mut prefill_scheduler, decode, mut decode_scheduler) = engines("hit", 30.0);

    // The decode's prefix cache holds the first two of four blocks: it loads the last two.
    let partial = finish_for_decode(&prefill, &mut prefill_scheduler, "p-part", &[5, 2, 9, 15]);
    decode_scheduler.on_new_request("d-part", Some(&partial));
    decode_scheduler
        .update_state_after_alloc("d-part", &[10, 11], &partial)
        .unwrap();
    // It holds all three blocks of the next request: nothing is read.
    let full = finish_for_decode(&prefill, &mut prefill_scheduler, "p-full", &[1, 3, 4]);
    decode_scheduler.on_new_request("d-full", Some(&full));
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
    assert_eq!(released(&prefill, 2, WAIT).await, ["p-full", "p-part"]);
    assert_eq!(prefill.send_stats(), freed(2, 0));
    assert!(
        decode.finished().recving.is_empty(),
        "a full hit is not a load that ends"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_prefill_request_frees_at_once_and_a_capped_one_waits() {
    let (_, prefill, mut s) = prefill("pf-abort", 30.0);
    let aborted = s.request_finished(
        "gone",
        &[1, 2],
        0,
        Some(&for_decode()),
        FinishStatus::Aborted,
    );
    assert!(!aborted.delay_free_blocks && aborted.kv_transfer_params.is_none());
    let capped = s.request_finished(
        "kept",
        &[3],
        0,
        Some(&for_decode()),
        FinishStatus::LengthCapped,
    );
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
    // A fresh decode: no handshake yet, so a load handed to the worker waits for one.
    let (spec, prefill, mut prefill_scheduler, decode, mut decode_scheduler) =
        engines("dabort", 30.0);

    // Both requests' handshakes pass a gate that opens only once the abort is handed over,
    // so that the abort always comes while the handshake runs.
    let (open, gate_port) = gated_relay(prefill.side_channel_addr().unwrap()).await;
    let through_gate = |mut params: KvTransferParams| {
        params.remote_port = Some(gate_port);
        params
    };
    // Aborted while it waited for blocks: notification only.
    let waiting = finish_for_decode(&prefill, &mut prefill_scheduler, "p-wait", &[1, 2]);
    let waiting = through_gate(waiting);
    decode_scheduler.on_new_request("d-wait", Some(&waiting));
    let done =
        decode_scheduler.request_finished("d-wait", &[], 0, Some(&waiting), FinishStatus::Aborted);
    assert!(!done.delay_free_blocks);
    // Aborted right after its load went to the worker, while the handshake runs: the READ
    // is never posted.
    let running = finish_for_decode(&prefill, &mut prefill_scheduler, "p-run", &[3, 4]);
    let running = through_gate(running);
    decode_scheduler.on_new_request("d-run", Some(&running));
    decode_scheduler
        .update_state_after_alloc("d-run", &[6, 7], &running)
        .unwrap();
    decode.start_load_kv(&decode_scheduler.build_connector_meta());
    let done = decode_scheduler.request_finished(
        "d-run",
        &[6, 7],
        0,
        Some(&running),
        FinishStatus::Aborted,
    );
    assert!(
        done.delay_free_blocks,
        "a READ may run: the blocks wait for the load's end"
    );
    let meta = decode_scheduler.build_connector_meta();
    assert_eq!(meta.aborted, ["d-run"]);
    decode.start_load_kv(&meta);
    open.send_replace(true);

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
    assert_eq!(released(&prefill, 2, WAIT).await, ["p-run", "p-wait"]);
    assert_eq!(
        prefill.send_stats(),
        freed(2, 0),
        "freed at once, not by the lease"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_racing_the_loads_completion_frees_each_request_once() {
    let (_, prefill, mut prefill_scheduler, decode, mut decode_scheduler) = engines("race", 30.0);
    handshake(
        &decode,
        "pf-race",
        prefill.side_channel_addr().unwrap().port(),
    )
    .await;

    const N: usize = 12;
    for i in 0..N {
        let params = finish_for_decode(&prefill, &mut prefill_scheduler, &format!("p{i}"), &[i]);
        let id = format!("d{i}");
        decode_scheduler.on_new_request(&id, Some(&params));
        decode_scheduler
            .update_state_after_alloc(&id, &[i], &params)
            .unwrap();
        // The READ is posted within start_load_kv and may be done before the abort.
        decode.start_load_kv(&decode_scheduler.build_connector_meta());
        if i % 3 == 1 {
            tokio::task::yield_now().await;
        }
        let done =
            decode_scheduler.request_finished(&id, &[i], 0, Some(&params), FinishStatus::Aborted);
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
    assert_eq!(released(&prefill, N, WAIT).await.len(), N);
    assert_eq!(prefill.send_stats(), freed(N as u64, 0));
    assert_nothing_more_freed(&prefill, "none twice").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_heartbeats_keeps_blocks_past_the_lease_and_one_that_stops_does_not() {
    // A 3 s lease: heartbeats every 500 ms, each extending it to 2 s from its arrival.
    let lease_s = 3.0;
    let (spec, prefill, mut prefill_scheduler) = prefill("pf-lease", lease_s);
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
    assert_eq!(
        released(&prefill, 1, Duration::from_secs(5)).await,
        ["p-wanted"]
    );
    assert!(
        stopped_at.elapsed() <= Duration::from_millis(3500),
        "freed within an extension (2 s) of the last heartbeat: {:?}",
        stopped_at.elapsed()
    );
    assert_eq!(prefill.send_stats(), freed(0, 2));
    assert!(prefill.finished().sending.is_empty());
}

/// Request id `i` of 48 characters, the length of vLLM's ids that the issue measured.
fn id48(i: usize) -> String {
    format!("{:x>48}", format!("-{i}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_waiting_for_5000_requests_extends_every_lease() {
    // 5,000 ids of 48 characters: 245,000 bytes of ids, which this decode splits into
    // heartbeats of at most 16 KiB (#30 item 1).
    const N: usize = 5000;
    let (_, prefill, mut prefill_scheduler, decode, mut decode_scheduler) = engines("hb5k", 30.0);
    for i in 0..N {
        let params = finished_for_decode(&mut prefill_scheduler, &id48(i), &[1]);
        decode_scheduler.on_new_request(&format!("d{i}"), Some(&params));
    }
    prefill.start_load_kv(&prefill_scheduler.build_connector_meta());
    // The first heartbeat of a step goes once the handshake is done.
    handshake(
        &decode,
        "pf-hb5k",
        prefill.side_channel_addr().unwrap().port(),
    )
    .await;
    let meta = decode_scheduler.build_connector_meta();
    assert_eq!(meta.heartbeats.len(), 1, "one engine");
    assert_eq!(meta.heartbeats[0].request_ids.len(), N);
    decode.start_load_kv(&meta);
    wait_for("every lease extended", WAIT, || {
        prefill.notification_stats().leases_extended >= N as u64
    })
    .await;
    let notes = prefill.notification_stats();
    assert_eq!(
        (
            notes.leases_extended,
            notes.unknown_heartbeat_ids,
            notes.malformed
        ),
        (N as u64, 0, 0),
        "{notes:?}"
    );
    assert!(notes.heartbeats >= 15, "split at 16 KiB: {notes:?}");
    assert!(prefill.finished().sending.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_heartbeats_and_repeated_or_late_notifications_stay_bounded() {
    let (_, prefill, mut prefill_scheduler) = prefill("pf-hostile", 2.0);
    // Rank 0 of a TP-2 decode: a reader whose notification counts for one of two.
    let decode = worker("dc-hostile", 0, 2, &common::spec_tp(2, 2));
    handshake(
        &decode,
        "pf-hostile",
        prefill.side_channel_addr().unwrap().port(),
    )
    .await;
    let to = prefill.agent().name().to_string();
    let send = |message: &[u8]| decode.agent().send_notification(&to, message).unwrap();

    let params = finish_for_decode(&prefill, &mut prefill_scheduler, "held", &[1]);
    let capability = params.remote_capability.clone().unwrap();
    let agent = decode.agent().name().to_string();
    let entry = |id: &str| format!("{id}#{}", capability.heartbeat_tag(agent.as_bytes(), id));
    let held = finish(&params, &agent, "held", 2);
    // Heartbeats for requests not held, and malformed notifications: ignored, counted.
    send(format!("HB:{},{}", entry("nobody"), entry("nothing")).as_bytes());
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
    send(&held);
    send(&held);
    // Wait for the effect of the last message sent (the repeated reader), not only the
    // malformed ones before it: the prefill's task may take them in more than one batch.
    wait_for("the malformed and the repeated notifications", WAIT, || {
        let notes = prefill.notification_stats();
        notes.malformed >= 7 && notes.duplicate_notifications >= 1
    })
    .await;
    let notes = prefill.notification_stats();
    assert_eq!(notes.unknown_heartbeat_ids, 2, "{notes:?}");
    assert_eq!(notes.malformed, 7, "{notes:?}");
    assert_eq!(notes.duplicate_notifications, 1, "{notes:?}");
    assert!(
        prefill.finished().sending.is_empty(),
        "one reader of two notified"
    );

    // The lease ends (2 s) before the second reader; its notification comes late.
    assert_eq!(released(&prefill, 1, WAIT).await, ["held"]);
    send(&held);
    send(&held);
    wait_for("the late notifications", WAIT, || {
        prefill.notification_stats().late_notifications >= 2
    })
    .await;
    assert_eq!(prefill.notification_stats().late_notifications, 2);
    assert_nothing_more_freed(&prefill, "never freed twice").await;
    assert_eq!(prefill.send_stats(), freed(0, 1));
}

/// The native finish notification of agent `sender` for `request` of `params`, saying
/// `count` readers, tagged under the params' capability.
fn finish(params: &KvTransferParams, sender: &str, request: &str, count: usize) -> Vec<u8> {
    let capability = params.remote_capability.as_ref().expect("native params");
    let tag = capability.finish_tag(sender.as_bytes(), request, count);
    format!("{request}:{count}:{tag}").into_bytes()
}

/// A relay to `to` that takes connections at once but passes no byte until `true` is sent
/// on the returned sender; the port it listens on.
async fn gated_relay(to: std::net::SocketAddr) -> (tokio::sync::watch::Sender<bool>, u16) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (open, gate) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let mut gate = gate.clone();
            tokio::spawn(async move {
                let _ = gate.wait_for(|open| *open).await;
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (open, port)
}

/// The decode role's environment: its load's params, as JSON.
const PARAMS_ENV: &str = "NIXL_CONNECTOR_TEST_PARAMS";
/// The blocks the prefill holds for the READ that its lease outlives, and the decode's
/// blocks they are read into.
const HELD: [usize; 2] = [7, 8];
const INTO: [usize; 2] = [0, 1];

/// The decode of a_lease_that_ends_during_a_read_..., in a child process so that the test
/// can stop it mid-READ: loads the params of `PARAMS_ENV` into [`INTO`], prints `IN FLIGHT`
/// once its READ is posted and NIXL has not reported it done, then `OUTLIVED` once the load
/// failed, never loaded, for the release marks showed the prefill's release (whatever
/// bytes landed); exits when its stdin closes (its notification sent by then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the decode of a_lease_that_ends_during_a_read_frees_once_and_fails_the_load_as_outlived, which starts it"]
async fn stopped_decode_role() {
    let params: KvTransferParams =
        serde_json::from_str(&std::env::var(PARAMS_ENV).expect("run by the parent test")).unwrap();
    let spec = spec(2);
    let decode = worker("dc-inflight", 0, 1, &spec);
    let mut scheduler = scheduler("dc-inflight", &decode, &common::cpu_config());
    scheduler.on_new_request("d-inflight", Some(&params));
    scheduler
        .update_state_after_alloc("d-inflight", &INTO, &params)
        .unwrap();
    decode.start_load_kv(&scheduler.build_connector_meta());
    // The READ cannot end until the prefill's agent progresses, which it does not yet.
    let agent = decode.agent();
    wait_for("the READ to be posted", WAIT, || {
        agent.driver_stats().held == 1
    })
    .await;
    // Its bytes may land before that (they need no help from the prefill here), but NIXL
    // reports it in progress: it is in flight.
    assert!(decode.finished().recving.is_empty());
    println!("IN FLIGHT");

    // Stopped here until the prefill's lease has ended and it reused the blocks (the bound
    // covers the stop). The READ then ends well in NIXL, but the load fails.
    let got = outcomes(&decode, &mut scheduler, 1, 3 * WAIT).await;
    match &got[..] {
        [LoadOutcome::Failed { request_id, reason }] => {
            assert_eq!(request_id, "d-inflight");
            assert!(
                reason.contains("released its blocks before the READ"),
                "{reason}"
            );
            assert!(reason.contains("lease epoch"), "{reason}");
        }
        other => panic!("the load must fail as outlived: {other:?}"),
    }
    println!("OUTLIVED");
    tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new()))
        .await
        .unwrap()
        .unwrap();
}

/// The decode of [`stopped_decode_role`] in its child process, which the test stops and
/// resumes; dropped, it is resumed and killed.
struct DecodeProcess {
    child: Child,
    lines: Option<ChildLines>,
}

impl DecodeProcess {
    fn start(params: &KvTransferParams) -> Self {
        let params = serde_json::to_string(params).unwrap();
        let mut child = role_process(
            "stopped_decode_role",
            &[(PARAMS_ENV, params.as_str())],
            Stdio::inherit(),
        );
        let lines = Some(stdout_lines(&mut child));
        DecodeProcess { child, lines }
    }

    /// Waits (off the runtime's threads) until the decode prints `tag`.
    async fn printed(&mut self, tag: &'static str) {
        let mut lines = self.lines.take().unwrap();
        let (found, lines) =
            tokio::task::spawn_blocking(move || (after_tag(&mut lines, tag).is_some(), lines))
                .await
                .unwrap();
        self.lines = Some(lines);
        assert!(found, "the decode process ended without printing {tag:?}");
    }

    fn signal(&self, signal: libc::c_int) {
        common::signal(&self.child, signal);
    }

    /// Whether every thread of the decode is stopped.
    fn stopped(&self) -> bool {
        common::all_threads_stopped(&self.child)
    }

    /// Stops the decode (SIGSTOP) and waits until every thread of it has stopped.
    async fn stop(&self) {
        self.signal(libc::SIGSTOP);
        wait_for("the decode process to stop", WAIT, || self.stopped()).await;
    }

    /// Resumes the stopped decode (SIGCONT).
    fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Closes the decode's stdin and waits for it to exit.
    async fn exit(&mut self) -> ExitStatus {
        drop(self.child.stdin.take());
        let mut status = None;
        wait_for("the decode process to exit", WAIT, || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        })
        .await;
        status.unwrap()
    }
}

impl Drop for DecodeProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.resume();
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_ends_during_a_read_frees_once_and_fails_the_load_as_outlived() {
    // The prefill's agent runs no progress thread: the decode's READ cannot finish until the
    // prefill's worker polls NIXL, which it starts to do when it first holds a request.
    let (spec, prefill, mut prefill_scheduler) = prefill_engine("pf-inflight", 2.0, true);
    let params = finished_for_decode(&mut prefill_scheduler, "p-inflight", &HELD);
    let meta = prefill_scheduler.build_connector_meta();
    let deadline = meta.sends[0].deadline;

    // The decode posts its READ, which stays in flight, and then stalls (stopped): it sends
    // no heartbeat, and its side of the READ cannot go on.
    let mut decode = DecodeProcess::start(&params);
    decode.printed("IN FLIGHT").await;
    decode.stop().await;
    // The prefill's worker takes the request at its step: it polls NIXL from now on, so its
    // side of the READ can go on, but the READ stays in flight with the decode stopped.
    prefill.start_load_kv(&meta);

    assert_eq!(released(&prefill, 1, WAIT).await, ["p-inflight"]);
    assert!(Instant::now() >= deadline, "freed by the lease's end");
    assert!(
        decode.stopped(),
        "the READ was still in flight when the lease ended"
    );
    assert_eq!(prefill.send_stats(), freed(0, 1), "counted as expired");
    assert_eq!(
        prefill.notification_stats(),
        NotificationStats::default(),
        "no notification yet"
    );

    // The engine reuses the freed blocks: another request's KV is written into them.
    for &b in &HELD {
        overwrite(&prefill, &spec, b);
    }
    // The decode resumes: NIXL reports its READ done (the bytes of freed blocks, maybe
    // reused), it notifies, late, and its load fails: the release marks it READs after
    // show the release.
    decode.resume();
    decode.printed("OUTLIVED").await;
    wait_for("the decode's late notification", WAIT, || {
        prefill.notification_stats().late_notifications >= 1
    })
    .await;
    assert_nothing_more_freed(&prefill, "freed once, by the lease").await;
    assert_eq!(
        prefill.notification_stats(),
        NotificationStats {
            late_notifications: 1,
            ..Default::default()
        }
    );
    assert_eq!(prefill.send_stats(), freed(0, 1));
    assert!(decode.exit().await.success(), "the decode's checks passed");
}

/// A prefill whose runtime is starved (a current-thread runtime whose one thread sleeps past
/// the lease, so the task applying notifications cannot run) still counts the finish
/// notification NIXL received within the lease: `finished` takes what NIXL holds before it
/// ends any lease, as vLLM's `get_finished` takes NIXL's notifications before it reaps
/// expired leases. Ending the lease first would free the blocks as expired and count the
/// decode's timely notification late.
#[tokio::test(flavor = "current_thread")]
async fn a_starved_prefill_counts_the_notification_nixl_holds_before_ending_the_lease() {
    let lease = Duration::from_millis(500);
    let (spec, prefill, mut prefill_scheduler) = prefill("pf-starved", lease.as_secs_f64());
    let decode = worker("dc-starved", 0, 1, &spec);
    handshake(
        &decode,
        "pf-starved",
        prefill.side_channel_addr().unwrap().port(),
    )
    .await;
    let params = finish_for_decode(&prefill, &mut prefill_scheduler, "timely", &[1]);
    let to = prefill.agent().name().to_string();
    let message = finish(&params, decode.agent().name(), "timely", 1);
    decode.agent().send_notification(&to, &message).unwrap();
    // The runtime's only thread sleeps past the lease: nothing on it runs meanwhile, while
    // NIXL's progress threads deliver the notification.
    std::thread::sleep(lease + Duration::from_millis(300));
    assert_eq!(prefill.finished().sending, ["timely"]);
    assert_eq!(prefill.send_stats(), freed(1, 0), "freed as notified");
    assert_eq!(prefill.notification_stats().late_notifications, 0);
    assert_nothing_more_freed(&prefill, "none twice").await;
}

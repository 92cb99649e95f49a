//! nixl-connector's push mode in vLLM's protocol (vLLM 0.33's `NixlPushConnector`) against
//! the Python peer (tests/py/vllm_peer.py), which speaks vLLM's push wire with vLLM's own
//! libraries (msgspec, pyzmq) over NIXL's Python agent, in both roles:
//! - a Rust decode registers its blocks with a Python push prefill (`PUSH_REG:` and
//!   MessagePack, checked key by key), which WRITEs every byte into them with vLLM's
//!   notification; a prefix hit, vLLM's random-suffix id matching, heartbeats past the
//!   lease while the prefill holds the WRITE, a registration never written (the load fails
//!   by the failure policy once its heartbeats stopped and a grace passed);
//! - a Python push decode registers with a Rust prefill, which WRITEs every byte: a prefix
//!   hit, a suffixed id, a `localhost` side channel, a registration before the request is
//!   held, heartbeats keeping the request past its lease (freed only by the WRITE's end);
//! - Python push prefills of TP 2, of two stages, and of both (each rank writing its
//!   layers' slice of the heads) into a Rust decode of TP 1, and a Rust push prefill of TP
//!   2 into a Python decode of TP 1 (registering with both ranks, waiting for both WRITEs),
//!   and an MLA one whose latent rank 0 writes once while rank 1 only notifies;
//! - the push/pull compatibility hash refused both ways, in both roles.

mod py;
mod vllm_peer_support;
#[path = "../nixl-connector/tests/vllm_support/mod.rs"]
mod vllm_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::platform::BuiltinPlatform;
use nixl_connector::vllm::push_reg::{PushRegistration, RegisteredBlocks};
use nixl_connector::vllm::{CompatibilityFactors, MetadataServer, VllmChannelLimits};
use nixl_connector::{
    FailedBlock, FailureKind, FinishStatus, KvAttention, KvCacheSpec, KvConnectorScheduler,
    KvConnectorWorker, KvLayout, KvTransferParams, LoadOutcome, SchedulerConfig, WorkerConfig,
    WorkerOutput,
};
use py::{hex, unhex};
use serde_json::{json, Value};
use vllm_peer_support::{
    fill_rust_prefill, python_byte_of, rust_byte_of, vllm_engine_with, vllm_kv, VllmPeer, BLOCKS,
    BLOCK_LEN, REGIONS,
};
use vllm_support::factors;

/// The factors of a push engine (vLLM hashes the transfer mode).
fn push_factors() -> CompatibilityFactors {
    CompatibilityFactors {
        transfer_mode: "push".into(),
        ..factors()
    }
}

/// A Rust vLLM-mode push decode of TP 1 (lease 0.6 s), its registration timeout
/// `timeout` seconds.
fn push_decode(timeout: f64) -> (KvConnectorWorker, KvConnectorScheduler) {
    let mut kv = vllm_kv(&push_factors());
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("transfer_mode".into(), "push".into());
    extra.insert("push_registration_timeout".into(), timeout.into());
    let (decode, scheduler) = vllm_engine_with("rs-push-decode", kv);
    let cache = decode.kv_caches().unwrap();
    for region in 0..REGIONS {
        cache
            .write(region, 0, &vec![0xEE; BLOCKS * BLOCK_LEN])
            .unwrap();
    }
    (decode, scheduler)
}

/// The Python push prefill (the kv_prefill engine), serving [`vllm_peer_support::kv_spec`]'s
/// geometry under `hash`; its port.
fn python_prefill(peer: &mut VllmPeer, hash: &str) -> u16 {
    let got = peer.json(&format!(
        "kv_prefill {hash} 0 0 py-push-prefill {REGIONS} {BLOCKS} {BLOCK_LEN} 16"
    ));
    got["port"].as_u64().unwrap() as u16
}

/// The Python prefill finishes `request` in `blocks`: vLLM's push params, parsed.
fn finish_on_python(peer: &mut VllmPeer, request: &str, blocks: &[usize]) -> KvTransferParams {
    let ids: Vec<String> = blocks.iter().map(usize::to_string).collect();
    let json = peer.call(&format!(
        "kv_push_finish {} {}",
        hex(request.as_bytes()),
        ids.join(",")
    ));
    let raw: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(raw["transfer_mode"], "push", "{raw}");
    assert!(raw.get("remote_blocks_expiry_time").is_none(), "{raw}");
    assert!(raw.get("remote_registration_generation").is_none(), "{raw}");
    KvTransferParams::from_vllm_json(&json).unwrap()
}

/// Schedules `request`'s load into `local` from `params` on the decode and hands it to the
/// worker (the registration goes out from its task).
fn start(
    (decode, scheduler): (&KvConnectorWorker, &mut KvConnectorScheduler),
    request: &str,
    local: &[usize],
    params: &KvTransferParams,
) {
    scheduler.on_new_request(request, Some(params));
    scheduler
        .update_state_after_alloc(request, local, params)
        .unwrap();
    decode.start_load_kv(&scheduler.build_connector_meta());
}

/// Steps the decode (heartbeats every 0.1 s) until `request`'s load ends, at most
/// `limit`; its outcome.
async fn outcome(
    engine: (&KvConnectorWorker, &mut KvConnectorScheduler),
    request: &str,
    limit: Duration,
) -> LoadOutcome {
    ended(engine, request, limit).await.0
}

/// [`outcome`], and the failed blocks the worker reported.
async fn ended(
    (decode, scheduler): (&KvConnectorWorker, &mut KvConnectorScheduler),
    request: &str,
    limit: Duration,
) -> (LoadOutcome, Vec<FailedBlock>) {
    let start = Instant::now();
    loop {
        decode.start_load_kv(&scheduler.build_connector_meta());
        let finished = decode.finished();
        if finished.recving.iter().any(|r| r == request) {
            let errors = decode.load_errors();
            let output = WorkerOutput {
                tp_rank: 0,
                pp_rank: 0,
                finished,
                load_errors: errors.clone(),
            };
            let mut outcomes = scheduler
                .update_connector_output(&[output])
                .unwrap()
                .load_outcomes;
            assert_eq!(outcomes.len(), 1, "{outcomes:?}");
            return (outcomes.remove(0), errors);
        }
        assert!(start.elapsed() < limit, "the load never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Checks that `local` blocks of `decode` hold the Python prefill's `remote` blocks, and
/// that `untouched` ones still hold 0xEE.
fn holds(decode: &KvConnectorWorker, local: &[usize], remote: &[usize], untouched: &[usize]) {
    holds_slices(decode, (local, remote, BLOCK_LEN), untouched);
}

/// As [`holds`], of a Python prefill whose ranks each hold `rank_len` bytes of a block (a
/// TP-th of the heads): byte `o` of a decode block is rank `o / rank_len`'s (HND), at its
/// own offset.
fn holds_slices(
    decode: &KvConnectorWorker,
    (local, remote, rank_len): (&[usize], &[usize], usize),
    untouched: &[usize],
) {
    let cache = decode.kv_caches().unwrap();
    for region in 0..REGIONS {
        for (&l, &r) in local.iter().zip(remote) {
            let mut got = vec![0u8; BLOCK_LEN];
            cache.read(region, l * BLOCK_LEN, &mut got).unwrap();
            let want: Vec<u8> = (0..BLOCK_LEN)
                .map(|o| python_byte_of(o / rank_len, region, r * rank_len + o % rank_len))
                .collect();
            assert!(got == want, "region {region} local block {l} (remote {r})");
        }
        for &u in untouched {
            let mut got = vec![0u8; BLOCK_LEN];
            cache.read(region, u * BLOCK_LEN, &mut got).unwrap();
            assert!(
                got.iter().all(|&b| b == 0xEE),
                "region {region} block {u} written"
            );
        }
    }
}

/// The registration the Python prefill took, as vLLM's msgspec decoded it, and the bytes.
fn registration_of(written: &Value) -> (Value, PushRegistration) {
    let raw = unhex(written["hex"].as_str().expect("the registration's bytes"));
    (
        written["registration"].clone(),
        PushRegistration::parse(&raw).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_push_prefill_writes_every_byte_into_a_rust_decodes_registered_blocks() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    assert_ne!(hash, factors().hash(), "the transfer mode is hashed");
    let port = python_prefill(&mut peer, &hash);
    let (decode, mut scheduler) = push_decode(30.0);
    let params = finish_on_python(&mut peer, "cmpl-1-0", &[3, 9, 14]);
    start((&decode, &mut scheduler), "cmpl-1-0", &[0, 1, 2], &params);

    let written = peer.json(&format!("kv_push_write {hash} 10 0"));
    assert_eq!(written["written"], json!([3, 9, 14]), "{written}");
    assert_eq!(written["into"], json!([0, 1, 2]), "{written}");
    assert_eq!(written["from"], decode.agent().name(), "{written}");
    let (theirs, ours) = registration_of(&written);
    let side = decode.side_channel_addr().unwrap();
    assert_eq!(
        theirs,
        json!({
            "request_id": "cmpl-1-0",
            "decode_engine_id": "rs-push-decode",
            "decode_host": "127.0.0.1",
            "decode_port": side.port(),
            "decode_tp_size": 1,
            "local_block_ids": [[0, 1, 2]],
            "remote_engine_id": "py-push-prefill",
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "remote_tp_size": 1,
            "remote_pp_size": 1,
        }),
        "vLLM's eleven keys"
    );
    assert_eq!(ours.request_id, "cmpl-1-0");

    let outcome = outcome(
        (&decode, &mut scheduler),
        "cmpl-1-0",
        Duration::from_secs(10),
    )
    .await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &[0, 1, 2], &[3, 9, 14], &[3, 4, 5]);
    let stats = decode.push_stats();
    assert_eq!(stats.registrations_sent, 1);
    assert_eq!(stats.refused_ends, 0);
}

/// A Python push prefill of `pp` stages of TP `tp` (each rank its stage's layers and a
/// `tp`-th of the KV heads) WRITEs into a Rust decode of TP 1: the decode registers with
/// every rank, each writes its slice of each of its layers' blocks, and the decode counts
/// vLLM's `pp_size` × producers per consumer WRITEs; every byte checked.
async fn python_ranks_push_into_a_rust_decode(pp: usize, tp: usize) {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    let rank_len = BLOCK_LEN / tp;
    let engine = format!("py-push-pp{pp}-tp{tp}");
    let prefill = peer.json(&format!(
        "kv_pp_prefill {hash} {engine} {pp} {tp} {REGIONS} {BLOCKS} {rank_len} 16"
    ));
    assert!(prefill["port"].is_u64(), "{prefill}");
    let (decode, mut scheduler) = push_decode(30.0);
    let json = peer.call(&format!("kv_pp_push_finish {} 3,9,14", hex(b"cmpl-pp-1")));
    let params = KvTransferParams::from_vllm_json(&json).unwrap();
    start((&decode, &mut scheduler), "cmpl-pp-1", &[0, 1, 2], &params);
    let written = peer.json(&format!("kv_pp_push_write {hash} 10"));
    let ranks = written["ranks"]
        .as_object()
        .unwrap_or_else(|| panic!("{written}"));
    assert_eq!(ranks.len(), pp * tp, "{written}");
    let outcome = outcome(
        (&decode, &mut scheduler),
        "cmpl-pp-1",
        Duration::from_secs(10),
    )
    .await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds_slices(&decode, (&[0, 1, 2], &[3, 9, 14], rank_len), &[3, 4, 5]);
    assert_eq!(decode.push_stats().registrations_sent, (pp * tp) as u64);
}

/// vLLM's push from Python prefills of TP 2, of two stages, and of both, into a Rust
/// decode of TP 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_prefills_of_tp_2_and_of_stages_push_into_a_rust_decode() {
    python_ranks_push_into_a_rust_decode(1, 2).await;
    python_ranks_push_into_a_rust_decode(2, 1).await;
    python_ranks_push_into_a_rust_decode(2, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_hit_and_a_suffixed_id_are_matched_as_vllms_prefill_matches_them() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    python_prefill(&mut peer, &hash);
    let (decode, mut scheduler) = push_decode(30.0);
    // The prefill finished "chat-7-1a2b3c4d"; the decode's id has another random suffix,
    // and its prefix cache holds the first two of the four blocks.
    let params = finish_on_python(&mut peer, "chat-7-1a2b3c4d", &[4, 5, 6, 7]);
    start(
        (&decode, &mut scheduler),
        "chat-7-0badf00d",
        &[10, 11],
        &params,
    );
    let written = peer.json(&format!("kv_push_write {hash} 10 0"));
    assert_eq!(written["matched"], "chat-7-1a2b3c4d", "{written}");
    assert_eq!(written["registration"]["request_id"], "chat-7-0badf00d");
    assert_eq!(written["written"], json!([6, 7]), "the last two: {written}");
    let outcome = outcome(
        (&decode, &mut scheduler),
        "chat-7-0badf00d",
        Duration::from_secs(10),
    )
    .await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &[10, 11], &[6, 7], &[8, 9, 12]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_the_prefills_request_past_its_lease_until_the_write_lands() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    python_prefill(&mut peer, &hash);
    let (decode, mut scheduler) = push_decode(30.0);
    let params = finish_on_python(&mut peer, "slow-1", &[1, 2]);
    start((&decode, &mut scheduler), "slow-1", &[5, 6], &params);
    // The decode steps (and heartbeats) while the prefill holds the WRITE for three of
    // the decode's leases; nothing ends the load meanwhile.
    let command = format!("kv_push_write {hash} 10 2");
    let writer = std::thread::spawn(move || {
        let written = peer.json(&command);
        (peer, written)
    });
    let start = Instant::now();
    while !writer.is_finished() {
        decode.start_load_kv(&scheduler.build_connector_meta());
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the WRITE never came"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        start.elapsed() >= Duration::from_secs(2),
        "held {:?}",
        start.elapsed()
    );
    let (mut peer, written) = writer.join().unwrap();
    assert_eq!(written["written"], json!([1, 2]), "{written}");
    let outcome = outcome((&decode, &mut scheduler), "slow-1", Duration::from_secs(10)).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &[5, 6], &[1, 2], &[7]);
    // The heartbeats named the prefill's request id, several times over the hold.
    let notes = peer.json("kv_notifs 3 2");
    let notes = notes.as_array().unwrap();
    assert!(notes.len() >= 3, "{notes:?}");
    for note in notes {
        assert_eq!(note["vllm"], json!({"hb": ["slow-1"]}), "{note}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_never_written_fails_the_load_after_its_heartbeats_stop_and_a_grace() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    python_prefill(&mut peer, &hash);
    let (decode, mut scheduler) = push_decode(0.5);
    let params = finish_on_python(&mut peer, "never-1", &[1, 2]);
    let started = Instant::now();
    start((&decode, &mut scheduler), "dc-never-1", &[5, 6], &params);
    // Past the timeout (0.5 s from the registration) and a heartbeat interval, the
    // heartbeats have stopped.
    while decode.push_stats().registration_timeouts == 0 {
        decode.start_load_kv(&scheduler.build_connector_meta());
        assert!(started.elapsed() < Duration::from_secs(5), "no timeout");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let timed_out = started.elapsed();
    for _ in 0..8 {
        decode.start_load_kv(&scheduler.build_connector_meta());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        decode.finished().recving.is_empty(),
        "ended before the grace"
    );
    let waited = peer.json("kv_notifs 100 0.05");
    let heartbeats = |notes: &Value| {
        notes
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["vllm"] == json!({"hb": ["never-1"]}))
            .count()
    };
    assert!(
        heartbeats(&waited) >= 2,
        "heartbeats while it waited: {waited}"
    );
    let (outcome, failed) = ended(
        (&decode, &mut scheduler),
        "dc-never-1",
        Duration::from_secs(10),
    )
    .await;
    let took = started.elapsed();
    // The timeout (0.5 s), then two leases (1.2 s) for a WRITE already under way.
    assert!(
        took >= Duration::from_millis(1700),
        "{took:?} ({timed_out:?} to see the timeout)"
    );
    assert!(
        matches!(
            outcome,
            LoadOutcome::Failed { .. } | LoadOutcome::Recompute { .. }
        ),
        "{outcome:?}"
    );
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(
        failed.iter().all(|f| f.kind == FailureKind::Timeout),
        "{failed:?}"
    );
    assert_eq!(decode.push_stats().registration_timeouts, 1);
    assert_eq!(decode.overdue_loads().len(), 1);
    let grace = peer.json("kv_notifs 100 0.05");
    assert_eq!(heartbeats(&grace), 0, "a heartbeat in the grace: {grace}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_and_pull_engines_refuse_each_others_hash_both_ways() {
    // A Python prefill serving the pull hash: the Rust push decode's handshake refuses it,
    // and no registration goes.
    let mut peer = VllmPeer::start();
    let pull = factors().hash();
    python_prefill(&mut peer, &pull);
    let (decode, mut scheduler) = push_decode(30.0);
    let params = finish_on_python(&mut peer, "mixed-1", &[1]);
    start((&decode, &mut scheduler), "mixed-1", &[2], &params);
    let (_, failed) = ended(
        (&decode, &mut scheduler),
        "mixed-1",
        Duration::from_secs(10),
    )
    .await;
    assert!(
        failed[0].reason.contains("compatibility hash mismatch"),
        "{failed:?}"
    );
    assert_eq!(decode.push_stats().registrations_sent, 0);

    // A Python push prefill whose own hash is the pull one: it refuses the Rust push
    // decode's payload before it writes.
    let mut peer = VllmPeer::start();
    let push = push_factors().hash();
    python_prefill(&mut peer, &push);
    let (decode, mut scheduler) = push_decode(30.0);
    let params = finish_on_python(&mut peer, "mixed-2", &[1]);
    start((&decode, &mut scheduler), "mixed-2", &[2], &params);
    let refused = peer.json(&format!("kv_push_write {pull} 10 0"));
    assert_eq!(refused["mismatch"], json!([pull, push]), "{refused}");
}

/// A Rust vLLM-mode push prefill of TP 1 (lease 1.5 s: the Python decode sends no
/// heartbeat unless told, and a loaded host's handshake with it fits), its cache filled
/// with [`rust_byte_of`] 0.
fn push_prefill() -> (KvConnectorWorker, KvConnectorScheduler) {
    let mut kv = vllm_kv(&push_factors());
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("transfer_mode".into(), "push".into());
    extra.insert("kv_lease_duration".into(), 1.5.into());
    let (prefill, scheduler) = vllm_engine_with("rs-push-prefill", kv);
    fill_rust_prefill(&prefill, 0);
    (prefill, scheduler)
}

/// Finishes `request` in `blocks` on the Rust prefill's scheduler for a decode and holds it
/// on every rank of `prefills` (the next step): vLLM's JSON params.
fn finish_on_rust(
    (prefills, scheduler): (&[KvConnectorWorker], &mut KvConnectorScheduler),
    request: &str,
    blocks: &[usize],
) -> String {
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let finished = scheduler.request_finished(
        request,
        blocks,
        blocks.len() * 16,
        Some(&for_decode),
        FinishStatus::LengthCapped,
    );
    assert!(finished.delay_free_blocks);
    let meta = scheduler.build_connector_meta();
    for rank in prefills {
        rank.start_load_kv(&meta);
    }
    finished.kv_transfer_params.unwrap().to_vllm_json()
}

/// The Python engine as a push decode (its cache and side channel serving under `hash`);
/// its side channel's port.
fn python_decode(peer: &mut VllmPeer, hash: &str) -> u16 {
    let got = peer.json(&format!(
        "kv_prefill {hash} 0 0 py-push-decode {REGIONS} {BLOCKS} {BLOCK_LEN} 16"
    ));
    got["port"].as_u64().unwrap() as u16
}

/// The Python decode registers `local` for its request `request` with the prefill of
/// `params`, its side channel named `host`, its handshake checking `hash`.
fn register(
    peer: &mut VllmPeer,
    params: &str,
    hash: &str,
    request: &str,
    local: &[usize],
    host: &str,
) -> Value {
    let ids: Vec<String> = local.iter().map(usize::to_string).collect();
    peer.json(&format!(
        "kv_push_register {} {hash} {} {} {host}",
        hex(params.as_bytes()),
        hex(request.as_bytes()),
        ids.join(",")
    ))
}

/// Waits for the Python decode's WRITE notification of `request` and checks that its
/// `local` blocks hold the Rust prefill's `remote` ones.
fn written_into_python(
    peer: &mut VllmPeer,
    prefill: &KvConnectorWorker,
    request: &str,
    local: &[usize],
    remote: &[usize],
) {
    let ids: Vec<String> = local.iter().map(usize::to_string).collect();
    let got = peer.json(&format!(
        "kv_push_wait {} {} 10",
        hex(request.as_bytes()),
        ids.join(",")
    ));
    let stats = (prefill.push_stats(), prefill.send_stats());
    assert_eq!(
        got["from"],
        prefill.agent().name(),
        "{request}: {got} {stats:?}"
    );
    assert_eq!(got["vllm"], json!({"id": request, "consumers": 1}), "{got}");
    let mut want = Vec::new();
    for region in 0..REGIONS {
        for &block in remote {
            want.extend((0..BLOCK_LEN).map(|o| rust_byte_of(0, region, block * BLOCK_LEN + o)));
        }
    }
    assert!(
        unhex(got["data"].as_str().unwrap()) == want,
        "other bytes landed"
    );
}

/// Waits until the Rust prefill has released `request` (its WRITE ended).
async fn released(prefill: &KvConnectorWorker, request: &str) {
    let start = Instant::now();
    loop {
        if prefill.finished().sending.iter().any(|r| r == request) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{request} never released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A Rust vLLM-mode push prefill of TP `tp` (lease 1.5 s), its ranks served by one side
/// channel, each a `tp`-th of the KV heads, rank `t`'s bytes [`rust_byte_of`] `t`; and its
/// scheduler.
fn push_prefill_of_tp(tp: usize) -> (Vec<KvConnectorWorker>, KvConnectorScheduler) {
    push_prefill_of(tp, KvAttention::Mha { total_kv_heads: 8 })
}

/// [`push_prefill_of_tp`] of a model of `attention` (MLA: each rank holds the whole latent).
fn push_prefill_of(
    tp: usize,
    attention: KvAttention,
) -> (Vec<KvConnectorWorker>, KvConnectorScheduler) {
    let mut kv = vllm_kv(&push_factors());
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("transfer_mode".into(), "push".into());
    extra.insert("kv_lease_duration".into(), 1.5.into());
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let server = Arc::new(MetadataServer::bind_now(any, VllmChannelLimits::default()).unwrap());
    let rank_len = match attention {
        KvAttention::Mla => BLOCK_LEN,
        _ => BLOCK_LEN / tp,
    };
    let spec = KvCacheSpec::uniform(REGIONS, BLOCKS, 16, attention, KvLayout::Hnd, rank_len);
    let ranks: Vec<KvConnectorWorker> = (0..tp)
        .map(|rank| {
            let mut config = WorkerConfig::new("rs-push-prefill-tp", rank, tp, kv.clone());
            config.platform = Arc::new(BuiltinPlatform::CPU);
            config.vllm_side_channel = Some(server.clone());
            let worker = KvConnectorWorker::new(config).unwrap();
            worker.register_host_kv_caches(spec.clone()).unwrap();
            fill_rust_prefill(&worker, rank);
            worker
        })
        .collect();
    let port = server.local_addr().port();
    let mut config =
        SchedulerConfig::new("rs-push-prefill-tp", "127.0.0.1", port, tp, &kv).unwrap();
    config.vllm_side_channel = Some(server);
    (ranks, KvConnectorScheduler::new(config))
}

/// A Rust push prefill of TP 2 WRITEs into a Python push decode of TP 1, which registers
/// with both ranks (vLLM's decode registers with every rank it handshook with) and waits
/// for both WRITEs (`id:2`): each rank's heads land at their place in every block, and each
/// rank frees the request once its WRITE ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_push_prefill_of_tp_2_writes_each_ranks_heads_into_a_python_decode() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    python_decode(&mut peer, &hash);
    let (prefills, mut scheduler) = push_prefill_of_tp(2);
    let (request, remote, local) = ("chat-tp2-1a2b3c4d", [5, 2, 11], [0, 1, 2]);
    let params = finish_on_rust((&prefills, &mut scheduler), request, &remote);
    let got = register(&mut peer, &params, &hash, request, &local, "127.0.0.1");
    assert_eq!(got["agents"].as_array().map(Vec::len), Some(2), "{got}");
    let ids: Vec<String> = local.iter().map(usize::to_string).collect();
    let got = peer.json(&format!(
        "kv_push_wait {} {} 10 2",
        hex(request.as_bytes()),
        ids.join(",")
    ));
    assert_eq!(got["vllm"], json!({"id": request, "consumers": 2}), "{got}");
    let mut senders: Vec<String> = serde_json::from_value(got["senders"].clone()).unwrap();
    senders.sort_unstable();
    let mut agents: Vec<String> = prefills
        .iter()
        .map(|p| p.agent().name().to_string())
        .collect();
    agents.sort_unstable();
    assert_eq!(senders, agents, "one WRITE from each rank");
    let half = BLOCK_LEN / 2;
    let mut want = Vec::new();
    for region in 0..REGIONS {
        for &block in &remote {
            want.extend(
                (0..BLOCK_LEN).map(|o| rust_byte_of(o / half, region, block * half + o % half)),
            );
        }
    }
    assert!(
        unhex(got["data"].as_str().unwrap()) == want,
        "other bytes landed"
    );
    for rank in &prefills {
        released(rank, request).await;
    }
}

/// An MLA push prefill of TP 2 into a Python push decode of TP 1: the latent, replicated on
/// both ranks, is written once (by rank 0: its bytes land, and rank 1 writes none), and rank
/// 1 sends its `id:2` notification alone; the decode, counting notifications as vLLM's does,
/// takes both, and each rank frees the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mla_push_prefill_of_tp_2_writes_the_latent_once_into_a_python_decode() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    python_decode(&mut peer, &hash);
    let (prefills, mut scheduler) = push_prefill_of(2, KvAttention::Mla);
    let (request, remote, local) = ("chat-mla-1a2b3c4d", [4, 9, 1], [3, 6, 7]);
    let params = finish_on_rust((&prefills, &mut scheduler), request, &remote);
    register(&mut peer, &params, &hash, request, &local, "127.0.0.1");
    let ids: Vec<String> = local.iter().map(usize::to_string).collect();
    let got = peer.json(&format!(
        "kv_push_wait {} {} 10 2",
        hex(request.as_bytes()),
        ids.join(",")
    ));
    let senders = got["senders"].as_array().map(Vec::len);
    assert_eq!(senders, Some(2), "{got}");
    let want: Vec<u8> = (0..REGIONS)
        .flat_map(|region| {
            remote.iter().flat_map(move |&block| {
                (0..BLOCK_LEN).map(move |o| rust_byte_of(0, region, block * BLOCK_LEN + o))
            })
        })
        .collect();
    assert!(
        unhex(got["data"].as_str().unwrap()) == want,
        "rank 0's latent, and no other bytes"
    );
    for rank in &prefills {
        released(rank, request).await;
    }
    let bytes: Vec<u64> = prefills
        .iter()
        .map(|p| p.push_stats().bytes_written)
        .collect();
    assert_eq!(bytes, [(REGIONS * remote.len() * BLOCK_LEN) as u64, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_push_prefill_writes_every_byte_a_python_decode_registered_and_then_frees() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    python_decode(&mut peer, &hash);
    let (prefill, mut scheduler) = push_prefill();
    let params = finish_on_rust(
        (std::slice::from_ref(&prefill), &mut scheduler),
        "chat-9-1a2b3c4d",
        &[5, 2, 11, 7],
    );
    let raw: Value = serde_json::from_str(&params).unwrap();
    let keys: Vec<&str> = raw
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut keys = keys;
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "dcp_size",
            "do_remote_decode",
            "do_remote_prefill",
            "pp_size",
            "remote_block_ids",
            "remote_engine_id",
            "remote_host",
            "remote_num_tokens",
            "remote_port",
            "remote_request_id",
            "tp_size",
            "transfer_mode"
        ],
        "vLLM's push params: {raw}"
    );
    assert_eq!(raw["transfer_mode"], "push");
    assert_eq!(raw["remote_block_ids"], json!([[5, 2, 11, 7]]));

    // The decode's id has another random suffix, its prefix cache holds the first two
    // blocks, and it names its side channel "localhost".
    let sent = register(
        &mut peer,
        &params,
        &hash,
        "chat-9-0badf00d",
        &[0, 1],
        "localhost",
    );
    assert_eq!(sent["agent"], prefill.agent().name(), "{sent}");
    written_into_python(&mut peer, &prefill, "chat-9-0badf00d", &[0, 1], &[11, 7]);
    released(&prefill, "chat-9-1a2b3c4d").await;
    let stats = prefill.push_stats();
    assert_eq!(
        (stats.registrations_matched, stats.writes),
        (1, 1),
        "{stats:?}"
    );
    assert_eq!(stats.bytes_written, (2 * REGIONS * BLOCK_LEN) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_registration_waits_and_heartbeats_keep_a_request_past_its_lease() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    python_decode(&mut peer, &hash);
    let (prefill, mut scheduler) = push_prefill();
    let params = finish_on_rust(
        (std::slice::from_ref(&prefill), &mut scheduler),
        "hb-1",
        &[1, 2],
    );
    // A registration for a request the prefill does not hold yet waits there (at most a
    // lease) until it is held.
    let early = params.replace("\"hb-1\"", "\"early-1\"");
    register(&mut peer, &early, &hash, "early-1", &[3, 4], "127.0.0.1");
    // Sent once register returns; taken within this (well inside the 1.5 s it may wait).
    tokio::time::sleep(Duration::from_millis(700)).await;
    finish_on_rust(
        (std::slice::from_ref(&prefill), &mut scheduler),
        "early-1",
        &[8, 9],
    );
    written_into_python(&mut peer, &prefill, "early-1", &[3, 4], &[8, 9]);
    released(&prefill, "early-1").await;
    assert_eq!(prefill.push_stats().registrations_waited, 1);

    // Heartbeats keep "hb-1" held over three leases with nothing registered.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(4500) {
        peer.call(&format!("kv_push_hb rs-push-prefill {}", hex(b"hb-1")));
        assert!(prefill.finished().sending.is_empty(), "freed while wanted");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    register(&mut peer, &params, &hash, "hb-1", &[6, 7], "127.0.0.1");
    written_into_python(&mut peer, &prefill, "hb-1", &[6, 7], &[1, 2]);
    released(&prefill, "hb-1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_push_prefill_and_a_python_pull_engine_refuse_each_other() {
    let mut peer = VllmPeer::start();
    let (push, pull) = (push_factors().hash(), factors().hash());
    // The Python decode checks with the pull hash: it refuses the Rust prefill.
    python_decode(&mut peer, &pull);
    let (prefill, mut scheduler) = push_prefill();
    let params = finish_on_rust(
        (std::slice::from_ref(&prefill), &mut scheduler),
        "mixed-3",
        &[1],
    );
    let refused = register(&mut peer, &params, &pull, "mixed-3", &[2], "127.0.0.1");
    assert_eq!(refused["mismatch"], json!([pull, push]), "{refused}");
    // Its registration checking the push hash goes, but it serves the pull one: the Rust
    // prefill's handshake refuses it and writes nothing; the request is freed by its lease.
    register(&mut peer, &params, &push, "mixed-3", &[2], "127.0.0.1");
    released(&prefill, "mixed-3").await;
    let stats = prefill.push_stats();
    assert_eq!((stats.writes, stats.failed_writes), (0, 1), "{stats:?}");
    assert_eq!(prefill.send_stats().freed_on_timeout, 1);
    let none = peer.json(&format!("kv_push_wait {} 2 0.3", hex(b"mixed-3")));
    assert_eq!(none["error"], "no WRITE notification", "{none}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_agents_and_malformed_notifications_are_dropped_and_counted_in_both_roles() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();

    // Decode: completions from an agent it did not register with, without a ':', or of a
    // count that is not a number or not the prefill's TP end nothing.
    python_prefill(&mut peer, &hash);
    let (decode, mut scheduler) = push_decode(30.0);
    let params = finish_on_python(&mut peer, "fg-1", &[1, 2]);
    start((&decode, &mut scheduler), "fg-1", &[3, 4], &params);
    let port = decode.side_channel_addr().unwrap().port();
    for forged in [&b"fg-1:1"[..], b"fg-1", b"fg-1:x", b"fg-1:2", b"\xff\xfe"] {
        let got = peer.json(&format!(
            "kv_forge {port} {hash} rs-push-decode {}",
            hex(forged)
        ));
        assert!(got.get("agent").is_some(), "{got}");
    }
    let start = Instant::now();
    while decode.push_stats().refused_ends < 5 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            decode.push_stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        decode.finished().recving.is_empty(),
        "ended by a forged completion"
    );
    peer.json(&format!("kv_push_write {hash} 10 0"));
    let outcome = outcome((&decode, &mut scheduler), "fg-1", Duration::from_secs(10)).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &[3, 4], &[1, 2], &[5]);

    // Prefill: a registration that does not parse is refused; one from a third agent naming
    // the real decode's blocks writes nothing and leaves the request for the decode's own.
    let mut peer = VllmPeer::start();
    let decode_port = python_decode(&mut peer, &hash);
    let (prefill, mut scheduler) = push_prefill();
    let params = finish_on_rust(
        (std::slice::from_ref(&prefill), &mut scheduler),
        "fg-2",
        &[6, 7],
    );
    let port = prefill.side_channel_addr().unwrap().port();
    let garbage = b"PUSH_REG:\x92\x01";
    peer.json(&format!(
        "kv_forge {port} {hash} rs-push-prefill {}",
        hex(garbage)
    ));
    let real: Value = serde_json::from_str(&params).unwrap();
    let forged = PushRegistration {
        request_id: "fg-2".into(),
        decode_engine_id: "py-push-decode".into(),
        decode_host: "127.0.0.1".into(),
        decode_port,
        decode_tp_size: 1,
        local_block_ids: RegisteredBlocks::Groups(vec![vec![0, 1]]),
        remote_engine_id: "rs-push-prefill".into(),
        remote_host: "127.0.0.1".into(),
        remote_port: real["remote_port"].as_u64().unwrap() as u16,
        remote_tp_size: 1,
        remote_pp_size: 1,
    };
    let message = forged.encode().unwrap();
    peer.json(&format!(
        "kv_forge {port} {hash} rs-push-prefill {}",
        hex(&message)
    ));
    let start = Instant::now();
    loop {
        let stats = prefill.push_stats();
        if stats.registrations_refused == 1 && stats.registrations_oversized == 1 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{stats:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(prefill.push_stats().writes, 0);
    register(&mut peer, &params, &hash, "fg-2", &[2, 3], "127.0.0.1");
    written_into_python(&mut peer, &prefill, "fg-2", &[2, 3], &[6, 7]);
    released(&prefill, "fg-2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_prefix_hit_sends_nothing_and_an_aborted_load_keeps_its_blocks_a_grace() {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    python_prefill(&mut peer, &hash);
    let (decode, mut scheduler) = push_decode(30.0);
    // A full prefix hit: nothing to write, and vLLM's push has no message for it (the
    // prefill frees by its lease).
    let params = finish_on_python(&mut peer, "hit-1", &[1, 2]);
    start((&decode, &mut scheduler), "hit-1", &[], &params);
    // An abort after the registration went.
    let params = finish_on_python(&mut peer, "ab-1", &[3, 4]);
    start((&decode, &mut scheduler), "ab-1", &[5, 6], &params);
    let start_at = Instant::now();
    while decode.push_stats().registrations_sent == 0 {
        assert!(
            start_at.elapsed() < Duration::from_secs(10),
            "no registration"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let finished =
        scheduler.request_finished("ab-1", &[5, 6], 0, Some(&params), FinishStatus::Aborted);
    assert!(
        finished.delay_free_blocks,
        "the blocks stay until the load ends"
    );
    let aborted = Instant::now();
    let (outcome, failed) = ended((&decode, &mut scheduler), "ab-1", Duration::from_secs(10)).await;
    assert!(
        matches!(outcome, LoadOutcome::AbortedLoadEnded { .. }),
        "{outcome:?}"
    );
    assert!(failed.is_empty(), "{failed:?}");
    assert!(
        aborted.elapsed() >= Duration::from_millis(1200),
        "two leases: {:?}",
        aborted.elapsed()
    );
    // The prefill got one registration (ab-1's) and nothing for hit-1.
    let notes = peer.json("kv_notifs 100 0.3");
    let registrations: Vec<&Value> = notes
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["hex"].as_str().unwrap().starts_with(&hex(b"PUSH_REG:")))
        .collect();
    assert_eq!(registrations.len(), 1, "{notes}");
    let raw = unhex(registrations[0]["hex"].as_str().unwrap());
    assert_eq!(PushRegistration::parse(&raw).unwrap().request_id, "ab-1");
    assert!(
        notes.as_array().unwrap().iter().all(|n| {
            let text = String::from_utf8_lossy(&unhex(n["hex"].as_str().unwrap())).to_string();
            text.starts_with("PUSH_REG:") || text.starts_with("HB:")
        }),
        "only registrations and heartbeats: {notes}"
    );
}

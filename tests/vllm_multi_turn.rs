//! Multi-turn read-backs (vLLM 0.33's `bidirectional_kv_xfer`) between nixl-connector in
//! vLLM mode and the Python vLLM-protocol peer (tests/py/vllm_peer.py), taught the mode from
//! vLLM's source, both ways, every byte checked:
//! - a Rust decode keeps a finished request's blocks and a Python prefill reads them back
//!   for turn 2 from the params the decode returned (the tokens counted as vLLM counts them,
//!   the expiry read through the handshake's clock offset, the suffix its prefix cache
//!   lacks), and the READ's notification frees them;
//! - a Python decode keeps blocks as vLLM's does, and a Rust prefill reads them back (with
//!   no heartbeat while it waits, as vLLM's prefill sends none for read-backs);
//! - in both directions, blocks that expire within vLLM's 5 s margin are declined: nothing
//!   is read and nobody told, and the decode frees them at their TTL;
//! - below vLLM's recompute threshold either prefill only tells the decode.

mod py;
mod vllm_peer_support;
#[path = "../nixl-connector/tests/vllm_support/mod.rs"]
mod vllm_support;

use std::time::{Duration, Instant};

use nixl::kv_config::KvTransferConfig;
use nixl_connector::{
    FinishStatus, KvConnectorScheduler, KvConnectorWorker, KvTransferParams, LoadOutcome,
    WorkerOutput,
};
use py::{hex, unhex};
use serde_json::{json, Value};
use vllm_peer_support::{
    fill_rust_prefill, python_byte_of, rust_byte_of, vllm_engine_with, vllm_kv, VllmPeer, BLOCKS,
    BLOCK_LEN, REGIONS,
};
use vllm_support::factors;

/// How long a test waits for the other engine.
const WAIT: Duration = Duration::from_secs(10);

/// [`vllm_kv`] with read-backs on, kept blocks living `ttl` seconds (vLLM's
/// `decoder_kv_blocks_ttl`) and vLLM's default recompute threshold of 64 tokens.
fn multi_turn_kv(ttl: f64) -> KvTransferConfig {
    let mut kv = vllm_kv(&factors());
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("bidirectional_kv_xfer".into(), true.into());
    extra.insert("decoder_kv_blocks_ttl".into(), ttl.into());
    kv
}

/// Starts the peer's Python engine `engine` on [`vllm_peer_support::kv_spec`]'s geometry
/// (`kv_prefill`: its KV cache registered and its side channel serving it, a prefill or a
/// decode alike).
fn python_engine(peer: &mut VllmPeer, engine: &str) {
    let got = peer.json(&format!(
        "kv_prefill {} 0 0 {engine} {REGIONS} {BLOCKS} {BLOCK_LEN} 16",
        factors().hash()
    ));
    assert!(got["port"].is_u64(), "{got}");
}

/// The peer's Python engine runs `kv_pull` of the JSON `params` into its `local` blocks,
/// with `turn2` its `PROMPT COMPUTED THRESHOLD` for a read-back.
fn python_pull(peer: &mut VllmPeer, params: &str, local: &str, turn2: &str) -> Value {
    let hash = factors().hash();
    peer.json(&format!(
        "kv_pull {} {hash} {local} {turn2}",
        hex(params.as_bytes())
    ))
}

/// Steps `engine` until request `id`'s load ends: its outcome.
async fn load_ended(
    (worker, scheduler): (&KvConnectorWorker, &mut KvConnectorScheduler),
    id: &str,
) -> LoadOutcome {
    worker.start_load_kv(&scheduler.build_connector_meta());
    let start = Instant::now();
    loop {
        let output = WorkerOutput {
            tp_rank: 0,
            pp_rank: 0,
            finished: worker.finished(),
            load_errors: worker.load_errors(),
        };
        let out = scheduler.update_connector_output(&[output]).unwrap();
        if let Some(outcome) = out.load_outcomes.into_iter().next() {
            return outcome;
        }
        assert!(start.elapsed() < WAIT, "request {id}'s load never ended");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Steps `engine` until it releases request `id` (the only one it holds).
async fn released((worker, scheduler): (&KvConnectorWorker, &mut KvConnectorScheduler), id: &str) {
    let start = Instant::now();
    loop {
        let output = WorkerOutput {
            tp_rank: 0,
            pp_rank: 0,
            finished: worker.finished(),
            load_errors: worker.load_errors(),
        };
        let out = scheduler.update_connector_output(&[output]).unwrap();
        if !out.finished_sending.is_empty() {
            assert_eq!(out.finished_sending, [id]);
            return;
        }
        assert!(start.elapsed() < WAIT, "request {id} was never released");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Blocks `blocks` of every region of `worker`'s cache, region by region (the order of
/// `kv_pull`'s data).
fn rust_blocks(worker: &KvConnectorWorker, blocks: &[usize]) -> Vec<u8> {
    let mut out = Vec::new();
    for region in 0..REGIONS {
        for &block in blocks {
            out.extend(rust_block(worker, region, block));
        }
    }
    out
}

/// Block `block` of region `region` of `worker`'s cache.
fn rust_block(worker: &KvConnectorWorker, region: usize, block: usize) -> Vec<u8> {
    let mut got = vec![0u8; BLOCK_LEN];
    worker
        .kv_caches()
        .unwrap()
        .read(region, block * BLOCK_LEN, &mut got)
        .unwrap();
    got
}

/// Block `block` of region `region` as `byte_of(region, i)` fills its region.
fn block_of(byte_of: impl Fn(usize, usize) -> u8, region: usize, block: usize) -> Vec<u8> {
    (0..BLOCK_LEN)
        .map(|o| byte_of(region, block * BLOCK_LEN + o))
        .collect()
}

/// The bytes a decode computes itself in block `block` of region `region`.
fn computed_block(region: usize, block: usize) -> Vec<u8> {
    block_of(|r, i| ((i * 5 + r * 29 + 17) % 251) as u8, region, block)
}

/// Turn 1 of a conversation on a Rust decode with read-backs on and kept blocks living
/// `ttl` seconds: it loads the Python prefill's 4 blocks (64 tokens, its blocks 1-4) into
/// blocks 5-8, computes 16 tokens in block 9, and keeps 5-9. The decode and its kept
/// params, vLLM's JSON.
async fn rust_decode_keeps(
    peer: &mut VllmPeer,
    tag: &str,
    ttl: f64,
) -> (KvConnectorWorker, KvConnectorScheduler, Value) {
    python_engine(peer, &format!("py-mt-prefill-{tag}"));
    let (decode, mut scheduler) =
        vllm_engine_with(&format!("rs-mt-decode-{tag}"), multi_turn_kv(ttl));
    let json = peer.call(&format!("kv_finish {} 1,2,3,4", hex(b"conv-1")));
    let params = KvTransferParams::from_vllm_json(&json).unwrap();
    scheduler.on_new_request("conv-1", Some(&params));
    scheduler
        .update_state_after_alloc("conv-1", &[5, 6, 7, 8], &params)
        .unwrap();
    let outcome = load_ended((&decode, &mut scheduler), "conv-1").await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    let cache = decode.kv_caches().unwrap();
    for region in 0..REGIONS {
        for (local, remote) in [(5, 1), (6, 2), (7, 3), (8, 4)] {
            let want = block_of(|r, i| python_byte_of(0, r, i), region, remote);
            assert!(
                rust_block(&decode, region, local) == want,
                "turn 1: block {local}"
            );
        }
        cache
            .write(region, 9 * BLOCK_LEN, &computed_block(region, 9))
            .unwrap();
    }
    let done =
        scheduler.request_finished("conv-1", &[5, 6, 7, 8, 9], 80, None, FinishStatus::Stopped);
    assert!(done.delay_free_blocks, "the decode keeps its blocks");
    decode.start_load_kv(&scheduler.build_connector_meta());
    let kept: Value =
        serde_json::from_str(&done.kv_transfer_params.unwrap().to_vllm_json()).unwrap();
    (decode, scheduler, kept)
}

/// (a) A Rust decode serving a vLLM prefill's turn 2: the Python prefill reads the suffix
/// its prefix cache lacks from the kept params, and its notification frees the blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_prefill_reads_back_a_rust_decodes_kept_blocks_and_its_notification_frees_them() {
    let mut peer = VllmPeer::start();
    let before = nixl_connector::vllm::clock::perf_counter();
    let (decode, mut scheduler, kept) = rust_decode_keeps(&mut peer, "read", 480.0).await;
    let port = decode.side_channel_addr().unwrap().port();
    let expiry = kept["remote_blocks_expiry_time"]
        .as_f64()
        .expect("an expiry time");
    assert!(expiry >= before + 480.0, "{kept}");
    // vLLM 0.33's request_finished on a decode (is_d_node) with bidirectional_kv_xfer.
    let want = json!({
        "do_remote_prefill": false, "do_remote_decode": true,
        "remote_block_ids": [[5, 6, 7, 8, 9]], "remote_engine_id": "rs-mt-decode-read",
        "remote_request_id": "conv-1", "remote_host": "127.0.0.1", "remote_port": port,
        "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 80,
        "remote_blocks_expiry_time": expiry,
        "remote_registration_generation": 1, "transfer_mode": "pull",
    });
    assert_eq!(kept, want);

    // Turn 2 of 90 tokens; the prefill's prefix cache holds the first block (16 tokens):
    // 64 tokens to read, into 4 blocks, from the last 4 of the decode's 5.
    let got = python_pull(&mut peer, &kept.to_string(), "10,11,12,13,14", "90 16 64");
    assert_eq!(got["tokens"], 64, "{got}");
    assert_eq!(got["remote_blocks"], json!([6, 7, 8, 9]), "{got}");
    let left = got["left"].as_f64().unwrap();
    assert!(
        (470.0..=480.0).contains(&left),
        "the expiry on the prefill's clock, through the handshake's offset: {left} s left"
    );
    let data = unhex(got["data"].as_str().expect("the blocks read"));
    assert!(
        data == rust_blocks(&decode, &[6, 7, 8, 9]),
        "the Python prefill read other bytes"
    );
    let mut turn_two = Vec::new();
    for region in 0..REGIONS {
        for block in 2..=4 {
            turn_two.extend(block_of(|r, i| python_byte_of(0, r, i), region, block));
        }
        turn_two.extend(computed_block(region, 9));
    }
    assert!(
        data == turn_two,
        "turn 1's prompt tail and the decode's own tokens"
    );

    // The READ's notification "conv-1:1" releases the kept request.
    released((&decode, &mut scheduler), "conv-1").await;
    assert_eq!(decode.send_stats().freed_on_notification, 1);
    assert_eq!(decode.send_stats().freed_on_timeout, 0);
    let stats = scheduler.kept_stats();
    assert_eq!(
        (stats.kept_requests, stats.kept_blocks, stats.kept_total),
        (0, 0, 1)
    );
}

/// (c) A Rust decode keeping blocks for 3 s: within vLLM's 5 s margin, the Python prefill
/// declines the read (nothing read, nobody told), and the decode frees them at their TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_prefill_declines_a_rust_decodes_blocks_near_their_expiry() {
    let mut peer = VllmPeer::start();
    let (decode, mut scheduler, kept) = rust_decode_keeps(&mut peer, "expiring", 3.0).await;
    let got = python_pull(&mut peer, &kept.to_string(), "10,11,12,13", "90 16 64");
    assert_eq!(got["declined"], "expired", "{got}");
    let left = got["left"].as_f64().unwrap();
    assert!((1.0..=3.0).contains(&left), "{left} s left");
    assert!(got.get("data").is_none(), "{got}");
    released((&decode, &mut scheduler), "conv-1").await;
    assert_eq!(decode.send_stats().freed_on_timeout, 1, "at the TTL");
    assert_eq!(decode.send_stats().freed_on_notification, 0, "nobody told");
}

/// Turn 1 of a conversation on a Rust prefill with read-backs on: it computes 64 tokens in
/// blocks 1-4, the Python decode loads them into its blocks 6-9 (every byte checked) and
/// its notification frees them; the decode then computes 16 tokens in block 10 and keeps
/// blocks 6-10 for `ttl` seconds. The prefill and the kept params (vLLM's JSON).
async fn python_decode_keeps(
    peer: &mut VllmPeer,
    tag: &str,
    ttl: f64,
) -> (KvConnectorWorker, KvConnectorScheduler, String) {
    python_engine(peer, &format!("py-mt-decode-{tag}"));
    let (prefill, mut scheduler) =
        vllm_engine_with(&format!("rs-mt-prefill-{tag}"), multi_turn_kv(480.0));
    fill_rust_prefill(&prefill, 0);
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let done = scheduler.request_finished(
        "conv-1",
        &[1, 2, 3, 4],
        64,
        Some(&for_decode),
        FinishStatus::LengthCapped,
    );
    prefill.start_load_kv(&scheduler.build_connector_meta());
    let params = done.kv_transfer_params.unwrap().to_vllm_json();
    let got = python_pull(peer, &params, "6,7,8,9", "");
    let mut want = Vec::new();
    for region in 0..REGIONS {
        for block in 1..=4 {
            want.extend(block_of(|r, i| rust_byte_of(0, r, i), region, block));
        }
    }
    let data = unhex(got["data"].as_str().expect("turn 1 read"));
    assert!(data == want, "turn 1: the Python decode read other bytes");
    released((&prefill, &mut scheduler), "conv-1").await;
    let kept = peer.call(&format!("kv_keep {} 6,7,8,9,10 80 {ttl}", hex(b"conv-1")));
    (prefill, scheduler, kept)
}

/// (b) A vLLM decode serving a Rust prefill's turn 2: the Rust prefill reads back the
/// suffix its prefix cache lacks, every byte, and the Python decode gets vLLM's
/// notification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_prefill_reads_back_a_python_decodes_kept_blocks_and_notifies_it() {
    let mut peer = VllmPeer::start();
    let (prefill, mut scheduler, kept) = python_decode_keeps(&mut peer, "read", 480.0).await;
    let json: Value = serde_json::from_str(&kept).unwrap();
    assert_eq!(json["do_remote_decode"], true, "{json}");
    assert_eq!(json["do_remote_prefill"], false, "{json}");
    let params = KvTransferParams::from_vllm_json(&kept).unwrap();

    // Turn 2 of 90 tokens; the prefill's prefix cache holds block 1 (16 tokens): 64 to read.
    assert_eq!(scheduler.read_back_tokens(Some(&params), 90, 16), 64);
    scheduler.on_new_request("conv-2", Some(&params));
    // It waits a few heartbeat intervals (0.1 s) for blocks: vLLM's prefill sends no
    // heartbeat for a read-back, nor does this one.
    for _ in 0..3 {
        prefill.start_load_kv(&scheduler.build_connector_meta());
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    scheduler
        .update_state_after_alloc("conv-2", &[12, 13, 14, 15], &params)
        .unwrap();
    let outcome = load_ended((&prefill, &mut scheduler), "conv-2").await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    // The decode's blocks 7-10: the Rust prefill's turn 1 blocks 2-4, then its own tokens.
    for region in 0..REGIONS {
        for (local, remote) in [(12, 2), (13, 3), (14, 4)] {
            let want = block_of(|r, i| rust_byte_of(0, r, i), region, remote);
            assert!(rust_block(&prefill, region, local) == want, "block {local}");
        }
        let want = block_of(|r, i| python_byte_of(0, r, i), region, 10);
        assert!(
            rust_block(&prefill, region, 15) == want,
            "block 15: the decode's"
        );
    }
    assert_eq!(scheduler.kept_stats().read_backs, 1);

    let notes = peer.json("kv_notifs 1 10");
    assert_eq!(notes[0]["from"], prefill.agent().name(), "{notes}");
    assert_eq!(unhex(notes[0]["hex"].as_str().unwrap()), b"conv-1:1");
    assert_eq!(notes[0]["vllm"], json!({"id": "conv-1", "consumers": 1}));
    assert_eq!(
        peer.json("kv_notifs 1 0.3"),
        json!([]),
        "one notification, no heartbeat"
    );
}

/// (c) A Python decode keeping blocks for 3 s: within vLLM's 5 s margin, the Rust prefill
/// declines the read-back, recomputes the tokens (nothing written), and tells nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_prefill_declines_a_python_decodes_blocks_near_their_expiry() {
    let mut peer = VllmPeer::start();
    let (prefill, mut scheduler, kept) = python_decode_keeps(&mut peer, "expiring", 3.0).await;
    let params = KvTransferParams::from_vllm_json(&kept).unwrap();
    assert_eq!(scheduler.read_back_tokens(Some(&params), 90, 16), 64);
    scheduler.on_new_request("conv-2", Some(&params));
    scheduler
        .update_state_after_alloc("conv-2", &[12, 13, 14, 15], &params)
        .unwrap();
    let before = rust_blocks(&prefill, &[12, 13, 14, 15]);
    match load_ended((&prefill, &mut scheduler), "conv-2").await {
        LoadOutcome::Recompute {
            block_ids, reason, ..
        } => {
            assert_eq!(block_ids, [12, 13, 14, 15]);
            assert!(reason.contains("expired"), "{reason}");
        }
        other => panic!("an expiring read-back must be recomputed: {other:?}"),
    }
    assert!(
        rust_blocks(&prefill, &[12, 13, 14, 15]) == before,
        "nothing read"
    );
    assert_eq!(peer.json("kv_notifs 1 1"), json!([]), "nobody told");
}

/// Below vLLM's recompute threshold (64 tokens) neither prefill reads back: each only
/// tells the decode, which frees the kept blocks on that notification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_the_recompute_threshold_either_prefill_only_tells_the_decode() {
    // A Python prefill whose prefix cache holds 32 of the 80 kept tokens: 48 to read.
    let mut peer = VllmPeer::start();
    let (decode, mut scheduler, kept) = rust_decode_keeps(&mut peer, "few", 480.0).await;
    let got = python_pull(&mut peer, &kept.to_string(), "10,11,12", "90 32 64");
    assert_eq!(
        (&got["tokens"], &got["notified"]),
        (&json!(0), &json!(true)),
        "{got}"
    );
    released((&decode, &mut scheduler), "conv-1").await;
    assert_eq!(decode.send_stats().freed_on_notification, 1);

    // A Rust prefill likewise, against a Python decode.
    let mut peer = VllmPeer::start();
    let (prefill, mut scheduler, kept) = python_decode_keeps(&mut peer, "few", 480.0).await;
    let params = KvTransferParams::from_vllm_json(&kept).unwrap();
    assert_eq!(scheduler.read_back_tokens(Some(&params), 90, 32), 0);
    scheduler.on_new_request("conv-2", Some(&params));
    scheduler
        .update_state_after_alloc("conv-2", &[], &params)
        .unwrap();
    prefill.start_load_kv(&scheduler.build_connector_meta());
    let notes = peer.json("kv_notifs 1 10");
    assert_eq!(
        notes[0]["vllm"],
        json!({"id": "conv-1", "consumers": 1}),
        "{notes}"
    );
    let stats = scheduler.kept_stats();
    assert_eq!((stats.below_threshold, stats.read_backs), (1, 0));
}

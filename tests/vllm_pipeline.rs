//! Pipeline parallelism in vLLM's protocol against the Python peer that speaks vLLM 0.33's
//! side channel (tests/py/vllm_peer.py), over real NIXL:
//! - a Rust decode of two pipeline stages reads a Python prefill of one, as vLLM's pull mode
//!   pairs them (each stage its layers' regions of the prefill's, vLLM's
//!   `_remote_region_offset`), every byte checked; each stage's rank notifies the prefill,
//!   saying both (vLLM's `pp_size` × producers per consumer);
//! - a Rust decode of one stage and one of two read a Python prefill of two stages (5
//!   layers, vLLM's split 3 + 2, each stage's rank registering its layers and served as
//!   `(pp_rank, 0)`), every byte checked; every decode rank notifies every prefill stage,
//!   saying the decode's `pp_size` × producers per consumer, and the Python prefill (counting
//!   as vLLM's prefill worker counts) frees the request only once every stage's readers did;
//!   and the same against a Python prefill of two stages of TP 2 (each rank's KV heads in
//!   their place, each rank notified by its readers);
//! - a Python decode asks a Rust prefill of two stages for each rank by `(pp_rank, tp_rank)`
//!   (vLLM's `_nixl_handshake` over every remote rank) and gets that stage's registration; a
//!   stage the engine lacks is refused, naming the ranks it serves;
//! - a Python reader on vLLM's wire (NIXL's Python API) of one stage reads a Rust prefill
//!   of two stages end to end (every layer from the stage holding it, every byte checked),
//!   and the Rust engine frees the request only once both stages heard their reader's
//!   notification. vLLM 0.33's own pull decode does not read so: it handshakes with every
//!   stage but reads from `pp_rank` 0 alone (its `_read_blocks`), so it pairs with a
//!   prefill of one stage (the connector README's pipeline section).

mod py;
mod vllm_peer_support;
#[path = "../nixl-connector/tests/vllm_support/mod.rs"]
mod vllm_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::kv_config::KvTransferConfig;
use nixl::platform::BuiltinPlatform;
use nixl_connector::vllm::{MetadataServer, VllmChannelLimits};
use nixl_connector::{
    FinishStatus, KvAttention, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvLayout,
    KvTransferParams, LoadOutcome, PipelineRank, PipelineStages, SchedulerConfig, WorkerConfig,
};
use py::{hex, unhex};
use serde_json::{json, Value};
use vllm_peer_support::{
    load_outcome, python_byte_of, rust_byte_of, vllm_kv, VllmPeer, BLOCKS, BLOCK_LEN, REGIONS,
};
use vllm_support::factors;

/// The layers of the Python prefill of two stages (vLLM's split: 3 on stage 0, 2 on 1).
const LAYERS: usize = 5;

/// A stage's cache: `layers` of the model's layers, one region each.
fn stage_spec(layers: usize) -> KvCacheSpec {
    let attention = KvAttention::Mha { total_kv_heads: 8 };
    KvCacheSpec::uniform(layers, BLOCKS, 16, attention, KvLayout::Hnd, BLOCK_LEN)
}

/// The ranks of an engine of `pp` pipeline stages of TP 1 splitting `layers` layers as
/// vLLM does, in vLLM mode, served by one side channel, and its scheduler.
fn engine_of_stages(
    engine: &str,
    layers: usize,
    pp: usize,
) -> (Vec<KvConnectorWorker>, KvConnectorScheduler) {
    engine_of_stages_with(engine, layers, pp, vllm_kv(&factors()))
}

/// As [`engine_of_stages`], with `kv`.
fn engine_of_stages_with(
    engine: &str,
    layers: usize,
    pp: usize,
    kv: KvTransferConfig,
) -> (Vec<KvConnectorWorker>, KvConnectorScheduler) {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let server = Arc::new(MetadataServer::bind_now(any, VllmChannelLimits::default()).unwrap());
    let stages = PipelineStages::even(layers, pp).unwrap();
    let workers = (0..pp)
        .map(|stage| {
            let mut config = WorkerConfig::new(engine, 0, 1, kv.clone());
            config.platform = Arc::new(BuiltinPlatform::CPU);
            config.vllm_side_channel = Some(server.clone());
            config.pipeline = Some(PipelineRank::new(stages.clone(), stage).unwrap());
            let worker = KvConnectorWorker::new(config).unwrap();
            let spec = stage_spec(stages.layers(stage).len());
            worker.register_host_kv_caches(spec).unwrap();
            worker
        })
        .collect();
    let port = server.local_addr().port();
    let mut config = SchedulerConfig::new(engine, "127.0.0.1", port, 1, &kv).unwrap();
    config.pp_size = pp;
    config.vllm_side_channel = Some(server);
    (workers, KvConnectorScheduler::new(config))
}

/// An engine of two pipeline stages of TP 1 (one layer each), as [`engine_of_stages`].
fn two_stages(engine: &str) -> (Vec<KvConnectorWorker>, KvConnectorScheduler) {
    engine_of_stages(engine, REGIONS, 2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_two_stages_reads_each_layer_from_a_python_prefill() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    peer.json(&format!(
        "kv_prefill {hash} 0 0 py-engine {REGIONS} {BLOCKS} {BLOCK_LEN} 16"
    ));
    let (decodes, mut scheduler) = two_stages("rs-decode-pp");
    let (remote, local) = ([3, 9, 14], [0, 1, 2]);
    let json = peer.call(&format!("kv_finish {} 3,9,14", hex(b"py-pp-req")));
    let params = KvTransferParams::from_vllm_json(&json).unwrap();
    scheduler.on_new_request("py-pp-req", Some(&params));
    scheduler
        .update_state_after_alloc("py-pp-req", &local, &params)
        .unwrap();
    let outcome = load_outcome(&mut scheduler, &decodes).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    // Stage s holds the prefill's layer s.
    for (stage, decode) in decodes.iter().enumerate() {
        let cache = decode.kv_caches().unwrap();
        for (&l, &r) in local.iter().zip(&remote) {
            let mut got = vec![0u8; BLOCK_LEN];
            cache.read(0, l * BLOCK_LEN, &mut got).unwrap();
            let want: Vec<u8> = (0..BLOCK_LEN)
                .map(|o| python_byte_of(0, stage, r * BLOCK_LEN + o))
                .collect();
            assert!(got == want, "stage {stage} local block {l} (remote {r})");
        }
    }
    // Each stage's rank notifies, saying both (among the heartbeats of the wait).
    let mut done = Vec::new();
    while done.len() < 2 {
        let notes = peer.json("kv_notifs 1 10");
        let note = notes.get(0).expect("a notification within 10 s").clone();
        if note["vllm"].get("hb").is_none() {
            done.push(note);
        }
    }
    let mut senders: Vec<&str> = done.iter().map(|n| n["from"].as_str().unwrap()).collect();
    senders.sort_unstable();
    for (stage, decode) in decodes.iter().enumerate() {
        let name = decode.agent().name();
        assert!(
            name.starts_with(&format!("rs-decode-pp-pp{stage}-rank0-")),
            "{name}"
        );
    }
    let mut agents: Vec<&str> = decodes.iter().map(|d| d.agent().name()).collect();
    agents.sort_unstable();
    assert_eq!(senders, agents, "{done:?}");
    for note in &done {
        assert_eq!(unhex(note["hex"].as_str().unwrap()), b"py-pp-req:2");
        assert_eq!(note["vllm"], json!({"id": "py-pp-req", "consumers": 2}));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_asks_a_rust_prefill_for_each_stage_by_pp_rank() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let (prefills, scheduler) = two_stages("rs-prefill-pp");
    drop(scheduler);
    let port = prefills[0].vllm_side_channel().unwrap().local_addr().port();
    for (stage, prefill) in prefills.iter().enumerate() {
        let got = peer.json(&format!("fetch {port} {stage} 0 {hash} 1"));
        let meta = &got["meta"];
        let base = prefill.kv_caches().unwrap().regions()[0].addr as u64;
        assert_eq!(
            meta["kv_caches_base_addr"],
            json!([base]),
            "stage {stage}: {got}"
        );
        let ours = prefill.vllm_handshake_payload().unwrap();
        assert_eq!(got["payload_same_bytes"], true, "{got}");
        let theirs = unhex(meta["agent_metadata"].as_str().unwrap());
        assert_eq!(theirs, ours.agent_metadata().unwrap().agent_metadata);
    }
    let got = peer.json(&format!("fetch {port} 2 0 {hash} 1"));
    let reason = got["raw"]["error"].as_str().unwrap();
    assert!(reason.contains("no pp_rank 2 tp_rank 0"), "{got}");
    assert!(reason.contains("(0, 0), (1, 0)"), "{got}");
}

/// A Python reader of one stage on vLLM's wire (a handshake with every remote
/// `(pp_rank, 0)` as vLLM's decode makes, each stage's layers read from it, each stage
/// notified `id:1`; not vLLM 0.33's pull decode, which reads `pp_rank` 0 alone) reads a
/// Rust prefill of two stages of [`LAYERS`] layers (3 + 2) end to end: every byte of every
/// layer as the stage holding it has it, and the engine frees the request by the
/// notifications, only once both stages heard theirs (after stage 0's alone: not yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_reads_a_rust_prefill_of_two_stages() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    // A lease far longer than the test: only the notifications free the request.
    let mut kv = vllm_kv(&factors());
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("kv_lease_duration".into(), 60.0.into());
    let engine = "rs-prefill-pp2";
    let (prefills, mut scheduler) = engine_of_stages_with(engine, LAYERS, 2, kv);
    let split = PipelineStages::even(LAYERS, 2).unwrap();
    for (stage, prefill) in prefills.iter().enumerate() {
        let cache = prefill.kv_caches().unwrap();
        for (region, layer) in split.layers(stage).enumerate() {
            let bytes: Vec<u8> = (0..BLOCKS * BLOCK_LEN)
                .map(|i| rust_byte_of(0, layer, i))
                .collect();
            cache.write(region, 0, &bytes).unwrap();
        }
    }
    let (id, remote) = ("rs-pp2-req", [5, 2, 11]);
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let finished = scheduler.request_finished(
        id,
        &remote,
        48,
        Some(&for_decode),
        FinishStatus::LengthCapped,
    );
    let params: Value =
        serde_json::from_str(&finished.kv_transfer_params.unwrap().to_vllm_json()).unwrap();
    assert_eq!(params["pp_size"], 2, "{params}");
    let port = params["remote_port"].as_u64().unwrap();
    let released = |scheduler: &mut KvConnectorScheduler| {
        let meta = scheduler.build_connector_meta();
        for prefill in &prefills {
            prefill.start_load_kv(&meta);
        }
        let outputs: Vec<_> = prefills.iter().map(|p| p.output()).collect();
        let output = scheduler.update_connector_output(&outputs).unwrap();
        output.finished_sending.iter().any(|r| r == id)
    };
    assert!(!released(&mut scheduler), "held from its first step");
    for (stage, prefill) in prefills.iter().enumerate() {
        let got = peer.json(&format!(
            "kv_pp_decode {port} {hash} {engine} {LAYERS} 2 {stage} 5,2,11 {} 1",
            hex(id.as_bytes())
        ));
        let layers = split.layers(stage);
        assert_eq!(got["first_layer"], layers.start, "{got}");
        assert_eq!(got["agent"], prefill.agent().name(), "{got}");
        let data = unhex(got["data"].as_str().expect("the blocks read"));
        let want: Vec<u8> = layers
            .flat_map(|layer| {
                remote.iter().flat_map(move |&b| {
                    (0..BLOCK_LEN).map(move |o| rust_byte_of(0, layer, b * BLOCK_LEN + o))
                })
            })
            .collect();
        assert!(
            data == want,
            "stage {stage}: the Python decode read other bytes"
        );
        // Stage 0 notified alone frees nothing; both notified, the engine frees it.
        let started = Instant::now();
        let mut freed = false;
        while !freed
            && started.elapsed() < Duration::from_millis(if stage == 0 { 300 } else { 10_000 })
        {
            freed = released(&mut scheduler);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(freed, stage == 1, "after stage {stage}'s notification");
        assert_eq!(
            prefill.send_stats().freed_on_notification,
            1,
            "stage {stage}"
        );
    }
}

/// A Rust decode of `decode_pp` stages (TP 1) reads a Python prefill of two stages of
/// [`LAYERS`] layers and TP `prefill_tp` (each rank a `prefill_tp`-th of the KV heads):
/// every block of every layer of every decode stage checked (the blocks read hold the
/// prefill stage's bytes of that layer, each prefill rank's heads in their place; the
/// others stay zero), then the notifications taken one at a time, each prefill rank freeing
/// the request with its last reader's and the engine with its last rank's.
async fn rust_decode_reads_python_stages(decode_pp: usize, prefill_tp: usize) {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let engine = format!("py-prefill-pp2-tp{prefill_tp}-{decode_pp}");
    let rank_len = BLOCK_LEN / prefill_tp;
    let prefill = peer.json(&format!(
        "kv_pp_prefill {hash} {engine} 2 {prefill_tp} {LAYERS} {BLOCKS} {rank_len} 16"
    ));
    assert_eq!(prefill["stages"], json!([[0, 3], [3, 2]]), "{prefill}");
    let id = format!("rs-decode-pp{decode_pp}");
    let (decodes, mut scheduler) = engine_of_stages(&id, LAYERS, decode_pp);
    let (remote, local) = ([3, 9, 14], [0, 5, 2]);
    let params = peer.call(&format!("kv_pp_finish {} 3,9,14", hex(b"py-pp2-req")));
    let params = KvTransferParams::from_vllm_json(&params).unwrap();
    assert_eq!(params.remote_pp_size, Some(2));
    scheduler.on_new_request("py-pp2-req", Some(&params));
    scheduler
        .update_state_after_alloc("py-pp2-req", &local, &params)
        .unwrap();
    let outcome = load_outcome(&mut scheduler, &decodes).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    let split = PipelineStages::even(LAYERS, decode_pp).unwrap();
    // Byte `o` of a decode block read from remote block `r` of `layer`: HND, so prefill
    // rank `o / rank_len`'s heads, at its own offset.
    let want_byte = |layer: usize, r: usize, o: usize| {
        python_byte_of(o / rank_len, layer, r * rank_len + o % rank_len)
    };
    for (stage, decode) in decodes.iter().enumerate() {
        let cache = decode.kv_caches().unwrap();
        for (region, layer) in split.layers(stage).enumerate() {
            for block in 0..BLOCKS {
                let mut got = vec![0u8; BLOCK_LEN];
                cache.read(region, block * BLOCK_LEN, &mut got).unwrap();
                let want: Vec<u8> = match local.iter().position(|&l| l == block) {
                    Some(i) => (0..BLOCK_LEN)
                        .map(|o| want_byte(layer, remote[i], o))
                        .collect(),
                    None => vec![0; BLOCK_LEN],
                };
                assert!(
                    got == want,
                    "decode stage {stage} layer {layer} block {block}"
                );
            }
        }
    }
    // Each prefill rank hears from every decode rank, each saying the decode's stages; no
    // rank frees the request before its last reader, nor the engine before its last rank.
    let mut agents: Vec<&str> = decodes.iter().map(|d| d.agent().name()).collect();
    agents.sort_unstable();
    let ranks: Vec<String> = (0..2)
        .flat_map(|s| (0..prefill_tp).map(move |t| format!("{s}:{t}")))
        .collect();
    let mut heard: Vec<Vec<String>> = vec![Vec::new(); ranks.len()];
    let notes = ranks.len() * decode_pp;
    for taken in 1..=notes {
        let got = peer.json("kv_pp_notifs 1 10");
        let note = &got["notes"][0];
        assert_eq!(
            note["vllm"],
            json!({"id": "py-pp2-req", "consumers": decode_pp}),
            "{got}"
        );
        let rank = note["rank"].as_str().unwrap_or_default();
        let Some(at) = ranks.iter().position(|r| r == rank) else {
            panic!("a notification to no prefill rank: {got}");
        };
        heard[at].push(note["from"].as_str().unwrap().to_string());
        for (rank, senders) in ranks.iter().zip(&heard) {
            let freed = got["freed"][rank].as_array().unwrap();
            assert_eq!(
                freed.len(),
                usize::from(senders.len() == decode_pp),
                "{got}"
            );
        }
        let engine_freed = got["engine_freed"].as_array().unwrap();
        assert_eq!(engine_freed.len(), usize::from(taken == notes), "{got}");
    }
    for senders in &mut heard {
        senders.sort_unstable();
        assert_eq!(
            *senders, agents,
            "every decode rank notifies each prefill rank once"
        );
    }
    let more = peer.json("kv_pp_notifs 1 0.3");
    assert_eq!(more["notes"], json!([]), "a notification too many: {more}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_one_stage_reads_a_python_prefill_of_two() {
    rust_decode_reads_python_stages(1, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_two_stages_reads_a_python_prefill_of_two() {
    rust_decode_reads_python_stages(2, 1).await;
}

/// PP and TP mixed against vLLM's wire: a Python prefill of two stages of TP 2 read by a
/// Rust decode of one stage of TP 1 (each stage's two ranks read, each rank's KV heads
/// placed in the decode's blocks, each rank notified and freeing on its own reader's), and
/// by a Rust decode of two stages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_decodes_read_a_python_prefill_of_two_stages_of_tp_2() {
    rust_decode_reads_python_stages(1, 2).await;
    rust_decode_reads_python_stages(2, 2).await;
}

//! Pipeline parallelism in vLLM's protocol against the Python peer that speaks vLLM 0.33's
//! side channel (tests/py/vllm_peer.py), over real NIXL:
//! - a Rust decode of two pipeline stages reads a Python prefill of one, as vLLM's pull mode
//!   pairs them (each stage its layers' regions of the prefill's, vLLM's
//!   `_remote_region_offset`), every byte checked; each stage's rank notifies the prefill,
//!   saying both (vLLM's `pp_size` × producers per consumer);
//! - a Python decode asks a Rust prefill of two stages for each rank by `(pp_rank, tp_rank)`
//!   (vLLM's `_nixl_handshake` over every remote rank) and gets that stage's registration; a
//!   stage the engine lacks is refused, naming the ranks it serves.

mod py;
mod vllm_peer_support;
#[path = "../nixl-connector/tests/vllm_support/mod.rs"]
mod vllm_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::platform::BuiltinPlatform;
use nixl_connector::vllm::{MetadataServer, VllmChannelLimits};
use nixl_connector::{
    KvAttention, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvLayout, KvTransferParams,
    LoadOutcome, PipelineRank, PipelineStages, SchedulerConfig, WorkerConfig,
};
use py::{hex, unhex};
use serde_json::json;
use vllm_peer_support::{python_byte_of, vllm_kv, VllmPeer, BLOCKS, BLOCK_LEN, REGIONS};
use vllm_support::factors;

/// One stage's cache: its one layer of [`vllm_peer_support::kv_spec`]'s two.
fn stage_spec() -> KvCacheSpec {
    let attention = KvAttention::Mha { total_kv_heads: 8 };
    KvCacheSpec::uniform(1, BLOCKS, 16, attention, KvLayout::Hnd, BLOCK_LEN)
}

/// The ranks of an engine of two pipeline stages of TP 1 (one layer each) in vLLM mode,
/// served by one side channel, and its scheduler.
fn two_stages(engine: &str) -> (Vec<KvConnectorWorker>, KvConnectorScheduler) {
    let kv = vllm_kv(&factors());
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let server = Arc::new(MetadataServer::bind_now(any, VllmChannelLimits::default()).unwrap());
    let stages = PipelineStages::even(REGIONS, 2).unwrap();
    let workers = (0..2)
        .map(|stage| {
            let mut config = WorkerConfig::new(engine, 0, 1, kv.clone());
            config.platform = Arc::new(BuiltinPlatform::CPU);
            config.vllm_side_channel = Some(server.clone());
            config.pipeline = Some(PipelineRank::new(stages.clone(), stage).unwrap());
            let worker = KvConnectorWorker::new(config).unwrap();
            worker.register_host_kv_caches(stage_spec()).unwrap();
            worker
        })
        .collect();
    let port = server.local_addr().port();
    let mut config = SchedulerConfig::new(engine, "127.0.0.1", port, 1, &kv).unwrap();
    config.pp_size = 2;
    config.vllm_side_channel = Some(server);
    (workers, KvConnectorScheduler::new(config))
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
    let started = Instant::now();
    let outcome = loop {
        if let Some(outcome) = scheduler.step(&decodes).unwrap().load_outcomes.pop() {
            break outcome;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the load never ended"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
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

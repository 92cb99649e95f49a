//! Decode context parallelism (DCP) in vLLM's protocol against the Python peer that speaks
//! vLLM 0.33's side channel (tests/py/vllm_peer.py), over real NIXL, MLA caches of DCP =
//! TP ranks, rank `r` holding the request's global block positions `r`, `r + DCP`, ...:
//! - a Rust decode of DCP 1 and one of DCP 2 read a Python prefill of DCP 2, every byte
//!   checked, each prefill rank notified once, saying vLLM's `dcp_consumer_count`; and as
//!   vLLM's decode pairs them, prefills of prefill context parallelism (PCP): PCP 2 sharded
//!   with DCP 2 (its PCP ranks its transfer ranks), and replicated PCP 2 (DCP 1), which a
//!   decode of DCP 2 is refused with vLLM's reason;
//! - a Python decode of DCP 1 and one of DCP 2 (its own reading of the DCP slicing, a
//!   rank at a time) read a Rust prefill of DCP 2, every byte checked, and the prefill
//!   frees the request on their notifications, long before its lease ends; and so a Rust
//!   prefill of PCP 2 sharded with DCP 2, its metadata saying both, while a Python decode of
//!   DCP 2 refuses a Rust prefill of replicated PCP 2 with vLLM's reason.

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
    FinishStatus, KvAttention, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvLayout,
    KvTransferParams, LoadOutcome, SchedulerConfig, WorkerConfig,
};
use py::{hex, unhex};
use vllm_peer_support::{
    fill_rust_prefill, load_outcome, python_byte_of, rust_byte_of, vllm_kv, VllmPeer, BLOCKS,
    BLOCK_LEN, REGIONS,
};
use vllm_support::factors;

/// The request: 7 global positions (the last block part full), its block list on the
/// prefill and on the decode (the first 7 at DCP 1, 4 at DCP 2).
const TOKENS: usize = 6 * 16 + 11;
const POSITIONS: usize = 7;
const REMOTE: [usize; 7] = [3, 9, 14, 6, 11, 12, 7];
const LOCAL: [usize; 7] = [0, 1, 2, 4, 5, 8, 10];

/// The MLA cache both sides register: 2 layers of 16 blocks of 16 tokens (1 KiB blocks).
fn mla_spec() -> KvCacheSpec {
    KvCacheSpec::uniform(
        REGIONS,
        BLOCKS,
        16,
        KvAttention::Mla,
        KvLayout::Hnd,
        BLOCK_LEN,
    )
}

/// The ranks of an engine of TP = DCP `dcp` in vLLM mode (lease 30 s), served by one side
/// channel, and its scheduler.
fn engine(id: &str, dcp: usize) -> (Vec<KvConnectorWorker>, KvConnectorScheduler) {
    engine_of_pcp(id, dcp, 1)
}

/// As [`engine`], of PCP `pcp` (replicated with DCP 1, or sharded with DCP = `pcp`: then
/// the ranks are its PCP ranks).
fn engine_of_pcp(
    id: &str,
    dcp: usize,
    pcp: usize,
) -> (Vec<KvConnectorWorker>, KvConnectorScheduler) {
    let mut kv = vllm_kv(&factors());
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("kv_lease_duration".into(), 30.into());
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let server = Arc::new(MetadataServer::bind_now(any, VllmChannelLimits::default()).unwrap());
    let workers = (0..dcp)
        .map(|rank| {
            let mut config = WorkerConfig::new(id, rank, dcp, kv.clone());
            config.platform = Arc::new(BuiltinPlatform::CPU);
            config.vllm_side_channel = Some(server.clone());
            config.dcp_size = dcp;
            config.pcp_size = pcp;
            let worker = KvConnectorWorker::new(config).unwrap();
            worker.register_host_kv_caches(mla_spec()).unwrap();
            worker
        })
        .collect();
    let port = server.local_addr().port();
    let mut config = SchedulerConfig::new(id, "127.0.0.1", port, dcp, &kv).unwrap();
    config.dcp_size = dcp;
    config.vllm_side_channel = Some(server);
    (workers, KvConnectorScheduler::new(config))
}

/// A Python prefill of `pdcp` transfer ranks of DCP `pdcp` and PCP `pcp` (vLLM's
/// `transfer_tp_size`, the params' `tp_size`), and a Rust decode's scheduled load of it
/// into the ranks of DCP `dcp`: the peer, the decode's ranks and scheduler, its block list.
fn python_prefill_and_rust_decode(
    (pdcp, pcp): (usize, usize),
    dcp: usize,
) -> (
    VllmPeer,
    Vec<KvConnectorWorker>,
    KvConnectorScheduler,
    &'static [usize],
) {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let engine_id = format!("py-dcp-{pdcp}-{pcp}-{dcp}");
    let prefill = peer.json(&format!(
        "kv_dcp_prefill {hash} {engine_id} {pdcp} {REGIONS} {BLOCKS} {BLOCK_LEN} 16 {pcp}"
    ));
    let port = prefill["port"].as_u64().unwrap();
    let remote = &REMOTE[..POSITIONS.div_ceil(pdcp)];
    let json = serde_json::json!({
        "do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [remote], "remote_engine_id": engine_id,
        "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "py-dcp-req",
        "tp_size": pdcp, "dcp_size": pdcp, "pp_size": 1, "remote_num_tokens": TOKENS,
        "remote_blocks_expiry_time": null, "transfer_mode": "pull",
    });
    let params = KvTransferParams::from_vllm_json(&json.to_string()).unwrap();
    let (decodes, mut scheduler) = engine(&format!("rs-decode-{pdcp}-{pcp}-{dcp}"), dcp);
    let list = &LOCAL[..POSITIONS.div_ceil(dcp)];
    scheduler.on_new_request("req", Some(&params));
    scheduler
        .update_state_after_alloc("req", list, &params)
        .unwrap();
    (peer, decodes, scheduler, list)
}

/// A Rust decode of DCP `dcp` reads a Python prefill of `pdcp` transfer ranks of DCP
/// `pdcp` and PCP `pcp`.
async fn rust_decode_reads_python_prefill((pdcp, pcp): (usize, usize), dcp: usize) {
    let (mut peer, decodes, mut scheduler, list) = python_prefill_and_rust_decode((pdcp, pcp), dcp);
    let outcome = load_outcome(&mut scheduler, &decodes).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    // Decode rank k's block at list index i holds position i * dcp + k, from the prefill
    // rank g % pdcp's block g / pdcp.
    for (k, decode) in decodes.iter().enumerate() {
        let cache = decode.kv_caches().unwrap();
        for region in 0..REGIONS {
            for block in 0..BLOCKS {
                let position = list
                    .iter()
                    .position(|&b| b == block)
                    .map(|i| i * dcp + k)
                    .filter(|&g| g < POSITIONS);
                let want: Vec<u8> = match position {
                    Some(g) => (0..BLOCK_LEN)
                        .map(|o| {
                            let i = REMOTE[g / pdcp] * BLOCK_LEN + o;
                            python_byte_of(g % pdcp, region, i)
                        })
                        .collect(),
                    None => vec![0; BLOCK_LEN],
                };
                let mut got = vec![0u8; BLOCK_LEN];
                cache.read(region, block * BLOCK_LEN, &mut got).unwrap();
                assert!(
                    got == want,
                    "DCP {dcp}: rank {k} region {region} block {block}"
                );
            }
        }
    }
    // Each prefill rank hears once, saying one consumer (vLLM's dcp_consumer_count: an
    // unsharded reader's TP, the ratio of equal DCP sizes, or of TP sizes).
    let mut done = Vec::new();
    let started = Instant::now();
    while done.len() < pdcp && started.elapsed() < Duration::from_secs(10) {
        for note in peer.json("kv_dcp_notifs 1 1").as_array().unwrap() {
            if note["vllm"].get("hb").is_none() {
                done.push(note.clone());
            }
        }
    }
    let mut ranks: Vec<u64> = done.iter().map(|n| n["rank"].as_u64().unwrap()).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, (0..pdcp as u64).collect::<Vec<_>>(), "{done:?}");
    for note in &done {
        assert_eq!(
            note["vllm"],
            serde_json::json!({"id": "py-dcp-req", "consumers": 1})
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_dcp_1_reads_a_python_prefill_of_dcp_2() {
    rust_decode_reads_python_prefill((2, 1), 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_dcp_2_reads_a_python_prefill_of_dcp_2() {
    rust_decode_reads_python_prefill((2, 1), 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_reads_a_python_prefill_of_pcp_2_sharded_with_dcp_2() {
    // vLLM's PCP+DCP prefill (TP 1): its transfer ranks are its 2 PCP ranks, each a DCP rank.
    rust_decode_reads_python_prefill((2, 2), 1).await;
    rust_decode_reads_python_prefill((2, 2), 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_reads_a_replicated_pcp_prefill_and_refuses_it_when_sharded() {
    // vLLM's replicated PCP prefill: PCP rank 0 of its TP rank serves the whole request.
    rust_decode_reads_python_prefill((1, 2), 1).await;
    // A decode of DCP 2 is refused it, with vLLM's reason, before any READ.
    let (_peer, decodes, mut scheduler, list) = python_prefill_and_rust_decode((1, 2), 2);
    let reason = match load_outcome(&mut scheduler, &decodes).await {
        LoadOutcome::Failed { reason, .. } | LoadOutcome::Recompute { reason, .. } => reason,
        other => panic!("{other:?}"),
    };
    let vllm = "Replicated PCP cannot be paired with a DCP-sharded NIXL peer. Local PCP/DCP=1/2; remote PCP/DCP=2/1.";
    assert!(reason.contains(vllm), "{reason}");
    for decode in &decodes {
        let cache = decode.kv_caches().unwrap();
        for &block in list {
            let mut got = vec![0u8; BLOCK_LEN];
            cache.read(0, block * BLOCK_LEN, &mut got).unwrap();
            assert!(got.iter().all(|&b| b == 0), "block {block} untouched");
        }
    }
}

/// A Python decode of DCP `dcp` (each rank in turn) reads a Rust prefill of DCP 2 and PCP
/// `pcp` (1, or 2 sharded with the DCP: its ranks its PCP ranks).
async fn python_decode_reads_rust_prefill(dcp: usize, pcp: usize) {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let id = format!("rs-prefill-dcp-{dcp}-{pcp}");
    let (prefills, mut scheduler) = engine_of_pcp(&id, 2, pcp);
    for (rank, prefill) in prefills.iter().enumerate() {
        fill_rust_prefill(prefill, rank);
    }
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let done = scheduler.request_finished(
        "rs-req",
        &REMOTE[..POSITIONS.div_ceil(2)],
        TOKENS,
        Some(&for_decode),
        FinishStatus::LengthCapped,
    );
    assert!(done.delay_free_blocks);
    let params = done.kv_transfer_params.unwrap().to_vllm_json();
    let sent: serde_json::Value = serde_json::from_str(&params).unwrap();
    assert_eq!(
        (sent["tp_size"].clone(), sent["dcp_size"].clone()),
        (2.into(), 2.into())
    );
    // The prefill holds the request from its next step.
    scheduler.step(&prefills).unwrap();
    // One consumer for each prefill rank, whichever the decode's DCP (1 or 2).
    for rank in 0..dcp {
        let got = peer.json(&format!(
            "kv_dcp_decode {} {hash} {dcp} {rank} 1",
            hex(params.as_bytes())
        ));
        let positions = got["positions"]
            .as_object()
            .unwrap_or_else(|| panic!("{got}"));
        let held: Vec<usize> = (rank..POSITIONS).step_by(dcp).collect();
        assert_eq!(positions.len(), held.len(), "DCP {dcp} rank {rank}: {got}");
        for g in held {
            let data = unhex(positions[&g.to_string()].as_str().unwrap());
            let want: Vec<u8> = (0..REGIONS)
                .flat_map(|region| {
                    (0..BLOCK_LEN)
                        .map(move |o| rust_byte_of(g % 2, region, REMOTE[g / 2] * BLOCK_LEN + o))
                })
                .collect();
            assert!(data == want, "DCP {dcp} rank {rank}: position {g}");
        }
    }
    // Freed on the notifications (its lease is 30 s).
    let started = Instant::now();
    let mut freed = false;
    while !freed && started.elapsed() < Duration::from_secs(10) {
        let sent = scheduler.step(&prefills).unwrap().finished_sending;
        freed = sent.iter().any(|r| r == "rs-req");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(freed, "DCP {dcp}: freed once every reader notified");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_of_dcp_1_reads_a_rust_prefill_of_dcp_2() {
    python_decode_reads_rust_prefill(1, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_of_dcp_2_reads_a_rust_prefill_of_dcp_2() {
    python_decode_reads_rust_prefill(2, 1).await;
}

/// A Rust prefill of PCP 2 sharded with DCP 2 (its ranks its PCP ranks), its metadata
/// saying both, read by Python decodes of DCP 1 and 2 that check them as vLLM's decode does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_decodes_read_a_rust_prefill_of_pcp_2_sharded_with_dcp_2() {
    python_decode_reads_rust_prefill(1, 2).await;
    python_decode_reads_rust_prefill(2, 2).await;
}

/// A Rust prefill of replicated PCP 2 (TP 1, DCP 1): a Python decode of DCP 2 refuses it
/// with vLLM's reason (`_validate_remote_parallel_config`), before any READ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_of_dcp_2_refuses_a_rust_prefill_of_replicated_pcp() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let (prefills, mut scheduler) = engine_of_pcp("rs-prefill-pcp-replicated", 1, 2);
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let done = scheduler.request_finished(
        "rs-req",
        &REMOTE[..POSITIONS],
        TOKENS,
        Some(&for_decode),
        FinishStatus::LengthCapped,
    );
    let params = done.kv_transfer_params.unwrap().to_vllm_json();
    scheduler.step(&prefills).unwrap();
    let got = peer.json(&format!(
        "kv_dcp_decode {} {hash} 2 0 1",
        hex(params.as_bytes())
    ));
    let vllm = "Replicated PCP cannot be paired with a DCP-sharded NIXL peer. Local PCP/DCP=1/2; remote PCP/DCP=2/1.";
    assert_eq!(got["refused"], vllm, "{got}");
}

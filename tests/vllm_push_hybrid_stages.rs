//! vLLM's push of a hybrid model from pipeline stages, against the Python peer
//! (tests/py/vllm_peer.py), which follows vLLM 0.33's push worker: each stage lays its
//! tensors out from its own layers (tensor `i` holds the stage's layer `i` of each group:
//! full attention at the even layers, a sliding window at the odd ones), names them in
//! `region_members`, aligns the decode's regions with its own by layer name
//! (`_align_remote_regions_by_layer`) and WRITEs layer by layer, each layer with its own
//! group's blocks (`_compute_desc_ids` with layer-name routing).
//!
//! Of 6 layers over 2 stages, the decode's regions are `{l0, l1} {l2, l3} {l4, l5}`, stage
//! 0's `{l0, l1} {l2}` and stage 1's `{l4, l3} {l5}`: a layer lands in another region index
//! than the stage's. A Rust decode naming its layers takes both stages' WRITEs, every byte
//! checked; a Rust prefill of two such stages WRITEs into a Python decode naming its layers
//! the same way, every byte checked on the Python side.

mod py;
mod vllm_peer_support;
#[path = "../nixl-connector/tests/vllm_support/mod.rs"]
mod vllm_support;

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;

use nixl::kv_config::{KvRole, KvTransferConfig};
use nixl::platform::BuiltinPlatform;
use nixl_connector::vllm::{CompatibilityFactors, MetadataServer, VllmChannelLimits};
use nixl_connector::{
    FinishStatus, KvAttention, KvCacheGroups, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker,
    KvLayout, KvTransferParams, LoadOutcome, PipelineRank, PipelineStages, SchedulerConfig,
    WorkerConfig, KV_CACHE_GROUPS_KEY,
};
use py::{hex, unhex};
use serde_json::{json, Value};
use vllm_peer_support::{
    load_outcome, python_byte_of, rust_byte_of, vllm_kv, VllmPeer, BLOCKS, BLOCK_LEN,
};
use vllm_support::{factors, hma_regions};

/// Layers of the model.
const LAYERS: usize = 6;
/// The request's blocks of each group (full attention, sliding window) on the prefill, and
/// the decode's they land in.
const PREFILL: [[usize; 3]; 2] = [[3, 9, 14], [1, 6, 2]];
const DECODE: [[usize; 3]; 2] = [[0, 4, 8], [5, 10, 12]];

/// The factors of a push engine (vLLM hashes the transfer mode).
fn push_factors() -> CompatibilityFactors {
    CompatibilityFactors {
        transfer_mode: "push".into(),
        ..factors()
    }
}

/// The push config of a rank holding `layers`, its KV cache groups naming them.
fn kv(layers: Range<usize>, role: KvRole) -> KvTransferConfig {
    let mut kv = vllm_kv(&push_factors());
    let named: Vec<Vec<Value>> = hma_regions(layers)
        .iter()
        .map(|r| {
            r.iter()
                .map(|&(l, g)| json!({"layer": format!("model.layers.{l}.attn"), "group": g}))
                .collect()
        })
        .collect();
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("transfer_mode".into(), "push".into());
    extra.insert("push_registration_timeout".into(), 30.0.into());
    extra.insert("kv_lease_duration".into(), 1.5.into());
    extra.insert(
        KV_CACHE_GROUPS_KEY.into(),
        json!({
            "block_size": 16,
            "groups": ["full_attention", {"sliding_window": {"window_tokens": 32}}],
            "region_layers": named,
        }),
    );
    kv.kv_role = Some(role);
    kv
}

/// The cache of a rank holding `layers`: one region per tensor.
fn spec(layers: Range<usize>) -> KvCacheSpec {
    let attention = KvAttention::Mha { total_kv_heads: 8 };
    let regions = hma_regions(layers).len();
    KvCacheSpec::uniform(regions, BLOCKS, 16, attention, KvLayout::Hnd, BLOCK_LEN)
}

/// The scheduler of the engine whose (rank 0) side channel is `server`, of `pp` stages.
fn scheduler(engine: &str, server: Arc<MetadataServer>, pp: usize) -> KvConnectorScheduler {
    let kv = kv(0..LAYERS, KvRole::Consumer);
    let port = server.local_addr().port();
    let mut config = SchedulerConfig::new(engine, "127.0.0.1", port, 1, &kv).unwrap();
    config.vllm_side_channel = Some(server);
    config.pp_size = pp;
    let groups = KvCacheGroups::from_kv_transfer_config(&kv).unwrap();
    KvConnectorScheduler::new(config).with_kv_cache_groups(groups)
}

/// A Rust decode (TP 1, one stage) of the hybrid model naming its layers, every block 0xEE.
fn rust_decode() -> (KvConnectorWorker, KvConnectorScheduler) {
    let mut config = WorkerConfig::new("rs-hma-decode", 0, 1, kv(0..LAYERS, KvRole::Consumer));
    config.platform = Arc::new(BuiltinPlatform::CPU);
    let decode = KvConnectorWorker::new(config).unwrap();
    decode.register_host_kv_caches(spec(0..LAYERS)).unwrap();
    let cache = decode.kv_caches().unwrap();
    for region in 0..cache.regions().len() {
        cache
            .write(region, 0, &vec![0xEE; BLOCKS * BLOCK_LEN])
            .unwrap();
    }
    let scheduler = scheduler("rs-hma-decode", decode.vllm_side_channel().unwrap(), 1);
    (decode, scheduler)
}

/// Where `layer` sits on a prefill of 2 stages: its stage and its region there.
fn prefill_region(layer: usize) -> (usize, usize) {
    let stages = PipelineStages::even(LAYERS, 2).unwrap();
    let stage = stages.stage_of(layer).unwrap();
    let region = hma_regions(stages.layers(stage))
        .iter()
        .position(|r| r.iter().any(|&(l, _)| l == layer))
        .unwrap();
    (stage, region)
}

/// What decode block `block` of decode region `region` holds after the push: for the
/// region's layer whose group names the block, the prefill's paired block of that layer
/// (`byte(stage, stage region, byte of that region)`); `None` for a block no group names.
fn expected(
    region: usize,
    block: usize,
    byte: impl Fn(usize, usize, usize) -> u8,
) -> Option<Vec<u8>> {
    hma_regions(0..LAYERS)[region]
        .iter()
        .find_map(|&(layer, g)| {
            let i = DECODE[g].iter().position(|&b| b == block)?;
            let (stage, pf_region) = prefill_region(layer);
            let from = PREFILL[g][i] * BLOCK_LEN;
            Some(
                (0..BLOCK_LEN)
                    .map(|o| byte(stage, pf_region, from + o))
                    .collect(),
            )
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_prefill_of_hybrid_stages_writes_each_layer_into_a_rust_decodes_region_of_its_name(
) {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    let prefill = peer.json(&format!(
        "kv_hma_pp_prefill {hash} py-hma-pp 2 {LAYERS} {BLOCKS} {BLOCK_LEN} 16"
    ));
    assert_eq!(
        prefill["regions"][1],
        json!([
            ["model.layers.4.attn", "model.layers.3.attn"],
            ["model.layers.5.attn"]
        ]),
        "{prefill}"
    );
    let (decode, mut scheduler) = rust_decode();
    let groups = PREFILL
        .map(|g| g.map(|b| b.to_string()).join(","))
        .join(";");
    let json = peer.call(&format!(
        "kv_hma_pp_push_finish {} {groups}",
        hex(b"cmpl-hma-1")
    ));
    let params = KvTransferParams::from_vllm_json(&json).unwrap();
    scheduler.on_new_request("cmpl-hma-1", Some(&params));
    scheduler
        .update_state_after_alloc_groups("cmpl-hma-1", &DECODE.map(Vec::from), &params)
        .unwrap();
    decode.start_load_kv(&scheduler.build_connector_meta());
    let written = peer.json(&format!("kv_hma_pp_push_write {hash} 10"));
    assert_eq!(
        written["ranks"]["1:0"]["layers"],
        json!([
            ["model.layers.4.attn", 2],
            ["model.layers.3.attn", 1],
            ["model.layers.5.attn", 2]
        ]),
        "vLLM's alignment by name: {written}"
    );
    let outcome = load_outcome(&mut scheduler, std::slice::from_ref(&decode)).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    let cache = decode.kv_caches().unwrap();
    for region in 0..cache.regions().len() {
        for block in 0..BLOCKS {
            let mut got = vec![0u8; BLOCK_LEN];
            cache.read(region, block * BLOCK_LEN, &mut got).unwrap();
            let want = expected(region, block, |stage, r, i| {
                python_byte_of(0, 100 * stage + r, i)
            })
            .unwrap_or_else(|| vec![0xEE; BLOCK_LEN]);
            assert!(got == want, "decode region {region} block {block}");
        }
    }
    assert_eq!(decode.push_stats().registrations_sent, 2, "one per stage");
}

/// A Rust push prefill of two stages of the hybrid model, each rank its stage's tensors
/// named and filled with [`rust_byte_of`] of its stage; and its scheduler.
fn rust_prefill_of_stages() -> (Vec<KvConnectorWorker>, KvConnectorScheduler) {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let server = Arc::new(MetadataServer::bind_now(any, VllmChannelLimits::default()).unwrap());
    let stages = PipelineStages::even(LAYERS, 2).unwrap();
    let ranks = (0..2)
        .map(|stage| {
            let layers = stages.layers(stage);
            let kv = kv(layers.clone(), KvRole::Producer);
            let mut config = WorkerConfig::new("rs-hma-prefill", 0, 1, kv);
            config.platform = Arc::new(BuiltinPlatform::CPU);
            config.vllm_side_channel = Some(server.clone());
            config.pipeline = Some(PipelineRank::new(stages.clone(), stage).unwrap());
            let worker = KvConnectorWorker::new(config).unwrap();
            worker.register_host_kv_caches(spec(layers)).unwrap();
            let cache = worker.kv_caches().unwrap();
            for region in 0..cache.regions().len() {
                let bytes: Vec<u8> = (0..BLOCKS * BLOCK_LEN)
                    .map(|i| rust_byte_of(stage, region, i))
                    .collect();
                cache.write(region, 0, &bytes).unwrap();
            }
            worker
        })
        .collect();
    (ranks, scheduler("rs-hma-prefill", server, 2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_prefill_of_hybrid_stages_writes_each_layer_into_a_python_decodes_region_of_its_name(
) {
    let mut peer = VllmPeer::start();
    let hash = push_factors().hash();
    let (prefills, mut scheduler) = rust_prefill_of_stages();
    let decode = peer.json(&format!(
        "kv_hma_decode {hash} py-hma-decode {LAYERS} {BLOCKS} {BLOCK_LEN} 16"
    ));
    assert!(decode["port"].is_u64(), "{decode}");
    let finished = scheduler
        .request_finished_all_groups(
            "cmpl-hma-2",
            &PREFILL.map(Vec::from),
            3 * 16,
            Some(&KvTransferParams {
                do_remote_decode: true,
                ..Default::default()
            }),
            FinishStatus::LengthCapped,
        )
        .unwrap();
    assert!(finished.delay_free_blocks);
    let meta = scheduler.build_connector_meta();
    for rank in &prefills {
        rank.start_load_kv(&meta);
    }
    let params = finished.kv_transfer_params.unwrap().to_vllm_json();
    let groups = DECODE.map(|g| g.map(|b| b.to_string()).join(",")).join(";");
    let registered = peer.json(&format!(
        "kv_hma_push_register {} {hash} {} {groups}",
        hex(params.as_bytes()),
        hex(b"cmpl-hma-2")
    ));
    assert_eq!(registered["stages"], 2, "{registered}");
    // vLLM's decode waits for pp_size x 1 WRITEs.
    let got = peer.json(&format!("kv_hma_push_wait {} 2 10", hex(b"cmpl-hma-2")));
    assert_eq!(
        got["vllm"],
        json!({"id": "cmpl-hma-2", "consumers": 1}),
        "{got}"
    );
    let regions = unhex(got["data"].as_str().unwrap_or_else(|| panic!("{got}")));
    let region_len = BLOCKS * BLOCK_LEN;
    for (region, bytes) in regions.chunks(region_len).enumerate() {
        for block in 0..BLOCKS {
            let got = &bytes[block * BLOCK_LEN..(block + 1) * BLOCK_LEN];
            let want = expected(region, block, rust_byte_of).unwrap_or_else(|| vec![0; BLOCK_LEN]);
            assert!(got == want, "python decode region {region} block {block}");
        }
    }
    let writes: u64 = prefills.iter().map(|p| p.push_stats().writes).sum();
    assert_eq!(writes, 2, "each stage wrote once");
}

//! A hybrid model (full attention at the even layers, a sliding window at the odd ones:
//! vLLM's HMA) pushed from a prefill of pipeline stages into a decode of one, over real
//! NIXL/UCX, in both protocols: vLLM's `NixlPushConnector` matches such regions by layer
//! name (`region_members`, `_align_remote_regions_by_layer`).
//!
//! Each rank lays its tensors out as vLLM does from its own layers: tensor `i` holds layer
//! `i` of each group. The decode's 6 layers give `{l0, l1} {l2, l3} {l4, l5}`; stage 0 of 2
//! (layers 0 to 2) `{l0, l1} {l2}`, stage 1 (3 to 5) `{l4, l3} {l5}`. So stage 1's first
//! region holds layers the decode keeps in two regions, and pairing regions by index from a
//! stage's offset would write other layers' KV. Every byte of every decode region is
//! checked: each layer's blocks of its group hold the prefill's bytes of that layer, the
//! rest stays zero; also past the prefill's clipped window and a prefix hit on the decode.
//! A prefill of stages whose regions do not name their layers, a pull prefill of such
//! stages, and a registration of another number of regions than named, are refused by
//! name.

mod common;
mod vllm_support;

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::kv_config::{KvRole, KvTransferConfig};
use nixl_connector::{
    FinishStatus, KvAttention, KvCacheGroups, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker,
    KvLayout, LoadOutcome, PipelineRank, PipelineStages, Protocol, RegionLayer, SchedulerConfig,
    KV_CACHE_GROUPS_KEY,
};

use common::ranks::engine_ranks;
use common::{cpu_config, vllm_config, vllm_factors, WAIT};
use vllm_support::hma_regions;

/// Layers of the model, KV heads, tokens per block, bytes of a head's token, blocks per
/// region.
const LAYERS: usize = 6;
const HEADS: usize = 2;
const TOKENS: usize = 4;
const TOKEN_BYTES: usize = 8;
const BLOCKS: usize = 16;
/// Blocks the sliding window keeps of a request (vLLM's `blocks_per_sw` of a window of
/// `2 × TOKENS`: `ceil(8 / 4) + 1`).
const WINDOW_BLOCKS: usize = 3;

/// A request's blocks of each group (full attention, sliding window) on the prefill, and
/// the decode's they land in (the tail of the prompt it lacks): one pool per engine, so no
/// id is in both groups.
struct Request {
    prefill: [&'static [usize]; 2],
    decode: [&'static [usize]; 2],
}

/// 3 blocks each, every one moved.
const WHOLE: Request = Request {
    prefill: [&[5, 2, 7], &[1, 6, 3]],
    decode: [&[2, 0, 5], &[7, 4, 1]],
};

/// 4 blocks each: the prefill clips its window to its last 3, and the decode holds the
/// first 2 blocks of the prompt already (a prefix hit), so it takes the last 2 of each.
const CLIPPED_AND_HIT: Request = Request {
    prefill: [&[5, 2, 7, 11], &[1, 6, 3, 13]],
    decode: [&[0, 4], &[10, 12]],
};

impl Request {
    /// The prefill block decode block `block` of group `group` takes, if the decode's
    /// request names it: its place from the end of the decode's list, in the prefill's.
    fn source(&self, group: usize, block: usize) -> Option<usize> {
        let decode = self.decode[group];
        let from_end = decode.len() - decode.iter().position(|&b| b == block)?;
        let prefill = self.prefill[group];
        Some(prefill[prefill.len() - from_end])
    }
}

fn name(layer: usize) -> String {
    format!("model.layers.{layer}.attn")
}

/// The regions vLLM registers for `layers` (one stage's, [`hma_regions`]), each layer
/// named with its group.
fn regions_of(layers: Range<usize>) -> Vec<Vec<RegionLayer>> {
    hma_regions(layers)
        .into_iter()
        .map(|region| {
            let layer = |(l, group)| RegionLayer {
                layer: name(l),
                group,
            };
            region.into_iter().map(layer).collect()
        })
        .collect()
}

/// The model's groups with the region layers of `layers`.
fn groups(layers: Range<usize>) -> KvCacheGroups {
    serde_json::from_value(serde_json::json!({
        "block_size": TOKENS,
        "groups": ["full_attention", {"sliding_window": {"window_tokens": 2 * TOKENS}}],
        "region_layers": regions_of(layers),
    }))
    .unwrap()
}

/// One engine: its stages and TP size.
#[derive(Clone)]
struct Layout {
    stages: PipelineStages,
    tp: usize,
}

impl Layout {
    fn new(pp: usize, tp: usize) -> Layout {
        Layout {
            stages: PipelineStages::even(LAYERS, pp).unwrap(),
            tp,
        }
    }

    fn spec(&self, stage: usize) -> KvCacheSpec {
        let regions = regions_of(self.stages.layers(stage)).len();
        let attention = KvAttention::Mha {
            total_kv_heads: HEADS,
        };
        let block_len = TOKENS * HEADS / self.tp * TOKEN_BYTES;
        KvCacheSpec::uniform(regions, BLOCKS, TOKENS, attention, KvLayout::Hnd, block_len)
    }
}

/// Block `block` of region `region` of prefill rank `(stage, tp_rank)` of TP `tp`: each
/// byte a function of the stage, the region, the block, the model's head, the token and the
/// byte.
fn prefill_block(
    (stage, tp_rank, tp): (usize, usize, usize),
    region: usize,
    block: usize,
) -> Vec<u8> {
    let heads = HEADS / tp;
    let mut out = Vec::with_capacity(TOKENS * heads * TOKEN_BYTES);
    for head in tp_rank * heads..(tp_rank + 1) * heads {
        for token in 0..TOKENS {
            out.extend((0..TOKEN_BYTES).map(|byte| {
                ((stage * 7919 + region * 1009 + block * 101 + head * 31 + token * 7 + byte) % 251
                    + 1) as u8
            }));
        }
    }
    out
}

/// The config of a rank of `protocol`, pushing, a producer or not, of the model's groups
/// with the region layers of `layers`.
fn kv(protocol: Protocol, producer: bool, layers: Range<usize>) -> KvTransferConfig {
    let mut factors = vllm_factors();
    factors["transfer_mode"] = "push".into();
    let mut kv = match protocol {
        Protocol::Native => cpu_config(),
        Protocol::Vllm => vllm_config(factors),
    };
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("transfer_mode".into(), "push".into());
    extra.insert(
        KV_CACHE_GROUPS_KEY.into(),
        serde_json::to_value(groups(layers)).unwrap(),
    );
    kv.kv_role = Some(if producer {
        KvRole::Producer
    } else {
        KvRole::Consumer
    });
    kv
}

/// The ranks of an engine of `layout` speaking `protocol` (in `(stage, tp_rank)` order,
/// [`common::ranks::engine_ranks`]; the prefill's, `producer`, filled), and its port.
fn engine(
    id: &str,
    layout: &Layout,
    producer: bool,
    protocol: Protocol,
) -> (Vec<KvConnectorWorker>, u16) {
    let rank = |n: usize| (n / layout.tp, n % layout.tp);
    let count = layout.stages.pp_size() * layout.tp;
    let (workers, port) = engine_ranks(id, protocol, count, |n| {
        let (stage, tp_rank) = rank(n);
        let kv = kv(protocol, producer, layout.stages.layers(stage));
        let mut config = nixl_connector::WorkerConfig::new(id, tp_rank, layout.tp, kv);
        config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
        if layout.stages.pp_size() > 1 {
            config.pipeline = Some(PipelineRank::new(layout.stages.clone(), stage).unwrap());
        }
        (config, layout.spec(stage))
    });
    if producer {
        for (n, worker) in workers.iter().enumerate() {
            let (stage, tp_rank) = rank(n);
            let caches = worker.kv_caches().unwrap();
            for region in 0..layout.spec(stage).num_regions() {
                for block in 0..BLOCKS {
                    let data = prefill_block((stage, tp_rank, layout.tp), region, block);
                    caches.write(region, block * data.len(), &data).unwrap();
                }
            }
        }
    }
    (workers, port)
}

fn scheduler(id: &str, port: u16, layout: &Layout, protocol: Protocol) -> KvConnectorScheduler {
    let kv = kv(protocol, false, 0..LAYERS);
    let mut config = SchedulerConfig::new(id, "127.0.0.1", port, layout.tp, &kv).unwrap();
    config.pp_size = layout.stages.pp_size();
    KvConnectorScheduler::new(config).with_kv_cache_groups(groups(0..LAYERS))
}

/// Pushes one request of the hybrid model from a prefill of `prefill` into a decode of
/// `decode` (one stage), both speaking `protocol`, and checks every byte of every decode
/// rank.
async fn push(
    tag: &str,
    (prefill, decode): (Layout, Layout),
    request: &Request,
    protocol: Protocol,
) {
    let tag = format!("{protocol}-{tag}");
    let (pf_id, dc_id) = (format!("pf-hma-{tag}"), format!("dc-hma-{tag}"));
    let (prefills, pf_port) = engine(&pf_id, &prefill, true, protocol);
    let (decodes, dc_port) = engine(&dc_id, &decode, false, protocol);
    let mut pf = scheduler(&pf_id, pf_port, &prefill, protocol);
    let mut dc = scheduler(&dc_id, dc_port, &decode, protocol);
    let id = "req";
    let done = pf
        .request_finished_all_groups(
            id,
            &request.prefill.map(Vec::from),
            request.prefill[0].len() * TOKENS,
            Some(&common::for_decode()),
            FinishStatus::Stopped,
        )
        .unwrap();
    let params = common::as_sent(protocol, done.kv_transfer_params.unwrap());
    let window = params.remote_block_group_lens.get(1).copied();
    assert_eq!(window, Some(WINDOW_BLOCKS), "{tag}: the window's blocks");
    dc.on_new_request(id, Some(&params));
    dc.update_state_after_alloc_groups(id, &request.decode.map(Vec::from), &params)
        .unwrap();
    let (mut loaded, mut freed) = (false, false);
    let started = Instant::now();
    while !(loaded && freed) && started.elapsed() < WAIT {
        freed |= pf
            .step(&prefills)
            .unwrap()
            .finished_sending
            .iter()
            .any(|r| r == id);
        for outcome in dc.step(&decodes).unwrap().load_outcomes {
            match outcome {
                LoadOutcome::Loaded { request_id } if request_id == id => loaded = true,
                other => panic!("{tag}: the load ended {other:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(loaded && freed, "{tag}: loaded {loaded}, freed {freed}");
    let writes: u64 = prefills.iter().map(|p| p.push_stats().writes).sum();
    assert_eq!(
        writes,
        prefills.len() as u64,
        "{tag}: every prefill rank wrote once"
    );
    check_decode(&tag, &decodes, (&prefill, &decode), request);
}

/// Where layer `layer` sits on an engine of `layout`: its stage and its region there.
fn region_of(layout: &Layout, layer: usize) -> (usize, usize) {
    let stage = layout.stages.stage_of(layer).unwrap();
    let region = regions_of(layout.stages.layers(stage))
        .iter()
        .position(|r| r.iter().any(|l| l.layer == name(layer)))
        .unwrap();
    (stage, region)
}

/// Checks each decode rank: in each region, each block of a group's request holds what the
/// prefill's paired block holds in the region of that group's layer; every other block is
/// zero.
fn check_decode(
    tag: &str,
    decodes: &[KvConnectorWorker],
    (prefill, decode): (&Layout, &Layout),
    request: &Request,
) {
    for (tp_rank, worker) in decodes.iter().enumerate() {
        let spec = decode.spec(0);
        let caches = worker.kv_caches().unwrap();
        for (region, layers) in regions_of(0..LAYERS).iter().enumerate() {
            let len = spec.block_len(region);
            for block in 0..BLOCKS {
                let from = layers.iter().find_map(|l| {
                    let pf_block = request.source(l.group, block)?;
                    let layer: usize = l.layer.split('.').nth(2)?.parse().ok()?;
                    Some((layer, pf_block))
                });
                let want = match from {
                    None => vec![0; len],
                    Some((layer, pf_block)) => {
                        let (stage, pf_region) = region_of(prefill, layer);
                        // The decode rank's heads, from the prefill ranks holding them.
                        let per_pf = HEADS / prefill.tp;
                        let per_dc = HEADS / decode.tp;
                        (tp_rank * per_dc..(tp_rank + 1) * per_dc)
                            .step_by(per_pf.min(per_dc))
                            .flat_map(|head| {
                                let pf_rank = head / per_pf;
                                let whole = prefill_block(
                                    (stage, pf_rank, prefill.tp),
                                    pf_region,
                                    pf_block,
                                );
                                let first = head % per_pf;
                                let take = per_pf.min(per_dc);
                                let head_len = TOKENS * TOKEN_BYTES;
                                whole[first * head_len..(first + take) * head_len].to_vec()
                            })
                            .collect()
                    }
                };
                let mut got = vec![0u8; len];
                caches.read(region, block * len, &mut got).unwrap();
                assert!(
                    got == want,
                    "{tag}: decode rank {tp_rank} region {region} block {block} (from {from:?})"
                );
            }
        }
    }
}

/// PP 2 → 1, PP 2 × TP 2 → 1 × 1 and PP 2 × TP 2 → 1 × 2, both protocols: each layer lands
/// in the decode's region of its name, with its group's blocks; and past a clipped window
/// and a prefix hit on the decode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_models_stages_push_each_layer_into_the_decodes_region_of_its_name() {
    for protocol in [Protocol::Native, Protocol::Vllm] {
        let layouts = (Layout::new(2, 1), Layout::new(1, 1));
        push("p2-d1", layouts, &WHOLE, protocol).await;
        let layouts = (Layout::new(2, 2), Layout::new(1, 1));
        push("p2x2-d1", layouts, &WHOLE, protocol).await;
        let layouts = (Layout::new(2, 2), Layout::new(1, 2));
        push("p2x2-d1x2-hit", layouts, &CLIPPED_AND_HIT, protocol).await;
    }
}

/// A prefill of stages of a hybrid model whose regions name no layer, or that pulls, is
/// refused at creation, and one registering another number of regions than it names at
/// registration, by name.
#[tokio::test]
async fn stages_of_a_hybrid_model_without_layer_names_or_pulling_are_refused() {
    let stages = PipelineStages::even(LAYERS, 2).unwrap();
    let config = |kv: KvTransferConfig| {
        let mut config = nixl_connector::WorkerConfig::new("pp-hma", 0, 1, kv);
        config.pipeline = Some(PipelineRank::new(stages.clone(), 1).unwrap());
        config
    };
    let mut unnamed = kv(Protocol::Native, true, 3..LAYERS);
    unnamed.kv_connector_extra_config.insert(
        KV_CACHE_GROUPS_KEY.into(),
        serde_json::json!({"block_size": TOKENS, "groups": ["full_attention", {"sliding_window": {"window_tokens": 8}}]}),
    );
    let err = KvConnectorWorker::new(config(unnamed))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("region_layers names 0 layers, stage 1 holds 3"),
        "{err}"
    );
    // Names for another number of regions than registered: refused at registration.
    let mut named = config(kv(Protocol::Native, true, 3..LAYERS));
    named.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
    let worker = KvConnectorWorker::new(named).unwrap();
    let err = worker
        .register_host_kv_caches(Layout::new(1, 1).spec(0))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("region_layers names the layers of 2 regions, 3 are registered"),
        "{err}"
    );
    let mut pulling = kv(Protocol::Native, true, 3..LAYERS);
    pulling.kv_connector_extra_config.remove("transfer_mode");
    let err = KvConnectorWorker::new(config(pulling))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("NixlConnector (pull) does not support"),
        "{err}"
    );
}

//! Pipeline parallelism, native protocol, over real NIXL/UCX: engines of PP × TP ranks in
//! this process, each rank of stage `s` registering only its stage's layers (two regions a
//! layer, K and V apart) and listening at the engine's port + `s` × TP + its TP rank. Both
//! engines step through their schedulers, every rank's output aggregated over every stage:
//! the prefill's params say its `pp_size`, each decode rank reads every layer it holds from
//! the prefill stage holding it (and notifies the stages holding none of them), every byte
//! of every decode rank is checked (the blocks read hold the prefill's, the others stay
//! zero), and the prefill frees the request once every stage's reader has notified.
//!
//! Geometries (prefill → decode, `PP × TP`): 2×1 → 1×1, 1×1 → 2×1, 2×1 → 2×1, 2×2 → 1×1,
//! 1×1 → 2×2, and an explicit partition (vLLM's `VLLM_PP_LAYER_PARTITION` "2,3") against
//! vLLM's even split of 5 layers ([3, 2]) across TP 1 → 2. Engines of different layer
//! counts, and what is refused at a worker's creation, are refused by name.

mod common;

use std::time::Instant;

use nixl_connector::{
    KvAttention, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvLayout, LoadOutcome,
    PipelineRank, PipelineStages, Protocol, SchedulerConfig, WorkerConfig,
};

use common::{cpu_config, finished_for_decode, WAIT};

/// KV heads of the model, tokens per block, bytes of a head's token, blocks per region.
const HEADS: usize = 2;
const TOKENS: usize = 4;
const TOKEN_BYTES: usize = 8;
const BLOCKS: usize = 8;
/// Regions a layer registers (K and V apart).
const PER_LAYER: usize = 2;
/// The request's blocks on the prefill, and the decode's they land in.
const REMOTE: [usize; 3] = [5, 2, 7];
const LOCAL: [usize; 3] = [1, 6, 3];

/// One engine's parallel layout: its stages and its TP size.
#[derive(Clone)]
struct Layout {
    stages: PipelineStages,
    tp: usize,
}

impl Layout {
    fn even(layers: usize, pp: usize, tp: usize) -> Layout {
        let stages = PipelineStages::even(layers, pp).unwrap();
        Layout { stages, tp }
    }

    fn pp(&self) -> usize {
        self.stages.pp_size()
    }

    /// The spec of a rank of stage `stage`.
    fn spec(&self, stage: usize) -> KvCacheSpec {
        let heads = HEADS / self.tp;
        let regions = self.stages.layers(stage).len() * PER_LAYER;
        let attention = KvAttention::Mha {
            total_kv_heads: HEADS,
        };
        let block_len = TOKENS * heads * TOKEN_BYTES;
        KvCacheSpec::uniform(regions, BLOCKS, TOKENS, attention, KvLayout::Hnd, block_len)
    }

    /// Block `block` of region `region` of the rank `(stage, tp_rank)`, as the prefill
    /// holds it: each byte a function of the model's region, the block, the model's head,
    /// the token and the byte.
    fn block(&self, (stage, tp_rank): (usize, usize), region: usize, block: usize) -> Vec<u8> {
        let heads = HEADS / self.tp;
        let global = self.stages.layers(stage).start * PER_LAYER + region;
        let mut out = Vec::with_capacity(TOKENS * heads * TOKEN_BYTES);
        for head in tp_rank * heads..(tp_rank + 1) * heads {
            for token in 0..TOKENS {
                out.extend((0..TOKEN_BYTES).map(|byte| {
                    ((global * 1009 + block * 101 + head * 31 + token * 7 + byte) % 251 + 1) as u8
                }));
            }
        }
        out
    }
}

/// The ranks of an engine of `layout` (in `(stage, tp_rank)` order), each at rank 0's port
/// + its number (tried again on other ports when one is taken); the prefill's filled.
fn engine(id: &str, layout: &Layout, filled: bool) -> (Vec<KvConnectorWorker>, u16) {
    let ranks: Vec<(usize, usize)> = (0..layout.pp())
        .flat_map(|s| (0..layout.tp).map(move |r| (s, r)))
        .collect();
    'ports: for _ in 0..20 {
        let mut workers: Vec<KvConnectorWorker> = Vec::new();
        let mut base: u16 = 0;
        for (n, &(stage, tp_rank)) in ranks.iter().enumerate() {
            let mut config = WorkerConfig::new(id, tp_rank, layout.tp, cpu_config());
            config.platform = std::sync::Arc::new(nixl::platform::BuiltinPlatform::CPU);
            let port = if n == 0 {
                Some(0)
            } else {
                base.checked_add(n as u16)
            };
            let Some(port) = port else { continue 'ports };
            config.side_channel.set_port(port);
            if layout.pp() > 1 {
                config.pipeline = Some(PipelineRank::new(layout.stages.clone(), stage).unwrap());
            }
            let worker = KvConnectorWorker::new(config).unwrap();
            let spec = layout.spec(stage);
            if worker.register_host_kv_caches(spec.clone()).is_err() {
                continue 'ports;
            }
            if n == 0 {
                base = worker.side_channel_addr().unwrap().port();
            }
            if filled {
                let caches = worker.kv_caches().unwrap();
                for region in 0..spec.num_regions() {
                    for block in 0..BLOCKS {
                        let data = layout.block((stage, tp_rank), region, block);
                        caches.write(region, block * data.len(), &data).unwrap();
                    }
                }
            }
            workers.push(worker);
        }
        return (workers, base);
    }
    panic!("no run of free ports for engine {id}");
}

fn scheduler(id: &str, port: u16, layout: &Layout) -> KvConnectorScheduler {
    let mut config = SchedulerConfig::new(id, "127.0.0.1", port, layout.tp, &cpu_config()).unwrap();
    config.pp_size = layout.pp();
    KvConnectorScheduler::new(config)
}

/// Runs one request from a prefill of `prefill` to a decode of `decode` through both
/// schedulers, and checks every byte of every decode rank.
async fn pair(tag: &str, prefill: Layout, decode: Layout) {
    let (pf_id, dc_id) = (format!("pf-{tag}"), format!("dc-{tag}"));
    let (prefills, pf_port) = engine(&pf_id, &prefill, true);
    let (decodes, dc_port) = engine(&dc_id, &decode, false);
    let mut pf = scheduler(&pf_id, pf_port, &prefill);
    let mut dc = scheduler(&dc_id, dc_port, &decode);
    let params = finished_for_decode(&mut pf, "req", &REMOTE);
    let expect_pp = (prefill.pp() > 1).then_some(prefill.pp());
    assert_eq!(
        params.remote_pp_size, expect_pp,
        "{tag}: the params say the prefill's stages"
    );
    dc.on_new_request("req", Some(&params));
    dc.update_state_after_alloc("req", &LOCAL, &params).unwrap();
    let (mut loaded, mut freed) = (None, false);
    let started = Instant::now();
    while (loaded.is_none() || !freed) && started.elapsed() < WAIT {
        freed |= pf
            .step(&prefills)
            .unwrap()
            .finished_sending
            .iter()
            .any(|r| r == "req");
        if let Some(outcome) = dc.step(&decodes).unwrap().load_outcomes.pop() {
            loaded = Some(outcome);
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let loaded_ok = LoadOutcome::Loaded {
        request_id: "req".into(),
    };
    assert_eq!(loaded, Some(loaded_ok), "{tag}: the decode's load");
    assert!(
        freed,
        "{tag}: the prefill freed the request once every stage's reader notified"
    );
    for (n, worker) in decodes.iter().enumerate() {
        let rank = (n / decode.tp, n % decode.tp);
        let spec = decode.spec(rank.0);
        let caches = worker.kv_caches().unwrap();
        for region in 0..spec.num_regions() {
            for block in 0..BLOCKS {
                let len = spec.block_len(region);
                let mut got = vec![0u8; len];
                caches.read(region, block * len, &mut got).unwrap();
                let want = match LOCAL.iter().position(|&b| b == block) {
                    Some(i) => decode.block(rank, region, REMOTE[i]),
                    None => vec![0; len],
                };
                assert!(
                    got == want,
                    "{tag}: decode rank {rank:?} region {region} block {block}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_decode_layer_is_read_from_the_prefill_stage_holding_it() {
    for (tag, prefill, decode) in [
        ("p2-d1", Layout::even(4, 2, 1), Layout::even(4, 1, 1)),
        ("p1-d2", Layout::even(4, 1, 1), Layout::even(4, 2, 1)),
        ("p2-d2", Layout::even(4, 2, 1), Layout::even(4, 2, 1)),
        ("p2x2-d1", Layout::even(4, 2, 2), Layout::even(4, 1, 1)),
        ("p1-d2x2", Layout::even(4, 1, 1), Layout::even(4, 2, 2)),
    ] {
        pair(tag, prefill, decode).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_partition_pairs_with_an_even_split() {
    let explicit = Layout {
        stages: PipelineStages::from_vllm_partition("2,3", 2, 5).unwrap(),
        tp: 1,
    };
    pair("explicit", explicit, Layout::even(5, 2, 2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_of_different_layer_counts_are_refused_before_any_read() {
    let (prefills, port) = engine("pf-layers", &Layout::even(4, 2, 1), true);
    let (decodes, dc_port) = engine("dc-layers", &Layout::even(6, 2, 1), false);
    let mut pf = scheduler("pf-layers", port, &Layout::even(4, 2, 1));
    let mut dc = scheduler("dc-layers", dc_port, &Layout::even(6, 2, 1));
    let params = finished_for_decode(&mut pf, "req", &REMOTE);
    pf.step(&prefills).unwrap();
    dc.on_new_request("req", Some(&params));
    dc.update_state_after_alloc("req", &LOCAL, &params).unwrap();
    let started = Instant::now();
    let outcome = loop {
        if let Some(outcome) = dc.step(&decodes).unwrap().load_outcomes.pop() {
            break outcome;
        }
        assert!(started.elapsed() < WAIT, "the load never ended");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    };
    let LoadOutcome::Failed { reason, .. } = outcome else {
        panic!("not refused: {outcome:?}");
    };
    assert!(reason.contains("hold 6 layers, the remote's 4"), "{reason}");
    let read: u64 = decodes
        .iter()
        .flat_map(|w| w.metrics())
        .map(|m| m.bytes)
        .sum();
    assert_eq!(read, 0, "nothing read");
}

#[tokio::test]
async fn stages_are_refused_where_they_are_not_supported() {
    let stage = || PipelineRank::new(PipelineStages::even(4, 2).unwrap(), 1).unwrap();
    let mut vllm = WorkerConfig::new("pp-vllm", 0, 1, cpu_config());
    vllm.protocol = Some(Protocol::Vllm);
    vllm.pipeline = Some(stage());
    let err = KvConnectorWorker::new(vllm).unwrap_err().to_string();
    assert!(
        err.contains("pipeline_parallel_size 2 is supported in the native protocol only"),
        "{err}"
    );
    let mut hybrid = WorkerConfig::new("pp-hybrid", 0, 1, cpu_config());
    hybrid.kv_transfer_config.kv_connector_extra_config.insert(
        nixl_connector::KV_CACHE_GROUPS_KEY.into(),
        serde_json::json!({"block_size": 4, "groups": ["full_attention", {"sliding_window": {"window_tokens": 8}}]}),
    );
    hybrid.pipeline = Some(stage());
    let err = KvConnectorWorker::new(hybrid).unwrap_err().to_string();
    assert!(
        err.contains("does not support pipeline_parallel_size > 1 with hybrid KV cache layouts"),
        "{err}"
    );
}

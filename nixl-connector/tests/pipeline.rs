//! Pipeline parallelism over real NIXL/UCX, in both protocols: engines of PP × TP ranks in
//! this process, each rank of stage `s` registering only its stage's layers (native: two
//! regions a layer, K and V apart, the rank listening at the engine's port + `s` × TP + its
//! TP rank; vLLM's: one region a layer, every rank served by the engine's side channel as
//! `(s, tp_rank)`). Both engines step through their schedulers, every rank's output
//! aggregated over every stage: the prefill's params say its `pp_size`, each decode rank
//! reads every layer it holds from the prefill stage holding it (and notifies the stages
//! holding none of them), every byte of every decode rank is checked (the blocks read hold
//! the prefill's, the others stay zero), and the prefill frees the request once every
//! stage's reader has notified. Then the next turn (multi-turn read-backs on): the decode
//! keeps the request and the prefill reads it back from the decode's stages, every byte
//! checked, every decode stage releasing it on the readers' notifications. Each decode rank
//! handshakes with the prefill's stages first (`handshake_with_layout`), and the load makes
//! no handshake of its own.
//!
//! Geometries (prefill → decode, `PP × TP`): 2×1 → 1×1, 1×1 → 2×1, 2×1 → 2×1, 2×2 → 1×1,
//! 1×1 → 2×2 and 5 layers split unevenly, 2×1 → 1×2; natively also an explicit partition
//! (vLLM's `VLLM_PP_LAYER_PARTITION` "2,3") against vLLM's even split of 5 layers ([3, 2])
//! across TP 1 → 2. Engines of different layer counts, a hybrid model's stages, a stage of
//! regions that are not whole layers and a load from no stage or too many are refused by
//! name. Push mode from a prefill of stages into a decode of one, in both protocols (PP 2 →
//! 1, 2 × 2 → 1 × 1, 5 layers over 2 × 2 → 1 × 2), every byte; a push decode of stages is
//! refused.

mod common;

use std::sync::Arc;
use std::time::Instant;

use nixl_connector::{
    EngineLayout, FinishStatus, KvAttention, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker,
    KvLayout, LoadOutcome, PipelineRank, PipelineStages, Protocol, RemoteBlocks, SchedulerConfig,
    TransferMode, WorkerConfig,
};

use common::ranks::engine_ranks;
use common::{cpu_config, finished_for_decode, vllm_config, vllm_factors, WAIT};
use nixl::kv_config::{KvRole, KvTransferConfig};

/// KV heads of the model, tokens per block, bytes of a head's token, blocks per region.
const HEADS: usize = 2;
const TOKENS: usize = 4;
const TOKEN_BYTES: usize = 8;
const BLOCKS: usize = 8;
/// The request's blocks on the prefill, and the decode's they land in.
const REMOTE: [usize; 3] = [5, 2, 7];
const LOCAL: [usize; 3] = [1, 6, 3];
/// The prefill's blocks the next turn reads the decode's kept ones back into.
const READ_BACK: [usize; 3] = [0, 4, 6];

/// One engine's parallel layout: its stages, its TP size, and the regions a layer
/// registers.
#[derive(Clone)]
struct Layout {
    stages: PipelineStages,
    tp: usize,
    per_layer: usize,
}

impl Layout {
    fn even(layers: usize, pp: usize, tp: usize) -> Layout {
        let stages = PipelineStages::even(layers, pp).unwrap();
        // K and V apart.
        let per_layer = 2;
        Layout {
            stages,
            tp,
            per_layer,
        }
    }

    fn pp(&self) -> usize {
        self.stages.pp_size()
    }

    /// The spec of a rank of stage `stage`.
    fn spec(&self, stage: usize) -> KvCacheSpec {
        let heads = HEADS / self.tp;
        let regions = self.stages.layers(stage).len() * self.per_layer;
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
        let global = self.stages.layers(stage).start * self.per_layer + region;
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

/// The ranks of an engine of `layout` (in `(stage, tp_rank)` order) speaking `protocol`
/// ([`common::ranks::engine_ranks`]). The prefill's filled. Its port.
fn engine(
    id: &str,
    layout: &Layout,
    filled: bool,
    (protocol, mode): (Protocol, TransferMode),
) -> (Vec<KvConnectorWorker>, u16) {
    let rank = |n: usize| (n / layout.tp, n % layout.tp);
    let (workers, port) = engine_ranks(id, protocol, layout.pp() * layout.tp, |n| {
        let (stage, tp_rank) = rank(n);
        let mut config = WorkerConfig::new(id, tp_rank, layout.tp, kv(protocol, mode, filled));
        config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
        if layout.pp() > 1 {
            config.pipeline = Some(PipelineRank::new(layout.stages.clone(), stage).unwrap());
        }
        (config, layout.spec(stage))
    });
    if filled {
        for (n, worker) in workers.iter().enumerate() {
            let caches = worker.kv_caches().unwrap();
            for region in 0..layout.spec(rank(n).0).num_regions() {
                for block in 0..BLOCKS {
                    let data = layout.block(rank(n), region, block);
                    caches.write(region, block * data.len(), &data).unwrap();
                }
            }
        }
    }
    (workers, port)
}

fn scheduler(id: &str, port: u16, layout: &Layout, kv: &KvTransferConfig) -> KvConnectorScheduler {
    let mut config = SchedulerConfig::new(id, "127.0.0.1", port, layout.tp, kv).unwrap();
    config.pp_size = layout.pp();
    KvConnectorScheduler::new(config)
}

/// Runs one request from a prefill of `prefill` to a decode of `decode` through both
/// schedulers, both engines speaking `protocol`, and checks every byte of every decode rank.
async fn pair(tag: &str, prefill: Layout, decode: Layout, protocol: Protocol) {
    let tag = format!("{protocol}-{tag}");
    let (pf_id, dc_id) = (format!("pf-{tag}"), format!("dc-{tag}"));
    let pull = (protocol, TransferMode::Pull);
    let (prefills, pf_port) = engine(&pf_id, &prefill, true, pull);
    let (decodes, dc_port) = engine(&dc_id, &decode, false, pull);
    let kv = kv(protocol, TransferMode::Pull, false);
    let mut pf = scheduler(&pf_id, pf_port, &prefill, &kv);
    let mut dc = scheduler(&dc_id, dc_port, &decode, &kv);
    let params = finished_for_decode(&mut pf, "req", &REMOTE);
    let pp = prefill.pp();
    let expect_pp = (pp > 1 || protocol == Protocol::Vllm).then_some(pp);
    assert_eq!(
        params.remote_pp_size, expect_pp,
        "{tag}: the params say the prefill's stages"
    );
    // In vLLM's protocol the params cross as vLLM's JSON.
    let params = common::as_sent(protocol, params);
    // Each decode rank handshakes with the prefill's stages before the request, as a decode
    // that learns of a prefill does; the load then handshakes no more.
    let layout = EngineLayout::tp(prefill.tp).with_pp(pp);
    let handshaken = common::handshake_first(&tag, &decodes, (&pf_id, pf_port), layout).await;
    assert!(
        handshaken.iter().all(|&n| n >= pp as u64),
        "{tag}: each decode rank handshook with every stage: {handshaken:?}"
    );
    dc.on_new_request("req", Some(&params));
    dc.update_state_after_alloc("req", &LOCAL, &params).unwrap();
    let reader = (&mut dc, &decodes[..]);
    let loaded = transfer(&tag, reader, (&mut pf, &prefills[..]), "req").await;
    assert_eq!(loaded, "req", "{tag}: the decode's load");
    assert_eq!(
        common::handshakes(&decodes),
        handshaken,
        "{tag}: the load reused the handshakes made before it"
    );
    // Every byte: the blocks read hold the prefill's, the others are untouched (zero).
    let read: Vec<(usize, usize)> = LOCAL.into_iter().zip(REMOTE).collect();
    holds(&tag, &decodes, &decode, &read, true);
    // The next turn: the decode keeps the request, and the prefill reads it back from the
    // decode's stages into other blocks, which then hold what its first blocks hold.
    let tokens = TOKENS * LOCAL.len();
    let kept = dc
        .request_finished("req", &LOCAL, tokens, None, FinishStatus::Stopped)
        .kv_transfer_params
        .expect("kept for the next turn");
    let kept = common::as_sent(protocol, kept);
    pf.on_new_request("turn-2", Some(&kept));
    pf.update_state_after_alloc("turn-2", &READ_BACK, &kept)
        .unwrap();
    let reader = (&mut pf, &prefills[..]);
    let loaded = transfer(&tag, reader, (&mut dc, &decodes[..]), "req").await;
    assert_eq!(loaded, "turn-2", "{tag}: the read-back");
    let read_back: Vec<(usize, usize)> = READ_BACK.into_iter().zip(REMOTE).collect();
    holds(&tag, &prefills, &prefill, &read_back, false);
}

/// An engine's scheduler and its ranks.
type Engine<'a> = (&'a mut KvConnectorScheduler, &'a [KvConnectorWorker]);

/// Steps both engines until the reader's one load ends and the source has released
/// `released` (every stage's reader notified); the loaded request's id.
async fn transfer(tag: &str, reader: Engine<'_>, source: Engine<'_>, released: &str) -> String {
    let (mut loaded, mut freed) = (None, false);
    let started = Instant::now();
    while (loaded.is_none() || !freed) && started.elapsed() < WAIT {
        let sent = source.0.step(source.1).unwrap().finished_sending;
        freed |= sent.iter().any(|r| r == released);
        if let Some(outcome) = reader.0.step(reader.1).unwrap().load_outcomes.pop() {
            loaded = Some(outcome);
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(
        freed,
        "{tag}: {released} released once every stage's reader notified"
    );
    match loaded {
        Some(LoadOutcome::Loaded { request_id }) => request_id,
        other => panic!("{tag}: the load ended {other:?}"),
    }
}

/// Checks that each rank of `workers` (an engine of `layout`) holds, in every region, at
/// each `(block, from)` of `read` what the prefill holds at `from`, and (`untouched_zero`)
/// zero in every other block.
fn holds(
    tag: &str,
    workers: &[KvConnectorWorker],
    layout: &Layout,
    read: &[(usize, usize)],
    untouched_zero: bool,
) {
    for (n, worker) in workers.iter().enumerate() {
        let rank = (n / layout.tp, n % layout.tp);
        let spec = layout.spec(rank.0);
        let caches = worker.kv_caches().unwrap();
        for region in 0..spec.num_regions() {
            let len = spec.block_len(region);
            for block in 0..BLOCKS {
                let want = match read.iter().find(|&&(b, _)| b == block) {
                    Some(&(_, from)) => layout.block(rank, region, from),
                    None if untouched_zero => vec![0; len],
                    None => continue,
                };
                let mut got = vec![0u8; len];
                caches.read(region, block * len, &mut got).unwrap();
                assert!(
                    got == want,
                    "{tag}: rank {rank:?} region {region} block {block}"
                );
            }
        }
    }
}

/// A DRAM config of `protocol` in `mode`: pulling, multi-turn read-backs on; pushing, the
/// prefill (`producer`) says it is one (vLLM's push writes from a prefill of stages only).
fn kv(protocol: Protocol, mode: TransferMode, producer: bool) -> KvTransferConfig {
    let mut factors = vllm_factors();
    if mode == TransferMode::Push {
        factors["transfer_mode"] = "push".into();
    }
    let mut kv = match protocol {
        Protocol::Native => cpu_config(),
        Protocol::Vllm => vllm_config(factors),
    };
    let extra = &mut kv.kv_connector_extra_config;
    match mode {
        TransferMode::Push => {
            extra.insert("transfer_mode".into(), "push".into());
            kv.kv_role = Some(if producer {
                KvRole::Producer
            } else {
                KvRole::Consumer
            });
        }
        _ => {
            extra.insert("bidirectional_kv_xfer".into(), true.into());
        }
    }
    kv
}

/// Runs one request pushed from a prefill of `prefill` (several stages) into a decode of one
/// stage of `decode`, both engines speaking `protocol` through their schedulers: the decode
/// registers with every prefill rank of its mapping in every stage, each stage WRITEs its
/// layers into the decode's, every byte of every decode rank is checked, and the prefill
/// frees the request once every stage's WRITE ended.
async fn push_from_stages(tag: &str, prefill: Layout, decode: Layout, protocol: Protocol) {
    let tag = format!("{protocol}-push-{tag}");
    let (pf_id, dc_id) = (format!("pf-{tag}"), format!("dc-{tag}"));
    let push = (protocol, TransferMode::Push);
    let (prefills, pf_port) = engine(&pf_id, &prefill, true, push);
    let (decodes, dc_port) = engine(&dc_id, &decode, false, push);
    let pf_kv = kv(protocol, TransferMode::Push, true);
    let dc_kv = kv(protocol, TransferMode::Push, false);
    let mut pf = scheduler(&pf_id, pf_port, &prefill, &pf_kv);
    let mut dc = scheduler(&dc_id, dc_port, &decode, &dc_kv);
    let params = finished_for_decode(&mut pf, "req", &REMOTE);
    assert_eq!(params.transfer_mode.as_deref(), Some("push"), "{tag}");
    let params = common::as_sent(protocol, params);
    dc.on_new_request("req", Some(&params));
    dc.update_state_after_alloc("req", &LOCAL, &params).unwrap();
    let reader = (&mut dc, &decodes[..]);
    let loaded = transfer(&tag, reader, (&mut pf, &prefills[..]), "req").await;
    assert_eq!(loaded, "req", "{tag}: the decode's load");
    let read: Vec<(usize, usize)> = LOCAL.into_iter().zip(REMOTE).collect();
    holds(&tag, &decodes, &decode, &read, true);
    let writes: u64 = prefills.iter().map(|p| p.push_stats().writes).sum();
    assert_eq!(
        writes,
        prefills.len() as u64,
        "{tag}: every prefill rank wrote once"
    );
}

/// Push from a prefill of several stages (vLLM's push writes from one; its decode has one
/// stage), both protocols: PP 2 → 1, PP 2 × TP 2 → 1 × 1 and 5 layers split unevenly
/// (PP 2 × TP 2 → TP 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_of_stages_pushes_each_layer_into_the_decode() {
    for protocol in [Protocol::Native, Protocol::Vllm] {
        for (tag, prefill, decode) in [
            ("p2-d1", Layout::even(4, 2, 1), Layout::even(4, 1, 1)),
            ("p2x2-d1", Layout::even(4, 2, 2), Layout::even(4, 1, 1)),
            ("uneven", Layout::even(5, 2, 2), Layout::even(5, 1, 2)),
        ] {
            let per_layer = match protocol {
                Protocol::Native => prefill.per_layer,
                Protocol::Vllm => 1,
            };
            let prefill = Layout {
                per_layer,
                ..prefill
            };
            let decode = Layout {
                per_layer,
                ..decode
            };
            push_from_stages(tag, prefill, decode, protocol).await;
        }
    }
}

/// A push worker of several stages that is not a producer (a decode of stages, which
/// vLLM's push refuses) is refused at creation, by name.
#[tokio::test]
async fn a_push_decode_of_stages_is_refused() {
    for role in [None, Some(KvRole::Consumer), Some(KvRole::Both)] {
        let mut kv = kv(Protocol::Native, TransferMode::Push, false);
        kv.kv_role = role;
        let mut config = WorkerConfig::new("dc-push-stages", 0, 1, kv);
        config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
        let stages = PipelineStages::even(4, 2).unwrap();
        config.pipeline = Some(PipelineRank::new(stages, 1).unwrap());
        let err = KvConnectorWorker::new(config)
            .map(drop)
            .unwrap_err()
            .to_string();
        assert!(err.contains("kv_producer"), "{role:?}: {err}");
    }
}

/// The geometries of both protocols: equal PP, 2 → 1, 1 → 2, PP and TP mixed both ways,
/// and an uneven split of 5 layers. In vLLM's protocol a layer is one region, as vLLM
/// registers it (a reader of one stage takes each region for a layer).
async fn every_geometry(protocol: Protocol) {
    for (tag, prefill, decode) in [
        ("p2-d1", Layout::even(4, 2, 1), Layout::even(4, 1, 1)),
        ("p1-d2", Layout::even(4, 1, 1), Layout::even(4, 2, 1)),
        ("p2-d2", Layout::even(4, 2, 1), Layout::even(4, 2, 1)),
        ("p2x2-d1", Layout::even(4, 2, 2), Layout::even(4, 1, 1)),
        ("p1-d2x2", Layout::even(4, 1, 1), Layout::even(4, 2, 2)),
        ("uneven", Layout::even(5, 2, 1), Layout::even(5, 1, 2)),
    ] {
        let per_layer = match protocol {
            Protocol::Native => prefill.per_layer,
            Protocol::Vllm => 1,
        };
        let (prefill, decode) = (
            Layout {
                per_layer,
                ..prefill
            },
            Layout {
                per_layer,
                ..decode
            },
        );
        pair(tag, prefill, decode, protocol).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_decode_layer_is_read_from_the_prefill_stage_holding_it() {
    every_geometry(Protocol::Native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_vllms_protocol_each_decode_layer_is_read_from_its_prefill_stage() {
    every_geometry(Protocol::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_partition_pairs_with_an_even_split() {
    // Native only: vLLM's metadata does not say a partition (its readers take the even
    // rule), so there a prefill of another one is refused by its regions' count.
    let explicit = Layout {
        stages: PipelineStages::from_vllm_partition("2,3", 2, 5).unwrap(),
        ..Layout::even(5, 1, 1)
    };
    pair(
        "explicit",
        explicit,
        Layout::even(5, 2, 2),
        Protocol::Native,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_of_different_layer_counts_are_refused_before_any_read() {
    let native = Protocol::Native;
    let native = (native, TransferMode::Pull);
    let (prefills, port) = engine("pf-layers", &Layout::even(4, 2, 1), true, native);
    let (decodes, dc_port) = engine("dc-layers", &Layout::even(6, 2, 1), false, native);
    let kv = kv(Protocol::Native, TransferMode::Pull, false);
    let mut pf = scheduler("pf-layers", port, &Layout::even(4, 2, 1), &kv);
    let mut dc = scheduler("dc-layers", dc_port, &Layout::even(6, 2, 1), &kv);
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
async fn stages_of_a_hybrid_model_are_refused_as_vllm_refuses_them() {
    let mut hybrid = WorkerConfig::new("pp-hybrid", 0, 1, cpu_config());
    hybrid.kv_transfer_config.kv_connector_extra_config.insert(
        nixl_connector::KV_CACHE_GROUPS_KEY.into(),
        serde_json::json!({"block_size": 4, "groups": ["full_attention", {"sliding_window": {"window_tokens": 8}}]}),
    );
    let stages = PipelineStages::even(4, 2).unwrap();
    hybrid.pipeline = Some(PipelineRank::new(stages, 1).unwrap());
    let err = KvConnectorWorker::new(hybrid).unwrap_err().to_string();
    assert!(
        err.contains("does not support pipeline_parallel_size > 1 with hybrid KV cache layouts"),
        "{err}"
    );
}

#[tokio::test]
async fn a_stage_of_regions_that_are_not_whole_layers_is_refused_at_registration() {
    let mut config = WorkerConfig::new("pp-regions", 0, 1, cpu_config());
    config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
    let stages = PipelineStages::even(4, 2).unwrap();
    config.pipeline = Some(PipelineRank::new(stages, 1).unwrap());
    let worker = KvConnectorWorker::new(config).unwrap();
    // Stage 1 holds 2 layers: 3 regions are not a whole number a layer.
    let three = Layout {
        per_layer: 1,
        ..Layout::even(3, 1, 1)
    };
    let err = worker.register_host_kv_caches(three.spec(0)).unwrap_err();
    let err = err.to_string();
    assert!(
        err.contains("3 regions for the 2 layers of stage 1"),
        "{err}"
    );
}

#[tokio::test]
async fn a_load_from_no_stage_or_too_many_is_refused() {
    let spec = Layout::even(2, 1, 1).spec(0);
    let decode = common::worker("pp-none", 0, 1, &spec);
    for pp_size in [0, nixl_connector::MAX_PP_SIZE + 1] {
        let remote = RemoteBlocks {
            pp_size,
            dcp_size: 1,
            ..common::remote(&decode, "pf", "req", vec![1], 1)
        };
        let err = decode.start_load("req", &[1], &remote).unwrap_err();
        let named = format!("a remote engine of {pp_size} pipeline stages");
        assert!(err.to_string().contains(&named), "{err}");
    }
}

//! Decode context parallelism (DCP) over real NIXL/UCX, in both protocols: engines of MLA caches whose ranks
//! each hold every `size`-th global block position of a request (DCP rank `r` the
//! positions `r`, `r + size`, ..., its `j`-th block of the request's list position
//! `j * size + r`), or all of them (DCP 1, the latent replicated over TP). Both engines
//! step through their schedulers in this process, every rank's output aggregated: the
//! prefill's params say its `dcp_size` and its tokens, each decode rank reads every
//! position it holds past its prefix cache from the prefill rank holding it (vLLM's
//! `_apply_dcp_prefix_caching`), the ranks holding none of them are only notified, every
//! byte of every decode rank is checked (the blocks read hold the prefill's positions,
//! every other block stays zero), and the prefill frees the request once every reader
//! notified (vLLM's `dcp_consumer_count`). Without a prefix hit, then the next turn
//! (multi-turn read-backs on): the decode keeps the request and the prefill reads it back
//! from the decode's DCP ranks, every position checked, the decode freeing it on the
//! readers' notifications.
//!
//! Geometries (prefill → decode, `TP/DCP`): 2/2 → 1/1, 1/1 → 2/2, 2/2 → 2/2, 4/4 → 2/2,
//! 2/2 → 4/4, 2/2 → 2/1, 4/4 → 1/1 and 1/1 → 4/4; with pipeline stages (`PP × TP/DCP`,
//! each stage vLLM's even split of the layers, each layer read from the stage holding it):
//! 2 × 2/2 → 1 × 1/1, 1 × 2/2 → 2 × 2/2, 2 × 2/2 → 2 × 2/2, 2 × 2/2 → 1 × 4/4 past a
//! prefix hit; prefix hits of 1 to 3 blocks; requests
//! short enough that some ranks read nothing (only notified). What vLLM refuses is refused
//! by name before any READ: a DCP size that is neither 1 nor the TP size, DCP with a cache
//! that is not MLA, params whose `dcp_size` is not the prefill's. Each decode rank
//! handshakes with the prefill first (`handshake_with_layout`, its TP and DCP sizes), and
//! the load makes no handshake of its own.

mod common;

use std::sync::Arc;
use std::time::Instant;

use nixl_connector::{
    EngineLayout, FinishStatus, KvAttention, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker,
    KvLayout, KvTransferParams, LoadOutcome, PipelineRank, PipelineStages, Protocol,
    SchedulerConfig, WorkerConfig,
};

use common::ranks::engine_ranks;
use common::{cpu_config, for_decode, vllm_config, vllm_factors, WAIT};
use nixl::kv_config::{KvRole, KvTransferConfig};

/// Layers (one region each), tokens per block, bytes of a token's latent, blocks per region.
const LAYERS: usize = 2;
const TOKENS: usize = 4;
const LATENT: usize = 8;
const BLOCKS: usize = 16;
/// The request's block list on the prefill (its first `ceil(positions / dcp)` used), and
/// the decode's.
const REMOTE: [usize; 8] = [9, 3, 12, 5, 7, 1, 14, 10];
const LOCAL: [usize; 8] = [2, 8, 4, 11, 6, 13, 0, 15];
/// The prefill's blocks the next turn reads the decode's kept ones back into.
const READ_BACK: [usize; 8] = [0, 2, 4, 6, 8, 11, 13, 15];

/// One engine's parallel layout: TP and DCP in each of its pipeline stages, and its PCP
/// size (its transfer ranks are the TP ones either way: replicated PCP's rank 0 of each TP
/// rank, or PCP+DCP's PCP ranks).
#[derive(Clone, Copy, Debug)]
struct Side {
    tp: usize,
    dcp: usize,
    pp: usize,
    pcp: usize,
}

/// One stage of TP `tp` and DCP `dcp`.
const fn side(tp: usize, dcp: usize) -> Side {
    Side {
        tp,
        dcp,
        pp: 1,
        pcp: 1,
    }
}

impl Side {
    /// This side in `pp` stages.
    const fn staged(self, pp: usize) -> Side {
        Side { pp, ..self }
    }

    /// This side with PCP `pcp`.
    const fn pcp(self, pcp: usize) -> Side {
        Side { pcp, ..self }
    }

    /// Its stages: vLLM's even split of the [`LAYERS`].
    fn stages(&self) -> PipelineStages {
        PipelineStages::even(LAYERS, self.pp).unwrap()
    }

    /// Rank `n` of the engine (in `(stage, tp_rank)` order) as `(stage, tp_rank)`.
    fn rank(&self, n: usize) -> (usize, usize) {
        (n / self.tp, n % self.tp)
    }
}

/// An MLA cache of `layers` layers: one latent per token, the same size on every rank.
fn spec(layers: usize) -> KvCacheSpec {
    let block_len = TOKENS * LATENT;
    KvCacheSpec::uniform(
        layers,
        BLOCKS,
        TOKENS,
        KvAttention::Mla,
        KvLayout::Hnd,
        block_len,
    )
}

/// What the prefill holds at global position `position` in layer `region`: a function of
/// both, the same on whichever rank holds it.
fn position_bytes(region: usize, position: usize) -> Vec<u8> {
    (0..TOKENS * LATENT)
        .map(|byte| ((region * 1009 + position * 101 + byte * 7) % 251 + 1) as u8)
        .collect()
}

/// A DRAM config of `protocol`, its lease (300 s) far past the tests' wait, so that only
/// the readers' notifications free a request in time; multi-turn read-backs on.
fn kv(protocol: Protocol) -> KvTransferConfig {
    let mut kv = match protocol {
        Protocol::Native => cpu_config(),
        Protocol::Vllm => vllm_config(vllm_factors()),
    };
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("kv_lease_duration".into(), 300.into());
    extra.insert("bidirectional_kv_xfer".into(), true.into());
    kv
}

/// The ranks of an engine of `side` speaking `protocol` ([`common::ranks::engine_ranks`]),
/// each holding `positions` positions of the request in `REMOTE` when `filled`. Its port.
fn engine(
    id: &str,
    side: Side,
    filled: Option<usize>,
    protocol: Protocol,
) -> (Vec<KvConnectorWorker>, u16) {
    let stages = side.stages();
    let (workers, port) = engine_ranks(id, protocol, side.pp * side.tp, |n| {
        let (stage, rank) = side.rank(n);
        let mut config = WorkerConfig::new(id, rank, side.tp, kv(protocol));
        config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
        config.dcp_size = side.dcp;
        config.pcp_size = side.pcp;
        if side.pp > 1 {
            config.pipeline = Some(PipelineRank::new(stages.clone(), stage).unwrap());
        }
        (config, spec(stages.layers(stage).len()))
    });
    if let Some(positions) = filled {
        for (n, worker) in workers.iter().enumerate() {
            let (stage, rank) = side.rank(n);
            let caches = worker.kv_caches().unwrap();
            let dcp_rank = rank % side.dcp;
            let held = (dcp_rank..positions).step_by(side.dcp);
            for (j, position) in held.enumerate() {
                for (region, layer) in stages.layers(stage).enumerate() {
                    let data = position_bytes(layer, position);
                    caches.write(region, REMOTE[j] * data.len(), &data).unwrap();
                }
            }
        }
    }
    (workers, port)
}

fn scheduler(id: &str, port: u16, side: Side, protocol: Protocol) -> KvConnectorScheduler {
    let kv = kv(protocol);
    let mut config = SchedulerConfig::new(id, "127.0.0.1", port, side.tp, &kv).unwrap();
    config.dcp_size = side.dcp;
    config.pp_size = side.pp;
    KvConnectorScheduler::new(config)
}

/// One request of `tokens` tokens from a prefill of `prefill` to a decode of `decode`
/// whose prefix cache holds its first `cached` blocks (of the decode's list), through both
/// schedulers, both engines speaking `protocol`; checks every byte of every decode rank.
async fn pair(prefill: Side, decode: Side, tokens: usize, cached: usize, protocol: Protocol) {
    let tag = format!(
        "{protocol}-p{}x{}x{}x{}-d{}x{}x{}x{}-t{tokens}-c{cached}",
        prefill.pp,
        prefill.tp,
        prefill.dcp,
        prefill.pcp,
        decode.pp,
        decode.tp,
        decode.dcp,
        decode.pcp
    );
    let positions = tokens.div_ceil(TOKENS);
    let (pf_id, dc_id) = (format!("pf-{tag}"), format!("dc-{tag}"));
    let (prefills, pf_port) = engine(&pf_id, prefill, Some(positions), protocol);
    let (decodes, dc_port) = engine(&dc_id, decode, None, protocol);
    let mut pf = scheduler(&pf_id, pf_port, prefill, protocol);
    let mut dc = scheduler(&dc_id, dc_port, decode, protocol);
    let remote = &REMOTE[..positions.div_ceil(prefill.dcp)];
    let done = pf.request_finished(
        "req",
        remote,
        tokens,
        Some(&for_decode()),
        FinishStatus::LengthCapped,
    );
    let params = done.kv_transfer_params.unwrap();
    let expect_dcp = (prefill.dcp > 1 || protocol == Protocol::Vllm).then_some(prefill.dcp);
    assert_eq!(params.remote_dcp_size, expect_dcp, "{tag}: dcp_size");
    let params = common::as_sent(protocol, params);
    let list = &LOCAL[..positions.div_ceil(decode.dcp)];
    let local = &list[cached..];
    // Each decode rank handshakes with the prefill ranks holding its positions before the
    // request, as a decode that learns of a prefill does; the load then handshakes no more.
    let layout = EngineLayout::tp(prefill.tp)
        .with_dcp(prefill.dcp)
        .with_pp(prefill.pp);
    let handshaken = common::handshake_first(&tag, &decodes, (&pf_id, pf_port), layout).await;
    assert!(handshaken.iter().all(|&n| n > 0), "{tag}: {handshaken:?}");
    dc.on_new_request("req", Some(&params));
    dc.update_state_after_alloc("req", local, &params).unwrap();
    let loaded = transfer(&tag, (&mut dc, &decodes), (&mut pf, &prefills)).await;
    assert_eq!(loaded, "req", "{tag}: the decode's load");
    assert_eq!(
        common::handshakes(&decodes),
        handshaken,
        "{tag}: the load reused the handshakes made before it"
    );
    holds_positions(&tag, &decodes, decode, (list, cached), positions);
    if cached > 0 {
        return;
    }
    // The next turn: the decode keeps the request, and the prefill reads it back from the
    // decode's DCP ranks into other blocks, which then hold every position again.
    let kept = dc
        .request_finished("req", list, tokens, None, FinishStatus::Stopped)
        .kv_transfer_params
        .expect("kept for the next turn");
    let kept = common::as_sent(protocol, kept);
    let back = &READ_BACK[..positions.div_ceil(prefill.dcp)];
    pf.on_new_request("turn-2", Some(&kept));
    pf.update_state_after_alloc("turn-2", back, &kept).unwrap();
    let loaded = transfer(&tag, (&mut pf, &prefills), (&mut dc, &decodes)).await;
    assert_eq!(loaded, "turn-2", "{tag}: the read-back");
    for (n, worker) in prefills.iter().enumerate() {
        let (stage, rank) = prefill.rank(n);
        let caches = worker.kv_caches().unwrap();
        for (j, &block) in back.iter().enumerate() {
            let position = j * prefill.dcp + rank % prefill.dcp;
            if position >= positions {
                continue;
            }
            for (region, layer) in prefill.stages().layers(stage).enumerate() {
                let len = TOKENS * LATENT;
                let mut got = vec![0u8; len];
                caches.read(region, block * len, &mut got).unwrap();
                let want = position_bytes(layer, position);
                assert!(
                    got == want,
                    "{tag}: read back, rank {rank} region {region} block {block}"
                );
            }
        }
    }
}

/// Checks that each rank of `decodes` (an engine of `decode`) holds, at list index `i` of
/// `list` past the `cached` first, position `i * dcp + dcp_rank` when it is in the request
/// of `positions`, and zero in every other block.
fn holds_positions(
    tag: &str,
    decodes: &[KvConnectorWorker],
    decode: Side,
    (list, cached): (&[usize], usize),
    positions: usize,
) {
    for (n, worker) in decodes.iter().enumerate() {
        let (stage, rank) = decode.rank(n);
        let dcp_rank = rank % decode.dcp;
        let caches = worker.kv_caches().unwrap();
        for (region, layer) in decode.stages().layers(stage).enumerate() {
            for block in 0..BLOCKS {
                let len = TOKENS * LATENT;
                let position = list
                    .iter()
                    .position(|&b| b == block)
                    .filter(|&i| i >= cached)
                    .map(|i| i * decode.dcp + dcp_rank)
                    .filter(|&p| p < positions);
                let want = match position {
                    Some(p) => position_bytes(layer, p),
                    None => vec![0; len],
                };
                let mut got = vec![0u8; len];
                caches.read(region, block * len, &mut got).unwrap();
                assert!(
                    got == want,
                    "{tag}: rank {rank} region {region} block {block} (position {position:?})"
                );
            }
        }
    }
}

/// An engine's scheduler and its ranks.
type Engine<'a> = (&'a mut KvConnectorScheduler, &'a [KvConnectorWorker]);

/// Steps both engines until the reader's one load ends and the source has freed `req`
/// (every reader notified); the loaded request's id.
async fn transfer(tag: &str, reader: Engine<'_>, source: Engine<'_>) -> String {
    let (mut loaded, mut freed) = (None, false);
    let started = Instant::now();
    while (loaded.is_none() || !freed) && started.elapsed() < WAIT {
        let sent = source.0.step(source.1).unwrap().finished_sending;
        freed |= sent.iter().any(|r| r == "req");
        if let Some(outcome) = reader.0.step(reader.1).unwrap().load_outcomes.pop() {
            loaded = Some(outcome);
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(freed, "{tag}: freed once every reader notified");
    match loaded {
        Some(LoadOutcome::Loaded { request_id }) => request_id,
        other => panic!("{tag}: the load ended {other:?}"),
    }
}

/// The geometries, with a request of 7 positions (the last block part full) and no cache.
async fn every_geometry(protocol: Protocol) {
    for (prefill, decode) in [
        (side(2, 2), side(1, 1)),
        (side(1, 1), side(2, 2)),
        (side(2, 2), side(2, 2)),
        (side(4, 4), side(2, 2)),
        (side(2, 2), side(4, 4)),
        (side(2, 2), side(2, 1)),
        (side(4, 4), side(1, 1)),
        (side(1, 1), side(4, 4)),
    ] {
        pair(prefill, decode, 26, 0, protocol).await;
    }
}

/// Prefix hits, and requests so short that some ranks read nothing.
async fn prefix_hits_and_ranks_with_nothing_to_read(protocol: Protocol) {
    for (prefill, decode, tokens, cached) in [
        // 7 positions; the decode's first 2 blocks (positions 0 to 3) cached.
        (side(4, 4), side(2, 2), 26, 2),
        // The decode's first block (positions 0 to 3) cached.
        (side(2, 2), side(4, 4), 28, 1),
        // 3 of the decode's 7 blocks cached.
        (side(2, 2), side(1, 1), 28, 3),
        // 2 positions: prefill ranks 2 and 3 hold none, and are only notified.
        (side(4, 4), side(1, 1), 8, 0),
        // 3 positions, the first block (0 and 1) cached: decode rank 1's next position (3)
        // is past the request, so it reads nothing and only notifies.
        (side(2, 2), side(2, 2), 12, 1),
    ] {
        pair(prefill, decode, tokens, cached, protocol).await;
    }
}

/// DCP and pipeline stages together: each decode rank reads every layer it holds from the
/// prefill stage holding it, and in that stage every position it holds from the DCP rank
/// holding it (a prefix hit too); the prefill frees the request once every stage's readers
/// notified, and reads it back from the decode's stages and DCP ranks.
async fn dcp_with_pipeline_stages(protocol: Protocol) {
    for (prefill, decode, tokens, cached) in [
        (side(2, 2).staged(2), side(1, 1), 26, 0),
        (side(2, 2), side(2, 2).staged(2), 26, 0),
        (side(2, 2).staged(2), side(2, 2).staged(2), 26, 0),
        (side(2, 2).staged(2), side(4, 4), 28, 1),
    ] {
        pair(prefill, decode, tokens, cached, protocol).await;
    }
}

/// Prefill context parallelism on Rust prefills, in vLLM's protocol (its metadata carries
/// `pcp_size`): a prefill of PCP 2 sharded with DCP 2 (its transfer ranks its PCP ranks) is
/// read by decodes of DCP 1 and 2 and reads their KV back the next turn, and a replicated
/// PCP 2 prefill likewise with a decode of DCP 1; a replicated PCP 2 prefill and a decode of
/// DCP 2 refuse each other with vLLM's reason before any READ, whichever reads (the decode,
/// or the prefill reading back the decode's kept KV).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefill_context_parallelism_pairs_as_vllm_pairs_it() {
    let protocol = Protocol::Vllm;
    pair(side(2, 2).pcp(2), side(1, 1), 26, 0, protocol).await;
    pair(side(2, 2).pcp(2), side(2, 2), 26, 0, protocol).await;
    pair(side(1, 1).pcp(2), side(1, 1), 26, 0, protocol).await;
    let replicated = "Replicated PCP cannot be paired with a DCP-sharded NIXL peer.";
    let got = refused(side(1, 1).pcp(2), side(2, 2), protocol).await;
    let sizes = "Local PCP/DCP=1/2; remote PCP/DCP=2/1.";
    assert!(got.contains(replicated) && got.contains(sizes), "{got}");
    // The turn back: the replicated PCP prefill reads the DCP-sharded decode's kept KV.
    let got = refused(side(2, 2), side(1, 1).pcp(2), protocol).await;
    let sizes = "Local PCP/DCP=2/1; remote PCP/DCP=1/2.";
    assert!(got.contains(replicated) && got.contains(sizes), "{got}");
}

/// A PCP size whose DCP neither is 1 nor spans it, or in a consumer, is refused at the
/// worker's creation, with vLLM's rules.
#[tokio::test]
async fn a_pcp_group_that_dcp_does_not_span_or_a_pcp_consumer_is_refused() {
    let config = |(dcp, pcp), role| {
        let mut config = WorkerConfig::new("pf-pcp", 0, 2, kv(Protocol::Vllm));
        config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
        (config.dcp_size, config.pcp_size) = (dcp, pcp);
        config.kv_transfer_config.kv_role = role;
        KvConnectorWorker::new(config).map(drop)
    };
    let err = config((2, 4), None).unwrap_err().to_string();
    assert!(
        err.contains("PCP+DCP must span the full PCP group"),
        "{err}"
    );
    for role in [KvRole::Consumer, KvRole::Both] {
        let err = config((2, 2), Some(role)).unwrap_err().to_string();
        assert!(
            err.contains("PCP currently supports kv_producer only"),
            "{err}"
        );
    }
    config((2, 2), Some(KvRole::Producer)).unwrap();
}

/// A request from a prefill of `prefill` to a decode of `decode`, both speaking `protocol`,
/// whose load is refused: the reason, every block of the decode still zero.
async fn refused(prefill: Side, decode: Side, protocol: Protocol) -> String {
    let tag = format!(
        "refused-{}x{}-{}x{}",
        prefill.tp, prefill.pcp, decode.tp, decode.pcp
    );
    let (pf_id, dc_id) = (format!("pf-{tag}"), format!("dc-{tag}"));
    let (_prefills, pf_port) = engine(&pf_id, prefill, Some(7), protocol);
    let (decodes, dc_port) = engine(&dc_id, decode, None, protocol);
    let mut pf = scheduler(&pf_id, pf_port, prefill, protocol);
    let mut dc = scheduler(&dc_id, dc_port, decode, protocol);
    let remote = &REMOTE[..7usize.div_ceil(prefill.dcp)];
    let done = pf.request_finished(
        "req",
        remote,
        26,
        Some(&for_decode()),
        FinishStatus::LengthCapped,
    );
    let params =
        KvTransferParams::from_vllm_json(&done.kv_transfer_params.unwrap().to_vllm_json()).unwrap();
    let list = &LOCAL[..7usize.div_ceil(decode.dcp)];
    dc.on_new_request("req", Some(&params));
    dc.update_state_after_alloc("req", list, &params).unwrap();
    let started = Instant::now();
    let reason = loop {
        assert!(started.elapsed() < WAIT, "{tag}: no outcome");
        match dc.step(&decodes).unwrap().load_outcomes.pop() {
            Some(LoadOutcome::Failed { reason, .. } | LoadOutcome::Recompute { reason, .. }) => {
                break reason
            }
            Some(other) => panic!("{tag}: {other:?}"),
            None => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
        }
    };
    holds_positions(&tag, &decodes, decode, (list, list.len()), 7);
    reason
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_dcp_with_pipeline_stages() {
    dcp_with_pipeline_stages(Protocol::Native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_dcp_with_pipeline_stages() {
    dcp_with_pipeline_stages(Protocol::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_every_geometry() {
    every_geometry(Protocol::Native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_prefix_hits_and_ranks_with_nothing_to_read() {
    prefix_hits_and_ranks_with_nothing_to_read(Protocol::Native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_every_geometry() {
    every_geometry(Protocol::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_prefix_hits_and_ranks_with_nothing_to_read() {
    prefix_hits_and_ranks_with_nothing_to_read(Protocol::Vllm).await;
}

#[tokio::test]
async fn a_dcp_size_neither_one_nor_the_tp_size_is_refused() {
    let mut config = WorkerConfig::new("dcp-3", 0, 4, cpu_config());
    config.dcp_size = 2;
    let err = KvConnectorWorker::new(config).unwrap_err().to_string();
    assert!(err.contains("a DCP size of 1 or the TP size"), "{err}");
    let mut config = WorkerConfig::new("dcp-0", 0, 1, cpu_config());
    config.dcp_size = 0;
    let err = KvConnectorWorker::new(config).unwrap_err().to_string();
    assert!(err.contains("dcp_size 0"), "{err}");
}

#[tokio::test]
async fn dcp_with_a_cache_that_is_not_mla_is_refused() {
    let mut config = WorkerConfig::new("dcp-mha", 0, 2, cpu_config());
    config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
    config.dcp_size = 2;
    let worker = KvConnectorWorker::new(config).unwrap();
    let err = worker
        .register_host_kv_caches(common::spec_tp(2, 2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("MLA caches only"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn params_whose_dcp_size_is_not_the_prefills_fail_the_load_before_any_read() {
    let protocol = Protocol::Native;
    let (prefill, decode) = (side(2, 2), side(1, 1));
    let (prefills, pf_port) = engine("pf-lie", prefill, Some(4), protocol);
    let (decodes, _) = engine("dc-lie", decode, None, protocol);
    let mut pf = scheduler("pf-lie", pf_port, prefill, protocol);
    let mut dc = scheduler("dc-lie", 0, decode, protocol);
    let done = pf.request_finished(
        "req",
        &REMOTE[..2],
        16,
        Some(&for_decode()),
        FinishStatus::LengthCapped,
    );
    let mut params = done.kv_transfer_params.unwrap();
    params.remote_dcp_size = None;
    dc.on_new_request("req", Some(&params));
    dc.update_state_after_alloc("req", &LOCAL[..4], &params)
        .unwrap();
    let started = Instant::now();
    let mut ended = None;
    while ended.is_none() && started.elapsed() < WAIT {
        pf.step(&prefills).unwrap();
        ended = dc.step(&decodes).unwrap().load_outcomes.pop();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    match ended {
        Some(LoadOutcome::Failed { reason, .. } | LoadOutcome::Recompute { reason, .. }) => {
            assert!(
                reason.contains("params say dcp_size 1, the remote rank's handshake 2"),
                "{reason}"
            )
        }
        other => panic!("the load ended {other:?}"),
    }
    let caches = decodes[0].kv_caches().unwrap();
    let mut got = vec![0u8; BLOCKS * TOKENS * LATENT];
    caches.read(0, 0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "nothing read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dcp_sizes_that_do_not_divide_are_refused_before_any_read() {
    // A decode of TP 2 DCP 2 and a load naming a prefill of TP 3 DCP 3.
    let (decodes, _) = engine("dc-three", side(2, 2), None, Protocol::Native);
    let remote = nixl_connector::RemoteBlocks {
        dcp_size: 3,
        tp_size: 3,
        ..common::remote(&decodes[0], "pf-three", "req", vec![1], 1)
    };
    let err = decodes[0]
        .start_load("req", &[1], &remote)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("DCP sizes must divide one another: local=2, remote=3"),
        "{err}"
    );
}

//! Multi-turn conversations over real NIXL/UCX (vLLM 0.33's bidirectional KV transfer), in
//! one process, both protocols: a decode keeps each finished request's KV and the next
//! turn's prefill reads it back (every byte checked, the prefill's own prefix cache used
//! first); an expired TTL is declined and recomputed; the recompute threshold both sides;
//! a hybrid model's read-back, group by group; and the cap on kept blocks evicting under
//! pressure while read-backs run, with every
//! block the decode frees poisoned at once, so that a read-back reported loaded from a
//! freed block would show.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{pattern, worker_with, TOKEN_BYTES, WAIT};
use nixl::kv_config::KvTransferConfig;
use nixl_connector::{
    FinishStatus, KvAttention, KvCacheGroupKind, KvCacheGroups, KvCacheSpec, KvConnectorScheduler,
    KvConnectorWorker, KvLayout, KvTransferParams, LoadOutcome, Protocol, SchedulerConfig,
    KV_CACHE_GROUPS_KEY,
};

/// 3 regions of 40 blocks of 4 tokens of 2 KV heads.
fn spec() -> KvCacheSpec {
    let heads = KvAttention::Mha { total_kv_heads: 2 };
    KvCacheSpec::uniform(3, 40, 4, heads, KvLayout::Hnd, 4 * 2 * TOKEN_BYTES)
}

/// A DRAM config of `protocol` with read-backs on and `extra` keys.
fn config(protocol: Protocol, extra: serde_json::Value) -> KvTransferConfig {
    let mut kv = match protocol {
        Protocol::Native => common::cpu_config(),
        Protocol::Vllm => common::vllm_config(common::vllm_factors()),
    };
    let keys = &mut kv.kv_connector_extra_config;
    keys.insert("bidirectional_kv_xfer".into(), true.into());
    for (key, value) in extra.as_object().unwrap() {
        keys.insert(key.clone(), value.clone());
    }
    kv
}

/// One engine of TP 1: its worker and scheduler, every request its steps released, and the
/// blocks of the requests it keeps, poisoned and freed as soon as a step releases them.
struct Engine {
    worker: KvConnectorWorker,
    scheduler: KvConnectorScheduler,
    released: Vec<String>,
    outcomes: HashMap<String, LoadOutcome>,
    kept: HashMap<String, Vec<usize>>,
    free: Vec<usize>,
}

impl Engine {
    fn new(id: &str, kv: &KvTransferConfig) -> Engine {
        common::init_tracing();
        let worker = worker_with(id, 0, 1, &spec(), |c| c.kv_transfer_config = kv.clone());
        let port = worker.side_channel_addr().unwrap().port();
        let config = SchedulerConfig::new(id, "127.0.0.1", port, 1, kv).unwrap();
        Engine {
            worker,
            scheduler: KvConnectorScheduler::new(config),
            released: Vec::new(),
            outcomes: HashMap::new(),
            kept: HashMap::new(),
            free: (4..20).collect(),
        }
    }

    /// One engine step: the scheduler's metadata to the worker, its output back.
    fn step(&mut self) {
        self.worker
            .start_load_kv(&self.scheduler.build_connector_meta());
        let out = self
            .scheduler
            .update_connector_output(&[self.worker.output()])
            .unwrap();
        for id in &out.finished_sending {
            if let Some(blocks) = self.kept.remove(id) {
                self.poison(&blocks);
                self.free.extend(blocks);
            }
        }
        self.released.extend(out.finished_sending);
        for outcome in out.load_outcomes {
            let id = match &outcome {
                LoadOutcome::Loaded { request_id }
                | LoadOutcome::Recompute { request_id, .. }
                | LoadOutcome::Failed { request_id, .. }
                | LoadOutcome::AbortedLoadEnded { request_id } => request_id.clone(),
            };
            self.outcomes.insert(id, outcome);
        }
    }

    /// Steps until request `id`'s load ends; its outcome.
    async fn load_ended(&mut self, id: &str) -> LoadOutcome {
        let start = Instant::now();
        loop {
            self.step();
            if let Some(outcome) = self.outcomes.remove(id) {
                return outcome;
            }
            assert!(start.elapsed() < WAIT, "request {id}'s load never ended");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Steps until request `id`'s blocks are released.
    async fn until_released(&mut self, id: &str) {
        let start = Instant::now();
        while !self.released.iter().any(|r| r == id) {
            self.step();
            assert!(start.elapsed() < WAIT, "request {id} was never released");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Block `block` of every region.
    fn block(&self, block: usize) -> Vec<Vec<u8>> {
        let spec = spec();
        (0..spec.num_regions())
            .map(|layer| common::block(&self.worker, &spec, layer, block))
            .collect()
    }

    /// Writes the KV of "computed" tokens into `block`: `seed`'s bytes in every region.
    fn compute(&self, block: usize, seed: usize) {
        let spec = spec();
        let reg = self.worker.kv_caches().unwrap();
        for layer in 0..spec.num_regions() {
            let len = spec.block_len(layer);
            let data: Vec<u8> = (0..len).map(|o| pattern(layer, seed, o) ^ 0x5a).collect();
            reg.write(layer, block * len, &data).unwrap();
        }
    }

    /// Poisons `blocks` (the engine freed them and may reuse them).
    fn poison(&self, blocks: &[usize]) {
        let spec = spec();
        let reg = self.worker.kv_caches().unwrap();
        for layer in 0..spec.num_regions() {
            let len = spec.block_len(layer);
            for &block in blocks {
                reg.write(layer, block * len, &vec![0xee; len]).unwrap();
            }
        }
    }

    /// This engine as a decode: request `id` loads `blocks` with `params`, and must load.
    async fn load(&mut self, id: &str, blocks: &[usize], params: &KvTransferParams) {
        self.scheduler.on_new_request(id, Some(params));
        self.scheduler
            .update_state_after_alloc(id, blocks, params)
            .unwrap();
        let outcome = self.load_ended(id).await;
        assert_eq!(
            outcome,
            LoadOutcome::Loaded {
                request_id: id.into()
            }
        );
    }

    /// Finishes request `id` in `blocks` after `tokens` computed tokens, `params` its own;
    /// the params handed on (to a decode, or back to a prefill).
    fn finish(
        &mut self,
        id: &str,
        blocks: &[usize],
        tokens: usize,
        params: Option<&KvTransferParams>,
    ) -> KvTransferParams {
        let done =
            self.scheduler
                .request_finished(id, blocks, tokens, params, FinishStatus::LengthCapped);
        assert!(done.delay_free_blocks, "request {id} keeps its blocks");
        self.step();
        done.kv_transfer_params.unwrap()
    }
}

fn for_decode() -> KvTransferParams {
    KvTransferParams {
        do_remote_decode: true,
        ..KvTransferParams::default()
    }
}

/// A prefill and a decode of `protocol`, both with `extra`, the prefill's cache filled.
fn pair(tag: &str, protocol: Protocol, extra: serde_json::Value) -> (Engine, Engine) {
    let kv = config(protocol, extra);
    let prefill = Engine::new(&format!("mt-p-{tag}"), &kv);
    common::fill(&prefill.worker, &spec());
    let decode = Engine::new(&format!("mt-d-{tag}"), &kv);
    (prefill, decode)
}

/// Turn 1 of a conversation: the prefill computes 12 tokens in blocks 1-3, the decode loads
/// them into 3 free blocks and computes 4 more in a fourth, then keeps them (poisoned and
/// freed when released); the kept params.
async fn turn_one(prefill: &mut Engine, decode: &mut Engine, id: &str) -> KvTransferParams {
    let params = prefill.finish(id, &[1, 2, 3], 12, Some(&for_decode()));
    decode.free.sort_unstable_by(|a, b| b.cmp(a));
    let blocks: Vec<usize> = (0..4)
        .map(|_| decode.free.pop().expect("a free block"))
        .collect();
    decode.load(id, &blocks[..3], &params).await;
    prefill.until_released(id).await;
    decode.compute(blocks[3], 800 + blocks[3]);
    decode.kept.insert(id.to_string(), blocks.clone());
    decode.finish(id, &blocks, 16, None)
}

async fn three_turns(protocol: Protocol) {
    let tag = format!("3t-{}", protocol.as_str());
    let (mut p, mut d) = pair(
        &tag,
        protocol,
        serde_json::json!({"kv_recompute_threshold": 0}),
    );
    let kept = turn_one(&mut p, &mut d, "c-1").await;
    assert!(kept.do_remote_decode && !kept.do_remote_prefill);
    assert_eq!(kept.remote_block_ids, [4, 5, 6, 7]);
    assert_eq!(kept.remote_num_tokens, Some(16));

    // Turn 2: 16 tokens of turn 1 and 4 new; the prefill's prefix cache still holds block 1
    // (4 tokens), so 12 are read back into its blocks 9-11, from the decode's 5-7.
    let read = p.scheduler.read_back_tokens(Some(&kept), 20, 4);
    assert_eq!(read, 12);
    p.load("c-2", &[9, 10, 11], &kept).await;
    let turn_one_blocks = [5, 6, 7].map(|b| d.block(b));
    for (local, far) in [(9, 5), (10, 6), (11, 7)] {
        assert_eq!(
            p.block(local),
            d.block(far),
            "turn 2: block {local} from {far}"
        );
    }
    // Released on the reader's word (and poisoned): what was read is what it held.
    d.until_released("c-1").await;
    assert_eq!(d.scheduler.kept_stats().kept_blocks, 0);
    assert_eq!([9, 10, 11].map(|b| p.block(b)), turn_one_blocks);
    // The engine would free turn 1's blocks to its prefix cache, unpoisoned.
    d.compute(4, 4);
    d.compute(5, 5);
    d.compute(6, 6);
    d.compute(7, 7);
    p.compute(12, 1200);
    let handed = p.finish("c-2", &[1, 9, 10, 11, 12], 20, Some(&kept));
    assert!(handed.do_remote_prefill && !handed.do_remote_decode);
    // The decode's prefix cache holds turn 1 (blocks 4-7): it loads only block 12.
    d.load("c-2", &[13], &handed).await;
    assert_eq!(d.block(13), p.block(12));
    p.until_released("c-2").await;
    d.compute(14, 1400);
    let kept = d.finish("c-2", &[4, 5, 6, 7, 13, 14], 24, None);

    // Turn 3: the prefill holds turn 2's 20 tokens; the decode's last block is read back.
    assert_eq!(p.scheduler.read_back_tokens(Some(&kept), 28, 20), 4);
    p.load("c-3", &[15], &kept).await;
    let answer = d.block(14);
    assert_eq!(p.block(15), answer, "turn 3: the decode's answer");
    assert_ne!(answer, vec![vec![0u8; spec().block_len(0)]; 3]);
    d.until_released("c-2").await;
    let stats = p.scheduler.kept_stats();
    assert_eq!(stats.read_backs, 2);
    assert_eq!(d.scheduler.kept_stats().kept_total, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_turn_conversation_reads_each_turn_back_byte_for_byte() {
    three_turns(Protocol::Native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg(feature = "vllm")]
async fn a_three_turn_conversation_reads_back_in_vllm_mode_too() {
    three_turns(Protocol::Vllm).await;
}

/// The groups of a hybrid model over the spec's blocks of 4 tokens, every region shared:
/// full attention, and a sliding window of 6 tokens (a group that needs only its last
/// blocks).
fn hybrid_groups() -> KvCacheGroups {
    let window = KvCacheGroupKind::SlidingWindow { window_tokens: 6 };
    KvCacheGroups::new(4, vec![KvCacheGroupKind::FullAttention, window]).unwrap()
}

/// Group `group`'s block ids in `params` (the lists follow one another, of
/// `remote_block_group_lens`).
fn group_ids(params: &KvTransferParams, group: usize) -> Vec<usize> {
    let lens = &params.remote_block_group_lens;
    let start: usize = lens[..group].iter().sum();
    params.remote_block_ids[start..start + lens[group]].to_vec()
}

/// Checks that the last `n` blocks of `local` on `to` hold the last `n` of `remote` on
/// `from` (a load pairs the tails of the two lists).
fn tails_equal(
    to: &Engine,
    local: &[usize],
    from: &Engine,
    remote: &[usize],
    n: usize,
    what: &str,
) {
    assert!(
        n <= local.len() && n <= remote.len(),
        "{what}: {n} of {local:?}, {remote:?}"
    );
    for (l, r) in local.iter().rev().zip(remote.iter().rev()).take(n) {
        assert_eq!(to.block(*l), from.block(*r), "{what}: block {l} from {r}");
    }
}

/// A hybrid model's conversation: turn 1 moves each group's blocks to the decode, which
/// keeps both groups' blocks; turn 2's prefill reads each group back (the full-attention
/// group every block its prefix cache lacks, the window group its last ones), byte for
/// byte, and the reader's notification releases the kept blocks.
async fn hybrid_read_back(protocol: Protocol) {
    let tag = format!("hy-{}", protocol.as_str());
    let mut kv = config(protocol, serde_json::json!({"kv_recompute_threshold": 0}));
    kv.kv_connector_extra_config.insert(
        KV_CACHE_GROUPS_KEY.into(),
        serde_json::to_value(hybrid_groups()).unwrap(),
    );
    let hybrid = |engine: Engine| Engine {
        scheduler: engine.scheduler.with_kv_cache_groups(hybrid_groups()),
        ..engine
    };
    let mut p = hybrid(Engine::new(&format!("mt-p-{tag}"), &kv));
    common::fill(&p.worker, &spec());
    let mut d = hybrid(Engine::new(&format!("mt-d-{tag}"), &kv));

    // Turn 1: 12 tokens in the prefill's blocks 1-3 (full) and 21-23 (window).
    let handed = p
        .scheduler
        .request_finished_all_groups(
            "h-1",
            &[vec![1, 2, 3], vec![21, 22, 23]],
            12,
            Some(&for_decode()),
            FinishStatus::LengthCapped,
        )
        .unwrap();
    assert!(handed.delay_free_blocks);
    p.step();
    let handed = handed.kv_transfer_params.unwrap();
    let turn_one = [vec![4, 5, 6], vec![14, 15, 16]];
    d.scheduler.on_new_request("h-1", Some(&handed));
    d.scheduler
        .update_state_after_alloc_groups("h-1", &turn_one, &handed)
        .unwrap();
    let loaded = LoadOutcome::Loaded {
        request_id: "h-1".into(),
    };
    assert_eq!(d.load_ended("h-1").await, loaded);
    p.until_released("h-1").await;
    tails_equal(
        &d,
        &turn_one[0],
        &p,
        &[1, 2, 3],
        3,
        "turn 1, full attention",
    );
    // The window's last 6 tokens (8-11) lie in the prompt's last two blocks.
    tails_equal(
        &d,
        &turn_one[1],
        &p,
        &group_ids(&handed, 1),
        2,
        "turn 1, window",
    );

    // The decode answers 4 tokens in a fourth block of each group and keeps both.
    d.compute(7, 700);
    d.compute(17, 1700);
    let answered = [vec![4, 5, 6, 7], vec![14, 15, 16, 17]];
    let done = d
        .scheduler
        .request_finished_all_groups("h-1", &answered, 16, None, FinishStatus::LengthCapped)
        .unwrap();
    assert!(done.delay_free_blocks);
    d.step();
    d.kept.insert("h-1".into(), answered.concat());
    let kept = done.kv_transfer_params.unwrap();
    assert!(kept.do_remote_decode && !kept.do_remote_prefill);
    assert_eq!(group_ids(&kept, 0), answered[0]);

    // Turn 2: 20 tokens; the prefill's prefix cache holds the first block, so 12 are read
    // back, into blocks 9-11 (full) and 29-31 (window).
    assert_eq!(p.scheduler.read_back_tokens(Some(&kept), 20, 4), 12);
    let turn_two = [vec![9, 10, 11], vec![29, 30, 31]];
    p.scheduler.on_new_request("h-2", Some(&kept));
    p.scheduler
        .update_state_after_alloc_groups("h-2", &turn_two, &kept)
        .unwrap();
    let loaded = LoadOutcome::Loaded {
        request_id: "h-2".into(),
    };
    assert_eq!(p.load_ended("h-2").await, loaded);
    tails_equal(
        &p,
        &turn_two[0],
        &d,
        &answered[0],
        3,
        "turn 2, full attention",
    );
    // The window at turn 2's end (tokens 10-15 of what was read) lies in its last two.
    tails_equal(
        &p,
        &turn_two[1],
        &d,
        &group_ids(&kept, 1),
        2,
        "turn 2, window",
    );
    let turn_two_bytes: Vec<_> = turn_two.concat().into_iter().map(|b| p.block(b)).collect();
    d.until_released("h-1").await;
    assert_eq!(d.scheduler.kept_stats().kept_blocks, 0);
    // Released (and poisoned) only after the read: what was read stays what it held.
    let after: Vec<_> = turn_two.concat().into_iter().map(|b| p.block(b)).collect();
    assert_eq!(after, turn_two_bytes);
    assert_eq!(p.scheduler.kept_stats().read_backs, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_models_read_back_reads_each_group_byte_for_byte() {
    hybrid_read_back(Protocol::Native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg(feature = "vllm")]
async fn a_hybrid_models_read_back_reads_each_group_in_vllm_mode_too() {
    hybrid_read_back(Protocol::Vllm).await;
}

/// A read-back whose kept blocks are gone (TTL `ttl` s, waited out) is not read: the
/// tokens are recomputed, whatever the failure policy, and nothing lands.
async fn expired(protocol: Protocol, ttl: f64, wait: Duration) {
    let tag = format!("ttl-{}", protocol.as_str());
    let extra = serde_json::json!({"decoder_kv_blocks_ttl": ttl, "kv_recompute_threshold": 0});
    let (mut p, mut d) = pair(&tag, protocol, extra);
    let kept = turn_one(&mut p, &mut d, "e-1").await;
    tokio::time::sleep(wait).await;
    d.step();
    let before = (p.block(20), p.block(21));
    p.scheduler.on_new_request("e-2", Some(&kept));
    p.scheduler
        .update_state_after_alloc("e-2", &[20, 21], &kept)
        .unwrap();
    match p.load_ended("e-2").await {
        LoadOutcome::Recompute {
            block_ids, reason, ..
        } => {
            assert_eq!(block_ids, [20, 21]);
            assert!(reason.contains("expired"), "{reason}");
        }
        other => panic!("an expired read-back must be recomputed: {other:?}"),
    }
    assert!((p.block(20), p.block(21)) == before, "nothing read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_kept_request_is_declined_and_recomputed() {
    // The decode released it at its TTL: the claim is not granted.
    expired(Protocol::Native, 0.2, Duration::from_millis(400)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg(feature = "vllm")]
async fn in_vllm_mode_a_read_back_near_its_expiry_time_is_declined() {
    // vLLM's safety margin is 5 s: a TTL of 3 s is declined at once.
    expired(Protocol::Vllm, 3.0, Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recompute_threshold_reads_64_tokens_and_tells_the_decode_of_63() {
    let (mut p, mut d) = pair("thr", Protocol::Native, serde_json::json!({}));
    // Turn 1 of 16 blocks (64 tokens) kept twice over.
    let blocks: Vec<usize> = (0..16).collect();
    for id in ["t-63", "t-64"] {
        let params = p.finish(id, &blocks, 64, Some(&for_decode()));
        let local: Vec<usize> = if id == "t-63" {
            (16..32).collect()
        } else {
            (24..40).collect()
        };
        d.load(id, &local, &params).await;
        p.until_released(id).await;
        let kept = d.finish(id, &local, 64, None);
        // Turn 2's prefill caches 1 token (63 to read) or none (64).
        let cached = usize::from(id == "t-63");
        let read = p.scheduler.read_back_tokens(Some(&kept), 70, cached);
        let second = format!("{id}-2");
        p.scheduler.on_new_request(&second, Some(&kept));
        if read == 0 {
            // Below the threshold: nothing read, the decode frees at once.
            p.scheduler
                .update_state_after_alloc(&second, &[], &kept)
                .unwrap();
            p.step();
            d.until_released(id).await;
            assert_eq!(d.worker.send_stats().freed_on_timeout, 0);
        } else {
            assert_eq!(read, 64);
            p.scheduler
                .update_state_after_alloc(&second, &(16..32).collect::<Vec<_>>(), &kept)
                .unwrap();
            assert!(matches!(
                p.load_ended(&second).await,
                LoadOutcome::Loaded { .. }
            ));
            d.until_released(id).await;
        }
    }
    let stats = p.scheduler.kept_stats();
    assert_eq!((stats.below_threshold, stats.read_backs), (1, 1));
}

/// The decode's half of turn 1 before it keeps: the prefill computes 12 tokens in blocks
/// 1-3 and the decode loads them into 3 free blocks and computes 4 more in a fourth; its
/// blocks.
async fn load_turn_one(prefill: &mut Engine, decode: &mut Engine, id: &str) -> Vec<usize> {
    let params = prefill.finish(id, &[1, 2, 3], 12, Some(&for_decode()));
    decode.free.sort_unstable_by(|a, b| b.cmp(a));
    let blocks: Vec<usize> = (0..4)
        .map(|_| decode.free.pop().expect("a free block"))
        .collect();
    decode.load(id, &blocks[..3], &params).await;
    prefill.until_released(id).await;
    decode.compute(blocks[3], 800 + blocks[3]);
    blocks
}

/// Starts the prefill's read-back of `kept` as request `reader` into blocks 20-22.
fn start_read_back(p: &mut Engine, reader: &str, kept: &KvTransferParams) {
    p.scheduler.on_new_request(reader, Some(kept));
    p.scheduler
        .update_state_after_alloc(reader, &[20, 21, 22], kept)
        .unwrap();
    p.step();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_evicts_the_oldest_kept_never_one_being_read_back() {
    // A cap of 4 blocks: one kept request. Each round the prefill reads back the last
    // round's request while the decode keeps a new one, over the cap, which evicts the
    // oldest unless the read-back claimed it first: the read-back starts well before the
    // keep, at the same time, or after it. Every block the decode releases is poisoned at
    // once: a read-back reported loaded must hold what was kept.
    let extra = serde_json::json!({"decoder_kv_blocks_cap": 4, "kv_recompute_threshold": 0});
    let (mut p, mut d) = pair("cap", Protocol::Native, extra);
    let mut last = turn_one(&mut p, &mut d, "k-0").await;
    let (mut loaded, mut recomputed) = (0, 0);
    for round in 1..=12 {
        let want: Vec<_> = last.remote_block_ids[1..]
            .iter()
            .map(|&b| d.block(b))
            .collect();
        let (reader, id) = (format!("k-{}-2", round - 1), format!("k-{round}"));
        let blocks = load_turn_one(&mut p, &mut d, &id).await;
        d.kept.insert(id.clone(), blocks.clone());
        let keep = |d: &mut Engine| d.finish(&id, &blocks, 16, None);
        last = match round % 3 {
            0 => {
                start_read_back(&mut p, &reader, &last);
                tokio::time::sleep(Duration::from_millis(50)).await;
                keep(&mut d)
            }
            1 => {
                let kept = keep(&mut d);
                start_read_back(&mut p, &reader, &last);
                kept
            }
            _ => {
                start_read_back(&mut p, &reader, &last);
                keep(&mut d)
            }
        };
        match p.load_ended(&reader).await {
            LoadOutcome::Loaded { .. } => {
                loaded += 1;
                let got = [20, 21, 22].map(|b| p.block(b)).to_vec();
                assert!(
                    got == want,
                    "round {round}: the read-back holds what was kept"
                );
            }
            LoadOutcome::Recompute { reason, .. } => {
                recomputed += 1;
                assert!(reason.contains("no longer keeps"), "{reason}");
            }
            other => panic!("round {round}: {other:?}"),
        }
        p.poison(&[20, 21, 22]);
        d.step();
    }
    let stats = d.scheduler.kept_stats();
    let evicted = d.worker.send_stats().freed_on_eviction;
    tracing::info!(loaded, recomputed, evicted, ?stats, "cap rounds");
    assert_eq!(loaded + recomputed, 12);
    assert!(
        loaded >= 4 && recomputed >= 4,
        "both sides of the race: {loaded} loaded, {recomputed} recomputed"
    );
    assert_eq!(
        recomputed as u64, evicted,
        "a read-back fails only when evicted first"
    );
    assert!(
        stats.kept_blocks <= 8,
        "the cap and at most one claimed: {stats:?}"
    );
}

/// An engine of TP `side.tp` in this process (native protocol), read-backs on.
#[cfg(feature = "vllm")]
struct Ranks {
    workers: Vec<KvConnectorWorker>,
    scheduler: KvConnectorScheduler,
    released: Vec<String>,
    outcomes: Vec<LoadOutcome>,
}

#[cfg(feature = "vllm")]
impl Ranks {
    fn new(id: &str, model: &common::geometry::Model, side: &common::geometry::Side) -> Ranks {
        let workers = common::geometry::engine(id, model, side);
        let port = workers[0].side_channel_addr().unwrap().port();
        let kv = config(
            Protocol::Native,
            serde_json::json!({"kv_recompute_threshold": 0}),
        );
        let config = SchedulerConfig::new(id, "127.0.0.1", port, side.tp, &kv).unwrap();
        Ranks {
            workers,
            scheduler: KvConnectorScheduler::new(config),
            released: Vec::new(),
            outcomes: Vec::new(),
        }
    }

    fn step(&mut self) {
        let meta = self.scheduler.build_connector_meta();
        for worker in &self.workers {
            worker.start_load_kv(&meta);
        }
        let outputs: Vec<_> = self.workers.iter().map(KvConnectorWorker::output).collect();
        let out = self.scheduler.update_connector_output(&outputs).unwrap();
        self.released.extend(out.finished_sending);
        self.outcomes.extend(out.load_outcomes);
    }

    /// Steps until `done` holds.
    async fn until(&mut self, what: &str, done: impl Fn(&Ranks) -> bool) {
        let start = Instant::now();
        while !done(self) {
            self.step();
            assert!(start.elapsed() < WAIT, "waited in vain for {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Every rank's bytes of `block`, region 0.
    fn block(&self, spec: &KvCacheSpec, block: usize) -> Vec<Vec<u8>> {
        let workers = self.workers.iter();
        workers.map(|w| common::block(w, spec, 0, block)).collect()
    }
}

/// Turn 1 from a prefill of TP `p_tp` to a decode of TP `d_tp` whose blocks hold
/// `d_block_size` tokens (the prefill's 4), kept there; turn 2's read-back brings the same
/// bytes back into other prefill blocks, each prefill rank its heads from the decode ranks
/// holding them.
#[cfg(feature = "vllm")]
async fn read_back_across_tp(p_tp: usize, d_tp: usize, d_block_size: usize) {
    use common::geometry::{Model, Side};
    let model = Model {
        attention: KvAttention::Mha { total_kv_heads: 4 },
        layout: KvLayout::Hnd,
        regions: vec![(nixl_connector::KvRegionKind::Tensor, 16)],
    };
    let side = |tp, block_size| Side {
        tp,
        block_size,
        num_blocks: 16,
    };
    let (p_side, d_side) = (side(p_tp, 4), side(d_tp, d_block_size));
    let tag = format!("{p_tp}{d_tp}{d_block_size}");
    let mut p = Ranks::new(&format!("mt-tp-p{tag}"), &model, &p_side);
    for (rank, worker) in p.workers.iter().enumerate() {
        model.fill_prefill(worker, &p_side, rank);
    }
    let mut d = Ranks::new(&format!("mt-tp-d{tag}"), &model, &d_side);
    // The decode's blocks for the prompt's 12 tokens.
    let d_blocks: Vec<usize> = (5..).take(12_usize.div_ceil(d_block_size)).collect();
    let for_decode = for_decode();
    let done = p.scheduler.request_finished(
        "c",
        &[1, 2, 3],
        12,
        Some(&for_decode),
        FinishStatus::Stopped,
    );
    p.step();
    let params = done.kv_transfer_params.unwrap();
    d.scheduler.on_new_request("c", Some(&params));
    d.scheduler
        .update_state_after_alloc("c", &d_blocks, &params)
        .unwrap();
    d.until("turn 1 loaded", |d| !d.outcomes.is_empty()).await;
    assert_eq!(
        d.outcomes,
        [LoadOutcome::Loaded {
            request_id: "c".into()
        }]
    );
    p.until("turn 1 released", |p| p.released == ["c"]).await;
    let kept = d
        .scheduler
        .request_finished("c", &d_blocks, 12, None, FinishStatus::Stopped)
        .kv_transfer_params
        .unwrap();
    d.step();
    assert_eq!(kept.remote_tp_size, Some(d_tp));
    p.scheduler.on_new_request("c-2", Some(&kept));
    p.scheduler
        .update_state_after_alloc("c-2", &[9, 10, 11], &kept)
        .unwrap();
    p.until("the read-back", |p| !p.outcomes.is_empty()).await;
    assert_eq!(
        p.outcomes,
        [LoadOutcome::Loaded {
            request_id: "c-2".into()
        }]
    );
    let spec = model.spec(&p_side);
    for (back, first) in [(9, 1), (10, 2), (11, 3)] {
        assert_eq!(
            p.block(&spec, back),
            p.block(&spec, first),
            "TP {p_tp} <- {d_tp}, blocks of {d_block_size} tokens"
        );
    }
    d.until("the kept request released by its reader", |d| {
        d.released == ["c"]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg(feature = "vllm")]
async fn a_read_back_crosses_tp_sizes_both_ways_and_block_sizes() {
    read_back_across_tp(1, 2, 4).await;
    read_back_across_tp(2, 1, 4).await;
    read_back_across_tp(1, 1, 8).await;
}

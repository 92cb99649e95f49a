//! The two engines of a case: the prefill (a child process running the role test) and the
//! decode (the test itself).

use std::time::{Duration, Instant};

use kv_model::{argmax, greedy, PagedKv, PagedLayout};
use nixl_connector::{FinishStatus, KvCacheSpec, KvConnectorWorker, KvTransferParams, LoadOutcome};

use super::engine::{engine, scheduler};
use super::prefill_child::PrefillChild;
use super::{assert_logits_close, model, num_blocks, reference, scattered, Scenario, Side, STEPS};
use crate::common::after_tag;

/// The variable that hands the prefill role its [`Scenario`] (JSON).
const SCENARIO_ENV: &str = "KV_MODEL_SCENARIO";

/// A guard against hangs only.
const WAIT: Duration = Duration::from_secs(60);

/// The request's id on the prefill and on the decode.
const PREFILL_REQUEST: &str = "model-prefill-req";
const DECODE_REQUEST: &str = "model-decode-req";

/// The spec every rank of `side` registers.
fn spec(scenario: &Scenario, side: &Side) -> KvCacheSpec {
    let model = model(scenario);
    PagedLayout::spec(
        model.config(),
        scenario.packing(),
        scenario.group_regions(),
        scenario.layout(),
        side.block_size,
        num_blocks(scenario, side.block_size),
        side.tp,
    )
}

/// Each rank's paged view of its own registered regions, through `block_tables` (one per
/// KV cache group).
fn paged<'a>(
    scenario: &Scenario,
    spec: &KvCacheSpec,
    ranks: &'a [KvConnectorWorker],
    block_tables: &[Vec<usize>],
) -> Vec<PagedKv<&'a nixl::Registration>> {
    let model = model(scenario);
    ranks
        .iter()
        .enumerate()
        .map(|(rank, worker)| {
            let layout = PagedLayout::new(
                model.config(),
                spec,
                scenario.packing(),
                scenario.group_regions(),
                rank,
                ranks.len(),
            )
            .unwrap();
            PagedKv::new(layout, worker.kv_caches().unwrap(), block_tables.to_vec())
        })
        .collect()
}

/// The prefill engine of the scenario in [`SCENARIO_ENV`]: computes the prompt into its
/// blocks, prints the last logits (`LOGITS`) and the params for the decode (`PARAMS`),
/// and waits until the decode's read releases the blocks (`RELEASED`).
pub async fn prefill_role() {
    let scenario: Scenario =
        serde_json::from_str(&std::env::var(SCENARIO_ENV).expect("run by a model test")).unwrap();
    let model = model(&scenario);
    let side = scenario.prefill;
    let spec = spec(&scenario, &side);
    let ranks = engine(&scenario, "model-prefill", &spec, side.tp);
    let blocks = scattered(
        model.config().kv_cache_groups(),
        scenario.prompt_len.div_ceil(side.block_size),
        spec.num_blocks,
    );
    let mut caches = paged(&scenario, &spec, &ranks, &blocks);
    let logits = model.prefill(&scenario.prompt(model.config().vocab), &mut caches);
    drop(caches);

    let mut scheduler = scheduler(&scenario, "model-prefill", side.block_size, &ranks);
    let asked = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    // Each group's blocks, a sliding window's clipped to its last.
    let finished = scheduler
        .request_finished_all_groups(
            PREFILL_REQUEST,
            &blocks,
            scenario.prompt_len,
            Some(&asked),
            FinishStatus::LengthCapped,
        )
        .unwrap();
    scheduler.step(&ranks).unwrap();
    let params = finished.kv_transfer_params.expect("params for the decode");
    let params = if scenario.vllm {
        params.to_vllm_json()
    } else {
        serde_json::to_string(&params).unwrap()
    };
    println!("LOGITS {}", serde_json::to_string(&logits).unwrap());
    println!("PARAMS {params}");

    let start = Instant::now();
    while !scheduler
        .step(&ranks)
        .unwrap()
        .finished_sending
        .iter()
        .any(|r| r == PREFILL_REQUEST)
    {
        assert!(start.elapsed() < WAIT, "no decode released the request");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    println!("RELEASED");
}

/// Runs the prefill role `role` of this test binary for `scenario` in a child process,
/// loads its blocks into this process's decode engine, generates [`STEPS`] tokens and
/// compares every token and logit with one process's run.
pub async fn decode_against_prefill(scenario: &Scenario, role: &str) {
    println!("case: {scenario:?}");
    let json = serde_json::to_string(scenario).unwrap();
    let (mut child, mut lines) = PrefillChild::start(role, &[(SCENARIO_ENV, &json)]);
    let (printed, mut lines) = tokio::task::spawn_blocking(move || {
        let logits = after_tag(&mut lines, "LOGITS ");
        let params = after_tag(&mut lines, "PARAMS ");
        (logits.zip(params), lines)
    })
    .await
    .unwrap();
    let Some((prefill_logits, params)) = printed else {
        child.fail("the prefill did not print its logits and params");
    };
    let prefill_logits: Vec<f32> = serde_json::from_str(&prefill_logits).unwrap();
    let params = if scenario.vllm {
        KvTransferParams::from_vllm_json(&params).unwrap()
    } else {
        serde_json::from_str(&params).unwrap()
    };

    let (want_logits, want) = reference(scenario);
    assert_logits_close("the prefill's last logits", &prefill_logits, &want_logits);
    let first = argmax(&prefill_logits);
    assert_eq!(first, argmax(&want_logits), "the prefill's token");

    let model = model(scenario);
    let side = scenario.decode;
    let spec = spec(scenario, &side);
    let ranks = engine(scenario, "model-decode", &spec, side.tp);
    let tables = scattered(
        model.config().kv_cache_groups(),
        (scenario.prompt_len + STEPS).div_ceil(side.block_size),
        spec.num_blocks,
    );
    let mut caches = paged(scenario, &spec, &ranks, &tables);
    let prompt = scenario.prompt(model.config().vocab);
    // The prefix cache's blocks: computed here.
    for (position, &token) in prompt
        .iter()
        .enumerate()
        .take(scenario.prefix_blocks * side.block_size)
    {
        model.forward(token, position, &mut caches);
    }
    // Each group's blocks the prompt fills past the prefix hit (a sliding window's clipped
    // to its last by the scheduler).
    let prompt_blocks = scenario.prefix_blocks..scenario.prompt_len.div_ceil(side.block_size);
    let local: Vec<&[usize]> = tables.iter().map(|t| &t[prompt_blocks.clone()]).collect();
    let mut decode_scheduler = scheduler(scenario, "model-decode", side.block_size, &ranks);
    decode_scheduler.on_new_request(DECODE_REQUEST, Some(&params));
    decode_scheduler
        .update_state_after_alloc_groups(DECODE_REQUEST, &local, &params)
        .unwrap();
    let start = Instant::now();
    loop {
        let mut output = decode_scheduler.step(&ranks).unwrap();
        match output.load_outcomes.pop() {
            Some(LoadOutcome::Loaded { .. }) => break,
            Some(other) => panic!("the load failed: {other:?}"),
            None => assert!(start.elapsed() < WAIT, "the load did not end"),
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let got = greedy(&model, first, scenario.prompt_len, STEPS, &mut caches);
    assert_eq!(got.tokens, want.tokens, "the decode's tokens");
    for (step, (g, w)) in got.logits.iter().zip(&want.logits).enumerate() {
        assert_logits_close(&format!("decode step {step}"), g, w);
    }

    // Read to the end: the child's last lines (libtest's) must not meet a closed pipe.
    let released = tokio::task::spawn_blocking(move || {
        let released = after_tag(&mut lines, "RELEASED");
        lines.for_each(drop);
        released
    })
    .await
    .unwrap();
    if released.is_none() {
        child.fail("the prefill did not release the request");
    }
    child.wait_success();
}

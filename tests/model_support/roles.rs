//! The two engines of a case: the prefill (a child process running the role test) and the
//! decode (the test itself).

use std::time::Duration;

use kv_model::argmax;
use nixl_rs::model_serving::scenario::reference;
use nixl_rs::model_serving::serving::{DecodeEngine, PrefillEngine};

use super::prefill_child::PrefillChild;
use super::{assert_logits_close, Scenario};
use crate::common::after_tag;

/// The variable that hands the prefill role its [`Scenario`] (JSON).
const SCENARIO_ENV: &str = "KV_MODEL_SCENARIO";

/// A guard against hangs only.
const WAIT: Duration = Duration::from_secs(60);

/// The prefill engine of the scenario in [`SCENARIO_ENV`]: computes the prompt into its
/// blocks, prints the last logits (`LOGITS`) and the params for the decode (`PARAMS`),
/// and waits until the decode's read releases the blocks (`RELEASED`).
pub async fn prefill_role() {
    let scenario: Scenario =
        serde_json::from_str(&std::env::var(SCENARIO_ENV).expect("run by a model test")).unwrap();
    let prefill = PrefillEngine::new(&scenario);
    let logits = prefill.compute();
    let (params, mut scheduler) = prefill.finish();
    println!("LOGITS {}", serde_json::to_string(&logits).unwrap());
    println!("PARAMS {params}");
    assert!(
        prefill.released(&mut scheduler, WAIT).await,
        "no decode released the request"
    );
    println!("RELEASED");
}

/// Runs the prefill role `role` of this test binary for `scenario` in a child process,
/// loads its blocks into this process's decode engine, generates the scenario's tokens and
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

    let (want_logits, want) = reference(scenario);
    assert_logits_close("the prefill's last logits", &prefill_logits, &want_logits);
    let first = argmax(&prefill_logits);
    assert_eq!(first, argmax(&want_logits), "the prefill's token");

    let mut decode = DecodeEngine::new(scenario, "model-decode");
    decode.compute_prompt(scenario.prefix_blocks * scenario.decode.block_size);
    if let Err(err) = decode.load(&params, WAIT).await {
        panic!("{err}");
    }
    let got = decode.generate(first, scenario.prompt_len, scenario.steps);
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

//! A two-turn conversation, both engines in this process: the first turn served prefill →
//! decode as the other cases; the decode keeps its KV (the prompt and the answer); the
//! second turn's prefill (the same engine) reads back what its prefix cache lacks and
//! computes only the rest, and the decode, loading only what its own prefix cache lacks,
//! generates the second answer. Both turns' tokens equal one process's, every logit within
//! `TOLERANCE`.

use std::time::Duration;

use kv_model::{argmax, Generation};
use nixl_rs::model_serving::read_back::PREFILL_HIT_BLOCKS;
use nixl_rs::model_serving::scenario::{model, reference, reference_over};
use nixl_rs::model_serving::serving::{DecodeEngine, PrefillEngine};

use super::{assert_logits_close, Scenario};

/// A guard against hangs only.
const WAIT: Duration = Duration::from_secs(60);

/// Panics unless `got` has `want`'s tokens and every logit within `TOLERANCE` of `want`'s.
fn assert_generation(turn: &str, got: &Generation, want: &Generation) {
    assert_eq!(got.tokens, want.tokens, "{turn}: the decode's tokens");
    for (step, (g, w)) in got.logits.iter().zip(&want.logits).enumerate() {
        assert_logits_close(&format!("{turn}: decode step {step}"), g, w);
    }
}

/// Serves `scenario`'s two turns (it has a [`second_turn`](Scenario::second_turn)) and
/// compares each with one process's run over its whole prompt.
pub async fn two_turns(scenario: &Scenario) {
    println!("conversation: {scenario:?}");
    let mut prefill = PrefillEngine::new(scenario);
    let mut decode = DecodeEngine::new(scenario, "model-decode");

    // Turn 1, as the other cases.
    let (want_logits, want) = reference(scenario);
    let logits = prefill.compute();
    assert_logits_close("turn 1: the prefill's last logits", &logits, &want_logits);
    let first = argmax(&logits);
    let (params, mut scheduler) = prefill.finish();
    decode.load(&params, WAIT).await.unwrap();
    assert!(
        prefill.released(&mut scheduler, WAIT).await,
        "turn 1 released"
    );
    let got = decode.generate(first, scenario.prompt_len, scenario.steps);
    assert_generation("turn 1", &got, &want);
    let kept = decode.keep().unwrap();

    // Turn 2: the prompt, its answer and new tokens; the prefill holds its first block.
    let answer: Vec<usize> = std::iter::once(first).chain(got.tokens).collect();
    let prompt = scenario.second_prompt(model(scenario).config().vocab, &answer);
    let (want_logits, want) = reference_over(scenario, &prompt);
    let (logits, read) = prefill
        .read_back(&mut scheduler, &kept, &prompt, WAIT)
        .await
        .unwrap();
    let hit = PREFILL_HIT_BLOCKS * scenario.prefill.block_size;
    assert_eq!(
        read,
        scenario.prompt_len + scenario.steps - hit,
        "turn 2: every token the decode computed past the prefill's hit is read back"
    );
    assert_logits_close("turn 2: the prefill's last logits", &logits, &want_logits);
    assert_eq!(
        scheduler.kept_stats().read_backs,
        1,
        "turn 2: one read-back"
    );
    assert!(
        decode.kept_released(WAIT).await,
        "the read-back released turn 1"
    );

    let first = argmax(&logits);
    let params = prefill.finish_second_turn(&mut scheduler, &kept).unwrap();
    let loaded = decode.load_second_turn(&params, WAIT).await.unwrap();
    let full = (scenario.prompt_len + scenario.steps) / scenario.decode.block_size;
    assert_eq!(
        loaded,
        prompt.len().div_ceil(scenario.decode.block_size) - full,
        "turn 2: the decode loads only what its prefix cache lacks"
    );
    assert!(
        prefill.second_turn_released(&mut scheduler, WAIT).await,
        "turn 2 released"
    );
    let got = decode.generate(first, prompt.len(), scenario.steps);
    assert_generation("turn 2", &got, &want);
}

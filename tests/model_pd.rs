//! A small transformer served prefill → decode through the connector over real NIXL, the
//! prefill in a child process: the decode's tokens equal one process's, and every logit
//! lies within 1e-4 of it (see `model_support`).

mod common;
mod model_support;

use model_support::{decode_against_prefill, Scenario};

/// The prefill engine of a case, which the case starts in a child process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill engine of the model tests, which start it"]
async fn prefill_role() {
    model_support::prefill_role().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp1_to_tp1_native() {
    decode_against_prefill(&Scenario::tp1(false), "prefill_role").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp1_to_tp1_vllm() {
    decode_against_prefill(&Scenario::tp1(true), "prefill_role").await;
}

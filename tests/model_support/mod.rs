//! Prefill → decode with a real model (`kv-model`) as the oracle (`nixl_rs::model_serving`):
//! the prefill engine runs in a child process, the decode engine in this one; the decode's
//! tokens (the scenario's steps) must equal one process's run of the same model over a contiguous cache,
//! and every logit must lie within `TOLERANCE` of it. A conversation's two turns
//! (`conversation`) run both engines in this process.

mod conversation;
mod prefill_child;
mod roles;

pub use conversation::two_turns;
pub use nixl_rs::model_serving::scenario::{Layout, Packing, Scenario};
pub use roles::{decode_against_prefill, prefill_role};

use nixl_rs::model_serving::scenario::logits_close;

/// Panics unless every logit of `got` lies within `TOLERANCE` of `want`'s.
pub fn assert_logits_close(what: &str, got: &[f32], want: &[f32]) {
    if let Err(err) = logits_close(got, want) {
        panic!("{what}: {err}");
    }
}

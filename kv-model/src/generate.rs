//! Greedy decoding.

use crate::kv_cache::KvCache;
use crate::model::Model;

/// What a greedy run produced: each step's token and the logits it was chosen from.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The tokens, in order.
    pub tokens: Vec<usize>,
    /// Each token's logits.
    pub logits: Vec<Vec<f32>>,
}

/// The index of the largest logit (the first, on a tie).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best
}

/// Generates `steps` tokens greedily: feeds `token` at `position` (every earlier position's
/// K and V in `ranks`), takes the largest logit as the next token, feeds it at the next
/// position, and so on.
pub fn greedy<C: KvCache>(
    model: &Model,
    token: usize,
    position: usize,
    steps: usize,
    ranks: &mut [C],
) -> Generation {
    let mut out = Generation {
        tokens: Vec::with_capacity(steps),
        logits: Vec::with_capacity(steps),
    };
    let mut token = token;
    for step in 0..steps {
        let logits = model.forward(token, position + step, ranks);
        token = argmax(&logits);
        out.tokens.push(token);
        out.logits.push(logits);
    }
    out
}

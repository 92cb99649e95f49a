//! Where attention keeps each token's K and V: one rank's share of the KV heads.

use std::ops::Range;

/// One rank's K and V of every layer, position and KV head it holds.
pub trait KvCache {
    /// The model-wide KV heads it holds.
    fn heads(&self) -> Range<usize>;

    /// Stores model-wide KV head `head`'s `key` and `value` of the token at `position` in
    /// layer `layer`.
    fn store(&mut self, layer: usize, head: usize, position: usize, key: &[f32], value: &[f32]);

    /// Loads what [`store`](Self::store) stored (or a transfer put) at the same place into
    /// `key` and `value`.
    fn load(&self, layer: usize, head: usize, position: usize, key: &mut [f32], value: &mut [f32]);
}

/// The model-wide KV heads rank `rank` of TP `tp` holds, of `kv_heads`: `kv_heads / tp`
/// consecutive heads, or the one head `rank * kv_heads / tp` when TP is larger (replicated
/// heads).
pub fn kv_heads_of_rank(kv_heads: usize, rank: usize, tp: usize) -> Range<usize> {
    if tp <= kv_heads {
        let per_rank = kv_heads / tp;
        rank * per_rank..(rank + 1) * per_rank
    } else {
        let head = rank * kv_heads / tp;
        head..head + 1
    }
}

//! The forward pass of one token: attention split over an engine's TP ranks, each reading
//! its own KV cache, their outputs summed; the MLP and output head whole.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::kv_cache::{kv_heads_of_rank, KvCache};
use crate::ops::{dot, matvec, matvec_cols, matvec_rows, rms_norm, rope, silu, softmax};
use crate::weights::{LayerWeights, Weights};

/// A transformer: its dimensions and weights.
#[derive(Debug, Clone)]
pub struct Model {
    config: ModelConfig,
    weights: Weights,
}

impl Model {
    /// The model of `config` with the weights drawn from `seed`.
    ///
    /// # Panics
    /// If `config` has a latent and more than one KV head.
    pub fn seeded(config: ModelConfig, seed: u64) -> Self {
        assert!(
            config.latent_dim.is_none() || config.kv_heads == 1,
            "an MLA-like model caches its latent as its one KV head"
        );
        Model {
            weights: Weights::seeded(&config, seed),
            config,
        }
    }

    /// Its dimensions.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Runs `token` at `position` through the model, storing its K and V in `ranks` (rank
    /// `r` of TP `ranks.len()` holding the KV heads [`kv_heads_of_rank`] gives it), and
    /// returns the logits of the next token. Positions before `position` must be in the
    /// caches.
    ///
    /// # Panics
    /// If a rank's cache holds other heads than its rank's, or TP does not split the query
    /// heads evenly.
    pub fn forward<C: KvCache>(&self, token: usize, position: usize, ranks: &mut [C]) -> Vec<f32> {
        let c = &self.config;
        let tp = ranks.len();
        assert!(
            tp > 0 && c.q_heads % tp == 0,
            "TP {tp} must split {} query heads evenly",
            c.q_heads
        );
        for (rank, cache) in ranks.iter().enumerate() {
            assert_eq!(
                cache.heads(),
                kv_heads_of_rank(c.kv_heads, rank, tp),
                "KV heads of rank {rank} of TP {tp}"
            );
        }
        let mut x = self.weights.embedding.row(token).to_vec();
        for (layer, w) in self.weights.layers.iter().enumerate() {
            let normed = rms_norm(&x, &w.attention_norm, c.norm_eps);
            for (rank, cache) in ranks.iter_mut().enumerate() {
                let q_heads = rank * c.q_heads / tp..(rank + 1) * c.q_heads / tp;
                let out = self.attention(w, layer, position, &normed, q_heads, cache);
                for (xi, oi) in x.iter_mut().zip(out) {
                    *xi += oi;
                }
            }
            let normed = rms_norm(&x, &w.mlp_norm, c.norm_eps);
            let gate = matvec(&w.w_gate, &normed);
            let up = matvec(&w.w_up, &normed);
            let inner: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
            for (xi, oi) in x.iter_mut().zip(matvec(&w.w_down, &inner)) {
                *xi += oi;
            }
        }
        let normed = rms_norm(&x, &self.weights.final_norm, c.norm_eps);
        matvec(&self.weights.lm_head, &normed)
    }

    /// Runs every token of `prompt` from position 0 ([`forward`](Self::forward)) and returns
    /// the logits after its last.
    ///
    /// # Panics
    /// If `prompt` is empty, or as [`forward`](Self::forward).
    pub fn prefill<C: KvCache>(&self, prompt: &[usize], ranks: &mut [C]) -> Vec<f32> {
        assert!(!prompt.is_empty(), "an empty prompt has no logits");
        let mut logits = Vec::new();
        for (position, &token) in prompt.iter().enumerate() {
            logits = self.forward(token, position, ranks);
        }
        logits
    }

    /// One rank's attention output (its query heads `q_heads`, projected by their columns
    /// of the output matrix): stores the token's K and V of the rank's KV heads, then
    /// attends over positions `first..=position` ([`ModelConfig::first_attended`]).
    fn attention<C: KvCache>(
        &self,
        w: &LayerWeights,
        layer: usize,
        position: usize,
        normed: &[f32],
        q_heads: Range<usize>,
        cache: &mut C,
    ) -> Vec<f32> {
        let c = &self.config;
        let dh = c.head_dim;
        if w.latent_up.is_some() {
            cache.store(layer, 0, position, &matvec(&w.wk, normed), &[]);
        } else {
            for head in cache.heads() {
                let mut key = matvec_rows(&w.wk, head * dh..(head + 1) * dh, normed);
                rope(&mut key, position, c.rope_theta);
                let value = matvec_rows(&w.wv, head * dh..(head + 1) * dh, normed);
                cache.store(layer, head, position, &key, &value);
            }
        }
        let scale = 1.0 / (dh as f32).sqrt();
        let mut heads_out = vec![0.0; q_heads.len() * dh];
        for (slot, q_head) in q_heads.clone().enumerate() {
            let mut query = matvec_rows(&w.wq, q_head * dh..(q_head + 1) * dh, normed);
            rope(&mut query, position, c.rope_theta);
            let kv_head = q_head / c.group_size();
            let first = c.first_attended(layer, position);
            let mut scores = Vec::with_capacity(position + 1 - first);
            let mut seen_values = Vec::with_capacity((position + 1 - first) * dh);
            for p in first..=position {
                let (key, value) = self.key_value(w, cache, layer, (q_head, kv_head), p);
                scores.push(dot(&query, &key) * scale);
                seen_values.extend_from_slice(&value);
            }
            softmax(&mut scores);
            let out = &mut heads_out[slot * dh..(slot + 1) * dh];
            for (weight, value) in scores.iter().zip(seen_values.chunks_exact(dh)) {
                for (o, v) in out.iter_mut().zip(value) {
                    *o += weight * v;
                }
            }
        }
        matvec_cols(&w.wo, q_heads.start * dh..q_heads.end * dh, &heads_out)
    }

    /// The K and V that query head `q_head` (of KV head `kv_head`) reads at `position`: the
    /// cached ones, or with a latent the up-projections of the cached latent, K rotated.
    fn key_value<C: KvCache>(
        &self,
        w: &LayerWeights,
        cache: &C,
        layer: usize,
        (q_head, kv_head): (usize, usize),
        position: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let dh = c.head_dim;
        let mut cached = vec![0.0; c.cached_dim()];
        let Some(up) = &w.latent_up else {
            let mut value = vec![0.0; dh];
            cache.load(layer, kv_head, position, &mut cached, &mut value);
            return (cached, value);
        };
        cache.load(layer, 0, position, &mut cached, &mut []);
        let rows = q_head * dh..(q_head + 1) * dh;
        let mut key = matvec_rows(&up.k, rows.clone(), &cached);
        rope(&mut key, position, c.rope_theta);
        (key, matvec_rows(&up.v, rows, &cached))
    }
}

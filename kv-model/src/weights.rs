//! The model's weights, drawn from a seed.

use crate::config::ModelConfig;
use crate::seeded::SplitMix64;

/// A row-major matrix: `rows` rows of `cols` elements.
#[derive(Debug, Clone)]
pub(crate) struct Matrix {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) data: Vec<f32>,
}

impl Matrix {
    /// A matrix of elements uniform in `±sqrt(3 / cols)`: unit variance out of a unit-variance
    /// input.
    fn seeded(rows: usize, cols: usize, rng: &mut SplitMix64) -> Self {
        let scale = (3.0 / cols as f32).sqrt();
        Matrix {
            rows,
            cols,
            data: (0..rows * cols).map(|_| rng.symmetric() * scale).collect(),
        }
    }

    /// Row `row`.
    pub(crate) fn row(&self, row: usize) -> &[f32] {
        &self.data[row * self.cols..(row + 1) * self.cols]
    }
}

/// RMSNorm gains near 1.
fn norm_gains(len: usize, rng: &mut SplitMix64) -> Vec<f32> {
    (0..len).map(|_| 1.0 + 0.1 * rng.symmetric()).collect()
}

/// One decoder layer's weights.
#[derive(Debug, Clone)]
pub(crate) struct LayerWeights {
    pub(crate) attention_norm: Vec<f32>,
    /// `q_heads × head_dim` rows.
    pub(crate) wq: Matrix,
    /// `kv_heads × head_dim` rows; with a latent, its `latent_dim` rows (the down-projection).
    pub(crate) wk: Matrix,
    /// `kv_heads × head_dim` rows; none with a latent.
    pub(crate) wv: Matrix,
    /// With a latent: the up-projections of K and V.
    pub(crate) latent_up: Option<LatentUp>,
    /// `hidden` rows of `q_heads × head_dim`.
    pub(crate) wo: Matrix,
    pub(crate) mlp_norm: Vec<f32>,
    pub(crate) w_gate: Matrix,
    pub(crate) w_up: Matrix,
    pub(crate) w_down: Matrix,
}

/// The up-projections of an MLA-like layer's latent: `q_heads × head_dim` rows of
/// `latent_dim` each.
#[derive(Debug, Clone)]
pub(crate) struct LatentUp {
    pub(crate) k: Matrix,
    pub(crate) v: Matrix,
}

/// Every weight of a model (untied embedding and output head).
#[derive(Debug, Clone)]
pub struct Weights {
    pub(crate) embedding: Matrix,
    pub(crate) layers: Vec<LayerWeights>,
    pub(crate) final_norm: Vec<f32>,
    pub(crate) lm_head: Matrix,
}

impl Weights {
    /// The weights of `config` drawn from `seed`.
    pub fn seeded(config: &ModelConfig, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let rng = &mut rng;
        let (d, dh) = (config.hidden, config.head_dim);
        let embedding = Matrix {
            rows: config.vocab,
            cols: d,
            data: (0..config.vocab * d).map(|_| rng.symmetric()).collect(),
        };
        let layers = (0..config.layers)
            .map(|_| LayerWeights {
                attention_norm: norm_gains(d, rng),
                wq: Matrix::seeded(config.q_heads * dh, d, rng),
                wk: Matrix::seeded(config.latent_dim.unwrap_or(config.kv_heads * dh), d, rng),
                wv: Matrix::seeded(
                    if config.latent_dim.is_some() {
                        0
                    } else {
                        config.kv_heads * dh
                    },
                    d,
                    rng,
                ),
                latent_up: config.latent_dim.map(|latent| LatentUp {
                    k: Matrix::seeded(config.q_heads * dh, latent, rng),
                    v: Matrix::seeded(config.q_heads * dh, latent, rng),
                }),
                wo: Matrix::seeded(d, config.q_heads * dh, rng),
                mlp_norm: norm_gains(d, rng),
                w_gate: Matrix::seeded(config.ffn, d, rng),
                w_up: Matrix::seeded(config.ffn, d, rng),
                w_down: Matrix::seeded(d, config.ffn, rng),
            })
            .collect();
        Weights {
            embedding,
            layers,
            final_norm: norm_gains(d, rng),
            lm_head: Matrix::seeded(config.vocab, d, rng),
        }
    }
}

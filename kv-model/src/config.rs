//! The model's dimensions.

/// The dimensions of a [`Model`](crate::Model).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (a divisor of `q_heads`: each serves `q_heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Elements of one head's query, key or value.
    pub head_dim: usize,
    /// Width of the SwiGLU MLP's inner layer.
    pub ffn: usize,
    /// Base of the rotary position embedding's frequencies.
    pub rope_theta: f32,
    /// RMSNorm's epsilon.
    pub norm_eps: f32,
    /// Sliding-window attention: `Some(w)` makes every odd layer attend to its last `w`
    /// positions only (the current one among them), as Gemma's alternating layers do. Those
    /// layers form KV cache group 1, the others group 0 (vLLM's hybrid KV cache manager).
    /// `None`: every layer attends to every position, in one group.
    pub sliding_window: Option<usize>,
    /// MLA-like attention: `Some(n)` caches one latent vector of `n` elements per token and
    /// layer instead of K and V heads, replicated on every TP rank (then `kv_heads` must be
    /// 1: the latent is the one cached head); each query head's K (rotated) and V are
    /// up-projections of it. `None`: K and V heads are cached.
    pub latent_dim: Option<usize>,
}

impl ModelConfig {
    /// A model small enough for a debug-build test to run in seconds: 2 layers, 8 query
    /// heads over 4 KV heads of 16 elements, hidden 64, vocabulary 128.
    pub fn small() -> Self {
        ModelConfig {
            vocab: 128,
            hidden: 64,
            layers: 2,
            q_heads: 8,
            kv_heads: 4,
            head_dim: 16,
            ffn: 128,
            rope_theta: 10_000.0,
            norm_eps: 1e-5,
            sliding_window: None,
            latent_dim: None,
        }
    }

    /// Elements of one cached head's K (or V) of one token, or of its latent.
    pub fn cached_dim(&self) -> usize {
        self.latent_dim.unwrap_or(self.head_dim)
    }

    /// Bytes of one cached head's K (or V) of one token, or of its latent:
    /// [`cached_dim`](Self::cached_dim) f32 elements.
    pub fn head_bytes(&self) -> usize {
        self.cached_dim() * std::mem::size_of::<f32>()
    }

    /// Query heads that share one KV head.
    pub fn group_size(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// KV cache groups: 2 with a sliding window, else 1.
    pub fn kv_cache_groups(&self) -> usize {
        if self.sliding_window.is_some() {
            2
        } else {
            1
        }
    }

    /// The KV cache group of layer `layer`: 1 for a sliding-window layer, else 0.
    pub fn group_of_layer(&self, layer: usize) -> usize {
        layer % self.kv_cache_groups()
    }

    /// The first position that layer `layer`'s attention at `position` reads.
    pub fn first_attended(&self, layer: usize, position: usize) -> usize {
        match self.sliding_window {
            Some(window) if self.group_of_layer(layer) == 1 => {
                (position + 1).saturating_sub(window)
            }
            _ => 0,
        }
    }
}

//! Prefill → decode with a real model (`kv-model`) as the oracle: the prefill engine (a
//! child process, its TP ranks inside it) computes a prompt's KV into its registered
//! blocks and finishes the request with `kv_transfer_params`; the decode engine (this
//! process, its ranks inside it) loads the blocks through the connector, computes the
//! prefix-hit blocks itself, and generates [`STEPS`] tokens. Its tokens must equal one
//! process's run of the same model over a contiguous cache, and every logit must lie
//! within [`TOLERANCE`] of it.

pub mod engine;
mod prefill_child;
mod roles;

pub use roles::{decode_against_prefill, prefill_role};

use kv_model::{ContiguousKv, GroupRegions, KvPacking, Model, ModelConfig};
use nixl_connector::{KvLayout, Protocol};
use serde::{Deserialize, Serialize};

/// Tokens each decode generates.
pub const STEPS: usize = 32;

/// A logit's largest difference from one process's, relative to its magnitude (floored at
/// 1, the logits' scale).
pub const TOLERANCE: f32 = 1e-4;

/// The seed of every model's weights.
const SEED: u64 = 44;

/// One engine's geometry.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Side {
    /// TP size.
    pub tp: usize,
    /// Tokens per block.
    pub block_size: usize,
}

/// What a case runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Scenario {
    /// Whether the engines speak vLLM's protocol (else the native one).
    pub vllm: bool,
    /// How each layer's K and V map onto regions (both engines).
    pub packing: Packing,
    /// Byte order of a block (both engines).
    pub layout: Layout,
    /// The prefill engine.
    pub prefill: Side,
    /// The decode engine.
    pub decode: Side,
    /// Tokens in the prompt.
    pub prompt_len: usize,
    /// Decode blocks of the prompt the decode computes itself (its prefix cache hit).
    pub prefix_blocks: usize,
    /// The model's KV heads (of 8 query heads).
    pub kv_heads: usize,
    /// The model's sliding window ([`ModelConfig::sliding_window`]): with it, two KV cache
    /// groups.
    pub sliding_window: Option<usize>,
    /// The model's latent ([`ModelConfig::latent_dim`]): MLA-like, with 1 KV head and
    /// [`Packing::Latent`].
    pub latent_dim: Option<usize>,
    /// Whether the groups' layers share regions ([`GroupRegions::Shared`]) or have their
    /// own ([`GroupRegions::Own`]).
    pub shared_regions: bool,
}

/// [`KvPacking`], serialisable.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub enum Packing {
    /// [`KvPacking::Packed`].
    Packed,
    /// [`KvPacking::Halves`].
    Halves,
    /// [`KvPacking::Separate`].
    Separate,
    /// [`KvPacking::Latent`].
    Latent,
}

/// [`KvLayout`], serialisable.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub enum Layout {
    /// HND.
    Hnd,
    /// NHD.
    Nhd,
}

impl Scenario {
    /// TP 1 → 1 in blocks of 16 tokens, packed K and V in HND, a 53-token prompt, no prefix
    /// hit, 4 KV heads, speaking vLLM's protocol or (`vllm` false) the native one.
    pub fn tp1(vllm: bool) -> Self {
        Scenario {
            vllm,
            packing: Packing::Packed,
            layout: Layout::Hnd,
            prefill: Side {
                tp: 1,
                block_size: 16,
            },
            decode: Side {
                tp: 1,
                block_size: 16,
            },
            prompt_len: 53,
            prefix_blocks: 0,
            kv_heads: 4,
            sliding_window: None,
            latent_dim: None,
            shared_regions: false,
        }
    }

    /// This scenario with the prefill's and the decode's TP sizes.
    pub fn tp(mut self, prefill: usize, decode: usize) -> Self {
        self.prefill.tp = prefill;
        self.decode.tp = decode;
        self
    }

    /// This scenario with the prefill's and the decode's tokens per block.
    pub fn block_sizes(mut self, prefill: usize, decode: usize) -> Self {
        self.prefill.block_size = prefill;
        self.decode.block_size = decode;
        self
    }

    fn protocol(&self) -> Protocol {
        if self.vllm {
            Protocol::Vllm
        } else {
            Protocol::Native
        }
    }

    fn packing(&self) -> KvPacking {
        match self.packing {
            Packing::Packed => KvPacking::Packed,
            Packing::Halves => KvPacking::Halves,
            Packing::Separate => KvPacking::Separate,
            Packing::Latent => KvPacking::Latent,
        }
    }

    fn group_regions(&self) -> GroupRegions {
        if self.shared_regions {
            GroupRegions::Shared
        } else {
            GroupRegions::Own
        }
    }

    fn layout(&self) -> KvLayout {
        match self.layout {
            Layout::Hnd => KvLayout::Hnd,
            Layout::Nhd => KvLayout::Nhd,
        }
    }

    /// The prompt: tokens that vary along it.
    fn prompt(&self, vocab: usize) -> Vec<usize> {
        (0..self.prompt_len)
            .map(|i| (i * 37 + i * i * 11 + 5) % vocab)
            .collect()
    }
}

/// The model of a case: 2 layers, 8 query heads over the scenario's KV heads of 16
/// elements, the second layer of the scenario's sliding window if any.
pub fn model(scenario: &Scenario) -> Model {
    Model::seeded(
        ModelConfig {
            kv_heads: scenario.kv_heads,
            sliding_window: scenario.sliding_window,
            latent_dim: scenario.latent_dim,
            ..ModelConfig::small()
        },
        SEED,
    )
}

/// A block table of `count` blocks for each of `groups` KV cache groups: distinct block ids
/// of `num_blocks` (one pool), scattered (`i * 7 + 3` modulo a count 7 does not divide).
fn scattered(groups: usize, count: usize, num_blocks: usize) -> Vec<Vec<usize>> {
    assert!(num_blocks % 7 != 0 && groups * count <= num_blocks);
    let ids: Vec<usize> = (0..groups * count)
        .map(|i| (i * 7 + 3) % num_blocks)
        .collect();
    ids.chunks(count.max(1)).map(<[usize]>::to_vec).collect()
}

/// Blocks per region of an engine with `block_size` tokens per block: room for the prompt
/// and the generation of each KV cache group, and some to spare (not a multiple of 7).
fn num_blocks(scenario: &Scenario, block_size: usize) -> usize {
    let groups = model(scenario).config().kv_cache_groups();
    let mut blocks = (scenario.prompt_len + STEPS).div_ceil(block_size) * groups + 5;
    if blocks % 7 == 0 {
        blocks += 1;
    }
    blocks
}

/// One process's run: the prompt's last logits, then [`STEPS`] tokens from its argmax.
pub fn reference(scenario: &Scenario) -> (Vec<f32>, kv_model::Generation) {
    let model = model(scenario);
    let c = model.config();
    let mut cache = [ContiguousKv::new(c.layers, 0..c.kv_heads, c.cached_dim())];
    let logits = model.prefill(&scenario.prompt(c.vocab), &mut cache);
    let first = kv_model::argmax(&logits);
    let generation = kv_model::greedy(&model, first, scenario.prompt_len, STEPS, &mut cache);
    (logits, generation)
}

/// Panics unless every logit of `got` lies within [`TOLERANCE`] of `want`'s.
pub fn assert_logits_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: logits");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= TOLERANCE * w.abs().max(1.0),
            "{what}: logit {i} is {g}, one process has {w}"
        );
    }
}

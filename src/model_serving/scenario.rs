//! What a prefill → decode run of the model serves: the model, the engines' geometry, the
//! prompt, and one process's reference run to compare with.

use kv_model::{ContiguousKv, GroupRegions, KvPacking, Model, ModelConfig};
use nixl_connector::{KvLayout, Protocol};
use serde::{Deserialize, Serialize};

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
    /// Tokens the decode generates.
    pub steps: usize,
    /// Decode blocks of the prompt the decode computes itself (its prefix cache hit).
    pub prefix_blocks: usize,
    /// The model's decoder layers.
    pub layers: usize,
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
    /// The new tokens of a second turn (see [`read_back`](super::read_back)): when set, both
    /// engines keep finished decodes' KV and read it back (`bidirectional_kv_xfer`, any
    /// count of tokens read), and their pools have room for both turns.
    #[serde(default)]
    pub second_turn: Option<usize>,
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
    /// TP 1 → 1 in blocks of 16 tokens, packed K and V in HND, a 53-token prompt, 32 tokens
    /// to generate, no prefix hit, 2 layers, 4 KV heads, speaking vLLM's protocol or (`vllm` false) the native one.
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
            steps: 32,
            prefix_blocks: 0,
            layers: 2,
            kv_heads: 4,
            sliding_window: None,
            latent_dim: None,
            shared_regions: false,
            second_turn: None,
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

    pub(crate) fn protocol(&self) -> Protocol {
        if self.vllm {
            Protocol::Vllm
        } else {
            Protocol::Native
        }
    }

    pub(crate) fn packing(&self) -> KvPacking {
        match self.packing {
            Packing::Packed => KvPacking::Packed,
            Packing::Halves => KvPacking::Halves,
            Packing::Separate => KvPacking::Separate,
            Packing::Latent => KvPacking::Latent,
        }
    }

    pub(crate) fn group_regions(&self) -> GroupRegions {
        if self.shared_regions {
            GroupRegions::Shared
        } else {
            GroupRegions::Own
        }
    }

    pub(crate) fn layout(&self) -> KvLayout {
        match self.layout {
            Layout::Hnd => KvLayout::Hnd,
            Layout::Nhd => KvLayout::Nhd,
        }
    }

    /// The prompt: tokens that vary along it.
    pub fn prompt(&self, vocab: usize) -> Vec<usize> {
        (0..self.prompt_len)
            .map(|i| (i * 37 + i * i * 11 + 5) % vocab)
            .collect()
    }

    /// Tokens in the second turn's prompt ([`second_prompt`](Self::second_prompt)), if any.
    pub fn second_prompt_len(&self) -> Option<usize> {
        self.second_turn
            .map(|new| self.prompt_len + 1 + self.steps + new)
    }

    /// The second turn's prompt: the first turn's, its `answer` (the prefill's token and the
    /// decode's steps), and the second turn's new tokens.
    ///
    /// # Panics
    /// If the scenario has no second turn, or `answer` is not one token more than its steps.
    pub fn second_prompt(&self, vocab: usize, answer: &[usize]) -> Vec<usize> {
        let new = self.second_turn.expect("a scenario with a second turn");
        assert_eq!(answer.len(), self.steps + 1, "the first turn's answer");
        let mut prompt = self.prompt(vocab);
        prompt.extend_from_slice(answer);
        prompt.extend((0..new).map(|i| (i * 13 + 7) % vocab));
        prompt
    }
}

/// The model of a scenario: its layers, 8 query heads over its KV heads of 16 elements,
/// the odd layers of its sliding window if any.
pub fn model(scenario: &Scenario) -> Model {
    Model::seeded(
        ModelConfig {
            layers: scenario.layers,
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
pub(crate) fn scattered(groups: usize, count: usize, num_blocks: usize) -> Vec<Vec<usize>> {
    assert!(num_blocks % 7 != 0 && groups * count <= num_blocks);
    let ids: Vec<usize> = (0..groups * count)
        .map(|i| (i * 7 + 3) % num_blocks)
        .collect();
    ids.chunks(count.max(1)).map(<[usize]>::to_vec).collect()
}

/// `count` block ids of a pool of `num_blocks` that `used` does not hold, scattered as
/// [`scattered`]'s (the same order, past the used ones).
///
/// # Panics
/// If the pool has fewer than `count` blocks more.
pub(crate) fn fresh(used: &[usize], count: usize, num_blocks: usize) -> Vec<usize> {
    let ids: Vec<usize> = (0..num_blocks)
        .map(|i| (i * 7 + 3) % num_blocks)
        .filter(|id| !used.contains(id))
        .take(count)
        .collect();
    assert_eq!(ids.len(), count, "free blocks in a pool of {num_blocks}");
    ids
}

/// Blocks per region of an engine with `block_size` tokens per block: room for the prompt
/// and the generation of each KV cache group (of both turns, with a second), and some to
/// spare (not a multiple of 7).
pub(crate) fn num_blocks(scenario: &Scenario, block_size: usize) -> usize {
    let groups = model(scenario).config().kv_cache_groups();
    let turns = [Some(scenario.prompt_len), scenario.second_prompt_len()];
    let per_group: usize = turns
        .into_iter()
        .flatten()
        .map(|prompt| (prompt + scenario.steps).div_ceil(block_size))
        .sum();
    let mut blocks = per_group * groups + 5;
    if blocks % 7 == 0 {
        blocks += 1;
    }
    blocks
}

/// One process's run over a contiguous cache: the prompt's last logits, then the
/// scenario's steps from its argmax.
pub fn reference(scenario: &Scenario) -> (Vec<f32>, kv_model::Generation) {
    let model = model(scenario);
    reference_over(scenario, &scenario.prompt(model.config().vocab))
}

/// One process's run of the scenario's model over `prompt` (a contiguous cache): its last
/// logits, then the scenario's steps from their argmax.
pub fn reference_over(scenario: &Scenario, prompt: &[usize]) -> (Vec<f32>, kv_model::Generation) {
    let model = model(scenario);
    let c = model.config();
    let mut cache = [ContiguousKv::new(c.layers, 0..c.kv_heads, c.cached_dim())];
    let logits = model.prefill(prompt, &mut cache);
    let first = kv_model::argmax(&logits);
    let generation = kv_model::greedy(&model, first, prompt.len(), scenario.steps, &mut cache);
    (logits, generation)
}

/// Whether every logit of `got` lies within [`TOLERANCE`] of `want`'s; else which does
/// not.
///
/// # Errors
/// A description of the first logit out of tolerance, or of a length mismatch.
pub fn logits_close(got: &[f32], want: &[f32]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{} logits, one process has {}",
            got.len(),
            want.len()
        ));
    }
    match got
        .iter()
        .zip(want)
        .position(|(g, w)| (g - w).abs() > TOLERANCE * w.abs().max(1.0))
    {
        Some(i) => Err(format!(
            "logit {i} is {}, one process has {}",
            got[i], want[i]
        )),
        None => Ok(()),
    }
}

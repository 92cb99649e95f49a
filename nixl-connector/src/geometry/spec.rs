//! The shape of a worker's KV cache: its regions (one per registered tensor, each with its
//! own block length), blocks, tokens per block, the attention it serves and the byte order
//! of a block.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How a block's bytes are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvLayout {
    /// Heads, then tokens, then head bytes: one head's slice of a block is contiguous, so a
    /// rank can read the heads it lacks from a peer of another TP size.
    Hnd,
    /// Tokens, then heads, then head bytes: a head's slice is not contiguous, so both sides
    /// must hold the same heads per rank.
    Nhd,
}

impl std::fmt::Display for KvLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvLayout::Hnd => "HND",
            KvLayout::Nhd => "NHD",
        })
    }
}

/// The attention a KV cache serves: what one token of a block holds, and how the TP ranks of
/// an engine share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvAttention {
    /// Multi-head attention (MHA, GQA, MQA): the model's `total_kv_heads` KV heads are split
    /// over the TP ranks. A rank of TP `tp` holds `total_kv_heads / tp` of them, or one when
    /// TP is larger than `total_kv_heads` (then several ranks hold the same head: replicated
    /// KV heads). Of the two sizes, one must divide the other.
    Mha {
        /// KV heads of the whole model (every rank together).
        total_kv_heads: usize,
    },
    /// Multi-head latent attention (DeepSeek-class models): one latent vector per token and
    /// layer, the same on every TP rank (replicated), so a block is read whole from one rank.
    Mla,
}

impl std::fmt::Display for KvAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvAttention::Mha { total_kv_heads } => write!(f, "MHA with {total_kv_heads} KV heads"),
            KvAttention::Mla => f.write_str("MLA"),
        }
    }
}

impl KvAttention {
    /// The KV heads rank `tp_rank` of TP `tp_size` holds, numbered across the model (vLLM's
    /// `local_physical_heads` and `compute_head_offset`): a contiguous range of
    /// `total / tp` heads, or the one head `tp_rank * total / tp_size` when TP is larger;
    /// `None` for MLA (no heads: the latent is whole on every rank).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when neither of TP size and KV heads divides the other, or
    /// for a rank not below the TP size.
    pub fn heads_of_rank(&self, tp_rank: usize, tp_size: usize) -> Result<Option<Range<usize>>> {
        let KvAttention::Mha {
            total_kv_heads: total,
        } = *self
        else {
            return Ok(None);
        };
        if tp_size == 0 || tp_rank >= tp_size || total == 0 {
            return Err(Error::invalid(
                "map KV heads to TP ranks",
                format!("rank {tp_rank} of TP {tp_size} with {total} KV heads"),
            ));
        }
        if total % tp_size != 0 && tp_size % total != 0 {
            return Err(Error::invalid(
                "map KV heads to TP ranks",
                format!(
                    "TP {tp_size} and {total} KV heads: one must divide the other to split the heads evenly"
                ),
            ));
        }
        let first = tp_rank.checked_mul(total).map(|n| n / tp_size);
        let count = (total / tp_size).max(1);
        first
            .and_then(|first| Some(first..first.checked_add(count)?))
            .map(Some)
            .ok_or_else(|| {
                Error::invalid(
                    "map KV heads to TP ranks",
                    format!("rank {tp_rank} of TP {tp_size} with {total} KV heads overflows"),
                )
            })
    }

    /// KV heads a rank of TP `tp_size` holds (1 for MLA, whose latent counts as one piece).
    fn heads_per_rank(&self, tp_size: usize) -> usize {
        match *self {
            KvAttention::Mha { total_kv_heads } => (total_kv_heads / tp_size.max(1)).max(1),
            KvAttention::Mla => 1,
        }
    }
}

/// What one block of a region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvRegionKind {
    /// One tensor: a layer's K and V packed per head and token (vLLM 0.33's `LBHNC`,
    /// [`KvCacheSpec::lbhnc`]: a block is `[heads, tokens, 2 × head_size]`, so a head's
    /// token holds its K then its V), K or V alone, or an MLA latent.
    Tensor,
    /// K and V, each half of the block in the spec's layout (FlashInfer's blocks-first
    /// layout, `[blocks][2][...]`): a head slice of a block is two pieces, one per half.
    KvHalves,
}

impl KvRegionKind {
    /// Halves of a block laid out alike (1 or 2).
    pub(crate) fn parts(self) -> usize {
        match self {
            KvRegionKind::Tensor => 1,
            KvRegionKind::KvHalves => 2,
        }
    }
}

impl std::fmt::Display for KvRegionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvRegionKind::Tensor => "one tensor",
            KvRegionKind::KvHalves => "K and V halves",
        })
    }
}

/// One registered region of a KV cache: `num_blocks` blocks of `block_len` bytes each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvRegion {
    /// Bytes of one block (vLLM's `block_lens` entry): tokens per block × this rank's heads ×
    /// bytes of one head's token (× 2 for [`KvRegionKind::KvHalves`]), or tokens per block
    /// × bytes of one latent for MLA.
    pub block_len: usize,
    /// What a block holds.
    pub kind: KvRegionKind,
}

/// One TP rank's KV cache: `regions` (one per registered tensor, e.g. one per layer with K
/// and V packed as vLLM 0.33 registers them, [`lbhnc`](Self::lbhnc)) of `num_blocks` blocks
/// each, a block holding `block_size` tokens of
/// the `attention`'s heads (this rank's share) or latent, in `layout` byte order.
///
/// Regions may differ in block length (layers of different sizes, K and V of different head
/// sizes); a peer's cache must have the same regions in the same order, each holding the
/// same bytes per token and head, possibly with another TP size or another block size.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvCacheSpec {
    /// Blocks per region.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The attention the cache serves.
    pub attention: KvAttention,
    /// Byte order of a block (for MLA, tokens then latent bytes whichever it says).
    pub layout: KvLayout,
    /// Each region's block length and content, in registration order.
    pub regions: Vec<KvRegion>,
}

impl KvCacheSpec {
    /// A cache of `num_regions` regions of one tensor each, whose blocks are all `block_len`
    /// bytes long.
    pub fn uniform(
        num_regions: usize,
        num_blocks: usize,
        block_size: usize,
        attention: KvAttention,
        layout: KvLayout,
        block_len: usize,
    ) -> Self {
        KvCacheSpec {
            num_blocks,
            block_size,
            attention,
            layout,
            regions: vec![
                KvRegion {
                    block_len,
                    kind: KvRegionKind::Tensor,
                };
                num_regions
            ],
        }
    }

    /// This cache with only the regions `regions` (those of the layers a peer's pipeline
    /// stage shares with it); none past the last.
    pub(crate) fn regions_in(&self, regions: &Range<usize>) -> KvCacheSpec {
        KvCacheSpec {
            regions: self
                .regions
                .get(regions.clone())
                .unwrap_or_default()
                .to_vec(),
            ..self.clone()
        }
    }

    /// This spec with regions `regions` only, in that order (a region may come twice; an
    /// index past the last is left out).
    pub(crate) fn regions_at(&self, regions: impl Iterator<Item = usize>) -> KvCacheSpec {
        KvCacheSpec {
            regions: regions
                .filter_map(|r| self.regions.get(r).cloned())
                .collect(),
            ..self.clone()
        }
    }

    /// vLLM 0.33's non-MLA cache (`kv_cache_layout` `"LBHNC"`, what its NixlConnector
    /// asks attention backends for in `get_required_kvcache_layout`): one region per layer,
    /// each block `[heads, tokens, 2 × head_size]` (HND, K and V packed per head and token),
    /// so a block holds `block_size × heads × 2 × head_bytes` bytes, `heads` being the KV
    /// heads of one rank of TP `tp_size` ([`KvAttention::heads_of_rank`]). A head's slice
    /// of a block (its K and V of every token) is contiguous, so ranks of other TP sizes
    /// read it as one piece. `head_bytes` is one head's K (or V) of one token.
    pub fn lbhnc(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        total_kv_heads: usize,
        tp_size: usize,
        head_bytes: usize,
    ) -> Self {
        let attention = KvAttention::Mha { total_kv_heads };
        let heads = attention.heads_per_rank(tp_size);
        let block_len = block_size
            .saturating_mul(heads)
            .saturating_mul(2)
            .saturating_mul(head_bytes);
        KvCacheSpec::uniform(
            num_layers,
            num_blocks,
            block_size,
            attention,
            KvLayout::Hnd,
            block_len,
        )
    }

    /// Number of regions.
    pub fn num_regions(&self) -> usize {
        self.regions.len()
    }

    /// Bytes of one block of region `region` (0 past the last region).
    pub fn block_len(&self, region: usize) -> usize {
        self.regions.get(region).map_or(0, |r| r.block_len)
    }

    /// Bytes of region `region` (0 past the last region).
    pub fn region_len(&self, region: usize) -> usize {
        self.block_len(region).saturating_mul(self.num_blocks)
    }

    /// Bytes of one token of one head (of one half, for [`KvRegionKind::KvHalves`]) in region
    /// `region` of a rank of TP `tp_size`, or of one token's latent for MLA; `None` when the
    /// block length does not divide evenly.
    pub fn token_bytes(&self, region: usize, tp_size: usize) -> Option<usize> {
        let r = self.regions.get(region)?;
        let per_token = r
            .kind
            .parts()
            .checked_mul(self.attention.heads_per_rank(tp_size))?
            .checked_mul(self.block_size)?;
        (per_token > 0 && r.block_len % per_token == 0).then(|| r.block_len / per_token)
    }

    /// Checks that every dimension is positive and the sizes fit in memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the zero dimension, the overflow, or K and V halves
    /// in an MLA cache (which has no V).
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "KV cache spec";
        for (name, value) in [
            ("regions", self.regions.len()),
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
        ] {
            if value == 0 {
                return Err(Error::invalid(OP, format!("{name} must be at least 1")));
            }
        }
        if self.attention == (KvAttention::Mha { total_kv_heads: 0 }) {
            return Err(Error::invalid(OP, "total_kv_heads must be at least 1"));
        }
        for (index, region) in self.regions.iter().enumerate() {
            if region.block_len == 0 {
                return Err(Error::invalid(
                    OP,
                    format!("region {index}: block_len must be at least 1"),
                ));
            }
            if self.attention == KvAttention::Mla && region.kind == KvRegionKind::KvHalves {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "region {index}: an MLA cache has one latent per token, not K and V halves"
                    ),
                ));
            }
            let fits = region
                .block_len
                .checked_mul(self.num_blocks)
                .is_some_and(|len| len <= isize::MAX as usize);
            if !fits {
                return Err(Error::invalid(
                    OP,
                    format!("region {index}'s size overflows the address space"),
                ));
            }
        }
        Ok(())
    }

    /// Checks that the cache fits a rank of TP `tp_size`: the attention's heads split over
    /// it, and every region's block splits into tokens and heads.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first region whose block length does not divide.
    pub fn check_rank(&self, tp_rank: usize, tp_size: usize) -> Result<()> {
        self.attention.heads_of_rank(tp_rank, tp_size)?;
        if let Some(index) =
            (0..self.regions.len()).find(|&r| self.token_bytes(r, tp_size).is_none())
        {
            let r = &self.regions[index];
            return Err(Error::invalid(
                "KV cache spec",
                format!(
                    "region {index}: a block of {} bytes ({}) does not split into {} tokens of {} per rank at TP {tp_size}",
                    r.block_len,
                    r.kind,
                    self.block_size,
                    match self.attention {
                        KvAttention::Mha { .. } =>
                            format!("{} KV heads", self.attention.heads_per_rank(tp_size)),
                        KvAttention::Mla => "one latent".to_string(),
                    },
                ),
            ));
        }
        Ok(())
    }
}

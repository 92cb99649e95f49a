//! The shape of a worker's KV cache: layers, blocks, heads and layout.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How a block's bytes are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvLayout {
    /// Heads, then tokens, then head dim: the bytes of one head's slice of a block are
    /// contiguous, so a decode with a larger TP can read its heads with one descriptor.
    Hnd,
    /// Tokens, then heads, then head dim. Only homogeneous TP can transfer it.
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

/// One TP rank's KV cache: `num_layers` regions of `num_blocks` blocks each, a block holding
/// `block_size` tokens of `num_kv_heads` heads (this rank's share) of `head_dim` elements
/// of `dtype_size` bytes (K and V together count as separate layers, as the engine lays
/// them out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheSpec {
    /// Number of per-layer regions.
    pub num_layers: usize,
    /// Blocks per layer.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV heads held by this rank.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Bytes per element.
    pub dtype_size: usize,
    /// Byte order of a block.
    pub layout: KvLayout,
}

impl KvCacheSpec {
    /// Bytes of one block of one layer.
    pub fn block_len(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim * self.dtype_size
    }

    /// Bytes of one layer's region.
    pub fn layer_len(&self) -> usize {
        self.block_len() * self.num_blocks
    }

    /// Checks that every dimension is positive and the sizes fit in memory.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the zero dimension or the overflow.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "KV cache spec";
        for (name, value) in [
            ("num_layers", self.num_layers),
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_size", self.dtype_size),
        ] {
            if value == 0 {
                return Err(Error::invalid(OP, format!("{name} must be at least 1")));
            }
        }
        [
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype_size,
            self.num_blocks,
        ]
        .iter()
        .try_fold(1usize, |acc, &v| acc.checked_mul(v))
        .filter(|&len| len <= isize::MAX as usize)
        .map(|_| ())
        .ok_or_else(|| Error::invalid(OP, "a layer's size overflows the address space"))
    }
}

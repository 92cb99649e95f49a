//! The demo's KV cache: `layers x blocks x block_bytes` of host memory, one region per layer
//! (as vLLM registers one tensor per layer), registered by the connector; and the pattern
//! each request's blocks are filled with and checked against.

use nixl::Registration;
use nixl_connector::{KvAttention, KvCacheSpec, KvConnectorWorker};

use crate::conversation::ANSWER;
use crate::error::{Error, Result};
use crate::pattern;

/// Most layers a cache may have.
pub const MAX_LAYERS: usize = 4096;

/// Geometry of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Layers, one registered region each.
    pub layers: usize,
    /// Blocks per layer.
    pub blocks: usize,
    /// Bytes per block.
    pub block_bytes: usize,
}

impl KvLayout {
    /// Checks that every dimension is non-zero and fits the wire protocol.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad dimension.
    pub fn validate(&self) -> Result<()> {
        if self.layers == 0 || self.blocks == 0 || self.block_bytes == 0 {
            return Err(Error::Config(format!(
                "layers, blocks and block size must be non-zero, got {self:?}"
            )));
        }
        if self.layers > MAX_LAYERS {
            return Err(Error::Config(format!(
                "at most {MAX_LAYERS} layers, got {}",
                self.layers
            )));
        }
        if u32::try_from(self.blocks).is_err() || self.layer_bytes().is_none() {
            return Err(Error::Config(format!("cache too large: {self:?}")));
        }
        Ok(())
    }

    /// Bytes of one layer's region.
    pub fn layer_bytes(&self) -> Option<usize> {
        self.blocks.checked_mul(self.block_bytes)
    }

    /// Bytes of the whole cache.
    pub fn total_bytes(&self) -> usize {
        self.layer_bytes()
            .unwrap_or(usize::MAX)
            .saturating_mul(self.layers)
    }

    /// The connector's view of this geometry: one region per layer, a block one token of
    /// one head of `block_bytes` bytes, so block lengths and offsets are the demo's own.
    pub fn spec(&self) -> KvCacheSpec {
        KvCacheSpec::uniform(
            self.layers,
            self.blocks,
            1,
            KvAttention::Mha { total_kv_heads: 1 },
            nixl_connector::KvLayout::Hnd,
            self.block_bytes,
        )
    }
}

/// The connector's registered KV cache, seen through the demo's geometry.
#[derive(Debug, Clone, Copy)]
pub struct KvCache<'w> {
    layout: KvLayout,
    registration: &'w Registration,
}

impl<'w> KvCache<'w> {
    /// The cache `worker` registered, with geometry `layout`.
    ///
    /// # Errors
    /// [`Error::Connector`] when the worker has no cache registered.
    pub fn of(worker: &'w KvConnectorWorker, layout: KvLayout) -> Result<Self> {
        Ok(KvCache {
            layout,
            registration: worker.kv_caches()?,
        })
    }

    /// The cache geometry.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Writes the pattern of `request` into `blocks` of every layer.
    pub fn fill_blocks(&self, blocks: &[u32], request: u64) -> Result<()> {
        self.compute_blocks(blocks, blocks, request)
    }

    /// Writes into local blocks `local[i]` of every layer the pattern prefill writes into
    /// its block `remote[i]` for `request`: what a decode computes itself (the blocks its
    /// prefix cache holds, or a local prefill after a failed load).
    pub fn compute_blocks(&self, local: &[u32], remote: &[u32], request: u64) -> Result<()> {
        let mut scratch = vec![0u8; self.layout.block_bytes];
        for layer in 0..self.layout.layers {
            for (&lb, &rb) in local.iter().zip(remote) {
                pattern::fill(&mut scratch, layer as u32, rb, request);
                self.registration.write(layer, self.offset(lb), &scratch)?;
            }
        }
        Ok(())
    }

    /// Flips one byte of `block` in layer 0, to show that corruption is caught.
    pub fn corrupt_block(&self, block: u32) -> Result<()> {
        let mut byte = [0u8; 1];
        self.registration.read(0, self.offset(block), &mut byte)?;
        byte[0] ^= 0xff;
        self.registration.write(0, self.offset(block), &byte)?;
        Ok(())
    }

    /// Checks local blocks `local[i]` of every layer against the pattern that prefill wrote
    /// into its block `remote[i]` for `request`; returns every mismatching block.
    pub fn verify_blocks(
        &self,
        local: &[u32],
        remote: &[u32],
        request: u64,
    ) -> Result<Vec<Mismatch>> {
        let mut scratch = vec![0u8; self.layout.block_bytes];
        let mut bad = Vec::new();
        for layer in 0..self.layout.layers {
            for (&lb, &rb) in local.iter().zip(remote) {
                self.registration
                    .read(layer, self.offset(lb), &mut scratch)?;
                if let Some(offset) = pattern::first_mismatch(&scratch, layer as u32, rb, request) {
                    bad.push(Mismatch {
                        request,
                        layer: layer as u32,
                        remote_block: rb,
                        offset,
                    });
                }
            }
        }
        Ok(bad)
    }

    fn offset(&self, block: u32) -> usize {
        block as usize * self.layout.block_bytes
    }
}

/// A block whose bytes differ from the expected pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    /// The request.
    pub request: u64,
    /// The layer.
    pub layer: u32,
    /// The prefill block the data came from; in conversations of several turns, the block's
    /// pattern key ([`Context::keys`](crate::conversation::Context::keys): its position, with
    /// [`ANSWER`] set on decode's answers).
    pub remote_block: u32,
    /// Offset of the first wrong byte in the block.
    pub offset: usize,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let block = self.remote_block;
        let (whose, block) = if block & ANSWER == 0 {
            ("prefill", block)
        } else {
            ("decode's answer", block & !ANSWER)
        };
        write!(
            f,
            "request {} layer {} {whose} block {block}: first wrong byte at offset {}",
            self.request, self.layer, self.offset
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_checks() {
        let ok = KvLayout {
            layers: 2,
            blocks: 3,
            block_bytes: 4,
        };
        ok.validate().unwrap();
        assert_eq!(ok.total_bytes(), 24);
        assert_eq!(ok.spec().block_len(0), 4);
        assert_eq!(ok.spec().region_len(0), 12);
        assert!(KvLayout { layers: 0, ..ok }.validate().is_err());
        assert!(KvLayout {
            block_bytes: usize::MAX,
            ..ok
        }
        .validate()
        .is_err());
    }
}

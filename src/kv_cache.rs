//! The demo's KV cache: `layers x blocks x block_bytes` of host memory, one region per layer
//! (as vLLM registers one tensor per layer), registered by the connector (split over an
//! engine's ranks with `--tp`/`--pp`, see [`parallel`](crate::parallel)); and the pattern
//! each request's blocks are filled with and checked against.

use nixl::Registration;
use nixl_connector::{KvConnectorWorker, PipelineStages};

use crate::conversation::ANSWER;
use crate::error::{Error, Result};
use crate::parallel::{Parallel, RankSlice};
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
}

/// The connector's registered KV cache, seen through the demo's geometry: the caches of an
/// engine's ranks ([`Parallel`]), each holding its stage's layers and its TP share of every
/// block (one rank holding all of it by default).
#[derive(Debug, Clone, Copy)]
pub struct KvCache<'w> {
    layout: KvLayout,
    parallel: Parallel,
    stages: &'w PipelineStages,
    ranks: &'w [KvConnectorWorker],
}

impl<'w> KvCache<'w> {
    /// The caches `ranks` registered (rank `i` as [`Parallel::slice`] says), with geometry
    /// `layout` split over `stages`.
    ///
    /// # Errors
    /// [`Error::Connector`] when a rank has no cache registered; [`Error::Config`] when
    /// there are not as many ranks as `parallel` says.
    pub fn of(
        ranks: &'w [KvConnectorWorker],
        layout: KvLayout,
        parallel: Parallel,
        stages: &'w PipelineStages,
    ) -> Result<Self> {
        if ranks.len() != parallel.ranks() {
            return Err(Error::Config(format!(
                "{} ranks for a cache of TP {} × PP {}",
                ranks.len(),
                parallel.tp,
                parallel.pp
            )));
        }
        for rank in ranks {
            rank.kv_caches()?;
        }
        Ok(KvCache {
            layout,
            parallel,
            stages,
            ranks,
        })
    }

    /// The cache geometry.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Each rank's registration and what it holds.
    fn ranks(&self) -> impl Iterator<Item = Result<(&'w Registration, RankSlice)>> + '_ {
        self.ranks.iter().enumerate().map(|(i, rank)| {
            let slice = self.parallel.slice(self.stages, self.layout.block_bytes, i);
            Ok((rank.kv_caches()?, slice))
        })
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
        for rank in self.ranks() {
            let (registration, slice) = rank?;
            for (region, layer) in slice.layers.clone().enumerate() {
                for (&lb, &rb) in local.iter().zip(remote) {
                    pattern::fill(&mut scratch, layer as u32, rb, request);
                    let at = self.offset(&slice, lb);
                    registration.write(region, at, &scratch[slice.bytes.clone()])?;
                }
            }
        }
        Ok(())
    }

    /// Flips one byte of `block` in layer 0, to show that corruption is caught.
    pub fn corrupt_block(&self, block: u32) -> Result<()> {
        let Some(rank) = self.ranks().next() else {
            return Ok(());
        };
        let (registration, slice) = rank?;
        let mut byte = [0u8; 1];
        registration.read(0, self.offset(&slice, block), &mut byte)?;
        byte[0] ^= 0xff;
        registration.write(0, self.offset(&slice, block), &byte)?;
        Ok(())
    }

    /// Checks local blocks `local[i]` of every layer against the pattern that prefill wrote
    /// into its block `remote[i]` for `request`; returns every mismatching block (a block
    /// of several ranks once for each rank whose share is wrong).
    pub fn verify_blocks(
        &self,
        local: &[u32],
        remote: &[u32],
        request: u64,
    ) -> Result<Vec<Mismatch>> {
        let mut bad = Vec::new();
        for rank in self.ranks() {
            let (registration, slice) = rank?;
            let mut scratch = vec![0u8; slice.bytes.len()];
            // A share of a block: its expected bytes, the whole block's pattern cut.
            let mut whole = vec![0u8; self.layout.block_bytes];
            let partial = slice.bytes.len() != self.layout.block_bytes;
            for (region, layer) in slice.layers.clone().enumerate() {
                for (&lb, &rb) in local.iter().zip(remote) {
                    registration.read(region, self.offset(&slice, lb), &mut scratch)?;
                    let wrong = if partial {
                        pattern::fill(&mut whole, layer as u32, rb, request);
                        let want = &whole[slice.bytes.clone()];
                        (scratch != want).then(|| {
                            let at = scratch.iter().zip(want).position(|(a, b)| a != b);
                            slice.bytes.start + at.unwrap_or(0)
                        })
                    } else {
                        pattern::first_mismatch(&scratch, layer as u32, rb, request)
                    };
                    if let Some(offset) = wrong {
                        bad.push(Mismatch {
                            request,
                            layer: layer as u32,
                            remote_block: rb,
                            offset,
                        });
                    }
                }
            }
        }
        Ok(bad)
    }

    /// Where `block` starts in a region of a rank holding `slice` of every block.
    fn offset(&self, slice: &RankSlice, block: u32) -> usize {
        block as usize * slice.bytes.len()
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
        assert!(KvLayout { layers: 0, ..ok }.validate().is_err());
        assert!(KvLayout {
            block_bytes: usize::MAX,
            ..ok
        }
        .validate()
        .is_err());
    }
}

//! The demo's parallel layouts: an engine of `pp` pipeline stages of `tp` tensor-parallel
//! ranks, all in one process, one connector worker per rank (as vLLM runs one worker per
//! GPU). Stage `s` holds vLLM's even split of the model's layers ([`PipelineStages::even`]);
//! every block of a layer is `kv_heads` KV heads of `block_bytes / kv_heads` bytes each (a
//! block is one token), and TP rank `t` holds heads `t × kv_heads / tp ..` of it, that is
//! its `t`-th share of every block's bytes.
//!
//! The demo's KV cache is MHA-like (every head its own bytes): decode context parallelism,
//! which vLLM 0.33's NixlConnector runs for MLA caches only, is refused
//! ([`check_dcp`]).

use std::ops::Range;

use nixl_connector::{KvAttention, KvCacheSpec, PipelineStages};

use crate::error::{Error, Result};

/// The most ranks (`tp × pp`) a demo engine may run in its process.
pub const MAX_RANKS: usize = 64;

/// How an engine's KV cache is split over its ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallel {
    /// Tensor-parallel ranks per stage (`--tp`).
    pub tp: usize,
    /// Pipeline stages (`--pp`).
    pub pp: usize,
    /// KV heads of every block (`--kv-heads`), split over the TP ranks.
    pub kv_heads: usize,
}

impl Default for Parallel {
    /// One rank holding every layer of one KV head: the demo's default engine.
    fn default() -> Self {
        Parallel {
            tp: 1,
            pp: 1,
            kv_heads: 1,
        }
    }
}

/// What one rank holds of the engine's cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSlice {
    /// The model's layers, one registered region each, in order.
    pub layers: Range<usize>,
    /// Its bytes of every block of the model's (`0..block_bytes` for a rank of TP 1).
    pub bytes: Range<usize>,
}

impl Parallel {
    /// Ranks of the engine, `pp × tp`.
    pub fn ranks(&self) -> usize {
        self.tp.saturating_mul(self.pp)
    }

    /// Whether the engine is one rank (TP 1, PP 1).
    pub fn is_single(&self) -> bool {
        self.ranks() == 1
    }

    /// Checks the split against a cache of `layers` layers of `block_bytes`-byte blocks.
    ///
    /// # Errors
    /// [`Error::Config`] for a zero size, more than [`MAX_RANKS`] ranks, more stages than
    /// layers, KV heads that the TP ranks cannot share evenly, or blocks that are not whole
    /// bytes of each head.
    pub fn validate(&self, layers: usize, block_bytes: usize) -> Result<()> {
        let Parallel { tp, pp, kv_heads } = *self;
        if tp == 0 || pp == 0 || kv_heads == 0 {
            return Err(Error::Config(format!(
                "--tp, --pp and --kv-heads must be at least 1, got {tp}, {pp} and {kv_heads}"
            )));
        }
        if self.ranks() > MAX_RANKS {
            return Err(Error::Config(format!(
                "--tp {tp} × --pp {pp} is {} ranks; this demo runs at most {MAX_RANKS} in one process",
                self.ranks()
            )));
        }
        if pp > layers {
            return Err(Error::Config(format!(
                "--pp {pp} stages of {layers} layers: every stage needs a layer, give at most --pp {layers}"
            )));
        }
        if kv_heads % tp != 0 {
            return Err(Error::Config(format!(
                "--kv-heads {kv_heads} cannot be shared by --tp {tp} ranks: give a multiple of {tp} (scripts/demo.sh picks a multiple of both engines' TP)"
            )));
        }
        if block_bytes % kv_heads != 0 {
            return Err(Error::Config(format!(
                "blocks of {block_bytes} bytes are not {kv_heads} heads of whole bytes: give a --block-size that --kv-heads divides"
            )));
        }
        Ok(())
    }

    /// The layers of each stage of a model of `layers` layers, vLLM's even split.
    ///
    /// # Errors
    /// The connector's, for more stages than layers.
    pub fn stages(&self, layers: usize) -> Result<PipelineStages> {
        Ok(PipelineStages::even(layers, self.pp)?)
    }

    /// The `(pp_rank, tp_rank)` of rank `index` (ranks go stage by stage).
    pub fn rank_of(&self, index: usize) -> (usize, usize) {
        (index / self.tp, index % self.tp)
    }

    /// What rank `index` holds of a cache of `stages`' layers of `block_bytes`-byte blocks.
    pub fn slice(&self, stages: &PipelineStages, block_bytes: usize, index: usize) -> RankSlice {
        let (stage, tp_rank) = self.rank_of(index);
        let share = block_bytes / self.tp;
        RankSlice {
            layers: stages.layers(stage),
            bytes: tp_rank * share..(tp_rank + 1) * share,
        }
    }

    /// The connector's view of what rank `index` registers of `blocks` blocks of
    /// `block_bytes` bytes: its stage's layers, one region each, every block its TP share
    /// of the KV heads (a block one token, heads outermost).
    pub fn spec(
        &self,
        stages: &PipelineStages,
        (blocks, block_bytes): (usize, usize),
        index: usize,
    ) -> KvCacheSpec {
        let slice = self.slice(stages, block_bytes, index);
        KvCacheSpec::uniform(
            slice.layers.len(),
            blocks,
            1,
            KvAttention::Mha {
                total_kv_heads: self.kv_heads,
            },
            nixl_connector::KvLayout::Hnd,
            slice.bytes.len(),
        )
    }
}

/// Checks a decode's `--dcp`: only 1, as the demo's cache is not MLA.
///
/// # Errors
/// [`Error::Config`] for a DCP size above 1.
pub fn check_dcp(dcp: usize) -> Result<()> {
    if dcp > 1 {
        return Err(Error::Config(format!(
            "--dcp {dcp}: decode context parallelism shards an MLA cache (vLLM 0.33's NixlConnector runs it for MLA only), and this demo's KV cache is MHA-like, every KV head its own bytes; run it with --dcp 1 (the connector's DCP is tested against MLA caches in nixl-connector/tests/dcp.rs and tests/vllm_dcp.rs)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_hold_their_stage_layers_and_their_heads() {
        let parallel = Parallel {
            tp: 2,
            pp: 2,
            kv_heads: 4,
        };
        parallel.validate(5, 64).unwrap();
        let stages = parallel.stages(5).unwrap();
        let slices: Vec<_> = (0..4).map(|i| parallel.slice(&stages, 64, i)).collect();
        assert_eq!(slices[0].layers, 0..3);
        assert_eq!(slices[0].bytes, 0..32);
        assert_eq!(slices[1].bytes, 32..64);
        assert_eq!(slices[3].layers, 3..5);
        assert_eq!(parallel.rank_of(3), (1, 1));
        assert_eq!(parallel.spec(&stages, (8, 64), 2).block_len(0), 32);
    }

    #[test]
    fn the_default_is_the_single_rank_cache() {
        let single = Parallel::default();
        assert!(single.is_single());
        let stages = single.stages(5).unwrap();
        // One region a layer, a block one token of one head of the demo's bytes.
        let whole = KvCacheSpec::uniform(
            5,
            8,
            1,
            KvAttention::Mha { total_kv_heads: 1 },
            nixl_connector::KvLayout::Hnd,
            64,
        );
        assert_eq!(single.spec(&stages, (8, 64), 0), whole);
        assert_eq!(whole.region_len(0), 8 * 64);
    }

    #[test]
    fn bad_splits_are_refused_naming_the_flag() {
        let bad = |tp, pp, kv_heads| {
            Parallel { tp, pp, kv_heads }
                .validate(5, 64)
                .unwrap_err()
                .to_string()
        };
        assert!(bad(0, 1, 1).contains("--tp"));
        assert!(bad(1, 6, 1).contains("--pp 6"));
        assert!(bad(2, 1, 1).contains("--kv-heads 1"));
        assert!(bad(3, 1, 3).contains("--block-size"));
        assert!(bad(64, 2, 64).contains("at most 64"));
        assert!(check_dcp(2).unwrap_err().to_string().contains("MLA"));
        check_dcp(1).unwrap();
    }
}

//! A KV cache in blocks of a [`KvCacheSpec`]'s layout, reached through a block table: where
//! each layer's K and V of a head and token sit in a rank's registered regions.

use std::ops::Range;

use nixl_connector::{KvAttention, KvCacheSpec, KvLayout, KvRegion, KvRegionKind};

use crate::config::ModelConfig;
use crate::kv_cache::{kv_heads_of_rank, KvCache};
use crate::memory::KvMemory;

/// How a layer's K and V map onto regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPacking {
    /// One region per layer ([`KvRegionKind::Tensor`]); a head's token holds its K then its
    /// V (vLLM 0.33's `LBHNC` in HND).
    Packed,
    /// One region per layer ([`KvRegionKind::KvHalves`]): a block's first half holds K, its
    /// second V, each in the spec's layout.
    Halves,
    /// Two regions per layer ([`KvRegionKind::Tensor`]): region `2l` holds layer `l`'s K,
    /// region `2l + 1` its V.
    Separate,
}

impl KvPacking {
    /// Regions per layer.
    fn regions_per_layer(self) -> usize {
        match self {
            KvPacking::Separate => 2,
            KvPacking::Packed | KvPacking::Halves => 1,
        }
    }

    /// What each of a layer's regions holds, and its bytes per head and token.
    fn region(self, head_bytes: usize) -> (KvRegionKind, usize) {
        match self {
            KvPacking::Packed => (KvRegionKind::Tensor, 2 * head_bytes),
            KvPacking::Halves => (KvRegionKind::KvHalves, head_bytes),
            KvPacking::Separate => (KvRegionKind::Tensor, head_bytes),
        }
    }
}

/// Where a rank's K and V bytes sit in its regions: the spec's layout and block size, the
/// packing and the rank's KV heads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedLayout {
    packing: KvPacking,
    layout: KvLayout,
    block_size: usize,
    heads: Range<usize>,
    head_bytes: usize,
    /// Bytes of one block of each region.
    block_lens: Vec<usize>,
}

impl PagedLayout {
    /// The spec rank caches of TP `tp` register for `config`: `num_blocks` blocks of
    /// `block_size` tokens per region, the regions as `packing` says, in `layout` order.
    pub fn spec(
        config: &ModelConfig,
        packing: KvPacking,
        layout: KvLayout,
        block_size: usize,
        num_blocks: usize,
        tp: usize,
    ) -> KvCacheSpec {
        let heads = kv_heads_of_rank(config.kv_heads, 0, tp).len();
        let (kind, unit) = packing.region(config.head_bytes());
        let block_len = kind_parts(kind) * heads * block_size * unit;
        KvCacheSpec {
            num_blocks,
            block_size,
            attention: KvAttention::Mha {
                total_kv_heads: config.kv_heads,
            },
            layout,
            regions: vec![
                KvRegion { block_len, kind };
                config.layers * packing.regions_per_layer()
            ],
        }
    }

    /// The layout of rank `rank` of TP `tp` of `config` in a cache of `spec`, whose regions
    /// `packing` describes.
    ///
    /// # Errors
    /// A description of the first thing in `spec` that does not fit: its attention, its
    /// region count, or a region's kind or block length.
    pub fn new(
        config: &ModelConfig,
        spec: &KvCacheSpec,
        packing: KvPacking,
        rank: usize,
        tp: usize,
    ) -> Result<Self, String> {
        let want = Self::spec(
            config,
            packing,
            spec.layout,
            spec.block_size,
            spec.num_blocks,
            tp,
        );
        if spec.attention != want.attention {
            return Err(format!(
                "attention {} instead of {}",
                spec.attention, want.attention
            ));
        }
        if spec.regions.len() != want.regions.len() {
            return Err(format!(
                "{} regions instead of {} ({packing:?} packing of {} layers)",
                spec.regions.len(),
                want.regions.len(),
                config.layers
            ));
        }
        if let Some((index, region)) = spec
            .regions
            .iter()
            .enumerate()
            .find(|(i, r)| **r != want.regions[*i])
        {
            return Err(format!(
                "region {index} is {region:?} instead of {:?}",
                want.regions[index]
            ));
        }
        Ok(PagedLayout {
            packing,
            layout: spec.layout,
            block_size: spec.block_size,
            heads: kv_heads_of_rank(config.kv_heads, rank, tp),
            head_bytes: config.head_bytes(),
            block_lens: spec.regions.iter().map(|r| r.block_len).collect(),
        })
    }

    /// The region and offset of model-wide KV head `head`'s K (`half` 0) or V (`half` 1) of
    /// token `token` in block `block` of layer `layer`.
    fn locate(
        &self,
        layer: usize,
        half: usize,
        head: usize,
        block: usize,
        token: usize,
    ) -> (usize, usize) {
        let (heads, local_head) = (self.heads.len(), head - self.heads.start);
        let unit = match self.packing {
            KvPacking::Packed => 2 * self.head_bytes,
            KvPacking::Halves | KvPacking::Separate => self.head_bytes,
        };
        let slot = match self.layout {
            KvLayout::Hnd => local_head * self.block_size + token,
            KvLayout::Nhd => token * heads + local_head,
        };
        let (region, within) = match self.packing {
            KvPacking::Packed => (layer, slot * unit + half * self.head_bytes),
            KvPacking::Halves => (layer, half * self.block_lens[layer] / 2 + slot * unit),
            KvPacking::Separate => (2 * layer + half, slot * unit),
        };
        (region, block * self.block_lens[region] + within)
    }
}

fn kind_parts(kind: KvRegionKind) -> usize {
    match kind {
        KvRegionKind::Tensor => 1,
        KvRegionKind::KvHalves => 2,
    }
}

/// A rank's KV cache in `memory`, laid out as its [`PagedLayout`] says, position `p` in
/// block `block_table[p / block_size]`.
#[derive(Debug, Clone)]
pub struct PagedKv<M> {
    layout: PagedLayout,
    memory: M,
    block_table: Vec<usize>,
}

impl<M: KvMemory> PagedKv<M> {
    /// The cache of `layout` in `memory`, through `block_table`.
    pub fn new(layout: PagedLayout, memory: M, block_table: Vec<usize>) -> Self {
        PagedKv {
            layout,
            memory,
            block_table,
        }
    }

    /// Region and offset of `head`'s K or V (`half`) at `position` of `layer`.
    fn locate(&self, layer: usize, half: usize, head: usize, position: usize) -> (usize, usize) {
        let size = self.layout.block_size;
        let block = *self.block_table.get(position / size).unwrap_or_else(|| {
            panic!(
                "position {position} lies past the block table's {} blocks",
                self.block_table.len()
            )
        });
        self.layout
            .locate(layer, half, head, block, position % size)
    }

    fn store_half(&mut self, layer: usize, half: usize, head: usize, position: usize, x: &[f32]) {
        let (region, offset) = self.locate(layer, half, head, position);
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.memory.write(region, offset, &bytes);
    }

    fn load_half(&self, layer: usize, half: usize, head: usize, position: usize, x: &mut [f32]) {
        let (region, offset) = self.locate(layer, half, head, position);
        let mut bytes = vec![0u8; std::mem::size_of_val(x)];
        self.memory.read(region, offset, &mut bytes);
        for (v, b) in x.iter_mut().zip(bytes.chunks_exact(4)) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}

impl<M: KvMemory> KvCache for PagedKv<M> {
    fn heads(&self) -> Range<usize> {
        self.layout.heads.clone()
    }

    fn store(&mut self, layer: usize, head: usize, position: usize, key: &[f32], value: &[f32]) {
        self.store_half(layer, 0, head, position, key);
        self.store_half(layer, 1, head, position, value);
    }

    fn load(&self, layer: usize, head: usize, position: usize, key: &mut [f32], value: &mut [f32]) {
        self.load_half(layer, 0, head, position, key);
        self.load_half(layer, 1, head, position, value);
    }
}

//! A KV cache in blocks of a [`KvCacheSpec`]'s layout, reached through a block table: where
//! each layer's K and V of a head and token sit in a rank's registered regions.

use std::ops::Range;

use nixl_connector::{KvAttention, KvCacheSpec, KvLayout, KvRegion, KvRegionKind};

use crate::config::ModelConfig;
use crate::group_regions::GroupRegions;
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
    /// One region per layer ([`KvRegionKind::Tensor`]) of one latent per token
    /// ([`KvAttention::Mla`], the model's [`ModelConfig::latent_dim`]), stored as the one
    /// head's K with an empty V.
    Latent,
}

impl KvPacking {
    /// Regions per layer.
    pub(crate) fn regions_per_layer(self) -> usize {
        match self {
            KvPacking::Separate => 2,
            KvPacking::Packed | KvPacking::Halves | KvPacking::Latent => 1,
        }
    }

    /// What each of a layer's regions holds, and its bytes per head and token.
    fn region(self, head_bytes: usize) -> (KvRegionKind, usize) {
        match self {
            KvPacking::Packed => (KvRegionKind::Tensor, 2 * head_bytes),
            KvPacking::Halves => (KvRegionKind::KvHalves, head_bytes),
            KvPacking::Separate | KvPacking::Latent => (KvRegionKind::Tensor, head_bytes),
        }
    }
}

/// Where a rank's K and V bytes sit in its regions: the spec's layout and block size, the
/// packing, the rank's KV heads, and each layer's regions and KV cache group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedLayout {
    packing: KvPacking,
    /// Each layer's region slot (its regions are those of a layer of that index).
    slots: Vec<usize>,
    /// Each layer's KV cache group (the block table it reads).
    groups: Vec<usize>,
    layout: KvLayout,
    block_size: usize,
    heads: Range<usize>,
    head_bytes: usize,
    /// Bytes of one block of each region.
    block_lens: Vec<usize>,
}

impl PagedLayout {
    /// The spec rank caches of TP `tp` register for `config`: `num_blocks` blocks of
    /// `block_size` tokens per region, the regions as `packing` and `regions` say, in
    /// `layout` order.
    ///
    /// # Panics
    /// As [`GroupRegions::slots`].
    pub fn spec(
        config: &ModelConfig,
        packing: KvPacking,
        regions: GroupRegions,
        layout: KvLayout,
        block_size: usize,
        num_blocks: usize,
        tp: usize,
    ) -> KvCacheSpec {
        let heads = kv_heads_of_rank(config.kv_heads, 0, tp).len();
        let (kind, unit) = packing.region(config.head_bytes());
        let block_len = kind_parts(kind) * heads * block_size * unit;
        let slots = regions.slots(config).last().map_or(0, |last| last + 1);
        KvCacheSpec {
            num_blocks,
            block_size,
            attention: match packing {
                KvPacking::Latent => KvAttention::Mla,
                _ => KvAttention::Mha {
                    total_kv_heads: config.kv_heads,
                },
            },
            layout,
            regions: vec![KvRegion { block_len, kind }; slots * packing.regions_per_layer()],
        }
    }

    /// The layout of rank `rank` of TP `tp` of `config` in a cache of `spec`, whose regions
    /// `packing` and `regions` describe.
    ///
    /// # Errors
    /// A description of the first thing in `spec` that does not fit: its attention, its
    /// region count, or a region's kind or block length.
    ///
    /// # Panics
    /// As [`GroupRegions::slots`].
    pub fn new(
        config: &ModelConfig,
        spec: &KvCacheSpec,
        packing: KvPacking,
        regions: GroupRegions,
        rank: usize,
        tp: usize,
    ) -> Result<Self, String> {
        if (packing == KvPacking::Latent) != config.latent_dim.is_some() {
            return Err(format!(
                "{packing:?} packing for a model with latent {:?}",
                config.latent_dim
            ));
        }
        let want = Self::spec(
            config,
            packing,
            regions,
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
                "{} regions instead of {} ({packing:?} packing of {} layers, {regions:?} regions)",
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
            slots: regions.slots(config),
            groups: (0..config.layers)
                .map(|layer| config.group_of_layer(layer))
                .collect(),
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
            KvPacking::Halves | KvPacking::Separate | KvPacking::Latent => self.head_bytes,
        };
        let slot = match self.layout {
            KvLayout::Hnd => local_head * self.block_size + token,
            KvLayout::Nhd => token * heads + local_head,
        };
        let layer_slot = self.slots[layer];
        let (region, within) = match self.packing {
            KvPacking::Packed => (layer_slot, slot * unit + half * self.head_bytes),
            KvPacking::Halves => (
                layer_slot,
                half * self.block_lens[layer_slot] / 2 + slot * unit,
            ),
            KvPacking::Separate => (2 * layer_slot + half, slot * unit),
            KvPacking::Latent => (layer_slot, slot * unit),
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

/// A rank's KV cache in `memory`, laid out as its [`PagedLayout`] says, position `p` of a
/// layer of KV cache group `g` in block `block_tables[g][p / block_size]`.
#[derive(Debug, Clone)]
pub struct PagedKv<M> {
    layout: PagedLayout,
    memory: M,
    block_tables: Vec<Vec<usize>>,
}

impl<M: KvMemory> PagedKv<M> {
    /// The cache of `layout` in `memory`, through `block_tables`, one per KV cache group.
    ///
    /// # Panics
    /// If some layer's group has no block table.
    pub fn new(layout: PagedLayout, memory: M, block_tables: Vec<Vec<usize>>) -> Self {
        let groups = layout.groups.iter().max().map_or(0, |last| last + 1);
        assert!(
            block_tables.len() >= groups,
            "{} block tables for {groups} KV cache groups",
            block_tables.len()
        );
        PagedKv {
            layout,
            memory,
            block_tables,
        }
    }

    /// Region and offset of `head`'s K or V (`half`) at `position` of `layer`.
    fn locate(&self, layer: usize, half: usize, head: usize, position: usize) -> (usize, usize) {
        let size = self.layout.block_size;
        let table = &self.block_tables[self.layout.groups[layer]];
        let block = *table.get(position / size).unwrap_or_else(|| {
            panic!(
                "position {position} of layer {layer} lies past its block table's {} blocks",
                table.len()
            )
        });
        self.layout
            .locate(layer, half, head, block, position % size)
    }

    fn store_half(&mut self, layer: usize, half: usize, head: usize, position: usize, x: &[f32]) {
        if x.is_empty() {
            return;
        }
        let (region, offset) = self.locate(layer, half, head, position);
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.memory.write(region, offset, &bytes);
    }

    fn load_half(&self, layer: usize, half: usize, head: usize, position: usize, x: &mut [f32]) {
        if x.is_empty() {
            return;
        }
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

//! Where a hybrid model's KV cache groups keep their layers' K and V in the registered
//! regions, and the connector's [`KvCacheGroups`] that say so.

use nixl_connector::{KvCacheGroupKind, KvCacheGroups};

use crate::config::ModelConfig;
use crate::paged::KvPacking;

/// How the layers of a model's KV cache groups map onto regions (vLLM's hybrid KV cache
/// manager). Each group reads its own block table; a model of one group reads the same
/// regions either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupRegions {
    /// Every layer has regions of its own, each region its layer's group's (vLLM's
    /// `region_group_ids` naming a group per region).
    Own,
    /// Layer `i` of every group shares one layer's regions (vLLM 0.33's shared regions,
    /// `_SHARED_REGION_GROUP_ID`): model layer `l` sits in the regions of slot
    /// `l / groups`, in its group's blocks.
    Shared,
}

impl GroupRegions {
    /// The region slot (a layer's worth of regions) of each of `config`'s layers.
    ///
    /// # Panics
    /// If the groups share regions and do not have as many layers each.
    pub fn slots(self, config: &ModelConfig) -> Vec<usize> {
        let groups = config.kv_cache_groups();
        match self {
            GroupRegions::Own => (0..config.layers).collect(),
            GroupRegions::Shared => {
                assert_eq!(
                    config.layers % groups,
                    0,
                    "{} layers do not split into {groups} groups of as many layers",
                    config.layers
                );
                (0..config.layers).map(|layer| layer / groups).collect()
            }
        }
    }

    /// The connector's KV cache groups of `config` over blocks of `block_size` tokens, its
    /// regions laid out as `packing` says: full attention, and with a sliding window a
    /// second group of it, each region's group named when regions are the layers' own.
    ///
    /// # Panics
    /// If the connector refuses the groups (a window or block size of 0 tokens).
    pub fn kv_cache_groups(
        self,
        config: &ModelConfig,
        packing: KvPacking,
        block_size: usize,
    ) -> KvCacheGroups {
        let mut kinds = vec![KvCacheGroupKind::FullAttention];
        if let Some(window_tokens) = config.sliding_window {
            kinds.push(KvCacheGroupKind::SlidingWindow { window_tokens });
        }
        let groups = KvCacheGroups::new(block_size, kinds).expect("the model's KV cache groups");
        if self == GroupRegions::Shared || config.kv_cache_groups() == 1 {
            return groups;
        }
        let region_groups = (0..config.layers)
            .flat_map(|layer| {
                let group = config.group_of_layer(layer) as i64;
                std::iter::repeat(group).take(packing.regions_per_layer())
            })
            .collect();
        groups
            .with_region_groups(region_groups)
            .expect("each region's group")
    }
}

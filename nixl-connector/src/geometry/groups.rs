//! Hybrid models: the KV cache groups of an engine and the block ids of a request as one
//! list per group (see [`KvCacheGroups`]).

use serde::{Deserialize, Serialize};

use nixl::kv_config::KvTransferConfig;

use crate::error::{Error, Result};
use crate::geometry::region_layers::{check_region_layers, RegionLayer};
use crate::geometry::ssm::{state_block, SsmState};

/// The `kv_connector_extra_config` key holding an engine's [`KvCacheGroups`] as JSON, e.g.
/// `{"block_size": 16, "groups": ["full_attention", {"sliding_window": {"window_tokens":
/// 4096}}]}`, or with an SSM (Mamba) group `{"block_size": 16, "groups": ["full_attention",
/// {"ssm": {"speculative_blocks": 0}}], "ssm_state": {"conv_bytes": [4096, 256, 256],
/// "temporal_bytes": 65536}}` (see [`SsmState`]). Absent: one full-attention group.
pub const KV_CACHE_GROUPS_KEY: &str = "kv_cache_groups";

/// What a KV cache group's layers attend to (vLLM's `kv_cache_spec` of the group). Non-exhaustive:
/// vLLM adds kinds of groups over time, and so may this crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum KvCacheGroupKind {
    /// Every token of the sequence (vLLM's `FullAttentionSpec`, `MLAAttentionSpec`): every
    /// block is read.
    FullAttention,
    /// The last `window_tokens` tokens (vLLM's `SlidingWindowSpec`): only the blocks of the
    /// window are read.
    SlidingWindow {
        /// The window, in tokens (vLLM's `sliding_window`).
        window_tokens: usize,
    },
    /// The recurrent state of SSM (Mamba) layers (vLLM's `MambaSpec`): a request's state is
    /// one block, the only one read (vLLM's `clip_ssm_state_blocks`); its bytes are the
    /// groups' [`SsmState`] ([`KvCacheGroups::with_ssm_state`]). The state handed over is
    /// the one before the prompt's last token, which the decode computes itself
    /// ([`KvCacheGroups::prefill_backoff_tokens`]).
    Ssm {
        /// Speculative-decoding scratch blocks at the end of each request's list (vLLM's
        /// `num_speculative_blocks`), never read; 0 when absent from the JSON.
        #[serde(default)]
        speculative_blocks: usize,
    },
}

impl std::fmt::Display for KvCacheGroupKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvCacheGroupKind::FullAttention => f.write_str("full attention"),
            KvCacheGroupKind::SlidingWindow { window_tokens } => {
                write!(f, "sliding window of {window_tokens} tokens")
            }
            KvCacheGroupKind::Ssm { .. } => f.write_str("SSM (Mamba) state"),
        }
    }
}

/// An engine's KV cache groups, in vLLM's order (its `kv_cache_config.transfer_groups`
/// under the hybrid KV cache manager, `SupportsHMA`), all sharing the engine's registered
/// regions and block size. The default is one full-attention group: a model without hybrid
/// layers, whose requests' block ids are one list.
///
/// What is supported is what vLLM 0.33 ships for full-attention and sliding-window layers:
/// every group has as many layers, and layer `i` of each group shares one registered
/// tensor (vLLM's `_SHARED_REGION_GROUP_ID`, `-1`, in `region_group_ids`), so that a
/// group's block ids address every region, and the groups' ids never collide (one block
/// pool). A load then reads each group's blocks across every region (vLLM's
/// `_compute_desc_ids` without region group mapping: the groups' lists flattened).
///
/// A sliding-window group needs only the blocks of its window: both engines clip its list
/// to the last `ceil(window / block_size) + 1` blocks (vLLM's `get_exchange_clipped_blocks`
/// and `blocks_per_sw`), the prefill when it hands the params to the decode
/// ([`KvConnectorScheduler::request_finished_all_groups`](crate::KvConnectorScheduler::request_finished_all_groups)),
/// the decode when it schedules the load
/// ([`KvConnectorScheduler::update_state_after_alloc_groups`](crate::KvConnectorScheduler::update_state_after_alloc_groups)),
/// and each group's local blocks pair with the tail of its remote ones (vLLM's
/// `_apply_prefix_caching`, group by group).
///
/// Groups may also have regions of their own
/// ([`with_region_groups`](Self::with_region_groups), vLLM's `region_group_ids`): a group's
/// blocks are then read only in its regions and the shared ones.
///
/// Blocks of different sizes on the two engines are read as vLLM 0.33's pull connector
/// reads them, in both protocols: a decode block may hold several of the prefill's (vLLM's
/// `block_size_ratio`), and an engine's block id may be several kernel blocks (its
/// `physical_blocks_per_logical_kv_block`, the kernel's block smaller than the logical
/// one): a rank whose [`block_size`](Self::block_size) is a multiple of its registered
/// blocks' says that many in its handshake and reads its own block ids as that many
/// registered blocks each. Each engine clips a window group in its own blocks, and each
/// group's lists pair at their tokens of the prompt, which the prompt's
/// `remote_num_tokens` says (see
/// [`LoadSpec::local_group_lens`](crate::LoadSpec::local_group_lens)).
///
/// SSM (Mamba) groups ([`KvCacheGroupKind::Ssm`], with the [`SsmState`] of their blocks,
/// [`with_ssm_state`](Self::with_ssm_state)) are read in both protocols as vLLM 0.33 reads
/// them: each request's one state-bearing block (vLLM's `clip_ssm_state_blocks`, on both
/// engines), which pairs with the prefill's one whatever its token position and whatever
/// the engines' block sizes (a state block moves whole: vLLM's
/// `_map_block_ids_for_block_size_ratio` leaves SSM groups alone), its page a block id's
/// registered blocks when they are several (`_logical_to_kernel_block_ids` leaves SSM
/// groups alone too), in every region its conv sub-projections and temporal state as descriptors of their own after
/// every attention descriptor (vLLM's `_build_mamba_local` and `[descs_fa | descs_ssm]`),
/// each rank holding a TP-th of each part: a decode of a larger TP takes its slice of each
/// (`_build_mamba_remote`), one of a smaller TP takes each prefill rank's parts as its
/// slices (`_build_local_splits_from_plan`), every one of them, also those whose attention
/// is read from another rank of their group (MLA's latent, replicated KV heads: vLLM's
/// `source_ranks_per_group`); the attention groups' blocks in every region.
/// The prefill's state (vLLM's `ssm_sizes`; the native handshake's
/// [`ssm_state`](crate::HandshakeMessage::ssm_state), part by part) must be this engine's
/// scaled by the TP sizes.
///
/// Both protocols' handshakes say each rank's kernel blocks per block id and each region's
/// group (vLLM's `physical_blocks_per_logical_kv_block` and `region_group_ids`; the native
/// [`HandshakeMessage::blocks_per_id`](crate::HandshakeMessage::blocks_per_id) and
/// [`region_groups`](crate::HandshakeMessage::region_groups)), so all of this is read in
/// either. Engines of different kernel blocks per block id are read with SSM groups too,
/// each engine's state page its block id's kernel blocks and the attention paired at its
/// tokens, past a decode's prefix hit too (vLLM 0.33 reads them only without prefix
/// caching).
///
/// Not supported, refused by name: a prefill's (kernel) blocks larger than the decode's in
/// a load of several groups (vLLM 0.33's `TransferTopology.block_size_ratio` asserts that
/// the decode's block size is a multiple of the prefill's); and models of SSM groups only
/// (vLLM 0.33's handshake fails on them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "GroupsJson", into = "GroupsJson")]
pub struct KvCacheGroups {
    block_size: usize,
    kinds: Vec<KvCacheGroupKind>,
    /// Each region's group, or [`SHARED_REGION`]; empty: every region shared.
    region_groups: Vec<i64>,
    /// Each region's layers by name, with their groups; empty: not named.
    region_layers: Vec<Vec<RegionLayer>>,
    /// What a block of the SSM groups holds; `None` without SSM groups.
    pub(super) ssm_state: Option<SsmState>,
}

/// vLLM's `_SHARED_REGION_GROUP_ID`: the [`KvCacheGroups::region_groups`] entry of a region
/// that layers of several KV cache groups share.
pub const SHARED_REGION: i64 = -1;

/// The JSON shape of [`KvCacheGroups`], checked on the way in.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GroupsJson {
    block_size: usize,
    groups: Vec<KvCacheGroupKind>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    region_groups: Vec<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    region_layers: Vec<Vec<RegionLayer>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ssm_state: Option<SsmState>,
}

impl TryFrom<GroupsJson> for KvCacheGroups {
    type Error = Error;

    fn try_from(json: GroupsJson) -> Result<Self> {
        let groups = KvCacheGroups::new(json.block_size, json.groups)?
            .with_region_groups(json.region_groups)?
            .with_region_layers(json.region_layers)?;
        match json.ssm_state {
            Some(state) => groups.with_ssm_state(state),
            None => {
                groups.checked_ssm_state()?;
                Ok(groups)
            }
        }
    }
}

impl From<KvCacheGroups> for GroupsJson {
    fn from(groups: KvCacheGroups) -> Self {
        GroupsJson {
            block_size: groups.block_size,
            groups: groups.kinds,
            region_groups: groups.region_groups,
            region_layers: groups.region_layers,
            ssm_state: groups.ssm_state,
        }
    }
}

impl Default for KvCacheGroups {
    fn default() -> Self {
        KvCacheGroups {
            block_size: 1,
            kinds: vec![KvCacheGroupKind::FullAttention],
            region_groups: Vec::new(),
            region_layers: Vec::new(),
            ssm_state: None,
        }
    }
}

const OP: &str = "KV cache groups";

impl KvCacheGroups {
    /// Groups of `kinds`, in vLLM's group order, over blocks of `block_size` tokens.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no group, a block size or window of 0 tokens.
    pub fn new(block_size: usize, kinds: Vec<KvCacheGroupKind>) -> Result<Self> {
        if kinds.is_empty() {
            return Err(Error::invalid(OP, "at least one KV cache group is needed"));
        }
        if block_size == 0 {
            return Err(Error::invalid(OP, "block_size must be at least 1"));
        }
        if let Some(group) = kinds
            .iter()
            .position(|k| *k == KvCacheGroupKind::SlidingWindow { window_tokens: 0 })
        {
            return Err(Error::invalid(
                OP,
                format!("group {group}: a sliding window must hold at least 1 token"),
            ));
        }
        if kinds
            .iter()
            .all(|k| matches!(k, KvCacheGroupKind::Ssm { .. }))
        {
            return Err(Error::invalid(
                OP,
                "a model of SSM (Mamba) groups only is not supported: an SSM group is read beside an attention group",
            ));
        }
        Ok(KvCacheGroups {
            block_size,
            kinds,
            region_groups: Vec::new(),
            region_layers: Vec::new(),
            ssm_state: None,
        })
    }

    /// The groups with the group of each registered region, in registration order (vLLM's
    /// `region_group_ids`): a group's number, or [`SHARED_REGION`] for a region that layers
    /// of several groups share. A group's blocks are read only in its regions and the shared
    /// ones (vLLM's `_compute_desc_ids` with region group mapping); with SSM groups, the
    /// attention groups' in every region and the SSM state in the SSM groups' regions and
    /// the shared ones (vLLM's `_compute_desc_ids` with Mamba groups, reading the state in
    /// its `_ssm_region_indices`). Both engines must have the same, which a decode checks in
    /// the handshake (either protocol's says them). Empty: every region is shared.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an entry that is neither a group nor
    /// [`SHARED_REGION`].
    pub fn with_region_groups(mut self, region_groups: Vec<i64>) -> Result<Self> {
        let groups = self.len();
        if let Some(region) = region_groups
            .iter()
            .position(|&g| g != SHARED_REGION && usize::try_from(g).map_or(true, |g| g >= groups))
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "region {region}: group {} is not one of the {groups} groups, nor {SHARED_REGION} (shared)",
                    region_groups[region]
                ),
            ));
        }
        self.region_groups = region_groups;
        Ok(self)
    }

    /// Each region's group (see [`with_region_groups`](Self::with_region_groups)); empty:
    /// every region shared.
    pub fn region_groups(&self) -> &[i64] {
        &self.region_groups
    }

    /// The groups with the layers of each registered region by name, in registration order,
    /// each with its group (vLLM's `region_members`, and its `transfer_group_index_by_layer`),
    /// e.g. `[[{"layer": "model.layers.0.attn", "group": 0}, {"layer":
    /// "model.layers.1.attn", "group": 1}], ...]`. A prefill of pipeline stages of a model of
    /// several groups needs them in push mode: each of its layers is written into the
    /// decode's region of the same name, with its group's blocks (see
    /// [`RegionLayer`]). Engines publish them in their handshake (vLLM's `region_members`).
    /// Empty: not named.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a group that is not one of these, a name twice, an
    /// empty region or name, or more than [`MAX_LAYER_NAMES`](crate::MAX_LAYER_NAMES).
    pub fn with_region_layers(mut self, region_layers: Vec<Vec<RegionLayer>>) -> Result<Self> {
        check_region_layers(&region_layers, self.len())?;
        self.region_layers = region_layers;
        Ok(self)
    }

    /// Each region's layers (see [`with_region_layers`](Self::with_region_layers)); empty:
    /// not named.
    pub fn region_layers(&self) -> &[Vec<RegionLayer>] {
        &self.region_layers
    }

    /// The layers' names of a rank of `regions` regions, as its handshake says them (vLLM's
    /// `region_members`): empty when not named.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when they are named for another number of regions.
    pub(crate) fn region_layer_names(&self, regions: usize) -> Result<Vec<Vec<String>>> {
        if !self.region_layers.is_empty() && self.region_layers.len() != regions {
            return Err(Error::invalid(
                OP,
                format!(
                    "region_layers names the layers of {} regions, {regions} are registered",
                    self.region_layers.len()
                ),
            ));
        }
        Ok(self
            .region_layers
            .iter()
            .map(|region| region.iter().map(|l| l.layer.clone()).collect())
            .collect())
    }

    /// The group of each named layer, region by region (as
    /// [`LayerRoute::local_layer`](crate::LayerRoute::local_layer) counts them).
    pub(crate) fn layer_groups(&self) -> Vec<i64> {
        self.region_layers
            .iter()
            .flatten()
            .map(|l| l.group as i64)
            .collect()
    }

    /// Whether some region belongs to one group only (its blocks are not read there for the
    /// others).
    pub fn has_regions_of_their_own(&self) -> bool {
        self.region_groups.iter().any(|&g| g != SHARED_REGION) && self.len() > 1
    }

    /// [`region_groups`](Self::region_groups) when some region is one group's only (then a
    /// group's blocks are read in its regions and the shared ones); empty otherwise.
    pub(crate) fn own_region_groups(&self) -> &[i64] {
        if self.has_regions_of_their_own() {
            &self.region_groups
        } else {
            &[]
        }
    }

    /// Registered (kernel) blocks per block id of an engine whose registered blocks hold
    /// `kernel_block_size` tokens: the groups' [`block_size`](Self::block_size) over it
    /// (vLLM's `physical_blocks_per_logical_kv_block`, the attention kernel's block smaller
    /// than the logical one, as vLLM's hybrid KV cache manager allows; the handshake says
    /// it), 1 when not larger.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the groups' block size is larger and not a multiple.
    pub(crate) fn kernel_blocks_per_id(&self, kernel_block_size: usize) -> Result<usize> {
        let (logical, kernel) = (self.block_size, kernel_block_size);
        if logical <= kernel {
            return Ok(1);
        }
        if kernel == 0 || logical % kernel != 0 {
            return Err(Error::invalid(
                "describe the KV cache's blocks",
                format!(
                    "kv_cache_groups.block_size {logical} is not a multiple of the registered blocks' {kernel} tokens (vLLM's physical_blocks_per_logical_kv_block is a whole number)"
                ),
            ));
        }
        Ok(logical / kernel)
    }

    /// The `region_group_ids` a rank of `regions` regions publishes in vLLM's metadata (and
    /// the native handshake's [`region_groups`](crate::HandshakeMessage::region_groups)):
    /// [`region_groups`](Self::region_groups) when given, else every region the one group's
    /// (0) or shared ([`SHARED_REGION`]) by several.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the region groups are not one per region.
    pub(crate) fn region_group_ids(&self, regions: usize) -> Result<Vec<i64>> {
        if self.region_groups.is_empty() {
            let id = if self.len() > 1 { SHARED_REGION } else { 0 };
            return Ok(vec![id; regions]);
        }
        if self.region_groups.len() != regions {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} region groups for {regions} registered regions",
                    self.region_groups.len()
                ),
            ));
        }
        Ok(self.region_groups.clone())
    }

    /// The groups `kv_connector_extra_config.kv_cache_groups` holds ([`KV_CACHE_GROUPS_KEY`]),
    /// or one full-attention group without it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming what is wrong, e.g. a kind of group that is not
    /// supported, or SSM groups without their state.
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Self> {
        match config.kv_connector_extra_config.get(KV_CACHE_GROUPS_KEY) {
            None => Ok(KvCacheGroups::default()),
            Some(value) => serde_json::from_value(value.clone()).map_err(|err| {
                Error::invalid(
                    OP,
                    format!(
                        "kv_connector_extra_config.{KV_CACHE_GROUPS_KEY}: {err}; only \
                         full_attention, sliding_window and ssm groups are supported (ssm with \
                         an ssm_state)"
                    ),
                )
            }),
        }
    }

    /// The groups' kinds, in order.
    pub fn kinds(&self) -> &[KvCacheGroupKind] {
        &self.kinds
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Never: there is at least one group.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether these are one full-attention group (a model without hybrid layers: nothing
    /// is clipped).
    pub fn is_single_full_attention(&self) -> bool {
        self.kinds == [KvCacheGroupKind::FullAttention]
    }

    /// Blocks group `group` needs of a request, from its last (vLLM's `blocks_per_sw`:
    /// `ceil(window / block_size) + 1`, the window seldom starting on a block's first
    /// token), or 1 for an SSM group (its state block, before its speculative ones);
    /// `None`: every block.
    pub fn blocks_needed(&self, group: usize) -> Option<usize> {
        match self.kinds.get(group)? {
            KvCacheGroupKind::FullAttention => None,
            KvCacheGroupKind::SlidingWindow { window_tokens } => {
                Some(window_tokens.div_ceil(self.block_size).saturating_add(1))
            }
            // The state-bearing block, not always the last (see `clip`).
            KvCacheGroupKind::Ssm { .. } => Some(1),
        }
    }

    /// A request's block ids, one list per group, clipped to what each group needs (vLLM's
    /// `get_exchange_clipped_blocks`): a sliding-window group keeps its last
    /// [`blocks_needed`](Self::blocks_needed), an SSM group the block holding its running
    /// state, the last before its speculative scratch blocks. No list at all (vLLM's empty tuple, a full
    /// prefix hit) is every group empty.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lists are not one per group.
    pub fn clip<'a, G: AsRef<[usize]>>(
        &self,
        request_id: &str,
        block_ids: &'a [G],
    ) -> Result<Vec<&'a [usize]>> {
        if block_ids.is_empty() {
            return Ok(vec![&[]; self.len()]);
        }
        if block_ids.len() != self.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "request {request_id:?}: {} lists of block ids for {} KV cache groups ({}); pass one list per group, in the groups' order",
                    block_ids.len(),
                    self.len(),
                    self.describe()
                ),
            ));
        }
        Ok(block_ids
            .iter()
            .enumerate()
            .map(|(group, ids)| {
                let ids = ids.as_ref();
                if let KvCacheGroupKind::Ssm { speculative_blocks } = self.kinds[group] {
                    return state_block(ids, speculative_blocks);
                }
                match self.blocks_needed(group) {
                    Some(n) if ids.len() > n => &ids[ids.len() - n..],
                    _ => ids,
                }
            })
            .collect())
    }

    /// The kinds, for messages.
    fn describe(&self) -> String {
        let kinds: Vec<String> = self.kinds.iter().map(ToString::to_string).collect();
        kinds.join(", ")
    }
}

/// Lists of block ids as one list and each list's length, as
/// [`KvTransferParams::remote_block_group_lens`](crate::KvTransferParams::remote_block_group_lens)
/// has them.
pub(crate) fn flatten(groups: &[&[usize]]) -> (Vec<usize>, Vec<usize>) {
    (
        groups.concat(),
        groups.iter().map(|group| group.len()).collect(),
    )
}

/// `ids` split into lists of `lens` (no length: one list).
///
/// # Errors
/// [`Error::InvalidArgument`] when the lengths do not add up to the ids.
pub(crate) fn split<'a>(ids: &'a [usize], lens: &[usize]) -> Result<Vec<&'a [usize]>> {
    if lens.is_empty() {
        return Ok(vec![ids]);
    }
    let total = lens.iter().try_fold(0usize, |sum, &n| sum.checked_add(n));
    if total != Some(ids.len()) {
        return Err(Error::invalid(
            "read the block ids of KV cache groups",
            format!(
                "remote_block_group_lens {lens:?} do not add up to the {} remote_block_ids",
                ids.len()
            ),
        ));
    }
    let mut rest = ids;
    Ok(lens
        .iter()
        .map(|&n| {
            let (group, tail) = rest.split_at(n);
            rest = tail;
            group
        })
        .collect())
}

/// The pairs each region reads, for `region_groups` (each region's group, or
/// [`SHARED_REGION`]): a region of one group reads that group's pairs, a shared one every
/// pair; `pairs` holds each group's in turn, `group_lens` of them (vLLM's `_compute_desc_ids`
/// with region group mapping).
///
/// # Errors
/// [`Error::InvalidArgument`] when the counts do not add up to the pairs, or a region names
/// a group the load has not.
pub(crate) fn pairs_by_region<'a>(
    pairs: &'a [(usize, usize)],
    group_lens: &[usize],
    region_groups: &[i64],
) -> Result<Vec<&'a [(usize, usize)]>> {
    const OP: &str = "read the blocks of KV cache groups";
    let mut groups = Vec::with_capacity(group_lens.len());
    let mut rest = pairs;
    for &n in group_lens {
        if n > rest.len() {
            return Err(Error::invalid(
                OP,
                format!("group counts {group_lens:?} for {} pairs", pairs.len()),
            ));
        }
        let (group, tail) = rest.split_at(n);
        groups.push(group);
        rest = tail;
    }
    region_groups
        .iter()
        .enumerate()
        .map(|(region, &g)| {
            if g == SHARED_REGION {
                return Ok(pairs);
            }
            usize::try_from(g)
                .ok()
                .and_then(|g| groups.get(g).copied())
                .ok_or_else(|| {
                    Error::invalid(
                        OP,
                        format!(
                            "region {region} is group {g}'s, the load has {} groups",
                            group_lens.len()
                        ),
                    )
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma_like() -> KvCacheGroups {
        KvCacheGroups::new(
            16,
            vec![
                KvCacheGroupKind::FullAttention,
                KvCacheGroupKind::SlidingWindow { window_tokens: 32 },
            ],
        )
        .unwrap()
    }

    #[test]
    fn a_block_id_is_a_whole_number_of_kernel_blocks() {
        let groups = |block_size| {
            KvCacheGroups::new(block_size, vec![KvCacheGroupKind::FullAttention]).unwrap()
        };
        assert_eq!(groups(32).kernel_blocks_per_id(16).unwrap(), 2);
        assert_eq!(groups(1).kernel_blocks_per_id(16).unwrap(), 1);
        let err = groups(24).kernel_blocks_per_id(16).unwrap_err().to_string();
        assert!(err.contains("block_size 24 is not a multiple"), "{err}");
    }

    #[test]
    fn a_sliding_window_group_keeps_its_last_blocks() {
        let groups = gemma_like();
        // 32 tokens of 16: 2 blocks, and one more for a window that starts inside a block.
        assert_eq!(groups.blocks_needed(1), Some(3));
        assert_eq!(groups.blocks_needed(0), None);
        let ids = [vec![1, 2, 3, 4, 5], vec![0, 0, 8, 9, 10]];
        let clipped = groups.clip("r", &ids).unwrap();
        assert_eq!(clipped, [&[1, 2, 3, 4, 5][..], &[8, 9, 10][..]]);
        // Short lists are kept whole; no list is every group empty.
        let short = [vec![1], vec![2]];
        assert_eq!(groups.clip("r", &short).unwrap(), [&[1][..], &[2][..]]);
        let none: [Vec<usize>; 0] = [];
        let empty: &[usize] = &[];
        assert_eq!(groups.clip("r", &none).unwrap(), [empty, empty]);
        let err = groups.clip("r", &[vec![1]]).unwrap_err().to_string();
        assert!(
            err.contains("1 lists of block ids for 2 KV cache groups"),
            "{err}"
        );
        assert!(err.contains("sliding window of 32 tokens"), "{err}");
    }

    #[test]
    fn groups_parse_from_the_extra_config_and_refuse_what_is_not_supported() {
        let mut kv = KvTransferConfig::default();
        assert!(KvCacheGroups::from_kv_transfer_config(&kv)
            .unwrap()
            .is_single_full_attention());
        kv.kv_connector_extra_config.insert(
            KV_CACHE_GROUPS_KEY.into(),
            serde_json::json!({"block_size": 16, "groups": ["full_attention", {"sliding_window": {"window_tokens": 32}}]}),
        );
        assert_eq!(
            KvCacheGroups::from_kv_transfer_config(&kv).unwrap(),
            gemma_like()
        );
        for (json, want) in [
            (
                serde_json::json!({"block_size": 16, "groups": ["full_attention", "mamba"]}),
                "unknown variant `mamba`",
            ),
            (
                serde_json::json!({"block_size": 16, "groups": []}),
                "at least one KV cache group",
            ),
            (
                serde_json::json!({"block_size": 16, "groups": [{"sliding_window": {"window_tokens": 0}}]}),
                "group 0: a sliding window must hold at least 1 token",
            ),
        ] {
            kv.kv_connector_extra_config
                .insert(KV_CACHE_GROUPS_KEY.into(), json);
            let err = KvCacheGroups::from_kv_transfer_config(&kv)
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err}");
            assert!(
                err.contains("only full_attention, sliding_window and ssm groups are supported"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_region_of_one_group_reads_that_groups_pairs_only() {
        let pairs = [(1, 7), (2, 8), (3, 9)];
        let by_region = pairs_by_region(&pairs, &[2, 1], &[0, SHARED_REGION, 1]).unwrap();
        assert_eq!(
            by_region,
            [&pairs[..2], &pairs[..], &pairs[2..]],
            "group 0, shared, group 1"
        );
        let err = pairs_by_region(&pairs, &[2, 1], &[2])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("region 0 is group 2's, the load has 2 groups"),
            "{err}"
        );
        assert!(pairs_by_region(&pairs, &[4], &[0]).is_err());
    }

    #[test]
    fn region_groups_name_a_group_or_shared() {
        let groups = gemma_like().with_region_groups(vec![0, 1, -1]).unwrap();
        assert!(groups.has_regions_of_their_own());
        assert_eq!(groups.region_groups(), [0, 1, -1]);
        let err = gemma_like()
            .with_region_groups(vec![0, 2])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("region 1: group 2 is not one of the 2 groups"),
            "{err}"
        );
    }

    #[test]
    #[cfg(feature = "vllm")]
    fn a_rank_publishes_each_regions_group() {
        let groups = gemma_like().with_region_groups(vec![0, 1, -1]).unwrap();
        assert_eq!(groups.region_group_ids(3).unwrap(), [0, 1, -1]);
        assert!(groups.region_group_ids(2).is_err());
        assert_eq!(gemma_like().region_group_ids(2).unwrap(), [-1, -1]);
        assert_eq!(
            KvCacheGroups::default().region_group_ids(2).unwrap(),
            [0, 0]
        );
    }

    #[test]
    fn lists_flatten_and_split_back() {
        let (flat, lens) = flatten(&[&[1, 2], &[], &[7]]);
        assert_eq!(
            (flat.as_slice(), lens.as_slice()),
            (&[1, 2, 7][..], &[2, 0, 1][..])
        );
        let empty: &[usize] = &[];
        assert_eq!(split(&flat, &lens).unwrap(), [&[1, 2][..], empty, &[7][..]]);
        assert_eq!(split(&flat, &[]).unwrap(), [&[1, 2, 7][..]]);
        let err = split(&flat, &[2, 2]).unwrap_err().to_string();
        assert!(err.contains("do not add up to the 3"), "{err}");
        assert!(split(&flat, &[usize::MAX, 4]).is_err());
    }
}

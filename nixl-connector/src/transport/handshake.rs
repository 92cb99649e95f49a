//! The handshake message two engines exchange, and the check that refuses a peer whose KV
//! cache cannot be transferred with ours.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::geometry::dcp::DcpSizes;
use crate::geometry::groups::KvCacheGroups;
use crate::geometry::pipeline::{shared_regions, StageOfRank};
use crate::geometry::read_plan::ReadPlan;
use crate::geometry::region_layers::{route_by_layer_name, LayerRoute};
use crate::geometry::spec::{KvAttention, KvCacheSpec};
use crate::geometry::ssm::SsmState;
use crate::geometry::tp_mapping::Share;
use crate::transport::release_marks::ReleaseMarks;

/// Version of the side-channel protocol and handshake; peers of another version are refused.
/// 3: the handshake says the rank's SSM (Mamba) state, each region's KV cache group and its
/// kernel blocks per block id ([`HandshakeMessage::ssm_state`], `region_groups`,
/// `blocks_per_id`). 4: finish notifications and heartbeats carry a tag of the request's
/// [`Capability`](crate::Capability), which a version-3 prefill would not parse and a
/// version-4 one requires. 5: the handshake names the rank's [`ReleaseMarks`] and the params
/// a request's lease epoch, which a reader checks after its READ.
pub const PROTOCOL_VERSION: u32 = 5;

/// Most registered (kernel) blocks per block id a peer may declare (its
/// [`HandshakeMessage::blocks_per_id`], vLLM's `physical_blocks_per_logical_kv_block`).
pub const MAX_BLOCKS_PER_ID: u64 = 1 << 10;

/// Most descriptors either list of a READ plan may have (regions × blocks × pieces of a
/// block, on the peer's side or, split to the peer's block size, on ours); a peer whose
/// geometry needs more is refused before anything is allocated for it.
pub const MAX_REMOTE_DESCRIPTORS: usize = 1 << 22;

/// What an engine's TP rank tells a peer about itself and its KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandshakeMessage {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol_version: u32,
    /// The sending engine's id.
    pub engine_id: String,
    /// The sender's NIXL agent name.
    pub agent_name: String,
    /// The sender's NIXL agent metadata.
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// Base address of each region.
    pub region_base_addrs: Vec<u64>,
    /// The sender's KV cache: blocks, tokens per block, attention, layout, and each region's
    /// block length.
    pub spec: KvCacheSpec,
    /// Device id NIXL uses for the memory.
    pub device_id: u64,
    /// The sender's TP rank.
    pub tp_rank: u64,
    /// The sender's TP size.
    pub tp_size: u64,
    /// What a block of the sender's SSM (Mamba) KV cache groups holds per rank, its
    /// [`KvCacheGroups::ssm_state`](crate::KvCacheGroups::ssm_state); `None` without SSM
    /// groups. A reader's must be the source's scaled by the TP sizes.
    #[serde(default)]
    pub ssm_state: Option<SsmState>,
    /// Each region's KV cache group (vLLM's `region_group_ids`: a group's number, or
    /// [`SHARED_REGION`](crate::SHARED_REGION) for a region that layers of several groups
    /// share); every region the same when no region is one group's only. When either side's
    /// differ between regions, both sides' must be the same.
    #[serde(default)]
    pub region_groups: Vec<i64>,
    /// Each region's layers by name (vLLM's `region_members`;
    /// [`KvCacheGroups::region_layers`](crate::KvCacheGroups::region_layers)); empty: not
    /// named. Where a side has several pipeline stages of a model of several KV cache groups
    /// (or both sides name their layers), regions pair by layer name
    /// ([`LayerRoute`](crate::LayerRoute)), and both sides must name them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub region_layers: Vec<Vec<String>>,
    /// Registered (kernel) blocks per block id of the sender's transfer params (vLLM's
    /// `physical_blocks_per_logical_kv_block`: its KV cache groups' block size over its
    /// registered blocks'), 1 to [`MAX_BLOCKS_PER_ID`].
    #[serde(default = "one_block_per_id")]
    pub blocks_per_id: u64,
    /// The sender's pipeline stage (vLLM's `pp_rank`; 0 without pipeline parallelism).
    #[serde(default)]
    pub pp_rank: u64,
    /// Layers per pipeline stage of the sender's engine (see
    /// [`PipelineStages`](crate::PipelineStages)); empty: one stage, holding every layer.
    /// A reader reads from each stage the regions of the layers both hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pp_partition: Vec<u64>,
    /// The sender's engine's decode context parallel size (vLLM's `dcp_size`; 1: none): its
    /// rank holds the global block positions of DCP rank `tp_rank % dcp_size` (see
    /// [`DcpPair`](crate::DcpPair)).
    #[serde(default = "one_dcp_rank")]
    pub dcp_size: u64,
    /// A reader's claims on requests the sender keeps for a read-back (multi-turn, native
    /// protocol): each must be answered in [`claimed`](Self::claimed) before the reader
    /// reads, so that the sender never releases early a request that may be read. Empty in
    /// a plain handshake.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<KeptClaim>,
    /// The answer to a reader's [`claims`](Self::claims): the request ids the sender still
    /// holds and now keeps for that reader until its finish notification or the end of a
    /// lease its heartbeats extend. A claimed id missing here is gone (its TTL ended, or it
    /// was evicted or never kept): the reader must not read it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claimed: Vec<String>,
    /// Where the sender keeps its release marks (native protocol; see
    /// [`ReleaseMarks`](crate::ReleaseMarks)): a reader READs them after its
    /// data READ to know that the blocks it read were not released first. `None` in vLLM
    /// mode, or where a reader handshakes.
    #[serde(default)]
    pub release_marks: Option<ReleaseMarks>,
}

/// A reader's claim on a request kept for a read-back: its id on the keeping engine, and the
/// heartbeat tag of the request's [`Capability`](crate::Capability) for the reader's agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptClaim {
    /// The request id on the keeping engine.
    pub request_id: String,
    /// The tag that proves the reader got the request's params.
    pub tag: String,
}

/// [`HandshakeMessage::blocks_per_id`] of a message that does not say it.
fn one_block_per_id() -> u64 {
    1
}

/// [`HandshakeMessage::dcp_size`] of a message that does not say it.
fn one_dcp_rank() -> u64 {
    1
}

/// Checks that `local` (the reader) can read `remote`'s blocks, and says how.
///
/// With pipeline parallelism on either side, only the regions of the layers both ranks hold
/// are compared and read ([`PipelineStages`](crate::PipelineStages)); a source holding none
/// of the reader's layers is only notified ([`Share::NotifiedOnly`]).
///
/// Refused, with both values in the message: another protocol version; a different engine
/// or `(pp_rank, tp_rank)` than expected; stages that do not pair (different layer counts,
/// regions not a whole number per layer, or a different number per layer); a spec that is
/// not valid; another attention, region count or layout; SSM (Mamba) state on one side
/// only, or a source's that is not the reader's scaled by the TP sizes; region groups not one per region, or different on the two sides when
/// either has regions of their own; kernel blocks per block id outside 1 to
/// `MAX_BLOCKS_PER_ID`; block sizes or TP sizes of which neither divides the other; a source rank the
/// reader's [`TpMapping`](crate::TpMapping) does not name; the first region whose content
/// or bytes per token and head differ (see [`ReadPlan`]); NHD when heads must be split; a
/// cache needing more than [`MAX_REMOTE_DESCRIPTORS`] or whose addresses overflow; release
/// marks that are empty, too many or overflow ([`ReleaseMarks`]).
///
/// # Errors
/// [`Error::Incompatible`].
pub fn check_compatible(
    local: &HandshakeMessage,
    remote: &HandshakeMessage,
    expected_engine: Option<&str>,
    expected_rank: Option<(usize, usize)>,
) -> Result<ReadPlan> {
    let refuse = |reason: String| Error::Incompatible {
        reader: rank_name(local),
        source_rank: rank_name(remote),
        reason,
    };
    let mismatch = peer_mismatch(local, remote, expected_engine, expected_rank)
        .or_else(|| message_mismatch(local, remote))
        .or_else(|| ssm_mismatch(local, remote))
        .or_else(|| groups_mismatch(local, remote))
        .or_else(|| dcp_mismatch(local, remote));
    if let Some(why) = mismatch {
        return Err(refuse(why));
    }
    let dcp = dcp_sizes(local, remote);
    let (ours, theirs, plan) = match layer_routes(local, remote).map_err(refuse)? {
        Some(routes) => {
            let ours = local.spec.regions_at(routes.iter().map(|r| r.local_region));
            let theirs = remote
                .spec
                .regions_at(routes.iter().map(|r| r.remote_region));
            let mut plan =
                ReadPlan::new(&ours, tp(local), &theirs, tp(remote), dcp).map_err(refuse)?;
            if routes.is_empty() {
                plan.share = Share::NotifiedOnly;
                plan.regions.clear();
            }
            plan.layer_routes = routes;
            (ours, theirs, plan)
        }
        None => {
            let shared = shared_regions(stage_of(local), stage_of(remote)).map_err(refuse)?;
            let (ours, theirs) = (
                local.spec.regions_in(&shared.local),
                remote.spec.regions_in(&shared.remote),
            );
            let mut plan =
                ReadPlan::new(&ours, tp(local), &theirs, tp(remote), dcp).map_err(refuse)?;
            if shared.local.is_empty() {
                // No layer in common: the source is only notified.
                plan.share = Share::NotifiedOnly;
                plan.regions.clear();
            }
            plan.local_first_region = shared.local.start;
            plan.remote_first_region = shared.remote.start;
            (ours, theirs, plan)
        }
    };
    let marks = remote
        .release_marks
        .as_ref()
        .and_then(ReleaseMarks::invalid);
    if let Some(why) = size_mismatch(&ours, &theirs, &plan)
        .or_else(|| address_mismatch(remote))
        .or(marks)
    {
        return Err(refuse(why));
    }
    Ok(plan)
}

/// The layers of `local` and `remote` paired by name, where their regions pair that way: a
/// side of several pipeline stages, and either a model of several KV cache groups (a region
/// group other than 0 on either side: a hybrid model's stages, whose regions do not follow
/// the model's layer order, which vLLM's push aligns by `region_members`) or both sides
/// naming their layers. Then each layer's group is its own, and the engines' blocks must
/// hold as many tokens (vLLM: "Attention-HMA push requires identical P/D block sizes").
/// `None`: regions pair by stage offsets ([`shared_regions`]), as vLLM pairs the stages of a
/// model of one group, whatever names its metadata carries.
fn layer_routes(
    local: &HandshakeMessage,
    remote: &HandshakeMessage,
) -> std::result::Result<Option<Vec<LayerRoute>>, String> {
    let one_stage = |m: &HandshakeMessage| m.pp_partition.len() <= 1;
    if one_stage(local) && one_stage(remote) {
        return Ok(None);
    }
    let named = |m: &HandshakeMessage| !m.region_layers.is_empty();
    let hybrid = |m: &HandshakeMessage| m.region_groups.iter().any(|&g| g != 0);
    let by_name = hybrid(local) || hybrid(remote) || (named(local) && named(remote));
    if !by_name {
        return Ok(None);
    }
    for (whose, message) in [("reader", local), ("source", remote)] {
        if !message.region_layers.is_empty()
            && message.region_layers.len() != message.spec.regions.len()
        {
            return Err(format!(
                "the {whose} names the layers of {} regions for {} regions",
                message.region_layers.len(),
                message.spec.regions.len()
            ));
        }
    }
    if local.spec.block_size != remote.spec.block_size {
        return Err(format!(
            "blocks of {} tokens (reader) vs {} (source): a hybrid model's pipeline stages pair by layer name with blocks of one size only (vLLM: Attention-HMA push requires identical P/D block sizes)",
            local.spec.block_size, remote.spec.block_size
        ));
    }
    if local.region_layers.is_empty() {
        return Err("the reader names no layer of its regions (kv_cache_groups.region_layers): a hybrid model's pipeline stages pair by layer name".to_string());
    }
    let routes = route_by_layer_name(
        (&local.region_layers, one_stage(local)),
        (&remote.region_layers, one_stage(remote)),
    )?;
    Ok(Some(routes))
}

/// The DCP sizes of a reader's message and a source's.
fn dcp_sizes(local: &HandshakeMessage, remote: &HandshakeMessage) -> DcpSizes {
    let size = |m: &HandshakeMessage| usize::try_from(m.dcp_size).unwrap_or(usize::MAX);
    DcpSizes {
        local: size(local),
        remote: size(remote),
    }
}

/// Why the two engines' decode context parallelism cannot pair, if it cannot, before any
/// READ (vLLM's `_validate_remote_parallel_config` and `_validate_remote_agent_handshake`,
/// with their reasons): DCP sizes that do not divide one another; with DCP on either side,
/// a DCP size that is neither 1 nor its engine's TP size (vLLM's `TransferTopology`
/// requires one or the other), a cache that is not MLA (vLLM's NixlConnector scopes DCP to
/// MLA), an SSM (Mamba) state (vLLM: hybrid MLA+Mamba needs equal DCP sizes; this
/// connector reads DCP for caches of one group only), several KV cache groups, or blocks of
/// different sizes (vLLM pairs DCP positions block for block).
fn dcp_mismatch(local: &HandshakeMessage, remote: &HandshakeMessage) -> Option<String> {
    let dcp = dcp_sizes(local, remote);
    if let Some(why) = dcp.mismatch() {
        return Some(why);
    }
    if !dcp.active() {
        return None;
    }
    for (whose, message, size) in [("reader", local, dcp.local), ("source", remote, dcp.remote)] {
        if size > 1 && message.tp_size != size as u64 {
            return Some(format!(
                "the {whose}'s DCP size {size} is neither 1 nor its TP size {}: vLLM's NixlConnector shards a cache over every TP rank or none",
                message.tp_size
            ));
        }
    }
    if local.spec.attention != KvAttention::Mla {
        return Some(format!(
            "decode context parallelism (local DCP={}, remote DCP={}) is supported for MLA caches only, as in vLLM's NixlConnector; this cache is {}",
            dcp.local, dcp.remote, local.spec.attention
        ));
    }
    if local.ssm_state.is_some() || remote.ssm_state.is_some() {
        if dcp.local != dcp.remote {
            return Some(format!(
                "Hybrid MLA+Mamba NIXL transfers require matching DCP sizes, got local={}, remote={}",
                dcp.local, dcp.remote
            ));
        }
        return Some("decode context parallelism with an SSM (Mamba) state is not supported by this connector".to_string());
    }
    let groups = |m: &HandshakeMessage| {
        let mut ids = m.region_groups.clone();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    };
    if groups(local) > 1 || groups(remote) > 1 {
        return Some("decode context parallelism with several KV cache groups is not supported by this connector (one group only)".to_string());
    }
    (local.spec.block_size != remote.spec.block_size).then(|| {
        format!(
            "DCP transfers pair blocks by global position and need one block size: {} (reader) vs {} (source) tokens",
            local.spec.block_size, remote.spec.block_size
        )
    })
}

/// A message's pipeline stage.
fn stage_of(message: &HandshakeMessage) -> StageOfRank<'_> {
    StageOfRank {
        partition: &message.pp_partition,
        pp_rank: message.pp_rank,
        regions: message.spec.regions.len(),
    }
}

/// A message's TP rank and size.
fn tp(message: &HandshakeMessage) -> (usize, usize) {
    (
        usize::try_from(message.tp_rank).unwrap_or(usize::MAX),
        usize::try_from(message.tp_size).unwrap_or(usize::MAX),
    )
}

/// Why `remote` is not the peer `local` expects, if it is not: another protocol version, or
/// not the engine or rank expected.
fn peer_mismatch(
    local: &HandshakeMessage,
    remote: &HandshakeMessage,
    expected_engine: Option<&str>,
    expected_rank: Option<(usize, usize)>,
) -> Option<String> {
    if remote.protocol_version != local.protocol_version {
        return Some(format!(
            "protocol version {} (reader) vs {} (source); run the same connector version on both engines",
            local.protocol_version, remote.protocol_version
        ));
    }
    if let Some(engine) = expected_engine.filter(|&engine| remote.engine_id != engine) {
        return Some(format!("the transfer params name engine {engine:?}"));
    }
    expected_rank
        .filter(|&(pp, tp)| (remote.pp_rank, remote.tp_rank) != (pp as u64, tp as u64))
        .map(|(pp, tp)| format!("the reader expected pp_rank {pp} tp_rank {tp}"))
}

/// Why either message does not describe a cache, if one does not: a spec that is not
/// valid, or the source's base addresses not one per region.
fn message_mismatch(local: &HandshakeMessage, remote: &HandshakeMessage) -> Option<String> {
    // Either side may be the peer: the server checks a reader's message, a reader a server's.
    for (whose, message) in [("reader", local), ("source", remote)] {
        if let Err(err) = message.spec.validate() {
            return Some(format!("the {whose}'s {err}"));
        }
    }
    (remote.region_base_addrs.len() != remote.spec.regions.len()).then(|| {
        format!(
            "the source sends {} base addresses for {} regions",
            remote.region_base_addrs.len(),
            remote.spec.regions.len()
        )
    })
}

/// Why reading the source's regions `spec` into the reader's `local` by `plan` would take
/// too many descriptors, on either side, if it would: more than [`MAX_REMOTE_DESCRIPTORS`]
/// in either list.
fn size_mismatch(local: &KvCacheSpec, spec: &KvCacheSpec, plan: &ReadPlan) -> Option<String> {
    let blocks = (spec.regions.len() as u64).checked_mul(spec.num_blocks as u64);
    if blocks.map_or(true, |d| d > MAX_REMOTE_DESCRIPTORS as u64)
        || plan.remote_descriptors() > MAX_REMOTE_DESCRIPTORS
    {
        return Some(format!(
            "the source declares {} blocks × {} regions; at most {MAX_REMOTE_DESCRIPTORS} descriptors are accepted",
            spec.num_blocks,
            spec.regions.len()
        ));
    }
    let local_descriptors = plan.local_descriptors(local.num_blocks);
    (local_descriptors > MAX_REMOTE_DESCRIPTORS).then(|| {
        format!(
            "reading blocks of {} tokens into blocks of {} takes {local_descriptors} local descriptors; at most {MAX_REMOTE_DESCRIPTORS} are accepted",
            spec.block_size, local.block_size
        )
    })
}

/// Why `remote`'s regions cannot be addressed, if one cannot: a null base address, or a
/// region whose end overflows the address space.
fn address_mismatch(remote: &HandshakeMessage) -> Option<String> {
    let spec = &remote.spec;
    let overflows = remote
        .region_base_addrs
        .iter()
        .zip(&spec.regions)
        .any(|(&base, region)| {
            let len = (region.block_len as u64).checked_mul(spec.num_blocks as u64);
            base == 0
                || len
                    .and_then(|len| base.checked_add(len))
                    .map_or(true, |end| usize::try_from(end).is_err())
        });
    overflows.then(|| "a region is null or overflows the address space".to_string())
}

/// Why the SSM state of `remote` is not that of `local` (the same model's, every rank
/// holding a TP-th of each part), if it is not.
fn ssm_mismatch(local: &HandshakeMessage, remote: &HandshakeMessage) -> Option<String> {
    let tp = |m: &HandshakeMessage| usize::try_from(m.tp_size).unwrap_or(usize::MAX);
    let (ours, theirs) = match (&local.ssm_state, &remote.ssm_state) {
        (None, None) => return None,
        (Some(ours), Some(theirs)) => (ours, theirs),
        (ours, _) => {
            let (with, without) = if ours.is_some() {
                ("reader", "source")
            } else {
                ("source", "reader")
            };
            return Some(format!(
                "the {with}'s KV cache groups have SSM (Mamba) state, the {without}'s none: both engines must serve the same model with the same kv_cache_groups"
            ));
        }
    };
    let expected = ours.scaled(tp(local), tp(remote));
    (expected.as_ref() != Some(theirs)).then(|| {
        format!(
            "SSM (Mamba) state of {theirs} per rank at TP {} (source) vs {ours} at TP {} (reader): every rank holds a TP-th of each part, so both engines must serve the same model with the same kv_cache_groups.ssm_state, its parts split over the larger TP",
            remote.tp_size, local.tp_size
        )
    })
}

/// Why the KV cache groups of `local` and `remote` cannot be read between, if they cannot:
/// region groups not one per region, or that differ while either side's differ between
/// regions (vLLM reads a group's blocks in its regions, which must be the same on both
/// engines), or kernel blocks per block id outside 1 to [`MAX_BLOCKS_PER_ID`].
fn groups_mismatch(local: &HandshakeMessage, remote: &HandshakeMessage) -> Option<String> {
    for (whose, message) in [("reader", local), ("source", remote)] {
        if !(1..=MAX_BLOCKS_PER_ID).contains(&message.blocks_per_id) {
            return Some(format!(
                "the {whose}'s kernel blocks per block id {} (1 to {MAX_BLOCKS_PER_ID})",
                message.blocks_per_id
            ));
        }
        let regions = message.spec.regions.len();
        if !message.region_groups.is_empty() && message.region_groups.len() != regions {
            return Some(format!(
                "the {whose}'s {} region groups for {regions} regions",
                message.region_groups.len()
            ));
        }
    }
    let own = |m: &HandshakeMessage| m.region_groups.windows(2).any(|w| w[0] != w[1]);
    ((own(local) || own(remote)) && local.region_groups != remote.region_groups).then(|| {
        format!(
            "region groups {:?} (source) vs {:?} (reader): both engines must register the same layers per KV cache group (kv_cache_groups.region_groups)",
            remote.region_groups, local.region_groups
        )
    })
}

/// `engine "e" rank r`, for messages.
fn rank_name(message: &HandshakeMessage) -> String {
    if message.pp_partition.len() > 1 {
        return format!(
            "engine {:?} pp_rank {} tp_rank {}",
            message.engine_id, message.pp_rank, message.tp_rank
        );
    }
    format!("engine {:?} rank {}", message.engine_id, message.tp_rank)
}

impl HandshakeMessage {
    /// The message of a rank holding `spec` for KV cache groups `groups` (their SSM state,
    /// each region's group, the kernel blocks of a block id), with base addresses and
    /// metadata.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for SSM groups without a state, region groups not one per
    /// region, or a groups' block size that is not a multiple of the registered blocks'.
    pub(crate) fn describe(
        engine_id: &str,
        agent_name: &str,
        agent_metadata: Vec<u8>,
        region_base_addrs: Vec<u64>,
        (spec, groups): (&KvCacheSpec, &KvCacheGroups),
        tp: (usize, usize),
        device_id: u64,
    ) -> Result<Self> {
        Ok(HandshakeMessage {
            protocol_version: PROTOCOL_VERSION,
            engine_id: engine_id.to_string(),
            agent_name: agent_name.to_string(),
            agent_metadata,
            region_base_addrs,
            spec: spec.clone(),
            device_id,
            tp_rank: tp.0 as u64,
            tp_size: tp.1 as u64,
            ssm_state: groups.checked_ssm_state()?.cloned(),
            region_groups: groups.region_group_ids(spec.regions.len())?,
            region_layers: groups.region_layer_names(spec.regions.len())?,
            blocks_per_id: groups.kernel_blocks_per_id(spec.block_size)? as u64,
            pp_rank: 0,
            pp_partition: Vec::new(),
            dcp_size: 1,
            claims: Vec::new(),
            claimed: Vec::new(),
            release_marks: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::spec::{KvAttention, KvLayout, KvRegion, KvRegionKind};

    fn message(tp: (u64, u64)) -> HandshakeMessage {
        let heads = KvAttention::Mha { total_kv_heads: 4 };
        let spec =
            KvCacheSpec::uniform(2, 8, 16, heads, KvLayout::Hnd, 16 * 4 * 32 / tp.1 as usize);
        HandshakeMessage {
            protocol_version: PROTOCOL_VERSION,
            engine_id: "e".to_string(),
            agent_name: "a".to_string(),
            agent_metadata: Vec::new(),
            region_base_addrs: vec![1 << 20, 1 << 30],
            spec,
            device_id: 0,
            tp_rank: tp.0,
            tp_size: tp.1,
            ssm_state: None,
            region_groups: Vec::new(),
            region_layers: Vec::new(),
            blocks_per_id: 1,
            pp_rank: 0,
            pp_partition: Vec::new(),
            dcp_size: 1,
            claims: Vec::new(),
            claimed: Vec::new(),
            release_marks: None,
        }
    }

    /// Asserts that `reader` refuses to read `source`, naming `want`.
    fn assert_refused(reader: &HandshakeMessage, source: &HandshakeMessage, want: &str) {
        let err = check_compatible(reader, source, None, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err}");
    }

    /// Every extreme a peer may claim, on either side of the check, gives an answer and never
    /// a panic, an overflow or an allocation sized by the claim.
    #[test]
    fn hostile_geometry_claims_are_refused_or_planned_without_a_panic() {
        const EXTREMES: [usize; 6] = [0, 1, 3, 1 << 20, 1 << 40, usize::MAX];
        type Mutation = fn(&mut HandshakeMessage, usize);
        let mutations: [Mutation; 13] = [
            |m, v| m.spec.num_blocks = v,
            |m, v| m.spec.block_size = v,
            |m, v| m.spec.regions[0].block_len = v,
            |m, v| m.spec.attention = KvAttention::Mha { total_kv_heads: v },
            |m, v| m.tp_size = v as u64,
            |m, v| m.tp_rank = v as u64,
            |m, v| m.region_base_addrs[1] = v as u64,
            |m, v| {
                m.spec.regions = vec![
                    KvRegion {
                        block_len: 64,
                        kind: KvRegionKind::KvHalves,
                    };
                    v.min(1 << 12)
                ]
            },
            |m, v| m.blocks_per_id = v as u64,
            |m, v| m.region_groups = vec![v as i64; v.min(3)],
            // A stage naming its layers (routed by name), in any number and repetition.
            |m, v| {
                (m.pp_partition, m.pp_rank) = (vec![1, 1], (v % 3) as u64);
                m.region_layers = vec![vec![format!("l{}", v % 5); v.min(3)]; v.min(4)];
            },
            |m, v| {
                (m.pp_partition, m.pp_rank) = (vec![1, 1], 1);
                m.region_layers = vec![vec!["x".repeat(v.min(1 << 10))], vec!["l1".into()]];
            },
            |m, v| {
                m.spec.attention = if v % 2 == 0 {
                    KvAttention::Mla
                } else {
                    m.spec.attention
                }
            },
        ];
        let mut good = (message((0, 1)), message((1, 2)));
        for m in [&mut good.0, &mut good.1] {
            m.region_layers = vec![vec!["l0".into()], vec!["l1".into()]];
        }
        assert!(check_compatible(&good.1, &good.0, None, None).is_ok());
        for mutate in mutations {
            for value in EXTREMES {
                for peer_is_source in [true, false] {
                    let (mut reader, mut source) = good.clone();
                    mutate(
                        if peer_is_source {
                            &mut source
                        } else {
                            &mut reader
                        },
                        value,
                    );
                    let _ = check_compatible(&reader, &source, None, None);
                }
            }
        }
    }

    #[test]
    fn decode_context_parallelism_pairs_as_vllm_pairs_it_or_is_refused_by_name() {
        let mla = |tp: (u64, u64), dcp: u64| HandshakeMessage {
            spec: KvCacheSpec::uniform(2, 8, 16, KvAttention::Mla, KvLayout::Hnd, 16 * 32),
            dcp_size: dcp,
            ..message(tp)
        };
        // An unsharded reader reads every rank of a sharded source.
        let plan = check_compatible(&mla((0, 1), 1), &mla((1, 2), 2), None, None).unwrap();
        assert_eq!(plan.share, Share::Latent);
        let refused = |reader: &HandshakeMessage, source: &HandshakeMessage, why: &str| {
            let err = check_compatible(reader, source, None, None)
                .unwrap_err()
                .to_string();
            assert!(err.contains(why), "{err}");
        };
        // DCP rank 0 of 2 holds no position of source rank 1 of DCP 4.
        refused(
            &mla((0, 2), 2),
            &mla((1, 4), 4),
            "reads from remote ranks [0, 2]",
        );
        refused(
            &mla((0, 2), 2),
            &mla((0, 3), 3),
            "DCP sizes must divide one another: local=2, remote=3",
        );
        refused(
            &mla((0, 2), 2),
            &mla((0, 4), 2),
            "neither 1 nor its TP size 4",
        );
        refused(&message((0, 1)), &mla((0, 1), 0), "each must be 1 to 256");
        let mha = HandshakeMessage {
            dcp_size: 2,
            ..message((0, 2))
        };
        refused(&mha, &message((0, 2)), "MLA caches only");
        let mut other_blocks = mla((0, 2), 2);
        other_blocks.spec.block_size = 8;
        refused(&mla((0, 2), 2), &other_blocks, "need one block size");
    }

    #[test]
    fn a_pipeline_stage_is_read_in_the_regions_of_the_layers_both_hold() {
        // The reader holds both layers (one stage); the source is stage 1 of [1, 1] and
        // holds the second: one region each, the reader's second.
        let reader = message((0, 1));
        let mut source = message((0, 1));
        source.spec.regions.truncate(1);
        source.region_base_addrs.truncate(1);
        (source.pp_rank, source.pp_partition) = (1, vec![1, 1]);
        let plan = check_compatible(&reader, &source, None, Some((1, 0))).unwrap();
        assert_eq!((plan.regions.len(), plan.local_first_region), (1, 1));
        assert_eq!(plan.remote_first_region, 0);
        assert!(
            !plan.reads_whole_local_blocks(),
            "not the registration's own list"
        );
        // A reader of stage 0 of [1, 1] shares no layer with it: only notified.
        let mut first = source.clone();
        first.pp_rank = 0;
        let plan = check_compatible(&first, &source, None, None).unwrap();
        assert_eq!((plan.share, plan.regions.len()), (Share::NotifiedOnly, 0));
        // The stage the reader expected, or a refusal naming it.
        let err = check_compatible(&reader, &source, None, Some((0, 0)))
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected pp_rank 0 tp_rank 0"), "{err}");
        assert!(err.contains("pp_rank 1 tp_rank 0"), "{err}");
    }

    #[test]
    fn a_peer_whose_blocks_would_split_ours_into_too_many_pieces_is_refused() {
        let (mut reader, mut source) = (message((0, 1)), message((0, 1)));
        reader.spec.num_blocks = 1 << 16;
        reader.spec.block_size = 1 << 10;
        reader.spec.regions[0].block_len = (1 << 10) * 4 * 32;
        reader.spec.regions[1].block_len = (1 << 10) * 4 * 32;
        source.spec.block_size = 1;
        source.spec.regions[0].block_len = 4 * 32;
        source.spec.regions[1].block_len = 4 * 32;
        let err = check_compatible(&reader, &source, None, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("local descriptors"), "{err}");
    }

    #[test]
    fn ssm_state_must_be_on_both_sides_and_the_same_models_at_each_tp() {
        let mamba = SsmState::new(vec![24, 8, 8], 64).unwrap();
        let (mut reader, mut source) = (message((1, 2)), message((0, 1)));
        reader.ssm_state = Some(mamba.clone());
        assert_refused(
            &reader,
            &source,
            "the reader's KV cache groups have SSM (Mamba) state, the source's none",
        );
        // The source of a smaller TP holds twice the reader's parts.
        source.ssm_state = mamba.scaled(2, 1);
        assert!(check_compatible(&reader, &source, None, None).is_ok());
        source.ssm_state = Some(mamba.clone());
        assert_refused(&reader, &source, "SSM (Mamba) state of conv_bytes [24, 8, 8] and temporal_bytes 64 per rank at TP 1 (source) vs conv_bytes [24, 8, 8] and temporal_bytes 64 at TP 2 (reader)");
        reader.ssm_state = None;
        assert_refused(
            &reader,
            &source,
            "the source's KV cache groups have SSM (Mamba) state, the reader's none",
        );
    }

    #[test]
    fn a_hybrid_models_stage_pairs_its_regions_by_layer_name() {
        let names = |regions: &[&[&str]]| -> Vec<Vec<String>> {
            regions
                .iter()
                .map(|r| r.iter().map(|n| n.to_string()).collect())
                .collect()
        };
        // A model of two groups (vLLM's shared regions, -1).
        let mut decode = message((0, 1));
        decode.region_layers = names(&[&["l0", "l1"], &["l2", "l3"]]);
        decode.region_groups = vec![-1, -1];
        // Stage 1 of 2 holds l2 and l3, in regions of its own order.
        let mut stage = message((0, 1));
        (stage.pp_rank, stage.pp_partition) = (1, vec![2, 2]);
        stage.region_layers = names(&[&["l3"], &["l2"]]);
        stage.region_groups = vec![-1, -1];
        let routes = |plan: &ReadPlan| -> Vec<(usize, usize, usize)> {
            plan.layer_routes
                .iter()
                .map(|r| (r.local_layer, r.local_region, r.remote_region))
                .collect()
        };
        let plan = check_compatible(&stage, &decode, None, None).unwrap();
        assert_eq!(routes(&plan), [(0, 0, 1), (1, 1, 1)]);
        assert_eq!(plan.regions.len(), 2);
        // Each layer's descriptors start at its region of the peer.
        let descs = plan.remote_descs(&decode.region_base_addrs, 0);
        let per_region = descs.len() / 2;
        assert_eq!(descs[0].addr, decode.region_base_addrs[1] as usize);
        assert_eq!(descs[per_region].addr, decode.region_base_addrs[1] as usize);
        let local: Vec<usize> = plan.local_descs(1).map(|(region, ..)| region).collect();
        assert_eq!(local, [0, 1]);
        // The decode's view: the layers both hold, in its order.
        let plan = check_compatible(&decode, &stage, None, None).unwrap();
        assert_eq!(routes(&plan), [(2, 1, 1), (3, 1, 0)]);
        // A stage and a peer naming no layer, other layers, or blocks of another size.
        let mut unnamed = decode.clone();
        unnamed.region_layers.clear();
        assert_refused(&stage, &unnamed, "the peer names no layer of its regions");
        assert_refused(&unnamed, &stage, "the reader names no layer of its regions");
        let mut other = decode.clone();
        other.region_layers = names(&[&["l0", "l1"], &["l2", "x3"]]);
        assert_refused(&stage, &other, "the peer lacks this rank's layers [\"l3\"]");
        let mut short = decode.clone();
        short.region_layers.pop();
        assert_refused(
            &stage,
            &short,
            "names the layers of 1 regions for 2 regions",
        );
        let mut larger = decode.clone();
        larger.spec.block_size *= 2;
        assert_refused(
            &stage,
            &larger,
            "pair by layer name with blocks of one size only",
        );
        // A model of one group pairs its stages by offset, named on one side or not (vLLM's
        // metadata names every region): stage 1's regions are the decode's from 2 on.
        let mut one_group = message((0, 1));
        let attention = one_group.spec.attention;
        one_group.spec = KvCacheSpec::uniform(4, 8, 16, attention, KvLayout::Hnd, 16 * 4 * 32);
        one_group.region_base_addrs = vec![1 << 20, 1 << 21, 1 << 22, 1 << 23];
        let mut named_stage = message((0, 1));
        (named_stage.pp_rank, named_stage.pp_partition) = (1, vec![2, 2]);
        named_stage.region_layers = names(&[&["l2"], &["l3"]]);
        let plan = check_compatible(&one_group, &named_stage, None, None).unwrap();
        assert!(plan.layer_routes.is_empty());
        assert_eq!((plan.local_first_region, plan.remote_first_region), (2, 0));
    }

    #[test]
    fn region_groups_and_kernel_blocks_per_id_are_checked() {
        let (mut reader, mut source) = (message((0, 1)), message((0, 1)));
        reader.region_groups = vec![-1, -1];
        source.region_groups = vec![0, 0];
        // Every region the same on each side: each group is read in every region.
        assert!(check_compatible(&reader, &source, None, None).is_ok());
        source.region_groups = vec![0, 1];
        assert_refused(
            &reader,
            &source,
            "region groups [0, 1] (source) vs [-1, -1] (reader)",
        );
        reader.region_groups = vec![0, 1];
        assert!(check_compatible(&reader, &source, None, None).is_ok());
        source.region_groups = vec![0, 1, 1];
        assert_refused(
            &reader,
            &source,
            "the source's 3 region groups for 2 regions",
        );
        source.region_groups = vec![0, 1];
        for bad in [0, MAX_BLOCKS_PER_ID + 1] {
            source.blocks_per_id = bad;
            assert_refused(
                &reader,
                &source,
                &format!("the source's kernel blocks per block id {bad} (1 to 1024)"),
            );
        }
    }

    /// A version-2 peer's message (before the SSM state, region groups and kernel blocks per
    /// id) still decodes, and is refused for its version, naming both.
    #[test]
    fn a_message_of_version_2_is_refused_for_its_version() {
        #[derive(Serialize)]
        struct Version2 {
            protocol_version: u32,
            engine_id: String,
            agent_name: String,
            #[serde(with = "serde_bytes")]
            agent_metadata: Vec<u8>,
            region_base_addrs: Vec<u64>,
            spec: KvCacheSpec,
            device_id: u64,
            tp_rank: u64,
            tp_size: u64,
        }
        let now = message((0, 1));
        let old = Version2 {
            protocol_version: 2,
            engine_id: now.engine_id.clone(),
            agent_name: now.agent_name.clone(),
            agent_metadata: now.agent_metadata.clone(),
            region_base_addrs: now.region_base_addrs.clone(),
            spec: now.spec.clone(),
            device_id: now.device_id,
            tp_rank: now.tp_rank,
            tp_size: now.tp_size,
        };
        let bytes = rmp_serde::to_vec_named(&old).unwrap();
        let decoded: HandshakeMessage = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!((&decoded.ssm_state, decoded.blocks_per_id), (&None, 1));
        assert_refused(&now, &decoded, "protocol version 5 (reader) vs 2 (source)");
    }
}

//! Which bytes a load reads from one remote rank: the pure planner the worker posts from.
//!
//! From plain inputs (both sides' block ids and their KV cache groups, the pairing of the
//! two caches' regions ([`ReadPlan`]), the engine's groups, the SSM state reads and whether
//! the rank's attention is read) it works out, in order:
//! 1. each side's registered (kernel) blocks of its block ids ([`kernel_blocks`]): a block
//!    id is `per_id` kernel blocks, but an SSM group's ids stay block ids;
//! 2. which local block each remote block lands in ([`pair_units`] for one group,
//!    [`pair_groups`] for several, or when a block id is several kernel blocks);
//! 3. the descriptor indices of both prepared lists ([`ReadPlan::descriptor_ids`]): every
//!    region for attention, the regions of each group where groups have regions of their
//!    own ([`pairs_by_region`]), and the SSM state blocks after the attention
//!    ([`SsmReads::descriptor_ids`]).
//!
//! Runs of blocks contiguous on both sides are left to NIXL: its `makeXferReq` (1.5.1)
//! merges consecutive indices whose descriptors are contiguous on both sides into one, so a
//! READ of 148 blocks contiguous on both sides in 128 regions posts 128 descriptors, not
//! 18,944 (`benches/descriptor_heavy.rs` records the count). The order above (region by
//! region, each group's pairs by local block) keeps a run's indices consecutive so that it
//! can, also a run the engine listed last first;
//! `read_runs_tests` checks the merged descriptors byte by byte, `tests/block_runs.rs` the
//! real NIXL's.
//!
//! Everything here is a peer's claim checked against this side's cache: ids past either
//! cache, lists longer than a cache, or group counts past the ids are refused before any
//! list of that size is made.

use std::borrow::Cow;

use crate::error::{Error, Result};
use crate::geometry::block_map::{pair_groups, pair_units, BlockSizes, GroupBlocks, GroupPairs};
use crate::geometry::groups::{pairs_by_region, KvCacheGroups};
use crate::geometry::read_plan::ReadPlan;
use crate::geometry::ssm::{split_state_pairs, SsmReads};

/// The operation errors name.
const OP: &str = "load remote blocks";

/// One side's blocks of a load.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SideBlocks<'a> {
    /// Block ids, in token order; each KV cache group's in turn.
    pub(crate) ids: &'a [usize],
    /// How many of `ids` each KV cache group has; empty: one group.
    pub(crate) group_lens: &'a [usize],
    /// Registered (kernel) blocks per block id.
    pub(crate) per_id: usize,
}

/// What a load reads from one remote rank, as plain inputs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadInputs<'a> {
    /// The local request id (named in errors).
    pub(crate) request_id: &'a str,
    /// The decode's blocks the READ fills.
    pub(crate) local: SideBlocks<'a>,
    /// The prefill's blocks it reads.
    pub(crate) remote: SideBlocks<'a>,
    /// Tokens the prefill computed, if known.
    pub(crate) num_tokens: Option<usize>,
    /// Registered blocks of the local cache.
    pub(crate) local_num_blocks: usize,
    /// How the two caches' regions pair (the handshake's plan).
    pub(crate) plan: &'a ReadPlan,
    /// This engine's KV cache groups.
    pub(crate) groups: &'a KvCacheGroups,
    /// The SSM state reads, with SSM groups.
    pub(crate) ssm: Option<&'a SsmReads>,
    /// Whether the rank's attention is read (else only its SSM state is).
    pub(crate) reads_attention: bool,
}

/// The descriptor indices of one READ into both prepared lists, and its bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ReadDescriptors {
    /// Indices into the local list.
    pub(crate) local: Vec<usize>,
    /// Indices into the remote list, paired with `local`.
    pub(crate) remote: Vec<usize>,
    /// Bytes the READ moves.
    pub(crate) bytes: usize,
}

/// The descriptors of the READ `inputs` describes.
///
/// # Errors
/// [`Error::InvalidArgument`] for block ids past either cache or whose kernel blocks
/// overflow, group counts that do not add up to the ids, lists that cannot pair, or SSM
/// state blocks past either cache.
pub(crate) fn plan_read(inputs: &ReadInputs<'_>) -> Result<ReadDescriptors> {
    let (pairs, group_lens) = pair_blocks(&Pairing::of_read(inputs))?;
    descriptors(inputs, pairs, &group_lens)
}

/// The descriptors of a push WRITE: `inputs` as [`plan_read`]'s, this side (`local`) the
/// prefill, whose blocks hold the prompt from its first token, and `remote` the decode,
/// whose registered blocks are the tail it lacks. The blocks pair as the decode's READ of
/// the same blocks would pair them (by the prompt's `num_tokens` where the engines' blocks
/// differ in tokens or in kernel blocks per id), each pair then turned to (prefill block,
/// decode block); the bytes move as [`plan_read`]'s, the other way.
///
/// # Errors
/// Those of [`plan_read`], the decode named the local side in them.
pub(crate) fn plan_write(inputs: &ReadInputs<'_>) -> Result<ReadDescriptors> {
    let read = Pairing::of_read(inputs);
    let sizes = read.sizes;
    let mirrored = Pairing {
        local: read.remote,
        remote: read.local,
        local_num_blocks: read.remote_num_blocks,
        remote_num_blocks: read.local_num_blocks,
        sizes: BlockSizes {
            local: sizes.remote,
            remote: sizes.local,
        },
        ..read
    };
    let (pairs, group_lens) = pair_blocks(&mirrored).map_err(|err| {
        Error::invalid(
            "write a push registration",
            format!("the decode's blocks (local) against the prefill's (remote): {err}"),
        )
    })?;
    let pairs: Vec<(usize, usize)> = pairs.into_iter().map(|(d, p)| (p, d)).collect();
    descriptors(inputs, pairs, &group_lens)
}

/// What pairs a load's blocks: both sides' ids and caches, and the prompt's tokens.
#[derive(Debug, Clone, Copy)]
struct Pairing<'a> {
    request_id: &'a str,
    /// The side whose blocks are the tail of the prompt it lacks.
    local: SideBlocks<'a>,
    /// The side whose blocks hold the prompt from its first token.
    remote: SideBlocks<'a>,
    num_tokens: Option<usize>,
    local_num_blocks: usize,
    remote_num_blocks: usize,
    sizes: BlockSizes,
    /// The engine's KV cache groups (as many on both sides).
    groups: &'a KvCacheGroups,
}

impl<'a> Pairing<'a> {
    /// The pairing of a READ: the reader's blocks the tail.
    fn of_read(inputs: &ReadInputs<'a>) -> Self {
        Pairing {
            request_id: inputs.request_id,
            local: inputs.local,
            remote: inputs.remote,
            num_tokens: inputs.num_tokens,
            local_num_blocks: inputs.local_num_blocks,
            remote_num_blocks: inputs.plan.remote_num_blocks,
            sizes: inputs.plan.block_sizes(),
            groups: inputs.groups,
        }
    }
}

/// Which local block each remote block of `inputs` lands in, and, for several groups (or
/// block ids of several kernel blocks), how many pairs each group has.
fn pair_blocks(inputs: &Pairing<'_>) -> Result<GroupPairs> {
    let is_state = |g| inputs.groups.is_ssm(g);
    let remote = inputs.remote;
    // Each group names a block once: at most the remote rank's blocks per group.
    let most = inputs
        .remote_num_blocks
        .saturating_mul(remote.group_lens.len().max(1));
    let remote_ids = kernel_blocks(remote, is_state, most, "remote_block_ids")?;
    if let Some(bad) = remote_ids.iter().find(|&&b| b >= inputs.remote_num_blocks) {
        return Err(Error::invalid(
            OP,
            format!("remote block {bad} of {} blocks", inputs.remote_num_blocks),
        ));
    }
    let sizes = inputs.sizes;
    let local = inputs.local;
    let local_lens = kernel_group_lens(local, is_state)?;
    let most = inputs.local_num_blocks.saturating_mul(local_lens.len());
    let local_ids = kernel_blocks(local, is_state, most, "local block ids")?;
    // In a push the local side is the decode's registration: a peer's claim too.
    if let Some(bad) = local_ids.iter().find(|&&b| b >= inputs.local_num_blocks) {
        return Err(Error::invalid(
            OP,
            format!(
                "local kernel block {bad} of {} blocks ({} per block id)",
                inputs.local_num_blocks, local.per_id
            ),
        ));
    }
    // One group pairs unit by unit from the prompt's first token, but not when a block id
    // is several kernel blocks (the last of which may hold no token): then as a group, at
    // the units' tokens of the prompt.
    let kernel_ids = local.per_id > 1 || (remote.per_id > 1 && sizes.remote <= sizes.local);
    if local.group_lens.is_empty() && !kernel_ids {
        let pairs = pair_units(
            inputs.request_id,
            &local_ids,
            &remote_ids,
            sizes,
            inputs.num_tokens,
        )?;
        return Ok((pairs, Vec::new()));
    }
    let remote_lens = kernel_group_lens(remote, is_state)?;
    pair_groups(
        inputs.request_id,
        GroupBlocks {
            ids: &local_ids,
            lens: &local_lens,
        },
        GroupBlocks {
            ids: &remote_ids,
            lens: &remote_lens,
        },
        sizes,
        inputs.num_tokens,
        (local.per_id, remote.per_id),
        is_state,
    )
}

/// The descriptors of `pairs` (`group_lens` of them per group, or one group): with SSM
/// groups, vLLM's `[descs_fa | descs_ssm]` (the attention groups' blocks in every region,
/// then the SSM groups' state); with groups of regions of their own, or regions paired by
/// layer name, each region the pairs of its group (of its layer); else every region all of
/// them.
fn descriptors(
    inputs: &ReadInputs<'_>,
    mut pairs: Vec<(usize, usize)>,
    group_lens: &[usize],
) -> Result<ReadDescriptors> {
    sort_by_local_unit(&mut pairs, group_lens);
    let pairs = pairs.as_slice();
    let plan = inputs.plan;
    let blocks = inputs.local_num_blocks;
    let routed = layer_groups(inputs)?;
    let own = routed
        .as_deref()
        .unwrap_or_else(|| inputs.groups.own_region_groups());
    let (local, remote, bytes) = if let Some(ssm) = inputs.ssm {
        let (attention, state) = split_state_pairs(pairs, group_lens, |g| inputs.groups.is_ssm(g))?;
        let (mut local, mut remote, bytes) = if inputs.reads_attention {
            plan.descriptor_ids(blocks, &attention)
        } else {
            // Its attention is read from another rank of its TP group: its state only.
            (Vec::new(), Vec::new(), 0)
        };
        let (state_local, state_remote, state_bytes) = ssm
            .descriptor_ids(&state)
            .map_err(|why| Error::invalid(OP, why))?;
        local.extend(state_local);
        remote.extend(state_remote);
        (local, remote, bytes + state_bytes)
    } else if own.is_empty() || group_lens.len() < 2 {
        plan.descriptor_ids(blocks, pairs)
    } else {
        let by_region = pairs_by_region(pairs, group_lens, own)?;
        plan.descriptor_ids_in(blocks, |region| {
            by_region.get(region).copied().unwrap_or(pairs)
        })
    };
    Ok(ReadDescriptors {
        local,
        remote,
        bytes,
    })
}

/// Sorts each group's pairs (`group_lens` of them per group, or one group) by local unit.
/// Each pair moves its own unit, so the order changes nothing but the descriptors' order:
/// NIXL joins consecutive descriptors contiguous on both sides, and a run of blocks
/// contiguous on both sides that the engine listed last first (vLLM frees a request's
/// blocks last first, so a run it hands out again comes back descending) is consecutive
/// only once sorted. Counts that do not add up leave `pairs` as they are, for the checks
/// after to refuse.
fn sort_by_local_unit(pairs: &mut [(usize, usize)], group_lens: &[usize]) {
    let total = group_lens
        .iter()
        .try_fold(0usize, |sum, &n| sum.checked_add(n));
    if total != Some(pairs.len()) {
        if group_lens.is_empty() {
            pairs.sort_unstable();
        }
        return;
    }
    let mut rest = pairs;
    for &n in group_lens {
        let (group, tail) = rest.split_at_mut(n);
        group.sort_unstable();
        rest = tail;
    }
}

/// The group of each of the plan's regions where they pair by layer name (its local layer's
/// group, vLLM's `_transfer_layer_group_ids`); `None` where they do not.
///
/// # Errors
/// [`Error::InvalidArgument`] for a layer this engine's groups do not name.
fn layer_groups(inputs: &ReadInputs<'_>) -> Result<Option<Vec<i64>>> {
    let routes = &inputs.plan.layer_routes;
    if routes.is_empty() {
        return Ok(None);
    }
    let groups = inputs.groups.layer_groups();
    routes
        .iter()
        .map(|r| {
            groups.get(r.local_layer).copied().ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!(
                        "layer {} of {} named in kv_cache_groups.region_layers",
                        r.local_layer,
                        groups.len()
                    ),
                )
            })
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// The registered (kernel) blocks of `side`'s block ids, `per_id` blocks each (vLLM's
/// `_logical_to_kernel_block_ids`: logical block `b` is kernel blocks `b * per_id ..
/// (b + 1) * per_id`), but the ids of the groups that are `is_state` (SSM), which stay
/// block ids: a state page is a whole id.
///
/// The ids are a peer's (`what` names them): more kernel blocks than `max_blocks` (each
/// group's list names a block once) are refused before a list of them is made.
///
/// # Errors
/// [`Error::InvalidArgument`] for an id whose blocks overflow, more than `max_blocks`, or
/// group counts past the ids.
pub(crate) fn kernel_blocks<'a>(
    side: SideBlocks<'a>,
    is_state: impl Fn(usize) -> bool,
    max_blocks: usize,
    what: &str,
) -> Result<Cow<'a, [usize]>> {
    let (ids, per_id) = (side.ids, side.per_id);
    if per_id == 1 {
        return Ok(Cow::Borrowed(ids));
    }
    // At most this many (state groups' ids stay one block each).
    let total = ids.len().checked_mul(per_id).filter(|&n| n <= max_blocks);
    let Some(total) = total else {
        return Err(Error::invalid(
            OP,
            format!(
                "{what}: {} block ids of {per_id} kernel blocks each name more than the {max_blocks} blocks of the KV caches' groups",
                ids.len()
            ),
        ));
    };
    let mut blocks = Vec::with_capacity(total);
    let miscounted = || {
        Error::invalid(
            OP,
            format!(
                "{what}: group counts {:?} for {} block ids",
                side.group_lens,
                ids.len()
            ),
        )
    };
    let mut rest = ids;
    for (group, &n) in group_lens_or_one(side).iter().enumerate() {
        let Some((these, tail)) = rest.split_at_checked(n) else {
            return Err(miscounted());
        };
        rest = tail;
        if is_state(group) {
            blocks.extend_from_slice(these);
            continue;
        }
        expand_ids(these, per_id, &mut blocks, what)?;
    }
    if !rest.is_empty() {
        return Err(miscounted());
    }
    Ok(Cow::Owned(blocks))
}

/// `side`'s ids and group counts (empty: one group, as given) as kernel blocks, every
/// group's ids expanded (no SSM group): a push between engines of as many kernel blocks per
/// id, cut by id, then pairs kernel block by kernel block, as vLLM's push pairs kernel ids.
///
/// # Errors
/// Those of [`kernel_blocks`] and [`kernel_group_lens`].
pub(crate) fn all_kernel_blocks(
    side: SideBlocks<'_>,
    max_blocks: usize,
    what: &str,
) -> Result<(Vec<usize>, Vec<usize>)> {
    let blocks = kernel_blocks(side, |_| false, max_blocks, what)?.into_owned();
    let lens = match side.group_lens.is_empty() {
        true => Vec::new(),
        false => kernel_group_lens(side, |_| false)?,
    };
    Ok((blocks, lens))
}

/// `side`'s group counts, or one group of every id.
fn group_lens_or_one(side: SideBlocks<'_>) -> Cow<'_, [usize]> {
    if side.group_lens.is_empty() {
        Cow::Owned(vec![side.ids.len()])
    } else {
        Cow::Borrowed(side.group_lens)
    }
}

/// Appends to `blocks` the `per_id` kernel blocks of each of `ids` (`what` names them).
///
/// # Errors
/// [`Error::InvalidArgument`] for an id whose blocks overflow.
fn expand_ids(ids: &[usize], per_id: usize, blocks: &mut Vec<usize>, what: &str) -> Result<()> {
    for &id in ids {
        let end = id
            .checked_add(1)
            .and_then(|n| n.checked_mul(per_id))
            .ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!("{what}: block id {id} of {per_id} kernel blocks each overflows"),
                )
            })?;
        blocks.extend(end - per_id..end);
    }
    Ok(())
}

/// How many kernel blocks each KV cache group of `side` has; an `is_state` (SSM) group's
/// ids stay block ids.
///
/// # Errors
/// [`Error::InvalidArgument`] for a count whose blocks overflow.
fn kernel_group_lens(side: SideBlocks<'_>, is_state: impl Fn(usize) -> bool) -> Result<Vec<usize>> {
    group_lens_or_one(side)
        .iter()
        .enumerate()
        .map(|(group, &n)| {
            let per_id = if is_state(group) { 1 } else { side.per_id };
            n.checked_mul(per_id).ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!("{n} block ids of {per_id} kernel blocks each overflow"),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::spec::{KvAttention, KvCacheSpec, KvLayout};

    /// The plan of a reader of `local` reading `remote`, both TP 1 and without DCP.
    fn tp1_plan(local: &KvCacheSpec, remote: &KvCacheSpec) -> ReadPlan {
        ReadPlan::new(
            local,
            (0, 1),
            remote,
            (0, 1),
            crate::geometry::dcp::DcpSizes::NONE,
        )
        .unwrap()
    }

    /// A cache of 2 regions of 8 blocks of `block_size` tokens, 2 heads of 4 bytes a token.
    fn spec(block_size: usize) -> KvCacheSpec {
        let heads = KvAttention::Mha { total_kv_heads: 2 };
        KvCacheSpec::uniform(
            2,
            8,
            block_size,
            heads,
            KvLayout::Hnd,
            2 * 2 * block_size * 4,
        )
    }

    fn side<'a>(ids: &'a [usize], per_id: usize) -> SideBlocks<'a> {
        SideBlocks {
            ids,
            group_lens: &[],
            per_id,
        }
    }

    fn inputs<'a>(
        plan: &'a ReadPlan,
        groups: &'a KvCacheGroups,
        local: SideBlocks<'a>,
        remote: SideBlocks<'a>,
        num_tokens: Option<usize>,
    ) -> ReadInputs<'a> {
        ReadInputs {
            request_id: "r",
            local,
            remote,
            num_tokens,
            local_num_blocks: 8,
            plan,
            groups,
            ssm: None,
            reads_attention: true,
        }
    }

    #[test]
    fn blocks_of_one_geometry_pair_in_order_in_every_region() {
        let spec = spec(16);
        let plan = tp1_plan(&spec, &spec);
        let groups = KvCacheGroups::default();
        let got = plan_read(&inputs(
            &plan,
            &groups,
            side(&[0, 1], 1),
            side(&[5, 2], 1),
            None,
        ))
        .unwrap();
        let (local, remote, bytes) = plan.descriptor_ids(8, &[(0, 5), (1, 2)]);
        assert_eq!(
            got,
            ReadDescriptors {
                local,
                remote,
                bytes
            }
        );
        assert_eq!(
            got.bytes,
            2 * 2 * spec.block_len(0),
            "2 blocks of 2 regions"
        );
        assert_eq!(got.local.len(), 4);
    }

    #[test]
    fn a_larger_decode_block_takes_the_prefills_blocks_in_turn() {
        // Prefill blocks of 16 tokens, decode blocks of 32: remote 5 and 2 fill local 3's
        // halves, remote 7 the first half of local 6.
        let (small, large) = (spec(16), spec(32));
        let plan = tp1_plan(&large, &small);
        let groups = KvCacheGroups::default();
        let got = plan_read(&inputs(
            &plan,
            &groups,
            side(&[3, 6], 1),
            side(&[5, 2, 7], 1),
            Some(48),
        ))
        .unwrap();
        let units = plan.descriptor_ids(8, &[(6, 5), (7, 2), (12, 7)]);
        assert_eq!((got.local, got.remote, got.bytes), units);
    }

    #[test]
    fn a_push_pairs_the_decodes_tail_at_the_prompts_tokens() {
        // The prefill (this side) of blocks of 8 tokens holds 3 and 6 for a prompt of 14
        // tokens; the decode, of blocks of 4, lacks the last 2 of its 4: tokens 8 to 15,
        // the halves of prefill block 6.
        let (large, small) = (spec(8), spec(4));
        let plan = tp1_plan(&large, &small);
        let groups = KvCacheGroups::default();
        let write = inputs(&plan, &groups, side(&[3, 6], 1), side(&[5, 1], 1), Some(14));
        let got = plan_write(&write).unwrap();
        let units = plan.descriptor_ids(8, &[(12, 5), (13, 1)]);
        assert_eq!((got.local, got.remote, got.bytes), units);
        // A decode block past the cache is refused, named as the decode's.
        let past = inputs(&plan, &groups, side(&[3, 6], 1), side(&[5, 8], 1), Some(14));
        let err = plan_write(&past).unwrap_err().to_string();
        assert!(
            err.contains("the decode's blocks (local)") && err.contains("local kernel block 8"),
            "{err}"
        );
    }

    /// A decode's registration is a peer's claim: any ids, group counts, kernel blocks per id
    /// and prompt lengths either plan a WRITE whose every descriptor is in both lists, or
    /// are refused; never a panic.
    #[test]
    fn any_registration_plans_a_write_in_bounds_or_is_refused() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut below = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let window = crate::geometry::groups::KvCacheGroupKind::SlidingWindow { window_tokens: 8 };
        let two = vec![
            crate::geometry::groups::KvCacheGroupKind::FullAttention,
            window,
        ];
        let hybrid = KvCacheGroups::new(4, two).unwrap();
        let (mut planned, mut refused) = (0, 0);
        let cases = [(8, 4), (4, 8), (4, 4), (16, 4)];
        for (groups, (prefill, decode)) in [KvCacheGroups::default(), hybrid]
            .iter()
            .flat_map(|g| cases.iter().map(move |&c| (g, c)))
        {
            let (ours, theirs) = (spec(prefill), spec(decode));
            let plan = tp1_plan(&ours, &theirs);
            for _ in 0..3000 {
                let held: Vec<usize> = (0..1 + below(4)).map(|_| below(8)).collect();
                let held_lens: Vec<usize> = match groups.len() {
                    1 => Vec::new(),
                    _ => {
                        let first = below(held.len() + 1);
                        vec![first, held.len() - first]
                    }
                };
                let ids: Vec<usize> = (0..below(12))
                    .map(|_| match below(12) {
                        0 => usize::MAX - below(3),
                        _ => below(10),
                    })
                    .collect();
                let lens: Vec<usize> = match below(4) {
                    0 => vec![below(6), below(6)],
                    _ => Vec::new(),
                };
                let decode = SideBlocks {
                    ids: &ids,
                    group_lens: &lens,
                    per_id: 1 + below(3),
                };
                let tokens = (below(8) > 0).then(|| below(70));
                let ours = SideBlocks {
                    ids: &held,
                    group_lens: &held_lens,
                    per_id: 1 + below(2),
                };
                let write = inputs(&plan, groups, ours, decode, tokens);
                match plan_write(&write) {
                    Ok(got) => {
                        planned += 1;
                        assert!(got.local.iter().all(|&i| i < plan.local_descriptors(8)));
                        assert!(got.remote.iter().all(|&i| i < plan.remote_descriptors()));
                        assert_eq!(got.local.len(), got.remote.len());
                    }
                    Err(_) => refused += 1,
                }
            }
        }
        assert!(
            planned > 100 && refused > 100,
            "{planned} planned, {refused} refused"
        );
    }

    #[test]
    fn a_peers_ids_past_either_cache_are_refused() {
        let spec = spec(16);
        let plan = tp1_plan(&spec, &spec);
        let groups = KvCacheGroups::default();
        let err = plan_read(&inputs(&plan, &groups, side(&[0], 1), side(&[8], 1), None))
            .unwrap_err()
            .to_string();
        assert!(err.contains("remote block 8 of 8 blocks"), "{err}");
        // Local block id 4 of 2 kernel blocks each: kernel blocks 8 and 9 of 8.
        let err = plan_read(&inputs(
            &plan,
            &groups,
            side(&[4], 2),
            side(&[0, 1], 1),
            None,
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("local kernel block 8 of 8 blocks (2 per block id)"),
            "{err}"
        );
    }

    #[test]
    fn block_ids_name_no_more_kernel_blocks_than_the_cache_holds() {
        let never = |_| false;
        let blocks = kernel_blocks(side(&[0, 3], 2), never, 8, "remote_block_ids").unwrap();
        assert_eq!(blocks[..], [0, 1, 6, 7]);
        // A peer's list of 4,096 ids of 1,024 kernel blocks each (its
        // physical_blocks_per_logical_kv_block) names 4 Mi blocks of a cache of 2,048: refused
        // before any list of that size is made.
        let many = [0; 1 << 12];
        let err = kernel_blocks(side(&many, 1 << 10), never, 2048, "remote_block_ids")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("remote_block_ids: 4096 block ids of 1024 kernel blocks each name more than the 2048 blocks"),
            "{err}"
        );
        let err = kernel_blocks(
            side(&[usize::MAX], 2),
            never,
            usize::MAX,
            "remote_block_ids",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("remote_block_ids: block id"), "{err}");
        // An SSM group's ids stay block ids; group counts must add up.
        let two = SideBlocks {
            ids: &[1, 4, 5],
            group_lens: &[2, 1],
            per_id: 2,
        };
        let state = |g| g == 1;
        assert_eq!(
            kernel_blocks(two, state, 8, "ids").unwrap()[..],
            [2, 3, 8, 9, 5]
        );
        assert_eq!(kernel_group_lens(two, state).unwrap(), [4, 1]);
        let miscounted = SideBlocks {
            group_lens: &[2, 2],
            ..two
        };
        let err = kernel_blocks(miscounted, state, 8, "ids")
            .unwrap_err()
            .to_string();
        assert!(err.contains("group counts [2, 2] for 3 block ids"), "{err}");
    }

    #[test]
    fn every_group_of_a_push_becomes_its_kernel_blocks() {
        let one = SideBlocks {
            ids: &[2, 5],
            group_lens: &[],
            per_id: 2,
        };
        assert_eq!(
            all_kernel_blocks(one, 12, "ids").unwrap(),
            (vec![4, 5, 10, 11], vec![])
        );
        let two = SideBlocks {
            ids: &[1, 0, 3],
            group_lens: &[2, 1],
            per_id: 3,
        };
        let expanded = (vec![3, 4, 5, 0, 1, 2, 9, 10, 11], vec![6, 3]);
        assert_eq!(all_kernel_blocks(two, 24, "ids").unwrap(), expanded);
        assert!(all_kernel_blocks(two, 8, "ids").is_err(), "past the bound");
        let overflow = SideBlocks {
            ids: &[usize::MAX],
            ..one
        };
        assert!(all_kernel_blocks(overflow, usize::MAX, "ids").is_err());
    }
}

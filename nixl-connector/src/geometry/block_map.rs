//! The load path's block-id mapping, in one place: which remote blocks a load reads into
//! which local blocks when the two sides' blocks hold different numbers of tokens, and the
//! prefix-cache trim.
//!
//! Blocks of both sides are split into *units* of the smaller block size (vLLM's kernel
//! blocks: `_logical_to_kernel_block_ids` expands a block id into
//! `physical_blocks_per_logical_kv_block` ids; `_map_block_ids_for_block_size_ratio` splits
//! a local block into remote-sized sub-blocks). Unit `s` of block `b` is unit
//! `b * units_per_block + s`. A load pairs local units with remote units in token order.

use crate::error::{Error, Result};

/// Tokens per block on both sides of a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockSizes {
    /// Tokens per local block.
    pub(crate) local: usize,
    /// Tokens per remote block.
    pub(crate) remote: usize,
}

impl BlockSizes {
    /// Tokens per unit: the smaller block size (the larger must be a multiple of it).
    pub(crate) fn unit(&self) -> usize {
        self.local.min(self.remote)
    }

    /// Units per local block.
    pub(crate) fn local_units(&self) -> usize {
        self.local / self.unit()
    }

    /// Units per remote block.
    pub(crate) fn remote_units(&self) -> usize {
        self.remote / self.unit()
    }
}

/// The units a load reads, as `(local unit, remote unit)` pairs in token order.
///
/// `remote` holds the prompt's blocks from its first token; `local` the decode's blocks
/// from the first token it lacks (its prefix cache may hold the first blocks: vLLM's
/// `_apply_prefix_caching` trims the remote list to the tail). The remote blocks' units that
/// hold tokens are all of them when the remote block is no larger than the local one, and
/// the first `ceil(num_tokens / unit)` otherwise; the decode's blocks for the whole prompt
/// are as many as those units fill, and `local` are the last of them. A local unit past the
/// prompt's end (in the last local block, when remote blocks are smaller) is not read.
///
/// # Errors
/// [`Error::InvalidArgument`] when there are more local blocks than the prompt fills, when
/// `num_tokens` does not fit the remote blocks, or when the remote blocks are larger and
/// `num_tokens` is needed to know where the local blocks start but absent.
pub(crate) fn pair_units(
    request_id: &str,
    local: &[usize],
    remote: &[usize],
    sizes: BlockSizes,
    num_tokens: Option<usize>,
) -> Result<Vec<(usize, usize)>> {
    const OP: &str = "pair the blocks of a load";
    let (unit, lu, ru) = (sizes.unit(), sizes.local_units(), sizes.remote_units());
    let remote_units = remote.len() * ru;
    // Units holding tokens: every remote unit, but for the tail of a larger last block.
    let filled = match num_tokens {
        Some(tokens) => {
            let units = tokens.div_ceil(unit);
            if units > remote_units || units + ru <= remote_units {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "request {request_id:?}: num_tokens {tokens} needs {} remote blocks of {} tokens, the load names {}",
                        tokens.div_ceil(sizes.remote),
                        sizes.remote,
                        remote.len()
                    ),
                ));
            }
            units
        }
        None if ru == 1 || local.len() * lu == remote_units => remote_units,
        None => {
            return Err(Error::invalid(
                OP,
                format!(
                "request {request_id:?}: {} local blocks of {} tokens for {} remote blocks of {}: \
                     which tokens they hold depends on the prompt's length; pass num_tokens \
                     (vLLM's remote_num_tokens)",
                local.len(),
                sizes.local,
                remote.len(),
                sizes.remote
            ),
            ))
        }
    };
    let local_total = filled.div_ceil(lu);
    let Some(skipped) = local_total.checked_sub(local.len()) else {
        return Err(Error::invalid(
            OP,
            format!(
                "request {request_id:?}: {} local blocks for {} remote blocks (the remote tokens fill {local_total} local blocks of {} tokens)",
                local.len(),
                remote.len(),
                sizes.local
            ),
        ));
    };
    let first = skipped * lu;
    let local_units = local.iter().flat_map(|&b| (0..lu).map(move |s| b * lu + s));
    let remote_units = remote
        .iter()
        .flat_map(|&b| (0..ru).map(move |s| b * ru + s));
    // No local block (a registration of none, in a push): `first` is past the tokens.
    Ok(local_units
        .zip(remote_units.skip(first).take(filled.saturating_sub(first)))
        .collect())
}

/// One side's block ids of a load of several KV cache groups: each group's in turn, `lens`
/// of them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupBlocks<'a> {
    /// The ids, group after group.
    pub(crate) ids: &'a [usize],
    /// How many ids each group has.
    pub(crate) lens: &'a [usize],
}

/// The `(local unit, remote unit)` pairs of a load of several KV cache groups, group after
/// group, and how many pairs each group has.
pub(crate) type GroupPairs = (Vec<(usize, usize)>, Vec<usize>);

/// The units a load of several KV cache groups reads (see [`KvCacheGroups`](crate::KvCacheGroups)),
/// as `(local unit, remote unit)` pairs in token order, group after group, and how many
/// pairs each group has.
///
/// Each group's lists are the tail of the blocks the prompt fills on each side: a
/// sliding-window group's clipped to its window (by each engine, in its own blocks), a
/// full-attention group's whole on the prefill and without the decode's prefix cache. The
/// `remote` ids are the prefill's kernel blocks, `per_id.1` of them for each of its block ids
/// (vLLM's `physical_blocks_per_logical_kv_block`; `_logical_to_kernel_block_ids` expands
/// them); units are the prefill's kernel blocks, of which a decode block holds
/// [`BlockSizes::local_units`] (vLLM's `_map_block_ids_for_block_size_ratio`). The `local`
/// ids are the decode's kernel blocks likewise, `per_id.0` for each of its block ids. A
/// unit is read when both sides' lists hold it, so each group's lists meet at the same
/// token of the prompt:
/// - with blocks of as many tokens and one kernel block per id, the lists end together:
///   local block `i` from the last pairs with remote block `i` from the last (vLLM's
///   `_apply_prefix_caching`);
/// - otherwise by the prompt's `num_tokens` (vLLM's `remote_num_tokens`): the units
///   holding tokens end the prompt, each side's ids end with its block id holding the last
///   token (kernel blocks past it are not read).
///
/// An SSM group (`is_state(group)`) holds the running state in one block on each side
/// (vLLM's `clip_ssm_state_blocks`, by each engine), whatever its token position: its
/// local block pairs with its remote block, as block ids rather than units (a state page is
/// a whole id, whatever the block sizes or kernel blocks per id: vLLM moves it 1:1).
///
/// # Errors
/// [`Error::InvalidArgument`] when the prefill's kernel blocks are larger than the decode's
/// (vLLM 0.33 reads blocks of different sizes only into a multiple of them:
/// `TransferTopology.block_size_ratio` asserts it), when the counts do not add up to the
/// ids or the groups differ in number, when a group has more local blocks than remote ones
/// (same sizes) or more than the prompt fills, when an SSM group has more than one block on
/// a side or a local block without a remote one, and when `num_tokens` is needed but
/// absent.
pub(crate) fn pair_groups(
    request_id: &str,
    local: GroupBlocks<'_>,
    remote: GroupBlocks<'_>,
    sizes: BlockSizes,
    num_tokens: Option<usize>,
    per_id: (usize, usize),
    is_state: impl Fn(usize) -> bool,
) -> Result<GroupPairs> {
    const OP: &str = "pair the blocks of a load";
    let invalid = |why: String| Error::invalid(OP, format!("request {request_id:?}: {why}"));
    let groups = local.lens.len();
    check_group_block_sizes(groups, sizes).map_err(invalid)?;
    let (locals, remotes) = split_groups(local, remote).map_err(invalid)?;
    let end = PromptEnd::of(groups, sizes, num_tokens, per_id).map_err(invalid)?;
    let lu = sizes.local_units();
    let mut pairs = Vec::with_capacity(local.ids.len().saturating_mul(lu));
    let mut counts = Vec::with_capacity(groups);
    for (group, (l, r)) in locals.iter().zip(&remotes).enumerate() {
        let before = pairs.len();
        let paired = if is_state(group) {
            pair_state_blocks(group, l, r, &mut pairs)
        } else if let Some(end) = &end {
            end.pair_by_tokens(group, l, r, &mut pairs)
        } else {
            pair_tails(group, l, r, &mut pairs)
        };
        paired.map_err(invalid)?;
        counts.push(pairs.len() - before);
    }
    Ok((pairs, counts))
}

/// Refuses a load of `groups` KV cache groups whose remote blocks are larger than the local
/// ones (vLLM 0.33's `TransferTopology.block_size_ratio` asserts the opposite).
fn check_group_block_sizes(groups: usize, sizes: BlockSizes) -> std::result::Result<(), String> {
    if sizes.remote > sizes.local {
        return Err(format!(
            "{groups} KV cache groups with blocks of {} tokens (local) and {} (remote): vLLM 0.33 reads a hybrid model's blocks only when the decode's block size is a multiple of the prefill's (its TransferTopology.block_size_ratio asserts it); give the decode blocks of a multiple of {} tokens",
            sizes.local, sizes.remote, sizes.remote
        ));
    }
    Ok(())
}

/// One side's block ids of a load, one list per KV cache group.
type GroupLists<'a> = Vec<&'a [usize]>;

/// Each side's ids split into its groups' lists, as many groups on both sides.
fn split_groups<'a>(
    local: GroupBlocks<'a>,
    remote: GroupBlocks<'a>,
) -> std::result::Result<(GroupLists<'a>, GroupLists<'a>), String> {
    let split = |side: GroupBlocks<'a>| {
        crate::geometry::groups::split(side.ids, side.lens).map_err(|err| err.to_string())
    };
    let (locals, remotes) = (split(local)?, split(remote)?);
    if locals.len() != remotes.len() {
        return Err(format!(
            "{} local KV cache groups for {} remote ones",
            locals.len(),
            remotes.len()
        ));
    }
    Ok((locals, remotes))
}

/// Where the prompt ends, for a load whose groups' lists meet at the prompt's tokens: in
/// units, and in each side's kernel blocks up to the end of the block id holding its last
/// token.
#[derive(Debug, Clone, Copy)]
struct PromptEnd {
    /// The prompt's tokens (vLLM's `remote_num_tokens`).
    tokens: usize,
    /// The units holding them.
    filled: usize,
    /// Remote kernel blocks up to the end of the remote block id holding the last token.
    remote_end: usize,
    /// Local kernel blocks up to the end of the local block id holding the last token.
    local_end: usize,
    /// Both sides' block sizes.
    sizes: BlockSizes,
    /// Kernel blocks per block id (local, remote).
    per_id: (usize, usize),
}

impl PromptEnd {
    /// Where the prompt of `num_tokens` ends for a load of `groups` groups, or `None` when
    /// the lists end together (blocks of as many tokens, one kernel block per id).
    fn of(
        groups: usize,
        sizes: BlockSizes,
        num_tokens: Option<usize>,
        (local_per_id, per_id): (usize, usize),
    ) -> std::result::Result<Option<Self>, String> {
        let lu = sizes.local_units();
        if lu == 1 && per_id == 1 && local_per_id == 1 {
            return Ok(None);
        }
        let Some(tokens) = num_tokens else {
            return Err(format!(
                "{groups} KV cache groups with blocks of {} tokens (local, {local_per_id} per block id) and {} (remote, {per_id} per block id): which tokens each group's blocks hold depends on the prompt's length; pass num_tokens (vLLM's remote_num_tokens)",
                sizes.local, sizes.remote
            ));
        };
        let filled = tokens.div_ceil(sizes.unit());
        let overflows = || format!("num_tokens {tokens} overflows");
        let remote_end = filled
            .div_ceil(per_id)
            .checked_mul(per_id)
            .ok_or_else(overflows)?;
        let local_end = filled
            .div_ceil(lu)
            .div_ceil(local_per_id)
            .checked_mul(local_per_id)
            .ok_or_else(overflows)?;
        Ok(Some(PromptEnd {
            tokens,
            filled,
            remote_end,
            local_end,
            sizes,
            per_id: (local_per_id, per_id),
        }))
    }

    /// Appends to `pairs` the units of `group` whose lists `l` (local) and `r` (remote) both
    /// hold, each list ending at the prompt's end.
    fn pair_by_tokens(
        &self,
        group: usize,
        l: &[usize],
        r: &[usize],
        pairs: &mut Vec<(usize, usize)>,
    ) -> std::result::Result<(), String> {
        let (local_per_id, per_id) = self.per_id;
        if r.len() > self.remote_end || l.len() > self.local_end {
            return Err(format!(
                "KV cache group {group}: num_tokens {} fill {} remote block ids of {} tokens and {} local ones of {} tokens, the load names {} and {}",
                self.tokens,
                self.remote_end / per_id,
                self.sizes.remote * per_id,
                self.local_end / local_per_id,
                self.sizes.local * local_per_id,
                r.len() / per_id,
                l.len() / local_per_id
            ));
        }
        let lu = self.sizes.local_units();
        let remote_first = self.remote_end - r.len();
        let skipped = self.local_end - l.len();
        for unit in remote_first.max(skipped.saturating_mul(lu))..self.filled {
            let block = l[unit / lu - skipped];
            pairs.push((block * lu + unit % lu, r[unit - remote_first]));
        }
        Ok(())
    }
}

/// Appends to `pairs` the one state-bearing block of SSM group `group` on each side (`l`
/// local, `r` remote), as block ids.
fn pair_state_blocks(
    group: usize,
    l: &[usize],
    r: &[usize],
    pairs: &mut Vec<(usize, usize)>,
) -> std::result::Result<(), String> {
    if l.len() > 1 || r.len() > 1 || l.len() > r.len() {
        return Err(format!(
            "KV cache group {group} (SSM state): {} local blocks for {} remote blocks, where each engine hands over its one state-bearing block (vLLM's clip_ssm_state_blocks)",
            l.len(),
            r.len()
        ));
    }
    pairs.extend(l.iter().copied().zip(r.iter().copied()));
    Ok(())
}

/// Appends to `pairs` group `group`'s blocks of lists that end together: local block `i`
/// from the last with remote block `i` from the last.
fn pair_tails(
    group: usize,
    l: &[usize],
    r: &[usize],
    pairs: &mut Vec<(usize, usize)>,
) -> std::result::Result<(), String> {
    let Some(skipped) = r.len().checked_sub(l.len()) else {
        return Err(format!(
            "KV cache group {group}: {} local blocks for {} remote blocks",
            l.len(),
            r.len()
        ));
    };
    pairs.extend(l.iter().copied().zip(r[skipped..].iter().copied()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAME: BlockSizes = BlockSizes {
        local: 16,
        remote: 16,
    };
    const LOCAL_DOUBLE: BlockSizes = BlockSizes {
        local: 32,
        remote: 16,
    };
    const REMOTE_DOUBLE: BlockSizes = BlockSizes {
        local: 16,
        remote: 32,
    };

    #[test]
    fn a_prefix_hit_reads_the_tail_of_the_remote_blocks() {
        let remote = [10, 11, 12, 13];
        let pairs = |local: &[usize]| pair_units("r", local, &remote, SAME, None).unwrap();
        assert_eq!(pairs(&[0, 1, 2, 3]), [(0, 10), (1, 11), (2, 12), (3, 13)]);
        assert_eq!(pairs(&[7]), [(7, 13)]);
        assert!(pairs(&[]).is_empty());
        let err = pair_units("r", &[0, 1, 2], &[5, 6], SAME, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("3 local blocks for 2 remote blocks"), "{err}");
    }

    #[test]
    fn smaller_remote_blocks_fill_whole_local_blocks() {
        // Local blocks of 32 tokens are units 2b and 2b + 1.
        let pairs = pair_units("r", &[4, 9], &[1, 2, 3, 7], LOCAL_DOUBLE, None).unwrap();
        assert_eq!(pairs, [(8, 1), (9, 2), (18, 3), (19, 7)]);
        // Three remote blocks: the last local block's second half is not read.
        let pairs = pair_units("r", &[4, 9], &[1, 2, 3], LOCAL_DOUBLE, None).unwrap();
        assert_eq!(pairs, [(8, 1), (9, 2), (18, 3)]);
        // A prefix hit of one local block (two remote blocks).
        let pairs = pair_units("r", &[9], &[1, 2, 3], LOCAL_DOUBLE, None).unwrap();
        assert_eq!(pairs, [(18, 3)]);
    }

    #[test]
    fn larger_remote_blocks_are_read_unit_by_unit() {
        // Remote blocks of 32 tokens are units 2b and 2b + 1; 48 tokens fill three.
        let pairs = pair_units("r", &[5, 6, 7], &[3, 8], REMOTE_DOUBLE, Some(48)).unwrap();
        assert_eq!(pairs, [(5, 6), (6, 7), (7, 16)]);
        // The same prompt with its first local block in the prefix cache.
        let pairs = pair_units("r", &[6, 7], &[3, 8], REMOTE_DOUBLE, Some(48)).unwrap();
        assert_eq!(pairs, [(6, 7), (7, 16)]);
        // Full blocks need no token count.
        let pairs = pair_units("r", &[0, 1, 2, 3], &[3, 8], REMOTE_DOUBLE, None).unwrap();
        assert_eq!(pairs, [(0, 6), (1, 7), (2, 16), (3, 17)]);
    }

    fn groups<'a>(ids: &'a [usize], lens: &'a [usize]) -> GroupBlocks<'a> {
        GroupBlocks { ids, lens }
    }

    #[test]
    fn groups_pair_block_by_block_when_their_blocks_hold_as_many_tokens() {
        let pair = |local: &[usize], lens: &[usize], sizes| {
            pair_groups(
                "r",
                groups(local, lens),
                groups(&[7, 8, 9], &[2, 1]),
                sizes,
                None,
                (1, 1),
                |_| false,
            )
        };
        let (pairs, counts) = pair(&[1, 2, 3], &[2, 1], SAME).unwrap();
        assert_eq!(pairs, [(1, 7), (2, 8), (3, 9)]);
        assert_eq!(counts, [2, 1]);
        // A prefix hit: the group's local blocks pair with the last of its remote ones.
        let (pairs, counts) = pair(&[2, 3], &[1, 1], SAME).unwrap();
        assert_eq!((pairs, counts), (vec![(2, 8), (3, 9)], vec![1, 1]));
        let err = pair(&[1, 2, 3], &[2, 1], REMOTE_DOUBLE)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("blocks of 16 tokens (local) and 32 (remote)")
                && err.contains("TransferTopology.block_size_ratio"),
            "{err}"
        );
        let err = pair(&[1, 2, 3], &[2, 2], SAME).unwrap_err().to_string();
        assert!(err.contains("do not add up to the 3"), "{err}");
        let err = pair(&[1, 2, 3], &[3], SAME).unwrap_err().to_string();
        assert!(
            err.contains("1 local KV cache groups for 2 remote"),
            "{err}"
        );
        let err = pair(&[1, 2, 3], &[1, 2], SAME).unwrap_err().to_string();
        assert!(
            err.contains("KV cache group 1: 2 local blocks for 1 remote blocks"),
            "{err}"
        );
        let err = pair(&[1, 2, 3], &[2, 1], LOCAL_DOUBLE)
            .unwrap_err()
            .to_string();
        assert!(err.contains("pass num_tokens"), "{err}");
    }

    #[test]
    fn larger_decode_blocks_pair_each_groups_units_by_token() {
        // 20 tokens: 2 remote blocks of 16, 1 local block of 32. Full attention: remote 3
        // and 8 into local 5's two units; the window group's last remote block, 12, into
        // the second unit of its local block 6.
        let (pairs, counts) = pair_groups(
            "r",
            groups(&[5, 6], &[1, 1]),
            groups(&[3, 8, 12], &[2, 1]),
            LOCAL_DOUBLE,
            Some(20),
            (1, 1),
            |_| false,
        )
        .unwrap();
        assert_eq!(pairs, [(10, 3), (11, 8), (13, 12)]);
        assert_eq!(counts, [2, 1]);
        // 70 tokens: 5 remote blocks (the last one partly filled), 3 local blocks. The
        // window group's lists start at the prompt's remote block 3 and local block 1
        // (units 2 and 3): unit 2 is not in its remote list and not read; units 3 and 4
        // land in the second half of local block 7 and the first half of 9.
        let (pairs, counts) = pair_groups(
            "r",
            groups(&[1, 2, 3, 7, 9], &[3, 2]),
            groups(&[10, 11, 12, 13, 14, 23, 24], &[5, 2]),
            LOCAL_DOUBLE,
            Some(70),
            (1, 1),
            |_| false,
        )
        .unwrap();
        assert_eq!(
            pairs,
            [
                (2, 10),
                (3, 11),
                (4, 12),
                (5, 13),
                (6, 14),
                (15, 23),
                (18, 24)
            ]
        );
        assert_eq!(counts, [5, 2]);
        let err = pair_groups(
            "r",
            groups(&[1, 2, 3, 4], &[4]),
            groups(&[10, 11], &[2]),
            LOCAL_DOUBLE,
            Some(20),
            (1, 1),
            |_| false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("KV cache group 0: num_tokens 20 fill 2 remote block ids of 16 tokens and 1 local ones of 32 tokens, the load names 2 and 4"),
            "{err}"
        );
    }

    #[test]
    fn kernel_blocks_past_the_prompt_are_not_read() {
        // Remote block ids of 2 kernel blocks of 16 tokens, 40 tokens: ids 4 and 6 are
        // kernel blocks 8, 9, 12 (13 holds no token); local blocks of 16.
        let (pairs, counts) = pair_groups(
            "r",
            groups(&[1, 2, 3, 5, 7], &[3, 2]),
            groups(&[8, 9, 12, 13, 12, 13], &[4, 2]),
            SAME,
            Some(40),
            (1, 2),
            |_| false,
        )
        .unwrap();
        assert_eq!(pairs, [(1, 8), (2, 9), (3, 12), (7, 12)]);
        assert_eq!(counts, [3, 1]);
        // With local blocks of two kernel blocks: units of 16 tokens.
        let (pairs, _) = pair_groups(
            "r",
            groups(&[4, 5], &[2]),
            groups(&[8, 9, 12, 13], &[4]),
            LOCAL_DOUBLE,
            Some(40),
            (1, 2),
            |_| false,
        )
        .unwrap();
        assert_eq!(pairs, [(8, 8), (9, 9), (10, 12)]);
    }

    #[test]
    fn a_decodes_block_ids_of_several_kernel_blocks_are_read_to_the_prompts_end() {
        // Local ids of 2 kernel blocks of 16 tokens (ids 3 and 5: kernel blocks 6 7 10 11),
        // remote blocks of 16 tokens, 40 tokens: kernel block 11 holds no token.
        let (pairs, counts) = pair_groups(
            "r",
            groups(&[6, 7, 10, 11, 10, 11], &[4, 2]),
            groups(&[1, 2, 3, 3], &[3, 1]),
            SAME,
            Some(40),
            (2, 1),
            |_| false,
        )
        .unwrap();
        assert_eq!(pairs, [(6, 1), (7, 2), (10, 3), (10, 3)]);
        assert_eq!(counts, [3, 1]);
        // A peer's token count past any prompt pairs at most the blocks named, or is
        // refused: no panic, nothing sized by it.
        for (tokens, sizes) in [(usize::MAX, SAME), (usize::MAX - 1, LOCAL_DOUBLE)] {
            let far = pair_groups(
                "r",
                groups(&[6, 7], &[2]),
                groups(&[1, 2], &[2]),
                sizes,
                Some(tokens),
                (2, 2),
                |_| false,
            );
            assert!(far.map_or(true, |(pairs, _)| pairs.len() <= 2));
        }
    }

    #[test]
    fn an_ambiguous_or_inconsistent_pairing_is_refused() {
        let err = pair_units("r", &[6, 7], &[3, 8], REMOTE_DOUBLE, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("pass num_tokens"), "{err}");
        let err = pair_units("r", &[6, 7], &[3, 8], REMOTE_DOUBLE, Some(65))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("num_tokens 65 needs 3 remote blocks of 32 tokens, the load names 2"),
            "{err}"
        );
        let err = pair_units("r", &[6, 7], &[3, 8], REMOTE_DOUBLE, Some(32))
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_tokens 32 needs 1 remote blocks"), "{err}");
        let err = pair_units("r", &[1, 2, 3], &[3, 8], LOCAL_DOUBLE, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("3 local blocks for 2 remote blocks"), "{err}");
    }

    #[test]
    fn an_ssm_group_pairs_its_one_state_block_with_the_prefills() {
        let pair = |local: &[usize], lens: &[usize], remote: &[usize], remote_lens: &[usize]| {
            pair_groups(
                "r",
                groups(local, lens),
                groups(remote, remote_lens),
                SAME,
                Some(40),
                (1, 1),
                |g| g == 1,
            )
        };
        // The attention group by its tail, the state block with the prefill's (not the
        // block at its token position).
        let (pairs, counts) = pair(&[5, 6, 31], &[2, 1], &[1, 2, 3, 21], &[3, 1]).unwrap();
        assert_eq!(pairs, [(5, 2), (6, 3), (31, 21)]);
        assert_eq!(counts, [2, 1]);
        for (local, lens, remote, remote_lens) in [
            (&[5, 31, 32][..], &[1, 2][..], &[3, 21][..], &[1, 1][..]),
            (&[5, 31], &[1, 1], &[3, 21, 22], &[1, 2]),
            (&[5, 31], &[1, 1], &[3], &[1, 0]),
        ] {
            let err = pair(local, lens, remote, remote_lens)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("KV cache group 1 (SSM state)")
                    && err.contains("clip_ssm_state_blocks"),
                "{err}"
            );
        }
    }
}

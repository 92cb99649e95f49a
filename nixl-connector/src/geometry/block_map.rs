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
    Ok(local_units
        .zip(remote_units.skip(first).take(filled - first))
        .collect())
}

/// The units a load of several KV cache groups reads (see [`KvCacheGroups`](crate::KvCacheGroups)): `remote`
/// holds each group's blocks in turn, `group_lens` long, already trimmed to the local ones
/// (the scheduler's `update_state_after_alloc_groups`), so that local block `i` reads
/// remote block `i`, both engines' blocks holding as many tokens.
///
/// # Errors
/// [`Error::InvalidArgument`] when the blocks differ in size, when the counts do not add up
/// to the remote blocks, or when there are not as many local blocks as remote ones.
pub(crate) fn pair_groups(
    request_id: &str,
    local: &[usize],
    remote: &[usize],
    group_lens: &[usize],
    sizes: BlockSizes,
) -> Result<Vec<(usize, usize)>> {
    const OP: &str = "pair the blocks of a load";
    if sizes.local != sizes.remote {
        return Err(Error::invalid(
            OP,
            format!(
                "request {request_id:?}: {} KV cache groups with blocks of {} tokens (local) and {} (remote): a hybrid model's blocks must hold as many tokens on both engines",
                group_lens.len(),
                sizes.local,
                sizes.remote
            ),
        ));
    }
    crate::geometry::groups::split(remote, group_lens)
        .map_err(|err| Error::invalid(OP, format!("request {request_id:?}: {err}")))?;
    if local.len() != remote.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "request {request_id:?}: {} local blocks for {} remote blocks of {} KV cache groups {group_lens:?}: pair them group by group (the scheduler's update_state_after_alloc_groups)",
                local.len(),
                remote.len(),
                group_lens.len()
            ),
        ));
    }
    Ok(local.iter().copied().zip(remote.iter().copied()).collect())
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

    #[test]
    fn groups_pair_block_by_block_when_their_blocks_hold_as_many_tokens() {
        let pairs = pair_groups("r", &[1, 2, 3], &[7, 8, 9], &[2, 1], SAME).unwrap();
        assert_eq!(pairs, [(1, 7), (2, 8), (3, 9)]);
        let err = pair_groups("r", &[1, 2, 3], &[7, 8, 9], &[2, 1], LOCAL_DOUBLE)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("blocks of 32 tokens (local) and 16 (remote)"),
            "{err}"
        );
        let err = pair_groups("r", &[1, 2, 3], &[7, 8, 9], &[2, 2], SAME)
            .unwrap_err()
            .to_string();
        assert!(err.contains("do not add up to the 3"), "{err}");
        let err = pair_groups("r", &[1, 2], &[7, 8, 9], &[2, 1], SAME)
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 local blocks for 3 remote blocks"), "{err}");
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
}

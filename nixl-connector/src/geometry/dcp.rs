//! Decode context parallelism (DCP): a request's blocks spread over the ranks of a DCP
//! group, the block at global position `g` on DCP rank `g % size`, as its `g / size`-th
//! block; and which of a local rank's blocks pair with which of a remote rank's when the
//! two engines' DCP sizes differ (vLLM's `_apply_dcp_prefix_caching`).
//!
//! One DCP size divides the other. With equal sizes, DCP rank `r` reads from remote DCP
//! rank `r`, block for block. With a larger remote size (by a factor `k`), a local rank's
//! positions are spread over `k` remote ranks, and each reads every `k`-th of its local
//! blocks from one of them; with a smaller remote size, a local rank reads every `k`-th
//! block of the one remote rank holding its positions. A prefix of the request may already
//! be cached locally: it is left out on both sides. A pair that matches nothing only
//! notifies the remote rank.

use crate::error::{Error, Result};

/// The most ranks a DCP group may have.
pub const MAX_DCP_SIZE: usize = 1 << 8;

/// A local DCP rank's place against a remote engine's DCP group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DcpPair {
    /// The local DCP group's size.
    pub local_size: usize,
    /// The local rank's place in it.
    pub local_rank: usize,
    /// The remote DCP group's size.
    pub remote_size: usize,
}

impl DcpPair {
    /// The pair, checked: sizes of 1 to [`MAX_DCP_SIZE`] of which one divides the other,
    /// and a local rank below the local size.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming both sizes.
    pub fn new(local_size: usize, local_rank: usize, remote_size: usize) -> Result<Self> {
        let sizes_ok = (1..=MAX_DCP_SIZE).contains(&local_size)
            && (1..=MAX_DCP_SIZE).contains(&remote_size)
            && (local_size % remote_size == 0 || remote_size % local_size == 0);
        if !sizes_ok || local_rank >= local_size {
            return Err(Error::invalid(
                "pair DCP groups",
                format!("local DCP size {local_size} (rank {local_rank}) against remote DCP size {remote_size}: one size must divide the other (1 to {MAX_DCP_SIZE}), and the rank be below its size"),
            ));
        }
        Ok(DcpPair {
            local_size,
            local_rank,
            remote_size,
        })
    }

    /// The blocks this rank reads from remote rank `remote_rank` (its TP rank; its DCP rank
    /// is `remote_rank % remote_size`): `local_ids` are the local blocks still to fill (those
    /// past the `local_cached` blocks the local prefix cache holds), `remote_ids` the remote
    /// rank's whole list; `num_blocks`, when known, the request's blocks in all (before DCP
    /// slicing, without allocation padding). Returns the pairs as two lists of equal length
    /// (empty: nothing read, the remote rank is only notified).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `num_blocks` is given and the remote blocks do not
    /// cover the local ones that need it.
    pub fn pair(
        &self,
        local_ids: &[usize],
        remote_ids: &[usize],
        remote_rank: usize,
        local_cached: usize,
        num_blocks: Option<usize>,
    ) -> Result<(Vec<usize>, Vec<usize>)> {
        let (local_size, remote_size) = (self.local_size, self.remote_size);
        let remote_dcp_rank = remote_rank % remote_size;
        let smaller = local_size.min(remote_size);
        if remote_dcp_rank % smaller != self.local_rank % smaller {
            // The two ranks hold no position in common.
            return Ok((Vec::new(), Vec::new()));
        }
        let local_ids = match num_blocks {
            Some(total) => {
                let held = total.saturating_sub(self.local_rank).div_ceil(local_size);
                &local_ids[..local_ids.len().min(held.saturating_sub(local_cached))]
            }
            None => local_ids,
        };
        let (local_slice, remote_slice): (Vec<usize>, Vec<usize>) = if local_size == remote_size {
            let remote = remote_ids.get(local_cached..).unwrap_or_default();
            (local_ids.to_vec(), remote.to_vec())
        } else if local_size < remote_size {
            // The local rank's positions go round `k` remote ranks; this one is the `p`-th.
            let k = remote_size / local_size;
            let p = (remote_dcp_rank - self.local_rank) / local_size;
            let start_local = (p + k - local_cached % k) % k;
            let start_remote = (local_cached + start_local - p) / k;
            let local = local_ids.iter().skip(start_local).step_by(k).copied();
            let remote = remote_ids.get(start_remote..).unwrap_or_default();
            (local.collect(), remote.to_vec())
        } else {
            // The remote rank holds `k` local ranks' positions; this one is the `c`-th.
            let k = local_size / remote_size;
            let c = (self.local_rank - remote_dcp_rank) / remote_size;
            let start_remote = c + local_cached * k;
            let remote = remote_ids.iter().skip(start_remote).step_by(k).copied();
            (local_ids.to_vec(), remote.collect())
        };
        let matched = local_slice.len().min(remote_slice.len());
        if num_blocks.is_some() && matched < local_slice.len() {
            return Err(Error::invalid(
                "pair DCP blocks",
                format!(
                    "remote rank {remote_rank} holds {} blocks for the {} local ones to fill: the remote KV does not cover the requested range",
                    remote_slice.len(),
                    local_slice.len()
                ),
            ));
        }
        Ok((
            local_slice[..matched].to_vec(),
            remote_slice[..matched].to_vec(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The global positions DCP rank `rank` of a group of `size` holds among `n`.
    fn owned(n: usize, size: usize, rank: usize) -> Vec<usize> {
        (0..n).filter(|g| g % size == rank).collect()
    }

    #[test]
    fn the_example_of_a_cached_prefix_reads_only_what_is_left() {
        // Local DCP 2, rank 0 holds positions 0, 2, 4, 6, the first three cached: only 6
        // is read. Remote DCP 4: rank 0 holds 0 and 4 (nothing left), rank 2 holds 2 and 6.
        let pair = DcpPair::new(2, 0, 4).unwrap();
        let remote = |rank| owned(8, 4, rank);
        assert_eq!(
            pair.pair(&[6], &remote(0), 0, 3, None).unwrap(),
            (vec![], vec![])
        );
        assert_eq!(
            pair.pair(&[6], &remote(2), 2, 3, None).unwrap(),
            (vec![6], vec![6])
        );
    }

    /// Every global position past the cached prefix is read exactly once, by the local rank
    /// that holds it, from the remote rank that holds it, with positions as block ids.
    fn every_position_read_once(n: usize, cached: usize, local_size: usize, remote_size: usize) {
        let mut reads = vec![0; n];
        for local_rank in 0..local_size {
            let pair = DcpPair::new(local_size, local_rank, remote_size).unwrap();
            let mine = owned(n, local_size, local_rank);
            let local_cached = mine.iter().filter(|&&g| g < cached).count();
            let to_fill = &mine[local_cached..];
            for remote_rank in 0..remote_size {
                let theirs = owned(n, remote_size, remote_rank);
                let (local, remote) = pair
                    .pair(to_fill, &theirs, remote_rank, local_cached, Some(n))
                    .unwrap();
                assert_eq!(local, remote, "{n} blocks, {cached} cached, DCP {local_size} <- {remote_size}: rank {local_rank} from {remote_rank}");
                for g in local {
                    reads[g] += 1;
                }
            }
        }
        for (g, &count) in reads.iter().enumerate() {
            let want = usize::from(g >= cached);
            assert_eq!(
                count, want,
                "position {g} of {n}, {cached} cached, DCP {local_size} <- {remote_size}"
            );
        }
    }

    #[test]
    fn every_position_is_read_once_by_the_rank_that_holds_it() {
        // Exhaustive over small cases: every size pair of 1, 2 and 4, every request length
        // up to 40 blocks and every cached prefix.
        for local_size in [1, 2, 4] {
            for remote_size in [1, 2, 4] {
                for n in 0..=40 {
                    for cached in 0..=n {
                        every_position_read_once(n, cached, local_size, remote_size);
                    }
                }
            }
        }
    }

    #[test]
    fn sizes_that_do_not_divide_and_short_remote_lists_are_refused() {
        assert!(DcpPair::new(2, 0, 3).is_err());
        assert!(DcpPair::new(4, 4, 2).is_err());
        assert!(DcpPair::new(0, 0, 1).is_err());
        let pair = DcpPair::new(1, 0, 1).unwrap();
        let err = pair.pair(&[0, 1, 2], &[0, 1], 0, 0, Some(3)).unwrap_err();
        assert!(err.to_string().contains("does not cover"), "{err}");
    }
}

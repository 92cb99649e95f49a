//! Decode context parallelism (DCP): a request's blocks spread over the ranks of a DCP
//! group, the block at global position `g` on DCP rank `g % size`, as its `g / size`-th
//! block; which remote ranks a rank reads (vLLM's `TransferTopology.dcp_source_ranks`),
//! how many readers notify each (`dcp_consumer_count`), and which of a local rank's blocks
//! pair with which of a remote rank's when the two engines' DCP sizes differ (vLLM's
//! `_apply_dcp_prefix_caching`).
//!
//! As in vLLM 0.33's NixlConnector, DCP is for MLA caches (one latent per token, the same
//! on every TP rank without DCP), and an engine's DCP size is 1 or its TP size, so that a
//! rank's DCP rank is its TP rank modulo the DCP size and no cache is part replicated, part
//! sharded.
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
            // Never below 0 (`start_local` is `p - local_cached` modulo `k`); saturating
            // for a peer's absurd token count.
            let start_remote = local_cached.saturating_add(start_local).saturating_sub(p) / k;
            let local = local_ids.iter().skip(start_local).step_by(k).copied();
            let remote = remote_ids.get(start_remote..).unwrap_or_default();
            (local.collect(), remote.to_vec())
        } else {
            // The remote rank holds `k` local ranks' positions; this one is the `c`-th.
            let k = local_size / remote_size;
            let c = (self.local_rank - remote_dcp_rank) / remote_size;
            let start_remote = c.saturating_add(local_cached.saturating_mul(k));
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

impl DcpPair {
    /// The blocks of a load this rank reads from remote rank `remote_rank`: `local_ids`,
    /// the local blocks still to fill, run to the request's end (its first blocks may be in
    /// the local prefix cache), and `remote_ids` is the remote rank's whole list. The
    /// request has `num_positions` global block positions when known (its tokens over the
    /// block size, as vLLM counts `num_remote_blocks`): the local list then has
    /// `num_positions / local_size` blocks (rounded up) of which those before `local_ids`
    /// are cached. Without it the two sizes must be equal, the cached blocks those of the
    /// remote list before the last `local_ids.len()`. The pairs as [`pair`](Self::pair)
    /// gives them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `local_ids` is longer than the request's local list,
    /// when the count is unknown and the sizes differ, and those of [`pair`](Self::pair).
    pub fn load_pairs(
        &self,
        local_ids: &[usize],
        remote_ids: &[usize],
        remote_rank: usize,
        num_positions: Option<usize>,
    ) -> Result<(Vec<usize>, Vec<usize>)> {
        const OP: &str = "pair DCP blocks";
        let held = match num_positions {
            Some(n) => n.div_ceil(self.local_size),
            None if self.local_size == self.remote_size => remote_ids.len(),
            None => {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "local DCP size {} against remote DCP size {}: the pairing depends on the request's length; pass num_tokens (vLLM's remote_num_tokens)",
                        self.local_size, self.remote_size
                    ),
                ))
            }
        };
        let Some(cached) = held.checked_sub(local_ids.len()) else {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} local blocks to fill for a request of {held} blocks on each DCP rank",
                    local_ids.len()
                ),
            ));
        };
        self.pair(local_ids, remote_ids, remote_rank, cached, num_positions)
    }
}

/// The DCP sizes of a reader engine (`local`) and of the engine it reads (`remote`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DcpSizes {
    /// The reader's DCP size.
    pub local: usize,
    /// The source's DCP size.
    pub remote: usize,
}

impl DcpSizes {
    /// Neither engine shards its cache.
    pub const NONE: DcpSizes = DcpSizes {
        local: 1,
        remote: 1,
    };

    /// Whether either engine shards its cache over DCP ranks (vLLM's `dcp_active`).
    pub fn active(&self) -> bool {
        self.local > 1 || self.remote > 1
    }

    /// Why the two sizes cannot pair, if they cannot: a size outside 1 to
    /// [`MAX_DCP_SIZE`], or sizes that do not divide one another (vLLM asserts it in
    /// `_validate_remote_agent_handshake`: it keeps the slicing a closed form).
    pub fn mismatch(&self) -> Option<String> {
        let (local, remote) = (self.local, self.remote);
        if !(1..=MAX_DCP_SIZE).contains(&local) || !(1..=MAX_DCP_SIZE).contains(&remote) {
            return Some(format!(
                "DCP sizes local={local}, remote={remote}: each must be 1 to {MAX_DCP_SIZE}"
            ));
        }
        (local % remote != 0 && remote % local != 0)
            .then(|| format!("DCP sizes must divide one another: local={local}, remote={remote}"))
    }
}

/// The remote TP ranks whose DCP slice overlaps that of rank `tp_rank` of a reader of DCP
/// size `local_dcp`, for a source of TP `remote_tp` sharded over `remote_dcp` > 1 DCP
/// ranks (vLLM's `dcp_source_ranks`): with a local DCP size no larger, every remote rank
/// whose DCP rank is the local one modulo the local size (every remote rank for an
/// unsharded reader); with a larger one, the one remote rank holding all of its positions.
pub fn source_ranks(
    tp_rank: usize,
    local_dcp: usize,
    remote_tp: usize,
    remote_dcp: usize,
) -> Vec<usize> {
    let local_dcp = local_dcp.max(1);
    let local_rank = tp_rank % local_dcp;
    if local_dcp <= remote_dcp {
        (0..remote_tp)
            .filter(|r| r % local_dcp == local_rank)
            .collect()
    } else {
        vec![local_rank % remote_dcp.max(1)]
    }
}

/// How many ranks of a reader engine of TP `reader_tp` and DCP size `reader_dcp` notify
/// each rank of an engine of TP `own_tp` and DCP size `own_dcp` about a request they read
/// (vLLM's `dcp_consumer_count`): every reader rank when a sharded source is read by an
/// unsharded reader, the ratio of the DCP sizes when both are sharded, and the ratio of
/// the TP sizes (at least 1) when the source is not sharded.
pub fn consumers(reader_tp: usize, reader_dcp: usize, own_tp: usize, own_dcp: usize) -> usize {
    if own_dcp > 1 {
        if reader_dcp <= 1 {
            return reader_tp.max(1);
        }
        return (reader_dcp / own_dcp).max(1);
    }
    (reader_tp / own_tp.max(1)).max(1)
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

    /// The engines of the engine-level checks: `(TP, DCP)` of an MLA engine, its DCP size
    /// 1 or its TP size as vLLM requires.
    const ENGINES: [(usize, usize); 6] = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 4), (8, 8)];

    /// The remote ranks rank `tp_rank` of `local` notifies on `remote`, and those of them
    /// it reads: the DCP source ranks of a sharded source (each read), else its MLA TP
    /// group, the first read.
    fn ranks_of(
        tp_rank: usize,
        local: (usize, usize),
        remote: (usize, usize),
    ) -> (Vec<usize>, Vec<usize>) {
        if remote.1 > 1 {
            let ranks = source_ranks(tp_rank, local.1, remote.0, remote.1);
            return (ranks.clone(), ranks);
        }
        let group: Vec<usize> = if local.0 >= remote.0 {
            vec![tp_rank / (local.0 / remote.0)]
        } else {
            let ratio = remote.0 / local.0;
            (tp_rank * ratio..(tp_rank + 1) * ratio).collect()
        };
        let read = vec![group[0]];
        (group, read)
    }

    /// For every pair of engines, every request length up to `n_max` blocks and every
    /// cached prefix: every rank of the reader reads each global position it holds past
    /// the prefix exactly once, from a remote rank holding it, into the block holding it;
    /// and each remote rank is notified by exactly `consumers` reader ranks. Returns the
    /// geometries checked.
    fn engines_read_every_position_once(n_max: usize) -> usize {
        let mut geometries = 0;
        for local in ENGINES {
            for remote in ENGINES {
                geometries += 1;
                let mut readers = vec![0; remote.0];
                for tp_rank in 0..local.0 {
                    for r in ranks_of(tp_rank, local, remote).0 {
                        readers[r] += 1;
                    }
                }
                let want = consumers(local.0, local.1, remote.0, remote.1);
                assert!(
                    readers.iter().all(|&c| c == want),
                    "{local:?} <- {remote:?}: {readers:?}, want {want}"
                );
                for n in 0..=n_max {
                    for cached in 0..=n {
                        for tp_rank in 0..local.0 {
                            let dcp_rank = tp_rank % local.1;
                            let pair = DcpPair::new(local.1, dcp_rank, remote.1).unwrap();
                            let mine = owned(n, local.1, dcp_rank);
                            let local_cached = mine.iter().filter(|&&g| g < cached).count();
                            let mut reads = vec![0; n];
                            for r in ranks_of(tp_rank, local, remote).1 {
                                let theirs = owned(n, remote.1, r % remote.1);
                                let (l, rm) = pair
                                    .pair(&mine[local_cached..], &theirs, r, local_cached, Some(n))
                                    .unwrap();
                                assert_eq!(l, rm, "{local:?} <- {remote:?}, rank {tp_rank} from {r}, {n} blocks, {cached} cached");
                                for g in l {
                                    reads[g] += 1;
                                }
                            }
                            for (g, &count) in reads.iter().enumerate() {
                                let want = usize::from(g >= cached && g % local.1 == dcp_rank);
                                assert_eq!(count, want, "{local:?} <- {remote:?}: rank {tp_rank}, position {g} of {n}, {cached} cached");
                            }
                        }
                    }
                }
            }
        }
        geometries
    }

    // Checked once against vLLM 0.33's own functions, run from the wheel (their source
    // taken from it and run as they are: `_apply_dcp_prefix_caching`, and
    // `TransferTopology.dcp_source_ranks` and `dcp_consumer_count`): the source ranks and
    // consumer counts of every rank of the 36 geometries of `ENGINES` agreed (126 of 126),
    // and so did the pairs of every DCP size pair of 1, 2, 4 and 8, every local DCP rank,
    // request of 0 to 20 blocks, cached prefix and remote rank sharing positions with the
    // local one, with and without the request's block count (16,926 of 16,926; vLLM never
    // reads the other remote ranks, for which `pair` returns nothing).
    #[test]
    fn engines_of_every_paired_geometry_read_each_position_once_by_its_holder() {
        // 6 engines each side: 36 geometries.
        assert_eq!(engines_read_every_position_once(24), 36);
    }

    #[test]
    fn hand_worked_vectors() {
        // Reader TP 4 DCP 4, source TP 2 DCP 2, 10 positions, none cached. Reader rank 3
        // holds 3 and 7 (its blocks 0 and 1), read from source rank 1 (holding 1, 3, 5, 7,
        // 9 as its blocks 0 to 4): every other source block from the second.
        assert_eq!(source_ranks(3, 4, 2, 2), [1]);
        let pair = DcpPair::new(4, 3, 2).unwrap();
        assert_eq!(
            pair.pair(&[20, 21], &[10, 11, 12, 13, 14], 1, 0, None)
                .unwrap(),
            (vec![20, 21], vec![11, 13])
        );
        // The same, its first block cached: only 7 (its block 1, the source's block 3).
        assert_eq!(
            pair.pair(&[21], &[10, 11, 12, 13, 14], 1, 1, None).unwrap(),
            (vec![21], vec![13])
        );
        // Reader TP 2 DCP 2, source TP 4 DCP 4, 9 positions, 2 of the reader's blocks
        // cached: reader rank 1 holds 1, 3, 5, 7 (cached 1 and 3), read from source ranks 1
        // (1, 5: its block 1) and 3 (3, 7: its block 1).
        assert_eq!(source_ranks(1, 2, 4, 4), [1, 3]);
        let pair = DcpPair::new(2, 1, 4).unwrap();
        assert_eq!(
            pair.pair(&[32, 33], &[40, 41], 1, 2, None).unwrap(),
            (vec![32], vec![41])
        );
        assert_eq!(
            pair.pair(&[32, 33], &[50, 51], 3, 2, None).unwrap(),
            (vec![33], vec![51])
        );
        // An unsharded reader (TP 2) of a source of DCP 2 reads both source ranks, each
        // rank of it: two readers per source rank.
        assert_eq!(source_ranks(1, 1, 2, 2), [0, 1]);
        assert_eq!(consumers(2, 1, 2, 2), 2);
        // A reader of DCP 2 of an unsharded source (TP 1) takes every other block of it.
        let pair = DcpPair::new(2, 1, 1).unwrap();
        assert_eq!(
            pair.pair(&[7, 8, 9], &[0, 1, 2, 3, 4, 5], 0, 0, None)
                .unwrap(),
            (vec![7, 8, 9], vec![1, 3, 5])
        );
        assert_eq!(consumers(2, 2, 1, 1), 2);
        // A reader of DCP 2 of a source of DCP 4: each source rank is read by one.
        assert_eq!(consumers(2, 2, 4, 4), 1);
        assert_eq!(consumers(4, 4, 2, 2), 2);
        // DCP sizes that do not divide one another, as vLLM words it.
        let sizes = DcpSizes {
            local: 2,
            remote: 3,
        };
        assert_eq!(
            sizes.mismatch().unwrap(),
            "DCP sizes must divide one another: local=2, remote=3"
        );
        assert!(DcpSizes {
            local: 4,
            remote: 2
        }
        .mismatch()
        .is_none());
    }

    #[test]
    fn a_peers_absurd_token_count_is_refused_not_a_panic() {
        for (local, remote) in [(2, 4), (4, 2), (2, 2)] {
            let pair = DcpPair::new(local, 1, remote).unwrap();
            for total in [usize::MAX, usize::MAX / 2, usize::MAX - 1] {
                for rank in 0..remote {
                    let got = pair.load_pairs(&[1, 2], &[3, 4], rank, Some(total));
                    assert!(got.is_err() || got.is_ok_and(|(l, _)| l.is_empty()));
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

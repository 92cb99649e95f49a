//! Which ranks of a remote (prefill) engine a local (decode) rank reads from, and what it
//! takes from each: vLLM's `TransferTopology.handshake_target_ranks`, `compute_tp_mapping`
//! and `compute_head_offset` (`tp_mapping.py`, `utils.py`).
//!
//! - Decode TP `D` a multiple of prefill TP `P`: rank `d` reads from prefill rank
//!   `d * P / D`, which holds its heads (MHA, HND) or the latent (MLA) whole.
//! - Prefill TP a multiple of decode TP: rank `d` holds the request's blocks with the `P / D`
//!   prefill ranks `d * P/D ..`. MHA: each head the decode holds is read once, from the first
//!   of them that holds it, into its place in the local block; MLA: the latent is read once,
//!   from the first. The ranks not read from are notified all the same, so that they free
//!   the request's blocks.
//!
//! Every prefill rank holding a request thus gets one notification from each decode rank
//! whose group it is in: `max(1, D / P)` of them ([`TpMapping::consumers`]).

use std::ops::Range;

use crate::error::{Error, Result};
use crate::geometry::dcp::{consumers, source_ranks, DcpSizes};
use crate::geometry::spec::KvAttention;

/// What a local rank takes from one remote rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    /// KV heads: the local rank's heads `local_first .. local_first + count` (counted within
    /// the local rank) are the remote rank's `remote_first ..` (counted within it).
    Heads {
        /// The first local head, counted from the local rank's first.
        local_first: usize,
        /// The first remote head, counted from the remote rank's first.
        remote_first: usize,
        /// How many heads.
        count: usize,
    },
    /// The whole latent of every token (MLA).
    Latent,
    /// Nothing: what this rank would give is read from another of the group. It is only
    /// notified, so that it frees the request's blocks (vLLM notifies the MLA ranks it did
    /// not read from).
    NotifiedOnly,
}

impl Share {
    /// Whether anything is read.
    pub fn reads(&self) -> bool {
        *self != Share::NotifiedOnly
    }
}

/// One remote rank of a local rank's group and what is taken from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankShare {
    /// The remote TP rank.
    pub rank: usize,
    /// What is read from it.
    pub share: Share,
}

/// How one local rank maps onto a remote engine's TP ranks: every remote rank that holds its
/// part of a request, in rank order, with what is read from each (vLLM's `TPMapping`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpMapping {
    /// The remote ranks this rank handshakes with and notifies.
    pub ranks: Vec<RankShare>,
}

impl TpMapping {
    /// The mapping of rank `tp_rank` of TP `tp_size` onto an engine of TP `remote_tp_size`
    /// serving `attention` (vLLM's `compute_tp_mapping`; `handshake_target_ranks` for the
    /// group). A decode rank reads each of its heads once: from the first remote rank of its
    /// group that holds it (vLLM's dedup of replicated GQA heads).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when neither TP size divides the other, for a rank not
    /// below its TP size, or when the heads do not split over either TP.
    pub fn new(
        tp_rank: usize,
        tp_size: usize,
        remote_tp_size: usize,
        attention: KvAttention,
    ) -> Result<Self> {
        let group = group(tp_rank, tp_size, remote_tp_size)?;
        let Some(local) = attention.heads_of_rank(tp_rank, tp_size)? else {
            // MLA: the first rank of the group is read, the others notified.
            let ranks = group
                .enumerate()
                .map(|(i, rank)| RankShare {
                    rank,
                    share: if i == 0 {
                        Share::Latent
                    } else {
                        Share::NotifiedOnly
                    },
                })
                .collect();
            return Ok(TpMapping { ranks });
        };
        let refuse = |why: String| {
            Error::invalid(
                "map KV heads to TP ranks",
                format!("rank {tp_rank} of TP {tp_size} holds heads {local:?}; {why}"),
            )
        };
        let held = group
            .clone()
            .map(|rank| {
                Ok(attention
                    .heads_of_rank(rank, remote_tp_size)?
                    .unwrap_or_default())
            })
            .collect::<Result<Vec<_>>>()?;
        // Each local head is read from the first rank of the group that holds it.
        let mut taken = vec![Vec::new(); held.len()];
        for head in local.clone() {
            let Some(i) = held.iter().position(|h| h.contains(&head)) else {
                return Err(refuse(format!(
                    "no rank of remote TP {remote_tp_size} among {group:?} holds head {head}"
                )));
            };
            taken[i].push(head);
        }
        let mut ranks = Vec::with_capacity(held.len());
        for ((rank, heads), from) in group.zip(taken).zip(held) {
            let share = match (heads.first(), heads.last()) {
                (Some(&first), Some(&last)) if last - first + 1 == heads.len() => Share::Heads {
                    local_first: first - local.start,
                    remote_first: first - from.start,
                    count: heads.len(),
                },
                (Some(_), _) => {
                    return Err(refuse(format!(
                        "remote rank {rank} would give heads {heads:?}, not one slice"
                    )))
                }
                (None, _) => Share::NotifiedOnly,
            };
            ranks.push(RankShare { rank, share });
        }
        Ok(TpMapping { ranks })
    }

    /// [`new`](Self::new) for engines of DCP sizes `dcp` (vLLM's `compute_tp_mapping` with
    /// `remote_dcp_size`): a source sharded over DCP ranks (MLA only) is read from each of
    /// its ranks holding positions of this rank's (vLLM's `dcp_source_ranks`), every one of them a
    /// [`Share::Latent`] (those whose blocks this rank's positions do not meet for a
    /// request are only notified, see [`DcpPair`](crate::DcpPair)); an unsharded source is
    /// mapped as without DCP.
    ///
    /// # Errors
    /// Those of [`new`](Self::new); [`Error::InvalidArgument`] for DCP sizes that do not
    /// pair ([`DcpSizes::mismatch`]) or a sharded source of a cache that is not MLA.
    pub fn with_dcp(
        tp_rank: usize,
        tp_size: usize,
        remote_tp_size: usize,
        attention: KvAttention,
        dcp: DcpSizes,
    ) -> Result<Self> {
        if let Some(why) = dcp.mismatch() {
            return Err(Error::invalid("map DCP ranks", why));
        }
        if dcp.remote <= 1 {
            return Self::new(tp_rank, tp_size, remote_tp_size, attention);
        }
        group(tp_rank, tp_size, remote_tp_size)?;
        if attention != KvAttention::Mla {
            return Err(Error::invalid(
                "map DCP ranks",
                format!("a source of DCP size {} holding a {attention} cache: decode context parallelism is for MLA caches only", dcp.remote),
            ));
        }
        let ranks = source_ranks(tp_rank, dcp.local, remote_tp_size, dcp.remote)
            .into_iter()
            .map(|rank| RankShare {
                rank,
                share: Share::Latent,
            })
            .collect();
        Ok(TpMapping { ranks })
    }

    /// The share of remote rank `rank`, if it is in the group.
    pub fn share_of(&self, rank: usize) -> Option<Share> {
        self.ranks.iter().find(|r| r.rank == rank).map(|r| r.share)
    }

    /// How many ranks of an engine of TP `reader_tp_size` notify each rank of an engine of TP
    /// `own_tp_size` about a request they read (vLLM's `dcp_consumer_count` without DCP):
    /// `max(1, reader / own)`; with DCP, vLLM's rule counts DCP ranks (see [`DcpSizes`]).
    pub fn consumers(reader_tp_size: usize, own_tp_size: usize) -> usize {
        consumers(reader_tp_size, 1, own_tp_size, 1)
    }
}

/// The largest TP size a mapping accepts (a peer's TP size is peer input).
pub const MAX_TP_SIZE: usize = 1 << 12;

/// The remote ranks that hold rank `tp_rank`'s part of a request (vLLM's
/// `handshake_target_ranks`).
fn group(tp_rank: usize, tp_size: usize, remote_tp_size: usize) -> Result<Range<usize>> {
    let divides = (1..=MAX_TP_SIZE).contains(&tp_size)
        && (1..=MAX_TP_SIZE).contains(&remote_tp_size)
        && (tp_size % remote_tp_size == 0 || remote_tp_size % tp_size == 0);
    if !divides || tp_rank >= tp_size {
        return Err(Error::invalid(
            "choose the remote ranks",
            format!(
                "rank {tp_rank} of TP {tp_size} cannot read from a peer of TP {remote_tp_size}: \
                 one TP size must divide the other (at most {MAX_TP_SIZE})"
            ),
        ));
    }
    Ok(if tp_size >= remote_tp_size {
        let rank = tp_rank / (tp_size / remote_tp_size);
        rank..rank + 1
    } else {
        let ratio = remote_tp_size / tp_size;
        tp_rank * ratio..(tp_rank + 1) * ratio
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mha(total_kv_heads: usize) -> KvAttention {
        KvAttention::Mha { total_kv_heads }
    }

    fn shares(
        rank: usize,
        tp: usize,
        remote_tp: usize,
        attention: KvAttention,
    ) -> Vec<(usize, Share)> {
        TpMapping::new(rank, tp, remote_tp, attention)
            .unwrap()
            .ranks
            .iter()
            .map(|r| (r.rank, r.share))
            .collect()
    }

    fn heads(local_first: usize, remote_first: usize, count: usize) -> Share {
        Share::Heads {
            local_first,
            remote_first,
            count,
        }
    }

    #[test]
    fn a_larger_decode_tp_reads_its_head_slice_from_one_rank() {
        // 8 heads, prefill TP 2 (4 each), decode TP 4 (2 each): vLLM's tp_rank % ratio.
        assert_eq!(shares(0, 4, 2, mha(8)), [(0, heads(0, 0, 2))]);
        assert_eq!(shares(1, 4, 2, mha(8)), [(0, heads(0, 2, 2))]);
        assert_eq!(shares(3, 4, 2, mha(8)), [(1, heads(0, 2, 2))]);
        // Same TP: the whole rank.
        assert_eq!(shares(1, 2, 2, mha(8)), [(1, heads(0, 0, 4))]);
    }

    #[test]
    fn a_smaller_decode_tp_reads_each_rank_of_its_group_into_its_slot() {
        assert_eq!(
            shares(1, 2, 4, mha(8)),
            [(2, heads(0, 0, 2)), (3, heads(2, 0, 2))]
        );
        assert_eq!(
            shares(0, 1, 2, mha(2)),
            [(0, heads(0, 0, 1)), (1, heads(1, 0, 1))]
        );
    }

    #[test]
    fn replicated_heads_follow_compute_head_offset_and_are_read_once() {
        // 2 heads, decode TP 4: ranks 0 and 1 hold head 0, 2 and 3 head 1; prefill TP 1 holds both.
        assert_eq!(shares(1, 4, 1, mha(2)), [(0, heads(0, 0, 1))]);
        assert_eq!(shares(2, 4, 1, mha(2)), [(0, heads(0, 1, 1))]);
        // Prefill TP 4 over 2 heads, decode TP 2: each decode head is on two prefill ranks,
        // read from the first and the second only notified.
        assert_eq!(
            shares(1, 2, 4, mha(2)),
            [(2, heads(0, 0, 1)), (3, Share::NotifiedOnly)]
        );
        // One head (MQA), prefill TP 2, decode TP 1.
        assert_eq!(
            shares(0, 1, 2, mha(1)),
            [(0, heads(0, 0, 1)), (1, Share::NotifiedOnly)]
        );
    }

    #[test]
    fn mla_reads_one_rank_and_notifies_the_rest() {
        assert_eq!(shares(3, 4, 2, KvAttention::Mla), [(1, Share::Latent)]);
        assert_eq!(
            shares(1, 2, 4, KvAttention::Mla),
            [(2, Share::Latent), (3, Share::NotifiedOnly)]
        );
    }

    #[test]
    fn sizes_that_do_not_divide_are_refused_by_name() {
        let err = TpMapping::new(0, 3, 2, mha(6)).unwrap_err().to_string();
        assert!(
            err.contains("rank 0 of TP 3 cannot read from a peer of TP 2"),
            "{err}"
        );
        let err = TpMapping::new(0, 4, 2, mha(6)).unwrap_err().to_string();
        assert!(err.contains("TP 4 and 6 KV heads"), "{err}");
    }

    #[test]
    fn each_remote_rank_counts_its_readers() {
        assert_eq!(TpMapping::consumers(4, 2), 2);
        assert_eq!(TpMapping::consumers(1, 2), 1);
        assert_eq!(TpMapping::consumers(2, 2), 1);
    }
}

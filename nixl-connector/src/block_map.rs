//! The load path's block-id mapping, in one place: which remote blocks a load reads into
//! which local blocks, and the descriptor indices of both in the prepared lists.
//!
//! Today both sides have the same geometry per rank (block length, layers; a decode with a
//! larger TP reads its head slice of each block, which the remote's prepared list already
//! describes). Heterogeneous geometries (prefill TP > decode TP, MLA, per-region lengths)
//! extend this module.

use crate::error::{Error, Result};

/// The remote blocks a load reads: the last `local.len()` of `remote`, paired in order with
/// `local`.
///
/// The decode's prefix cache may already hold the first blocks of the prompt; the engine
/// then allocates (and passes) only the blocks it still needs, which are the tail of the
/// prompt, so they pair with the tail of the prefill's list. Follows vLLM's
/// `_apply_prefix_caching` (the remote ids trimmed to the last N in `_read_blocks`). No
/// local block (a full prefix hit) reads nothing.
///
/// # Errors
/// [`Error::InvalidArgument`] when there are more local blocks than remote ones.
pub(crate) fn remote_tail<'a>(
    request_id: &str,
    local: &[usize],
    remote: &'a [usize],
) -> Result<&'a [usize]> {
    remote
        .len()
        .checked_sub(local.len())
        .map(|skip| &remote[skip..])
        .ok_or_else(|| {
            Error::invalid(
                "pair the blocks of a load",
                format!(
                    "request {request_id:?}: {} local blocks for {} remote blocks (at most as many local as remote)",
                    local.len(),
                    remote.len()
                ),
            )
        })
}

/// The descriptor indices of a READ of `remote_ids` into `local_ids` (paired in order,
/// equally long) over layer-major prepared lists: descriptor `layer * num_blocks + block`
/// on either side. Returns (local, remote) indices, layer by layer.
pub(crate) fn descriptor_ids(
    num_layers: usize,
    local_num_blocks: usize,
    remote_num_blocks: usize,
    local_ids: &[usize],
    remote_ids: &[usize],
) -> (Vec<usize>, Vec<usize>) {
    debug_assert_eq!(local_ids.len(), remote_ids.len());
    let mut local = Vec::with_capacity(num_layers * local_ids.len());
    let mut remote = Vec::with_capacity(local.capacity());
    for layer in 0..num_layers {
        local.extend(local_ids.iter().map(|b| layer * local_num_blocks + b));
        remote.extend(remote_ids.iter().map(|b| layer * remote_num_blocks + b));
    }
    (local, remote)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_hit_reads_the_tail_of_the_remote_blocks() {
        let remote = [10, 11, 12, 13];
        assert_eq!(remote_tail("r", &[0, 1, 2, 3], &remote).unwrap(), remote);
        assert_eq!(remote_tail("r", &[7], &remote).unwrap(), [13]);
        assert!(remote_tail("r", &[], &remote).unwrap().is_empty());
        let err = remote_tail("r", &[0, 1, 2], &[5, 6])
            .unwrap_err()
            .to_string();
        assert!(err.contains("3 local blocks for 2 remote blocks"), "{err}");
    }

    #[test]
    fn descriptors_are_layer_major_on_both_sides() {
        let (local, remote) = descriptor_ids(2, 8, 16, &[1, 2], &[5, 9]);
        assert_eq!(local, [1, 2, 9, 10]);
        assert_eq!(remote, [5, 9, 21, 25]);
    }
}

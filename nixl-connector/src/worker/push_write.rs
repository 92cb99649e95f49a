//! A prefill rank's push WRITE, in either protocol: the prefill's blocks cut to the
//! decode's (a prefix hit on the decode), as kernel blocks when a block id is several of
//! them on both engines, planned with `plan_read` as the reader of the
//! decode's geometry (the pull mode's TP mapping and read plan, data going the other way),
//! posted with the protocol's notification, and awaited with the `nixl` crate's async
//! completion.

use nixl::{XferOp, XferOptions, XferStatus};

use crate::error::Error;
use crate::geometry::load_reads::{all_kernel_blocks, plan_read, ReadInputs, SideBlocks};
use crate::transport::push_wire::PushEnd;
use crate::worker::remotes::Remote;
use crate::worker::shared::Shared;

/// What one WRITE moves.
pub(crate) struct WriteInputs<'a> {
    /// The request's id on the prefill (named in a refusal).
    pub(crate) request_id: &'a str,
    /// The decode's registered blocks and their count per KV cache group (empty: one).
    pub(crate) decode: (&'a [usize], &'a [usize]),
    /// The prefill's held blocks and their count per group.
    pub(crate) ready: (&'a [usize], &'a [usize]),
    /// NIXL's notification of the WRITE, which the decode gets once its bytes are in place.
    pub(crate) notification: Vec<u8>,
}

/// Plans, posts and awaits the WRITE of `inputs` into the blocks of decode rank `remote`;
/// its bytes, or how it ended (`Refused`: it does not fit; `Failed`: NIXL ended it
/// failed) and why.
pub(crate) async fn post_and_await(
    shared: &Shared,
    inputs: WriteInputs<'_>,
    remote: &Remote,
) -> std::result::Result<usize, (PushEnd, Error)> {
    const OP: &str = "write a push registration";
    let refused = |err: Error| (PushEnd::Refused, err);
    let caches = shared
        .caches
        .get()
        .ok_or((PushEnd::Failed, Error::NotRegistered { operation: OP }))?;
    let lists = remote.lists.as_ref().ok_or_else(|| {
        refused(Error::invalid(
            OP,
            "the decode rank's geometry gives this rank nothing to write",
        ))
    })?;
    let (decode_ids, decode_lens) = inputs.decode;
    let per_id = shared
        .groups
        .kernel_blocks_per_id(caches.spec.block_size)
        .map_err(refused)?;
    // Both engines' block ids of as many kernel blocks of one size: the cut by block id is
    // then the cut by kernel block too (vLLM cuts kernel ids).
    if per_id != remote.blocks_per_id
        || remote.plan.local_block_size != remote.plan.remote_block_size
    {
        return Err(refused(Error::invalid(
            OP,
            "push between engines of different block sizes, or of other kernel blocks per block id, is not built yet; use pull mode",
        )));
    }
    let (mut local_ids, mut local_lens) =
        crate::geometry::push_cut::cut_to_decode(inputs.ready, inputs.decode)
            .map_err(|why| refused(Error::invalid(OP, why)))?;
    let (mut decode_ids, mut decode_lens) = (decode_ids.to_vec(), decode_lens.to_vec());
    if per_id > 1 {
        if remote.ssm.is_some() {
            return Err(refused(Error::invalid(
                OP,
                "push of SSM state with several kernel blocks per block id is not built yet; use pull mode",
            )));
        }
        let kernel = |(ids, group_lens): (&[usize], &[usize]), num_blocks: usize, what| {
            let side = SideBlocks {
                ids,
                group_lens,
                per_id,
            };
            // Each group's list names a block once.
            let most = num_blocks.saturating_mul(group_lens.len().max(1));
            all_kernel_blocks(side, most, what).map_err(refused)
        };
        let decode_blocks = remote.plan.remote_num_blocks;
        (local_ids, local_lens) = kernel(
            (&local_ids, &local_lens),
            caches.spec.num_blocks,
            "held blocks",
        )?;
        (decode_ids, decode_lens) = kernel(
            (&decode_ids, &decode_lens),
            decode_blocks,
            "registered blocks",
        )?;
    }
    // Kernel blocks from here on.
    let per_id = 1;
    let writes = plan_read(&ReadInputs {
        request_id: inputs.request_id,
        local: SideBlocks {
            ids: &local_ids,
            group_lens: &local_lens,
            per_id,
        },
        remote: SideBlocks {
            ids: &decode_ids,
            group_lens: &decode_lens,
            per_id,
        },
        num_tokens: None,
        local_num_blocks: caches.spec.num_blocks,
        plan: &remote.plan,
        groups: &shared.groups,
        ssm: remote.ssm.as_ref(),
        reads_attention: remote.reads_attention(),
    })
    .map_err(refused)?;
    let agent = shared.setup.agent();
    let options = XferOptions::new().notification(inputs.notification);
    let failed = |err: nixl::Error| (PushEnd::Failed, Error::from(err));
    let mut request = agent
        .make_xfer_req(
            XferOp::Write,
            lists.local.as_ref().unwrap_or(&caches.local),
            &writes.local,
            &lists.remote,
            &writes.remote,
            &options,
        )
        .map_err(failed)?;
    if request.post().map_err(failed)? != XferStatus::Done {
        request.await.map_err(failed)?;
    }
    Ok(writes.bytes)
}

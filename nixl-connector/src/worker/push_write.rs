//! A prefill rank's push WRITE, in either protocol, planned with the pull mode's TP mapping
//! and read plan (the prefill as the reader of the decode's geometry, data going the other
//! way): between engines of one kernel block size and kernel blocks per id, the prefill's
//! blocks cut to the decode's (a prefix hit on the decode), then as kernel blocks
//! (`plan_read`); otherwise paired at the prompt's tokens (`plan_write`). Posted with the
//! protocol's notification, and awaited with the `nixl` crate's async completion.

use nixl::{XferOp, XferOptions, XferStatus};

use crate::error::Error;
use crate::geometry::load_reads::{
    all_kernel_blocks, plan_read, plan_write, ReadDescriptors, ReadInputs, SideBlocks,
};
use crate::transport::push_wire::PushEnd;
use crate::worker::remotes::Remote;
use crate::worker::shared::Shared;

/// The operation errors name.
const OP: &str = "write a push registration";

/// A held request's blocks, which a push writes from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HeldBlocks {
    /// Its blocks, in token order (each KV cache group's in turn).
    pub(crate) block_ids: Vec<usize>,
    /// How many of them each group has; empty: one group.
    pub(crate) group_lens: Vec<usize>,
    /// The prompt's tokens it computed, if known: where a decode's blocks start in the
    /// prompt when the engines' blocks differ in tokens or in kernel blocks per id.
    pub(crate) num_tokens: Option<usize>,
}

#[cfg(test)]
impl HeldBlocks {
    /// One group's `block_ids`, of tokens not given.
    pub(crate) fn of(block_ids: &[usize]) -> Self {
        HeldBlocks {
            block_ids: block_ids.to_vec(),
            ..HeldBlocks::default()
        }
    }
}

/// What one WRITE moves.
pub(crate) struct WriteInputs<'a> {
    /// The request's id on the prefill (named in a refusal).
    pub(crate) request_id: &'a str,
    /// The decode's registered blocks and their count per KV cache group (empty: one).
    pub(crate) decode: (&'a [usize], &'a [usize]),
    /// The prefill's held blocks.
    pub(crate) ready: &'a HeldBlocks,
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
    let per_id = shared
        .groups
        .kernel_blocks_per_id(caches.spec.block_size)
        .map_err(refused)?;
    let writes = if per_id == remote.blocks_per_id
        && remote.plan.local_block_size == remote.plan.remote_block_size
    {
        by_block_ids(shared, &inputs, remote, (caches.spec.num_blocks, per_id))
    } else {
        by_tokens(shared, &inputs, remote, (caches.spec.num_blocks, per_id))
    }
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

/// The WRITE between engines whose block ids are as many kernel blocks of one size: the
/// prefill's ids cut to the decode's by id (vLLM's push cuts its list to the last
/// `len(decode blocks)`), then both sides' kernel blocks paired in order.
fn by_block_ids(
    shared: &Shared,
    inputs: &WriteInputs<'_>,
    remote: &Remote,
    (num_blocks, per_id): (usize, usize),
) -> Result<ReadDescriptors, Error> {
    let held = inputs.ready;
    let (mut local_ids, mut local_lens) = crate::geometry::push_cut::cut_to_decode(
        (&held.block_ids, &held.group_lens),
        inputs.decode,
    )
    .map_err(|why| Error::invalid(OP, why))?;
    let (decode_ids, decode_lens) = inputs.decode;
    let (mut decode_ids, mut decode_lens) = (decode_ids.to_vec(), decode_lens.to_vec());
    if per_id > 1 {
        if remote.ssm.is_some() {
            return Err(Error::invalid(
                OP,
                "push of SSM state with several kernel blocks per block id is not built yet; use pull mode",
            ));
        }
        let kernel = |(ids, group_lens): (&[usize], &[usize]), blocks: usize, what| {
            let side = SideBlocks {
                ids,
                group_lens,
                per_id,
            };
            // Each group's list names a block once.
            let most = blocks.saturating_mul(group_lens.len().max(1));
            all_kernel_blocks(side, most, what)
        };
        (local_ids, local_lens) = kernel((&local_ids, &local_lens), num_blocks, "held blocks")?;
        let decode_blocks = remote.plan.remote_num_blocks;
        (decode_ids, decode_lens) = kernel(
            (&decode_ids, &decode_lens),
            decode_blocks,
            "registered blocks",
        )?;
    }
    // Kernel blocks from here on.
    let per_id = 1;
    plan_read(&ReadInputs {
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
        local_num_blocks: num_blocks,
        plan: &remote.plan,
        groups: &shared.groups,
        ssm: remote.ssm.as_ref(),
        reads_attention: remote.reads_attention(),
    })
}

/// The WRITE between engines whose blocks hold different numbers of tokens, or whose block
/// ids are other numbers of kernel blocks: paired at the prompt's tokens, as the decode's
/// READ of the same blocks would be (vLLM 0.33's push pairs ids by their count instead,
/// which puts tokens in the wrong blocks on a prefix hit or when the last block id ends at
/// another token on each side; and its decode cannot complete such a push).
fn by_tokens(
    shared: &Shared,
    inputs: &WriteInputs<'_>,
    remote: &Remote,
    (num_blocks, per_id): (usize, usize),
) -> Result<ReadDescriptors, Error> {
    let held = inputs.ready;
    let sizes = format!(
        "kernel blocks of {} tokens, {per_id} per block id, here and of {}, {} per id, on the decode",
        remote.plan.local_block_size, remote.plan.remote_block_size, remote.blocks_per_id
    );
    if remote.ssm.is_some() {
        return Err(Error::invalid(
            OP,
            format!("push of SSM state between engines of {sizes} is not built (vLLM's push refuses hybrid models of different block sizes too); use pull mode"),
        ));
    }
    let Some(num_tokens) = held.num_tokens else {
        return Err(Error::invalid(
            OP,
            format!("with {sizes}, where the decode's blocks start in the prompt depends on its tokens, which the hold did not give (SendSpec::num_tokens)"),
        ));
    };
    let (decode_ids, decode_lens) = inputs.decode;
    if decode_ids.is_empty() {
        return Err(Error::invalid(OP, "a registration of no block"));
    }
    plan_write(&ReadInputs {
        request_id: inputs.request_id,
        local: SideBlocks {
            ids: &held.block_ids,
            group_lens: &held.group_lens,
            per_id,
        },
        remote: SideBlocks {
            ids: decode_ids,
            group_lens: decode_lens,
            per_id: remote.blocks_per_id,
        },
        num_tokens: Some(num_tokens),
        local_num_blocks: num_blocks,
        plan: &remote.plan,
        groups: &shared.groups,
        ssm: None,
        reads_attention: remote.reads_attention(),
    })
}

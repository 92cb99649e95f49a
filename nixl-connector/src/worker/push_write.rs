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
use crate::geometry::spec::KvAttention;
use crate::transport::push_wire::PushEnd;
use crate::worker::push_book::HeldBlocks;
use crate::worker::remotes::Remote;
use crate::worker::shared::Shared;

/// The operation errors name.
const OP: &str = "write a push registration";

/// What one WRITE moves.
pub(crate) struct WriteInputs<'a> {
    /// The request's id on the prefill (named in a refusal).
    pub(crate) request_id: &'a str,
    /// The decode's registered blocks and their count per KV cache group (empty: one).
    pub(crate) decode: (&'a [usize], &'a [usize]),
    /// The decode's TP size.
    pub(crate) decode_tp: usize,
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
    let ours = (shared.config.tp_rank, shared.config.tp_size);
    let writes_attention = remote.reads_attention()
        && writes_decode_heads(&caches.spec.attention, ours, inputs.decode_tp);
    if !writes_attention && remote.ssm.is_none() {
        // Another rank of the group writes the same bytes: the decode counts this rank's
        // notification alone (0 bytes).
        let agent = shared.setup.agent();
        agent
            .send_notification(&remote.agent, &inputs.notification)
            .map_err(|err| (PushEnd::Failed, Error::from(err)))?;
        return Ok(0);
    }
    let writes = if per_id == remote.blocks_per_id
        && remote.plan.local_block_size == remote.plan.remote_block_size
    {
        by_block_ids(
            shared,
            &inputs,
            remote,
            (caches.spec.num_blocks, per_id),
            writes_attention,
        )
    } else {
        by_tokens(
            shared,
            &inputs,
            remote,
            (caches.spec.num_blocks, per_id),
            writes_attention,
        )
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
    writes_attention: bool,
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
        reads_attention: writes_attention,
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
    writes_attention: bool,
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
        reads_attention: writes_attention,
    })
}

/// Whether prefill rank `rank` of TP `tp` writes a decode rank's attention (of a decode of
/// TP `decode_tp`, the model's `attention`), of the prefill ranks that hold the same copy of
/// its heads (MLA's latent, on every rank; KV heads replicated over ranks, when TP is above
/// their count): the first of them does, the others only notify (vLLM's push has each write
/// its copy, the same bytes landing again).
fn writes_decode_heads(
    attention: &KvAttention,
    (rank, tp): (usize, usize),
    decode_tp: usize,
) -> bool {
    let heads = match attention {
        KvAttention::Mla => 1,
        KvAttention::Mha { total_kv_heads } => (*total_kv_heads).max(1),
    };
    // Ranks holding each head on each side; the prefill's holders of a decode rank's head
    // are consecutive ranks, as many as the prefill has per decode holder.
    let per_head = |tp: usize| (tp / heads).max(1);
    let holders = (per_head(tp) / per_head(decode_tp.max(1))).max(1);
    rank % holders == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_prefill_rank_of_each_copy_writes_it() {
        let writers = |attention: KvAttention, tp: usize, decode_tp: usize| -> Vec<usize> {
            (0..tp)
                .filter(|&rank| writes_decode_heads(&attention, (rank, tp), decode_tp))
                .collect()
        };
        let mha = |total_kv_heads| KvAttention::Mha { total_kv_heads };
        // MLA's latent: one rank of each decode rank's group.
        assert_eq!(writers(KvAttention::Mla, 4, 1), [0]);
        assert_eq!(writers(KvAttention::Mla, 4, 2), [0, 2]);
        assert_eq!(writers(KvAttention::Mla, 2, 2), [0, 1]);
        // Heads split over both sides: every rank writes its own.
        assert_eq!(writers(mha(4), 4, 2), [0, 1, 2, 3]);
        // Two heads over 4 prefill ranks (each held twice): one of each pair writes.
        assert_eq!(writers(mha(2), 4, 1), [0, 2]);
        assert_eq!(writers(mha(2), 4, 2), [0, 2]);
        // Replicated on the decode too: 8 ranks over 2 heads into 4 (each held twice).
        assert_eq!(writers(mha(2), 8, 4), [0, 2, 4, 6]);
        assert_eq!(writers(mha(2), 4, 4), [0, 1, 2, 3]);
    }
}

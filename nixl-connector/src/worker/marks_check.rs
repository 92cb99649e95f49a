//! A load's check of the release marks of each rank it read from, once its data READs have
//! ended (native protocol; see [`ReleaseMarks`](crate::ReleaseMarks)).

use std::sync::Arc;

use futures::future::try_join_all;
use nixl::{
    Backend, LocalDescList, MemType, RemoteDescList, XferDesc, XferOp, XferOptions, XferStatus,
};

use crate::error::{Error, Result};
use crate::transport::params::RemoteBlocks;
use crate::transport::release_marks::{first_released, runs, MARK_LEN};
use crate::worker::remotes::Remote;
use crate::worker::shared::Shared;

/// Checks, after a load's data READs from `read` (each remote rank with its number) all
/// ended, that none of those ranks released the blocks of `blocks` first: one READ of the
/// ranks' release marks each, compared with the params' lease epoch. Params without an
/// epoch are not checked.
///
/// # Errors
/// [`Error::LeaseOutlived`] when a mark is at or past the epoch; [`Error::TransferTimeout`]
/// when the marks' READ outlives the transfer timeout; [`Error::InvalidArgument`] when a
/// rank names no marks or a block id has none; NIXL's errors.
pub(crate) async fn check_after_read(
    shared: &Shared,
    blocks: &RemoteBlocks,
    read: &[(usize, Arc<Remote>)],
) -> Result<()> {
    let Some(epoch) = blocks.lease_epoch else {
        return Ok(());
    };
    let checks = read
        .iter()
        .filter(|(_, remote)| remote.is_read())
        .map(|(rank, remote)| check_rank(shared, blocks, epoch, *rank, remote));
    let deadline = shared.config.transfer_timeout;
    match tokio::time::timeout(deadline, try_join_all(checks)).await {
        Ok(checked) => checked.map(|_| ()),
        Err(_) => Err(Error::TransferTimeout {
            request_id: blocks.request_id.clone(),
            deadline,
        }),
    }
}

/// [`check_after_read`] for remote rank `rank`.
async fn check_rank(
    shared: &Shared,
    blocks: &RemoteBlocks,
    epoch: u64,
    rank: usize,
    remote: &Remote,
) -> Result<()> {
    const OP: &str = "check the release marks";
    let engine = &blocks.engine_id;
    let marks = remote.release_marks.ok_or_else(|| {
        Error::invalid(
            OP,
            format!("engine {engine:?} rank {rank} names no release marks, yet the params carry a lease epoch"),
        )
    })?;
    let (runs, words) = runs(&blocks.block_ids, &marks)
        .map_err(|why| Error::invalid(OP, format!("engine {engine:?} rank {rank}: {why}")))?;
    let agent = shared.setup.agent();
    let backends: Vec<&Backend> = shared.setup.backends().iter().collect();
    let scratch = shared.scratch.take(agent, &backends, words)?;
    let mut local = LocalDescList::with_capacity(MemType::Dram, runs.len())?;
    let mut theirs = RemoteDescList::new(MemType::Dram)?;
    let mut at = 0;
    for (first, len) in runs {
        local.push(&scratch, 0, at * MARK_LEN, len * MARK_LEN)?;
        // Within the marks: checked at the handshake and by `runs`.
        let addr = marks.addr + (first * MARK_LEN) as u64;
        let addr = usize::try_from(addr).map_err(|_| Error::invalid(OP, "a mark's address"))?;
        theirs.push(XferDesc::new(addr, len * MARK_LEN, 0))?;
        at += len;
    }
    let options = XferOptions::new();
    let mut request =
        agent.create_xfer_req(XferOp::Read, &local, &theirs, &remote.agent, &options)?;
    if request.post()? != XferStatus::Done {
        request.await?;
    }
    let mut read = vec![0u8; words * MARK_LEN];
    scratch.read(0, 0, &mut read)?;
    // The READ ended: nothing writes the words any more.
    drop(local);
    shared.scratch.give(scratch);
    match first_released(&read, epoch) {
        None => Ok(()),
        Some((_, mark)) => Err(Error::LeaseOutlived {
            request_id: blocks.request_id.clone(),
            engine: engine.clone(),
            detail: format!("rank {rank}: a block's release mark {mark} is at or past the request's lease epoch {epoch}"),
        }),
    }
}

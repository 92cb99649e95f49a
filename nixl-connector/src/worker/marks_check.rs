//! A load's check of the release marks of each rank it read from, once its data READs have
//! ended (native protocol; see [`ReleaseMarks`](crate::ReleaseMarks)).

use std::sync::Arc;

use futures::future::join_all;
use nixl::{
    Backend, LocalDescList, MemType, Registration, RemoteDescList, XferDesc, XferOp, XferOptions,
    XferRequest, XferStatus,
};

use crate::config::Protocol;
use crate::error::{Error, Result};
use crate::transport::params::RemoteBlocks;
use crate::transport::release_marks::{first_released, runs, ReleaseMarks, MARK_LEN};
use crate::worker::remotes::Remote;
use crate::worker::shared::Shared;

/// Whether a load of `blocks` checks release marks: native protocol, params with a lease
/// epoch.
pub(crate) fn applies(shared: &Shared, blocks: &RemoteBlocks) -> bool {
    shared.protocol == Protocol::Native && blocks.lease_epoch.is_some()
}

/// Posts, once a load's data READs from `read` (each remote rank with its number) all
/// ended, one READ of each rank's release marks of the blocks of `blocks`, to be compared
/// with the params' lease epoch ([`PostedMarks::compare`]), which then sends each rank
/// `notification` once its READ ended. A rank whose READ cannot be posted, and those after
/// it, get it now. `None` for a load the marks do not apply to ([`applies`]).
///
/// The notification goes on its own, after the READ, rather than with it: carried by the
/// READ, it made a tenth of the loads wait 1 to 10 ms more on one host (we infer that such
/// a READ ends only once its notification is sent, which waits for the prefill's progress).
///
/// # Errors
/// [`Error::InvalidArgument`] when a rank names no marks or a block id has none; NIXL's
/// errors.
pub(crate) fn post_checks(
    shared: &Shared,
    blocks: &RemoteBlocks,
    read: &[(usize, Arc<Remote>)],
    notification: &[u8],
) -> Result<Option<PostedMarks>> {
    let Some(epoch) = blocks.lease_epoch.filter(|_| applies(shared, blocks)) else {
        return Ok(None);
    };
    let ranks: Vec<&(usize, Arc<Remote>)> =
        read.iter().filter(|(_, remote)| remote.is_read()).collect();
    let mut reads = Vec::with_capacity(ranks.len());
    for (i, (rank, remote)) in ranks.iter().enumerate() {
        match post(shared, blocks, (*rank, remote)) {
            Ok(posted) => reads.push(posted),
            Err(err) => {
                for (_, unposted) in &ranks[i..] {
                    notify_plainly(shared, blocks, &unposted.agent, notification);
                }
                return Err(err);
            }
        }
    }
    Ok(Some(PostedMarks {
        epoch,
        reads,
        notification: notification.to_vec(),
    }))
}

/// The READs of a load's release marks, one per rank read, posted.
pub(crate) struct PostedMarks {
    /// The params' lease epoch.
    epoch: u64,
    reads: Vec<MarksRead>,
    /// What each rank is sent once its READ ended.
    notification: Vec<u8>,
}

impl PostedMarks {
    /// Whether NIXL finished every READ within its post.
    fn ended_in_post(&self) -> bool {
        self.reads.iter().all(|read| read.done)
    }

    /// Awaits the READs (at most the transfer timeout), notifies each rank whose READ
    /// ended, and compares the marks with the epoch.
    ///
    /// # Errors
    /// [`Error::LeaseOutlived`] when a mark is at or past the epoch;
    /// [`Error::TransferTimeout`] when the READs outlive the transfer timeout; NIXL's
    /// errors.
    pub(crate) async fn compare(self, shared: &Shared, blocks: &RemoteBlocks) -> Result<()> {
        let (epoch, notification) = (self.epoch, &self.notification[..]);
        let checks = self.reads.into_iter().map(|read| async move {
            let MarksRead {
                rank,
                agent,
                scratch,
                request,
                done,
                words,
            } = read;
            let ended = if done { Ok(request) } else { request.await };
            // Ended, well or not: the rank may release.
            notify_plainly(shared, blocks, &agent, notification);
            compare_read(shared, blocks, epoch, (rank, words), (ended?, scratch))
        });
        let deadline = shared.config.transfer_timeout;
        // Every rank's READ awaited, so that each is notified, whichever fails first.
        match tokio::time::timeout(deadline, join_all(checks)).await {
            Ok(checked) => checked.into_iter().collect(),
            Err(_) => Err(Error::TransferTimeout {
                request_id: blocks.request_id.clone(),
                deadline,
            }),
        }
    }

    /// Compares the marks with the epoch here and now, every READ having ended within its
    /// post ([`ended_in_post`](Self::ended_in_post)): the comparison's outcome (an error as
    /// [`compare`](Self::compare)'s), or, when a READ did not end in its post, the READs
    /// back untouched, to [`compare`](Self::compare) once they end.
    pub(crate) fn compare_now(
        self,
        shared: &Shared,
        blocks: &RemoteBlocks,
    ) -> std::result::Result<Result<()>, PostedMarks> {
        if !self.ended_in_post() {
            return Err(self);
        }
        let (epoch, notification) = (self.epoch, &self.notification[..]);
        let mut compared = Ok(());
        for read in self.reads {
            notify_plainly(shared, blocks, &read.agent, notification);
            let at = (read.rank, read.words);
            let this = compare_read(shared, blocks, epoch, at, (read.request, read.scratch));
            compared = compared.and(this);
        }
        Ok(compared)
    }
}

/// The READ of one rank's marks, posted: the rank and its agent, the words it writes into,
/// the request, whether NIXL finished it in the post, and how many words it reads.
struct MarksRead {
    rank: usize,
    agent: String,
    scratch: Registration,
    request: XferRequest,
    done: bool,
    words: usize,
}

/// Posts the READ of rank `rank`'s marks of the blocks of `blocks` into scratch words.
fn post(
    shared: &Shared,
    blocks: &RemoteBlocks,
    (rank, remote): (usize, &Remote),
) -> Result<MarksRead> {
    const OP: &str = "check the release marks";
    let engine = &blocks.engine_id;
    let marks: ReleaseMarks = remote.release_marks.ok_or_else(|| {
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
    let done = request.post()? == XferStatus::Done;
    Ok(MarksRead {
        rank,
        agent: remote.agent.clone(),
        scratch,
        request,
        done,
        words,
    })
}

/// Compares the `words` marks rank `rank`'s READ (`ended`) wrote into `scratch` with
/// `epoch`, and keeps `scratch` for a later load.
fn compare_read(
    shared: &Shared,
    blocks: &RemoteBlocks,
    epoch: u64,
    (rank, words): (usize, usize),
    (ended, scratch): (XferRequest, Registration),
) -> Result<()> {
    let mut marks = vec![0u8; words * MARK_LEN];
    scratch.read(0, 0, &mut marks)?;
    // The READ ended: nothing writes the words any more.
    drop(ended);
    shared.scratch.give(scratch);
    match first_released(&marks, epoch) {
        None => Ok(()),
        Some((_, mark)) => Err(Error::LeaseOutlived {
            request_id: blocks.request_id.clone(),
            engine: blocks.engine_id.clone(),
            detail: format!("rank {rank}: a block's release mark {mark} is at or past the request's lease epoch {epoch}"),
        }),
    }
}

/// Sends `notification` to the prefill rank `agent` on its own; a failure is logged and
/// counted (the prefill then frees the blocks when their lease ends).
fn notify_plainly(shared: &Shared, blocks: &RemoteBlocks, agent: &str, notification: &[u8]) {
    if let Err(err) = shared.setup.agent().send_notification(agent, notification) {
        shared.series.failed_notification();
        tracing::warn!(request = %blocks.request_id, %agent, %err, "could not tell a prefill rank that its READ ended; it frees the blocks when their lease ends");
    }
}

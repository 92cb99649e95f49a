//! One load: the handshakes with the remote ranks holding the request if needed, then one
//! prepared READ per rank read from, by unit (or, for a full prefix hit or an aborted
//! request, the notifications alone), outcome recorded.
//!
//! Every remote rank holding the request is notified: the ranks read from by their READ's
//! notification, the others (MLA or replicated heads read elsewhere) by a notification
//! alone once every READ is posted (vLLM's `_read_blocks_for_req`). If a READ cannot be
//! posted, none after it is, and the load ends only once those already posted have.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use nixl::{XferOp, XferOptions, XferStatus};
use tracing::Instrument;

use crate::config::Protocol;
use crate::error::{Error, Result};
use crate::failure::{FailedBlock, FailureKind};
use crate::geometry::dcp::{consumers, DcpPair, DcpSizes};
use crate::geometry::load_reads::{plan_read, ReadInputs, SideBlocks};
use crate::metrics::TransferMetrics;
use crate::scheduler::outcomes::OverdueLoad;
use crate::transport::params::RemoteBlocks;
#[cfg(feature = "vllm")]
use crate::vllm::clock::perf_counter;
use crate::worker::claim;
use crate::worker::connect::{self, Engine};
use crate::worker::marks_check::{self, PostedMarks};
use crate::worker::notification_format::notification_message;
use crate::worker::remotes::Remote;
use crate::worker::shared::Shared;

/// What [`crate::KvConnectorWorker::start_load`] checked and hands the task.
pub(crate) struct Load {
    pub(crate) request_id: String,
    pub(crate) local_block_ids: Vec<usize>,
    /// How many of `local_block_ids` each KV cache group has (see
    /// [`LoadSpec::local_group_lens`](crate::LoadSpec::local_group_lens)); empty: one group.
    pub(crate) local_group_lens: Vec<usize>,
    pub(crate) remote: RemoteBlocks,
    /// The remote ranks holding the request, each with its side-channel port.
    pub(crate) ranks: Vec<(usize, u16)>,
    /// The load's tracing span: its posts and its completion run inside it.
    pub(crate) span: tracing::Span,
}

impl Load {
    /// The span of a load of `blocks` local blocks for `request_id` from `remote`'s `ranks`.
    pub(crate) fn span(
        request_id: &str,
        remote: &RemoteBlocks,
        ranks: &[(usize, u16)],
        blocks: usize,
    ) -> tracing::Span {
        let ranks: Vec<usize> = ranks.iter().map(|&(rank, _)| rank).collect();
        tracing::info_span!("nixl_load", request = request_id, engine = %remote.engine_id, ranks = ?ranks, blocks, outcome = tracing::field::Empty)
    }

    /// The notification each remote rank gets: the remote request id and, in the native
    /// protocol, this engine's TP size (the prefill works out how many ranks read it) and
    /// the tag of the request's capability for this rank's agent, in vLLM's, how many ranks
    /// of this engine notify each remote rank (vLLM's `local_consumers`, times this engine's
    /// pipeline stages, each of which notifies: vLLM's `pp_size` × producers per consumer
    /// of its push mode). A native load
    /// whose params had no capability notifies without a tag, which a prefill refuses (its
    /// lease frees the blocks).
    fn notification(&self, shared: &Shared) -> Vec<u8> {
        let own_tp = shared.config.tp_size;
        let agent = shared.setup.agent().name();
        let (count, proof) = match shared.protocol {
            Protocol::Native => (own_tp, self.remote.capability.as_ref().map(|c| (c, agent))),
            Protocol::Vllm => {
                let stages = shared.config.pipeline.as_ref();
                let own_pp = stages.map_or(1, |p| p.stages().pp_size());
                let (own_dcp, remote) = (shared.config.dcp_size, &self.remote);
                let consumers = consumers(own_tp, own_dcp, remote.tp_size, remote.dcp_size);
                (consumers * own_pp, None)
            }
        };
        notification_message(&self.remote.request_id, count, proof)
    }

    /// Whether its READs, once ended, are checked against the lease (see [`after_read`]):
    /// its params carry a lease epoch (native protocol) or an expiry time (vLLM's).
    fn checked_after_read(&self) -> bool {
        self.remote.lease_epoch.is_some() || self.remote.blocks_expiry_time.is_some()
    }

    /// Whether the ranks it reads are notified once the READs of their release marks ended
    /// rather than by the data READs (see [`marks_check::applies`]).
    fn notifies_after_marks(&self, shared: &Shared) -> bool {
        marks_check::applies(shared, &self.remote)
    }

    /// Whether it claims kept blocks before it reads (see [`claim::needs_claim`]).
    fn needs_claim(&self, shared: &Shared) -> bool {
        claim::needs_claim(shared, &self.remote, !self.local_block_ids.is_empty())
    }

    /// The remote engine as a handshake needs it.
    pub(crate) fn engine(&self) -> Engine<'_> {
        Engine {
            id: &self.remote.engine_id,
            host: &self.remote.host,
            tp_size: self.remote.tp_size,
            pp_size: self.remote.pp_size,
        }
    }
}

/// The READs of a load once posted, and what they add up to.
pub(crate) struct Posted {
    /// When the first was posted.
    at: Instant,
    /// Each READ with the remote rank it reads, and whether NIXL finished it in the post.
    reads: Vec<PostedRead>,
    /// Bytes and descriptors of the READs made.
    bytes: usize,
    descriptors: usize,
    /// Why the next READ could not be posted, if one could not.
    failed: Option<Error>,
    /// The READs of the release marks, posted once the data READs ended within their posts
    /// (by [`try_now`]) but not ended within their own.
    marks: Option<PostedMarks>,
}

/// One READ of a load, posted.
struct PostedRead {
    /// The remote rank it reads.
    rank: usize,
    remote: Arc<Remote>,
    request: nixl::XferRequest,
    /// Whether NIXL finished it within the post.
    done: bool,
}

impl Posted {
    /// Whether every READ is done and none failed.
    fn done(&self) -> bool {
        self.failed.is_none() && self.reads.iter().all(|read| read.done)
    }
}

/// Handshakes if needed, then reads, unless the load was aborted meanwhile (then only
/// notifies); records the outcome.
pub(crate) async fn run(shared: Arc<Shared>, load: Load) {
    let span = load.span.clone();
    async move {
        match connect::remotes(&shared, load.engine(), &load.ranks).await {
            Err(err) => record(&shared, &load, None, Err(err)),
            Ok(remotes) if shared.outcomes.lock().is_aborted(&load.request_id) => {
                notify(
                    &shared,
                    &load,
                    remotes.iter(),
                    "an aborted request will not be read",
                );
                record(&shared, &load, None, Ok(()));
            }
            Ok(remotes) => {
                if load.needs_claim(&shared) {
                    let claimed = claim::claim(&shared, &load.remote, load.engine(), &load.ranks);
                    if let Err(err) = claimed.await {
                        notify(
                            &shared,
                            &load,
                            remotes.iter(),
                            "its kept blocks are not read",
                        );
                        record(&shared, &load, None, Err(err));
                        return;
                    }
                }
                let posted = {
                    let _entered = load.span.enter();
                    post(&shared, &load, &remotes)
                };
                finish_posted(&shared, &load, posted).await;
            }
        }
    }
    .instrument(span)
    .await;
}

/// Posts the load at once when the handshakes with its remote ranks are done, and records
/// it if NIXL finished it within the posts, the check after its READs too (see
/// [`checked_now`]); `None` when it is done, else the load, with its posted READs if there
/// are some, for a task to finish.
pub(crate) fn try_now(shared: &Arc<Shared>, load: Load) -> Option<(Load, Option<Posted>)> {
    // Kept blocks are claimed first, over the side channel.
    if load.needs_claim(shared) {
        return Some((load, None));
    }
    // A remote prepared over a registration replaced since is handshaken with again first.
    let generation = shared.caches.get().map(|c| c.generation);
    let remotes: Option<Vec<Arc<Remote>>> = load
        .ranks
        .iter()
        .map(|&(rank, _)| {
            shared
                .remotes
                .ready(&load.remote.engine_id, rank)
                .filter(|r| Some(r.local_generation) == generation)
        })
        .collect();
    let Some(remotes) = remotes else {
        return Some((load, None));
    };
    let mut posted = {
        let _entered = load.span.enter();
        post(shared, &load, &remotes)
    };
    if !posted.done() {
        return Some((load, Some(posted)));
    }
    // Every READ ended within its post (most do between processes of one host): so may
    // the check after them, which then ends the load here too, without a task.
    let outcome = match checked_now(shared, &load, &mut posted) {
        Some(outcome) => outcome,
        None => return Some((load, Some(posted))),
    };
    let counts: Vec<Option<usize>> = posted
        .reads
        .iter()
        .map(|read| record_telemetry(shared, &read.request))
        .collect();
    let descriptors = match (&outcome, counts.into_iter().sum::<Option<usize>>()) {
        (Ok(()), Some(counted)) => counted,
        _ => posted.descriptors,
    };
    record(
        shared,
        &load,
        Some((posted.at, posted.bytes, descriptors)),
        outcome,
    );
    None
}

/// The outcome of the check after a load's READs ([`after_read`]), all of which ended
/// within their posts, when it can be had without waiting: at once when nothing is
/// checked or the check failed, else once the release marks' READs ended within their
/// posts too. `None` when they did not: they are left in `posted`, for a task to await.
fn checked_now(shared: &Shared, load: &Load, posted: &mut Posted) -> Option<Result<()>> {
    if !load.checked_after_read() {
        return Some(Ok(()));
    }
    let read: Vec<(usize, Arc<Remote>)> = posted
        .reads
        .iter()
        .map(|read| (read.rank, read.remote.clone()))
        .collect();
    match start_check(shared, load, &read) {
        Ok(None) => Some(Ok(())),
        Err(err) => Some(Err(err)),
        Ok(Some(marks)) => match marks.compare_now(shared, &load.remote) {
            Ok(compared) => Some(compared),
            Err(pending) => {
                posted.marks = Some(pending);
                None
            }
        },
    }
}

/// Awaits the READs [`try_now`] posted (those it finished too, when they are checked after
/// the read, and the release marks' READs it posted when those did not end in their posts),
/// and records the outcome.
pub(crate) async fn finish(shared: Arc<Shared>, load: Load, posted: Posted) {
    let span = load.span.clone();
    finish_posted(&shared, &load, posted).instrument(span).await;
}

/// Sends a load's notifications without reading (a full prefix hit, vLLM's notification
/// path of `_read_blocks`, or an aborted request) to every remote rank holding the request,
/// handshaking first if needed. Nothing is reported in `finished`: no block was to be
/// written. A failure is logged and counted; the prefill then frees the blocks when their
/// lease ends.
pub(crate) async fn notify_only(shared: Arc<Shared>, load: Load) {
    let span = load.span.clone();
    async move {
        let remotes = join_all(
            load.ranks
                .iter()
                .map(|&(rank, port)| connect::remote(&shared, load.engine(), rank, port)),
        )
        .await;
        let mut reached = Vec::with_capacity(remotes.len());
        for remote in remotes {
            match remote {
                Ok(remote) => reached.push(remote),
                Err(err) => {
                    shared.series.failed_notification();
                    tracing::warn!(request = %load.request_id, %err, "could not tell a prefill rank that nothing will be read; it frees the blocks when their lease ends");
                }
            }
        }
        notify(&shared, &load, reached.iter(), "nothing will be read");
        load.span.record("outcome", "notified");
    }
    .instrument(span)
    .await;
}

/// Sends the load's notification to each of `remotes`; `why` says what it tells them, for
/// the log of a failure.
fn notify<'a>(
    shared: &Shared,
    load: &Load,
    remotes: impl Iterator<Item = &'a Arc<Remote>>,
    why: &str,
) {
    let message = load.notification(shared);
    for remote in remotes {
        if let Err(err) = shared
            .setup
            .agent()
            .send_notification(&remote.agent, &message)
        {
            shared.series.failed_notification();
            tracing::warn!(request = %load.request_id, agent = %remote.agent, %err, "could not tell a prefill rank that {why}; it frees the blocks when their lease ends");
        }
    }
}

/// Records NIXL's telemetry of a completed READ, if the agent recorded it; returns its
/// descriptor count as NIXL counts them (after joining those contiguous on both sides), the
/// one count both [`NUM_DESCRIPTORS`](crate::series::NUM_DESCRIPTORS) and
/// [`TransferMetrics::descriptors`] report.
fn record_telemetry(shared: &Shared, request: &nixl::XferRequest) -> Option<usize> {
    match request.telemetry() {
        Ok(telemetry) => {
            shared.series.transfer(&telemetry);
            usize::try_from(telemetry.desc_count).ok()
        }
        Err(err) => {
            tracing::debug!(%err, "no NIXL telemetry for a load");
            None
        }
    }
}

/// Records a load's outcome (with when its READs were posted, their bytes and descriptors)
/// and wakes whoever waits for ended loads.
pub(crate) fn record(
    shared: &Shared,
    load: &Load,
    posted: Option<(Instant, usize, usize)>,
    outcome: Result<()>,
) {
    let (duration, bytes, descriptors) =
        posted.map_or((Duration::ZERO, 0, 0), |(at, b, d)| (at.elapsed(), b, d));
    let failure = outcome
        .err()
        .map(|err| (FailureKind::of(&err), err.to_string()));
    let mut outcomes = shared.outcomes.lock();
    let aborted = outcomes.end(&load.request_id);
    let ended = match (&failure, aborted) {
        (_, true) => "aborted",
        (None, false) => "loaded",
        (Some(_), false) => "failed",
    };
    load.span.record("outcome", ended);
    shared.series.load_ended(ended);
    tracing::debug!(request = %load.request_id, remote = %load.remote.engine_id, outcome = ended, bytes, descriptors, ?duration, "load ended");
    if let Some((kind, reason)) = &failure {
        shared.series.failed(*kind);
        if aborted {
            tracing::debug!(request = %load.request_id, %reason, "the load of an aborted request failed");
        } else {
            tracing::warn!(request = %load.request_id, remote = %load.remote.engine_id, %kind, %reason, "load failed; its blocks are in load_errors");
            let reason: Arc<str> = reason.as_str().into();
            outcomes
                .load_errors
                .extend(load.local_block_ids.iter().map(|&block_id| FailedBlock {
                    block_id,
                    request_id: load.request_id.clone(),
                    kind: *kind,
                    reason: reason.clone(),
                }));
        }
    }
    outcomes.recving.push(load.request_id.clone());
    outcomes.add_metrics(TransferMetrics {
        request_id: load.request_id.clone(),
        remote_engine: load.remote.engine_id.clone(),
        duration,
        bytes: bytes as u64,
        descriptors,
        failure: failure.map(|(_, reason)| reason),
    });
    drop(outcomes);
    shared.outcomes.notify_ended();
}

/// Makes and posts one READ per remote rank read from, in rank order, stopping at the first
/// that fails (its remote is forgotten, so the next load handshakes again); after all are
/// posted, notifies the ranks not read from. In vLLM mode, blocks whose expiry time is near
/// are not read (vLLM's `_is_turn2_read_expired`), nor any rank notified.
fn post(shared: &Shared, load: &Load, remotes: &[Arc<Remote>]) -> Posted {
    let mut posted = Posted {
        at: Instant::now(),
        reads: Vec::with_capacity(remotes.len()),
        bytes: 0,
        descriptors: 0,
        failed: None,
        marks: None,
    };
    #[cfg(feature = "vllm")]
    if let Some(err) = shared
        .vllm
        .as_ref()
        .and_then(|vllm| vllm.expired(&load.remote, perf_counter()))
    {
        posted.failed = Some(err);
        return posted;
    }
    let mut nothing_to_read = Vec::new();
    for (&(rank, _), remote) in load.ranks.iter().zip(remotes) {
        if !remote.is_read() {
            continue;
        }
        let blocks = match dcp_blocks(shared, load, rank, remote) {
            Ok(blocks) => blocks,
            Err(err) => {
                posted.failed = Some(err);
                return posted;
            }
        };
        if blocks.as_ref().is_some_and(|(local, _)| local.is_empty()) {
            // Under DCP its positions and this rank's do not meet past the prefix cache:
            // it is only notified (vLLM's notification-only path).
            nothing_to_read.push(remote.clone());
            continue;
        }
        match post_one(shared, load, remote, blocks.as_ref(), &mut posted) {
            Ok((request, done)) => posted.reads.push(PostedRead {
                rank,
                remote: remote.clone(),
                request,
                done,
            }),
            Err(err) => {
                let engine = &load.remote.engine_id;
                shared.remotes.transfer_failed(engine, rank, remote, &err);
                posted.failed = Some(err);
                return posted;
            }
        }
    }
    let unread = remotes
        .iter()
        .filter(|r| !r.is_read())
        .chain(&nothing_to_read);
    notify(
        shared,
        load,
        unread,
        "its blocks were read from another rank",
    );
    posted
}

/// Makes the READ from one remote rank over the prepared lists and posts it, adding its
/// bytes and descriptors to `posted`; the request and whether NIXL finished it. Which
/// descriptors it reads is [`plan_read`]'s.
fn post_one(
    shared: &Shared,
    load: &Load,
    remote: &Remote,
    dcp: Option<&(Vec<usize>, Vec<usize>)>,
    posted: &mut Posted,
) -> Result<(nixl::XferRequest, bool)> {
    const OP: &str = "load remote blocks";
    let caches = shared
        .caches
        .get()
        .ok_or(Error::NotRegistered { operation: OP })?;
    if caches.generation != remote.local_generation {
        return Err(Error::invalid(
            OP,
            "the KV caches were registered again since the handshake with this rank; it will be handshaken with again",
        ));
    }
    let lists = remote
        .lists
        .as_ref()
        .ok_or(Error::NotRegistered { operation: OP })?;
    // Under DCP, the blocks of this rank's positions, of one KV cache group; the request's
    // token count is the whole request's, not the slices'.
    let (local_ids, remote_ids, local_lens, remote_lens, num_tokens) = match dcp {
        Some((local, remote)) => (&local[..], &remote[..], &[][..], &[][..], None),
        None => (
            &load.local_block_ids[..],
            &load.remote.block_ids[..],
            &load.local_group_lens[..],
            &load.remote.group_lens[..],
            load.remote.num_tokens,
        ),
    };
    let reads = plan_read(&ReadInputs {
        request_id: &load.request_id,
        local: SideBlocks {
            ids: local_ids,
            group_lens: local_lens,
            // Kernel blocks per block id of this engine (vLLM's
            // `physical_blocks_per_logical_kv_block`).
            per_id: shared.groups.kernel_blocks_per_id(caches.spec.block_size)?,
        },
        remote: SideBlocks {
            ids: remote_ids,
            group_lens: remote_lens,
            per_id: remote.blocks_per_id,
        },
        num_tokens,
        local_num_blocks: caches.spec.num_blocks,
        plan: &remote.plan,
        groups: &shared.groups,
        ssm: remote.ssm.as_ref(),
        reads_attention: remote.reads_attention(),
    })?;
    // With release marks, the rank is notified once the READ of its marks ended: a rank
    // released on every reader's notification raises its marks too, which must not fail
    // the check.
    let options = match load.notifies_after_marks(shared) {
        true => XferOptions::new(),
        false => XferOptions::new().notification(load.notification(shared)),
    };
    let mut request = shared.setup.agent().make_xfer_req(
        XferOp::Read,
        lists.local.as_ref().unwrap_or(&caches.local),
        &reads.local,
        &lists.remote,
        &reads.remote,
        &options,
    )?;
    posted.bytes += reads.bytes;
    posted.descriptors += reads.local.len();
    let done = request.post()? == XferStatus::Done;
    Ok((request, done))
}

/// Under decode context parallelism on either engine, the blocks of a load this rank reads
/// from `remote` (numbered `rank` as in `KvConnectorWorker::remote_ranks`): the local and
/// remote blocks of the global positions both hold ([`DcpPair::load_pairs`], vLLM's
/// `_apply_dcp_prefix_caching`), empty when none (the rank is then only notified); `None`
/// without DCP (the load's lists are read as they are).
///
/// # Errors
/// [`Error::InvalidArgument`] when the load's params and the remote's handshake disagree
/// on its DCP size, and those of [`DcpPair::load_pairs`].
fn dcp_blocks(
    shared: &Shared,
    load: &Load,
    rank: usize,
    remote: &Remote,
) -> Result<Option<(Vec<usize>, Vec<usize>)>> {
    const OP: &str = "load remote blocks";
    let dcp = DcpSizes {
        local: shared.config.dcp_size,
        remote: remote.dcp_size,
    };
    if remote.dcp_size != load.remote.dcp_size {
        return Err(Error::invalid(
            OP,
            format!(
                "request {:?}: its params say dcp_size {}, the remote rank's handshake {}",
                load.request_id, load.remote.dcp_size, remote.dcp_size
            ),
        ));
    }
    if !dcp.active() {
        return Ok(None);
    }
    let pair = DcpPair::new(dcp.local, shared.config.tp_rank % dcp.local, dcp.remote)?;
    let block_size = remote.plan.remote_block_size.max(1);
    let positions = load.remote.num_tokens.map(|n| n.div_ceil(block_size));
    let tp_rank = rank % load.remote.tp_size.max(1);
    pair.load_pairs(
        &load.local_block_ids,
        &load.remote.block_ids,
        tp_rank,
        positions,
    )
    .map(Some)
}

/// Awaits posted READs, forgets the remotes whose READ failed, and records the outcome:
/// the first failure, if any. READs still in flight when the transfer timeout passes (one
/// deadline for all of them) are reported at once as overdue, with their remotes
/// forgotten, and then awaited to their end: NIXL may still write the load's blocks until
/// it has ended every READ, so the outcome ([`Error::TransferTimeout`]) is recorded, and
/// the blocks go back to the engine, only then (vLLM's `_pop_done_transfers`: a failed
/// request keeps its handles, and is reported, until none is in progress).
async fn finish_posted(shared: &Shared, load: &Load, posted: Posted) {
    let deadline = shared.config.transfer_timeout;
    let Posted {
        at,
        reads,
        bytes,
        descriptors,
        failed,
        marks,
    } = posted;
    let read: Vec<(usize, Arc<Remote>)> = reads
        .iter()
        .map(|read| (read.rank, read.remote.clone()))
        .collect();
    let waits = reads.into_iter().map(|read| async move {
        let outcome = if read.done {
            Ok(read.request)
        } else {
            read.request.await.map_err(Error::from)
        };
        (read.rank, read.remote, outcome)
    });
    let all = join_all(waits);
    tokio::pin!(all);
    let (ended, overdue) = match tokio::time::timeout(deadline, &mut all).await {
        Ok(ended) => (ended, false),
        Err(_) => {
            for (rank, remote) in &read {
                shared
                    .remotes
                    .forget_after_failure(&load.remote.engine_id, *rank, remote);
            }
            report_overdue(shared, load, deadline);
            (all.await, true)
        }
    };
    let mut first_failure = failed.map(Err);
    if overdue {
        first_failure = Some(Err(Error::TransferTimeout {
            request_id: load.request_id.clone(),
            deadline,
        }));
    }
    let mut counted = Some(0);
    let mut whole = Vec::with_capacity(ended.len());
    for (rank, remote, outcome) in ended {
        match outcome {
            Ok(request) => {
                let count = record_telemetry(shared, &request);
                counted = counted.zip(count).map(|(sum, more)| sum + more);
                whole.push(remote);
            }
            Err(err) => {
                let engine = &load.remote.engine_id;
                shared.remotes.transfer_failed(engine, rank, &remote, &err);
                first_failure.get_or_insert(Err(err));
            }
        }
    }
    let outcome = match first_failure {
        Some(failed) => {
            // The ranks whose READ ended well hear of it, as their READ's notification
            // would have told them.
            if load.notifies_after_marks(shared) {
                notify(shared, load, whole.iter(), "its READ ended");
            }
            failed
        }
        None => match marks {
            // The check's READs were posted already (by `try_now`).
            Some(marks) => marks.compare(shared, &load.remote).await,
            None => after_read(shared, load, &read).await,
        },
    };
    // NIXL's count when every READ completed with telemetry; else the descriptors asked for.
    let descriptors = match (&outcome, counted) {
        (Ok(()), Some(counted)) => counted,
        _ => descriptors,
    };
    record(shared, load, Some((at, bytes, descriptors)), outcome);
}

/// Checks, once every READ of a load ended well, that the prefill still held the blocks
/// when they ended, so that a READ that outlived the lease never counts as loaded: in vLLM
/// mode the blocks' expiry time, read again on this clock; in the native protocol the
/// release marks of every rank read.
async fn after_read(shared: &Shared, load: &Load, read: &[(usize, Arc<Remote>)]) -> Result<()> {
    match start_check(shared, load, read)? {
        Some(marks) => marks.compare(shared, &load.remote).await,
        None => Ok(()),
    }
}

/// The part of [`after_read`] that does not wait: the vLLM-mode expiry check, then the
/// release marks' READs posted (`None` without marks).
fn start_check(
    shared: &Shared,
    load: &Load,
    read: &[(usize, Arc<Remote>)],
) -> Result<Option<PostedMarks>> {
    #[cfg(feature = "vllm")]
    if let Some(err) = shared
        .vllm
        .as_ref()
        .and_then(|vllm| vllm.outlived(&load.remote, perf_counter()))
    {
        return Err(err);
    }
    let notification = load.notification(shared);
    marks_check::post_checks(shared, &load.remote, read, &notification)
}

/// Reports a load whose READs outlived its transfer timeout: logged, counted
/// ([`NUM_OVERDUE_TRANSFERS`](crate::series::NUM_OVERDUE_TRANSFERS)) and listed for
/// [`KvConnectorWorker::overdue_loads`](crate::KvConnectorWorker::overdue_loads). Its blocks
/// stay with the connector.
pub(crate) fn report_overdue(shared: &Shared, load: &Load, deadline: Duration) {
    shared.series.overdue();
    tracing::warn!(request = %load.request_id, remote = %load.remote.engine_id, ?deadline, blocks = load.local_block_ids.len(), "a load's READs are still in flight past the transfer timeout; its blocks stay with the connector until NIXL ends them");
    shared.outcomes.lock().add_overdue(OverdueLoad {
        request_id: load.request_id.clone(),
        remote_engine: load.remote.engine_id.clone(),
        block_ids: load.local_block_ids.clone(),
        deadline,
    });
}

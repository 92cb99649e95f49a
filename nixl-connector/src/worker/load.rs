//! One load: the handshakes with the remote ranks holding the request if needed, then one
//! prepared READ per rank read from, by unit (or, for a full prefix hit or an aborted
//! request, the notifications alone), outcome recorded.
//!
//! Every remote rank holding the request is notified: the ranks read from by their READ's
//! notification, the others (MLA or replicated heads read elsewhere) by a notification
//! alone once every READ is posted (vLLM's `_read_blocks_for_req`). If a READ cannot be
//! posted, none after it is, and the load ends only once those already posted have.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use nixl::{XferOp, XferOptions, XferStatus};
use tracing::Instrument;

use crate::config::Protocol;
use crate::error::{Error, Result};
use crate::failure::{FailedBlock, FailureKind};
use crate::geometry::block_map::{pair_groups, pair_units, GroupBlocks};
use crate::geometry::groups::pairs_by_region;
use crate::geometry::ssm::split_state_pairs;
use crate::geometry::tp_mapping::TpMapping;
use crate::metrics::TransferMetrics;
use crate::scheduler::outcomes::OverdueLoad;
use crate::transport::params::RemoteBlocks;
#[cfg(feature = "vllm")]
use crate::vllm::clock::perf_counter;
use crate::worker::connect::{self, Engine};
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
    /// of this engine notify each remote rank (vLLM's `local_consumers`). A native load
    /// whose params had no capability notifies without a tag, which a prefill refuses (its
    /// lease frees the blocks).
    fn notification(&self, shared: &Shared) -> Vec<u8> {
        let own_tp = shared.config.tp_size;
        let agent = shared.setup.agent().name();
        let (count, proof) = match shared.protocol {
            Protocol::Native => (own_tp, self.remote.capability.as_ref().map(|c| (c, agent))),
            Protocol::Vllm => (TpMapping::consumers(own_tp, self.remote.tp_size), None),
        };
        notification_message(&self.remote.request_id, count, proof)
    }

    /// The remote engine as a handshake needs it.
    fn engine(&self) -> Engine<'_> {
        Engine {
            id: &self.remote.engine_id,
            host: &self.remote.host,
            tp_size: self.remote.tp_size,
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
        match handshakes(&shared, &load).await {
            Err(err) => record(&shared, &load, None, Err(err)),
            Ok(remotes) if shared.outcomes().is_aborted(&load.request_id) => {
                notify(
                    &shared,
                    &load,
                    remotes.iter(),
                    "an aborted request will not be read",
                );
                record(&shared, &load, None, Ok(()));
            }
            Ok(remotes) => {
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
/// it if NIXL finished it within the posts; `None` when it is done, else the load, with its
/// posted READs if there are some, for a task to finish.
pub(crate) fn try_now(shared: &Arc<Shared>, load: Load) -> Option<(Load, Option<Posted>)> {
    // A remote prepared over a registration replaced since is handshaken with again first.
    let generation = shared.current_caches().map(|c| c.generation);
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
    let posted = {
        let _entered = load.span.enter();
        post(shared, &load, &remotes)
    };
    if posted.done() {
        let counts: Vec<Option<usize>> = posted
            .reads
            .iter()
            .map(|read| record_telemetry(shared, &read.request))
            .collect();
        let descriptors = counts.into_iter().sum::<Option<usize>>();
        let at = Some((
            posted.at,
            posted.bytes,
            descriptors.unwrap_or(posted.descriptors),
        ));
        record(shared, &load, at, Ok(()));
        return None;
    }
    Some((load, Some(posted)))
}

/// Awaits the READs [`try_now`] posted, and records the outcome.
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

/// The handshakes with every remote rank of the load, run together.
async fn handshakes(shared: &Arc<Shared>, load: &Load) -> Result<Vec<Arc<Remote>>> {
    join_all(
        load.ranks
            .iter()
            .map(|&(rank, port)| connect::remote(shared, load.engine(), rank, port)),
    )
    .await
    .into_iter()
    .collect()
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
fn record(
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
    let mut outcomes = shared.outcomes();
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
    outcomes.metrics.push(TransferMetrics {
        request_id: load.request_id.clone(),
        remote_engine: load.remote.engine_id.clone(),
        duration,
        bytes: bytes as u64,
        descriptors,
        failure: failure.map(|(_, reason)| reason),
    });
    drop(outcomes);
    shared.load_ended.notify_one();
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
    for (&(rank, _), remote) in load.ranks.iter().zip(remotes) {
        if !remote.is_read() {
            continue;
        }
        match post_one(shared, load, remote, &mut posted) {
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
    let unread = remotes.iter().filter(|r| !r.is_read());
    notify(
        shared,
        load,
        unread,
        "its blocks were read from another rank",
    );
    posted
}

/// Makes the READ from one remote rank over the prepared lists and posts it, adding its
/// bytes and descriptors to `posted`; the request and whether NIXL finished it.
fn post_one(
    shared: &Shared,
    load: &Load,
    remote: &Remote,
    posted: &mut Posted,
) -> Result<(nixl::XferRequest, bool)> {
    const OP: &str = "load remote blocks";
    let caches = shared
        .current_caches()
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
    let plan = &remote.plan;
    let is_state = |g| shared.groups.is_ssm(g);
    // Each group names a block once: at most the remote rank's blocks per group.
    let remote_ids = blocks_of_ids(
        (&load.remote.block_ids, &load.remote.group_lens),
        remote.blocks_per_id,
        is_state,
        plan.remote_num_blocks
            .saturating_mul(load.remote.group_lens.len().max(1)),
        "remote_block_ids",
    )?;
    if let Some(bad) = remote_ids.iter().find(|&&b| b >= plan.remote_num_blocks) {
        return Err(Error::invalid(
            OP,
            format!("remote block {bad} of {} blocks", plan.remote_num_blocks),
        ));
    }
    // Kernel blocks per block id of this engine (vLLM's `physical_blocks_per_logical_kv_block`).
    let local_per_id = shared.groups.kernel_blocks_per_id(caches.spec.block_size)?;
    // One group pairs unit by unit from the prompt's first token, but not when a block id
    // is several kernel blocks (the last of which may hold no token): then as a group, at
    // the units' tokens of the prompt.
    let sizes = plan.block_sizes();
    let kernel_ids = local_per_id > 1 || (remote.blocks_per_id > 1 && sizes.remote <= sizes.local);
    let (pairs, group_pairs) = if load.local_group_lens.is_empty() && !kernel_ids {
        let pairs = pair_units(
            &load.request_id,
            &load.local_block_ids,
            &remote_ids,
            sizes,
            load.remote.num_tokens,
        )?;
        (pairs, Vec::new())
    } else {
        let remote_lens = kernel_group_lens(
            &load.remote.block_ids,
            &load.remote.group_lens,
            remote.blocks_per_id,
            is_state,
        )?;
        let local_lens = kernel_group_lens(
            &load.local_block_ids,
            &load.local_group_lens,
            local_per_id,
            is_state,
        )?;
        let local_ids = blocks_of_ids(
            (&load.local_block_ids, &load.local_group_lens),
            local_per_id,
            is_state,
            caches.spec.num_blocks.saturating_mul(local_lens.len()),
            "local block ids",
        )?;
        if let Some(bad) = local_ids.iter().find(|&&b| b >= caches.spec.num_blocks) {
            return Err(Error::invalid(
                OP,
                format!(
                    "local kernel block {bad} of {} blocks ({local_per_id} per block id)",
                    caches.spec.num_blocks
                ),
            ));
        }
        pair_groups(
            &load.request_id,
            GroupBlocks {
                ids: &local_ids,
                lens: &local_lens,
            },
            GroupBlocks {
                ids: &remote_ids,
                lens: &remote_lens,
            },
            sizes,
            load.remote.num_tokens,
            (local_per_id, remote.blocks_per_id),
            is_state,
        )?
    };
    let own = shared.groups.own_region_groups();
    let (local, far, bytes) = if let Some(ssm) = &remote.ssm {
        // vLLM's `[descs_fa | descs_ssm]`: the attention groups' blocks in every region,
        // then the SSM groups' state.
        let (attention, state) = split_state_pairs(&pairs, &group_pairs, is_state)?;
        let (mut local, mut far, bytes) = if remote.reads_attention() {
            plan.descriptor_ids(caches.spec.num_blocks, &attention)
        } else {
            // Its attention is read from another rank of its TP group: its state only.
            (Vec::new(), Vec::new(), 0)
        };
        let (state_local, state_far, state_bytes) = ssm
            .descriptor_ids(&state)
            .map_err(|why| Error::invalid(OP, why))?;
        local.extend(state_local);
        far.extend(state_far);
        (local, far, bytes + state_bytes)
    } else if own.is_empty() || group_pairs.len() < 2 {
        plan.descriptor_ids(caches.spec.num_blocks, &pairs)
    } else {
        let by_region = pairs_by_region(&pairs, &group_pairs, own)?;
        plan.descriptor_ids_in(caches.spec.num_blocks, |region| {
            by_region.get(region).copied().unwrap_or(&pairs)
        })
    };
    let options = XferOptions::new().notification(load.notification(shared));
    let mut request = shared.setup.agent().make_xfer_req(
        XferOp::Read,
        lists.local.as_ref().unwrap_or(&caches.local),
        &local,
        &lists.remote,
        &far,
        &options,
    )?;
    posted.bytes += bytes;
    posted.descriptors += local.len();
    let done = request.post()? == XferStatus::Done;
    Ok((request, done))
}

/// The registered (kernel) blocks of block `ids` (`group_lens` of them per KV cache group;
/// none: one group), `per_id` blocks each (vLLM's `_logical_to_kernel_block_ids`: logical
/// block `b` is kernel blocks `b * per_id .. (b + 1) * per_id`), but the ids of the groups
/// that are `is_state` (SSM), which stay block ids: a state page is a whole id.
///
/// The ids are a peer's (`what` names them): more kernel blocks than `max_blocks` (each
/// group's list names a block once) are refused before a list of them is made.
///
/// # Errors
/// [`Error::InvalidArgument`] for an id whose blocks overflow, more than `max_blocks`, or
/// group counts past the ids.
fn blocks_of_ids<'a>(
    (ids, group_lens): (&'a [usize], &[usize]),
    per_id: usize,
    is_state: impl Fn(usize) -> bool,
    max_blocks: usize,
    what: &str,
) -> Result<Cow<'a, [usize]>> {
    const OP: &str = "load remote blocks";
    if per_id == 1 {
        return Ok(Cow::Borrowed(ids));
    }
    // At most this many (state groups' ids stay one block each).
    let total = ids.len().checked_mul(per_id).filter(|&n| n <= max_blocks);
    let Some(total) = total else {
        return Err(Error::invalid(
            OP,
            format!(
                "{what}: {} block ids of {per_id} kernel blocks each name more than the {max_blocks} blocks of the KV caches' groups",
                ids.len()
            ),
        ));
    };
    let mut blocks = Vec::with_capacity(total);
    let miscounted = || {
        Error::invalid(
            OP,
            format!(
                "{what}: group counts {group_lens:?} for {} block ids",
                ids.len()
            ),
        )
    };
    let mut rest = ids;
    let one = [ids.len()];
    let lens = if group_lens.is_empty() {
        &one[..]
    } else {
        group_lens
    };
    for (group, &n) in lens.iter().enumerate() {
        let Some((these, tail)) = rest.split_at_checked(n) else {
            return Err(miscounted());
        };
        rest = tail;
        if is_state(group) {
            blocks.extend_from_slice(these);
            continue;
        }
        expand_ids(these, per_id, &mut blocks, what)?;
    }
    if !rest.is_empty() {
        return Err(miscounted());
    }
    Ok(Cow::Owned(blocks))
}

/// Appends to `blocks` the `per_id` kernel blocks of each of `ids` (`what` names them).
///
/// # Errors
/// [`Error::InvalidArgument`] for an id whose blocks overflow.
fn expand_ids(ids: &[usize], per_id: usize, blocks: &mut Vec<usize>, what: &str) -> Result<()> {
    const OP: &str = "load remote blocks";
    for &id in ids {
        let end = id
            .checked_add(1)
            .and_then(|n| n.checked_mul(per_id))
            .ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!("{what}: block id {id} of {per_id} kernel blocks each overflows"),
                )
            })?;
        blocks.extend(end - per_id..end);
    }
    Ok(())
}

/// How many kernel blocks each KV cache group of block `ids` has, `group_lens` of the ids
/// each (none: one group of every id), `per_id` kernel blocks per id; an `is_state` (SSM)
/// group's ids stay block ids.
///
/// # Errors
/// [`Error::InvalidArgument`] for a count whose blocks overflow.
fn kernel_group_lens(
    ids: &[usize],
    group_lens: &[usize],
    per_id: usize,
    is_state: impl Fn(usize) -> bool,
) -> Result<Vec<usize>> {
    let one = [ids.len()];
    let lens = if group_lens.is_empty() {
        &one[..]
    } else {
        group_lens
    };
    lens.iter()
        .enumerate()
        .map(|(group, &n)| {
            let per_id = if is_state(group) { 1 } else { per_id };
            n.checked_mul(per_id).ok_or_else(|| {
                Error::invalid(
                    "load remote blocks",
                    format!("{n} remote block ids of {per_id} kernel blocks each overflow"),
                )
            })
        })
        .collect()
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
    for (rank, remote, outcome) in ended {
        match outcome {
            Ok(request) => {
                let count = record_telemetry(shared, &request);
                counted = counted.zip(count).map(|(sum, more)| sum + more);
            }
            Err(err) => {
                let engine = &load.remote.engine_id;
                shared.remotes.transfer_failed(engine, rank, &remote, &err);
                first_failure.get_or_insert(Err(err));
            }
        }
    }
    let outcome = first_failure.unwrap_or(Ok(()));
    // NIXL's count when every READ completed with telemetry; else the descriptors asked for.
    let descriptors = match (&outcome, counted) {
        (Ok(()), Some(counted)) => counted,
        _ => descriptors,
    };
    record(shared, load, Some((at, bytes, descriptors)), outcome);
}

/// Reports a load whose READs outlived its transfer timeout: logged, counted
/// ([`NUM_OVERDUE_TRANSFERS`](crate::series::NUM_OVERDUE_TRANSFERS)) and listed for
/// [`KvConnectorWorker::overdue_loads`](crate::KvConnectorWorker::overdue_loads). Its blocks
/// stay with the connector.
fn report_overdue(shared: &Shared, load: &Load, deadline: Duration) {
    shared.series.overdue();
    tracing::warn!(request = %load.request_id, remote = %load.remote.engine_id, ?deadline, blocks = load.local_block_ids.len(), "a load's READs are still in flight past the transfer timeout; its blocks stay with the connector until NIXL ends them");
    shared.outcomes().overdue.push(OverdueLoad {
        request_id: load.request_id.clone(),
        remote_engine: load.remote.engine_id.clone(),
        block_ids: load.local_block_ids.clone(),
        deadline,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_ids_name_no_more_kernel_blocks_than_the_cache_holds() {
        assert_eq!(
            blocks_of_ids((&[0, 3], &[]), 2, |_| false, 8, "remote_block_ids").unwrap()[..],
            [0, 1, 6, 7]
        );
        // A peer's list of 4,096 ids of 1,024 kernel blocks each (its
        // physical_blocks_per_logical_kv_block) names 4 Mi blocks of a cache of 2,048: refused
        // before any list of that size is made.
        let err = blocks_of_ids(
            (&[0; 1 << 12], &[]),
            1 << 10,
            |_| false,
            2048,
            "remote_block_ids",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("remote_block_ids: 4096 block ids of 1024 kernel blocks each name more than the 2048 blocks"),
            "{err}"
        );
        let err = blocks_of_ids(
            (&[usize::MAX], &[]),
            2,
            |_| false,
            usize::MAX,
            "remote_block_ids",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("remote_block_ids: block id"), "{err}");
    }
}

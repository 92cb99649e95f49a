//! One load: handshake if needed, then one prepared READ by block id (or, for a full
//! prefix hit or an aborted request, the notification alone), outcome recorded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::{XferOp, XferOptions, XferStatus};
use tracing::Instrument;

use crate::block_map::descriptor_ids;
use crate::connect;
use crate::error::{Error, Result};
use crate::failure::{FailedBlock, FailureKind};
use crate::metrics::TransferMetrics;
use crate::params::RemoteBlocks;
use crate::remotes::Remote;
use crate::sending::notification_message;
use crate::shared::Shared;

/// What [`crate::KvConnectorWorker::start_load`] checked and hands the task.
pub(crate) struct Load {
    pub(crate) request_id: String,
    pub(crate) local_block_ids: Vec<usize>,
    /// The remote blocks read into `local_block_ids`, paired in order (the tail of
    /// `remote.block_ids`, see [`crate::block_map::remote_tail`]).
    pub(crate) remote_block_ids: Vec<usize>,
    pub(crate) remote: RemoteBlocks,
    pub(crate) remote_rank: usize,
    pub(crate) port: u16,
    /// The load's tracing span: its post and its completion run inside it.
    pub(crate) span: tracing::Span,
}

impl Load {
    /// The span of a load of `local` blocks for `request_id` from `remote`.
    pub(crate) fn span(
        request_id: &str,
        remote: &RemoteBlocks,
        rank: usize,
        blocks: usize,
    ) -> tracing::Span {
        tracing::info_span!("nixl_load", request = request_id, engine = %remote.engine_id, rank, blocks, outcome = tracing::field::Empty)
    }

    fn notification(&self, shared: &Shared) -> Vec<u8> {
        notification_message(&self.remote.request_id, shared.config.tp_size)
    }
}

/// Handshakes if needed, then reads, unless the load was aborted meanwhile (then only
/// notifies); records the outcome.
pub(crate) async fn run(shared: Arc<Shared>, load: Load) {
    let span = load.span.clone();
    async move {
        let mut posted = None;
        let outcome = transfer(&shared, &load, &mut posted).await;
        record(&shared, &load, posted, outcome);
    }
    .instrument(span)
    .await;
}

/// Posts the load at once when the handshake with its remote rank is done, and records it
/// if NIXL finished it within the post; `None` when it is done, else the load, with its
/// posted request if there is one, for a task to finish.
pub(crate) fn try_now(shared: &Arc<Shared>, load: Load) -> Option<(Load, Option<Posted>)> {
    let Some(remote) = shared
        .remotes
        .ready(&load.remote.engine_id, load.remote_rank)
    else {
        return Some((load, None));
    };
    let posted = {
        let _entered = load.span.enter();
        post(shared, &load, &remote)
    };
    match posted {
        Ok((at, XferState::Done(request))) => {
            record_telemetry(shared, &request);
            record(shared, &load, Some(at), Ok(()));
            None
        }
        Ok((at, XferState::InFlight(request))) => Some((
            load,
            Some(Posted {
                remote,
                request,
                at,
            }),
        )),
        Err(err) => {
            shared
                .remotes
                .forget(&load.remote.engine_id, load.remote_rank, &remote);
            record(shared, &load, None, Err(err));
            None
        }
    }
}

/// A load's READ, posted and not done within the post.
pub(crate) struct Posted {
    remote: Arc<Remote>,
    request: nixl::XferRequest,
    at: Instant,
}

/// Awaits a READ [`try_now`] posted, and records the outcome.
pub(crate) async fn finish(shared: Arc<Shared>, load: Load, posted: Posted) {
    let span = load.span.clone();
    async move {
        let outcome = complete(&shared, &load, posted.request).await;
        if outcome.is_err() {
            shared
                .remotes
                .forget(&load.remote.engine_id, load.remote_rank, &posted.remote);
        }
        record(&shared, &load, Some(posted.at), outcome);
    }
    .instrument(span)
    .await;
}

/// Sends a load's notification without reading (a full prefix hit, vLLM's notification
/// path of `_read_blocks`, or an aborted request), handshaking first if needed. Nothing is
/// reported in `finished`: no block was to be written. A failure is logged and counted;
/// the prefill then frees the blocks when its lease ends.
pub(crate) async fn notify_only(shared: Arc<Shared>, load: Load) {
    let span = load.span.clone();
    async move {
        let sent = match connect::remote(
            &shared,
            &load.remote.engine_id,
            load.remote_rank,
            &load.remote.host,
            load.port,
        )
        .await
        {
            Ok(remote) => send_notification(&shared, &remote, &load),
            Err(err) => Err(err),
        };
        if let Err(err) = sent {
            shared.series.failed_notification();
            tracing::warn!(request = %load.request_id, %err, "could not tell the prefill that nothing will be read; it frees the blocks when their lease ends");
        }
        load.span.record("outcome", "notified");
    }
    .instrument(span)
    .await;
}

/// Sends the load's notification to its remote rank.
fn send_notification(shared: &Shared, remote: &Remote, load: &Load) -> Result<()> {
    shared
        .setup
        .agent()
        .send_notification(remote.prepared.remote_agent(), &load.notification(shared))
        .map_err(Error::from)
}

/// Records NIXL's telemetry of a completed READ, if the agent recorded it.
fn record_telemetry(shared: &Shared, request: &nixl::XferRequest) {
    match request.telemetry() {
        Ok(telemetry) => shared.series.transfer(&telemetry),
        Err(err) => tracing::debug!(%err, "no NIXL telemetry for a load"),
    }
}

/// Records a load's outcome and wakes whoever waits for ended loads.
fn record(shared: &Shared, load: &Load, posted: Option<Instant>, outcome: Result<()>) {
    let layers = shared.caches.get().map_or(0, |c| c.spec.num_layers);
    let slice = shared.caches.get().map_or(0, |c| c.spec.block_len());
    let descriptors = layers * load.local_block_ids.len();
    let duration = posted.map_or(Duration::ZERO, |at: Instant| at.elapsed());
    let failure = outcome
        .err()
        .map(|err| (FailureKind::of(&err), err.to_string()));
    let mut outcomes = shared.outcomes();
    let aborted = outcomes.end(&load.request_id);
    load.span.record(
        "outcome",
        match (&failure, aborted) {
            (_, true) => "aborted",
            (None, false) => "loaded",
            (Some(_), false) => "failed",
        },
    );
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
        bytes: (descriptors * slice) as u64,
        descriptors,
        failure: failure.map(|(_, reason)| reason),
    });
    drop(outcomes);
    shared.load_ended.notify_one();
}

/// Handshakes if needed, then reads (or only notifies, when the load was aborted meanwhile);
/// a remote whose READ failed in NIXL is forgotten.
async fn transfer(shared: &Arc<Shared>, load: &Load, posted: &mut Option<Instant>) -> Result<()> {
    let remote = connect::remote(
        shared,
        &load.remote.engine_id,
        load.remote_rank,
        &load.remote.host,
        load.port,
    )
    .await?;
    if shared.outcomes().is_aborted(&load.request_id) {
        if let Err(err) = send_notification(shared, &remote, load) {
            shared.series.failed_notification();
            tracing::warn!(request = %load.request_id, %err, "could not tell the prefill that an aborted request will not be read; it frees the blocks when their lease ends");
        }
        return Ok(());
    }
    let outcome = read(shared, load, &remote, posted).await;
    if outcome.is_err() {
        shared
            .remotes
            .forget(&load.remote.engine_id, load.remote_rank, &remote);
    }
    outcome
}

/// The READ itself, from a remote rank after its handshake.
async fn read(
    shared: &Shared,
    load: &Load,
    remote: &Remote,
    posted: &mut Option<Instant>,
) -> Result<()> {
    let (at, state) = post(shared, load, remote)?;
    *posted = Some(at);
    match state {
        XferState::Done(request) => {
            record_telemetry(shared, &request);
            Ok(())
        }
        XferState::InFlight(request) => complete(shared, load, request).await,
    }
}

/// A READ after its post.
enum XferState {
    /// NIXL finished it within the post.
    Done(nixl::XferRequest),
    /// Still in flight.
    InFlight(nixl::XferRequest),
}

/// Makes the READ by block id over the prepared lists and posts it; when it was posted.
fn post(shared: &Shared, load: &Load, remote: &Remote) -> Result<(Instant, XferState)> {
    const OP: &str = "load remote blocks";
    let caches = shared
        .caches
        .get()
        .ok_or(Error::NotRegistered { operation: OP })?;
    let remote_blocks = remote.plan.remote_num_blocks;
    if let Some(bad) = load.remote_block_ids.iter().find(|&&b| b >= remote_blocks) {
        return Err(Error::invalid(
            OP,
            format!("remote block {bad} of {remote_blocks} blocks"),
        ));
    }
    let (local, far) = descriptor_ids(
        caches.spec.num_layers,
        caches.spec.num_blocks,
        remote_blocks,
        &load.local_block_ids,
        &load.remote_block_ids,
    );
    let options = XferOptions::new().notification(load.notification(shared));
    let agent = shared.setup.agent();
    let mut request = agent.make_xfer_req(
        XferOp::Read,
        &caches.local,
        &local,
        &remote.prepared,
        &far,
        &options,
    )?;
    let at = Instant::now();
    Ok(match request.post()? {
        XferStatus::Done => (at, XferState::Done(request)),
        _ => (at, XferState::InFlight(request)),
    })
}

/// Awaits a posted READ within the transfer timeout.
async fn complete(shared: &Shared, load: &Load, request: nixl::XferRequest) -> Result<()> {
    let deadline = shared.config.transfer_timeout;
    match tokio::time::timeout(deadline, request).await {
        Ok(Ok(request)) => {
            record_telemetry(shared, &request);
            Ok(())
        }
        Ok(Err(err)) => Err(Error::from(err)),
        Err(_) => Err(Error::TransferTimeout {
            request_id: load.request_id.clone(),
            deadline,
        }),
    }
}

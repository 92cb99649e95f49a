//! One load: handshake if needed, one prepared READ by block id, outcome recorded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::{XferOp, XferOptions, XferStatus};

use crate::error::{Error, Result};
use crate::metrics::TransferMetrics;
use crate::params::RemoteBlocks;
use crate::remote::Remote;
use crate::sending::notification_message;
use crate::worker::Shared;

/// What [`crate::KvConnectorWorker::start_load`] checked and hands the task.
pub(crate) struct Load {
    pub(crate) request_id: String,
    pub(crate) local_block_ids: Vec<usize>,
    pub(crate) remote: RemoteBlocks,
    pub(crate) remote_rank: usize,
    pub(crate) port: u16,
}

/// Runs the load and records its outcome.
pub(crate) async fn run(shared: Arc<Shared>, load: Load) {
    let mut posted = None;
    let outcome = transfer(&shared, &load, &mut posted).await;
    record(&shared, &load, posted, outcome);
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
    match post(shared, &load, &remote) {
        Ok((at, XferState::Done)) => {
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
    let outcome = complete(&shared, &load, posted.request).await;
    if outcome.is_err() {
        shared
            .remotes
            .forget(&load.remote.engine_id, load.remote_rank, &posted.remote);
    }
    record(&shared, &load, Some(posted.at), outcome);
}

/// Records a load's outcome and wakes whoever waits for ended loads.
fn record(shared: &Shared, load: &Load, posted: Option<Instant>, outcome: Result<()>) {
    let layers = shared.caches.get().map_or(0, |c| c.spec.num_layers);
    let slice = shared.caches.get().map_or(0, |c| c.spec.block_len());
    let descriptors = layers * load.local_block_ids.len();
    let duration = posted.map_or(Duration::ZERO, |at: Instant| at.elapsed());
    let failure = outcome.err().map(|err| err.to_string());
    let mut outcomes = shared.outcomes();
    if let Some(reason) = &failure {
        tracing::warn!(request = %load.request_id, remote = %load.remote.engine_id, %reason, "load failed; its blocks are in load_errors");
        outcomes
            .load_errors
            .extend(load.local_block_ids.iter().copied());
    }
    outcomes.recving.push(load.request_id.clone());
    outcomes.metrics.push(TransferMetrics {
        request_id: load.request_id.clone(),
        remote_engine: load.remote.engine_id.clone(),
        duration,
        bytes: (descriptors * slice) as u64,
        descriptors,
        failure,
    });
    drop(outcomes);
    shared.load_ended.notify_one();
}

/// Handshakes if needed, then reads; a remote whose READ failed in NIXL is forgotten.
async fn transfer(shared: &Arc<Shared>, load: &Load, posted: &mut Option<Instant>) -> Result<()> {
    let remote = shared
        .remotes
        .get(
            shared,
            &load.remote.engine_id,
            load.remote_rank,
            &load.remote.host,
            load.port,
        )
        .await?;
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
        XferState::Done => Ok(()),
        XferState::InFlight(request) => complete(shared, load, request).await,
    }
}

/// A READ after its post.
enum XferState {
    /// NIXL finished it within the post.
    Done,
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
    let local_blocks = caches.spec.num_blocks;
    let remote_blocks = remote.plan.remote_num_blocks;
    if let Some(bad) = load.remote.block_ids.iter().find(|&&b| b >= remote_blocks) {
        return Err(Error::invalid(
            OP,
            format!("remote block {bad} of {remote_blocks} blocks"),
        ));
    }
    let mut local = Vec::with_capacity(caches.spec.num_layers * load.local_block_ids.len());
    let mut far = Vec::with_capacity(local.capacity());
    for layer in 0..caches.spec.num_layers {
        local.extend(
            load.local_block_ids
                .iter()
                .map(|b| layer * local_blocks + b),
        );
        far.extend(
            load.remote
                .block_ids
                .iter()
                .map(|b| layer * remote_blocks + b),
        );
    }
    let message = notification_message(&load.remote.request_id, shared.config.tp_size);
    let options = XferOptions::new().notification(message);
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
        XferStatus::Done => (at, XferState::Done),
        _ => (at, XferState::InFlight(request)),
    })
}

/// Awaits a posted READ within the transfer timeout.
async fn complete(shared: &Shared, load: &Load, request: nixl::XferRequest) -> Result<()> {
    let deadline = shared.config.transfer_timeout;
    match tokio::time::timeout(deadline, request).await {
        Ok(done) => done.map(drop).map_err(Error::from),
        Err(_) => Err(Error::TransferTimeout {
            request_id: load.request_id.clone(),
            deadline,
        }),
    }
}

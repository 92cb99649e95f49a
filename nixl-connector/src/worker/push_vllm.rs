//! Push mode in vLLM's protocol (vLLM 0.33's `NixlPushConnector` on the wire): the flow of
//! `push.rs`, with vLLM's messages in place of the native ones.
//!
//! **Decode** ([`load`]): the handshakes with the prefill ranks of the
//! [`TpMapping`](crate::TpMapping) (vLLM's `get_meta_msg`, the compatibility hash of push
//! mode checked), then one `PUSH_REG:` registration ([`PushRegistration`]) to each, then
//! the wait, an async wake-up, for each rank's WRITE: its notification
//! `"{request_id}:{prefill TP}"`, counted once per rank and only from the agents
//! registered with. vLLM's prefill answers nothing else: a registration it never writes
//! has no end. Past `push_registration_timeout` the load's heartbeats stop (until the
//! engine takes the load's end), so that the
//! prefill's lease ends and it drops the registration, and the load still waits a grace
//! of two leases (the worker's `kv_lease_duration`, which must be at least the
//! prefill's) for a WRITE that was already under way; then it fails by the failure policy
//! and hands its blocks back. An aborted load waits the same grace.
//!
//! **Prefill** ([`ready`], [`route`]): a registration is matched to a request held for
//! push by vLLM's rules (`push_book_vllm.rs`); the rank handshakes with the decode rank its
//! own rank writes (vLLM's TP mapping: decode TP at most this engine's), whose agent must be
//! the registration's sender, and WRITEs as the native push does (`push_write.rs`) with
//! vLLM's notification. The request is released once NIXL has ended the WRITE (never by
//! its lease while it runs), or at once when the proven decode's registration does not fit
//! it (vLLM's wire has no refusal: the decode's registration times out). A registration
//! that fails before that (another engine's, a TP vLLM cannot pair, a handshake that
//! fails, a sender that is not the decode rank) leaves the request held for another.
//!
//! Every notification of a vLLM push worker comes here ([`route`]): `HB:` heartbeats go to
//! the held requests as in pull mode, `PUSH_REG:` to the prefill side, the rest are WRITE
//! notifications parsed strictly (no `:`, a count that is not a number: dropped and
//! counted).

use std::sync::Arc;
use std::time::Instant;

use nixl::Notification;

use crate::error::{Error, Result};
use crate::transport::push_wire::PushEnd;
use crate::vllm::notify::{self, NotificationLimits, VllmNotification, HEARTBEAT_PREFIX};
use crate::vllm::push_reg::{PushRegistration, RegisteredBlocks, PUSH_REG_PREFIX};
use crate::worker::connect::{self, Engine};
use crate::worker::load::{record, report_overdue, Load};
use crate::worker::push_book::{HeldBlocks, WaitProof};
use crate::worker::push_book_vllm::VllmWrite;
use crate::worker::push_outcome::outcome;
use crate::worker::push_state::Push;
use crate::worker::push_write::{post_and_await, WriteInputs};
use crate::worker::remotes::Remote;
use crate::worker::shared::Shared;

/// One notification of a vLLM push worker.
pub(crate) fn route(shared: &Arc<Shared>, push: &Push, note: Notification) {
    let message = &note.message[..];
    if message.starts_with(HEARTBEAT_PREFIX.as_bytes()) {
        shared
            .sends
            .lock()
            .notified(&note.sender, message, std::time::Instant::now());
        shared.sends.notify_arrived();
        return;
    }
    let refused = |why: &str| {
        tracing::debug!(sender = %String::from_utf8_lossy(&note.sender), why, "vLLM push notification dropped");
    };
    if message.starts_with(PUSH_REG_PREFIX) {
        if push.closing() {
            refused("the worker is closing");
            return;
        }
        match PushRegistration::parse(message) {
            Ok(registration) => {
                // What it holds once decoded: each block id takes 8 bytes, most took 1.
                let ids = registration.local_block_ids.id_count();
                let bytes = message.len() + note.sender.len() + 8 * ids;
                let write = push
                    .vllm_book()
                    .registration(&note.sender, registration, bytes);
                if let Some(write) = write {
                    spawn_write(shared, write);
                }
            }
            Err(err) => {
                refused(&err.to_string());
                push.count(|s| s.registrations_refused += 1);
            }
        }
        return;
    }
    let written = match notify::parse(message, &NotificationLimits::default()) {
        Ok(VllmNotification::Done {
            request_id,
            consumers,
        }) => push
            .waits()
            .written(&note.sender, request_id, u64::from(consumers))
            .map_err(|why| format!("{why:?}")),
        Ok(VllmNotification::Heartbeat { .. }) => Ok(()),
        Err(err) => Err(err.to_string()),
    };
    if let Err(why) = written {
        refused(&why);
        push.count(|s| s.refused_ends += 1);
    }
}

/// Decode: registers `load`'s blocks with its prefill ranks and waits for their WRITEs,
/// then records the outcome (see the module's docs).
pub(crate) async fn load(shared: Arc<Shared>, push: &Push, load: Load) {
    let outcome = run_load(&shared, push, &load).await;
    push.waits().done(&load.request_id);
    push.load_ended();
    record(&shared, &load, None, outcome);
}

/// `load`'s registration: its own request id and engine, this rank's side channel, its
/// blocks per KV cache group, and the prefill's coordinates from its params.
fn registration(shared: &Shared, load: &Load) -> Result<PushRegistration> {
    const OP: &str = "register blocks for a vLLM push";
    let addr = connect::reachable_side_channel(shared, OP)?;
    let ids: Vec<u64> = load.local_block_ids.iter().map(|&b| b as u64).collect();
    let mut groups = Vec::with_capacity(load.local_group_lens.len().max(1));
    if load.local_group_lens.is_empty() {
        groups.push(ids);
    } else {
        let mut rest = &ids[..];
        for &len in &load.local_group_lens {
            let (group, after) = rest.split_at(len.min(rest.len()));
            groups.push(group.to_vec());
            rest = after;
        }
    }
    let remote = &load.remote;
    Ok(PushRegistration {
        request_id: load.request_id.clone(),
        decode_engine_id: shared.config.engine_id.clone(),
        decode_host: addr.ip().to_string(),
        decode_port: addr.port(),
        decode_tp_size: shared.config.tp_size as u64,
        local_block_ids: RegisteredBlocks::Groups(groups),
        remote_engine_id: remote.engine_id.clone(),
        remote_host: remote.host.clone(),
        remote_port: remote.port,
        remote_tp_size: remote.tp_size as u64,
        remote_pp_size: remote.pp_size as u64,
    })
}

async fn run_load(shared: &Arc<Shared>, push: &Push, load: &Load) -> Result<()> {
    const OP: &str = "register blocks for a vLLM push";
    // vLLM's decode waits for pp_size × max(1, prefill TP / decode TP) WRITEs: one from each
    // prefill rank of its TP mapping (with MLA too: a rank only notified in pull writes its
    // cut in push). A mapping of another count could not be told apart by vLLM's wire.
    let per_rank = (load.remote.tp_size / shared.config.tp_size.max(1)).max(1);
    if load.ranks.len() != per_rank * load.remote.pp_size {
        return Err(Error::invalid(
            OP,
            format!("request {:?}: {} prefill ranks to register with where vLLM's push counts {} WRITEs (vLLM's push protocol cannot count them); use pull mode", load.request_id, load.ranks.len(), per_rank * load.remote.pp_size),
        ));
    }
    let message = registration(shared, load)?.encode()?;
    let remotes = connect::remotes(shared, load.engine(), &load.ranks).await?;
    let agents: Vec<String> = remotes.iter().map(|r| r.agent.clone()).collect();
    let proof = WaitProof::VllmCount(load.remote.tp_size as u64);
    let woken = push.waits().wait(&load.request_id, &agents, proof);
    for agent in &agents {
        if let Err(err) = shared.setup.agent().send_notification(agent, &message) {
            shared.series.failed_notification();
            tracing::warn!(%agent, %err, "vLLM push registration not sent; the load times out");
        }
    }
    push.count(|s| s.registrations_sent += agents.len() as u64);
    shared.series.push_registrations(agents.len() as u64);

    let timeout = push.settings.registration_timeout;
    let mut deadline = tokio::time::Instant::now() + timeout;
    let mut stopped: Option<bool> = None;
    loop {
        let ends = push.waits().ends(&load.request_id);
        let now = tokio::time::Instant::now();
        let aborted = shared.outcomes.lock().is_aborted(&load.request_id);
        let timed_out = stopped.is_none() && now >= deadline;
        if ends.iter().all(|(_, end)| end.is_some()) || (stopped.is_some() && now >= deadline) {
            return outcome(load, &ends, stopped.filter(|&t| t).map(|_| timeout));
        }
        if stopped.is_none() && (aborted || timed_out) {
            if timed_out {
                push.count(|s| s.registration_timeouts += 1);
                shared.series.push_timeout();
                report_overdue(shared, load, timeout);
                push.silence(&load.remote.request_id, &load.request_id);
            }
            // vLLM's prefill has no cancel: a WRITE it started may still land. Its lease
            // ends without heartbeats; one more lease covers a WRITE posted before that.
            deadline = now + push.lease.saturating_mul(2);
            stopped = Some(timed_out);
            tracing::warn!(request = %load.request_id, grace = ?push.lease.saturating_mul(2), "vLLM push load stopped waiting; its blocks stay until a WRITE already under way can no longer land");
        }
        tokio::select! {
            () = woken.notified() => {}
            () = tokio::time::sleep_until(deadline) => {}
        }
    }
}

/// Prefill: `request_id` is held for a push of `blocks`; a registration that came first is
/// written now.
pub(crate) fn ready(shared: &Arc<Shared>, push: &Push, request_id: &str, blocks: HeldBlocks) {
    if let Some(write) = push.vllm_book().ready(request_id, blocks) {
        spawn_write(shared, write);
    }
}

fn spawn_write(shared: &Arc<Shared>, write: VllmWrite) {
    let shared = shared.clone();
    tokio::spawn(async move {
        if let Some(push) = &shared.push {
            self::write(&shared, push, write).await;
        }
    });
}

/// The decode rank this rank writes for `registration`, handshaken (its agent must be
/// `sender`), or why not.
async fn decode_rank(
    shared: &Arc<Shared>,
    registration: &PushRegistration,
    sender: &[u8],
) -> std::result::Result<Arc<Remote>, (PushEnd, Error)> {
    const OP: &str = "write a vLLM push registration";
    let refused = |why: String| (PushEnd::Refused, Error::invalid(OP, why));
    let own = &shared.config;
    if registration.remote_engine_id != own.engine_id {
        return Err(refused(format!(
            "it names prefill engine {:?}, this is {:?}",
            registration.remote_engine_id, own.engine_id
        )));
    }
    let stages = own.pipeline.as_ref().map_or(1, |p| p.stages().pp_size());
    if registration.remote_tp_size != own.tp_size as u64
        || registration.remote_pp_size != stages as u64
    {
        return Err(refused(format!(
            "it names a prefill of TP {} and {} stages, this is TP {} of {stages}",
            registration.remote_tp_size, registration.remote_pp_size, own.tp_size
        )));
    }
    let decode_tp = usize::try_from(registration.decode_tp_size).unwrap_or(usize::MAX);
    if decode_tp == 0 || decode_tp > own.tp_size || own.tp_size % decode_tp != 0 {
        return Err(refused(format!(
            "a decode of TP {decode_tp}: push writes a decode whose TP divides this prefill's ({}), as vLLM's push",
            own.tp_size
        )));
    }
    let rank = own.tp_rank / (own.tp_size / decode_tp);
    let engine = Engine {
        id: &registration.decode_engine_id,
        host: &registration.decode_host,
        tp_size: decode_tp,
        pp_size: 1,
    };
    let remote = connect::remote(shared, engine, rank, registration.decode_port)
        .await
        .map_err(|err| (PushEnd::Failed, err))?;
    if remote.agent.as_bytes() != sender {
        return Err(refused(format!(
            "the registration came from agent {:?}, but decode rank {rank} is agent {:?}",
            String::from_utf8_lossy(sender),
            remote.agent
        )));
    }
    Ok(remote)
}

/// The decode's registered blocks in token order and their count per KV cache group
/// (empty for one group).
fn decode_blocks(
    registration: &PushRegistration,
) -> std::result::Result<(Vec<usize>, Vec<usize>), (PushEnd, Error)> {
    let groups = registration.local_block_ids.groups();
    let mut ids = Vec::new();
    for &id in groups.iter().flatten() {
        ids.push(usize::try_from(id).map_err(|_| {
            (
                PushEnd::Refused,
                Error::invalid("write a vLLM push registration", format!("block id {id}")),
            )
        })?);
    }
    let lens = match groups.len() {
        1 => Vec::new(),
        _ => groups.iter().map(Vec::len).collect(),
    };
    Ok((ids, lens))
}

/// Prefill: WRITEs `write`'s held blocks into the decode blocks its registration names,
/// with vLLM's notification, and releases the request once NIXL has ended the WRITE (or
/// at once when it was refused after the decode rank was proven). A registration whose
/// decode rank cannot be handshaken or is not its sender leaves the request held for a
/// genuine one (its lease frees it), so that no agent can drop a request by naming it.
async fn write(shared: &Arc<Shared>, push: &Push, write: VllmWrite) {
    let VllmWrite {
        request_id,
        sender,
        registration,
        ready,
    } = write;
    let started = Instant::now();
    let not_done = |end: PushEnd, err: &Error| {
        let refused = end == PushEnd::Refused;
        let outcome = if refused { "refused" } else { "failed" };
        shared.series.push_write(outcome, started.elapsed());
        push.count(|s| match refused {
            true => s.registrations_oversized += 1,
            false => s.failed_writes += 1,
        });
        tracing::warn!(request = %request_id, decode = %registration.decode_engine_id, %err, outcome, "vLLM push WRITE not done; the decode's registration times out");
    };
    // Pinned from here: its lease cannot end it while the handshake runs.
    if !shared.sends.lock().start_writing(&request_id) {
        tracing::debug!(request = %request_id, "a vLLM push registration for a request no longer held");
        return;
    }
    let remote = match decode_rank(shared, &registration, &sender).await {
        Ok(remote) => remote,
        Err((end, err)) => {
            not_done(end, &err);
            // Nothing was posted: the request is the lease's again, and another
            // registration kept for it may write it.
            shared.sends.lock().stop_writing(&request_id);
            shared.sends.notify_arrived();
            let next = push.vllm_book().unstart(&request_id);
            if let Some(next) = next {
                spawn_write(shared, next);
            }
            return;
        }
    };
    let outcome = match decode_blocks(&registration) {
        Ok((ids, lens)) => {
            let notification = format!("{}:{}", registration.request_id, shared.config.tp_size);
            let inputs = WriteInputs {
                request_id: &request_id,
                decode: (&ids, &lens),
                decode_tp: usize::try_from(registration.decode_tp_size).unwrap_or(usize::MAX),
                ready: &ready,
                notification: notification.into_bytes(),
            };
            post_and_await(shared, inputs, &remote).await
        }
        Err(refused) => Err(refused),
    };
    match &outcome {
        Ok(bytes) => {
            shared.series.push_write("written", started.elapsed());
            push.count(|s| {
                s.writes += 1;
                s.bytes_written += *bytes as u64;
            });
            tracing::debug!(request = %request_id, bytes, took = ?started.elapsed(), "vLLM push WRITE ended");
        }
        Err((end, err)) => not_done(*end, err),
    }
    // NIXL has ended the WRITE (or none was posted): the blocks may go back.
    shared.sends.lock().written(&request_id);
    shared.sends.notify_arrived();
}

//! Push mode on a worker (native protocol): the decode registers its blocks with the
//! prefill ranks that write them, and the prefill WRITEs the request's KV into them.
//!
//! **Decode** (a load, [`load`]): the handshakes with the prefill ranks of the
//! [`TpMapping`](crate::TpMapping) (as a pull load's), one registration to each, then the
//! wait for each rank's end, an async wake-up, no polling. Past the registration timeout, or
//! once the request is aborted, each rank that has not ended gets a cancel; the load's
//! outcome, which hands its blocks back to the engine, waits for every rank's end, since
//! only the prefill knows whether a WRITE into them may still run.
//!
//! **Prefill** (on its notifications, [`route`]): a registration is matched to a request
//! held for push by its id and proven by its tag; its blocks are cut to the last as many as
//! the decode registered (a prefix hit on the decode), the rank handshakes with the decode
//! rank that registered (its agent must be the registration's sender), and WRITEs over the
//! same plan a READ of the other direction uses (`geometry::load_reads`, with this rank as
//! the reader of the decode's geometry, so the TP mapping is the pull mode's). The request
//! is released once NIXL has ended the WRITE, never by its lease while it runs.

use std::sync::Arc;
use std::time::Instant;

use nixl::{Notification, NotificationFilter};

use crate::config::Protocol;
use crate::error::{Error, Result};
use crate::transport::capability::Capability;
use crate::transport::push_wire::{
    cancel_message, end_message, fresh_nonce, parse_cancel, parse_end, parse_registration,
    registration_message, EndProof, PushEnd, Registration, SignedRegistration, CANCEL_PREFIX,
    END_PREFIX, PUSH_PREFIX, REGISTRATION_PREFIX,
};
use crate::worker::connect::{self, Engine};
use crate::worker::load::{record, report_overdue, Load};
use crate::worker::push_book::{HeldBlocks, PrefillAction, Ready, WaitProof};
use crate::worker::push_outcome::outcome;
use crate::worker::push_state::Push;
use crate::worker::push_write::{post_and_await, WriteInputs};
use crate::worker::shared::Shared;

/// The push part of `shared`, which push mode has.
fn part(shared: &Shared) -> Option<&Push> {
    shared.push.as_ref()
}

/// Subscribes the push notifications of `shared`'s agent now, before any other stream, so
/// that they go to it; [`take`] then takes them.
pub(crate) fn subscribe(shared: &Shared) -> Result<nixl::NotificationStream> {
    // vLLM's WRITE notifications have no prefix: in its protocol every one comes here.
    let filter = match shared.protocol {
        Protocol::Native => NotificationFilter::any().prefix(PUSH_PREFIX),
        Protocol::Vllm => NotificationFilter::any(),
    };
    Ok(shared.setup.agent().notification_stream(filter)?)
}

/// Takes push notifications from `stream` while the worker lives, and after it closes until
/// no load waits for its prefill's ends (a load's blocks go back only once every rank
/// answered, and its task keeps the registered caches until then).
pub(crate) async fn take(shared: Arc<Shared>, mut stream: nixl::NotificationStream) {
    let Some(push) = part(&shared) else {
        return;
    };
    while !push.closed() {
        tokio::select! {
            note = stream.recv() => route(&shared, note),
            () = push.changed() => {}
        }
    }
    push.stop_serving();
    tracing::debug!("push listener stopped: the worker is gone and no push load waits");
}

/// One push notification from the network.
fn route(shared: &Arc<Shared>, note: Notification) {
    let Some(push) = part(shared) else {
        return;
    };
    #[cfg(feature = "vllm")]
    if shared.protocol == Protocol::Vllm {
        crate::worker::push_vllm::route(shared, push, note);
        return;
    }
    let message = &note.message[..];
    let refused = |why: &str| {
        tracing::debug!(sender = %String::from_utf8_lossy(&note.sender), why, "push notification refused");
    };
    let prefill_side =
        message.starts_with(REGISTRATION_PREFIX) || message.starts_with(CANCEL_PREFIX);
    if prefill_side && push.closing() {
        refused("the worker is closing");
        return;
    }
    if message.starts_with(REGISTRATION_PREFIX) {
        match parse_registration(message) {
            Ok(signed) => {
                let actions = push.book().registration(&note.sender, signed);
                act(shared, actions);
            }
            Err(why) => {
                refused(why);
                push.count(|s| s.registrations_refused += 1);
            }
        }
    } else if message.starts_with(CANCEL_PREFIX) {
        match parse_cancel(message) {
            Ok(cancel) => {
                let actions = push.book().registration(&note.sender, cancel);
                act(shared, actions);
            }
            Err(why) => {
                refused(why);
                push.count(|s| s.registrations_refused += 1);
            }
        }
    } else if message.starts_with(END_PREFIX) {
        let counted = parse_end(message)
            .map_err(|why| why.to_string())
            .and_then(|end| {
                push.waits()
                    .ended(&note.sender, &end)
                    .map_err(|why| format!("{why:?}"))
            });
        if let Err(why) = counted {
            refused(&why);
            push.count(|s| s.refused_ends += 1);
        }
    } else {
        refused("an unknown push message");
        push.count(|s| s.refused_ends += 1);
    }
}

/// Carries out what the prefill book asks for.
fn act(shared: &Arc<Shared>, actions: Vec<PrefillAction>) {
    for action in actions {
        match action {
            PrefillAction::Write {
                request_id,
                sender,
                registration,
                ready,
            } => {
                let shared = shared.clone();
                tokio::spawn(async move {
                    write(&shared, &request_id, &sender, *registration, ready).await;
                });
            }
            PrefillAction::End {
                sender,
                registration,
                end,
                proof,
            } => {
                let shared = shared.clone();
                tokio::spawn(async move {
                    send_end(&shared, &sender, &registration, end, &proof).await;
                });
            }
            PrefillAction::Release { request_id } => {
                shared.sends.lock().release_unwritten(&request_id);
                shared.sends.notify_arrived();
            }
        }
    }
}

/// Prefill: `request_id` is held for a push of `blocks` under `capability`; registrations
/// that came first are matched now.
pub(crate) fn ready(
    shared: &Arc<Shared>,
    request_id: &str,
    blocks: HeldBlocks,
    capability: Capability,
) {
    let Some(push) = part(shared) else {
        return;
    };
    let actions = push.book().ready(request_id, blocks, capability);
    act(shared, actions);
}

/// The decode rank that sent `registration`, handshaken (its agent must be `sender`).
async fn decode_rank(
    shared: &Arc<Shared>,
    registration: &Registration,
    sender: &[u8],
) -> Result<Arc<crate::worker::remotes::Remote>> {
    let tp_size = usize::try_from(registration.tp_size).unwrap_or(usize::MAX);
    let rank = usize::try_from(registration.tp_rank).unwrap_or(usize::MAX);
    if tp_size == 0 || rank >= tp_size || tp_size > shared.config.tp_size {
        return Err(Error::invalid(
            "write a push registration",
            format!("decode rank {rank} of TP {tp_size}: push writes a decode of TP at most this prefill's ({}), as vLLM's push", shared.config.tp_size),
        ));
    }
    let engine = Engine {
        id: &registration.engine_id,
        host: &registration.host,
        tp_size,
        pp_size: 1,
    };
    let remote = connect::remote(shared, engine, rank, registration.port).await?;
    if remote.agent.as_bytes() != sender {
        return Err(Error::invalid(
            "write a push registration",
            format!(
                "the registration came from agent {:?}, but the decode rank it names is agent {:?}",
                String::from_utf8_lossy(sender),
                remote.agent
            ),
        ));
    }
    Ok(remote)
}

/// Sends `end` of `registration` to its decode rank `sender`, handshaking first if needed.
async fn send_end(
    shared: &Arc<Shared>,
    sender: &[u8],
    registration: &Registration,
    end: PushEnd,
    proof: &EndProof,
) {
    let agent = shared.setup.agent();
    let sent = match decode_rank(shared, registration, sender).await {
        Ok(remote) => {
            let message = end_message(&registration.decode_request_id, end, proof, agent.name());
            let sent = agent
                .send_notification(&remote.agent, &message)
                .map_err(Error::from);
            if let Err(err) = &sent {
                // Its connection may be dead: the decode's cancel, sent again, finds a new one.
                let rank = usize::try_from(registration.tp_rank).unwrap_or(usize::MAX);
                shared
                    .remotes
                    .transfer_failed(&registration.engine_id, rank, &remote, err);
            }
            sent
        }
        Err(err) => Err(err),
    };
    if let Err(err) = sent {
        shared.series.failed_notification();
        tracing::warn!(request = %registration.request_id, end = end.as_str(), %err, "could not tell a decode how its push registration ended");
    }
}

/// Prefill: WRITEs `ready`'s blocks into the decode blocks of `signed`, from decode rank
/// `sender`, and releases `request_id` once NIXL has ended the WRITE. The decode hears the
/// end: the WRITE's own notification, or `refused` / `failed` / `gone` alone.
async fn write(
    shared: &Arc<Shared>,
    request_id: &str,
    sender: &[u8],
    signed: SignedRegistration,
    ready: Ready,
) {
    let registration = signed.registration;
    let Some(push) = part(shared) else {
        return;
    };
    let proof = EndProof::Capability(ready.capability.clone());
    if !shared.sends.lock().start_writing(request_id) {
        send_end(shared, sender, &registration, PushEnd::Gone, &proof).await;
        return;
    }
    let started = Instant::now();
    let outcome = match decode_rank(shared, &registration, sender).await {
        Ok(remote) => {
            let decode_ids: Vec<usize> = registration
                .block_ids
                .iter()
                .map(|&b| usize::try_from(b).unwrap_or(usize::MAX))
                .collect();
            let decode_lens: Vec<usize> = registration
                .group_lens
                .iter()
                .map(|&n| usize::try_from(n).unwrap_or(usize::MAX))
                .collect();
            let notification = end_message(
                &registration.decode_request_id,
                PushEnd::Written,
                &EndProof::Capability(ready.capability.clone()),
                shared.setup.agent().name(),
            );
            let inputs = WriteInputs {
                request_id: &registration.request_id,
                decode: (&decode_ids, &decode_lens),
                decode_tp: usize::try_from(registration.tp_size).unwrap_or(usize::MAX),
                ready: &ready.blocks,
                notification,
            };
            post_and_await(shared, inputs, &remote).await
        }
        Err(err) => Err((PushEnd::Failed, err)),
    };
    let took = started.elapsed();
    match &outcome {
        Ok(_) => shared.series.push_write("written", took),
        Err((PushEnd::Refused, _)) => shared.series.push_write("refused", took),
        Err(_) => shared.series.push_write("failed", took),
    }
    match &outcome {
        Ok(bytes) => {
            push.count(|s| {
                s.writes += 1;
                s.bytes_written += *bytes as u64;
            });
            tracing::debug!(request = request_id, bytes, took = ?started.elapsed(), "push WRITE ended");
        }
        Err((end, err)) => {
            if *end == PushEnd::Refused {
                push.count(|s| s.registrations_oversized += 1);
            } else {
                push.count(|s| s.failed_writes += 1);
            }
            tracing::warn!(request = request_id, decode = %registration.engine_id, end = end.as_str(), %err, "push WRITE not done");
        }
    }
    // NIXL has ended the WRITE (or none was posted): the blocks may go back.
    shared.sends.lock().written(request_id);
    shared.sends.notify_arrived();
    if let Err((end, _)) = outcome {
        send_end(shared, sender, &registration, end, &proof).await;
    }
}

/// Decode: registers `load`'s blocks with its prefill ranks and waits for each one's end,
/// then records the outcome (see the module's docs).
pub(crate) async fn load(shared: Arc<Shared>, load: Load) {
    let outcome = run_load(&shared, &load).await;
    if let Some(push) = part(&shared) {
        push.waits().done(&load.request_id);
        push.load_ended();
    }
    record(&shared, &load, None, outcome);
}

/// Decode: `load` has no block (a full prefix hit): a cancel of no block tells the
/// prefill ranks to release the request now. A failure is logged; the prefill then
/// releases it when its lease ends.
pub(crate) async fn cancel_only(shared: Arc<Shared>, load: Load) {
    if let Err(err) = cancel_nothing(&shared, &load).await {
        tracing::warn!(request = %load.request_id, %err, "could not tell the prefill that nothing will be written; it frees the blocks when their lease ends");
    }
}

async fn cancel_nothing(shared: &Arc<Shared>, load: &Load) -> Result<()> {
    let (registration, capability, ranks) = registration_of(shared, load).await?;
    let message = cancel_message(&registration, &capability, shared.setup.agent().name());
    send_to(shared, load, &ranks, &message, "cancel");
    Ok(())
}

/// What `load` registers, under which capability, with which agents (its prefill ranks,
/// handshaken).
async fn registration_of(
    shared: &Arc<Shared>,
    load: &Load,
) -> Result<(Registration, Capability, Vec<Ranked>)> {
    const OP: &str = "register blocks for a push";
    let capability = load.remote.capability.clone().ok_or_else(|| {
        Error::invalid(OP, "the params carry no remote_capability: a native push needs one to prove the registration")
    })?;
    let addr = connect::reachable_side_channel(shared, OP)?;
    let remotes = connect::remotes(shared, load.engine(), &load.ranks).await?;
    let ranks = load.ranks.iter().map(|&(rank, _)| rank);
    let agents = ranks.zip(remotes).collect();
    let registration = Registration {
        request_id: load.remote.request_id.clone(),
        decode_request_id: load.request_id.clone(),
        engine_id: shared.config.engine_id.clone(),
        host: addr.ip().to_string(),
        port: addr.port(),
        tp_size: shared.config.tp_size as u64,
        tp_rank: shared.config.tp_rank as u64,
        block_ids: load.local_block_ids.iter().map(|&b| b as u64).collect(),
        group_lens: load.local_group_lens.iter().map(|&n| n as u64).collect(),
        nonce: String::new(),
    };
    Ok((registration, capability, agents))
}

async fn run_load(shared: &Arc<Shared>, load: &Load) -> Result<()> {
    let push = part(shared).ok_or(Error::invalid(
        "register blocks for a push",
        "the worker is not in push mode",
    ))?;
    let (registration, capability, ranks) = registration_of(shared, load).await?;
    let agents: Vec<String> = ranks.iter().map(|(_, r)| r.agent.clone()).collect();
    // Drawn now: once registered, the load must be able to cancel.
    let nonce = fresh_nonce()?;
    let woken = push.waits().wait(
        &load.request_id,
        &agents,
        WaitProof::Capability(capability.clone()),
    );
    let own = shared.setup.agent();
    let message = registration_message(&registration, &capability, own.name());
    send_to(shared, load, &ranks, &message, "registration");
    push.count(|s| s.registrations_sent += agents.len() as u64);
    shared.series.push_registrations(agents.len() as u64);
    // After a cancel, sent again this often to the ranks that have not answered (a send
    // lost with a connection, or its answer, would otherwise hold the blocks for good).
    let resend = push.settings.registration_timeout.min(CANCEL_RESEND);
    let mut cancel: Option<Vec<u8>> = None;

    let timeout = push.settings.registration_timeout;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut cancelled: Option<bool> = None;
    loop {
        let ends = push.waits().ends(&load.request_id);
        if ends.iter().all(|(_, end)| end.is_some()) {
            return outcome(load, &ends, cancelled.filter(|&t| t).map(|_| timeout));
        }
        let aborted = shared.outcomes.lock().is_aborted(&load.request_id);
        let timed_out = tokio::time::Instant::now() >= deadline;
        if cancelled.is_none() && (aborted || timed_out) {
            if timed_out {
                push.count(|s| s.registration_timeouts += 1);
                shared.series.push_timeout();
                report_overdue(shared, load, timeout);
            }
            let waiting: Vec<String> = ends
                .into_iter()
                .filter(|(_, end)| end.is_none())
                .map(|(agent, _)| agent)
                .collect();
            let mut cancelling = registration.clone();
            cancelling.nonce = nonce.clone();
            push.waits().cancelling(&load.request_id, &nonce);
            let message = cancel_message(&cancelling, &capability, own.name());
            let waiting: Vec<Ranked> = ranks
                .iter()
                .filter(|(_, r)| waiting.contains(&r.agent))
                .cloned()
                .collect();
            send_to(shared, load, &waiting, &message, "cancel");
            cancel = Some(message);
            cancelled = Some(timed_out);
        }
        let wait_until = match &cancelled {
            None => deadline,
            Some(_) => tokio::time::Instant::now() + resend,
        };
        tokio::select! {
            () = woken.notified() => continue,
            () = tokio::time::sleep_until(wait_until) => {}
        }
        if let Some(message) = &cancel {
            resend_cancel(shared, load, message).await;
        }
    }
}

/// How often a cancel is sent again, at most, to the prefill ranks that have not answered.
const CANCEL_RESEND: std::time::Duration = std::time::Duration::from_secs(2);

/// A prefill rank of a load: its rank (the key of its handshake) and the handshake.
type Ranked = (usize, Arc<crate::worker::remotes::Remote>);

/// Sends the cancel `message` of `load` again to its prefill ranks that have not answered,
/// handshaking again with those whose connection failed (a cancel the prefill already
/// answered is answered again, from its record of the requests it released).
async fn resend_cancel(shared: &Arc<Shared>, load: &Load, message: &[u8]) {
    let Some(push) = part(shared) else {
        return;
    };
    let waiting: Vec<String> = push
        .waits()
        .ends(&load.request_id)
        .into_iter()
        .filter(|(_, end)| end.is_none())
        .map(|(agent, _)| agent)
        .collect();
    if waiting.is_empty() {
        return;
    }
    let remotes = match connect::remotes(shared, load.engine(), &load.ranks).await {
        Ok(remotes) => remotes,
        Err(err) => {
            tracing::debug!(request = %load.request_id, %err, "a cancel waits to be sent again");
            return;
        }
    };
    let ranks = load.ranks.iter().map(|&(rank, _)| rank);
    let again: Vec<Ranked> = ranks
        .zip(remotes)
        .filter(|(_, r)| waiting.contains(&r.agent))
        .collect();
    send_to(shared, load, &again, message, "cancel (again)");
}

/// Sends `message` (a `what`) to each of `ranks` of `load`'s prefill; a failure is logged
/// and counted (the registration timeout then cancels), and the rank forgotten, so that the
/// next send handshakes with it again (a connection a reset ended stays dead in UCX).
fn send_to(shared: &Shared, load: &Load, ranks: &[Ranked], message: &[u8], what: &str) {
    for (rank, remote) in ranks {
        if let Err(err) = shared
            .setup
            .agent()
            .send_notification(&remote.agent, message)
        {
            shared.series.failed_notification();
            tracing::warn!(agent = %remote.agent, %err, "push {what} not sent");
            let err = Error::from(err);
            shared
                .remotes
                .transfer_failed(&load.remote.engine_id, *rank, remote, &err);
        }
    }
}

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
//! Every notification of a vLLM push worker comes here ([`route`]): `HB:` heartbeats go to
//! the held requests as in pull mode, `PUSH_REG:` to the prefill side, the rest are WRITE
//! notifications parsed strictly (no `:`, a count that is not a number: dropped and
//! counted).

use std::sync::Arc;

use futures::future::join_all;
use nixl::Notification;

use crate::error::{Error, Result};
use crate::vllm::notify::{self, NotificationLimits, VllmNotification, HEARTBEAT_PREFIX};
use crate::vllm::push_reg::{PushRegistration, RegisteredBlocks, PUSH_REG_PREFIX};
use crate::worker::connect;
use crate::worker::load::{record, report_overdue, Load};
use crate::worker::push_book::WaitProof;
use crate::worker::push_outcome::outcome;
use crate::worker::push_state::Push;
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
        refused("a registration: this crate's prefill does not take vLLM's push registrations yet");
        push.count(|s| s.registrations_refused += 1);
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
    let caches = shared
        .caches
        .get()
        .ok_or(Error::NotRegistered { operation: OP })?;
    let addr = caches.side_channel;
    if addr.ip().is_unspecified() {
        return Err(Error::invalid(OP, format!("this rank's vLLM side channel listens on {addr}: set WorkerConfig::side_channel to an address the prefill reaches, which the registration names")));
    }
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
    // prefill rank of its TP mapping. An MLA cache, where fewer ranks are read, is not
    // built.
    let per_rank = (load.remote.tp_size / shared.config.tp_size.max(1)).max(1);
    if load.ranks.len() != per_rank * load.remote.pp_size {
        return Err(Error::invalid(
            OP,
            format!("request {:?}: {} prefill ranks to register with where vLLM's push counts {} WRITEs (an MLA cache across TP sizes is not built in vLLM's push protocol); use pull mode", load.request_id, load.ranks.len(), per_rank * load.remote.pp_size),
        ));
    }
    let message = registration(shared, load)?.encode()?;
    let remotes = join_all(
        load.ranks
            .iter()
            .map(|&(rank, port)| connect::remote(shared, load.engine(), rank, port)),
    )
    .await
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
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

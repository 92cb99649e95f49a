//! The prefill's end of vLLM's side channel: one ROUTER per engine answering each
//! `[b"get_meta_msg", pp_rank, tp_rank]` with that rank's [`NixlHandshakePayload`] and the
//! engine's clock.
//!
//! Unlike vLLM's listener, a request for a rank this engine lacks, or one that does not
//! decode, is answered with an error reply (`{"error": reason}`, then the clock) and the
//! server goes on; a malformed frame closes only its own connection. Each connection runs
//! in its own task under the [`VllmChannelLimits`], so a slow or idle peer holds nothing
//! but its connection, and at the connection cap a new peer displaces the least recently
//! active one that is not being answered.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

use super::clock::perf_counter;
use super::limits::VllmChannelLimits;
use super::payload::{decode_request, encode_clock, encode_error, NixlHandshakePayload};
use super::zmtp::{Connection, SocketType};
use crate::error::{Error, Result};
use crate::transport::peer_networks::PeerNetworks;
use crate::transport::refusals::{refused, Refusal, RefusalCounts, Refusals};
use crate::transport::wire::within;

/// Most ranks an error reply lists.
const LISTED_RANKS: usize = 16;

/// A vLLM side-channel server (the prefill engine's ROUTER socket). Dropping it stops
/// the server and closes its connections.
///
/// # Thread safety
/// `Send` and `Sync`: payloads can be published from any thread while it serves.
pub struct MetadataServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl std::fmt::Debug for MetadataServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataServer")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

struct Shared {
    limits: VllmChannelLimits,
    state: Mutex<State>,
    /// The connections refused, by kind.
    refusals: Refusals,
}

#[derive(Default)]
struct State {
    /// The networks answered.
    peers: PeerNetworks,
    /// Encoded payloads by (pp_rank, tp_rank).
    payloads: BTreeMap<(u32, u32), Arc<[u8]>>,
    generation: u64,
    next_id: u64,
    connections: HashMap<u64, Slot>,
}

struct Slot {
    last_active: Instant,
    /// Between a complete request and the end of its reply.
    answering: bool,
    abort: AbortHandle,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mark(&self, id: u64, answering: bool) {
        if let Some(slot) = self.lock().connections.get_mut(&id) {
            slot.answering = answering;
            slot.last_active = Instant::now();
        }
    }
}

impl MetadataServer {
    /// Listens on `addr` (port 0: any free port) and serves until dropped. Publish each
    /// rank's payload with [`MetadataServer::publish`]; until then requests for it are
    /// answered with an error.
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound.
    pub async fn bind(addr: SocketAddr, limits: VllmChannelLimits) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|err| Error::io("bind the vLLM side channel", addr, err))?;
        Self::serve(listener, limits)
    }

    /// Listens on `addr` as [`bind`](Self::bind) does, without awaiting: for callers that
    /// are not async, inside a tokio runtime's context.
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound.
    pub fn bind_now(addr: SocketAddr, limits: VllmChannelLimits) -> Result<Self> {
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(TcpListener::from_std)
            .map_err(|err| Error::io("bind the vLLM side channel", addr, err))?;
        Self::serve(listener, limits)
    }

    /// Serves on `listener` until dropped.
    fn serve(listener: TcpListener, limits: VllmChannelLimits) -> Result<Self> {
        let local_addr = listener
            .local_addr()
            .map_err(|err| Error::io("bind the vLLM side channel", "its listener", err))?;
        let shared = Arc::new(Shared {
            limits,
            state: Mutex::new(State::default()),
            refusals: Refusals::labelled(vec![metrics::Label::new(
                "listener",
                local_addr.to_string(),
            )]),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        tracing::info!(%local_addr, "vLLM side channel listening");
        Ok(MetadataServer {
            local_addr,
            shared,
            accept,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves `payload` for rank (`pp_rank`, `tp_rank`) from now on. A payload that differs
    /// from the one served before (or is the first) starts a new registration generation,
    /// as vLLM's `set_xfer_handshake_metadata` does.
    pub fn publish(&self, pp_rank: u32, tp_rank: u32, payload: &NixlHandshakePayload) {
        let encoded: Arc<[u8]> = payload.encode().into();
        let mut state = self.shared.lock();
        if state.payloads.get(&(pp_rank, tp_rank)) != Some(&encoded) {
            state.generation += 1;
        }
        state.payloads.insert((pp_rank, tp_rank), encoded);
    }

    /// Stops serving rank (`pp_rank`, `tp_rank`) (e.g. its worker is gone): requests for it
    /// are answered with an error from now on.
    pub fn withdraw(&self, pp_rank: u32, tp_rank: u32) {
        self.shared.lock().payloads.remove(&(pp_rank, tp_rank));
    }

    /// How many times a rank's payload changed (vLLM's `remote_registration_generation`).
    pub fn registration_generation(&self) -> u64 {
        self.shared.lock().generation
    }

    /// Answers only peers in `peers` from now on (default: any): a connection from
    /// elsewhere is closed as it is accepted, before a byte is read or sent. vLLM's protocol
    /// has no credential, so this allowlist is its only guard (see the README's security
    /// section); warns when the server listens on a non-loopback address without one.
    pub fn set_allowed_peers(&self, peers: PeerNetworks) {
        crate::transport::peer_networks::warn_if_open(
            "the vLLM side channel",
            self.local_addr,
            false,
            &peers,
        );
        self.shared.lock().peers = peers;
    }

    /// Connections closed at accept because they came from outside the allowed networks.
    pub fn refused_networks(&self) -> u64 {
        self.shared.refusals.counts().network
    }

    /// The connections refused so far, by kind: from outside the allowed networks, or at
    /// the connection cap while every connection was being answered (each kind is logged
    /// at its 1st, 2nd, 4th, 8th... refusal only; the metric series carry the label
    /// `listener`).
    pub fn refusals(&self) -> RefusalCounts {
        self.shared.refusals.counts()
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.shared.lock().connections.len()
    }
}

impl Drop for MetadataServer {
    fn drop(&mut self) {
        self.accept.abort();
        let open: Vec<AbortHandle> = self
            .shared
            .lock()
            .connections
            .values()
            .map(|slot| slot.abort.clone())
            .collect();
        for abort in open {
            abort.abort();
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(%err, "vLLM side channel: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        admit(&shared, stream, peer);
    }
}

/// Starts serving a new connection, closing the least recently active idle one at the cap.
fn admit(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let mut state = shared.lock();
    if !state.peers.allows(peer.ip()) {
        refused!(shared.refusals, Refusal::Network, %peer, "vLLM side channel: a connection from outside the allowed peer networks closed");
        return;
    }
    let mut displaced = None;
    if state.connections.len() >= shared.limits.max_connections {
        let idlest = state
            .connections
            .iter()
            .filter(|(_, slot)| !slot.answering)
            .min_by_key(|(_, slot)| slot.last_active)
            .map(|(&id, _)| id);
        let Some(slot) = idlest.and_then(|id| state.connections.remove(&id)) else {
            refused!(shared.refusals, Refusal::Busy, %peer, max = shared.limits.max_connections, "vLLM side channel: every connection is being answered; new connection closed");
            return;
        };
        displaced = Some(slot.abort);
    }
    let id = state.next_id;
    state.next_id += 1;
    // The task's first use of the table comes after a network round trip, and waits for
    // this lock anyway: its slot is in place before it can look.
    let task = tokio::spawn(serve(shared.clone(), id, stream, peer));
    state.connections.insert(
        id,
        Slot {
            last_active: Instant::now(),
            answering: false,
            abort: task.abort_handle(),
        },
    );
    drop(state);
    if let Some(abort) = displaced {
        abort.abort();
        tracing::debug!(%peer, "vLLM side channel: at the connection cap; closed the least recently active idle connection");
    }
}

/// Removes a connection's slot when its task ends or is aborted.
struct SlotGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.shared.lock().connections.remove(&self.id);
    }
}

async fn serve(shared: Arc<Shared>, id: u64, stream: TcpStream, peer: SocketAddr) {
    let _slot = SlotGuard {
        shared: shared.clone(),
        id,
    };
    let limits = shared.limits;
    let name = peer.to_string();
    let _ = stream.set_nodelay(true);
    let handshake = Connection::handshake(
        stream,
        name.clone(),
        SocketType::Router,
        &[SocketType::Req, SocketType::Dealer, SocketType::Router],
    );
    let mut conn = match within("ZMTP handshake", &name, limits.deadline, handshake).await {
        Ok(conn) => conn,
        Err(err) => {
            tracing::debug!(%err, "vLLM side channel: handshake failed");
            return;
        }
    };
    shared.mark(id, false);
    loop {
        let request = match within(
            "wait for a request",
            &name,
            limits.idle,
            conn.recv(&[limits.max_request]),
        )
        .await
        {
            Ok(parts) => parts,
            Err(Error::Closed { .. }) => return,
            Err(err) => {
                tracing::debug!(%err, "vLLM side channel: connection closed");
                return;
            }
        };
        shared.mark(id, true);
        let reply = answer(&shared, &request);
        let clock = encode_clock(perf_counter());
        let sent = within(
            "answer a request",
            &name,
            limits.deadline,
            conn.send(&[&reply[..], &clock]),
        )
        .await;
        if let Err(err) = sent {
            tracing::debug!(%err, "vLLM side channel: reply not sent");
            return;
        }
        shared.mark(id, false);
    }
}

/// The first reply frame for a request: the rank's payload, or an error.
fn answer(shared: &Shared, request: &[Vec<u8>]) -> Arc<[u8]> {
    let (pp_rank, tp_rank) = match request {
        [body] => match decode_request(body) {
            Ok(ranks) => ranks,
            Err(reason) => return encode_error(&reason).into(),
        },
        _ => {
            return encode_error(&format!(
                "a request of {} frames; vLLM's has one",
                request.len()
            ))
            .into()
        }
    };
    let state = shared.lock();
    let found = u32::try_from(pp_rank)
        .ok()
        .zip(u32::try_from(tp_rank).ok())
        .and_then(|key| state.payloads.get(&key));
    if let Some(payload) = found {
        return payload.clone();
    }
    let served: Vec<String> = state
        .payloads
        .keys()
        .take(LISTED_RANKS)
        .map(|(pp, tp)| format!("({pp}, {tp})"))
        .collect();
    let more = state.payloads.len().saturating_sub(LISTED_RANKS);
    let reason =
        format!(
        "this engine has no pp_rank {pp_rank} tp_rank {tp_rank}; it serves (pp_rank, tp_rank) {}{}",
        if served.is_empty() { "none yet".into() } else { served.join(", ") },
        if more > 0 { format!(" and {more} more") } else { String::new() }
    );
    encode_error(&reason).into()
}

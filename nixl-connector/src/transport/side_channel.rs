//! The side channel: a TCP server that answers handshakes, and the client that asks them.
//!
//! One exchange: the reader sends its [`HandshakeMessage`]; the server checks that the
//! reader can read its cache ([`check_compatible`]) and answers with its own message or a
//! refusal with the reason. Both sides check. Every exchange runs under one total deadline,
//! frames are capped, and a server runs at most [`ChannelLimits::max_sessions`] handshakes
//! at once ([`PendingHandshakes`]): when all are taken, the oldest is closed with a "busy"
//! answer to make room for the newest, and the client retries a busy answer with backoff
//! within its deadline, so connections held open without a word cannot lock readers out.
//!
//! With a [`SharedSecret`] both sides authenticate each other before any metadata leaves,
//! and the metadata travels sealed (see [`auth`](crate::auth)): the reader opens with a
//! nonce and the exchange's version instead of its message, the server answers with its
//! own, the reader sends its message sealed under the exchange's reader key, and only once
//! that opens does the server answer, its message (or refusal) sealed under its own key. A
//! relay between the two sees sealed bytes only, and a byte it changes makes the exchange
//! fail. A server with a secret answers a reader without one with an
//! [`Error::Unauthenticated`] refusal and nothing else, and a reader of another version of
//! the exchange with a refusal naming both. Every refusal is counted by kind and logged at
//! the 1st, 2nd, 4th, 8th... of its kind ([`Refusal`]). Connections from outside the
//! allowed [`PeerNetworks`] are closed as they are accepted.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::transport::auth::{nonce, Nonce, SharedSecret, NONCE_BYTES};
use crate::transport::handshake::{check_compatible, HandshakeMessage, KeptClaim};
use crate::transport::peer_networks::PeerNetworks;
use crate::transport::pending::{PendingHandshakes, PendingSlot};
use crate::transport::readers::{Reader, Readers};
use crate::transport::refusals::{refused, Refusal, Refusals};
use crate::transport::sealing::{Role, SessionKeys, SIDE_CHANNEL_AUTH_VERSION};
use crate::transport::wire::{within, Channel, ChannelLimits};

/// How long a new connection waits for the place of the handshake evicted for it; past it,
/// the new connection is the one told the server is busy.
pub const EVICTION_GRACE: Duration = Duration::from_secs(1);

/// The first pause before trying again after a busy answer or (etcd) metadata not yet
/// there (see [`RetryBackoff`]).
pub const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(10);

/// The longest pause between tries (see [`RetryBackoff`]).
pub const MAX_RETRY_PAUSE: Duration = Duration::from_millis(320);

/// What a reader sends.
#[derive(Debug, Serialize, Deserialize)]
enum Request {
    /// The reader's own handshake, for the server's check (no shared secret).
    Handshake(Box<HandshakeMessage>),
    /// The opening of an authenticated exchange: the reader's nonce and version of the
    /// exchange.
    Hello {
        /// The reader's fresh nonce.
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        /// The reader's [`SIDE_CHANNEL_AUTH_VERSION`] (absent, 0, from a reader of
        /// version 1).
        #[serde(default)]
        version: u32,
    },
    /// The reader's handshake in an authenticated exchange, answering a
    /// [`Response::Challenge`].
    Proof {
        /// The reader's [`HandshakeMessage`], encoded and sealed under the exchange's
        /// reader key.
        #[serde(with = "serde_bytes")]
        sealed: Vec<u8>,
    },
}

/// What a server answers.
#[derive(Debug, Serialize, Deserialize)]
enum Response {
    /// The server's handshake.
    Accepted(Box<HandshakeMessage>),
    /// Why the server refuses the reader.
    Refused {
        /// A message for a person.
        reason: String,
    },
    /// The server has no room for this handshake now; try again shortly.
    Busy {
        /// A message for a person.
        reason: String,
    },
    /// The server's nonce and version of the exchange, answering a [`Request::Hello`].
    Challenge {
        /// The server's fresh nonce.
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        /// The server's [`SIDE_CHANNEL_AUTH_VERSION`] (absent, 0, from a server of
        /// version 1).
        #[serde(default)]
        version: u32,
    },
    /// The server's answer in an authenticated exchange, once the reader's proof opened.
    Proven {
        /// A [`Sealed`] answer, encoded and sealed under the exchange's server key.
        #[serde(with = "serde_bytes")]
        sealed: Vec<u8>,
    },
    /// The reader did not prove the shared secret (or the server has none, and was asked to
    /// prove one).
    Unauthenticated {
        /// A message for a person.
        reason: String,
    },
}

/// What a server's [`Response::Proven`] holds.
#[derive(Debug, Serialize, Deserialize)]
enum Sealed {
    /// The server's handshake.
    Accepted(Box<HandshakeMessage>),
    /// Why the server refuses the (authenticated) reader.
    Refused {
        /// A message for a person.
        reason: String,
    },
}

/// Most claims on kept requests one handshake may make; past them the rest go unanswered
/// (gone, to the reader).
pub(crate) const MAX_CLAIMS: usize = 1024;

/// What answers readers' claims on requests kept for a read-back: the worker's held
/// requests.
pub(crate) trait KeptRequests: Send + Sync {
    /// Claims for agent `reader` each of `claims` still held, whose tag is of its request's
    /// capability; the ids claimed.
    fn claim(&self, reader: &[u8], claims: &[KeptClaim]) -> Vec<String>;
}

/// The worker's [`KeptRequests`], set once the worker's parts exist.
#[derive(Default)]
pub(crate) struct KeptHook(std::sync::OnceLock<Arc<dyn KeptRequests>>);

impl KeptHook {
    /// Sets what answers claims (once).
    pub(crate) fn set(&self, kept: Arc<dyn KeptRequests>) {
        let _ = self.0.set(kept);
    }

    /// The ids of `claims` that `reader` now holds (none before the worker set its hook).
    fn claim(&self, reader: &str, claims: &[KeptClaim]) -> Vec<String> {
        match self.0.get() {
            Some(kept) if !claims.is_empty() => {
                kept.claim(reader.as_bytes(), &claims[..claims.len().min(MAX_CLAIMS)])
            }
            _ => Vec::new(),
        }
    }
}

impl std::fmt::Debug for KeptHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeptHook")
    }
}

/// What a side-channel server checks of its peers, besides their handshakes: the shared
/// secret, the networks it answers, and where it notes the readers it accepted.
#[derive(Debug, Default)]
pub(crate) struct Guard {
    /// The secret readers must prove (`None`: readers are not authenticated).
    pub(crate) secret: Option<SharedSecret>,
    /// The networks answered.
    pub(crate) peers: PeerNetworks,
    /// The readers accepted.
    pub(crate) readers: std::sync::Arc<Readers>,
    /// The connections refused, by kind.
    pub(crate) refusals: Refusals,
    /// What answers readers' claims on kept requests.
    pub(crate) kept: KeptHook,
}

/// Accepts connections on `listener` and answers each with the message `ours` holds when it
/// is accepted (closing it at once while `ours` holds none: the KV caches are being
/// registered again), `pending` holding the places of the handshakes under way, until
/// aborted.
pub(crate) fn serve(
    listener: TcpListener,
    ours: tokio::sync::watch::Receiver<Option<Arc<HandshakeMessage>>>,
    limits: ChannelLimits,
    pending: Arc<PendingHandshakes>,
    guard: Arc<Guard>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(err) => {
                    tracing::warn!(%err, "side channel: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if !guard.peers.allows(peer.ip()) {
                refused!(guard.refusals, Refusal::Network, %peer, "side channel: a connection from outside the allowed peer networks closed");
                drop(stream);
                continue;
            }
            let Some(message) = ours.borrow().clone() else {
                tracing::debug!(%peer, "side channel: the KV caches are being registered again; connection closed");
                drop(stream);
                continue;
            };
            let Some(slot) = pending.admit(EVICTION_GRACE).await else {
                refused!(guard.refusals, Refusal::Busy, %peer, max = limits.max_sessions, "side channel: no handshake place came free; connection refused as busy");
                let reason = format!(
                    "{} handshakes are under way, the most this side channel runs at once",
                    limits.max_sessions
                );
                answer_busy(
                    &mut Channel::new(stream, peer.to_string(), limits.max_frame),
                    reason,
                );
                continue;
            };
            let ours = message;
            let guard = guard.clone();
            tokio::spawn(async move {
                let peer_name = peer.to_string();
                let outcome = within(
                    "answer a handshake",
                    &peer_name,
                    limits.deadline,
                    answer(stream, peer, &ours, limits, &slot, &guard),
                )
                .await;
                if let Err(err) = outcome {
                    let kind = match err {
                        Error::Deadline { .. } => Refusal::Deadline,
                        _ => Refusal::Malformed,
                    };
                    refused!(guard.refusals, kind, %err, "side channel: handshake failed");
                }
                drop(slot);
            });
        }
    })
}

/// Tells the peer on a fresh connection that the server is busy, if its socket takes the
/// frame at once (it does: nothing was sent on it before); nothing waits on the peer.
fn answer_busy(channel: &mut Channel, reason: String) {
    let _ = channel.send(&Response::Busy { reason }).now_or_never();
}

async fn answer(
    stream: TcpStream,
    peer: SocketAddr,
    ours: &HandshakeMessage,
    limits: ChannelLimits,
    slot: &PendingSlot,
    guard: &Guard,
) -> Result<()> {
    let mut channel = Channel::new(stream, peer.to_string(), limits.max_frame);
    let evicted = slot.evicted();
    // Once part of our answer may be out, a busy frame after it would garble the stream.
    let answering = AtomicBool::new(false);
    let exchange = async {
        let response = match (channel.recv().await?, &guard.secret) {
            (Request::Handshake(theirs), None) => check(peer, &theirs, ours, guard)
                .map(|answer| Response::Accepted(Box::new(answer)))
                .unwrap_or_else(|reason| Response::Refused { reason }),
            (Request::Hello { nonce, version }, Some(secret)) => {
                if version != SIDE_CHANNEL_AUTH_VERSION {
                    refused!(guard.refusals, Refusal::Version, %peer, version, "side channel: a reader of another version of the authenticated exchange refused");
                    Response::Refused {
                        reason: format!(
                            "the reader speaks version {version} of the authenticated side channel, this engine {SIDE_CHANNEL_AUTH_VERSION}; run the same connector version on both engines"
                        ),
                    }
                } else {
                    let reader = nonce_of(&channel, &nonce)?;
                    prove(&mut channel, peer, ours, guard, secret, reader).await?
                }
            }
            (Request::Handshake(_) | Request::Proof { .. }, Some(_)) => {
                refused!(guard.refusals, Refusal::Unauthenticated, %peer, "side channel: a reader without the shared secret refused");
                Response::Unauthenticated {
                    reason: "this side channel requires the shared secret; configure the same secret on both engines".into(),
                }
            }
            (Request::Hello { .. } | Request::Proof { .. }, None) => {
                refused!(guard.refusals, Refusal::Unauthenticated, %peer, "side channel: a reader asked for authentication, which this side channel has no secret for");
                Response::Unauthenticated {
                    reason: "this side channel has no shared secret; configure the same secret on both engines".into(),
                }
            }
        };
        answering.store(true, Ordering::Relaxed);
        channel.send(&response).await
    };
    tokio::select! {
        done = exchange => done,
        () = evicted => {
            refused!(guard.refusals, Refusal::Busy, %peer, max = limits.max_sessions, "side channel: closed the oldest handshake under way to make room for a newer one");
            let reason = format!(
                "this handshake was the oldest of the {} under way, the most this side channel runs at once, and was closed for a newer one",
                limits.max_sessions
            );
            if !answering.load(Ordering::Relaxed) {
                answer_busy(&mut channel, reason);
            }
            Ok(())
        }
    }
}

/// The rest of an authenticated exchange that opened with the reader's nonce `reader`: the
/// server's challenge, the reader's sealed proof, and the answer to send, sealed when the
/// proof opened.
async fn prove(
    channel: &mut Channel,
    peer: SocketAddr,
    ours: &HandshakeMessage,
    guard: &Guard,
    secret: &SharedSecret,
    reader: Nonce,
) -> Result<Response> {
    let server = nonce()?;
    channel
        .send(&Response::Challenge {
            nonce: server.to_vec(),
            version: SIDE_CHANNEL_AUTH_VERSION,
        })
        .await?;
    let Request::Proof { sealed } = channel.recv().await? else {
        return Err(channel.protocol("the reader sent no proof after the challenge".into()));
    };
    let keys = SessionKeys::derive(secret, &reader, &server);
    let Some(message) = keys.open(Role::Reader, &sealed) else {
        refused!(guard.refusals, Refusal::Unauthenticated, %peer, "side channel: a reader without the shared secret refused");
        return Ok(Response::Unauthenticated {
            reason: "the reader did not prove the shared secret; configure the same secret on both engines".into(),
        });
    };
    let theirs: HandshakeMessage = decode(channel, &message)?;
    let answer = match check(peer, &theirs, ours, guard) {
        Ok(answer) => Sealed::Accepted(Box::new(answer)),
        Err(reason) => Sealed::Refused { reason },
    };
    let answer = encode(channel, &answer)?;
    Ok(Response::Proven {
        sealed: keys.seal(Role::Server, &answer),
    })
}

/// Checks a reader's message, and notes the reader when it is accepted, answering its claims
/// on kept requests: our message to send back, or the reason it is refused.
fn check(
    peer: SocketAddr,
    theirs: &HandshakeMessage,
    ours: &HandshakeMessage,
    guard: &Guard,
) -> std::result::Result<HandshakeMessage, String> {
    match check_compatible(theirs, ours, None, None) {
        Ok(_) => {
            tracing::info!(%peer, engine = %theirs.engine_id, rank = theirs.tp_rank, "side channel: handshake accepted");
            let reader = Reader {
                engine_id: theirs.engine_id.clone(),
                tp_size: usize::try_from(theirs.tp_size).unwrap_or(usize::MAX),
                // Checked: at most MAX_PP_SIZE.
                pp_size: theirs.pp_partition.len().max(1),
                // Checked: 1 to MAX_DCP_SIZE.
                dcp_size: usize::try_from(theirs.dcp_size).unwrap_or(1),
            };
            guard.readers.accept(&theirs.agent_name, reader);
            Ok(HandshakeMessage {
                claimed: guard.kept.claim(&theirs.agent_name, &theirs.claims),
                ..ours.clone()
            })
        }
        Err(err) => {
            refused!(guard.refusals, Refusal::Incompatible, %peer, %err, "side channel: handshake refused");
            Err(err.to_string())
        }
    }
}

/// A peer's nonce, checked for its length.
fn nonce_of(channel: &Channel, bytes: &[u8]) -> Result<Nonce> {
    bytes.try_into().map_err(|_| {
        channel.protocol(format!(
            "a nonce of {} bytes, not {NONCE_BYTES}",
            bytes.len()
        ))
    })
}

/// `message` (a handshake, or a server's answer) as MessagePack, as it is sealed and sent.
fn encode<T: Serialize>(channel: &Channel, message: &T) -> Result<Vec<u8>> {
    rmp_serde::to_vec_named(message)
        .map_err(|err| channel.protocol(format!("cannot encode a sealed message: {err}")))
}

/// The message in the (authenticated) bytes `message`.
fn decode<T: serde::de::DeserializeOwned>(channel: &Channel, message: &[u8]) -> Result<T> {
    rmp_serde::from_slice(message).map_err(|err| {
        channel.protocol(format!(
            "undecodable sealed message of {} bytes: {err}",
            message.len()
        ))
    })
}

/// Connects to `addr`, sends `ours` and returns the server's handshake, all within
/// `limits.deadline`. A server that answers it is busy is asked again after a pause
/// ([`RetryBackoff`]) while the deadline allows. Unauthenticated: see
/// [`fetch_handshake_with`].
///
/// # Errors
/// As [`fetch_handshake_with`].
pub async fn fetch_handshake(
    addr: SocketAddr,
    ours: &HandshakeMessage,
    limits: ChannelLimits,
) -> Result<HandshakeMessage> {
    fetch_handshake_with(addr, ours, limits, None).await
}

/// As [`fetch_handshake`], authenticating both sides with `secret` when one is given (both
/// messages travel sealed under the exchange's keys, and the server's is returned only once
/// it opened).
///
/// # Errors
/// [`Error::Busy`] when the server was still busy at the deadline; [`Error::Deadline`],
/// [`Error::Io`], [`Error::Protocol`], [`Error::Refused`] with the server's reason, or
/// [`Error::Unauthenticated`] when either side did not prove the secret.
pub async fn fetch_handshake_with(
    addr: SocketAddr,
    ours: &HandshakeMessage,
    limits: ChannelLimits,
    secret: Option<&SharedSecret>,
) -> Result<HandshakeMessage> {
    let peer = addr.to_string();
    let mut busy = None;
    let mut tries = 0;
    let retried = tokio::time::timeout(limits.deadline, async {
        let mut backoff = RetryBackoff::default();
        loop {
            tries += 1;
            match ask(addr, &peer, ours, limits, secret).await? {
                Ok(theirs) => return Ok(theirs),
                Err(reason) => {
                    tracing::debug!(%peer, %reason, tries, "side channel: the server is busy; trying again");
                    busy = Some(reason);
                }
            }
            tokio::time::sleep(backoff.next_pause()).await;
        }
    })
    .await;
    let Ok(outcome) = retried else {
        return Err(match busy {
            Some(reason) => Error::Busy {
                peer,
                reason,
                tries,
                deadline: limits.deadline,
            },
            None => Error::Deadline {
                operation: "handshake",
                peer,
                deadline: limits.deadline,
            },
        });
    };
    outcome
}

/// One try: connect, send `ours` (with its proof, after the server's challenge, when
/// there is a `secret`), read the answer: the server's handshake, or why it was busy.
async fn ask(
    addr: SocketAddr,
    peer: &str,
    ours: &HandshakeMessage,
    limits: ChannelLimits,
    secret: Option<&SharedSecret>,
) -> Result<std::result::Result<HandshakeMessage, String>> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|err| Error::io("connect to the side channel", addr, err))?;
    let mut channel = Channel::new(stream, peer.to_string(), limits.max_frame);
    let Some(secret) = secret else {
        channel
            .send(&Request::Handshake(Box::new(ours.clone())))
            .await?;
        return match channel.recv().await? {
            Response::Accepted(theirs) => Ok(Ok(*theirs)),
            other => answer_of(&channel, other),
        };
    };
    let reader = nonce()?;
    channel
        .send(&Request::Hello {
            nonce: reader.to_vec(),
            version: SIDE_CHANNEL_AUTH_VERSION,
        })
        .await?;
    let server = match channel.recv().await? {
        Response::Challenge { nonce, version } if version == SIDE_CHANNEL_AUTH_VERSION => {
            nonce_of(&channel, &nonce)?
        }
        Response::Challenge { version, .. } => {
            return Err(Error::Refused {
                peer: peer.to_string(),
                reason: format!(
                    "the server speaks version {version} of the authenticated side channel, this engine {SIDE_CHANNEL_AUTH_VERSION}; run the same connector version on both engines"
                ),
            })
        }
        other => return answer_of(&channel, other),
    };
    let keys = SessionKeys::derive(secret, &reader, &server);
    let message = encode(&channel, ours)?;
    channel
        .send(&Request::Proof {
            sealed: keys.seal(Role::Reader, &message),
        })
        .await?;
    match channel.recv().await? {
        Response::Proven { sealed } => {
            let Some(answer) = keys.open(Role::Server, &sealed) else {
                return Err(Error::Unauthenticated {
                    peer: peer.to_string(),
                    reason: "the server's answer did not open under the exchange's key: it does not hold the shared secret, or the answer was changed on the way; configure the same secret on both engines".into(),
                });
            };
            match decode(&channel, &answer)? {
                Sealed::Accepted(theirs) => Ok(Ok(*theirs)),
                Sealed::Refused { reason } => Err(Error::Refused {
                    peer: peer.to_string(),
                    reason,
                }),
            }
        }
        other => answer_of(&channel, other),
    }
}

/// What a server's answer other than the one expected means: busy (`Ok(Err(reason))`), a
/// refusal, or a protocol error.
fn answer_of(
    channel: &Channel,
    response: Response,
) -> Result<std::result::Result<HandshakeMessage, String>> {
    let peer = channel.peer().to_string();
    match response {
        Response::Busy { reason } => Ok(Err(reason)),
        Response::Refused { reason } => Err(Error::Refused { peer, reason }),
        Response::Unauthenticated { reason } => Err(Error::Unauthenticated { peer, reason }),
        Response::Accepted(_) => Err(channel.protocol(
            "the server answered without authenticating; it has no shared secret, and this side requires one".into(),
        )),
        Response::Challenge { .. } | Response::Proven { .. } => {
            Err(channel.protocol("an answer out of the exchange's order".into()))
        }
    }
}

/// The pauses of a client between tries, after a server turned it away as busy (or etcd
/// did not have the metadata yet): from
/// [`FIRST_RETRY_PAUSE`], doubling up to [`MAX_RETRY_PAUSE`], each with up to half of it
/// added at random, so that clients turned away together spread out.
#[derive(Debug, Clone, Copy)]
pub struct RetryBackoff {
    pause: Duration,
}

impl Default for RetryBackoff {
    fn default() -> Self {
        RetryBackoff {
            pause: FIRST_RETRY_PAUSE,
        }
    }
}

impl RetryBackoff {
    /// The pause before the next try.
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.pause;
        self.pause = (pause * 2).min(MAX_RETRY_PAUSE);
        let random = RandomState::new().build_hasher().finish();
        let half = u64::try_from(pause.as_nanos() / 2).unwrap_or(u64::MAX);
        pause + Duration::from_nanos(random % half.max(1))
    }
}

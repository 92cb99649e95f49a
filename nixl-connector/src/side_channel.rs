//! The side channel: a TCP server that answers handshakes, and the client that asks them.
//!
//! One exchange: the reader sends its [`HandshakeMessage`]; the server checks that the
//! reader can read its cache ([`check_compatible`]) and answers with its own message or a
//! refusal with the reason. Both sides check. Every exchange runs under one total deadline,
//! frames are capped, and a server runs at most [`ChannelLimits::max_sessions`] handshakes
//! at once ([`PendingHandshakes`]): when all are taken, the oldest is closed with a "busy"
//! answer to make room for the newest, and the client retries a busy answer with backoff
//! within its deadline, so connections held open without a word cannot lock readers out.

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
use crate::handshake::{check_compatible, HandshakeMessage};
use crate::pending::{PendingHandshakes, PendingSlot};
use crate::wire::{within, Channel, ChannelLimits};

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
    /// The reader's own handshake, for the server's check.
    Handshake(Box<HandshakeMessage>),
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
}

/// Accepts connections on `listener` and answers each with `ours`, `pending` holding the
/// places of the handshakes under way, until aborted.
pub(crate) fn serve(
    listener: TcpListener,
    ours: Arc<HandshakeMessage>,
    limits: ChannelLimits,
    pending: Arc<PendingHandshakes>,
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
            let Some(slot) = pending.admit(EVICTION_GRACE).await else {
                tracing::warn!(%peer, max = limits.max_sessions, "side channel: no handshake place came free; connection refused as busy");
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
            let ours = ours.clone();
            tokio::spawn(async move {
                let peer_name = peer.to_string();
                let outcome = within(
                    "answer a handshake",
                    &peer_name,
                    limits.deadline,
                    answer(stream, peer, &ours, limits, &slot),
                )
                .await;
                if let Err(err) = outcome {
                    tracing::warn!(%err, "side channel: handshake failed");
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
) -> Result<()> {
    let mut channel = Channel::new(stream, peer.to_string(), limits.max_frame);
    let evicted = slot.evicted();
    // Once part of our answer may be out, a busy frame after it would garble the stream.
    let answering = AtomicBool::new(false);
    let exchange = async {
        let Request::Handshake(theirs) = channel.recv().await?;
        let response = match check_compatible(&theirs, ours, None, None) {
            Ok(_) => {
                tracing::info!(%peer, engine = %theirs.engine_id, rank = theirs.tp_rank, "side channel: handshake accepted");
                Response::Accepted(Box::new(ours.clone()))
            }
            Err(err) => {
                tracing::warn!(%peer, %err, "side channel: handshake refused");
                Response::Refused {
                    reason: err.to_string(),
                }
            }
        };
        answering.store(true, Ordering::Relaxed);
        channel.send(&response).await
    };
    tokio::select! {
        done = exchange => done,
        () = evicted => {
            tracing::warn!(%peer, max = limits.max_sessions, "side channel: closed the oldest handshake under way to make room for a newer one");
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

/// Connects to `addr`, sends `ours` and returns the server's handshake, all within
/// `limits.deadline`. A server that answers it is busy is asked again after a pause
/// ([`RetryBackoff`]) while the deadline allows.
///
/// # Errors
/// [`Error::Busy`] when the server was still busy at the deadline; [`Error::Deadline`],
/// [`Error::Io`], [`Error::Protocol`], or [`Error::Refused`] with the server's reason.
pub async fn fetch_handshake(
    addr: SocketAddr,
    ours: &HandshakeMessage,
    limits: ChannelLimits,
) -> Result<HandshakeMessage> {
    let peer = addr.to_string();
    let mut busy = None;
    let mut tries = 0;
    let retried = tokio::time::timeout(limits.deadline, async {
        let mut backoff = RetryBackoff::default();
        loop {
            tries += 1;
            match ask(addr, &peer, ours, limits).await? {
                Response::Accepted(theirs) => return Ok(*theirs),
                Response::Refused { reason } => {
                    return Err(Error::Refused {
                        peer: peer.clone(),
                        reason,
                    })
                }
                Response::Busy { reason } => {
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

/// One try: connect, send `ours`, read the answer.
async fn ask(
    addr: SocketAddr,
    peer: &str,
    ours: &HandshakeMessage,
    limits: ChannelLimits,
) -> Result<Response> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|err| Error::io("connect to the side channel", addr, err))?;
    let mut channel = Channel::new(stream, peer.to_string(), limits.max_frame);
    channel
        .send(&Request::Handshake(Box::new(ours.clone())))
        .await?;
    channel.recv().await
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

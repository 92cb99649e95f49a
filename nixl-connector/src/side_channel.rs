//! The side channel: a TCP server that answers handshakes, and the client that asks them.
//!
//! One exchange: the reader sends its [`HandshakeMessage`]; the server checks that the
//! reader can read its cache ([`check_compatible`]) and answers with its own message or a
//! refusal with the reason. Both sides check. Every exchange runs under one total deadline,
//! frames are capped, and a server runs at most [`ChannelLimits::max_sessions`] at once.

use std::net::SocketAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::handshake::{check_compatible, HandshakeMessage};
use crate::wire::{within, Channel, ChannelLimits};

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
}

/// Accepts connections on `listener` and answers each with `ours`, until aborted.
pub(crate) fn serve(
    listener: TcpListener,
    ours: Arc<HandshakeMessage>,
    limits: ChannelLimits,
) -> JoinHandle<()> {
    let sessions = Arc::new(Semaphore::new(limits.max_sessions));
    tokio::spawn(async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(err) => {
                    tracing::warn!(%err, "side channel: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = sessions.clone().try_acquire_owned() else {
                tracing::warn!(%peer, max = limits.max_sessions, "side channel: too many handshakes at once; connection closed");
                continue;
            };
            let ours = ours.clone();
            tokio::spawn(async move {
                let peer_name = peer.to_string();
                let outcome = within(
                    "answer a handshake",
                    &peer_name,
                    limits.deadline,
                    answer(stream, peer, &ours, limits),
                )
                .await;
                if let Err(err) = outcome {
                    tracing::warn!(%err, "side channel: handshake failed");
                }
                drop(permit);
            });
        }
    })
}

async fn answer(
    stream: TcpStream,
    peer: SocketAddr,
    ours: &HandshakeMessage,
    limits: ChannelLimits,
) -> Result<()> {
    let mut channel = Channel::new(stream, peer.to_string(), limits.max_frame);
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
    channel.send(&response).await
}

/// Connects to `addr`, sends `ours` and returns the server's handshake, all within
/// `limits.deadline`.
///
/// # Errors
/// [`Error::Deadline`], [`Error::Io`], [`Error::Protocol`], or [`Error::Refused`] with the
/// server's reason.
pub async fn fetch_handshake(
    addr: SocketAddr,
    ours: &HandshakeMessage,
    limits: ChannelLimits,
) -> Result<HandshakeMessage> {
    let peer = addr.to_string();
    within("handshake", &peer, limits.deadline, async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|err| Error::io("connect to the side channel", addr, err))?;
        let mut channel = Channel::new(stream, peer.clone(), limits.max_frame);
        channel
            .send(&Request::Handshake(Box::new(ours.clone())))
            .await?;
        match channel.recv().await? {
            Response::Accepted(theirs) => Ok(*theirs),
            Response::Refused { reason } => Err(Error::Refused {
                peer: channel.peer().to_string(),
                reason,
            }),
        }
    })
    .await
}

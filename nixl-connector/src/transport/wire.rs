//! Framed MessagePack messages on a byte stream: a length-delimited codec (a 4-byte
//! big-endian length, then the body) with a frame cap, so a peer's declared length is refused
//! before anything is allocated for it.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use crate::error::{Error, Result};

/// Limits of the side channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelLimits {
    /// Largest frame accepted or sent, in bytes.
    pub max_frame: usize,
    /// Total time one exchange (connect, request, response) may take.
    pub deadline: Duration,
    /// Most handshakes a server runs at once; when all are under way, the oldest is closed
    /// with a "busy" answer to make room for a new connection (clients retry within their
    /// deadline), so idle or slow peers cannot lock prompt ones out.
    pub max_sessions: usize,
}

impl Default for ChannelLimits {
    /// 1 MiB frames, 5 s per exchange, 64 sessions at once.
    fn default() -> Self {
        ChannelLimits {
            max_frame: 1 << 20,
            deadline: Duration::from_secs(5),
            max_sessions: 64,
        }
    }
}

/// One peer's framed stream of MessagePack messages, the side channel's wire format, for
/// any control traffic an engine adds beside the handshake (e.g. a proxy's requests).
///
/// Every message is one frame, a MessagePack map of at most `max_frame` bytes. A frame
/// that declares more is refused before anything is allocated for it. Nothing here has a
/// deadline: wrap exchanges in `tokio::time::timeout`, one total per exchange.
pub struct Channel<S = TcpStream> {
    framed: Framed<S, LengthDelimitedCodec>,
    peer: String,
    max_frame: usize,
}

impl<S> std::fmt::Debug for Channel<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("peer", &self.peer)
            .field("max_frame", &self.max_frame)
            .finish_non_exhaustive()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Channel<S> {
    /// Frames `stream`, whose other end is `peer` (named in errors), with frames of at
    /// most `max_frame` bytes both ways.
    pub fn new(stream: S, peer: String, max_frame: usize) -> Self {
        let codec = LengthDelimitedCodec::builder()
            .length_field_type::<u32>()
            .max_frame_length(max_frame)
            .new_codec();
        Channel {
            framed: Framed::new(stream, codec),
            peer,
            max_frame,
        }
    }

    /// The peer, as named in errors.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The stream underneath.
    pub fn get_ref(&self) -> &S {
        self.framed.get_ref()
    }

    /// The stream underneath, e.g. to change its settings (reading or writing it directly
    /// would break the framing).
    pub fn get_mut(&mut self) -> &mut S {
        self.framed.get_mut()
    }

    pub(crate) fn protocol(&self, reason: String) -> Error {
        Error::Protocol {
            peer: self.peer.clone(),
            reason,
        }
    }

    /// Sends one message as a MessagePack map.
    ///
    /// # Errors
    /// [`Error::Protocol`] for a message over the frame cap (nothing is sent);
    /// [`Error::Io`] when the stream fails.
    pub async fn send<T: Serialize>(&mut self, message: &T) -> Result<()> {
        let bytes = rmp_serde::to_vec_named(message)
            .map_err(|err| self.protocol(format!("cannot encode a message: {err}")))?;
        if bytes.len() > self.max_frame {
            return Err(self.protocol(format!(
                "our message of {} bytes exceeds the {}-byte frame cap",
                bytes.len(),
                self.max_frame
            )));
        }
        self.framed
            .send(bytes::Bytes::from(bytes))
            .await
            .map_err(|err| Error::io("send a side-channel frame", &self.peer, err))
    }

    /// Receives one message.
    ///
    /// # Errors
    /// [`Error::Closed`] when the stream ends between frames, [`Error::Truncated`] inside
    /// one; [`Error::Protocol`] for a frame over the cap or bytes that do not decode as `T`;
    /// [`Error::Io`] when the stream fails.
    pub async fn recv<T: DeserializeOwned>(&mut self) -> Result<T> {
        let frame = match self.framed.next().await {
            None => {
                return Err(Error::Closed {
                    peer: self.peer.clone(),
                })
            }
            Some(Err(err)) if err.kind() == std::io::ErrorKind::InvalidData => {
                return Err(self.protocol(format!(
                    "the peer declared a frame longer than the {}-byte cap",
                    self.max_frame
                )))
            }
            // The codec fails at the end of the stream only with bytes of a frame left over.
            Some(Err(err))
                if err.kind() == std::io::ErrorKind::Other
                    && !self.framed.read_buffer().is_empty() =>
            {
                return Err(Error::Truncated {
                    peer: self.peer.clone(),
                })
            }
            Some(Err(err)) => {
                return Err(Error::io("receive a side-channel frame", &self.peer, err))
            }
            Some(Ok(frame)) => frame,
        };
        rmp_serde::from_slice(&frame).map_err(|err| {
            self.protocol(format!(
                "undecodable message of {} bytes: {err}",
                frame.len()
            ))
        })
    }

    /// Flushes what was sent and closes the sending half of the stream.
    ///
    /// # Errors
    /// [`Error::Io`] when the stream fails.
    pub async fn close(&mut self) -> Result<()> {
        SinkExt::<bytes::Bytes>::close(&mut self.framed)
            .await
            .map_err(|err| Error::io("close the side channel", &self.peer, err))
    }
}

/// Runs `work` within `deadline` (a total), naming `operation` and `peer` when it passes.
pub(crate) async fn within<T>(
    operation: &'static str,
    peer: &str,
    deadline: Duration,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(deadline, work)
        .await
        .unwrap_or_else(|_| {
            Err(Error::Deadline {
                operation,
                peer: peer.to_string(),
                deadline,
            })
        })
}

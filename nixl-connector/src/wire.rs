//! Framed MessagePack messages on a TCP stream: a length-delimited codec with a frame cap,
//! so a peer's declared length is refused before anything is allocated for it.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
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
    /// Most handshakes a server runs at once; further connections are closed at once.
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

/// One peer's framed stream.
pub(crate) struct Channel {
    framed: Framed<TcpStream, LengthDelimitedCodec>,
    peer: String,
    max_frame: usize,
}

impl Channel {
    pub(crate) fn new(stream: TcpStream, peer: String, max_frame: usize) -> Self {
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

    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    fn protocol(&self, reason: String) -> Error {
        Error::Protocol {
            peer: self.peer.clone(),
            reason,
        }
    }

    /// Sends one message as a MessagePack map.
    pub(crate) async fn send<T: Serialize>(&mut self, message: &T) -> Result<()> {
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

    /// Receives one message; a frame over the cap, a closed stream or undecodable bytes
    /// are errors naming the peer.
    pub(crate) async fn recv<T: DeserializeOwned>(&mut self) -> Result<T> {
        let frame = match self.framed.next().await {
            None => return Err(self.protocol("the peer closed the connection".to_string())),
            Some(Err(err)) if err.kind() == std::io::ErrorKind::InvalidData => {
                return Err(self.protocol(format!(
                    "the peer declared a frame longer than the {}-byte cap ({err})",
                    self.max_frame
                )))
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

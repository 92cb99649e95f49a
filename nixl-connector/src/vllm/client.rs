//! The decode's end of vLLM's side channel: a REQ socket asking a prefill engine's ROUTER
//! for a rank's handshake payload.

use tokio::net::TcpStream;

use super::clock::perf_counter;
use super::limits::VllmChannelLimits;
use super::payload::{
    decode_clock, decode_reply_frame, encode_request, NixlHandshakePayload, ReplyFrame,
};
use super::zmtp::{Connection, SocketType};
use crate::error::{Error, Result};
use crate::transport::wire::within;

/// Largest clock frame taken (a MessagePack float has 9 bytes).
const MAX_CLOCK: usize = 16;

/// A rank's handshake payload and the clocks around it.
#[derive(Debug, Clone, PartialEq)]
pub struct MetaReply {
    /// The rank's payload (check it with
    /// [`Compatibility::check`](super::compat::Compatibility::check)).
    pub payload: NixlHandshakePayload,
    /// The prefill's clock when it answered.
    pub remote_clock: f64,
    /// Our [`perf_counter`] when the request was sent.
    pub sent_at: f64,
    /// Our [`perf_counter`] when the reply arrived.
    pub received_at: f64,
}

impl MetaReply {
    /// The round trip, in seconds.
    pub fn rtt(&self) -> f64 {
        self.received_at - self.sent_at
    }

    /// The prefill's clock minus ours, estimated at the middle of the round trip (the
    /// sample with the smallest [`MetaReply::rtt`] is the best, as vLLM keeps it). A
    /// prefill time `t` is `t - offset` on our clock.
    pub fn clock_offset(&self) -> f64 {
        self.remote_clock - (self.sent_at + self.received_at) / 2.0
    }
}

/// A connection to one prefill engine's side channel (vLLM's REQ socket). Requests go one
/// at a time. A request that gets no whole reply closes the connection, and later ones
/// fail at once.
pub struct MetadataClient {
    conn: Option<Connection<TcpStream>>,
    peer: String,
    limits: VllmChannelLimits,
}

impl std::fmt::Debug for MetadataClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataClient")
            .field("peer", &self.peer)
            .field("open", &self.conn.is_some())
            .finish_non_exhaustive()
    }
}

impl MetadataClient {
    /// Connects to the side channel at `host:port` (vLLM's `remote_host`, `remote_port`)
    /// and runs the ZMTP handshake, within `limits.deadline`.
    ///
    /// # Errors
    /// [`Error::Deadline`], [`Error::Io`], [`Error::Protocol`] for a peer that is not a
    /// ZMQ ROUTER (or REP) socket.
    pub async fn connect(host: &str, port: u16, limits: VllmChannelLimits) -> Result<Self> {
        let peer = format!("{host}:{port}");
        let conn = within(
            "connect to a vLLM side channel",
            &peer,
            limits.deadline,
            async {
                let stream = TcpStream::connect((host, port))
                    .await
                    .map_err(|err| Error::io("connect to a vLLM side channel", &peer, err))?;
                // libzmq sets TCP_NODELAY too: a request is one small write.
                stream
                    .set_nodelay(true)
                    .map_err(|err| Error::io("set TCP_NODELAY", &peer, err))?;
                Connection::handshake(
                    stream,
                    peer.clone(),
                    SocketType::Req,
                    &[SocketType::Router, SocketType::Rep],
                )
                .await
            },
        )
        .await?;
        Ok(MetadataClient {
            conn: Some(conn),
            peer,
            limits,
        })
    }

    /// The peer, as named in errors.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Asks for the payload of rank (`pp_rank`, `tp_rank`) and waits for it, within
    /// `limits.deadline`.
    ///
    /// # Errors
    /// [`Error::Refused`] with the server's reason (e.g. a rank it does not have);
    /// [`Error::Deadline`]; [`Error::Protocol`] for a reply that is not two frames, a
    /// frame over its cap, or an undecodable payload or clock; [`Error::Closed`],
    /// [`Error::Truncated`], [`Error::Io`]; [`Error::InvalidArgument`] once an earlier
    /// request failed.
    pub async fn get_meta(&mut self, pp_rank: u32, tp_rank: u32) -> Result<MetaReply> {
        let mut conn = self.conn.take().ok_or_else(|| {
            Error::invalid(
                "ask a vLLM side channel for metadata",
                format!(
                    "an earlier request to {} got no whole reply, so this connection is closed; connect again",
                    self.peer
                ),
            )
        })?;
        let request = encode_request(pp_rank, tp_rank);
        let caps = [self.limits.max_payload, MAX_CLOCK];
        let exchange = async {
            let sent_at = perf_counter();
            conn.send(&[&request]).await?;
            let parts = conn.recv(&caps).await?;
            let received_at = perf_counter();
            Ok::<_, Error>((parts, sent_at, received_at))
        };
        let (parts, sent_at, received_at) = within(
            "ask a vLLM side channel for metadata",
            &self.peer,
            self.limits.deadline,
            exchange,
        )
        .await?;
        // A whole reply came back: the REQ socket may send again, whatever the reply says.
        self.conn = Some(conn);
        let protocol = |reason: String| Error::Protocol {
            peer: self.peer.clone(),
            reason,
        };
        let [payload, clock] = <[Vec<u8>; 2]>::try_from(parts).map_err(|parts| {
            protocol(format!(
                "a reply of {} frames; vLLM's has 2 (payload, clock)",
                parts.len()
            ))
        })?;
        let payload = match decode_reply_frame(payload).map_err(protocol)? {
            ReplyFrame::Payload(payload) => payload,
            ReplyFrame::Error(reason) => {
                return Err(Error::Refused {
                    peer: self.peer.clone(),
                    reason: reason.chars().take(1024).collect(),
                })
            }
        };
        let remote_clock = decode_clock(&clock).map_err(protocol)?;
        Ok(MetaReply {
            payload,
            remote_clock,
            sent_at,
            received_at,
        })
    }
}

/// Connects to `host:port`, asks for rank (`pp_rank`, `tp_rank`)'s payload and closes, all
/// within one `limits.deadline`.
///
/// # Errors
/// As [`MetadataClient::connect`] and [`MetadataClient::get_meta`].
pub async fn fetch_meta(
    host: &str,
    port: u16,
    pp_rank: u32,
    tp_rank: u32,
    limits: VllmChannelLimits,
) -> Result<MetaReply> {
    let peer = format!("{host}:{port}");
    within("fetch a vLLM handshake", &peer, limits.deadline, async {
        let mut client = MetadataClient::connect(host, port, limits).await?;
        client.get_meta(pp_rank, tp_rank).await
    })
    .await
}

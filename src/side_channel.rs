//! The side channel between prefill and decode: a TCP connection carrying framed messages.
//!
//! 1. decode → prefill [`Hello`]: its agent name and metadata, cache geometry, and the
//!    work it wants (requests, blocks per request, requests in flight);
//! 2. prefill → decode [`Welcome`]: its agent name and metadata and its cache layout (or
//!    [`Message::Error`] saying why it refuses);
//! 3. prefill → decode [`Message::Announce`] per request: which prefill blocks hold it;
//!    decode READs them through NIXL, the notification carrying the request id;
//! 4. prefill → decode [`Message::Complete`] once every request was acknowledged.
//!
//! Metadata is empty in etcd mode, where it travels through etcd instead.

use std::io::{BufReader, BufWriter, ErrorKind, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

use crate::codec::{Decoder, Encoder};
use crate::deadline::{Deadline, DeadlineStream};
use crate::error::{Error, Result};
use crate::framing::{read_frame_charged, write_frame, FrameBudget, FrameError, Unbudgeted};

/// Version of the protocol; both sides must speak the same.
pub const PROTOCOL_VERSION: u32 = 1;

/// How long [`Sender::shutdown`] may wait for unsent bytes to leave.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Longest agent name accepted.
pub const MAX_NAME_BYTES: usize = 256;
/// Largest agent metadata accepted.
pub const MAX_METADATA_BYTES: usize = 8 << 20;
/// Most layers a cache layout may have.
pub const MAX_LAYERS: usize = 4096;
/// Most blocks one announcement may list.
pub const MAX_BLOCKS_PER_REQUEST: usize = 1 << 20;
/// Longest error text accepted.
pub const MAX_ERROR_BYTES: usize = 4096;

const TAG_HELLO: u8 = 1;
const TAG_WELCOME: u8 = 2;
const TAG_ANNOUNCE: u8 = 3;
const TAG_COMPLETE: u8 = 4;
const TAG_ERROR: u8 = 5;

/// decode → prefill: who the decode worker is and what it wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub version: u32,
    /// The decode agent's name.
    pub agent: String,
    /// The decode agent's metadata (empty in etcd mode).
    pub metadata: Vec<u8>,
    /// Layers of the decode cache; must equal prefill's.
    pub layers: u32,
    /// Block size of the decode cache; must equal prefill's.
    pub block_bytes: u64,
    /// Requests to serve in this session.
    pub requests: u64,
    /// Blocks per request.
    pub blocks_per_request: u32,
    /// Most requests announced and not yet acknowledged at any time.
    pub in_flight: u32,
}

/// Where a worker's KV cache lives, as its peer needs it to build remote descriptors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheDescription {
    /// Blocks per layer.
    pub blocks: u32,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Start address of each layer's region (one per layer).
    pub bases: Vec<u64>,
}

/// prefill → decode: who the prefill worker is and where its cache lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    /// The prefill agent's name.
    pub agent: String,
    /// The prefill agent's metadata (empty in etcd mode).
    pub metadata: Vec<u8>,
    /// The prefill cache layout.
    pub cache: CacheDescription,
}

/// One side-channel message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Welcome`].
    Welcome(Welcome),
    /// Request `request` is ready in these prefill blocks (the same blocks in every layer).
    Announce {
        /// Request id, unique per prefill process.
        request: u64,
        /// Prefill block indices.
        blocks: Vec<u32>,
    },
    /// Every request of the session was pulled and acknowledged.
    Complete {
        /// Requests served.
        requests: u64,
    },
    /// The sender gives up on the session, and why.
    Error {
        /// Human-readable reason.
        message: String,
    },
}

impl Message {
    /// Short name of the message kind, for errors and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello(_) => "Hello",
            Message::Welcome(_) => "Welcome",
            Message::Announce { .. } => "Announce",
            Message::Complete { .. } => "Complete",
            Message::Error { .. } => "Error",
        }
    }

    /// The frame body of the message.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Message::Hello(h) => Encoder::new(TAG_HELLO)
                .u32(h.version)
                .str(&h.agent)
                .bytes(&h.metadata)
                .u32(h.layers)
                .u64(h.block_bytes)
                .u64(h.requests)
                .u32(h.blocks_per_request)
                .u32(h.in_flight)
                .finish(),
            Message::Welcome(w) => Encoder::new(TAG_WELCOME)
                .str(&w.agent)
                .bytes(&w.metadata)
                .u32(w.cache.blocks)
                .u64(w.cache.block_bytes)
                .u64_list(&w.cache.bases)
                .finish(),
            Message::Announce { request, blocks } => Encoder::new(TAG_ANNOUNCE)
                .u64(*request)
                .u32_list(blocks)
                .finish(),
            Message::Complete { requests } => Encoder::new(TAG_COMPLETE).u64(*requests).finish(),
            Message::Error { message } => Encoder::new(TAG_ERROR).str(message).finish(),
        }
    }

    /// Parses a frame body, enforcing every limit.
    ///
    /// # Errors
    /// [`Error::Protocol`] for an unknown tag, a cut-short or over-long field, or trailing bytes.
    pub fn decode(body: &[u8]) -> Result<Message> {
        let mut d = Decoder::new(body);
        let message = match d.u8("tag")? {
            TAG_HELLO => Message::Hello(Hello {
                version: d.u32("version")?,
                agent: d.str("agent", MAX_NAME_BYTES)?,
                metadata: d.bytes("metadata", MAX_METADATA_BYTES)?,
                layers: d.u32("layers")?,
                block_bytes: d.u64("block_bytes")?,
                requests: d.u64("requests")?,
                blocks_per_request: d.u32("blocks_per_request")?,
                in_flight: d.u32("in_flight")?,
            }),
            TAG_WELCOME => Message::Welcome(Welcome {
                agent: d.str("agent", MAX_NAME_BYTES)?,
                metadata: d.bytes("metadata", MAX_METADATA_BYTES)?,
                cache: CacheDescription {
                    blocks: d.u32("blocks")?,
                    block_bytes: d.u64("block_bytes")?,
                    bases: d.u64_list("bases", MAX_LAYERS)?,
                },
            }),
            TAG_ANNOUNCE => Message::Announce {
                request: d.u64("request")?,
                blocks: d.u32_list("blocks", MAX_BLOCKS_PER_REQUEST)?,
            },
            TAG_COMPLETE => Message::Complete {
                requests: d.u64("requests")?,
            },
            TAG_ERROR => Message::Error {
                message: d.str("message", MAX_ERROR_BYTES)?,
            },
            tag => return Err(Error::Protocol(format!("unknown message tag {tag}"))),
        };
        d.finish(message.kind())?;
        Ok(message)
    }
}

/// The receiving half of a side-channel connection.
#[derive(Debug)]
pub struct Receiver {
    stream: BufReader<DeadlineStream>,
    max_frame: usize,
}

impl Receiver {
    /// Reads and parses the next message.
    ///
    /// # Errors
    /// [`Error::Frame`] for a closed, truncated, oversized or stalled frame (see
    /// [`set_deadline`](Self::set_deadline)) or a socket error, [`Error::Protocol`] for a
    /// malformed message.
    pub fn recv(&mut self) -> Result<Message> {
        self.recv_charged(&mut Unbudgeted)
    }

    /// Like [`recv`](Self::recv), charging `budget` for the frame's memory as it grows.
    ///
    /// # Errors
    /// Those of [`recv`](Self::recv), and the budget's refusal.
    pub fn recv_charged(&mut self, budget: &mut impl FrameBudget) -> Result<Message> {
        let body = read_frame_charged(&mut self.stream, self.max_frame, budget)?;
        Message::decode(&body)
    }

    /// Sets the deadline of the reads to come: a frame not complete by then ends
    /// [`recv`](Self::recv) with [`FrameError::Stalled`]
    /// (`None`: reads may block forever).
    pub fn set_deadline(&mut self, deadline: Option<Deadline>) {
        self.stream.get_mut().set_deadline(deadline);
    }
}

/// The sending half of a side-channel connection.
#[derive(Debug)]
pub struct Sender {
    stream: BufWriter<DeadlineStream>,
    max_frame: usize,
}

impl Sender {
    /// Encodes and sends `message`.
    ///
    /// # Errors
    /// [`Error::Frame`] when the message exceeds the frame limit or the socket fails.
    pub fn send(&mut self, message: &Message) -> Result<()> {
        write_frame(&mut self.stream, &message.encode(), self.max_frame)?;
        Ok(())
    }

    /// Like [`send`](Self::send), but gives up when the peer has not taken the whole frame
    /// by `deadline` (a peer that reads nothing cannot hold the sender).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the deadline passes; those of [`send`](Self::send).
    pub fn send_by(&mut self, message: &Message, deadline: Deadline) -> Result<()> {
        let timed_out = || {
            Error::Timeout(format!(
                "the peer did not take the {} message within {:?}",
                message.kind(),
                deadline.limit()
            ))
        };
        self.stream.get_mut().set_deadline(Some(deadline));
        let sent = self.send(message);
        self.stream.get_mut().set_deadline(None);
        match sent {
            Err(Error::Frame(FrameError::Io(err)))
                if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                Err(timed_out())
            }
            other => other,
        }
    }

    /// Closes the connection both ways (after what was sent, given [`SHUTDOWN_GRACE`] to
    /// leave), which also ends a [`Receiver::recv`] blocked on the other half.
    pub fn shutdown(&mut self) {
        self.stream
            .get_mut()
            .set_deadline(Some(Deadline::after(SHUTDOWN_GRACE)));
        let _ = self.stream.flush();
        if let Err(err) = self.stream.get_ref().get_ref().shutdown(Shutdown::Both) {
            tracing::debug!(%err, "side-channel shutdown");
        }
    }
}

/// Splits a connected stream into its two halves, with `max_frame` as the frame limit.
///
/// # Errors
/// [`Error::Io`] if the socket cannot be duplicated.
pub fn split(stream: TcpStream, max_frame: usize) -> Result<(Sender, Receiver)> {
    stream
        .set_nodelay(true)
        .map_err(|err| Error::io("set TCP_NODELAY on the side channel", err))?;
    let reader = stream
        .try_clone()
        .map_err(|err| Error::io("duplicate the side-channel socket", err))?;
    Ok((
        Sender {
            stream: BufWriter::new(DeadlineStream::new(stream)),
            max_frame,
        },
        Receiver {
            stream: BufReader::new(DeadlineStream::new(reader)),
            max_frame,
        },
    ))
}

/// Connects to a prefill side channel, retrying until `deadline` (prefill may still be
/// starting).
///
/// # Errors
/// [`Error::Timeout`] with the last connection error when no connection succeeds in time.
pub fn connect(addr: SocketAddr, deadline: Deadline) -> Result<TcpStream> {
    loop {
        let attempt = deadline
            .remaining()
            .map(|left| TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(1))));
        match attempt {
            Some(Ok(stream)) => return Ok(stream),
            Some(Err(err)) if !deadline.passed() => {
                tracing::debug!(%addr, %err, "prefill side channel not reachable yet; retrying");
                std::thread::sleep(Duration::from_millis(100));
            }
            Some(Err(err)) => {
                return Err(Error::Timeout(format!(
                    "could not connect to prefill's side channel at {addr} within {:?}: {err}",
                    deadline.limit()
                )))
            }
            None => {
                return Err(Error::Timeout(format!(
                    "could not connect to prefill's side channel at {addr} within {:?}",
                    deadline.limit()
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Message> {
        vec![
            Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                agent: "decode-1".into(),
                metadata: vec![1, 2, 3],
                layers: 32,
                block_bytes: 16384,
                requests: 100,
                blocks_per_request: 16,
                in_flight: 4,
            }),
            Message::Welcome(Welcome {
                agent: "prefill-1".into(),
                metadata: vec![],
                cache: CacheDescription {
                    blocks: 512,
                    block_bytes: 16384,
                    bases: vec![0x1000, 0x2000],
                },
            }),
            Message::Announce {
                request: 9,
                blocks: vec![1, 5, 7],
            },
            Message::Complete { requests: 100 },
            Message::Error {
                message: "no".into(),
            },
        ]
    }

    #[test]
    fn round_trip() {
        for m in samples() {
            assert_eq!(Message::decode(&m.encode()).unwrap(), m);
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        for m in samples() {
            let body = m.encode();
            for cut in 0..body.len() {
                assert!(Message::decode(&body[..cut]).is_err(), "{m:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn rejects_unknown_tags_and_trailing_bytes() {
        assert!(Message::decode(&[99]).is_err());
        let mut body = Message::Complete { requests: 1 }.encode();
        body.push(0);
        assert!(Message::decode(&body).is_err());
    }

    #[test]
    fn a_peer_that_reads_nothing_cannot_hold_the_sender() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_peer, _) = listener.accept().unwrap();
        let (mut tx, _rx) = split(stream, 16 << 20).unwrap();
        let mut hello = samples().remove(0);
        if let Message::Hello(h) = &mut hello {
            h.metadata = vec![0; MAX_METADATA_BYTES];
        }
        let start = std::time::Instant::now();
        let err = tx
            .send_by(&hello, Deadline::after(Duration::from_millis(300)))
            .unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(
            err.to_string(),
            "timed out: the peer did not take the Hello message within 300ms"
        );
    }

    #[test]
    fn rejects_over_limit_lists() {
        let body = Encoder::new(TAG_ANNOUNCE).u64(1).u32(u32::MAX).finish();
        assert!(Message::decode(&body).is_err());
    }
}

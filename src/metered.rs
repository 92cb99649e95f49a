//! A control-channel stream that counts what it received, keeps the first frame's length
//! header, and during a handshake charges what arrives to an [`admission::Ticket`], so the
//! demo can say how far a stalled peer got and bound what pending handshakes hold.
//!
//! [`admission::Ticket`]: crate::admission::Ticket

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::admission::Ticket;

/// Bytes of the length header in front of every frame.
pub const HEADER_BYTES: usize = 4;

/// Most bytes one read takes in while a ticket is charged (64 KiB).
pub const CHARGED_READ_BYTES: usize = 64 << 10;

/// A TCP stream with its received bytes counted (and charged while a ticket is held).
#[derive(Debug)]
pub struct Metered {
    stream: TcpStream,
    received: usize,
    header: [u8; HEADER_BYTES],
    ticket: Option<Ticket>,
    refusal: Option<String>,
    /// Where charged reads land first.
    scratch: Vec<u8>,
}

impl Metered {
    /// Wraps `stream`; `ticket` (a pending handshake's place) is charged for every byte
    /// received until [`release`](Self::release).
    pub fn new(stream: TcpStream, ticket: Option<Ticket>) -> Self {
        Metered {
            stream,
            received: 0,
            header: [0; HEADER_BYTES],
            ticket,
            refusal: None,
            scratch: Vec::new(),
        }
    }

    /// Gives the handshake's place back: what arrives from now on is not charged.
    pub fn release(&mut self) {
        self.ticket = None;
        self.scratch = Vec::new();
    }

    /// Counts `fresh` bytes received, keeping those of the first frame's header.
    fn count(&mut self, fresh: &[u8]) {
        for (i, &byte) in fresh.iter().enumerate() {
            if let Some(slot) = self.header.get_mut(self.received + i) {
                *slot = byte;
            }
        }
        self.received += fresh.len();
    }

    /// Why the ticket refused more bytes, once it did.
    pub fn refusal(&self) -> Option<&str> {
        self.refusal.as_deref()
    }

    /// How far the first frame got: e.g. `"5 of 1004 bytes"` (header included), or
    /// `"2 of 4 header bytes"` before its length arrived.
    pub fn first_frame_progress(&self) -> String {
        if self.received < HEADER_BYTES {
            return format!("{} of {HEADER_BYTES} header bytes", self.received);
        }
        let total = u32::from_be_bytes(self.header) as usize + HEADER_BYTES;
        format!("{} of {total} bytes", self.received.min(total))
    }

    /// The first bytes received (those of the first frame's header, at most
    /// [`HEADER_BYTES`]).
    pub fn first_bytes(&self) -> &[u8] {
        &self.header[..self.received.min(HEADER_BYTES)]
    }

    /// Bytes received so far.
    pub fn received(&self) -> usize {
        self.received
    }
}

impl AsyncRead for Metered {
    /// While a ticket is held, reads at most [`CHARGED_READ_BYTES`] at a time (through a
    /// scratch buffer), so no read takes in much more than the ticket allows.
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(reason) = &this.refusal {
            return Poll::Ready(Err(io::Error::other(reason.clone())));
        }
        if this.ticket.is_none() {
            let before = buf.filled().len();
            let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
            if let Poll::Ready(Ok(())) = polled {
                let fresh = buf.filled().len() - before;
                this.count(&buf.filled()[before..before + fresh]);
            }
            return polled;
        }
        let room = buf.remaining().min(CHARGED_READ_BYTES);
        let mut scratch = std::mem::take(&mut this.scratch);
        scratch.resize(room, 0);
        let mut chunk = ReadBuf::new(&mut scratch);
        let polled = Pin::new(&mut this.stream).poll_read(cx, &mut chunk);
        let outcome = match polled {
            Poll::Ready(Ok(())) => {
                let fresh = chunk.filled();
                this.count(fresh);
                match this.ticket.as_mut().map(|t| t.charge(fresh.len())) {
                    Some(Err(reason)) => {
                        this.refusal = Some(reason.clone());
                        Poll::Ready(Err(io::Error::other(reason)))
                    }
                    _ => {
                        buf.put_slice(fresh);
                        Poll::Ready(Ok(()))
                    }
                }
            }
            other => other,
        };
        this.scratch = scratch;
        outcome
    }
}

impl AsyncWrite for Metered {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

//! The part of ZMTP 3.x (ZeroMQ's wire protocol, <https://rfc.zeromq.org/spec/37/>) that
//! vLLM's side channel uses, over any tokio byte stream: the greeting, the NULL security
//! mechanism's READY, PING/PONG and ERROR commands, and REQ/ROUTER messages behind their
//! empty delimiter frame. Only what a peer's bytes can be checked against is kept in memory:
//! every frame has a cap checked before it is read, and frames grow as their bytes arrive.
//! Nothing here has a deadline: callers wrap each exchange in one.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use crate::error::{Error, Result};

/// Largest command frame taken (a READY with its properties; ours is 41 bytes).
const MAX_COMMAND: usize = 4096;

/// ZeroMQ socket types this module speaks or accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SocketType {
    /// A client sending one request, then taking one reply.
    Req,
    /// A replier to REQ sockets.
    Rep,
    /// An asynchronous client.
    Dealer,
    /// A server routing replies to many clients.
    Router,
}

impl SocketType {
    fn name(self) -> &'static str {
        match self {
            SocketType::Req => "REQ",
            SocketType::Rep => "REP",
            SocketType::Dealer => "DEALER",
            SocketType::Router => "ROUTER",
        }
    }
}

/// Our greeting: signature (with the ZMTP 1.0 compatible padding libzmq sends), version
/// 3.1, mechanism NULL, as-server 0, filler.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[8] = 1;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// Appends one frame to `out`.
fn put_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// A command's body: its name, then `rest`.
fn command(name: &str, rest: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(1 + name.len() + rest.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name.as_bytes());
    body.extend_from_slice(rest);
    body
}

/// One frame read from the peer.
struct Frame {
    more: bool,
    command: bool,
    body: Vec<u8>,
}

/// A ZMTP connection after its handshake.
pub(crate) struct Connection<S> {
    io: BufReader<S>,
    peer: String,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    /// Runs the handshake on `stream` as a socket of type `ours`, refusing a peer whose
    /// socket type is not in `accepts`. `peer` names the other end in errors.
    ///
    /// # Errors
    /// [`Error::Protocol`] for a peer that is not ZMTP 3 with the NULL mechanism, or of a
    /// socket type not accepted; [`Error::Refused`] when the peer sends ERROR;
    /// [`Error::Closed`], [`Error::Truncated`], [`Error::Io`].
    pub(crate) async fn handshake(
        stream: S,
        peer: String,
        ours: SocketType,
        accepts: &[SocketType],
    ) -> Result<Self> {
        let mut conn = Connection {
            io: BufReader::new(stream),
            peer,
        };
        let mut hello = greeting().to_vec();
        let mut props = Vec::new();
        put_property(&mut props, "Socket-Type", ours.name().as_bytes());
        if ours != SocketType::Rep {
            // libzmq sends an (empty) Identity from REQ, DEALER and ROUTER sockets.
            put_property(&mut props, "Identity", b"");
        }
        put_frame(&mut hello, FLAG_COMMAND, &command("READY", &props));
        conn.write(&hello).await?;

        let mut theirs = [0u8; 64];
        conn.read_exact(&mut theirs)
            .await
            .map_err(|err| match err {
                Error::Truncated { peer } => Error::Closed { peer },
                other => other,
            })?;
        if theirs[0] != 0xff || theirs[9] & 1 == 0 {
            return Err(conn.protocol(format!(
                "not a ZMTP 3 peer (its first bytes are {:02x?})",
                &theirs[..10]
            )));
        }
        if theirs[10] < 3 {
            return Err(conn.protocol(format!(
                "the peer speaks ZMTP {}.{}; only ZMTP 3.x is supported",
                theirs[10], theirs[11]
            )));
        }
        let mechanism = &theirs[12..32];
        let end = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
        if &mechanism[..end] != b"NULL" {
            return Err(conn.protocol(format!(
                "the peer uses the {:?} security mechanism; only NULL is supported",
                String::from_utf8_lossy(&mechanism[..end])
            )));
        }

        let frame = conn.read_frame(MAX_COMMAND, "command").await?;
        let (name, rest) = conn.parse_command(&frame)?;
        match name {
            b"READY" => {}
            b"ERROR" => return Err(conn.peer_error(rest)),
            other => {
                return Err(conn.protocol(format!(
                    "expected READY, got the {:?} command",
                    String::from_utf8_lossy(other)
                )))
            }
        }
        let socket_type = conn.socket_type(rest)?;
        if !accepts.iter().any(|t| t.name() == socket_type) {
            let reason = format!(
                "a {} socket does not talk to a {socket_type} socket",
                ours.name()
            );
            let mut error = Vec::new();
            let mut text = reason.clone().into_bytes();
            text.truncate(255);
            let mut rest = vec![text.len() as u8];
            rest.extend_from_slice(&text);
            put_frame(&mut error, FLAG_COMMAND, &command("ERROR", &rest));
            // The peer learns why, if it is listening; the refusal stands either way.
            let _ = conn.write(&error).await;
            return Err(conn.protocol(reason));
        }
        Ok(conn)
    }

    /// Sends one message behind the empty delimiter frame (REQ/ROUTER framing).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub(crate) async fn send(&mut self, parts: &[&[u8]]) -> Result<()> {
        let mut out = Vec::with_capacity(2 + parts.iter().map(|p| p.len() + 9).sum::<usize>());
        put_frame(&mut out, FLAG_MORE, b"");
        for (i, part) in parts.iter().enumerate() {
            let more = if i + 1 < parts.len() { FLAG_MORE } else { 0 };
            put_frame(&mut out, more, part);
        }
        self.write(&out).await
    }

    /// Receives one message sent behind the empty delimiter frame, with at most
    /// `caps.len()` parts, part `i` at most `caps[i]` bytes. PING is answered, PONG and
    /// unknown commands between messages are skipped.
    ///
    /// # Errors
    /// [`Error::Closed`] when the peer closes between messages; [`Error::Protocol`] for a
    /// missing delimiter, too many parts, a part over its cap or a malformed frame;
    /// [`Error::Refused`] when the peer sends ERROR; [`Error::Truncated`], [`Error::Io`].
    pub(crate) async fn recv(&mut self, caps: &[usize]) -> Result<Vec<Vec<u8>>> {
        let delimiter = loop {
            let frame = self.read_frame(MAX_COMMAND, "delimiter").await?;
            if !frame.command {
                break frame;
            }
            self.on_command(&frame).await?;
        };
        if !delimiter.body.is_empty() || !delimiter.more {
            return Err(self.protocol(
                "the message does not start with the empty delimiter frame of REQ/ROUTER sockets"
                    .into(),
            ));
        }
        let mut parts = Vec::new();
        loop {
            let Some(&cap) = caps.get(parts.len()) else {
                return Err(
                    self.protocol(format!("the message has more than {} parts", caps.len()))
                );
            };
            let frame = self.read_frame(cap, "message").await?;
            if frame.command {
                return Err(self.protocol("a command inside a message".into()));
            }
            parts.push(frame.body);
            if !frame.more {
                return Ok(parts);
            }
        }
    }

    /// Handles a command between messages.
    async fn on_command(&mut self, frame: &Frame) -> Result<()> {
        let (name, rest) = self.parse_command(frame)?;
        match name {
            b"PING" => {
                // TTL (2 bytes), then up to 16 bytes of context that PONG echoes.
                let context = rest.get(2..).unwrap_or_default();
                let context = &context[..context.len().min(16)];
                let mut out = Vec::new();
                put_frame(&mut out, FLAG_COMMAND, &command("PONG", context));
                self.write(&out).await
            }
            b"ERROR" => Err(self.peer_error(rest)),
            other => {
                tracing::debug!(peer = %self.peer, command = %String::from_utf8_lossy(other), "zmtp: command skipped");
                Ok(())
            }
        }
    }

    /// A command frame's name and the bytes after it.
    fn parse_command<'f>(&self, frame: &'f Frame) -> Result<(&'f [u8], &'f [u8])> {
        if !frame.command {
            return Err(self.protocol("expected a command frame, got a message frame".into()));
        }
        if frame.more {
            return Err(self.protocol("a command frame with the MORE flag".into()));
        }
        let body = &frame.body;
        let len = usize::from(
            *body
                .first()
                .ok_or_else(|| self.protocol("an empty command".into()))?,
        );
        if body.len() < 1 + len {
            return Err(self.protocol("a command name longer than its frame".into()));
        }
        Ok((&body[1..1 + len], &body[1 + len..]))
    }

    /// The Socket-Type property of a READY command's properties.
    fn socket_type(&self, mut props: &[u8]) -> Result<String> {
        let malformed = || self.protocol("malformed READY properties".into());
        let mut socket_type = None;
        while let Some((&name_len, rest)) = props.split_first() {
            let name_len = usize::from(name_len);
            let name = rest.get(..name_len).ok_or_else(malformed)?;
            let rest = &rest[name_len..];
            let value_len: [u8; 4] = rest
                .get(..4)
                .ok_or_else(malformed)?
                .try_into()
                .expect("4 bytes");
            let value_len = u32::from_be_bytes(value_len) as usize;
            let value = rest
                .get(4..4 + value_len.min(rest.len()))
                .filter(|v| v.len() == value_len)
                .ok_or_else(malformed)?;
            if name.eq_ignore_ascii_case(b"Socket-Type") {
                socket_type = Some(String::from_utf8_lossy(value).into_owned());
            }
            props = &rest[4 + value_len..];
        }
        socket_type.ok_or_else(|| self.protocol("READY without a Socket-Type".into()))
    }

    fn peer_error(&self, rest: &[u8]) -> Error {
        let len = rest.first().map_or(0, |&l| usize::from(l));
        let reason = rest.get(1..1 + len).unwrap_or(&rest[rest.len().min(1)..]);
        Error::Refused {
            peer: self.peer.clone(),
            reason: format!("ZMTP ERROR: {}", String::from_utf8_lossy(reason)),
        }
    }

    async fn read_frame(&mut self, cap: usize, what: &str) -> Result<Frame> {
        let flags = match self.io.read_u8().await {
            Ok(flags) => flags,
            Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(Error::Closed {
                    peer: self.peer.clone(),
                })
            }
            Err(err) => return Err(Error::io("read a ZMTP frame", &self.peer, err)),
        };
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(self.protocol(format!(
                "a frame with reserved flag bits set ({flags:#04x})"
            )));
        }
        let len = if flags & FLAG_LONG != 0 {
            let mut len = [0u8; 8];
            self.read_exact(&mut len).await?;
            u64::from_be_bytes(len)
        } else {
            let mut len = [0u8; 1];
            self.read_exact(&mut len).await?;
            u64::from(len[0])
        };
        let command = flags & FLAG_COMMAND != 0;
        let cap = if command { MAX_COMMAND } else { cap };
        if len > cap as u64 {
            return Err(self.protocol(format!(
                "a {} frame of {len} bytes, over the {cap}-byte cap",
                if command { "command" } else { what }
            )));
        }
        // Grows with what arrives, never to more than `len` (at most `cap`).
        let mut body = Vec::with_capacity((len as usize).min(8192));
        (&mut self.io)
            .take(len)
            .read_to_end(&mut body)
            .await
            .map_err(|err| Error::io("read a ZMTP frame", &self.peer, err))?;
        if body.len() as u64 != len {
            return Err(Error::Truncated {
                peer: self.peer.clone(),
            });
        }
        Ok(Frame {
            more: flags & FLAG_MORE != 0,
            command,
            body,
        })
    }

    async fn read_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        match self.io.read_exact(buf).await {
            Ok(_) => Ok(()),
            Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => Err(Error::Truncated {
                peer: self.peer.clone(),
            }),
            Err(err) => Err(Error::io("read from a ZMTP peer", &self.peer, err)),
        }
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let io = self.io.get_mut();
        io.write_all(bytes)
            .await
            .map_err(|err| Error::io("write to a ZMTP peer", &self.peer, err))?;
        io.flush()
            .await
            .map_err(|err| Error::io("write to a ZMTP peer", &self.peer, err))
    }

    fn protocol(&self, reason: String) -> Error {
        Error::Protocol {
            peer: self.peer.clone(),
            reason: format!("ZMTP: {reason}"),
        }
    }
}

/// Appends a READY property.
fn put_property(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(value.len() as u32).to_be_bytes());
    out.extend_from_slice(value);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    async fn pair() -> (
        Connection<tokio::io::DuplexStream>,
        Connection<tokio::io::DuplexStream>,
    ) {
        let (a, b) = duplex(1 << 16);
        let client =
            Connection::handshake(a, "router".into(), SocketType::Req, &[SocketType::Router]);
        let server = Connection::handshake(
            b,
            "req".into(),
            SocketType::Router,
            &[SocketType::Req, SocketType::Dealer],
        );
        let (client, server) = tokio::join!(client, server);
        (client.unwrap(), server.unwrap())
    }

    #[tokio::test]
    async fn messages_go_both_ways_with_pings_between() {
        let (mut client, mut server) = pair().await;
        client.send(&[b"hello"]).await.unwrap();
        assert_eq!(server.recv(&[16]).await.unwrap(), vec![b"hello".to_vec()]);
        // A PING before the next request is answered with a PONG carrying its context,
        // which the client skips before the reply.
        let mut ping = Vec::new();
        put_frame(&mut ping, FLAG_COMMAND, &command("PING", b"\x00\x0actx"));
        client.write(&ping).await.unwrap();
        client.send(&[b"again"]).await.unwrap();
        assert_eq!(server.recv(&[16]).await.unwrap(), vec![b"again".to_vec()]);
        let big = vec![7u8; 1000];
        server.send(&[&big, b"t"]).await.unwrap();
        assert_eq!(
            client.recv(&[1000, 8]).await.unwrap(),
            vec![big, b"t".to_vec()]
        );
        drop(client);
        assert!(matches!(
            server.recv(&[16]).await,
            Err(Error::Closed { .. })
        ));
    }

    #[tokio::test]
    async fn a_part_over_its_cap_or_too_many_parts_is_refused() {
        let (mut client, mut server) = pair().await;
        client.send(&[&[0u8; 17]]).await.unwrap();
        let err = server.recv(&[16]).await.unwrap_err().to_string();
        assert!(err.contains("17 bytes, over the 16-byte cap"), "{err}");

        let (mut client, mut server) = pair().await;
        client.send(&[b"a", b"b"]).await.unwrap();
        let err = server.recv(&[16]).await.unwrap_err().to_string();
        assert!(err.contains("more than 1 parts"), "{err}");

        let (mut client, mut server) = pair().await;
        let mut raw = Vec::new();
        put_frame(&mut raw, 0, b"no delimiter");
        client.write(&raw).await.unwrap();
        let err = server.recv(&[16]).await.unwrap_err().to_string();
        assert!(err.contains("empty delimiter"), "{err}");
    }

    #[tokio::test]
    async fn a_wrong_socket_type_is_refused_with_an_error_command() {
        let (a, b) = duplex(1 << 16);
        let client = Connection::handshake(
            a,
            "router".into(),
            SocketType::Dealer,
            &[SocketType::Router],
        );
        let server = Connection::handshake(b, "req".into(), SocketType::Router, &[SocketType::Req]);
        let (client, server) = tokio::join!(client, server);
        let err = server.err().unwrap().to_string();
        assert!(
            err.contains("ROUTER socket does not talk to a DEALER"),
            "{err}"
        );
        let mut client = client.unwrap();
        let err = client.recv(&[16]).await.err().unwrap().to_string();
        assert!(err.contains("ZMTP ERROR: a ROUTER socket"), "{err}");
    }

    #[tokio::test]
    async fn greetings_of_other_protocols_are_refused() {
        for (bytes, expect) in [
            (vec![0u8; 64], "not a ZMTP 3 peer"),
            (
                [&[0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 2, 0][..], &[0; 52]].concat(),
                "ZMTP 2.0",
            ),
            (
                [
                    &[0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 1][..],
                    b"CURVE",
                    &[0; 47],
                ]
                .concat(),
                "\"CURVE\"",
            ),
        ] {
            let (mut a, b) = duplex(1 << 16);
            a.write_all(&bytes).await.unwrap();
            let err = Connection::handshake(b, "p".into(), SocketType::Router, &[SocketType::Req])
                .await
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains(expect), "{err}");
        }
    }

    #[tokio::test]
    async fn a_huge_declared_frame_is_refused_before_reading_it() {
        let (mut a, b) = duplex(1 << 16);
        let mut hello = greeting().to_vec();
        let mut props = Vec::new();
        put_property(&mut props, "Socket-Type", b"REQ");
        put_frame(&mut hello, FLAG_COMMAND, &command("READY", &props));
        hello.push(FLAG_MORE | FLAG_LONG);
        hello.extend_from_slice(&u64::MAX.to_be_bytes());
        a.write_all(&hello).await.unwrap();
        let mut server =
            Connection::handshake(b, "p".into(), SocketType::Router, &[SocketType::Req])
                .await
                .unwrap();
        let err = server.recv(&[16]).await.unwrap_err().to_string();
        assert!(err.contains("18446744073709551615 bytes"), "{err}");
    }

    #[tokio::test]
    async fn malformed_ready_properties_are_refused() {
        for props in [
            &b"\x0bSocket-Type\x00\x00\x00\x09REQ"[..],
            b"\x20Socket",
            b"\x08Identity\x00\x00\x00\x00",
        ] {
            let (mut a, b) = duplex(1 << 16);
            let mut hello = greeting().to_vec();
            put_frame(&mut hello, FLAG_COMMAND, &command("READY", props));
            a.write_all(&hello).await.unwrap();
            let err = Connection::handshake(b, "p".into(), SocketType::Router, &[SocketType::Req])
                .await
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains("READY"), "{err}");
        }
    }
}

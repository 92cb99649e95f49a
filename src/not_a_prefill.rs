//! What decode says when the address it was given (`--prefill`) answers its Hello with
//! something other than a prefill's control channel: what it reached, as far as the first
//! bytes tell, and what was expected, with the address to use instead.

use std::net::SocketAddr;

use crate::error::Error;
use crate::protocol::PROTOCOL_VERSION;

/// How the peer at `--prefill` failed to answer as a prefill's control channel.
#[derive(Debug)]
pub enum Answer<'a> {
    /// It closed the connection without sending a byte.
    ClosedSilently,
    /// It sent bytes that are not a control-channel frame (the connector's reason).
    NotAFrame(&'a str),
}

/// The error for `addr`, which gave `answer` to decode's Hello; `first_bytes` are the
/// first bytes it sent (at most a frame header's).
pub fn not_a_prefill(addr: SocketAddr, answer: Answer<'_>, first_bytes: &[u8]) -> Error {
    let expected = format!(
        "decode expected a Welcome from a prefill's control channel (length-prefixed \
         MessagePack frames of the demo's control protocol, version {PROTOCOL_VERSION})"
    );
    let hint = "point --prefill at the address the prefill prints as `listening on ADDR` \
                (its --listen), not at its connector side channel (`side channel ADDR`) or \
                another service";
    let message = match answer {
        Answer::ClosedSilently => format!(
            "{addr} closed the connection without answering decode's Hello: either the \
             prefill there stopped, or {addr} is not a prefill's control channel (a prefill's \
             connector side channel, for one, closes on a Hello). {expected}; {hint}"
        ),
        Answer::NotAFrame(reason) => format!(
            "{addr} is not a prefill's control channel: {} ({reason}). {expected}; {hint}",
            what_it_sent(first_bytes)
        ),
    };
    Error::NotAPrefill(message)
}

/// What the first bytes a peer sent suggest it is, and the bytes.
fn what_it_sent(first_bytes: &[u8]) -> String {
    let shown: Vec<String> = first_bytes.iter().map(|b| format!("{b:02x}")).collect();
    let bytes = format!(
        "its first bytes, {}, are no control-channel frame",
        shown.join(" ")
    );
    if first_bytes.starts_with(b"HTTP") {
        format!("it answered in HTTP, so it is a web server; {bytes}")
    } else if first_bytes.first() == Some(&0xff) {
        format!(
            "it sent what looks like a ZeroMQ greeting, so it is a ZMQ socket, such as the \
             side channel of a connector speaking vLLM's protocol; {bytes}"
        )
    } else if first_bytes.is_empty() {
        "it sent nothing decode could read as a frame".to_string()
    } else {
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_what_the_first_bytes_suggest() {
        assert!(what_it_sent(b"HTTP").starts_with("it answered in HTTP"));
        assert!(what_it_sent(&[0xff, 0, 0, 0]).contains("ZeroMQ greeting"));
        assert_eq!(
            what_it_sent(&[1, 2]),
            "its first bytes, 01 02, are no control-channel frame"
        );
    }
}

//! A request's capability (native protocol): a random 128-bit token that a prefill draws
//! for each request it holds for a decode and hands out only in the request's transfer
//! params ([`KvTransferParams::remote_capability`](crate::KvTransferParams::remote_capability)).
//!
//! A finish notification or a heartbeat for the request counts only with a tag made under
//! it: HMAC-SHA256 keyed by the capability, over what the message says (finish or heartbeat,
//! the request, the reader count) and the sending agent's name. Whoever did not get the
//! params (another reader that handshook, an agent that took a reader's name) cannot make
//! one, and whoever sees one tag cannot make another (a heartbeat's tag never frees a
//! request). Tags are checked in constant time.

use ring::hmac;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::transport::auth::random_bytes;

/// Bytes of a capability.
pub const CAPABILITY_BYTES: usize = 16;

/// Characters of a tag in a notification: the hex of HMAC-SHA256's 32 bytes.
pub(crate) const TAG_HEX_CHARS: usize = 64;

/// What a finish notification's tag covers first.
const FINISH_LABEL: &[u8] = b"nixl-connector finish v1";

/// What a heartbeat's tag covers first.
const HEARTBEAT_LABEL: &[u8] = b"nixl-connector heartbeat v1";

/// A request's capability. Its `Debug` shows no byte of it; it travels as 32 hex digits.
#[derive(Clone)]
pub struct Capability {
    bytes: [u8; CAPABILITY_BYTES],
    /// The HMAC key of `bytes`, made once: every tag made or checked uses it.
    key: hmac::Key,
}

impl PartialEq for Capability {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Capability {}

impl std::fmt::Debug for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Capability(<redacted>)")
    }
}

impl Capability {
    /// A fresh random capability from the operating system.
    ///
    /// # Errors
    /// [`Error::Io`] when the operating system gives no randomness.
    pub fn random() -> Result<Self> {
        random_bytes("draw a request capability").map(Capability::of)
    }

    /// The capability in its text form (32 lowercase hex digits), as the params carry it.
    pub fn to_hex(&self) -> String {
        hex(&self.bytes)
    }

    /// The capability of the text `text` (32 hex digits).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for any other text.
    pub fn from_hex(text: &str) -> Result<Self> {
        unhex(text)
            .and_then(|bytes| bytes.try_into().ok())
            .map(Capability::of)
            .ok_or_else(|| {
                Error::invalid(
                    "read a request capability",
                    format!(
                        "{} characters that are not {} hex digits",
                        text.len(),
                        2 * CAPABILITY_BYTES
                    ),
                )
            })
    }

    /// The capability of `bytes`.
    fn of(bytes: [u8; CAPABILITY_BYTES]) -> Self {
        Capability {
            bytes,
            key: hmac::Key::new(hmac::HMAC_SHA256, &bytes),
        }
    }

    /// The tag, in hex, of a finish notification from agent `sender` for `request` saying
    /// `count` readers: the native finish notification is `request:count:tag` (what a
    /// worker sends when its load ends; for engines that notify by themselves).
    pub fn finish_tag(&self, sender: &[u8], request: &str, count: usize) -> String {
        let input = finish_input(sender, request, count);
        hex(hmac::sign(&self.key, &input).as_ref())
    }

    /// Whether `tag` (hex) is the tag of a finish notification from `sender` for `request`
    /// saying `count` (compared in constant time).
    pub(crate) fn verify_finish(
        &self,
        sender: &[u8],
        request: &str,
        count: usize,
        tag: &str,
    ) -> bool {
        let input = finish_input(sender, request, count);
        unhex(tag).is_some_and(|tag| hmac::verify(&self.key, &input, &tag).is_ok())
    }

    /// The tag, in hex, of a heartbeat from agent `sender` for `request`: a native
    /// heartbeat is `HB:` and comma-separated `request#tag` entries (what a worker sends for
    /// its waiting loads; for engines that send heartbeats by themselves).
    pub fn heartbeat_tag(&self, sender: &[u8], request: &str) -> String {
        let input = heartbeat_input(sender, request);
        hex(hmac::sign(&self.key, &input).as_ref())
    }

    /// Whether `tag` (hex) is the tag of a heartbeat from `sender` for `request` (compared
    /// in constant time).
    pub(crate) fn verify_heartbeat(&self, sender: &[u8], request: &str, tag: &str) -> bool {
        let input = heartbeat_input(sender, request);
        unhex(tag).is_some_and(|tag| hmac::verify(&self.key, &input, &tag).is_ok())
    }

    /// The tag, in hex, of a push-mode message of kind `label` from agent `sender` over
    /// `fields` (see [`push_wire`](crate::transport::push_wire)).
    pub(crate) fn push_tag(&self, label: &[u8], sender: &[u8], fields: &[&[u8]]) -> String {
        hex(hmac::sign(&self.key, &push_input(label, sender, fields)).as_ref())
    }

    /// Whether `tag` (hex) is [`push_tag`](Self::push_tag)'s for these (compared in constant
    /// time).
    pub(crate) fn verify_push(
        &self,
        label: &[u8],
        sender: &[u8],
        fields: &[&[u8]],
        tag: &str,
    ) -> bool {
        let input = push_input(label, sender, fields);
        unhex(tag).is_some_and(|tag| hmac::verify(&self.key, &input, &tag).is_ok())
    }
}

impl Serialize for Capability {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Capability {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Capability::from_hex(&text).map_err(serde::de::Error::custom)
    }
}

/// What a finish notification's tag covers: its label, then each field after its length.
fn finish_input(sender: &[u8], request: &str, count: usize) -> Vec<u8> {
    framed(&[
        FINISH_LABEL,
        sender,
        request.as_bytes(),
        &(count as u64).to_be_bytes(),
    ])
}

/// What a heartbeat's tag covers: its label, then each field after its length.
fn heartbeat_input(sender: &[u8], request: &str) -> Vec<u8> {
    framed(&[HEARTBEAT_LABEL, sender, request.as_bytes()])
}

/// What a push-mode message's tag covers: its label, the sender, then each field, each
/// after its length.
fn push_input(label: &[u8], sender: &[u8], fields: &[&[u8]]) -> Vec<u8> {
    let mut parts = vec![label, sender];
    parts.extend_from_slice(fields);
    framed(&parts)
}

fn framed(parts: &[&[u8]]) -> Vec<u8> {
    let mut input = Vec::new();
    for part in parts {
        input.extend_from_slice(&(part.len() as u64).to_be_bytes());
        input.extend_from_slice(part);
    }
    input
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of lowercase or uppercase hex `text`; `None` for an odd length or another
/// character.
fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    text.as_bytes()
        .chunks(2)
        .map(|pair| {
            let digit = |c: u8| (c as char).to_digit(16);
            Some((digit(pair[0])? * 16 + digit(pair[1])?) as u8)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capability_travels_as_hex_and_shows_nothing() {
        let cap = Capability::random().unwrap();
        assert_ne!(cap, Capability::random().unwrap());
        let text = cap.to_hex();
        assert_eq!(text.len(), 2 * CAPABILITY_BYTES);
        assert_eq!(Capability::from_hex(&text).unwrap(), cap);
        assert_eq!(format!("{cap:?}"), "Capability(<redacted>)");
        for bad in ["", "00", &text[1..], &format!("{text}00"), &"zz".repeat(16)] {
            assert!(Capability::from_hex(bad).is_err(), "{bad}");
        }
        let json = serde_json::to_string(&cap).unwrap();
        assert_eq!(serde_json::from_str::<Capability>(&json).unwrap(), cap);
    }

    #[test]
    fn a_tag_holds_only_for_its_kind_sender_request_and_count() {
        let cap = Capability::random().unwrap();
        let tag = cap.finish_tag(b"d0", "req", 2);
        assert_eq!(tag.len(), TAG_HEX_CHARS);
        assert!(cap.verify_finish(b"d0", "req", 2, &tag));
        assert!(cap.verify_finish(b"d0", "req", 2, &tag.to_uppercase()));
        assert!(!cap.verify_finish(b"d1", "req", 2, &tag), "another sender");
        assert!(
            !cap.verify_finish(b"d0", "req2", 2, &tag),
            "another request"
        );
        assert!(!cap.verify_finish(b"d0", "req", 1, &tag), "another count");
        assert!(
            !cap.verify_heartbeat(b"d0", "req", &tag),
            "a finish is no heartbeat"
        );
        assert!(!Capability::random()
            .unwrap()
            .verify_finish(b"d0", "req", 2, &tag));
        assert!(!cap.verify_finish(b"d0", "req", 2, &tag[..62]));
        assert!(!cap.verify_finish(b"d0", "req", 2, ""));
        let beat = cap.heartbeat_tag(b"d0", "req");
        assert!(cap.verify_heartbeat(b"d0", "req", &beat));
        assert!(
            !cap.verify_finish(b"d0", "req", 2, &beat),
            "a heartbeat frees nothing"
        );
        // Fields are framed: a name and a request cannot trade bytes.
        assert!(!cap.verify_heartbeat(b"d", "0req", &beat));
    }
}

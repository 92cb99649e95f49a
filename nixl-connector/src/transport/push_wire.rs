//! Push mode's NIXL notifications in the native protocol, each tagged under the request's
//! [`Capability`] for its sending agent, and parsed strictly (a message from the network:
//! bounded, typed refusals, never a panic):
//!
//! | message | from → to | format |
//! | --- | --- | --- |
//! | registration | decode rank → each prefill rank that writes it | `PUSHREG:` tag `:` MessagePack [`Registration`] |
//! | cancel | decode rank → the same | `PUSHX:` tag `:` the registration again |
//! | end | prefill rank → the registering decode rank | `PUSHED:` decode request id `:` [`PushEnd`] `:` tag |
//!
//! The end `written` is the notification of the WRITE itself, so NIXL delivers it only once
//! the WRITE's bytes are in place; every other end goes alone, once no WRITE for the
//! registration can run.

use serde::{Deserialize, Serialize};

use crate::transport::capability::{Capability, TAG_HEX_CHARS};

/// What every push-mode message starts with (one notification stream takes them all).
pub(crate) const PUSH_PREFIX: &[u8] = b"PUSH";
/// A registration's prefix.
pub(crate) const REGISTRATION_PREFIX: &[u8] = b"PUSHREG:";
/// A cancel's prefix.
pub(crate) const CANCEL_PREFIX: &[u8] = b"PUSHX:";
/// An end's prefix.
pub(crate) const END_PREFIX: &[u8] = b"PUSHED:";

/// Most bytes of a registration message taken; longer ones are refused unparsed.
pub(crate) const MAX_REGISTRATION_BYTES: usize = 1 << 20;
/// Most bytes of a cancel or end message taken.
pub(crate) const MAX_SHORT_MESSAGE_BYTES: usize = 8 << 10;

const REGISTRATION_LABEL: &[u8] = b"nixl-connector push registration v1";
const CANCEL_LABEL: &[u8] = b"nixl-connector push cancel v1";
const END_LABEL: &[u8] = b"nixl-connector push end v1";

/// A decode rank's registration of its blocks for one request with a prefill rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Registration {
    /// The request's id on the prefill (the params' `remote_request_id`).
    pub(crate) request_id: String,
    /// The request's id on the decode (the ends name it).
    pub(crate) decode_request_id: String,
    /// The decode engine's id.
    pub(crate) engine_id: String,
    /// The decode rank's side-channel host and port (the prefill handshakes with it).
    pub(crate) host: String,
    pub(crate) port: u16,
    /// The decode's TP size and this rank's TP rank.
    pub(crate) tp_size: u64,
    pub(crate) tp_rank: u64,
    /// The decode's blocks to write, in token order (each group's in turn).
    pub(crate) block_ids: Vec<u64>,
    /// How many of `block_ids` each KV cache group has; empty: one group.
    pub(crate) group_lens: Vec<u64>,
    /// A cancel's fresh random nonce (64 hex digits; empty in a registration): a prefill
    /// rank that does not hold the request answers `cancelled` with it in place of a tag.
    #[serde(default)]
    pub(crate) nonce: String,
}

/// A fresh nonce for a cancel.
///
/// # Errors
/// When the system's random source fails.
pub(crate) fn fresh_nonce() -> crate::error::Result<String> {
    let bytes: [u8; TAG_HEX_CHARS / 2] = crate::transport::auth::random_bytes("draw a push nonce")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// How an end is proven: by the tag of the request's capability, or, for `cancelled` from
/// a rank that does not hold the request, by the cancel's nonce echoed.
#[derive(Debug, Clone)]
pub(crate) enum EndProof {
    /// The request's capability.
    Capability(Capability),
    /// The cancel's nonce.
    Nonce(String),
}

/// How a prefill rank's part of a registration ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PushEnd {
    /// The WRITE ended well (its own notification).
    Written,
    /// Refused: it does not fit the request the prefill holds (more blocks than it has, a
    /// geometry it cannot write), or the decode rank is not one it writes.
    Refused,
    /// The WRITE (or the handshake before it) failed; NIXL has ended it.
    Failed,
    /// Cancelled by the decode before any WRITE was posted.
    Cancelled,
    /// The prefill no longer holds the request (its lease ended, or it never held it).
    Gone,
}

impl PushEnd {
    /// Its name on the wire.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PushEnd::Written => "written",
            PushEnd::Refused => "refused",
            PushEnd::Failed => "failed",
            PushEnd::Cancelled => "cancelled",
            PushEnd::Gone => "gone",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        [
            PushEnd::Written,
            PushEnd::Refused,
            PushEnd::Failed,
            PushEnd::Cancelled,
            PushEnd::Gone,
        ]
        .into_iter()
        .find(|end| end.as_str() == text)
    }
}

/// Which of the two messages that carry a [`Registration`] one is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegistrationKind {
    /// Write these blocks.
    Register,
    /// Write nothing more of the request (the decode timed out or was aborted); the
    /// registration is repeated so that the prefill can answer its rank.
    Cancel,
}

impl RegistrationKind {
    fn prefix(self) -> &'static [u8] {
        match self {
            RegistrationKind::Register => REGISTRATION_PREFIX,
            RegistrationKind::Cancel => CANCEL_PREFIX,
        }
    }

    fn label(self) -> &'static [u8] {
        match self {
            RegistrationKind::Register => REGISTRATION_LABEL,
            RegistrationKind::Cancel => CANCEL_LABEL,
        }
    }
}

/// A registration message from agent `sender`, tagged under `capability`.
pub(crate) fn registration_message(
    registration: &Registration,
    capability: &Capability,
    sender: &str,
) -> Vec<u8> {
    signed_message(RegistrationKind::Register, registration, capability, sender)
}

/// A cancel of `registration` from agent `sender`, tagged under `capability`.
pub(crate) fn cancel_message(
    registration: &Registration,
    capability: &Capability,
    sender: &str,
) -> Vec<u8> {
    signed_message(RegistrationKind::Cancel, registration, capability, sender)
}

fn signed_message(
    kind: RegistrationKind,
    registration: &Registration,
    capability: &Capability,
    sender: &str,
) -> Vec<u8> {
    // Encoding plain strings and integers into a Vec cannot fail.
    let body = rmp_serde::to_vec_named(registration).unwrap_or_default();
    let tag = capability.push_tag(kind.label(), sender.as_bytes(), &[&body]);
    let prefix = kind.prefix();
    let mut message = Vec::with_capacity(prefix.len() + TAG_HEX_CHARS + 1 + body.len());
    message.extend_from_slice(prefix);
    message.extend_from_slice(tag.as_bytes());
    message.push(b':');
    message.extend_from_slice(&body);
    message
}

/// A registration or cancel as it came, parsed but not yet proven: its tag is checked once
/// the request it names is held ([`SignedRegistration::verify`]).
#[derive(Debug, Clone)]
pub(crate) struct SignedRegistration {
    pub(crate) kind: RegistrationKind,
    pub(crate) registration: Registration,
    tag: String,
    body: Vec<u8>,
}

impl SignedRegistration {
    /// Bytes it takes while it waits.
    pub(crate) fn bytes(&self) -> usize {
        self.body.len() + self.tag.len() + std::mem::size_of::<Self>()
    }

    /// Whether its tag is `capability`'s for `sender` over its kind and body.
    pub(crate) fn verify(&self, capability: &Capability, sender: &[u8]) -> bool {
        capability.verify_push(self.kind.label(), sender, &[&self.body], &self.tag)
    }
}

/// Parses a registration message (`PUSHREG:`).
pub(crate) fn parse_registration(message: &[u8]) -> Result<SignedRegistration, &'static str> {
    parse_signed(RegistrationKind::Register, message)
}

/// Parses a cancel message (`PUSHX:`).
pub(crate) fn parse_cancel(message: &[u8]) -> Result<SignedRegistration, &'static str> {
    parse_signed(RegistrationKind::Cancel, message)
}

fn parse_signed(
    kind: RegistrationKind,
    message: &[u8],
) -> Result<SignedRegistration, &'static str> {
    if message.len() > MAX_REGISTRATION_BYTES {
        return Err("a push registration over 1 MiB");
    }
    let rest = message
        .strip_prefix(kind.prefix())
        .ok_or("not a push registration")?;
    if rest.len() < TAG_HEX_CHARS + 1 || rest[TAG_HEX_CHARS] != b':' {
        return Err("a push registration without its tag");
    }
    let tag = std::str::from_utf8(&rest[..TAG_HEX_CHARS])
        .map_err(|_| "a push registration whose tag is not hex")?;
    let body = &rest[TAG_HEX_CHARS + 1..];
    let registration: Registration =
        rmp_serde::from_slice(body).map_err(|_| "a push registration that does not parse")?;
    let group_total = registration
        .group_lens
        .iter()
        .try_fold(0u64, |sum, &n| sum.checked_add(n));
    if !registration.group_lens.is_empty()
        && group_total != Some(registration.block_ids.len() as u64)
    {
        return Err("a push registration whose group lengths do not add up to its blocks");
    }
    if registration.request_id.is_empty() || registration.decode_request_id.is_empty() {
        return Err("a push registration without its request ids");
    }
    Ok(SignedRegistration {
        kind,
        registration,
        tag: tag.to_string(),
        body: body.to_vec(),
    })
}

/// An end message for decode request `decode_request_id` from agent `sender`.
pub(crate) fn end_message(
    decode_request_id: &str,
    end: PushEnd,
    proof: &EndProof,
    sender: &str,
) -> Vec<u8> {
    let fields: [&[u8]; 2] = [decode_request_id.as_bytes(), end.as_str().as_bytes()];
    let tag = match proof {
        EndProof::Capability(capability) => {
            capability.push_tag(END_LABEL, sender.as_bytes(), &fields)
        }
        EndProof::Nonce(nonce) => nonce.clone(),
    };
    let mut message = END_PREFIX.to_vec();
    message.extend_from_slice(format!("{decode_request_id}:{}:{tag}", end.as_str()).as_bytes());
    message
}

/// An end as it came: the decode request, how it ended, its tag to check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SignedEnd<'a> {
    pub(crate) decode_request_id: &'a str,
    pub(crate) end: PushEnd,
    tag: &'a str,
}

impl SignedEnd<'_> {
    /// Whether its tag is `capability`'s for `sender`, or it is `cancelled` with `nonce`
    /// (a cancel's, non-empty) echoed.
    pub(crate) fn verify(&self, capability: &Capability, sender: &[u8], nonce: &str) -> bool {
        if self.end == PushEnd::Cancelled && !nonce.is_empty() && self.tag == nonce {
            return true;
        }
        let fields: [&[u8]; 2] = [
            self.decode_request_id.as_bytes(),
            self.end.as_str().as_bytes(),
        ];
        capability.verify_push(END_LABEL, sender, &fields, self.tag)
    }
}

/// Parses an end message.
pub(crate) fn parse_end(message: &[u8]) -> Result<SignedEnd<'_>, &'static str> {
    let text = short_text(message, END_PREFIX)?;
    let (rest, tag) = text.rsplit_once(':').ok_or("a push end without its tag")?;
    let (decode_request_id, end) = rest
        .rsplit_once(':')
        .ok_or("a push end without its status")?;
    let end = PushEnd::parse(end).ok_or("a push end of an unknown status")?;
    if decode_request_id.is_empty() || tag.len() != TAG_HEX_CHARS {
        return Err("a push end without a request or a tag");
    }
    Ok(SignedEnd {
        decode_request_id,
        end,
        tag,
    })
}

/// The UTF-8 text of a short message after `prefix`.
fn short_text<'a>(message: &'a [u8], prefix: &[u8]) -> Result<&'a str, &'static str> {
    if message.len() > MAX_SHORT_MESSAGE_BYTES {
        return Err("a push message over 8 KiB");
    }
    let rest = message
        .strip_prefix(prefix)
        .ok_or("not this push message")?;
    std::str::from_utf8(rest).map_err(|_| "a push message that is not UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration() -> Registration {
        Registration {
            request_id: "p-1".into(),
            decode_request_id: "d:1".into(),
            engine_id: "decode".into(),
            host: "127.0.0.1".into(),
            port: 4000,
            tp_size: 1,
            tp_rank: 0,
            block_ids: vec![3, 1, 4],
            group_lens: vec![],
            nonce: String::new(),
        }
    }

    #[test]
    fn messages_round_trip_and_their_tags_bind_sender_and_content() {
        let cap = Capability::random().unwrap();
        let other = Capability::random().unwrap();
        let message = registration_message(&registration(), &cap, "dec-agent");
        let signed = parse_registration(&message).unwrap();
        assert_eq!(signed.registration, registration());
        assert!(signed.verify(&cap, b"dec-agent"));
        assert!(!signed.verify(&cap, b"another-agent"));
        assert!(!signed.verify(&other, b"dec-agent"));
        // A block changed after signing no longer verifies.
        let mut forged = message.clone();
        let last = forged.len() - 1;
        forged[last] ^= 1;
        if let Ok(forged) = parse_registration(&forged) {
            assert!(!forged.verify(&cap, b"dec-agent"));
        }

        let cancel = cancel_message(&registration(), &cap, "dec-agent");
        let parsed = parse_cancel(&cancel).unwrap();
        assert_eq!(parsed.registration, registration());
        assert!(parsed.verify(&cap, b"dec-agent"));
        assert!(!parsed.verify(&cap, b"pf-agent"));
        // A registration's tag does not make a cancel, nor the other way round.
        let swapped = [CANCEL_PREFIX, &message[REGISTRATION_PREFIX.len()..]].concat();
        assert!(!parse_cancel(&swapped).unwrap().verify(&cap, b"dec-agent"));
        assert!(parse_registration(&cancel).is_err());

        let proof = EndProof::Capability(cap.clone());
        let end = end_message("d:1", PushEnd::Written, &proof, "pf-agent");
        let parsed = parse_end(&end).unwrap();
        assert_eq!(
            (parsed.decode_request_id, parsed.end),
            ("d:1", PushEnd::Written)
        );
        assert!(parsed.verify(&cap, b"pf-agent", ""));
        assert!(!parsed.verify(&cap, b"dec-agent", ""));
        // A status changed in flight does not verify.
        let text = String::from_utf8(end)
            .unwrap()
            .replace("written", "refused");
        let parsed = parse_end(text.as_bytes()).unwrap();
        assert!(!parsed.verify(&cap, b"pf-agent", ""));
        // A nonce proves `cancelled` only, and only the cancel's.
        let nonce = fresh_nonce().unwrap();
        let by_nonce = EndProof::Nonce(nonce.clone());
        let cancelled = end_message("d:1", PushEnd::Cancelled, &by_nonce, "pf-agent");
        assert!(parse_end(&cancelled)
            .unwrap()
            .verify(&cap, b"pf-agent", &nonce));
        assert!(!parse_end(&cancelled)
            .unwrap()
            .verify(&cap, b"pf-agent", &fresh_nonce().unwrap()));
        assert!(!parse_end(&cancelled).unwrap().verify(&cap, b"pf-agent", ""));
        let written = end_message("d:1", PushEnd::Written, &by_nonce, "pf-agent");
        assert!(!parse_end(&written)
            .unwrap()
            .verify(&cap, b"pf-agent", &nonce));
    }

    #[test]
    fn malformed_messages_are_refused_without_a_panic() {
        let tag = "0".repeat(TAG_HEX_CHARS);
        let huge = [REGISTRATION_PREFIX, &vec![b'a'; MAX_REGISTRATION_BYTES]].concat();
        let mut bad_groups = registration();
        bad_groups.group_lens = vec![1, 1];
        let cap = Capability::random().unwrap();
        let bad_groups = registration_message(&bad_groups, &cap, "a");
        for message in [
            b"PUSHREG:".to_vec(),
            format!("PUSHREG:{tag}").into_bytes(),
            [format!("PUSHREG:{tag}:").as_bytes(), &[0x91, 0x01]].concat(),
            format!("PUSHREG:{tag}:not msgpack").into_bytes(),
            huge,
            bad_groups,
        ] {
            assert!(parse_registration(&message).is_err());
        }
        for message in [
            "PUSHED:".to_string(),
            "PUSHED:id".to_string(),
            format!("PUSHED:id:{tag}"),
            format!("PUSHED:id:done:{tag}"),
            format!("PUSHED::written:{tag}"),
            "PUSHED:id:written:short".to_string(),
            format!(
                "PUSHED:{}:written:{tag}",
                "x".repeat(MAX_SHORT_MESSAGE_BYTES)
            ),
        ] {
            assert!(parse_end(message.as_bytes()).is_err(), "{message:.40}");
        }
        assert!(parse_end(b"PUSHED:\xff:written:0").is_err());
        for message in ["PUSHX:", "PUSHX:id", &format!("PUSHX:{tag}:")] {
            assert!(parse_cancel(message.as_bytes()).is_err(), "{message}");
        }
    }
}

//! vLLM 0.33's push-mode registration (`NixlPushConnector`): the NIXL notification a decode
//! rank sends each prefill rank once per request, `PUSH_REG:` then a MessagePack map of the
//! decode's identity, its freshly allocated block ids per KV cache group and the prefill's
//! coordinates. The prefill WRITEs into those blocks with the notification
//! `"{request_id}:{prefill TP size}"` (vLLM's done form, read with [`super::notify::parse`]).
//!
//! A prefill matches a registration to the request it holds by exact id, else by the id
//! with vLLM's random suffix (`-` and 8 hex digits) stripped on both sides ([`base_id`]).
//! Parsing is strict and bounded: a message over [`MAX_REGISTRATION_BYTES`] or of more
//! MessagePack values than [`MAX_REGISTRATION_VALUES`] is refused before it is decoded.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// What every registration starts with.
pub const PUSH_REG_PREFIX: &[u8] = b"PUSH_REG:";

/// Most bytes of a registration taken.
pub const MAX_REGISTRATION_BYTES: usize = 1 << 20;

/// Most MessagePack values of a registration taken (each block id is one).
pub const MAX_REGISTRATION_VALUES: usize = 1 << 18;

/// A decode's block ids, as vLLM's registration carries them: one list per KV cache group
/// (vLLM's `BlockIds`), or, from a peer that collapses one group, a flat list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RegisteredBlocks {
    /// One list per KV cache group.
    Groups(Vec<Vec<u64>>),
    /// One group's list.
    Flat(Vec<u64>),
}

impl RegisteredBlocks {
    /// One list per group.
    pub fn groups(&self) -> Vec<Vec<u64>> {
        match self {
            RegisteredBlocks::Groups(groups) => groups.clone(),
            RegisteredBlocks::Flat(ids) => vec![ids.clone()],
        }
    }

    /// How many block ids, in every group.
    pub fn id_count(&self) -> usize {
        match self {
            RegisteredBlocks::Groups(groups) => groups.iter().map(Vec::len).sum(),
            RegisteredBlocks::Flat(ids) => ids.len(),
        }
    }
}

/// vLLM's registration map (its eleven keys, in its order; keys it may add later are
/// skipped when read).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushRegistration {
    /// The request's id on the decode (the WRITE's notification names it).
    pub request_id: String,
    /// The decode engine's id.
    pub decode_engine_id: String,
    /// The decode's side-channel host (a name or an address) and port: the prefill
    /// handshakes with it before it WRITEs.
    pub decode_host: String,
    /// See `decode_host`.
    pub decode_port: u16,
    /// The decode's TP size.
    pub decode_tp_size: u64,
    /// The decode's uncached blocks, per KV cache group.
    pub local_block_ids: RegisteredBlocks,
    /// The prefill engine's id, host, port, TP size and pipeline stages, as the decode's
    /// params named them.
    pub remote_engine_id: String,
    /// See `remote_engine_id`.
    pub remote_host: String,
    /// See `remote_engine_id`.
    pub remote_port: u16,
    /// See `remote_engine_id`.
    pub remote_tp_size: u64,
    /// See `remote_engine_id`.
    pub remote_pp_size: u64,
}

impl PushRegistration {
    /// The notification: [`PUSH_REG_PREFIX`] and the map.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when it does not encode or is over
    /// [`MAX_REGISTRATION_BYTES`].
    pub fn encode(&self) -> Result<Vec<u8>> {
        const OP: &str = "encode a vLLM push registration";
        let map =
            rmp_serde::to_vec_named(self).map_err(|err| Error::invalid(OP, err.to_string()))?;
        let mut message = PUSH_REG_PREFIX.to_vec();
        message.extend_from_slice(&map);
        if message.len() > MAX_REGISTRATION_BYTES {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} bytes, over the {MAX_REGISTRATION_BYTES}-byte limit a prefill of this crate takes",
                    message.len()
                ),
            ));
        }
        Ok(message)
    }

    /// Reads a registration from a peer's notification.
    ///
    /// # Errors
    /// [`Error::Notification`] saying what is wrong: no prefix, over a limit, not one
    /// MessagePack map of the keys' types, an empty request id.
    pub fn parse(message: &[u8]) -> Result<Self> {
        let refuse = |reason: String| Error::Notification { reason };
        let body = message
            .strip_prefix(PUSH_REG_PREFIX)
            .ok_or_else(|| refuse("a push registration starts with \"PUSH_REG:\"".into()))?;
        if message.len() > MAX_REGISTRATION_BYTES {
            return Err(refuse(format!(
                "a push registration of {} bytes, over the {MAX_REGISTRATION_BYTES}-byte limit",
                message.len()
            )));
        }
        let registration: PushRegistration =
            super::msgpack::decode_within(body, MAX_REGISTRATION_VALUES)
                .map_err(|why| refuse(format!("a push registration: {why}")))?;
        if registration.request_id.is_empty() {
            return Err(refuse("a push registration of an empty request_id".into()));
        }
        Ok(registration)
    }
}

/// `request_id` without vLLM's per-request random suffix (`-` and 8 hex digits, either
/// case, at the end), as vLLM's `get_base_request_id`.
pub fn base_id(request_id: &str) -> &str {
    let bytes = request_id.as_bytes();
    match bytes.len().checked_sub(9) {
        Some(at) if bytes[at] == b'-' && bytes[at + 1..].iter().all(u8::is_ascii_hexdigit) => {
            &request_id[..at]
        }
        _ => request_id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration() -> PushRegistration {
        PushRegistration {
            request_id: "cmpl-7-0-1a2b3c4d".into(),
            decode_engine_id: "dc".into(),
            decode_host: "localhost".into(),
            decode_port: 5601,
            decode_tp_size: 1,
            local_block_ids: RegisteredBlocks::Groups(vec![vec![4, 5], vec![9]]),
            remote_engine_id: "pf".into(),
            remote_host: "10.0.0.1".into(),
            remote_port: 5600,
            remote_tp_size: 2,
            remote_pp_size: 1,
        }
    }

    #[test]
    fn a_registration_round_trips_as_an_eleven_key_map() {
        let message = registration().encode().unwrap();
        assert!(message.starts_with(b"PUSH_REG:"));
        // fixmap of 11 entries, the first key "request_id".
        assert_eq!(message[9], 0x8b);
        assert_eq!(&message[10..21], b"\xaarequest_id");
        assert_eq!(PushRegistration::parse(&message).unwrap(), registration());
    }

    #[test]
    fn a_flat_block_list_is_one_group_and_unknown_keys_are_skipped() {
        #[derive(Serialize)]
        struct Newer<'a> {
            request_id: &'a str,
            decode_engine_id: &'a str,
            decode_host: &'a str,
            decode_port: u16,
            decode_tp_size: u64,
            local_block_ids: Vec<u64>,
            remote_engine_id: &'a str,
            remote_host: &'a str,
            remote_port: u16,
            remote_tp_size: u64,
            remote_pp_size: u64,
            a_newer_key: Vec<&'a str>,
        }
        let newer = Newer {
            request_id: "r",
            decode_engine_id: "d",
            decode_host: "h",
            decode_port: 1,
            decode_tp_size: 1,
            local_block_ids: vec![3, 4],
            remote_engine_id: "p",
            remote_host: "h",
            remote_port: 2,
            remote_tp_size: 1,
            remote_pp_size: 1,
            a_newer_key: vec!["x"],
        };
        let mut message = PUSH_REG_PREFIX.to_vec();
        message.extend(rmp_serde::to_vec_named(&newer).unwrap());
        let got = PushRegistration::parse(&message).unwrap();
        assert_eq!(got.local_block_ids.groups(), vec![vec![3, 4]]);
        assert_eq!(got.local_block_ids.id_count(), 2);
    }

    #[test]
    fn malformed_registrations_are_refused_with_the_reason() {
        let good = registration().encode().unwrap();
        let mut cut = good.clone();
        cut.truncate(good.len() - 3);
        let mut long = PUSH_REG_PREFIX.to_vec();
        long.resize(MAX_REGISTRATION_BYTES + 1, 0xc0);
        let mut empty_id = registration();
        empty_id.request_id.clear();
        for (message, expect) in [
            (b"PUSH_RE".to_vec(), "starts with"),
            (cut, "cut short"),
            (long, "over the"),
            (b"PUSH_REG:\x92\x01\x02".to_vec(), "push registration"),
            (empty_id.encode().unwrap(), "empty request_id"),
        ] {
            let err = PushRegistration::parse(&message).unwrap_err().to_string();
            assert!(err.contains(expect), "{expect}: {err}");
        }
    }

    #[test]
    fn the_base_id_strips_vllms_random_suffix_only() {
        assert_eq!(base_id("cmpl-7-0-1a2b3c4d"), "cmpl-7-0");
        assert_eq!(base_id("cmpl-7-0-1A2B3C4D"), "cmpl-7-0");
        assert_eq!(base_id("cmpl-7-0-1a2b3c4"), "cmpl-7-0-1a2b3c4");
        assert_eq!(base_id("cmpl-7-0-1a2b3c4g"), "cmpl-7-0-1a2b3c4g");
        assert_eq!(base_id("-1a2b3c4d"), "");
        assert_eq!(base_id("1a2b3c4d"), "1a2b3c4d");
        assert_eq!(base_id("é-1a2b3c4d"), "é");
    }
}

//! The decode notifications' wire format, both protocols': a reader's finish notification
//! (`request:count`, native: `request:count:tag`) and heartbeats (`HB:` and comma-separated
//! request ids, native: each `id#tag`), how a decode makes them and how a prefill parses
//! them, strictly. Tags are of the request's [`Capability`].

use crate::config::Protocol;
use crate::transport::capability::{Capability, TAG_HEX_CHARS};

/// Largest reader TP a notification may claim.
pub(crate) const MAX_READER_TP: usize = 1 << 12;

/// Heartbeat messages start with this (vLLM's format: `HB:` and comma-separated remote
/// request ids; in the native protocol each id is followed by `#` and its tag).
pub(crate) const HEARTBEAT_PREFIX: &str = "HB:";

/// What separates a request id from its tag in a native heartbeat.
pub(crate) const TAG_SEPARATOR: char = '#';

/// Longest heartbeat message this connector sends; a decode splits longer lists. Heartbeats
/// taken have no such bound: vLLM's `_send_heartbeats` sends one message per engine naming
/// every request it waits for, so they are bounded only by what NIXL delivers (its UCX
/// notifications have no size limit; the agent's notification hub holds at most 64 MiB).
pub(crate) const MAX_HEARTBEAT_BYTES: usize = 16 << 10;

/// Longest request id a heartbeat may name (that of vLLM's
/// [`NotificationLimits`](crate::vllm::NotificationLimits)); a heartbeat naming a longer
/// one is refused whole.
pub(crate) const MAX_HEARTBEAT_ID_BYTES: usize = 4096;

/// The notification message a reader sends for `request_id`: `request:count`, `count` its
/// TP size (native protocol) or how many of its ranks notify each prefill rank (vLLM's
/// `local_consumers`); in the native protocol followed by `:` and the tag of `proof`'s
/// capability for the sending agent (`proof`'s name).
pub(crate) fn notification_message(
    request_id: &str,
    count: usize,
    proof: Option<(&Capability, &str)>,
) -> Vec<u8> {
    match proof {
        Some((capability, sender)) => {
            let tag = capability.finish_tag(sender.as_bytes(), request_id, count);
            format!("{request_id}:{count}:{tag}").into_bytes()
        }
        None => format!("{request_id}:{count}").into_bytes(),
    }
}

/// The heartbeat entries for remote requests `ids` (vLLM's `_send_heartbeats` names the ids
/// alone): in the native protocol (`proofs` given: each id's capability, in order, and the
/// sending agent's name) each id followed by `#` and its tag, and an id without a
/// capability left out (no prefill would count it). An id that is empty, holds a comma or is
/// longer than a heartbeat's ids may be is left out (it could not be parsed).
pub(crate) fn heartbeat_entries<'a>(
    ids: impl IntoIterator<Item = &'a str>,
    proofs: Option<(&[Option<Capability>], &str)>,
) -> Vec<String> {
    let mut entries = Vec::new();
    for (i, id) in ids.into_iter().enumerate() {
        if id.is_empty() || id.contains(',') || id.len() > MAX_HEARTBEAT_ID_BYTES {
            tracing::warn!(
                request = id,
                "a remote request id that a heartbeat cannot carry; its lease is not extended"
            );
            continue;
        }
        match proofs {
            None => entries.push(id.to_string()),
            Some((capabilities, sender)) => match capabilities.get(i).and_then(Option::as_ref) {
                Some(capability) => {
                    let tag = capability.heartbeat_tag(sender.as_bytes(), id);
                    entries.push(format!("{id}{TAG_SEPARATOR}{tag}"));
                }
                None => tracing::warn!(
                    request = id,
                    "a remote request without a capability in its params; its lease is not extended"
                ),
            },
        }
    }
    entries
}

/// The heartbeat messages for `entries` ([`heartbeat_entries`]): `HB:` and the entries
/// separated by commas, split so that none is longer than [`MAX_HEARTBEAT_BYTES`].
pub(crate) fn heartbeat_messages(entries: &[String]) -> Vec<Vec<u8>> {
    let mut messages = Vec::new();
    let mut current = String::from(HEARTBEAT_PREFIX);
    for entry in entries {
        let separator = usize::from(current.len() > HEARTBEAT_PREFIX.len());
        if current.len() + separator + entry.len() > MAX_HEARTBEAT_BYTES {
            messages
                .push(std::mem::replace(&mut current, String::from(HEARTBEAT_PREFIX)).into_bytes());
        }
        if current.len() > HEARTBEAT_PREFIX.len() {
            current.push(',');
        }
        current.push_str(entry);
    }
    if current.len() > HEARTBEAT_PREFIX.len() {
        messages.push(current.into_bytes());
    }
    messages
}

/// A notification as parsed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Note<'a> {
    /// A reader is done with `request` (it read it, or never will); `count` is its TP
    /// size (native protocol) or how many readers notify (vLLM's); `tag`, in the native
    /// protocol, its capability's tag.
    Done {
        request: &'a str,
        count: usize,
        tag: Option<&'a str>,
    },
    /// A decode still waits for these requests: their entries, comma-separated, each
    /// checked (non-empty, at most [`MAX_HEARTBEAT_ID_BYTES`] and, in the native protocol,
    /// a tag).
    Heartbeat(&'a str),
}

/// Parses a notification strictly: `HB:` and non-empty comma-separated ids of at most
/// [`MAX_HEARTBEAT_ID_BYTES`] each (vLLM's `_handle_heartbeat` format, of any length; in
/// the native protocol each id followed by `#` and its tag), or `request:count` with a
/// non-empty request and a count of 1 to [`MAX_READER_TP`] (in the native protocol followed
/// by `:` and its tag); why not, otherwise. It allocates nothing: a heartbeat's ids are
/// read from the message.
pub(crate) fn parse(message: &[u8], protocol: Protocol) -> Result<Note<'_>, &'static str> {
    let text = std::str::from_utf8(message).map_err(|_| "not UTF-8")?;
    if let Some(ids) = text.strip_prefix(HEARTBEAT_PREFIX) {
        for entry in ids.split(',') {
            let id = match protocol {
                Protocol::Native => {
                    split_tag(entry, TAG_SEPARATOR)
                        .ok_or("a heartbeat's request id without its capability tag")?
                        .0
                }
                Protocol::Vllm => entry,
            };
            if id.is_empty() {
                return Err("heartbeat with an empty request id");
            }
            if id.len() > MAX_HEARTBEAT_ID_BYTES {
                return Err("heartbeat with a request id over 4096 bytes");
            }
        }
        return Ok(Note::Heartbeat(ids));
    }
    let (text, tag) = match protocol {
        Protocol::Native => {
            let (text, tag) =
                split_tag(text, ':').ok_or("a finish notification without its capability tag")?;
            (text, Some(tag))
        }
        Protocol::Vllm => (text, None),
    };
    let (request, tp) = text
        .rsplit_once(':')
        .ok_or("neither `request:tp` nor `HB:ids`")?;
    let count = tp
        .parse::<usize>()
        .ok()
        .filter(|tp| (1..=MAX_READER_TP).contains(tp))
        .ok_or("the reader count is not a number from 1 to 4096")?;
    if request.is_empty() {
        return Err("empty request id");
    }
    Ok(Note::Done {
        request,
        count,
        tag,
    })
}

/// `text` split at its last `separator` into what comes before and a tag of
/// [`TAG_HEX_CHARS`] characters after it.
pub(crate) fn split_tag(text: &str, separator: char) -> Option<(&str, &str)> {
    text.rsplit_once(separator)
        .filter(|(_, tag)| tag.len() == TAG_HEX_CHARS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm(message: &[u8]) -> Result<Note<'_>, &'static str> {
        parse(message, Protocol::Vllm)
    }

    fn native(message: &[u8]) -> Result<Note<'_>, &'static str> {
        parse(message, Protocol::Native)
    }

    #[test]
    fn notifications_are_parsed_strictly() {
        assert_eq!(
            vllm(b"req-1:2"),
            Ok(Note::Done {
                request: "req-1",
                count: 2,
                tag: None
            })
        );
        assert_eq!(
            vllm(b"a:b:1"),
            Ok(Note::Done {
                request: "a:b",
                count: 1,
                tag: None
            })
        );
        assert_eq!(vllm(b"HB:a,b"), Ok(Note::Heartbeat("a,b")));
        for bad in [
            &b"HB:"[..],
            b"HB:a,,b",
            b"HB:a,",
            b"req",
            b":1",
            b"r:0",
            b"r:-1",
            b"r:4097",
            b"r:99999999999999999999999",
            b"\xff:1",
        ] {
            assert!(vllm(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        // vLLM sends one heartbeat of any length; each id has a cap.
        let ids = vec!["r".repeat(48); 5000].join(",");
        let long = format!("HB:{ids}");
        assert_eq!(vllm(long.as_bytes()), Ok(Note::Heartbeat(ids.as_str())));
        let id = "x".repeat(MAX_HEARTBEAT_ID_BYTES);
        assert!(vllm(format!("HB:a,{id}").as_bytes()).is_ok());
        assert!(vllm(format!("HB:a,{id}x").as_bytes()).is_err());
    }

    #[test]
    fn native_notifications_carry_their_capability_tag() {
        let cap = Capability::random().unwrap();
        let message = notification_message("a:b", 2, Some((&cap, "d0")));
        let tag = cap.finish_tag(b"d0", "a:b", 2);
        assert_eq!(message, format!("a:b:2:{tag}").into_bytes());
        assert_eq!(
            native(&message),
            Ok(Note::Done {
                request: "a:b",
                count: 2,
                tag: Some(&tag)
            })
        );
        // Without a tag, or with a tag of another length: refused before anything counts.
        for bad in [
            &b"r:1"[..],
            b"a:b:1",
            format!("r:1:{}", &tag[1..]).as_bytes(),
        ] {
            assert!(native(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        let entries = heartbeat_entries(
            ["r1", "r2", "r3"],
            Some((&[Some(cap.clone()), None, Some(cap.clone())], "d0")),
        );
        assert_eq!(entries.len(), 2, "an id without a capability is not sent");
        let beat = format!("HB:{}", entries.join(","));
        assert_eq!(native(beat.as_bytes()), Ok(Note::Heartbeat(&beat[3..])));
        assert!(native(b"HB:r1").is_err(), "an id without its tag");
        assert!(native(format!("HB:{},r2", entries[0]).as_bytes()).is_err());
        assert_eq!(
            heartbeat_entries(["r1"], None),
            ["r1"],
            "vLLM's: the ids alone"
        );
    }

    #[test]
    fn heartbeats_are_split_and_parse_back() {
        let ids: Vec<String> = (0..5000).map(|i| format!("request-{i}")).collect();
        let entries = heartbeat_entries(ids.iter().map(String::as_str).chain(["", "a,b"]), None);
        let messages = heartbeat_messages(&entries);
        assert!(messages.len() > 1);
        let mut back = Vec::new();
        for m in &messages {
            assert!(m.len() <= MAX_HEARTBEAT_BYTES);
            match parse(m, Protocol::Vllm).unwrap() {
                Note::Heartbeat(got) => back.extend(got.split(',').map(String::from)),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            back, ids,
            "every id once, in order; the unsendable ones left out"
        );
        assert!(heartbeat_messages(&[]).is_empty());
    }
}

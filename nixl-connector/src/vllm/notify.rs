//! The NIXL notifications vLLM's decode sends its prefill (UTF-8 text):
//! - `"{remote_request_id}:{consumers}"` after its READ of a request's blocks, and alone
//!   for a full prefix-cache hit or an abort: the prefill frees the blocks once all
//!   `consumers` decode ranks reading from it have sent it;
//! - `"HB:" + ",".join(remote_request_ids)`, a heartbeat renewing the requests' leases.
//!
//! Parsing is strict and bounded by [`NotificationLimits`]: it allocates nothing but the
//! list of a heartbeat's ids, which borrow from the message.

use crate::error::{Error, Result};

/// The prefix of a heartbeat.
pub const HEARTBEAT_PREFIX: &str = "HB:";

/// Bounds on a notification from a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotificationLimits {
    /// Longest notification, in bytes.
    pub max_len: usize,
    /// Longest request id, in bytes.
    pub max_request_id: usize,
    /// Most request ids in one heartbeat.
    pub max_heartbeat_ids: usize,
}

impl Default for NotificationLimits {
    /// 1 MiB notifications, 4 KiB request ids, 65536 ids per heartbeat.
    fn default() -> Self {
        NotificationLimits {
            max_len: 1 << 20,
            max_request_id: 4096,
            max_heartbeat_ids: 1 << 16,
        }
    }
}

/// A parsed notification, borrowing its ids from the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmNotification<'a> {
    /// A decode rank is done with the request's blocks; `consumers` ranks will say so.
    Done {
        /// The request's id on the prefill.
        request_id: &'a str,
        /// How many decode ranks read the request from this prefill rank.
        consumers: u32,
    },
    /// Renew the leases of these requests.
    Heartbeat {
        /// The requests' ids on the prefill.
        request_ids: Vec<&'a str>,
    },
}

fn refuse(reason: String) -> Error {
    Error::Notification { reason }
}

/// The first `n` characters of `s`, for quoting a peer's text in an error.
fn quote(s: &str) -> String {
    const SHOWN: usize = 64;
    let shown: String = s.chars().take(SHOWN).collect();
    if shown.len() < s.len() {
        format!("{shown:?}…")
    } else {
        format!("{shown:?}")
    }
}

/// `"{request_id}:{consumers}"`, the notification after a READ, a full prefix hit or an
/// abort.
///
/// # Errors
/// [`Error::Notification`] for an empty id, one starting with `"HB:"` (it would read as a
/// heartbeat), or `consumers` 0.
pub fn encode_done(request_id: &str, consumers: u32) -> Result<Vec<u8>> {
    if request_id.is_empty() {
        return Err(refuse("an empty request id".into()));
    }
    if request_id.starts_with(HEARTBEAT_PREFIX) {
        return Err(refuse(format!(
            "request id {} starts with {HEARTBEAT_PREFIX:?}, so its notification would read as a heartbeat",
            quote(request_id)
        )));
    }
    if consumers == 0 {
        return Err(refuse("consumers must be at least 1".into()));
    }
    Ok(format!("{request_id}:{consumers}").into_bytes())
}

/// `"HB:" + ",".join(request_ids)`.
///
/// # Errors
/// [`Error::Notification`] for no ids, an empty id, or one containing `,`.
pub fn encode_heartbeat<'a>(request_ids: impl IntoIterator<Item = &'a str>) -> Result<Vec<u8>> {
    let mut out = HEARTBEAT_PREFIX.as_bytes().to_vec();
    for (i, id) in request_ids.into_iter().enumerate() {
        if id.is_empty() || id.contains(',') {
            return Err(refuse(format!(
                "request id {} cannot go in a heartbeat (empty, or containing ',')",
                quote(id)
            )));
        }
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(id.as_bytes());
    }
    if out.len() == HEARTBEAT_PREFIX.len() {
        return Err(refuse("a heartbeat needs at least one request id".into()));
    }
    Ok(out)
}

/// Parses a notification from a decode.
///
/// # Errors
/// [`Error::Notification`] saying what is wrong: over a limit, not UTF-8, neither form,
/// an empty or over-long request id, or a consumer count that is not a positive decimal
/// number without leading zeros.
pub fn parse<'a>(bytes: &'a [u8], limits: &NotificationLimits) -> Result<VllmNotification<'a>> {
    if bytes.len() > limits.max_len {
        return Err(refuse(format!(
            "{} bytes, over the {}-byte limit",
            bytes.len(),
            limits.max_len
        )));
    }
    let text = std::str::from_utf8(bytes).map_err(|err| refuse(format!("not UTF-8: {err}")))?;
    let check_id = |id: &str| {
        if id.is_empty() {
            Err(refuse(format!("an empty request id in {}", quote(text))))
        } else if id.len() > limits.max_request_id {
            Err(refuse(format!(
                "a request id of {} bytes, over the {}-byte limit",
                id.len(),
                limits.max_request_id
            )))
        } else {
            Ok(())
        }
    };
    if let Some(ids) = text.strip_prefix(HEARTBEAT_PREFIX) {
        let mut request_ids = Vec::new();
        for id in ids.split(',') {
            if request_ids.len() == limits.max_heartbeat_ids {
                return Err(refuse(format!(
                    "a heartbeat of more than {} request ids",
                    limits.max_heartbeat_ids
                )));
            }
            check_id(id)?;
            request_ids.push(id);
        }
        return Ok(VllmNotification::Heartbeat { request_ids });
    }
    let (request_id, consumers) = text.rsplit_once(':').ok_or_else(|| {
        refuse(format!(
            "{} is neither \"{{request_id}}:{{consumers}}\" nor \"HB:{{ids}}\"",
            quote(text)
        ))
    })?;
    check_id(request_id)?;
    let decimal = !consumers.is_empty()
        && consumers.len() <= 10
        && consumers.bytes().all(|b| b.is_ascii_digit())
        && !consumers.starts_with('0');
    let consumers = decimal
        .then(|| consumers.parse::<u32>().ok())
        .flatten()
        .ok_or_else(|| {
            refuse(format!(
                "consumer count {} in {} is not a positive decimal number",
                quote(consumers),
                quote(text)
            ))
        })?;
    Ok(VllmNotification::Done {
        request_id,
        consumers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(bytes: &[u8]) -> Result<VllmNotification<'_>> {
        parse(bytes, &NotificationLimits::default())
    }

    #[test]
    fn done_and_heartbeats_round_trip() {
        let done = encode_done("cmpl-1:x-0", 2).unwrap();
        assert_eq!(done, b"cmpl-1:x-0:2");
        assert_eq!(
            parsed(&done).unwrap(),
            VllmNotification::Done {
                request_id: "cmpl-1:x-0",
                consumers: 2
            }
        );
        let hb = encode_heartbeat(["a", "b:c", "d"]).unwrap();
        assert_eq!(hb, b"HB:a,b:c,d");
        assert_eq!(
            parsed(&hb).unwrap(),
            VllmNotification::Heartbeat {
                request_ids: vec!["a", "b:c", "d"]
            }
        );
        assert_eq!(
            parsed(b"HB:one").unwrap(),
            VllmNotification::Heartbeat {
                request_ids: vec!["one"]
            }
        );
    }

    #[test]
    fn what_cannot_be_said_is_not_encoded() {
        assert!(encode_done("", 1).is_err());
        assert!(encode_done("HB:x", 1).is_err());
        assert!(encode_done("x", 0).is_err());
        assert!(encode_heartbeat([]).is_err());
        assert!(encode_heartbeat(["a,b"]).is_err());
        assert!(encode_heartbeat(["a", ""]).is_err());
    }

    #[test]
    fn malformed_notifications_are_refused_with_the_reason() {
        for (bytes, expect) in [
            (&b"req"[..], "neither"),
            (b"req:", "consumer count"),
            (b"req:0", "consumer count"),
            (b"req:01", "consumer count"),
            (b"req:+1", "consumer count"),
            (b"req: 1", "consumer count"),
            (b"req:1.0", "consumer count"),
            (b"req:99999999999", "consumer count"),
            (b"req:4294967296", "consumer count"),
            (b":1", "empty request id"),
            (b"HB:", "empty request id"),
            (b"HB:a,,b", "empty request id"),
            (b"\xff\xfe:1", "not UTF-8"),
        ] {
            let err = parsed(bytes).unwrap_err().to_string();
            assert!(err.contains(expect), "{bytes:?}: {err}");
        }
        assert_eq!(
            parsed(b"req:4294967295").unwrap(),
            VllmNotification::Done {
                request_id: "req",
                consumers: u32::MAX
            }
        );
    }

    #[test]
    fn limits_bound_what_is_taken() {
        let limits = NotificationLimits {
            max_len: 64,
            max_request_id: 8,
            max_heartbeat_ids: 3,
        };
        let err = parse(&[b'a'; 65], &limits).unwrap_err().to_string();
        assert!(err.contains("65 bytes"), "{err}");
        let err = parse(b"123456789:1", &limits).unwrap_err().to_string();
        assert!(err.contains("9 bytes"), "{err}");
        let err = parse(b"HB:a,b,c,d", &limits).unwrap_err().to_string();
        assert!(err.contains("more than 3"), "{err}");
        assert!(parse(b"HB:a,b,c", &limits).is_ok());
        // The quoted text in an error is cut short.
        let long = "z".repeat(10_000);
        let err = parsed(long.as_bytes()).unwrap_err().to_string();
        assert!(err.contains("neither"), "{err}");
        assert!(err.len() < 400, "{}", err.len());
    }
}

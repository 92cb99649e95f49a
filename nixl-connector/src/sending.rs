//! The prefill side's held requests: released when the decode notifications arrive or when
//! their abort deadline passes.

use std::collections::HashMap;
use std::time::Instant;

use crate::metrics::SendStats;

/// Most notifications kept for requests not (yet) held, e.g. ones that arrive before the
/// engine's step hands the request over; older ones are dropped past this.
const MAX_EARLY: usize = 1 << 16;

/// The notification message a reader of TP `tp_size` sends for `request_id`.
pub(crate) fn notification_message(request_id: &str, tp_size: usize) -> Vec<u8> {
    format!("{request_id}:{tp_size}").into_bytes()
}

/// Parses [`notification_message`]: the request id and the reader's TP size.
fn parse_notification(message: &[u8]) -> Option<(&str, usize)> {
    let text = std::str::from_utf8(message).ok()?;
    let (request, tp) = text.rsplit_once(':')?;
    Some((request, tp.parse().ok().filter(|&tp| tp > 0)?))
}

#[derive(Debug)]
struct Held {
    deadline: Instant,
    received: usize,
    needed: usize,
}

/// Held requests and early notifications of one rank.
#[derive(Debug)]
pub(crate) struct Sends {
    own_tp: usize,
    held: HashMap<String, Held>,
    early: HashMap<String, (usize, usize)>,
    done: Vec<String>,
    stats: SendStats,
}

impl Sends {
    pub(crate) fn new(own_tp: usize) -> Self {
        Sends {
            own_tp,
            held: HashMap::new(),
            early: HashMap::new(),
            done: Vec::new(),
            stats: SendStats::default(),
        }
    }

    /// Holds `request_id` until its notifications arrive or `deadline`.
    pub(crate) fn hold(&mut self, request_id: String, deadline: Instant) {
        let (received, needed) = self.early.remove(&request_id).unwrap_or((0, 1));
        if received >= needed {
            self.release(request_id, true);
        } else {
            self.held.insert(
                request_id,
                Held {
                    deadline,
                    received,
                    needed,
                },
            );
        }
    }

    /// Counts one decode notification.
    pub(crate) fn notified(&mut self, sender: &[u8], message: &[u8]) {
        let Some((request, reader_tp)) = parse_notification(message) else {
            tracing::warn!(sender = %String::from_utf8_lossy(sender), "notification is not `request:tp`; ignored");
            return;
        };
        let needed = (reader_tp / self.own_tp).max(1);
        if let Some(held) = self.held.get_mut(request) {
            held.received += 1;
            held.needed = needed;
            if held.received >= held.needed {
                self.held.remove(request);
                self.release(request.to_string(), true);
            }
            return;
        }
        if self.early.len() >= MAX_EARLY && !self.early.contains_key(request) {
            tracing::warn!(
                request,
                "too many notifications for requests not held; dropped"
            );
            return;
        }
        let entry = self.early.entry(request.to_string()).or_insert((0, needed));
        entry.0 += 1;
    }

    /// Releases every held request whose deadline has passed.
    pub(crate) fn expire(&mut self, now: Instant) {
        let expired: Vec<String> = self
            .held
            .iter()
            .filter(|(_, held)| held.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let held = self.held.remove(&id);
            tracing::warn!(request = %id, received = held.as_ref().map_or(0, |h| h.received), "no decode read the request before its abort timeout; blocks freed");
            self.release(id, false);
        }
    }

    fn release(&mut self, request_id: String, notified: bool) {
        if notified {
            self.stats.freed_on_notification += 1;
        } else {
            self.stats.freed_on_timeout += 1;
        }
        self.done.push(request_id);
    }

    pub(crate) fn take_done(&mut self) -> Vec<String> {
        std::mem::take(&mut self.done)
    }

    pub(crate) fn stats(&self) -> SendStats {
        self.stats
    }
}

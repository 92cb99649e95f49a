//! The prefill side's held requests: each is released once every decode rank reading it has
//! notified, or when its KV lease ends; heartbeats extend leases.
//!
//! Every notification is peer input: parsed strictly, and whatever it says, memory stays
//! bounded ([`MAX_EARLY`] early notifications, [`MAX_RELEASED`] remembered releases) and no
//! request is released twice.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use crate::config::Protocol;
use crate::geometry::tp_mapping::{TpMapping, MAX_TP_SIZE};
use crate::lease::Lease;
use crate::metrics::series::Series;
use crate::metrics::SendStats;
use crate::transport::readers::Readers;

/// Most notifications kept for requests not (yet) held, e.g. ones that arrive before the
/// engine's step hands the request over; more are dropped, and each is dropped after a
/// lease in any case.
const MAX_EARLY: usize = 1 << 16;

/// Most released request ids remembered, to tell a late or repeated notification from an
/// early one.
const MAX_RELEASED: usize = 1 << 14;

/// Largest reader TP a notification may claim.
const MAX_READER_TP: usize = 1 << 12;

/// Heartbeat messages start with this (vLLM's format: `HB:` and comma-separated remote
/// request ids).
const HEARTBEAT_PREFIX: &str = "HB:";

/// Longest heartbeat message this connector sends; a decode splits longer lists. Heartbeats
/// taken have no such bound: vLLM's `_send_heartbeats` sends one message per engine naming
/// every request it waits for, so they are bounded only by what NIXL delivers (its UCX
/// notifications have no size limit; the agent's notification hub holds at most 64 MiB).
pub(crate) const MAX_HEARTBEAT_BYTES: usize = 16 << 10;

/// Longest request id a heartbeat may name (that of vLLM's
/// [`NotificationLimits`](crate::vllm::NotificationLimits)); a heartbeat naming a longer
/// one is refused whole.
const MAX_HEARTBEAT_ID_BYTES: usize = 4096;

/// The notification message a reader sends for `request_id`: `request:count`, `count` its
/// TP size (native protocol) or how many of its ranks notify each prefill rank (vLLM's
/// `local_consumers`).
pub(crate) fn notification_message(request_id: &str, count: usize) -> Vec<u8> {
    format!("{request_id}:{count}").into_bytes()
}

/// The heartbeat messages for remote requests `ids` (vLLM's `_send_heartbeats`): `HB:` and
/// the ids separated by commas, split so that none is longer than [`MAX_HEARTBEAT_BYTES`].
/// An id that is empty, holds a comma or is longer than a heartbeat's ids may be is left
/// out (it could not be parsed).
pub(crate) fn heartbeat_messages<'a>(ids: impl IntoIterator<Item = &'a str>) -> Vec<Vec<u8>> {
    let mut messages = Vec::new();
    let mut current = String::from(HEARTBEAT_PREFIX);
    for id in ids {
        if id.is_empty() || id.contains(',') || id.len() > MAX_HEARTBEAT_ID_BYTES {
            tracing::warn!(
                request = id,
                "a remote request id that a heartbeat cannot carry; its lease is not extended"
            );
            continue;
        }
        let separator = usize::from(current.len() > HEARTBEAT_PREFIX.len());
        if current.len() + separator + id.len() > MAX_HEARTBEAT_BYTES {
            messages
                .push(std::mem::replace(&mut current, String::from(HEARTBEAT_PREFIX)).into_bytes());
        }
        if current.len() > HEARTBEAT_PREFIX.len() {
            current.push(',');
        }
        current.push_str(id);
    }
    if current.len() > HEARTBEAT_PREFIX.len() {
        messages.push(current.into_bytes());
    }
    messages
}

/// A notification as parsed.
#[derive(Debug, PartialEq, Eq)]
enum Note<'a> {
    /// A reader is done with `request` (it read it, or never will); `count` is its TP
    /// size (native protocol) or how many readers notify (vLLM's).
    Done { request: &'a str, count: usize },
    /// A decode still waits for these requests: their ids, comma-separated, each checked
    /// (non-empty, at most [`MAX_HEARTBEAT_ID_BYTES`]).
    Heartbeat(&'a str),
}

/// Parses a notification strictly: `HB:` and non-empty comma-separated ids of at most
/// [`MAX_HEARTBEAT_ID_BYTES`] each (vLLM's `_handle_heartbeat` format, of any length), or
/// `request:count` with a non-empty request and a count of 1 to [`MAX_READER_TP`]; why not,
/// otherwise. It allocates nothing: a heartbeat's ids are read from the message.
fn parse(message: &[u8]) -> Result<Note<'_>, &'static str> {
    let text = std::str::from_utf8(message).map_err(|_| "not UTF-8")?;
    if let Some(ids) = text.strip_prefix(HEARTBEAT_PREFIX) {
        for id in ids.split(',') {
            if id.is_empty() {
                return Err("heartbeat with an empty request id");
            }
            if id.len() > MAX_HEARTBEAT_ID_BYTES {
                return Err("heartbeat with a request id over 4096 bytes");
            }
        }
        return Ok(Note::Heartbeat(ids));
    }
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
    Ok(Note::Done { request, count })
}

/// What the prefill's notifications did, besides releasing requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotificationStats {
    /// Heartbeat messages accepted.
    pub heartbeats: u64,
    /// Leases a heartbeat extended (one per held request named).
    pub leases_extended: u64,
    /// Request ids in heartbeats that name no held request (ignored).
    pub unknown_heartbeat_ids: u64,
    /// Notifications for requests already released (their lease ended first, or a repeat),
    /// or never held within a lease (ignored).
    pub late_notifications: u64,
    /// Repeated notifications from the same reader for a held request (counted once).
    pub duplicate_notifications: u64,
    /// Notifications that are neither `request:tp` nor a well-formed heartbeat (ignored).
    pub malformed: u64,
    /// Finish notifications refused (ignored): in the native protocol, from an agent that no
    /// handshake with this rank named as a reader, or with a count other than that
    /// reader's TP size; in vLLM's, with more readers than a decode can have.
    pub refused: u64,
}

#[derive(Debug)]
struct Held {
    /// When the lease ends.
    deadline: Instant,
    /// The latest the lease may end ([`Lease::max_hold`] after the hold), if capped.
    limit: Option<Instant>,
    /// The agents that notified (each counts once).
    readers: Vec<Vec<u8>>,
    needed: usize,
}

#[derive(Debug)]
struct Early {
    readers: Vec<Vec<u8>>,
    needed: usize,
    arrived: Instant,
}

/// Held requests and early notifications of one rank.
pub(crate) struct Sends {
    own_tp: usize,
    protocol: Protocol,
    lease: Lease,
    series: Arc<Series>,
    held: HashMap<String, Held>,
    early: HashMap<String, Early>,
    released: HashSet<String>,
    released_order: VecDeque<String>,
    done: Vec<String>,
    stats: SendStats,
    notes: NotificationStats,
    /// The readers this rank's side channel accepted (native protocol).
    readers: Arc<Readers>,
}

impl Sends {
    pub(crate) fn new(
        own_tp: usize,
        protocol: Protocol,
        lease: Lease,
        series: Arc<Series>,
        readers: Arc<Readers>,
    ) -> Self {
        Sends {
            readers,
            own_tp,
            protocol,
            lease,
            series,
            held: HashMap::new(),
            early: HashMap::new(),
            released: HashSet::new(),
            released_order: VecDeque::new(),
            done: Vec::new(),
            stats: SendStats::default(),
            notes: NotificationStats::default(),
        }
    }

    /// Holds `request_id` until its notifications arrive or its lease ends at `deadline`
    /// (at most [`Lease::max_hold`] from `now`, if capped). A request already held keeps its
    /// lease.
    pub(crate) fn hold(&mut self, request_id: String, deadline: Instant, now: Instant) {
        if self.held.contains_key(&request_id) {
            tracing::warn!(request = %request_id, "request is already held; its lease is kept");
            return;
        }
        if self.released.remove(&request_id) {
            self.released_order.retain(|id| *id != request_id);
        }
        let limit = self.lease.max_hold().map(|cap| now + cap);
        let (readers, needed) = self
            .early
            .remove(&request_id)
            .map_or((Vec::new(), 1), |e| (e.readers, e.needed));
        if readers.len() >= needed {
            self.release(request_id, true);
            return;
        }
        let held = Held {
            deadline: limit.map_or(deadline, |limit| deadline.min(limit)),
            limit,
            readers,
            needed,
        };
        self.held.insert(request_id, held);
        self.series.held(self.held.len());
    }

    /// How many requests are held for decodes now.
    pub(crate) fn held_count(&self) -> usize {
        self.held.len()
    }

    /// Takes one notification from agent `sender`.
    pub(crate) fn notified(&mut self, sender: &[u8], message: &[u8], now: Instant) {
        match parse(message) {
            Ok(Note::Heartbeat(ids)) => self.heartbeat(ids, now),
            Ok(Note::Done { request, count }) => {
                if let Err(why) = self.admit(sender, count) {
                    self.notes.refused += 1;
                    self.series.refused_notification();
                    // Logged at the 1st, 2nd, 4th, 8th... so that a flood cannot flood the log.
                    if self.notes.refused.is_power_of_two() {
                        tracing::warn!(sender = %String::from_utf8_lossy(sender), request, count, why, refused = self.notes.refused, "finish notification refused");
                    }
                    return;
                }
                let needed = match self.protocol {
                    Protocol::Native => TpMapping::consumers(count, self.own_tp),
                    Protocol::Vllm => count,
                };
                self.done_reading(sender, request, needed, now);
            }
            Err(why) => {
                self.notes.malformed += 1;
                // Logged at the 1st, 2nd, 4th, 8th... so that a flood cannot flood the log.
                if self.notes.malformed.is_power_of_two() {
                    tracing::warn!(sender = %String::from_utf8_lossy(sender), why, malformed = self.notes.malformed, "malformed notification ignored");
                }
            }
        }
    }

    /// Whether a finish notification from `sender` saying `count` may count. Native: only
    /// from an agent a handshake with this rank named as a reader, and only with that
    /// reader's TP size. vLLM: the prefill never learns its readers' agents (they load its
    /// metadata, not it theirs), so only the count is checked: at most as many readers as
    /// a decode of the largest TP has per rank of this engine.
    fn admit(&self, sender: &[u8], count: usize) -> Result<(), &'static str> {
        match self.protocol {
            Protocol::Native => {
                let reader = self
                    .readers
                    .get(sender)
                    .ok_or("not from a reader that handshook with this rank")?;
                if count != reader.tp_size {
                    return Err("the count is not the reader's TP size");
                }
                Ok(())
            }
            Protocol::Vllm => {
                if count > (MAX_TP_SIZE / self.own_tp.max(1)).max(1) {
                    return Err("more readers than a decode can have per rank of this engine");
                }
                Ok(())
            }
        }
    }

    /// Extends the lease of every held request in `ids` (comma-separated) to
    /// [`Lease::extension`] from now (never shortening it, never past its limit); follows
    /// vLLM's `_handle_heartbeat`.
    fn heartbeat(&mut self, ids: &str, now: Instant) {
        self.notes.heartbeats += 1;
        self.series.heartbeat();
        let until = now + self.lease.extension();
        let mut any_held = false;
        for id in ids.split(',') {
            match self.held.get_mut(id) {
                Some(held) => {
                    let extended = held.deadline.max(until);
                    held.deadline = held.limit.map_or(extended, |limit| extended.min(limit));
                    self.notes.leases_extended += 1;
                    any_held = true;
                }
                None => self.notes.unknown_heartbeat_ids += 1,
            }
        }
        if !any_held {
            self.series.heartbeat_refused();
        }
    }

    /// Counts a reader's notification that it is done with `request` (vLLM's
    /// `_get_new_notifs`; here each reader agent counts once).
    fn done_reading(&mut self, sender: &[u8], request: &str, needed: usize, now: Instant) {
        if let Some(held) = self.held.get_mut(request) {
            if held.readers.iter().any(|r| r == sender) {
                self.notes.duplicate_notifications += 1;
                return;
            }
            held.readers.push(sender.to_vec());
            held.needed = held.needed.max(needed);
            if held.readers.len() >= held.needed {
                self.held.remove(request);
                self.release(request.to_string(), true);
            }
            return;
        }
        if self.released.contains(request) {
            self.late(request, "notification for a request already released (its lease ended first, or a repeat); ignored");
            return;
        }
        if self.early.len() >= MAX_EARLY && !self.early.contains_key(request) {
            self.late(
                request,
                "too many notifications for requests not held; dropped",
            );
            return;
        }
        let early = self.early.entry(request.to_string()).or_insert(Early {
            readers: Vec::new(),
            needed,
            arrived: now,
        });
        if early.readers.iter().any(|r| r == sender) {
            self.notes.duplicate_notifications += 1;
        } else {
            early.readers.push(sender.to_vec());
            early.needed = early.needed.max(needed);
        }
    }

    fn late(&mut self, request: &str, why: &str) {
        self.notes.late_notifications += 1;
        self.series.after_expiry();
        tracing::warn!(request, "{why}");
    }

    /// Releases every held request whose lease has ended (vLLM's
    /// `_reap_expired_send_leases`), and drops early notifications older than a lease.
    pub(crate) fn expire(&mut self, now: Instant) {
        let expired: Vec<String> = self
            .held
            .iter()
            .filter(|(_, held)| held.deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        self.series.expired(expired.len() as u64);
        for id in expired {
            let readers = self.held.remove(&id).map_or(0, |h| h.readers.len());
            tracing::warn!(request = %id, readers, "the request's KV lease ended before every decode rank notified; blocks freed");
            self.release(id, false);
        }
        let lease = self.lease.duration();
        let stale: Vec<String> = self
            .early
            .iter()
            .filter(|(_, early)| now.saturating_duration_since(early.arrived) >= lease)
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            self.early.remove(&id);
            self.late(
                &id,
                "notification for a request that was not held within a lease; dropped",
            );
        }
    }

    fn release(&mut self, request_id: String, notified: bool) {
        if notified {
            self.stats.freed_on_notification += 1;
        } else {
            self.stats.freed_on_timeout += 1;
        }
        self.series.released(notified);
        self.series.held(self.held.len());
        tracing::debug!(request = %request_id, by = if notified { "notification" } else { "lease" }, "request released");
        if self.released_order.len() >= MAX_RELEASED {
            if let Some(oldest) = self.released_order.pop_front() {
                self.released.remove(&oldest);
            }
        }
        self.released.insert(request_id.clone());
        self.released_order.push_back(request_id.clone());
        self.done.push(request_id);
    }

    pub(crate) fn take_done(&mut self) -> Vec<String> {
        std::mem::take(&mut self.done)
    }

    pub(crate) fn stats(&self) -> SendStats {
        self.stats
    }

    pub(crate) fn notification_stats(&self) -> NotificationStats {
        self.notes
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::transport::readers::Reader;

    /// Readers that handshook: `d` and `solo` of TP 1, `d0` and `d1` of TP `tp`.
    fn readers(tp: usize) -> Arc<Readers> {
        let readers = Arc::new(Readers::default());
        for (agent, tp_size) in [("d", 1), ("solo", 1), ("d0", tp), ("d1", tp)] {
            let engine_id = "decode".to_string();
            readers.accept(agent, Reader { engine_id, tp_size });
        }
        readers
    }

    fn sends(own_tp: usize) -> Sends {
        let lease = Lease::new(Duration::from_secs(30))
            .and_then(|lease| lease.with_max_hold(Duration::from_secs(100)))
            .unwrap();
        Sends::new(
            own_tp,
            Protocol::Native,
            lease,
            Arc::new(Series::new("test", 0, None)),
            readers(2),
        )
    }

    #[test]
    fn notifications_are_parsed_strictly() {
        assert_eq!(
            parse(b"req-1:2"),
            Ok(Note::Done {
                request: "req-1",
                count: 2
            })
        );
        assert_eq!(
            parse(b"a:b:1"),
            Ok(Note::Done {
                request: "a:b",
                count: 1
            })
        );
        assert_eq!(parse(b"HB:a,b"), Ok(Note::Heartbeat("a,b")));
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
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        // vLLM sends one heartbeat of any length; each id has a cap.
        let ids = vec!["r".repeat(48); 5000].join(",");
        let long = format!("HB:{ids}");
        assert_eq!(parse(long.as_bytes()), Ok(Note::Heartbeat(ids.as_str())));
        let id = "x".repeat(MAX_HEARTBEAT_ID_BYTES);
        assert!(parse(format!("HB:a,{id}").as_bytes()).is_ok());
        assert!(parse(format!("HB:a,{id}x").as_bytes()).is_err());
    }

    #[test]
    fn heartbeats_are_split_and_parse_back() {
        let ids: Vec<String> = (0..5000).map(|i| format!("request-{i}")).collect();
        let messages = heartbeat_messages(ids.iter().map(String::as_str).chain(["", "a,b"]));
        assert!(messages.len() > 1);
        let mut back = Vec::new();
        for m in &messages {
            assert!(m.len() <= MAX_HEARTBEAT_BYTES);
            match parse(m).unwrap() {
                Note::Heartbeat(got) => back.extend(got.split(',').map(String::from)),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            back, ids,
            "every id once, in order; the unsendable ones left out"
        );
        assert!(heartbeat_messages([]).is_empty());
    }

    #[test]
    fn a_heartbeat_extends_the_lease_by_two_thirds_up_to_its_limit() {
        let mut s = sends(1);
        let t0 = Instant::now();
        s.hold("r".into(), t0 + Duration::from_secs(30), t0);
        s.notified(b"d", b"HB:r,unknown", t0 + Duration::from_secs(25));
        s.expire(t0 + Duration::from_secs(44));
        assert!(s.take_done().is_empty(), "extended to 25 + 20 s");
        s.expire(t0 + Duration::from_secs(45));
        assert_eq!(s.take_done(), ["r"]);
        let notes = s.notification_stats();
        assert_eq!(
            (
                notes.heartbeats,
                notes.leases_extended,
                notes.unknown_heartbeat_ids
            ),
            (1, 1, 1)
        );
        assert_eq!(s.stats().freed_on_timeout, 1);

        // Heartbeats never keep a request past max_hold.
        s.hold("q".into(), t0 + Duration::from_secs(30), t0);
        for at in (20..200).step_by(10) {
            s.notified(b"d", b"HB:q", t0 + Duration::from_secs(at));
        }
        s.expire(t0 + Duration::from_secs(100));
        assert_eq!(s.take_done(), ["q"]);
    }

    #[test]
    fn without_a_cap_heartbeats_keep_a_request_while_they_come() {
        // vLLM's default: no cap (the 480 s one ended leases vLLM's heartbeats kept alive).
        let lease = Lease::default();
        let mut s = Sends::new(
            1,
            Protocol::Vllm,
            lease,
            Arc::new(Series::new("t", 0, None)),
            readers(1),
        );
        let t0 = Instant::now();
        s.hold("r".into(), t0 + Duration::from_secs(30), t0);
        for at in (20..2000).step_by(10) {
            s.notified(b"d", b"HB:r", t0 + Duration::from_secs(at));
            s.expire(t0 + Duration::from_secs(at));
        }
        assert!(s.take_done().is_empty(), "held while heartbeats came");
        s.expire(t0 + Duration::from_secs(1990 + 20));
        assert_eq!(s.take_done(), ["r"], "freed an extension after the last");
    }

    #[test]
    fn a_vllm_notification_says_how_many_readers_notify() {
        let t0 = Instant::now();
        let lease = Lease::default();
        // Prefill TP 2 read by decode TP 4: vLLM's decode says 2 consumers, ours 4 (its TP).
        let series = || Arc::new(Series::new("t", 0, None));
        let mut vllm = Sends::new(2, Protocol::Vllm, lease, series(), readers(4));
        let mut native = Sends::new(2, Protocol::Native, lease, series(), readers(4));
        for (s, message) in [(&mut vllm, &b"r:2"[..]), (&mut native, b"r:4")] {
            s.hold("r".into(), t0 + Duration::from_secs(30), t0);
            s.notified(b"d0", message, t0);
            assert!(s.take_done().is_empty());
            s.notified(b"d1", message, t0);
            assert_eq!(s.take_done(), ["r"]);
        }
    }

    #[test]
    fn each_reader_counts_once_and_nothing_is_released_twice() {
        let mut s = sends(1);
        let t0 = Instant::now();
        s.hold("r".into(), t0 + Duration::from_secs(30), t0);
        s.notified(b"d0", b"r:2", t0);
        s.notified(b"d0", b"r:2", t0);
        assert!(
            s.take_done().is_empty(),
            "a repeat from the same reader counts once"
        );
        s.notified(b"d1", b"r:2", t0);
        assert_eq!(s.take_done(), ["r"]);
        s.notified(b"d1", b"r:2", t0);
        s.expire(t0 + Duration::from_secs(60));
        assert!(s.take_done().is_empty());
        let notes = s.notification_stats();
        assert_eq!(
            (notes.duplicate_notifications, notes.late_notifications),
            (1, 1)
        );

        // Early notifications release at the hold, and go stale after a lease.
        s.notified(b"solo", b"e:1", t0);
        s.hold("e".into(), t0 + Duration::from_secs(30), t0);
        assert_eq!(s.take_done(), ["e"]);
        s.notified(b"solo", b"never:1", t0);
        s.expire(t0 + Duration::from_secs(31));
        assert!(s.early.is_empty());
        assert_eq!(s.notification_stats().late_notifications, 2);
    }

    #[test]
    fn only_readers_count_and_only_with_their_tp() {
        let mut s = sends(1);
        let t0 = Instant::now();
        s.hold("r".into(), t0 + Duration::from_secs(30), t0);
        s.notified(b"third", b"r:1", t0);
        s.notified(b"d0", b"r:4096", t0);
        s.notified(b"d0", b"r:1", t0);
        s.notified(b"d", b"r:4294967295", t0);
        assert!(s.take_done().is_empty(), "the request is still held");
        let notes = s.notification_stats();
        assert_eq!((notes.refused, notes.malformed), (3, 1));
        s.notified(b"d0", b"r:2", t0);
        s.notified(b"d1", b"r:2", t0);
        assert_eq!(s.take_done(), ["r"]);

        // vLLM: a count no decode can have is refused.
        let lease = Lease::default();
        let series = Arc::new(Series::new("t", 0, None));
        let mut vllm = Sends::new(2, Protocol::Vllm, lease, series, readers(1));
        vllm.hold("r".into(), t0 + Duration::from_secs(30), t0);
        vllm.notified(b"anyone", b"r:4096", t0);
        assert_eq!(vllm.notification_stats().refused, 1);
        vllm.notified(b"anyone", b"r:1", t0);
        assert_eq!(vllm.take_done(), ["r"]);
    }
}

//! The prefill side's held requests: each is released once every decode rank reading it has
//! notified, or when its KV lease ends; heartbeats extend leases.
//!
//! Every notification is peer input: parsed strictly, and whatever it says, memory stays
//! bounded ([`MAX_EARLY`] early notifications, [`MAX_RELEASED`] remembered releases) and no
//! request is released twice. In the native protocol a finish notification or a heartbeat
//! counts only with a tag made under the request's [`Capability`], and from an agent that
//! handshook as a reader; vLLM's protocol has neither, and its guard is the side channel's
//! allowlist of peer networks.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use crate::config::Protocol;
use crate::geometry::dcp;
use crate::geometry::tp_mapping::MAX_TP_SIZE;
use crate::lease::Lease;
use crate::metrics::series::Series;
use crate::metrics::SendStats;
use crate::transport::capability::Capability;
use crate::transport::handshake::KeptClaim;
use crate::transport::readers::Readers;
use crate::worker::notification_format::{parse, split_tag, Note, TAG_SEPARATOR};

/// Most notifications kept for requests not (yet) held, e.g. ones that arrive before the
/// engine's step hands the request over; more are dropped, and each is dropped after a
/// lease in any case.
const MAX_EARLY: usize = 1 << 16;

/// Most released request ids remembered, to tell a late or repeated notification from an
/// early one.
const MAX_RELEASED: usize = 1 << 14;

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
    /// Finish notifications and heartbeat entries refused (ignored): in the native
    /// protocol, without a tag of the request's capability, from an agent that no
    /// handshake with this rank named as a reader, or with a count other than that
    /// reader's TP size; in vLLM's, with more readers than a decode can have.
    pub refused: u64,
}

/// Why a held request was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Released {
    /// Every reader notified.
    Notification = 0,
    /// Its lease ended first.
    Lease = 1,
    /// Kept for a read-back, unclaimed, past the cap on kept blocks.
    Eviction = 2,
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
    /// The capability of its params (native protocol; without one only the lease frees it).
    capability: Option<Capability>,
    /// Whether a reader has shown itself (a heartbeat or a finish notification that
    /// counted): then it may be reading, and an eviction leaves it held.
    claimed: bool,
    /// The release marks to raise when it is released, if its params carry a lease epoch.
    marks: Option<Marks>,
    /// Push mode: a WRITE of its blocks is under way, so its lease cannot release it;
    /// NIXL's end of the WRITE does.
    writing: bool,
}

/// The release marks of one held request (see
/// [`ReleaseMarks`](crate::ReleaseMarks)): its blocks' marks are raised to its
/// lease epoch when it is released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Marks {
    /// The lease epoch of the request's params.
    pub(crate) epoch: u64,
    /// The request's blocks.
    pub(crate) block_ids: Vec<usize>,
}

impl Held {
    /// A reader showed itself (a heartbeat or a claim): the lease lasts until `until` at
    /// least (never shortened, never past its limit), and the request is claimed.
    fn extend_for_reader(&mut self, until: Instant) {
        let extended = self.deadline.max(until);
        self.deadline = self.limit.map_or(extended, |limit| extended.min(limit));
        self.claimed = true;
    }
}

/// Finish notifications for a request not held yet: checked against its capability when it
/// is.
#[derive(Debug)]
struct Early {
    /// Each reader that notified, with its tag (native protocol) and count.
    readers: Vec<EarlyReader>,
    arrived: Instant,
}

#[derive(Debug)]
struct EarlyReader {
    sender: Vec<u8>,
    tag: Option<String>,
    count: usize,
    needed: usize,
}

/// Held requests and early notifications of one rank.
pub(crate) struct Sends {
    own_tp: usize,
    /// This engine's DCP size (1: none).
    own_dcp: usize,
    protocol: Protocol,
    lease: Lease,
    series: Arc<Series>,
    held: HashMap<String, Held>,
    early: HashMap<String, Early>,
    released: HashSet<String>,
    released_order: VecDeque<String>,
    done: Vec<String>,
    /// The marks of the requests in `done`, to raise before the engine hears of them.
    to_mark: Vec<Marks>,
    /// The largest epoch marked so far (a new registration's marks start at it).
    marked_up_to: u64,
    stats: SendStats,
    notes: NotificationStats,
    /// The readers this rank's side channel accepted (native protocol).
    readers: Arc<Readers>,
}

impl Sends {
    /// These sends for an engine of DCP size `dcp` (see [`dcp::consumers`]).
    pub(crate) fn with_own_dcp(self, dcp: usize) -> Self {
        Sends {
            own_dcp: dcp,
            ..self
        }
    }

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
            own_dcp: 1,
            protocol,
            lease,
            series,
            held: HashMap::new(),
            early: HashMap::new(),
            released: HashSet::new(),
            released_order: VecDeque::new(),
            done: Vec::new(),
            to_mark: Vec::new(),
            marked_up_to: 0,
            stats: SendStats::default(),
            notes: NotificationStats::default(),
        }
    }

    /// Holds `request_id` until its notifications arrive or its lease ends at `deadline`
    /// (at most [`Lease::max_hold`] from `now`, if capped); in the native protocol only
    /// notifications and heartbeats tagged under `capability` count. Its `marks`, if any,
    /// are raised when it is released. A request already held keeps its lease.
    pub(crate) fn hold(
        &mut self,
        request_id: String,
        (deadline, now): (Instant, Instant),
        capability: Option<Capability>,
        marks: Option<Marks>,
    ) {
        if self.held.contains_key(&request_id) {
            tracing::warn!(request = %request_id, "request is already held; its lease is kept");
            return;
        }
        if self.released.remove(&request_id) {
            self.released_order.retain(|id| *id != request_id);
        }
        let limit = self.lease.max_hold().map(|cap| now + cap);
        let mut readers = Vec::new();
        let mut needed = 1;
        let early = self
            .early
            .remove(&request_id)
            .map_or(Vec::new(), |e| e.readers);
        for early in early {
            let tag = early.tag.as_deref();
            let finished = |cap: &Capability, tag: &str| {
                cap.verify_finish(&early.sender, &request_id, early.count, tag)
            };
            if !proven(self.protocol, capability.as_ref(), tag, finished) {
                self.refuse(
                    &early.sender,
                    &request_id,
                    "an early finish notification without a tag of the request's capability",
                );
                continue;
            }
            readers.push(early.sender);
            needed = needed.max(early.needed);
        }
        if readers.len() >= needed {
            self.release(request_id, Released::Notification, marks);
            return;
        }
        let held = Held {
            deadline: limit.map_or(deadline, |limit| deadline.min(limit)),
            limit,
            claimed: !readers.is_empty(),
            readers,
            needed,
            capability,
            marks,
            writing: false,
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
        match parse(message, self.protocol) {
            Ok(Note::Heartbeat(ids)) => self.heartbeat(sender, ids, now),
            Ok(Note::Done {
                request,
                count,
                tag,
            }) => {
                let (stages, reader_dcp) = match self.admit(sender, count) {
                    Ok(reader) => reader,
                    Err(why) => {
                        self.refuse(sender, request, why);
                        return;
                    }
                };
                let needed = match self.protocol {
                    Protocol::Native => {
                        dcp::consumers(count, reader_dcp, self.own_tp, self.own_dcp) * stages
                    }
                    Protocol::Vllm => count,
                };
                self.done_reading(sender, request, (count, needed), tag, now);
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

    /// Whether a finish notification from `sender` saying `count` may count, and the
    /// pipeline stages of its engine (each stage's ranks notify this rank, vLLM's
    /// `pp_size` × producers per consumer) with its DCP size. Native: only from an agent a handshake with
    /// this rank named as a reader, and only with that reader's TP size. vLLM: the prefill
    /// never learns its readers' agents (they load its metadata, not it theirs), so only
    /// the count is checked: at most as many readers as a decode of the largest TP has per
    /// rank of this engine; one stage.
    fn admit(&self, sender: &[u8], count: usize) -> Result<(usize, usize), &'static str> {
        match self.protocol {
            Protocol::Native => {
                let reader = self
                    .readers
                    .get(sender)
                    .ok_or("not from a reader that handshook with this rank")?;
                if count != reader.tp_size {
                    return Err("the count is not the reader's TP size");
                }
                Ok((reader.pp_size, reader.dcp_size))
            }
            Protocol::Vllm => {
                if count > (MAX_TP_SIZE / self.own_tp.max(1)).max(1) {
                    return Err("more readers than a decode can have per rank of this engine");
                }
                Ok((1, 1))
            }
        }
    }

    /// Counts one refused finish notification or heartbeat entry from `sender` for
    /// `request`, logged at the 1st, 2nd, 4th, 8th... so that a flood cannot flood the log.
    fn refuse(&mut self, sender: &[u8], request: &str, why: &str) {
        self.notes.refused += 1;
        self.series.refused_notification();
        if self.notes.refused.is_power_of_two() {
            tracing::warn!(sender = %String::from_utf8_lossy(sender), request, why, refused = self.notes.refused, "notification refused");
        }
    }

    /// Extends the lease of every held request in `entries` (comma-separated; in the native
    /// protocol only those whose tag is of the request's capability, from `sender`) to
    /// [`Lease::extension`] from now (never shortening it, never past its limit); follows
    /// vLLM's `_handle_heartbeat`.
    fn heartbeat(&mut self, sender: &[u8], entries: &str, now: Instant) {
        self.notes.heartbeats += 1;
        self.series.heartbeat();
        let until = now + self.lease.extension();
        let mut any_held = false;
        let protocol = self.protocol;
        for entry in entries.split(',') {
            let (id, tag) = match protocol {
                // Parsed: every entry has its tag.
                Protocol::Native => split_tag(entry, TAG_SEPARATOR)
                    .map_or((entry, None), |(id, tag)| (id, Some(tag))),
                Protocol::Vllm => (entry, None),
            };
            let Some(held) = self.held.get_mut(id) else {
                self.notes.unknown_heartbeat_ids += 1;
                continue;
            };
            let beat = |cap: &Capability, tag: &str| cap.verify_heartbeat(sender, id, tag);
            if !proven(protocol, held.capability.as_ref(), tag, beat) {
                self.refuse(
                    sender,
                    id,
                    "a heartbeat without a tag of the request's capability",
                );
                continue;
            }
            held.extend_for_reader(until);
            self.notes.leases_extended += 1;
            any_held = true;
        }
        if !any_held {
            self.series.heartbeat_refused();
        }
    }

    /// Counts a reader's notification that it is done with `request`, saying `count`
    /// readers of which `needed` notify this rank, with `tag` (vLLM's `_get_new_notifs`;
    /// here each reader agent counts once, and in the native protocol only with the tag of
    /// the request's capability).
    fn done_reading(
        &mut self,
        sender: &[u8],
        request: &str,
        (count, needed): (usize, usize),
        tag: Option<&str>,
        now: Instant,
    ) {
        if let Some(held) = self.held.get_mut(request) {
            let finished =
                |cap: &Capability, tag: &str| cap.verify_finish(sender, request, count, tag);
            if !proven(self.protocol, held.capability.as_ref(), tag, finished) {
                self.refuse(
                    sender,
                    request,
                    "a finish notification without a tag of the request's capability",
                );
                return;
            }
            if held.readers.iter().any(|r| r == sender) {
                self.notes.duplicate_notifications += 1;
                return;
            }
            held.readers.push(sender.to_vec());
            held.needed = held.needed.max(needed);
            held.claimed = true;
            if held.readers.len() >= held.needed {
                let marks = self.held.remove(request).and_then(|h| h.marks);
                self.release(request.to_string(), Released::Notification, marks);
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
            arrived: now,
        });
        if early.readers.iter().any(|r| r.sender == sender) {
            self.notes.duplicate_notifications += 1;
        } else {
            early.readers.push(EarlyReader {
                sender: sender.to_vec(),
                tag: tag.map(str::to_string),
                count,
                needed,
            });
        }
    }

    /// Counts a late notification for `request`, logged at the 1st, 2nd, 4th, 8th... so that
    /// a flood of notifications for released requests cannot flood the log.
    fn late(&mut self, request: &str, why: &str) {
        self.notes.late_notifications += 1;
        self.series.after_expiry();
        if self.notes.late_notifications.is_power_of_two() {
            tracing::warn!(request, late = self.notes.late_notifications, "{why}");
        }
    }

    /// Releases every held request whose lease has ended (vLLM's
    /// `_reap_expired_send_leases`), and drops early notifications older than a lease.
    pub(crate) fn expire(&mut self, now: Instant) {
        let expired: Vec<String> = self
            .held
            .iter()
            .filter(|(_, held)| held.deadline <= now && !held.writing)
            .map(|(id, _)| id.clone())
            .collect();
        self.series.expired(expired.len() as u64);
        for id in expired {
            let held = self.held.remove(&id);
            let readers = held.as_ref().map_or(0, |h| h.readers.len());
            tracing::warn!(request = %id, readers, "the request's KV lease ended before every decode rank notified; blocks freed");
            self.release(id, Released::Lease, held.and_then(|h| h.marks));
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

    /// Claims each of `claims` for agent `reader` (a handshake's claims on requests kept for a
    /// read-back, native protocol): a held request whose claim carries the heartbeat tag of
    /// its capability for `reader` is claimed (never evicted from now on) and its lease
    /// extended as a heartbeat would; the ids claimed. Others are refused and counted.
    pub(crate) fn claim(
        &mut self,
        reader: &[u8],
        claims: &[KeptClaim],
        now: Instant,
    ) -> Vec<String> {
        let until = now + self.lease.extension();
        let mut claimed = Vec::new();
        for claim in claims {
            let id = claim.request_id.as_str();
            let Some(held) = self.held.get_mut(id) else {
                continue;
            };
            let beat = |cap: &Capability, tag: &str| cap.verify_heartbeat(reader, id, tag);
            if self.protocol != Protocol::Native
                || !proven(
                    self.protocol,
                    held.capability.as_ref(),
                    Some(&claim.tag),
                    beat,
                )
            {
                self.refuse(
                    reader,
                    id,
                    "a claim without a tag of the request's capability",
                );
                continue;
            }
            held.extend_for_reader(until);
            claimed.push(claim.request_id.clone());
        }
        claimed
    }

    /// Releases a request kept for a read-back now, unless a reader has claimed it (a
    /// heartbeat or a finish notification of it counted): that reader may be reading, and
    /// the request then stays until its readers notify or its lease ends. Whether it was.
    pub(crate) fn evict(&mut self, request_id: &str) -> bool {
        match self.held.get(request_id) {
            Some(held) if !held.claimed => {
                let marks = self.held.remove(request_id).and_then(|h| h.marks);
                self.release(request_id.to_string(), Released::Eviction, marks);
                true
            }
            Some(_) => {
                tracing::debug!(
                    request = request_id,
                    "a reader claimed the kept request; it is not evicted"
                );
                false
            }
            None => false,
        }
    }

    /// Push mode: a WRITE of `request_id`'s blocks is about to be posted; from now on only
    /// [`written`](Self::written) releases it. False when it is not held (its lease ended)
    /// or a WRITE of it is already under way: nothing may be posted then.
    pub(crate) fn start_writing(&mut self, request_id: &str) -> bool {
        match self.held.get_mut(request_id) {
            Some(held) if !held.writing => {
                held.writing = true;
                held.claimed = true;
                true
            }
            _ => false,
        }
    }

    /// Push mode: no WRITE of `request_id`'s blocks was posted after
    /// [`start_writing`](Self::start_writing), and the request stays held for another one:
    /// its lease applies again (a lease that ended meanwhile releases it at the next
    /// [`expire`](Self::expire)).
    #[cfg_attr(not(feature = "vllm"), allow(dead_code))]
    pub(crate) fn stop_writing(&mut self, request_id: &str) {
        if let Some(held) = self.held.get_mut(request_id) {
            held.writing = false;
        }
    }

    /// Push mode: NIXL ended the WRITE of `request_id`'s blocks (or none was posted after
    /// [`start_writing`](Self::start_writing)): it is released.
    pub(crate) fn written(&mut self, request_id: &str) {
        if let Some(held) = self.held.remove(request_id) {
            self.release(request_id.to_string(), Released::Notification, held.marks);
        }
    }

    /// Push mode: the decode wants nothing written (a proven cancel): `request_id` is
    /// released now unless a WRITE of it is under way.
    pub(crate) fn release_unwritten(&mut self, request_id: &str) {
        if self.held.get(request_id).is_some_and(|h| !h.writing) {
            self.written(request_id);
        }
    }

    /// Releases `request_id`, released `by`, its `marks` to raise before the engine hears.
    fn release(&mut self, request_id: String, by: Released, marks: Option<Marks>) {
        match by {
            Released::Notification => self.stats.freed_on_notification += 1,
            Released::Lease => self.stats.freed_on_timeout += 1,
            Released::Eviction => self.stats.freed_on_eviction += 1,
        }
        self.series.released(by as usize);
        self.series.held(self.held.len());
        tracing::debug!(request = %request_id, by = ?by, "request released");
        if self.released_order.len() >= MAX_RELEASED {
            if let Some(oldest) = self.released_order.pop_front() {
                self.released.remove(&oldest);
            }
        }
        self.released.insert(request_id.clone());
        self.released_order.push_back(request_id.clone());
        self.done.push(request_id);
        if let Some(marks) = marks {
            self.marked_up_to = self.marked_up_to.max(marks.epoch);
            self.to_mark.push(marks);
        }
    }

    /// The requests released since the last call, and the marks to raise before the engine
    /// hears of them.
    pub(crate) fn take_done(&mut self) -> (Vec<String>, Vec<Marks>) {
        (
            std::mem::take(&mut self.done),
            std::mem::take(&mut self.to_mark),
        )
    }

    /// The largest lease epoch marked so far: a new registration's marks start at it, so
    /// that no release before it is forgotten.
    pub(crate) fn marked_up_to(&self) -> u64 {
        self.marked_up_to
    }

    pub(crate) fn stats(&self) -> SendStats {
        self.stats
    }

    pub(crate) fn notification_stats(&self) -> NotificationStats {
        self.notes
    }
}

/// Whether a finish notification or heartbeat with `tag` may count for a request held with
/// `capability`: always in vLLM's protocol (it has no capabilities); in the native one only
/// when `verify` holds for the capability and the tag.
fn proven(
    protocol: Protocol,
    capability: Option<&Capability>,
    tag: Option<&str>,
    verify: impl FnOnce(&Capability, &str) -> bool,
) -> bool {
    match protocol {
        Protocol::Vllm => true,
        Protocol::Native => capability
            .zip(tag)
            .is_some_and(|(capability, tag)| verify(capability, tag)),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::metrics::series::rank_labels;
    use crate::transport::readers::Reader;
    use crate::worker::notification_format::{
        heartbeat_entries, heartbeat_messages, notification_message,
    };

    /// Readers that handshook: `d` and `solo` of TP 1, `d0` and `d1` of TP `tp`.
    fn readers(tp: usize) -> Arc<Readers> {
        let readers = Arc::new(Readers::default());
        for (agent, tp_size) in [("d", 1), ("solo", 1), ("d0", tp), ("d1", tp)] {
            let engine_id = "decode".to_string();
            readers.accept(
                agent,
                Reader {
                    engine_id,
                    tp_size,
                    pp_size: 1,
                    dcp_size: 1,
                },
            );
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
            Arc::new(Series::new(rank_labels("test", 0, None), None)),
            readers(2),
        )
    }

    /// The capability every request of these tests is held with.
    fn cap() -> Capability {
        Capability::from_hex("000102030405060708090a0b0c0d0e0f").unwrap()
    }

    /// Holds `request` in `s` from `t0` for 30 s under [`cap`], with no release marks.
    fn hold_30s(s: &mut Sends, request: &str, t0: Instant) {
        s.hold(
            request.into(),
            (t0 + Duration::from_secs(30), t0),
            Some(cap()),
            None,
        );
    }

    /// A native finish notification of `sender` for `request` saying `count`, tagged
    /// under `capability`.
    fn fin_with(capability: &Capability, sender: &str, request: &str, count: usize) -> Vec<u8> {
        notification_message(request, count, Some((capability, sender)))
    }

    /// As [`fin_with`], under [`cap`].
    fn fin(sender: &str, request: &str, count: usize) -> Vec<u8> {
        fin_with(&cap(), sender, request, count)
    }

    /// A native heartbeat of `sender` for `ids`, tagged under `capability`.
    fn hb_with(capability: &Capability, sender: &str, ids: &[&str]) -> Vec<u8> {
        let capabilities = vec![Some(capability.clone()); ids.len()];
        let entries = heartbeat_entries(ids.iter().copied(), Some((&capabilities, sender)));
        heartbeat_messages(&entries).remove(0)
    }

    #[test]
    fn a_heartbeat_extends_the_lease_by_two_thirds_up_to_its_limit() {
        let mut s = sends(1);
        let t0 = Instant::now();
        hold_30s(&mut s, "r", t0);
        s.notified(
            b"d",
            &hb_with(&cap(), "d", &["r", "unknown"]),
            t0 + Duration::from_secs(25),
        );
        s.expire(t0 + Duration::from_secs(44));
        assert!(s.take_done().0.is_empty(), "extended to 25 + 20 s");
        s.expire(t0 + Duration::from_secs(45));
        assert_eq!(s.take_done().0, ["r"]);
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
        hold_30s(&mut s, "q", t0);
        for at in (20..200).step_by(10) {
            s.notified(
                b"d",
                &hb_with(&cap(), "d", &["q"]),
                t0 + Duration::from_secs(at),
            );
        }
        s.expire(t0 + Duration::from_secs(100));
        assert_eq!(s.take_done().0, ["q"]);
    }

    #[test]
    fn a_request_is_freed_once_every_stage_of_its_reader_notified() {
        // A decode of two pipeline stages of TP 1: each stage's rank reads (or notifies)
        // this TP 1 rank, so both must notify.
        let mut s = sends(1);
        for agent in ["s0", "s1"] {
            let engine_id = "decode".to_string();
            let reader = Reader {
                engine_id,
                tp_size: 1,
                pp_size: 2,
                dcp_size: 1,
            };
            s.readers.accept(agent, reader);
        }
        let t0 = Instant::now();
        hold_30s(&mut s, "r", t0);
        s.notified(b"s0", &fin("s0", "r", 1), t0);
        s.notified(b"s0", &fin("s0", "r", 1), t0);
        assert!(
            s.take_done().0.is_empty(),
            "stage 1's reader has not notified"
        );
        s.notified(b"s1", &fin("s1", "r", 1), t0);
        assert_eq!(s.take_done().0, ["r"]);
    }

    #[test]
    fn without_a_cap_heartbeats_keep_a_request_while_they_come() {
        // vLLM's default: no cap (the 480 s one ended leases vLLM's heartbeats kept alive).
        let lease = Lease::default();
        let mut s = Sends::new(
            1,
            Protocol::Vllm,
            lease,
            Arc::new(Series::new(rank_labels("t", 0, None), None)),
            readers(1),
        );
        let t0 = Instant::now();
        s.hold("r".into(), (t0 + Duration::from_secs(30), t0), None, None);
        for at in (20..2000).step_by(10) {
            s.notified(b"d", b"HB:r", t0 + Duration::from_secs(at));
            s.expire(t0 + Duration::from_secs(at));
        }
        assert!(s.take_done().0.is_empty(), "held while heartbeats came");
        s.expire(t0 + Duration::from_secs(1990 + 20));
        assert_eq!(s.take_done().0, ["r"], "freed an extension after the last");
    }

    #[test]
    fn a_vllm_notification_says_how_many_readers_notify() {
        let t0 = Instant::now();
        let lease = Lease::default();
        // Prefill TP 2 read by decode TP 4: vLLM's decode says 2 consumers, ours 4 (its TP).
        let series = || Arc::new(Series::new(rank_labels("t", 0, None), None));
        let mut vllm = Sends::new(2, Protocol::Vllm, lease, series(), readers(4));
        let mut native = Sends::new(2, Protocol::Native, lease, series(), readers(4));
        let vllm_messages = [b"r:2".to_vec(), b"r:2".to_vec()];
        let native_messages = [fin("d0", "r", 4), fin("d1", "r", 4)];
        for (s, messages) in [(&mut vllm, vllm_messages), (&mut native, native_messages)] {
            hold_30s(s, "r", t0);
            s.notified(b"d0", &messages[0], t0);
            assert!(s.take_done().0.is_empty());
            s.notified(b"d1", &messages[1], t0);
            assert_eq!(s.take_done().0, ["r"]);
        }
    }

    #[test]
    fn each_reader_counts_once_and_nothing_is_released_twice() {
        let mut s = sends(1);
        let t0 = Instant::now();
        hold_30s(&mut s, "r", t0);
        s.notified(b"d0", &fin("d0", "r", 2), t0);
        s.notified(b"d0", &fin("d0", "r", 2), t0);
        assert!(
            s.take_done().0.is_empty(),
            "a repeat from the same reader counts once"
        );
        s.notified(b"d1", &fin("d1", "r", 2), t0);
        assert_eq!(s.take_done().0, ["r"]);
        s.notified(b"d1", &fin("d1", "r", 2), t0);
        s.expire(t0 + Duration::from_secs(60));
        assert!(s.take_done().0.is_empty());
        let notes = s.notification_stats();
        assert_eq!(
            (notes.duplicate_notifications, notes.late_notifications),
            (1, 1)
        );

        // Early notifications release at the hold, and go stale after a lease.
        s.notified(b"solo", &fin("solo", "e", 1), t0);
        hold_30s(&mut s, "e", t0);
        assert_eq!(s.take_done().0, ["e"]);
        s.notified(b"solo", &fin("solo", "never", 1), t0);
        s.expire(t0 + Duration::from_secs(31));
        assert!(s.early.is_empty());
        assert_eq!(s.notification_stats().late_notifications, 2);
    }

    #[test]
    fn only_readers_count_and_only_with_their_tp() {
        let mut s = sends(1);
        let t0 = Instant::now();
        hold_30s(&mut s, "r", t0);
        s.notified(b"third", &fin("third", "r", 1), t0);
        s.notified(b"d0", &fin("d0", "r", 4096), t0);
        s.notified(b"d0", &fin("d0", "r", 1), t0);
        s.notified(b"d", &fin("d", "r", 4294967295), t0);
        assert!(s.take_done().0.is_empty(), "the request is still held");
        let notes = s.notification_stats();
        assert_eq!((notes.refused, notes.malformed), (3, 1));
        s.notified(b"d0", &fin("d0", "r", 2), t0);
        s.notified(b"d1", &fin("d1", "r", 2), t0);
        assert_eq!(s.take_done().0, ["r"]);

        // vLLM: a count no decode can have is refused.
        let lease = Lease::default();
        let series = Arc::new(Series::new(rank_labels("t", 0, None), None));
        let mut vllm = Sends::new(2, Protocol::Vllm, lease, series, readers(1));
        vllm.hold("r".into(), (t0 + Duration::from_secs(30), t0), None, None);
        vllm.notified(b"anyone", b"r:4096", t0);
        assert_eq!(vllm.notification_stats().refused, 1);
        vllm.notified(b"anyone", b"r:1", t0);
        assert_eq!(vllm.take_done().0, ["r"]);
    }

    #[test]
    fn only_the_requests_capability_frees_it_or_extends_its_lease() {
        let mut s = sends(1);
        let t0 = Instant::now();
        let other = Capability::random().unwrap();
        hold_30s(&mut s, "r", t0);
        // A reader that handshook but never got the params: another capability's tags.
        s.notified(b"d", &fin_with(&other, "d", "r", 1), t0);
        // An agent that took a reader's name, replaying a tag made for another reader.
        s.notified(b"d1", &fin("d0", "r", 2), t0);
        // Untagged, as before capabilities: not even parsed.
        s.notified(b"d", b"r:1", t0);
        s.notified(b"d", b"HB:r", t0);
        // A heartbeat's tag frees nothing, and another capability's extends nothing.
        let beat = hb_with(&cap(), "d", &["r"]);
        let tag = std::str::from_utf8(&beat)
            .unwrap()
            .rsplit_once('#')
            .unwrap()
            .1;
        s.notified(b"d", format!("r:1:{tag}").as_bytes(), t0);
        s.notified(
            b"d",
            &hb_with(&other, "d", &["r"]),
            t0 + Duration::from_secs(25),
        );
        let notes = s.notification_stats();
        assert_eq!(
            (notes.refused, notes.malformed, notes.leases_extended),
            (4, 2, 0)
        );
        s.expire(t0 + Duration::from_secs(30));
        assert_eq!(s.take_done().0, ["r"], "freed by its lease, not extended");
        assert_eq!(s.stats().freed_on_timeout, 1);

        // Early notifications are checked when the request is held.
        s.notified(b"d", &fin_with(&other, "d", "e", 1), t0);
        s.notified(b"solo", &fin("solo", "e", 1), t0);
        hold_30s(&mut s, "e", t0);
        assert_eq!(
            s.take_done().0,
            ["e"],
            "the reader with the capability frees it"
        );
        assert_eq!(s.notification_stats().refused, 5);
        s.notified(b"d", &fin_with(&other, "d", "f", 1), t0);
        hold_30s(&mut s, "f", t0);
        assert!(
            s.take_done().0.is_empty(),
            "a forged early notification frees nothing"
        );

        // Held without a capability: only the lease frees it.
        s.hold("n".into(), (t0 + Duration::from_secs(30), t0), None, None);
        s.notified(b"d", &fin("d", "n", 1), t0);
        assert!(s.take_done().0.is_empty());
    }

    #[test]
    fn a_lease_never_releases_a_request_whose_write_runs() {
        let t0 = Instant::now();
        let mut s = sends(1);
        hold_30s(&mut s, "r", t0);
        assert!(s.start_writing("r"));
        assert!(!s.start_writing("r"), "one WRITE at a time");
        s.expire(t0 + Duration::from_secs(60));
        assert!(s.take_done().0.is_empty(), "the lease ended mid-WRITE");
        s.release_unwritten("r");
        assert!(s.take_done().0.is_empty(), "a cancel does not stop a WRITE");
        s.written("r");
        assert_eq!(s.take_done().0, ["r"]);
        assert_eq!(
            (s.stats().freed_on_notification, s.stats().freed_on_timeout),
            (1, 0)
        );
        // Released, it cannot be written again.
        assert!(!s.start_writing("r"));
        // One not written is released by a cancel at once, or by its lease.
        hold_30s(&mut s, "c", t0);
        s.release_unwritten("c");
        assert_eq!(s.take_done().0, ["c"]);
        hold_30s(&mut s, "l", t0);
        s.expire(t0 + Duration::from_secs(60));
        assert_eq!(s.take_done().0, ["l"]);
        // One given up before its WRITE is posted is the lease's again.
        hold_30s(&mut s, "g", t0);
        assert!(s.start_writing("g"));
        s.expire(t0 + Duration::from_secs(60));
        assert!(s.take_done().0.is_empty());
        s.stop_writing("g");
        assert!(s.start_writing("g"), "another registration may write it");
        s.stop_writing("g");
        s.expire(t0 + Duration::from_secs(60));
        assert_eq!(s.take_done().0, ["g"]);
    }

    #[test]
    fn a_release_raises_the_marks_of_the_requests_blocks_once() {
        let mut s = sends(1);
        let t0 = Instant::now();
        let marks = |epoch, block_ids: &[usize]| {
            Some(Marks {
                epoch,
                block_ids: block_ids.to_vec(),
            })
        };
        let lease = (t0 + Duration::from_secs(30), t0);
        s.hold("by-lease".into(), lease, Some(cap()), marks(7, &[1, 2]));
        s.hold("read".into(), lease, Some(cap()), marks(9, &[3]));
        s.hold("unmarked".into(), lease, Some(cap()), None);
        assert_eq!(s.take_done().1, [], "nothing released, nothing marked");
        s.notified(b"solo", &fin("solo", "read", 1), t0);
        let read = (vec!["read".to_string()], vec![marks(9, &[3]).unwrap()]);
        assert_eq!(s.take_done(), read);
        s.expire(t0 + Duration::from_secs(30));
        let (mut done, marked) = s.take_done();
        done.sort();
        assert_eq!(done, ["by-lease", "unmarked"]);
        assert_eq!(marked, [marks(7, &[1, 2]).unwrap()]);
        assert_eq!(s.marked_up_to(), 9);
    }
}

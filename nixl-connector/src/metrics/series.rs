//! The metrics the connector exports through the [`metrics`] crate's facade, named after
//! vLLM's `vllm:nixl_*` Prometheus series (vLLM's `NixlPromMetrics`).
//!
//! The engine picks the exporter: install a recorder (e.g. `metrics-exporter-prometheus`)
//! before creating workers, and set the histogram buckets from [`buckets`] (vLLM's). Every
//! series carries the labels `engine` (the engine id) and `rank` (the TP rank), and, for a
//! rank of an engine of several pipeline stages, `pp_rank` (its stage). Without a
//! recorder the facade drops everything, at the cost of an atomic load.
//!
//! Each role exports only its own series: a worker whose `kv_role` is `kv_consumer` (a
//! decode) registers the decode side's, a `kv_producer` (a prefill) the prefill side's, and
//! `kv_both` (or no role) both; [`NUM_KV_EXPIRED_REQS`] and [`LEAKED_REQUESTS`] belong to
//! both sides.
//!
//! Decode side, per load, from NIXL's own telemetry ([`nixl::XferRequest::telemetry`], the
//! workers' agents run with telemetry on): [`XFER_TIME_SECONDS`], [`POST_TIME_SECONDS`],
//! [`BYTES_TRANSFERRED`], [`NUM_DESCRIPTORS`] (NIXL's count, after it joins descriptors
//! contiguous on both sides; [`TransferMetrics::descriptors`](crate::TransferMetrics) is
//! the same count). Failures by kind: [`NUM_FAILED_TRANSFERS`] (label `kind`: `handshake`,
//! `transfer`, `timeout`, `invalid`, `lease_outlived`, `notification`), and [`NUM_FAILED_NOTIFICATIONS`]. Per
//! handshake: [`HANDSHAKE_TIME_SECONDS`]. Gauges [`LOADS_IN_FLIGHT`], [`HANDSHAKES_PENDING`];
//! counters [`NUM_LOADS`] (label `outcome`: `loaded`, `failed`, `aborted`),
//! [`NUM_HEARTBEATS_SENT`], and, from the scheduler (label `engine` only, exported once they
//! first move), [`NUM_ABORTED_REQS`] and [`NUM_PREFIX_HITS`], and for multi-turn
//! conversations the gauge [`KEPT_BLOCKS`] and the counter [`NUM_KEPT_EVICTIONS`].
//!
//! Prefill side: gauge [`REQUESTS_HELD`]; counters [`NUM_RELEASED_REQS`] (label `by`:
//! `notification`, `lease`), [`NUM_KV_EXPIRED_REQS`], [`NUM_NOTIFICATIONS_AFTER_EXPIRY`],
//! [`NUM_HEARTBEATS`] (received), [`NUM_HEARTBEATS_REFUSED`], [`NUM_REFUSED_NOTIFICATIONS`]
//! and [`NUM_SIDE_CHANNEL_REFUSALS`] (label `kind`); from the scheduler, for read-backs,
//! [`NUM_READ_BACKS`] and [`NUM_BELOW_RECOMPUTE_THRESHOLD`]. Decode side also
//! [`NUM_OVERDUE_TRANSFERS`], [`NUM_HANDSHAKE_FAILURES`] and [`NUM_EVICTED_ENGINES`].

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Label, Unit};
use nixl::kv_config::KvRole;

use crate::failure::FailureKind;

/// Histogram: seconds from a READ's post to its completion (NIXL's `xferDuration`).
pub const XFER_TIME_SECONDS: &str = "vllm:nixl_xfer_time_seconds";
/// Histogram: seconds NIXL spent posting a READ (NIXL's `postDuration`).
pub const POST_TIME_SECONDS: &str = "vllm:nixl_post_time_seconds";
/// Histogram: bytes moved by one READ.
pub const BYTES_TRANSFERRED: &str = "vllm:nixl_bytes_transferred";
/// Histogram: descriptors in one READ.
pub const NUM_DESCRIPTORS: &str = "vllm:nixl_num_descriptors";
/// Counter: failed loads by `kind`, notification failures included (as in vLLM).
pub const NUM_FAILED_TRANSFERS: &str = "vllm:nixl_num_failed_transfers";
/// Counter: notifications (load done, notification only, heartbeat) NIXL refused to send.
pub const NUM_FAILED_NOTIFICATIONS: &str = "vllm:nixl_num_failed_notifications";
/// Counter: held requests freed because their lease ended (prefill side), and loads
/// declined because the prefill's blocks expire first (decode side, vLLM mode).
pub const NUM_KV_EXPIRED_REQS: &str = "vllm:nixl_num_kv_expired_reqs";
/// Counter: notifications for requests no longer held, e.g. after their lease ended: the
/// decode may have read blocks already reused (prefill side, one per notification).
pub const NUM_NOTIFICATIONS_AFTER_EXPIRY: &str = "vllm:nixl_num_notifications_after_expiry";
/// Histogram: seconds a handshake with a remote rank took (not a vLLM series).
pub const HANDSHAKE_TIME_SECONDS: &str = "vllm:nixl_handshake_time_seconds";
/// Counter: heartbeat messages received (prefill side; not a vLLM series).
pub const NUM_HEARTBEATS: &str = "vllm:nixl_num_heartbeats";
/// Counter: heartbeats received that extended no lease: they named no request held here,
/// or (native protocol) none with a tag of its capability (prefill side; not a vLLM series).
pub const NUM_HEARTBEATS_REFUSED: &str = "vllm:nixl_num_heartbeats_refused";
/// Counter: heartbeat messages sent (decode side; not a vLLM series).
pub const NUM_HEARTBEATS_SENT: &str = "vllm:nixl_num_heartbeats_sent";
/// Gauge: requests held for decodes, their blocks not yet released (prefill side; not a
/// vLLM series).
pub const REQUESTS_HELD: &str = "vllm:nixl_requests_held";
/// Counter: held requests released, by `by`: `notification` (every decode rank notified),
/// `lease` (the lease ended first) or `eviction` (a decode's kept request released early,
/// past the cap on kept blocks) (prefill side; not a vLLM series).
pub const NUM_RELEASED_REQS: &str = "vllm:nixl_num_released_reqs";
/// Gauge: loads started and not yet ended, READs or handshakes under way (decode side; not
/// a vLLM series).
pub const LOADS_IN_FLIGHT: &str = "vllm:nixl_loads_in_flight";
/// Counter: loads ended, by `outcome`: `loaded`, `failed` or `aborted` (decode side; not a
/// vLLM series).
pub const NUM_LOADS: &str = "vllm:nixl_num_loads";
/// Gauge: handshakes with remote ranks under way (decode side; not a vLLM series).
pub const HANDSHAKES_PENDING: &str = "vllm:nixl_handshakes_pending";
/// Counter: decode requests finished before their load ended (aborted), from the scheduler
/// (decode side; not a vLLM series).
pub const NUM_ABORTED_REQS: &str = "vllm:nixl_num_aborted_reqs";
/// Counter: decode requests whose blocks the prefix cache held entirely, so nothing was
/// read, from the scheduler (decode side; not a vLLM series).
pub const NUM_PREFIX_HITS: &str = "vllm:nixl_num_prefix_hits";
/// Gauge: blocks a decode keeps for read-backs by the next turn's prefill, from the
/// scheduler (decode side; not a vLLM series).
pub const KEPT_BLOCKS: &str = "vllm:nixl_kept_blocks";
/// Counter: kept requests the scheduler asked its workers to release early, oldest first,
/// because the kept blocks passed their cap (decode side; not a vLLM series).
pub const NUM_KEPT_EVICTIONS: &str = "vllm:nixl_num_kept_evictions";
/// Counter: read-backs scheduled: requests loading a decode's kept blocks, from the
/// scheduler (prefill side; not a vLLM series).
pub const NUM_READ_BACKS: &str = "vllm:nixl_num_read_backs";
/// Counter: read-backs not made because fewer tokens than `kv_recompute_threshold` would be
/// read; the prefill computes them (prefill side; not a vLLM series).
pub const NUM_BELOW_RECOMPUTE_THRESHOLD: &str = "vllm:nixl_num_below_recompute_threshold";
/// Gauge: transfer requests this worker's agent gave up while they may still have been in
/// flight, their memory kept for the process's life ([`nixl::LeakStats::requests`]; both
/// sides; not a vLLM series).
pub const LEAKED_REQUESTS: &str = "vllm:nixl_leaked_requests";
/// Counter: finish notifications and heartbeat entries refused: without a tag of the
/// request's capability (native protocol), or whose sender or count is not one of this
/// engine's readers' (prefill side; not a vLLM series).
pub const NUM_REFUSED_NOTIFICATIONS: &str = "vllm:nixl_num_refused_notifications";
/// Counter: connections a side channel refused (label `kind`: `network`, `busy`,
/// `unauthenticated`, `version`, `incompatible`, `malformed`, `deadline`; see
/// [`Refusal`](crate::transport::refusals::Refusal)), both protocols' (prefill side; not a
/// vLLM series).
pub const NUM_SIDE_CHANNEL_REFUSALS: &str = "vllm:nixl_num_side_channel_refusals";
/// Counter: loads whose READs were still in flight at the transfer timeout; their blocks
/// stay with the connector until NIXL ends the READs (decode side; not a vLLM series).
pub const NUM_OVERDUE_TRANSFERS: &str = "vllm:nixl_num_overdue_transfers";
/// Counter: handshakes with a remote rank that failed, one per try (the loads waiting on
/// one fail under [`NUM_FAILED_TRANSFERS`] kind `handshake`; tries an engine's backoff
/// skips are not counted) (decode side; not a vLLM series).
pub const NUM_HANDSHAKE_FAILURES: &str = "vllm:nixl_num_handshake_failures";
/// Counter: remote engines evicted, their agents' metadata invalidated: unused for longer
/// than `engine_ttl`, or replaced at their side-channel address by another engine (decode
/// side; not a vLLM series).
pub const NUM_EVICTED_ENGINES: &str = "vllm:nixl_num_evicted_engines";
/// Counter: push mode, registrations a decode sent (one per prefill rank and load; decode
/// side; not a vLLM series).
pub const NUM_PUSH_REGISTRATIONS: &str = "vllm:nixl_num_push_registrations";
/// Counter: push mode, loads whose registration timeout passed before every prefill rank
/// ended its part (decode side; not a vLLM series).
pub const NUM_PUSH_REGISTRATION_TIMEOUTS: &str = "vllm:nixl_num_push_registration_timeouts";
/// Counter: push mode, WRITEs a prefill rank ended (label `outcome`: `written`, `failed`,
/// `refused`; prefill side; not a vLLM series).
pub const NUM_PUSH_WRITES: &str = "vllm:nixl_num_push_writes";
/// Histogram: push mode, seconds from a registration's match to the end of its WRITE,
/// the handshake with the decode rank included (prefill side; not a vLLM series).
pub const PUSH_WRITE_TIME_SECONDS: &str = "vllm:nixl_push_write_time_seconds";
/// Counter: push mode, registrations that waited for their request to be held (prefill
/// side; not a vLLM series).
pub const NUM_PUSH_REGISTRATION_WAITS: &str = "vllm:nixl_num_push_registration_waits";
/// Counter: push mode, registrations dropped unmatched, past their time or the bounds
/// (prefill side; not a vLLM series).
pub const NUM_PUSH_REGISTRATION_EXPIRIES: &str = "vllm:nixl_num_push_registration_expiries";

/// vLLM's buckets for the post time (seconds).
const TIME_BUCKETS: [f64; 13] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
];
/// vLLM's buckets for bytes per transfer: 2 KiB to 8 GiB, every fourth power of two.
const BYTES_BUCKETS: [f64; 12] = [
    2048.0,
    8192.0,
    32768.0,
    131_072.0,
    524_288.0,
    2_097_152.0,
    8_388_608.0,
    33_554_432.0,
    134_217_728.0,
    536_870_912.0,
    2_147_483_648.0,
    8_589_934_592.0,
];
/// vLLM's buckets for descriptors per transfer.
const DESCRIPTOR_BUCKETS: [f64; 14] = [
    10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0, 20000.0,
    50000.0,
];

/// The histogram buckets vLLM uses for histogram `name`, or `None` for a name that is not
/// one of this module's histograms.
pub fn buckets(name: &str) -> Option<&'static [f64]> {
    match name {
        // vLLM drops the first time bucket for the transfer time.
        XFER_TIME_SECONDS => Some(&TIME_BUCKETS[1..]),
        POST_TIME_SECONDS | HANDSHAKE_TIME_SECONDS | PUSH_WRITE_TIME_SECONDS => Some(&TIME_BUCKETS),
        BYTES_TRANSFERRED => Some(&BYTES_BUCKETS),
        NUM_DESCRIPTORS => Some(&DESCRIPTOR_BUCKETS),
        _ => None,
    }
}

/// Every histogram this module exports.
pub const HISTOGRAMS: [&str; 6] = [
    XFER_TIME_SECONDS,
    POST_TIME_SECONDS,
    BYTES_TRANSFERRED,
    NUM_DESCRIPTORS,
    HANDSHAKE_TIME_SECONDS,
    PUSH_WRITE_TIME_SECONDS,
];

/// What kind of series a name is, as the recorder is told it.
#[derive(Debug, Clone, Copy)]
enum SeriesKind {
    Histogram,
    Counter,
    Gauge,
}

/// Every series' kind, name, unit and description, in the order [`describe`] gives them.
const DESCRIPTIONS: [(SeriesKind, &str, Unit, &str); 35] = [
    (
        SeriesKind::Histogram,
        XFER_TIME_SECONDS,
        Unit::Seconds,
        "Transfer duration of NIXL KV cache loads (NIXL telemetry).",
    ),
    (
        SeriesKind::Histogram,
        POST_TIME_SECONDS,
        Unit::Seconds,
        "Post duration of NIXL KV cache loads (NIXL telemetry).",
    ),
    (
        SeriesKind::Histogram,
        BYTES_TRANSFERRED,
        Unit::Bytes,
        "Bytes per NIXL KV cache load.",
    ),
    (
        SeriesKind::Histogram,
        NUM_DESCRIPTORS,
        Unit::Count,
        "Descriptors per NIXL KV cache load.",
    ),
    (
        SeriesKind::Histogram,
        HANDSHAKE_TIME_SECONDS,
        Unit::Seconds,
        "Duration of side-channel handshakes with remote ranks.",
    ),
    (
        SeriesKind::Counter,
        NUM_FAILED_TRANSFERS,
        Unit::Count,
        "Failed NIXL KV cache loads by kind, notification failures included.",
    ),
    (
        SeriesKind::Counter,
        NUM_FAILED_NOTIFICATIONS,
        Unit::Count,
        "NIXL notifications that could not be sent.",
    ),
    (
        SeriesKind::Counter,
        NUM_KV_EXPIRED_REQS,
        Unit::Count,
        "Held requests freed because their KV lease ended (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_NOTIFICATIONS_AFTER_EXPIRY,
        Unit::Count,
        "Notifications for requests no longer held, e.g. after their lease ended (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_HEARTBEATS,
        Unit::Count,
        "Heartbeat notifications received (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_OVERDUE_TRANSFERS,
        Unit::Count,
        "Loads whose READs were in flight at the transfer timeout; their blocks are held until the READs end.",
    ),
    (
        SeriesKind::Counter,
        NUM_HANDSHAKE_FAILURES,
        Unit::Count,
        "Handshakes with remote ranks that failed, one per try (decode side).",
    ),
    (
        SeriesKind::Counter,
        NUM_EVICTED_ENGINES,
        Unit::Count,
        "Remote engines evicted: unused past engine_ttl, or replaced at their address (decode side).",
    ),
    (
        SeriesKind::Counter,
        NUM_PUSH_REGISTRATIONS,
        Unit::Count,
        "Push registrations sent, one per prefill rank and load (decode side).",
    ),
    (
        SeriesKind::Counter,
        NUM_PUSH_REGISTRATION_TIMEOUTS,
        Unit::Count,
        "Push loads past push_registration_timeout before every prefill rank ended (decode side).",
    ),
    (
        SeriesKind::Counter,
        NUM_PUSH_WRITES,
        Unit::Count,
        "Push WRITEs ended, by outcome (prefill side).",
    ),
    (
        SeriesKind::Histogram,
        PUSH_WRITE_TIME_SECONDS,
        Unit::Seconds,
        "Seconds from a push registration's match to the end of its WRITE (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_PUSH_REGISTRATION_WAITS,
        Unit::Count,
        "Push registrations that waited for their request to be held (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_PUSH_REGISTRATION_EXPIRIES,
        Unit::Count,
        "Push registrations dropped unmatched, past their time or the bounds (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_REFUSED_NOTIFICATIONS,
        Unit::Count,
        "Finish notifications and heartbeats refused: without the request's capability, not from a reader of this engine, or a count beyond its TP (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_SIDE_CHANNEL_REFUSALS,
        Unit::Count,
        "Connections a side channel refused, by kind (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_HEARTBEATS_REFUSED,
        Unit::Count,
        "Heartbeats received that named no held request (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_HEARTBEATS_SENT,
        Unit::Count,
        "Heartbeat notifications sent (decode side).",
    ),
    (
        SeriesKind::Counter,
        NUM_RELEASED_REQS,
        Unit::Count,
        "Held requests released, by notification, lease end or eviction (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_LOADS,
        Unit::Count,
        "KV cache loads ended, by outcome (decode side).",
    ),
    (
        SeriesKind::Counter,
        NUM_ABORTED_REQS,
        Unit::Count,
        "Decode requests finished before their load ended (decode side).",
    ),
    (
        SeriesKind::Counter,
        NUM_PREFIX_HITS,
        Unit::Count,
        "Decode requests whose blocks the prefix cache held entirely (decode side).",
    ),
    (
        SeriesKind::Gauge,
        REQUESTS_HELD,
        Unit::Count,
        "Requests held for decodes, blocks not yet released (prefill side).",
    ),
    (
        SeriesKind::Gauge,
        LOADS_IN_FLIGHT,
        Unit::Count,
        "KV cache loads started and not yet ended (decode side).",
    ),
    (
        SeriesKind::Gauge,
        HANDSHAKES_PENDING,
        Unit::Count,
        "Handshakes with remote ranks under way (decode side).",
    ),
    (
        SeriesKind::Gauge,
        LEAKED_REQUESTS,
        Unit::Count,
        "Transfer requests given up while possibly in flight, memory kept (NIXL leak_stats).",
    ),
    (
        SeriesKind::Gauge,
        KEPT_BLOCKS,
        Unit::Count,
        "Blocks a decode keeps for read-backs by the next turn's prefill (decode side).",
    ),
    (
        SeriesKind::Counter,
        NUM_KEPT_EVICTIONS,
        Unit::Count,
        "Kept requests released early because the kept blocks passed their cap (decode side).",
    ),
    (
        SeriesKind::Counter,
        NUM_READ_BACKS,
        Unit::Count,
        "Read-backs of a decode's kept blocks scheduled (prefill side).",
    ),
    (
        SeriesKind::Counter,
        NUM_BELOW_RECOMPUTE_THRESHOLD,
        Unit::Count,
        "Read-backs not made because fewer tokens than kv_recompute_threshold (prefill side).",
    ),
];

/// Gives the installed recorder each series' description and unit (workers do it when
/// they are created; call it again after installing a recorder later).
pub fn describe() {
    for (kind, name, unit, description) in DESCRIPTIONS {
        match kind {
            SeriesKind::Histogram => metrics::describe_histogram!(name, unit, description),
            SeriesKind::Counter => metrics::describe_counter!(name, unit, description),
            SeriesKind::Gauge => metrics::describe_gauge!(name, unit, description),
        }
    }
}

/// Which sides' series a worker of `role` exports: (decode's, prefill's).
fn sides(role: Option<KvRole>) -> (bool, bool) {
    match role {
        Some(KvRole::Consumer) => (true, false),
        Some(KvRole::Producer) => (false, true),
        Some(KvRole::Both) | None => (true, true),
    }
}

/// Labels of a series with one more label.
fn with(labels: &[Label], key: &'static str, value: &'static str) -> Vec<Label> {
    let mut more = labels.to_vec();
    more.push(Label::new(key, value));
    more
}

/// One worker's handles on the series (registered when the worker is created, so every
/// series is exported from the start).
pub(crate) struct Series {
    xfer_time: Histogram,
    post_time: Histogram,
    bytes: Histogram,
    descriptors: Histogram,
    handshake_time: Histogram,
    failed: [Counter; 5],
    failed_notifications: Counter,
    failed_notifications_kind: Counter,
    expired: Counter,
    after_expiry: Counter,
    heartbeats: Counter,
    heartbeats_refused: Counter,
    heartbeats_sent: Counter,
    held: Gauge,
    /// Released by notification, by lease, by eviction.
    released: [Counter; 3],
    in_flight: Gauge,
    /// Loads ended: loaded, failed, aborted.
    loads: [Counter; 3],
    handshakes_pending: Gauge,
    leaked: Gauge,
    refused_notifications: Counter,
    overdue: Counter,
    handshake_failures: Counter,
    evicted_engines: Counter,
    push: PushSeries,
}

/// Push mode's series of a worker.
struct PushSeries {
    registrations: Counter,
    timeouts: Counter,
    /// WRITEs ended: written, failed, refused.
    writes: [Counter; 3],
    write_time: Histogram,
    waits: Counter,
    expiries: Counter,
}

/// The `outcome` labels of [`NUM_PUSH_WRITES`], in `PushSeries::writes` order.
const PUSH_OUTCOMES: [&str; 3] = ["written", "failed", "refused"];

/// The `outcome` labels of [`NUM_LOADS`], in `Series::loads` order.
const OUTCOMES: [&str; 3] = ["loaded", "failed", "aborted"];

const KINDS: [FailureKind; 5] = [
    FailureKind::Handshake,
    FailureKind::Transfer,
    FailureKind::Timeout,
    FailureKind::Invalid,
    FailureKind::LeaseOutlived,
];

/// The labels of the series of TP rank `rank` of `engine`, and of its pipeline stage
/// `pp_rank` when the engine has several.
pub(crate) fn rank_labels(engine: &str, rank: usize, pp_rank: Option<usize>) -> Vec<Label> {
    let mut labels = vec![
        Label::new("engine", engine.to_string()),
        Label::new("rank", rank.to_string()),
    ];
    labels.extend(pp_rank.map(|stage| Label::new("pp_rank", stage.to_string())));
    labels
}

impl Series {
    /// The handles of a worker of `role` whose series carry `labels` ([`rank_labels`]): the
    /// series of the other side are not registered (their handles do nothing).
    pub(crate) fn new(labels: Vec<Label>, role: Option<KvRole>) -> Self {
        describe();
        let (decode, prefill) = sides(role);
        let counter = |exported: bool, name: &'static str, labels: Vec<Label>| {
            if exported {
                metrics::counter!(name, labels)
            } else {
                Counter::noop()
            }
        };
        let gauge = |exported: bool, name: &'static str| {
            if exported {
                metrics::gauge!(name, labels.clone())
            } else {
                Gauge::noop()
            }
        };
        let histogram = |name: &'static str| {
            if decode {
                metrics::histogram!(name, labels.clone())
            } else {
                Histogram::noop()
            }
        };
        let kind =
            |kind: &'static str| counter(decode, NUM_FAILED_TRANSFERS, with(&labels, "kind", kind));
        Series {
            xfer_time: histogram(XFER_TIME_SECONDS),
            post_time: histogram(POST_TIME_SECONDS),
            bytes: histogram(BYTES_TRANSFERRED),
            descriptors: histogram(NUM_DESCRIPTORS),
            handshake_time: histogram(HANDSHAKE_TIME_SECONDS),
            failed: KINDS.map(|k| kind(k.as_str())),
            failed_notifications: counter(decode, NUM_FAILED_NOTIFICATIONS, labels.clone()),
            failed_notifications_kind: kind("notification"),
            expired: counter(true, NUM_KV_EXPIRED_REQS, labels.clone()),
            after_expiry: counter(prefill, NUM_NOTIFICATIONS_AFTER_EXPIRY, labels.clone()),
            heartbeats: counter(prefill, NUM_HEARTBEATS, labels.clone()),
            heartbeats_refused: counter(prefill, NUM_HEARTBEATS_REFUSED, labels.clone()),
            heartbeats_sent: counter(decode, NUM_HEARTBEATS_SENT, labels.clone()),
            held: gauge(prefill, REQUESTS_HELD),
            released: ["notification", "lease", "eviction"]
                .map(|by| counter(prefill, NUM_RELEASED_REQS, with(&labels, "by", by))),
            in_flight: gauge(decode, LOADS_IN_FLIGHT),
            loads: OUTCOMES.map(|o| counter(decode, NUM_LOADS, with(&labels, "outcome", o))),
            handshakes_pending: gauge(decode, HANDSHAKES_PENDING),
            leaked: gauge(true, LEAKED_REQUESTS),
            refused_notifications: counter(prefill, NUM_REFUSED_NOTIFICATIONS, labels.clone()),
            overdue: counter(decode, NUM_OVERDUE_TRANSFERS, labels.clone()),
            handshake_failures: counter(decode, NUM_HANDSHAKE_FAILURES, labels.clone()),
            evicted_engines: counter(decode, NUM_EVICTED_ENGINES, labels.clone()),
            push: PushSeries {
                registrations: counter(decode, NUM_PUSH_REGISTRATIONS, labels.clone()),
                timeouts: counter(decode, NUM_PUSH_REGISTRATION_TIMEOUTS, labels.clone()),
                writes: PUSH_OUTCOMES
                    .map(|o| counter(prefill, NUM_PUSH_WRITES, with(&labels, "outcome", o))),
                write_time: match prefill {
                    true => metrics::histogram!(PUSH_WRITE_TIME_SECONDS, labels.clone()),
                    false => Histogram::noop(),
                },
                waits: counter(prefill, NUM_PUSH_REGISTRATION_WAITS, labels.clone()),
                expiries: counter(prefill, NUM_PUSH_REGISTRATION_EXPIRIES, labels.clone()),
            },
        }
    }

    /// Push mode: `count` registrations sent.
    pub(crate) fn push_registrations(&self, count: u64) {
        self.push.registrations.increment(count);
    }

    /// Push mode: a load's registration timeout passed.
    pub(crate) fn push_timeout(&self) {
        self.push.timeouts.increment(1);
    }

    /// Push mode: a WRITE ended with `outcome` (`written`, `failed` or `refused`) `took`
    /// after its registration matched.
    pub(crate) fn push_write(&self, outcome: &str, took: Duration) {
        if let Some(at) = PUSH_OUTCOMES.iter().position(|&o| o == outcome) {
            self.push.writes[at].increment(1);
        }
        self.push.write_time.record(took.as_secs_f64());
    }

    /// Push mode: registrations that waited for their request, and early ones dropped.
    pub(crate) fn push_waits(&self, waited: u64, expired: u64) {
        self.push.waits.increment(waited);
        self.push.expiries.increment(expired);
    }

    /// A load started (its READs or handshakes are under way).
    pub(crate) fn load_started(&self) {
        self.in_flight.increment(1.0);
    }

    /// A load started with [`load_started`](Self::load_started) ended with `outcome`, one
    /// of `loaded`, `failed`, `aborted`.
    pub(crate) fn load_ended(&self, outcome: &str) {
        self.in_flight.decrement(1.0);
        if let Some(at) = OUTCOMES.iter().position(|&o| o == outcome) {
            self.loads[at].increment(1);
        }
    }

    /// A handshake with a remote rank began (`true`) or ended (`false`).
    pub(crate) fn handshake_pending(&self, began: bool) {
        if began {
            self.handshakes_pending.increment(1.0);
        } else {
            self.handshakes_pending.decrement(1.0);
        }
    }

    /// A heartbeat message sent.
    pub(crate) fn heartbeat_sent(&self) {
        self.heartbeats_sent.increment(1);
    }

    /// A heartbeat received that named no held request.
    pub(crate) fn heartbeat_refused(&self) {
        self.heartbeats_refused.increment(1);
    }

    /// `held` requests are held now.
    pub(crate) fn held(&self, held: usize) {
        self.held.set(held as f64);
    }

    /// A held request released: by notification (0), its lease's end (1) or eviction (2).
    pub(crate) fn released(&self, by: usize) {
        self.released[by].increment(1);
    }

    /// The agent's leaks so far.
    pub(crate) fn leaks(&self, leaks: &nixl::LeakStats) {
        self.leaked.set(leaks.requests as f64);
    }

    /// A READ that completed, with NIXL's telemetry of it.
    pub(crate) fn transfer(&self, telemetry: &nixl::XferTelemetry) {
        self.xfer_time.record(telemetry.xfer_duration.as_secs_f64());
        self.post_time.record(telemetry.post_duration.as_secs_f64());
        self.bytes.record(telemetry.total_bytes as f64);
        self.descriptors.record(telemetry.desc_count as f64);
    }

    /// A load that failed; one declined because the prefill's blocks expire counts as an
    /// expired request, not a failed transfer (as vLLM counts it).
    pub(crate) fn failed(&self, kind: FailureKind) {
        if kind == FailureKind::Expired {
            self.expired.increment(1);
        } else if let Some(at) = KINDS.iter().position(|&k| k == kind) {
            self.failed[at].increment(1);
        }
    }

    /// A notification that could not be sent.
    pub(crate) fn failed_notification(&self) {
        self.failed_notifications.increment(1);
        self.failed_notifications_kind.increment(1);
    }

    /// A handshake that succeeded.
    pub(crate) fn handshake(&self, took: Duration) {
        self.handshake_time.record(took.as_secs_f64());
    }

    /// A handshake that failed (the loads it fails are counted apart, by kind).
    pub(crate) fn handshake_failed(&self) {
        self.handshake_failures.increment(1);
    }

    /// `count` remote engines evicted.
    pub(crate) fn engines_evicted(&self, count: usize) {
        self.evicted_engines.increment(count as u64);
    }

    /// Held requests freed by their lease's end.
    pub(crate) fn expired(&self, count: u64) {
        self.expired.increment(count);
    }

    /// A notification for a request no longer held.
    pub(crate) fn after_expiry(&self) {
        self.after_expiry.increment(1);
    }

    /// A heartbeat received.
    pub(crate) fn heartbeat(&self) {
        self.heartbeats.increment(1);
    }

    /// A load whose READs outlived its transfer timeout.
    pub(crate) fn overdue(&self) {
        self.overdue.increment(1);
    }

    /// A finish notification refused.
    pub(crate) fn refused_notification(&self) {
        self.refused_notifications.increment(1);
    }
}

/// A side channel with metric labels `labels` refused a connection for `kind` (registered at
/// its first use).
pub(crate) fn side_channel_refusal(labels: &[metrics::Label], kind: &'static str) {
    let mut labels = labels.to_vec();
    labels.push(metrics::Label::new("kind", kind));
    metrics::counter!(NUM_SIDE_CHANNEL_REFUSALS, labels).increment(1);
}

/// A decode request of engine `engine` finished before its load ended (the scheduler's
/// count; registered at its first use, so a prefill never exports it).
pub(crate) fn aborted_request(engine: &str) {
    metrics::counter!(NUM_ABORTED_REQS, "engine" => engine.to_string()).increment(1);
}

/// Engine `engine`'s decode keeps `blocks` blocks for read-backs now (the scheduler's
/// gauge; registered at its first use).
pub(crate) fn kept_blocks(engine: &str, blocks: usize) {
    metrics::gauge!(KEPT_BLOCKS, "engine" => engine.to_string()).set(blocks as f64);
}

/// Engine `engine`'s decode asked its workers to release a kept request early (the
/// scheduler's count; registered at its first use).
pub(crate) fn kept_eviction(engine: &str) {
    metrics::counter!(NUM_KEPT_EVICTIONS, "engine" => engine.to_string()).increment(1);
}

/// Engine `engine`'s prefill scheduled a read-back (the scheduler's count; registered at
/// its first use).
pub(crate) fn read_back(engine: &str) {
    metrics::counter!(NUM_READ_BACKS, "engine" => engine.to_string()).increment(1);
}

/// Engine `engine`'s prefill recomputes a read-back's tokens, fewer than the threshold (the
/// scheduler's count; registered at its first use).
pub(crate) fn below_recompute_threshold(engine: &str) {
    metrics::counter!(NUM_BELOW_RECOMPUTE_THRESHOLD, "engine" => engine.to_string()).increment(1);
}

/// A decode request of engine `engine` whose blocks the prefix cache held entirely (the
/// scheduler's count; registered at its first use, so a prefill never exports it).
pub(crate) fn prefix_hit(engine: &str) {
    metrics::counter!(NUM_PREFIX_HITS, "engine" => engine.to_string()).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_of_several_is_labelled_with_its_pp_rank() {
        let shown = |labels: Vec<Label>| {
            let pairs = labels.iter().map(|l| format!("{}={}", l.key(), l.value()));
            pairs.collect::<Vec<_>>().join(",")
        };
        assert_eq!(shown(rank_labels("e", 1, None)), "engine=e,rank=1");
        assert_eq!(
            shown(rank_labels("e", 1, Some(2))),
            "engine=e,rank=1,pp_rank=2"
        );
    }

    #[test]
    fn every_series_is_described_once_and_the_histograms_are_those_listed() {
        let mut names: Vec<&str> = DESCRIPTIONS.iter().map(|&(_, name, _, _)| name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), DESCRIPTIONS.len(), "a series described twice");
        let histograms: Vec<&str> = DESCRIPTIONS
            .iter()
            .filter(|(kind, ..)| matches!(kind, SeriesKind::Histogram))
            .map(|&(_, name, _, _)| name)
            .collect();
        assert_eq!(histograms, HISTOGRAMS);
        assert!(HISTOGRAMS.iter().all(|name| buckets(name).is_some()));
    }
}

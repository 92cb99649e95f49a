//! The metrics the connector exports through the [`metrics`] crate's facade, named after
//! vLLM's `vllm:nixl_*` Prometheus series (vLLM's `NixlPromMetrics`).
//!
//! The engine picks the exporter: install a recorder (e.g. `metrics-exporter-prometheus`)
//! before creating workers, and set the histogram buckets from [`buckets`] (vLLM's). Every
//! series carries the labels `engine` (the engine id) and `rank` (the TP rank). Without a
//! recorder the facade drops everything, at the cost of an atomic load.
//!
//! Per load (decode side), from NIXL's own telemetry ([`nixl::XferRequest::telemetry`], the
//! workers' agents run with telemetry on): [`XFER_TIME_SECONDS`], [`POST_TIME_SECONDS`],
//! [`BYTES_TRANSFERRED`], [`NUM_DESCRIPTORS`]. Failures by kind: [`NUM_FAILED_TRANSFERS`]
//! (label `kind`: `handshake`, `transfer`, `timeout`, `invalid`, `notification`), and
//! [`NUM_FAILED_NOTIFICATIONS`]; loads past their transfer timeout:
//! [`NUM_OVERDUE_TRANSFERS`]. Per handshake: [`HANDSHAKE_TIME_SECONDS`]. Prefill side:
//! [`NUM_KV_EXPIRED_REQS`], [`NUM_NOTIFICATIONS_AFTER_EXPIRY`], [`NUM_HEARTBEATS`].

use std::time::Duration;

use metrics::{Counter, Histogram, Label, Unit};

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
/// Counter: loads whose READs were still in flight at the transfer timeout; their blocks
/// stay with the connector until NIXL ends the READs (decode side; not a vLLM series).
pub const NUM_OVERDUE_TRANSFERS: &str = "vllm:nixl_num_overdue_transfers";

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
        POST_TIME_SECONDS | HANDSHAKE_TIME_SECONDS => Some(&TIME_BUCKETS),
        BYTES_TRANSFERRED => Some(&BYTES_BUCKETS),
        NUM_DESCRIPTORS => Some(&DESCRIPTOR_BUCKETS),
        _ => None,
    }
}

/// Every histogram this module exports.
pub const HISTOGRAMS: [&str; 5] = [
    XFER_TIME_SECONDS,
    POST_TIME_SECONDS,
    BYTES_TRANSFERRED,
    NUM_DESCRIPTORS,
    HANDSHAKE_TIME_SECONDS,
];

/// Gives the installed recorder each series' description and unit (workers do it when
/// they are created; call it again after installing a recorder later).
pub fn describe() {
    use metrics::{describe_counter, describe_histogram};
    describe_histogram!(
        XFER_TIME_SECONDS,
        Unit::Seconds,
        "Transfer duration of NIXL KV cache loads (NIXL telemetry)."
    );
    describe_histogram!(
        POST_TIME_SECONDS,
        Unit::Seconds,
        "Post duration of NIXL KV cache loads (NIXL telemetry)."
    );
    describe_histogram!(
        BYTES_TRANSFERRED,
        Unit::Bytes,
        "Bytes per NIXL KV cache load."
    );
    describe_histogram!(
        NUM_DESCRIPTORS,
        Unit::Count,
        "Descriptors per NIXL KV cache load."
    );
    describe_histogram!(
        HANDSHAKE_TIME_SECONDS,
        Unit::Seconds,
        "Duration of side-channel handshakes with remote ranks."
    );
    describe_counter!(
        NUM_FAILED_TRANSFERS,
        Unit::Count,
        "Failed NIXL KV cache loads by kind, notification failures included."
    );
    describe_counter!(
        NUM_FAILED_NOTIFICATIONS,
        Unit::Count,
        "NIXL notifications that could not be sent."
    );
    describe_counter!(
        NUM_KV_EXPIRED_REQS,
        Unit::Count,
        "Held requests freed because their KV lease ended (prefill side)."
    );
    describe_counter!(
        NUM_NOTIFICATIONS_AFTER_EXPIRY,
        Unit::Count,
        "Notifications for requests no longer held, e.g. after their lease ended (prefill side)."
    );
    describe_counter!(
        NUM_HEARTBEATS,
        Unit::Count,
        "Heartbeat notifications received (prefill side)."
    );
    describe_counter!(
        NUM_OVERDUE_TRANSFERS,
        Unit::Count,
        "Loads whose READs were in flight at the transfer timeout; their blocks are held until the READs end."
    );
}

/// One worker's handles on the series (registered when the worker is created, so every
/// series is exported from the start).
pub(crate) struct Series {
    xfer_time: Histogram,
    post_time: Histogram,
    bytes: Histogram,
    descriptors: Histogram,
    handshake_time: Histogram,
    failed: [Counter; 4],
    failed_notifications: Counter,
    failed_notifications_kind: Counter,
    expired: Counter,
    after_expiry: Counter,
    heartbeats: Counter,
    overdue: Counter,
}

const KINDS: [FailureKind; 4] = [
    FailureKind::Handshake,
    FailureKind::Transfer,
    FailureKind::Timeout,
    FailureKind::Invalid,
];

impl Series {
    /// The handles of engine `engine`, rank `rank`.
    pub(crate) fn new(engine: &str, rank: usize) -> Self {
        describe();
        let labels = vec![
            Label::new("engine", engine.to_string()),
            Label::new("rank", rank.to_string()),
        ];
        let kind = |kind: &'static str| {
            let mut with_kind = labels.clone();
            with_kind.push(Label::new("kind", kind));
            metrics::counter!(NUM_FAILED_TRANSFERS, with_kind)
        };
        Series {
            xfer_time: metrics::histogram!(XFER_TIME_SECONDS, labels.clone()),
            post_time: metrics::histogram!(POST_TIME_SECONDS, labels.clone()),
            bytes: metrics::histogram!(BYTES_TRANSFERRED, labels.clone()),
            descriptors: metrics::histogram!(NUM_DESCRIPTORS, labels.clone()),
            handshake_time: metrics::histogram!(HANDSHAKE_TIME_SECONDS, labels.clone()),
            failed: KINDS.map(|k| kind(k.as_str())),
            failed_notifications: metrics::counter!(NUM_FAILED_NOTIFICATIONS, labels.clone()),
            failed_notifications_kind: kind("notification"),
            expired: metrics::counter!(NUM_KV_EXPIRED_REQS, labels.clone()),
            after_expiry: metrics::counter!(NUM_NOTIFICATIONS_AFTER_EXPIRY, labels.clone()),
            heartbeats: metrics::counter!(NUM_HEARTBEATS, labels.clone()),
            overdue: metrics::counter!(NUM_OVERDUE_TRANSFERS, labels),
        }
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

    /// A handshake that succeeded (a failed one is counted with the loads it fails).
    pub(crate) fn handshake(&self, took: Duration) {
        self.handshake_time.record(took.as_secs_f64());
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
}

//! The decode process's memory over the soak (#30): its heap in use (what leaks grow,
//! without the freed memory RSS keeps) once warm, at a third and two thirds of the rest of
//! the run, and at the end; the transfer requests leaked on purpose by then (a request whose
//! post or status failed may still be in flight: NIXL's request and what it holds are never
//! freed); and the bound the heap's growth after warm-up stays under.

use std::time::{Duration, Instant};

use nixl_connector::KvConnectorWorker;

use crate::common;

/// Requests after which the decode counts as warm: its agents, maps and UCX's pools at a
/// working size (about 2 s of run, before the first prefill restart).
pub const WARM_UP_REQUESTS: u64 = 100;

/// The heap a request leaked on purpose keeps, in bytes, at most: NIXL's request (its
/// descriptor lists, notification and UCX state; about 2.5 KiB in `engine_churn.rs`, 0.8 KiB
/// of it NIXL's request object by heaptrack), and its share of the prepared lists it pins.
pub const LEAKED_REQUEST_BYTES: u64 = 3072;

/// What the heap may grow by after warm-up whatever the run's length, in KiB: UCX's memory
/// pools growing to new peaks (a chunk of its registered pool alone is 2 MiB), a restarted
/// prefill's new peer (2.5 MB in the first third of a 600 s run, 0.65 MB in CI), and UCX's TCP
/// send buffers. Each message queued to a stalled peer over UCX's TCP transport holds a
/// buffer of its send segment, from the heap, which UCX pools and never frees: at the
/// connector's 64 KiB segment the soak's stalls left 1.9, 4.0 and 6.7 MB of them (UCX's 8 KiB
/// segment: 0.3 and 0.7 MB), a peak that stays flat afterwards.
pub const GROWTH_ALLOWANCE_KIB: u64 = 12288;

/// What the heap may grow by per request after warm-up, beyond the allowance and the leaked
/// requests, in bytes: about 60 measured over the last two thirds of a 600 s run (the UCX
/// entries evicted engines leave, pools at new peaks); a connector keeping 1 KiB a request
/// fails a 120 s run.
pub const MAX_GROWTH_PER_REQUEST_BYTES: u64 = 128;

/// What the heap may grow by after warm-up in a run without faults, in KiB: pools at new
/// peaks only, no request leaked and no peer evicted (a 240 s run: +134 KiB in its first
/// third, +47 KiB in its second, +3 KiB in its last; CI's 4,000 requests: 50 KiB at UCX's
/// 8 KiB TCP send segment, 169 to 241 KiB at the connector's 64 KiB, whose send pool grows
/// by several segments at a time: one growth more failed a bound of 512 KiB once).
pub const FAULT_FREE_GROWTH_ALLOWANCE_KIB: u64 = 1536;

/// What the heap may grow by per request after warm-up in a run without faults, in bytes
/// (a 240 s run: 5 bytes a request over 39,000, nearly all of it in its first third).
pub const FAULT_FREE_MAX_GROWTH_PER_REQUEST_BYTES: u64 = 16;

/// The decode's memory at one point of the run.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub at: Duration,
    pub requests: u64,
    pub prefill_restarts: u64,
    /// Transfer requests leaked so far by every agent of the decode process.
    pub leaked_requests: u64,
    pub heap_kib: u64,
    pub rss_kib: u64,
}

impl Sample {
    /// The memory now, after `requests` requests and `prefill_restarts` restarts, with the
    /// leaks of `workers`' agents.
    pub fn take(
        started: Instant,
        requests: u64,
        prefill_restarts: u64,
        workers: &[&KvConnectorWorker],
    ) -> Sample {
        Sample {
            at: started.elapsed(),
            requests,
            prefill_restarts,
            leaked_requests: workers
                .iter()
                .map(|w| w.agent().leak_stats().requests)
                .sum(),
            heap_kib: common::heap_in_use_kib(),
            rss_kib: common::status_kib("VmRSS"),
        }
    }
}

/// When the soak samples the decode's memory: once warm, at a third and two thirds of the
/// rest of the run (of its time in a long run, of its requests in CI), and at the end.
pub struct MemoryTrace {
    /// The run's length, in a long run.
    seconds: Option<u64>,
    /// The requests of a CI run.
    target: u64,
    samples: Vec<Sample>,
}

impl MemoryTrace {
    /// A trace of a long run of `seconds`, or of a CI run of `target` requests.
    pub fn new(seconds: Option<u64>, target: u64) -> MemoryTrace {
        MemoryTrace {
            seconds,
            target,
            samples: Vec::new(),
        }
    }

    /// Whether the next sample before the end is due, after `requests` at `elapsed`.
    pub fn due(&self, requests: u64, elapsed: Duration) -> bool {
        let Some(warm) = self.samples.first() else {
            return requests >= WARM_UP_REQUESTS;
        };
        let thirds = self.samples.len() as u64;
        if thirds > 2 {
            return false;
        }
        match self.seconds {
            Some(s) => {
                let rest = Duration::from_secs(s).saturating_sub(warm.at);
                elapsed >= warm.at + rest * thirds as u32 / 3
            }
            None => {
                requests >= warm.requests + self.target.saturating_sub(warm.requests) * thirds / 3
            }
        }
    }

    /// Records `sample`.
    pub fn push(&mut self, sample: Sample) {
        self.samples.push(sample);
    }

    /// Prints the samples and what the heap grew by after warm-up, and checks it against the
    /// bound: the allowance, the leaked requests, and a small slope per request; without
    /// `faults`, no request leaked and a tight allowance and slope.
    pub fn report_and_check(&self, faults: bool) {
        for s in &self.samples {
            eprintln!(
                "soak memory at {:.1} s: {} requests, {} prefill restarts, {} requests leaked, \
                 heap in use {} KiB, RSS {} KiB",
                s.at.as_secs_f64(),
                s.requests,
                s.prefill_restarts,
                s.leaked_requests,
                s.heap_kib,
                s.rss_kib
            );
        }
        let (Some(warm), Some(end)) = (self.samples.first(), self.samples.last()) else {
            panic!("the soak ended before it was warm: {:?}", self.samples);
        };
        let requests = end.requests - warm.requests;
        let leaked = end.leaked_requests - warm.leaked_requests;
        let growth_kib = end.heap_kib.saturating_sub(warm.heap_kib);
        let leaked_kib = leaked * LEAKED_REQUEST_BYTES / 1024;
        let (allowance_kib, per_request) = if faults {
            (GROWTH_ALLOWANCE_KIB, MAX_GROWTH_PER_REQUEST_BYTES)
        } else {
            assert_eq!(end.leaked_requests, 0, "no request leaked without faults");
            (
                FAULT_FREE_GROWTH_ALLOWANCE_KIB,
                FAULT_FREE_MAX_GROWTH_PER_REQUEST_BYTES,
            )
        };
        let bound_kib = allowance_kib + leaked_kib + requests * per_request / 1024;
        eprintln!(
            "soak memory after warm-up: heap +{growth_kib} KiB over {requests} requests ({:.0} \
             bytes a request), {leaked} requests leaked (at most {leaked_kib} KiB of it); bound \
             {bound_kib} KiB ({allowance_kib} KiB, the leaks and {per_request} bytes a \
             request)",
            growth_kib as f64 * 1024.0 / requests.max(1) as f64,
        );
        assert!(
            growth_kib <= bound_kib,
            "the decode's heap grew by {growth_kib} KiB after warm-up, over its bound of \
             {bound_kib} KiB: {:?}",
            self.samples
        );
    }
}

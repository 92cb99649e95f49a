//! Push mode's part of a worker (see [`Shared`](crate::worker::shared::Shared)): its
//! settings, the prefill book and decode waits of `push_book.rs` behind their locks, and
//! what push did so far; `push.rs` drives it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use crate::metrics::series::Series;
use crate::transfer_mode::PushSettings;
use crate::worker::push_book::{DecodeWaits, PrefillBook};
#[cfg(feature = "vllm")]
use crate::worker::push_book_vllm::VllmPrefillBook;

/// What push mode did on a worker so far (both roles).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PushStats {
    /// Decode: registrations sent (one per prefill rank and load).
    pub registrations_sent: u64,
    /// Decode: loads whose registration timeout passed before every prefill rank ended.
    pub registration_timeouts: u64,
    /// Decode: ends refused (an unknown request, an agent not registered with, a bad tag)
    /// or malformed push messages.
    pub refused_ends: u64,
    /// Prefill: registrations matched to a held request.
    pub registrations_matched: u64,
    /// Prefill: registrations that waited for their request to be held.
    pub registrations_waited: u64,
    /// Prefill: early registrations and cancels dropped unmatched (past the bounds or
    /// their time).
    pub registrations_evicted: u64,
    /// Prefill: registrations and cancels refused (no valid tag, malformed).
    pub registrations_refused: u64,
    /// Prefill: registrations that do not fit the request held (more blocks than it has,
    /// another group count, a geometry it cannot write), answered `refused`.
    pub registrations_oversized: u64,
    /// Prefill: WRITEs NIXL ended well (a rank whose copy of a decode rank's heads another
    /// rank writes ends with its notification alone, counted here with no bytes).
    pub writes: u64,
    /// Prefill: bytes of those WRITEs.
    pub bytes_written: u64,
    /// Prefill: WRITEs (or the handshakes before them) that failed.
    pub failed_writes: u64,
}

/// A worker's push-mode part (in [`Shared`]): its settings, its prefill book and decode
/// waits, its counts. Each lock is held only within one call, never across an await or
/// another part's lock.
pub(crate) struct Push {
    pub(crate) settings: PushSettings,
    /// The worker's KV lease (vLLM's protocol: how long a load whose registration went
    /// unwritten keeps its blocks after its heartbeats stop, see `push_vllm.rs`).
    #[cfg_attr(not(feature = "vllm"), allow(dead_code))]
    pub(crate) lease: std::time::Duration,
    /// vLLM's protocol: the prefill request ids whose loads stopped waiting (timed out),
    /// each with its load's request id: their heartbeats stop, so that the prefill's
    /// lease ends, until the engine has taken the load's end.
    silenced: Mutex<std::collections::HashMap<String, String>>,
    book: Mutex<PrefillBook>,
    /// vLLM's protocol: its prefill book (registrations without proofs).
    #[cfg(feature = "vllm")]
    vllm_book: Mutex<VllmPrefillBook>,
    waits: Mutex<DecodeWaits>,
    stats: Mutex<PushStats>,
    /// The book's waits and drops the series have heard of.
    exported: Mutex<(u64, u64)>,
    /// The worker is gone or shutting down: the listener takes the ends of the loads still
    /// waiting, then stops.
    closing: AtomicBool,
    /// Wakes the listener: the worker closes, or a load stopped waiting.
    changed: tokio::sync::Notify,
    /// The rank's native side channel: it serves until the listener stops, so that a
    /// prefill rank can still handshake to answer a load's cancel after the worker closed.
    side_channels: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Push {
    /// The part of a worker whose held requests' leases last `lease`.
    pub(crate) fn new(settings: PushSettings, lease: std::time::Duration) -> Self {
        Push {
            settings,
            lease,
            silenced: Mutex::default(),
            book: Mutex::new(PrefillBook::new(lease)),
            #[cfg(feature = "vllm")]
            vllm_book: Mutex::new(VllmPrefillBook::new(lease)),
            waits: Mutex::default(),
            stats: Mutex::default(),
            exported: Mutex::default(),
            closing: AtomicBool::new(false),
            changed: tokio::sync::Notify::new(),
            side_channels: Mutex::default(),
        }
    }

    /// Keeps the rank's side channel `server` serving until [`stop_serving`](Self::stop_serving).
    pub(crate) fn keep_serving(&self, server: tokio::task::JoinHandle<()>) {
        self.side_channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(server);
    }

    /// Stops the rank's side channel (the listener stopped: no load waits, the worker is
    /// gone).
    pub(crate) fn stop_serving(&self) {
        let servers =
            std::mem::take(&mut *self.side_channels.lock().unwrap_or_else(|p| p.into_inner()));
        for server in servers {
            server.abort();
        }
    }

    /// The worker is gone or shutting down (see [`closed`](Self::closed)).
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Release);
        self.changed.notify_one();
    }

    /// A load stopped waiting: the listener checks whether it may stop.
    pub(crate) fn load_ended(&self) {
        self.changed.notify_one();
    }

    /// Resolves when the worker closes or a load stops waiting.
    pub(crate) async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Whether the worker is closing, so that the listener takes no new registration.
    pub(crate) fn closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Whether the worker is closing and no load waits: the listener may stop.
    pub(crate) fn closed(&self) -> bool {
        self.closing() && self.waits().is_empty()
    }

    pub(crate) fn book(&self) -> MutexGuard<'_, PrefillBook> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[cfg(feature = "vllm")]
    pub(crate) fn vllm_book(&self) -> MutexGuard<'_, VllmPrefillBook> {
        self.vllm_book.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn waits(&self) -> MutexGuard<'_, DecodeWaits> {
        self.waits.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn count(&self, add: impl FnOnce(&mut PushStats)) {
        add(&mut self.stats.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// The counts so far, the prefill book's included.
    pub(crate) fn stats(&self) -> PushStats {
        #[cfg_attr(not(feature = "vllm"), allow(unused_mut))]
        let mut book = self.book().stats;
        #[cfg(feature = "vllm")]
        {
            let vllm = self.vllm_book().stats;
            book.matched += vllm.matched;
            book.waited += vllm.waited;
            book.evicted += vllm.evicted;
            book.refused += vllm.refused;
        }
        let mut stats = *self.stats.lock().unwrap_or_else(|p| p.into_inner());
        stats.registrations_matched = book.matched;
        stats.registrations_waited = book.waited;
        stats.registrations_evicted = book.evicted;
        stats.registrations_refused += book.refused;
        stats
    }

    /// The held requests `released` are gone: late messages for them hear `gone`. Early
    /// registrations past their time are dropped, and `series` hears of the waits and
    /// drops since the last call.
    pub(crate) fn released(&self, released: &[String], series: &Series) {
        let mut book = self.book();
        for id in released {
            book.released(id);
        }
        book.expire(Instant::now());
        #[cfg_attr(not(feature = "vllm"), allow(unused_mut))]
        let mut now = (book.stats.waited, book.stats.evicted);
        drop(book);
        #[cfg(feature = "vllm")]
        {
            let mut book = self.vllm_book();
            for id in released {
                book.released(id);
            }
            book.expire(Instant::now());
            now = (now.0 + book.stats.waited, now.1 + book.stats.evicted);
        }
        let mut exported = self.exported.lock().unwrap_or_else(|p| p.into_inner());
        series.push_waits(now.0 - exported.0, now.1 - exported.1);
        *exported = now;
    }

    /// vLLM's protocol: stops the heartbeats of the prefill's `request_id`, for the load
    /// of `load_id`.
    #[cfg_attr(not(feature = "vllm"), allow(dead_code))]
    pub(crate) fn silence(&self, request_id: &str, load_id: &str) {
        let mut silenced = self.silenced.lock().unwrap_or_else(|p| p.into_inner());
        silenced.insert(request_id.to_string(), load_id.to_string());
    }

    /// The engine took the ends of the loads `ended`: their heartbeats, stopped, are the
    /// scheduler's again (it sends none for an ended load).
    pub(crate) fn loads_taken(&self, ended: &[String]) {
        let mut silenced = self.silenced.lock().unwrap_or_else(|p| p.into_inner());
        if !silenced.is_empty() {
            silenced.retain(|_, load| !ended.contains(load));
        }
    }

    /// Whether the heartbeats of the prefill's `request_id` are stopped.
    pub(crate) fn silenced(&self, request_id: &str) -> bool {
        self.silenced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(request_id)
    }

    /// Wakes the load of `request_id`, if it waits (it was aborted).
    pub(crate) fn wake(&self, request_id: &str) {
        self.waits().wake(request_id);
    }
}

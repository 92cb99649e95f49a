//! What the decode printed (see [`crate::roles::decode`]), read as it comes, on the
//! monotonic clock both namespaces share.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::process::Child;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::common::stdout_lines;
use crate::hosts::Fault;

/// A load as the decode reported it.
#[derive(Debug, Clone, Default)]
pub struct Load {
    /// When it started (ms).
    pub start: u64,
    /// When it passed the transfer timeout, if it did.
    pub overdue: Option<u64>,
    /// When it ended, and how.
    pub end: Option<(u64, String)>,
}

/// What the decode holds, as its `STATS` line says (see `roles::print_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Open file descriptors.
    pub fds: u64,
    /// Threads.
    pub threads: u64,
    /// Resident memory, KiB.
    pub rss_kib: u64,
    /// Remote agents loaded.
    pub agents: u64,
    /// Remote engines known.
    pub engines: u64,
    /// Metadata loads into NIXL so far.
    pub metadata_loads: u64,
    /// NIXL requests given up while maybe in flight.
    pub leaked_requests: u64,
    /// Handshakes started and not yet ended.
    pub handshakes_pending: u64,
}

#[derive(Default)]
struct State {
    loads: BTreeMap<String, Load>,
    stats: Vec<Held>,
    loaded: usize,
    /// Blocks written after their load handed them back (`LATE` lines).
    late_blocks: usize,
    drained: Option<usize>,
    closed: bool,
}

/// The decode's report, filled by a reader thread.
pub struct Timeline {
    state: Arc<(Mutex<State>, Condvar)>,
}

impl Timeline {
    /// Reads `decode`'s stdout in a thread.
    pub fn read(decode: &mut Child) -> Self {
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        let mut lines = stdout_lines(decode);
        let shared = state.clone();
        std::thread::spawn(move || {
            for line in lines.by_ref().map_while(Result::ok) {
                let (lock, changed) = &*shared;
                let mut state = lock.lock().unwrap();
                state.take(&line);
                changed.notify_all();
            }
            let (lock, changed) = &*shared;
            lock.lock().unwrap().closed = true;
            changed.notify_all();
        });
        Timeline { state }
    }

    /// Waits until `count` more loads were loaded; an error naming `what` after `limit`
    /// or when the decode's output ends.
    pub fn wait_loaded(&self, count: usize, limit: Duration, what: &str) -> Result<(), String> {
        let (lock, changed) = &*self.state;
        let mut state = lock.lock().unwrap();
        let want = state.loaded + count;
        let deadline = Instant::now() + limit;
        while state.loaded < want {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || state.closed {
                return Err(format!("waited in vain for {what}: {}", state.summary()));
            }
            state = changed.wait_timeout(state, left).unwrap().0;
        }
        Ok(())
    }

    /// Waits until `count` loads of requests named `prefix...` (a prefill's, see
    /// [`crate::roles::decode`]) were loaded in all; an error naming `what` after `limit` or
    /// when the decode's output ends.
    pub fn wait_loaded_from(
        &self,
        prefix: &str,
        count: usize,
        limit: Duration,
        what: &str,
    ) -> Result<(), String> {
        let (lock, changed) = &*self.state;
        let mut state = lock.lock().unwrap();
        let deadline = Instant::now() + limit;
        while state.loaded_from(prefix, 0, u64::MAX) < count {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || state.closed {
                return Err(format!("waited in vain for {what}: {}", state.summary()));
            }
            state = changed.wait_timeout(state, left).unwrap().0;
        }
        Ok(())
    }

    /// Waits at most `limit` for the `count`-th `STATS` line of the decode; what it said.
    pub fn wait_stats(&self, count: usize, limit: Duration) -> Option<Held> {
        let (lock, changed) = &*self.state;
        let mut state = lock.lock().unwrap();
        let deadline = Instant::now() + limit;
        while state.stats.len() < count && !state.closed {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = changed.wait_timeout(state, left).unwrap().0;
        }
        state.stats.get(count - 1).copied()
    }

    /// How many loads of requests named `prefix...` ended loaded from `from` to `to` (ms).
    pub fn loaded_from(&self, prefix: &str, from: u64, to: u64) -> usize {
        self.state.0.lock().unwrap().loaded_from(prefix, from, to)
    }

    /// Waits at most `limit` for the decode's `DRAINED` line: the loads it left in flight.
    pub fn wait_drained(&self, limit: Duration) -> Option<usize> {
        let (lock, changed) = &*self.state;
        let mut state = lock.lock().unwrap();
        let deadline = Instant::now() + limit;
        while state.drained.is_none() && !state.closed {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = changed.wait_timeout(state, left).unwrap().0;
        }
        state.drained
    }

    /// Waits at most `limit` for `count` loads to end (however they did); the first one's
    /// start, end and outcome.
    pub fn wait_ended(&self, count: usize, limit: Duration) -> Result<(u64, u64, String), String> {
        let (lock, changed) = &*self.state;
        let mut state = lock.lock().unwrap();
        let deadline = Instant::now() + limit;
        loop {
            let mut ended: Vec<(u64, u64, String)> = state
                .loads
                .values()
                .filter_map(|l| l.end.clone().map(|(end, how)| (l.start, end, how)))
                .collect();
            if ended.len() >= count {
                ended.sort();
                return Ok(ended.swap_remove(0));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || state.closed {
                return Err(format!(
                    "waited in vain for {count} loads to end: {}",
                    state.summary()
                ));
            }
            state = changed.wait_timeout(state, left).unwrap().0;
        }
    }

    /// The loads that READ through a fault from `at` to `until` and failed of it: those that
    /// ended in between, neither loaded nor failed at the handshake, each with the time from
    /// `at` (or its start, if later) to its end, in ms.
    pub fn failed_reads(&self, at: u64, until: u64) -> Vec<u64> {
        self.loads()
            .values()
            .filter_map(|load| load.end.as_ref().map(|(end, how)| (load.start, *end, how)))
            .filter(|(_, end, how)| {
                (at + 1..=until).contains(end) && *how != "loaded" && !how.starts_with("Handshake")
            })
            .map(|(start, end, _)| end - start.max(at))
            .collect()
    }

    /// How many blocks the decode found written after their load handed them back.
    pub fn late_blocks(&self) -> usize {
        self.state.0.lock().unwrap().late_blocks
    }

    /// Every load the decode reported.
    pub fn loads(&self) -> BTreeMap<String, Load> {
        self.state.0.lock().unwrap().loads.clone()
    }

    /// Per fault: how long it lasted, the loads it touched (in flight at its start, or
    /// started before its end) and how they ended, and the longest time from the fault's
    /// start (or the load's, if later) to a load's end; then the outcomes of all loads.
    pub fn report(&self, faults: &[(Fault, u64, u64)]) -> String {
        let loads = self.loads();
        let mut out = String::new();
        for (i, (fault, at, healed)) in faults.iter().enumerate() {
            let touched: Vec<&Load> = loads
                .values()
                .filter(|l| l.start <= *healed && l.end.as_ref().map_or(true, |(end, _)| end > at))
                .collect();
            let waits: Vec<Option<u64>> = touched
                .iter()
                .map(|l| l.end.as_ref().map(|(end, _)| end - l.start.max(*at)))
                .collect();
            let longest = if waits.iter().any(Option::is_none) {
                "never".to_string()
            } else {
                format!("{} ms", waits.iter().flatten().max().copied().unwrap_or(0))
            };
            let loaded = touched
                .iter()
                .filter(|l| l.end.as_ref().is_some_and(|(_, how)| how == "loaded"))
                .count();
            let _ = writeln!(
                out,
                "fault {i} ({}, {at} + {} ms): {} loads touched, {loaded} loaded; longest from fault to a load's end: {longest}",
                fault.name(),
                healed - at,
                touched.len(),
            );
        }
        let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
        for load in loads.values() {
            let how = load
                .end
                .as_ref()
                .map_or("never ended".to_string(), |(_, how)| {
                    how.split(" ").take(1).collect::<String>()
                });
            *outcomes.entry(how).or_default() += 1;
        }
        let _ = writeln!(
            out,
            "outcomes: {outcomes:?}; blocks written after their load ended: {}",
            self.late_blocks()
        );
        // Each failure reason (its numbers left out) once, with how often and when first.
        let mut reasons: BTreeMap<String, (usize, u64)> = BTreeMap::new();
        for load in loads.values() {
            if let Some((end, how)) = &load.end {
                if how != "loaded" {
                    let key: String = how.chars().filter(|c| !c.is_ascii_digit()).collect();
                    let entry = reasons.entry(key).or_insert((0, *end));
                    entry.0 += 1;
                    entry.1 = entry.1.min(*end);
                }
            }
        }
        for (how, (count, first)) in reasons {
            let _ = writeln!(out, "  {count} x, first at {first}: {how}");
        }
        out
    }
}

impl State {
    /// Takes one line of the decode's output (libtest may have printed the test's name
    /// before the first one, on the same line).
    fn take(&mut self, line: &str) {
        if let Some(at) = line.find("STATS ") {
            let n: Vec<u64> = line[at + 6..]
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            if let [fds, threads, rss_kib, agents, engines, metadata_loads, leaked_requests, handshakes_pending] =
                n[..]
            {
                self.stats.push(Held {
                    fds,
                    threads,
                    rss_kib,
                    agents,
                    engines,
                    metadata_loads,
                    leaked_requests,
                    handshakes_pending,
                });
            }
            return;
        }
        let Some(at) = ["START ", "OVERDUE ", "END ", "DRAINED ", "LATE "]
            .iter()
            .filter_map(|tag| line.find(tag))
            .min()
        else {
            return;
        };
        let mut words = line[at..].splitn(4, ' ');
        let (tag, first) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        let ms = words.next().and_then(|w| w.trim().parse::<u64>().ok());
        let how = words.next().unwrap_or("").to_string();
        match tag {
            "START" => self.loads.entry(first.to_string()).or_default().start = ms.unwrap_or(0),
            "OVERDUE" => self.loads.entry(first.to_string()).or_default().overdue = ms,
            "END" => {
                if how == "loaded" {
                    self.loaded += 1;
                }
                self.loads.entry(first.to_string()).or_default().end = Some((ms.unwrap_or(0), how));
            }
            "DRAINED" => self.drained = first.trim().parse().ok(),
            "LATE" => self.late_blocks += how.trim().parse::<usize>().unwrap_or(1),
            _ => {}
        }
    }

    /// How many loads of requests named `prefix...` ended loaded from `from` to `to` (ms).
    fn loaded_from(&self, prefix: &str, from: u64, to: u64) -> usize {
        self.loads
            .iter()
            .filter(|(request, _)| request.starts_with(prefix))
            .filter_map(|(_, load)| load.end.as_ref())
            .filter(|(end, how)| how == "loaded" && (from..=to).contains(end))
            .count()
    }

    fn summary(&self) -> String {
        let open = self.loads.values().filter(|l| l.end.is_none()).count();
        format!(
            "{} loads started, {} loaded, {open} not ended",
            self.loads.len(),
            self.loaded
        )
    }
}

//! The completion driver: one background thread per agent that polls the requests awaited
//! asynchronously (or dropped in flight) and the notifications awaited asynchronously, and
//! wakes the tasks waiting on them.
//!
//! It is runtime-agnostic: futures register a std [`Waker`], and the driver calls it.
//! It starts on the agent's first asynchronous use. While requests are in flight it polls
//! them back to back (the polling thread is the one UCX copies in, so it does the work a
//! blocking `wait` would); when none are, it keeps looking for new ones for a short while,
//! then parks on a condition variable and costs nothing. With notification waiters and no
//! requests, it polls notifications with a back-off from 20 µs to 1 ms.
//!
//! Backpressure: at most [`CAPACITY`] requests are admitted per agent; further futures wait
//! for room. A request dropped in flight is always taken (dropping cannot wait).

use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::Waker;
use std::time::{Duration, Instant};

use crate::agent::driver_stats::{DriverCounters, DriverStats};
use crate::agent::notify_hub::{Hub, Notification};
use crate::error::{Error, Result};

/// Most requests one agent's driver holds at once.
pub(crate) const CAPACITY: usize = 4096;
/// How long the driver keeps looking for new requests before it parks.
const SPIN_BEFORE_PARK: Duration = Duration::from_micros(200);
/// Shortest and longest pause between notification polls while waiters exist.
const NOTIF_BACKOFF: (Duration, Duration) = (Duration::from_micros(20), Duration::from_millis(1));

/// Locks a mutex, ignoring poisoning (every critical section leaves consistent state).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the driver polls: a transfer request, as far as the driver is concerned.
pub(crate) trait Pollable: Send {
    /// Polls once: `Ok(true)` when done, `Ok(false)` while in progress, `Err` when failed.
    fn poll_done(&mut self) -> Result<bool>;
    /// The value itself, for the future that gets it back to recover its type.
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

/// Takes the notifications NIXL holds for the agent.
pub(crate) type Fetch = Box<dyn Fn() -> Result<Vec<Notification>> + Send + Sync>;

/// What a polled item ends as: itself when done, or the error that failed it.
pub(crate) type Outcome = Result<Box<dyn Pollable>>;

/// Where the outcome of one awaited request is handed from the driver to its future.
#[derive(Default)]
pub(crate) struct Slot {
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    outcome: Option<Outcome>,
    waker: Option<Waker>,
    /// The future is gone: the driver releases the request itself once it is done.
    cancelled: bool,
}

impl Slot {
    /// The outcome, if the driver delivered it; otherwise `waker` is called once it does.
    pub(crate) fn take_or_wait(&self, waker: &Waker) -> Option<Outcome> {
        let mut state = lock(&self.state);
        let outcome = state.outcome.take();
        if outcome.is_none() {
            match &state.waker {
                Some(known) if known.will_wake(waker) => {}
                _ => state.waker = Some(waker.clone()),
            }
        }
        outcome
    }

    /// Marks the future gone; returns an outcome delivered meanwhile, to be dropped.
    pub(crate) fn cancel(&self) -> Option<Outcome> {
        let mut state = lock(&self.state);
        state.cancelled = true;
        state.waker = None;
        state.outcome.take()
    }

    /// Hands `outcome` to the future, or gives it back when the future is gone.
    fn deliver(&self, outcome: Outcome) -> Option<Outcome> {
        let mut state = lock(&self.state);
        if state.cancelled {
            return Some(outcome);
        }
        state.outcome = Some(outcome);
        let waker = state.waker.take();
        drop(state);
        if let Some(waker) = waker {
            waker.wake();
        }
        None
    }
}

/// A request the driver polls, and where its outcome goes.
pub(crate) struct Entry {
    pub(crate) item: Box<dyn Pollable>,
    pub(crate) slot: Arc<Slot>,
}

#[derive(Default)]
struct Queue {
    incoming: Vec<Entry>,
    /// Requests admitted and not yet finished (incoming plus those the thread holds).
    admitted: usize,
    /// Futures waiting for room.
    room: VecDeque<Waker>,
    parked: bool,
    stop: bool,
}

/// What the agent and the futures share with the driver thread.
pub(crate) struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Notifications awaited asynchronously.
    pub(crate) hub: Mutex<Hub>,
    /// Serialises taking notifications from NIXL with handing them out, so that messages
    /// keep their order whoever polls.
    pub(crate) notif_poll: Mutex<()>,
    /// How to take notifications from NIXL, installed by the first notification waiter.
    fetch: OnceLock<Fetch>,
    /// What the driver did so far.
    counters: DriverCounters,
}

/// The handle an agent keeps on its driver.
pub(crate) struct Driver {
    pub(crate) shared: Arc<Shared>,
}

impl Driver {
    /// Starts the driver thread of the agent named `agent`.
    pub(crate) fn start(agent: &str) -> Result<Driver> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            hub: Mutex::new(Hub::default()),
            notif_poll: Mutex::new(()),
            fetch: OnceLock::new(),
            counters: DriverCounters::default(),
        });
        let name: String = format!("nixl-drv-{agent}").chars().take(15).collect();
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || run(&thread_shared))
            .map_err(|source| Error::Io {
                operation: "start the completion driver",
                source,
            })?;
        tracing::debug!(%agent, "started the completion driver");
        Ok(Driver { shared })
    }

    /// Tells the driver thread to exit once it holds no request.
    pub(crate) fn stop(&self) {
        lock(&self.shared.queue).stop = true;
        self.shared.wake.notify_one();
    }
}

impl Shared {
    /// Admits `entry` if there is room (or `force`), else keeps `waker` to be woken when
    /// there is and gives the entry back.
    pub(crate) fn submit(
        &self,
        entry: Entry,
        force: bool,
        waker: Option<&Waker>,
    ) -> std::result::Result<(), Entry> {
        let mut queue = lock(&self.queue);
        if !force && queue.admitted >= CAPACITY {
            if let Some(waker) = waker {
                queue.room.push_back(waker.clone());
            }
            self.counters.waited_for_room();
            return Err(entry);
        }
        if force {
            self.counters.dropped_in_flight();
        } else {
            self.counters.awaited();
        }
        queue.admitted += 1;
        queue.incoming.push(entry);
        let parked = queue.parked;
        drop(queue);
        if parked {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// What the driver did so far, and the requests it holds now.
    pub(crate) fn stats(&self) -> DriverStats {
        let held = lock(&self.queue).admitted;
        self.counters.snapshot(held)
    }

    /// Wakes the driver if it is parked (e.g. a notification waiter arrived).
    pub(crate) fn kick(&self) {
        if lock(&self.queue).parked {
            self.wake.notify_one();
        }
    }

    /// Counts `count` requests as finished and wakes as many futures waiting for room.
    fn finished(&self, count: usize) {
        if count == 0 {
            return;
        }
        let wakers: Vec<Waker> = {
            let mut queue = lock(&self.queue);
            queue.admitted -= count;
            let n = count.min(queue.room.len());
            queue.room.drain(..n).collect()
        };
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Sets how notifications are taken from NIXL, unless that is set already.
    pub(crate) fn install_fetch(&self, fetch: Fetch) {
        let _ = self.fetch.set(fetch);
    }

    /// Takes the notifications NIXL holds into the hub, handing each to its waiter; returns
    /// how many arrived.
    pub(crate) fn pull(&self) -> Result<usize> {
        let Some(fetch) = self.fetch.get() else {
            return Ok(0);
        };
        let _order = lock(&self.notif_poll);
        let notes = fetch()?;
        let count = notes.len();
        let wakers: Vec<Waker> = {
            let mut hub = lock(&self.hub);
            notes.into_iter().filter_map(|n| hub.dispatch(n)).collect()
        };
        wakers.into_iter().for_each(Waker::wake);
        Ok(count)
    }

    /// [`pull`](Self::pull) for the driver thread, which logs a failure and goes on.
    fn poll_notifications(&self) -> usize {
        self.pull().unwrap_or_else(|err| {
            tracing::warn!(%err, "the completion driver could not take notifications");
            0
        })
    }
}

/// Polls each held request once; removes the finished ones and delivers them, counting
/// them out of the held requests first, so whoever sees a delivery sees them gone.
fn poll_requests(shared: &Shared, held: &mut Vec<Entry>) {
    let mut ended = Vec::new();
    let mut index = 0;
    while index < held.len() {
        let outcome = match held[index].item.poll_done() {
            Ok(false) => {
                index += 1;
                continue;
            }
            Ok(true) => None,
            Err(err) => Some(err),
        };
        ended.push((held.swap_remove(index), outcome));
    }
    shared.finished(ended.len());
    for (Entry { item, slot }, outcome) in ended {
        let leftover = match outcome {
            None => slot.deliver(Ok(item)),
            // A failed request may still be partly in flight: dropping it leaks it with its
            // memory (see XferRequest).
            Some(err) => {
                drop(item);
                slot.deliver(Err(err))
            }
        };
        // A cancelled future's request is released (or leaked) here, off the caller's thread.
        drop(leftover);
    }
}

/// The driver thread.
fn run(shared: &Shared) {
    let mut held: Vec<Entry> = Vec::new();
    let mut idle_since: Option<Instant> = None;
    let mut backoff = NOTIF_BACKOFF.0;
    let mut next_notif = Instant::now();
    let mut rounds: u32 = 0;
    loop {
        held.append(&mut lock(&shared.queue).incoming);
        if !held.is_empty() {
            idle_since = None;
            poll_requests(shared, &mut held);
        }
        let now = Instant::now();
        let notif_waiters = lock(&shared.hub).wants_messages();
        if notif_waiters && now >= next_notif {
            backoff = if shared.poll_notifications() > 0 {
                NOTIF_BACKOFF.0
            } else {
                (backoff * 2).min(NOTIF_BACKOFF.1)
            };
            next_notif = now + backoff;
        }
        if !held.is_empty() {
            rounds = rounds.wrapping_add(1);
            if rounds % 64 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        let since = *idle_since.get_or_insert(now);
        if now.duration_since(since) < SPIN_BEFORE_PARK {
            std::thread::yield_now();
            continue;
        }
        let mut queue = lock(&shared.queue);
        if !queue.incoming.is_empty() {
            continue;
        }
        if queue.stop {
            return;
        }
        queue.parked = true;
        queue = if notif_waiters {
            let pause = next_notif.saturating_duration_since(Instant::now());
            shared
                .wake
                .wait_timeout(queue, pause)
                .unwrap_or_else(PoisonError::into_inner)
                .0
        } else {
            shared
                .wake
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner)
        };
        queue.parked = false;
    }
}

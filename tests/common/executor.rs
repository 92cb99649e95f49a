//! A hand-made executor for the tests: it polls futures on the calling thread, each with its
//! own waker, and between rounds sleeps until a waker is woken, then polls only the futures
//! whose wakers were. A future that completes under it was woken through its own waker: no
//! runtime, timer or busy poll stood in, and a lost wake-up leaves it pending.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::Instant;

use super::WAIT;

/// What the wakers share: which futures were woken, and the thread to wake.
struct Woken {
    thread: Thread,
    indices: Mutex<Vec<usize>>,
    wakes: AtomicUsize,
}

/// The waker of future `index`.
struct FutureWaker {
    index: usize,
    woken: Arc<Woken>,
}

impl Wake for FutureWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.wakes.fetch_add(1, Ordering::SeqCst);
        self.woken.indices.lock().unwrap().push(self.index);
        self.woken.thread.unpark();
    }
}

/// Futures polled on this thread.
pub struct Executor<F: Future> {
    futures: Vec<Option<Pin<Box<F>>>>,
    outputs: Vec<Option<F::Output>>,
    wakers: Vec<Waker>,
    woken: Arc<Woken>,
    /// Whether every future was polled once already.
    started: bool,
}

impl<F: Future> Executor<F> {
    /// An executor for `futures`, on the calling thread; nothing is polled yet.
    pub fn new(futures: impl IntoIterator<Item = F>) -> Self {
        let futures: Vec<_> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
        let outputs = futures.iter().map(|_| None).collect();
        let woken = Arc::new(Woken {
            thread: std::thread::current(),
            indices: Mutex::new(Vec::new()),
            wakes: AtomicUsize::new(0),
        });
        let wakers = (0..futures.len())
            .map(|index| {
                Waker::from(Arc::new(FutureWaker {
                    index,
                    woken: woken.clone(),
                }))
            })
            .collect();
        Executor {
            futures,
            outputs,
            wakers,
            woken,
            started: false,
        }
    }

    /// Polls future `index` if it is not done yet; returns whether it is done now.
    fn poll_one(&mut self, index: usize) -> bool {
        let Some(future) = &mut self.futures[index] else {
            return true;
        };
        let mut cx = Context::from_waker(&self.wakers[index]);
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(out) => {
                self.outputs[index] = Some(out);
                self.futures[index] = None;
                true
            }
            Poll::Pending => false,
        }
    }

    /// Polls every unfinished future once, woken or not; returns how many are pending.
    pub fn poll_all(&mut self) -> usize {
        self.started = true;
        (0..self.futures.len())
            .filter(|&index| !self.poll_one(index))
            .count()
    }

    /// How many times a waker of this executor was woken so far.
    pub fn wakes(&self) -> usize {
        self.woken.wakes.load(Ordering::SeqCst)
    }

    /// Polls every future once (unless [`poll_all`](Self::poll_all) did), then only the
    /// woken ones, sleeping between rounds, until all are ready; returns the outputs in
    /// order. Panics after [`WAIT`].
    pub fn run(&mut self) -> Vec<F::Output> {
        let deadline = Instant::now() + WAIT;
        let mut pending = if self.started {
            self.futures.iter().filter(|f| f.is_some()).count()
        } else {
            self.poll_all()
        };
        while pending > 0 {
            let woken = std::mem::take(&mut *self.woken.indices.lock().unwrap());
            if woken.is_empty() {
                let left = deadline.saturating_duration_since(Instant::now());
                assert!(
                    !left.is_zero(),
                    "{pending} futures never woken within {WAIT:?}"
                );
                std::thread::park_timeout(left);
                continue;
            }
            for index in woken {
                if self.futures[index].is_some() && self.poll_one(index) {
                    pending -= 1;
                }
            }
        }
        self.outputs
            .iter_mut()
            .map(|out| out.take().unwrap())
            .collect()
    }
}

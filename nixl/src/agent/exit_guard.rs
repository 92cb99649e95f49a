//! Agents destroyed while the process exits: `std::process::exit` runs UCX's exit-time
//! cleanup while other threads still run, so an agent whose last reference a runtime thread
//! drops at that moment would tear down its UCX backend (`destroyEngine`) against a UCX
//! already half gone, and crash. An exit handler, registered when the first agent is
//! created, marks the process as exiting and waits (a bounded time) for the agents being
//! destroyed to finish; an agent whose destruction would start after that is left to the
//! exiting process instead (its memory and connections go with it).

use std::sync::{Condvar, Mutex, Once, PoisonError};
use std::time::{Duration, Instant};

/// The longest the exit handler waits for destructions under way.
const EXIT_WAIT: Duration = Duration::from_secs(10);

#[derive(Default)]
struct State {
    exiting: bool,
    destroying: usize,
}

static STATE: Mutex<State> = Mutex::new(State {
    exiting: false,
    destroying: 0,
});
static DONE: Condvar = Condvar::new();

/// Registers the exit handler once (at the first agent's creation).
pub(crate) fn install() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: `on_exit` is an `extern "C" fn()` that does not unwind (it only locks and
        // waits) and stays valid for the whole process.
        if unsafe { libc::atexit(on_exit) } != 0 {
            tracing::warn!("could not register the NIXL agents' exit handler");
        }
    });
}

/// A destruction under way; it ends when dropped.
pub(crate) struct Destroying(());

/// Starts destroying an agent, or `None` when the process is exiting (leave it then).
pub(crate) fn begin() -> Option<Destroying> {
    let mut state = STATE.lock().unwrap_or_else(PoisonError::into_inner);
    if state.exiting {
        return None;
    }
    state.destroying += 1;
    Some(Destroying(()))
}

impl Drop for Destroying {
    fn drop(&mut self) {
        let mut state = STATE.lock().unwrap_or_else(PoisonError::into_inner);
        state.destroying -= 1;
        DONE.notify_all();
    }
}

extern "C" fn on_exit() {
    let deadline = Instant::now() + EXIT_WAIT;
    let mut state = STATE.lock().unwrap_or_else(PoisonError::into_inner);
    state.exiting = true;
    while state.destroying > 0 {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return;
        };
        state = DONE
            .wait_timeout(state, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

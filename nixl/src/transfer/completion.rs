//! Awaiting a posted request: `request.await` hands it to the agent's completion driver.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::agent::driver::{Entry, Pollable, Slot};
use crate::error::{Error, Result};
use crate::transfer::xfer::{XferRequest, XferStatus};

/// A future of a posted request's completion; made by `request.await` (or
/// [`XferRequest::completion`]).
///
/// It resolves to the request, done and ready to be posted again, or to the error that
/// failed it. The agent's completion driver polls it (see [`crate::Agent`]); the task
/// awaiting it costs nothing meanwhile.
///
/// Dropping it before it resolves cancels the wait, never the transfer and never
/// blocking: the driver keeps the request, with the memory it holds, until NIXL reports it
/// done, then releases it. That holds under `mem::forget` too, since the request is then
/// never released and its memory never freed. Deadlines come from the caller's timer, e.g.
/// `tokio::time::timeout(d, request)`.
#[must_use = "futures do nothing unless awaited"]
pub struct Completion {
    state: State,
}

enum State {
    /// Not handed to the driver yet (the first poll does, when the driver has room).
    Holding(Box<XferRequest>),
    /// With the driver; the outcome arrives in the slot.
    Driven(Arc<Slot>),
    Finished,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Holding(_) => "holding",
            State::Driven(_) => "driven",
            State::Finished => "finished",
        };
        f.debug_struct("Completion").field("state", &state).finish()
    }
}

impl Future for Completion {
    type Output = Result<XferRequest>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            match std::mem::replace(&mut self.state, State::Finished) {
                State::Finished => {
                    return Poll::Ready(Err(Error::InvalidArgument {
                        operation: "await transfer",
                        reason: "the completion was already awaited to its end".to_string(),
                    }))
                }
                State::Holding(mut request) => {
                    if !request.is_in_flight() {
                        return Poll::Ready(check_awaitable(*request));
                    }
                    // One poll here often finds a small transfer done, sparing the hand-over.
                    match request.status() {
                        Ok(XferStatus::Done) => return Poll::Ready(Ok(*request)),
                        Err(err) => return Poll::Ready(Err(err)),
                        Ok(XferStatus::InProgress) => {}
                    }
                    let slot = Arc::new(Slot::default());
                    match request.try_hand_to_driver(slot.clone(), cx.waker()) {
                        Ok(()) => self.state = State::Driven(slot),
                        Err(HandOver::Full(request)) => {
                            self.state = State::Holding(request);
                            return Poll::Pending;
                        }
                        Err(HandOver::Failed(err)) => return Poll::Ready(Err(err)),
                    }
                }
                State::Driven(slot) => {
                    return match slot.take_or_wait(cx.waker()) {
                        Some(outcome) => Poll::Ready(outcome.and_then(into_request)),
                        None => {
                            self.state = State::Driven(slot);
                            Poll::Pending
                        }
                    };
                }
            }
        }
    }
}

/// The request the driver gives back (only requests are handed to it by completions).
fn into_request(item: Box<dyn Pollable>) -> Result<XferRequest> {
    item.into_any()
        .downcast::<XferRequest>()
        .map(|request| *request)
        .map_err(|_| Error::InvalidArgument {
            operation: "await transfer",
            reason: "the completion driver returned something other than the request".into(),
        })
}

/// A request that is not in flight: done if it was posted.
fn check_awaitable(request: XferRequest) -> Result<XferRequest> {
    if request.is_posted() {
        Ok(request)
    } else {
        Err(Error::InvalidArgument {
            operation: "await transfer",
            reason: "the request has not been posted; post it, then await it".to_string(),
        })
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.state, State::Finished) {
            // Dropping the request hands it to the driver if it is in flight.
            State::Holding(_) | State::Finished => {}
            // An outcome delivered meanwhile is dropped here: the request was done, or
            // failed (and is then leaked with its memory).
            State::Driven(slot) => drop(slot.cancel()),
        }
    }
}

/// Why a request could not be handed to the driver.
pub(crate) enum HandOver {
    /// The driver is at capacity; the future is woken when it has room.
    Full(Box<XferRequest>),
    /// The driver could not start.
    Failed(Error),
}

impl XferRequest {
    /// A future of this posted request's completion (what `request.await` makes).
    pub fn completion(self) -> Completion {
        Completion {
            state: State::Holding(Box::new(self)),
        }
    }

    /// Hands the request to its agent's driver if it has room.
    fn try_hand_to_driver(
        self: Box<Self>,
        slot: Arc<Slot>,
        waker: &std::task::Waker,
    ) -> std::result::Result<(), HandOver> {
        let shared = match self.agent_inner().driver() {
            Ok(driver) => driver.shared.clone(),
            Err(err) => {
                // Never released while in flight: leaked with its memory.
                drop(self);
                return Err(HandOver::Failed(err));
            }
        };
        let entry = Entry { item: self, slot };
        shared
            .submit(entry, false, Some(waker))
            .map_err(|entry| match into_request(entry.item) {
                Ok(request) => HandOver::Full(Box::new(request)),
                Err(err) => HandOver::Failed(err),
            })
    }
}

impl IntoFuture for XferRequest {
    type Output = Result<XferRequest>;
    type IntoFuture = Completion;

    /// `request.await`: see [`Completion`].
    fn into_future(self) -> Completion {
        self.completion()
    }
}

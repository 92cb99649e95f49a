//! Awaiting notifications: each task subscribes with a filter to the agent's hub
//! (`agent/notify_hub.rs`), which the agent's completion driver fills from NIXL.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use crate::agent::driver::{lock, Shared};
use crate::agent::notify_hub::{Notification, NotificationFilter};
use crate::agent::{Agent, AgentInner};
use crate::error::Result;
use crate::notifications::notif_map::take_from_nixl;

/// Lets the driver of `agent` take its notifications from NIXL (once; later calls keep the
/// first).
pub(crate) fn install_fetch(agent: &Arc<AgentInner>, shared: &Shared) {
    let agent = Arc::downgrade(agent);
    shared.install_fetch(Box::new(move || match agent.upgrade() {
        Some(agent) => take_from_nixl(&agent, &[]),
        None => Ok(Vec::new()),
    }));
}

/// A subscription of one task, removed when it is dropped.
struct Subscription {
    agent: Agent,
    shared: Arc<Shared>,
    id: u64,
}

impl Subscription {
    fn new(agent: &Agent, filter: NotificationFilter, once: bool) -> Result<Self> {
        let shared = agent.inner.driver()?.shared.clone();
        install_fetch(&agent.inner, &shared);
        let id = lock(&shared.hub).subscribe(filter, once);
        shared.kick();
        Ok(Subscription {
            agent: agent.clone(),
            shared,
            id,
        })
    }

    fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Notification> {
        let next = lock(&self.shared.hub).next_for(self.id, cx.waker());
        match next {
            Some(note) => Poll::Ready(note),
            None => {
                self.shared.kick();
                Poll::Pending
            }
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let wakers = lock(&self.shared.hub).unsubscribe(self.id);
        wakers.into_iter().for_each(Waker::wake);
    }
}

/// A future of the next notification that passes a filter ([`Agent::notification`]).
///
/// Subscribed when made, so messages arriving from then on are not missed; dropped before
/// it completes, it gives up nothing: a message it had taken goes back to the others.
#[must_use = "futures do nothing unless awaited"]
pub struct NextNotification {
    subscription: Subscription,
}

impl Future for NextNotification {
    type Output = Notification;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Notification> {
        self.subscription.poll_next(cx)
    }
}

impl std::fmt::Debug for NextNotification {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NextNotification")
            .field("agent", &self.subscription.agent.name())
            .finish_non_exhaustive()
    }
}

/// A stream of every notification that passes a filter ([`Agent::notification_stream`]).
/// It never ends while it lives; dropped, its untaken messages go back to the others.
pub struct NotificationStream {
    subscription: Subscription,
}

impl NotificationStream {
    /// The next notification.
    pub fn recv(&mut self) -> impl Future<Output = Notification> + '_ {
        std::future::poll_fn(|cx| self.subscription.poll_next(cx))
    }

    /// Every notification for this stream that NIXL has received by now, without waiting:
    /// asks NIXL for its notifications first (as the driver does now and then), so a caller
    /// about to act on the time (e.g. to end a lease) sees each message that arrived before.
    /// Bounded by the hub's cap on messages held.
    ///
    /// # Errors
    /// [`crate::Error`] from NIXL's notification query; messages already queued for this
    /// stream stay queued.
    pub fn take_arrived(&mut self) -> Result<Vec<Notification>> {
        let shared = &self.subscription.shared;
        shared.pull()?;
        let mut hub = lock(&shared.hub);
        Ok(std::iter::from_fn(|| hub.try_next_for(self.subscription.id)).collect())
    }
}

impl futures_core::Stream for NotificationStream {
    type Item = Notification;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Notification>> {
        self.subscription.poll_next(cx).map(Some)
    }
}

impl std::fmt::Debug for NotificationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotificationStream")
            .field("agent", &self.subscription.agent.name())
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// The next notification that passes `filter`, for one task to await.
    ///
    /// Many tasks can each await their own (by sender, by message prefix); each message
    /// goes to the oldest waiter it matches, or waits for a later one. The agent's
    /// completion driver takes notifications from NIXL from then on; see
    /// [`notifications`](Self::notifications) for mixing with the blocking API.
    ///
    /// # Errors
    /// [`crate::Error::Io`] if the driver thread cannot start.
    pub fn notification(&self, filter: NotificationFilter) -> Result<NextNotification> {
        Ok(NextNotification {
            subscription: Subscription::new(self, filter, true)?,
        })
    }

    /// A stream of every notification that passes `filter`.
    ///
    /// # Errors
    /// As for [`notification`](Self::notification).
    pub fn notification_stream(&self, filter: NotificationFilter) -> Result<NotificationStream> {
        Ok(NotificationStream {
            subscription: Subscription::new(self, filter, false)?,
        })
    }
}

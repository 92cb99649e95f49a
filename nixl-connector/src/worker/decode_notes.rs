//! A prefill rank's stream of decode notifications (finish notifications and heartbeats),
//! shared by the task that applies them as they come and by
//! [`KvConnectorWorker::finished`](crate::KvConnectorWorker::finished), which applies those
//! NIXL already holds before it ends any lease (vLLM's `get_finished` takes NIXL's
//! notifications before `_reap_expired_send_leases`): a rank whose task is starved must not
//! end a lease whose heartbeat or finish notification has already arrived.

use std::sync::{Mutex, MutexGuard};
use std::task::Poll;

use futures::StreamExt;
use nixl::{Notification, NotificationStream};

/// The stream, once the rank holds its first request for a decode.
#[derive(Default)]
pub(crate) struct DecodeNotes {
    stream: Mutex<Option<NotificationStream>>,
}

impl DecodeNotes {
    /// Sets the stream (once, when the rank starts listening).
    pub(crate) fn set(&self, stream: NotificationStream) {
        *self.lock() = Some(stream);
    }

    /// The next notification, for the task that applies them as they come; the lock is
    /// held only while the stream is polled, never across an await.
    pub(crate) async fn next(&self) -> Notification {
        std::future::poll_fn(|cx| match self.lock().as_mut() {
            Some(stream) => match stream.poll_next_unpin(cx) {
                Poll::Ready(Some(note)) => Poll::Ready(note),
                // The stream never ends while it lives.
                Poll::Ready(None) | Poll::Pending => Poll::Pending,
            },
            None => Poll::Pending,
        })
        .await
    }

    /// Every notification NIXL has received for the rank by now (none before it listens).
    pub(crate) fn take_arrived(&self) -> Vec<Notification> {
        let Some(arrived) = self.lock().as_mut().map(|s| s.take_arrived()) else {
            return Vec::new();
        };
        arrived.unwrap_or_else(|err| {
            tracing::warn!(%err, "cannot take the decode notifications NIXL holds; leases are ended without them");
            Vec::new()
        })
    }

    fn lock(&self) -> MutexGuard<'_, Option<NotificationStream>> {
        self.stream.lock().unwrap_or_else(|p| p.into_inner())
    }
}

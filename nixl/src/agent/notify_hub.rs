//! Notifications for many tasks, as data: each message goes to the oldest waiter whose
//! filter matches; messages nobody waits for are kept (in order) for the next waiter, stream
//! or [`crate::Agent::notifications`] call. No message is lost or given twice. Who takes
//! messages from NIXL and who waits is the business of `driver.rs` (beside it) and
//! `notifications/notification_wait.rs`.

use std::collections::VecDeque;
use std::task::Waker;

/// Most bytes of messages the hub keeps before it stops taking more from NIXL (which then
/// holds them) until waiters catch up.
const MAX_HELD_BYTES: usize = 64 << 20;
/// Most messages the hub keeps, likewise.
const MAX_HELD_MESSAGES: usize = 1 << 20;

/// One notification: the exact bytes of the sender's name and of the message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Notification {
    /// The sending agent's name, byte for byte.
    pub sender: Vec<u8>,
    /// The message.
    pub message: Vec<u8>,
}

/// Which notifications a waiter or stream takes: by sender and by message (whole or
/// prefix, as Python's `check_remote_xfer_done`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NotificationFilter {
    sender: Option<Vec<u8>>,
    message: MessageMatch,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum MessageMatch {
    #[default]
    Any,
    Prefix(Vec<u8>),
    Exact(Vec<u8>),
}

impl NotificationFilter {
    /// Every notification.
    pub fn any() -> Self {
        Self::default()
    }

    /// Only notifications from the agent named exactly `sender`.
    pub fn from_sender(mut self, sender: impl Into<Vec<u8>>) -> Self {
        self.sender = Some(sender.into());
        self
    }

    /// Only messages that start with `prefix`.
    pub fn prefix(mut self, prefix: impl Into<Vec<u8>>) -> Self {
        self.message = MessageMatch::Prefix(prefix.into());
        self
    }

    /// Only messages equal to `message`.
    pub fn exact(mut self, message: impl Into<Vec<u8>>) -> Self {
        self.message = MessageMatch::Exact(message.into());
        self
    }

    /// Whether `note` passes the filter.
    pub fn matches(&self, note: &Notification) -> bool {
        self.sender.as_ref().map_or(true, |s| *s == note.sender)
            && match &self.message {
                MessageMatch::Any => true,
                MessageMatch::Prefix(p) => note.message.starts_with(p),
                MessageMatch::Exact(m) => note.message == *m,
            }
    }
}

/// A waiter (one message) or a stream (every message), in the order they subscribed.
struct Subscriber {
    id: u64,
    filter: NotificationFilter,
    once: bool,
    /// A waiter (`once`) that has handed out its message wants no other.
    served: bool,
    queue: VecDeque<Notification>,
    waker: Option<Waker>,
}

impl Subscriber {
    fn wants(&self, note: &Notification) -> bool {
        !(self.once && (self.served || !self.queue.is_empty())) && self.filter.matches(note)
    }
}

/// The agent's notifications awaited asynchronously.
#[derive(Default)]
pub(crate) struct Hub {
    /// Set once anyone subscribed: from then on NIXL's notifications go through the hub.
    pub(crate) active: bool,
    unclaimed: VecDeque<Notification>,
    subscribers: Vec<Subscriber>,
    held_bytes: usize,
    held_messages: usize,
    next_id: u64,
}

impl Hub {
    /// Whether the driver should take notifications from NIXL: someone waits, and the hub
    /// has room.
    pub(crate) fn wants_messages(&self) -> bool {
        !self.subscribers.is_empty()
            && self.held_bytes < MAX_HELD_BYTES
            && self.held_messages < MAX_HELD_MESSAGES
    }

    /// Hands `note` to the oldest subscriber that wants it, or keeps it unclaimed; returns
    /// the waker to call.
    pub(crate) fn dispatch(&mut self, note: Notification) -> Option<Waker> {
        self.held_bytes += note.message.len() + note.sender.len();
        self.held_messages += 1;
        match self.subscribers.iter_mut().find(|s| s.wants(&note)) {
            Some(sub) => {
                sub.queue.push_back(note);
                sub.waker.take()
            }
            None => {
                self.unclaimed.push_back(note);
                None
            }
        }
    }

    fn release(&mut self, note: &Notification) {
        self.held_bytes -= note.message.len() + note.sender.len();
        self.held_messages -= 1;
    }

    /// Adds a subscriber, giving it the unclaimed messages it wants.
    pub(crate) fn subscribe(&mut self, filter: NotificationFilter, once: bool) -> u64 {
        self.active = true;
        let id = self.next_id;
        self.next_id += 1;
        let mut sub = Subscriber {
            id,
            filter,
            once,
            served: false,
            queue: VecDeque::new(),
            waker: None,
        };
        let mut kept = VecDeque::with_capacity(self.unclaimed.len());
        for note in self.unclaimed.drain(..) {
            if sub.wants(&note) {
                sub.queue.push_back(note);
            } else {
                kept.push_back(note);
            }
        }
        self.unclaimed = kept;
        self.subscribers.push(sub);
        id
    }

    /// The next message of subscriber `id`, or `None` after keeping `waker`.
    pub(crate) fn next_for(&mut self, id: u64, waker: &Waker) -> Option<Notification> {
        let note = self.try_next_for(id);
        if note.is_none() {
            if let Some(sub) = self.subscribers.iter_mut().find(|s| s.id == id) {
                sub.waker = Some(waker.clone());
            }
        }
        note
    }

    /// The next message of subscriber `id`, if one is queued for it.
    pub(crate) fn try_next_for(&mut self, id: u64) -> Option<Notification> {
        let sub = self.subscribers.iter_mut().find(|s| s.id == id)?;
        let note = sub.queue.pop_front()?;
        sub.served = sub.once;
        self.release(&note);
        Some(note)
    }

    /// Removes subscriber `id`; messages it did not take go back, first in line, to the
    /// other subscribers or the unclaimed messages.
    pub(crate) fn unsubscribe(&mut self, id: u64) -> Vec<Waker> {
        let Some(at) = self.subscribers.iter().position(|s| s.id == id) else {
            return Vec::new();
        };
        let sub = self.subscribers.remove(at);
        let mut wakers = Vec::new();
        let mut back = Vec::new();
        for note in sub.queue {
            self.release(&note);
            match self.subscribers.iter_mut().find(|s| s.wants(&note)) {
                Some(other) => {
                    self.held_bytes += note.message.len() + note.sender.len();
                    self.held_messages += 1;
                    other.queue.push_back(note);
                    wakers.extend(other.waker.take());
                }
                None => back.push(note),
            }
        }
        for note in back.into_iter().rev() {
            self.held_bytes += note.message.len() + note.sender.len();
            self.held_messages += 1;
            self.unclaimed.push_front(note);
        }
        wakers
    }

    /// Takes every unclaimed message.
    pub(crate) fn take_unclaimed(&mut self) -> Vec<Notification> {
        let notes: Vec<Notification> = self.unclaimed.drain(..).collect();
        for note in &notes {
            self.held_bytes -= note.message.len() + note.sender.len();
            self.held_messages -= 1;
        }
        notes
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    use super::*;

    fn note(sender: &str, message: &str) -> Notification {
        Notification {
            sender: sender.as_bytes().to_vec(),
            message: message.as_bytes().to_vec(),
        }
    }

    /// A waker that counts its wakes.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn waker() -> (Waker, Arc<Count>) {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        (Waker::from(count.clone()), count)
    }

    /// Every message subscriber `id` holds now, in order.
    fn drain(hub: &mut Hub, id: u64) -> Vec<Notification> {
        let (waker, _) = waker();
        std::iter::from_fn(|| hub.next_for(id, &waker)).collect()
    }

    #[test]
    fn overlapping_waiters_take_one_message_each_oldest_first() {
        let mut hub = Hub::default();
        let any = hub.subscribe(NotificationFilter::any(), true);
        let prefixed = hub.subscribe(NotificationFilter::any().prefix("req"), true);
        for message in ["req-1", "req-2", "req-3"] {
            hub.dispatch(note("a", message));
        }
        assert_eq!(drain(&mut hub, any), [note("a", "req-1")]);
        assert_eq!(drain(&mut hub, prefixed), [note("a", "req-2")]);
        // Both waiters are served: the third message waits for someone else.
        assert_eq!(hub.take_unclaimed(), [note("a", "req-3")]);
        assert_eq!(drain(&mut hub, any), []);
    }

    #[test]
    fn a_stream_takes_every_match_before_younger_waiters() {
        let mut hub = Hub::default();
        let stream = hub.subscribe(NotificationFilter::any().prefix("s"), false);
        let waiter = hub.subscribe(NotificationFilter::any(), true);
        for message in ["s1", "t1", "s2"] {
            hub.dispatch(note("a", message));
        }
        assert_eq!(drain(&mut hub, stream), [note("a", "s1"), note("a", "s2")]);
        assert_eq!(drain(&mut hub, waiter), [note("a", "t1")]);
    }

    #[test]
    fn senders_match_by_their_exact_bytes() {
        let mut hub = Hub::default();
        let short = hub.subscribe(NotificationFilter::any().from_sender("agent-1"), false);
        let long = hub.subscribe(NotificationFilter::any().from_sender("agent-10"), false);
        for sender in ["agent-10", "agent-1", "agent-", "agent-1\0"] {
            hub.dispatch(note(sender, sender));
        }
        assert_eq!(drain(&mut hub, short), [note("agent-1", "agent-1")]);
        assert_eq!(drain(&mut hub, long), [note("agent-10", "agent-10")]);
        assert_eq!(
            hub.take_unclaimed(),
            [note("agent-", "agent-"), note("agent-1\0", "agent-1\0")]
        );
    }

    #[test]
    fn messages_match_whole_or_by_prefix() {
        let exact = NotificationFilter::any().exact("req");
        assert!(exact.matches(&note("a", "req")));
        assert!(!exact.matches(&note("a", "req-1")));
        assert!(!exact.matches(&note("a", "re")));
        let prefix = NotificationFilter::any().prefix("req");
        assert!(prefix.matches(&note("a", "req")) && prefix.matches(&note("a", "req-1")));
        assert!(!prefix.matches(&note("a", "re")));
    }

    #[test]
    fn unclaimed_messages_wait_in_order_for_a_later_subscriber() {
        let mut hub = Hub::default();
        for message in ["1", "x", "2"] {
            hub.dispatch(note("a", message));
        }
        let digits = hub.subscribe(NotificationFilter::any().prefix("1"), false);
        let rest = hub.subscribe(NotificationFilter::any(), false);
        hub.dispatch(note("a", "3"));
        assert_eq!(drain(&mut hub, digits), [note("a", "1")]);
        assert_eq!(
            drain(&mut hub, rest),
            [note("a", "x"), note("a", "2"), note("a", "3")]
        );
    }

    #[test]
    fn a_dispatch_wakes_the_subscriber_that_took_it() {
        let mut hub = Hub::default();
        let id = hub.subscribe(NotificationFilter::any(), true);
        let (waker, count) = waker();
        assert_eq!(hub.next_for(id, &waker), None);
        hub.dispatch(note("a", "m")).expect("a waker").wake();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        // A message nobody wants wakes nobody.
        assert!(hub.dispatch(note("a", "n")).is_none());
    }

    #[test]
    fn an_unsubscribed_waiters_messages_go_back_first_in_line() {
        let mut hub = Hub::default();
        let gone = hub.subscribe(NotificationFilter::any(), false);
        hub.dispatch(note("a", "1"));
        hub.dispatch(note("a", "2"));
        let (waker, count) = waker();
        let later = hub.subscribe(NotificationFilter::any().exact("2"), true);
        assert_eq!(hub.next_for(later, &waker), None);
        hub.dispatch(note("a", "0"));
        let wakers = hub.unsubscribe(gone);
        wakers.into_iter().for_each(Waker::wake);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "the waiter got its message"
        );
        assert_eq!(drain(&mut hub, later), [note("a", "2")]);
        // The others go back to the unclaimed messages, ahead of what was there.
        assert_eq!(hub.take_unclaimed(), [note("a", "1"), note("a", "0")]);
        assert_eq!((hub.held_bytes, hub.held_messages), (0, 0));
    }

    #[test]
    fn the_hub_stops_taking_messages_while_it_holds_too_many_bytes() {
        let mut hub = Hub::default();
        assert!(!hub.wants_messages(), "nobody waits");
        let id = hub.subscribe(NotificationFilter::any().exact("never"), true);
        assert!(hub.wants_messages());
        hub.dispatch(Notification {
            sender: b"a".to_vec(),
            message: vec![0; MAX_HELD_BYTES],
        });
        assert!(!hub.wants_messages(), "full");
        assert_eq!(hub.take_unclaimed().len(), 1);
        assert!(hub.wants_messages(), "room again");
        hub.unsubscribe(id);
        assert!(!hub.wants_messages());
    }
}

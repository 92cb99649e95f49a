//! How an agent's notifications reach the tasks awaiting them, between real agents: each
//! message goes to exactly one waiter (the oldest whose filter matches) even when filters
//! overlap, and senders are matched by the exact bytes of their names, even names that
//! share a prefix.

mod common;

use futures::FutureExt;
use nixl::{Agent, NotificationFilter};

use common::{runtime, unique_name, wait_notifications, WAIT};

/// An agent named `name` with a UCX backend.
fn agent(name: &str) -> Agent {
    let agent = Agent::new(name).unwrap();
    agent.create_backend("UCX").unwrap();
    agent
}

/// Lets each of `senders` send notifications to `receiver`.
fn connect(receiver: &Agent, senders: &[&Agent]) {
    for sender in senders {
        sender
            .load_remote_metadata(&receiver.local_metadata().unwrap())
            .unwrap();
    }
}

#[test]
fn overlapping_filters_each_message_goes_to_exactly_one_waiter() {
    let a = agent(&unique_name("route-a"));
    let b = agent(&unique_name("route-b"));
    connect(&b, &[&a]);
    runtime().block_on(async {
        // Subscribed oldest first; every filter matches "req-1".
        let from_a = b
            .notification(
                NotificationFilter::any()
                    .from_sender(a.name())
                    .prefix("req"),
            )
            .unwrap();
        let anything = b.notification(NotificationFilter::any()).unwrap();
        let mut requests = b
            .notification_stream(NotificationFilter::any().prefix("req"))
            .unwrap();
        for message in ["req-1", "req-2", "req-3", "other"] {
            a.send_notification(b.name(), message.as_bytes()).unwrap();
        }
        let got = |note: nixl::Notification| (note.sender, note.message);
        let want = |message: &str| (a.name().as_bytes().to_vec(), message.as_bytes().to_vec());
        let first = tokio::time::timeout(WAIT, from_a).await.unwrap();
        assert_eq!(got(first), want("req-1"), "the oldest waiter");
        let second = tokio::time::timeout(WAIT, anything).await.unwrap();
        assert_eq!(got(second), want("req-2"), "the next waiter still waiting");
        let third = tokio::time::timeout(WAIT, requests.recv()).await.unwrap();
        assert_eq!(
            got(third),
            want("req-3"),
            "the stream, once both are served"
        );
        // "other" matches no one left: it is kept for the blocking API, once.
        assert_eq!(
            wait_notifications(&b, a.name(), 1),
            [b"other".to_vec()],
            "no message given twice"
        );
        assert!(requests.recv().now_or_never().is_none());
    });
    assert!(b.notifications().unwrap().is_empty());
}

#[test]
fn senders_whose_names_share_a_prefix_are_told_apart() {
    let short_name = unique_name("route-share");
    let long_name = format!("{short_name}0");
    let short = agent(&short_name);
    let long = agent(&long_name);
    let b = agent(&unique_name("route-receiver"));
    connect(&b, &[&short, &long]);
    runtime().block_on(async {
        let mut from_short = b
            .notification(NotificationFilter::any().from_sender(short_name.as_bytes()))
            .unwrap();
        let from_long = b
            .notification(NotificationFilter::any().from_sender(long_name.as_bytes()))
            .unwrap();
        // The longer name alone first: a prefix match would hand its message to the older
        // waiter, for the shorter name.
        long.send_notification(b.name(), b"from the long name")
            .unwrap();
        let note = tokio::time::timeout(WAIT, from_long).await.unwrap();
        assert_eq!(
            (note.sender, note.message),
            (long_name.into_bytes(), b"from the long name".to_vec())
        );
        assert!((&mut from_short).now_or_never().is_none());
        short
            .send_notification(b.name(), b"from the short name")
            .unwrap();
        let note = tokio::time::timeout(WAIT, from_short).await.unwrap();
        assert_eq!(
            (note.sender, note.message),
            (short_name.into_bytes(), b"from the short name".to_vec())
        );
    });
    assert!(b.notifications().unwrap().is_empty());
}

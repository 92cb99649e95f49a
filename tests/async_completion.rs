//! Awaiting requests and notifications through the agent's completion driver, under tokio.

mod common;

use std::collections::BTreeSet;
use std::future::IntoFuture;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::executor::Executor;
use common::{
    contents, in_flight_write, pattern, resume_b_when, runtime, stalled_pair, tracked_pair,
    unique_name, Pair, WAIT,
};
use nixl::{Agent, Error, NotificationFilter, XferOp, XferOptions, XferStatus};

#[test]
fn an_awaited_request_comes_back_done_and_can_be_reposted() {
    let pair = Pair::new("await");
    let (src, dst) = pair.source_and_destination(pattern(1 << 20, 1));
    pair.exchange();
    runtime().block_on(async {
        let mut req = pair
            .whole_request(XferOp::Write, &src, &dst, &XferOptions::new())
            .unwrap();
        for round in 0..5u8 {
            src.write(0, 0, &pattern(1 << 20, round)).unwrap();
            req.post().unwrap();
            req = req.await.unwrap();
            assert!(!req.is_in_flight());
            assert_eq!(common::contents(&dst), pattern(1 << 20, round));
        }
        // A request never posted is refused, not awaited forever.
        let fresh = pair
            .whole_request(XferOp::Write, &src, &dst, &XferOptions::new())
            .unwrap();
        match fresh.await {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(reason.contains("not been posted"), "{reason}")
            }
            other => panic!("expected an unposted request to be refused, got {other:?}"),
        }
    });
}

/// A stalled pair with `LEN` bytes to write from a to b, and that WRITE posted and in flight.
fn stalled_write(prefix: &str) -> (Pair, nixl::Registration, nixl::XferRequest) {
    const LEN: usize = 1 << 20;
    let pair = stalled_pair(prefix);
    let (src, dst) = pair.source_and_destination(pattern(LEN, 4));
    pair.exchange();
    let req = in_flight_write(&pair, &src, &dst);
    (pair, dst, req)
}

/// Whether a's driver holds exactly one request: the one the test handed it.
fn driver_holds_it(pair: &Pair) -> bool {
    pair.a.driver_stats().held == 1
}

/// After the transfer: the bytes landed, and the driver carried exactly one request.
fn assert_done_through_the_driver(pair: &Pair, dst: &nixl::Registration, req: &nixl::XferRequest) {
    assert!(!req.is_in_flight());
    assert_eq!(contents(dst), pattern(1 << 20, 4));
    // The driver counts a request finished just after handing it back.
    common::wait_until("the driver to count the request finished", || {
        pair.a.driver_stats().held == 0
    });
    assert_eq!(pair.a.driver_stats().awaited, 1);
}

#[test]
fn an_in_flight_request_completes_through_the_driver_under_tokio() {
    let (pair, dst, req) = stalled_write("resume-tokio");
    // b resumes only once the driver holds the request, so the task's wake-up can only
    // come from the driver. The request is a task of its own: the timer below wakes only
    // the task that waits for it, never the request's.
    let outcome = resume_b_when(
        &pair,
        || driver_holds_it(&pair),
        || {
            runtime().block_on(async {
                tokio::time::timeout(WAIT, tokio::spawn(req.into_future())).await
            })
        },
    );
    let req = outcome
        .expect("done within WAIT")
        .expect("the task ran")
        .expect("the transfer succeeds");
    assert_done_through_the_driver(&pair, &dst, &req);
}

#[test]
fn an_in_flight_request_completes_through_the_driver_under_a_hand_made_executor() {
    let (pair, dst, req) = stalled_write("resume-hand");
    let mut executor = Executor::new([req.completion()]);
    assert_eq!(executor.poll_all(), 1, "in flight: pending");
    assert!(driver_holds_it(&pair), "{:?}", pair.a.driver_stats());
    assert_eq!(executor.wakes(), 0);
    let mut outcomes = resume_b_when(&pair, || true, || executor.run());
    let req = outcomes.pop().unwrap().expect("the transfer succeeds");
    assert_eq!(executor.wakes(), 1, "the driver woke the future once");
    assert_done_through_the_driver(&pair, &dst, &req);
}

#[test]
fn a_deadline_from_the_callers_timer_cancels_the_wait_not_the_transfer() {
    let pair = stalled_pair("deadline");
    let (src, src_freed, dst, dst_freed) = tracked_pair(&pair, 1 << 20);
    let req = common::in_flight_write(&pair, &src, &dst);
    drop((src, dst));
    let started = Instant::now();
    let outcome =
        runtime().block_on(async { tokio::time::timeout(Duration::from_millis(100), req).await });
    let waited = started.elapsed();
    assert!(outcome.is_err(), "the stalled transfer cannot finish");
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_secs(5),
        "the deadline ends the wait ({waited:?})"
    );
    // The dropped future left the request to the driver, which keeps its memory ...
    assert!(!src_freed.load(Ordering::SeqCst) && !dst_freed.load(Ordering::SeqCst));
    // ... until b makes progress, the transfer finishes and the driver releases it.
    common::wait_until("the driver to release the request's memory", || {
        pair.b.notifications().unwrap();
        src_freed.load(Ordering::SeqCst) && dst_freed.load(Ordering::SeqCst)
    });
    assert_eq!(pair.a.leak_stats(), nixl::LeakStats::default());
}

#[test]
fn dropping_an_in_flight_request_does_not_block_and_frees_later() {
    let pair = stalled_pair("dropinflight");
    let (src, src_freed, dst, _dst_freed) = tracked_pair(&pair, 1 << 20);
    let req = common::in_flight_write(&pair, &src, &dst);
    drop(src);
    let started = Instant::now();
    drop(req);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "drop handed the request over"
    );
    assert!(!src_freed.load(Ordering::SeqCst));
    common::wait_until("the driver to release the request's memory", || {
        pair.b.notifications().unwrap();
        src_freed.load(Ordering::SeqCst)
    });
    // Done transfer, released by the driver: dst holds the data.
    assert_eq!(common::contents(&dst), pattern(1 << 20, 3));
}

#[test]
fn futures_dropped_mid_flight_in_select_keep_memory_alive() {
    let pair = stalled_pair("select");
    let (src, src_freed, dst, _dst_freed) = tracked_pair(&pair, 1 << 20);
    let req = common::in_flight_write(&pair, &src, &dst);
    drop(src);
    runtime().block_on(async {
        tokio::select! {
            _ = req => panic!("the stalled transfer cannot finish"),
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    });
    assert!(!src_freed.load(Ordering::SeqCst));
    common::wait_until("the driver to release the request", || {
        pair.b.notifications().unwrap();
        src_freed.load(Ordering::SeqCst)
    });
}

#[test]
fn many_waiters_each_get_their_own_notifications() {
    let a = Agent::new(&unique_name("notes-a")).unwrap();
    let b = Agent::new(&unique_name("notes-b")).unwrap();
    let c = Agent::new(&unique_name("notes-c")).unwrap();
    for agent in [&a, &b, &c] {
        agent.create_backend("UCX").unwrap();
    }
    for sender in [&a, &c] {
        sender
            .load_remote_metadata(&b.local_metadata().unwrap())
            .unwrap();
    }
    const TAGS: usize = 8;
    const PER_TAG: usize = 25;
    let rt = runtime();
    rt.block_on(async {
        // Waiters subscribe before anything is sent; a stream takes a's untagged messages.
        let mut waiters = Vec::new();
        for tag in 0..TAGS {
            let b = b.clone();
            let a_name = a.name().as_bytes().to_vec();
            waiters.push(tokio::spawn(async move {
                let mut got = Vec::new();
                for _ in 0..PER_TAG {
                    let filter = NotificationFilter::any()
                        .from_sender(a_name.clone())
                        .prefix(format!("tag{tag}:"));
                    got.push(b.notification(filter).unwrap().await.message);
                }
                got
            }));
        }
        let mut stream = b
            .notification_stream(NotificationFilter::any().from_sender(c.name().as_bytes()))
            .unwrap();
        // Non-UTF-8 bytes travel as they are.
        for n in 0..PER_TAG {
            for tag in 0..TAGS {
                a.send_notification(b.name(), format!("tag{tag}:{n}").as_bytes())
                    .unwrap();
            }
            c.send_notification(b.name(), &[0xff, 0xfe, n as u8])
                .unwrap();
        }
        for (tag, waiter) in waiters.into_iter().enumerate() {
            let got = tokio::time::timeout(WAIT, waiter).await.unwrap().unwrap();
            let want: Vec<Vec<u8>> = (0..PER_TAG)
                .map(|n| format!("tag{tag}:{n}").into_bytes())
                .collect();
            assert_eq!(got, want, "waiter {tag} gets its messages, in order");
        }
        for n in 0..PER_TAG {
            let note = tokio::time::timeout(WAIT, stream.recv()).await.unwrap();
            assert_eq!(note.sender, c.name().as_bytes());
            assert_eq!(note.message, vec![0xff, 0xfe, n as u8]);
        }
    });
    // Nothing was given twice: no message is left over.
    assert!(b.notifications().unwrap().is_empty());
}

#[test]
fn messages_nobody_waits_for_are_kept_for_later() {
    let a = Agent::new(&unique_name("keep-a")).unwrap();
    let b = Agent::new(&unique_name("keep-b")).unwrap();
    a.create_backend("UCX").unwrap();
    b.create_backend("UCX").unwrap();
    a.load_remote_metadata(&b.local_metadata().unwrap())
        .unwrap();
    runtime().block_on(async {
        // A waiter for something else is active: it must not swallow other messages.
        let other = b
            .notification(NotificationFilter::any().exact(b"never".to_vec()))
            .unwrap();
        for n in 0..10u8 {
            a.send_notification(b.name(), &[n]).unwrap();
        }
        // A late waiter still gets the earliest matching message.
        let first = tokio::time::timeout(WAIT, b.notification(NotificationFilter::any()).unwrap())
            .await
            .unwrap();
        assert_eq!(first.message, vec![0]);
        drop(other);
        // The rest are there for the blocking API, once each.
        let mut rest = BTreeSet::new();
        let deadline = Instant::now() + WAIT;
        while rest.len() < 9 {
            for message in b
                .notifications()
                .unwrap()
                .remove(a.name())
                .unwrap_or_default()
            {
                assert!(rest.insert(message), "a message came twice");
            }
            assert!(Instant::now() < deadline, "messages were lost: {rest:?}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(rest, (1..10u8).map(|n| vec![n]).collect());
    });
}

#[test]
fn a_completed_request_is_ready_at_once() {
    let pair = Pair::new("ready");
    let (src, dst) = pair.source_and_destination(pattern(4096, 9));
    pair.exchange();
    let mut req = pair
        .whole_request(XferOp::Write, &src, &dst, &XferOptions::new())
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(req.status().unwrap(), XferStatus::Done);
    let req = futures::executor::block_on(req.completion()).unwrap();
    assert!(!req.is_in_flight());
}

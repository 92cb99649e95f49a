//! A step never waits for a handshake: `start_load` returns at once even when the prefill's
//! side channel never answers, and the loads waiting for that one handshake all fail at the
//! side channel's total deadline. Loads share one handshake per remote rank (the side
//! channel accepts one connection for all of them), and after it `start_load` posts the
//! READ itself.

mod common;

use std::time::{Duration, Instant};

use common::{
    block, filled_prefill_and_decode, handshake, pattern, poll_until, remote, spec, worker_with,
    CountingListener, WAIT,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_load_does_not_wait_for_a_silent_prefill() {
    common::init_tracing();
    /// The handshake's total deadline here.
    const DEADLINE: Duration = Duration::from_secs(4);
    let spec = spec(2);
    let decode = worker_with("dc-silent", 0, 1, &spec, |c| c.limits.deadline = DEADLINE);
    let silent = CountingListener::silent().await;
    let mut from = remote(&decode, "pf-silent", "r", vec![0, 1], 1);
    from.port = silent.port;

    let start = Instant::now();
    for i in 0..4 {
        decode
            .start_load(&format!("r{i}"), &[2 * i, 2 * i + 1], &from)
            .unwrap();
    }
    // The silent server ends the handshake only by its deadline: a start_load that waited
    // for it would return after the whole deadline, its load failed.
    let returned = start.elapsed();
    assert!(decode.finished().recving.is_empty(), "no load ended yet");
    assert!(returned < DEADLINE, "start_load took {returned:?}");
    assert_eq!(decode.remote_stats().handshakes_pending, 1, "one shared");

    let done = poll_until(&decode, WAIT, |f| f.recving.len() == 4).await;
    assert_eq!(done.recving.len(), 4);
    assert!(
        start.elapsed() >= DEADLINE,
        "failed by the deadline, not before"
    );
    assert_eq!(silent.accepted(), 1, "the four loads shared one handshake");
    assert_eq!(decode.remote_stats().handshakes_pending, 0, "ended");
    assert_eq!(decode.load_errors(), (0..8).collect::<Vec<_>>());
    for metrics in decode.metrics() {
        let failure = metrics.failure.unwrap();
        assert!(failure.contains("total deadline"), "{failure}");
    }
}

/// Loads started together wait for one handshake, and the loads after it reuse it: the
/// prefill's side channel sees one connection for eight loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_share_one_handshake_and_reuse_it() {
    common::init_tracing();
    let (spec, prefill, decode) = filled_prefill_and_decode("pf-share", "dc-share");
    let counted = CountingListener::forward(prefill.side_channel_addr().unwrap()).await;
    let from = |i: usize| {
        let mut from = remote(&prefill, "pf-share", "q", vec![15 - i], 1);
        from.port = counted.port;
        from
    };
    for round in [0..4, 4..8] {
        for i in round.clone() {
            decode.start_load(&format!("d{i}"), &[i], &from(i)).unwrap();
        }
        let done = poll_until(&decode, WAIT, |f| f.recving.len() == round.len()).await;
        assert_eq!(done.recving.len(), round.len());
        assert!(decode.load_errors().is_empty(), "{:?}", decode.metrics());
        assert_eq!(counted.accepted(), 1, "one handshake for loads {round:?}");
    }
    for i in 0..8 {
        let want: Vec<u8> = (0..spec.block_len(0))
            .map(|o| pattern(1, 15 - i, o))
            .collect();
        assert_eq!(block(&decode, &spec, 1, i), want, "block {i}");
    }
}

/// A handshake run ahead of the loads: the loads after it reuse it; a wrong engine id is
/// refused by the handshake itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_handshake_serves_the_loads_after_it() {
    common::init_tracing();
    let (spec, prefill, decode) = filled_prefill_and_decode("pf-early", "dc-early");
    let port = prefill.side_channel_addr().unwrap().port();

    let err = decode
        .handshake_with("not-pf-early", "127.0.0.1", port, 1)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("the transfer params name engine"), "{err}");

    let counted = CountingListener::forward(prefill.side_channel_addr().unwrap()).await;
    handshake(&decode, "pf-early", counted.port).await;
    assert_eq!(counted.accepted(), 1);
    for i in 0..8 {
        let mut from = remote(&prefill, "pf-early", "q", vec![15 - i], 1);
        from.port = counted.port;
        decode.start_load(&format!("d{i}"), &[i], &from).unwrap();
    }
    let done = poll_until(&decode, WAIT, |f| f.recving.len() == 8).await;
    assert_eq!(done.recving.len(), 8);
    assert!(decode.load_errors().is_empty());
    assert_eq!(
        counted.accepted(),
        1,
        "the loads reused the early handshake"
    );
    for i in 0..8 {
        let want: Vec<u8> = (0..spec.block_len(0))
            .map(|o| pattern(1, 15 - i, o))
            .collect();
        assert_eq!(block(&decode, &spec, 1, i), want, "block {i}");
    }
}

/// On a current-thread runtime no task runs while the test's own code does not yield: the
/// blocks of a load started after the handshake land before the test yields once, so
/// `start_load` itself posted the READ (the agents' progress threads move the bytes).
#[tokio::test]
async fn after_the_handshake_start_load_posts_the_read_itself() {
    common::init_tracing();
    let (spec, prefill, decode) = filled_prefill_and_decode("pf-now", "dc-now");
    handshake(
        &decode,
        "pf-now",
        prefill.side_channel_addr().unwrap().port(),
    )
    .await;
    decode
        .start_load("now", &[3], &remote(&prefill, "pf-now", "now", vec![9], 1))
        .unwrap();
    let want: Vec<u8> = (0..spec.block_len(0)).map(|o| pattern(2, 9, o)).collect();
    let deadline = Instant::now() + WAIT;
    // Blocking on purpose: this thread is the runtime's only one.
    while block(&decode, &spec, 2, 3) != want {
        assert!(Instant::now() < deadline, "the READ was never posted");
        std::thread::sleep(Duration::from_millis(1));
    }
}

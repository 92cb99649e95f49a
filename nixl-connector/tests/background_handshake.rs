//! A step never waits for a handshake: `start_load` returns at once even when the prefill's
//! side channel never answers, and the loads waiting for that one handshake all fail at the
//! side channel's total deadline. A handshake run ahead with `handshake_with` serves the
//! loads after it.

mod common;

use std::time::{Duration, Instant};

use common::{poll_until, remote, spec, worker, SERVER_DEADLINE};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_load_does_not_wait_for_a_silent_prefill() {
    common::init_tracing();
    let spec = spec(2);
    let decode = worker("dc-silent", 0, 1, spec);
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let mut from = remote(&decode, "pf-silent", "r", vec![0, 1], 1);
    from.port = port;

    let start = Instant::now();
    for i in 0..4 {
        decode
            .start_load(&format!("r{i}"), &[2 * i, 2 * i + 1], &from)
            .unwrap();
    }
    let returned = start.elapsed();
    assert!(
        returned < Duration::from_millis(200),
        "start_load took {returned:?}"
    );
    assert!(decode.finished().recving.is_empty());

    let done = poll_until(&decode, Duration::from_secs(20), |f| f.recving.len() == 4).await;
    assert_eq!(done.recving.len(), 4);
    let failed_after = start.elapsed();
    assert!(
        failed_after >= SERVER_DEADLINE && failed_after < 2 * SERVER_DEADLINE,
        "the four loads share one handshake and its failure: {failed_after:?}"
    );
    assert_eq!(decode.load_errors(), (0..8).collect::<Vec<_>>());
    let failure = decode.metrics()[0].failure.clone().unwrap();
    assert!(failure.contains("total deadline"), "{failure}");
    hold.abort();
}

/// A handshake run ahead of the loads: the loads after it reuse it (and are posted within
/// `start_load`); a wrong engine id is refused by the handshake itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_handshake_serves_the_loads_after_it() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("pf-early", 0, 1, spec);
    common::fill(&prefill, &spec);
    let decode = worker("dc-early", 0, 1, spec);
    let port = prefill.side_channel_addr().unwrap().port();

    let err = decode
        .handshake_with("not-pf-early", "127.0.0.1", port, 1)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("the transfer params name engine"), "{err}");

    decode
        .handshake_with("pf-early", "127.0.0.1", port, 1)
        .await
        .unwrap();
    prefill.hold_for_decode("q", Instant::now() + Duration::from_secs(30));
    for i in 0..8 {
        decode
            .start_load(
                &format!("d{i}"),
                &[i],
                &remote(&prefill, "pf-early", "q", vec![15 - i], 1),
            )
            .unwrap();
    }
    let done = poll_until(&decode, Duration::from_secs(10), |f| f.recving.len() == 8).await;
    assert_eq!(done.recving.len(), 8);
    assert!(decode.load_errors().is_empty());
    for i in 0..8 {
        let want: Vec<u8> = (0..spec.block_len())
            .map(|o| common::pattern(1, 15 - i, o))
            .collect();
        assert_eq!(common::block(&decode, &spec, 1, i), want, "block {i}");
    }
}

//! Idle peers cannot lock prompt ones out of the side channel: `max_sessions` caps the
//! handshakes under way, the oldest is closed with a "busy" answer to make room for a new
//! connection, and clients retry a busy answer within their deadline.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::loads::{fail_a_load, load};
use common::{fill, spec, worker, worker_with};
use nixl_connector::side_channel::fetch_handshake;
use nixl_connector::{Channel, ChannelLimits, Error, KvCacheSpec, KvConnectorWorker, PendingStats};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// The server's busy answer, as it travels (the side channel's own type is private).
#[derive(Debug, Serialize, Deserialize)]
enum Answer {
    Busy { reason: String },
}

/// A prefill whose side channel runs at most `max_sessions` handshakes and gives a silent
/// peer 30 s (so only eviction closes one within these tests).
fn prefill_with_cap(engine: &str, spec: &KvCacheSpec, max_sessions: usize) -> KvConnectorWorker {
    worker_with(engine, 0, 1, spec, |config| {
        config.limits.max_sessions = max_sessions;
        config.limits.deadline = Duration::from_secs(30);
    })
}

/// Waits until the side channel's counts satisfy `done`, for at most 10 s.
async fn wait_stats(
    worker: &KvConnectorWorker,
    done: impl Fn(&PendingStats) -> bool,
) -> PendingStats {
    let start = Instant::now();
    loop {
        let stats = worker.side_channel_stats();
        if done(&stats) {
            return stats;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{stats:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether the server closed `stream` after a busy answer (read within 10 s), or keeps it
/// open without a word (nothing within 200 ms: a closed one reads its end far sooner).
async fn closed_as_busy(stream: TcpStream) -> bool {
    let mut channel = Channel::new(stream, "prefill".into(), 1 << 20);
    let limit = Duration::from_millis(200);
    match tokio::time::timeout(limit, channel.recv::<Answer>()).await {
        Err(_) => false,
        Ok(Ok(Answer::Busy { reason })) => {
            assert!(reason.contains("closed for a newer one"), "{reason}");
            let end = tokio::time::timeout(Duration::from_secs(10), channel.recv::<Answer>()).await;
            assert!(matches!(end, Ok(Err(Error::Closed { .. }))), "{end:?}");
            true
        }
        Ok(other) => panic!("expected a busy answer or nothing, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_sessions_caps_handshakes_and_evicts_the_oldest() {
    common::init_tracing();
    const CAP: usize = 4;
    let spec = spec(2);
    let prefill = prefill_with_cap("pf-cap", &spec, CAP);
    let addr = prefill.side_channel_addr().unwrap();

    // Ten silent connections, one after another: the fifth evicts the first, and so on.
    let mut silent = Vec::new();
    for i in 0..10 {
        silent.push(TcpStream::connect(addr).await.unwrap());
        let admitted = i as u64 + 1;
        let stats = wait_stats(&prefill, |s| s.admitted == admitted).await;
        assert_eq!(
            stats.evicted,
            admitted.saturating_sub(CAP as u64),
            "{stats:?}"
        );
    }
    // A prompt reader still gets its answer (evicting one more silent peer).
    let decode = worker("dc-cap", 0, 1, &spec);
    let theirs = fetch_handshake(addr, &decode.handshake().unwrap(), ChannelLimits::default())
        .await
        .unwrap();
    assert_eq!(theirs.engine_id, "pf-cap");

    // The seven oldest were closed with a busy answer; the three newest are still held.
    let mut closed = Vec::new();
    for stream in silent {
        closed.push(closed_as_busy(stream).await);
    }
    let mut expected = vec![true; 7];
    expected.extend([false; 3]);
    assert_eq!(closed, expected);
    let stats = prefill.side_channel_stats();
    assert_eq!(
        (stats.admitted, stats.evicted, stats.refused),
        (11, 7, 0),
        "{stats:?}"
    );
    assert_eq!(stats.peak, CAP, "{stats:?}");
}

/// Connects to `addr` and holds the connection without a word until the server closes it,
/// then reconnects after `pause`, until `until`; returns how many of its connections the
/// server closed (the one still open at `until`, admitted or still waiting to be accepted,
/// is not counted).
async fn hold_silently(addr: std::net::SocketAddr, until: Instant, pause: Duration) -> u64 {
    let mut closed = 0;
    while Instant::now() < until {
        if let Ok(mut stream) = TcpStream::connect(addr).await {
            let mut buf = [0u8; 256];
            loop {
                match tokio::time::timeout_at(until, stream.read(&mut buf)).await {
                    Ok(Ok(0) | Err(_)) => break,
                    Ok(Ok(_)) => {}
                    Err(_) => return closed,
                }
            }
            closed += 1;
        }
        tokio::time::sleep(pause).await;
    }
    closed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_silent_connections_for_14_s_do_not_keep_a_decode_out() {
    common::init_tracing();
    const CAP: usize = 16;
    const HOLD: Duration = Duration::from_secs(14);
    let spec = spec(2);
    let prefill = prefill_with_cap("pf-idle", &spec, CAP);
    fill(&prefill, &spec);
    let addr = prefill.side_channel_addr().unwrap();

    // 50 peers connect and say nothing; each one the server closes reconnects 100 ms later.
    let until = Instant::now() + HOLD;
    let holders: Vec<_> = (0..50)
        .map(|_| tokio::spawn(hold_silently(addr, until, Duration::from_millis(100))))
        .collect();
    wait_stats(&prefill, |s| s.admitted >= 50).await;

    // Meanwhile a prompt reader handshakes every 100 ms...
    let asker = worker("dc-idle-asker", 0, 1, &spec);
    let ours = asker.handshake().unwrap();
    let answered = Arc::new(AtomicU64::new(0));
    let asking = {
        let answered = answered.clone();
        tokio::spawn(async move {
            while Instant::now() + Duration::from_millis(500) < until {
                let limits = ChannelLimits::default();
                let theirs = fetch_handshake(addr, &ours, limits).await.unwrap();
                assert_eq!(theirs.engine_id, "pf-idle");
                answered.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // ...and a decode loads 256 requests, every byte checked, handshaking again after every
    // 16th (a failed load makes it forget the prefill).
    let decode = worker("dc-idle", 0, 1, &spec);
    for i in 0..256 {
        if i % 16 == 15 {
            fail_a_load(&decode, &prefill, &spec, "pf-idle", &format!("bad-{i}")).await;
        }
        let local = [2 * (i % 8), 2 * (i % 8) + 1];
        let far = [i % spec.num_blocks, (i * 7 + 3) % spec.num_blocks];
        let request = format!("req-{i}");
        load(
            &decode,
            &prefill,
            &spec,
            "pf-idle",
            &request,
            (&local, &far),
        )
        .await
        .unwrap();
    }
    let decoded_at = Instant::now();
    asking.await.unwrap();
    let mut closed = 0;
    for holder in holders {
        closed += holder.await.unwrap();
    }
    assert!(
        decoded_at < until,
        "the decode finished after the idle peers left"
    );
    let stats = prefill.side_channel_stats();
    eprintln!(
        "{closed} silent connections closed by the server, {} prompt handshakes answered; side channel: {stats:?}",
        answered.load(Ordering::Relaxed)
    );
    assert!(answered.load(Ordering::Relaxed) >= 10);
    // Every silent connection the server closed (30 s deadline) was closed by an eviction.
    assert!(stats.evicted >= closed, "{stats:?}");
    assert!(stats.peak <= CAP, "{stats:?}");
}

/// A server that answers `busy` connections with a busy answer, then passes the next ones
/// to `real`.
async fn busy_then(real: std::net::SocketAddr, busy: usize) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        for n in 0.. {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            if n < busy {
                let mut channel = Channel::new(stream, "reader".into(), 1 << 20);
                let _ = channel.recv::<serde::de::IgnoredAny>().await;
                let reason = format!("busy, try {n}");
                let _ = channel.send(&Answer::Busy { reason }).await;
                let _ = channel.close().await;
            } else {
                let mut stream = stream;
                let mut server = TcpStream::connect(real).await.unwrap();
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut stream, &mut server).await;
                });
            }
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_answer_is_retried_within_the_deadline() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("pf-busy", 0, 1, &spec);
    let decode = worker("dc-busy", 0, 1, &spec);
    let ours = decode.handshake().unwrap();
    let limits = ChannelLimits {
        deadline: Duration::from_millis(1500),
        ..ChannelLimits::default()
    };

    let twice_busy = busy_then(prefill.side_channel_addr().unwrap(), 2).await;
    let theirs = fetch_handshake(twice_busy, &ours, limits).await.unwrap();
    assert_eq!(theirs.engine_id, "pf-busy");

    let always_busy = busy_then(prefill.side_channel_addr().unwrap(), usize::MAX).await;
    let err = fetch_handshake(always_busy, &ours, limits)
        .await
        .unwrap_err();
    let Error::Busy {
        reason,
        tries,
        deadline,
        ..
    } = &err
    else {
        panic!("{err}");
    };
    assert!(*tries >= 3, "{err}");
    assert_eq!(*deadline, limits.deadline);
    assert!(reason.starts_with("busy, try "), "{err}");
    assert!(err.to_string().contains("was still busy after"), "{err}");
}

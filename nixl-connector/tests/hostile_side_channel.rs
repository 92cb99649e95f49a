//! A hostile peer on the side channel gets a clear error in bounded time and memory, on
//! both ends, and the server keeps serving others.
//!
//! Time bounds are causal or wide: a peer cut "at once" is cut well before the deadline
//! that would otherwise end it, and one cut at the total deadline is cut before the 10 s a
//! dribble takes to finish (what a deadline per read would allow).

mod common;

use std::time::{Duration, Instant};

use common::{spec, worker, worker_with};
use nixl_connector::side_channel::fetch_handshake;
use nixl_connector::{ChannelLimits, Error};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The client's total deadline.
const CLIENT_DEADLINE: Duration = Duration::from_millis(600);
/// The server's total deadline.
const SERVER_DEADLINE: Duration = Duration::from_secs(4);
/// How long a dribble of 100 bytes, one every 100 ms, takes to finish.
const DRIBBLE: Duration = Duration::from_secs(10);

fn limits() -> ChannelLimits {
    ChannelLimits {
        deadline: CLIENT_DEADLINE,
        ..ChannelLimits::default()
    }
}

/// Reads until the server closes; returns how long that took.
async fn until_closed(stream: &mut (impl AsyncReadExt + Unpin)) -> Duration {
    let start = Instant::now();
    let mut buf = [0u8; 64];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await
    {
        if n == 0 {
            break;
        }
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_drops_huge_and_slow_peers_and_still_serves() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker_with("pf-hostile", 0, 1, &spec, |c| {
        c.limits.deadline = SERVER_DEADLINE
    });
    let addr = prefill.side_channel_addr().unwrap();

    // A 4 GiB frame declared: closed at once (a server waiting for it would hold it to the
    // deadline), nothing allocated for it.
    let mut huge = TcpStream::connect(addr).await.unwrap();
    huge.write_all(&0xFFFF_FFF0u32.to_be_bytes()).await.unwrap();
    let closed_after = until_closed(&mut huge).await;
    assert!(closed_after < SERVER_DEADLINE, "{closed_after:?}");

    // A peer that declares 100 bytes and dribbles them one every 100 ms is cut at the
    // total deadline, not kept alive by each byte.
    // Timed from before the connect: the server's deadline starts at its accept, which can
    // come before this task runs again after `connect` returns.
    let opened = Instant::now();
    let slow = TcpStream::connect(addr).await.unwrap();
    let (mut slow_read, mut slow_write) = slow.into_split();
    slow_write.write_all(&100u32.to_be_bytes()).await.unwrap();
    let dribble = tokio::spawn(async move {
        for _ in 0..100 {
            if slow_write.write_all(&[0x90]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let slow_closed = tokio::spawn(async move {
        until_closed(&mut slow_read).await;
        opened.elapsed()
    });

    // Meanwhile: garbage in a well-formed frame is closed at once, and an honest peer is
    // still answered.
    let mut junk = TcpStream::connect(addr).await.unwrap();
    junk.write_all(&[0, 0, 0, 3, 0xc1, 0xc1, 0xc1])
        .await
        .unwrap();
    let closed_after = until_closed(&mut junk).await;
    assert!(closed_after < SERVER_DEADLINE, "{closed_after:?}");
    let decode = worker("dc-hostile", 0, 1, &spec);
    let theirs = fetch_handshake(addr, &decode.handshake().unwrap(), limits())
        .await
        .unwrap();
    assert_eq!(theirs.engine_id, "pf-hostile");

    let open_for = slow_closed.await.unwrap();
    dribble.abort();
    assert!(
        open_for >= SERVER_DEADLINE && open_for < DRIBBLE,
        "closed after {open_for:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_refuses_huge_and_slow_servers_in_bounded_time() {
    common::init_tracing();
    let decode = worker("dc-victim", 0, 1, &spec(2));
    let ours = decode.handshake().unwrap();

    // A server that declares a 4 GiB answer.
    let huge = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let huge_addr = huge.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = huge.accept().await.unwrap();
        s.write_all(&0xFFFF_FFF0u32.to_be_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let start = Instant::now();
    let err = fetch_handshake(huge_addr, &ours, limits())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Protocol { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("frame longer than the 1048576-byte cap"),
        "{err}"
    );
    // Not waiting for the server, which holds the connection 5 s.
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );

    // A server that dribbles a byte every 100 ms: cut at the total deadline.
    let slow = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let slow_addr = slow.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = slow.accept().await.unwrap();
        s.write_all(&100u32.to_be_bytes()).await.unwrap();
        for _ in 0..100 {
            if s.write_all(&[0x90]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let start = Instant::now();
    let err = fetch_handshake(slow_addr, &ours, limits())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Deadline { .. }), "{err}");
    assert!(err.to_string().contains("total deadline"), "{err}");
    let took = start.elapsed();
    assert!(took >= CLIENT_DEADLINE && took < DRIBBLE, "{took:?}");
}

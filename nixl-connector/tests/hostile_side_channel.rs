//! A hostile peer on the side channel gets a clear error in bounded time and memory, on
//! both ends, and the server keeps serving others.

mod common;

use std::time::{Duration, Instant};

use common::{spec, worker, SERVER_DEADLINE};
use nixl_connector::side_channel::fetch_handshake;
use nixl_connector::{ChannelLimits, Error};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn limits() -> ChannelLimits {
    ChannelLimits {
        deadline: Duration::from_millis(600),
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
    let prefill = worker("pf-hostile", 0, 1, spec);
    let addr = prefill.side_channel_addr().unwrap();

    // A 4 GiB frame declared: closed at once, nothing allocated for it.
    let mut huge = TcpStream::connect(addr).await.unwrap();
    huge.write_all(&0xFFFF_FFF0u32.to_be_bytes()).await.unwrap();
    assert!(until_closed(&mut huge).await < Duration::from_secs(2));

    // A peer that declares 100 bytes and dribbles them one every 100 ms is cut at the
    // total deadline, not kept alive by each byte.
    let slow = TcpStream::connect(addr).await.unwrap();
    let opened = Instant::now();
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
    until_closed(&mut slow_read).await;
    dribble.abort();
    let open_for = opened.elapsed();
    assert!(
        open_for >= SERVER_DEADLINE && open_for < SERVER_DEADLINE + Duration::from_secs(2),
        "closed after {open_for:?}"
    );

    // Garbage in a well-formed frame: closed, and an honest peer is still answered.
    let mut junk = TcpStream::connect(addr).await.unwrap();
    junk.write_all(&[0, 0, 0, 3, 0xc1, 0xc1, 0xc1])
        .await
        .unwrap();
    assert!(until_closed(&mut junk).await < Duration::from_secs(2));
    let decode = worker("dc-hostile", 0, 1, spec);
    let theirs = fetch_handshake(addr, &decode.handshake().unwrap(), limits())
        .await
        .unwrap();
    assert_eq!(theirs.engine_id, "pf-hostile");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_refuses_huge_and_slow_servers_in_bounded_time() {
    common::init_tracing();
    let decode = worker("dc-victim", 0, 1, spec(2));
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
    assert!(start.elapsed() < Duration::from_secs(1));

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
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_millis(1500),
        "{took:?}"
    );
}

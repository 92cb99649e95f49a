//! vLLM's side channel in Rust on both ends, and each end against hostile peers: a clear
//! error in bounded time and memory, and a server that goes on serving prompt peers.

mod vllm_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nixl_connector::vllm::{
    fetch_meta, Compatibility, CompatibilityFactors, MetadataClient, MetadataServer,
    NixlHandshakePayload, VllmChannelLimits,
};
use nixl_connector::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use vllm_support::{factors, frame, hello, message, metadata, read_frame, read_reply};

fn limits() -> VllmChannelLimits {
    VllmChannelLimits {
        deadline: Duration::from_millis(800),
        idle: Duration::from_millis(800),
        max_connections: 4,
        ..VllmChannelLimits::default()
    }
}

async fn server(limits: VllmChannelLimits) -> MetadataServer {
    MetadataServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), limits)
        .await
        .unwrap()
}

/// A server answering ranks (0, 0) and (0, 1) under `factors()`'s hash.
async fn prefill(limits: VllmChannelLimits) -> MetadataServer {
    let server = server(limits).await;
    let hash = factors().hash();
    for rank in 0..2 {
        let payload = NixlHandshakePayload::new(&hash, &metadata("pf", rank));
        server.publish(0, rank as u32, &payload);
    }
    server
}

/// Reads until the peer closes (or 10 s pass); returns how long that took.
async fn until_closed(stream: &mut TcpStream) -> Duration {
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await
    {
        if n == 0 {
            break;
        }
    }
    start.elapsed()
}

/// Connects to `server` as a raw REQ peer past its handshake.
async fn raw_req(server: &MetadataServer) -> TcpStream {
    let mut stream = TcpStream::connect(server.local_addr()).await.unwrap();
    req_handshake(&mut stream).await;
    stream
}

async fn req_handshake(stream: &mut TcpStream) {
    stream.write_all(&hello("REQ")).await.unwrap();
    let mut theirs = [0u8; 64];
    stream.read_exact(&mut theirs).await.unwrap();
    read_frame(stream).await; // READY
}

fn error_of(frame: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct ErrorReply {
        error: String,
    }
    rmp_serde::from_slice::<ErrorReply>(frame).unwrap().error
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_fetches_each_ranks_payload_and_checks_its_hash() {
    let server = prefill(limits()).await;
    assert_eq!(server.registration_generation(), 2);
    let addr = server.local_addr();
    let compat = Compatibility::new(&factors(), true);

    let mut client = MetadataClient::connect("127.0.0.1", addr.port(), limits())
        .await
        .unwrap();
    for rank in 0..2 {
        let reply = client.get_meta(0, rank).await.unwrap();
        assert_eq!(
            compat.check(&reply.payload, client.peer()).unwrap(),
            metadata("pf", u64::from(rank))
        );
        assert!(reply.remote_clock.is_finite() && reply.rtt() >= 0.0);
        // Both ends share this process's clock: the offset is within the round trip.
        assert!(
            reply.clock_offset().abs() <= reply.rtt() + 1e-6,
            "{reply:?}"
        );
    }

    // A rank the engine lacks gets the server's reason, and the connection goes on.
    let err = client.get_meta(0, 7).await.unwrap_err().to_string();
    assert!(
        err.contains("no pp_rank 0 tp_rank 7") && err.contains("(0, 0), (0, 1)"),
        "{err}"
    );
    assert!(client.get_meta(0, 1).await.is_ok());

    // Another engine's hash is refused, naming both; not when the check is off.
    let other = CompatibilityFactors {
        model: "other".into(),
        ..factors()
    };
    let theirs = Compatibility::new(&other, true);
    let reply = fetch_meta("127.0.0.1", addr.port(), 0, 0, limits())
        .await
        .unwrap();
    let err = theirs.check(&reply.payload, "pf").unwrap_err();
    assert!(matches!(err, Error::CompatibilityMismatch { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&compat.hash) && text.contains(&theirs.hash),
        "{text}"
    );
    let off = Compatibility {
        enforce: false,
        ..theirs
    };
    assert!(off.check(&reply.payload, "pf").is_ok());

    // A republished payload starts a new generation; the same one does not.
    let changed = NixlHandshakePayload::new(&compat.hash, &metadata("pf", 9));
    server.publish(0, 0, &changed);
    server.publish(0, 0, &changed);
    assert_eq!(server.registration_generation(), 3);
    let reply = fetch_meta("127.0.0.1", addr.port(), 0, 0, limits())
        .await
        .unwrap();
    assert_eq!(reply.payload, changed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_an_error_reply_and_the_connection_goes_on() {
    let server = prefill(limits()).await;
    let mut req = raw_req(&server).await;
    for (request, expect) in [
        (vec![0xc1], "not a metadata request"),
        (b"\x93\xa7get_all\x00\x00".to_vec(), "unknown request"),
        (
            b"\x93\xc4\x0cget_meta_msg\xff\x00".to_vec(),
            "no pp_rank -1 tp_rank 0",
        ),
        (
            b"\x92\xc4\x0cget_meta_msg\x00".to_vec(),
            "not a metadata request",
        ),
    ] {
        req.write_all(&message(&[&request])).await.unwrap();
        let reply = read_reply(&mut req).await;
        assert_eq!(reply.len(), 2);
        assert!(
            error_of(&reply[0]).contains(expect),
            "{}",
            error_of(&reply[0])
        );
    }
    // Still answered on the same connection.
    req.write_all(&message(&[b"\x93\xc4\x0cget_meta_msg\x00\x01"]))
        .await
        .unwrap();
    let reply = read_reply(&mut req).await;
    let payload: NixlHandshakePayload = rmp_serde::from_slice(&reply[0]).unwrap();
    assert_eq!(payload.agent_metadata().unwrap(), metadata("pf", 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peers_are_cut_off_and_prompt_ones_still_served() {
    let limits = limits();
    let server = prefill(limits).await;
    let addr = server.local_addr();

    // A frame of 2^64 - 1 bytes declared: closed at once, nothing allocated for it.
    let mut huge = raw_req(&server).await;
    let mut declared = vec![1, 0, 2];
    declared.extend_from_slice(&u64::MAX.to_be_bytes());
    huge.write_all(&declared).await.unwrap();
    assert!(until_closed(&mut huge).await < Duration::from_secs(2));

    // A request over the cap, and more parts than a request has: closed.
    for parts in [vec![vec![0x90u8; 2000]], vec![b"a".to_vec(), b"b".to_vec()]] {
        let mut big = raw_req(&server).await;
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        big.write_all(&message(&parts)).await.unwrap();
        assert!(until_closed(&mut big).await < Duration::from_secs(2));
    }

    // Not ZMTP at all: closed.
    let mut http = TcpStream::connect(addr).await.unwrap();
    http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    http.write_all(&[0u8; 64]).await.unwrap();
    assert!(until_closed(&mut http).await < Duration::from_secs(2));

    // A DEALER is served; a PUB socket is refused.
    let mut dealer = TcpStream::connect(addr).await.unwrap();
    dealer.write_all(&hello("DEALER")).await.unwrap();
    dealer
        .write_all(&message(&[b"\x93\xc4\x0cget_meta_msg\x00\x00"]))
        .await
        .unwrap();
    let mut theirs = [0u8; 64];
    dealer.read_exact(&mut theirs).await.unwrap();
    read_frame(&mut dealer).await;
    assert_eq!(read_reply(&mut dealer).await.len(), 2);
    let mut publisher = TcpStream::connect(addr).await.unwrap();
    publisher.write_all(&hello("PUB")).await.unwrap();
    assert!(until_closed(&mut publisher).await < Duration::from_secs(2));

    // A request dribbled a byte every 100 ms is cut at the idle limit, a total.
    let mut slow = raw_req(&server).await;
    let opened = Instant::now();
    let request = message(&[b"\x93\xc4\x0cget_meta_msg\x00\x00"]);
    let (mut slow_read, mut slow_write) = slow.split();
    let dribble = async {
        for byte in request.iter().cycle().take(100) {
            if slow_write.write_all(&[*byte]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let closed = async {
        let mut buf = [0u8; 64];
        while let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_secs(10), slow_read.read(&mut buf)).await
        {
            if n == 0 {
                break;
            }
        }
    };
    tokio::select! { _ = dribble => panic!("never cut off"), _ = closed => {} }
    let open_for = opened.elapsed();
    assert!(
        open_for + Duration::from_millis(100) >= limits.idle
            && open_for < limits.idle + Duration::from_secs(2),
        "cut after {open_for:?}"
    );

    // Idle connections fill every slot; a prompt peer still gets in, at once.
    let mut idle = Vec::new();
    for _ in 0..3 * limits.max_connections {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let start = Instant::now();
    let reply = fetch_meta("127.0.0.1", addr.port(), 0, 0, limits)
        .await
        .unwrap();
    assert_eq!(reply.payload.agent_metadata().unwrap(), metadata("pf", 0));
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "{:?}",
        start.elapsed()
    );
    assert!(server.connections() <= limits.max_connections);
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_reads_its_reply_is_cut_at_the_deadline() {
    let limits = VllmChannelLimits {
        max_connections: 2,
        ..limits()
    };
    let server = server(limits).await;
    // 8 MiB: more than the socket buffers hold, so the reply's write waits on the reader.
    let mut big = metadata("pf", 0);
    big.agent_metadata = vec![7; 8 << 20];
    server.publish(0, 0, &NixlHandshakePayload::new("h", &big));
    server.publish(0, 1, &NixlHandshakePayload::new("h", &metadata("pf", 1)));

    // A reader whose receive buffer is small and never read.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stuck = socket.connect(server.local_addr()).await.unwrap();
    req_handshake(&mut stuck).await;
    stuck
        .write_all(&message(&[b"\x93\xc4\x0cget_meta_msg\x00\x00"]))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // It is being answered, so not displaced; the other slot serves prompt peers (each
    // once the server has seen the one before it close).
    for _ in 0..3 {
        let settled = Instant::now() + Duration::from_secs(2);
        while server.connections() > 1 && Instant::now() < settled {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let reply = fetch_meta("127.0.0.1", server.local_addr().port(), 0, 1, limits)
            .await
            .unwrap();
        assert_eq!(reply.payload.compatibility_hash, "h");
    }
    // Past the deadline the server has given up on the reply: what is left to read ends
    // short of it.
    tokio::time::sleep(limits.deadline + Duration::from_millis(500)).await;
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), stuck.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        got += n;
    }
    assert!(got < 8 << 20, "read {got} bytes");
}

/// A server that runs `misbehave` on each accepted connection after the ZMTP handshake
/// (and after reading one request).
async fn hostile_server<F, Fut>(misbehave: F) -> u16
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            stream.write_all(&hello("ROUTER")).await.unwrap();
            let mut theirs = [0u8; 64];
            stream.read_exact(&mut theirs).await.unwrap();
            read_frame(&mut stream).await; // READY
            read_frame(&mut stream).await; // delimiter
            read_frame(&mut stream).await; // request
            misbehave(stream).await;
        }
    });
    port
}

async fn client_error<F, Fut>(misbehave: F) -> (Error, Duration)
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let port = hostile_server(misbehave).await;
    let start = Instant::now();
    let err = fetch_meta("127.0.0.1", port, 0, 0, limits())
        .await
        .unwrap_err();
    (err, start.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_gets_a_clear_error_from_a_hostile_prefill_in_bounded_time() {
    let clock = rmp_serde::to_vec(&1.5f64).unwrap();
    let payload = NixlHandshakePayload::new("h", &metadata("pf", 0)).encode();

    // Silent: the total deadline.
    let (err, took) = client_error(|stream| async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(stream);
    })
    .await;
    assert!(matches!(err, Error::Deadline { .. }), "{err}");
    assert!(
        took < limits().deadline + Duration::from_secs(1),
        "{took:?}"
    );

    // A declared frame of 2^63 bytes, and one just over the cap: refused before reading.
    for len in [1u64 << 63, limits().max_payload as u64 + 1] {
        let (err, took) = client_error(move |mut stream| async move {
            let mut declared = vec![1, 0, 3];
            declared.extend_from_slice(&len.to_be_bytes());
            let _ = stream.write_all(&declared).await;
            tokio::time::sleep(Duration::from_secs(3)).await;
        })
        .await;
        let text = err.to_string();
        assert!(text.contains(&format!("{len} bytes")), "{text}");
        assert!(took < Duration::from_millis(500), "{took:?}");
    }

    // Replies of the wrong shape.
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (message(&[&payload]), "a reply of 1 frames"),
        (message(&[&payload, &clock, b"x"]), "more than 2 parts"),
        (
            message(&[b"\xc1", &clock]),
            "undecodable NixlHandshakePayload",
        ),
        (message(&[&payload, b"\xa3abc"]), "undecodable clock"),
        (message(&[&payload, &[0x10; 17]]), "over the 16-byte cap"),
        (frame(0, b"no delimiter"), "empty delimiter"),
        (
            [frame(1, b""), frame(1, b"x")].concat(),
            "closed the connection",
        ),
        (frame(4, b"\x05ERROR\x04nope"), "ZMTP ERROR: nope"),
    ];
    for (bytes, expect) in cases {
        let (err, took) = client_error(move |mut stream| {
            let bytes = bytes.clone();
            async move {
                let _ = stream.write_all(&bytes).await;
            }
        })
        .await;
        let text = err.to_string();
        assert!(text.contains(expect), "{expect}: {text}");
        assert!(took < Duration::from_millis(500), "{took:?}");
    }

    // An error reply names the server's reason.
    let (err, _) = client_error(|mut stream| async move {
        let reason = rmp_serde::to_vec_named(&std::collections::BTreeMap::from([(
            "error",
            "no such rank",
        )]))
        .unwrap();
        let clock = rmp_serde::to_vec(&1.5f64).unwrap();
        let _ = stream.write_all(&message(&[&reason, &clock])).await;
    })
    .await;
    assert!(
        matches!(&err, Error::Refused { reason, .. } if reason == "no such rank"),
        "{err}"
    );

    // Not a ZMQ server at all.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream.write_all(&[b'H'; 64]).await;
        }
    });
    let err = fetch_meta("127.0.0.1", port, 0, 0, limits())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not a ZMTP 3 peer"), "{err}");
}

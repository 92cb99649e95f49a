//! The native side channel's authentication with a shared secret, over real sockets and
//! real NIXL agents: engines sharing the secret handshake and read; a reader without it, or
//! with another, gets a typed refusal and nothing else within the deadline; a reader with a
//! secret refuses a server without one; a recorded exchange replayed to either side fails;
//! the allowlist of peer networks closes other networks' connections at accept (both
//! protocols); and a bounded fuzz of the authenticated exchange leaves the server answering.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{fill, spec, worker_with, SERVER_DEADLINE};
use nixl_connector::side_channel::{fetch_handshake, fetch_handshake_with};
use nixl_connector::vllm::{fetch_meta, MetadataServer, VllmChannelLimits};
use nixl_connector::{
    Channel, ChannelLimits, Error, HandshakeMessage, KvConnectorWorker, PeerNetworks, SharedSecret,
};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};

/// The side channel's request, as the connector encodes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Request {
    Handshake(Box<HandshakeMessage>),
    Hello {
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        #[serde(default)]
        version: u32,
    },
    Proof {
        #[serde(with = "serde_bytes")]
        sealed: Vec<u8>,
    },
}

/// The side channel's answer, as the connector encodes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Response {
    Accepted(Box<HandshakeMessage>),
    Refused {
        reason: String,
    },
    Busy {
        reason: String,
    },
    Challenge {
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        #[serde(default)]
        version: u32,
    },
    Proven {
        #[serde(with = "serde_bytes")]
        sealed: Vec<u8>,
    },
    Unauthenticated {
        reason: String,
    },
}

fn secret(text: &str) -> SharedSecret {
    SharedSecret::new(text.as_bytes()).unwrap()
}

const SECRET: &str = "a shared secret of the test deployment";

/// A TP-1 worker of engine `engine` with the cache of [`spec`]`(2)`, filled, with `secret`.
fn engine(engine: &str, secret: Option<SharedSecret>) -> KvConnectorWorker {
    common::init_tracing();
    let spec = spec(2);
    let worker = worker_with(engine, 0, 1, &spec, |c| c.secret = secret);
    fill(&worker, &spec);
    worker
}

fn addr(worker: &KvConnectorWorker) -> SocketAddr {
    worker.side_channel_addr().unwrap()
}

fn limits() -> ChannelLimits {
    ChannelLimits {
        deadline: Duration::from_secs(2),
        ..ChannelLimits::default()
    }
}

async fn channel(addr: SocketAddr) -> Channel {
    let stream = TcpStream::connect(addr).await.unwrap();
    Channel::new(stream, addr.to_string(), 1 << 20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_sharing_the_secret_handshake_and_others_are_refused_with_nothing_else() {
    let prefill = engine("pf-auth", Some(secret(SECRET)));
    let decode = engine("dc-auth", Some(secret(SECRET)));
    let port = addr(&prefill).port();
    decode
        .handshake_with("pf-auth", "127.0.0.1", port, 1)
        .await
        .expect("both sides hold the secret");

    let ours = decode.handshake().unwrap();
    // No secret: a typed refusal, within the deadline, and no handshake message.
    let started = Instant::now();
    let err = fetch_handshake(addr(&prefill), &ours, limits())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unauthenticated { .. }), "{err}");
    assert!(started.elapsed() < limits().deadline);
    // Another secret: the same.
    let err = fetch_handshake_with(
        addr(&prefill),
        &ours,
        limits(),
        Some(&secret("not the secret of the deployment")),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Unauthenticated { .. }), "{err}");
    // By hand: what a reader without the secret receives is the refusal alone.
    for first in [
        Request::Handshake(Box::new(ours.clone())),
        Request::Proof {
            sealed: vec![1; 40],
        },
    ] {
        let mut c = channel(addr(&prefill)).await;
        c.send(&first).await.unwrap();
        let answer: Response = c.recv().await.unwrap();
        assert!(
            matches!(answer, Response::Unauthenticated { .. }),
            "{answer:?}"
        );
        let next = c.recv::<Response>().await.unwrap_err();
        assert!(matches!(next, Error::Closed { .. }), "then the end: {next}");
    }
    // By hand: a proof not sealed under the exchange's key (the message in the clear, with
    // bytes where a tag would be) gets the refusal alone.
    let mut c = channel(addr(&prefill)).await;
    c.send(&Request::Hello {
        nonce: vec![7; 32],
        version: 2,
    })
    .await
    .unwrap();
    let challenge: Response = c.recv().await.unwrap();
    assert!(
        matches!(challenge, Response::Challenge { .. }),
        "{challenge:?}"
    );
    let mut sealed = rmp_serde::to_vec_named(&ours).unwrap();
    sealed.extend([3; 16]);
    c.send(&Request::Proof { sealed }).await.unwrap();
    let answer: Response = c.recv().await.unwrap();
    assert!(
        matches!(answer, Response::Unauthenticated { .. }),
        "{answer:?}"
    );
    let next = c.recv::<Response>().await.unwrap_err();
    assert!(matches!(next, Error::Closed { .. }), "then the end: {next}");
    // A reader of version 1 of the exchange (no version in its hello) is refused by name.
    let mut c = channel(addr(&prefill)).await;
    c.send(&Request::Hello {
        nonce: vec![7; 32],
        version: 0,
    })
    .await
    .unwrap();
    match c.recv::<Response>().await.unwrap() {
        Response::Refused { reason } => assert!(
            reason.contains("version 0") && reason.contains("this engine 2"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
    // A decode engine without the secret: its handshake fails, naming why.
    let open = engine("dc-open", None);
    let err = open
        .handshake_with("pf-auth", "127.0.0.1", port, 1)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("not authenticated"), "{err}");

    // A reader with a secret refuses a server without one.
    let open_prefill = engine("pf-open", None);
    let err = fetch_handshake_with(addr(&open_prefill), &ours, limits(), Some(&secret(SECRET)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unauthenticated { .. }), "{err}");
}

/// Relays one authenticated exchange between a reader and `server`, recording each frame.
async fn record(listener: TcpListener, server: SocketAddr) -> (Vec<Request>, Vec<Response>) {
    let (stream, peer) = listener.accept().await.unwrap();
    let mut reader = Channel::new(stream, peer.to_string(), 1 << 20);
    let mut upstream = channel(server).await;
    let (mut requests, mut responses) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let request: Request = reader.recv().await.unwrap();
        upstream.send(&request).await.unwrap();
        requests.push(request);
        let response: Response = upstream.recv().await.unwrap();
        reader.send(&response).await.unwrap();
        responses.push(response);
    }
    (requests, responses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_exchange_replayed_to_either_side_fails() {
    let prefill = engine("pf-replay", Some(secret(SECRET)));
    let decode = engine("dc-replay", Some(secret(SECRET)));
    let ours = decode.handshake().unwrap();
    let key = secret(SECRET);

    // A genuine exchange through a recording relay.
    let relay = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let recording = tokio::spawn(record(relay, addr(&prefill)));
    let theirs = fetch_handshake_with(relay_addr, &ours, limits(), Some(&key))
        .await
        .expect("the relayed exchange is genuine");
    assert_eq!(theirs.agent_name, prefill.handshake().unwrap().agent_name);
    let (requests, responses) = recording.await.unwrap();
    assert!(matches!(responses[1], Response::Proven { .. }));

    // The reader's frames replayed to the server: its challenge is new, the proof fails.
    let mut c = channel(addr(&prefill)).await;
    c.send(&requests[0]).await.unwrap();
    let challenge: Response = c.recv().await.unwrap();
    let (
        Response::Challenge { nonce: fresh, .. },
        Response::Challenge {
            nonce: recorded, ..
        },
    ) = (&challenge, &responses[0])
    else {
        panic!("{challenge:?}");
    };
    assert_ne!(fresh, recorded, "a fresh nonce");
    c.send(&requests[1]).await.unwrap();
    let answer: Response = c.recv().await.unwrap();
    assert!(
        matches!(answer, Response::Unauthenticated { .. }),
        "{answer:?}"
    );

    // The server's frames replayed to a reader: its nonce is new, the server's sealed answer
    // does not open.
    let fake = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake_addr = fake.local_addr().unwrap();
    let replayed = responses.clone();
    let server = tokio::spawn(async move {
        let (stream, peer) = fake.accept().await.unwrap();
        let mut c = Channel::new(stream, peer.to_string(), 1 << 20);
        for response in replayed {
            let _: Request = c.recv().await.unwrap();
            c.send(&response).await.unwrap();
        }
    });
    let err = fetch_handshake_with(fake_addr, &ours, limits(), Some(&key))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unauthenticated { .. }), "{err}");
    server.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_allowed_peer_networks_are_answered_by_either_protocols_listener() {
    common::init_tracing();
    let spec = spec(2);
    let elsewhere = PeerNetworks::only(vec!["10.0.0.0/8".parse().unwrap()]);
    let closed = worker_with("pf-closed", 0, 1, &spec, |c| {
        c.allowed_peers = Some(elsewhere.clone());
    });
    let loopback = worker_with("pf-loopback", 0, 1, &spec, |c| {
        c.allowed_peers = Some(PeerNetworks::only(vec!["127.0.0.0/8".parse().unwrap()]));
    });
    let decode = worker_with("dc-networks", 0, 1, &spec, |_| {});
    let ours = decode.handshake().unwrap();
    let err = fetch_handshake(addr(&closed), &ours, limits())
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Closed { .. } | Error::Io { .. }),
        "closed at accept: {err}"
    );
    fetch_handshake(addr(&loopback), &ours, limits())
        .await
        .expect("loopback is allowed");

    // The vLLM ROUTER: closed at accept, counted.
    let vllm_limits = VllmChannelLimits {
        deadline: SERVER_DEADLINE,
        ..VllmChannelLimits::default()
    };
    let server = MetadataServer::bind("127.0.0.1:0".parse().unwrap(), vllm_limits)
        .await
        .unwrap();
    server.set_allowed_peers(elsewhere);
    let port = server.local_addr().port();
    let err = fetch_meta("127.0.0.1", port, 0, 0, vllm_limits).await;
    assert!(err.is_err(), "{err:?}");
    assert_eq!(server.refused_networks(), 1);
    assert_eq!(server.connections(), 0);
}

/// xorshift64*: small, seeded, good enough to pick inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, most: usize) -> Vec<u8> {
        let len = (self.next() % (most as u64 + 1)) as usize;
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// Bounded fuzz of the authenticated exchange (run by scripts/test.sh, so by .ci/run):
/// random requests (nonces of any length, proofs of random or unsealed bytes, frames of
/// random bytes, other versions of the exchange) at a server with a secret. Every exchange ends, within the deadline, with
/// a refusal, a closed connection or a protocol error, never a handshake message; the
/// server answers a genuine reader afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_authenticated_exchanges_get_nothing_and_the_server_goes_on() {
    let prefill = engine("pf-fuzz", Some(secret(SECRET)));
    let decode = engine("dc-fuzz", Some(secret(SECRET)));
    let ours = decode.handshake().unwrap();
    let server = addr(&prefill);
    let mut rng = Rng(0x5eed_0031);
    let started = Instant::now();
    for round in 0..300 {
        let step = tokio::time::timeout(SERVER_DEADLINE + Duration::from_secs(1), async {
            let stream = TcpStream::connect(server).await.unwrap();
            if rng.next() % 4 == 0 {
                // Raw bytes, framed or not.
                use tokio::io::AsyncWriteExt;
                let mut stream = stream;
                let _ = stream.write_all(&rng.bytes(64)).await;
                return None;
            }
            let mut c = Channel::new(stream, server.to_string(), 1 << 20);
            let nonce = if rng.next() % 3 == 0 {
                rng.bytes(40)
            } else {
                (0..32).map(|_| rng.next() as u8).collect()
            };
            // Mostly this version of the exchange; now and then another.
            let version = if rng.next() % 8 == 0 {
                rng.next() as u32 % 4
            } else {
                2
            };
            c.send(&Request::Hello { nonce, version }).await.ok()?;
            let answer: Response = c.recv().await.ok()?;
            let Response::Challenge { .. } = answer else {
                return Some(answer);
            };
            // The message in the clear, or random bytes: neither opens under the exchange's key.
            let sealed = if rng.next() % 2 == 0 {
                rmp_serde::to_vec_named(&ours).unwrap()
            } else {
                rng.bytes(256)
            };
            c.send(&Request::Proof { sealed }).await.ok()?;
            c.recv::<Response>().await.ok()
        })
        .await
        .unwrap_or_else(|_| panic!("round {round} outlived the server's deadline"));
        if let Some(answer) = step {
            assert!(
                matches!(
                    answer,
                    Response::Unauthenticated { .. }
                        | Response::Refused { .. }
                        | Response::Busy { .. }
                ),
                "round {round}: {answer:?}"
            );
        }
    }
    tracing::info!(took = ?started.elapsed(), "300 fuzzed exchanges");
    fetch_handshake_with(server, &ours, limits(), Some(&secret(SECRET)))
        .await
        .expect("a genuine reader is still answered");
}

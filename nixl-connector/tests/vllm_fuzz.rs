//! Bounded mutation fuzzing of everything in the vLLM protocol that reads a peer's bytes:
//! the payload, metadata, request, clock and notification decoders, kv_transfer_params,
//! and a ROUTER fed mutated byte streams. Every input must give a value or an error (no
//! panic), and the server must still answer a well-behaved decode afterwards. Seeded, so a
//! failure reproduces; a crash found here becomes a regression test beside it.

mod vllm_support;

use std::net::SocketAddr;
use std::time::Duration;

use nixl_connector::vllm::notify::{encode_done, encode_heartbeat, parse, NotificationLimits};
use nixl_connector::vllm::payload::{
    decode_clock, decode_reply, decode_request, encode_clock, encode_error, encode_request,
};
use nixl_connector::vllm::{
    fetch_meta, MetadataServer, NixlAgentMetadata, NixlHandshakePayload, VllmChannelLimits,
    VllmKvTransferParams,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use vllm_support::{hello, message};

/// xorshift64*: small, seeded, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// `seed` with 1–4 mutations: flipped bits, interesting bytes, cuts, splices,
    /// duplicated runs.
    fn mutate(&mut self, seed: &[u8]) -> Vec<u8> {
        let mut out = seed.to_vec();
        for _ in 0..1 + self.below(4) {
            let at = self.below(out.len() + 1);
            match self.below(6) {
                0 if !out.is_empty() => {
                    let i = self.below(out.len());
                    out[i] ^= 1 << self.below(8);
                }
                1 if !out.is_empty() => {
                    let i = self.below(out.len());
                    out[i] = [0x00, 0xff, 0x7f, 0x80, 0xc1, 0xdd, 0xdf, 0xc6, 0xcf, 0x3a]
                        [self.below(10)];
                }
                2 => out.truncate(at),
                3 => {
                    let junk: Vec<u8> = (0..self.below(16)).map(|_| self.next() as u8).collect();
                    out.splice(at..at, junk);
                }
                4 if at < out.len() => {
                    let end = (at + 1 + self.below(32)).min(out.len());
                    let run = out[at..end].to_vec();
                    out.splice(at..at, run);
                }
                _ => out.insert(at, self.next() as u8),
            }
        }
        out
    }
}

fn metadata() -> NixlAgentMetadata {
    vllm_support::metadata("pf", 0)
}

#[test]
fn decoders_give_a_value_or_an_error_for_any_bytes() {
    let mut rng = Rng(0x5eed_0001);
    let payload = NixlHandshakePayload::new("h", &metadata());
    let seeds: Vec<Vec<u8>> = vec![
        payload.encode(),
        metadata().encode(),
        encode_request(0, 3),
        encode_clock(12.5),
        encode_error("no rank"),
        encode_done("cmpl-1:x", 2).unwrap(),
        encode_heartbeat(["a", "b", "c"]).unwrap(),
        br#"{"do_remote_prefill": true, "remote_block_ids": [[1, 2], [3]], "remote_port": 5600, "remote_blocks_expiry_time": null, "x": [1]}"#.to_vec(),
    ];
    let limits = NotificationLimits::default();
    let mut decoded = 0usize;
    for _ in 0..50_000 {
        let seed = &seeds[rng.below(seeds.len())];
        let input = rng.mutate(seed);
        decoded += usize::from(decode_reply(&input).is_ok());
        decoded += usize::from(NixlAgentMetadata::decode(&input).is_ok());
        decoded += usize::from(decode_request(&input).is_ok());
        decoded += usize::from(decode_clock(&input).is_ok());
        decoded += usize::from(parse(&input, &limits).is_ok());
        if let Ok(text) = std::str::from_utf8(&input) {
            decoded += usize::from(VllmKvTransferParams::from_json(text).is_ok());
        }
    }
    // Mutants near the seeds often still decode: the fuzzer reaches past the first byte.
    assert!(decoded > 1000, "only {decoded} mutants decoded");
}

/// Valid client bytes for one request: greeting, READY (REQ), then the request.
fn client_stream() -> Vec<u8> {
    [hello("REQ"), message(&[&encode_request(0, 0)])].concat()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_fed_mutated_streams_keeps_serving() {
    let limits = VllmChannelLimits {
        deadline: Duration::from_millis(300),
        idle: Duration::from_millis(300),
        max_connections: 16,
        ..VllmChannelLimits::default()
    };
    let server = MetadataServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), limits)
        .await
        .unwrap();
    server.publish(0, 0, &NixlHandshakePayload::new("h", &metadata()));
    let addr = server.local_addr();
    let seed = client_stream();
    let mut rng = Rng(0x5eed_0002);
    let mut answered = 0usize;
    for round in 0..1000 {
        let input = if round == 0 {
            seed.clone()
        } else {
            rng.mutate(&seed)
        };
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let _ = stream.write_all(&input).await;
        let _ = stream.shutdown().await;
        // Read whatever comes back until the server closes or goes quiet.
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(50), stream.read(&mut buf)).await
        {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        // Past the server's greeting (64 bytes) and READY (43): a reply.
        answered += usize::from(got.len() > 64 + 43);
    }
    assert!(answered > 20, "only {answered} mutants were answered");
    let reply = fetch_meta("127.0.0.1", addr.port(), 0, 0, limits)
        .await
        .unwrap();
    assert_eq!(reply.payload.agent_metadata().unwrap(), metadata());
}

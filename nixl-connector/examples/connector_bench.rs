//! Cross-process throughput of the connector: a decode process loads requests from a
//! prefill process (a child it starts) over NIXL/UCX, a fixed number in flight, then checks
//! every byte; beside it, a one-thread memcpy of the same blocks.
//!
//! ```sh
//! cargo run --release -p nixl-connector --example connector_bench -- \
//!     --layers 32 --blocks 512 --requests 256 --blocks-per-request 16 --in-flight 4
//! ```
//! Blocks are 16 KiB (16 tokens × 8 heads × 64 × 2 bytes, HND).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::kv_config::KvTransferConfig;
use nixl::platform::BuiltinPlatform;
use nixl_connector::{
    KvAttention, KvCacheSpec, KvConnectorWorker, KvLayout, RemoteBlocks, WorkerConfig,
};

const PREFILL_ENV: &str = "NIXL_CONNECTOR_BENCH_PREFILL";

struct Args {
    layers: usize,
    blocks: usize,
    requests: usize,
    per_request: usize,
    in_flight: usize,
}

fn args() -> Args {
    let mut a = Args {
        layers: 32,
        blocks: 512,
        requests: 256,
        per_request: 16,
        in_flight: 4,
    };
    let words: Vec<String> = std::env::args().skip(1).collect();
    for pair in words.chunks(2) {
        let value = || {
            pair.get(1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{} needs a positive number", pair[0]))
        };
        match pair[0].as_str() {
            "--layers" => a.layers = value(),
            "--blocks" => a.blocks = value(),
            "--requests" => a.requests = value(),
            "--blocks-per-request" => a.per_request = value(),
            "--in-flight" => a.in_flight = value(),
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(
        a.per_request <= a.blocks && a.in_flight > 0,
        "blocks per request must fit the cache"
    );
    a
}

/// `a.layers` regions of blocks of 16 tokens of 8 KV heads of 64 two-byte elements.
fn spec(a: &Args) -> KvCacheSpec {
    let heads = KvAttention::Mha { total_kv_heads: 8 };
    KvCacheSpec::uniform(
        a.layers,
        a.blocks,
        16,
        heads,
        KvLayout::Hnd,
        16 * 8 * 64 * 2,
    )
}

fn worker(engine: &str, spec: KvCacheSpec) -> nixl_connector::Result<KvConnectorWorker> {
    let kv = KvTransferConfig {
        kv_buffer_device: "cpu".into(),
        ..Default::default()
    };
    let mut config = WorkerConfig::new(engine, 0, 1, kv);
    config.platform = Arc::new(BuiltinPlatform::CPU);
    let worker = KvConnectorWorker::new(config)?;
    worker.register_host_kv_caches(spec)?;
    Ok(worker)
}

fn block_pattern(layer: usize, block: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|o| (layer * 7 + block * 13 + o) as u8)
        .collect()
}

/// Request `i`'s blocks: consecutive (wrapping), remote and local offset differently.
fn blocks_of(i: usize, a: &Args) -> (Vec<usize>, Vec<usize>) {
    let start = i * a.per_request;
    let remote = (0..a.per_request).map(|k| (start + k) % a.blocks).collect();
    let local = (0..a.per_request)
        .map(|k| (start + k + a.blocks / 2) % a.blocks)
        .collect();
    (local, remote)
}

async fn prefill(a: &Args) -> nixl_connector::Result<()> {
    let spec = spec(a);
    let w = worker("bench-prefill", spec.clone())?;
    let cache = w.kv_caches()?;
    for layer in 0..a.layers {
        for block in 0..spec.num_blocks {
            cache.write(
                layer,
                block * spec.block_len(0),
                &block_pattern(layer, block, spec.block_len(0)),
            )?;
        }
    }
    println!("PORT {}", w.side_channel_addr()?.port());
    // Serve until the decode closes our stdin.
    tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut Vec::new()))
        .await
        .ok();
    Ok(())
}

async fn decode(a: &Args) -> nixl_connector::Result<()> {
    let mut child = Command::new(std::env::current_exe().expect("own path"))
        .args(std::env::args().skip(1))
        .env(PREFILL_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the prefill process");
    let line = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("PORT "))
        .expect("prefill prints its port");
    let port: u16 = line[5..].parse().expect("a port");
    let outcome = measure(a, port).await;
    drop(child.stdin.take());
    child.wait().ok();
    outcome
}

/// Loads every request from the prefill on `port`, checks the bytes, prints the figures.
async fn measure(a: &Args, port: u16) -> nixl_connector::Result<()> {
    let spec = spec(a);
    let w = worker("bench-decode", spec.clone())?;
    let remote = |i: usize, blocks: Vec<usize>| RemoteBlocks {
        engine_id: "bench-prefill".into(),
        host: "127.0.0.1".into(),
        port,
        block_ids: blocks,
        group_lens: Vec::new(),
        request_id: format!("r{i}"),
        tp_size: 1,
        pp_size: 1,
        dcp_size: 1,
        num_tokens: None,
        blocks_expiry_time: None,
        registration_generation: None,
        // The bench's prefill holds nothing: nothing for a notification to free.
        capability: None,
        lease_epoch: None,
        kept: false,
    };

    // Warm-up: the handshake and the first connection are not timed.
    let (local, far) = blocks_of(0, a);
    w.start_load("warm", &local, &remote(0, far))?;
    while w.finished().recving.is_empty() {
        w.load_ended().await;
    }
    w.metrics();

    let mut last = vec![None; a.blocks];
    let mut next = 0;
    let mut pending = VecDeque::new();
    let mut done = 0;
    let start = Instant::now();
    while done < a.requests {
        while next < a.requests && pending.len() < a.in_flight {
            let (local, far) = blocks_of(next, a);
            for (&l, &r) in local.iter().zip(&far) {
                last[l] = Some(r);
            }
            w.start_load(&format!("d{next}"), &local, &remote(next, far))?;
            pending.push_back(next);
            next += 1;
        }
        let finished = w.finished().recving;
        if finished.is_empty() {
            w.load_ended().await;
            continue;
        }
        done += finished.len();
        pending.drain(..finished.len().min(pending.len()));
    }
    let elapsed = start.elapsed();
    let errors = w.load_errors();
    let metrics = w.metrics();
    let bytes: u64 = metrics.iter().map(|m| m.bytes).sum();

    let cache = w.kv_caches()?;
    let mut bad = 0;
    let mut got = vec![0u8; spec.block_len(0)];
    for layer in 0..a.layers {
        for (local, far) in last.iter().enumerate() {
            if let Some(far) = far {
                cache.read(layer, local * spec.block_len(0), &mut got)?;
                bad += usize::from(got != block_pattern(layer, *far, spec.block_len(0)));
            }
        }
    }
    let memcpy = memcpy_gbps(a, &spec);
    let gbps = bytes as f64 / elapsed.as_secs_f64() / 1e9;
    println!(
        "connector: {} requests x {} blocks x {} layers x {} B, {} in flight: {:.3} GB/s ({} bytes in {:.3} s); load errors {}, mismatched blocks {}; memcpy 1 thread same blocks {:.3} GB/s; ratio {:.2}x",
        a.requests, a.per_request, a.layers, spec.block_len(0), a.in_flight, gbps, bytes, elapsed.as_secs_f64(), errors.len(), bad, memcpy, gbps / memcpy
    );
    if bad > 0 || !errors.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}

/// One thread copying the same blocks between two caches of the same shape.
fn memcpy_gbps(a: &Args, spec: &KvCacheSpec) -> f64 {
    let len = spec.block_len(0);
    let src: Vec<Vec<u8>> = (0..a.layers)
        .map(|_| vec![1u8; spec.region_len(0)])
        .collect();
    let mut dst: Vec<Vec<u8>> = (0..a.layers)
        .map(|_| vec![0u8; spec.region_len(0)])
        .collect();
    let start = Instant::now();
    for i in 0..a.requests {
        let (local, far) = blocks_of(i, a);
        for layer in 0..a.layers {
            for (&l, &r) in local.iter().zip(&far) {
                dst[layer][l * len..(l + 1) * len]
                    .copy_from_slice(&src[layer][r * len..(r + 1) * len]);
            }
        }
    }
    let elapsed = start.elapsed().max(Duration::from_nanos(1));
    std::hint::black_box(&dst);
    (a.requests * a.per_request * a.layers * len) as f64 / elapsed.as_secs_f64() / 1e9
}

#[tokio::main]
async fn main() -> nixl_connector::Result<()> {
    let a = args();
    if std::env::var_os(PREFILL_ENV).is_some() {
        prefill(&a).await
    } else {
        decode(&a).await
    }
}

//! The cross-process figure: the throughput of one run of the prefill/decode demo
//! (`scripts/demo.sh`: two processes, decode loads KV-cache blocks from prefill through the
//! connector over NIXL/UCX and verifies every byte) at one of its two shapes, read from the
//! demo's output, next to a single-thread memcpy of
//! the same bytes in the same shape (blocks of the same size, in layers of the same size)
//! measured right after it.

use std::path::Path;
use std::time::Instant;

use nixl::HostBuffer;

use super::report::{XPROC_CONFIG, XPROC_SHAPES};
use super::{permutation, pin, Output, Res, MEASURE_CORE};

/// What one demo run moved and how fast, as its output tells.
struct DemoRun {
    layers: usize,
    blocks: usize,
    block_bytes: usize,
    requests: usize,
    blocks_per_request: usize,
    gbps: f64,
}

/// The words of the first line of `text` containing `marker`, after the marker.
fn after<'a>(text: &'a str, marker: &str) -> Res<Vec<&'a str>> {
    text.lines()
        .find_map(|line| line.split_once(marker).map(|(_, rest)| rest))
        .map(|rest| {
            rest.split(|c: char| c.is_whitespace() || c == '(' || c == ',')
                .filter(|w| !w.is_empty())
                .collect()
        })
        .ok_or_else(|| format!("demo output without {marker:?}").into())
}

fn number<T: std::str::FromStr>(words: &[&str], i: usize, what: &str) -> Res<T> {
    words
        .get(i)
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| format!("demo output: cannot read {what} from {words:?}").into())
}

fn parse(text: &str) -> Res<DemoRun> {
    if !text.contains("demo: PASSED") {
        return Err("the demo run did not pass".into());
    }
    // "prefill: agent P listening on ADDR (32 layers x 512 blocks x 16384 bytes = ..."
    let cache = after(text, " listening on ")?;
    // "decode: agent D pulling 256 requests of 16 blocks x 32 layers x 16384 bytes from ..."
    let pull = after(text, " pulling ")?;
    // "  bytes:     2147483648 (2048.0 MiB)" and "  time:      0.987 s, 2.18 GB/s"
    let bytes: f64 = number(&after(text, "  bytes:")?, 0, "bytes")?;
    let secs: f64 = number(&after(text, "  time:")?, 0, "time")?;
    let run = DemoRun {
        layers: number(&cache, 1, "layers")?,
        blocks: number(&cache, 4, "blocks")?,
        block_bytes: number(&cache, 7, "block bytes")?,
        requests: number(&pull, 0, "requests")?,
        blocks_per_request: number(&pull, 3, "blocks per request")?,
        gbps: bytes / secs / 1e9,
    };
    let moved = run.requests * run.blocks_per_request * run.layers * run.block_bytes;
    if moved as f64 != bytes || run.blocks_per_request > run.blocks {
        return Err(format!("demo output: {bytes} bytes pulled, {moved} expected").into());
    }
    Ok(run)
}

/// One thread copying, for every request, `blocks_per_request` blocks of every layer from
/// one set of layer buffers to another (block indices from a fixed permutation); GB/s.
fn memcpy_blocks(run: &DemoRun) -> Res<f64> {
    let layer_bytes = run.blocks * run.block_bytes;
    let alloc = |fill: u8| -> Res<Vec<HostBuffer>> {
        (0..run.layers)
            .map(|_| {
                let mut buf = HostBuffer::zeroed(layer_bytes)?;
                buf.fill(fill);
                Ok(buf)
            })
            .collect()
    };
    let (src, mut dst) = (alloc(0x5a)?, alloc(0)?);
    let perm = permutation(run.blocks, 42);
    let per = run.blocks_per_request;
    let chunks = run.blocks / per;
    let picks = |c: usize| &perm[c * per..(c + 1) * per];
    let t0 = Instant::now();
    for request in 0..run.requests {
        let (from, to) = (
            picks((request + chunks / 2) % chunks),
            picks(request % chunks),
        );
        for (s, d) in src.iter().zip(dst.iter_mut()) {
            for (&f, &t) in from.iter().zip(to) {
                let (f, t) = (f * run.block_bytes, t * run.block_bytes);
                d[t..t + run.block_bytes]
                    .copy_from_slice(std::hint::black_box(&s[f..f + run.block_bytes]));
            }
            std::hint::black_box(&mut *d);
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    Ok(
        (run.requests * run.blocks_per_request * run.layers * run.block_bytes) as f64
            / 1e9
            / elapsed,
    )
}

/// Records the demo run whose output is in `demo_output` and the memcpy probe.
pub fn record(out: &mut Output, demo_output: &Path) -> Res<()> {
    let run = parse(&std::fs::read_to_string(demo_output)?)?;
    let workload = match (run.requests, run.blocks_per_request) {
        (256, 16) => XPROC_SHAPES[0].0,
        (200, 32) => XPROC_SHAPES[1].0,
        (requests, per) => {
            return Err(format!(
                "demo shape {requests} requests × {per} blocks is not one the report knows"
            )
            .into())
        }
    };
    out.emit("rust", XPROC_CONFIG, workload, "gbps", run.gbps);
    pin(MEASURE_CORE)?;
    let gbps = memcpy_blocks(&run)?;
    out.emit("memcpy", "1 thread", workload, "gbps", gbps);
    Ok(())
}

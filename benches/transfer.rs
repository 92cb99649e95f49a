//! NIXL transfer benchmarks of the `nixl` crate, side by side with NIXL's Python API
//! (`bench/python/transfer.py`, same workloads) and a single-thread memcpy probe.
//!
//! ```sh
//! scripts/bench.sh                                                  # everything, A B A B rounds
//! CARGO_TARGET_DIR=/tmp/target-bench cargo bench -p nixl-rs --bench transfer   # one Rust round
//! ```
//!
//! Setup, identical to the Python side: two agents "A" and "B" in one process, UCX with default
//! parameters, DRAM buffers from [`HostBuffer`] (large ones 2 MiB-aligned and backed by
//! transparent huge pages, as NumPy's), metadata exchanged in-process. The agents are created
//! while the creating thread is pinned to core 1, so NIXL's and UCX's threads inherit that
//! affinity; the measuring thread then pins itself to core 0.
//!
//! Arguments: `[--round N] [--json PATH]` runs one round (JSON lines appended to PATH, else
//! printed); `cross-process DEMO_OUTPUT [--round N] [--json PATH]` records the GB/s of one
//! `scripts/demo.sh` run (its output in DEMO_OUTPUT) and a memcpy probe of the same shape;
//! `report JSONL OUT_DIR` turns the JSON lines of a whole run into `OUT_DIR/results.md` and
//! `OUT_DIR/transfer.svg` and `OUT_DIR/latency.svg`. The async completion variants (`.await`,
//! blocking `wait`, a 5 ms sleep-poll loop) are in `transfer/awaiting.rs`; many tasks awaiting
//! transfers against the same transfers one after another are in `transfer/concurrent.rs`
//! (part of every round; `concurrent [--round N] [--json PATH]` runs them alone, and
//! `report-concurrent JSONL OUT_MD` writes their table; `concurrent-peer SEED` is its child
//! process). `w4 [--round N] [--json PATH]` runs W4 alone, with its floors through the bare C
//! calls (`transfer/raw_w4.rs`).

#[path = "transfer/awaiting.rs"]
mod awaiting;
#[path = "transfer/concurrent.rs"]
mod concurrent;
#[path = "transfer/cross_process.rs"]
mod cross_process;
#[path = "transfer/raw_w4.rs"]
mod raw_w4;
#[path = "transfer/report.rs"]
mod report;

use std::io::Write;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use awaiting::Completer;
use nixl::{
    Agent, AgentConfig, HostBuffer, LocalDescList, MemType, Registration, RemoteDescList,
    ThreadSync, XferDesc, XferOp, XferOptions, XferRequest, XferStatus,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const BULK: usize = 64 * MIB;
const BULK_ITERS: usize = 20;
const KV_BLOCKS: usize = 8192;
const KV_BLOCK: usize = 32 * KIB;
const KV_READ: usize = 1024;
const KV_ITERS: usize = 16;
const SMALL: usize = 4 * KIB;
const SMALL_ITERS: usize = 2000;
const BUILD_DESCS: usize = 100_000;
const BUILD_DESC: usize = 64;
const BUILD_STRIDE: usize = 128;
const BUILD_REPS: usize = 5;
const SWEEP: [usize; 5] = [4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB];
const IDLE: Duration = Duration::from_secs(1);
const AGENT_CORE: usize = 1;
const MEASURE_CORE: usize = 0;
const WAIT: Duration = Duration::from_secs(60);

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.first().map(String::as_str) == Some("report") {
        let [_, input, out_dir] = args.as_slice() else {
            return Err("usage: transfer report JSONL OUT_DIR".into());
        };
        return report::write(input.as_ref(), out_dir.as_ref());
    }
    if let [cmd, arg] = args.as_slice() {
        if cmd == "concurrent-peer" {
            return concurrent::serve_peer(arg);
        }
    }
    if let [cmd, input, out_md] = args.as_slice() {
        if cmd == "report-concurrent" {
            return report::write_concurrent_only(input.as_ref(), out_md.as_ref());
        }
    }
    if args.first().map(String::as_str) == Some("concurrent-profile") {
        return concurrent::profile(&args[1..]);
    }
    if args.first().map(String::as_str) == Some("w4") {
        let mut out = Output::from_args(&args[1..])?;
        let pair = Pair::new(&AgentConfig::default(), false)?;
        w4(&mut out, &pair)?;
        out.summary(&format!(
            "w4 round {}: lists of 100,000 descriptors and a request, the crate's default agents \
             and the bare C calls",
            out.round
        ));
        return Ok(());
    }
    if args.first().map(String::as_str) == Some("concurrent") {
        let mut out = Output::from_args(&args[1..])?;
        let round = u64::from(out.round);
        concurrent::record(&mut out, round)?;
        out.summary(&format!(
            "concurrent round {}: {} tasks each awaiting a 16 KiB READ against the same READs \
             one after another (blocking wait)",
            out.round,
            concurrent::REQUESTS
        ));
        return Ok(());
    }
    if let [cmd, demo_output, rest @ ..] = args.as_slice() {
        if cmd == "cross-process" {
            let mut out = Output::from_args(rest)?;
            cross_process::record(&mut out, demo_output.as_ref())?;
            out.summary(&format!(
                "cross-process round {}: GB/s of one scripts/demo.sh run (decode's summary: bytes / time); \
                 memcpy probe of the same blocks on core {MEASURE_CORE}",
                out.round
            ));
            return Ok(());
        }
    }
    let mut out = Output::from_args(&args)?;
    run_round(&mut out)?;
    out.summary(&format!(
        "rust bench round {}: agents A,B created on core {AGENT_CORE} (NIXL/UCX threads inherit it), \
         measured on core {MEASURE_CORE}; the crate's default UCX backend (the plugin's defaults: \
         no worker threads; UCX's mutex worker lock) unless the config says otherwise; config 'default' = nixl::AgentConfig::default()",
        out.round
    ));
    Ok(())
}

/// Where the records go, and the round they belong to.
struct Output {
    round: u32,
    json: Option<std::fs::File>,
    records: Vec<serde_json::Value>,
}

impl Output {
    fn from_args(args: &[String]) -> Res<Output> {
        let mut out = Output {
            round: 0,
            json: None,
            records: Vec::new(),
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match (arg.as_str(), it.next()) {
                ("--round", Some(n)) => out.round = n.parse()?,
                ("--json", Some(path)) => {
                    out.json = Some(
                        std::fs::OpenOptions::new()
                            .create(true)
                            .append(true)
                            .open(path)?,
                    );
                }
                _ => return Err(format!("unknown argument {arg:?}").into()),
            }
        }
        Ok(out)
    }

    fn emit(&mut self, lang: &str, config: &str, workload: &str, metric: &str, value: f64) {
        let unit = match metric {
            "gbps" => "GB/s",
            "cpu_s_per_gb" => "CPU s/GB",
            "req_per_s" => "req/s",
            "us_per_iter" | "p50_us" | "p99_us" => "us",
            "in_progress_pct" => "% of posts",
            "core_pct" => "% of a core",
            "ratio" => "x",
            _ => "ms",
        };
        let record = serde_json::json!({
            "lang": lang, "config": config, "workload": workload, "metric": metric,
            "value": value, "unit": unit, "round": self.round,
        });
        match &mut self.json {
            Some(file) => {
                if let Err(err) = writeln!(file, "{record}") {
                    eprintln!("rust bench: cannot write record: {err}");
                }
            }
            None => println!("{record}"),
        }
        self.records.push(record);
    }

    /// Prints `header`, every record and the command reproducing them to stderr.
    fn summary(&self, header: &str) {
        eprintln!("{header}");
        for r in &self.records {
            eprintln!(
                "  {:<7} {:<15} {:<16} {:<13} {:>12.4} {}",
                r["lang"].as_str().unwrap_or(""),
                r["config"].as_str().unwrap_or(""),
                r["workload"].as_str().unwrap_or(""),
                r["metric"].as_str().unwrap_or(""),
                r["value"].as_f64().unwrap_or(f64::NAN),
                r["unit"].as_str().unwrap_or(""),
            );
        }
        let args: Vec<String> = std::env::args().skip(1).collect();
        eprintln!(
            "reproduce: CARGO_TARGET_DIR=/tmp/target-bench cargo bench -p nixl-rs --bench transfer -- {}",
            args.into_iter()
                .filter(|a| a != "--bench")
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
}

/// Pins the calling thread to one core.
fn pin(core: usize) -> Res<()> {
    pin_to(&[core])
}

/// Restricts the calling thread to `cores`.
fn pin_to(cores: &[usize]) -> Res<()> {
    // SAFETY: cpu_set_t is plain bits, valid when zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &core in cores {
        // SAFETY: `core` is below CPU_SETSIZE (checked by libc's macro) and `set` is ours.
        unsafe { libc::CPU_SET(core, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; the set is valid for its size.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(format!(
            "pin to cores {cores:?}: {}",
            std::io::Error::last_os_error()
        )
        .into());
    }
    Ok(())
}

/// User plus system CPU seconds of the whole process (every thread, NIXL's and UCX's too).
fn cpu_seconds() -> f64 {
    // SAFETY: rusage is plain data, valid when zeroed.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// Fisher-Yates shuffle of `0..n` driven by splitmix64 (identical to the Python bench).
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut perm: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        perm.swap(i, j);
    }
    perm
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len / 8)
        .flat_map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).to_le_bytes())
        .collect()
}

fn contents(reg: &Registration) -> Res<Vec<u8>> {
    let mut out = vec![0u8; reg.regions()[0].len];
    reg.read(0, 0, &mut out)?;
    Ok(out)
}

fn check(ok: bool, what: &str) -> Res<()> {
    if ok {
        Ok(())
    } else {
        Err(format!("destination bytes wrong after {what}").into())
    }
}

/// How a benchmark waits for a posted request.
#[derive(Clone, Copy, PartialEq)]
enum Poll {
    /// [`XferRequest::wait`]: the crate's spin-and-yield loop.
    Wait,
    /// Polls `status()` back to back, never yielding (an alternative to `wait`).
    Spin,
}

fn post_wait(req: &mut XferRequest, poll: Poll) -> Res<()> {
    if req.post()? == XferStatus::Done {
        return Ok(());
    }
    match poll {
        Poll::Wait => req.wait(WAIT)?,
        Poll::Spin => while req.status()? == XferStatus::InProgress {},
    }
    Ok(())
}

/// Two agents with a UCX backend each and their registered buffers.
struct Pair {
    a: Agent,
    a_bulk: Registration,
    b_bulk: Registration,
    kv: Option<[Registration; 2]>,
    a_small: Registration,
    b_small: Registration,
    a_build: Registration,
    b_build: Registration,
    b: Agent,
}

impl Pair {
    /// Creates A and B with `config` on [`AGENT_CORE`], registers the buffers (the KV cache
    /// only with `kv`), loads B's metadata into A, then moves the caller to [`MEASURE_CORE`].
    fn new(config: &AgentConfig, kv: bool) -> Res<Pair> {
        Pair::with(config, config, kv)
    }

    /// As [`Pair::new`], with different configurations for A (initiator) and B (target).
    fn with(a_config: &AgentConfig, b_config: &AgentConfig, kv: bool) -> Res<Pair> {
        Pair::with_ucx(a_config, b_config, kv, &[], &[AGENT_CORE])
    }

    /// As [`Pair::with`], with UCX parameters `ucx` on both agents, created while the
    /// creating thread may run on `agent_cores` (NIXL's and UCX's threads inherit them).
    fn with_ucx(
        a_config: &AgentConfig,
        b_config: &AgentConfig,
        kv: bool,
        ucx: &[(&str, &str)],
        agent_cores: &[usize],
    ) -> Res<Pair> {
        pin_to(agent_cores)?;
        let a = Agent::builder("A").config(a_config.clone()).build()?;
        let b = Agent::builder("B").config(b_config.clone()).build()?;
        // SAFETY: a benchmark, where a crash of NIXL 1.5.1's UCX worker threads (some setups
        // set `num_threads`) costs a round: scripts/bench.sh logs it and runs the round again.
        let (ucx_a, ucx_b) = unsafe {
            (
                a.create_backend_with_unchecked("UCX", ucx.iter().copied())?,
                b.create_backend_with_unchecked("UCX", ucx.iter().copied())?,
            )
        };
        let reg = |agent: &Agent, len: usize| -> Res<Registration> {
            let backend = if agent.name() == "A" { &ucx_a } else { &ucx_b };
            Ok(agent.register_memory(HostBuffer::zeroed(len)?, &[backend])?)
        };
        let pair = Pair {
            a_bulk: reg(&a, BULK)?,
            b_bulk: reg(&b, BULK)?,
            kv: if kv {
                Some([
                    reg(&a, KV_BLOCKS * KV_BLOCK)?,
                    reg(&b, KV_BLOCKS * KV_BLOCK)?,
                ])
            } else {
                None
            },
            a_small: reg(&a, SMALL)?,
            b_small: reg(&b, SMALL)?,
            a_build: reg(&a, BUILD_DESCS * BUILD_STRIDE)?,
            b_build: reg(&b, BUILD_DESCS * BUILD_STRIDE)?,
            a,
            b,
        };
        pair.a.load_remote_metadata(&pair.b.local_metadata()?)?;
        pin(MEASURE_CORE)?;
        Ok(pair)
    }
}

fn remote(reg: &Registration, offset: usize, len: usize) -> XferDesc {
    XferDesc::new(reg.regions()[0].addr + offset, len, 0)
}

/// One request covering `[offset, offset + len)` of A's and B's bulk buffers, cut into `descs`
/// equal descriptors that NIXL is told not to merge back into one.
fn bulk_request(
    pair: &Pair,
    op: XferOp,
    offset: usize,
    len: usize,
    descs: usize,
) -> Res<XferRequest> {
    let piece = len / descs;
    let mut local = LocalDescList::with_capacity(MemType::Dram, descs)?;
    let mut remote_descs = Vec::with_capacity(descs);
    for i in 0..descs {
        local.push(&pair.a_bulk, 0, offset + i * piece, piece)?;
        remote_descs.push(remote(&pair.b_bulk, offset + i * piece, piece));
    }
    let remote = RemoteDescList::from_descs(MemType::Dram, &remote_descs)?;
    let opts = XferOptions::new().skip_desc_merge(descs > 1);
    Ok(pair.a.create_xfer_req(op, &local, &remote, "B", &opts)?)
}

/// Requests covering `[0, size)` of A's and B's bulk buffers, cut into `parts` requests of
/// one descriptor each.
fn bulk_requests(pair: &Pair, op: XferOp, size: usize, parts: usize) -> Res<Vec<XferRequest>> {
    let part = size / parts;
    (0..parts)
        .map(|i| bulk_request(pair, op, i * part, part, 1))
        .collect()
}

/// Fills the source with a fresh pattern, clears the destination, runs the requests once
/// and compares the bytes.
fn bulk_check(
    pair: &Pair,
    op: XferOp,
    size: usize,
    reqs: &mut [XferRequest],
    seed: u64,
) -> Res<()> {
    let (src, dst) = match op {
        XferOp::Write => (&pair.a_bulk, &pair.b_bulk),
        XferOp::Read => (&pair.b_bulk, &pair.a_bulk),
    };
    src.write(0, 0, &pattern(size, seed))?;
    dst.write(0, 0, &vec![0u8; size])?;
    for req in reqs.iter_mut() {
        post_wait(req, Poll::Wait)?;
    }
    check(
        contents(src)?[..size] == contents(dst)?[..size],
        "bulk transfer",
    )
}

/// Times `iters` reposts of one single-descriptor request; returns (GB/s, CPU s/GB).
fn bulk(
    pair: &Pair,
    op: XferOp,
    size: usize,
    iters: usize,
    poll: Poll,
    seed: u64,
) -> Res<(f64, f64)> {
    bulk_descs(pair, op, size, 1, iters, poll, seed)
}

/// As [`bulk`], with the request cut into `descs` unmerged descriptors.
fn bulk_descs(
    pair: &Pair,
    op: XferOp,
    size: usize,
    descs: usize,
    iters: usize,
    poll: Poll,
    seed: u64,
) -> Res<(f64, f64)> {
    let mut reqs = vec![bulk_request(pair, op, 0, size, descs)?];
    bulk_check(pair, op, size, &mut reqs, seed)?;
    let req = &mut reqs[0];
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    for _ in 0..iters {
        post_wait(req, poll)?;
    }
    let (elapsed, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    let gb = (size * iters) as f64 / 1e9;
    Ok((gb / elapsed, cpu / gb))
}

/// W1 cut into `parts` requests, each posted and polled by its own thread (the measuring
/// thread on core 0, helpers on core 1): the polling thread does the copy, so the copies run
/// in parallel. Returns (GB/s, CPU s/GB).
fn bulk_split(pair: &Pair, op: XferOp, parts: usize, seed: u64) -> Res<(f64, f64)> {
    let mut reqs = bulk_requests(pair, op, BULK, parts)?;
    bulk_check(pair, op, BULK, &mut reqs, seed)?;
    let mut mine = reqs.remove(0);
    let start = Barrier::new(parts);
    let done = Barrier::new(parts);
    let (mut cpu0, mut t0) = (0.0, Instant::now());
    std::thread::scope(|s| -> Res<()> {
        let helpers: Vec<_> = reqs
            .into_iter()
            .map(|mut req| {
                let (start, done) = (&start, &done);
                s.spawn(move || -> Result<(), String> {
                    pin(AGENT_CORE).map_err(|e| e.to_string())?;
                    let mut result = Ok(());
                    for _ in 0..=BULK_ITERS {
                        start.wait();
                        if result.is_ok() {
                            result = post_wait(&mut req, Poll::Wait).map_err(|e| e.to_string());
                        }
                        done.wait();
                    }
                    result
                })
            })
            .collect();
        // One untimed iteration so that every thread has started, then the timed ones.
        for i in 0..=BULK_ITERS {
            if i == 1 {
                (cpu0, t0) = (cpu_seconds(), Instant::now());
            }
            start.wait();
            post_wait(&mut mine, Poll::Wait)?;
            done.wait();
        }
        for helper in helpers {
            helper.join().map_err(|_| "helper thread panicked")??;
        }
        Ok(())
    })?;
    let (elapsed, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    let gb = (BULK * BULK_ITERS) as f64 / 1e9;
    Ok((gb / elapsed, cpu / gb))
}

/// W2: READ 1024 of 8192 blocks of 32 KiB per iteration, each request posted and waited for
/// by `how` on `rt`; returns (req/s, GB/s, CPU s/GB).
fn kv(
    pair: &Pair,
    perm: &[usize],
    prepared: bool,
    seed: u64,
    rt: &tokio::runtime::Runtime,
    how: Completer,
) -> Res<(f64, f64, f64)> {
    let [a_kv, b_kv] = pair.kv.as_ref().ok_or("pair built without the KV cache")?;
    let chunks = KV_BLOCKS / KV_READ;
    let blocks = |c: usize| &perm[c * KV_READ..(c + 1) * KV_READ];
    let picks = |i: usize| (blocks((i + chunks / 2) % chunks), blocks(i % chunks));
    let opts = XferOptions::new();
    let b_desc = |block: usize| remote(b_kv, block * KV_BLOCK, KV_BLOCK);
    let lists = if prepared {
        let mut local = LocalDescList::with_capacity(MemType::Dram, KV_BLOCKS)?;
        local.push_blocks(a_kv, 0, KV_BLOCK, 0..KV_BLOCKS)?;
        let all: Vec<XferDesc> = (0..KV_BLOCKS).map(b_desc).collect();
        let remote_list = RemoteDescList::from_descs(MemType::Dram, &all)?;
        Some((
            pair.a.prepare_local(&local, &[])?,
            pair.a.prepare_remote("B", &remote_list, &[])?,
        ))
    } else {
        None
    };
    let one = |i: usize| -> Res<()> {
        let (local_idx, remote_idx) = picks(i);
        let req = match &lists {
            Some((pl, pr)) => {
                pair.a
                    .make_xfer_req(XferOp::Read, pl, local_idx, pr, remote_idx, &opts)?
            }
            None => {
                let mut local = LocalDescList::with_capacity(MemType::Dram, KV_READ)?;
                local.push_blocks(a_kv, 0, KV_BLOCK, local_idx.iter().copied())?;
                let descs: Vec<XferDesc> = remote_idx.iter().map(|&b| b_desc(b)).collect();
                let remote_list = RemoteDescList::from_descs(MemType::Dram, &descs)?;
                pair.a
                    .create_xfer_req(XferOp::Read, &local, &remote_list, "B", &opts)?
            }
        };
        rt.block_on(how.post_and_complete(req)).map(drop)
    };
    b_kv.write(0, 0, &pattern(KV_BLOCKS * KV_BLOCK, seed))?;
    a_kv.write(0, 0, &vec![0u8; KV_BLOCKS * KV_BLOCK])?;
    one(0)?;
    let (a_bytes, b_bytes) = (contents(a_kv)?, contents(b_kv)?);
    let (local_idx, remote_idx) = picks(0);
    let block = |bytes: &[u8], b: usize| bytes[b * KV_BLOCK..(b + 1) * KV_BLOCK].to_vec();
    check(
        local_idx
            .iter()
            .zip(remote_idx)
            .all(|(&l, &r)| block(&a_bytes, l) == block(&b_bytes, r)),
        "kv READ",
    )?;
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    for i in 0..KV_ITERS {
        one(i)?;
    }
    let (elapsed, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    let gb = (KV_ITERS * KV_READ * KV_BLOCK) as f64 / 1e9;
    Ok((KV_ITERS as f64 / elapsed, gb / elapsed, cpu / gb))
}

/// W3: create, post, wait and release one 4 KiB WRITE; microseconds per iteration.
fn small(pair: &Pair, poll: Poll, seed: u64) -> Res<f64> {
    let mut local = LocalDescList::new(MemType::Dram)?;
    local.push_region(&pair.a_small, 0)?;
    let remote_list =
        RemoteDescList::from_descs(MemType::Dram, &[remote(&pair.b_small, 0, SMALL)])?;
    let opts = XferOptions::new();
    let one = || -> Res<()> {
        let mut req = pair
            .a
            .create_xfer_req(XferOp::Write, &local, &remote_list, "B", &opts)?;
        post_wait(&mut req, poll)
    };
    pair.a_small.write(0, 0, &pattern(SMALL, seed))?;
    pair.b_small.write(0, 0, &[0u8; SMALL])?;
    one()?;
    check(
        contents(&pair.a_small)? == contents(&pair.b_small)?,
        "small WRITE",
    )?;
    let t0 = Instant::now();
    for _ in 0..SMALL_ITERS {
        one()?;
    }
    Ok(t0.elapsed().as_secs_f64() / SMALL_ITERS as f64 * 1e6)
}

/// W3's floors: the same 4 KiB WRITE with the request made once and reposted (post and wait
/// only), and with a request made from prepared one-descriptor lists each iteration.
/// Microseconds per iteration: (repost, prepared).
fn small_floors(pair: &Pair) -> Res<(f64, f64)> {
    let mut local = LocalDescList::new(MemType::Dram)?;
    local.push_region(&pair.a_small, 0)?;
    let remote_list =
        RemoteDescList::from_descs(MemType::Dram, &[remote(&pair.b_small, 0, SMALL)])?;
    let opts = XferOptions::new();
    let mut req = pair
        .a
        .create_xfer_req(XferOp::Write, &local, &remote_list, "B", &opts)?;
    post_wait(&mut req, Poll::Wait)?;
    let t0 = Instant::now();
    for _ in 0..SMALL_ITERS {
        post_wait(&mut req, Poll::Wait)?;
    }
    let repost = t0.elapsed().as_secs_f64() / SMALL_ITERS as f64 * 1e6;
    drop(req);
    let pl = pair.a.prepare_local(&local, &[])?;
    let pr = pair.a.prepare_remote("B", &remote_list, &[])?;
    let t0 = Instant::now();
    for _ in 0..SMALL_ITERS {
        let mut req = pair
            .a
            .make_xfer_req(XferOp::Write, &pl, &[0], &pr, &[0], &opts)?;
        post_wait(&mut req, Poll::Wait)?;
    }
    let prepared = t0.elapsed().as_secs_f64() / SMALL_ITERS as f64 * 1e6;
    Ok((repost, prepared))
}

/// W4 with the crate's default agents (`pair`), with lists made once and refilled, and its
/// floors through the bare C calls: the lists alone, and the whole of W4 ([`raw_w4`]).
fn w4(out: &mut Output, pair: &Pair) -> Res<()> {
    let [total, local, remote_ms, create, cpu] = build(pair)?;
    for (metric, value) in [
        ("ms", total),
        ("local_ms", local),
        ("remote_ms", remote_ms),
        ("create_ms", create),
        ("cpu_ms", cpu),
    ] {
        out.emit("rust", "default", "w4_build", metric, value);
    }
    let [total, local, remote_ms, create, cpu] = build_reused(pair)?;
    for (metric, value) in [
        ("ms", total),
        ("local_ms", local),
        ("remote_ms", remote_ms),
        ("create_ms", create),
        ("cpu_ms", cpu),
    ] {
        out.emit("rust", "reused lists", "w4_build", metric, value);
    }
    let base = pair.b_build.regions()[0].addr;
    for (reserve, config) in [(false, "raw C API floor"), (true, "raw C API + reserve")] {
        let ms = median_of(BUILD_REPS, || raw_list_floor(base, reserve))?;
        out.emit("rust", config, "w4_build", "local_ms", ms);
    }
    let [total, lists, create, cpu] = raw_w4::floor()?;
    out.emit("rust", "raw C API W4", "w4_build", "ms", total);
    out.emit("rust", "raw C API W4", "w4_build", "lists_ms", lists);
    out.emit("rust", "raw C API W4", "w4_build", "create_ms", create);
    out.emit("rust", "raw C API W4", "w4_build", "cpu_ms", cpu);
    Ok(())
}

/// W4: local and remote lists of 100,000 descriptors of 64 B and a request (not posted).
/// Returns the median run's (total, local list, remote list, create) in milliseconds, and
/// the CPU time the measuring thread spent on the whole (insensitive to other processes on
/// a shared machine: NIXL builds the lists and the request in the calling thread).
fn build(pair: &Pair) -> Res<[f64; 5]> {
    let mut runs = Vec::with_capacity(BUILD_REPS);
    for _ in 0..BUILD_REPS {
        let cpu0 = thread_cpu_ms();
        let t0 = Instant::now();
        let mut local = LocalDescList::with_capacity(MemType::Dram, BUILD_DESCS)?;
        for i in 0..BUILD_DESCS {
            local.push(&pair.a_build, 0, i * BUILD_STRIDE, BUILD_DESC)?;
        }
        let t1 = Instant::now();
        let descs: Vec<XferDesc> = (0..BUILD_DESCS)
            .map(|i| remote(&pair.b_build, i * BUILD_STRIDE, BUILD_DESC))
            .collect();
        let remote_list = RemoteDescList::from_vec(MemType::Dram, descs)?;
        let t2 = Instant::now();
        let req = pair.a.create_xfer_req(
            XferOp::Write,
            &local,
            &remote_list,
            "B",
            &XferOptions::new(),
        )?;
        let t3 = Instant::now();
        let cpu = thread_cpu_ms() - cpu0;
        drop(req);
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        runs.push([ms(t0, t3), ms(t0, t1), ms(t1, t2), ms(t2, t3), cpu]);
    }
    runs.sort_by(|x, y| x[0].total_cmp(&y[0]));
    Ok(runs[runs.len() / 2])
}

/// W4 with the lists made once and refilled each run (`clear`, then the same pushes): the
/// crate's cheapest correct way to build large lists again and again, since a cleared list
/// keeps its storage on both sides (no allocation, no page touched for the first time).
/// Returns what [`build`] returns.
fn build_reused(pair: &Pair) -> Res<[f64; 5]> {
    let mut local = LocalDescList::with_capacity(MemType::Dram, BUILD_DESCS)?;
    let mut remote_list = RemoteDescList::from_vec(MemType::Dram, Vec::with_capacity(BUILD_DESCS))?;
    let mut runs = Vec::with_capacity(BUILD_REPS);
    for _ in 0..=BUILD_REPS {
        let cpu0 = thread_cpu_ms();
        let t0 = Instant::now();
        local.clear()?;
        for i in 0..BUILD_DESCS {
            local.push(&pair.a_build, 0, i * BUILD_STRIDE, BUILD_DESC)?;
        }
        let t1 = Instant::now();
        remote_list.clear()?;
        for i in 0..BUILD_DESCS {
            remote_list.push(remote(&pair.b_build, i * BUILD_STRIDE, BUILD_DESC))?;
        }
        let t2 = Instant::now();
        let req = pair.a.create_xfer_req(
            XferOp::Write,
            &local,
            &remote_list,
            "B",
            &XferOptions::new(),
        )?;
        let t3 = Instant::now();
        let cpu = thread_cpu_ms() - cpu0;
        drop(req);
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        runs.push([ms(t0, t3), ms(t0, t1), ms(t1, t2), ms(t2, t3), cpu]);
    }
    // The first run touched the storage for the first time.
    runs.remove(0);
    runs.sort_by(|x, y| x[0].total_cmp(&y[0]));
    Ok(runs[runs.len() / 2])
}

/// CPU time of the calling thread, in milliseconds.
fn thread_cpu_ms() -> f64 {
    // SAFETY: timespec is plain data, valid when zeroed.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid clock id and out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 * 1e3 + t.tv_nsec as f64 * 1e-6
}

/// Percent of a core one idle agent with a UCX backend burns.
fn idle(config: &AgentConfig, window: Duration) -> Res<f64> {
    pin(AGENT_CORE)?;
    let agent = Agent::builder("idle").config(config.clone()).build()?;
    let _ucx = agent.create_backend("UCX")?;
    pin(MEASURE_CORE)?;
    std::thread::sleep(Duration::from_millis(100));
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    std::thread::sleep(window);
    Ok((cpu_seconds() - cpu0) / t0.elapsed().as_secs_f64() * 100.0)
}

/// Single-thread memcpy between two huge-page-backed buffers; GB/s.
fn memcpy(src: &HostBuffer, dst: &mut HostBuffer, size: usize, iters: usize) -> f64 {
    dst[..size].copy_from_slice(&src[..size]);
    let t0 = Instant::now();
    for _ in 0..iters {
        dst[..size].copy_from_slice(std::hint::black_box(&src[..size]));
        std::hint::black_box(&mut dst[..size]);
    }
    (size * iters) as f64 / 1e9 / t0.elapsed().as_secs_f64()
}

/// The floor of W4's list building through NIXL's C API, which adds one descriptor per call:
/// a C list and 100,000 `nixl_capi_xfer_dlist_add_desc` calls, no checks. With `reserve`, the
/// list's storage is reserved first (`nixl_capi_xfer_dlist_resize` to the final size, then
/// `clear`, which keeps the capacity). Milliseconds.
fn raw_list_floor(base: usize, reserve: bool) -> Res<f64> {
    use nixl_capi_sys::nixl_capi_status_t::NIXL_CAPI_SUCCESS as OK;
    let capi = raw_capi()?;
    let t0 = Instant::now();
    let mut list = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    let status = unsafe {
        capi.nixl_capi_create_xfer_dlist(
            nixl_capi_sys::nixl_capi_mem_type_t::NIXL_CAPI_MEM_DRAM,
            &mut list,
        )
    };
    if status != OK {
        return Err("create raw descriptor list".into());
    }
    let mut ok = true;
    if reserve {
        // SAFETY: live list created above.
        ok &= unsafe { capi.nixl_capi_xfer_dlist_resize(list, BUILD_DESCS) } == OK;
        // SAFETY: as above.
        ok &= unsafe { capi.nixl_capi_xfer_dlist_clear(list) } == OK;
    }
    for i in 0..BUILD_DESCS {
        // SAFETY: live list created above; NIXL only copies the numbers.
        ok &= unsafe {
            capi.nixl_capi_xfer_dlist_add_desc(list, base + i * BUILD_STRIDE, BUILD_DESC, 0)
        } == OK;
    }
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    // SAFETY: created above, destroyed once, not used again.
    unsafe { capi.nixl_capi_destroy_xfer_dlist(list) };
    if ok {
        Ok(ms)
    } else {
        Err("raw descriptor list calls failed".into())
    }
}

/// NIXL's C API, opened from the library the `nixl` crate loaded (the same one, already
/// in the process).
fn raw_capi() -> Res<&'static nixl_capi_sys::NixlCapi> {
    static CAPI: std::sync::OnceLock<nixl_capi_sys::NixlCapi> = std::sync::OnceLock::new();
    if let Some(capi) = CAPI.get() {
        return Ok(capi);
    }
    let path = nixl::load_library()?.path();
    // SAFETY: the library nixl loaded and checked, opened again (the loader shares it).
    let capi = unsafe { nixl_capi_sys::NixlCapi::new(path) }?;
    Ok(CAPI.get_or_init(|| capi))
}

/// Median of `reps` runs of `f`.
fn median_of(reps: usize, mut f: impl FnMut() -> Res<f64>) -> Res<f64> {
    let mut runs = (0..reps).map(|_| f()).collect::<Res<Vec<f64>>>()?;
    runs.sort_by(f64::total_cmp);
    Ok(runs[runs.len() / 2])
}

/// Two threads (cores 0 and 1) each copying one half of `size` bytes, `iters` times in step:
/// the ceiling of any split of W1 into two parallel copies on this machine. GB/s.
fn memcpy2(src: &HostBuffer, dst: &mut HostBuffer, size: usize, iters: usize) -> Res<f64> {
    let half = size / 2;
    let (src0, src1) = src[..size].split_at(half);
    let (dst0, dst1) = dst[..size].split_at_mut(half);
    let (start, done) = (Barrier::new(2), Barrier::new(2));
    let mut t0 = Instant::now();
    std::thread::scope(|s| -> Res<()> {
        let helper = s.spawn(|| -> Result<(), String> {
            pin(AGENT_CORE).map_err(|e| e.to_string())?;
            for _ in 0..=iters {
                start.wait();
                dst1.copy_from_slice(std::hint::black_box(src1));
                done.wait();
            }
            Ok(())
        });
        for i in 0..=iters {
            if i == 1 {
                t0 = Instant::now();
            }
            start.wait();
            dst0.copy_from_slice(std::hint::black_box(src0));
            done.wait();
        }
        helper.join().map_err(|_| "memcpy helper panicked")??;
        Ok(())
    })?;
    Ok((size * iters) as f64 / 1e9 / t0.elapsed().as_secs_f64())
}

fn sweep_iters(size: usize) -> usize {
    (256 * MIB / size).clamp(BULK_ITERS, SMALL_ITERS)
}

/// W1 WRITE and READ on `pair`, recorded under config `name`: GB/s and CPU s/GB.
fn w1(out: &mut Output, pair: &Pair, name: &str, round: u64) -> Res<()> {
    for (op, w, seed) in [(XferOp::Write, "w1_write", 5), (XferOp::Read, "w1_read", 6)] {
        let (gbps, cpu) = bulk(pair, op, BULK, BULK_ITERS, Poll::Wait, seed + round)?;
        out.emit("rust", name, w, "gbps", gbps);
        out.emit("rust", name, w, "cpu_s_per_gb", cpu);
    }
    Ok(())
}

/// W2 with fresh and with prepared lists on `pair` (which must hold the KV cache), recorded
/// under config `name`: requests/s, GB/s and CPU s/GB.
fn w2(out: &mut Output, pair: &Pair, name: &str, round: u64) -> Res<()> {
    let perm = permutation(KV_BLOCKS, 42);
    let rt = awaiting::runtime()?;
    for (prepared, w) in [(false, "w2_fresh"), (true, "w2_prepared")] {
        let (rps, gbps, cpu) = kv(pair, &perm, prepared, 7 + round, &rt, Completer::Blocking)?;
        out.emit("rust", name, w, "req_per_s", rps);
        out.emit("rust", name, w, "gbps", gbps);
        out.emit("rust", name, w, "cpu_s_per_gb", cpu);
    }
    Ok(())
}

fn run_round(out: &mut Output) -> Res<()> {
    let round = u64::from(out.round);
    let default = AgentConfig::default();
    let mut no_thread = AgentConfig::default();
    no_thread.progress_thread = false;
    let mut delay0 = AgentConfig::default();
    delay0.progress_delay = Duration::ZERO;
    let mut sync_none = AgentConfig::default();
    sync_none.thread_sync = ThreadSync::None;
    let mut python_like = sync_none.clone();
    python_like.progress_delay = Duration::ZERO;

    out.emit("rust", "default", "idle", "core_pct", idle(&default, IDLE)?);
    out.emit("rust", "delay0", "idle", "core_pct", idle(&delay0, IDLE)?);
    awaiting::record(out, round)?;
    concurrent::record(out, round)?;

    pin(MEASURE_CORE)?;
    let mut src = HostBuffer::zeroed(BULK)?;
    src.copy_from_slice(&pattern(BULK, round));
    let mut dst = HostBuffer::zeroed(BULK)?;
    for size in SWEEP {
        let gbps = memcpy(&src, &mut dst, size, sweep_iters(size));
        out.emit("memcpy", "1 thread", &format!("sweep_{size}"), "gbps", gbps);
    }
    let gbps = memcpy(&src, &mut dst, BULK, BULK_ITERS);
    out.emit("memcpy", "1 thread", "w1_write", "gbps", gbps);
    let gbps = memcpy2(&src, &mut dst, BULK, BULK_ITERS)?;
    out.emit("memcpy", "2 threads", "w1_write", "gbps", gbps);
    drop((src, dst));

    // The crate's default configuration on both agents, then the initiator A without a
    // progress thread (B, the target, keeps the default one: a WRITE needs B progressed).
    for (a_config, name) in [(&default, "default"), (&no_thread, "a-no-thread")] {
        let pair = Pair::with(a_config, &default, true)?;
        let split = if name == "default" {
            "split2".to_string()
        } else {
            format!("{name}+split2")
        };
        if name == "default" {
            for size in SWEEP {
                let (gbps, _) = bulk(
                    &pair,
                    XferOp::Write,
                    size,
                    sweep_iters(size),
                    Poll::Wait,
                    3 + round,
                )?;
                out.emit("rust", name, &format!("sweep_{size}"), "gbps", gbps);
            }
        }
        for (op, w, seed) in [(XferOp::Write, "w1_write", 5), (XferOp::Read, "w1_read", 6)] {
            let (gbps, cpu) = bulk(&pair, op, BULK, BULK_ITERS, Poll::Wait, seed + round)?;
            out.emit("rust", name, w, "gbps", gbps);
            out.emit("rust", name, w, "cpu_s_per_gb", cpu);
            let (gbps, cpu) = bulk_split(&pair, op, 2, seed + round)?;
            out.emit("rust", &split, w, "gbps", gbps);
            out.emit("rust", &split, w, "cpu_s_per_gb", cpu);
        }
        w2(out, &pair, name, round)?;
        out.emit(
            "rust",
            name,
            "w3_small",
            "us_per_iter",
            small(&pair, Poll::Wait, 11 + round)?,
        );
        if name == "default" {
            let (gbps, _) = bulk(
                &pair,
                XferOp::Write,
                BULK,
                BULK_ITERS,
                Poll::Spin,
                5 + round,
            )?;
            out.emit("rust", "spin-poll", "w1_write", "gbps", gbps);
            let us = small(&pair, Poll::Spin, 11 + round)?;
            out.emit("rust", "spin-poll", "w3_small", "us_per_iter", us);
            let (repost, prepared) = small_floors(&pair)?;
            out.emit("rust", "repost only", "w3_small", "us_per_iter", repost);
            out.emit(
                "rust",
                "prepared 1-desc",
                "w3_small",
                "us_per_iter",
                prepared,
            );
            w4(out, &pair)?;
        }
    }

    // NIXL's locking off (the Python API's default), with the crate's 1 ms progress delay
    // and with the Python API's zero delay (its whole default configuration).
    for (config, name) in [
        (&sync_none, "sync-none"),
        (&python_like, "sync-none+delay0"),
    ] {
        let pair = Pair::new(config, false)?;
        w1(out, &pair, name, round)?;
        let us = small(&pair, Poll::Wait, 11 + round)?;
        out.emit("rust", name, "w3_small", "us_per_iter", us);
    }

    // UCX's multi-threaded mode (2 worker threads, batches split down to one descriptor) with
    // W1 cut into 2 and 4 unmerged descriptors, against the same cuts with the crate's default
    // UCX backend (no worker threads).
    // Agents created while allowed on both cores, so that the workers may run on either.
    let mt = [("num_threads", "2"), ("split_batch_size", "1")];
    for (ucx, prefix) in [(&mt[..], "ucx-mt2+"), (&[][..], "")] {
        let pair = Pair::with_ucx(&default, &default, false, ucx, &[MEASURE_CORE, AGENT_CORE])?;
        for descs in [2, 4] {
            let name = format!("{prefix}{descs}desc");
            for (op, w, seed) in [(XferOp::Write, "w1_write", 5), (XferOp::Read, "w1_read", 6)] {
                let (gbps, cpu) =
                    bulk_descs(&pair, op, BULK, descs, BULK_ITERS, Poll::Wait, seed + round)?;
                out.emit("rust", &name, w, "gbps", gbps);
                out.emit("rust", &name, w, "cpu_s_per_gb", cpu);
            }
        }
    }

    // Two UCX worker threads splitting requests of 2+ descriptors (with W1's 64 MiB cut in two
    // by create_xfer_req), in the common pinned setup: the crate's default before this run's
    // measurements made it the plugin's own (no threads).
    let threads = [("num_threads", "2"), ("split_batch_size", "2")];
    let pair = Pair::with_ucx(&default, &default, true, &threads, &[AGENT_CORE])?;
    w1(out, &pair, "ucx-threads2", round)?;
    w2(out, &pair, "ucx-threads2", round)?;
    let us = small(&pair, Poll::Wait, 11 + round)?;
    out.emit("rust", "ucx-threads2", "w3_small", "us_per_iter", us);
    drop(pair);

    // NIXL Python's progress-thread setting (zero delay) on both agents.
    let pair = Pair::new(&delay0, false)?;
    let (gbps, cpu) = bulk(
        &pair,
        XferOp::Write,
        BULK,
        BULK_ITERS,
        Poll::Wait,
        5 + round,
    )?;
    out.emit("rust", "delay0", "w1_write", "gbps", gbps);
    out.emit("rust", "delay0", "w1_write", "cpu_s_per_gb", cpu);
    out.emit(
        "rust",
        "delay0",
        "w3_small",
        "us_per_iter",
        small(&pair, Poll::Wait, 11 + round)?,
    );
    Ok(())
}

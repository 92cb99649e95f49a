//! Many tasks awaiting transfers on a multi-thread tokio runtime against the same transfers
//! one after another with the blocking API: [`REQUESTS`] requests of one 16 KiB READ each,
//! every byte checked, in one process (agents A and B) and across processes (B in a child
//! process of this binary, `transfer concurrent-peer`, over UCX on loopback), at 1, 2 and 4
//! tokio workers.
//!
//! Concurrent: a task per request posts it, awaits it (`req.post()?; req.await?` when the
//! post left it in progress) and checks its bytes. Sequential: the measuring thread posts each
//! request, `wait`s for it and checks its bytes. Both run on A's UCX backend as the crate
//! makes it (UCX's worker lock a mutex, see `nixl::Agent::create_backend`) and, as the
//! baseline, on a second A whose backend asks for UCX's default spinlock
//! (`engine_config=USE_MT_MUTEX=n`), and on a third A whose backend has two UCX workers
//! (`num_workers=2`, which the safe API refuses: made with `create_backend_with_unchecked`),
//! request `i` bound to worker `i % 2` (`worker_id=` in its custom parameter), to see whether
//! copies on different workers overlap. The six runs alternate [`REPS`] times per worker count.
//! Records the milliseconds of a batch, the ratio concurrent/sequential of each repetition
//! (the report takes medians) and the CPU seconds per GB of each.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use nixl::{
    Agent, HostBuffer, LocalDescList, MemType, Registration, RemoteDescList, XferDesc, XferOp,
    XferOptions, XferRequest, XferStatus,
};

use super::{cpu_seconds, pattern, pin_to, Output, Res, WAIT};

/// Requests (and tasks) per batch.
pub const REQUESTS: usize = 1000;
/// Bytes each request reads.
const BLOCK: usize = 16 << 10;
/// Bytes of the awaited round trip.
const SMALL: usize = 4 << 10;
/// Awaited round trips per lock and repetition.
const RT_ITERS: usize = 2000;
/// The tokio worker counts measured.
const WORKERS: [usize; 3] = [1, 2, 4];
/// Repetitions per worker count and round, the runs alternating.
const REPS: usize = 7;
/// The cores every thread of this workload may run on.
const CORES: [usize; 2] = [0, 1];

/// How A's UCX backend is set up: its worker lock, and how many workers it has.
#[derive(Clone, Copy, PartialEq)]
enum Lock {
    /// The crate's default: a mutex.
    Mutex,
    /// UCX's own default, the baseline: a spinlock.
    Spin,
    /// The mutex, with two UCX workers (`num_workers=2`), request `i` on worker `i % 2`.
    Workers2,
}

impl Lock {
    const ALL: [Lock; 3] = [Lock::Mutex, Lock::Spin, Lock::Workers2];

    /// Its name in the records' configuration.
    fn name(self) -> &'static str {
        match self {
            Lock::Mutex => "mutex",
            Lock::Spin => "spinlock",
            Lock::Workers2 => "workers2",
        }
    }

    /// The backend parameters that choose it.
    fn params(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Lock::Mutex => Vec::new(),
            Lock::Spin => vec![("engine_config", "USE_MT_MUTEX=n")],
            Lock::Workers2 => vec![("num_workers", "2")],
        }
    }

    /// The UCX workers of its backend.
    fn workers(self) -> usize {
        match self {
            Lock::Workers2 => 2,
            Lock::Mutex | Lock::Spin => 1,
        }
    }
}

/// The initiator's side of one setup: its requests and where they land.
struct Side {
    dst: Arc<Registration>,
    reqs: Vec<XferRequest>,
    /// A READ of the first 4 KiB, for the awaited round trip.
    small: Option<XferRequest>,
    /// One READ of every block, a descriptor each (unmerged), for `concurrent-profile`.
    whole: Option<XferRequest>,
    /// What the source holds.
    expected: Arc<Vec<u8>>,
}

/// Records every figure of this workload for one round.
pub fn record(out: &mut Output, round: u64) -> Res<()> {
    pin_to(&CORES)?;
    let seed = 0xC0C0 + round;
    // B (the source, which a READ does not need to progress) keeps the crate's defaults.
    let b = Agent::new("CB")?;
    let ucx_b = b.create_backend("UCX")?;
    let src = b.register_memory(HostBuffer::zeroed(REQUESTS * BLOCK)?, &[&ucx_b])?;
    src.write(0, 0, &pattern(REQUESTS * BLOCK, seed))?;
    let b_meta = b.local_metadata()?;
    let mut in_process = Lock::ALL
        .into_iter()
        .map(|lock| side(lock, &b_meta, src.regions()[0].addr, seed))
        .collect::<Res<Vec<Side>>>()?;
    round_trips(out, &mut in_process)?;
    measure(out, "in-process", in_process)?;
    let (_peer, addr, metadata) = Peer::start(seed)?;
    let cross = Lock::ALL
        .into_iter()
        .map(|lock| side(lock, &metadata, addr, seed))
        .collect::<Res<Vec<Side>>>()?;
    measure(out, "cross-process", cross)
}

/// An initiator A with `lock`, its requests reading every block of B's buffer at `src_addr`
/// (B's metadata `b_meta`, filled with the pattern of `seed`).
fn side(lock: Lock, b_meta: &[u8], src_addr: usize, seed: u64) -> Res<Side> {
    let a = Agent::new(&format!("CA-{}", lock.name()))?;
    let ucx = if lock.workers() > 1 {
        // SAFETY: no worker threads (`num_threads` stays 0); the further worker's listener
        // is reachable only from this benchmark's own agents, whose metadata it trusts.
        unsafe { a.create_backend_with_unchecked("UCX", lock.params())? }
    } else {
        a.create_backend_with("UCX", lock.params())?
    };
    let dst = a.register_memory(HostBuffer::zeroed(REQUESTS * BLOCK)?, &[&ucx])?;
    let peer = a.load_remote_metadata(b_meta)?;
    let read = |offset: usize, len: usize, worker: usize| -> Res<XferRequest> {
        let mut local = LocalDescList::with_capacity(MemType::Dram, 1)?;
        local.push(&dst, 0, offset, len)?;
        let remote =
            RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(src_addr + offset, len, 0)])?;
        let options = if lock.workers() > 1 {
            XferOptions::new().custom_param(format!("worker_id={worker}"))
        } else {
            XferOptions::new()
        };
        Ok(a.create_xfer_req(XferOp::Read, &local, &remote, &peer, &options)?)
    };
    let reqs = (0..REQUESTS)
        .map(|i| read(i * BLOCK, BLOCK, i % lock.workers()))
        .collect::<Res<Vec<XferRequest>>>()?;
    let small = Some(read(0, SMALL, 0)?);
    let mut local = LocalDescList::with_capacity(MemType::Dram, REQUESTS)?;
    let mut descs = Vec::with_capacity(REQUESTS);
    for i in 0..REQUESTS {
        local.push(&dst, 0, i * BLOCK, BLOCK)?;
        descs.push(XferDesc::new(src_addr + i * BLOCK, BLOCK, 0));
    }
    let remote = RemoteDescList::from_descs(MemType::Dram, &descs)?;
    let mut options = XferOptions::new().skip_desc_merge(true);
    if lock.workers() > 1 {
        options = options.custom_param("worker_id=0");
    }
    let whole = Some(a.create_xfer_req(XferOp::Read, &local, &remote, &peer, &options)?);
    Ok(Side {
        dst: Arc::new(dst),
        reqs,
        small,
        whole,
        expected: Arc::new(pattern(REQUESTS * BLOCK, seed)),
    })
}

/// The awaited 4 KiB READ round trip (`post`, then `.await` if in progress) on a
/// current-thread runtime, each lock's in turn, [`REPS`] times; records the mean µs of each
/// lock and the ratio mutex/spinlock of the repetitions' means.
fn round_trips(out: &mut Output, sides: &mut [Side]) -> Res<()> {
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    let mut us = vec![Vec::new(); sides.len()];
    for rep in 0..=REPS {
        for (l, side) in sides.iter_mut().enumerate() {
            let mut req = side.small.take().ok_or("round-trip request lost")?;
            let t0 = Instant::now();
            req = rt.block_on(async move {
                for _ in 0..RT_ITERS {
                    if req.post()? == XferStatus::InProgress {
                        req = req.await?;
                    }
                }
                Ok::<_, nixl::Error>(req)
            })?;
            side.small = Some(req);
            if rep > 0 {
                us[l].push(t0.elapsed().as_secs_f64() * 1e6 / RT_ITERS as f64);
            }
        }
    }
    for (l, lock) in Lock::ALL.into_iter().enumerate() {
        out.emit(
            "rust",
            lock.name(),
            "rt_4k_read_await",
            "us_per_iter",
            median(&us[l]),
        );
    }
    let ratios: Vec<f64> = us[0].iter().zip(&us[1]).map(|(m, s)| m / s).collect();
    out.emit(
        "rust",
        "mutex",
        "rt_4k_read_await",
        "ratio",
        median(&ratios),
    );
    Ok(())
}

/// Checks block `i` of `dst` against the pattern.
fn check_block(dst: &Registration, expected: &[u8], i: usize) -> Result<(), String> {
    let mut got = vec![0u8; BLOCK];
    dst.read(0, i * BLOCK, &mut got)
        .map_err(|e| e.to_string())?;
    if got != expected[i * BLOCK..(i + 1) * BLOCK] {
        return Err(format!("block {i}: bytes wrong after the READ"));
    }
    Ok(())
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// Measures sequential and concurrent batches on each of `sides` (one per [`Lock`]) at
/// every worker count, alternating.
fn measure(out: &mut Output, setup: &str, mut sides: Vec<Side>) -> Res<()> {
    let gb = (REQUESTS * BLOCK) as f64 / 1e9;
    for workers in WORKERS {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .build()?;
        // [lock][concurrent] -> per-repetition ms and CPU s/GB.
        let mut ms = vec![[Vec::new(), Vec::new()]; sides.len()];
        let mut cpu = vec![[Vec::new(), Vec::new()]; sides.len()];
        // One untimed repetition first (pages touched, runtime threads started).
        for rep in 0..=REPS {
            for (l, side) in sides.iter_mut().enumerate() {
                for concurrent in [false, true] {
                    side.dst.write(0, 0, &vec![0u8; REQUESTS * BLOCK])?;
                    let (cpu0, t0) = (cpu_seconds(), Instant::now());
                    side.reqs = run(&rt, concurrent, side)?;
                    let (elapsed, used) = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
                    if rep > 0 {
                        ms[l][usize::from(concurrent)].push(elapsed * 1e3);
                        cpu[l][usize::from(concurrent)].push(used / gb);
                    }
                }
            }
        }
        let workload = format!("conc_16k_w{workers}");
        for (l, lock) in Lock::ALL.into_iter().enumerate() {
            for (c, how) in ["sequential", "concurrent"].into_iter().enumerate() {
                let config = format!("{setup} {} {how}", lock.name());
                out.emit("rust", &config, &workload, "ms", median(&ms[l][c]));
                out.emit(
                    "rust",
                    &config,
                    &workload,
                    "cpu_s_per_gb",
                    median(&cpu[l][c]),
                );
            }
            let ratios: Vec<f64> = ms[l][1].iter().zip(&ms[l][0]).map(|(c, s)| c / s).collect();
            let config = format!("{setup} {} concurrent", lock.name());
            out.emit("rust", &config, &workload, "ratio", median(&ratios));
        }
    }
    Ok(())
}

/// Runs the batch of `side`'s requests, one after another or a task each; gives the
/// requests back, done and checked.
fn run(rt: &tokio::runtime::Runtime, concurrent: bool, side: &mut Side) -> Res<Vec<XferRequest>> {
    let reqs = std::mem::take(&mut side.reqs);
    if !concurrent {
        let mut done = Vec::with_capacity(reqs.len());
        for (i, mut req) in reqs.into_iter().enumerate() {
            if req.post()? == XferStatus::InProgress {
                req.wait(WAIT)?;
            }
            check_block(&side.dst, &side.expected, i)?;
            done.push(req);
        }
        return Ok(done);
    }
    let (dst, expected) = (side.dst.clone(), side.expected.clone());
    // Spawned from a task of the runtime, as a server's request handlers would be.
    let batch = rt.spawn(async move {
        let tasks: Vec<_> = reqs
            .into_iter()
            .enumerate()
            .map(|(i, mut req)| {
                let (dst, expected) = (dst.clone(), expected.clone());
                tokio::spawn(async move {
                    if req.post().map_err(|e| e.to_string())? == XferStatus::InProgress {
                        req = req.await.map_err(|e| e.to_string())?;
                    }
                    check_block(&dst, &expected, i)?;
                    Ok::<_, String>(req)
                })
            })
            .collect();
        let mut done = Vec::with_capacity(tasks.len());
        for task in tasks {
            done.push(task.await.map_err(|e| e.to_string())??);
        }
        Ok::<_, String>(done)
    });
    Ok(rt.block_on(batch)??)
}

/// `transfer concurrent-profile LOCK WORKERS HOW BATCHES`: runs one variant alone (in-process,
/// `LOCK` one of mutex, spinlock, workers2; `HOW` sequential, concurrent, one-request: one
/// task posting one request of all the blocks, a descriptor each, and checking them, or
/// check-only: a task per block checking it, no transfer) for
/// `BATCHES` batches, for a profiler (`perf record`, `valgrind --tool=callgrind`) to look at.
pub fn profile(args: &[String]) -> Res<()> {
    let [lock, workers, how, batches] = args else {
        return Err("usage: transfer concurrent-profile LOCK WORKERS HOW BATCHES".into());
    };
    let lock = Lock::ALL
        .into_iter()
        .find(|l| l.name() == lock)
        .ok_or("LOCK: mutex, spinlock or workers2")?;
    let concurrent = match how.as_str() {
        "sequential" | "one-request" | "check-only" => false,
        "concurrent" => true,
        _ => return Err("HOW: sequential, concurrent, one-request or check-only".into()),
    };
    pin_to(&CORES)?;
    let seed = 0xC0C0;
    let b = Agent::new("CB")?;
    let ucx_b = b.create_backend("UCX")?;
    let src = b.register_memory(HostBuffer::zeroed(REQUESTS * BLOCK)?, &[&ucx_b])?;
    src.write(0, 0, &pattern(REQUESTS * BLOCK, seed))?;
    let mut side = side(lock, &b.local_metadata()?, src.regions()[0].addr, seed)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers.parse()?)
        .build()?;
    if how == "check-only" {
        // The blocks to check, read once.
        side.reqs = run(&rt, false, &mut side)?;
    }
    let (cpu0, sleeps0, t0) = (cpu_seconds(), sleeps(), Instant::now());
    let batches: usize = batches.parse()?;
    for _ in 0..batches {
        if how == "one-request" {
            side.whole = Some(run_whole(&rt, &mut side)?);
        } else if how == "check-only" {
            run_checks(&rt, &side)?;
        } else {
            side.reqs = run(&rt, concurrent, &mut side)?;
        }
    }
    let per = |total: f64| total * 1e6 / (batches * REQUESTS) as f64;
    eprintln!(
        "{} {how} at {workers} workers: {:.2} µs and {:.2} µs of CPU a request, {:.3} sleeps \
         (voluntary context switches of the process) a request",
        lock.name(),
        per(t0.elapsed().as_secs_f64()),
        per(cpu_seconds() - cpu0),
        per((sleeps() - sleeps0) as f64) / 1e6,
    );
    Ok(())
}

/// A task per block that only checks it (no transfer), spawned and awaited as by `run`.
fn run_checks(rt: &tokio::runtime::Runtime, side: &Side) -> Res<()> {
    let (dst, expected) = (side.dst.clone(), side.expected.clone());
    let batch = rt.spawn(async move {
        let tasks: Vec<_> = (0..REQUESTS)
            .map(|i| {
                let (dst, expected) = (dst.clone(), expected.clone());
                tokio::spawn(async move { check_block(&dst, &expected, i) })
            })
            .collect();
        for task in tasks {
            task.await.map_err(|e| e.to_string())??;
        }
        Ok::<_, String>(())
    });
    Ok(rt.block_on(batch)??)
}

/// One task posts one request of every block, awaits it and checks every block; gives the
/// request back, done.
fn run_whole(rt: &tokio::runtime::Runtime, side: &mut Side) -> Res<XferRequest> {
    let mut req = side.whole.take().ok_or("whole request lost")?;
    let (dst, expected) = (side.dst.clone(), side.expected.clone());
    let task = rt.spawn(async move {
        if req.post().map_err(|e| e.to_string())? == XferStatus::InProgress {
            req = req.await.map_err(|e| e.to_string())?;
        }
        for i in 0..REQUESTS {
            check_block(&dst, &expected, i)?;
        }
        Ok::<_, String>(req)
    });
    Ok(rt.block_on(task)??)
}

/// Voluntary context switches of the whole process so far: its threads going to sleep, e.g.
/// waiting for a lock another thread holds.
fn sleeps() -> i64 {
    // SAFETY: rusage is plain data, valid when zeroed.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_nvcsw
}

/// The child process holding agent B; it exits when its stdin closes (on drop).
struct Peer {
    child: Child,
}

impl Peer {
    /// Starts `transfer concurrent-peer SEED`; returns it, B's buffer address and metadata.
    fn start(seed: u64) -> Res<(Peer, usize, Vec<u8>)> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["concurrent-peer", &seed.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no peer stdout")?;
        let peer = Peer { child };
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let (addr, hex) = line
            .trim()
            .split_once(' ')
            .ok_or("the peer printed no address and metadata")?;
        Ok((peer, addr.parse()?, from_hex(hex)?))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// The child side: agent B with its buffer holding the pattern of `seed`; prints the buffer's
/// address and B's metadata (hex) on one line, then serves until stdin closes.
pub fn serve_peer(seed: &str) -> Res<()> {
    let seed: u64 = seed.parse()?;
    let b = Agent::new("CB")?;
    let ucx = b.create_backend("UCX")?;
    let src = b.register_memory(HostBuffer::zeroed(REQUESTS * BLOCK)?, &[&ucx])?;
    src.write(0, 0, &pattern(REQUESTS * BLOCK, seed))?;
    let hex: String = b
        .local_metadata()?
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{} {hex}", src.regions()[0].addr)?;
    stdout.flush()?;
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())?;
    Ok(())
}

fn from_hex(hex: &str) -> Res<Vec<u8>> {
    (0..hex.len())
        .step_by(2)
        .map(|i| Ok(u8::from_str_radix(hex.get(i..i + 2).ok_or("odd hex")?, 16)?))
        .collect()
}

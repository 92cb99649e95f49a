//! The crate's async completion side by side with its blocking `wait` and with a 5 ms
//! sleep-poll loop (how Dynamo's block manager awaits NIXL transfers), on one tokio
//! current-thread runtime driven by the measuring thread: the 4 KiB round trip (mean, p50,
//! p99), W2 with prepared lists (req/s, GB/s, CPU s/GB), and the CPU of idle agents whose
//! completion driver has been started, against the same agents before it was.
//!
//! Two setups. With the crate's default UCX backend, UCX copies within `post` (its CMA
//! transport) and nearly every post returns done, so no variant has anything to wait for.
//! With two UCX worker threads (`num_threads=2`, `split_batch_size=1`), requests of several
//! descriptors are copied by those threads after `post` returns, as a NIC would: the variants
//! really wait. Each variant records the share of its posts that returned in progress.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nixl::{AgentConfig, XferOp, XferRequest, XferStatus};
use tokio::runtime::Runtime;

use super::{
    bulk_check, bulk_request, cpu_seconds, kv, permutation, pin, pin_to, Output, Pair, Res,
    AGENT_CORE, BULK, IDLE, KV_BLOCKS, MEASURE_CORE, SMALL, WAIT,
};

/// The pause between status polls of the sleep-poll loop.
pub const SLEEP_POLL: Duration = Duration::from_millis(5);
/// Round trips per variant and round for `.await` and blocking `wait`.
const RT_ITERS: usize = 10_000;
/// Round trips per round for the sleep-poll loop (each may sleep 5 ms).
const RT_SLEEP_ITERS: usize = 500;
/// The variants alternate in this many chunks per round, so that drift hits all of them.
const RT_CHUNKS: usize = 5;
/// Awaited 64 MiB READs at most until one is still in flight when handed to the driver.
const DRIVER_START_TRIES: usize = 20;
/// W2 measurements per variant and round (alternating), of which the median is recorded.
const W2_REPS: usize = 3;

/// Posts made through [`Completer::post_and_complete`], and those that returned in progress.
static POSTS: AtomicU64 = AtomicU64::new(0);
static POSTS_IN_PROGRESS: AtomicU64 = AtomicU64::new(0);

/// Where the variants run.
pub struct Setup {
    /// Put before each variant's configuration name in the records.
    pub prefix: &'static str,
    /// What the report calls it.
    pub label: &'static str,
    /// The UCX backend's parameters.
    ucx: &'static [(&'static str, &'static str)],
    /// The cores the agents are created on (their threads inherit them).
    agent_cores: &'static [usize],
    /// The 4 KiB round trip's descriptors (unmerged).
    rt_descs: usize,
    /// Whether the idle driver is measured here (it needs a request still in flight after
    /// `post` to start).
    pub idle: bool,
}

pub const SETUPS: [Setup; 2] = [
    Setup {
        prefix: "",
        label: "UCX default (copies within post)",
        ucx: &[],
        agent_cores: &[AGENT_CORE],
        rt_descs: 1,
        idle: false,
    },
    Setup {
        prefix: "ucx-mt2 ",
        label: "UCX 2 worker threads (copy after post)",
        ucx: &[("num_threads", "2"), ("split_batch_size", "1")],
        agent_cores: &[MEASURE_CORE, AGENT_CORE],
        rt_descs: 2,
        idle: true,
    },
];

/// How a posted request is waited for.
#[derive(Clone, Copy, PartialEq)]
pub enum Completer {
    /// `req.post()?; let req = req.await?;`: the agent's completion driver polls it.
    Await,
    /// [`XferRequest::wait`] in the task's thread (the blocking API).
    Blocking,
    /// `status()`, then a [`SLEEP_POLL`] tokio sleep while in progress (Dynamo's pattern).
    SleepPoll,
}

impl Completer {
    pub const ALL: [Completer; 3] = [Completer::Await, Completer::Blocking, Completer::SleepPoll];

    /// The configuration name its records carry (after the setup's prefix).
    pub fn config(self) -> &'static str {
        match self {
            Completer::Await => "await",
            Completer::Blocking => "blocking",
            Completer::SleepPoll => "sleep-poll 5ms",
        }
    }

    /// Posts `req`, waits for it this way and gives it back done.
    pub async fn post_and_complete(self, mut req: XferRequest) -> Res<XferRequest> {
        let posted = req.post()?;
        POSTS.fetch_add(1, Ordering::Relaxed);
        if posted == XferStatus::Done {
            return Ok(req);
        }
        POSTS_IN_PROGRESS.fetch_add(1, Ordering::Relaxed);
        match self {
            Completer::Await => req = req.await?,
            Completer::Blocking => req.wait(WAIT)?,
            Completer::SleepPoll => {
                while req.status()? == XferStatus::InProgress {
                    tokio::time::sleep(SLEEP_POLL).await;
                }
            }
        }
        Ok(req)
    }
}

/// Counts the posts made from here on; [`PostCount::in_progress_pct`] reads the share.
struct PostCount(u64, u64);

impl PostCount {
    fn start() -> PostCount {
        PostCount(
            POSTS.load(Ordering::Relaxed),
            POSTS_IN_PROGRESS.load(Ordering::Relaxed),
        )
    }

    /// Percent of the posts since [`PostCount::start`] that returned in progress.
    fn in_progress_pct(&self) -> f64 {
        let posts = POSTS.load(Ordering::Relaxed) - self.0;
        let in_progress = POSTS_IN_PROGRESS.load(Ordering::Relaxed) - self.1;
        in_progress as f64 / posts.max(1) as f64 * 100.0
    }
}

/// A current-thread tokio runtime with timers, driven by whichever thread blocks on it.
pub fn runtime() -> Res<Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?)
}

/// Records every figure of this module for one round, on a fresh default pair per setup.
pub fn record(out: &mut Output, round: u64) -> Res<()> {
    let rt = runtime()?;
    let default = AgentConfig::default();
    for setup in &SETUPS {
        let pair = Pair::with_ucx(&default, &default, true, setup.ucx, setup.agent_cores)?;
        if setup.idle {
            idle_driver(out, setup, &pair, &rt)?;
        }
        round_trips(out, setup, &pair, &rt, 11 + round)?;
        w2(out, setup, &pair, &rt, 7 + round)?;
    }
    Ok(())
}

/// Percent of a core the whole process burns over [`IDLE`] with no traffic.
fn idle_core_pct() -> f64 {
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    std::thread::sleep(IDLE);
    (cpu_seconds() - cpu0) / t0.elapsed().as_secs_f64() * 100.0
}

/// Nanoseconds the thread named `nixl-drv-A` has run (its schedstat), if it exists.
fn driver_thread_ns() -> Option<u64> {
    std::fs::read_dir("/proc/self/task").ok()?.find_map(|task| {
        let dir = task.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
        if comm.trim() != "nixl-drv-A" {
            return None;
        }
        let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
        stat.split_whitespace().next()?.parse().ok()
    })
}

/// The idle pair's CPU before any async use (`blocking`), then after one awaited 64 MiB
/// READ has started A's completion driver (`await`), and the driver thread's own share.
fn idle_driver(out: &mut Output, setup: &Setup, pair: &Pair, rt: &Runtime) -> Res<()> {
    if driver_thread_ns().is_some() {
        return Err("a completion driver runs before the idle baseline".into());
    }
    std::thread::sleep(Duration::from_millis(100));
    let config = |how: Completer| format!("{}{}", setup.prefix, how.config());
    let baseline = idle_core_pct();
    out.emit(
        "rust",
        &config(Completer::Blocking),
        "idle_pair",
        "core_pct",
        baseline,
    );
    // Awaited from the agents' cores: the driver thread inherits them, as NIXL's threads do.
    // A READ done within `post` (or at the future's first poll) never reaches the driver:
    // the request is reposted until one does.
    pin_to(setup.agent_cores)?;
    let mut req = bulk_request(pair, XferOp::Read, 0, BULK, 2)?;
    for _ in 0..DRIVER_START_TRIES {
        req = rt.block_on(Completer::Await.post_and_complete(req))?;
        if driver_thread_ns().is_some() {
            break;
        }
    }
    pin(MEASURE_CORE)?;
    driver_thread_ns().ok_or("no awaited 64 MiB READ started the completion driver")?;
    std::thread::sleep(Duration::from_millis(100));
    let (ns0, t0) = (driver_thread_ns(), Instant::now());
    let pct = idle_core_pct();
    let ns = driver_thread_ns()
        .zip(ns0)
        .map(|(ns, ns0)| ns - ns0)
        .ok_or("the completion driver thread exited")?;
    let driver_pct = ns as f64 / t0.elapsed().as_nanos() as f64 * 100.0;
    out.emit(
        "rust",
        &config(Completer::Await),
        "idle_pair",
        "core_pct",
        pct,
    );
    out.emit(
        "rust",
        &config(Completer::Await),
        "idle_driver_thread",
        "core_pct",
        driver_pct,
    );
    Ok(())
}

/// `iters` round trips of `req`, each timed alone; gives the request back and the
/// microseconds of each.
async fn timed(how: Completer, mut req: XferRequest, iters: usize) -> Res<(XferRequest, Vec<f64>)> {
    let mut us = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        req = how.post_and_complete(req).await?;
        us.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    Ok((req, us))
}

/// The value below which `q` of the sorted `samples` lie.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// One variant's round trips: its request and what was measured so far.
struct Trips {
    how: Completer,
    req: Option<XferRequest>,
    us: Vec<f64>,
    in_progress: Vec<f64>,
}

/// The 4 KiB round trip: one WRITE request per variant (cut into the setup's descriptors),
/// made once, posted and completed again and again, the variants alternating in
/// [`RT_CHUNKS`] chunks; records the mean, p50 and p99 in microseconds and the share of
/// posts left in progress.
fn round_trips(out: &mut Output, setup: &Setup, pair: &Pair, rt: &Runtime, seed: u64) -> Res<()> {
    let mut runs = Vec::new();
    for how in Completer::ALL {
        let mut reqs = vec![bulk_request(pair, XferOp::Write, 0, SMALL, setup.rt_descs)?];
        bulk_check(pair, XferOp::Write, SMALL, &mut reqs, seed)?;
        runs.push(Trips {
            how,
            req: reqs.pop(),
            us: Vec::new(),
            in_progress: Vec::new(),
        });
    }
    for _ in 0..RT_CHUNKS {
        for run in &mut runs {
            let iters = match run.how {
                Completer::SleepPoll => RT_SLEEP_ITERS,
                _ => RT_ITERS,
            } / RT_CHUNKS;
            let req = run.req.take().ok_or("round-trip request lost")?;
            let posts = PostCount::start();
            let (req, us) = rt.block_on(timed(run.how, req, iters))?;
            run.in_progress.push(posts.in_progress_pct());
            run.req = Some(req);
            run.us.extend(us);
        }
    }
    for mut run in runs {
        let mean = run.us.iter().sum::<f64>() / run.us.len() as f64;
        run.us.sort_by(f64::total_cmp);
        let config = format!("{}{}", setup.prefix, run.how.config());
        let in_progress = run.in_progress.iter().sum::<f64>() / run.in_progress.len() as f64;
        out.emit("rust", &config, "rt_4k_write", "us_per_iter", mean);
        out.emit(
            "rust",
            &config,
            "rt_4k_write",
            "p50_us",
            quantile(&run.us, 0.5),
        );
        out.emit(
            "rust",
            &config,
            "rt_4k_write",
            "p99_us",
            quantile(&run.us, 0.99),
        );
        out.emit(
            "rust",
            &config,
            "rt_4k_write",
            "in_progress_pct",
            in_progress,
        );
    }
    Ok(())
}

/// W2 with prepared lists for each variant, alternating [`W2_REPS`] times; records the
/// medians of req/s, GB/s and CPU s/GB, and the share of posts left in progress.
fn w2(out: &mut Output, setup: &Setup, pair: &Pair, rt: &Runtime, seed: u64) -> Res<()> {
    let perm = permutation(KV_BLOCKS, 42);
    let mut figures: Vec<Vec<[f64; 4]>> = vec![Vec::new(); Completer::ALL.len()];
    for _ in 0..W2_REPS {
        for (how, runs) in Completer::ALL.into_iter().zip(&mut figures) {
            let posts = PostCount::start();
            let (rps, gbps, cpu) = kv(pair, &perm, true, seed, rt, how)?;
            runs.push([rps, gbps, cpu, posts.in_progress_pct()]);
        }
    }
    for (how, runs) in Completer::ALL.into_iter().zip(figures) {
        let config = format!("{}{}", setup.prefix, how.config());
        for (i, metric) in ["req_per_s", "gbps", "cpu_s_per_gb", "in_progress_pct"]
            .into_iter()
            .enumerate()
        {
            let mut values: Vec<f64> = runs.iter().map(|r| r[i]).collect();
            values.sort_by(f64::total_cmp);
            out.emit(
                "rust",
                &config,
                "w2_prepared",
                metric,
                values[values.len() / 2],
            );
        }
    }
    Ok(())
}

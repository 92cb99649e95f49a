//! Descriptor-heavy READs, as a long prompt on a model of many layers gives them: 64 layers
//! with K and V apart (128 regions), 148 blocks of 16 KiB per request (18,944 descriptors,
//! 310 MB), block ids (a) contiguous on both sides, (b) random from a pool of 4,096,
//! (c) half a run and half random ([`tables`]). Side by side with NIXL's Python API doing
//! what vLLM's worker does (`bench/python/descriptor_heavy.py`) and the CMA limit of the
//! same bytes ([`cma`]).
//!
//! ```sh
//! scripts/bench-descriptors.sh                      # rounds alternating Rust and Python, then the table
//! cargo bench -p nixl-rs --bench descriptor_heavy   # one Rust round (NIXL and CMA), printed
//! ```
//!
//! The Rust side is the path the connector's load takes: both caches' block lists prepared
//! once (every block of every region, `prepare_local` / `prepare_remote`), then per request
//! one `make_xfer_req` with the indices of its blocks, region by region (the order of the
//! connector's `ReadPlan::descriptor_ids` and of vLLM's `_get_block_descs_ids`), a
//! notification, `post`, and a wait for completion. Agents A (decode) and B (prefill) live in
//! one process, created on core 1 (NIXL's and UCX's threads inherit it), measured on core 0,
//! with the crate's default UCX backend; each region is its own lazily zeroed allocation.
//! Every case's first request runs into zeroed blocks and every byte is checked; then
//! [`REPS`] requests are timed, each followed by the CMA probe reading the same runs one per
//! `process_vm_readv` and 64 per call, alternating.
//!
//! Arguments: `[--round N] [--json PATH]` runs one round (JSON lines appended to PATH, else
//! printed); with `--telemetry` it records instead how many descriptors NIXL posted for each
//! case after merging (NIXL's telemetry on, every byte still checked, nothing timed);
//! `report JSONL OUT_MD` writes the table of a run; `cma-serve` is the CMA probe's child.

#[path = "descriptor_heavy/cma.rs"]
mod cma;
#[path = "descriptor_heavy/report.rs"]
mod report;
#[path = "descriptor_heavy/tables.rs"]
mod tables;

use std::io::Write;
use std::time::{Duration, Instant};

use nixl::{
    Agent, LocalDescList, MemType, PreparedLocal, PreparedRemote, Registration, RemoteDescList,
    XferDesc, XferOp, XferOptions, XferStatus,
};

use tables::{Case, BLOCK, POOL, REGIONS, REQUEST_BYTES};

/// Timed requests per case and round (each followed by the two CMA reads).
const REPS: usize = 5;
const AGENT_CORE: usize = 1;
const MEASURE_CORE: usize = 0;
const WAIT: Duration = Duration::from_secs(60);

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    match args.first().map(String::as_str) {
        Some("cma-serve") => return cma::serve(),
        Some("report") => {
            let [_, input, out] = args.as_slice() else {
                return Err("usage: descriptor_heavy report JSONL OUT_MD".into());
            };
            return report::write(input.as_ref(), out.as_ref());
        }
        _ => {}
    }
    let mut out = Output::from_args(&args)?;
    round(&mut out)?;
    eprintln!(
        "descriptor-heavy round {}: {REGIONS} regions x {} blocks of {} KiB per request ({} descriptors, {:.0} MB), \
         Rust: the nixl crate's prepared lists + make_xfer_req + post + wait (the connector's load path), agents on core \
         {AGENT_CORE}, measured on core {MEASURE_CORE}; CMA: process_vm_readv of the same runs from a child process\n\
         reproduce: cargo bench -p nixl-rs --bench descriptor_heavy; all rounds with Python: scripts/bench-descriptors.sh",
        out.round,
        tables::PER_REQUEST,
        BLOCK >> 10,
        REGIONS * tables::PER_REQUEST,
        REQUEST_BYTES as f64 / 1e6
    );
    Ok(())
}

/// Where the records go, and the round they belong to.
struct Output {
    round: u32,
    telemetry: bool,
    json: Option<std::fs::File>,
}

impl Output {
    fn from_args(args: &[String]) -> Res<Output> {
        let mut out = Output {
            round: 0,
            telemetry: false,
            json: None,
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--round" => out.round = it.next().ok_or("--round N")?.parse()?,
                "--json" => {
                    let path = it.next().ok_or("--json PATH")?;
                    out.json = Some(
                        std::fs::OpenOptions::new()
                            .create(true)
                            .append(true)
                            .open(path)?,
                    );
                }
                "--telemetry" => out.telemetry = true,
                other => return Err(format!("unknown argument {other:?}").into()),
            }
        }
        Ok(out)
    }

    /// Records one figure (printed, and appended to the JSON file if any).
    fn emit(&mut self, lang: &str, case: Case, metric: &str, value: f64) -> Res<()> {
        let unit = match metric {
            "gbps" => "GB/s",
            "descriptors" => "descriptors",
            _ => "ms",
        };
        let record = serde_json::json!({
            "lang": lang, "config": "default", "workload": case.name(), "metric": metric,
            "value": value, "unit": unit, "round": self.round,
        });
        println!("{record}");
        if let Some(file) = &mut self.json {
            writeln!(file, "{record}")?;
        }
        Ok(())
    }
}

/// One round: every case through NIXL, alternating with the CMA probe; with telemetry, the
/// descriptor counts only.
fn round(out: &mut Output) -> Res<()> {
    let pair = Pair::new(out.telemetry)?;
    if out.telemetry {
        return count_descriptors(out, &pair);
    }
    let mut cma = cma::Peer::start()?;
    for case in Case::ALL {
        let (local, remote) = case.tables();
        pair.fill(&remote)?;
        pair.clear(&local)?;
        pair.read(&local, &remote, false)?;
        pair.check(case, &local, &remote)?;
        cma.read(case, 1, true)?;
        cma.read(case, 64, true)?;
        let mut timed = Vec::with_capacity(REPS);
        let (mut one, mut many) = (Vec::new(), Vec::new());
        for _ in 0..REPS {
            timed.push(pair.read(&local, &remote, false)?);
            one.push(cma.read(case, 1, false)?);
            many.push(cma.read(case, 64, false)?);
        }
        let gbps = |s: f64| REQUEST_BYTES as f64 / s / 1e9;
        let med = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        out.emit(
            "rust",
            case,
            "make_ms",
            med(timed.iter().map(|t| t.make * 1e3).collect()),
        )?;
        out.emit(
            "rust",
            case,
            "post_ms",
            med(timed.iter().map(|t| t.post * 1e3).collect()),
        )?;
        let done = med(timed.iter().map(|t| t.done).collect());
        out.emit("rust", case, "complete_ms", done * 1e3)?;
        out.emit("rust", case, "gbps", gbps(done))?;
        out.emit("cma-1", case, "gbps", gbps(med(one)))?;
        out.emit("cma-64", case, "gbps", gbps(med(many)))?;
    }
    Ok(())
}

/// How many descriptors NIXL posts for each case after merging (`pair` made with
/// telemetry on, which costs time: nothing is timed), every byte checked.
fn count_descriptors(out: &mut Output, pair: &Pair) -> Res<()> {
    for case in Case::ALL {
        let (local, remote) = case.tables();
        pair.fill(&remote)?;
        pair.clear(&local)?;
        let read = pair.read(&local, &remote, true)?;
        pair.check(case, &local, &remote)?;
        let descriptors = read.descriptors.ok_or("no telemetry")?;
        out.emit("rust", case, "descriptors", descriptors as f64)?;
    }
    Ok(())
}

/// Seconds from the start of a request to each step.
struct Timing {
    /// `make_xfer_req` returned.
    make: f64,
    /// `post` returned.
    post: f64,
    /// The READ completed.
    done: f64,
    /// Descriptors NIXL posted (with telemetry on).
    descriptors: Option<u64>,
}

/// Agents A (decode) and B (prefill) in this process, their caches and prepared lists.
struct Pair {
    a: Agent,
    local: Registration,
    remote: Registration,
    local_list: PreparedLocal,
    remote_list: PreparedRemote,
    // Dropped last: the registrations and lists above are its.
    _b: Agent,
}

impl Pair {
    /// Creates A and B on [`AGENT_CORE`], registers both caches, prepares every block of
    /// both as A's lists, then moves the caller to [`MEASURE_CORE`].
    fn new(telemetry: bool) -> Res<Pair> {
        pin(AGENT_CORE)?;
        let a = Agent::builder("A").telemetry(telemetry).build()?;
        let b = Agent::builder("B").telemetry(telemetry).build()?;
        let (ucx_a, ucx_b) = (a.create_backend("UCX")?, b.create_backend("UCX")?);
        let local = a.register_memory(cma::cache(), &[&ucx_a])?;
        let remote = b.register_memory(cma::cache(), &[&ucx_b])?;
        a.load_remote_metadata(&b.local_metadata()?)?;
        let mut list = LocalDescList::with_capacity(MemType::Dram, REGIONS * POOL)?;
        for r in 0..REGIONS {
            list.push_blocks(&local, r, BLOCK, 0..POOL)?;
        }
        let local_list = a.prepare_local(&list, &[&ucx_a])?;
        let descs = remote
            .regions()
            .iter()
            .flat_map(|region| (0..POOL).map(|b| XferDesc::new(region.addr + b * BLOCK, BLOCK, 0)))
            .collect();
        let remote_list = a.prepare_remote(
            "B",
            &RemoteDescList::from_vec(MemType::Dram, descs)?,
            &[&ucx_a],
        )?;
        pin(MEASURE_CORE)?;
        Ok(Pair {
            a,
            local,
            remote,
            local_list,
            remote_list,
            _b: b,
        })
    }

    /// Fills the prefill's `blocks` of every region with their pattern.
    fn fill(&self, blocks: &[usize]) -> Res<()> {
        let mut data = vec![0u8; BLOCK];
        for r in 0..REGIONS {
            for &b in blocks {
                tables::fill(&mut data, r, b);
                self.remote.write(r, b * BLOCK, &data)?;
            }
        }
        Ok(())
    }

    /// Zeroes the decode's `blocks` of every region.
    fn clear(&self, blocks: &[usize]) -> Res<()> {
        let zeros = vec![0u8; BLOCK];
        for r in 0..REGIONS {
            for &b in blocks {
                self.local.write(r, b * BLOCK, &zeros)?;
            }
        }
        Ok(())
    }

    /// Checks that every byte of the decode's `local` blocks holds its `remote` block.
    fn check(&self, case: Case, local: &[usize], remote: &[usize]) -> Res<()> {
        let mut got = vec![0u8; BLOCK];
        for r in 0..REGIONS {
            for (&l, &far) in local.iter().zip(remote) {
                self.local.read(r, l * BLOCK, &mut got)?;
                if !tables::holds(&got, r, far) {
                    return Err(format!(
                        "NIXL {}: region {r} local block {l} does not hold remote block {far}",
                        case.name()
                    )
                    .into());
                }
            }
        }
        Ok(())
    }

    /// One READ of `remote` into `local` in every region, as the connector makes it; with
    /// `telemetry`, NIXL's count of the descriptors it posted.
    fn read(&self, local: &[usize], remote: &[usize], telemetry: bool) -> Res<Timing> {
        let t0 = Instant::now();
        let indices = |blocks: &[usize]| -> Vec<usize> {
            (0..REGIONS)
                .flat_map(|r| blocks.iter().map(move |&b| r * POOL + b))
                .collect()
        };
        let (li, ri) = (indices(local), indices(remote));
        let options = XferOptions::new().notification(b"descriptor-heavy".to_vec());
        let mut request = self.a.make_xfer_req(
            XferOp::Read,
            &self.local_list,
            &li,
            &self.remote_list,
            &ri,
            &options,
        )?;
        let make = t0.elapsed().as_secs_f64();
        let status = request.post()?;
        let post = t0.elapsed().as_secs_f64();
        if status == XferStatus::InProgress {
            request.wait(WAIT)?;
        }
        let done = t0.elapsed().as_secs_f64();
        let descriptors = if telemetry {
            Some(request.telemetry()?.desc_count)
        } else {
            None
        };
        Ok(Timing {
            make,
            post,
            done,
            descriptors,
        })
    }
}

/// Restricts the calling thread to `core`.
fn pin(core: usize) -> Res<()> {
    // SAFETY: cpu_set_t is plain bits, valid when zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `core` is below CPU_SETSIZE and `set` is ours.
    unsafe { libc::CPU_SET(core, &mut set) };
    // SAFETY: pid 0 is the calling thread; the set is valid for its size.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        return Err(format!("pin to core {core}: {}", std::io::Error::last_os_error()).into());
    }
    Ok(())
}

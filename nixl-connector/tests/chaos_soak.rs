//! A chaos soak of a prefill engine (TP 1) in a child process and a decode engine of TP 2
//! (two ranks in the test process, their outputs aggregated by the scheduler) over real
//! NIXL/UCX (#30 item 6): hundreds of requests with random prefix hits, some waiting for
//! blocks longer than a lease (kept by the decode's heartbeats, or by a third agent's
//! vLLM-style ones of over 16 KiB), aborts while waiting and while loading,
//! leases that end for requests nobody reads, a prefill stopped
//! (SIGSTOP) now and then for longer than the decode's transfer timeout while READs from it
//! run, a decode stopped (the prefill stops its parent, the test process) for less and for
//! more than a lease, a prefill killed (SIGKILL) mid-run and restarted as a new engine on a
//! new port (the dead one evicted by the decode), and heartbeat floods with malformed notifications from a third agent.
//!
//! Both engines keep a block pool. Every block either side frees is overwritten with a
//! poison pattern, and checked to be still poisoned when it is taken again; every block the
//! decode is told is loaded is checked, rank by rank (each holds its head's half of the
//! prefill's block), against its request's pattern, unless the request's
//! lease may have ended while the decode was stopped (the prefill may then have reused the
//! blocks before the READ: the documented cost of a lease). A READ landing in a block after
//! its load handed it back shows as a late write; a block freed while a READ could still
//! read it, as a poisoned or mismatched block.
//!
//! In CI it runs 300 requests in about 9 s; `NIXL_CONNECTOR_SOAK_SECONDS=600` runs it for
//! ten minutes, the prefill killed and restarted every 150 requests.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use std::process::Stdio;

use common::{after_tag, handshake, role_process, stdout_lines, worker_with};
use nixl_connector::{
    open_fds, ConnectorMetadata, FinishStatus, KvAttention, KvCacheSpec, KvConnectorScheduler,
    KvConnectorWorker, KvLayout, KvTransferParams, LoadOutcome, SchedulerConfig,
};

/// Blocks per cache: enough for a few dozen requests in flight.
const BLOCKS: usize = 64;
/// The byte every freed block is filled with.
const POISON: u8 = 0xEE;

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1) as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// The byte at `offset` of the `index`th block of request `seed`, region `region`: never
/// the poison.
fn byte(seed: u64, index: usize, region: usize, offset: usize) -> u8 {
    let x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((index * 7919 + region * 104_729 + offset * 31) as u64);
    match (x ^ (x >> 29)) as u8 {
        POISON => 0x11,
        b => b,
    }
}

/// One engine's blocks: the free ones, and the cache they live in.
struct Pool {
    free: Vec<usize>,
    spec: KvCacheSpec,
}

impl Pool {
    fn new(spec: &KvCacheSpec) -> Pool {
        Pool {
            free: (0..BLOCKS).rev().collect(),
            spec: spec.clone(),
        }
    }

    /// `n` free blocks of the engine of `ranks`; counts in `late` each rank's block that
    /// something wrote since it was poisoned (a READ that landed after its load's outcome
    /// handed the block back).
    fn take(
        &mut self,
        ranks: &[KvConnectorWorker],
        n: usize,
        late: &mut u64,
    ) -> Option<Vec<usize>> {
        if self.free.len() < n {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for rank in ranks {
            let cache = rank.kv_caches().unwrap();
            for &b in &blocks {
                for region in 0..self.spec.num_regions() {
                    let len = self.spec.block_len(region);
                    let mut got = vec![0u8; len];
                    cache.read(region, b * len, &mut got).unwrap();
                    // Never used (zero) or poisoned when freed, and untouched since.
                    if !(got.iter().all(|&x| x == POISON) || got.iter().all(|&x| x == 0)) {
                        *late += 1;
                    }
                }
            }
        }
        Some(blocks)
    }

    /// Poisons `blocks` in every rank's cache and gives them back; counts a block freed
    /// twice.
    fn give(&mut self, ranks: &[KvConnectorWorker], blocks: &[usize], twice: &mut u64) {
        for &b in blocks {
            if self.free.contains(&b) {
                *twice += 1;
                continue;
            }
            for rank in ranks {
                let cache = rank.kv_caches().unwrap();
                for region in 0..self.spec.num_regions() {
                    let len = self.spec.block_len(region);
                    cache.write(region, b * len, &vec![POISON; len]).unwrap();
                }
            }
            self.free.push(b);
        }
    }

    /// Writes request `seed`'s pattern into `blocks`.
    fn fill(&self, worker: &KvConnectorWorker, seed: u64, blocks: &[usize]) {
        let cache = worker.kv_caches().unwrap();
        for (index, &b) in blocks.iter().enumerate() {
            for region in 0..self.spec.num_regions() {
                let len = self.spec.block_len(region);
                let data: Vec<u8> = (0..len).map(|o| byte(seed, index, region, o)).collect();
                cache.write(region, b * len, &data).unwrap();
            }
        }
    }
}

/// What the soak saw.
/// What the soak saw.
#[derive(Debug, Default)]
struct Report {
    requests: u64,
    loads: u64,
    loaded: u64,
    failed: u64,
    recompute: u64,
    aborted_while_waiting: u64,
    aborted_while_loading: u64,
    full_hits: u64,
    /// Refused for lacking remote blocks, and freed at once.
    without_remote_blocks: u64,
    never_read: u64,
    overdue: u64,
    blocks_verified: u64,
    poisoned_blocks: u64,
    mismatched_blocks: u64,
    late_writes: u64,
    freed_twice: u64,
    floods: u64,
    prefill_stops: u64,
    decode_stalls: u64,
    decode_stalls_past_lease: u64,
    /// Loaded, but not held to its pattern: the request's lease may have ended in a decode
    /// stall; and how many of their blocks (region by rank) the prefill had reused.
    loaded_past_lease: u64,
    reused_past_lease: u64,
    /// Requests that waited for blocks longer than a lease (heartbeats keeping it).
    waited_past_lease: u64,
    /// Of those, kept by the third agent's unsplit (vLLM) heartbeats, over 16 KiB.
    waited_on_vllm_heartbeats: u64,
    prefill_restarts: u64,
    /// Outcomes of loads from a killed prefill: loaded before it died, and not.
    dead_loaded: u64,
    dead_failed: u64,
    /// Loaded from a prefill started after a restart.
    loaded_after_restart: u64,
}

/// A decode request: its params, when to allocate it, its request seed and remote blocks,
/// which prefill process made it, and whether its lease may have ended in a decode stall.
struct Queued {
    id: String,
    params: Box<KvTransferParams>,
    at_step: u64,
    /// Not before then either: some wait for blocks longer than a lease, kept by the
    /// heartbeats that start at `on_new_request`.
    ready_at: Instant,
    seed: u64,
    remote_len: usize,
    generation: u64,
    past_lease: bool,
    /// Loaded, neither aborted nor a full hit (one of a killed prefill's, which must fail).
    plain: bool,
    /// Its lease kept while it waits by the third agent's vLLM heartbeats, not the
    /// decode's (`on_new_request` only at allocation).
    vllm_heartbeats: bool,
}

/// A decode request under way: its local blocks and which of the request's blocks they are.
struct Loading {
    local: Vec<usize>,
    seed: u64,
    first_index: usize,
    generation: u64,
    past_lease: bool,
    plain: bool,
}

/// The cache of a rank of TP `tp` of a model with 2 KV heads (HND: a block is its heads'
/// tokens, head by head, so rank `d` of TP 2 holds the second half of each prefill block
/// when `d` is 1, the first when 0).
fn spec(tp: usize) -> KvCacheSpec {
    KvCacheSpec::uniform(
        3,
        BLOCKS,
        4,
        KvAttention::Mha { total_kv_heads: 2 },
        KvLayout::Hnd,
        4 * (2 / tp) * 16,
    )
}

/// The decode's TP (the prefill's is 1): each decode rank reads its head from the prefill.
const DECODE_TP: usize = 2;

/// The role's environment: how many requests the prefill makes (at most, in a long run).
const TARGET_ENV: &str = "NIXL_CONNECTOR_SOAK_REQUESTS";
/// The role's environment: the prefill's engine id (a restarted prefill is a new engine).
const ENGINE_ENV: &str = "NIXL_CONNECTOR_SOAK_ENGINE";
/// The long run's length, in whole seconds (the prefill process gets what is left of it).
const SECONDS_ENV: &str = "NIXL_CONNECTOR_SOAK_SECONDS";
/// The first prefill's engine id.
const PREFILL: &str = "pf-soak";
/// UCX's transport selection, and the soak's: TCP only (with UCX's own self transport).
const UCX_TLS: &str = "UCX_TLS";
const TCP_ONLY: &str = "tcp,self";
/// The prefill is killed and restarted after this many of its requests reached the decode
/// (once in CI, again and again in a long run).
const KILL_AFTER: u64 = 150;
/// The decode is stopped every this many steps: the first of every four times for more
/// than a whole lease (leases end), the others for less than the lease's margin
/// (heartbeats stop, leases hold).
const STALL_EVERY: u64 = 250;
/// A stall that misses heartbeats (sent every 250 ms, each extending the lease to 1 s from
/// its arrival) without ending a lease.
const SHORT_STALL_MS: u64 = 300;
/// A stall past the 1.5 s lease.
const LONG_STALL_MS: u64 = 2200;
/// How often the third agent floods the prefill with heartbeats.
const FLOOD_EVERY: Duration = Duration::from_millis(250);
/// The decode's engine TTL, in seconds (`engine_ttl`): a killed prefill is evicted.
const ENGINE_TTL_S: f64 = 1.0;
/// How long some requests wait for their blocks: past the 1.5 s lease.
const LONG_WAIT: Duration = Duration::from_secs(2);

/// `NIXL_CONNECTOR_SOAK_SECONDS`: a long run's length (the prefill process sees it too).
fn soak_seconds() -> Option<u64> {
    std::env::var(SECONDS_ENV).ok().map(|s| {
        s.parse()
            .expect("NIXL_CONNECTOR_SOAK_SECONDS: whole seconds")
    })
}

/// The `kv_transfer_config` of both engines: DRAM, a 1.5 s lease.
fn kv() -> nixl::kv_config::KvTransferConfig {
    let mut kv = common::cpu_config();
    kv.kv_connector_extra_config
        .insert("kv_lease_duration".into(), 1.5.into());
    kv
}

/// The scheduler of engine `engine` of TP `tp`, whose rank 0 is `rank0`.
fn scheduler(engine: &str, tp: usize, rank0: &KvConnectorWorker) -> KvConnectorScheduler {
    let port = rank0.side_channel_addr().unwrap().port();
    KvConnectorScheduler::new(SchedulerConfig::new(engine, "127.0.0.1", port, tp, &kv()).unwrap())
}

/// Sends `signal` to this process's parent (the soak's decode).
fn signal_parent(signal: libc::c_int) {
    // SAFETY: kill(2) and getppid(2) touch no memory of ours; the parent is the test process
    // that waits for this child, so it is alive while this child runs.
    let sent = unsafe { libc::kill(libc::getppid(), signal) };
    assert_eq!(
        sent,
        0,
        "signal {signal}: {}",
        std::io::Error::last_os_error()
    );
}

/// Serves the decode's stall orders on stdin (`STALL <ms>`: stop the parent, the decode,
/// for that long, then print `RESUMED`), until stdin closes.
fn serve_stalls() {
    for line in std::io::stdin().lines().map_while(Result::ok) {
        if let Some(ms) = line.strip_prefix("STALL ") {
            signal_parent(libc::SIGSTOP);
            std::thread::sleep(Duration::from_millis(ms.trim().parse().unwrap()));
            signal_parent(libc::SIGCONT);
            println!("RESUMED");
        }
    }
}

/// The prefill, in a child process: prints `PORT <port> <agent>`, then makes requests of 1 to 4
/// blocks as its pool allows (until it made them all, or a long run's time is up), each
/// finished for a remote decode and printed as `REQ <seed> <blocks> <params JSON>`; poisons
/// and frees the blocks of each released request. Once every one is released, prints
/// `END <freed twice> <late writes>` and serves stall orders until its stdin closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill of the soak, which starts it"]
async fn soak_prefill_role() {
    common::init_tracing();
    let mut target: u64 = std::env::var(TARGET_ENV)
        .expect("run by the soak")
        .parse()
        .unwrap();
    let engine = std::env::var(ENGINE_ENV).expect("run by the soak");
    let until = soak_seconds().map(|s| Instant::now() + Duration::from_secs(s));
    let spec = spec(1);
    let kv = kv();
    let prefill = [worker_with(&engine, 0, 1, &spec, |c| {
        c.kv_transfer_config = kv.clone()
    })];
    let mut ps = scheduler(&engine, 1, &prefill[0]);
    let mut pool = Pool::new(&spec);
    let mut rng = Rng(0x5eed_0000_0000_0001 ^ u64::from(std::process::id()));
    let (mut made, mut twice, mut late) = (0u64, 0u64, 0u64);
    let mut held: HashMap<String, Vec<usize>> = HashMap::new();
    let mut released: HashSet<String> = HashSet::new();
    let stalls = std::thread::spawn(serve_stalls);
    println!(
        "PORT {} {}",
        prefill[0].side_channel_addr().unwrap().port(),
        prefill[0].agent().name()
    );
    while made < target || !held.is_empty() {
        let n = 1 + rng.below(4);
        let making = made < target && until.map_or(true, |u| Instant::now() < u);
        if !making && made < target {
            target = made;
        }
        if making && held.len() < 32 {
            if let Some(blocks) = pool.take(&prefill, n, &mut late) {
                made += 1;
                let seed = rng.below(usize::MAX) as u64 | 1;
                let id = format!("p{made}");
                pool.fill(&prefill[0], seed, &blocks);
                let done = ps.request_finished(
                    &id,
                    &blocks,
                    0,
                    Some(&common::for_decode()),
                    FinishStatus::LengthCapped,
                );
                let params = serde_json::to_string(&done.kv_transfer_params.unwrap()).unwrap();
                held.insert(id, blocks);
                println!("REQ {seed} {n} {params}");
            }
        }
        prefill[0].start_load_kv(&ps.build_connector_meta());
        let released_now = ps
            .update_connector_output(&[prefill[0].output()])
            .unwrap()
            .finished_sending;
        for id in released_now {
            if !released.insert(id.clone()) {
                twice += 1;
                continue;
            }
            let blocks = held.remove(&id).expect("a held request released");
            pool.give(&prefill, &blocks, &mut twice);
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    println!("END {twice} {late}");
    tokio::task::spawn_blocking(move || stalls.join())
        .await
        .unwrap()
        .unwrap();
}

/// What the prefill process printed.
enum Line {
    Request {
        seed: u64,
        blocks: usize,
        params: Box<KvTransferParams>,
    },
    Resumed,
    End {
        freed_twice: u64,
        late_writes: u64,
    },
}

/// Reads the prefill process's lines (after its port) in a thread, into a channel that
/// closes when the process's stdout does.
fn read_lines(mut lines: common::ChildLines) -> tokio::sync::mpsc::UnboundedReceiver<Line> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in lines.by_ref().map_while(Result::ok) {
            if line.contains("RESUMED") {
                if tx.send(Line::Resumed).is_err() {
                    break;
                }
                continue;
            }
            let Some(at) = line.find("REQ ").or_else(|| line.find("END ")) else {
                continue;
            };
            let mut words = line[at..].splitn(4, ' ');
            let parsed = match words.next() {
                Some("REQ") => Line::Request {
                    seed: words.next().unwrap().parse().unwrap(),
                    blocks: words.next().unwrap().parse().unwrap(),
                    params: Box::new(serde_json::from_str(words.next().unwrap()).unwrap()),
                },
                _ => Line::End {
                    freed_twice: words.next().unwrap().parse().unwrap(),
                    late_writes: words.next().unwrap().trim().parse().unwrap(),
                },
            };
            if tx.send(parsed).is_err() {
                break;
            }
        }
    });
    rx
}

/// A prefill process: the child, its agent's name and what it prints.
struct PrefillProcess {
    child: std::process::Child,
    engine: String,
    port: u16,
    agent: String,
    lines: tokio::sync::mpsc::UnboundedReceiver<Line>,
}

/// Starts a prefill process of engine `engine` that makes `target` requests (or runs for
/// `seconds`).
fn start_prefill(engine: &str, target: u64, seconds: Option<u64>) -> PrefillProcess {
    let target = target.to_string();
    let seconds = seconds.map(|s| s.to_string());
    let mut env = vec![
        (TARGET_ENV, target.as_str()),
        (ENGINE_ENV, engine),
        (UCX_TLS, TCP_ONLY),
    ];
    if let Some(seconds) = &seconds {
        env.push((SECONDS_ENV, seconds.as_str()));
    }
    let mut child = role_process("soak_prefill_role", &env, Stdio::inherit());
    let mut lines = stdout_lines(&mut child);
    let printed = after_tag(&mut lines, "PORT ").expect("the prefill prints its port");
    let (port, agent) = printed.trim().split_once(' ').unwrap();
    PrefillProcess {
        port: port.parse().unwrap(),
        agent: agent.into(),
        engine: engine.into(),
        lines: read_lines(lines),
        child,
    }
}

/// The decode engine: its ranks, scheduler, pool and requests, and what it saw.
struct DecodeEngine {
    ranks: Vec<KvConnectorWorker>,
    scheduler: KvConnectorScheduler,
    pool: Pool,
    spec: KvCacheSpec,
    rng: Rng,
    queued: Vec<Queued>,
    loading: HashMap<String, Loading>,
    aborted: HashSet<String>,
    /// The prefill's ids of the requests the third agent heartbeats (as a vLLM decode).
    vllm_waiting: HashSet<String>,
    r: Report,
}

impl DecodeEngine {
    /// Takes a request of prefill process `generation` (nobody reads some of them: their
    /// leases end); `past_lease` if its lease may end before the decode reads it.
    fn receive(
        &mut self,
        step: u64,
        generation: u64,
        past_lease: bool,
        (seed, blocks, params): (u64, usize, Box<KvTransferParams>),
    ) {
        self.r.requests += 1;
        if self.rng.chance(8) {
            self.r.never_read += 1;
            return;
        }
        let id = format!("d{}", self.r.requests);
        // Long waits come between long decode stalls (which would end their leases too).
        let mut ready_at = Instant::now();
        let window = step % (4 * STALL_EVERY);
        let mut vllm_heartbeats = false;
        // (The first two in a run, then 8 % of them.)
        let long = self.r.waited_past_lease < 2 || self.rng.chance(8);
        if (STALL_EVERY..3 * STALL_EVERY).contains(&window) && !past_lease && long {
            ready_at += LONG_WAIT;
            self.r.waited_past_lease += 1;
            // Every second one is kept by a vLLM decode's heartbeats instead (the third agent's
            // unsplit ones), the engine telling the connector only when it allocates.
            vllm_heartbeats = self.r.waited_past_lease % 2 == 1;
        }
        if vllm_heartbeats {
            self.r.waited_on_vllm_heartbeats += 1;
            let remote = params.remote_request_id.clone().unwrap();
            self.vllm_waiting.insert(remote);
        } else {
            self.scheduler.on_new_request(&id, Some(&params));
        }
        self.queued.push(Queued {
            id,
            params,
            at_step: step + self.rng.below(4) as u64,
            ready_at,
            seed,
            remote_len: blocks,
            generation,
            past_lease,
            plain: vllm_heartbeats,
            vllm_heartbeats,
        });
    }

    /// Marks every request under way as one whose lease may end (a long stall follows).
    fn past_lease(&mut self) {
        self.queued.iter_mut().for_each(|q| q.past_lease = true);
        self.loading.values_mut().for_each(|l| l.past_lease = true);
    }

    /// One engine step: queued requests get their blocks (a random prefix hit, or an
    /// abort), loads start, some are aborted while loading, and the outcomes are checked.
    fn step(&mut self, step: u64, generation: u64) {
        let mut later = Vec::new();
        for q in std::mem::take(&mut self.queued) {
            if q.at_step > step || q.ready_at > Instant::now() {
                later.push(q);
                continue;
            }
            if !q.plain && self.rng.chance(5) {
                self.scheduler
                    .request_finished(&q.id, &[], 0, None, FinishStatus::Aborted);
                self.r.aborted_while_waiting += 1;
                continue;
            }
            let hit = if !q.plain && self.rng.chance(15) {
                q.remote_len
            } else {
                self.rng.below(q.remote_len)
            };
            let Some(local) =
                self.pool
                    .take(&self.ranks, q.remote_len - hit, &mut self.r.late_writes)
            else {
                later.push(q);
                continue;
            };
            if q.vllm_heartbeats {
                self.vllm_waiting
                    .remove(q.params.remote_request_id.as_deref().unwrap());
                self.scheduler.on_new_request(&q.id, Some(&q.params));
            }
            // Now and then (the first time in a run, then 2 %) the engine passes params without
            // remote blocks: refused, and the request waits for nothing (the engine computes
            // its blocks).
            let bare = !q.plain
                && !local.is_empty()
                && (self.r.without_remote_blocks == 0 || self.rng.chance(2));
            let mut params = q.params.clone();
            if bare {
                params.remote_block_ids.clear();
            }
            let scheduled = self
                .scheduler
                .update_state_after_alloc(&q.id, &local, &params);
            if bare && scheduled.is_err() {
                self.r.without_remote_blocks += 1;
                let done =
                    self.scheduler
                        .request_finished(&q.id, &local, 0, None, FinishStatus::Stopped);
                assert!(!done.delay_free_blocks, "{}: nothing to load", q.id);
                self.pool.give(&self.ranks, &local, &mut self.r.freed_twice);
                continue;
            }
            scheduled.unwrap();
            if local.is_empty() {
                self.r.full_hits += 1;
                self.scheduler
                    .request_finished(&q.id, &[], 0, None, FinishStatus::Stopped);
                continue;
            }
            self.r.loads += 1;
            self.loading.insert(
                q.id,
                Loading {
                    local,
                    seed: q.seed,
                    first_index: hit,
                    generation: q.generation,
                    past_lease: q.past_lease,
                    plain: q.plain,
                },
            );
        }
        self.queued = later;
        let meta = self.scheduler.build_connector_meta();
        for rank in &self.ranks {
            rank.start_load_kv(&meta);
        }
        // Aborts while loading: the blocks stay until the load ends.
        let running: Vec<String> = self
            .loading
            .iter()
            .filter(|(id, load)| !load.plain && !self.aborted.contains(*id))
            .map(|(id, _)| id)
            .cloned()
            .collect();
        for id in running {
            if self.rng.chance(1) {
                let done =
                    self.scheduler
                        .request_finished(&id, &[], 0, None, FinishStatus::Aborted);
                assert!(done.delay_free_blocks, "{id}");
                self.aborted.insert(id);
                self.r.aborted_while_loading += 1;
            }
        }
        // The outcomes: loaded blocks checked, then every block poisoned and freed.
        // Every rank's output, aggregated as vLLM's engine does.
        let outputs: Vec<_> = self.ranks.iter().map(|rank| rank.output()).collect();
        for rank in &self.ranks {
            self.r.overdue += rank.overdue_loads().len() as u64;
            rank.metrics();
        }
        let outcomes = self
            .scheduler
            .update_connector_output(&outputs)
            .unwrap()
            .load_outcomes;
        for outcome in outcomes {
            self.ended(outcome, generation);
        }
    }

    /// Checks every rank's blocks of `load` against its request's pattern: rank `d` holds
    /// the `d`th slice of the prefill's block (its head). Counts (poisoned, mismatched).
    fn check(&self, load: &Loading) -> (u64, u64) {
        let (mut poisoned, mut mismatched) = (0, 0);
        for (d, rank) in self.ranks.iter().enumerate() {
            let cache = rank.kv_caches().unwrap();
            for (k, &b) in load.local.iter().enumerate() {
                for region in 0..self.spec.num_regions() {
                    let len = self.spec.block_len(region);
                    let mut got = vec![0u8; len];
                    cache.read(region, b * len, &mut got).unwrap();
                    let want: Vec<u8> = (0..len)
                        .map(|o| byte(load.seed, load.first_index + k, region, d * len + o))
                        .collect();
                    if got.iter().all(|&x| x == POISON) {
                        poisoned += 1;
                    } else if got != want {
                        mismatched += 1;
                    }
                }
            }
        }
        (poisoned, mismatched)
    }

    /// Checks and frees a load that ended with `outcome` (`generation`: the live prefill).
    fn ended(&mut self, outcome: LoadOutcome, generation: u64) {
        let (id, loaded) = match &outcome {
            LoadOutcome::Loaded { request_id } => {
                self.r.loaded += 1;
                (request_id, true)
            }
            LoadOutcome::Failed { request_id, .. } => {
                self.r.failed += 1;
                (request_id, false)
            }
            LoadOutcome::Recompute { request_id, .. } => {
                self.r.recompute += 1;
                (request_id, false)
            }
            LoadOutcome::AbortedLoadEnded { request_id } => (request_id, false),
        };
        let load = self
            .loading
            .remove(id)
            .expect("an outcome for a load under way");
        self.aborted.remove(id);
        let aborted = matches!(outcome, LoadOutcome::AbortedLoadEnded { .. });
        if load.generation < generation && !aborted {
            match loaded {
                true => self.r.dead_loaded += 1,
                false => self.r.dead_failed += 1,
            }
        }
        if loaded && load.generation > 0 {
            self.r.loaded_after_restart += 1;
        }
        if loaded {
            let (poisoned, mismatched) = self.check(&load);
            if load.past_lease {
                // The prefill may have reused them before the READ: counted, not failed.
                self.r.loaded_past_lease += 1;
                self.r.reused_past_lease += poisoned + mismatched;
            } else {
                self.r.poisoned_blocks += poisoned;
                self.r.mismatched_blocks += mismatched;
                self.r.blocks_verified += (load.local.len() * self.ranks.len()) as u64;
            }
        }
        if !aborted {
            let done =
                self.scheduler
                    .request_finished(id, &load.local, 0, None, FinishStatus::Stopped);
            assert!(!done.delay_free_blocks, "{id}: its load ended");
        }
        self.pool
            .give(&self.ranks, &load.local, &mut self.r.freed_twice);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_block_is_reused_or_reported_loaded_while_a_read_can_touch_it() {
    common::init_tracing();
    let seconds = soak_seconds();
    // A long run: requests until its time is up, the prefill restarted again and again.
    let target = seconds.map_or(300, |_| u64::MAX);
    let max_restarts = seconds.map_or(1, |_| u64::MAX);
    let limit = Duration::from_secs(seconds.map_or(50, |s| s + 60));
    let seconds_left =
        |started: Instant| seconds.map(|s| s.saturating_sub(started.elapsed().as_secs()));
    // Over TCP a READ's bytes need the prefill to send them: a stopped prefill holds them
    // back, and a READ handed back early lands late (over shared memory they land at once,
    // and only the READ's completion waits for the prefill). Set before any agent exists;
    // this binary's only other test is the prefill role, in its own process.
    std::env::set_var(UCX_TLS, TCP_ONLY);
    let started = Instant::now();
    let mut prefill = start_prefill(PREFILL, target, seconds);
    let spec = spec(DECODE_TP);
    let kv = kv();
    let ranks: Vec<KvConnectorWorker> = (0..DECODE_TP)
        .map(|rank| {
            worker_with("dc-soak", rank, DECODE_TP, &spec, |c| {
                c.kv_transfer_config = kv.clone();
                // A killed prefill's engine is evicted within the run (a live one may be
                // too, between loads, and is handshaken again).
                c.kv_transfer_config
                    .kv_connector_extra_config
                    .insert("engine_ttl".into(), ENGINE_TTL_S.into());
                // Shorter than the prefill's stops, so that READs from it pass it.
                c.transfer_timeout = Duration::from_millis(100);
            })
        })
        .collect();
    let hostile = worker_with("hb-soak", 0, 1, &self::spec(1), |c| {
        c.kv_transfer_config = kv.clone()
    });
    handshake(&hostile, PREFILL, prefill.port).await;
    let mut d = DecodeEngine {
        scheduler: scheduler("dc-soak", DECODE_TP, &ranks[0]),
        ranks,
        pool: Pool::new(&spec),
        spec: spec.clone(),
        rng: Rng(0x5eed_1234_abcd_0001),
        queued: Vec::new(),
        loading: HashMap::new(),
        aborted: HashSet::new(),
        vllm_waiting: HashSet::new(),
        r: Report::default(),
    };
    let fds_before = open_fds().unwrap();
    let rss_before = common::status_kib("VmRSS");
    let mut prefill_end = None;
    let mut stopped_until: Option<Instant> = None;
    let mut next_prefill_stop = 100;
    let mut last_flood = Instant::now();
    let mut step = 0u64;
    let mut generation = 0u64;
    let mut from_current = 0u64;
    loop {
        step += 1;
        if prefill_end.is_some() && d.queued.is_empty() && d.loading.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < limit,
            "the soak did not end: {} queued, {} loading, {:?}",
            d.queued.len(),
            d.loading.len(),
            d.r
        );
        // The prefill stops for 250 ms, 100 steps or more apart, while loads from it run.
        match stopped_until {
            Some(until) if Instant::now() >= until => {
                common::signal(&prefill.child, libc::SIGCONT);
                stopped_until = None;
            }
            None if step >= next_prefill_stop && !d.loading.is_empty() && prefill_end.is_none() => {
                common::signal(&prefill.child, libc::SIGSTOP);
                stopped_until = Some(Instant::now() + Duration::from_millis(250));
                next_prefill_stop = step + 100;
                d.r.prefill_stops += 1;
            }
            _ => {}
        }
        // The prefill is killed and a new one (a new engine, port and agent) takes over,
        // while requests from it wait for their blocks (so that some loads from it fail).
        if from_current >= KILL_AFTER
            && d.r.prefill_restarts < max_restarts
            && prefill_end.is_none()
            && d.queued.iter().any(|q| q.generation == generation)
        {
            d.queued
                .iter_mut()
                .filter(|q| q.generation == generation)
                .for_each(|q| q.plain = true);
            prefill.child.kill().unwrap();
            prefill.child.wait().unwrap();
            stopped_until = None;
            // What the dead one printed still comes: its loads fail.
            while let Some(line) = prefill.lines.recv().await {
                if let Line::Request {
                    seed,
                    blocks,
                    params,
                } = line
                {
                    d.receive(step, generation, false, (seed, blocks, params));
                }
            }
            generation += 1;
            from_current = 0;
            d.r.prefill_restarts += 1;
            let engine = format!("{PREFILL}-{generation}");
            let left = target.saturating_sub(d.r.requests);
            prefill = start_prefill(&engine, left, seconds_left(started));
            handshake(&hostile, &engine, prefill.port).await;
        }
        // The decode stops: alternately past the heartbeats only, and past whole leases.
        if step % STALL_EVERY == 0 && prefill_end.is_none() {
            if stopped_until.take().is_some() {
                common::signal(&prefill.child, libc::SIGCONT);
            }
            let past_lease = (step / STALL_EVERY) % 4 == 1;
            let ms = if past_lease {
                d.past_lease();
                d.r.decode_stalls_past_lease += 1;
                LONG_STALL_MS
            } else {
                SHORT_STALL_MS
            };
            d.r.decode_stalls += 1;
            use std::io::Write;
            let stdin = prefill.child.stdin.as_mut().unwrap();
            stdin.write_all(format!("STALL {ms}\n").as_bytes()).unwrap();
            // Stopped by the prefill until it prints RESUMED; what it made meanwhile may
            // outlive its lease too.
            loop {
                match prefill
                    .lines
                    .recv()
                    .await
                    .expect("the prefill resumes the decode")
                {
                    Line::Resumed => break,
                    Line::End {
                        freed_twice,
                        late_writes,
                    } => prefill_end = Some((freed_twice, late_writes)),
                    Line::Request {
                        seed,
                        blocks,
                        params,
                    } => {
                        from_current += 1;
                        d.receive(step, generation, past_lease, (seed, blocks, params));
                    }
                }
            }
        }
        while let Ok(line) = prefill.lines.try_recv() {
            match line {
                Line::End {
                    freed_twice,
                    late_writes,
                } => prefill_end = Some((freed_twice, late_writes)),
                Line::Resumed => {}
                Line::Request {
                    seed,
                    blocks,
                    params,
                } => {
                    from_current += 1;
                    d.receive(step, generation, false, (seed, blocks, params));
                }
            }
        }
        // The third agent's heartbeat flood with malformed notifications, every 250 ms (more
        // often than a heartbeat's 1 s extension): one heartbeat naming the requests it
        // waits for as a vLLM decode does, in one message (far over 16 KiB).
        if last_flood.elapsed() >= FLOOD_EVERY {
            last_flood = Instant::now();
            d.r.floods += 1;
            let padding = (0..5000).map(|i| format!("{:x>48}", i));
            let ids: Vec<String> = d.vllm_waiting.iter().cloned().chain(padding).collect();
            for message in [
                format!("HB:{}", ids.join(",")).into_bytes(),
                b"HB:a,,b".to_vec(),
                b"p1:0".to_vec(),
                vec![0xff; 64],
            ] {
                hostile
                    .agent()
                    .send_notification(&prefill.agent, &message)
                    .unwrap();
            }
        }
        d.step(step, generation);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    if stopped_until.is_some() {
        common::signal(&prefill.child, libc::SIGCONT);
    }
    let (prefill_freed_twice, prefill_late_writes) = prefill_end.unwrap();
    drop(prefill.child.stdin.take());
    assert!(
        prefill.child.wait().unwrap().success(),
        "the prefill's checks passed"
    );
    // Every killed prefill's engine is evicted once idle past the TTL (each step sweeps).
    let evicted = |d: &DecodeEngine| {
        d.ranks.iter().all(|rank| {
            rank.start_load_kv(&ConnectorMetadata::default());
            let stats = rank.remote_stats();
            stats.evicted >= d.r.prefill_restarts && stats.engines <= 1
        })
    };
    common::wait_for(
        "the dead prefills' engines evicted",
        Duration::from_secs(5),
        || evicted(&d),
    )
    .await;
    let (fds_after, rss_after) = (open_fds().unwrap(), common::status_kib("VmRSS"));
    let r = &d.r;
    eprintln!(
        "soak: {:.1} s, {step} steps, {r:?}; last prefill {}: freed twice {prefill_freed_twice}, \
         late writes {prefill_late_writes}; decode fds {fds_before} -> {fds_after}, RSS \
         {rss_before} -> {rss_after} KiB",
        started.elapsed().as_secs_f64(),
        prefill.engine,
    );
    assert_eq!((prefill_freed_twice, prefill_late_writes), (0, 0));
    assert_eq!(
        (
            r.poisoned_blocks,
            r.mismatched_blocks,
            r.late_writes,
            r.freed_twice
        ),
        (0, 0, 0, 0),
        "{r:?}"
    );
    assert!(r.loaded > 0 && r.blocks_verified > 0, "{r:?}");
    assert_eq!(d.pool.free.len(), BLOCKS, "every block back");
    assert!(r.overdue > 0, "some READs passed the timeout: {r:?}");
    assert!(
        r.decode_stalls_past_lease > 0 && r.decode_stalls > r.decode_stalls_past_lease,
        "the decode stalled, past a lease and not: {r:?}"
    );
    assert!(
        r.waited_on_vllm_heartbeats > 0,
        "some requests waited for blocks past a lease, kept by vLLM heartbeats: {r:?}"
    );
    assert!(
        r.prefill_restarts > 0 && r.dead_failed > 0 && r.loaded_after_restart > 0,
        "a prefill died with loads from it, and its successor served: {r:?}"
    );
    assert!(
        fds_after <= fds_before + 4,
        "fds {fds_before} -> {fds_after}"
    );
}

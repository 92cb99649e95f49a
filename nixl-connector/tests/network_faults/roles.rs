//! The engines, each run in a child process in its own namespace: a prefill that fills its
//! cache and serves (pushing, it holds the decode's next requests ahead), and a decode that keeps loads from each prefill it knows in flight and
//! prints when each starts and ends, on the machine's monotonic clock (the same in every
//! namespace).

use std::collections::HashMap;
use std::io::BufRead;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Duration;

use crate::common::{capability, fill, pattern, vllm_config, vllm_factors, worker_with};
use crate::hosts::tcp_table;
use nixl_connector::{
    FailedBlock, KvAttention, KvCacheSpec, KvConnectorWorker, KvLayout, RemoteBlocks, WorkerConfig,
};

/// The variable naming the prefills the decode role loads from: `ENGINE@ip:port` (the
/// engine's id and its side channel), comma-separated.
pub const PREFILL_ADDR: &str = "NF43_PREFILL_ADDR";
/// The variable giving the address the prefill's side channel binds.
pub const BIND_ADDR: &str = "NF43_BIND_ADDR";
/// The variable giving the prefill role's engine id ([`PREFILL`] without it).
pub const ENGINE: &str = "NF43_ENGINE";
/// The variable giving how many loads the decode keeps in flight from each prefill
/// ([`IN_FLIGHT`] without it).
pub const SLOTS_PER_PREFILL: &str = "NF43_SLOTS_PER_PREFILL";
/// The variable giving the decode's TP (1 without it): each rank reads its head of every
/// block from the prefill (of TP 1).
pub const DECODE_TP: &str = "NF43_DECODE_TP";
/// The variable giving the decode's longest backoff from a failing engine, in seconds
/// (the connector's `engine_backoff_max_s`; its default without it).
pub const BACKOFF_S: &str = "NF43_BACKOFF_S";
/// The variable naming the protocol both engines speak: `vllm` for vLLM's (its side
/// channel, handshake and notifications), the native one without it.
pub const PROTOCOL: &str = "NF43_PROTOCOL";
/// [`PROTOCOL`]'s value for vLLM's protocol.
pub const VLLM: &str = "vllm";
/// The variable naming the transfer mode both engines use (native protocol): `push` for
/// push mode (the prefill WRITEs into the blocks the decode registers), pull without it.
pub const TRANSFER_MODE: &str = "NF43_TRANSFER_MODE";
/// [`TRANSFER_MODE`]'s value for push mode.
pub const PUSH: &str = "push";
/// How many requests a push prefill holds ahead of the decode's (it cannot learn them
/// sooner: a registration for a request not held waits, bounded).
const HELD_AHEAD: usize = 64;
/// The prefill's engine id.
pub const PREFILL: &str = "nf43-prefill";
/// Loads the decode keeps in flight from each prefill, unless told otherwise.
pub const IN_FLIGHT: usize = 4;
/// Blocks per load.
pub const BLOCKS_PER_LOAD: usize = 8;
/// The decode's transfer timeout: a load past it is overdue, and fails once NIXL ended it.
pub const TRANSFER_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the decode waits, after its last load started, for every load to end.
pub const DRAIN: Duration = Duration::from_secs(150);
/// The byte the decode fills a slot's blocks with when their load ends (see [`Poisoned`]).
const POISON: u8 = 0xEE;
/// How many bytes at each end of a block region the poison covers and is checked on.
const POISON_EDGE: usize = 64;

/// Whether the engines speak vLLM's protocol ([`PROTOCOL`]).
fn speaks_vllm() -> bool {
    std::env::var(PROTOCOL).is_ok_and(|p| p == VLLM)
}

/// Whether the engines push ([`TRANSFER_MODE`]).
fn pushes() -> bool {
    std::env::var(TRANSFER_MODE).is_ok_and(|m| m == PUSH)
}

/// Sets `config` to speak vLLM's protocol if [`PROTOCOL`] says so, and to push if
/// [`TRANSFER_MODE`] does (a decode then waits at most [`TRANSFER_TIMEOUT`] for the WRITE).
fn protocol(config: &mut WorkerConfig) {
    if speaks_vllm() {
        config.kv_transfer_config = vllm_config(vllm_factors());
    }
    if pushes() {
        let extra = &mut config.kv_transfer_config.kv_connector_extra_config;
        extra.insert("transfer_mode".into(), PUSH.into());
        let timeout = TRANSFER_TIMEOUT.as_secs_f64();
        extra.insert("push_registration_timeout".into(), timeout.into());
    }
}

/// The prefill's blocks of request `p<i>r<n>`: the decode reads (or a push prefill writes)
/// these for its `n`th load.
fn remote_blocks(n: usize, num_blocks: usize) -> Vec<usize> {
    (0..BLOCKS_PER_LOAD)
        .map(|i| (n * 7 + i * 5) % num_blocks)
        .collect()
}

/// The machine's monotonic clock in milliseconds (CLOCK_MONOTONIC: namespaces share it).
pub fn now_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// The prefill's cache: 4 regions of 64 blocks of 64 KiB (2 MiB a load, 16 MiB in all), 2
/// KV heads.
pub fn spec() -> KvCacheSpec {
    spec_of_rank(1)
}

/// The cache of a rank of TP `tp` (HND: rank `d` of TP 2 holds the `d`th half of each of
/// the prefill's blocks, its head).
fn spec_of_rank(tp: usize) -> KvCacheSpec {
    KvCacheSpec::uniform(
        4,
        64,
        16,
        KvAttention::Mha { total_kv_heads: 2 },
        KvLayout::Hnd,
        64 * 1024 / tp,
    )
}

/// Logs the connector's events to stderr (inherited: the test's output), filtered by
/// `RUST_LOG` (errors only without it); stdout carries the role's tagged lines.
pub fn log_to_stderr() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
}

/// The prefill: engine `ENGINE`, binds its side channel at `BIND_ADDR`, fills its cache,
/// prints `PORT <port>` and serves until it is killed.
pub async fn prefill() {
    let bind = std::env::var(BIND_ADDR).expect("run by the parent test");
    let engine = std::env::var(ENGINE).unwrap_or_else(|_| PREFILL.to_string());
    let spec = spec();
    let backoff: Option<f64> = std::env::var(BACKOFF_S).ok().map(|s| s.parse().unwrap());
    let prefill = worker_with(&engine, 0, 1, &spec, |c| {
        protocol(c);
        c.side_channel = format!("{bind}:0").parse().unwrap();
        // A push prefill hands its ends to the decode: it backs off from it too.
        if let Some(seconds) = backoff {
            c.kv_transfer_config
                .kv_connector_extra_config
                .insert(nixl_connector::ENGINE_BACKOFF_KEY.into(), seconds.into());
        }
    });
    fill(&prefill, &spec);
    println!("PORT {}", prefill.side_channel_addr().unwrap().port());
    if !pushes() {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        return;
    }
    // Push: hold the decode's next requests (`p0r<n>`, in order) ahead of it, one more for
    // each that ends (written, cancelled or given up by its lease).
    let (mut held, mut ended) = (0usize, 0usize);
    loop {
        while held < ended + HELD_AHEAD {
            let request = format!("p0r{held}");
            let blocks = remote_blocks(held, spec.num_blocks);
            let deadline = std::time::Instant::now() + Duration::from_secs(3600);
            prefill
                .hold_for_push(&request, deadline, &capability(), (&blocks, &[]), None)
                .unwrap();
            held += 1;
        }
        ended += prefill.finished().sending.len();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A load in flight: its request, the remote blocks it reads, and the decode's ranks whose
/// part of it has not ended yet.
struct Slot {
    request: String,
    remote: Vec<usize>,
    ranks_left: usize,
}

/// A prefill the decode loads from: its engine id, host and side channel's port.
struct Source {
    engine: String,
    host: String,
    port: u16,
}

impl Source {
    /// `ENGINE@ip:port`.
    fn parse(entry: &str) -> Source {
        let (engine, at) = entry.trim().split_once('@').expect("ENGINE@ip:port");
        let (host, port) = at.rsplit_once(':').expect("ip:port");
        Source {
            engine: engine.to_string(),
            host: host.to_string(),
            port: port.parse().expect("a port"),
        }
    }
}

/// How long a slot waits after a failed load before it starts the next (as an engine that
/// recomputes a failed request would not ask for it again at once).
const AFTER_FAILURE: Duration = Duration::from_millis(100);

/// The decode: until its stdin says `STOP` (or closes), keeps `SLOTS_PER_PREFILL` loads of
/// [`BLOCKS_PER_LOAD`] blocks in flight from each prefill of `PREFILL_ADDR`, and of each
/// its stdin adds (`ADD ENGINE@ip:port`), printing `START <request> <ms>`,
/// `OVERDUE <request> <ms>` and `END <request> <ms> <outcome>` (`loaded`, a bad byte's
/// `mismatch`, or the failure's kind and reason), where a request from the `i`-th prefill
/// is named `p<i>r<n>`; then waits at most [`DRAIN`] for the loads still in flight, checks
/// the poison of every slot a second later, prints `DRAINED <loads left>` and exits at once
/// (a READ NIXL never ends would keep the worker from shutting down). A slot's blocks are
/// poisoned when its load ends, and checked when the slot is taken again: a byte that
/// landed in between (a READ that went on after its load handed the blocks back) prints
/// `LATE <slot> <ms> <blocks>`.
pub async fn decode() {
    let prefills = std::env::var(PREFILL_ADDR).expect("run by the parent test");
    let per_prefill = std::env::var(SLOTS_PER_PREFILL)
        .map_or(IN_FLIGHT, |n| n.parse().expect("a number of slots"));
    let mut sources: Vec<Source> = prefills.split(',').map(Source::parse).collect();
    let commands = commands_on_stdin();
    let tp: usize = std::env::var(DECODE_TP).map_or(1, |n| n.parse().expect("a TP size"));
    let spec = spec_of_rank(tp);
    let backoff: Option<f64> = std::env::var(BACKOFF_S).ok().map(|s| s.parse().unwrap());
    let decode: Vec<KvConnectorWorker> = (0..tp)
        .map(|rank| {
            worker_with("nf43-decode", rank, tp, &spec, |c| {
                protocol(c);
                if pushes() {
                    // A push prefill handshakes with the decode: its side channel on the
                    // decode host's address.
                    let bind = std::env::var(BIND_ADDR).expect("run by the parent test");
                    c.side_channel = format!("{bind}:0").parse().unwrap();
                }
                c.transfer_timeout = TRANSFER_TIMEOUT;
                if let Some(seconds) = backoff {
                    c.kv_transfer_config
                        .kv_connector_extra_config
                        .insert(nixl_connector::ENGINE_BACKOFF_KEY.into(), seconds.into());
                }
            })
        })
        .collect();
    // Slot k loads from prefill k / per_prefill, into blocks of its own.
    let slots_for = |sources: usize| sources * per_prefill;
    assert!(slots_for(sources.len()) * BLOCKS_PER_LOAD <= spec.num_blocks);
    let mut slots: Vec<Option<Slot>> = (0..slots_for(sources.len())).map(|_| None).collect();
    let mut resume = vec![tokio::time::Instant::now(); slots.len()];
    let mut failed = HashMap::new();
    let mut poisoned = Poisoned::default();
    let mut next = 0usize;
    let mut stopped_at = None;
    loop {
        let mut starting = stopped_at.is_none();
        loop {
            match commands.try_recv() {
                Ok(Command::Add(source)) if starting => {
                    sources.push(source);
                    assert!(slots_for(sources.len()) * BLOCKS_PER_LOAD <= spec.num_blocks);
                    slots.resize_with(slots_for(sources.len()), || None);
                    poisoned.slots.resize(slots.len(), false);
                    resume.resize(slots.len(), tokio::time::Instant::now());
                }
                Ok(Command::Add(_)) => {}
                Ok(Command::Stats) => print_stats(&decode[0]),
                Ok(Command::Stop) | Err(TryRecvError::Disconnected) => starting = false,
                Err(TryRecvError::Empty) => break,
            }
            if !starting {
                break;
            }
        }
        if !starting && stopped_at.is_none() {
            stopped_at = Some(tokio::time::Instant::now());
        }
        for (slot, held) in slots.iter_mut().enumerate() {
            if held.is_some() || !starting || tokio::time::Instant::now() < resume[slot] {
                continue;
            }
            let source = &sources[slot / per_prefill];
            let request = format!("p{}r{next}", slot / per_prefill);
            let remote = remote_blocks(next, spec.num_blocks);
            next += 1;
            let mut from = RemoteBlocks {
                host: source.host.clone(),
                port: source.port,
                ..crate::common::remote(&decode[0], &source.engine, &request, remote.clone(), 1)
            };
            if speaks_vllm() {
                // vLLM's params carry no capability.
                from.capability = None;
            }
            poisoned.check(&decode, &spec, slot);
            clear(&decode, &spec, slot);
            println!("START {request} {}", now_ms());
            for rank in &decode {
                rank.start_load(&request, &local_blocks(slot), &from)
                    .unwrap();
            }
            *held = Some(Slot {
                request,
                remote,
                ranks_left: tp,
            });
        }
        let drained = slots.iter().all(Option::is_none) && !starting;
        if drained || stopped_at.is_some_and(|at| at.elapsed() > DRAIN) {
            // What lands late lands soon after its load's end (the same connection).
            tokio::time::sleep(Duration::from_secs(1)).await;
            for (slot, _) in slots.iter().enumerate().filter(|(_, s)| s.is_none()) {
                poisoned.check(&decode, &spec, slot);
            }
            let left = slots.iter().filter(|s| s.is_some()).count();
            println!("DRAINED {left}");
            break;
        }
        let any_ended =
            futures::future::select_all(decode.iter().map(|rank| Box::pin(rank.load_ended())));
        let _ = tokio::time::timeout(Duration::from_millis(20), any_ended).await;
        let ended = report(&decode, &spec, &mut slots, &mut failed);
        for (slot, failed) in ended {
            poisoned.poison(&decode, &spec, slot);
            if failed {
                resume[slot] = tokio::time::Instant::now() + AFTER_FAILURE;
            }
        }
    }
    // A READ NIXL never ended would hold the worker's shutdown: leave at once.
    std::process::exit(0);
}

/// What the parent test tells the decode on its stdin.
enum Command {
    /// `ADD ENGINE@ip:port`: load from that prefill too.
    Add(Source),
    /// `STATS`: print what the process holds (see [`print_stats`]).
    Stats,
    /// `STOP`: start no more loads.
    Stop,
}

/// The commands on stdin, read by a thread: the channel disconnects after `STOP` or when
/// stdin closes (both mean stop).
fn commands_on_stdin() -> Receiver<Command> {
    let (send, commands) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            let line = line.trim();
            if line == "STOP" {
                let _ = send.send(Command::Stop);
                break;
            }
            if line == "STATS" {
                let _ = send.send(Command::Stats);
            }
            if let Some(entry) = line.strip_prefix("ADD ") {
                let _ = send.send(Command::Add(Source::parse(entry)));
            }
        }
    });
    commands
}

/// Prints `STATS <fds> <threads> <rss KiB> <remote agents> <remote engines> <metadata
/// loads> <leaked requests>`: what this process holds now.
fn print_stats(decode: &KvConnectorWorker) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    if std::env::var_os("NF43_FD_KINDS").is_some() {
        eprintln!("decode fds by kind: {:?}", fd_kinds());
    }
    let remotes = decode.remote_stats();
    println!(
        "STATS {} {} {} {} {} {} {} {}",
        nixl_connector::open_fds().unwrap_or(0),
        field("Threads:"),
        field("VmRSS:"),
        remotes.agents,
        remotes.engines,
        remotes.loaded,
        decode.agent().leak_stats().requests,
        remotes.handshakes_pending,
    );
}

/// This process's open file descriptors counted by what they are (`socket`,
/// `anon_inode:[eventfd]`, a path), for finding what grows (`NF43_FD_KINDS`, by hand).
fn fd_kinds() -> std::collections::BTreeMap<String, usize> {
    let mut kinds = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = std::fs::read_link(entry.path())
            .map(|t| t.to_string_lossy().into_owned())
            .unwrap_or_default();
        let kind = match target.split_once(":[") {
            Some(("socket", inode)) => socket_kind(inode.trim_end_matches(']')),
            Some(("pipe", _)) => "pipe".to_string(),
            _ => target,
        };
        *kinds.entry(kind).or_default() += 1;
    }
    kinds
}

/// `socket tcp STATE local-port->remote-port`, or `socket other`: socket `inode` found in
/// this namespace's TCP tables (the state as `hosts::TcpRow` has it).
fn socket_kind(inode: &str) -> String {
    let port = |address: &str| {
        let hex = address.rsplit(':').next().unwrap_or("");
        u16::from_str_radix(hex, 16).unwrap_or(0)
    };
    tcp_table(std::process::id())
        .into_iter()
        .find(|row| row.inode == inode)
        .map_or("socket other".to_string(), |row| {
            format!(
                "socket tcp {} {}->{}",
                row.state,
                port(&row.local),
                port(&row.remote)
            )
        })
}

/// Which slots' blocks were poisoned when their load ended, and not taken since.
#[derive(Default)]
struct Poisoned {
    slots: Vec<bool>,
}

impl Poisoned {
    /// Poisons both ends of every block region of `slot` (its load ended: nothing may
    /// write them any more).
    fn poison(&mut self, decode: &[KvConnectorWorker], spec: &KvCacheSpec, slot: usize) {
        let len = spec.block_len(0);
        for caches in decode.iter().map(|rank| rank.kv_caches().unwrap()) {
            for local in local_blocks(slot) {
                for region in 0..spec.num_regions() {
                    for at in [local * len, (local + 1) * len - POISON_EDGE] {
                        caches.write(region, at, &[POISON; POISON_EDGE]).unwrap();
                    }
                }
            }
        }
        if self.slots.len() <= slot {
            self.slots.resize(slot + 1, false);
        }
        self.slots[slot] = true;
    }

    /// If `slot` was poisoned, checks that nothing wrote its blocks on any rank since
    /// (printing `LATE` with the blocks written), and forgets it.
    fn check(&mut self, decode: &[KvConnectorWorker], spec: &KvCacheSpec, slot: usize) {
        if !self.slots.get(slot).copied().unwrap_or(false) {
            return;
        }
        self.slots[slot] = false;
        let len = spec.block_len(0);
        let caches: Vec<_> = decode
            .iter()
            .map(|rank| rank.kv_caches().unwrap())
            .collect();
        let written = caches
            .iter()
            .flat_map(|caches| local_blocks(slot).into_iter().map(move |l| (caches, l)))
            .filter(|&(caches, local)| {
                (0..spec.num_regions()).any(|region| {
                    [local * len, (local + 1) * len - POISON_EDGE]
                        .into_iter()
                        .any(|at| {
                            let mut edge = [0u8; POISON_EDGE];
                            caches.read(region, at, &mut edge).unwrap();
                            edge.iter().any(|&b| b != POISON)
                        })
                })
            })
            .count();
        if written > 0 {
            println!("LATE {slot} {} {written}", now_ms());
        }
    }
}

/// The local blocks of `slot`.
fn local_blocks(slot: usize) -> Vec<usize> {
    (slot * BLOCKS_PER_LOAD..(slot + 1) * BLOCKS_PER_LOAD).collect()
}

/// Zeroes the bytes of `slot`'s blocks that [`loaded_right`] checks, on every rank.
fn clear(decode: &[KvConnectorWorker], spec: &KvCacheSpec, slot: usize) {
    let len = spec.block_len(0);
    for caches in decode.iter().map(|rank| rank.kv_caches().unwrap()) {
        for local in local_blocks(slot) {
            for region in 0..spec.num_regions() {
                caches.write(region, local * len, &[0u8; 64]).unwrap();
            }
        }
    }
}

/// Prints what ended and what is overdue since the last call, and frees the slots of the
/// loads that ended on every rank; returns those slots, each with whether its load failed.
/// `failed` keeps the first failed block of each load not yet seen to end.
fn report(
    decode: &[KvConnectorWorker],
    spec: &KvCacheSpec,
    slots: &mut [Option<Slot>],
    failed: &mut HashMap<String, FailedBlock>,
) -> Vec<(usize, bool)> {
    let mut ended = Vec::new();
    for rank in decode {
        // Failed blocks come with the load's end or after it: take them after `finished`.
        let finished = rank.finished();
        for block in rank.load_errors() {
            failed.entry(block.request_id.clone()).or_insert(block);
        }
        for overdue in rank.overdue_loads() {
            println!("OVERDUE {} {}", overdue.request_id, now_ms());
        }
        for request in finished.recving {
            let Some(slot) = slots
                .iter()
                .position(|s| s.as_ref().is_some_and(|s| s.request == request))
            else {
                continue;
            };
            let held = slots[slot].as_mut().unwrap();
            held.ranks_left -= 1;
            if held.ranks_left == 0 {
                ended.push(slot);
            }
        }
    }
    ended
        .into_iter()
        .map(|slot| {
            let held = slots[slot].take().unwrap();
            let failure = failed.remove(&held.request);
            let failed = failure.is_some();
            let outcome = match failure {
                Some(block) => {
                    let reason = block.reason.replace('\n', " ");
                    let reason: String = reason.chars().take(160).collect();
                    format!("{:?} {reason}", block.kind)
                }
                None if loaded_right(decode, spec, slot, &held.remote) => "loaded".to_string(),
                None => "mismatch".to_string(),
            };
            println!("END {} {} {outcome}", held.request, now_ms());
            (slot, failed)
        })
        .collect()
}

/// Whether the first bytes of every block of `slot`, on every rank, hold the prefill's
/// pattern of `remote` (rank `d` of TP `n`: the `d`th `n`th of the prefill's block).
fn loaded_right(
    decode: &[KvConnectorWorker],
    spec: &KvCacheSpec,
    slot: usize,
    remote: &[usize],
) -> bool {
    let len = spec.block_len(0);
    decode.iter().enumerate().all(|(d, rank)| {
        let caches = rank.kv_caches().unwrap();
        local_blocks(slot)
            .iter()
            .zip(remote)
            .all(|(&local, &source)| {
                (0..spec.num_regions()).all(|region| {
                    let mut head = [0u8; 64];
                    caches.read(region, local * len, &mut head).unwrap();
                    head.iter()
                        .enumerate()
                        .all(|(o, &b)| b == pattern(region, source, d * len + o))
                })
            })
    })
}

//! The prefill engine, in a child process of the soak (the ignored role test runs it): it
//! makes requests for the decode, frees their blocks once released, and stops its parent,
//! the decode, when told to.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_connector::{FinishStatus, KvConnectorWorker, PipelineRank, WorkerConfig};

use crate::common::{self, worker_with, SERVER_DEADLINE};
use crate::pool::Pool;
use crate::prefill_child::monotonic;
use crate::rng::Rng;
use crate::settings::{
    kv, prefill_pp, role_wire, scheduler, soak_seconds, spec, stage_spec, stages, ENGINE_ENV,
    TARGET_ENV,
};

/// The ranks of engine `engine` of `pp` stages of TP 1, stage by stage: stage `s` holds its
/// layers and listens at stage 0's port + `s` (another run of ports is tried when one is
/// taken), as the native protocol finds a stage.
fn stage_ranks(engine: &str, pp: usize) -> Vec<KvConnectorWorker> {
    if pp == 1 {
        return vec![worker_with(engine, 0, 1, &spec(1), |c| {
            c.kv_transfer_config = kv(role_wire())
        })];
    }
    let stages = stages(pp);
    'ports: for _ in 0..20 {
        let mut ranks: Vec<KvConnectorWorker> = Vec::new();
        for stage in 0..pp {
            let mut config = WorkerConfig::new(engine, 0, 1, kv(role_wire()));
            config.platform = std::sync::Arc::new(nixl::platform::BuiltinPlatform::CPU);
            config.limits.deadline = SERVER_DEADLINE;
            config.pipeline = Some(PipelineRank::new(stages.clone(), stage).unwrap());
            if let Some(first) = ranks.first() {
                let port = first.side_channel_addr().unwrap().port();
                let Some(port) = port.checked_add(stage as u16) else {
                    continue 'ports;
                };
                config.side_channel.set_port(port);
            }
            let rank = KvConnectorWorker::new(config).expect("create a stage's worker");
            let spec = stage_spec(1, stages.layers(stage).len());
            if rank.register_host_kv_caches(spec).is_err() {
                continue 'ports;
            }
            ranks.push(rank);
        }
        return ranks;
    }
    panic!("no run of {pp} free ports for the prefill's stages");
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

/// Serves the decode's orders on stdin until it closes: `GO` (its engine is up and takes
/// requests: `go` is set) and `STALL <ms>` (stop the parent, the decode, for that long,
/// then print `RESUMED`).
fn serve_orders(go: &AtomicBool) {
    for line in std::io::stdin().lines().map_while(Result::ok) {
        if line == "GO" {
            go.store(true, Ordering::Release);
        } else if let Some(ms) = line.strip_prefix("STALL ") {
            signal_parent(libc::SIGSTOP);
            std::thread::sleep(Duration::from_millis(ms.trim().parse().unwrap()));
            signal_parent(libc::SIGCONT);
            println!("RESUMED");
        }
    }
}

/// The prefill, in a child process (of `NIXL_CONNECTOR_SOAK_PREFILL_PP` stages, each a rank
/// holding its layers): prints `PORT <port> <agents>` (comma-joined, stage by stage), then, once the decode
/// says `GO` (its engine is up: a request made before would wait unread in the pipe while
/// its lease runs, and on a loaded machine the decode's agents take seconds to start),
/// makes requests of 1 to 4 blocks as its pool allows (until it made them all, or a long
/// run's time is up), each finished for a remote decode and printed as
/// `REQ <seed> <blocks> <made> <params JSON>` (`made`: when, in µs of [`monotonic`]);
/// poisons and frees the blocks of each released request. Once every one is released,
/// prints `END <freed twice> <late writes>` and serves stall orders until its stdin closes.
pub async fn serve() {
    common::init_tracing();
    let mut target: u64 = std::env::var(TARGET_ENV)
        .expect("run by the soak")
        .parse()
        .unwrap();
    let engine = std::env::var(ENGINE_ENV).expect("run by the soak");
    let until = soak_seconds().map(|s| Instant::now() + Duration::from_secs(s));
    let spec = spec(1);
    let pp = prefill_pp();
    let prefill = stage_ranks(&engine, pp);
    let firsts: Vec<usize> = (0..pp).map(|s| stages(pp).layers(s).start).collect();
    let mut ps = scheduler(&engine, (1, pp), &prefill[0], role_wire());
    let mut pool = Pool::new(&spec);
    let mut rng = Rng(0x5eed_0000_0000_0001 ^ u64::from(std::process::id()));
    let (mut made, mut twice, mut late) = (0u64, 0u64, 0u64);
    let mut held: HashMap<String, Vec<usize>> = HashMap::new();
    let mut released: HashSet<String> = HashSet::new();
    let go = Arc::new(AtomicBool::new(false));
    let orders = std::thread::spawn({
        let go = go.clone();
        move || serve_orders(&go)
    });
    let agents: Vec<&str> = prefill.iter().map(|rank| rank.agent().name()).collect();
    println!(
        "PORT {} {}",
        prefill[0].side_channel_addr().unwrap().port(),
        agents.join(",")
    );
    while made < target || !held.is_empty() {
        let n = 1 + rng.below(4);
        if !go.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(3)).await;
            continue;
        }
        let making = made < target && until.map_or(true, |u| Instant::now() < u);
        if !making && made < target {
            target = made;
        }
        if making && held.len() < 32 {
            if let Some(blocks) = pool.take(&prefill, n, &mut late) {
                made += 1;
                let seed = rng.below(usize::MAX) as u64 | 1;
                // As vLLM's request ids: a base the decode's id shares, and a suffix of
                // its own (vLLM's push matches registrations by the base).
                let id = format!("p{made}-{:08x}", rng.below(1 << 32));
                for (rank, &first) in prefill.iter().zip(&firsts) {
                    pool.fill((rank, first), seed, &blocks);
                }
                let made_at = monotonic();
                // Its prompt fills its blocks (vLLM's params need the tokens).
                let done = ps.request_finished(
                    &id,
                    &blocks,
                    n * spec.block_size,
                    Some(&common::for_decode()),
                    FinishStatus::LengthCapped,
                );
                let params = serde_json::to_string(&done.kv_transfer_params.unwrap()).unwrap();
                held.insert(id, blocks);
                println!("REQ {seed} {n} {} {params}", made_at.as_micros());
            }
        }
        let meta = ps.build_connector_meta();
        for rank in &prefill {
            rank.start_load_kv(&meta);
        }
        // Every stage's output, aggregated as vLLM's engine does: a request is released
        // once every stage's readers notified.
        let outputs: Vec<_> = prefill.iter().map(|rank| rank.output()).collect();
        let released_now = ps
            .update_connector_output(&outputs)
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
    tokio::task::spawn_blocking(move || orders.join())
        .await
        .unwrap()
        .unwrap();
}

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
//! prefill's block), against its request's pattern, whatever its lease did: a load whose
//! lease ended while the decode was stopped or before the request reached it (the prefill
//! may then have reused the blocks before the READ) must fail as outlived (the prefill's
//! release marks), never be reported loaded. A READ landing in a block after
//! its load handed it back shows as a late write; a block freed while a READ could still
//! read it, as a poisoned or mismatched block.
//!
//! The decode process's heap in use must stay under a bound after warm-up (see [`memory`]).
//!
//! In CI it runs 300 requests in about 14 s, and again against a prefill of two pipeline
//! stages (two ranks of the prefill process, the 3 layers split 2 + 1, each decode rank
//! reading every layer from the stage holding it); `NIXL_CONNECTOR_SOAK_SECONDS=600` runs
//! the first for ten minutes, the prefill killed and restarted every 150 requests.
//!
//! The same soak runs in push mode (#41): the prefill WRITEs into the blocks the decode (TP
//! 1 there) registered, its stops pass the decode's registration timeout mid-WRITE, the
//! decode's stalls pass leases while WRITEs run, and its aborts come after registering. A
//! block either side frees and the WRITE then reaches shows as a late write. The blocks of
//! loads registered with a killed prefill that never answered stay with the decode (held,
//! never handed back: the connector README's known limit), and are counted. A mutation
//! (the decode handing its blocks back at the registration timeout, without the prefill's
//! answer) fails it with 60-70 late writes.
//!
//! Both soaks run in vLLM 0.33's protocol too (#41: vLLM's side channel, handshake,
//! heartbeats, finish notifications, and in push mode `PUSH_REG:` registrations and `id:world`
//! completions, between two Rust engines), request ids named as vLLM's (a base shared by
//! both engines, a suffix of each's own: its push matches registrations by the base). Two
//! differences, both vLLM's: pulling, the decode never stalls past a lease and does not read
//! a request that arrives late, since neither vLLM's wire (no release marks) nor a Rust
//! prefill's params (no expiry time) could tell a READ that its lease ended; pushing, the
//! blocks of a load registered with a killed prefill go back two leases after the
//! registration timeout, vLLM's prefill having no answer to wait for.
//!
//! Without faults (`NIXL_CONNECTOR_SOAK_FAULTS=0` for a long run, and a second test in CI of
//! 4,000 requests, about 30 s) the same engines run with no prefill killed or stopped, no
//! decode stalled, no transfer timeout and no engine evicted (prefix hits, aborts, floods
//! and requests nobody reads stay): no request is leaked, and the heap after warm-up must
//! stay flat.

#[path = "../common/mod.rs"]
mod common;
mod decode;
mod memory;
mod pool;
mod prefill_child;
mod prefill_role;
mod report;
mod rng;
mod settings;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::{handshake, worker_with};
use nixl_connector::{
    open_fds, Capability, ConnectorMetadata, HeartbeatSpec, KvConnectorWorker, Protocol,
    TransferMode,
};

use decode::DecodeEngine;
use memory::{MemoryTrace, Sample};
use pool::{Pool, BLOCKS};
use prefill_child::{start_prefill, Line};
use report::Report;
use rng::Rng;
use settings::{
    kv, scheduler, soak_faults, soak_seconds, spec, Wire, ENGINE_TTL_S, FAULT_FREE_REQUESTS,
    FLOOD_EVERY, HOSTILE_ENGINE_TTL_S, KILL_AFTER, LONG_STALL_MS, PREFILL, SHORT_STALL_MS,
    STALL_EVERY, TCP_ONLY, UCX_TLS,
};

/// The soak's prefill, in a child process: see [`prefill_role::serve`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill of the soak, which starts it"]
async fn soak_prefill_role() {
    prefill_role::serve().await;
}

/// One soak at a time: they share the process's heap, which each measures, and its signals.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_block_is_reused_or_reported_loaded_while_a_read_can_touch_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    soak(Wire::NATIVE_PULL, soak_faults(), 300, 1).await;
}

/// The same soak in push mode (the prefill WRITEs into the blocks the decode registered; a
/// decode of TP 1): the prefill stops mid-WRITE past the decode's registration timeout, is
/// killed with WRITEs and registrations under way, the decode aborts after registering and
/// stalls past leases while WRITEs run. No block either side frees is written after, and
/// every block reported loaded holds its request's bytes. The decode's blocks registered
/// with a killed prefill that never answered are held, never handed back (the connector
/// README's known limit), and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_mode_no_block_is_reused_or_reported_loaded_while_a_write_can_touch_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    soak(Wire::NATIVE_PUSH, soak_faults(), 300, 1).await;
}

/// The same soak in vLLM 0.33's protocol, pulling (vLLM's side channel, handshake,
/// heartbeats and finish notifications between the two Rust engines): but that no READ
/// may outlive a lease (vLLM's wire could not tell the reader; see [`Wire::lease_checked`]),
/// the same faults and checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_vllms_protocol_no_block_is_reused_or_reported_loaded_while_a_read_can_touch_it() {
    if soak_seconds().is_some() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    soak(Wire::VLLM_PULL, soak_faults(), 300, 1).await;
}

/// The push soak in vLLM 0.33's push protocol (`PUSH_REG:` registrations, `id:world`
/// completions): the same faults and checks, and the blocks of a load registered with a
/// killed prefill go back, two leases after the registration timeout, unwritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_vllms_push_protocol_no_block_is_reused_or_reported_loaded_while_a_write_can_touch_it() {
    if soak_seconds().is_some() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    soak(Wire::VLLM_PUSH, soak_faults(), 300, 1).await;
}

/// The same soak and checks against a prefill of two pipeline stages (its layers 2 + 1, each
/// stage a rank of the prefill process at its own port): each decode rank reads every layer
/// from the stage holding it, and the prefill frees a request once both stages' readers
/// notified (or its lease ended on both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_of_two_stages_frees_no_block_a_read_can_touch() {
    if soak_seconds().is_some() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    soak(Wire::NATIVE_PULL, soak_faults(), 300, 2).await;
}

/// Without faults nothing is leaked or evicted, and the heap stays flat (a long run is the
/// other test's, with `NIXL_CONNECTOR_SOAK_FAULTS=0`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_heap_stays_flat_without_faults() {
    if soak_seconds().is_some() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    soak(Wire::NATIVE_PULL, false, FAULT_FREE_REQUESTS, 1).await;
}

/// The soak on `wire`, with its faults or without, of `ci_target` requests in CI, against a
/// prefill of `prefill_pp` pipeline stages.
async fn soak(wire: Wire, faults: bool, ci_target: u64, prefill_pp: usize) {
    common::init_tracing();
    let seconds = soak_seconds();
    // A long run: requests until its time is up, the prefill restarted again and again.
    let target = seconds.map_or(ci_target, |_| u64::MAX);
    let max_restarts = match (faults, seconds) {
        (false, _) => 0,
        (true, None) => 1,
        (true, Some(_)) => u64::MAX,
    };
    let limit = Duration::from_secs(seconds.map_or(if faults { 50 } else { 150 }, |s| s + 60));
    let seconds_left =
        |started: Instant| seconds.map(|s| s.saturating_sub(started.elapsed().as_secs()));
    // Over TCP a READ's bytes need the prefill to send them: a stopped prefill holds them
    // back, and a READ handed back early lands late (over shared memory they land at once,
    // and only the READ's completion waits for the prefill). Set before any agent exists;
    // this binary's only other test is the prefill role, in its own process.
    std::env::set_var(UCX_TLS, TCP_ONLY);
    let started = Instant::now();
    let mut prefill = start_prefill(PREFILL, (prefill_pp, wire), target, seconds);
    let tp = wire.decode_tp();
    let spec = spec(tp);
    let kv = kv(wire);
    let ranks: Vec<KvConnectorWorker> = (0..tp)
        .map(|rank| {
            worker_with("dc-soak", rank, tp, &spec, |c| {
                c.kv_transfer_config = kv.clone();
                if !faults {
                    return;
                }
                // A killed prefill's engine is evicted within the run (a live one may be
                // too, between loads, and is handshaken again).
                c.kv_transfer_config
                    .kv_connector_extra_config
                    .insert("engine_ttl".into(), ENGINE_TTL_S.into());
                // Shorter than the prefill's stops, so that READs (or in push mode, the
                // prefill's WRITEs) pass it.
                c.transfer_timeout = Duration::from_millis(100);
                if wire.mode == TransferMode::Push {
                    c.kv_transfer_config
                        .kv_connector_extra_config
                        .insert("push_registration_timeout".into(), 0.15.into());
                }
            })
        })
        .collect();
    // It evicts the killed prefills as an engine does (their metadata invalidated), keeping
    // the live one in use with heartbeats of no request; longer than a decode stall.
    let padding_capability = Capability::random().unwrap();
    let hostile = worker_with("hb-soak", 0, 1, &self::spec(1), |c| {
        c.kv_transfer_config = kv.clone();
        if faults {
            c.kv_transfer_config
                .kv_connector_extra_config
                .insert("engine_ttl".into(), HOSTILE_ENGINE_TTL_S.into());
        }
    });
    handshake(&hostile, PREFILL, prefill.port).await;
    let mut d = DecodeEngine {
        scheduler: scheduler("dc-soak", (tp, 1), &ranks[0], wire),
        wire,
        ranks,
        pool: Pool::new(&spec),
        spec: spec.clone(),
        rng: Rng(0x5eed_1234_abcd_0001),
        queued: Vec::new(),
        loading: HashMap::new(),
        aborted: HashSet::new(),
        vllm_waiting: HashMap::new(),
        outlived: HashSet::new(),
        r: Report::default(),
    };
    let fds_before = open_fds().unwrap();
    let rss_before = common::status_kib("VmRSS");
    let heap_before = common::heap_in_use_kib();
    let mut memory = MemoryTrace::new(seconds, target);
    prefill.go();
    let mut next_decode_stall = Instant::now() + STALL_EVERY;
    let mut prefill_end = None;
    let mut stopped_until: Option<Instant> = None;
    let mut next_prefill_stop = 100;
    let mut last_flood = Instant::now();
    let mut step = 0u64;
    let mut generation = 0u64;
    let mut from_current = 0u64;
    loop {
        step += 1;
        if prefill_end.is_some() && d.queued.is_empty() && d.held_by_dead(generation) {
            break;
        }
        assert!(
            started.elapsed() < limit,
            "the soak did not end: {} queued, {} loading, {:?}",
            d.queued.len(),
            d.loading.len(),
            d.r
        );
        // The prefill stops for 250 ms, 100 steps or more apart, just before this step posts
        // loads from it (their READs then pass the timeout: loads already running may have
        // ended in NIXL on a loaded machine); 20 steps apart until a READ passed it.
        match stopped_until {
            Some(until) if Instant::now() >= until => {
                common::signal(&prefill.child, libc::SIGCONT);
                stopped_until = None;
            }
            None if faults
                && step >= next_prefill_stop
                && d.loads_due(step)
                && prefill_end.is_none() =>
            {
                common::signal(&prefill.child, libc::SIGSTOP);
                stopped_until = Some(Instant::now() + Duration::from_millis(250));
                next_prefill_stop = step + if d.r.overdue > 0 { 100 } else { 20 };
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
                    made,
                    params,
                } = line
                {
                    d.receive(step, generation, false, (seed, blocks, made, params));
                }
            }
            generation += 1;
            from_current = 0;
            d.r.prefill_restarts += 1;
            let engine = format!("{PREFILL}-{generation}");
            let left = target.saturating_sub(d.r.requests);
            prefill = start_prefill(&engine, (prefill_pp, wire), left, seconds_left(started));
            handshake(&hostile, &engine, prefill.port).await;
            prefill.go();
        }
        // The decode stops: alternately past the heartbeats only, and past whole leases.
        if faults && next_decode_stall <= Instant::now() && prefill_end.is_none() {
            if stopped_until.take().is_some() {
                common::signal(&prefill.child, libc::SIGCONT);
            }
            let past_lease = d.r.decode_stalls % 4 == 0 && wire.lease_checked();
            let ms = if past_lease {
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
                let line = prefill
                    .lines
                    .recv()
                    .await
                    .expect("the prefill resumes the decode");
                let at = (step, generation, past_lease);
                if take_line(line, &mut d, at, &mut from_current, &mut prefill_end) {
                    // (Sooner after a long one, so that both kinds come in CI.)
                    let wait = if past_lease {
                        STALL_EVERY / 2
                    } else {
                        STALL_EVERY
                    };
                    next_decode_stall = Instant::now() + wait;
                    break;
                }
            }
        }
        while let Ok(line) = prefill.lines.try_recv() {
            let at = (step, generation, false);
            take_line(line, &mut d, at, &mut from_current, &mut prefill_end);
        }
        // The third agent's heartbeat flood with malformed notifications, every 250 ms (more
        // often than a heartbeat's 1 s extension): one heartbeat naming the requests it
        // waits for as a vLLM decode does, in one message (far over 16 KiB).
        if last_flood.elapsed() >= FLOOD_EVERY {
            last_flood = Instant::now();
            d.r.floods += 1;
            // The third agent's engine step: it sweeps the engines idle past its TTL (the
            // killed prefills), and keeps the live one in use.
            hostile.start_load_kv(&ConnectorMetadata {
                heartbeats: vec![HeartbeatSpec {
                    engine_id: prefill.engine.clone(),
                    host: "127.0.0.1".into(),
                    port: prefill.port,
                    tp_size: 1,
                    pp_size: prefill.pp,
                    dcp_size: 1,
                    request_ids: Vec::new(),
                    capabilities: Vec::new(),
                }],
                ..ConnectorMetadata::default()
            });
            // Native heartbeats carry each request's capability tag: the waiting requests'
            // from their params (this agent stands for the decode that got them), the
            // padding's under another capability (they name no held request). vLLM's carry
            // bare ids.
            let sender = hostile.agent().name().as_bytes();
            let entry = |id: &str, cap: Option<&Capability>| match cap {
                Some(cap) => format!("{id}#{}", cap.heartbeat_tag(sender, id)),
                None => id.to_string(),
            };
            let padding_capability = match wire.protocol {
                Protocol::Vllm => None,
                _ => Some(&padding_capability),
            };
            let padding = (0..5000).map(|i| entry(&format!("{:x>48}", i), padding_capability));
            let waiting = d
                .vllm_waiting
                .iter()
                .map(|(id, cap)| entry(id, cap.as_ref()));
            let ids: Vec<String> = waiting.chain(padding).collect();
            // To every stage: the first is handshaken before the run; a later one once
            // this agent's heartbeats above handshook with it (then every flood).
            for (stage, agent) in prefill.agents.iter().enumerate() {
                for message in [
                    format!("HB:{}", ids.join(",")).into_bytes(),
                    b"HB:a,,b".to_vec(),
                    b"p1:0".to_vec(),
                    vec![0xff; 64],
                ] {
                    let sent = hostile.agent().send_notification(agent, &message);
                    match (stage, sent) {
                        (0, sent) => sent.unwrap(),
                        (_, Ok(())) => d.r.floods_to_later_stages += 1,
                        (_, Err(_)) => {}
                    }
                }
            }
        }
        d.step(step, generation);
        if memory.due(d.r.requests, started.elapsed()) {
            let workers: Vec<_> = d.ranks.iter().chain([&hostile]).collect();
            memory.push(Sample::take(
                started,
                d.r.requests,
                d.r.prefill_restarts,
                &workers,
            ));
        }
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
    // Every killed prefill's engine is evicted once idle past the TTL (each step sweeps), by
    // the decode's ranks and the third agent (which evicts the last prefill, ended, too).
    let evicted = |d: &DecodeEngine| {
        for worker in d.ranks.iter().chain([&hostile]) {
            worker.start_load_kv(&ConnectorMetadata::default());
        }
        hostile.remote_stats().evicted > d.r.prefill_restarts
            && d.ranks.iter().all(|rank| {
                let stats = rank.remote_stats();
                stats.evicted >= d.r.prefill_restarts && stats.engines <= 1
            })
    };
    if faults {
        common::wait_for(
            "the dead prefills' engines evicted",
            Duration::from_secs(10),
            || evicted(&d),
        )
        .await;
    }
    let (fds_after, rss_after) = (open_fds().unwrap(), common::status_kib("VmRSS"));
    let heap_after = common::heap_in_use_kib();
    let workers: Vec<_> = d.ranks.iter().chain([&hostile]).collect();
    memory.push(Sample::take(
        started,
        d.r.requests,
        d.r.prefill_restarts,
        &workers,
    ));
    d.r.held_by_dead = d.loading.len() as u64;
    let r = &d.r;
    eprintln!(
        "soak ({wire:?}): {:.1} s, {step} steps, {r:?}; last prefill {}: freed twice {prefill_freed_twice}, \
         late writes {prefill_late_writes}; decode fds {fds_before} -> {fds_after}, RSS \
         {rss_before} -> {rss_after} KiB, heap in use {heap_before} -> {heap_after} KiB",
        started.elapsed().as_secs_f64(),
        prefill.engine,
    );
    memory.report_and_check(faults);
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
    if prefill_pp > 1 {
        assert!(
            r.floods_to_later_stages > 0,
            "the third agent's heartbeats reached every stage: {r:?}"
        );
    }
    // Every block back, but those registered with a killed prefill in push mode (held).
    let held: usize = d.loading.values().map(|load| load.local.len()).sum();
    assert_eq!(d.pool.free.len() + held, BLOCKS, "every block back");
    assert!(
        fds_after <= fds_before + 4,
        "fds {fds_before} -> {fds_after}"
    );
    if !faults {
        assert_eq!(
            (r.overdue, r.decode_stalls, r.prefill_restarts, r.failed),
            (0, 0, 0, 0),
            "no fault: {r:?}"
        );
        let evicted: u64 = workers.iter().map(|w| w.remote_stats().evicted).sum();
        assert_eq!(evicted, 0, "no engine evicted");
        return;
    }
    assert!(r.overdue > 0, "some READs passed the timeout: {r:?}");
    assert!(
        (r.decode_stalls_past_lease > 0 || !wire.lease_checked())
            && r.decode_stalls > r.decode_stalls_past_lease,
        "the decode stalled, past a lease (where a READ past it is caught) and not: {r:?}"
    );
    assert!(
        r.waited_on_vllm_heartbeats > 0,
        "some requests waited for blocks past a lease, kept by vLLM heartbeats: {r:?}"
    );
    // A load from the killed prefill failed, or, in native push mode, registered with it
    // and is held (which of the two depends on where the kill met it).
    let held = if wire.holds_for_the_dead() {
        r.held_by_dead
    } else {
        0
    };
    assert!(
        r.prefill_restarts > 0 && r.dead_failed + held > 0 && r.loaded_after_restart > 0,
        "a prefill died with loads from it, and its successor served: {r:?}"
    );
}

/// Takes a line of the current prefill process: a request it made (at `step`, of prefill
/// `generation`; `past_lease` if made while the decode stalled past its lease) goes to the
/// decode and counts in `from_current`, its end's counts go to `prefill_end`. Whether the
/// line was `RESUMED` (the end of a decode stall).
fn take_line(
    line: Line,
    d: &mut DecodeEngine,
    (step, generation, past_lease): (u64, u64, bool),
    from_current: &mut u64,
    prefill_end: &mut Option<(u64, u64)>,
) -> bool {
    match line {
        Line::Resumed => return true,
        Line::End {
            freed_twice,
            late_writes,
        } => *prefill_end = Some((freed_twice, late_writes)),
        Line::Request {
            seed,
            blocks,
            made,
            params,
        } => {
            *from_current += 1;
            d.receive(step, generation, past_lease, (seed, blocks, made, params));
        }
    }
    false
}

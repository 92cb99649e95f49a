//! Engines of TP 2 stepping as vLLM's do, every rank's output aggregated by the scheduler
//! (vLLM's `KVOutputAggregator` before `update_connector_output`), against real NIXL:
//! - one decode rank stalled (its worker has not run the step that starts its load): the
//!   other rank's load ends and the prefill rank it read releases the request, yet there is
//!   no `Loaded` and no block to free until the stalled rank's load has ended too;
//! - the decode's scheduler and its two TP workers as three processes: the connector
//!   metadata goes to each worker process and each rank's output comes back as MessagePack.
//!
//! Both engines keep every byte of the model of `common::geometry` (MHA, 4 KV heads, HND).

mod common;

use std::io::Write;
use std::process::{Child, ChildStdin, Stdio};
use std::time::{Duration, Instant};

use nixl_connector::{
    ConnectorMetadata, ConnectorOutput, KvAttention, KvConnectorScheduler, KvConnectorWorker,
    KvLayout, KvRegionKind, KvTransferParams, LoadOutcome, SchedulerConfig, WorkerOutput,
};

use common::geometry::{engine, rank_config, Model, Request, Side};
use common::{
    after_tag, cpu_config, finished_for_decode, hex, role_process, stdout_lines, unhex, WAIT,
};

const RANK_ENV: &str = "NIXL_CONNECTOR_TEST_RANK";
/// The prefill's request and the decode's.
const PREFILL_REQUEST: &str = "req-p";
const DECODE_REQUEST: &str = "req-d";

fn model() -> Model {
    Model {
        attention: KvAttention::Mha { total_kv_heads: 4 },
        layout: KvLayout::Hnd,
        regions: vec![(KvRegionKind::Tensor, 16), (KvRegionKind::KvHalves, 8)],
    }
}

/// Both engines' side: TP 2, 4-token blocks.
fn side() -> Side {
    Side {
        tp: 2,
        block_size: 4,
        num_blocks: 12,
    }
}

/// The request of every test: three prefill blocks into three decode blocks.
fn request() -> Request {
    Request {
        id: DECODE_REQUEST.to_string(),
        remote: vec![3, 8, 1],
        local: vec![5, 0, 9],
        num_tokens: None,
    }
}

fn scheduler(engine_id: &str, port: u16) -> KvConnectorScheduler {
    KvConnectorScheduler::new(
        SchedulerConfig::new(engine_id, "127.0.0.1", port, 2, &cpu_config()).unwrap(),
    )
}

/// A prefill engine of TP 2 holding [`request`]'s blocks for a decode, with its scheduler;
/// and the params for the decode.
fn prefill() -> (
    Vec<KvConnectorWorker>,
    KvConnectorScheduler,
    KvTransferParams,
) {
    let ranks = engine("pf-tp2", &model(), &side());
    for (rank, worker) in ranks.iter().enumerate() {
        model().fill_prefill(worker, &side(), rank);
    }
    let mut scheduler = scheduler("pf-tp2", ranks[0].side_channel_addr().unwrap().port());
    let params = finished_for_decode(&mut scheduler, PREFILL_REQUEST, &request().remote);
    let meta = scheduler.build_connector_meta();
    for worker in &ranks {
        worker.start_load_kv(&meta);
    }
    (ranks, scheduler, params)
}

/// One step's output of every rank of `ranks`.
fn outputs(ranks: &[KvConnectorWorker]) -> Vec<WorkerOutput> {
    ranks.iter().map(KvConnectorWorker::output).collect()
}

/// Whether `outputs` of one step report `request` in `rank`'s finished sending or receiving.
fn reported(outputs: &[WorkerOutput], rank: usize, request: &str) -> bool {
    let finished = &outputs[rank].finished;
    finished
        .sending
        .iter()
        .chain(&finished.recving)
        .any(|r| r == request)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_rank_holds_loaded_and_free_until_both_ranks_are_done() {
    common::init_tracing();
    let (prefill, mut prefill_scheduler, params) = prefill();
    let decode = engine("dc-tp2", &model(), &side());
    for worker in &decode {
        model().fill_sentinel(worker, &side());
    }
    let mut decode_scheduler = scheduler("dc-tp2", 0);
    decode_scheduler.on_new_request(DECODE_REQUEST, Some(&params));
    decode_scheduler
        .update_state_after_alloc(DECODE_REQUEST, &request().local, &params)
        .unwrap();
    let meta = decode_scheduler.build_connector_meta();
    // Rank 1 is stalled: only rank 0 runs the step.
    decode[0].start_load_kv(&meta);

    // Rank 0's load ends and prefill rank 0 (the one it reads) releases the request; the
    // schedulers, given both ranks' outputs, report nothing.
    let (mut decode_rank0_done, mut prefill_rank0_done) = (false, false);
    let start = Instant::now();
    while !(decode_rank0_done && prefill_rank0_done) {
        assert!(start.elapsed() < WAIT, "rank 0 never finished");
        let (decode_step, prefill_step) = (outputs(&decode), outputs(&prefill));
        decode_rank0_done |= reported(&decode_step, 0, DECODE_REQUEST);
        prefill_rank0_done |= reported(&prefill_step, 0, PREFILL_REQUEST);
        assert!(!reported(&decode_step, 1, DECODE_REQUEST));
        assert!(!reported(&prefill_step, 1, PREFILL_REQUEST));
        let loaded = decode_scheduler
            .update_connector_output(&decode_step)
            .unwrap();
        let freed = prefill_scheduler
            .update_connector_output(&prefill_step)
            .unwrap();
        assert_eq!(loaded, ConnectorOutput::default(), "rank 1 has not loaded");
        assert_eq!(
            freed,
            ConnectorOutput::default(),
            "prefill rank 1 is still to be read"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The single-output path is closed: one rank's output alone is refused.
    let err = decode_scheduler
        .update_connector_output(&outputs(&decode[..1]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no output of TP rank 1"), "{err}");

    // Rank 1 catches up: now the request is loaded, and the prefill's blocks are free.
    decode[1].start_load_kv(&meta);
    let (mut loaded, mut freed) = (Vec::new(), Vec::new());
    let start = Instant::now();
    while loaded.is_empty() || freed.is_empty() {
        assert!(start.elapsed() < WAIT, "rank 1 never finished");
        let step = decode_scheduler
            .update_connector_output(&outputs(&decode))
            .unwrap();
        loaded.extend(step.load_outcomes);
        assert!(step.finished_sending.is_empty());
        let step = prefill_scheduler
            .update_connector_output(&outputs(&prefill))
            .unwrap();
        freed.extend(step.finished_sending);
        assert!(step.load_outcomes.is_empty());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        loaded,
        [LoadOutcome::Loaded {
            request_id: DECODE_REQUEST.into()
        }]
    );
    assert_eq!(freed, [PREFILL_REQUEST]);
    for (rank, worker) in decode.iter().enumerate() {
        model()
            .check_decode(worker, &side(), &side(), rank, &[&request()])
            .unwrap();
    }
}

/// A decode rank of [`the_scheduler_and_two_tp_workers_run_as_three_processes`]: takes
/// the connector metadata as MessagePack (hex) from stdin, runs it, prints its outputs
/// (`OUTPUT <hex>`, one a step) until one reports the load ended, checks every byte and
/// prints `CHECKED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a decode rank of the_scheduler_and_two_tp_workers_run_as_three_processes, which starts it"]
async fn decode_rank_role() {
    let rank: usize = std::env::var(RANK_ENV).unwrap().parse().unwrap();
    let me = KvConnectorWorker::new(rank_config("dc-3p", rank, 2, 0)).unwrap();
    me.register_host_kv_caches(model().spec(&side())).unwrap();
    model().fill_sentinel(&me, &side());
    println!("READY");
    let line = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    let meta = ConnectorMetadata::from_msgpack(&unhex(line.trim())).unwrap();
    me.start_load_kv(&meta);
    let start = Instant::now();
    loop {
        let output = me.output();
        let done = reported(std::slice::from_ref(&output), 0, DECODE_REQUEST);
        println!("OUTPUT {}", hex(&output.to_msgpack().unwrap()));
        if done {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no load ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    model()
        .check_decode(&me, &side(), &side(), rank, &[&request()])
        .unwrap();
    println!("CHECKED");
}

/// A decode rank's process: its stdin, and the outputs it prints.
struct RankProcess {
    child: Child,
    stdin: ChildStdin,
    lines: common::ChildLines,
}

impl RankProcess {
    fn start(rank: usize) -> Self {
        let rank = rank.to_string();
        let mut child = role_process("decode_rank_role", &[(RANK_ENV, &rank)], Stdio::inherit());
        let stdin = child.stdin.take().unwrap();
        let mut lines = stdout_lines(&mut child);
        after_tag(&mut lines, "READY").expect("the rank starts");
        RankProcess {
            child,
            stdin,
            lines,
        }
    }

    /// Its output of the next step (blocks until it prints it).
    fn output(&mut self) -> WorkerOutput {
        let line = after_tag(&mut self.lines, "OUTPUT ").expect("the rank prints its output");
        WorkerOutput::from_msgpack(&unhex(line.trim())).unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_and_two_tp_workers_run_as_three_processes() {
    common::init_tracing();
    let (prefill, mut prefill_scheduler, params) = prefill();
    let mut ranks: Vec<RankProcess> = (0..2).map(RankProcess::start).collect();
    let mut decode_scheduler = scheduler("dc-3p", 0);
    decode_scheduler.on_new_request(DECODE_REQUEST, Some(&params));
    decode_scheduler
        .update_state_after_alloc(DECODE_REQUEST, &request().local, &params)
        .unwrap();
    let meta = decode_scheduler
        .build_connector_meta()
        .to_msgpack()
        .unwrap();
    for rank in &mut ranks {
        writeln!(rank.stdin, "{}", hex(&meta)).unwrap();
    }

    // Each step takes one output of each rank process, until the load ended on both.
    let mut ranks = tokio::task::spawn_blocking(move || {
        let mut outcomes = Vec::new();
        let mut done = [false; 2];
        while done != [true; 2] {
            let step: Vec<WorkerOutput> = ranks
                .iter_mut()
                .zip(&done)
                .enumerate()
                .map(|(tp_rank, (rank, &done))| {
                    if done {
                        // A rank done with its load prints no more: nothing new from it.
                        WorkerOutput {
                            tp_rank,
                            ..Default::default()
                        }
                    } else {
                        rank.output()
                    }
                })
                .collect();
            for (rank, output) in step.iter().enumerate() {
                assert_eq!(output.tp_rank, rank);
                assert!(output.load_errors.is_empty(), "{:?}", output.load_errors);
                done[rank] |= reported(&step, rank, DECODE_REQUEST);
            }
            let step = decode_scheduler.update_connector_output(&step).unwrap();
            if done != [true; 2] {
                assert!(step.load_outcomes.is_empty(), "loaded before both ranks");
            }
            outcomes.extend(step.load_outcomes);
        }
        assert_eq!(
            outcomes,
            [LoadOutcome::Loaded {
                request_id: DECODE_REQUEST.into()
            }]
        );
        ranks
    })
    .await
    .unwrap();
    for rank in &mut ranks {
        after_tag(&mut rank.lines, "CHECKED").expect("the rank checks every byte");
        assert!(rank.child.wait().unwrap().success());
    }

    // Both prefill ranks were read and notified: the prefill frees the request.
    let start = Instant::now();
    loop {
        let step = prefill_scheduler
            .update_connector_output(&outputs(&prefill))
            .unwrap();
        if step.finished_sending == [PREFILL_REQUEST] {
            break;
        }
        assert!(
            start.elapsed() < WAIT,
            "the prefill never freed the request"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

//! Heterogeneous TP across processes, every byte checked against the model of
//! `common::geometry` (MHA, 4 KV heads, HND; K and V regions of different head sizes and a
//! region with K and V halves in each block):
//! - decode TP 2 against prefill TP 1, each decode rank in its own process: rank `r` reads
//!   head slice `r` of every block; the prefill holds the request after the first rank's
//!   notification and frees it after the second;
//! - prefill TP 2 (two child processes) with decode TP 1: the decode reads its first two
//!   heads from prefill rank 0 and the last two from rank 1, one READ each, and both free;
//! - prefill TP 4 (four child processes, blocks of 8 tokens) with decode TP 2 (blocks of 4):
//!   each decode rank reads two prefill ranks, a head and a half-block at a time, and all
//!   four prefill ranks free.
//!
//! Prefill rank `r` is found at the side-channel port + `r`.

mod common;

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Stdio};
use std::time::{Duration, Instant};

use nixl_connector::{KvAttention, KvConnectorWorker, KvLayout, KvRegionKind};

use common::geometry::{engine, rank_config, Model, Request, Side};
use common::{poll_until, role_process, WAIT};

const PORT_ENV: &str = "NIXL_CONNECTOR_TEST_PORT";
const RANK_ENV: &str = "NIXL_CONNECTOR_TEST_RANK";
const TP_ENV: &str = "NIXL_CONNECTOR_TEST_TP";
const BLOCK_SIZE_ENV: &str = "NIXL_CONNECTOR_TEST_BLOCK_SIZE";
const BLOCKS: usize = 12;

/// The model of every test here.
fn model() -> Model {
    Model {
        attention: KvAttention::Mha { total_kv_heads: 4 },
        layout: KvLayout::Hnd,
        regions: vec![
            (KvRegionKind::Tensor, 16),
            (KvRegionKind::Tensor, 8),
            (KvRegionKind::KvHalves, 8),
        ],
    }
}

fn side(tp: usize, block_size: usize) -> Side {
    Side {
        tp,
        block_size,
        num_blocks: BLOCKS,
    }
}

/// A role's numeric setting.
fn setting(name: &str) -> usize {
    std::env::var(name)
        .expect("run by the parent test")
        .parse()
        .unwrap()
}

/// The request every test loads: 19 tokens (ending inside a block) of 4-token blocks.
fn request(id: &str, prefill: &Side, decode: &Side) -> Request {
    let tokens: usize = 19;
    let unit = prefill.block_size.min(decode.block_size);
    Request {
        id: id.to_string(),
        remote: (0..tokens.div_ceil(prefill.block_size))
            .map(|i| (i * 5 + 3) % BLOCKS)
            .collect(),
        local: (0..(tokens.div_ceil(unit) * unit).div_ceil(decode.block_size))
            .map(|i| (i * 7 + 1) % BLOCKS)
            .collect(),
        num_tokens: Some(tokens),
    }
}

/// Loads `request` into every rank of `decodes` from the prefill engine `engine_id` (TP
/// `prefill.tp`, rank 0 at `port`) and checks every byte and the bytes moved.
async fn load_and_check(
    decodes: &[KvConnectorWorker],
    decode: &Side,
    prefill: &Side,
    (engine_id, port): (&str, u16),
    request: &Request,
) {
    let model = model();
    for worker in decodes {
        model.fill_sentinel(worker, decode);
        let from = Model::remote(request, engine_id, port, prefill.tp);
        worker
            .start_load(&request.id, &request.local, &from)
            .unwrap();
    }
    for (rank, worker) in decodes.iter().enumerate() {
        let done = poll_until(worker, WAIT, |f| !f.recving.is_empty()).await;
        assert_eq!(done.recving, [request.id.as_str()]);
        let metrics = worker.metrics();
        assert!(worker.load_errors().is_empty(), "{metrics:?}");
        model
            .check_decode(worker, prefill, decode, rank, &[request])
            .unwrap();
        let moved = model.moved_bytes(prefill, decode, rank, request);
        assert_eq!(metrics[0].bytes, moved as u64, "each byte read once");
    }
}

/// One decode rank (TP 2) of decode_tp2_reads_each_head_slice_from_prefill_tp1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a decode rank of decode_tp2_reads_each_head_slice_from_prefill_tp1, which starts it"]
async fn decode_rank_role() {
    let (port, rank) = (setting(PORT_ENV) as u16, setting(RANK_ENV));
    let (prefill, decode) = (side(1, 4), side(2, 4));
    let me = KvConnectorWorker::new(rank_config("dc-tp2", rank, 2, 0)).unwrap();
    me.register_host_kv_caches(model().spec(&decode)).unwrap();
    let request = request("req-tp", &prefill, &decode);
    let model = model();
    model.fill_sentinel(&me, &decode);
    let from = Model::remote(&request, "pf-tp1", port, 1);
    me.start_load(&request.id, &request.local, &from).unwrap();
    let done = poll_until(&me, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["req-tp"]);
    assert!(me.load_errors().is_empty(), "{:?}", me.metrics());
    model
        .check_decode(&me, &prefill, &decode, rank, &[&request])
        .unwrap();
    println!("RANK {rank} CHECKED");
}

/// Runs decode rank `rank` in a child process against the prefill at `port`, to its end.
async fn run_decode_rank(port: u16, rank: usize) {
    let (port, rank_text) = (port.to_string(), rank.to_string());
    let env = [(PORT_ENV, port.as_str()), (RANK_ENV, rank_text.as_str())];
    let child = role_process("decode_rank_role", &env, Stdio::piped());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(&format!("RANK {rank} CHECKED")),
        "decode rank {rank} failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_tp2_reads_each_head_slice_from_prefill_tp1() {
    common::init_tracing();
    let prefill_side = side(1, 4);
    let prefill = engine("pf-tp1", &model(), &prefill_side).remove(0);
    model().fill_prefill(&prefill, &prefill_side, 0);
    prefill.hold_for_decode(
        "req-tp",
        Instant::now() + Duration::from_secs(600),
        Some(&common::capability()),
    );
    let port = prefill.side_channel_addr().unwrap().port();

    // Rank 0 reads and notifies: the request stays held, for rank 1.
    run_decode_rank(port, 0).await;
    tokio::time::timeout(WAIT, prefill.notified())
        .await
        .unwrap();
    assert!(prefill.finished().sending.is_empty(), "held for rank 1");
    assert_eq!(prefill.send_stats().freed_on_notification, 0);

    // Rank 1's notification frees it.
    run_decode_rank(port, 1).await;
    tokio::time::timeout(WAIT, prefill.notified())
        .await
        .unwrap();
    assert_eq!(prefill.finished().sending, ["req-tp"]);
    let stats = prefill.send_stats();
    assert_eq!(
        (stats.freed_on_notification, stats.freed_on_timeout),
        (1, 0)
    );
}

/// One prefill rank in a child process: rank `RANK_ENV` of TP `TP_ENV` with blocks of
/// `BLOCK_SIZE_ENV` tokens, its side channel on `PORT_ENV` (0: any); fills its cache as the
/// model says, holds `req-many`, prints `PORT <port>`, and `FREED` once the decode ranks'
/// notifications free the request (60 s at most).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a prefill rank of the prefill_tp*_decode_tp* tests, which start it"]
async fn prefill_rank_role() {
    let (rank, tp, port) = (setting(RANK_ENV), setting(TP_ENV), setting(PORT_ENV));
    let side = side(tp, setting(BLOCK_SIZE_ENV));
    let worker = KvConnectorWorker::new(rank_config("pf-many", rank, tp, port as u16)).unwrap();
    if let Err(err) = worker.register_host_kv_caches(model().spec(&side)) {
        println!("NO PORT: {err}");
        return;
    }
    model().fill_prefill(&worker, &side, rank);
    worker.hold_for_decode(
        "req-many",
        Instant::now() + Duration::from_secs(600),
        Some(&common::capability()),
    );
    println!("PORT {}", worker.side_channel_addr().unwrap().port());
    let freed = poll_until(&worker, Duration::from_secs(60), |f| !f.sending.is_empty()).await;
    assert_eq!(freed.sending, ["req-many"]);
    assert_eq!(worker.send_stats().freed_on_notification, 1);
    println!("FREED");
}

/// A prefill rank's child process and its stdout.
struct PrefillRank {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl PrefillRank {
    /// The rest of the next line of its stdout that holds one of `words`, from the word on
    /// (the test harness may print before it on the same line).
    fn line(&mut self, words: &[&str]) -> Option<String> {
        self.lines.by_ref().map_while(Result::ok).find_map(|l| {
            let at = words.iter().filter_map(|w| l.find(w)).min()?;
            Some(l[at..].to_string())
        })
    }
}

/// Starts the TP-`prefill.tp` prefill engine as one child process per rank, rank `r` on
/// rank 0's port + `r` (another run of ports when one is taken); the ranks and rank 0's port.
fn start_prefill(prefill: &Side) -> (Vec<PrefillRank>, u16) {
    let start = |rank: usize, port: u16| {
        let env = [
            (RANK_ENV, rank.to_string()),
            (TP_ENV, prefill.tp.to_string()),
            (PORT_ENV, port.to_string()),
            (BLOCK_SIZE_ENV, prefill.block_size.to_string()),
        ];
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut child = role_process("prefill_rank_role", &env, Stdio::null());
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        PrefillRank { child, lines }
    };
    for _ in 0..10 {
        let mut ranks = vec![start(0, 0)];
        let line = ranks[0].line(&["PORT "]).expect("rank 0 prints its port");
        let port: u16 = line[5..].trim().parse().unwrap();
        let mut listening = true;
        for rank in 1..prefill.tp {
            let mut next = start(rank, port + rank as u16);
            listening = next
                .line(&["PORT ", "NO PORT"])
                .is_some_and(|line| line.starts_with("PORT "));
            ranks.push(next);
            if !listening {
                break;
            }
        }
        if listening {
            return (ranks, port);
        }
        for mut rank in ranks {
            let _ = rank.child.kill();
            let _ = rank.child.wait();
        }
    }
    panic!("no {} free ports in a row in 10 tries", prefill.tp);
}

/// Prefill TP `prefill.tp` in child processes, decode TP `decode.tp` in this one: every
/// decode rank loads `req-many`, every byte is checked, and every prefill rank frees it.
async fn prefill_in_processes(prefill: Side, decode: Side) {
    common::init_tracing();
    let (ranks, port) = start_prefill(&prefill);
    let decodes = engine("dc-many", &model(), &decode);
    let request = request("req-many", &prefill, &decode);
    load_and_check(&decodes, &decode, &prefill, ("pf-many", port), &request).await;
    for (rank, mut prefill_rank) in ranks.into_iter().enumerate() {
        let freed = tokio::task::spawn_blocking(move || {
            let freed = prefill_rank.line(&["FREED"]).is_some();
            (freed, prefill_rank.child.wait().unwrap())
        });
        let (freed, status) = tokio::time::timeout(WAIT, freed).await.unwrap().unwrap();
        assert!(freed && status.success(), "prefill rank {rank}: {status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp2_in_two_processes_serves_decode_tp1() {
    prefill_in_processes(side(2, 4), side(1, 4)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp4_in_four_processes_serves_decode_tp2_with_smaller_blocks() {
    prefill_in_processes(side(4, 8), side(2, 4)).await;
}

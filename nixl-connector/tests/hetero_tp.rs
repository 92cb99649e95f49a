//! Heterogeneous TP. Decode TP 2 against prefill TP 1, each decode rank in its own process:
//! rank `r` reads head slice `r` of every block (HND: contiguous), checked byte for byte;
//! the prefill holds the request after the first rank's notification and frees it after
//! the second. Prefill rank `r` is found at the side-channel port + `r`. A decode with a
//! smaller TP than its prefill is refused.

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_connector::{Error, KvConnectorWorker, WorkerConfig};

use common::{block, fill, pattern, poll_until, remote, role_process, spec, worker, WAIT};

const PORT_ENV: &str = "NIXL_CONNECTOR_TEST_PREFILL_PORT";
const RANK_ENV: &str = "NIXL_CONNECTOR_TEST_DECODE_RANK";
const PREFILL_HEADS: usize = 4;
const REMOTE: [usize; 3] = [11, 4, 0];
const LOCAL: [usize; 3] = [1, 2, 3];

/// One decode rank (TP 2), run in a child process by the test below.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a decode rank of decode_tp2_reads_each_head_slice_from_prefill_tp1, which starts it"]
async fn decode_rank_role() {
    let port: u16 = std::env::var(PORT_ENV)
        .expect("run by the parent test")
        .parse()
        .unwrap();
    let rank: usize = std::env::var(RANK_ENV).unwrap().parse().unwrap();
    let spec = spec(PREFILL_HEADS / 2);
    let decode = worker("dc-tp2", rank, 2, spec);
    let mut from = remote(&decode, "pf-tp1", "req-tp", REMOTE.to_vec(), 1);
    from.port = port;
    decode.start_load("dec-tp", &LOCAL, &from).unwrap();
    let done = poll_until(&decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["dec-tp"]);
    assert!(decode.load_errors().is_empty(), "{:?}", decode.metrics());
    let slice = spec.block_len();
    for layer in 0..spec.num_layers {
        for (&local, &far) in LOCAL.iter().zip(&REMOTE) {
            let want: Vec<u8> = (rank * slice..(rank + 1) * slice)
                .map(|o| pattern(layer, far, o))
                .collect();
            assert_eq!(
                block(&decode, &spec, layer, local),
                want,
                "rank {rank} layer {layer} block {local}"
            );
        }
    }
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
    let spec = spec(PREFILL_HEADS);
    let prefill = worker("pf-tp1", 0, 1, spec);
    fill(&prefill, &spec);
    prefill.hold_for_decode("req-tp", Instant::now() + Duration::from_secs(600));
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

/// Prefill ranks 0 and 1 of a TP-2 engine, rank `r` listening on rank 0's port + `r`.
fn prefill_tp2(spec: nixl_connector::KvCacheSpec) -> [KvConnectorWorker; 2] {
    for _ in 0..20 {
        let rank0 = worker("pf-ports", 0, 2, spec);
        let port = rank0.side_channel_addr().unwrap().port();
        let Some(next) = port.checked_add(1) else {
            continue;
        };
        let mut config = WorkerConfig::new("pf-ports", 1, 2, common::cpu_config());
        config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
        config.side_channel.set_port(next);
        let rank1 = KvConnectorWorker::new(config).unwrap();
        // The port above rank 0's may be taken: then try another pair.
        if rank1.register_host_kv_caches(spec).is_ok() {
            return [rank0, rank1];
        }
    }
    panic!("no two free ports in a row in 20 tries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_rank_r_is_found_at_the_side_channel_port_plus_r() {
    common::init_tracing();
    let spec = spec(2);
    let [rank0, rank1] = prefill_tp2(spec);
    // Rank 1's blocks differ from rank 0's in every byte.
    fill(&rank0, &spec);
    let cache = rank1.kv_caches().unwrap();
    for layer in 0..spec.num_layers {
        let len = spec.block_len();
        for b in 0..spec.num_blocks {
            let data: Vec<u8> = (0..len).map(|o| !pattern(layer, b, o)).collect();
            cache.write(layer, b * len, &data).unwrap();
        }
    }
    // Decode rank 1 (TP 2) is given rank 0's port, and reads from rank 1.
    let decode = worker("dc-ports", 1, 2, spec);
    let from = remote(&rank0, "pf-ports", "r", vec![7], 2);
    decode.start_load("r", &[0], &from).unwrap();
    poll_until(&decode, WAIT, |f| !f.recving.is_empty()).await;
    assert!(decode.load_errors().is_empty(), "{:?}", decode.metrics());
    let want: Vec<u8> = (0..spec.block_len()).map(|o| !pattern(1, 7, o)).collect();
    assert_eq!(block(&decode, &spec, 1, 0), want);
}

/// Refused for now: the geometry work will let a decode with a smaller TP read from several
/// prefill ranks, and this test will then check that it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_with_a_smaller_tp_than_its_prefill_is_refused() {
    let spec = spec(2);
    let prefill = worker("pf-larger", 0, 2, spec);
    let decode = worker("dc-smaller", 0, 1, spec);
    let port = prefill.side_channel_addr().unwrap().port();
    let refused = |result: nixl_connector::Result<()>| match result {
        Err(Error::InvalidArgument { reason, .. }) => assert_eq!(
            reason,
            "this rank 0 of TP 1 cannot read from a peer of TP 2: the reader's TP must be a \
             multiple of the peer's (reading from a larger TP is not supported)"
        ),
        other => panic!("expected the smaller TP to be refused, got {other:?}"),
    };
    refused(decode.start_load("r", &[0], &remote(&prefill, "pf-larger", "r", vec![0], 2)));
    refused(
        decode
            .handshake_with("pf-larger", "127.0.0.1", port, 2)
            .await,
    );
    assert_eq!(decode.finished(), Default::default());
}

//! Decode TP 2 against prefill TP 1, each decode rank in its own process: rank `r` reads
//! head slice `r` of every block (HND: contiguous), checked byte for byte; the prefill
//! frees the request once both ranks notified.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{block, fill, pattern, poll_until, remote, role_process, spec, worker};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_tp2_reads_each_head_slice_from_prefill_tp1() {
    common::init_tracing();
    let spec = spec(PREFILL_HEADS);
    let prefill = worker("pf-tp1", 0, 1, spec);
    fill(&prefill, &spec);
    let held_at = Instant::now();
    prefill.hold_for_decode("req-tp", held_at + Duration::from_secs(60));
    let port = prefill.side_channel_addr().unwrap().port();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let (port, rank) = (port.to_string(), rank.to_string());
            let env = [(PORT_ENV, port.as_str()), (RANK_ENV, rank.as_str())];
            role_process("decode_rank_role", &env, Stdio::piped())
        })
        .collect();
    let outputs: Vec<_> = tokio::task::spawn_blocking(move || {
        children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect()
    })
    .await
    .unwrap();
    for (rank, out) in outputs.iter().enumerate() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("RANK {rank} CHECKED")),
            "decode rank {rank} failed: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let freed = poll_until(&prefill, Duration::from_secs(10), |f| !f.sending.is_empty()).await;
    assert_eq!(freed.sending, ["req-tp"]);
    assert_eq!(
        prefill.send_stats().freed_on_notification,
        1,
        "freed once, after both ranks"
    );
}

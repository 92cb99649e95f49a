//! One prefill and one decode in one process: every byte checked, the prefill frees the
//! blocks on the notification well before the timeout, and a decode that never reads lets
//! the prefill free them after the timeout.

mod common;

use std::time::{Duration, Instant};

use common::{block, fill, pattern, poll_until, remote, spec, worker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_reads_every_byte_and_prefill_frees_on_the_notification() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("pf-one", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker("dc-one", 0, 1, &spec);

    let abort_timeout = Duration::from_secs(30);
    let held_at = Instant::now();
    prefill.hold_for_decode(
        "req-7",
        held_at + abort_timeout,
        Some(&common::capability()),
    );
    let remote_blocks = vec![5, 2, 9, 15];
    let local_blocks = [0, 1, 2, 3];
    decode
        .start_load(
            "dec-7",
            &local_blocks,
            &remote(&prefill, "pf-one", "req-7", remote_blocks.clone(), 1),
        )
        .unwrap();

    let done = poll_until(&decode, Duration::from_secs(10), |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["dec-7"]);
    assert!(decode.load_errors().is_empty());
    for layer in 0..spec.num_regions() {
        for (&local, &far) in local_blocks.iter().zip(&remote_blocks) {
            let got = block(&decode, &spec, layer, local);
            let want: Vec<u8> = (0..spec.block_len(0))
                .map(|o| pattern(layer, far, o))
                .collect();
            assert_eq!(
                got, want,
                "layer {layer} local block {local} (remote {far})"
            );
        }
    }
    // Blocks not loaded stay zero.
    assert!(block(&decode, &spec, 0, 4).iter().all(|&b| b == 0));

    let metrics = decode.metrics();
    assert_eq!(metrics.len(), 1);
    assert_eq!(metrics[0].descriptors, spec.num_regions() * 4);
    assert_eq!(
        metrics[0].bytes as usize,
        spec.num_regions() * 4 * spec.block_len(0)
    );
    assert!(metrics[0].failure.is_none());

    // The prefill sleeps until the notification arrives, then finds the request released.
    tokio::time::timeout(Duration::from_secs(10), prefill.notified())
        .await
        .expect("the decode's notification wakes the prefill");
    assert_eq!(prefill.finished().sending, ["req-7"]);
    assert!(
        held_at.elapsed() < abort_timeout / 4,
        "freed after {:?}",
        held_at.elapsed()
    );
    assert_eq!(prefill.send_stats().freed_on_notification, 1);
    assert_eq!(prefill.send_stats().freed_on_timeout, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_dropped_before_reading_lets_prefill_free_after_the_timeout() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("pf-drop", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker("dc-drop", 0, 1, &spec);
    drop(decode);

    let timeout = Duration::from_millis(800);
    let held_at = Instant::now();
    prefill.hold_for_decode("req-1", held_at + timeout, Some(&common::capability()));
    assert!(
        prefill.finished().sending.is_empty(),
        "not freed before the timeout"
    );
    let freed = poll_until(&prefill, Duration::from_secs(5), |f| !f.sending.is_empty()).await;
    assert_eq!(freed.sending, ["req-1"]);
    assert!(held_at.elapsed() >= timeout);
    assert_eq!(prefill.send_stats().freed_on_timeout, 1);
    assert_eq!(prefill.send_stats().freed_on_notification, 0);
}

//! `transfer_timeout`: a READ still in flight when it passes fails the load with
//! `Error::TransferTimeout`, exactly its blocks in `load_errors`; the READ itself is left to
//! NIXL's completion driver, which releases it once the source lets it finish.

mod common;

use std::time::Duration;

use common::{
    fill, handshake, poll_until, progress_until, remote, spec, stalled_worker, worker_with, WAIT,
};
use nixl_connector::Error;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_past_the_transfer_timeout_fails_its_load_with_the_timeout() {
    common::init_tracing();
    const TIMEOUT: Duration = Duration::from_millis(500);
    let spec = spec(2);
    // The prefill's agent makes no progress until polled: the READ cannot finish.
    let prefill = stalled_worker("pf-stalled", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker_with("dc-timeout", 0, 1, &spec, |c| c.transfer_timeout = TIMEOUT);
    handshake(
        &decode,
        "pf-stalled",
        prefill.side_channel_addr().unwrap().port(),
    )
    .await;

    decode
        .start_load(
            "late",
            &[1, 2],
            &remote(&prefill, "pf-stalled", "late", vec![5, 6], 1),
        )
        .unwrap();
    let done = poll_until(&decode, WAIT, |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["late"]);
    assert_eq!(decode.load_errors(), [1, 2]);
    let metrics = decode.metrics();
    let timeout = Error::TransferTimeout {
        request_id: "late".to_string(),
        deadline: TIMEOUT,
    };
    assert_eq!(
        metrics[0].failure.as_deref(),
        Some(timeout.to_string().as_str())
    );
    assert!(metrics[0].duration >= TIMEOUT, "{:?}", metrics[0].duration);

    // The READ was never given up: once the prefill progresses it finishes, and the
    // driver releases it (nothing leaked).
    let agent = decode.agent();
    assert_eq!(agent.driver_stats().held, 1, "{:?}", agent.driver_stats());
    progress_until(&prefill, "the timed-out READ to finish", || {
        agent.driver_stats().held == 0
    })
    .await;
    assert_eq!(agent.leak_stats(), nixl::LeakStats::default());
}

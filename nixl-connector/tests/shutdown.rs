//! A program that ends its workers and calls `std::process::exit` while its tokio runtime
//! still runs must not crash: NIXL's UCX backend torn down on a runtime thread raced UCX's
//! exit-time cleanup and segfaulted in about 1 run in 5. Each case runs 50 times, each run a
//! child process that loads blocks between two workers (so UCX has connections to tear
//! down), ends both workers and exits at once:
//! - `shutdown().await`, which destroys each agent before it returns;
//! - a plain drop, whose agents the runtime destroys later (nixl's exit guard lets the exit
//!   wait for a destruction under way, and leaves one not yet started to the exit).
//!
//! And `shutdown()` returns only once the agent is destroyed, also when a READ is still in
//! flight as it is called.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::loads::load;
use common::{
    fill, filled_prefill_and_decode, handshake, progress_until, remote, role_process, spec,
    stalled_worker, worker_with,
};

const MODE_ENV: &str = "NIXL_CONNECTOR_TEST_END";
const RUNS: usize = 50;
/// Children at once.
const BATCH: usize = 5;

/// A child: loads, ends both workers as `NIXL_CONNECTOR_TEST_END` says, and exits with
/// status 0 while the runtime runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child of the tests below, which start it"]
async fn end_and_exit_role() {
    let (spec, prefill, decode) = filled_prefill_and_decode("pf-end", "dc-end");
    // The prefill listens for the decode's notification: a task of the runtime holds its
    // agent, so that dropping the worker leaves the agent's end to that task.
    prefill.hold_for_decode(
        "r",
        Instant::now() + Duration::from_secs(60),
        Some(&common::capability()),
    );
    load(&decode, &prefill, &spec, "pf-end", "r", (&[0, 1], &[2, 3]))
        .await
        .unwrap();
    match std::env::var(MODE_ENV).unwrap().as_str() {
        "shutdown" => {
            decode.shutdown().await;
            prefill.shutdown().await;
        }
        _ => {
            drop(decode);
            drop(prefill);
        }
    }
    std::process::exit(0);
}

/// Runs the role [`RUNS`] times with `mode`; every run must exit with status 0.
async fn run_many(mode: &'static str) {
    let start = Instant::now();
    let mut failures = Vec::new();
    for batch in 0..RUNS / BATCH {
        let children: Vec<_> = (0..BATCH)
            .map(|_| role_process("end_and_exit_role", &[(MODE_ENV, mode)], Stdio::piped()))
            .collect();
        for (i, child) in children.into_iter().enumerate() {
            let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
                .await
                .unwrap();
            if !out.status.success() {
                failures.push(format!(
                    "run {}: {} {}",
                    batch * BATCH + i,
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {RUNS} runs ({mode}) crashed or failed in {:?}:\n{}",
        failures.len(),
        start.elapsed(),
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_then_exit_never_crashes() {
    run_many("shutdown").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_then_exit_never_crashes() {
    run_many("drop").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_once_the_agent_is_destroyed_after_a_read_in_flight() {
    common::init_tracing();
    let spec = spec(2);
    // The prefill's agent makes no progress until polled: the decode's READ stays in flight.
    let prefill = stalled_worker("pf-sd", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker_with("dc-sd", 0, 1, &spec, |c| {
        c.transfer_timeout = Duration::from_millis(300)
    });
    let port = prefill.side_channel_addr().unwrap().port();
    handshake(&decode, "pf-sd", port).await;
    decode
        .start_load("r", &[1, 2], &remote(&prefill, "pf-sd", "r", vec![5, 6], 1))
        .unwrap();
    let destroyed = Arc::new(AtomicBool::new(false));
    let flag = destroyed.clone();
    decode
        .agent()
        .on_destroyed(move || flag.store(true, Ordering::SeqCst));

    // The READ finishes only once the prefill progresses, well after shutdown was called.
    let (destroyed_when_returned, ()) = tokio::join!(
        async {
            decode.shutdown().await;
            destroyed.load(Ordering::SeqCst)
        },
        async {
            tokio::time::sleep(Duration::from_millis(800)).await;
            progress_until(&prefill, "the decode's agent to be destroyed", || {
                destroyed.load(Ordering::SeqCst)
            })
            .await;
        }
    );
    assert!(
        destroyed_when_returned,
        "shutdown returned before the agent was destroyed"
    );
}

//! An engine's steps around one request: its load from a remote engine, to its end, and
//! the release of the blocks it lends.

use std::time::{Duration, Instant};

use nixl_connector::{KvConnectorScheduler, KvConnectorWorker, KvTransferParams, LoadOutcome};

/// Schedules request `id` to load each KV cache group's `local` blocks with `params` (a
/// remote prefill's, or a decode's kept blocks read back) and steps `scheduler` over
/// `ranks` until the load ends, waiting at most `wait`.
///
/// # Errors
/// Why the connector refused the request, a step's failure, an outcome other than loaded,
/// or the wait passing first.
pub(super) async fn load(
    scheduler: &mut KvConnectorScheduler,
    ranks: &[KvConnectorWorker],
    id: &str,
    local: &[&[usize]],
    params: &KvTransferParams,
    wait: Duration,
) -> Result<(), String> {
    scheduler.on_new_request(id, Some(params));
    scheduler
        .update_state_after_alloc_groups(id, local, params)
        .map_err(|err| err.to_string())?;
    let start = Instant::now();
    loop {
        let output = scheduler.step(ranks).map_err(|err| err.to_string())?;
        if let Some(outcome) = output.load_outcomes.into_iter().next() {
            return match outcome {
                LoadOutcome::Loaded { request_id } if request_id == id => Ok(()),
                other => Err(format!("the load failed: {other:?}")),
            };
        }
        if start.elapsed() > wait {
            return Err(format!("request {id}'s load did not end"));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Steps `scheduler` over `ranks` until the blocks request `id` lends (a prefill's, or a
/// decode's kept ones) are released, or `wait` passed; whether they were.
///
/// # Panics
/// If a scheduler step fails.
pub(super) async fn released(
    scheduler: &mut KvConnectorScheduler,
    ranks: &[KvConnectorWorker],
    id: &str,
    wait: Duration,
) -> bool {
    let start = Instant::now();
    while start.elapsed() < wait {
        let output = scheduler.step(ranks).expect("a scheduler step");
        if output.finished_sending.iter().any(|r| r == id) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

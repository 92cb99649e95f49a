//! The decode's timed load of a request's blocks from the prefill, on a connection
//! handshaken before.

use std::time::{Duration, Instant};

use nixl_connector::{FinishStatus, KvTransferParams, LoadOutcome};

use crate::engine::Engine;

/// How long a load may take before the run fails.
const DEADLINE: Duration = Duration::from_secs(30);

/// Loads request `id` of `params` into the decode's `blocks`, and how long that took: the
/// scheduler's steps from the request's arrival until [`LoadOutcome::Loaded`], with the
/// READ posted and completed (its notification to the prefill rides on it) in between. The
/// request is then finished, as the engine would once it ran.
///
/// # Errors
/// If the connector refused the load, the load failed, or it did not end in time.
pub async fn load(
    decode: &mut Engine,
    id: &str,
    params: &KvTransferParams,
    blocks: &[usize],
) -> Result<Duration, String> {
    let start = Instant::now();
    decode.scheduler.on_new_request(id, Some(params));
    decode
        .scheduler
        .update_state_after_alloc(id, blocks, params)
        .map_err(|e| e.to_string())?;
    loop {
        let mut output = decode
            .scheduler
            .step(&decode.ranks)
            .map_err(|e| e.to_string())?;
        match output.load_outcomes.pop() {
            Some(LoadOutcome::Loaded { .. }) => break,
            Some(other) => return Err(format!("the load of {id} failed: {other:?}")),
            None if start.elapsed() > DEADLINE => {
                return Err(format!("the load of {id} did not end in {DEADLINE:?}"))
            }
            None => {
                // Woken when a load ends; the deadline above catches one that never does.
                let _ = tokio::time::timeout(DEADLINE, decode.ranks[0].load_ended()).await;
            }
        }
    }
    let elapsed = start.elapsed();
    decode
        .scheduler
        .request_finished(id, &[], 0, None, FinishStatus::LengthCapped);
    Ok(elapsed)
}

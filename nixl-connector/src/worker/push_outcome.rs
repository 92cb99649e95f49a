//! How a push load ended, from how each prefill rank's part ended (both protocols).

use crate::error::{Error, Result};
use crate::transport::push_wire::PushEnd;
use crate::worker::load::Load;

/// A load's outcome from its ranks' `ends`: loaded only when every one was written.
pub(crate) fn outcome(
    load: &Load,
    ends: &[(String, Option<PushEnd>)],
    timed_out: Option<std::time::Duration>,
) -> Result<()> {
    let not_written = ends.iter().find(|(_, end)| *end != Some(PushEnd::Written));
    match (not_written, timed_out) {
        (None, _) => Ok(()),
        (Some(_), Some(deadline)) => Err(Error::TransferTimeout {
            request_id: load.request_id.clone(),
            deadline,
        }),
        (Some((agent, end)), None) => Err(Error::PushNotWritten {
            request_id: load.request_id.clone(),
            engine: load.remote.engine_id.clone(),
            agent: agent.clone(),
            end: end.map_or("none", PushEnd::as_str).to_string(),
        }),
    }
}

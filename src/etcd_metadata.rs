//! Metadata through etcd with NIXL's own etcd support: publish once, fetch by agent name.

use std::time::{Duration, Instant};

use nixl::{Agent, MetadataPeer};

use crate::error::{Error, Result};

/// Asks etcd (through NIXL) for `remote`'s metadata and waits until NIXL has loaded it.
///
/// # Errors
/// NIXL's error when the fetch cannot start; [`Error::Timeout`] when the metadata does not
/// arrive within `timeout` (the peer has not published it, or etcd is unreachable).
pub fn fetch(agent: &Agent, remote: &str, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    agent.fetch_remote_metadata(remote, &MetadataPeer::Etcd)?;
    while !agent.has_remote_metadata(remote)? {
        if start.elapsed() >= timeout {
            return Err(Error::Timeout(format!(
                "agent {remote:?}'s metadata did not arrive from etcd within {timeout:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    tracing::debug!(%remote, waited = ?start.elapsed(), "loaded metadata from etcd");
    Ok(())
}

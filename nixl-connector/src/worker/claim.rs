//! A read-back's claim (multi-turn, native protocol). Before a load reads a decode's blocks
//! kept for the next turn, it claims them in a handshake with each remote rank holding the
//! request ([`HandshakeMessage::claims`]). A rank that still holds them keeps them for this
//! reader from then on (never released early past the cap on kept blocks, and its TTL
//! becomes a lease the reader's heartbeats extend) and says so in
//! [`HandshakeMessage::claimed`]; one that no longer holds them (their TTL ended, or they
//! were evicted) leaves them out, and nothing is read: the tokens are recomputed.

use futures::future::try_join_all;

use crate::config::Protocol;
use crate::error::{Error, Result};
use crate::transport::handshake::{HandshakeMessage, KeptClaim};
use crate::worker::connect::fetch;
use crate::worker::load::Load;
use crate::worker::shared::Shared;

/// Whether `load` must claim its blocks before it reads: kept blocks to read, in the native
/// protocol (vLLM's readers read kept blocks until their expiry time instead).
pub(crate) fn needs_claim(shared: &Shared, load: &Load) -> bool {
    shared.protocol == Protocol::Native && load.remote.kept && !load.local_block_ids.is_empty()
}

/// Claims `load`'s kept blocks on every remote rank holding them, together.
///
/// # Errors
/// [`Error::KeptBlocksGone`] for a rank that no longer holds them (or a load whose params
/// have no capability to claim them with), and the errors of a handshake.
pub(crate) async fn claim(shared: &Shared, load: &Load) -> Result<()> {
    let remote = &load.remote;
    let gone = |rank: usize| Error::KeptBlocksGone {
        request_id: remote.request_id.clone(),
        engine: remote.engine_id.clone(),
        rank,
    };
    let capability = remote.capability.as_ref().ok_or_else(|| gone(0))?;
    let caches = shared.caches.get().ok_or(Error::NotRegistered {
        operation: "claim kept blocks",
    })?;
    let agent = shared.setup.agent().name();
    let ours = HandshakeMessage {
        claims: vec![KeptClaim {
            request_id: remote.request_id.clone(),
            tag: capability.heartbeat_tag(agent.as_bytes(), &remote.request_id),
        }],
        ..(*caches.handshake).clone()
    };
    try_join_all(load.ranks.iter().map(|&(rank, port)| {
        let ours = &ours;
        async move {
            let theirs = fetch(shared, ours, load.engine(), rank, port).await?;
            if theirs.claimed.contains(&remote.request_id) {
                Ok(())
            } else {
                Err(gone(rank))
            }
        }
    }))
    .await?;
    Ok(())
}

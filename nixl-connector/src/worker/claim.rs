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
use crate::transport::params::RemoteBlocks;
use crate::worker::connect::{fetch, Engine};
use crate::worker::shared::Shared;

/// Whether a load from `remote` that reads (`reads`) must claim its blocks first: kept
/// blocks, in the native protocol (vLLM's readers read kept blocks until their expiry time
/// instead).
pub(crate) fn needs_claim(shared: &Shared, remote: &RemoteBlocks, reads: bool) -> bool {
    shared.protocol == Protocol::Native && remote.kept && reads
}

/// Claims `remote`'s kept blocks on every rank of `engine` holding them (`ranks`, each with
/// its side-channel port), together.
///
/// # Errors
/// [`Error::KeptBlocksGone`] for a rank that no longer holds them (or a load whose params
/// have no capability to claim them with), and the errors of a handshake.
pub(crate) async fn claim(
    shared: &Shared,
    remote: &RemoteBlocks,
    engine: Engine<'_>,
    ranks: &[(usize, u16)],
) -> Result<()> {
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
    try_join_all(ranks.iter().map(|&(rank, port)| {
        let ours = &ours;
        async move {
            let theirs = fetch(shared, ours, engine, rank, port).await?;
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

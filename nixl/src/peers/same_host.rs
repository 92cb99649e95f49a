//! Peers' same-host transports on this host, for agents that refuse them.
//!
//! Cross-memory attach, POSIX and System V shared-memory FIFOs and XPMEM name a process (or
//! its segment) on a host. A peer's metadata is a claim: offering one of them on this host,
//! it can name any process here that this one may reach, and a READ or WRITE to the peer
//! then moves that process's memory into or out of this process's memory, which the peer
//! reads or writes in turn. Cross-host peers' addresses name their own host, which UCX
//! never reaches through these transports.

use crate::error::{Error, Result};
use crate::peers::local_peers;
use crate::peers::wire::{Destination, Host, PeerMetadata};

/// The host of a same-host transport address, with the transport's name.
fn same_host(dest: &Destination) -> Option<(Host, &'static str)> {
    match dest {
        Destination::Cma { host, .. } => Some((*host, "cma")),
        Destination::PosixProc { host, .. } | Destination::PosixNamed { host, .. } => {
            Some((*host, "posix"))
        }
        Destination::Sysv { host, .. } => Some((*host, "sysv")),
        Destination::Xpmem { host, .. } => Some((*host, "xpmem")),
        _ => None,
    }
}

/// Refuses `peer`'s metadata if it offers a same-host transport on a host (and namespace)
/// of this process's workers.
///
/// # Errors
/// [`Error::SameHostTransportRefused`] naming the first such transport.
pub(crate) fn refuse(peer: &PeerMetadata<'_>) -> Result<()> {
    let Some(worker) = &peer.worker else {
        return Ok(());
    };
    let ours: Vec<(Host, &str)> = local_peers::live_agents()
        .iter()
        .flat_map(|agent| agent.workers.iter())
        .flat_map(|worker| worker.destinations.iter())
        .filter_map(same_host)
        .collect();
    let offered = worker.destinations.iter().find_map(|dest| {
        let (host, transport) = same_host(dest)?;
        ours.iter()
            .any(|(h, t)| *h == host && *t == transport)
            .then_some(transport)
    });
    match offered {
        Some(transport) => Err(Error::SameHostTransportRefused {
            agent: peer.name.to_string(),
            transport: format!("a UCX {transport} address"),
        }),
        None => Ok(()),
    }
}

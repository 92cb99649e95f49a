//! Remote ranks this worker reads from: one handshake each, run by the first load that
//! needs it (in the background), then their prepared descriptor list is reused.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use nixl::{PreparedRemote, RemoteDescList, XferDesc};
use tokio::sync::OnceCell;

use crate::error::{Error, Result};
use crate::handshake::{check_compatible, ReadPlan};
use crate::side_channel::fetch_handshake;
use crate::worker::Shared;

/// A remote rank after a successful handshake.
#[derive(Debug)]
pub(crate) struct Remote {
    /// Its layer-major block list (descriptor `layer * remote_num_blocks + block`), each
    /// descriptor this rank's head slice of the block.
    pub(crate) prepared: PreparedRemote,
    /// How its blocks are read.
    pub(crate) plan: ReadPlan,
}

/// A remote rank's slot: empty until a handshake with it succeeds.
type Slot = Arc<OnceCell<Arc<Remote>>>;

/// Remote ranks by engine id and rank.
#[derive(Default)]
pub(crate) struct Remotes {
    map: Mutex<HashMap<(String, usize), Slot>>,
}

impl Remotes {
    /// The remote rank `rank` of `engine` at `host:port`, handshaking first if no load has
    /// yet. A failed handshake is retried by the next load.
    pub(crate) async fn get(
        &self,
        shared: &Shared,
        engine: &str,
        rank: usize,
        host: &str,
        port: u16,
    ) -> Result<Arc<Remote>> {
        let cell = self
            .map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((engine.to_string(), rank))
            .or_default()
            .clone();
        cell.get_or_try_init(|| connect(shared, engine, rank, host, port))
            .await
            .cloned()
    }
}

async fn connect(
    shared: &Shared,
    engine: &str,
    rank: usize,
    host: &str,
    port: u16,
) -> Result<Arc<Remote>> {
    let caches = shared.caches.get().ok_or(Error::NotRegistered {
        operation: "handshake",
    })?;
    let addr = resolve(host, port).await?;
    let ours = &caches.handshake;
    let theirs = fetch_handshake(addr, ours, shared.config.limits).await?;
    let plan = check_compatible(ours, &theirs, Some(engine), Some(rank))?;
    let agent = shared.setup.agent();
    let name = agent.load_remote_metadata(&theirs.agent_metadata)?;
    if name != theirs.agent_name {
        return Err(Error::Incompatible {
            reader: format!("engine {:?} rank {}", ours.engine_id, ours.tp_rank),
            source_rank: format!("engine {engine:?} rank {rank}"),
            reason: format!(
                "its metadata names agent {name:?}, its handshake {:?}",
                theirs.agent_name
            ),
        });
    }
    let mut descs = Vec::with_capacity(theirs.layer_base_addrs.len() * plan.remote_num_blocks);
    for &base in &theirs.layer_base_addrs {
        for block in 0..plan.remote_num_blocks {
            let addr = base as usize + block * plan.remote_block_len + plan.slice_offset;
            descs.push(XferDesc::new(addr, plan.slice_len, theirs.device_id));
        }
    }
    let list = RemoteDescList::from_vec(caches.registration.mem_type(), descs)?;
    let backends: Vec<&nixl::Backend> = shared.setup.backends().iter().collect();
    let prepared = agent.prepare_remote(&name, &list, &backends)?;
    tracing::info!(engine, rank, agent = %name, blocks = plan.remote_num_blocks, slice_offset = plan.slice_offset, "handshake done");
    Ok(Arc::new(Remote { prepared, plan }))
}

async fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let peer = format!("{host}:{port}");
    tokio::net::lookup_host((host, port))
        .await
        .map_err(|err| Error::io("resolve the side channel", &peer, err))?
        .next()
        .ok_or_else(|| {
            Error::io(
                "resolve the side channel",
                &peer,
                std::io::Error::other("no address"),
            )
        })
}

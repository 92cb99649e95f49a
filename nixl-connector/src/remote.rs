//! Remote ranks this worker reads from: one handshake each, run by the first load that
//! needs it (in the background), then their prepared descriptor list is reused.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use futures::future::{BoxFuture, FutureExt, Shared};
use nixl::{PreparedRemote, RemoteDescList, XferDesc};

use crate::config::MetadataExchange;
use crate::error::{Error, Result};
use crate::handshake::{check_compatible, ReadPlan};
use crate::side_channel::fetch_handshake;
use crate::wire::within;
use crate::worker::Shared as WorkerShared;

/// A remote rank after a successful handshake.
#[derive(Debug)]
pub(crate) struct Remote {
    /// Its layer-major block list (descriptor `layer * remote_num_blocks + block`), each
    /// descriptor this rank's head slice of the block.
    pub(crate) prepared: PreparedRemote,
    /// How its blocks are read.
    pub(crate) plan: ReadPlan,
}

/// A handshake under way or done, shared by every load that needs it; the error is the
/// failure's message.
type Handshake = Shared<BoxFuture<'static, std::result::Result<Arc<Remote>, String>>>;

/// Remote ranks by engine id and rank.
#[derive(Default)]
pub(crate) struct Remotes {
    map: Mutex<HashMap<(String, usize), Handshake>>,
}

impl Remotes {
    /// The remote rank `rank` of `engine` at `host:port`, handshaking first if no load has
    /// yet. Loads that wait for the same handshake share its outcome; a failed one is
    /// forgotten, so a later load tries again.
    ///
    /// # Errors
    /// [`Error::Handshake`] with the reason.
    pub(crate) async fn get(
        &self,
        shared: &Arc<WorkerShared>,
        engine: &str,
        rank: usize,
        host: &str,
        port: u16,
    ) -> Result<Arc<Remote>> {
        let key = (engine.to_string(), rank);
        let handshake = self
            .lock()
            .entry(key.clone())
            .or_insert_with(|| {
                let (shared, engine, host) = (shared.clone(), engine.to_string(), host.to_string());
                async move {
                    let started = std::time::Instant::now();
                    let remote = connect(&shared, &engine, rank, &host, port).await;
                    if remote.is_ok() {
                        shared.series.handshake(started.elapsed());
                    }
                    remote.map_err(|err| err.to_string())
                }
                .boxed()
                .shared()
            })
            .clone();
        match handshake.clone().await {
            Ok(remote) => Ok(remote),
            Err(reason) => {
                let mut map = self.lock();
                if map.get(&key).is_some_and(|h| h.ptr_eq(&handshake)) {
                    map.remove(&key);
                }
                Err(Error::Handshake {
                    engine: engine.to_string(),
                    rank,
                    reason,
                })
            }
        }
    }

    /// The remote rank `rank` of `engine` if its handshake is done, without waiting.
    pub(crate) fn ready(&self, engine: &str, rank: usize) -> Option<Arc<Remote>> {
        let key = (engine.to_string(), rank);
        self.lock()
            .get(&key)
            .and_then(|h| h.peek())
            .and_then(|done| done.as_ref().ok().cloned())
    }

    /// Forgets `remote` (after a transfer with it failed), so the next load handshakes
    /// again; a newer handshake under the same key is kept.
    pub(crate) fn forget(&self, engine: &str, rank: usize, remote: &Arc<Remote>) {
        let key = (engine.to_string(), rank);
        let mut map = self.lock();
        let same = map
            .get(&key)
            .and_then(|h| h.peek())
            .is_some_and(|done| done.as_ref().is_ok_and(|r| Arc::ptr_eq(r, remote)));
        if same {
            map.remove(&key);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, usize), Handshake>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

async fn connect(
    shared: &WorkerShared,
    engine: &str,
    rank: usize,
    host: &str,
    port: u16,
) -> Result<Arc<Remote>> {
    let caches = shared.caches.get().ok_or(Error::NotRegistered {
        operation: "handshake",
    })?;
    let started = std::time::Instant::now();
    let addr = resolve(host, port).await?;
    let ours = &caches.handshake;
    let theirs = fetch_handshake(addr, ours, shared.config.limits).await?;
    let plan = check_compatible(ours, &theirs, Some(engine), Some(rank))?;
    let agent = shared.setup.agent();
    // The same agent reached again (e.g. after a failed transfer, or under a second engine
    // id) is not loaded twice: NIXL refuses to reload an agent it knows.
    let name = if agent.has_remote_metadata(&theirs.agent_name)? {
        theirs.agent_name.clone()
    } else {
        match shared.config.metadata_exchange {
            MetadataExchange::SideChannel => agent.load_remote_metadata(&theirs.agent_metadata)?,
            MetadataExchange::Etcd => {
                let fetched = crate::etcd::fetch(agent, &theirs.agent_name);
                // What is left of the handshake's deadline: one total for the whole of it.
                let left = shared
                    .config
                    .limits
                    .deadline
                    .saturating_sub(started.elapsed());
                within(
                    "fetch agent metadata from etcd",
                    &theirs.agent_name,
                    left,
                    fetched,
                )
                .await?;
                theirs.agent_name.clone()
            }
        }
    };
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

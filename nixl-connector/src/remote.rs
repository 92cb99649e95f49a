//! Remote ranks this worker reads from: one handshake each, run by the first load that
//! needs it (in the background), then their prepared descriptor list is reused.
//!
//! A remote rank is handshaken with again after a transfer with it failed. Its agent's
//! metadata is loaded into NIXL only when it differs, byte for byte, from what that agent
//! was loaded from (then the old one is invalidated first): NIXL 1.5.1 keeps two file
//! descriptors for every load and invalidation of a live peer, so reloading a flapping peer
//! would grow the process's descriptors without bound.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use futures::future::{BoxFuture, FutureExt, Shared};
use nixl::{Agent, PreparedRemote, RemoteDescList, XferDesc};

use crate::error::{Error, Result};
use crate::handshake::{check_compatible, ReadPlan};
use crate::metrics::RemoteStats;
use crate::side_channel::fetch_handshake;
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

/// Remote ranks by engine id and rank, and the metadata their agents were loaded from.
#[derive(Default)]
pub(crate) struct Remotes {
    map: Mutex<HashMap<(String, usize), Handshake>>,
    loaded: Mutex<LoadedAgents>,
}

/// The metadata each remote agent was loaded from, by agent name, and the counts.
#[derive(Default)]
struct LoadedAgents {
    by_name: HashMap<String, LoadedAgent>,
    stats: RemoteStats,
}

/// A remote agent this worker loaded.
struct LoadedAgent {
    /// The bytes it was loaded from.
    metadata: Vec<u8>,
    /// The engine id and rank whose handshake loaded it: only theirs may replace it.
    source: (String, usize),
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

    /// Makes `agent` know the remote agent `name`, named in the handshake of `source`
    /// (engine id and rank), from `metadata` (validated by [`Agent::load_remote_metadata`])
    /// and returns the name the metadata declares. Metadata identical to what `name` was
    /// loaded from reuses the loaded agent. Different metadata replaces it (invalidating the
    /// old) only when `source` loaded it: a peer cannot take over another's agent by naming it.
    fn load_metadata(
        &self,
        agent: &Agent,
        source: &(String, usize),
        name: &str,
        metadata: &[u8],
    ) -> Result<String> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        loaded.stats.handshakes += 1;
        let known = agent.has_remote_metadata(name)?;
        match loaded.by_name.get(name).filter(|_| known) {
            Some(last) if last.metadata == metadata => {
                loaded.stats.reused += 1;
                return Ok(name.to_string());
            }
            Some(last) if last.source != *source => {
                return Err(Error::Incompatible {
                    reader: format!("agent {:?}", agent.name()),
                    source_rank: format!("engine {:?} rank {}", source.0, source.1),
                    reason: format!(
                        "its handshake names agent {name:?}, loaded from other metadata for \
                         engine {:?} rank {}",
                        last.source.0, last.source.1
                    ),
                })
            }
            Some(_) => {
                tracing::info!(remote = %name, "the remote agent's metadata changed; invalidating the old one");
                agent.invalidate_remote_metadata(name)?;
                loaded.by_name.remove(name);
                loaded.stats.replaced += 1;
            }
            None => {}
        }
        let declared = agent.load_remote_metadata(metadata)?;
        loaded.stats.loaded += 1;
        let entry = LoadedAgent {
            metadata: metadata.to_vec(),
            source: source.clone(),
        };
        loaded.by_name.insert(declared.clone(), entry);
        Ok(declared)
    }

    /// The counts so far, with the process's open file descriptors now.
    pub(crate) fn stats(&self) -> RemoteStats {
        let loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        RemoteStats {
            open_fds: crate::metrics::open_fds(),
            ..loaded.stats
        }
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
    let source = (engine.to_string(), rank);
    let name = match &shared.etcd {
        None => shared.remotes.load_metadata(
            agent,
            &source,
            &theirs.agent_name,
            &theirs.agent_metadata,
        )?,
        Some(etcd) => {
            // What is left of the handshake's deadline: one total for the whole of it.
            let limits = shared.config.limits;
            let left = limits.deadline.saturating_sub(started.elapsed());
            let key = crate::etcd::metadata_key(&etcd.namespace, &theirs.agent_name);
            let metadata =
                crate::etcd::fetch_metadata(&etcd.endpoints, &key, limits.max_frame, left).await?;
            shared
                .remotes
                .load_metadata(agent, &source, &theirs.agent_name, &metadata)?
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

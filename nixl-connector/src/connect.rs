//! A decode rank's handshake with one remote rank (vLLM's `_nixl_handshake` and
//! `add_remote_agent`): its handshake message fetched over the side channel and checked, its
//! agent's metadata loaded, and, when it is read from, the pieces of its blocks and of the
//! local blocks they land in described in prepared lists ([`ReadPlan`](crate::ReadPlan)). Run
//! once per remote rank, in the background, through [`Remotes`](crate::remotes).

use std::net::SocketAddr;
use std::sync::Arc;

use futures::FutureExt;
use nixl::{LocalDescList, RemoteDescList};

use crate::error::{Error, Result};
use crate::handshake::check_compatible;
use crate::remotes::{ReadLists, Remote};
use crate::shared::Shared;
use crate::side_channel::fetch_handshake;

/// The remote rank `rank` of `engine` at `host:port`, handshaking first if no load has yet
/// (see [`Remotes::get`](crate::remotes::Remotes::get)).
///
/// # Errors
/// [`Error::Handshake`] with the reason.
pub(crate) async fn remote(
    shared: &Arc<Shared>,
    engine: &str,
    rank: usize,
    host: &str,
    port: u16,
) -> Result<Arc<Remote>> {
    let start = || {
        let (shared, engine, host) = (shared.clone(), engine.to_string(), host.to_string());
        async move {
            let started = std::time::Instant::now();
            let remote = connect(&shared, &engine, rank, &host, port).await;
            if remote.is_ok() {
                shared.series.handshake(started.elapsed());
            }
            remote
        }
        .boxed()
    };
    shared.remotes.get(engine, rank, start).await
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
    let lists = if plan.share.reads() {
        let backends: Vec<&nixl::Backend> = shared.setup.backends().iter().collect();
        let mem_type = caches.registration.mem_type();
        let descs = plan.remote_descs(&theirs.region_base_addrs, theirs.device_id);
        let remote = agent.prepare_remote(
            &name,
            &RemoteDescList::from_vec(mem_type, descs)?,
            &backends,
        )?;
        let local = if plan.reads_whole_local_blocks() {
            None
        } else {
            let num_blocks = caches.spec.num_blocks;
            let mut list =
                LocalDescList::with_capacity(mem_type, plan.local_descriptors(num_blocks))?;
            for (region, offset, len) in plan.local_descs(num_blocks) {
                list.push(&caches.registration, region, offset, len)?;
            }
            Some(agent.prepare_local(&list, &backends)?)
        };
        Some(ReadLists { remote, local })
    } else {
        None
    };
    tracing::info!(engine, rank, agent = %name, share = ?plan.share, blocks = plan.remote_num_blocks, "handshake done");
    Ok(Arc::new(Remote {
        agent: name,
        plan,
        lists,
    }))
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

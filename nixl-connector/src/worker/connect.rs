//! A decode rank's handshake with one remote rank (vLLM's `_nixl_handshake` and
//! `add_remote_agent`): its handshake message fetched over the side channel (the native
//! exchange, or vLLM's `get_meta_msg` converted, see [`VllmWorker::fetch`](crate::vllm::VllmWorker))
//! and checked, its agent's metadata loaded (validated by NIXL's loader, whichever protocol
//! brought it), and, when it is read from, the pieces of its blocks and of the local blocks
//! they land in described in prepared lists ([`ReadPlan`](crate::ReadPlan)), which NIXL holds
//! to the memory the loaded metadata advertises. Run once per remote rank, in the
//! background, through [`Remotes`](crate::worker::remotes).

use std::net::SocketAddr;
use std::sync::Arc;

use futures::FutureExt;
use nixl::{LocalDescList, RemoteDescList};

use crate::error::{Error, Result};
use crate::transport::handshake::check_compatible;
use crate::transport::side_channel::fetch_handshake_with;
use crate::worker::remotes::{ReadLists, Remote};
use crate::worker::shared::Shared;

/// Where a remote engine's side channel is, and its TP size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Engine<'a> {
    /// Its id.
    pub(crate) id: &'a str,
    /// Its side-channel host.
    pub(crate) host: &'a str,
    /// Its TP size.
    pub(crate) tp_size: usize,
}

/// The remote rank `rank` of `engine`, whose side channel is at `port`, handshaking first
/// if no load has yet (see [`Remotes::get`](crate::worker::remotes::Remotes::get)).
///
/// # Errors
/// [`Error::Handshake`] with the reason.
pub(crate) async fn remote(
    shared: &Arc<Shared>,
    engine: Engine<'_>,
    rank: usize,
    port: u16,
) -> Result<Arc<Remote>> {
    let start = || {
        let shared = shared.clone();
        let (id, host, tp_size) = (
            engine.id.to_string(),
            engine.host.to_string(),
            engine.tp_size,
        );
        async move {
            let engine = Engine {
                id: &id,
                host: &host,
                tp_size,
            };
            let started = std::time::Instant::now();
            shared.series.handshake_pending(true);
            let remote = connect(&shared, engine, rank, port).await;
            shared.series.handshake_pending(false);
            if remote.is_ok() {
                shared.series.handshake(started.elapsed());
            }
            remote
        }
        .boxed()
    };
    shared.remotes.serves(engine.host, port, engine.id);
    let remote = shared.remotes.get(engine.id, rank, start).await?;
    let generation = shared.current_caches().map(|c| c.generation);
    if generation.is_some_and(|g| g != remote.local_generation) {
        // Prepared over a registration this worker has replaced since (a handshake that
        // was under way when the caches were registered again): handshake again.
        shared.remotes.forget(engine.id, rank, &remote);
        return shared.remotes.get(engine.id, rank, start).await;
    }
    Ok(remote)
}

async fn connect(
    shared: &Shared,
    engine: Engine<'_>,
    rank: usize,
    port: u16,
) -> Result<Arc<Remote>> {
    let caches = shared.current_caches().ok_or(Error::NotRegistered {
        operation: "handshake",
    })?;
    let started = std::time::Instant::now();
    let ours = &caches.handshake;
    #[cfg_attr(not(feature = "vllm"), allow(unused_labels))]
    let (theirs, blocks_per_id) = 'fetched: {
        #[cfg(feature = "vllm")]
        if let Some(vllm) = &shared.vllm {
            let fetched = vllm
                .fetch(ours, rank, engine.tp_size, engine.host, port)
                .await?;
            break 'fetched (fetched.message, fetched.blocks_per_logical);
        }
        let addr = resolve(engine.host, port).await?;
        let secret = shared.guard.secret.as_ref();
        (
            fetch_handshake_with(addr, ours, shared.config.limits, secret).await?,
            1,
        )
    };
    let engine = engine.id;
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
            let key = crate::transport::etcd::metadata_key(&etcd.namespace, &theirs.agent_name);
            let metadata = crate::transport::etcd::fetch_metadata_with(
                &etcd.endpoints,
                &key,
                limits.max_frame,
                left,
                etcd.credentials.as_ref(),
                etcd.tls.as_ref(),
            )
            .await?;
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
        blocks_per_id,
        local_generation: caches.generation,
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

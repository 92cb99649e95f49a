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

use futures::future::join_all;
use futures::FutureExt;
use nixl::{LocalDescList, RemoteDescList};

use crate::error::{Error, Result};
use crate::geometry::read_plan::ReadPlan;
use crate::geometry::ssm::SsmReads;
use crate::transport::handshake::{check_compatible, HandshakeMessage, MAX_REMOTE_DESCRIPTORS};
use crate::transport::side_channel::fetch_handshake_with;
use crate::worker::current_caches::Caches;
use crate::worker::remotes::{ReadLists, Remote};
use crate::worker::shared::Shared;

/// Where a remote engine's side channel is, its TP size and its pipeline stages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Engine<'a> {
    /// Its id.
    pub(crate) id: &'a str,
    /// Its side-channel host.
    pub(crate) host: &'a str,
    /// Its TP size.
    pub(crate) tp_size: usize,
    /// Its pipeline stages (1: none).
    pub(crate) pp_size: usize,
}

impl Engine<'_> {
    /// Its rank numbered `rank` (see `KvConnectorWorker::remote_ranks`), as `(pp_rank,
    /// tp_rank)`.
    pub(crate) fn rank(&self, rank: usize) -> (usize, usize) {
        let tp_size = self.tp_size.max(1);
        (rank / tp_size, rank % tp_size)
    }
}

/// The address this rank's side channel listens on, for a peer to reach (a push decode
/// names it in its registrations).
///
/// # Errors
/// [`Error::NotRegistered`] before the caches are; [`Error::InvalidArgument`] when it
/// listens on an unspecified address (`0.0.0.0`), which names no host.
pub(crate) fn reachable_side_channel(
    shared: &Shared,
    operation: &'static str,
) -> Result<SocketAddr> {
    let caches = shared
        .caches
        .get()
        .ok_or(Error::NotRegistered { operation })?;
    let addr = caches.side_channel;
    if addr.ip().is_unspecified() {
        return Err(Error::invalid(operation, format!("this rank's side channel listens on {addr}: set WorkerConfig::side_channel to an address the prefill reaches, which the registration names")));
    }
    Ok(addr)
}

/// [`remote`] for each of `engine`'s `ranks` (rank, side-channel port), run together: the
/// remote ranks in the same order.
///
/// # Errors
/// The first failed handshake's, in rank order.
pub(crate) async fn remotes(
    shared: &Arc<Shared>,
    engine: Engine<'_>,
    ranks: &[(usize, u16)],
) -> Result<Vec<Arc<Remote>>> {
    join_all(
        ranks
            .iter()
            .map(|&(rank, port)| remote(shared, engine, rank, port)),
    )
    .await
    .into_iter()
    .collect()
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
        let (id, host, tp_size, pp_size) = (
            engine.id.to_string(),
            engine.host.to_string(),
            engine.tp_size,
            engine.pp_size,
        );
        async move {
            let engine = Engine {
                id: &id,
                host: &host,
                tp_size,
                pp_size,
            };
            let started = std::time::Instant::now();
            shared.series.handshake_pending(true);
            let remote = connect(&shared, engine, rank, port).await;
            shared.series.handshake_pending(false);
            match &remote {
                Ok(_) => shared.series.handshake(started.elapsed()),
                Err(_) => shared.series.handshake_failed(),
            }
            remote
        }
        .boxed()
    };
    shared.remotes.serves(engine.host, port, engine.id);
    let remote = shared.remotes.get(engine.id, rank, start).await?;
    let generation = shared.caches.get().map(|c| c.generation);
    if generation.is_some_and(|g| g != remote.local_generation) {
        // Prepared over a registration this worker has replaced since (a handshake that
        // was under way when the caches were registered again): handshake again.
        shared.remotes.forget(engine.id, rank, &remote);
        return shared.remotes.get(engine.id, rank, start).await;
    }
    Ok(remote)
}

/// The handshake with rank `rank` of `engine` (its side channel at `port`): its message
/// fetched and checked, its agent's metadata loaded, and the lists its READs use prepared.
async fn connect(
    shared: &Shared,
    engine: Engine<'_>,
    rank: usize,
    port: u16,
) -> Result<Arc<Remote>> {
    let caches = shared.caches.get().ok_or(Error::NotRegistered {
        operation: "handshake",
    })?;
    let started = std::time::Instant::now();
    let ours = &caches.handshake;
    let theirs = fetch(shared, ours, engine, rank, port).await?;
    let plan = check_compatible(ours, &theirs, Some(engine.id), Some(engine.rank(rank)))?;
    // Checked: 1 to MAX_BLOCKS_PER_ID.
    let blocks_per_id = theirs.blocks_per_id as usize;
    let ssm = ssm_reads(shared, (ours, &theirs), &plan, blocks_per_id)?;
    let source = (engine.id.to_string(), rank);
    let name = load_metadata(shared, &theirs, &source, started).await?;
    if name != theirs.agent_name {
        return Err(Error::Incompatible {
            reader: format!("engine {:?} rank {}", ours.engine_id, ours.tp_rank),
            source_rank: format!("engine {:?} rank {rank}", engine.id),
            reason: format!(
                "its metadata names agent {name:?}, its handshake {:?}",
                theirs.agent_name
            ),
        });
    }
    let reads = Reads {
        plan: &plan,
        ssm: ssm.as_ref(),
    };
    let lists = prepare_lists(shared, &caches, &theirs, &name, reads)?;
    tracing::info!(engine = engine.id, rank, agent = %name, share = ?plan.share, blocks = plan.remote_num_blocks, "handshake done");
    Ok(Arc::new(Remote {
        agent: name,
        plan,
        ssm,
        lists,
        blocks_per_id,
        // Checked against ours in `check_compatible`: 1 to MAX_DCP_SIZE.
        dcp_size: theirs.dcp_size as usize,
        local_generation: caches.generation,
        release_marks: theirs.release_marks,
    }))
}

/// The handshake message of rank `rank` of `engine`, from its side channel at `port`:
/// vLLM's `get_meta_msg` converted in vLLM mode, else the native exchange (sealed with a
/// secret).
pub(crate) async fn fetch(
    shared: &Shared,
    ours: &HandshakeMessage,
    engine: Engine<'_>,
    // The native exchange reaches the rank through its port alone.
    #[cfg_attr(not(feature = "vllm"), allow(unused_variables))] rank: usize,
    port: u16,
) -> Result<HandshakeMessage> {
    #[cfg(feature = "vllm")]
    if let Some(vllm) = &shared.vllm {
        let groups = &shared.groups;
        let sizes = (engine.pp_size, engine.tp_size);
        let at = (engine.host, port);
        return vllm
            .fetch(
                (ours, groups, shared.config.pcp_size as u64),
                engine.rank(rank),
                sizes,
                at,
            )
            .await;
    }
    let addr = resolve(engine.host, port).await?;
    let secret = shared.guard.secret.as_ref();
    fetch_handshake_with(addr, ours, shared.config.limits, secret).await
}

/// Loads the agent metadata of the remote rank `source` whose handshake is `theirs`: the
/// handshake's own, or (etcd mode) fetched from etcd within what is left of the
/// handshake's deadline (one total, from `started`); the name of the agent loaded.
async fn load_metadata(
    shared: &Shared,
    theirs: &HandshakeMessage,
    source: &(String, usize),
    started: std::time::Instant,
) -> Result<String> {
    let agent = shared.setup.agent();
    let metadata = match &shared.etcd {
        None => std::borrow::Cow::Borrowed(&theirs.agent_metadata[..]),
        Some(etcd) => {
            let limits = shared.config.limits;
            let left = limits.deadline.saturating_sub(started.elapsed());
            let key = crate::transport::etcd::metadata_key(&etcd.namespace, &theirs.agent_name);
            std::borrow::Cow::Owned(etcd.fetch(&key, limits.max_frame, left).await?)
        }
    };
    shared
        .remotes
        .load_metadata(agent, source, &theirs.agent_name, &metadata)
}

/// What a remote rank's READs read: its attention as `plan` says, and its SSM state.
#[derive(Clone, Copy)]
struct Reads<'a> {
    plan: &'a ReadPlan,
    ssm: Option<&'a SsmReads>,
}

/// The prepared lists the READs from the rank `theirs` (agent `name`) use, as `reads`
/// says: its blocks' pieces, and the local blocks' pieces unless whole local blocks take
/// them (the caches' own list); `None` when nothing of it is read (it is only notified).
fn prepare_lists(
    shared: &Shared,
    caches: &Caches,
    theirs: &HandshakeMessage,
    name: &str,
    reads: Reads<'_>,
) -> Result<Option<ReadLists>> {
    let (plan, ssm) = (reads.plan, reads.ssm);
    let attention = plan.share.reads();
    if !attention && ssm.is_none() {
        return Ok(None);
    }
    let agent = shared.setup.agent();
    let backends: Vec<&nixl::Backend> = shared.setup.backends().iter().collect();
    let mem_type = caches.registration.mem_type();
    let (addrs, device) = (&theirs.region_base_addrs, theirs.device_id);
    let mut descs = if attention {
        plan.remote_descs(addrs, device)
    } else {
        Vec::new()
    };
    if let Some(ssm) = ssm {
        descs.extend(ssm.remote_descs(addrs, device));
    }
    let remote_list = RemoteDescList::from_vec(mem_type, descs)?;
    let remote = agent.prepare_remote(name, &remote_list, &backends)?;
    if plan.reads_whole_local_blocks() && ssm.is_none() {
        return Ok(Some(ReadLists {
            remote,
            local: None,
        }));
    }
    let num_blocks = caches.spec.num_blocks;
    let attention_descs = if attention {
        plan.local_descriptors(num_blocks)
    } else {
        0
    };
    let ssm_descs = ssm.map_or(0, SsmReads::local_descriptors);
    let mut list = LocalDescList::with_capacity(mem_type, attention_descs + ssm_descs)?;
    let attention_local = plan.local_descs(num_blocks).take(attention_descs);
    let ssm_local = ssm.into_iter().flat_map(SsmReads::local_descs);
    for (region, offset, len) in attention_local.chain(ssm_local) {
        list.push(&caches.registration, region, offset, len)?;
    }
    let local = Some(agent.prepare_local(&list, &backends)?);
    Ok(Some(ReadLists { remote, local }))
}

/// How the SSM state of this engine's SSM groups is read from the remote rank `theirs`
/// (`None` without SSM groups), whose block ids are `blocks_per_id` registered blocks each,
/// after the attention descriptors of `plan` if it reads them; every rank of a larger
/// prefill TP holds part of it, so each is read from, its attention or not.
///
/// # Errors
/// [`Error::Incompatible`] when it cannot be read (see [`SsmReads::new`]), or its
/// descriptors pass the cap; [`Error::InvalidArgument`] for SSM groups without a state.
fn ssm_reads(
    shared: &Shared,
    (ours, theirs): (&HandshakeMessage, &HandshakeMessage),
    plan: &ReadPlan,
    blocks_per_id: usize,
) -> Result<Option<SsmReads>> {
    let Some(state) = shared.groups.checked_ssm_state()? else {
        return Ok(None);
    };
    let local_per_id = shared.groups.kernel_blocks_per_id(ours.spec.block_size)?;
    let refuse = |reason: String| Error::Incompatible {
        reader: format!("engine {:?} rank {}", ours.engine_id, ours.tp_rank),
        source_rank: format!("engine {:?} rank {}", theirs.engine_id, theirs.tp_rank),
        reason,
    };
    let tp = |m: &HandshakeMessage| usize::try_from(m.tp_size).unwrap_or(usize::MAX);
    let rank = usize::try_from(ours.tp_rank).unwrap_or(usize::MAX);
    let theirs_rank = usize::try_from(theirs.tp_rank).unwrap_or(usize::MAX);
    // A rank whose attention is read from another of its TP group (MLA's latent,
    // replicated KV heads) still holds its part of the state: its lists hold the state's
    // descriptors only (vLLM's `source_ranks_per_group`, SSM groups read from every rank).
    let first = if plan.share.reads() {
        (
            plan.local_descriptors(ours.spec.num_blocks),
            plan.remote_descriptors(),
        )
    } else {
        (0, 0)
    };
    let regions = shared.groups.ssm_regions(ours.spec.regions.len());
    let reads = SsmReads::new(
        (state, &regions),
        (&ours.spec, (rank, tp(ours))),
        (&theirs.spec, (theirs_rank, tp(theirs))),
        (local_per_id, blocks_per_id),
        first,
    )
    .map_err(refuse)?;
    let remote = reads.remote_descriptors().saturating_add(first.1);
    if remote > MAX_REMOTE_DESCRIPTORS {
        return Err(refuse(format!(
            "{remote} descriptors with the SSM state's; at most {MAX_REMOTE_DESCRIPTORS} are accepted"
        )));
    }
    Ok(Some(reads))
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

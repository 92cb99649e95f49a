//! Registering a worker's KV cache and publishing it: the prepared local list, the
//! handshake message, the native side channel or vLLM's, and the metadata in etcd mode;
//! in host-buffer mode also the VRAM it stages through.

use std::net::SocketAddr;
use std::sync::Arc;

use nixl::{RegDesc, RegisterMemory, Registration};

use crate::config::{MetadataExchange, Protocol};
use crate::error::{Error, Result};
use crate::geometry::spec::{KvAttention, KvCacheSpec};
use crate::transport::handshake::HandshakeMessage;
use crate::transport::peer_networks::warn_if_open;
use crate::transport::pending::PendingHandshakes;
#[cfg(feature = "vllm")]
use crate::vllm::{MetadataServer, NixlAgentMetadata, NixlHandshakePayload, RankRegistration};
use crate::worker::current_caches::Caches;
use crate::worker::host_buffer::Staging;
use crate::worker::mark_words::MarkWords;

use super::reregister::KeptChannel;
#[cfg(not(feature = "vllm"))]
use super::vllm_not_built;
#[cfg(feature = "vllm")]
use super::vllm_rank;
use super::{already_registered, KvConnectorWorker};

impl KvConnectorWorker {
    /// Registers the KV cache: `caches` holds the regions of `spec` in order (one per layer
    /// with K and V packed as vLLM 0.33 has them, [`KvCacheSpec::lbhnc`], ...), region `r` at least `spec.region_len(r)` bytes,
    /// of the memory type the platform and kv-buffer device give (DRAM for `cpu`), with the
    /// configured backends; then publishes the agent metadata (etcd mode) and starts the
    /// side channel. The handshake tells peers each region's block length.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad spec or one that does not fit this rank's TP
    /// (see [`KvCacheSpec::check_rank`]), a wrong region count or short regions, or a second
    /// call (see [`register_kv_caches_again`](Self::register_kv_caches_again)); the
    /// registration errors of [`NixlSetup::register_memory`](nixl::kv_config::NixlSetup::register_memory);
    /// [`Error::EtcdUnreachable`] (etcd mode); [`Error::Io`] when the side channel cannot
    /// bind.
    pub fn register_kv_caches<M: RegisterMemory + 'static>(
        &self,
        caches: M,
        spec: KvCacheSpec,
    ) -> Result<()> {
        const OP: &str = "register the KV caches";
        self.check_spec(&spec)?;
        if self.registered.get().is_some() {
            return Err(already_registered(OP));
        }
        let registration = self.shared.setup.register_memory(caches)?;
        self.finish_registration(registration, spec, None)
    }

    /// Allocates one zeroed [`HostBuffer`](nixl::HostBuffer) of `spec.region_len(r)` bytes
    /// per region `r`, backed with memory up front as an engine's KV cache is, and registers
    /// them as the KV cache ([`register_kv_caches`](Self::register_kv_caches)): the cache of
    /// a `cpu` kv-buffer device, or the host side of host-buffer mode.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad spec (checked before anything is allocated);
    /// allocation errors; those of [`register_kv_caches`](Self::register_kv_caches).
    pub fn register_host_kv_caches(&self, spec: KvCacheSpec) -> Result<()> {
        self.check_spec(&spec)?;
        let regions = (0..spec.num_regions())
            .map(|r| nixl::HostBuffer::backed(spec.region_len(r)))
            .collect::<nixl::Result<Vec<_>>>()?;
        self.register_kv_caches(regions, spec)
    }

    /// Checks `spec` on its own, against this rank's TP, against its pipeline stage's
    /// layers, and that a rank of decode context parallelism holds an MLA cache.
    pub(super) fn check_spec(&self, spec: &KvCacheSpec) -> Result<()> {
        spec.validate()?;
        let config = &self.shared.config;
        // A stage of a hybrid model whose regions name their layers pairs them by name (its
        // tensors need not follow the layers' order); else each layer has as many regions.
        let groups = &self.shared.groups;
        let by_name = groups.len() > 1 && !groups.region_layers().is_empty();
        if let Some(pipeline) = config.pipeline.as_ref().filter(|_| !by_name) {
            pipeline.regions_per_layer(spec.num_regions())?;
        }
        groups.region_layer_names(spec.num_regions())?;
        if config.dcp_size > 1 && spec.attention != KvAttention::Mla {
            return Err(Error::invalid(
                "register the KV caches",
                format!("dcp_size {} with a {} cache: decode context parallelism is for MLA caches only (vLLM's NixlConnector scopes it to MLA)", config.dcp_size, spec.attention),
            ));
        }
        spec.check_rank(config.tp_rank, config.tp_size)
    }

    /// Builds the prepared list, the handshake and the side channel for a registration (or,
    /// registering again, serves the new handshake on the side channel `kept`).
    pub(super) fn finish_registration(
        &self,
        registration: Registration,
        spec: KvCacheSpec,
        kept: Option<KeptChannel>,
    ) -> Result<()> {
        const OP: &str = "register the KV caches";
        check_regions(&registration, &spec)?;
        let local = self.prepare_blocks(&registration, &spec)?;
        let marks = self.release_marks(&spec)?;
        let handshake = self.describe(&registration, &spec, marks.as_ref())?;
        let generation = kept.as_ref().map_or(1, |k| k.generation + 1);
        let serving = self.serve(&handshake, kept)?;
        let caches = Arc::new(Caches {
            generation,
            served: serving.served,
            registration,
            spec,
            local,
            handshake,
            marks,
            side_channel: serving.side_channel,
            side_channel_pending: serving.pending,
            #[cfg(feature = "vllm")]
            vllm: serving.vllm,
        });
        if self.registered.set(caches.clone()).is_err() {
            return Err(already_registered(OP));
        }
        self.shared.caches.set(caches);
        let caches = self.caches(OP)?;
        let config = &self.shared.config;
        #[cfg(feature = "vllm")]
        if let Some((server, payload)) = &caches.vllm {
            let (pp_rank, tp_rank) = vllm_rank(config);
            server.publish(pp_rank, tp_rank, payload);
        }
        let spec = &caches.spec;
        tracing::info!(engine = %config.engine_id, rank = config.tp_rank, side_channel = %caches.side_channel, generation, regions = spec.num_regions(), blocks = spec.num_blocks, block_size = spec.block_size, block_len = spec.block_len(0), attention = %spec.attention, "KV caches registered");
        Ok(())
    }

    /// Every block of every region of `registration`, as `spec` lays them out, in a list
    /// prepared for the backends.
    fn prepare_blocks(
        &self,
        registration: &Registration,
        spec: &KvCacheSpec,
    ) -> Result<nixl::PreparedLocal> {
        let mut list = nixl::LocalDescList::with_capacity(
            registration.mem_type(),
            spec.num_regions() * spec.num_blocks,
        )?;
        for index in 0..spec.num_regions() {
            list.push_blocks(
                registration,
                index,
                spec.block_len(index),
                0..spec.num_blocks,
            )?;
        }
        let backends: Vec<&nixl::Backend> = self.shared.setup.backends().iter().collect();
        Ok(self.agent().prepare_local(&list, &backends)?)
    }

    /// The release marks of a registration of `spec` (native protocol): one per block,
    /// registered before the agent's metadata is taken, so that the metadata covers them,
    /// each starting at the largest epoch marked under an earlier registration.
    fn release_marks(&self, spec: &KvCacheSpec) -> Result<Option<MarkWords>> {
        if self.shared.protocol != Protocol::Native {
            return Ok(None);
        }
        let floor = self.shared.sends.lock().marked_up_to();
        let backends: Vec<&nixl::Backend> = self.shared.setup.backends().iter().collect();
        let marks = MarkWords::register(self.agent(), &backends, spec.num_blocks, floor)?;
        Ok(Some(marks))
    }

    /// This rank's handshake message for `registration` laid out as `spec`, naming `marks`:
    /// its agent's metadata in it, or (etcd) published there instead.
    fn describe(
        &self,
        registration: &Registration,
        spec: &KvCacheSpec,
        marks: Option<&MarkWords>,
    ) -> Result<Arc<HandshakeMessage>> {
        let config = &self.shared.config;
        let metadata = match config.metadata_exchange {
            MetadataExchange::SideChannel => self.agent().local_metadata()?,
            MetadataExchange::Etcd => {
                let secret = self.shared.guard.secret.as_ref();
                crate::transport::etcd::publish(self.agent(), secret)?;
                Vec::new()
            }
        };
        let described = HandshakeMessage::describe(
            &config.engine_id,
            self.agent().name(),
            metadata,
            registration
                .regions()
                .iter()
                .map(|r| r.addr as u64)
                .collect(),
            (spec, &self.shared.groups),
            (config.tp_rank, config.tp_size),
            config.device_id,
        )?;
        let message = HandshakeMessage {
            release_marks: marks.and_then(MarkWords::describe),
            ..described
        };
        Ok(Arc::new(match &config.pipeline {
            Some(pipeline) => HandshakeMessage {
                pp_rank: pipeline.pp_rank() as u64,
                pp_partition: pipeline.partition(),
                dcp_size: config.dcp_size as u64,
                ..message
            },
            None => HandshakeMessage {
                dcp_size: config.dcp_size as u64,
                ..message
            },
        }))
    }

    /// The side channel that answers with `handshake`: the one `kept` from the registration
    /// replaced, now answering with it, or a new one.
    fn serve(
        &self,
        handshake: &Arc<HandshakeMessage>,
        kept: Option<KeptChannel>,
    ) -> Result<Serving> {
        let (served, pending, kept_at) = match kept {
            Some(kept) => {
                kept.served.send_replace(Some(handshake.clone()));
                let at = (kept.side_channel, kept.vllm);
                (kept.served, kept.pending, Some(at))
            }
            None => (
                Arc::new(tokio::sync::watch::channel(Some(handshake.clone())).0),
                PendingHandshakes::new(self.shared.config.limits.max_sessions),
                None,
            ),
        };
        #[cfg(feature = "vllm")]
        let (side_channel, vllm) = match (self.shared.protocol, kept_at) {
            (Protocol::Native, Some((at, _))) => (at, None),
            (Protocol::Native, None) => (
                self.serve_native(served.subscribe(), pending.clone())?,
                None,
            ),
            (Protocol::Vllm, kept) => {
                let vllm = self.vllm_side_channel_for(handshake, kept.and_then(|k| k.1))?;
                (vllm.0.local_addr(), Some(vllm))
            }
        };
        #[cfg(not(feature = "vllm"))]
        let side_channel = match (self.shared.protocol, kept_at) {
            (Protocol::Native, Some((at, ()))) => at,
            (Protocol::Native, None) => self.serve_native(served.subscribe(), pending.clone())?,
            (Protocol::Vllm, _) => return Err(vllm_not_built("register the KV caches")),
        };
        Ok(Serving {
            served,
            pending,
            side_channel,
            #[cfg(feature = "vllm")]
            vllm,
        })
    }

    /// Starts the native side channel at the config's address, answering with `ours`; where
    /// it listens.
    fn serve_native(
        &self,
        ours: tokio::sync::watch::Receiver<Option<Arc<HandshakeMessage>>>,
        pending: Arc<PendingHandshakes>,
    ) -> Result<SocketAddr> {
        let config = &self.shared.config;
        let listener = std::net::TcpListener::bind(config.side_channel)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|err| Error::io("bind the side channel", config.side_channel, err))?;
        let side_channel = listener
            .local_addr()
            .map_err(|err| Error::io("bind the side channel", config.side_channel, err))?;
        let _entered = self.runtime.enter();
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|err| Error::io("bind the side channel", side_channel, err))?;
        let guard = self.shared.guard.clone();
        warn_if_open(
            "the side channel",
            side_channel,
            guard.secret.is_some(),
            &guard.peers,
        );
        let server =
            crate::transport::side_channel::serve(listener, ours, config.limits, pending, guard);
        match &self.shared.push {
            // Push mode: it serves while loads wait for their prefill, the worker gone too.
            Some(push) => push.keep_serving(server),
            None => self
                .tasks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(server),
        }
        Ok(side_channel)
    }

    /// vLLM mode: the engine's side channel (`kept` from an earlier registration, the
    /// config's, or one bound at the config's address) and this rank's payload for it,
    /// described from `ours`.
    #[cfg(feature = "vllm")]
    fn vllm_side_channel_for(
        &self,
        ours: &HandshakeMessage,
        kept: Option<Arc<MetadataServer>>,
    ) -> Result<(Arc<MetadataServer>, NixlHandshakePayload)> {
        let config = &self.shared.config;
        let compat = &self.vllm()?.compat;
        let mut metadata = NixlAgentMetadata::of_rank(RankRegistration {
            engine_id: &config.engine_id,
            agent_metadata: ours.agent_metadata.clone(),
            base_addrs: ours.region_base_addrs.clone(),
            spec: &ours.spec,
            device_id: config.device_id,
            mem_type: self.mem_type().to_string(),
            attn_backend_name: compat
                .factors
                .as_ref()
                .map(|f| f.attn_backend_name.clone())
                .unwrap_or_default(),
            region_group_ids: ours.region_groups.clone(),
            blocks_per_logical: ours.blocks_per_id as usize,
            dcp_size: ours.dcp_size,
            pcp_size: config.pcp_size as u64,
        })?;
        // vLLM's `region_members`: a prefill of stages aligns its layers with them.
        metadata.region_members = ours.region_layers.clone();
        // vLLM's `_mamba_ssm_size`: (0, 0) without SSM groups.
        if let Some(state) = &ours.ssm_state {
            let (conv, temporal) = state.ssm_sizes();
            metadata.ssm_sizes = (conv as u64, temporal as u64);
        }
        let payload = NixlHandshakePayload::new(&compat.hash, &metadata);
        let server = match kept.as_ref().or(config.vllm_side_channel.as_ref()) {
            Some(server) => server.clone(),
            None => {
                let _entered = self.runtime.enter();
                Arc::new(MetadataServer::bind_now(
                    config.side_channel,
                    config.vllm_limits,
                )?)
            }
        };
        server.set_allowed_peers(self.shared.guard.peers.clone());
        Ok((server, payload))
    }

    /// Registers a VRAM KV cache in host-buffer mode (see [`host_buffer`](crate::host_buffer)):
    /// `device_layers` are the engine's VRAM regions (device addresses, `dev_id` the GPU
    /// index), region `r` at least `spec.region_len(r)` bytes; the connector allocates and
    /// registers a host buffer of the same shape for transfers and starts the side channel.
    ///
    /// # Safety
    /// Every descriptor must describe device memory that stays allocated until this worker
    /// and every request made from it have been dropped (as for
    /// [`nixl::Agent::register_raw`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless the config's kv-buffer device is `cpu` on a `cuda`
    /// platform, or for regions that do not fit `spec`; [`Error::HostBufferNeedsGpu`] when
    /// no CUDA device is usable; then the errors of
    /// [`register_kv_caches`](Self::register_kv_caches).
    pub unsafe fn register_kv_caches_host_buffer(
        &self,
        device_layers: &[RegDesc],
        spec: KvCacheSpec,
    ) -> Result<()> {
        const OP: &str = "register the KV caches in host-buffer mode";
        self.check_spec(&spec)?;
        if self.staging.get().is_some() {
            return Err(already_registered(OP));
        }
        // SAFETY: forwarded from the caller's contract.
        let vram = unsafe { Staging::register_device(&self.shared, device_layers, &spec) }?;
        self.register_host_kv_caches(spec.clone())?;
        let staging = Staging::new(&self.shared, vram, self.kv_caches()?, spec)?;
        if self.staging.set(staging).is_err() {
            return Err(already_registered(OP));
        }
        Ok(())
    }
}

/// The side channel a registration answers from.
struct Serving {
    /// What the native side channel answers with.
    served: Arc<tokio::sync::watch::Sender<Option<Arc<HandshakeMessage>>>>,
    /// The places of its handshakes under way.
    pending: Arc<PendingHandshakes>,
    /// Where it listens.
    side_channel: SocketAddr,
    /// vLLM mode: the engine's side channel this rank's payload is published to, and the
    /// payload.
    #[cfg(feature = "vllm")]
    vllm: Option<(Arc<MetadataServer>, NixlHandshakePayload)>,
}

/// Refuses a `registration` of other regions than `spec` has, or a region shorter than
/// its blocks.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the count or the region.
fn check_regions(registration: &Registration, spec: &KvCacheSpec) -> Result<()> {
    const OP: &str = "register the KV caches";
    let regions = registration.regions();
    if regions.len() != spec.num_regions() {
        return Err(Error::invalid(
            OP,
            format!(
                "{} regions for a spec of {}; pass one region per entry of spec.regions",
                regions.len(),
                spec.num_regions()
            ),
        ));
    }
    if let Some((index, region)) = regions
        .iter()
        .enumerate()
        .find(|(r, region)| region.len < spec.region_len(*r))
    {
        return Err(Error::invalid(
            OP,
            format!(
                "region {index} has {} bytes, the spec needs {}",
                region.len,
                spec.region_len(index)
            ),
        ));
    }
    Ok(())
}

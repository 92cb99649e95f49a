//! Host-buffer mode, as vLLM's `kv_buffer_device = "cpu"` on a cuda platform: the engine's
//! KV cache stays in VRAM, and the connector registers a host (DRAM) copy of it, which is
//! what NIXL moves between engines.
//!
//! - The prefill computes into VRAM, then calls
//!   [`stage_to_host`](KvConnectorWorker::stage_to_host) for a request's blocks before
//!   handing its params to the decode (a NIXL WRITE from the VRAM registration into the
//!   host buffer, on the worker's own agent).
//! - The decode loads into the host buffer as usual ([`KvConnectorWorker::start_load`]);
//!   once the request is in [`finished`](KvConnectorWorker::finished)`.recving` without
//!   load errors, it calls [`stage_from_host`](KvConnectorWorker::stage_from_host) (a NIXL
//!   READ from the host buffer into VRAM).
//!
//! The handshake describes the host buffer, so both engines of a pair must run this mode
//! (or a `cpu` kv-buffer device), and a peer's memory type must match. On a machine
//! without a CUDA device, [`register_kv_caches_host_buffer`](KvConnectorWorker::register_kv_caches_host_buffer)
//! fails with [`Error::HostBufferNeedsGpu`] before allocating anything.

use nixl::{
    LocalDescList, MemType, PreparedLocal, PreparedRemote, RegDesc, Registration, RemoteDescList,
    XferDesc, XferOp, XferOptions, XferStatus,
};

use crate::error::{Error, Result};
use crate::spec::KvCacheSpec;
use crate::worker::KvConnectorWorker;

/// The VRAM cache and the lists that copy it to and from the host buffer.
pub(crate) struct Staging {
    /// Held so that the VRAM stays registered while the lists exist.
    _device: Registration,
    device_list: PreparedLocal,
    host_list: PreparedRemote,
    spec: KvCacheSpec,
}

impl KvConnectorWorker {
    /// Registers a VRAM KV cache in host-buffer mode: `device_layers` are the engine's
    /// per-layer VRAM regions (device addresses, `dev_id` the GPU index), each at least
    /// `spec.layer_len()` bytes; the connector allocates and registers a host buffer of the
    /// same shape for transfers and starts the side channel.
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
        spec.validate()?;
        let config = &self.shared.config;
        let device = config.kv_transfer_config.kv_buffer_device.as_str();
        let platform = config.platform.device_type();
        if device != "cpu" || platform != "cuda" {
            return Err(Error::invalid(OP, format!(
                "host-buffer mode needs kv_buffer_device \"cpu\" on the cuda platform; this worker has {device:?} on {platform:?}"
            )));
        }
        if device_layers.len() != spec.num_layers
            || device_layers.iter().any(|d| d.len < spec.layer_len())
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "pass {} VRAM regions of at least {} bytes each",
                    spec.num_layers,
                    spec.layer_len()
                ),
            ));
        }
        if self.staging.get().is_some() {
            return Err(Error::invalid(OP, "the KV caches are already registered"));
        }
        let agent = self.agent();
        let backends: Vec<&nixl::Backend> = self.shared.setup.backends().iter().collect();
        // SAFETY: forwarded from the caller's contract.
        let vram = unsafe { agent.register_raw(MemType::Vram, device_layers, &backends) }.map_err(
            |err| match err {
                nixl::Error::NoCudaDevice { detail, .. } => Error::HostBufferNeedsGpu { detail },
                other => Error::Nixl(other),
            },
        )?;
        self.register_host_kv_caches(spec)?;
        let host_reg = self.kv_caches()?;
        agent.load_remote_metadata(&agent.local_metadata()?)?;
        let mut device_list =
            LocalDescList::with_capacity(MemType::Vram, spec.num_layers * spec.num_blocks)?;
        let mut host_descs = Vec::with_capacity(spec.num_layers * spec.num_blocks);
        for layer in 0..spec.num_layers {
            device_list.push_blocks(&vram, layer, spec.block_len(), 0..spec.num_blocks)?;
            let base = host_reg.regions()[layer].addr;
            host_descs.extend(
                (0..spec.num_blocks)
                    .map(|b| XferDesc::new(base + b * spec.block_len(), spec.block_len(), 0)),
            );
        }
        let device_list = agent.prepare_local(&device_list, &backends)?;
        let host_list = agent.prepare_remote(
            agent.name(),
            &RemoteDescList::from_vec(MemType::Dram, host_descs)?,
            &backends,
        )?;
        let staging = Staging {
            _device: vram,
            device_list,
            host_list,
            spec,
        };
        if self.staging.set(staging).is_err() {
            return Err(Error::invalid(OP, "the KV caches are already registered"));
        }
        Ok(())
    }

    /// Copies `block_ids` of every layer from VRAM to the host buffer (prefill, before the
    /// decode reads them).
    ///
    /// # Errors
    /// As [`stage_from_host`](Self::stage_from_host).
    pub async fn stage_to_host(&self, block_ids: &[usize]) -> Result<()> {
        self.stage(XferOp::Write, block_ids).await
    }

    /// Copies `block_ids` of every layer from the host buffer to VRAM (decode, after a
    /// load finished without errors).
    ///
    /// # Errors
    /// [`Error::NotRegistered`] unless registered in host-buffer mode;
    /// [`Error::InvalidArgument`] for a block id out of range; [`Error::TransferTimeout`];
    /// NIXL's errors.
    pub async fn stage_from_host(&self, block_ids: &[usize]) -> Result<()> {
        self.stage(XferOp::Read, block_ids).await
    }

    async fn stage(&self, op: XferOp, block_ids: &[usize]) -> Result<()> {
        const OP: &str = "stage blocks through the host buffer";
        let staging = self
            .staging
            .get()
            .ok_or(Error::NotRegistered { operation: OP })?;
        let blocks = staging.spec.num_blocks;
        if let Some(bad) = block_ids.iter().find(|&&b| b >= blocks) {
            return Err(Error::invalid(
                OP,
                format!("block {bad} of {blocks} blocks"),
            ));
        }
        let indices: Vec<usize> = (0..staging.spec.num_layers)
            .flat_map(|layer| block_ids.iter().map(move |b| layer * blocks + b))
            .collect();
        let mut request = self.agent().make_xfer_req(
            op,
            &staging.device_list,
            &indices,
            &staging.host_list,
            &indices,
            &XferOptions::new(),
        )?;
        if request.post()? == XferStatus::Done {
            return Ok(());
        }
        let deadline = self.shared.config.transfer_timeout;
        match tokio::time::timeout(deadline, request).await {
            Ok(done) => done.map(drop).map_err(Error::from),
            Err(_) => Err(Error::TransferTimeout {
                request_id: "host-buffer staging".to_string(),
                deadline,
            }),
        }
    }
}

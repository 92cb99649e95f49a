//! Host-buffer mode, as vLLM's `kv_buffer_device = "cpu"` on a cuda platform: the engine's
//! KV cache stays in VRAM, and the connector registers a host (DRAM) copy of it, which is
//! what NIXL moves between engines.
//!
//! - The prefill computes into VRAM, then calls
//!   [`stage_to_host`](crate::KvConnectorWorker::stage_to_host) for a request's blocks before
//!   handing its params to the decode (a NIXL WRITE from the VRAM registration into the
//!   host buffer, on the worker's own agent).
//! - The decode loads into the host buffer as usual ([`KvConnectorWorker::start_load`](crate::KvConnectorWorker::start_load));
//!   once the request is in [`finished`](crate::KvConnectorWorker::finished)`.recving` without
//!   load errors, it calls [`stage_from_host`](crate::KvConnectorWorker::stage_from_host) (a NIXL
//!   READ from the host buffer into VRAM).
//!
//! The handshake describes the host buffer, so both engines of a pair must run this mode
//! (or a `cpu` kv-buffer device), and a peer's memory type must match. On a machine
//! without a CUDA device, [`register_kv_caches_host_buffer`](crate::KvConnectorWorker::register_kv_caches_host_buffer)
//! fails with [`Error::HostBufferNeedsGpu`] before allocating anything.

use nixl::{
    LocalDescList, MemType, PreparedLocal, PreparedRemote, RegDesc, Registration, RemoteDescList,
    XferDesc, XferOp, XferOptions, XferStatus,
};

use crate::error::{Error, Result};
use crate::geometry::spec::KvCacheSpec;
use crate::worker::shared::Shared;

/// The VRAM cache and the lists that copy it to and from the host buffer.
pub(crate) struct Staging {
    /// Held so that the VRAM stays registered while the lists exist.
    _device: Registration,
    device_list: PreparedLocal,
    host_list: PreparedRemote,
    spec: KvCacheSpec,
}

impl Staging {
    /// Checks that `shared`'s worker may run host-buffer mode with `device_layers`, then
    /// registers them as VRAM (first of all, so that a machine without a GPU fails before
    /// the host buffer is allocated).
    ///
    /// # Safety
    /// As [`KvConnectorWorker::register_kv_caches_host_buffer`](crate::KvConnectorWorker::register_kv_caches_host_buffer).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless the kv-buffer device is `cpu` on a `cuda` platform,
    /// or for regions that do not fit `spec`; [`Error::HostBufferNeedsGpu`] when no CUDA
    /// device is usable; NIXL's registration errors.
    pub(crate) unsafe fn register_device(
        shared: &Shared,
        device_layers: &[RegDesc],
        spec: &KvCacheSpec,
    ) -> Result<Registration> {
        const OP: &str = "register the KV caches in host-buffer mode";
        let config = &shared.config;
        let device = config.kv_transfer_config.kv_buffer_device.as_str();
        let platform = config.platform.device_type();
        if device != "cpu" || platform != "cuda" {
            return Err(Error::invalid(OP, format!(
                "host-buffer mode needs kv_buffer_device \"cpu\" on the cuda platform; this worker has {device:?} on {platform:?}"
            )));
        }
        let short = device_layers
            .iter()
            .enumerate()
            .any(|(r, d)| d.len < spec.region_len(r));
        if device_layers.len() != spec.num_regions() || short {
            let lens: Vec<usize> = (0..spec.num_regions())
                .map(|r| spec.region_len(r))
                .collect();
            return Err(Error::invalid(
                OP,
                format!(
                    "pass {} VRAM regions of at least {lens:?} bytes",
                    spec.num_regions(),
                ),
            ));
        }
        let agent = shared.setup.agent();
        let backends: Vec<&nixl::Backend> = shared.setup.backends().iter().collect();
        // SAFETY: forwarded from the caller's contract.
        unsafe { agent.register_raw(MemType::Vram, device_layers, &backends) }.map_err(|err| {
            match err {
                nixl::Error::NoCudaDevice { detail, .. } => Error::HostBufferNeedsGpu { detail },
                other => Error::Nixl(other),
            }
        })
    }

    /// The lists that copy between `vram` and the registered host buffer `host` (both of
    /// `spec`'s shape) on `shared`'s own agent.
    ///
    /// # Errors
    /// NIXL's errors.
    pub(crate) fn new(
        shared: &Shared,
        vram: Registration,
        host: &Registration,
        spec: KvCacheSpec,
    ) -> Result<Staging> {
        let agent = shared.setup.agent();
        let backends: Vec<&nixl::Backend> = shared.setup.backends().iter().collect();
        agent.load_remote_metadata(&agent.local_metadata()?)?;
        let descriptors = spec.num_regions() * spec.num_blocks;
        let mut device_list = LocalDescList::with_capacity(MemType::Vram, descriptors)?;
        let mut host_descs = Vec::with_capacity(descriptors);
        for region in 0..spec.num_regions() {
            let len = spec.block_len(region);
            device_list.push_blocks(&vram, region, len, 0..spec.num_blocks)?;
            let base = host.regions()[region].addr;
            host_descs.extend((0..spec.num_blocks).map(|b| XferDesc::new(base + b * len, len, 0)));
        }
        let device_list = agent.prepare_local(&device_list, &backends)?;
        let host_list = agent.prepare_remote(
            agent.name(),
            &RemoteDescList::from_vec(MemType::Dram, host_descs)?,
            &backends,
        )?;
        Ok(Staging {
            _device: vram,
            device_list,
            host_list,
            spec,
        })
    }

    /// Copies `block_ids` of every region between VRAM and the host buffer: a WRITE from VRAM
    /// into the host buffer, or a READ from it into VRAM.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a block id out of range; [`Error::TransferTimeout`];
    /// NIXL's errors.
    pub(crate) async fn copy(
        &self,
        shared: &Shared,
        op: XferOp,
        block_ids: &[usize],
    ) -> Result<()> {
        const OP: &str = "stage blocks through the host buffer";
        let blocks = self.spec.num_blocks;
        if let Some(bad) = block_ids.iter().find(|&&b| b >= blocks) {
            return Err(Error::invalid(
                OP,
                format!("block {bad} of {blocks} blocks"),
            ));
        }
        let indices: Vec<usize> = (0..self.spec.num_regions())
            .flat_map(|region| block_ids.iter().map(move |b| region * blocks + b))
            .collect();
        let mut request = shared.setup.agent().make_xfer_req(
            op,
            &self.device_list,
            &indices,
            &self.host_list,
            &indices,
            &XferOptions::new(),
        )?;
        if request.post()? == XferStatus::Done {
            return Ok(());
        }
        let deadline = shared.config.transfer_timeout;
        match tokio::time::timeout(deadline, request).await {
            Ok(done) => done.map(drop).map_err(Error::from),
            Err(_) => Err(Error::TransferTimeout {
                request_id: "host-buffer staging".to_string(),
                deadline,
            }),
        }
    }
}

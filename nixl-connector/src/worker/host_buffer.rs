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
//! A copy returns only once NIXL has ended it: one past the transfer timeout is reported
//! at once and still awaited, its blocks untouched by the engine meanwhile.
//!
//! The handshake describes the host buffer, so both engines of a pair must run this mode
//! (or a `cpu` kv-buffer device), and a peer's memory type must match. On a machine
//! without a CUDA device, [`register_kv_caches_host_buffer`](crate::KvConnectorWorker::register_kv_caches_host_buffer)
//! fails with [`Error::HostBufferNeedsGpu`] before allocating anything.

use std::future::IntoFuture;
use std::time::Duration;

use nixl::{
    LocalDescList, MemType, PreparedLocal, PreparedRemote, RegDesc, Registration, RemoteDescList,
    XferDesc, XferOp, XferOptions, XferRequest, XferStatus,
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
    /// into the host buffer, or a READ from it into VRAM. Returns once NIXL has ended the
    /// copy (see [`finish_copy`]): a copy past the transfer timeout is reported at once
    /// (logged, counted in `vllm:nixl_num_overdue_transfers`) and still awaited.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a block id out of range; [`Error::TransferTimeout`]
    /// (once the copy ended); NIXL's errors.
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
        finish_copy(request, deadline, || {
            shared.series.overdue();
            tracing::warn!(?op, blocks = block_ids.len(), ?deadline, "a host-buffer copy is still in flight past the transfer timeout; its blocks stay the connector's until NIXL ends it");
        })
        .await
    }
}

/// Awaits the posted copy `request` until NIXL has ended it, done or failed: until then
/// NIXL may still write its blocks, so the outcome, which hands them back to the caller,
/// comes only then. Past `deadline` it calls `overdue` once and goes on waiting; the copy
/// then ends with [`Error::TransferTimeout`] (as a load's READs do, following vLLM's
/// `_pop_done_transfers`). Dropping the future does not stop the copy either: the agent's
/// completion driver takes it over.
///
/// # Errors
/// [`Error::TransferTimeout`] for a copy that outlived `deadline`; NIXL's errors.
async fn finish_copy(
    request: XferRequest,
    deadline: Duration,
    overdue: impl FnOnce(),
) -> Result<()> {
    let mut copy = std::pin::pin!(request.into_future());
    match tokio::time::timeout(deadline, &mut copy).await {
        Ok(done) => done.map(drop).map_err(Error::from),
        Err(_) => {
            overdue();
            let ended = copy.await;
            tracing::debug!(failed = ended.is_err(), "an overdue host-buffer copy ended");
            Err(Error::TransferTimeout {
                request_id: "host-buffer staging".to_string(),
                deadline,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    use nixl::{Agent, XferOp, XferOptions};

    use super::*;

    /// A copy from an agent that makes no progress until polled (UCX needs it for the
    /// wire-up), posted and in flight: the stalled agent and the copy's source, the copy's
    /// destination, the copy and the agent that makes it.
    fn stalled_copy(len: usize) -> (Agent, Registration, Registration, XferRequest, Agent) {
        let local = Agent::new(&format!("hb-copy-{}", std::process::id())).unwrap();
        let stalled = Agent::builder(&format!("hb-stalled-{}", std::process::id()))
            .progress_thread(false)
            .build()
            .unwrap();
        let (ucx_local, ucx_stalled) = (
            local.create_backend("UCX").unwrap(),
            stalled.create_backend("UCX").unwrap(),
        );
        let destination = local
            .register_memory(vec![0u8; len], &[&ucx_local])
            .unwrap();
        let source = stalled
            .register_memory(vec![7u8; len], &[&ucx_stalled])
            .unwrap();
        local
            .load_remote_metadata(&stalled.local_metadata().unwrap())
            .unwrap();
        stalled
            .load_remote_metadata(&local.local_metadata().unwrap())
            .unwrap();
        let mut into = LocalDescList::new(MemType::Dram).unwrap();
        into.push_region(&destination, 0).unwrap();
        let r = &source.regions()[0];
        let from =
            RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(r.addr, r.len, r.dev_id)])
                .unwrap();
        let mut request = local
            .create_xfer_req(
                XferOp::Read,
                &into,
                &from,
                stalled.name(),
                &XferOptions::new(),
            )
            .unwrap();
        assert_eq!(request.post().unwrap(), XferStatus::InProgress);
        (stalled, source, destination, request, local)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_copy_past_its_deadline_is_reported_at_once_and_ends_only_with_nixl() {
        const DEADLINE: Duration = Duration::from_millis(200);
        const LEN: usize = 1 << 16;
        let (stalled, _source, destination, request, _local) = stalled_copy(LEN);
        let overdue = Arc::new(AtomicBool::new(false));
        let reported = overdue.clone();
        let started = Instant::now();
        let copy = tokio::spawn(finish_copy(request, DEADLINE, move || {
            reported.store(true, Ordering::SeqCst)
        }));
        tokio::time::sleep(2 * DEADLINE).await;
        assert!(overdue.load(Ordering::SeqCst), "reported at the deadline");
        assert!(
            !copy.is_finished(),
            "no outcome while the copy is in flight"
        );
        // The stalled agent progresses: the copy lands, and only then the outcome comes.
        while !copy.is_finished() {
            stalled.notifications().unwrap();
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the copy never ended"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let err = copy.await.unwrap().unwrap_err();
        assert!(matches!(err, Error::TransferTimeout { .. }), "{err}");
        let mut landed = vec![0u8; LEN];
        destination.read(0, 0, &mut landed).unwrap();
        assert!(
            landed.iter().all(|&b| b == 7),
            "the copy ended before its outcome"
        );
    }
}

//! Registering the KV caches again (vLLM's sleep mode: `unregister_kv_caches` at sleep,
//! `restore_kv_caches` at wake-up): [`KvConnectorWorker::register_kv_caches_again`].
//!
//! Memory NIXL may still use is never deregistered or freed early: the worker refuses to
//! let go of its caches while a load of its own is under way or a request is held for a
//! decode; loads and handshakes keep the registration they started with (NIXL's lists and
//! transfer requests hold its memory) until they end; and peers are told of the new
//! registration by a newer registration generation, so that they handshake again rather
//! than read the old addresses.

use std::net::SocketAddr;
use std::sync::Arc;

use nixl::RegisterMemory;

use super::KvConnectorWorker;
use crate::error::{Error, Result};
use crate::geometry::spec::KvCacheSpec;
use crate::transport::handshake::HandshakeMessage;
use crate::transport::pending::PendingHandshakes;
#[cfg(feature = "vllm")]
use crate::vllm::MetadataServer;

/// The side channel of the registration being replaced, which the new one is served on.
pub(crate) struct KeptChannel {
    /// The generation of the registration replaced.
    pub(super) generation: u64,
    /// What the native side channel answers with.
    pub(super) served: Arc<tokio::sync::watch::Sender<Option<Arc<HandshakeMessage>>>>,
    /// The places of its handshakes under way.
    pub(super) pending: Arc<PendingHandshakes>,
    /// Where it listens.
    pub(super) side_channel: SocketAddr,
    /// vLLM mode: the engine's side channel the payload is published to.
    #[cfg(feature = "vllm")]
    pub(super) vllm: Option<Arc<MetadataServer>>,
    /// Without the `vllm` feature there is no vLLM side channel.
    #[cfg(not(feature = "vllm"))]
    pub(super) vllm: (),
}

impl KvConnectorWorker {
    /// Registers the KV caches again, in place of those registered so far (vLLM's sleep
    /// mode: the engine deregisters its caches when it sleeps and registers them again when
    /// it wakes, `unregister_kv_caches` and `restore_kv_caches`): `caches` and `spec` as for
    /// [`register_kv_caches`](Self::register_kv_caches), which may differ from the old ones.
    ///
    /// Only an idle rank registers again: while a load of this rank is under way (its READs
    /// may still write the old memory) or a request is held for a decode (the decode may
    /// still read it), it is refused, and nothing changes. Drain the engine first, as vLLM
    /// does before it sleeps: stop scheduling, and register again once every load and send
    /// has been reported finished ([`output`](Self::output)). Then the old registration is
    /// deregistered and dropped (its owned memory freed; a READ of a load that started
    /// concurrently with this call still holds it until NIXL ends that READ), what this
    /// rank learned of remote ranks is forgotten (their lists were prepared over the old
    /// registration; the next loads handshake again), the new caches are registered, and the
    /// side channel, kept at its address, answers with the new registration. Between the two
    /// it answers nobody: a peer's handshake then fails and is tried again later.
    ///
    /// [`registration_generation`](Self::registration_generation) counts the registrations.
    /// Peers that handshook with the old one must learn of the new one before they read:
    /// in vLLM mode the engine's side channel starts a new registration generation when the
    /// payload changes, which the prefill's params carry (vLLM's
    /// `remote_registration_generation`; where that side channel runs in another process,
    /// publish the rank's new `vllm_handshake_payload`
    /// there, as after the first registration); in the native protocol, tell the engine's
    /// scheduler ([`KvConnectorScheduler::kv_caches_registered_again`](crate::KvConnectorScheduler::kv_caches_registered_again))
    /// once every rank has registered again. A decode seeing a newer generation forgets the
    /// engine's ranks and handshakes again (vLLM's `_read_blocks_for_req`).
    ///
    /// If the new registration fails, the worker is left without caches
    /// ([`Error::NotRegistered`] from then on) and its side channel answers nobody.
    ///
    /// # Errors
    /// [`Error::NotRegistered`] before a first registration; [`Error::InvalidArgument`]
    /// while loads are under way or requests held (with their counts), in host-buffer mode
    /// (not supported), or for a spec that does not fit; then the errors of
    /// [`register_kv_caches`](Self::register_kv_caches).
    pub fn register_kv_caches_again<M: RegisterMemory + 'static>(
        &mut self,
        caches: M,
        spec: KvCacheSpec,
    ) -> Result<()> {
        const OP: &str = "register the KV caches again";
        self.check_spec(&spec)?;
        let kept = self.retire_caches(OP)?;
        let registration = self.shared.setup.register_memory(caches)?;
        self.finish_registration(registration, spec, Some(kept))
    }

    /// [`register_kv_caches_again`](Self::register_kv_caches_again) with zeroed
    /// [`HostBuffer`](nixl::HostBuffer)s, as
    /// [`register_host_kv_caches`](Self::register_host_kv_caches) allocates them.
    ///
    /// # Errors
    /// As [`register_kv_caches_again`](Self::register_kv_caches_again); allocation errors.
    pub fn register_host_kv_caches_again(&mut self, spec: KvCacheSpec) -> Result<()> {
        self.check_spec(&spec)?;
        let regions = (0..spec.num_regions())
            .map(|r| nixl::HostBuffer::backed(spec.region_len(r)))
            .collect::<nixl::Result<Vec<_>>>()?;
        self.register_kv_caches_again(regions, spec)
    }

    /// How many times this rank registered its KV caches (0 before the first registration,
    /// then 1, and one more with each [`register_kv_caches_again`](Self::register_kv_caches_again)).
    pub fn registration_generation(&self) -> u64 {
        self.registered.get().map_or(0, |caches| caches.generation)
    }

    /// Lets go of the registered caches if this rank is idle: stops serving them, forgets
    /// the remote ranks prepared over them, and drops them; the side channel to serve the
    /// next registration on.
    fn retire_caches(&mut self, operation: &'static str) -> Result<KeptChannel> {
        if self.staging.get().is_some() {
            return Err(Error::invalid(
                operation,
                "registering again is not supported in host-buffer mode; create a new worker",
            ));
        }
        let Some(old) = self.registered.get() else {
            return Err(Error::NotRegistered { operation });
        };
        let loads = self.shared.outcomes.lock().under_way();
        let held = self.shared.sends.lock().held_count();
        if loads > 0 || held > 0 {
            return Err(Error::invalid(
                operation,
                format!(
                    "{loads} load(s) under way and {held} request(s) held for decodes on this rank: NIXL may still use the registered memory; register again once the engine has drained (every load and send reported in the workers' output), as vLLM does before it sleeps"
                ),
            ));
        }
        old.served.send_replace(None);
        #[cfg(feature = "vllm")]
        if let Some((server, _)) = &old.vllm {
            let (pp_rank, tp_rank) = super::vllm_rank(&self.shared.config);
            server.withdraw(pp_rank, tp_rank);
        }
        self.shared.caches.clear();
        self.shared.remotes.forget_all();
        let old = self
            .registered
            .take()
            .ok_or(Error::NotRegistered { operation })?;
        let kept = KeptChannel {
            generation: old.generation,
            served: old.served.clone(),
            pending: old.side_channel_pending.clone(),
            side_channel: old.side_channel,
            #[cfg(feature = "vllm")]
            vllm: old.vllm.as_ref().map(|(server, _)| server.clone()),
            #[cfg(not(feature = "vllm"))]
            vllm: (),
        };
        tracing::info!(engine = %self.shared.config.engine_id, rank = self.shared.config.tp_rank, generation = old.generation, "KV caches deregistered, to be registered again");
        // Deregisters and frees, unless a READ that started concurrently still holds it.
        drop(old);
        Ok(kept)
    }
}

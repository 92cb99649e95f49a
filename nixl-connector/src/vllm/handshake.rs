//! A worker's side of vLLM's protocol: as a decode, the handshake with one rank of a remote
//! engine (vLLM's `_nixl_handshake`): the rank's payload fetched from the engine's ROUTER,
//! the compatibility hash checked before the metadata is decoded, the metadata's geometry
//! converted into a [`HandshakeMessage`] for [`check_compatible`](crate::check_compatible),
//! and the clock offset kept; then the registration generations and block expiry times of
//! the loads.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use super::client::fetch_meta;
use super::compat::Compatibility;
use super::limits::VllmChannelLimits;
use crate::error::{Error, Result};
use crate::geometry::groups::KvCacheGroups;
use crate::geometry::pipeline::{PipelineRank, PipelineStages};
use crate::transport::handshake::{HandshakeMessage, MAX_BLOCKS_PER_ID, PROTOCOL_VERSION};
use crate::transport::params::{newer_generation, RemoteBlocks};

/// How long before a prefill's block expiry time a read is declined (vLLM's
/// `_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`): it absorbs the clock offset's error and the read.
pub const EXPIRY_SAFETY_MARGIN: Duration = Duration::from_secs(5);

/// A worker's vLLM-mode settings, and what its handshakes learned of remote engines.
#[derive(Debug)]
pub(crate) struct VllmWorker {
    /// Our hash, and whether peers must match it.
    pub(crate) compat: Compatibility,
    /// The side channel's caps and deadlines.
    pub(crate) limits: VllmChannelLimits,
    engines: Mutex<HashMap<String, EngineClock>>,
}

/// What the handshakes with one remote engine learned.
#[derive(Debug, Clone, Copy, Default)]
struct EngineClock {
    /// The round trip and clock offset of the handshake with the smallest round trip.
    best: Option<(f64, f64)>,
    /// The registration generation its ranks were loaded at.
    generation: u64,
}

impl VllmWorker {
    pub(crate) fn new(compat: Compatibility, limits: VllmChannelLimits) -> Self {
        VllmWorker {
            compat,
            limits,
            engines: Mutex::new(HashMap::new()),
        }
    }

    fn engines(&self) -> MutexGuard<'_, HashMap<String, EngineClock>> {
        self.engines.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the engine at `host:port` for rank `(pp_rank, rank)`'s payload (vLLM's
    /// `_nixl_handshake` over every `(remote_pp_rank, remote_tp_rank)`), checks its hash and
    /// decodes its metadata as vLLM's decode does, and converts it for `ours` (the engine
    /// serves the same model: its KV heads and attention are ours), with the TP and pipeline
    /// sizes of the transfer params (its stages split our layers by vLLM's even rule).
    ///
    /// # Errors
    /// The side channel's errors ([`Error::Refused`] for a rank the engine lacks);
    /// [`Error::CompatibilityMismatch`] naming both hashes; [`Error::Protocol`] for metadata
    /// that does not decode; [`Error::InvalidArgument`] for geometry the connector does not
    /// read (see [`NixlAgentMetadata::kv_cache_spec`](super::NixlAgentMetadata::kv_cache_spec))
    /// or agent metadata that is not NIXL's.
    pub(crate) async fn fetch(
        &self,
        (ours, groups, pcp): (&HandshakeMessage, &KvCacheGroups, u64),
        (pp_rank, rank): (usize, usize),
        (pp_size, tp_size): (usize, usize),
        (host, port): (&str, u16),
    ) -> Result<HandshakeMessage> {
        let asked = |rank: usize| {
            u32::try_from(rank)
                .map_err(|_| Error::invalid("ask for a vLLM rank", format!("rank {rank}")))
        };
        let reply = fetch_meta(host, port, asked(pp_rank)?, asked(rank)?, self.limits).await?;
        let peer = format!("{host}:{port}");
        let meta = self.compat.check(&reply.payload, &peer)?;
        self.clock_sample(&meta.engine_id, reply.rtt(), reply.clock_offset());
        if let Some(why) = pcp_refusal((pcp, ours.dcp_size), (meta.pcp_size, meta.dcp_size)) {
            return Err(Error::invalid("pair with a vLLM prefill", why));
        }
        let reader_tp = usize::try_from(ours.tp_size).unwrap_or(usize::MAX);
        let ssm = groups
            .checked_ssm_state()?
            .map(|state| (state, reader_tp, tp_size));
        let spec = meta.kv_cache_spec_for(ours.spec.attention, groups.own_region_groups(), ssm)?;
        if let Some(types) = meta.region_mem_types.as_ref() {
            if types.len() != spec.num_regions() {
                return Err(Error::invalid(
                    "convert vLLM's NixlAgentMetadata",
                    format!(
                        "{} memory types for {} regions",
                        types.len(),
                        spec.num_regions()
                    ),
                ));
            }
        }
        let blocks_per_id = match meta.physical_blocks_per_logical_kv_block {
            n @ 1..=MAX_BLOCKS_PER_ID => n,
            n => {
                return Err(Error::invalid(
                    "convert vLLM's NixlAgentMetadata",
                    format!("physical_blocks_per_logical_kv_block {n} (1 to {MAX_BLOCKS_PER_ID})"),
                ))
            }
        };
        // vLLM's metadata says the state's sums only (`ssm_sizes`), which match ours scaled:
        // its parts are taken to be ours scaled too (the same model).
        let ssm_state = match ssm {
            None => None,
            Some((state, reader_tp, tp_size)) => Some(state.scaled(reader_tp, tp_size).ok_or_else(|| {
                Error::invalid(
                    "convert vLLM's NixlAgentMetadata",
                    format!("the SSM state's parts ({state}) do not split over the prefill's TP {tp_size} from this engine's {reader_tp}"),
                )
            })?),
        };
        let agent_name = nixl::metadata_agent_name(&meta.agent_metadata)?;
        Ok(HandshakeMessage {
            protocol_version: PROTOCOL_VERSION,
            engine_id: meta.engine_id,
            agent_name,
            agent_metadata: meta.agent_metadata,
            region_base_addrs: meta.kv_caches_base_addr,
            spec,
            device_id: meta.device_id,
            tp_rank: rank as u64,
            tp_size: tp_size as u64,
            ssm_state,
            // Checked against ours in the conversion: one per region.
            region_groups: meta.region_group_ids.unwrap_or_default(),
            // Bounded by the payload's limits; checked where regions pair by them.
            region_layers: meta.region_members,
            // The block ids of its transfer params are logical.
            blocks_per_id,
            // vLLM's metadata does not say the stages: vLLM's even rule over our layers.
            pp_rank: pp_rank as u64,
            pp_partition: peer_partition(&ours.pp_partition, layers_of(ours), pp_size)?,
            dcp_size: meta.dcp_size,
            // vLLM's readers do not claim.
            claims: Vec::new(),
            claimed: Vec::new(),
            // vLLM's protocol has no release marks.
            release_marks: None,
        })
    }

    /// Keeps the clock offset to `engine` of the handshake with the smallest round trip,
    /// as vLLM does.
    fn clock_sample(&self, engine: &str, rtt: f64, offset: f64) {
        let mut engines = self.engines();
        let clock = engines.entry(engine.to_string()).or_default();
        if clock.best.map_or(true, |(best, _)| rtt < best) {
            clock.best = Some((rtt, offset));
        }
    }

    /// The estimated clock offset to `engine` (its clock minus ours), once a handshake ran.
    pub(crate) fn clock_offset(&self, engine: &str) -> Option<f64> {
        self.engines()
            .get(engine)
            .and_then(|c| c.best)
            .map(|(_, offset)| offset)
    }

    /// Why a READ of `remote`'s blocks that ended at `now` (our [`perf_counter`](super::clock::perf_counter))
    /// may have outlived them: their expiry time, on our clock through the clock offset, is
    /// not ahead of `now` by more than the offset's error (half the handshake's round trip),
    /// so the prefill may have freed them before the READ ended. `None` without an expiry
    /// time or before any handshake with the engine.
    pub(crate) fn outlived(&self, remote: &RemoteBlocks, now: f64) -> Option<Error> {
        let expiry = remote.blocks_expiry_time?;
        let (rtt, offset) = self.engines().get(&remote.engine_id)?.best?;
        let deadline = expiry - offset;
        (deadline - now <= rtt / 2.0).then(|| Error::LeaseOutlived {
            request_id: remote.request_id.clone(),
            engine: remote.engine_id.clone(),
            detail: format!(
                "the READ ended at {now:.3} s on this clock, the blocks' expiry time is {deadline:.3} s on it (clock offset {offset:.3} s, its error up to {:.3} s)",
                rtt / 2.0
            ),
        })
    }

    /// Whether `remote`'s registration generation is newer than the one its engine's ranks
    /// were loaded at (the engine registered its KV cache again; the rule is
    /// [`newer_generation`]'s): then it is remembered, and the caller forgets the engine's
    /// ranks so that they are handshaken with again. Params without a generation are not.
    pub(crate) fn newer_generation(&self, remote: &RemoteBlocks) -> bool {
        let Some(generation) = remote.registration_generation else {
            return false;
        };
        let mut engines = self.engines();
        let clock = engines.entry(remote.engine_id.clone()).or_default();
        newer_generation(&mut clock.generation, generation)
    }

    /// Forgets what the handshakes with `engine` learned (it was evicted).
    pub(crate) fn forget(&self, engine: &str) {
        self.engines().remove(engine);
    }

    /// Why `remote`'s blocks must not be read at `now` (our [`perf_counter`](super::clock::perf_counter)):
    /// its expiry time, read on our clock through the clock offset, is within
    /// [`EXPIRY_SAFETY_MARGIN`] (vLLM's `_is_turn2_read_expired`). `None` without an expiry
    /// time or before any handshake with the engine.
    pub(crate) fn expired(&self, remote: &RemoteBlocks, now: f64) -> Option<Error> {
        let expiry = remote.blocks_expiry_time?;
        let offset = self.clock_offset(&remote.engine_id)?;
        let deadline = expiry - offset;
        let left = deadline - now;
        (left <= EXPIRY_SAFETY_MARGIN.as_secs_f64()).then(|| Error::BlocksExpired {
            request_id: remote.request_id.clone(),
            engine: remote.engine_id.clone(),
            left,
            clock_offset: offset,
        })
    }
}

/// Why a reader of PCP and DCP sizes `local` does not read a vLLM engine of PCP and DCP
/// sizes `remote`, if it does not, with vLLM's reasons (`_validate_remote_parallel_config`):
/// a remote PCP+DCP that does not span its PCP group, or replicated PCP (DCP 1) on one side
/// against a DCP-sharded engine on the other. What vLLM pairs is read as the source
/// presents it: a PCP+DCP engine as its PCP ranks, each a DCP rank (its params' `tp_size`
/// is the PCP size, vLLM's `transfer_tp_size`); a replicated one as its TP ranks (its PCP
/// rank 0 serves the KV, the others free at once).
fn pcp_refusal(
    (local_pcp, local_dcp): (u64, u64),
    (remote_pcp, remote_dcp): (u64, u64),
) -> Option<String> {
    if remote_pcp > 1 && remote_dcp != 1 && remote_dcp != remote_pcp {
        return Some(format!("Remote NixlConnector PCP+DCP does not span the full PCP group. Remote PCP/DCP={remote_pcp}/{remote_dcp}."));
    }
    let replicated_here = local_pcp > 1 && local_dcp == 1 && remote_dcp > 1;
    let replicated_there = remote_pcp > 1 && remote_dcp == 1 && local_dcp > 1;
    (replicated_here || replicated_there).then(|| format!("Replicated PCP cannot be paired with a DCP-sharded NIXL peer. Local PCP/DCP={local_pcp}/{local_dcp}; remote PCP/DCP={remote_pcp}/{remote_dcp}."))
}

/// The reader's layers in `ours`: its named layers, else one a region (as vLLM registers
/// its layers without a hybrid model's shared tensors).
fn layers_of(ours: &HandshakeMessage) -> usize {
    match ours.region_layers.iter().map(Vec::len).sum() {
        0 => ours.spec.num_regions(),
        named => named,
    }
}

/// The partition of a peer of `pp_size` stages whose handshake does not say it (vLLM's
/// `NixlAgentMetadata` has no stages): vLLM's even rule over the reader's layers, those of
/// its own partition, or `reader_layers` when it has none; empty for one stage.
///
/// # Errors
/// [`Error::InvalidArgument`] when the layers cannot be split over `pp_size` stages.
fn peer_partition(
    reader_partition: &[u64],
    reader_layers: usize,
    pp_size: usize,
) -> Result<Vec<u64>> {
    if pp_size <= 1 {
        return Ok(Vec::new());
    }
    let layers = match reader_partition {
        [] | [_] => reader_layers,
        partition => partition.iter().map(|&n| n as usize).sum(),
    };
    Ok(PipelineRank::new(PipelineStages::even(layers, pp_size)?, 0)?.partition())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_does_not_say_its_stages_is_split_by_vllms_rule() {
        assert_eq!(
            peer_partition(&[], 5, 2).unwrap(),
            [3, 2],
            "a region a layer"
        );
        assert_eq!(
            peer_partition(&[2, 3], 6, 2).unwrap(),
            [3, 2],
            "the reader's layers"
        );
        assert!(peer_partition(&[], 32, 1).unwrap().is_empty());
        assert!(peer_partition(&[], 1, 2).is_err());
    }

    #[test]
    fn a_pcp_peer_is_read_where_vllm_reads_it_and_refused_with_its_reason_elsewhere() {
        assert_eq!(pcp_refusal((1, 2), (1, 2)), None);
        let spans = pcp_refusal((1, 1), (4, 2)).unwrap();
        assert!(
            spans.contains("does not span the full PCP group. Remote PCP/DCP=4/2"),
            "{spans}"
        );
        let replicated = pcp_refusal((1, 2), (2, 1)).unwrap();
        assert!(replicated.contains("Replicated PCP cannot be paired with a DCP-sharded NIXL peer. Local PCP/DCP=1/2; remote PCP/DCP=2/1."), "{replicated}");
        // The reader replicated, the source sharded: refused the same way.
        let here = pcp_refusal((2, 1), (1, 2)).unwrap();
        assert!(
            here.contains("Local PCP/DCP=2/1; remote PCP/DCP=1/2."),
            "{here}"
        );
        // What vLLM pairs: replicated PCP with an unsharded engine on the other side,
        // PCP+DCP spanning the group with any reader, either way.
        for (local, remote) in [
            ((1, 1), (2, 1)),
            ((1, 2), (2, 2)),
            ((1, 1), (4, 4)),
            ((2, 1), (1, 1)),
            ((2, 2), (1, 2)),
            ((2, 2), (2, 2)),
        ] {
            assert_eq!(pcp_refusal(local, remote), None, "{local:?} {remote:?}");
        }
    }

    fn worker() -> VllmWorker {
        let compat = Compatibility {
            hash: String::new(),
            enforce: false,
            factors: None,
        };
        VllmWorker::new(compat, VllmChannelLimits::default())
    }

    fn remote(expiry: Option<f64>, generation: Option<u64>) -> RemoteBlocks {
        RemoteBlocks {
            engine_id: "p".into(),
            host: "h".into(),
            port: 1,
            block_ids: vec![0],
            group_lens: Vec::new(),
            request_id: "r".into(),
            tp_size: 1,
            pp_size: 1,
            dcp_size: 1,
            num_tokens: None,
            blocks_expiry_time: expiry,
            registration_generation: generation,
            capability: None,
            lease_epoch: None,
            kept: false,
        }
    }

    #[test]
    fn expiry_is_read_through_the_best_clock_offset() {
        let w = worker();
        // No handshake yet: nothing is known to be expired.
        assert!(w.expired(&remote(Some(0.0), None), 100.0).is_none());
        // The prefill's clock is 1000 s ahead of ours (the best of two samples).
        w.clock_sample("p", 0.5, 990.0);
        w.clock_sample("p", 0.001, 1000.0);
        w.clock_sample("p", 0.2, 900.0);
        assert_eq!(w.clock_offset("p"), Some(1000.0));
        // Expiry 1110 on its clock is 110 on ours.
        assert!(w.expired(&remote(Some(1110.0), None), 100.0).is_none());
        let err = w.expired(&remote(Some(1110.0), None), 106.0).unwrap();
        assert!(matches!(err, Error::BlocksExpired { .. }), "{err}");
        assert!(err.to_string().contains("1000"), "{err}");
        assert!(w.expired(&remote(None, None), 1e9).is_none());
        // After the READ: outlived once the expiry is within the offset's error (1 ms).
        assert!(w.outlived(&remote(Some(1110.0), None), 109.0).is_none());
        let err = w.outlived(&remote(Some(1110.0), None), 109.9999).unwrap();
        assert!(matches!(err, Error::LeaseOutlived { .. }), "{err}");
        assert!(w.outlived(&remote(Some(1110.0), None), 111.0).is_some());
        assert!(w.outlived(&remote(None, None), 1e9).is_none());
    }

    #[test]
    fn only_a_newer_generation_forgets_an_engine() {
        let w = worker();
        assert!(!w.newer_generation(&remote(None, None)));
        assert!(
            !w.newer_generation(&remote(None, Some(0))),
            "vLLM's default"
        );
        assert!(
            w.newer_generation(&remote(None, Some(1))),
            "the first one seen is newer than the 0 stored"
        );
        assert!(!w.newer_generation(&remote(None, Some(1))));
        assert!(w.newer_generation(&remote(None, Some(2))));
        assert!(!w.newer_generation(&remote(None, Some(1))), "an older one");
    }
}

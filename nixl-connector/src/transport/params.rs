//! The transfer params handed from a prefill engine to a decode engine with each request.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::geometry::dcp::MAX_DCP_SIZE;
use crate::geometry::pipeline::MAX_PP_SIZE;
use crate::transport::capability::Capability;

/// vLLM's `kv_transfer_params`: on a request sent to prefill, `do_remote_decode`; on the
/// prefill's answer (handed to decode), where and which blocks to read.
///
/// It holds every key of vLLM 0.33's params, and keeps the keys it does not know in
/// [`vllm_extra`](Self::vllm_extra), so that vLLM's JSON converts to it and back unchanged
/// ([`VllmKvTransferParams`](crate::vllm::VllmKvTransferParams)).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// The request's KV is computed elsewhere and must be read (decode side).
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// The request's KV will be read by a remote decode (prefill side).
    #[serde(default)]
    pub do_remote_decode: bool,
    /// The prefill engine's id.
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    /// The prefill engine's side-channel host.
    #[serde(default)]
    pub remote_host: Option<String>,
    /// The prefill engine's side-channel port: TP rank 0's of stage 0 in the native protocol
    /// (rank `r` of stage `s` listens on port + `s` × TP size + `r`), the engine's one ROUTER
    /// in vLLM's (ranks asked by number).
    #[serde(default)]
    pub remote_port: Option<u16>,
    /// The prefill's block ids holding the request's KV, in token order; for a hybrid
    /// model, each KV cache group's in turn (see
    /// [`remote_block_group_lens`](Self::remote_block_group_lens)).
    #[serde(default)]
    pub remote_block_ids: Vec<usize>,
    /// For a hybrid model of several KV cache groups ([`KvCacheGroups`](crate::KvCacheGroups)):
    /// how many of `remote_block_ids` each group has, in order (vLLM's `remote_block_ids`
    /// is one list per group, these lists flattened). Empty: one group.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remote_block_group_lens: Vec<usize>,
    /// The request's id on the prefill engine (the notification names it).
    #[serde(default)]
    pub remote_request_id: Option<String>,
    /// The prefill engine's TP size (vLLM's `tp_size`).
    #[serde(default)]
    pub remote_tp_size: Option<usize>,
    /// Tokens the prefill computed (vLLM's `remote_num_tokens`): needed to pair a decode's
    /// blocks with a prefill's larger ones when the decode's prefix cache holds part of the
    /// prompt or the prompt ends inside a block, and a hybrid model's blocks of different
    /// sizes (see [`RemoteBlocks::num_tokens`]).
    #[serde(default)]
    pub remote_num_tokens: Option<usize>,
    /// The prefill engine's decode context parallel size (vLLM's `dcp_size`; `None`: 1): a
    /// decode reads each of its blocks' global positions from the prefill rank holding it
    /// (see [`DcpPair`](crate::DcpPair)).
    #[serde(default)]
    pub remote_dcp_size: Option<usize>,
    /// The prefill engine's pipeline parallel size (vLLM's `pp_size`; `None`: 1). A decode
    /// reads each of its layers from the prefill stage holding it.
    #[serde(default)]
    pub remote_pp_size: Option<usize>,
    /// When the prefill frees the blocks, on its own clock (vLLM's
    /// `remote_blocks_expiry_time`, seconds of its `time.perf_counter()`); a decode in vLLM
    /// mode reads it on its clock through the handshake's clock offset and declines a read
    /// past it.
    #[serde(default)]
    pub remote_blocks_expiry_time: Option<f64>,
    /// The prefill's registration generation (vLLM's `remote_registration_generation`): a
    /// decode in vLLM mode that handshook with an older one handshakes again.
    #[serde(default)]
    pub remote_registration_generation: Option<u64>,
    /// `"pull"` (the decode READs; also when absent) or `"push"` (the prefill WRITEs into
    /// blocks the decode registers: [`TransferMode`](crate::TransferMode)); engines of
    /// different modes refuse each other's params.
    #[serde(default)]
    pub transfer_mode: Option<String>,
    /// The request's capability (native protocol): the decode's finish notifications and
    /// heartbeats for the request count only with tags made under it, so only whoever got
    /// these params can free the prefill's blocks or extend their lease. Keep the params as
    /// private as the KV they lead to. vLLM's protocol has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_capability: Option<Capability>,
    /// The request's lease epoch (native protocol; see
    /// [`ReleaseMarks`](crate::ReleaseMarks)): after its READ, a decode fails
    /// the load if a release mark of a block it read is at or past it. vLLM's protocol has
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_lease_epoch: Option<u64>,
    /// Keys of vLLM's JSON this type has no field for, and known keys whose value was
    /// `null`, as they came.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub vllm_extra: Map<String, Value>,
}

/// Where a load reads from: the complete remote half of [`KvTransferParams`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemoteBlocks {
    /// The prefill engine's id.
    pub engine_id: String,
    /// Its side-channel host.
    pub host: String,
    /// Its side-channel port (see [`KvTransferParams::remote_port`]).
    pub port: u16,
    /// Its block ids, paired in order with the local ones.
    pub block_ids: Vec<usize>,
    /// For several KV cache groups, how many of `block_ids` each has (see
    /// [`KvTransferParams::remote_block_group_lens`]). A load whose
    /// [`LoadSpec::local_group_lens`](crate::LoadSpec::local_group_lens) are given pairs
    /// each group's local blocks with its remote ones at their tokens of the prompt (the
    /// scheduler's
    /// [`update_state_after_alloc_groups`](crate::KvConnectorScheduler::update_state_after_alloc_groups)).
    /// Empty: one group.
    #[serde(default)]
    pub group_lens: Vec<usize>,
    /// The request's id there.
    pub request_id: String,
    /// Its TP size.
    pub tp_size: usize,
    /// Its pipeline stages (1: none). Its rank `(pp_rank, tp_rank)` listens at
    /// [`port`](Self::port) + `pp_rank` × `tp_size` + `tp_rank` (native protocol).
    #[serde(default = "one_stage")]
    pub pp_size: usize,
    /// Its decode context parallel size (1: none): its rank `r` holds the request's blocks
    /// at global positions `r % dcp_size`, `r % dcp_size + dcp_size`, ... (see
    /// [`DcpPair`](crate::DcpPair)), `block_ids[j]` position `j * dcp_size + r % dcp_size`.
    #[serde(default = "no_dcp")]
    pub dcp_size: usize,
    /// Tokens it computed, if known. Only a decode whose blocks are smaller than the
    /// prefill's needs it, to know which of the prefill's tokens its blocks start at; without
    /// it, such a load must cover every token of the prefill's blocks. A load of several KV
    /// cache groups needs it when the blocks differ in size or a block id is several kernel
    /// blocks: it says where each group's lists are in the prompt.
    pub num_tokens: Option<usize>,
    /// When it frees the blocks, on its clock (see
    /// [`KvTransferParams::remote_blocks_expiry_time`]; vLLM mode).
    pub blocks_expiry_time: Option<f64>,
    /// Its registration generation (see
    /// [`KvTransferParams::remote_registration_generation`]; vLLM mode).
    pub registration_generation: Option<u64>,
    /// The request's capability (see [`KvTransferParams::remote_capability`]; native
    /// protocol).
    #[serde(default)]
    pub capability: Option<Capability>,
    /// The request's lease epoch (see [`KvTransferParams::remote_lease_epoch`]; native
    /// protocol): without one the load is not checked against release marks.
    #[serde(default)]
    pub lease_epoch: Option<u64>,
    /// The blocks are a decode's, kept for a read-back (multi-turn: the params'
    /// `do_remote_decode`). In the native protocol a load claims them in a handshake before
    /// it reads, and reads nothing if they are gone.
    #[serde(default)]
    pub kept: bool,
}

impl KvTransferParams {
    /// The remote half, when every field of it is present.
    pub fn remote_blocks(&self) -> Option<RemoteBlocks> {
        Some(RemoteBlocks {
            engine_id: self.remote_engine_id.clone()?,
            host: self.remote_host.clone()?,
            port: self.remote_port?,
            block_ids: self.remote_block_ids.clone(),
            group_lens: self.remote_block_group_lens.clone(),
            request_id: self.remote_request_id.clone()?,
            tp_size: self.remote_tp_size?,
            pp_size: self.remote_pp_size.unwrap_or(1),
            dcp_size: self.remote_dcp_size.unwrap_or(1),
            num_tokens: self.remote_num_tokens,
            blocks_expiry_time: self.remote_blocks_expiry_time,
            registration_generation: self.remote_registration_generation,
            capability: self.remote_capability.clone(),
            lease_epoch: self.remote_lease_epoch,
            kept: self.do_remote_decode,
        })
    }

    /// Refuses what the connector cannot read in either mode: a `transfer_mode` other than
    /// `"pull"` or `"push"` (an engine refuses the other mode's params in
    /// [`TransferMode::check_params`](crate::TransferMode::check_params)), a DCP size of 0 or
    /// more than [`MAX_DCP_SIZE`], and a pipeline of no stage or more than [`MAX_PP_SIZE`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the key and its value.
    pub fn check_supported(&self) -> Result<()> {
        const OP: &str = "read kv_transfer_params";
        if let Some(mode) = self
            .transfer_mode
            .as_deref()
            .filter(|&m| m != "pull" && m != "push")
        {
            return Err(Error::invalid(
                OP,
                format!("transfer_mode {mode:?} is not a transfer mode: \"pull\" or \"push\""),
            ));
        }
        self.check_geometry()
    }

    /// Refuses a DCP size of 0 or more than [`MAX_DCP_SIZE`], and a pipeline of no stage or
    /// more than [`MAX_PP_SIZE`].
    pub(crate) fn check_geometry(&self) -> Result<()> {
        const OP: &str = "read kv_transfer_params";
        if let Some(size) = self
            .remote_dcp_size
            .filter(|s| !(1..=MAX_DCP_SIZE).contains(s))
        {
            return Err(Error::invalid(
                OP,
                format!("dcp_size {size}: 1 to {MAX_DCP_SIZE} ranks"),
            ));
        }
        if let Some(size) = self
            .remote_pp_size
            .filter(|s| !(1..=MAX_PP_SIZE).contains(s))
        {
            return Err(Error::invalid(
                OP,
                format!("pp_size {size}: 1 to {MAX_PP_SIZE} stages"),
            ));
        }
        Ok(())
    }
}

/// [`RemoteBlocks::pp_size`] of params that do not say it.
pub(crate) fn one_stage() -> usize {
    1
}

/// [`RemoteBlocks::dcp_size`] of params that do not say it.
pub(crate) fn no_dcp() -> usize {
    1
}

/// Whether `generation`, the registration generation a remote engine's transfer params
/// carry ([`RemoteBlocks::registration_generation`]), is newer than `seen`, the one its
/// ranks were handshaken with, 0 before any: vLLM's rule
/// (`_remote_registration_generations.get(engine_id, 0) < generation` in its
/// `_start_load_kv`), in both protocols. The first generation above 0 counts too: ranks
/// handshaken before it (for heartbeats, or a load that carried none) may hold the metadata
/// of a registration since replaced. A newer one becomes `seen`, and the caller forgets the
/// engine's ranks, so that the next loads handshake again and never read the addresses of
/// the registration it replaced.
pub(crate) fn newer_generation(seen: &mut u64, generation: u64) -> bool {
    if generation <= *seen {
        return false;
    }
    *seen = generation;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_generation_above_the_one_seen_is_newer() {
        let mut seen = 0;
        assert!(!newer_generation(&mut seen, 0), "0 is vLLM's default");
        assert!(newer_generation(&mut seen, 1), "the first one above 0");
        assert!(!newer_generation(&mut seen, 1), "the same one");
        assert!(newer_generation(&mut seen, 3));
        assert!(!newer_generation(&mut seen, 2), "an older one");
        assert_eq!(seen, 3);
    }
}

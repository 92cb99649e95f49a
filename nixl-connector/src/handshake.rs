//! The handshake message two engines exchange, and the check that refuses a peer whose KV
//! cache cannot be transferred with ours.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::spec::{KvCacheSpec, KvLayout};

/// Version of the side-channel protocol and handshake; peers of another version are refused.
pub const PROTOCOL_VERSION: u32 = 1;

/// Most descriptors a peer's cache may need (layers × blocks); a larger declared cache is
/// refused before anything is allocated for it.
pub const MAX_REMOTE_DESCRIPTORS: usize = 1 << 22;

/// What an engine's TP rank tells a peer about itself and its KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandshakeMessage {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol_version: u32,
    /// The sending engine's id.
    pub engine_id: String,
    /// The sender's NIXL agent name.
    pub agent_name: String,
    /// The sender's NIXL agent metadata.
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// Base address of each layer's region.
    pub layer_base_addrs: Vec<u64>,
    /// Length in bytes of one block, per layer.
    pub block_lens: Vec<u64>,
    /// Blocks per layer.
    pub num_blocks: u64,
    /// Tokens per block.
    pub block_size: u64,
    /// KV heads held by the sender's rank.
    pub num_kv_heads: u64,
    /// Elements per head.
    pub head_dim: u64,
    /// Bytes per element.
    pub dtype_size: u64,
    /// Byte order of a block.
    pub layout: KvLayout,
    /// Device id NIXL uses for the memory.
    pub device_id: u64,
    /// The sender's TP rank.
    pub tp_rank: u64,
    /// The sender's TP size.
    pub tp_size: u64,
}

/// How this (decode) rank reads from a compatible peer rank, from [`check_compatible`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadPlan {
    /// Byte offset of this rank's head slice inside a peer block.
    pub slice_offset: usize,
    /// Bytes read per block and layer (this rank's block length).
    pub slice_len: usize,
    /// The peer's block length.
    pub remote_block_len: usize,
    /// The peer's blocks per layer.
    pub remote_num_blocks: usize,
}

/// Which peer rank a rank of TP `tp_size` reads from, given the peer's TP.
///
/// # Errors
/// [`Error::InvalidArgument`] unless `tp_size` is a multiple of `remote_tp_size` (a decode
/// with a smaller TP than its prefill is not supported).
pub fn remote_rank_for(tp_rank: usize, tp_size: usize, remote_tp_size: usize) -> Result<usize> {
    if remote_tp_size == 0 || tp_size == 0 || tp_size % remote_tp_size != 0 || tp_rank >= tp_size {
        return Err(Error::invalid(
            "choose the remote rank",
            format!(
                "this rank {tp_rank} of TP {tp_size} cannot read from a peer of TP {remote_tp_size}: \
                 the reader's TP must be a multiple of the peer's (reading from a larger TP is not supported)"
            ),
        ));
    }
    Ok(tp_rank / (tp_size / remote_tp_size))
}

/// Checks that `local` (the reader) can read `remote`'s blocks, and says how.
///
/// Refused, with both values in the message: another protocol version; a different engine
/// or rank than expected; different layer count, block size, head dim, dtype size or
/// layout; a TP ratio that is not a whole number; a different total head count; NHD with
/// different TPs; block lengths that disagree with the geometry; a cache larger than
/// [`MAX_REMOTE_DESCRIPTORS`] or whose addresses overflow.
///
/// # Errors
/// [`Error::Incompatible`].
pub fn check_compatible(
    local: &HandshakeMessage,
    remote: &HandshakeMessage,
    expected_engine: Option<&str>,
    expected_rank: Option<usize>,
) -> Result<ReadPlan> {
    let refuse = |reason: String| Error::Incompatible {
        reader: rank_name(local),
        source_rank: rank_name(remote),
        reason,
    };
    if remote.protocol_version != local.protocol_version {
        return Err(refuse(format!(
            "protocol version {} (reader) vs {} (source); run the same connector version on both engines",
            local.protocol_version, remote.protocol_version
        )));
    }
    if let Some(engine) = expected_engine {
        if remote.engine_id != engine {
            return Err(refuse(format!(
                "the transfer params name engine {engine:?}"
            )));
        }
    }
    if let Some(rank) = expected_rank {
        if remote.tp_rank as usize != rank {
            return Err(refuse(format!("the reader expected TP rank {rank}")));
        }
    }
    let same = |what: &str, reader: String, source: String| {
        if reader == source {
            Ok(())
        } else {
            Err(refuse(format!("{what} {reader} (reader) vs {source} (source); both engines must serve the same model geometry")))
        }
    };
    same(
        "layers",
        local.layer_base_addrs.len().to_string(),
        remote.layer_base_addrs.len().to_string(),
    )?;
    same(
        "block size",
        local.block_size.to_string(),
        remote.block_size.to_string(),
    )?;
    same(
        "head dim",
        local.head_dim.to_string(),
        remote.head_dim.to_string(),
    )?;
    same(
        "dtype size",
        local.dtype_size.to_string(),
        remote.dtype_size.to_string(),
    )?;
    same(
        "layout",
        local.layout.to_string(),
        remote.layout.to_string(),
    )?;
    if remote.block_lens.len() != remote.layer_base_addrs.len() {
        return Err(refuse(format!(
            "the source sends {} block lengths for {} layers",
            remote.block_lens.len(),
            remote.layer_base_addrs.len()
        )));
    }
    if remote.tp_size == 0 || local.tp_size % remote.tp_size != 0 {
        return Err(refuse(format!(
            "reader TP {} is not a multiple of source TP {} (reading from a larger TP is not supported)",
            local.tp_size, remote.tp_size
        )));
    }
    let ratio = local.tp_size / remote.tp_size;
    if ratio > 1 && local.layout != KvLayout::Hnd {
        return Err(refuse(format!(
            "source TP {} to reader TP {} needs the HND layout (a head slice of a block contiguous), both use {}",
            remote.tp_size, local.tp_size, local.layout
        )));
    }
    let local_heads = local.num_kv_heads.checked_mul(local.tp_size);
    let remote_heads = remote.num_kv_heads.checked_mul(remote.tp_size);
    if local_heads != remote_heads || local_heads.is_none() {
        return Err(refuse(format!(
            "KV heads per rank × TP: {} × {} (reader) vs {} × {} (source); the total must match",
            local.num_kv_heads, local.tp_size, remote.num_kv_heads, remote.tp_size
        )));
    }
    let geometry = |m: &HandshakeMessage| {
        m.block_size
            .checked_mul(m.num_kv_heads)
            .and_then(|v| v.checked_mul(m.head_dim))
            .and_then(|v| v.checked_mul(m.dtype_size))
    };
    let remote_len = geometry(remote).filter(|&len| len > 0);
    let Some(remote_len) = remote_len.filter(|len| remote.block_lens.iter().all(|l| l == len))
    else {
        return Err(refuse(format!(
            "the source's block lengths {:?} disagree with its geometry (block size × heads × head dim × dtype size)",
            remote.block_lens
        )));
    };
    let local_len = geometry(local).unwrap_or(0);
    let descriptors = remote
        .num_blocks
        .checked_mul(remote.layer_base_addrs.len() as u64);
    if remote.num_blocks == 0 || descriptors.map_or(true, |d| d > MAX_REMOTE_DESCRIPTORS as u64) {
        return Err(refuse(format!(
            "the source declares {} blocks × {} layers; between 1 and {MAX_REMOTE_DESCRIPTORS} descriptors are accepted",
            remote.num_blocks,
            remote.layer_base_addrs.len()
        )));
    }
    let layer_bytes = remote.num_blocks.checked_mul(remote_len);
    let overflows = remote
        .layer_base_addrs
        .iter()
        .any(|&base| base == 0 || layer_bytes.and_then(|len| base.checked_add(len)).is_none());
    if overflows || usize::try_from(layer_bytes.unwrap_or(u64::MAX)).is_err() {
        return Err(refuse(
            "a layer region is null or overflows the address space".to_string(),
        ));
    }
    let slice = local.tp_rank % ratio;
    Ok(ReadPlan {
        slice_offset: (slice * local_len) as usize,
        slice_len: local_len as usize,
        remote_block_len: remote_len as usize,
        remote_num_blocks: remote.num_blocks as usize,
    })
}

/// `engine "e" rank r`, for messages.
fn rank_name(message: &HandshakeMessage) -> String {
    format!("engine {:?} rank {}", message.engine_id, message.tp_rank)
}

impl HandshakeMessage {
    /// The message of a rank holding `spec`, with base addresses and metadata.
    pub(crate) fn describe(
        engine_id: &str,
        agent_name: &str,
        agent_metadata: Vec<u8>,
        layer_base_addrs: Vec<u64>,
        spec: &KvCacheSpec,
        tp: (usize, usize),
        device_id: u64,
    ) -> Self {
        HandshakeMessage {
            protocol_version: PROTOCOL_VERSION,
            engine_id: engine_id.to_string(),
            agent_name: agent_name.to_string(),
            agent_metadata,
            block_lens: vec![spec.block_len() as u64; layer_base_addrs.len()],
            layer_base_addrs,
            num_blocks: spec.num_blocks as u64,
            block_size: spec.block_size as u64,
            num_kv_heads: spec.num_kv_heads as u64,
            head_dim: spec.head_dim as u64,
            dtype_size: spec.dtype_size as u64,
            layout: spec.layout,
            device_id,
            tp_rank: tp.0 as u64,
            tp_size: tp.1 as u64,
        }
    }
}

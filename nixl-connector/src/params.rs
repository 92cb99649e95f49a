//! The transfer params handed from a prefill engine to a decode engine with each request.

use serde::{Deserialize, Serialize};

/// vLLM's `kv_transfer_params`: on a request sent to prefill, `do_remote_decode`; on the
/// prefill's answer (handed to decode), where and which blocks to read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// The side-channel port of the prefill's TP rank 0 (rank `r` listens on port + `r`).
    #[serde(default)]
    pub remote_port: Option<u16>,
    /// The prefill's block ids holding the request's KV, in token order.
    #[serde(default)]
    pub remote_block_ids: Vec<usize>,
    /// The request's id on the prefill engine (the notification names it).
    #[serde(default)]
    pub remote_request_id: Option<String>,
    /// The prefill engine's TP size.
    #[serde(default)]
    pub remote_tp_size: Option<usize>,
    /// Tokens the prefill computed (vLLM's `remote_num_tokens`): needed to pair a decode's
    /// blocks with a prefill's larger ones when the decode's prefix cache holds part of the
    /// prompt or the prompt ends inside a block (see [`RemoteBlocks::num_tokens`]).
    #[serde(default)]
    pub remote_num_tokens: Option<usize>,
}

/// Where a load reads from: the complete remote half of [`KvTransferParams`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteBlocks {
    /// The prefill engine's id.
    pub engine_id: String,
    /// Its side-channel host.
    pub host: String,
    /// The side-channel port of its TP rank 0.
    pub port: u16,
    /// Its block ids, paired in order with the local ones.
    pub block_ids: Vec<usize>,
    /// The request's id there.
    pub request_id: String,
    /// Its TP size.
    pub tp_size: usize,
    /// Tokens it computed, if known. Only a decode whose blocks are smaller than the
    /// prefill's needs it, to know which of the prefill's tokens its blocks start at; without
    /// it, such a load must cover every token of the prefill's blocks.
    pub num_tokens: Option<usize>,
}

impl KvTransferParams {
    /// The remote half, when every field of it is present.
    pub fn remote_blocks(&self) -> Option<RemoteBlocks> {
        Some(RemoteBlocks {
            engine_id: self.remote_engine_id.clone()?,
            host: self.remote_host.clone()?,
            port: self.remote_port?,
            block_ids: self.remote_block_ids.clone(),
            request_id: self.remote_request_id.clone()?,
            tp_size: self.remote_tp_size?,
            num_tokens: self.remote_num_tokens,
        })
    }
}

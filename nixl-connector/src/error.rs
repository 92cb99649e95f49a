//! The crate's one error type.

use std::time::Duration;

/// Result with the connector's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the connector can fail with; each message says what to check or change.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// NIXL refused an operation.
    #[error("NIXL: {0}")]
    Nixl(#[from] nixl::Error),
    /// A socket operation failed.
    #[error("{operation} with {peer}: {source}")]
    Io {
        /// What was being done.
        operation: &'static str,
        /// The peer (or local address) involved.
        peer: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A side-channel exchange did not finish within its total deadline.
    #[error("{operation} with {peer} did not finish within {deadline:?} (a total deadline, not per read); the peer is slow, stuck or hostile")]
    Deadline {
        /// What was being done.
        operation: &'static str,
        /// The peer.
        peer: String,
        /// The deadline that passed.
        deadline: Duration,
    },
    /// A peer sent a frame that breaks the side channel's rules (too long, undecodable,
    /// or closed early).
    #[error("side channel with {peer}: {reason}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        reason: String,
    },
    /// The peer closed the side channel between frames.
    #[error("side channel with {peer}: the peer closed the connection")]
    Closed {
        /// The peer.
        peer: String,
    },
    /// The peer closed the side channel inside a frame.
    #[error("side channel with {peer}: the peer closed the connection inside a frame")]
    Truncated {
        /// The peer.
        peer: String,
    },
    /// A reader's KV cache cannot be filled from a source's.
    #[error("{reader} cannot read from {source_rank}: {reason}")]
    Incompatible {
        /// The reading engine and rank, e.g. `engine "decode" rank 1`.
        reader: String,
        /// The engine and rank read from.
        source_rank: String,
        /// The mismatch, with both values.
        reason: String,
    },
    /// The peer refused our handshake, with its reason.
    #[error("peer {peer} refused the handshake: {reason}")]
    Refused {
        /// The peer.
        peer: String,
        /// The peer's stated reason.
        reason: String,
    },
    /// The agent metadata could not be published to etcd with the etcd credentials.
    #[error("publish agent metadata to etcd (key {key:?}): {reason}")]
    EtcdPublish {
        /// The key published under.
        key: String,
        /// What went wrong, per endpoint.
        reason: String,
    },
    /// A peer did not prove the shared secret of the side channel (or one side has a secret
    /// and the other none); nothing was exchanged beyond the refusal.
    #[error("side channel with {peer}: not authenticated: {reason}")]
    Unauthenticated {
        /// The peer.
        peer: String,
        /// What was not proven.
        reason: String,
    },
    /// The peer was still too busy to answer a handshake when the deadline passed, after
    /// every try it turned away.
    #[error("peer {peer} was still busy after {tries} tries within {deadline:?}: {reason}")]
    Busy {
        /// The peer.
        peer: String,
        /// Its last stated reason.
        reason: String,
        /// Tries made.
        tries: u32,
        /// The deadline that passed.
        deadline: Duration,
    },
    /// The handshake with a remote rank failed; every load waiting for it fails with it.
    #[error("handshake with engine {engine:?} rank {rank} failed: {reason}")]
    Handshake {
        /// The remote engine.
        engine: String,
        /// Its TP rank.
        rank: usize,
        /// What went wrong.
        reason: String,
    },
    /// An argument is out of its valid range.
    #[error("{operation}: {reason}")]
    InvalidArgument {
        /// What was being done.
        operation: &'static str,
        /// What is wrong and what is valid.
        reason: String,
    },
    /// An operation needs the KV caches registered first.
    #[error("{operation}: register the KV caches first (register_kv_caches)")]
    NotRegistered {
        /// What was being done.
        operation: &'static str,
    },
    /// Host-buffer mode needs a CUDA device.
    #[error("host-buffer mode (kv_buffer_device = \"cpu\" on a cuda platform) stages a VRAM KV cache through host memory and needs a CUDA device: {detail}")]
    HostBufferNeedsGpu {
        /// Why no device was usable.
        detail: String,
    },
    /// Metadata goes through etcd, and no etcd endpoint answers.
    #[error("etcd does not answer, so this agent's metadata cannot be published (start etcd or fix NIXL_ETCD_ENDPOINTS): {failures}")]
    EtcdUnreachable {
        /// Each endpoint and what went wrong there.
        failures: String,
    },
    /// A peer's agent metadata could not be fetched from etcd.
    #[error("fetch agent metadata from etcd (key {key:?}): {reason}")]
    EtcdFetch {
        /// The key asked for.
        key: String,
        /// What went wrong, per endpoint.
        reason: String,
    },
    /// A transfer did not complete within its deadline.
    #[error("transfer for request {request_id:?} did not complete within {deadline:?}")]
    TransferTimeout {
        /// The request.
        request_id: String,
        /// The deadline that passed.
        deadline: Duration,
    },
    /// A vLLM peer's compatibility hash differs from ours (see [`crate::vllm::compat`]).
    #[error("NIXL compatibility hash mismatch with {peer}: local {local}, remote {remote}; the prefill and decode differ in vLLM version, model, dtype, KV heads, head size, layers, attention backend, cache dtype, hybrid KV cache manager, speculative config or transfer mode (set kv_connector_extra_config.enforce_handshake_compat to false to skip this check)")]
    CompatibilityMismatch {
        /// The peer.
        peer: String,
        /// Our hash.
        local: String,
        /// The peer's hash.
        remote: String,
    },
    /// A prefill's blocks are freed, or will be before they could be read: their expiry
    /// time (vLLM's `remote_blocks_expiry_time`, read on our clock through the handshake's
    /// clock offset) is past or within the safety margin ([`EXPIRY_SAFETY_MARGIN`](crate::vllm::EXPIRY_SAFETY_MARGIN)), so they are not read.
    #[error("request {request_id:?}: the blocks of engine {engine:?} expire {left:.3} s from now on this clock (clock offset {clock_offset:.3} s), within the safety margin; not read")]
    BlocksExpired {
        /// The remote request.
        request_id: String,
        /// The remote engine.
        engine: String,
        /// Seconds until they expire, on our clock (negative: past).
        left: f64,
        /// The engine's clock minus ours.
        clock_offset: f64,
    },
    /// A read-back's kept blocks are no longer held by the decode that kept them (their TTL
    /// ended, or they were released past the cap on kept blocks), so they are not read
    /// (native protocol: the load's claim was not granted).
    #[error("request {request_id:?}: engine {engine:?} rank {rank} no longer keeps its blocks for a read-back (their TTL ended, or they were evicted past the cap on kept blocks); nothing read, the tokens are recomputed")]
    KeptBlocksGone {
        /// The request on the keeping engine.
        request_id: String,
        /// The keeping engine.
        engine: String,
        /// Its rank that did not grant the claim.
        rank: usize,
    },
    /// A load's READ may have outlived the prefill's hold on the blocks it read: the prefill
    /// released them (its lease ended) before the READ was known to have ended, so it may
    /// have read blocks already reused. The load fails, never counted loaded (native
    /// protocol: a release mark of a block read was at or past the request's lease epoch;
    /// vLLM mode: the READ ended past the blocks' expiry time).
    #[error("request {request_id:?}: engine {engine:?} released its blocks before the READ was known to have ended ({detail}); what was read may be another request's KV, so the load failed")]
    LeaseOutlived {
        /// The remote request.
        request_id: String,
        /// The remote engine.
        engine: String,
        /// What showed it.
        detail: String,
    },
    /// Push mode: a prefill rank the decode registered its blocks with ended its part
    /// without writing them (it refused the registration, its WRITE failed, it no longer
    /// held the request, or the registration was cancelled); nothing more will be written.
    #[error("request {request_id:?}: engine {engine:?} (agent {agent:?}) did not write the registered blocks: {end}")]
    PushNotWritten {
        /// The decode request.
        request_id: String,
        /// The prefill engine.
        engine: String,
        /// Its rank's agent.
        agent: String,
        /// How that rank's part ended (`refused`, `failed`, `cancelled`, `gone`).
        end: String,
    },
    /// A NIXL notification in vLLM's format could not be parsed or made.
    #[error("vLLM notification: {reason}")]
    Notification {
        /// What is wrong.
        reason: String,
    },
}

impl Error {
    pub(crate) fn io(operation: &'static str, peer: impl ToString, source: std::io::Error) -> Self {
        Error::Io {
            operation,
            peer: peer.to_string(),
            source,
        }
    }

    pub(crate) fn invalid(operation: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            operation,
            reason: reason.into(),
        }
    }
}

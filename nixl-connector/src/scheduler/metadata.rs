//! What the scheduler hands its workers each step (vLLM's `NixlConnectorMetadata`): the
//! loads to start, the requests to hold for a decode, the aborted loads and the heartbeats
//! to send.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::transport::capability::Capability;
use crate::transport::params::{no_dcp, one_stage, RemoteBlocks};

/// One load for the workers: read `remote` into `local_block_ids`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// The local request id.
    pub request_id: String,
    /// Local blocks, paired in token order with the last of `remote.block_ids`; empty: nothing
    /// is read, the prefill is only notified (a full prefix hit, or an aborted request).
    pub local_block_ids: Vec<usize>,
    /// For a hybrid model, how many of `local_block_ids` each KV cache group has, in the
    /// groups' order (the scheduler's
    /// [`update_state_after_alloc_groups`](crate::KvConnectorScheduler::update_state_after_alloc_groups)):
    /// each group's local blocks then pair with its remote ones by token (see
    /// [`RemoteBlocks::group_lens`]). Empty: one group, paired as above.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub local_group_lens: Vec<usize>,
    /// Where to read.
    pub remote: RemoteBlocks,
}

/// One request whose blocks wait for a decode: freed on its notification or when its lease
/// ends at `deadline`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendSpec {
    /// The request id (the notification names it).
    pub request_id: String,
    /// When the lease ends unless a heartbeat extends it (in another process: the time left
    /// when it was sent, from its arrival; see [`ConnectorMetadata::to_msgpack`]).
    #[serde(with = "crate::scheduler::step_wire::deadline")]
    pub deadline: Instant,
    /// The capability handed out in the request's params (native protocol): a finish
    /// notification or heartbeat counts only with a tag made under it. `None` in vLLM's
    /// protocol; in the native one, `None` lets only the lease free the request.
    #[serde(default)]
    pub capability: Option<Capability>,
    /// The request's blocks (native protocol): when it is released, each rank raises their
    /// release marks to [`lease_epoch`](Self::lease_epoch) before the engine hears of it (see
    /// [`ReleaseMarks`](crate::ReleaseMarks)). In push mode (either protocol) the blocks a
    /// decode's registration is written from. Empty in vLLM's pull mode.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub block_ids: Vec<usize>,
    /// The lease epoch of the request's params (native protocol; `None`: no marks raised).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_epoch: Option<u64>,
    /// For a hybrid model, how many of [`block_ids`](Self::block_ids) each KV cache group
    /// has (push mode writes each group's blocks into the decode's of that group). Empty:
    /// one group.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub group_lens: Vec<usize>,
    /// The prompt's tokens the request computed (its `num_computed_tokens`), if known: in
    /// push mode, where a decode's blocks start in the prompt when the two engines' blocks
    /// hold different numbers of tokens (or a block id is another number of kernel blocks
    /// on each).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_tokens: Option<usize>,
}

/// A heartbeat for one remote engine: its requests that loads here still wait for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatSpec {
    /// The remote engine.
    pub engine_id: String,
    /// Its side-channel host.
    pub host: String,
    /// The side-channel port of its TP rank 0.
    pub port: u16,
    /// Its TP size.
    pub tp_size: usize,
    /// Its pipeline stages (1: none); every stage's ranks get the heartbeat.
    #[serde(default = "one_stage")]
    pub pp_size: usize,
    /// Its decode context parallel size (1: none): with more, the ranks holding this rank's
    /// positions get the heartbeat.
    #[serde(default = "no_dcp")]
    pub dcp_size: usize,
    /// Its request ids (the remote ones) whose leases to extend. With none, nothing is
    /// sent, but the engine counts as in use (for `engine_ttl`) and its ranks are
    /// handshaken with, so that later heartbeats go at once.
    pub request_ids: Vec<String>,
    /// The capability of each of `request_ids`, in the same order (native protocol: a
    /// heartbeat counts only with a tag made under it; an id without one is not sent).
    /// In vLLM's protocol, which has none, the workers send the ids alone whatever it holds
    /// (the scheduler gives `None` for each).
    #[serde(default)]
    pub capabilities: Vec<Option<Capability>>,
}

/// What the scheduler hands its workers each step (vLLM's `NixlConnectorMetadata`); it
/// crosses to worker processes as MessagePack ([`to_msgpack`](Self::to_msgpack)).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnectorMetadata {
    /// Loads to start.
    pub loads: Vec<LoadSpec>,
    /// Requests to hold for a decode.
    pub sends: Vec<SendSpec>,
    /// Local requests whose loads were aborted while they may run.
    pub aborted: Vec<String>,
    /// Heartbeats to send (at most one step in
    /// [`Lease::heartbeat_interval`](crate::Lease::heartbeat_interval) has them).
    pub heartbeats: Vec<HeartbeatSpec>,
    /// Requests kept for a read-back to release now, unless a reader has claimed them
    /// (native protocol; the kept blocks passed
    /// [`MultiTurn::kept_blocks_cap`](crate::MultiTurn::kept_blocks_cap)): each rank
    /// reports them in [`Finished::sending`](crate::Finished::sending) once released.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evict: Vec<String>,
}

impl ConnectorMetadata {
    /// This step's metadata as MessagePack, for worker processes (vLLM serializes its
    /// `NixlConnectorMetadata` to each worker every step). Each [`SendSpec::deadline`]
    /// crosses as the time left until it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::error::Error::InvalidArgument) if it cannot be
    /// encoded.
    pub fn to_msgpack(&self) -> Result<Vec<u8>> {
        crate::scheduler::step_wire::encode("encode the connector metadata", self)
    }

    /// Metadata from the MessagePack of [`to_msgpack`](Self::to_msgpack), its deadlines on
    /// this process's clock.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::error::Error::InvalidArgument) naming what does
    /// not decode.
    pub fn from_msgpack(bytes: &[u8]) -> Result<Self> {
        crate::scheduler::step_wire::decode("decode the connector metadata", bytes)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_metadata_crosses_with_its_deadlines_rebased() {
        let remote = RemoteBlocks {
            engine_id: "p".into(),
            host: "10.0.0.1".into(),
            port: 5600,
            block_ids: vec![3, 4],
            group_lens: vec![1, 1],
            request_id: "rp".into(),
            tp_size: 2,
            pp_size: 1,
            dcp_size: 1,
            num_tokens: Some(30),
            blocks_expiry_time: Some(12.5),
            registration_generation: Some(2),
            capability: Some(Capability::random().unwrap()),
            lease_epoch: Some(9),
            kept: false,
        };
        let sent = ConnectorMetadata {
            loads: vec![LoadSpec {
                request_id: "d".into(),
                local_block_ids: vec![7, 1],
                local_group_lens: vec![1, 1],
                remote,
            }],
            sends: vec![
                SendSpec {
                    request_id: "held".into(),
                    deadline: Instant::now() + Duration::from_secs(30),
                    capability: Some(Capability::random().unwrap()),
                    block_ids: vec![3, 4],
                    lease_epoch: Some(7),
                    group_lens: vec![1, 1],
                    num_tokens: Some(30),
                },
                SendSpec {
                    request_id: "past".into(),
                    deadline: Instant::now() - Duration::from_secs(1),
                    capability: None,
                    block_ids: Vec::new(),
                    lease_epoch: None,
                    group_lens: Vec::new(),
                    num_tokens: None,
                },
            ],
            aborted: vec!["a".into()],
            heartbeats: vec![HeartbeatSpec {
                engine_id: "p".into(),
                host: "10.0.0.1".into(),
                port: 5600,
                tp_size: 2,
                pp_size: 1,
                dcp_size: 1,
                request_ids: vec!["rp".into()],
                capabilities: vec![Some(Capability::random().unwrap())],
            }],
            evict: vec!["kept".into()],
        };
        let before = Instant::now();
        let got = ConnectorMetadata::from_msgpack(&sent.to_msgpack().unwrap()).unwrap();
        let after = Instant::now();
        assert_eq!(
            (&got.loads, &got.aborted, &got.heartbeats, &got.evict),
            (&sent.loads, &sent.aborted, &sent.heartbeats, &sent.evict)
        );
        let left = got.sends[0].deadline - before;
        assert!(
            left <= Duration::from_secs(30) + (after - before),
            "{left:?}"
        );
        assert!(left >= Duration::from_secs(29), "{left:?}");
        assert!(got.sends[1].deadline <= after, "a past deadline stays past");
        let capabilities = |m: &ConnectorMetadata| -> Vec<_> {
            let send = |s: &SendSpec| (s.capability.clone(), s.block_ids.clone(), s.lease_epoch);
            m.sends.iter().map(send).collect()
        };
        assert_eq!(capabilities(&got), capabilities(&sent));
    }
}

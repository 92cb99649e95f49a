//! What crosses the step boundary between an engine's scheduler process and its worker
//! processes, as vLLM's engine core and workers exchange it each step: the
//! [`ConnectorMetadata`](crate::ConnectorMetadata) one way, each rank's
//! [`WorkerOutput`](crate::WorkerOutput) the other, in MessagePack (as on the side channel).
//!
//! A deadline is an [`Instant`], which means nothing in another process. It crosses as the
//! time left until it (vLLM's `scheduler_clock`, which its workers rebase the remaining
//! lease onto their own clock with): the receiver's deadline is its own now plus what was
//! left when it was sent, so the time in transit only lengthens a lease, the safe direction.

use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};

/// `value` as MessagePack with field names.
pub(crate) fn encode<T: Serialize>(operation: &'static str, value: &T) -> Result<Vec<u8>> {
    rmp_serde::to_vec_named(value).map_err(|err| Error::invalid(operation, err.to_string()))
}

/// A `T` from the MessagePack of [`encode`].
pub(crate) fn decode<T: DeserializeOwned>(operation: &'static str, bytes: &[u8]) -> Result<T> {
    rmp_serde::from_slice(bytes).map_err(|err| {
        Error::invalid(
            operation,
            format!(
                "{err} ({} bytes that are not what the other process sent)",
                bytes.len()
            ),
        )
    })
}

/// Serde of an [`Instant`] as the time left until it, in nanoseconds (past: 0); for
/// `#[serde(with = "crate::scheduler::step_wire::deadline")]`.
pub(crate) mod deadline {
    use super::*;

    /// Writes the time left until `at` from now.
    pub(crate) fn serialize<S: Serializer>(
        at: &Instant,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        let left = at.saturating_duration_since(Instant::now());
        u64::try_from(left.as_nanos())
            .unwrap_or(u64::MAX)
            .serialize(serializer)
    }

    /// Reads the time left as a deadline on this process's clock (now plus the time left,
    /// capped at a year from now).
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Instant, D::Error> {
        const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);
        let left = Duration::from_nanos(u64::deserialize(deserializer)?).min(YEAR);
        Ok(Instant::now() + left)
    }
}

impl crate::ConnectorMetadata {
    /// This step's metadata as MessagePack, for worker processes (vLLM serializes its
    /// `NixlConnectorMetadata` to each worker every step). Each
    /// [`SendSpec::deadline`](crate::SendSpec::deadline) crosses as the time left until it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if it cannot be encoded.
    pub fn to_msgpack(&self) -> Result<Vec<u8>> {
        encode("encode the connector metadata", self)
    }

    /// Metadata from the MessagePack of [`to_msgpack`](Self::to_msgpack), its deadlines on
    /// this process's clock.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming what does not decode.
    pub fn from_msgpack(bytes: &[u8]) -> Result<Self> {
        decode("decode the connector metadata", bytes)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::transport::capability::Capability;
    use crate::{
        ConnectorMetadata, FailedBlock, FailureKind, Finished, HeartbeatSpec, LoadSpec,
        RemoteBlocks, SendSpec, WorkerOutput,
    };

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
            num_tokens: Some(30),
            blocks_expiry_time: Some(12.5),
            registration_generation: Some(2),
            capability: Some(Capability::random().unwrap()),
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
                },
                SendSpec {
                    request_id: "past".into(),
                    deadline: Instant::now() - Duration::from_secs(1),
                    capability: None,
                },
            ],
            aborted: vec!["a".into()],
            heartbeats: vec![HeartbeatSpec {
                engine_id: "p".into(),
                host: "10.0.0.1".into(),
                port: 5600,
                tp_size: 2,
                request_ids: vec!["rp".into()],
                capabilities: vec![Some(Capability::random().unwrap())],
            }],
        };
        let before = Instant::now();
        let got = ConnectorMetadata::from_msgpack(&sent.to_msgpack().unwrap()).unwrap();
        let after = Instant::now();
        assert_eq!(
            (&got.loads, &got.aborted, &got.heartbeats),
            (&sent.loads, &sent.aborted, &sent.heartbeats)
        );
        let left = got.sends[0].deadline - before;
        assert!(
            left <= Duration::from_secs(30) + (after - before),
            "{left:?}"
        );
        assert!(left >= Duration::from_secs(29), "{left:?}");
        assert!(got.sends[1].deadline <= after, "a past deadline stays past");
        let capabilities = |m: &ConnectorMetadata| -> Vec<Option<Capability>> {
            m.sends.iter().map(|s| s.capability.clone()).collect()
        };
        assert_eq!(capabilities(&got), capabilities(&sent));
    }

    #[test]
    fn a_worker_output_crosses_and_garbage_is_refused() {
        let sent = WorkerOutput {
            tp_rank: 1,
            finished: Finished {
                sending: vec!["s".into()],
                recving: vec!["r".into()],
            },
            load_errors: vec![FailedBlock {
                block_id: 4,
                request_id: "r".into(),
                kind: FailureKind::Timeout,
                reason: Arc::from("too slow"),
            }],
        };
        let got = WorkerOutput::from_msgpack(&sent.to_msgpack().unwrap()).unwrap();
        assert_eq!(got, sent);
        let err = WorkerOutput::from_msgpack(b"\xc1garbage").unwrap_err();
        assert!(err.to_string().contains("decode a worker output"), "{err}");
    }
}

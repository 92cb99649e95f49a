//! How what crosses the step boundary between an engine's scheduler process and its worker
//! processes is encoded, as vLLM's engine core and workers exchange it each step: the
//! [`ConnectorMetadata`](crate::ConnectorMetadata) one way, each rank's
//! [`WorkerOutput`](crate::WorkerOutput) the other, in MessagePack (as on the side channel);
//! each type's `to_msgpack` and `from_msgpack` are with the type.
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

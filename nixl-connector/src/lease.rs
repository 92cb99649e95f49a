//! The KV lease: how long a prefill holds a finished request's blocks for a remote decode,
//! and how heartbeats extend it.

use std::time::Duration;

use nixl::kv_config::KvTransferConfig;
use serde_json::Value;

use crate::error::{Error, Result};

/// vLLM's default `kv_lease_duration`: 30 s.
pub const DEFAULT_KV_LEASE_DURATION: Duration = Duration::from_secs(30);

/// The longest [`Lease::duration`] and [`Lease::max_hold`]: a day.
pub const MAX_LEASE: Duration = Duration::from_secs(86_400);

/// The `kv_connector_extra_config` key of the lease, in seconds (vLLM's).
pub const LEASE_KEY: &str = "kv_lease_duration";

/// The `kv_connector_extra_config` key of the opt-in cap on how long a request is held,
/// heartbeats or not ([`Lease::max_hold`]), in seconds; not one of vLLM's.
pub const MAX_HOLD_KEY: &str = "kv_lease_max_hold";

/// How long a prefill holds a finished request's blocks for a remote decode (vLLM's KV
/// lease, `kv_connector_extra_config.kv_lease_duration`, in seconds).
///
/// The prefill frees the blocks when the lease ends without the decode's notification. A
/// decode whose load still waits sends a heartbeat every [`heartbeat_interval`](Self::heartbeat_interval);
/// each heartbeat extends the lease to [`extension`](Self::extension) from its arrival,
/// without bound, as vLLM 0.33's `_handle_heartbeat` does. An opt-in cap,
/// [`max_hold`](Self::max_hold) ([`MAX_HOLD_KEY`]), ends a hold that long after it began
/// whatever the heartbeats say, so that a decode heartbeating forever cannot pin blocks
/// forever; none by default.
///
/// Every value is checked when the lease is made: a lease cannot hold a duration that
/// overflows a deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    duration: Duration,
    max_hold: Option<Duration>,
}

impl Default for Lease {
    /// vLLM's: 30 s ([`DEFAULT_KV_LEASE_DURATION`]), no cap.
    fn default() -> Self {
        Lease {
            duration: DEFAULT_KV_LEASE_DURATION,
            max_hold: None,
        }
    }
}

/// Checks that `value` is a lease-like duration: more than zero, at most [`MAX_LEASE`].
fn in_range(what: &str, value: Duration) -> Result<Duration> {
    if value.is_zero() || value > MAX_LEASE {
        return Err(Error::invalid(
            "make the KV lease",
            format!(
                "{what} is {value:?}; give more than zero and at most {} s",
                MAX_LEASE.as_secs()
            ),
        ));
    }
    Ok(value)
}

impl Lease {
    /// A lease of `duration` without a cap.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero duration or one over [`MAX_LEASE`].
    pub fn new(duration: Duration) -> Result<Self> {
        Ok(Lease {
            duration: in_range("the lease", duration)?,
            max_hold: None,
        })
    }

    /// This lease, with every hold ended `max_hold` after it began, heartbeats or not.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero cap or one over [`MAX_LEASE`].
    pub fn with_max_hold(self, max_hold: Duration) -> Result<Self> {
        Ok(Lease {
            max_hold: Some(in_range("the cap on holds (max_hold)", max_hold)?),
            ..self
        })
    }

    /// The lease of `config`: `kv_connector_extra_config.kv_lease_duration` (seconds, a
    /// positive number; default 30) and, if given, the cap `kv_lease_max_hold` (seconds).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value that is not a positive number of seconds of
    /// at most [`MAX_LEASE`].
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Self> {
        let extra = &config.kv_connector_extra_config;
        let mut lease = match extra.get(LEASE_KEY) {
            Some(value) => Lease::new(seconds(LEASE_KEY, value, 30)?)?,
            None => Lease::default(),
        };
        if let Some(value) = extra.get(MAX_HOLD_KEY) {
            lease = lease.with_max_hold(seconds(MAX_HOLD_KEY, value, 480)?)?;
        }
        Ok(lease)
    }

    /// The lease: how long a request is held without heartbeats.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// The opt-in cap: the longest a request is held, heartbeats or not (`None`: no cap).
    pub fn max_hold(&self) -> Option<Duration> {
        self.max_hold
    }

    /// How often a decode heartbeats a remote engine it still waits for: a sixth of the
    /// lease (vLLM's `_heartbeat_interval`).
    pub fn heartbeat_interval(&self) -> Duration {
        self.duration / 6
    }

    /// How far a heartbeat extends a lease, from the heartbeat's arrival: two thirds of the
    /// lease (vLLM's `_lease_extension`).
    pub fn extension(&self) -> Duration {
        self.duration * 2 / 3
    }
}

/// `kv_connector_extra_config.{key}`, a positive number of seconds of at most
/// [`MAX_LEASE`]; `example` goes in the error.
fn seconds(key: &str, value: &Value, example: u32) -> Result<Duration> {
    value
        .as_f64()
        .filter(|s| *s > 0.0 && *s <= MAX_LEASE.as_secs_f64())
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| {
            Error::invalid(
                "read the KV lease",
                format!(
                    "kv_connector_extra_config.{key} is {value}; give a positive number of seconds (at most {}), e.g. {example}",
                    MAX_LEASE.as_secs()
                ),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_durations_are_refused_when_the_lease_is_made() {
        for bad in [
            Duration::ZERO,
            MAX_LEASE + Duration::from_nanos(1),
            Duration::MAX,
        ] {
            let err = Lease::new(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
            assert!(err.to_string().contains("at most 86400 s"), "{err}");
            let err = Lease::default().with_max_hold(bad).unwrap_err();
            assert!(err.to_string().contains("max_hold"), "{err}");
        }
        let lease = Lease::new(MAX_LEASE).unwrap();
        assert_eq!(lease.max_hold(), None, "no cap unless asked for");
        let capped = lease.with_max_hold(Duration::from_secs(480)).unwrap();
        assert_eq!(capped.max_hold(), Some(Duration::from_secs(480)));
        assert_eq!(Lease::default().max_hold(), None);
    }

    #[test]
    fn the_cap_is_opt_in_and_named_in_the_config() {
        let kv = |json: &str| KvTransferConfig::from_json(json).unwrap();
        let lease = Lease::from_kv_transfer_config(&kv(
            r#"{"kv_connector_extra_config":{"kv_lease_duration":600}}"#,
        ))
        .unwrap();
        assert_eq!(
            (lease.duration(), lease.max_hold()),
            (Duration::from_secs(600), None),
            "a lease over the old hidden 480 s cap stays whole"
        );
        let lease = Lease::from_kv_transfer_config(&kv(
            r#"{"kv_connector_extra_config":{"kv_lease_max_hold":900.5}}"#,
        ))
        .unwrap();
        assert_eq!(lease.duration(), DEFAULT_KV_LEASE_DURATION);
        assert_eq!(lease.max_hold(), Some(Duration::from_millis(900_500)));
        for bad in [
            r#"{"kv_connector_extra_config":{"kv_lease_max_hold":0}}"#,
            r#"{"kv_connector_extra_config":{"kv_lease_max_hold":1e300}}"#,
            r#"{"kv_connector_extra_config":{"kv_lease_duration":86401}}"#,
        ] {
            let err = Lease::from_kv_transfer_config(&kv(bad)).unwrap_err();
            assert!(err.to_string().contains("kv_lease_"), "{err}");
        }
    }
}

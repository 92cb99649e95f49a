//! Multi-turn settings (vLLM 0.33's bidirectional KV transfer): whether a decode keeps a
//! finished request's KV for the next turn's prefill to read back, for how long and how much
//! of it, and below how many tokens a read is not worth its latency.

use std::time::Duration;

use nixl::kv_config::KvTransferConfig;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::lease::MAX_LEASE;

/// The `kv_connector_extra_config` key enabling read-backs (vLLM's, default false).
pub const BIDIRECTIONAL_KEY: &str = "bidirectional_kv_xfer";

/// The `kv_connector_extra_config` key of how long a decode keeps a finished request's
/// blocks for a read-back, in seconds (vLLM's, default 480).
pub const KEPT_TTL_KEY: &str = "decoder_kv_blocks_ttl";

/// The `kv_connector_extra_config` key of the fewest tokens worth reading from a remote
/// engine (vLLM's, default 64; 0 reads any count).
pub const RECOMPUTE_THRESHOLD_KEY: &str = "kv_recompute_threshold";

/// The `kv_connector_extra_config` key of the most blocks a decode keeps for read-backs at
/// once (not one of vLLM's; default: no cap but the TTL).
pub const KEPT_BLOCKS_CAP_KEY: &str = "decoder_kv_blocks_cap";

/// vLLM's default [`KEPT_TTL_KEY`]: 480 s.
pub const DEFAULT_KEPT_TTL: Duration = Duration::from_secs(480);

/// vLLM's default [`RECOMPUTE_THRESHOLD_KEY`]: 64 tokens.
pub const DEFAULT_RECOMPUTE_THRESHOLD: usize = 64;

/// Multi-turn settings of an engine (vLLM's `bidirectional_kv_xfer`,
/// `decoder_kv_blocks_ttl` and `kv_recompute_threshold`, and a cap of our own).
///
/// - On a decode with [`bidirectional`](Self::bidirectional) set, a request whose KV came
///   from a remote prefill keeps its blocks when it finishes, for
///   [`kept_ttl`](Self::kept_ttl) or until a reader's finish notification, and its params
///   name them for the next turn's prefill.
/// - On a prefill with it set, a request whose params name a decode's kept blocks reads back
///   the tokens its own prefix cache lacks, unless they are fewer than
///   [`recompute_threshold`](Self::recompute_threshold).
/// - [`kept_blocks_cap`](Self::kept_blocks_cap) bounds what a decode keeps (see
///   [`KvConnectorScheduler::kept_stats`](crate::KvConnectorScheduler::kept_stats)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MultiTurn {
    /// Whether read-backs are on (both roles).
    pub bidirectional: bool,
    /// How long a decode keeps a finished request's blocks when no reader comes (at most
    /// [`MAX_LEASE`]: a longer one is taken as that).
    pub kept_ttl: Duration,
    /// The fewest tokens read from a remote engine; fewer are recomputed (0: any count).
    pub recompute_threshold: usize,
    /// The most blocks a decode keeps at once; past it the oldest kept requests are released
    /// first (native protocol) or new ones are not kept (vLLM's); `None`: no cap.
    pub kept_blocks_cap: Option<usize>,
}

impl Default for MultiTurn {
    /// vLLM's: off, 480 s, 64 tokens; no cap.
    fn default() -> Self {
        MultiTurn {
            bidirectional: false,
            kept_ttl: DEFAULT_KEPT_TTL,
            recompute_threshold: DEFAULT_RECOMPUTE_THRESHOLD,
            kept_blocks_cap: None,
        }
    }
}

impl MultiTurn {
    /// The settings of `config`'s `kv_connector_extra_config`: [`BIDIRECTIONAL_KEY`] (a
    /// boolean), [`KEPT_TTL_KEY`] (a positive number of seconds, at most a day),
    /// [`RECOMPUTE_THRESHOLD_KEY`] and [`KEPT_BLOCKS_CAP_KEY`] (whole numbers).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value of the wrong type or out of range, naming the
    /// key.
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Self> {
        let extra = &config.kv_connector_extra_config;
        let mut settings = MultiTurn::default();
        if let Some(value) = extra.get(BIDIRECTIONAL_KEY) {
            settings.bidirectional = value
                .as_bool()
                .ok_or_else(|| bad(BIDIRECTIONAL_KEY, value, "true or false"))?;
        }
        if let Some(value) = extra.get(KEPT_TTL_KEY) {
            settings.kept_ttl = value
                .as_f64()
                .filter(|s| *s > 0.0 && *s <= MAX_LEASE.as_secs_f64())
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| {
                    bad(
                        KEPT_TTL_KEY,
                        value,
                        &format!(
                            "a positive number of seconds, at most {}, e.g. 480",
                            MAX_LEASE.as_secs()
                        ),
                    )
                })?;
        }
        if let Some(value) = extra.get(RECOMPUTE_THRESHOLD_KEY) {
            settings.recompute_threshold = count(RECOMPUTE_THRESHOLD_KEY, value, "64")?;
        }
        if let Some(value) = extra.get(KEPT_BLOCKS_CAP_KEY) {
            settings.kept_blocks_cap = Some(count(KEPT_BLOCKS_CAP_KEY, value, "4096")?);
        }
        Ok(settings)
    }
}

/// `value` as a whole number of at most `u32::MAX`.
fn count(key: &str, value: &Value, example: &str) -> Result<usize> {
    value
        .as_u64()
        .filter(|n| *n <= u64::from(u32::MAX))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| bad(key, value, &format!("a whole number, e.g. {example}")))
}

fn bad(key: &str, value: &Value, expected: &str) -> Error {
    Error::invalid(
        "read the multi-turn settings",
        format!("kv_connector_extra_config.{key} is {value}; give {expected}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(extra: &str) -> Result<MultiTurn> {
        let json = format!(r#"{{"kv_connector_extra_config":{extra}}}"#);
        MultiTurn::from_kv_transfer_config(&KvTransferConfig::from_json(&json).unwrap())
    }

    #[test]
    fn the_defaults_are_vllms() {
        let settings = of("{}").unwrap();
        assert_eq!(settings, MultiTurn::default());
        assert!(!settings.bidirectional);
        assert_eq!(settings.kept_ttl, Duration::from_secs(480));
        assert_eq!(settings.recompute_threshold, 64);
        assert_eq!(settings.kept_blocks_cap, None);
    }

    #[test]
    fn every_key_is_read_and_bad_values_name_their_key() {
        let settings = of(r#"{"bidirectional_kv_xfer":true,"decoder_kv_blocks_ttl":12.5,"kv_recompute_threshold":0,"decoder_kv_blocks_cap":100}"#).unwrap();
        assert_eq!(
            settings,
            MultiTurn {
                bidirectional: true,
                kept_ttl: Duration::from_millis(12_500),
                recompute_threshold: 0,
                kept_blocks_cap: Some(100),
            }
        );
        for (extra, key) in [
            (r#"{"bidirectional_kv_xfer":"yes"}"#, BIDIRECTIONAL_KEY),
            (r#"{"decoder_kv_blocks_ttl":0}"#, KEPT_TTL_KEY),
            (r#"{"decoder_kv_blocks_ttl":1e300}"#, KEPT_TTL_KEY),
            (r#"{"kv_recompute_threshold":-1}"#, RECOMPUTE_THRESHOLD_KEY),
            (r#"{"kv_recompute_threshold":6.5}"#, RECOMPUTE_THRESHOLD_KEY),
            (r#"{"decoder_kv_blocks_cap":"all"}"#, KEPT_BLOCKS_CAP_KEY),
        ] {
            let err = of(extra).unwrap_err().to_string();
            assert!(err.contains(key), "{extra}: {err}");
        }
    }
}

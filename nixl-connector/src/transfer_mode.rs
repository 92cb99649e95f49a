//! Which way the KV moves between a prefill and a decode (vLLM 0.33's `NixlConnector`, pull,
//! and `NixlPushConnector`, push), and push mode's settings, read from a
//! `kv_transfer_config` with what push refuses named.

use std::time::Duration;

use nixl::kv_config::{KvRole, KvTransferConfig};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::multi_turn::{BIDIRECTIONAL_KEY, DEFAULT_KEPT_TTL, KEPT_TTL_KEY};
use crate::transport::params::KvTransferParams;

/// The `kv_connector_extra_config` key naming the [`TransferMode`].
pub const TRANSFER_MODE_KEY: &str = "transfer_mode";

/// The `kv_connector_extra_config` key of [`PushSettings::registration_timeout`], in seconds
/// (vLLM's).
pub const PUSH_REGISTRATION_TIMEOUT_KEY: &str = "push_registration_timeout";

/// The `kv_connector` name of vLLM's push connector, which selects push mode as
/// `transfer_mode: "push"` does.
pub const PUSH_CONNECTOR_NAME: &str = "NixlPushConnector";

/// The longest [`PushSettings::registration_timeout`]: a day.
pub const MAX_PUSH_REGISTRATION_TIMEOUT: Duration = Duration::from_secs(86_400);

/// Which engine moves the KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransferMode {
    /// `"pull"`: the decode READs the blocks the prefill holds for it (vLLM's
    /// `NixlConnector`).
    #[default]
    Pull,
    /// `"push"`: the decode registers its freshly allocated blocks with the prefill, which
    /// WRITEs the KV into them (vLLM's `NixlPushConnector`; in both protocols).
    Push,
}

impl TransferMode {
    /// The mode of `config`: `kv_connector_extra_config.transfer_mode` (`"pull"` or
    /// `"push"`), else push when `kv_connector` is `NixlPushConnector`, else pull. Push
    /// refuses what vLLM's push connector refuses and this crate knows of at this point:
    /// bidirectional KV transfer (`bidirectional_kv_xfer`), and a `decode_context_parallel_size`,
    /// `dcp_size` or decode `pipeline_parallel_size` above 1 in `kv_connector_extra_config`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the key: another value, a `transfer_mode` of
    /// `"pull"` with `kv_connector` `NixlPushConnector`, or a setting push refuses.
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Self> {
        const OP: &str = "read the transfer mode";
        let extra = &config.kv_connector_extra_config;
        let by_connector = config.kv_connector.as_deref() == Some(PUSH_CONNECTOR_NAME);
        let mode = match extra.get(TRANSFER_MODE_KEY) {
            None => match by_connector {
                true => TransferMode::Push,
                false => TransferMode::Pull,
            },
            Some(Value::String(name)) => name.parse()?,
            Some(other) => {
                return Err(Error::invalid(
                    OP,
                    format!("kv_connector_extra_config.{TRANSFER_MODE_KEY} is {other}; use \"pull\" or \"push\""),
                ))
            }
        };
        if by_connector && mode == TransferMode::Pull {
            return Err(Error::invalid(
                OP,
                format!("kv_connector is {PUSH_CONNECTOR_NAME} but kv_connector_extra_config.{TRANSFER_MODE_KEY} is \"pull\"; drop one of them"),
            ));
        }
        if mode == TransferMode::Push {
            refuse_for_push(config)?;
        }
        Ok(mode)
    }

    /// Refuses `params` an engine of this mode cannot use: params of the other mode (their
    /// `transfer_mode`, pull when absent), a DCP size out of range (push: any but 1, as
    /// vLLM's push refuses decode context parallelism), and a pipeline of no stage or too
    /// many.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming both modes, or the key and its value.
    pub fn check_params(self, params: &KvTransferParams) -> Result<()> {
        let theirs = params.transfer_mode.as_deref().unwrap_or("pull");
        if theirs != self.as_str() {
            return Err(Error::invalid(
                "read kv_transfer_params",
                format!("transfer_mode {theirs:?} in the params, but this engine is in {self} mode: a push engine and a pull engine do not pair (set kv_connector_extra_config.{TRANSFER_MODE_KEY} alike on both)"),
            ));
        }
        if let Some(size) = params.remote_dcp_size.filter(|&s| s != 1) {
            if self == TransferMode::Push {
                return Err(Error::invalid(
                    "read kv_transfer_params",
                    format!("dcp_size {size} is not supported in push mode (only 1), as in vLLM's push connector"),
                ));
            }
        }
        params.check_geometry()
    }

    /// Its name in `kv_connector_extra_config` and in transfer params: `pull` or `push`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferMode::Pull => "pull",
            TransferMode::Push => "push",
        }
    }
}

impl std::str::FromStr for TransferMode {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self> {
        match name {
            "pull" => Ok(TransferMode::Pull),
            "push" => Ok(TransferMode::Push),
            other => Err(Error::invalid(
                "read the transfer mode",
                format!("unknown transfer mode {other:?}; use \"pull\" or \"push\""),
            )),
        }
    }
}

impl std::fmt::Display for TransferMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Refuses, by name, the settings of `config` that vLLM's push connector refuses.
fn refuse_for_push(config: &KvTransferConfig) -> Result<()> {
    const OP: &str = "configure push mode";
    let extra = &config.kv_connector_extra_config;
    if extra.get(BIDIRECTIONAL_KEY).and_then(Value::as_bool) == Some(true) {
        return Err(Error::invalid(
            OP,
            format!("{BIDIRECTIONAL_KEY} is true: bidirectional KV transfer is not supported in push mode (as in vLLM's NixlPushConnector); use pull mode for read-backs"),
        ));
    }
    for key in ["decode_context_parallel_size", "dcp_size"] {
        if let Some(size) = extra.get(key).and_then(Value::as_u64).filter(|&s| s > 1) {
            return Err(Error::invalid(
                OP,
                format!("{key} is {size}: decode context parallelism is not supported in push mode (as in vLLM's NixlPushConnector)"),
            ));
        }
    }
    if let Some(size) = extra
        .get("pipeline_parallel_size")
        .and_then(Value::as_u64)
        .filter(|&s| s > 1 && config.kv_role != Some(KvRole::Producer))
    {
        return Err(Error::invalid(
            OP,
            format!("pipeline_parallel_size is {size}: push mode writes into one pipeline stage of the decode only (as in vLLM's NixlPushConnector); a prefill of stages says kv_role kv_producer"),
        ));
    }
    Ok(())
}

/// Push mode's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushSettings {
    /// How long a decode waits for the prefill's WRITEs after it registered its blocks
    /// (`kv_connector_extra_config.push_registration_timeout`, seconds; default
    /// `decoder_kv_blocks_ttl`'s, itself 480 s by default, as vLLM's). Past it the load
    /// fails by the failure policy once the prefill answered that no WRITE runs.
    pub registration_timeout: Duration,
}

impl Default for PushSettings {
    fn default() -> Self {
        PushSettings {
            registration_timeout: DEFAULT_KEPT_TTL,
        }
    }
}

impl PushSettings {
    /// The settings of `config`: `push_registration_timeout`, else `decoder_kv_blocks_ttl`,
    /// else 480 s.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value that is not a positive number of seconds up
    /// to a day.
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Self> {
        let extra = &config.kv_connector_extra_config;
        let from = |key: &str, value: &Value| {
            value
                .as_f64()
                .filter(|s| *s > 0.0 && *s <= MAX_PUSH_REGISTRATION_TIMEOUT.as_secs_f64())
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| {
                    Error::invalid(
                        "read the push settings",
                        format!("kv_connector_extra_config.{key} is {value}; give a positive number of seconds, at most {}", MAX_PUSH_REGISTRATION_TIMEOUT.as_secs()),
                    )
                })
        };
        let registration_timeout = match (
            extra.get(PUSH_REGISTRATION_TIMEOUT_KEY),
            extra.get(KEPT_TTL_KEY),
        ) {
            (Some(value), _) => from(PUSH_REGISTRATION_TIMEOUT_KEY, value)?,
            (None, Some(value)) => from(KEPT_TTL_KEY, value)?,
            (None, None) => DEFAULT_KEPT_TTL,
        };
        Ok(PushSettings {
            registration_timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(connector: Option<&str>, extra: Value) -> KvTransferConfig {
        let mut config = KvTransferConfig {
            kv_connector: connector.map(str::to_string),
            ..Default::default()
        };
        for (key, value) in extra.as_object().unwrap() {
            config
                .kv_connector_extra_config
                .insert(key.clone(), value.clone());
        }
        config
    }

    #[test]
    fn the_mode_comes_from_the_key_or_the_connector_name() {
        let mode = |c, e| TransferMode::from_kv_transfer_config(&config(c, e));
        assert_eq!(mode(None, json!({})).unwrap(), TransferMode::Pull);
        assert_eq!(
            mode(Some("NixlConnector"), json!({})).unwrap(),
            TransferMode::Pull
        );
        assert_eq!(
            mode(Some(PUSH_CONNECTOR_NAME), json!({})).unwrap(),
            TransferMode::Push
        );
        assert_eq!(
            mode(None, json!({"transfer_mode": "push"})).unwrap(),
            TransferMode::Push
        );
        let refused = |c, e, want: &str| {
            let err = mode(c, e).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        };
        refused(None, json!({"transfer_mode": "write"}), "\"write\"");
        refused(None, json!({"transfer_mode": 1}), "transfer_mode is 1");
        refused(
            Some(PUSH_CONNECTOR_NAME),
            json!({"transfer_mode": "pull"}),
            "drop one",
        );
        refused(
            None,
            json!({"transfer_mode": "push", "bidirectional_kv_xfer": true}),
            "bidirectional_kv_xfer",
        );
        refused(
            Some(PUSH_CONNECTOR_NAME),
            json!({"decode_context_parallel_size": 2}),
            "decode_context_parallel_size is 2",
        );
        refused(
            None,
            json!({"transfer_mode": "push", "pipeline_parallel_size": 2}),
            "pipeline_parallel_size is 2",
        );
        // A prefill of stages pushes (vLLM's push writes from stages).
        let mut prefill = config(
            None,
            json!({"transfer_mode": "push", "pipeline_parallel_size": 2}),
        );
        prefill.kv_role = Some(KvRole::Producer);
        assert_eq!(
            TransferMode::from_kv_transfer_config(&prefill).unwrap(),
            TransferMode::Push
        );
        // Pull mode is left as it was.
        assert_eq!(
            mode(None, json!({"bidirectional_kv_xfer": true})).unwrap(),
            TransferMode::Pull
        );
    }

    #[test]
    fn the_registration_timeout_defaults_to_the_kept_blocks_ttl() {
        let timeout = |e| {
            PushSettings::from_kv_transfer_config(&config(None, e)).map(|s| s.registration_timeout)
        };
        assert_eq!(timeout(json!({})).unwrap(), Duration::from_secs(480));
        assert_eq!(
            timeout(json!({"decoder_kv_blocks_ttl": 60})).unwrap(),
            Duration::from_secs(60)
        );
        assert_eq!(
            timeout(json!({"decoder_kv_blocks_ttl": 60, "push_registration_timeout": 2.5}))
                .unwrap(),
            Duration::from_millis(2500)
        );
        for bad in [json!(0), json!(-1), json!("10"), json!(1e9)] {
            let err = timeout(json!({ "push_registration_timeout": bad })).unwrap_err();
            assert!(
                err.to_string().contains("push_registration_timeout"),
                "{err}"
            );
        }
    }
}

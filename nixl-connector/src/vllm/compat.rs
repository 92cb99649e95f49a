//! vLLM's NIXL compatibility hash: SHA-256 over the sorted JSON of the factors that decide
//! whether two engines can exchange KV blocks at all (vLLM's
//! `compute_nixl_compatibility_hash`). A decode compares the prefill's hash with its own
//! before it decodes the prefill's metadata; `enforce_handshake_compat: false` skips that.
//!
//! vLLM hashes `json.dumps(factors, sort_keys=True)`: keys sorted at every level, `", "`
//! and `": "` as separators, non-ASCII characters as `\uXXXX` escapes. [`CompatibilityFactors::json`]
//! writes the same text, so the hash is byte-identical to vLLM's for the same factors.

use std::fmt::Write as _;

use nixl::kv_config::KvTransferConfig;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::payload::{NixlAgentMetadata, NixlHandshakePayload, NIXL_CONNECTOR_VERSION};
use crate::error::{Error, Result};

/// The `kv_connector_extra_config` key that turns the hash check off (vLLM's own key).
pub const ENFORCE_KEY: &str = "enforce_handshake_compat";

/// The `kv_connector_extra_config` key holding the [`CompatibilityFactors`].
pub const FACTORS_KEY: &str = "vllm_compat_factors";

/// The factors vLLM hashes, as the vLLM engine on the other side computes them from its
/// config. Their names are vLLM's; the connector version is [`NIXL_CONNECTOR_VERSION`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompatibilityFactors {
    /// `vllm.__version__`, e.g. `"0.33.0"`.
    pub vllm_version: String,
    /// The model's name or path as vLLM was given it.
    pub model: String,
    /// `str(model_config.dtype)`, e.g. `"torch.bfloat16"`.
    pub dtype: String,
    /// The model's total KV heads.
    pub num_kv_heads: u64,
    /// The head size.
    pub head_size: u64,
    /// The model's total hidden layers.
    pub num_hidden_layers: u64,
    /// The attention backend's name, e.g. `"FLASH_ATTN"`.
    pub attn_backend_name: String,
    /// `str(cache_config.cache_dtype)`, e.g. `"auto"`.
    pub cache_dtype: String,
    /// Whether the hybrid KV cache manager is on (not `disable_hybrid_kv_cache_manager`).
    pub is_hma_enabled: bool,
    /// The EAGLE/MTP draft's factors, `None` without one.
    #[serde(default)]
    pub speculative_config: Option<SpeculativeFactors>,
    /// `"pull"` (READ) or `"push"` (WRITE): the engine's transfer mode, which must be the
    /// same (vLLM's push and pull engines refuse each other by this factor).
    #[serde(default = "pull")]
    pub transfer_mode: String,
}

fn pull() -> String {
    "pull".into()
}

/// The factors of an EAGLE/MTP draft model (vLLM's `_get_speculative_compatibility_factors`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeFactors {
    /// The speculative method, e.g. `"eagle3"` or `"mtp"`.
    pub method: String,
    /// The draft model.
    pub model: String,
    /// The draft model's revision.
    #[serde(default)]
    pub revision: Option<String>,
    /// The draft model's code revision.
    #[serde(default)]
    pub code_revision: Option<String>,
    /// Whether drafting runs in parallel.
    pub parallel_drafting: bool,
    /// The draft's effective KV cache dtype.
    pub kv_cache_dtype: String,
    /// `eagle_aux_hidden_state_layer_ids`, when the draft has them.
    #[serde(default)]
    pub auxiliary_layer_ids: Option<Vec<i64>>,
}

/// A JSON value as Python's `json.dumps` writes it (the only kinds the factors hold).
enum Json<'a> {
    Null,
    Bool(bool),
    Int(i128),
    Str(&'a str),
    List(Vec<Json<'a>>),
    /// Written with its keys sorted.
    Map(Vec<(&'a str, Json<'a>)>),
}

impl Json<'_> {
    fn write(&self, out: &mut String) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(i) => {
                let _ = write!(out, "{i}");
            }
            Json::Str(s) => write_str(s, out),
            Json::List(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    item.write(out);
                }
                out.push(']');
            }
            Json::Map(entries) => {
                let mut sorted: Vec<&(&str, Json)> = entries.iter().collect();
                // Python sorts by code point, which is the order of the UTF-8 bytes.
                sorted.sort_by(|a, b| a.0.cmp(b.0));
                out.push('{');
                for (i, (key, value)) in sorted.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_str(key, out);
                    out.push_str(": ");
                    value.write(out);
                }
                out.push('}');
            }
        }
    }
}

/// A string as `json.dumps` writes it with `ensure_ascii=True`.
fn write_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

fn opt_str(s: &Option<String>) -> Json<'_> {
    s.as_deref().map_or(Json::Null, Json::Str)
}

impl CompatibilityFactors {
    fn tree(&self) -> Json<'_> {
        let speculative = self.speculative_config.as_ref().map_or(Json::Null, |s| {
            Json::Map(vec![
                ("method", Json::Str(&s.method)),
                ("model", Json::Str(&s.model)),
                ("revision", opt_str(&s.revision)),
                ("code_revision", opt_str(&s.code_revision)),
                ("parallel_drafting", Json::Bool(s.parallel_drafting)),
                ("kv_cache_dtype", Json::Str(&s.kv_cache_dtype)),
                (
                    "auxiliary_layer_ids",
                    s.auxiliary_layer_ids.as_ref().map_or(Json::Null, |ids| {
                        Json::List(ids.iter().map(|&i| Json::Int(i.into())).collect())
                    }),
                ),
            ])
        });
        Json::Map(vec![
            ("vllm_version", Json::Str(&self.vllm_version)),
            (
                "nixl_connector_version",
                Json::Int(NIXL_CONNECTOR_VERSION.into()),
            ),
            ("model", Json::Str(&self.model)),
            ("dtype", Json::Str(&self.dtype)),
            ("num_kv_heads", Json::Int(self.num_kv_heads.into())),
            ("head_size", Json::Int(self.head_size.into())),
            (
                "num_hidden_layers",
                Json::Int(self.num_hidden_layers.into()),
            ),
            ("attn_backend_name", Json::Str(&self.attn_backend_name)),
            ("cache_dtype", Json::Str(&self.cache_dtype)),
            ("is_hma_enabled", Json::Bool(self.is_hma_enabled)),
            ("speculative_config", speculative),
            ("transfer_mode", Json::Str(&self.transfer_mode)),
        ])
    }

    /// The JSON text vLLM hashes for these factors.
    pub fn json(&self) -> String {
        let mut out = String::new();
        self.tree().write(&mut out);
        out
    }

    /// The compatibility hash: the SHA-256 hex digest of [`CompatibilityFactors::json`].
    pub fn hash(&self) -> String {
        Sha256::digest(self.json().as_bytes()).iter().fold(
            String::with_capacity(64),
            |mut hex, b| {
                let _ = write!(hex, "{b:02x}");
                hex
            },
        )
    }
}

/// The hash this engine sends and, when enforced, requires of its peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compatibility {
    /// Our hash (empty when no factors were given and the check is off).
    pub hash: String,
    /// Whether a peer with another hash is refused.
    pub enforce: bool,
    /// The factors the hash is of, when given (their `attn_backend_name` is also what this
    /// engine's `NixlAgentMetadata` names).
    pub factors: Option<CompatibilityFactors>,
}

impl Compatibility {
    /// Our hash from `factors`; `enforce` says whether peers must match it.
    pub fn new(factors: &CompatibilityFactors, enforce: bool) -> Self {
        Compatibility {
            hash: factors.hash(),
            enforce,
            factors: Some(factors.clone()),
        }
    }

    /// From `kv_connector_extra_config`: [`ENFORCE_KEY`] (default `true`) and
    /// [`FACTORS_KEY`], an object of [`CompatibilityFactors`], e.g.
    /// `{"vllm_version": "0.33.0", "model": "Qwen/Qwen3-0.6B", "dtype": "torch.bfloat16",
    /// "num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 28, "attn_backend_name":
    /// "FLASH_ATTN", "cache_dtype": "auto", "is_hma_enabled": true}`. The factors may be
    /// left out only when the check is off; our hash is then empty.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a non-boolean [`ENFORCE_KEY`], missing or malformed
    /// factors, or a transfer mode other than `"pull"` or `"push"`.
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Self> {
        const OPERATION: &str = "read the vLLM compatibility settings";
        let extra = &config.kv_connector_extra_config;
        let enforce = match extra.get(ENFORCE_KEY) {
            None => true,
            Some(value) => value.as_bool().ok_or_else(|| {
                Error::invalid(
                    OPERATION,
                    format!("kv_connector_extra_config.{ENFORCE_KEY} must be true or false; got {value}"),
                )
            })?,
        };
        let Some(value) = extra.get(FACTORS_KEY) else {
            if enforce {
                return Err(Error::invalid(
                    OPERATION,
                    format!(
                        "kv_connector_extra_config.{FACTORS_KEY} is needed to compute the compatibility \
                         hash vLLM peers check (the factors of vLLM's compute_nixl_compatibility_hash: \
                         vllm_version, model, dtype, num_kv_heads, head_size, num_hidden_layers, \
                         attn_backend_name, cache_dtype, is_hma_enabled, speculative_config, transfer_mode), \
                         or set {ENFORCE_KEY} to false"
                    ),
                ));
            }
            return Ok(Compatibility {
                hash: String::new(),
                enforce,
                factors: None,
            });
        };
        let factors: CompatibilityFactors =
            serde_json::from_value(value.clone()).map_err(|err| {
                Error::invalid(
                    OPERATION,
                    format!("kv_connector_extra_config.{FACTORS_KEY}: {err}"),
                )
            })?;
        if !["pull", "push"].contains(&factors.transfer_mode.as_str()) {
            return Err(Error::invalid(
                OPERATION,
                format!(
                    "{FACTORS_KEY}.transfer_mode {:?} is not a transfer mode: use \"pull\" or \"push\"",
                    factors.transfer_mode
                ),
            ));
        }
        Ok(Compatibility::new(&factors, enforce))
    }

    /// Refuses factors whose `transfer_mode` is not `mode`, the engine's (`"pull"` or
    /// `"push"`): vLLM hashes it, so a peer of the engine's mode would refuse this hash.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming both.
    pub fn check_transfer_mode(&self, mode: &str) -> Result<()> {
        match &self.factors {
            Some(factors) if factors.transfer_mode != mode => Err(Error::invalid(
                "read the vLLM compatibility settings",
                format!(
                    "{FACTORS_KEY}.transfer_mode is {:?} (\"pull\" when left out), but this engine is in {mode} mode: vLLM hashes the mode, so set it to {mode:?}",
                    factors.transfer_mode
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Checks a peer's payload, then decodes the metadata it carries. The hash is checked
    /// first, as vLLM does, so a peer of another connector version is refused by its hash
    /// rather than by a decoding error.
    ///
    /// # Errors
    /// [`Error::CompatibilityMismatch`] naming both hashes (when enforced);
    /// [`Error::Protocol`] when the metadata does not decode.
    pub fn check(&self, payload: &NixlHandshakePayload, peer: &str) -> Result<NixlAgentMetadata> {
        if self.enforce && payload.compatibility_hash != self.hash {
            return Err(Error::CompatibilityMismatch {
                peer: peer.to_string(),
                local: self.hash.clone(),
                remote: payload.compatibility_hash.clone(),
            });
        }
        payload.agent_metadata().map_err(|reason| Error::Protocol {
            peer: peer.to_string(),
            reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen() -> CompatibilityFactors {
        serde_json::from_value(serde_json::json!({
            "vllm_version": "0.33.0",
            "model": "Qwen/Qwen3-0.6B",
            "dtype": "torch.bfloat16",
            "num_kv_heads": 8,
            "head_size": 128,
            "num_hidden_layers": 28,
            "attn_backend_name": "FLASH_ATTN",
            "cache_dtype": "auto",
            "is_hma_enabled": true,
        }))
        .unwrap()
    }

    /// Python: `hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()`
    /// for the same factors (tests/vllm_protocol.rs checks more sets against Python live).
    #[test]
    fn the_hash_is_vllms() {
        let factors = qwen();
        assert_eq!(
            factors.json(),
            r#"{"attn_backend_name": "FLASH_ATTN", "cache_dtype": "auto", "dtype": "torch.bfloat16", "head_size": 128, "is_hma_enabled": true, "model": "Qwen/Qwen3-0.6B", "nixl_connector_version": 15, "num_hidden_layers": 28, "num_kv_heads": 8, "speculative_config": null, "transfer_mode": "pull", "vllm_version": "0.33.0"}"#
        );
        assert_eq!(factors.hash(), PYTHON_QWEN_HASH);
    }

    const PYTHON_QWEN_HASH: &str =
        "cde24c489ad71bfdbccb1b829551f03719b0fe359a22fe635ec9986a6f36e549";

    #[test]
    fn strings_are_escaped_as_python_does() {
        let mut out = String::new();
        write_str("a\"b\\c\n\r\t\u{8}\u{c}\u{1}\u{7f}é€😀/", &mut out);
        assert_eq!(
            out,
            r#""a\"b\\c\n\r\t\b\f\u0001\u007f\u00e9\u20ac\ud83d\ude00/""#
        );
    }

    #[test]
    fn config_gives_the_factors_or_turns_the_check_off() {
        let mut config = KvTransferConfig::default();
        let err = Compatibility::from_kv_transfer_config(&config).unwrap_err();
        assert!(err.to_string().contains(FACTORS_KEY), "{err}");

        config
            .kv_connector_extra_config
            .insert(FACTORS_KEY.into(), serde_json::to_value(qwen()).unwrap());
        let compat = Compatibility::from_kv_transfer_config(&config).unwrap();
        assert_eq!(compat, Compatibility::new(&qwen(), true));

        config
            .kv_connector_extra_config
            .insert(ENFORCE_KEY.into(), serde_json::json!("no"));
        assert!(Compatibility::from_kv_transfer_config(&config).is_err());

        config.kv_connector_extra_config.remove(FACTORS_KEY);
        config
            .kv_connector_extra_config
            .insert(ENFORCE_KEY.into(), serde_json::json!(false));
        let off = Compatibility::from_kv_transfer_config(&config).unwrap();
        assert_eq!(
            off,
            Compatibility {
                hash: String::new(),
                enforce: false,
                factors: None,
            }
        );

        let push = CompatibilityFactors {
            transfer_mode: "push".into(),
            ..qwen()
        };
        config
            .kv_connector_extra_config
            .insert(FACTORS_KEY.into(), serde_json::to_value(push).unwrap());
        let compat = Compatibility::from_kv_transfer_config(&config).unwrap();
        assert_ne!(compat.hash, qwen().hash(), "the mode is hashed");
        compat.check_transfer_mode("push").unwrap();
        let err = compat.check_transfer_mode("pull").unwrap_err();
        assert!(err.to_string().contains("in pull mode"), "{err}");
        let sideways = CompatibilityFactors {
            transfer_mode: "sideways".into(),
            ..qwen()
        };
        config
            .kv_connector_extra_config
            .insert(FACTORS_KEY.into(), serde_json::to_value(sideways).unwrap());
        let err = Compatibility::from_kv_transfer_config(&config).unwrap_err();
        assert!(
            err.to_string()
                .contains("\"sideways\" is not a transfer mode"),
            "{err}"
        );

        let mut typo = serde_json::to_value(qwen()).unwrap();
        typo["num_kv_head"] = serde_json::json!(8);
        config
            .kv_connector_extra_config
            .insert(FACTORS_KEY.into(), typo);
        let err = Compatibility::from_kv_transfer_config(&config).unwrap_err();
        assert!(err.to_string().contains("num_kv_head"), "{err}");
    }

    #[test]
    fn a_mismatch_names_both_hashes_unless_the_check_is_off() {
        let ours = Compatibility::new(&qwen(), true);
        let theirs = CompatibilityFactors {
            num_kv_heads: 4,
            ..qwen()
        };
        let meta = NixlAgentMetadata {
            engine_id: "p".into(),
            ..NixlAgentMetadata::default()
        };
        let payload = NixlHandshakePayload::new(&theirs.hash(), &meta);
        let err = ours.check(&payload, "peer").unwrap_err().to_string();
        assert!(
            err.contains(&ours.hash) && err.contains(&theirs.hash()),
            "{err}"
        );
        let off = Compatibility {
            enforce: false,
            ..ours.clone()
        };
        assert_eq!(off.check(&payload, "peer").unwrap(), meta);
        let same = NixlHandshakePayload::new(&ours.hash, &meta);
        assert_eq!(ours.check(&same, "peer").unwrap(), meta);
    }
}

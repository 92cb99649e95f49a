//! vLLM's `kv_transfer_config` (the JSON passed with `--kv-transfer-config`), and turning it
//! plus a platform into a NIXL agent with exactly the configured backends.
//!
//! ```
//! use nixl::kv_config::{KvRole, KvTransferConfig};
//!
//! let config = KvTransferConfig::from_json(r#"{
//!     "kv_connector": "NixlConnector",
//!     "kv_role": "kv_both",
//!     "kv_buffer_device": "cpu",
//!     "kv_connector_extra_config": {
//!         "backends": ["UCX", "POSIX"],
//!         "backend_params": {"UCX": {"engine_config": "TCP_USER_TIMEOUT=10s"}}
//!     }
//! }"#).unwrap();
//! assert_eq!(config.kv_role, Some(KvRole::Both));
//! assert_eq!(config.backends().unwrap(), ["UCX", "POSIX"]);
//! assert_eq!(config.backend_params("UCX").unwrap()["engine_config"], "TCP_USER_TIMEOUT=10s");
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::agent::backend::Backend;
use crate::agent::{Agent, AgentBuilder};
use crate::error::{Error, Result};
use crate::ffi::descriptor::RegDesc;
use crate::ffi::mem_type::MemType;
use crate::memory::registrable::RegisterMemory;
use crate::memory::registration::Registration;
use crate::platform::{Platform, PlatformRegistry};

/// The NIXL backends used when the config names none.
pub const DEFAULT_BACKENDS: [&str; 1] = ["UCX"];

/// Role of a worker in disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvRole {
    /// Produces KV cache (prefill).
    #[serde(rename = "kv_producer")]
    Producer,
    /// Consumes KV cache (decode).
    #[serde(rename = "kv_consumer")]
    Consumer,
    /// Both.
    #[serde(rename = "kv_both")]
    Both,
}

/// vLLM's `kv_transfer_config`. Keys this type does not know are kept in [`other`](Self::other)
/// and written back by [`to_json`](Self::to_json).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvTransferConfig {
    /// Connector class name, e.g. `NixlConnector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_connector: Option<String>,
    /// This worker's role.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_role: Option<KvRole>,
    /// Where the KV cache lives: `cuda` (vLLM's default), `cpu`, or a platform's own device.
    #[serde(default = "default_kv_buffer_device")]
    pub kv_buffer_device: String,
    /// Connector-specific settings; NIXL's connector reads `backends` from here.
    #[serde(default)]
    pub kv_connector_extra_config: Map<String, Value>,
    /// Every other key, kept as given.
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

fn default_kv_buffer_device() -> String {
    "cuda".to_string()
}

impl Default for KvTransferConfig {
    fn default() -> Self {
        KvTransferConfig {
            kv_connector: None,
            kv_role: None,
            kv_buffer_device: default_kv_buffer_device(),
            kv_connector_extra_config: Map::new(),
            other: Map::new(),
        }
    }
}

impl KvTransferConfig {
    /// Parses the JSON object vLLM users pass with `--kv-transfer-config`.
    ///
    /// # Errors
    /// [`Error::Config`] for malformed JSON, a value of the wrong type, an unknown `kv_role`,
    /// or a malformed `backends` list or `backend_params` map, with serde's line and column.
    pub fn from_json(json: &str) -> Result<Self> {
        let config: KvTransferConfig = serde_json::from_str(json).map_err(|err| Error::Config {
            reason: err.to_string(),
        })?;
        for backend in config.backends()? {
            config.backend_params(&backend)?;
        }
        config.refuse_same_host_transports()?;
        Ok(config)
    }

    /// Writes the config back as JSON, unknown keys included.
    pub fn to_json(&self) -> String {
        Value::from(self.to_value()).to_string()
    }

    fn to_value(&self) -> Map<String, Value> {
        match serde_json::to_value(self) {
            Ok(Value::Object(map)) => map,
            _ => Map::new(),
        }
    }

    /// `kv_connector_extra_config.refuse_same_host_transports`, when set: whether the agent
    /// refuses peers' same-host transports on this host
    /// ([`AgentConfig::refuse_same_host_transports`](crate::AgentConfig::refuse_same_host_transports)).
    ///
    /// # Errors
    /// [`Error::Config`] if it is not `true` or `false`.
    pub fn refuse_same_host_transports(&self) -> Result<Option<bool>> {
        match self
            .kv_connector_extra_config
            .get("refuse_same_host_transports")
        {
            None => Ok(None),
            Some(Value::Bool(on)) => Ok(Some(*on)),
            Some(other) => Err(Error::Config {
                reason: format!(
                    "kv_connector_extra_config.refuse_same_host_transports must be true or \
                     false (true for cross-host deployments); got {other}"
                ),
            }),
        }
    }

    /// The NIXL backends to create: `kv_connector_extra_config.backends`, default `["UCX"]`.
    ///
    /// # Errors
    /// [`Error::Config`] if `backends` is not a non-empty list of non-empty strings.
    pub fn backends(&self) -> Result<Vec<String>> {
        let Some(value) = self.kv_connector_extra_config.get("backends") else {
            return Ok(DEFAULT_BACKENDS.iter().map(|b| b.to_string()).collect());
        };
        let bad = |what: &str| Error::Config {
            reason: format!(
                "kv_connector_extra_config.backends {what}, e.g. [\"UCX\"]; got {value}"
            ),
        };
        let list = value
            .as_array()
            .ok_or_else(|| bad("must be a list of backend names"))?;
        if list.is_empty() {
            return Err(bad("must name at least one backend"));
        }
        list.iter()
            .map(|b| match b.as_str() {
                Some(name) if !name.is_empty() => Ok(name.to_string()),
                _ => Err(bad("must hold only non-empty strings")),
            })
            .collect()
    }

    /// The parameters to create backend `backend` with, over the plugin's defaults:
    /// `kv_connector_extra_config.backend_params.<backend>`, an object of strings (e.g.
    /// `{"UCX": {"engine_config": "TCP_USER_TIMEOUT=10s", "ucx_error_handling_mode":
    /// "peer"}}`); empty when absent. The keys are checked when the backend is created
    /// ([`Agent::create_backend_with`]).
    ///
    /// # Errors
    /// [`Error::Config`] if `backend_params` is not an object of objects, or a value is not
    /// a string.
    pub fn backend_params(&self, backend: &str) -> Result<BTreeMap<String, String>> {
        let Some(all) = self.kv_connector_extra_config.get("backend_params") else {
            return Ok(BTreeMap::new());
        };
        let bad = |what: String| Error::Config {
            reason: format!(
                "kv_connector_extra_config.backend_params {what}, e.g. {{\"UCX\": \
                 {{\"engine_config\": \"TCP_USER_TIMEOUT=10s\"}}}}; got {all}"
            ),
        };
        let all = all
            .as_object()
            .ok_or_else(|| bad("must map backend names to their parameters".into()))?;
        let Some(params) = all.get(backend) else {
            return Ok(BTreeMap::new());
        };
        let params = params
            .as_object()
            .ok_or_else(|| bad(format!("must give {backend}'s parameters as an object")))?;
        params
            .iter()
            .map(|(key, value)| match value.as_str() {
                Some(value) => Ok((key.clone(), value.to_string())),
                None => Err(bad(format!(
                    "must give {backend}'s parameter {key:?} as a string"
                ))),
            })
            .collect()
    }
}

/// A NIXL agent set up from a [`KvTransferConfig`] and a platform: exactly the configured
/// backends, and the memory type to register the KV cache with.
#[derive(Debug, Clone)]
pub struct NixlSetup {
    agent: Agent,
    backends: Vec<Backend>,
    mem_type: MemType,
}

impl NixlSetup {
    /// Resolves the memory type (see [`crate::platform`]), creates the agent (with
    /// [`refuse_same_host_transports`](KvTransferConfig::refuse_same_host_transports) from
    /// the config, when set), checks every configured backend against the available
    /// plugins, and creates each one with its
    /// [`backend_params`](KvTransferConfig::backend_params).
    ///
    /// # Errors
    /// The platform errors of [`PlatformRegistry::nixl_memory_type`];
    /// [`Error::Config`] for a bad backend list, `backend_params` map or
    /// `refuse_same_host_transports` value;
    /// [`Error::UnknownPlugin`] (listing the available plugins) for a backend NIXL does not
    /// have; agent and backend creation errors (those of
    /// [`Agent::create_backend_with`]).
    pub fn new(
        agent: AgentBuilder,
        config: &KvTransferConfig,
        platform: &dyn Platform,
        registry: &PlatformRegistry,
    ) -> Result<Self> {
        let mem_type = registry.nixl_memory_type(platform, &config.kv_buffer_device)?;
        let names = config.backends()?;
        let agent = match config.refuse_same_host_transports()? {
            Some(on) => agent.refuse_same_host_transports(on),
            None => agent,
        };
        let agent = agent.build()?;
        let available = agent.available_plugins()?;
        if let Some(missing) = names.iter().find(|name| !available.contains(name)) {
            return Err(Error::UnknownPlugin {
                name: missing.clone(),
                available,
            });
        }
        let backends = names
            .iter()
            .map(|name| agent.create_backend_with(name, config.backend_params(name)?))
            .collect::<Result<Vec<_>>>()?;
        tracing::info!(
            agent = agent.name(),
            platform = platform.device_type(),
            kv_buffer_device = %config.kv_buffer_device,
            %mem_type,
            backends = ?names,
            "NIXL set up from kv_transfer_config"
        );
        Ok(NixlSetup {
            agent,
            backends,
            mem_type,
        })
    }

    /// Like [`new`](Self::new), with the [global](crate::platform::global) registry.
    pub fn with_global_registry(
        agent: AgentBuilder,
        config: &KvTransferConfig,
        platform: &dyn Platform,
    ) -> Result<Self> {
        let registry = crate::platform::global()
            .read()
            .unwrap_or_else(|p| p.into_inner());
        Self::new(agent, config, platform, &registry)
    }

    /// The agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The configured backends, in config order.
    pub fn backends(&self) -> &[Backend] {
        &self.backends
    }

    /// The memory type the KV cache must be registered as.
    pub fn mem_type(&self) -> MemType {
        self.mem_type
    }

    /// Registers `memory` with exactly the configured backends.
    ///
    /// # Errors
    /// [`Error::MemTypeMismatch`] when `memory` is not of [`mem_type`](Self::mem_type), then
    /// the errors of [`Agent::register_memory`].
    pub fn register_memory<M: RegisterMemory + 'static>(&self, memory: M) -> Result<Registration> {
        self.check_mem_type(memory.mem_type())?;
        self.agent.register_memory(memory, &self.backend_refs())
    }

    /// Registers raw descriptors of [`mem_type`](Self::mem_type) with exactly the configured
    /// backends (e.g. device pointers of a VRAM KV cache).
    ///
    /// # Safety
    /// As for [`Agent::register_raw`].
    pub unsafe fn register_raw(&self, descs: &[RegDesc]) -> Result<Registration> {
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            self.agent
                .register_raw(self.mem_type, descs, &self.backend_refs())
        }
    }

    fn backend_refs(&self) -> Vec<&Backend> {
        self.backends.iter().collect()
    }

    fn check_mem_type(&self, found: MemType) -> Result<()> {
        if found == self.mem_type {
            Ok(())
        } else {
            Err(Error::MemTypeMismatch {
                operation: "register KV cache",
                expected: self.mem_type,
                found,
            })
        }
    }
}

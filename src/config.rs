//! Worker configuration: `--kv-transfer-config` and `--platform` turned into a connector
//! worker through the platform registry (and, with the cache geometry, into its registered
//! KV cache), and how agent metadata is exchanged.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use nixl::kv_config::{KvRole, KvTransferConfig};
use nixl::platform::{self, Platform};
use nixl::MemType;
use nixl_connector::etcd::ETCD_ENDPOINTS_ENV;
use nixl_connector::vllm::compat::{ENFORCE_KEY, FACTORS_KEY};
use nixl_connector::{
    KvConnectorWorker, MetadataExchange, MultiTurn, Protocol, SharedSecret, TransferMode,
    WorkerConfig as ConnectorConfig, BIDIRECTIONAL_KEY, PROTOCOL_KEY, RECOMPUTE_THRESHOLD_KEY,
    TRANSFER_MODE_KEY,
};

use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvLayout};

/// The default `--kv-transfer-config` of a worker with `role`: NIXL's connector, KV cache in
/// host memory, UCX.
pub fn default_kv_transfer_config(role: KvRole) -> String {
    let role = match role {
        KvRole::Producer => "kv_producer",
        KvRole::Consumer => "kv_consumer",
        KvRole::Both => "kv_both",
    };
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_buffer_device":"cpu","kv_connector_extra_config":{{"backends":["UCX"]}}}}"#
    )
}

/// How the two workers exchange NIXL agent metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetadataMode {
    /// Inside the connector's side-channel handshake.
    #[default]
    SideChannel,
    /// Through etcd with NIXL's own etcd support (`NIXL_ETCD_ENDPOINTS`).
    Etcd,
}

impl MetadataMode {
    /// The connector's setting for this mode.
    pub fn exchange(self) -> MetadataExchange {
        match self {
            MetadataMode::SideChannel => MetadataExchange::SideChannel,
            MetadataMode::Etcd => MetadataExchange::Etcd,
        }
    }
}

impl FromStr for MetadataMode {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "side-channel" => Ok(MetadataMode::SideChannel),
            "etcd" => Ok(MetadataMode::Etcd),
            other => Err(format!(
                "unknown metadata mode {other:?}; use side-channel or etcd"
            )),
        }
    }
}

impl std::fmt::Display for MetadataMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MetadataMode::SideChannel => "side-channel",
            MetadataMode::Etcd => "etcd",
        })
    }
}

/// The platform named `name` in the global registry, or the current platform
/// (`NIXL_RS_PLATFORM`, else auto-detected) when `None`.
///
/// # Errors
/// [`Error::Nixl`] for a device type the registry does not know.
pub fn resolve_platform(name: Option<&str>) -> Result<std::sync::Arc<dyn Platform>> {
    let platform = match name {
        Some(name) => platform::global()
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .platform(name)?,
        None => platform::current_platform()?,
    };
    Ok(platform)
}

/// Parses `json` (or the default config of `role` when `None`) and checks that its role, if
/// given, is `role` or `kv_both`.
///
/// # Errors
/// [`Error::Nixl`] for malformed JSON; [`Error::Config`] for the wrong role.
pub fn kv_transfer_config(json: Option<&str>, role: KvRole) -> Result<KvTransferConfig> {
    let config = KvTransferConfig::from_json(json.unwrap_or(&default_kv_transfer_config(role)))?;
    match config.kv_role {
        Some(r) if r != role && r != KvRole::Both => Err(Error::Config(format!(
            "kv_role is {r:?}, but this worker is a {role:?}"
        ))),
        _ => Ok(config),
    }
}

/// What a worker's command line says about its agent and KV cache.
#[derive(Debug, Clone, Copy)]
pub struct WorkerConfig<'a> {
    /// The worker's kind (`prefill`, `decode`): its agent is named `<worker>-<pid>` unless
    /// [`name`](Self::name) is given.
    pub worker: &'a str,
    /// The worker's role: the default `--kv-transfer-config`, and the role a given one must
    /// allow (see [`kv_transfer_config`]).
    pub role: KvRole,
    /// `--kv-transfer-config`, or `None` for the default of [`role`](Self::role).
    pub kv_transfer_config: Option<&'a str>,
    /// `--platform`, or `None` for the current platform (see [`resolve_platform`]).
    pub platform: Option<&'a str>,
    /// `--name`, the agent's name.
    pub name: Option<&'a str>,
    /// `--metadata`, how agent metadata is exchanged.
    pub metadata: MetadataMode,
    /// `--layers`, `--blocks` and `--block-size`.
    pub layout: KvLayout,
    /// `--protocol`, the connector's protocol (`None`: the `kv_transfer_config`'s, by
    /// default native).
    pub protocol: Option<Protocol>,
    /// `--transfer-mode`, pull or push (`None`: the `kv_transfer_config`'s, by default
    /// pull). In push mode the multi-turn read-backs stay off: push refuses them.
    pub transfer_mode: Option<TransferMode>,
    /// `--secret-file`, the file holding the secret both workers' side channels prove
    /// (native protocol; `None`: the `kv_transfer_config`'s or the environment's, if any).
    pub secret_file: Option<&'a Path>,
    /// Multi-turn read-backs (see [`conversation`](crate::conversation)): `Some(true)` turns
    /// vLLM's `bidirectional_kv_xfer` on unless the `kv_transfer_config` names it; `None`
    /// leaves the `kv_transfer_config` as it is.
    pub read_backs: Option<bool>,
    /// `--recompute-threshold`, vLLM's `kv_recompute_threshold` (the fewest tokens worth
    /// reading back; a block is a token in this demo), over the `kv_transfer_config`'s.
    pub recompute_threshold: Option<usize>,
}

/// A worker's connector, with its agent and registered KV cache, as set up by
/// [`WorkerConfig::set_up`].
pub struct Worker {
    /// The connector's worker half: the agent with its configured backends, and the KV
    /// cache registered with them.
    pub connector: KvConnectorWorker,
    /// The cache geometry.
    pub layout: KvLayout,
    /// The platform the memory type was resolved on.
    pub platform: Arc<dyn Platform>,
    /// The agent's name, also the engine id.
    pub name: String,
    /// The parsed `--kv-transfer-config` (the scheduler's lease, failure policy and
    /// protocol), with `--protocol`, the multi-turn settings and, in vLLM's protocol,
    /// [`demo_factors`] unless it gives factors itself.
    pub kv_transfer_config: KvTransferConfig,
    /// Its multi-turn settings (whether read-backs are on, the recompute threshold).
    pub multi_turn: MultiTurn,
}

impl Worker {
    /// The registered KV cache.
    ///
    /// # Errors
    /// Never once set up; [`Error::Connector`] otherwise.
    pub fn cache(&self) -> Result<KvCache<'_>> {
        KvCache::of(&self.connector, self.layout)
    }
}

impl WorkerConfig<'_> {
    /// Parses the kv_transfer_config, resolves the platform, creates the connector worker
    /// (its agent with the configured backends; `tune` sets the rest of its config, e.g. the
    /// side-channel address), allocates one zeroed host buffer per layer and registers them
    /// through the connector. Call it inside a tokio runtime.
    ///
    /// # Errors
    /// Those of [`kv_transfer_config`] and [`resolve_platform`]; [`Error::Config`] for a bad
    /// layout or a kv-buffer device that is not host memory on this platform; the
    /// connector's errors.
    pub fn set_up(&self, tune: impl FnOnce(&mut ConnectorConfig)) -> Result<Worker> {
        self.layout.validate()?;
        let mut kv_config = kv_transfer_config(self.kv_transfer_config, self.role)?;
        let extra = &mut kv_config.kv_connector_extra_config;
        if let Some(protocol) = self.protocol {
            extra.insert(PROTOCOL_KEY.into(), protocol.as_str().into());
        }
        if let Some(mode) = self.transfer_mode {
            extra.insert(TRANSFER_MODE_KEY.into(), mode.as_str().into());
        }
        let push = TransferMode::from_kv_transfer_config(&kv_config)? == TransferMode::Push;
        let extra = &mut kv_config.kv_connector_extra_config;
        if let Some(on) = self.read_backs.filter(|_| !push) {
            extra.entry(BIDIRECTIONAL_KEY).or_insert(on.into());
        }
        if let Some(threshold) = self.recompute_threshold {
            extra.insert(RECOMPUTE_THRESHOLD_KEY.into(), threshold.into());
        }
        let protocol = Protocol::from_kv_transfer_config(&kv_config)?;
        let multi_turn = MultiTurn::from_kv_transfer_config(&kv_config)?;
        let extra = &mut kv_config.kv_connector_extra_config;
        let given = extra.contains_key(FACTORS_KEY) || extra.contains_key(ENFORCE_KEY);
        if protocol == Protocol::Vllm && !given {
            let mode = if push {
                TransferMode::Push
            } else {
                TransferMode::Pull
            };
            extra.insert(FACTORS_KEY.into(), demo_factors(self.layout, mode));
        }
        let platform = resolve_platform(self.platform)?;
        let name = match self.name {
            Some(name) => name.to_string(),
            None => format!("{}-{}", self.worker, std::process::id()),
        };
        let mut config = ConnectorConfig::new(&name, 0, 1, kv_config.clone());
        if let Some(path) = self.secret_file {
            config.secret = Some(SharedSecret::from_file(path)?);
        }
        config.platform = platform.clone();
        config.agent_name = Some(name.clone());
        config.metadata_exchange = self.metadata.exchange();
        tune(&mut config);
        let connector = KvConnectorWorker::new(config)?;
        if connector.mem_type() != MemType::Dram {
            return Err(Error::Config(format!(
                "the kv_transfer_config resolves to {} memory on this platform, but this demo \
                 keeps its KV cache in host memory: use \"kv_buffer_device\": \"cpu\"",
                connector.mem_type()
            )));
        }
        connector.register_host_kv_caches(self.layout.spec())?;
        Ok(Worker {
            connector,
            layout: self.layout,
            platform,
            name,
            kv_transfer_config: kv_config,
            multi_turn,
        })
    }
}

/// The factors of vLLM's compatibility hash the demo's workers use in vLLM's protocol: a
/// model named `nixl-rs-demo` of `layout.layers` layers of one KV head of
/// `layout.block_bytes` bytes per block, so that workers of different caches have different
/// hashes, in transfer mode `mode` (vLLM hashes it: push and pull workers refuse each other).
pub fn demo_factors(layout: KvLayout, mode: TransferMode) -> serde_json::Value {
    serde_json::json!({
        "vllm_version": "0.33.0",
        "model": "nixl-rs-demo",
        "dtype": "torch.uint8",
        "num_kv_heads": 1,
        "head_size": layout.block_bytes,
        "num_hidden_layers": layout.layers,
        "attn_backend_name": "FLASH_ATTN",
        "cache_dtype": "auto",
        "is_hma_enabled": false,
        "transfer_mode": mode.as_str(),
    })
}

/// Sets `NIXL_ETCD_ENDPOINTS` for agents created afterwards.
///
/// Call it at the start of `main`, before any thread is spawned: the process environment is
/// shared by all threads.
pub fn set_etcd_endpoints(endpoints: &str) {
    std::env::set_var(ETCD_ENDPOINTS_ENV, endpoints);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_configs_parse() {
        for role in [KvRole::Producer, KvRole::Consumer] {
            let config = kv_transfer_config(None, role).unwrap();
            assert_eq!(config.kv_role, Some(role));
            assert_eq!(config.kv_buffer_device, "cpu");
            assert_eq!(config.backends().unwrap(), ["UCX"]);
        }
    }

    #[test]
    fn wrong_role_is_rejected() {
        let json = default_kv_transfer_config(KvRole::Consumer);
        assert!(kv_transfer_config(Some(&json), KvRole::Producer).is_err());
        let both = default_kv_transfer_config(KvRole::Both);
        assert!(kv_transfer_config(Some(&both), KvRole::Producer).is_ok());
    }

    #[test]
    fn metadata_modes() {
        assert_eq!("etcd".parse::<MetadataMode>(), Ok(MetadataMode::Etcd));
        assert_eq!(
            "side-channel".parse::<MetadataMode>(),
            Ok(MetadataMode::SideChannel)
        );
        assert!("x".parse::<MetadataMode>().is_err());
        assert_eq!(MetadataMode::Etcd.to_string(), "etcd");
    }
}

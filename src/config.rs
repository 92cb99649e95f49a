//! Worker configuration: `--kv-transfer-config` and `--platform` turned into a NIXL agent
//! through the platform registry (and, with the cache geometry, into a worker's KV cache),
//! and how agent metadata is exchanged.

use std::str::FromStr;
use std::sync::Arc;

use nixl::kv_config::{KvRole, KvTransferConfig, NixlSetup};
use nixl::platform::{self, Platform};
use nixl::Agent;

use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvLayout};

/// The environment variable NIXL reads its etcd endpoints from when an agent is created.
pub const ETCD_ENDPOINTS_ENV: &str = "NIXL_ETCD_ENDPOINTS";

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
    /// Inside the side channel's handshake.
    #[default]
    SideChannel,
    /// Through etcd with NIXL's own etcd support (`NIXL_ETCD_ENDPOINTS`).
    Etcd,
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

/// Creates agent `name` with the configured backends for `platform`.
///
/// In etcd mode `NIXL_ETCD_ENDPOINTS` must already be set (see
/// [`set_etcd_endpoints`]), since NIXL reads it when the agent is created.
///
/// # Errors
/// [`Error::Config`] for etcd mode without endpoints; [`NixlSetup`]'s errors.
pub fn nixl_setup(
    name: &str,
    config: &KvTransferConfig,
    platform: &dyn Platform,
    mode: MetadataMode,
) -> Result<NixlSetup> {
    if mode == MetadataMode::Etcd && std::env::var_os(ETCD_ENDPOINTS_ENV).is_none() {
        return Err(Error::Config(format!(
            "etcd metadata mode needs {ETCD_ENDPOINTS_ENV} (or --etcd-endpoints)"
        )));
    }
    Ok(NixlSetup::with_global_registry(
        Agent::builder(name),
        config,
        platform,
    )?)
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
}

/// A worker's NIXL agent and registered KV cache, as set up by [`WorkerConfig::set_up`].
pub struct Worker {
    /// The KV cache, registered with the configured backends. (Declared before `setup`, so
    /// that it is deregistered before the agent goes.)
    pub cache: KvCache,
    /// The agent with its configured backends.
    pub setup: NixlSetup,
    /// The platform the memory type was resolved on.
    pub platform: Arc<dyn Platform>,
    /// The agent's name.
    pub name: String,
}

impl WorkerConfig<'_> {
    /// Parses the kv_transfer_config, resolves the platform, creates the agent with the
    /// configured backends and allocates and registers the KV cache.
    ///
    /// # Errors
    /// Those of [`kv_transfer_config`], [`resolve_platform`], [`nixl_setup`] and
    /// [`KvCache::allocate`].
    pub fn set_up(&self) -> Result<Worker> {
        let kv_config = kv_transfer_config(self.kv_transfer_config, self.role)?;
        let platform = resolve_platform(self.platform)?;
        let name = match self.name {
            Some(name) => name.to_string(),
            None => format!("{}-{}", self.worker, std::process::id()),
        };
        let setup = nixl_setup(&name, &kv_config, platform.as_ref(), self.metadata)?;
        let cache = KvCache::allocate(&setup, self.layout)?;
        Ok(Worker {
            cache,
            setup,
            platform,
            name,
        })
    }
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

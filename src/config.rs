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
    KvConnectorWorker, MetadataExchange, MultiTurn, PipelineRank, PipelineStages, Protocol,
    SharedSecret, TransferMode, WorkerConfig as ConnectorConfig, BIDIRECTIONAL_KEY, PROTOCOL_KEY,
    RECOMPUTE_THRESHOLD_KEY, TRANSFER_MODE_KEY,
};

use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvLayout};
use crate::parallel::Parallel;

/// How many runs of free side-channel ports the ranks of a native engine try (rank `i`
/// listens at rank 0's port + `i`, as the connector's native protocol finds them).
const PORT_RUNS: usize = 20;

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
    /// `--tp`, `--pp` and `--kv-heads`: the engine's ranks, one connector worker each in
    /// this process (see [`parallel`](crate::parallel)).
    pub parallel: Parallel,
}

/// A worker's connector, with its agent and registered KV cache, as set up by
/// [`WorkerConfig::set_up`].
pub struct Worker {
    /// The connector's worker half of each rank, stage by stage (rank `(pp, tp)` at
    /// `pp × TP + tp`): its agent with the configured backends, and its share of the KV cache
    /// registered with them.
    pub ranks: Vec<KvConnectorWorker>,
    /// The cache geometry (the whole model's, over all ranks).
    pub layout: KvLayout,
    /// How the cache is split over the ranks.
    pub parallel: Parallel,
    /// The layers of each pipeline stage.
    pub stages: PipelineStages,
    /// The platform the memory type was resolved on.
    pub platform: Arc<dyn Platform>,
    /// The engine id, also the agent's name of a single-rank engine (rank `(pp, tp)` of a
    /// parallel one is `<name>-pp<pp>-tp<tp>`).
    pub name: String,
    /// The parsed `--kv-transfer-config` (the scheduler's lease, failure policy and
    /// protocol), with `--protocol`, the multi-turn settings and, in vLLM's protocol,
    /// [`demo_factors`] unless it gives factors itself.
    pub kv_transfer_config: KvTransferConfig,
    /// Its multi-turn settings (whether read-backs are on, the recompute threshold).
    pub multi_turn: MultiTurn,
}

impl Worker {
    /// The first rank's connector worker (the engine's only one by default): where the
    /// engine's side channel listens, its protocol and settings.
    pub fn connector(&self) -> &KvConnectorWorker {
        &self.ranks[0]
    }

    /// Waits for a notification to reach any rank (see [`KvConnectorWorker::notified`]).
    pub async fn notified(&self) {
        match self.ranks.as_slice() {
            [one] => one.notified().await,
            ranks => any(ranks.iter().map(|rank| Box::pin(rank.notified()))).await,
        }
    }

    /// Waits for a load of any rank to end (see [`KvConnectorWorker::load_ended`]).
    pub async fn load_ended(&self) {
        match self.ranks.as_slice() {
            [one] => one.load_ended().await,
            ranks => any(ranks.iter().map(|rank| Box::pin(rank.load_ended()))).await,
        }
    }

    /// Drops the transfer metrics every rank gathered (the engine's steps read none).
    pub fn drop_metrics(&self) {
        for rank in &self.ranks {
            rank.metrics();
        }
    }

    /// The registered KV cache, over every rank.
    ///
    /// # Errors
    /// Never once set up; [`Error::Connector`] otherwise.
    pub fn cache(&self) -> Result<KvCache<'_>> {
        KvCache::of(&self.ranks, self.layout, self.parallel, &self.stages)
    }
}

impl WorkerConfig<'_> {
    /// Parses the kv_transfer_config, resolves the platform, creates the connector worker
    /// (its agent with the configured backends; `tune` sets the rest of its config, e.g. the
    /// side-channel address), allocates one zeroed host buffer per layer and registers them
    /// through the connector; with several ranks ([`parallel`](Self::parallel)), one
    /// connector worker per rank, each registering its share. Call it inside a tokio
    /// runtime.
    ///
    /// # Errors
    /// Those of [`kv_transfer_config`] and [`resolve_platform`]; [`Error::Config`] for a bad
    /// layout or split, settings several ranks do not run with (etcd, push mode), or a
    /// kv-buffer device that is not host memory on this platform; the connector's errors.
    pub fn set_up(&self, tune: impl FnOnce(&mut ConnectorConfig)) -> Result<Worker> {
        self.layout.validate()?;
        let parallel = self.parallel;
        parallel.validate(self.layout.layers, self.layout.block_bytes)?;
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
        if !parallel.is_single() && (push || self.metadata == MetadataMode::Etcd) {
            return Err(Error::Config(format!(
                "--tp {} --pp {}: several ranks run in pull mode with the metadata in the side channel; drop --transfer-mode push and --metadata etcd, or run one rank",
                parallel.tp, parallel.pp
            )));
        }
        let multi_turn = MultiTurn::from_kv_transfer_config(&kv_config)?;
        let extra = &mut kv_config.kv_connector_extra_config;
        let given = extra.contains_key(FACTORS_KEY) || extra.contains_key(ENFORCE_KEY);
        if protocol == Protocol::Vllm && !given {
            let mode = if push {
                TransferMode::Push
            } else {
                TransferMode::Pull
            };
            let factors = demo_factors(self.layout, self.parallel.kv_heads, mode);
            extra.insert(FACTORS_KEY.into(), factors);
        }
        let platform = resolve_platform(self.platform)?;
        let name = match self.name {
            Some(name) => name.to_string(),
            None => format!("{}-{}", self.worker, std::process::id()),
        };
        let mut config = ConnectorConfig::new(&name, 0, parallel.tp, kv_config.clone());
        if let Some(path) = self.secret_file {
            config.secret = Some(SharedSecret::from_file(path)?);
        }
        config.platform = platform.clone();
        config.agent_name = Some(name.clone());
        config.metadata_exchange = self.metadata.exchange();
        tune(&mut config);
        let stages = parallel.stages(self.layout.layers)?;
        let ranks = if parallel.is_single() {
            vec![self.register(config, 0, &stages)?]
        } else {
            self.register_ranks(&config, &stages)?
        };
        Ok(Worker {
            ranks,
            layout: self.layout,
            parallel,
            stages,
            platform,
            name,
            kv_transfer_config: kv_config,
            multi_turn,
        })
    }

    /// The connector worker of rank `index` made from `config`, its cache registered.
    fn register(
        &self,
        config: ConnectorConfig,
        index: usize,
        stages: &PipelineStages,
    ) -> Result<KvConnectorWorker> {
        let connector = KvConnectorWorker::new(config)?;
        if connector.mem_type() != MemType::Dram {
            return Err(Error::Config(format!(
                "the kv_transfer_config resolves to {} memory on this platform, but this demo \
                 keeps its KV cache in host memory: use \"kv_buffer_device\": \"cpu\"",
                connector.mem_type()
            )));
        }
        let geometry = (self.layout.blocks, self.layout.block_bytes);
        connector.register_host_kv_caches(self.parallel.spec(stages, geometry, index))?;
        Ok(connector)
    }

    /// Every rank of a parallel engine, from `base` (rank 0's settings): rank `(pp, tp)`
    /// named `<engine>-pp<pp>-tp<tp>`, with its stage; in vLLM's protocol every rank
    /// served by rank 0's side channel, natively rank `i` listening at rank 0's port + `i`
    /// (another run of ports tried when one is taken).
    fn register_ranks(
        &self,
        base: &ConnectorConfig,
        stages: &PipelineStages,
    ) -> Result<Vec<KvConnectorWorker>> {
        let parallel = self.parallel;
        let rank_config = |index: usize| -> Result<ConnectorConfig> {
            let (pp, tp) = parallel.rank_of(index);
            let mut config = base.clone();
            config.tp_rank = tp;
            config.agent_name = Some(format!("{}-pp{pp}-tp{tp}", base.engine_id));
            config.pipeline = Some(PipelineRank::new(stages.clone(), pp)?);
            Ok(config)
        };
        let mut last = None;
        for _ in 0..PORT_RUNS {
            let first = self.register(rank_config(0)?, 0, stages)?;
            let port = first.side_channel_addr()?.port();
            let vllm = match first.protocol() {
                Protocol::Vllm => Some(first.vllm_side_channel()?),
                Protocol::Native => None,
            };
            let mut ranks = vec![first];
            for index in 1..parallel.ranks() {
                let mut config = rank_config(index)?;
                if let Some(server) = &vllm {
                    config.vllm_side_channel = Some(server.clone());
                } else {
                    let Some(at) = port.checked_add(index as u16) else {
                        break;
                    };
                    config.side_channel.set_port(at);
                }
                match self.register(config, index, stages) {
                    Ok(rank) => ranks.push(rank),
                    Err(err) => {
                        last = Some(err);
                        break;
                    }
                }
            }
            if ranks.len() == parallel.ranks() {
                return Ok(ranks);
            }
            if vllm.is_some() {
                break;
            }
        }
        Err(last.unwrap_or_else(|| {
            Error::Config(format!(
                "no run of {} free side-channel ports for the engine's ranks",
                parallel.ranks()
            ))
        }))
    }
}

/// Waits for the first of `waits` to end; never, for none.
async fn any<F: std::future::Future<Output = ()> + Unpin>(waits: impl Iterator<Item = F>) {
    let waits: Vec<F> = waits.collect();
    if waits.is_empty() {
        return std::future::pending().await;
    }
    futures_util::future::select_all(waits).await;
}

/// The factors of vLLM's compatibility hash the demo's workers use in vLLM's protocol: a
/// model named `nixl-rs-demo` of `layout.layers` layers of `kv_heads` KV heads sharing
/// `layout.block_bytes` bytes per block, so that workers of different caches have different
/// hashes, in transfer mode `mode` (vLLM hashes it: push and pull workers refuse each other).
pub fn demo_factors(layout: KvLayout, kv_heads: usize, mode: TransferMode) -> serde_json::Value {
    serde_json::json!({
        "vllm_version": "0.33.0",
        "model": "nixl-rs-demo",
        "dtype": "torch.uint8",
        "num_kv_heads": kv_heads,
        "head_size": layout.block_bytes / kv_heads.max(1),
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

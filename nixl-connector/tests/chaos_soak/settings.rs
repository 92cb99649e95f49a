//! The soak's shape: caches, timings, the engines' config, and the variables that pass it
//! to the prefill process.

use std::time::Duration;

use nixl_connector::{
    KvAttention, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvLayout, PipelineStages,
    Protocol, SchedulerConfig, TransferMode,
};

use crate::common;
use crate::pool::BLOCKS;

/// The cache of a rank of TP `tp` of a model with 2 KV heads (HND: a block is its heads'
/// tokens, head by head, so rank `d` of TP 2 holds the second half of each prefill block
/// when `d` is 1, the first when 0).
pub fn spec(tp: usize) -> KvCacheSpec {
    stage_spec(tp, LAYERS)
}

/// The model's layers (one region each).
pub const LAYERS: usize = 3;

/// The cache of a rank of TP `tp` holding `layers` of the model's layers (a pipeline stage's).
pub fn stage_spec(tp: usize, layers: usize) -> KvCacheSpec {
    KvCacheSpec::uniform(
        layers,
        BLOCKS,
        4,
        KvAttention::Mha { total_kv_heads: 2 },
        KvLayout::Hnd,
        4 * (2 / tp) * 16,
    )
}

/// How the soak's engines move the KV: pulled or pushed, in which protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wire {
    pub mode: TransferMode,
    pub protocol: Protocol,
}

impl Wire {
    /// Pulled, in the native protocol.
    pub const NATIVE_PULL: Wire = Wire::of(TransferMode::Pull, Protocol::Native);
    /// Pushed, in the native protocol.
    pub const NATIVE_PUSH: Wire = Wire::of(TransferMode::Push, Protocol::Native);
    /// Pulled, in vLLM's protocol.
    pub const VLLM_PULL: Wire = Wire::of(TransferMode::Pull, Protocol::Vllm);
    /// Pushed, in vLLM's protocol.
    pub const VLLM_PUSH: Wire = Wire::of(TransferMode::Push, Protocol::Vllm);

    /// `mode` in `protocol`.
    const fn of(mode: TransferMode, protocol: Protocol) -> Wire {
        Wire { mode, protocol }
    }

    /// The decode's TP (the prefill's is 1): in pull mode 2, each decode rank reading its
    /// head from the prefill; in push mode 1, as push writes a decode of TP at most the
    /// prefill's.
    pub fn decode_tp(self) -> usize {
        match self.mode {
            TransferMode::Pull => 2,
            TransferMode::Push => 1,
        }
    }

    /// Whether a reader can tell that a lease ended before its READ did: yes but in vLLM's
    /// protocol when pulling, where a Rust prefill's params carry no expiry time and vLLM's
    /// wire no release marks (the connector README's "vLLM mode" under the lease checks).
    /// Without, the soak makes no READ that may outlive a lease: no decode stall past one,
    /// and a request that arrives late is not read.
    pub fn lease_checked(self) -> bool {
        self != Wire::VLLM_PULL
    }

    /// Whether the decode keeps, for as long as it runs, the blocks of a load registered
    /// with a prefill that died before answering: in native push mode (the connector
    /// README's known limit); in vLLM's push protocol it hands them back two leases after
    /// the registration timeout.
    pub fn holds_for_the_dead(self) -> bool {
        self.mode == TransferMode::Push && self.protocol == Protocol::Native
    }
}

/// The stages of a prefill of `pp` pipeline stages (vLLM's even split: 2 + 1 for PP 2).
pub fn stages(pp: usize) -> PipelineStages {
    PipelineStages::even(LAYERS, pp).unwrap()
}

/// The role's environment: how many requests the prefill makes (at most, in a long run).
pub const TARGET_ENV: &str = "NIXL_CONNECTOR_SOAK_REQUESTS";
/// The role's environment: the prefill's engine id (a restarted prefill is a new engine).
pub const ENGINE_ENV: &str = "NIXL_CONNECTOR_SOAK_ENGINE";
/// The long run's length, in whole seconds (the prefill process gets what is left of it).
pub const SECONDS_ENV: &str = "NIXL_CONNECTOR_SOAK_SECONDS";
/// `0` runs the soak without faults (no prefill killed or stopped, no decode stalled, no
/// transfer timeout, no engine evicted: no request leaked), to show the decode's memory flat;
/// unset or `1`, with them.
pub const FAULTS_ENV: &str = "NIXL_CONNECTOR_SOAK_FAULTS";
/// The role's environment: the engines' transfer mode, `push` or `pull` (unset).
pub const MODE_ENV: &str = "NIXL_CONNECTOR_SOAK_MODE";
/// The role's environment: the engines' protocol, `vllm` or `native` (unset).
pub const PROTOCOL_ENV: &str = "NIXL_CONNECTOR_SOAK_PROTOCOL";
/// The role's environment: the prefill's pipeline stages (unset: 1), each a rank of its
/// process holding its layers, the decode reading each layer from the stage holding it.
pub const PREFILL_PP_ENV: &str = "NIXL_CONNECTOR_SOAK_PREFILL_PP";
/// The first prefill's engine id.
pub const PREFILL: &str = "pf-soak";
/// UCX's transport selection, and the soak's: TCP only (with UCX's own self transport).
pub const UCX_TLS: &str = "UCX_TLS";
pub const TCP_ONLY: &str = "tcp,self";
/// The prefill is killed and restarted after this many of its requests reached the decode
/// (once in CI, again and again in a long run).
pub const KILL_AFTER: u64 = 150;
/// The decode is stopped this long after the start and after it resumed (half of it after
/// a long stop; by time, not steps: on a loaded machine a step takes several times
/// longer): the first of every four times for more than a whole lease (leases end), the
/// others for less than the lease's margin (heartbeats stop, leases hold).
pub const STALL_EVERY: Duration = Duration::from_secs(2);
/// A stall that misses heartbeats (sent every 250 ms, each extending the lease to 1 s from
/// its arrival) without ending a lease.
pub const SHORT_STALL_MS: u64 = 300;
/// A stall past the 1.5 s lease.
pub const LONG_STALL_MS: u64 = 2200;
/// How often the third agent floods the prefill with heartbeats.
pub const FLOOD_EVERY: Duration = Duration::from_millis(250);
/// The decode's engine TTL, in seconds (`engine_ttl`): a killed prefill is evicted.
pub const ENGINE_TTL_S: f64 = 1.0;
/// The third agent's engine TTL, in seconds: a killed prefill is evicted, the live one is
/// kept (in use every flood) through the longest decode stall, which stops the third agent
/// too.
pub const HOSTILE_ENGINE_TTL_S: f64 = 5.0;
/// A request that reaches the decode this long after the prefill made it may lose its
/// 1.5 s lease before the decode's first heartbeat arrives (on a loaded machine): it gets
/// no long wait (its load, if the lease ended, fails as outlived).
pub const ARRIVED_LATE: Duration = Duration::from_millis(750);
/// How long some requests wait for their blocks: past the 1.5 s lease.
pub const LONG_WAIT: Duration = Duration::from_secs(2);

/// `NIXL_CONNECTOR_SOAK_SECONDS`: a long run's length (the prefill process sees it too).
pub fn soak_seconds() -> Option<u64> {
    std::env::var(SECONDS_ENV).ok().map(|s| {
        s.parse()
            .expect("NIXL_CONNECTOR_SOAK_SECONDS: whole seconds")
    })
}

/// `NIXL_CONNECTOR_SOAK_FAULTS`: whether the soak's run has its faults (the default).
pub fn soak_faults() -> bool {
    match std::env::var(FAULTS_ENV).as_deref() {
        Err(_) | Ok("1") => true,
        Ok("0") => false,
        Ok(other) => panic!("NIXL_CONNECTOR_SOAK_FAULTS: 0 or 1, not {other:?}"),
    }
}

/// The requests of a CI run without faults: enough after warm-up for a leak of a few hundred
/// bytes a request to pass the bound of [`crate::memory`].
pub const FAULT_FREE_REQUESTS: u64 = 4000;

/// The prefill process's wire, from [`MODE_ENV`] and [`PROTOCOL_ENV`].
pub fn role_wire() -> Wire {
    let mode = match std::env::var(MODE_ENV).as_deref() {
        Ok("push") => TransferMode::Push,
        _ => TransferMode::Pull,
    };
    let protocol = match std::env::var(PROTOCOL_ENV).as_deref() {
        Ok("vllm") => Protocol::Vllm,
        _ => Protocol::Native,
    };
    Wire::of(mode, protocol)
}

/// The `kv_transfer_config` of every engine: DRAM, a 1.5 s lease, `wire`'s mode and
/// protocol.
pub fn kv(wire: Wire) -> nixl::kv_config::KvTransferConfig {
    let mut kv = match wire.protocol {
        Protocol::Vllm => {
            let mut factors = common::vllm_factors();
            if wire.mode == TransferMode::Push {
                factors["transfer_mode"] = "push".into();
            }
            common::vllm_config(factors)
        }
        _ => common::cpu_config(),
    };
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("kv_lease_duration".into(), 1.5.into());
    if wire.mode == TransferMode::Push {
        extra.insert("transfer_mode".into(), "push".into());
    }
    kv
}

/// The scheduler of engine `engine` of TP `tp` and `pp` stages on `wire`, whose rank 0 is
/// `rank0`.
pub fn scheduler(
    engine: &str,
    (tp, pp): (usize, usize),
    rank0: &KvConnectorWorker,
    wire: Wire,
) -> KvConnectorScheduler {
    let port = rank0.side_channel_addr().unwrap().port();
    let mut config = SchedulerConfig::new(engine, "127.0.0.1", port, tp, &kv(wire)).unwrap();
    config.pp_size = pp;
    KvConnectorScheduler::new(config)
}

/// `NIXL_CONNECTOR_SOAK_PREFILL_PP`: the prefill's stages.
pub fn prefill_pp() -> usize {
    std::env::var(PREFILL_PP_ENV).map_or(1, |s| {
        s.parse()
            .expect("NIXL_CONNECTOR_SOAK_PREFILL_PP: a number of stages")
    })
}

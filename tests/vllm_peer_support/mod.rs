//! The Python vLLM-protocol peer (tests/py/vllm_peer.py) and the engines the tests run
//! against it: the geometry both sides share, their bytes, and a Rust engine in vLLM mode.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::kv_config::KvTransferConfig;
use nixl::platform::BuiltinPlatform;
use nixl_connector::vllm::CompatibilityFactors;
use nixl_connector::{
    KvAttention, KvCacheGroups, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvLayout,
    LoadOutcome, SchedulerConfig, WorkerConfig,
};
use serde_json::Value;

use crate::py;

/// A running tests/py/vllm_peer.py.
pub struct VllmPeer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl VllmPeer {
    pub fn start() -> VllmPeer {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/vllm_peer.py");
        let mut child = Command::new(py::python())
            .arg(script)
            .env("NIXL_LOG_LEVEL", "WARN")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start tests/py/vllm_peer.py");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        VllmPeer {
            child,
            stdin,
            stdout,
        }
    }

    /// Sends one command and returns its answer (blocking: run it off the async workers).
    pub fn call(&mut self, command: &str) -> String {
        tokio::task::block_in_place(|| {
            writeln!(self.stdin, "{command}").expect("write peer");
            self.stdin.flush().unwrap();
            loop {
                let mut line = String::new();
                let n = self.stdout.read_line(&mut line).expect("read peer");
                assert!(n > 0, "the Python peer exited");
                if let Some(rest) = line.strip_prefix("@@ ") {
                    return rest.trim_end().to_string();
                }
            }
        })
    }

    pub fn json(&mut self, command: &str) -> Value {
        serde_json::from_str(&self.call(command)).expect("peer JSON")
    }
}

impl Drop for VllmPeer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// The bytes of region `region` of a Python engine (tests/py/vllm_peer.py's `kv_byte`, byte `i`
/// from the region's start), in its registration after `salt` others (`kv_reregister`).
pub fn python_byte_of(salt: usize, region: usize, i: usize) -> u8 {
    ((i * 7 + (i >> 8) * 13 + region * 131 + salt * 89 + 3) % 256) as u8
}

/// The bytes of region `region` of a Rust prefill (byte `i` from the region's start), in
/// its registration after `salt` others.
pub fn rust_byte_of(salt: usize, region: usize, i: usize) -> u8 {
    ((i * 11 + (i >> 8) * 5 + region * 71 + salt * 97 + 1) % 256) as u8
}

/// The geometry both engines of the Python tests share, vLLM 0.33's `LBHNC`: 2 layers of 16
/// blocks of 16 tokens of 8 KV heads of 4 bytes of K and 4 of V (1 KiB blocks).
pub const REGIONS: usize = 2;
pub const BLOCKS: usize = 16;
pub const BLOCK_LEN: usize = 1024;

pub fn kv_spec() -> KvCacheSpec {
    KvCacheSpec::uniform(
        REGIONS,
        BLOCKS,
        16,
        KvAttention::Mha { total_kv_heads: 8 },
        KvLayout::Hnd,
        BLOCK_LEN,
    )
}

/// A host-memory `kv_transfer_config` speaking vLLM's protocol with `factors`, a lease of
/// 0.6 s (heartbeats every 0.1 s).
pub fn vllm_kv(factors: &CompatibilityFactors) -> KvTransferConfig {
    let mut kv = KvTransferConfig {
        kv_buffer_device: "cpu".into(),
        ..Default::default()
    };
    let extra = &mut kv.kv_connector_extra_config;
    extra.insert("protocol".into(), "vllm".into());
    extra.insert(
        "vllm_compat_factors".into(),
        serde_json::to_value(factors).unwrap(),
    );
    extra.insert("kv_lease_duration".into(), 0.6.into());
    kv
}

/// A vLLM-mode engine of TP 1 with `kv` , its scheduler knowing the KV
/// cache groups `kv` names.
pub fn vllm_engine_with(
    engine: &str,
    kv: KvTransferConfig,
) -> (KvConnectorWorker, KvConnectorScheduler) {
    let mut config = WorkerConfig::new(engine, 0, 1, kv.clone());
    config.platform = Arc::new(BuiltinPlatform::CPU);
    let worker = KvConnectorWorker::new(config).unwrap();
    worker.register_host_kv_caches(kv_spec()).unwrap();
    let port = worker.side_channel_addr().unwrap().port();
    let mut config = SchedulerConfig::new(engine, "127.0.0.1", port, 1, &kv).unwrap();
    config.vllm_side_channel = Some(worker.vllm_side_channel().unwrap());
    let groups = KvCacheGroups::from_kv_transfer_config(&kv).unwrap();
    (
        worker,
        KvConnectorScheduler::new(config).with_kv_cache_groups(groups),
    )
}

/// Fills every region of a Rust prefill's cache, whole, with [`rust_byte_of`] `salt`.
pub fn fill_rust_prefill(prefill: &KvConnectorWorker, salt: usize) {
    let cache = prefill.kv_caches().unwrap();
    for (region, registered) in cache.regions().iter().enumerate() {
        let bytes: Vec<u8> = (0..registered.len)
            .map(|i| rust_byte_of(salt, region, i))
            .collect();
        cache.write(region, 0, &bytes).unwrap();
    }
}

/// Steps `scheduler` over `decodes` until its one load ends (at most 10 s).
pub async fn load_outcome(
    scheduler: &mut KvConnectorScheduler,
    decodes: &[KvConnectorWorker],
) -> LoadOutcome {
    let started = Instant::now();
    loop {
        if let Some(outcome) = scheduler.step(decodes).unwrap().load_outcomes.pop() {
            return outcome;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the load never ended"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

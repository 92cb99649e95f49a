//! Shared helpers of the connector tests: DRAM caches, patterns, polling, stalled workers,
//! side channels that count their connections.

#![allow(dead_code)]

// Both speak vLLM's protocol too: only the tests of the vllm feature use them.
#[cfg(feature = "vllm")]
pub mod geometry;
#[cfg(feature = "vllm")]
pub mod hybrid;
pub mod loads;
#[cfg(feature = "vllm")]
pub mod matrix;
#[cfg(feature = "vllm")]
pub mod ranks;
#[cfg(feature = "vllm")]
pub mod ssm;

use std::process::Child;
#[path = "../../../tests/common/netns.rs"]
mod netns;
#[path = "../../../tests/common/role.rs"]
mod role;
#[path = "../../../tests/common/skip.rs"]
mod skip;
#[path = "../../../tests/common/tracked.rs"]
mod tracked;

// Not every test binary uses each.
#[allow(unused_imports)]
pub use netns::netns_unavailable;
#[allow(unused_imports)]
pub use role::{
    after_tag, all_threads_stopped, hex, role_process, signal, stdout_lines, unhex, ChildLines,
};
#[allow(unused_imports)]
pub use skip::skip;
#[allow(unused_imports)]
pub use tracked::Tracked;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::kv_config::KvTransferConfig;
use nixl_connector::{
    Capability, EngineLayout, FinishStatus, Finished, KvAttention, KvCacheSpec,
    KvConnectorScheduler, KvConnectorWorker, KvLayout, KvTransferParams, RemoteBlocks,
    WorkerConfig,
};

/// The total deadline of the test workers' side channels.
pub const SERVER_DEADLINE: Duration = Duration::from_secs(2);

/// Bytes of one head's token in the test caches (8 elements of 2 bytes).
pub const TOKEN_BYTES: usize = 16;

/// A memory figure of this process from `/proc/self/status` in KiB, e.g. `VmRSS` or
/// `VmHWM` (its peak).
pub fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"))
}

/// The bytes this process's heap (glibc malloc, every arena and its mmapped blocks) holds
/// allocated now, in KiB: what leaks grow, without the freed memory that RSS keeps.
pub fn heap_in_use_kib() -> u64 {
    // SAFETY: mallinfo2 only reads the allocator's counters.
    let info = unsafe { libc::mallinfo2() };
    ((info.uordblks + info.hblkhd) / 1024) as u64
}

/// A small HND cache of a rank of TP `tp` of a model with `total` KV heads: 3 regions of 16
/// blocks of 4 tokens.
pub fn spec_tp(total: usize, tp: usize) -> KvCacheSpec {
    let heads = (total / tp).max(1);
    KvCacheSpec::uniform(
        3,
        16,
        4,
        KvAttention::Mha {
            total_kv_heads: total,
        },
        KvLayout::Hnd,
        4 * heads * TOKEN_BYTES,
    )
}

/// [`spec_tp`] for TP 1: `heads` KV heads.
pub fn spec(heads: usize) -> KvCacheSpec {
    spec_tp(heads, 1)
}

pub fn cpu_config() -> KvTransferConfig {
    KvTransferConfig {
        kv_buffer_device: "cpu".to_string(),
        ..Default::default()
    }
}

/// The factors of vLLM's compatibility hash the tests' vLLM-mode engines share.
pub fn vllm_factors() -> serde_json::Value {
    serde_json::json!({
        "vllm_version": "0.33.0", "model": "nixl-rs/test-model", "dtype": "torch.bfloat16",
        "num_kv_heads": 4, "head_size": 8, "num_hidden_layers": 3,
        "attn_backend_name": "FLASH_ATTN", "cache_dtype": "auto", "is_hma_enabled": false,
    })
}

/// A host-memory `kv_transfer_config` speaking vLLM's protocol with `factors`.
pub fn vllm_config(factors: serde_json::Value) -> KvTransferConfig {
    let mut config = cpu_config();
    let extra = &mut config.kv_connector_extra_config;
    extra.insert("protocol".into(), "vllm".into());
    extra.insert("vllm_compat_factors".into(), factors);
    config
}

/// `config` in push mode (`transfer_mode: "push"`), its vLLM compatibility factors (if it
/// speaks vLLM's protocol) saying so too, as vLLM's push engines' do.
pub fn in_push_mode(config: &mut KvTransferConfig) {
    let extra = &mut config.kv_connector_extra_config;
    extra.insert("transfer_mode".into(), "push".into());
    if let Some(factors) = extra.get_mut("vllm_compat_factors") {
        factors["transfer_mode"] = "push".into();
    }
}

/// A worker with a registered zeroed DRAM cache of `spec`.
pub fn worker(engine: &str, rank: usize, tp: usize, spec: &KvCacheSpec) -> KvConnectorWorker {
    worker_with(engine, rank, tp, spec, |_| {})
}

/// As [`worker`], with `adjust` applied to the config first.
pub fn worker_with(
    engine: &str,
    rank: usize,
    tp: usize,
    spec: &KvCacheSpec,
    adjust: impl FnOnce(&mut WorkerConfig),
) -> KvConnectorWorker {
    let mut config = WorkerConfig::new(engine, rank, tp, cpu_config());
    config.platform = std::sync::Arc::new(nixl::platform::BuiltinPlatform::CPU);
    config.limits.deadline = SERVER_DEADLINE;
    adjust(&mut config);
    let worker = KvConnectorWorker::new(config).expect("create worker");
    worker
        .register_host_kv_caches(spec.clone())
        .expect("register");
    worker
}

/// A prefill worker of engine `prefill` with every block filled ([`fill`]) and a decode
/// worker of engine `decode`, both TP 1 with the cache of [`spec`]`(2)`.
pub fn filled_prefill_and_decode(
    prefill: &str,
    decode: &str,
) -> (KvCacheSpec, KvConnectorWorker, KvConnectorWorker) {
    let spec = spec(2);
    let source = worker(prefill, 0, 1, &spec);
    fill(&source, &spec);
    let decode = worker(decode, 0, 1, &spec);
    (spec, source, decode)
}

/// Runs `decode`'s handshake with engine `engine` (TP 1) at 127.0.0.1:`port`; panics if it
/// fails.
pub async fn handshake(decode: &KvConnectorWorker, engine: &str, port: u16) {
    decode
        .handshake_with(engine, "127.0.0.1", port, 1)
        .await
        .unwrap_or_else(|err| panic!("handshake with {engine}: {err}"));
}

/// Each of `decodes` handshakes with engine `engine` of `layout` at 127.0.0.1:`port` before
/// any request, as a decode that learns of a prefill does (panics if one fails): each
/// rank's handshakes so far ([`handshakes`]).
pub async fn handshake_first(
    tag: &str,
    decodes: &[KvConnectorWorker],
    (engine, port): (&str, u16),
    layout: EngineLayout,
) -> Vec<u64> {
    for rank in decodes {
        rank.handshake_with_layout(engine, "127.0.0.1", port, layout)
            .await
            .unwrap_or_else(|err| panic!("{tag}: handshake with {engine} ({layout:?}): {err}"));
    }
    handshakes(decodes)
}

/// `params` as the other engine gets them in `protocol`: through vLLM's JSON in vLLM's,
/// as they are in the native one.
#[cfg(feature = "vllm")]
pub fn as_sent(protocol: nixl_connector::Protocol, params: KvTransferParams) -> KvTransferParams {
    match protocol {
        nixl_connector::Protocol::Vllm => {
            KvTransferParams::from_vllm_json(&params.to_vllm_json()).unwrap()
        }
        _ => params,
    }
}

/// How many handshakes each of `ranks` made so far.
pub fn handshakes(ranks: &[KvConnectorWorker]) -> Vec<u64> {
    ranks.iter().map(|r| r.remote_stats().handshakes).collect()
}

/// The byte at `offset` of block `block`, region `layer`, of a prefill cache.
pub fn pattern(layer: usize, block: usize, offset: usize) -> u8 {
    (layer * 131 + block * 31 + offset * 7 + 1) as u8
}

/// Fills every block of a prefill worker with [`pattern`].
pub fn fill(worker: &KvConnectorWorker, spec: &KvCacheSpec) {
    let reg = worker.kv_caches().unwrap();
    for layer in 0..spec.num_regions() {
        let len = spec.block_len(layer);
        for block in 0..spec.num_blocks {
            let data: Vec<u8> = (0..len).map(|o| pattern(layer, block, o)).collect();
            reg.write(layer, block * len, &data).unwrap();
        }
    }
}

/// Reads one block of one region.
pub fn block(
    worker: &KvConnectorWorker,
    spec: &KvCacheSpec,
    layer: usize,
    block: usize,
) -> Vec<u8> {
    let len = spec.block_len(layer);
    let mut out = vec![0u8; len];
    worker
        .kv_caches()
        .unwrap()
        .read(layer, block * len, &mut out)
        .unwrap();
    out
}

/// Where to read `blocks` of request `request` from `prefill`.
pub fn remote(
    prefill: &KvConnectorWorker,
    engine: &str,
    request: &str,
    blocks: Vec<usize>,
    tp: usize,
) -> RemoteBlocks {
    RemoteBlocks {
        engine_id: engine.to_string(),
        host: "127.0.0.1".to_string(),
        port: prefill.side_channel_addr().unwrap().port(),
        block_ids: blocks,
        group_lens: Vec::new(),
        request_id: request.to_string(),
        tp_size: tp,
        pp_size: 1,
        dcp_size: 1,
        num_tokens: None,
        blocks_expiry_time: None,
        registration_generation: None,
        capability: Some(capability()),
        lease_epoch: None,
        kept: false,
    }
}

/// The native finish notification of agent `sender` for `request` saying `count` readers,
/// tagged under [`capability`].
pub fn finish_message(sender: &str, request: &str, count: usize) -> Vec<u8> {
    let tag = capability().finish_tag(sender.as_bytes(), request, count);
    format!("{request}:{count}:{tag}").into_bytes()
}

/// The capability the tests' requests are held and read with (see
/// [`KvConnectorWorker::hold_for_decode`]).
pub fn capability() -> Capability {
    Capability::from_hex("7e57ca9ab1117e57ca9ab1117e57ca9a").unwrap()
}

/// The params of a prefill request that a remote decode will read.
pub fn for_decode() -> KvTransferParams {
    KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    }
}

/// Finishes prefill request `request` in `blocks` for a remote decode (its lease starts
/// now), and returns the params for the decode; the worker holds it from its next
/// `start_load_kv`.
pub fn finished_for_decode(
    scheduler: &mut KvConnectorScheduler,
    request: &str,
    blocks: &[usize],
) -> KvTransferParams {
    let done = scheduler.request_finished(
        request,
        blocks,
        0,
        Some(&for_decode()),
        FinishStatus::LengthCapped,
    );
    assert!(done.delay_free_blocks);
    done.kv_transfer_params.unwrap()
}

/// [`finished_for_decode`], and hands the request to `worker` at once (its blocks held).
pub fn finish_for_decode(
    worker: &KvConnectorWorker,
    scheduler: &mut KvConnectorScheduler,
    request: &str,
    blocks: &[usize],
) -> KvTransferParams {
    let params = finished_for_decode(scheduler, request, blocks);
    worker.start_load_kv(&scheduler.build_connector_meta());
    params
}

/// Polls `worker.finished()` until `done` says so or `limit` passes; returns all finished.
pub async fn poll_until(
    worker: &KvConnectorWorker,
    limit: Duration,
    mut done: impl FnMut(&Finished) -> bool,
) -> Finished {
    let start = Instant::now();
    let mut all = Finished::default();
    loop {
        let step = worker.finished();
        all.sending.extend(step.sending);
        all.recving.extend(step.recving);
        if done(&all) || start.elapsed() > limit {
            return all;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Reads `child`'s stdout until a line holds `PORT <port>`, and returns the port.
pub fn printed_port(child: &mut Child) -> u16 {
    after_tag(&mut stdout_lines(child), "PORT ")
        .expect("the child prints its port")
        .trim()
        .parse()
        .unwrap()
}

/// Upper bound for any single wait in the tests. Only a guard against hangs: nothing asserts
/// how fast anything is.
pub const WAIT: Duration = Duration::from_secs(60);

/// A worker as [`worker`] whose NIXL agent runs no progress thread: a READ from it stays in
/// flight (UCX needs the source for the connection's wire-up) until something polls its
/// agent, e.g. [`progress_until`].
pub fn stalled_worker(
    engine: &str,
    rank: usize,
    tp: usize,
    spec: &KvCacheSpec,
) -> KvConnectorWorker {
    worker_with(engine, rank, tp, spec, |config| {
        config.agent_config.progress_thread = false
    })
}

/// Waits until `done` holds, checking every millisecond; panics, naming `what`, after
/// `limit`.
pub async fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "waited in vain for {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Lets `worker`'s agent progress (polling it every millisecond) until `done` holds; panics,
/// naming `what`, after [`WAIT`].
pub async fn progress_until(
    worker: &KvConnectorWorker,
    what: &str,
    mut done: impl FnMut() -> bool,
) {
    wait_for(what, WAIT, || {
        done() || {
            worker.agent().notifications().expect("poll the agent");
            false
        }
    })
    .await
}

/// A TCP listener on 127.0.0.1 that counts the connections it accepts and forwards each to
/// a side channel, or holds it open in silence.
pub struct CountingListener {
    /// The port it listens on.
    pub port: u16,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl CountingListener {
    /// Forwards every connection to `target`.
    pub async fn forward(target: SocketAddr) -> Self {
        Self::start(Some(target)).await
    }

    /// Accepts connections and never answers.
    pub async fn silent() -> Self {
        Self::start(None).await
    }

    async fn start(target: Option<SocketAddr>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                match target {
                    Some(target) => {
                        tokio::spawn(async move {
                            if let Ok(mut upstream) = tokio::net::TcpStream::connect(target).await {
                                let _ =
                                    tokio::io::copy_bidirectional(&mut stream, &mut upstream).await;
                            }
                        });
                    }
                    None => held.push(stream),
                }
            }
        });
        CountingListener {
            port,
            accepted,
            task,
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for CountingListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

//! Command-line pieces both demo workers share: the KV-cache and NIXL options, logging, the
//! async runtime, and how a run's outcome becomes an exit code.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use nixl::kv_config::KvRole;
use nixl_connector::{Protocol, TransferMode};
use nixl_rs::cli::{parse_positive, parse_protocol, parse_size, parse_transfer_mode, use_colour};
use nixl_rs::config::{self, MetadataMode, WorkerConfig};
use nixl_rs::kv_cache::KvLayout;
use nixl_rs::parallel::Parallel;

/// Options of the KV cache and of the worker's NIXL agent.
#[derive(Debug, clap::Args)]
pub struct WorkerArgs {
    /// vLLM's kv_transfer_config JSON (backends, kv_role, kv_buffer_device).
    /// Default: NixlConnector, this worker's role, cpu buffers, backends ["UCX"].
    #[arg(long)]
    pub kv_transfer_config: Option<String>,
    /// Platform device type from the platform registry.
    /// Default: $NIXL_RS_PLATFORM, else auto-detected.
    #[arg(long)]
    pub platform: Option<String>,
    /// Layers of the KV cache (one registered region each); the same on both workers.
    #[arg(long, default_value_t = 32, value_parser = parse_positive::<usize>)]
    pub layers: usize,
    /// Blocks per layer.
    #[arg(long, default_value_t = 512, value_parser = parse_positive::<usize>)]
    pub blocks: usize,
    /// Bytes per block, the same on both workers (suffixes K/KiB, M/MiB).
    #[arg(long, default_value = "16KiB", value_parser = parse_size)]
    pub block_size: usize,
    /// The connector's protocol: native (its own handshake, one side channel per rank) or
    /// vllm (vLLM 0.33's NixlConnector protocol: a ZMQ ROUTER, the compatibility hash,
    /// vLLM's JSON kv_transfer_params). Default: the kv_transfer_config's, else native.
    #[arg(long, value_parser = parse_protocol)]
    pub protocol: Option<Protocol>,
    /// Which way the KV moves: pull (the decode READs) or push (the decode registers its
    /// blocks and the prefill WRITEs into them; native protocol, no read-backs). Default:
    /// the kv_transfer_config's, else pull.
    #[arg(long, value_parser = parse_transfer_mode)]
    pub transfer_mode: Option<TransferMode>,
    /// How agent metadata is exchanged: side-channel (the connector's handshake) or etcd.
    #[arg(long, default_value_t = MetadataMode::SideChannel)]
    pub metadata: MetadataMode,
    /// etcd endpoints for --metadata etcd (sets NIXL_ETCD_ENDPOINTS).
    #[arg(long)]
    pub etcd_endpoints: Option<String>,
    /// File holding the secret both workers' connector side channels prove to each other
    /// (native protocol; 16 to 4096 bytes, e.g. from `openssl rand -hex 32`). Default: the
    /// kv_transfer_config's auth_secret_file or auth_secret, else $NIXL_CONNECTOR_SECRET or
    /// $NIXL_CONNECTOR_SECRET_FILE, else none (not authenticated).
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Agent name (default: <worker>-<pid>).
    #[arg(long)]
    pub name: Option<String>,
    /// Largest control-channel message accepted (suffixes K/KiB, M/MiB).
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    pub max_frame: usize,
    /// Serve the connector's vllm:nixl_* metrics to Prometheus on this address (GET
    /// /metrics; port 0: any free port, printed at start). Default: no endpoint.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Tensor-parallel ranks of this engine (per stage), each a connector worker in this
    /// process holding its share of every block's KV heads (see --kv-heads). Pull mode
    /// with the metadata in the side channel.
    #[arg(long, default_value_t = 1, value_parser = parse_positive::<usize>)]
    pub tp: usize,
    /// Pipeline stages of this engine, each a TP group of connector workers in this process
    /// holding vLLM's even split of the layers.
    #[arg(long, default_value_t = 1, value_parser = parse_positive::<usize>)]
    pub pp: usize,
    /// KV heads of every block, the same on both workers, shared by the TP ranks: a multiple
    /// of both engines' --tp that divides --block-size.
    #[arg(long, default_value_t = 1, value_parser = parse_positive::<usize>)]
    pub kv_heads: usize,
}

impl WorkerArgs {
    /// Sets up what must precede any agent (etcd endpoints, logging to stderr, filtered by
    /// `RUST_LOG`, default `warn`, in colour only when stderr is a terminal and `NO_COLOR` is
    /// unset or empty).
    pub fn start(&self) {
        if let Some(endpoints) = &self.etcd_endpoints {
            config::set_etcd_endpoints(endpoints);
        }
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(use_colour(
                std::io::stderr().is_terminal(),
                std::env::var_os("NO_COLOR").as_deref(),
            ))
            .init();
    }

    /// Starts the Prometheus endpoint if `--metrics-addr` asks for one, and prints where it
    /// listens; call it before the worker is set up.
    pub async fn serve_metrics(&self, worker: &str) -> nixl_rs::Result<()> {
        if let Some(addr) = self.metrics_addr {
            let bound = nixl_rs::prometheus::serve(addr).await?;
            println!("{worker}: Prometheus metrics on http://{bound}/metrics");
        }
        Ok(())
    }

    /// The KV-cache layout.
    pub fn layout(&self) -> KvLayout {
        KvLayout {
            layers: self.layers,
            blocks: self.blocks,
            block_bytes: self.block_size,
        }
    }

    /// What these options say about worker `worker` in `role`.
    pub fn worker_config<'a>(&'a self, worker: &'a str, role: KvRole) -> WorkerConfig<'a> {
        WorkerConfig {
            worker,
            role,
            kv_transfer_config: self.kv_transfer_config.as_deref(),
            platform: self.platform.as_deref(),
            name: self.name.as_deref(),
            metadata: self.metadata,
            layout: self.layout(),
            protocol: self.protocol,
            transfer_mode: self.transfer_mode,
            secret_file: self.secret_file.as_deref(),
            read_backs: None,
            recompute_threshold: None,
            parallel: Parallel {
                tp: self.tp,
                pp: self.pp,
                kv_heads: self.kv_heads,
            },
        }
    }
}

/// A tokio runtime for a worker: current-thread, or multi-thread with `threads` workers.
pub fn runtime(threads: Option<usize>) -> nixl_rs::Result<tokio::runtime::Runtime> {
    let mut builder = match threads {
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_current_thread(),
    };
    builder
        .enable_all()
        .build()
        .map_err(|err| nixl_rs::Error::io("start the async runtime", err))
}

/// The exit code of worker `worker` whose run ended with `result`: the run's own code, or
/// [`ExitCode::FAILURE`] after printing `<worker>: error: <err>` to stderr.
pub fn exit_code(worker: &str, result: nixl_rs::Result<ExitCode>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("{worker}: error: {err}");
            ExitCode::FAILURE
        }
    }
}

/// How a worker's startup line names its ranks: nothing for one rank, else its TP × PP and
/// KV heads.
pub fn ranks_note(parallel: &Parallel) -> String {
    if parallel.is_single() {
        return String::new();
    }
    format!(
        ", {} ranks in this process: TP {} x PP {}, {} KV heads",
        parallel.ranks(),
        parallel.tp,
        parallel.pp,
        parallel.kv_heads
    )
}

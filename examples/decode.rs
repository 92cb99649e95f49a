//! The decode worker of the disaggregated-serving demo: connects to a prefill worker, pulls
//! every announced request's KV-cache blocks with NIXL READs (the notification carrying the
//! request id), verifies every byte, and prints a summary.
//!
//! ```sh
//! cargo run --release --example decode -- --prefill 127.0.0.1:7800 --requests 64
//! ```

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use nixl::kv_config::KvRole;
use nixl_rs::cli::{self, parse_size};
use nixl_rs::config::{self, MetadataMode, WorkerConfig};
use nixl_rs::decode::{self, DecodeOptions};
use nixl_rs::kv_cache::KvLayout;

/// Decode worker: pulls KV-cache blocks from a prefill worker through NIXL.
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Args {
    /// Prefill's side-channel address.
    #[arg(long, default_value = "127.0.0.1:7800")]
    prefill: SocketAddr,
    /// vLLM's kv_transfer_config JSON (backends, kv_role, kv_buffer_device).
    /// Default: NixlConnector, kv_consumer, cpu buffers, backends ["UCX"].
    #[arg(long)]
    kv_transfer_config: Option<String>,
    /// Platform device type from the platform registry.
    /// Default: $NIXL_RS_PLATFORM, else auto-detected.
    #[arg(long)]
    platform: Option<String>,
    /// Layers of the KV cache; must match prefill.
    #[arg(long, default_value_t = 32)]
    layers: usize,
    /// Blocks per layer of the decode cache.
    #[arg(long, default_value_t = 512)]
    blocks: usize,
    /// Bytes per block; must match prefill (suffixes K/KiB, M/MiB).
    #[arg(long, default_value = "16KiB", value_parser = parse_size)]
    block_size: usize,
    /// Requests to pull.
    #[arg(long, default_value_t = 64)]
    requests: u64,
    /// Blocks per request (in every layer).
    #[arg(long, default_value_t = 16)]
    blocks_per_request: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    in_flight: u32,
    /// How agent metadata is exchanged: side-channel or etcd.
    #[arg(long, default_value_t = MetadataMode::SideChannel)]
    metadata: MetadataMode,
    /// etcd endpoints for --metadata etcd (sets NIXL_ETCD_ENDPOINTS).
    #[arg(long)]
    etcd_endpoints: Option<String>,
    /// Agent name (default: decode-<pid>).
    #[arg(long)]
    name: Option<String>,
    /// Seconds to keep trying to reach prefill and to wait for its handshake.
    #[arg(long, default_value_t = 30)]
    connect_timeout_s: u64,
    /// Seconds one READ may take.
    #[arg(long, default_value_t = 20)]
    xfer_timeout_s: u64,
    /// Milliseconds between progress lines.
    #[arg(long, default_value_t = 500)]
    progress_interval_ms: u64,
    /// Largest side-channel message accepted.
    #[arg(long, default_value = "16MiB", value_parser = parse_size)]
    max_frame: usize,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(endpoints) = &args.etcd_endpoints {
        config::set_etcd_endpoints(endpoints);
    }
    init_logging();
    cli::exit_code("decode", run(&args))
}

/// Runs the decode worker; [`ExitCode::FAILURE`] when bytes mismatched.
fn run(args: &Args) -> nixl_rs::Result<ExitCode> {
    let layout = KvLayout {
        layers: args.layers,
        blocks: args.blocks,
        block_bytes: args.block_size,
    };
    let worker = WorkerConfig {
        worker: "decode",
        role: KvRole::Consumer,
        kv_transfer_config: args.kv_transfer_config.as_deref(),
        platform: args.platform.as_deref(),
        name: args.name.as_deref(),
        metadata: args.metadata,
        layout,
    }
    .set_up()?;
    let options = DecodeOptions {
        prefill: args.prefill,
        mode: args.metadata,
        requests: args.requests,
        blocks_per_request: args.blocks_per_request,
        in_flight: args.in_flight,
        connect_timeout: Duration::from_secs(args.connect_timeout_s),
        xfer_timeout: Duration::from_secs(args.xfer_timeout_s),
        max_frame: args.max_frame,
        progress_interval: Duration::from_millis(args.progress_interval_ms),
    };
    println!(
        "decode: agent {} pulling {} requests of {} blocks x {} layers x {} bytes from {} \
         ({} in flight, metadata via {})",
        worker.name,
        args.requests,
        args.blocks_per_request,
        layout.layers,
        layout.block_bytes,
        args.prefill,
        args.in_flight,
        args.metadata
    );
    let summary = decode::run(&worker.setup, &worker.cache, &options, |progress| {
        println!("decode: {progress}");
    })
    .unwrap_or_else(|err| {
        // Exit before the cache and agent are torn down: NIXL may still hold connections to
        // a dead prefill, and the OS reclaims everything anyway.
        eprintln!("decode: error: {err}");
        std::process::exit(1)
    });
    println!("{summary}");
    Ok(if summary.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

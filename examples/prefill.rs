//! The prefill worker of the disaggregated-serving demo, a thin client of the KV connector:
//! fills each request's KV-cache blocks, hands decode workers the request's transfer params
//! over its control channel, and frees the blocks when the connector reports the decode's
//! notification.
//!
//! ```sh
//! cargo run --release --example prefill -- --listen 127.0.0.1:7800 --sessions 1
//! ```

mod common;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use nixl::kv_config::KvRole;
use nixl_rs::cli::{parse_positive, parse_size};
use nixl_rs::prefill::{
    PrefillEvent, PrefillOptions, PrefillServer, DEFAULT_MAX_PENDING_HANDSHAKES,
};
use nixl_rs::stats::gb_per_s;

/// Prefill worker: serves KV-cache blocks to decode workers through NIXL.
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Args {
    #[command(flatten)]
    worker: common::WorkerArgs,
    /// Control-channel address to listen on (port 0: any free port, printed at start); the
    /// connector's side channel listens on the same host, on a port of its own.
    #[arg(long, default_value = "127.0.0.1:7800")]
    listen: SocketAddr,
    /// Exit after serving this many decode sessions (default: serve forever).
    #[arg(long, value_parser = parse_positive::<u64>)]
    sessions: Option<u64>,
    /// Seconds a new connection may take, in all, to complete its handshake.
    #[arg(long, default_value_t = 10, value_parser = parse_positive::<u64>)]
    handshake_timeout_s: u64,
    /// Most connections in their handshake at once; when all are taken, the oldest is closed
    /// with a busy answer for each new one (decode retries a busy answer).
    #[arg(long, default_value_t = DEFAULT_MAX_PENDING_HANDSHAKES, value_parser = parse_positive::<usize>)]
    max_pending_handshakes: usize,
    /// Most bytes pending handshakes may have received together, beyond 64 KiB each
    /// (suffixes K/KiB, M/MiB); a handshake that would pass it is refused.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    max_pending_handshake_bytes: usize,
    /// Decodes running conversations of several turns (decode --turns): the fewest answer
    /// tokens worth reading back (a block is a token in this demo); fewer are computed here.
    /// Default: the kv_transfer_config's kv_recompute_threshold, else vLLM's 64.
    #[arg(long)]
    recompute_threshold: Option<usize>,
    /// Fault injection: corrupt one byte of this request id after filling it.
    #[arg(long, hide = true)]
    corrupt_request: Option<u64>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    args.worker.start();
    let result = common::runtime(None).and_then(|rt| rt.block_on(run(&args)));
    common::exit_code("prefill", result)
}

async fn run(args: &Args) -> nixl_rs::Result<ExitCode> {
    let layout = args.worker.layout();
    args.worker.serve_metrics("prefill").await?;
    let mut worker_config = args.worker.worker_config("prefill", KvRole::Producer);
    // Read-backs on, for decodes that run conversations of several turns; a single-turn
    // session reads nothing back.
    worker_config.read_backs = Some(true);
    worker_config.recompute_threshold = args.recompute_threshold;
    let worker = worker_config.set_up(|config| {
        config.side_channel = SocketAddr::new(args.listen.ip(), 0);
        config.limits.deadline = Duration::from_secs(args.handshake_timeout_s);
        config.limits.max_sessions = args.max_pending_handshakes;
    })?;
    let backends: Vec<_> = worker
        .connector()
        .backends()
        .iter()
        .map(|b| b.plugin().to_string())
        .collect();
    let (name, platform) = (
        worker.name.clone(),
        worker.platform.device_type().to_string(),
    );
    let side_channel = worker.connector().side_channel_addr()?;
    let protocol = worker.connector().protocol();
    let authenticated = worker.connector().authenticated();
    let ranks = common::ranks_note(&worker.parallel);
    let options = PrefillOptions {
        max_frame: args.worker.max_frame,
        handshake_timeout: Duration::from_secs(args.handshake_timeout_s),
        max_pending_handshakes: args.max_pending_handshakes,
        max_pending_handshake_bytes: args.max_pending_handshake_bytes,
        max_sessions: args.sessions,
        corrupt_request: args.corrupt_request,
    };
    let server = PrefillServer::bind(worker, args.listen, options).await?;
    println!(
        "prefill: agent {name} listening on {} ({} layers x {} blocks x {} bytes = {:.1} MiB, \
         backends {backends:?}, platform {platform}, metadata via {}, connector protocol {protocol}, {}side channel {side_channel}{ranks})",
        server.local_addr()?,
        layout.layers,
        layout.blocks,
        layout.block_bytes,
        layout.total_bytes() as f64 / (1 << 20) as f64,
        args.worker.metadata,
        if authenticated { "authenticated " } else { "" },
    );
    let stats = server
        .serve(|event| match event {
            PrefillEvent::SessionStarted {
                peer,
                decode_agent,
                requests,
            } => println!("prefill: session with {decode_agent} ({peer}): {requests} requests"),
            PrefillEvent::SessionEnded(report) => match &report.outcome {
                Ok(()) => {
                    if let Some(read_backs) = &report.read_backs {
                        println!("prefill: session with {}: {read_backs}", report.decode_agent);
                    }
                    println!(
                    "prefill: session with {} done: {}/{} requests, {:.1} MiB in {:.3} s ({:.2} GB/s)",
                    report.decode_agent,
                    report.requests_acked,
                    report.requests_wanted,
                    report.bytes as f64 / (1 << 20) as f64,
                    report.duration.as_secs_f64(),
                    gb_per_s(report.bytes, report.duration),
                    )
                }
                Err(err) => eprintln!(
                    "prefill: session with {} ended early after {}/{} requests: {err}",
                    report.decode_agent, report.requests_acked, report.requests_wanted
                ),
            },
            PrefillEvent::Rejected { peer, error } => {
                eprintln!("prefill: rejected connection from {peer}: {error}")
            }
        })
        .await;
    println!(
        "prefill summary: {} sessions ({} ended early), {} requests served ({} freed when their lease ended), {} connections rejected",
        stats.sessions, stats.failed_sessions, stats.requests, stats.freed_on_lease_end, stats.rejected
    );
    Ok(
        if stats.failed_sessions == 0 && stats.read_back_mismatches == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
}

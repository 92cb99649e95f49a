//! The decode worker of the disaggregated-serving demo, a thin client of the KV connector:
//! connects to a prefill worker, loads every announced request's KV-cache blocks through the
//! connector (NIXL READs, the notification naming the request), verifies every byte, and
//! prints a summary.
//!
//! ```sh
//! cargo run --release --example decode -- --prefill 127.0.0.1:7800 --requests 64
//! ```

mod common;

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use nixl::kv_config::KvRole;
use nixl_connector::TransferMode;
use nixl_rs::cli::parse_positive;
use nixl_rs::decode::{self, DecodeOptions};

/// Decode worker: pulls KV-cache blocks from a prefill worker through NIXL.
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Args {
    #[command(flatten)]
    worker: common::WorkerArgs,
    /// Prefill's control-channel address: what the prefill prints as `listening on ADDR` (its
    /// --listen), not its connector side channel.
    #[arg(long, default_value = "127.0.0.1:7800")]
    prefill: SocketAddr,
    /// Requests to pull.
    #[arg(long, default_value_t = 64, value_parser = parse_positive::<u64>)]
    requests: u64,
    /// Blocks per request (in every layer).
    #[arg(long, default_value_t = 16, value_parser = parse_positive::<u32>)]
    blocks_per_request: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4, value_parser = parse_positive::<u32>)]
    in_flight: u32,
    /// Seconds that reaching prefill and the handshake may take in all (also the limit of
    /// the connector's handshake with prefill's side channel).
    #[arg(long, default_value_t = 30, value_parser = parse_positive::<u64>)]
    connect_timeout_s: u64,
    /// Seconds one READ may take, and the longest the run may go without news from prefill
    /// (an announcement, or a READ that ended).
    #[arg(long, default_value_t = 20, value_parser = parse_positive::<u64>)]
    xfer_timeout_s: u64,
    /// Milliseconds between progress lines.
    #[arg(long, default_value_t = 500, value_parser = parse_positive::<u64>)]
    progress_interval_ms: u64,
    /// Blocks at the start of every request that decode's own prefix cache holds: it
    /// computes them itself and loads only the rest from prefill (all of them: it only
    /// tells prefill, which frees the blocks). Every byte is verified either way.
    #[arg(long, default_value_t = 0)]
    prefix_hit_blocks: u32,
    /// Abort every Kth announced request, alternately before its load starts (prefill is
    /// told at once) and while its load runs (its blocks are freed when the load ends).
    #[arg(long, value_parser = parse_positive::<u64>)]
    abort_every: Option<u64>,
    /// Turns per conversation: every request becomes a conversation of N turns. Decode
    /// answers each turn but the last with blocks of its own and keeps them; the next turn's
    /// prompt (the last one, its answer and --blocks-per-request new blocks) reads them back
    /// on prefill, and decode loads only what its prefix cache lacks (read-backs turned on:
    /// bidirectional_kv_xfer).
    #[arg(long, default_value_t = 1, value_parser = parse_positive::<u32>)]
    turns: u32,
    /// With --turns: the most blocks decode answers a turn with (answers take 1 to N blocks,
    /// varying by conversation and turn).
    #[arg(long, default_value_t = 4, value_parser = parse_positive::<u32>)]
    answer_blocks: u32,
    /// Fault injection: corrupt one byte of the first answer of this conversation (its
    /// number is turn 1's request id on prefill).
    #[arg(long, hide = true)]
    corrupt_answer: Option<u64>,
    /// Decode context parallelism: 1 only, as this demo's KV cache is MHA-like (vLLM 0.33
    /// runs DCP for MLA caches only); a larger size is refused.
    #[arg(long, default_value_t = 1, value_parser = parse_positive::<usize>)]
    dcp: usize,
    /// Seconds to keep serving --metrics-addr after the run, so that Prometheus can take a
    /// last scrape of a run that ended.
    #[arg(long, default_value_t = 0)]
    metrics_linger_s: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    args.worker.start();
    let result = common::runtime(None).and_then(|rt| rt.block_on(run(&args)));
    common::exit_code("decode", result)
}

/// Runs the decode worker; [`ExitCode::FAILURE`] when bytes mismatched.
async fn run(args: &Args) -> nixl_rs::Result<ExitCode> {
    nixl_rs::parallel::check_dcp(args.dcp)?;
    let layout = args.worker.layout();
    let connect_timeout = Duration::from_secs(args.connect_timeout_s);
    args.worker.serve_metrics("decode").await?;
    let turns = args.turns > 1;
    let mut worker_config = args.worker.worker_config("decode", KvRole::Consumer);
    worker_config.read_backs = turns.then_some(true);
    let worker = worker_config.set_up(|config| {
        config.limits.deadline = connect_timeout;
        config.transfer_timeout = Duration::from_secs(args.xfer_timeout_s);
        let push = TransferMode::from_kv_transfer_config(&config.kv_transfer_config)
            .is_ok_and(|mode| mode == TransferMode::Push);
        if turns || push {
            // Prefill reads the kept answers back, or handshakes to WRITE (push mode),
            // through this side channel: bound where prefill can reach it.
            config.side_channel = SocketAddr::new(local_ip_towards(args.prefill), 0);
        }
    })?;
    let options = DecodeOptions {
        prefill: args.prefill,
        requests: args.requests,
        blocks_per_request: args.blocks_per_request,
        in_flight: args.in_flight,
        connect_timeout,
        idle_timeout: Duration::from_secs(args.xfer_timeout_s),
        max_frame: args.worker.max_frame,
        progress_interval: Duration::from_millis(args.progress_interval_ms),
        prefix_hit_blocks: args.prefix_hit_blocks,
        abort_every: args.abort_every,
        turns: args.turns,
        answer_blocks: args.answer_blocks,
        corrupt_answer: args.corrupt_answer,
    };
    let conversations = if turns {
        format!(" (conversations of {} turns)", args.turns)
    } else {
        String::new()
    };
    println!(
        "decode: agent {} pulling {} requests{conversations} of {} blocks x {} layers x {} bytes from {} \
         ({} in flight, metadata via {}, connector protocol {}{})",
        worker.name,
        args.requests,
        args.blocks_per_request,
        layout.layers,
        layout.block_bytes,
        args.prefill,
        args.in_flight,
        args.worker.metadata,
        worker.connector().protocol(),
        common::ranks_note(&worker.parallel),
    );
    let summary = decode::run(&worker, &options, |progress| {
        println!("decode: {progress}");
    })
    .await
    .unwrap_or_else(|err| {
        // Exit before the connector and agent are torn down: NIXL may still hold
        // connections to a dead prefill, and the OS reclaims everything anyway.
        eprintln!("decode: error: {err}");
        std::process::exit(1)
    });
    println!("{summary}");
    if args.worker.metrics_addr.is_some() && args.metrics_linger_s > 0 {
        println!(
            "decode: run ended; serving metrics {} s more",
            args.metrics_linger_s
        );
        tokio::time::sleep(Duration::from_secs(args.metrics_linger_s)).await;
    }
    Ok(if summary.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The address of this host that reaches `peer` (the route's source; no packet is sent), or
/// loopback when there is no route.
fn local_ip_towards(peer: SocketAddr) -> IpAddr {
    let loopback = IpAddr::from([127, 0, 0, 1]);
    std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0))
        .and_then(|socket| {
            socket.connect(peer)?;
            socket.local_addr()
        })
        .map_or(loopback, |addr| addr.ip())
}

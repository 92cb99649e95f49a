//! What NIXL's UCX backend does between two network namespaces without the connector: a
//! target process in `--target-netns` registers a filled buffer, and this process moves it.
//! - By default ([`bulk`]): the ceiling the prefill/decode demo is held to across hosts
//!   (scripts/bench-tcp.sh), READs and WRITEs of the whole buffer in GB/s.
//! - With `--concurrent-reads N` ([`concurrent`]): N awaited 16 KiB READs at once on a
//!   multi-thread tokio runtime against the same READs one after another, as a ratio of
//!   their times: whether overlap hides the network's latency.
//!
//! UCX's settings come from the environment (`UCX_TLS=tcp UCX_NET_DEVICES=...`, which the
//! target inherits) and from `--engine-config`, on both sides:
//!
//! ```sh
//! ip netns exec NS_A env UCX_TLS=tcp cargo run --release --example tcp_probe -- \
//!     --target-netns NS_B --bytes 268435456 --desc-bytes 262144
//! ip netns exec NS_A env UCX_TLS=tcp cargo run --release --example tcp_probe -- \
//!     --target-netns NS_B --concurrent-reads 1000 --workers 2
//! ```

mod bulk;
mod concurrent;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use nixl::Agent;

/// The probe's settings.
#[derive(Parser)]
struct Args {
    /// Bytes of the target's buffer (what one pass moves; with `--concurrent-reads`, at
    /// least that many 16 KiB blocks).
    #[arg(long, default_value_t = 256 << 20)]
    bytes: usize,
    /// Bytes of each descriptor.
    #[arg(long, default_value_t = 256 << 10)]
    desc_bytes: usize,
    /// Requests in flight at once; each moves an equal share of the buffer.
    #[arg(long, default_value_t = 4)]
    in_flight: usize,
    /// Times the whole buffer is moved, per operation.
    #[arg(long, default_value_t = 4)]
    passes: usize,
    /// Awaited 16 KiB READs at once, against the same one after another (0: the bulk rates).
    #[arg(long, default_value_t = 0)]
    concurrent_reads: usize,
    /// The tokio runtime's worker threads, with `--concurrent-reads`.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Timed repetitions of each, alternating, with `--concurrent-reads`.
    #[arg(long, default_value_t = 7)]
    reps: usize,
    /// The UCX backend's `engine_config` on both sides (`KEY=VALUE,...`, UCX's settings
    /// without their `UCX_` prefix).
    #[arg(long, default_value = "")]
    engine_config: String,
    /// The network namespace of the target (`ip netns exec`); none: this one.
    #[arg(long)]
    target_netns: Option<String>,
    /// Run as the target: register a filled buffer, print its metadata and address, wait
    /// for stdin to close.
    #[arg(long, hide = true)]
    serve: bool,
}

/// What starts the target's line of its agent name, metadata and address.
const TAG: &str = "tcp-probe-target: ";

/// How long one pass or batch may take before the probe gives up.
const PASS_LIMIT: Duration = Duration::from_secs(120);

fn main() {
    let args = Args::parse();
    if args.serve {
        serve(&args);
        return;
    }
    let (mut child, name, metadata, addr) = start_target(&args);
    let agent = Agent::new(&format!("tcp-probe-{}", std::process::id())).expect("agent");
    ucx_backend(&agent, &args.engine_config);
    assert_eq!(
        agent.load_remote_metadata(&metadata).expect("metadata"),
        name
    );
    let local = Arc::new(
        agent
            .register_memory(vec![0u8; args.bytes], &[])
            .expect("register the local buffer"),
    );
    match args.concurrent_reads {
        0 => bulk::rates(&args, &agent, &local, (&name, addr)),
        reads => concurrent::ratio(&args, reads, &agent, &local, (&name, addr)),
    }
    drop(child.stdin.take());
    let _ = child.wait();
}

/// The byte at `i` of the target's buffer.
fn fill(i: usize) -> u8 {
    (i * 7 + 3) as u8
}

/// Starts the target (in `--target-netns` if given) and reads its agent name, metadata and
/// buffer address.
fn start_target(args: &Args) -> (Child, String, Vec<u8>, usize) {
    let me = std::env::current_exe().expect("the probe's own path");
    let mut command = match &args.target_netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&me);
            c
        }
        None => Command::new(&me),
    };
    let mut child = command
        .args(["--serve", "--bytes", &args.bytes.to_string()])
        .args(["--engine-config", &args.engine_config])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the target");
    // UCX may print to stdout too (UCX_PROTO_INFO), its C buffer flushed in blocks that
    // end mid-line: the target's words follow the tag, wherever it starts.
    let line = BufReader::new(child.stdout.take().expect("the target's stdout"))
        .lines()
        .map(|line| line.expect("the target's output"))
        .find_map(|line| line.find(TAG).map(|at| line[at + TAG.len()..].to_string()))
        .expect("the target's line");
    let mut words = line.split_whitespace();
    let name = words.next().expect("a name").to_string();
    let metadata = unhex(words.next().expect("metadata"));
    let addr = words.next().expect("an address").parse().expect("a number");
    (child, name, metadata, addr)
}

/// Creates `agent`'s UCX backend with `engine_config`.
fn ucx_backend(agent: &Agent, engine_config: &str) {
    agent
        .create_backend_with("UCX", [("engine_config", engine_config)])
        .expect("UCX backend");
}

/// The target: a filled, registered buffer of `--bytes`; prints its tagged
/// `NAME METADATA-HEX ADDR`.
fn serve(args: &Args) {
    let name = format!("tcp-probe-target-{}", std::process::id());
    let agent = Agent::new(&name).expect("agent");
    ucx_backend(&agent, &args.engine_config);
    let buffer: Vec<u8> = (0..args.bytes).map(fill).collect();
    let reg = agent.register_memory(buffer, &[]).expect("register");
    let metadata = agent.local_metadata().expect("metadata");
    let hex: String = metadata.iter().map(|b| format!("{b:02x}")).collect();
    let mut out = std::io::stdout();
    writeln!(out, "{TAG}{name} {hex} {}", reg.regions()[0].addr).expect("print");
    out.flush().expect("flush");
    let mut rest = String::new();
    let _ = std::io::stdin().read_line(&mut rest);
}

/// The bytes of a hex string.
fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

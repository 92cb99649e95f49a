//! What NIXL's UCX backend carries between two network namespaces without the connector:
//! the ceiling the prefill/decode demo is held to across hosts (scripts/bench-tcp.sh). A
//! target process in `--target-netns` registers a buffer of `--bytes`; this process READs
//! it whole (`--in-flight` requests at once, descriptors of `--desc-bytes` that NIXL does
//! not merge), `--passes` times, then WRITEs it the same way, and prints both rates:
//!
//! ```text
//! tcp-probe read GB/s 0.912
//! tcp-probe write GB/s 1.801
//! ```
//!
//! UCX's settings come from the environment (`UCX_TLS=tcp UCX_NET_DEVICES=...`, and any
//! `UCX_TCP_*`), which the target inherits:
//!
//! ```sh
//! ip netns exec NS_A env UCX_TLS=tcp cargo run --release --example tcp_probe -- \
//!     --target-netns NS_B --bytes 268435456 --desc-bytes 262144
//! ```

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use nixl::{Agent, LocalDescList, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};

/// The probe's settings.
#[derive(Parser)]
struct Args {
    /// Bytes of the target's buffer (what one pass moves).
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

/// How long one pass may take before the probe gives up.
const PASS_LIMIT: Duration = Duration::from_secs(120);

fn main() {
    let args = Args::parse();
    if args.serve {
        serve(&args);
        return;
    }
    assert!(
        args.desc_bytes > 0
            && args.in_flight > 0
            && args.bytes % (args.desc_bytes * args.in_flight) == 0,
        "--bytes must be a multiple of --desc-bytes x --in-flight"
    );
    let (mut child, name, metadata, addr) = start_target(&args);
    let agent = Agent::new(&format!("tcp-probe-{}", std::process::id())).expect("agent");
    ucx_backend(&agent, &args.engine_config);
    assert_eq!(
        agent.load_remote_metadata(&metadata).expect("metadata"),
        name
    );
    let local = agent
        .register_memory(vec![0u8; args.bytes], &[])
        .expect("register the local buffer");
    for op in [XferOp::Read, XferOp::Write] {
        let share = args.bytes / args.in_flight;
        let mut requests: Vec<_> = (0..args.in_flight)
            .map(|r| {
                let mut mine = LocalDescList::new(MemType::Dram).expect("list");
                let mut theirs = RemoteDescList::new(MemType::Dram).expect("list");
                for offset in (r * share..(r + 1) * share).step_by(args.desc_bytes) {
                    mine.push(&local, 0, offset, args.desc_bytes)
                        .expect("local");
                    theirs
                        .push(XferDesc::new(addr + offset, args.desc_bytes, 0))
                        .expect("remote");
                }
                let options = XferOptions::new().skip_desc_merge(true);
                agent
                    .create_xfer_req(op, &mine, &theirs, &name, &options)
                    .expect("request")
            })
            .collect();
        let start = Instant::now();
        for _ in 0..args.passes {
            for request in &mut requests {
                request.post().expect("post");
            }
            for request in &mut requests {
                request.wait(PASS_LIMIT).expect("transfer");
            }
        }
        let gbps = (args.passes * args.bytes) as f64 / start.elapsed().as_secs_f64() / 1e9;
        let label = if op == XferOp::Read { "read" } else { "write" };
        println!("tcp-probe {label} GB/s {gbps:.3}");
        if op == XferOp::Read {
            let mut probe = [0u8; 1];
            local
                .read(0, args.bytes - 1, &mut probe)
                .expect("read back");
            assert_eq!(probe[0], fill(args.bytes - 1), "the target's last byte");
        }
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

//! The CMA limit of this machine: how fast one process reads another's memory with
//! `process_vm_readv`, the path UCX takes between two processes on one host. It reads
//! blocks of `--block-bytes` at random places of a buffer of `--bytes` in a child process,
//! with one iovec per call and with 64, `--passes` times over, and prints both rates:
//!
//! ```text
//! cma one-iovec GB/s 4.92
//! cma 64-iovec GB/s 5.10
//! ```
//!
//! ```sh
//! cargo run --release --example cma_probe -- --bytes 16777216 --block-bytes 8192 --passes 16
//! ```

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use clap::Parser;

/// The probe's settings.
#[derive(Parser)]
struct Args {
    /// Bytes of the child's buffer (the bytes a transfer moves).
    #[arg(long, default_value_t = 16 << 20)]
    bytes: usize,
    /// Bytes of each block read (a transfer's descriptor).
    #[arg(long, default_value_t = 8192)]
    block_bytes: usize,
    /// Times the whole buffer is read, in a new random order each time.
    #[arg(long, default_value_t = 16)]
    passes: usize,
    /// Run as the child: allocate and fill the buffer, print `PID ADDR`, wait for stdin.
    #[arg(long, hide = true)]
    serve: bool,
}

fn main() {
    let args = Args::parse();
    if args.serve {
        serve(args.bytes);
        return;
    }
    let mut child = Command::new(std::env::current_exe().expect("the probe's own path"))
        .args(["--serve", "--bytes", &args.bytes.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the probe's child");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("the child's stdout"))
        .read_line(&mut line)
        .expect("the child's address");
    let mut words = line
        .split_whitespace()
        .map(|w| w.parse::<usize>().expect("a number"));
    let (pid, addr) = (
        words.next().expect("a pid"),
        words.next().expect("an address"),
    );
    for per_call in [1, 64] {
        let gbps = read_all(pid as libc::pid_t, addr, &args, per_call);
        let name = if per_call == 1 {
            "one-iovec"
        } else {
            "64-iovec"
        };
        println!("cma {name} GB/s {gbps:.3}");
    }
    drop(child.stdin.take());
    let _ = child.wait();
}

/// The child: a filled buffer of `bytes`, its address printed, kept until stdin closes.
fn serve(bytes: usize) {
    let buffer: Vec<u8> = (0..bytes).map(|i| (i * 7 + 3) as u8).collect();
    let mut out = std::io::stdout();
    writeln!(out, "{} {}", std::process::id(), buffer.as_ptr() as usize).expect("print");
    out.flush().expect("flush");
    let mut rest = String::new();
    let _ = std::io::stdin().read_line(&mut rest);
    drop(buffer);
}

/// GB/s of reading the child's buffer at `addr` in `pid`, block by block in random
/// orders, `per_call` blocks per `process_vm_readv`; each call's first byte is checked.
fn read_all(pid: libc::pid_t, addr: usize, args: &Args, per_call: usize) -> f64 {
    let blocks = args.bytes / args.block_bytes;
    let mut local = vec![0u8; per_call * args.block_bytes];
    let mut order: Vec<usize> = (0..blocks).collect();
    let mut seed = 0x5eed_u64;
    let start = Instant::now();
    for _ in 0..args.passes {
        shuffle(&mut order, &mut seed);
        for chunk in order.chunks(per_call) {
            let local_iov = libc::iovec {
                iov_base: local.as_mut_ptr().cast(),
                iov_len: chunk.len() * args.block_bytes,
            };
            let remote: Vec<libc::iovec> = chunk
                .iter()
                .map(|&b| libc::iovec {
                    iov_base: (addr + b * args.block_bytes) as *mut libc::c_void,
                    iov_len: args.block_bytes,
                })
                .collect();
            // SAFETY: `local_iov` describes `local`, which lives and is not otherwise
            // borrowed during the call; the remote iovecs name the child's memory, which
            // the kernel reads (checking its bounds), not ours.
            let got = unsafe {
                libc::process_vm_readv(pid, &local_iov, 1, remote.as_ptr(), remote.len() as _, 0)
            };
            assert_eq!(
                got as usize,
                local_iov.iov_len,
                "process_vm_readv: {}",
                std::io::Error::last_os_error()
            );
            let first = chunk[0] * args.block_bytes;
            assert_eq!(local[0], (first * 7 + 3) as u8, "the child's bytes");
        }
    }
    (args.passes * blocks * args.block_bytes) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Shuffles `order` with a xorshift generator seeded by `seed`.
fn shuffle(order: &mut [usize], seed: &mut u64) {
    for i in (1..order.len()).rev() {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        order.swap(i, (*seed % (i as u64 + 1)) as usize);
    }
}

//! What `Registration::read` and `Registration::write` cost: GB/s of one 64 MiB copy out of
//! and into a registered DRAM region (aligned, and starting 3 bytes in), beside a plain
//! memcpy of the same size between two `Vec`s measured in the same run (the baseline; the
//! ratio is copy/memcpy). Median of 9 rounds each; the variants alternate within a round.
//!
//! ```sh
//! cargo bench -p nixl-rs --bench registered_copy
//! ```

use std::time::Instant;

use nixl::{Agent, HostBuffer};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const LEN: usize = 64 << 20;
const ROUNDS: usize = 9;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// GB/s of `bytes` moved in `f`'s single call.
fn gbps(bytes: usize, f: impl FnOnce() -> Res<()>) -> Res<f64> {
    let start = Instant::now();
    f()?;
    Ok(bytes as f64 / start.elapsed().as_secs_f64() / 1e9)
}

fn main() -> Res<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    let agent = Agent::new("bench-registered-copy")?;
    agent.create_backend("UCX")?;
    let reg = agent.register_memory(HostBuffer::zeroed(LEN + 8)?, &[])?;
    let data = vec![0x5au8; LEN];
    let mut out = vec![0u8; LEN];
    let mut plain = vec![0u8; LEN];
    let names = ["memcpy", "read", "write", "read +3", "write +3"];
    let mut figures: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for _ in 0..ROUNDS {
        figures[0].push(gbps(LEN, || {
            plain.copy_from_slice(std::hint::black_box(&data));
            Ok(())
        })?);
        figures[1].push(gbps(LEN, || Ok(reg.read(0, 0, &mut out)?))?);
        figures[2].push(gbps(LEN, || Ok(reg.write(0, 0, &data)?))?);
        figures[3].push(gbps(LEN, || Ok(reg.read(0, 3, &mut out)?))?);
        figures[4].push(gbps(LEN, || Ok(reg.write(0, 3, &data)?))?);
        std::hint::black_box((&out, &plain));
    }
    let base = median(figures[0].clone());
    println!("Registration::read / write of 64 MiB (median of {ROUNDS} rounds)");
    println!("{:>10} {:>8} {:>10}", "copy", "GB/s", "/memcpy");
    for (name, runs) in names.iter().zip(figures) {
        let m = median(runs);
        println!("{name:>10} {m:>8.2} {:>9.2}x", m / base);
    }
    println!("reproduce: cargo bench -p nixl-rs --bench registered_copy");
    Ok(())
}

//! What validating remote metadata adds to `Agent::load_remote_metadata`.
//!
//! For metadata of an agent with 1 and with 1000 registrations (UCX, 4 KiB DRAM each) it
//! times, per call (median of 7 rounds):
//! - `validate`: `nixl::validate_metadata` alone;
//! - `first load`: `load_remote_metadata` + `invalidate_remote_metadata` (connects each time);
//! - `reload`: `load_remote_metadata` of the metadata already loaded (NIXL's cheapest path:
//!   no new connection, no new descriptors). Bytes identical to those the agent was last
//!   loaded from are not validated again; what that path adds instead is one comparison
//!   with the kept copy, timed as `compare`;
//!
//! and prints validate as a percentage of a first load, and compare as a percentage of a
//! reload (the target is at most 5 % for each).
//!
//! ```sh
//! cargo bench -p nixl-rs --bench metadata
//! ```

use std::time::Instant;

use nixl::{validate_metadata, Agent, Registration};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Median seconds per call of `f` over `rounds` rounds of `iters` calls.
fn per_call(rounds: usize, iters: usize, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        times.push(start.elapsed().as_secs_f64() / iters as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn main() -> Res<()> {
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    println!("metadata validation cost (median of 7 rounds, per call)");
    println!(
        "{:>6} {:>9} {:>12} {:>14} {:>12} {:>11} {:>10} {:>10}",
        "regs",
        "bytes",
        "validate us",
        "first load us",
        "reload us",
        "compare us",
        "% first",
        "% reload"
    );
    for count in [1usize, 1000] {
        let source = Agent::new(&format!("bench-md-src-{count}"))?;
        let ucx = source.create_backend("UCX")?;
        let _regs: Vec<Registration> = (0..count)
            .map(|i| source.register_memory(vec![i as u8; 4096], &[&ucx]))
            .collect::<nixl::Result<_>>()?;
        let md = source.local_metadata()?;
        let target = Agent::new(&format!("bench-md-dst-{count}"))?;
        let _ucx_t = target.create_backend("UCX")?;
        let iters = if count == 1 { 2000 } else { 20 };
        let validate = per_call(7, iters * 10, || Ok(validate_metadata(&md)?))?;
        let first = per_call(7, iters / 10, || {
            target.load_remote_metadata(&md)?;
            target.invalidate_remote_metadata(source.name())?;
            Ok(())
        })?;
        target.load_remote_metadata(&md)?;
        let reload = per_call(7, iters, || {
            target.load_remote_metadata(&md)?;
            Ok(())
        })?;
        let kept: Box<[u8]> = md.as_slice().into();
        let compare = per_call(7, iters * 10, || {
            std::hint::black_box(*kept == *std::hint::black_box(md.as_slice()));
            Ok(())
        })?;
        println!(
            "{count:>6} {:>9} {:>12.2} {:>14.1} {:>12.1} {:>11.2} {:>9.2}% {:>9.2}%",
            md.len(),
            validate * 1e6,
            first * 1e6,
            reload * 1e6,
            compare * 1e6,
            100.0 * validate / first,
            100.0 * compare / reload
        );
    }
    Ok(())
}

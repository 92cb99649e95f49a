//! The table of medians per token count, and the crossover.

use std::time::Duration;

/// One token count's samples, one per round each way.
pub struct Samples {
    /// Tokens loaded or recomputed.
    pub n: usize,
    /// Each round's load.
    pub loads: Vec<Duration>,
    /// Each round's recompute.
    pub recomputes: Vec<Duration>,
}

fn median(samples: &[Duration]) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Prints the medians of `samples` as a Markdown table (KV bytes from `kv_bytes_per_token`),
/// each row's samples as a `RESULT` JSON line, and the crossover: the smallest N from which
/// loading was faster at every larger N measured.
pub fn print(samples: &[Samples], kv_bytes_per_token: usize) {
    println!(
        "| N tokens | KV bytes | load ms | recompute ms | load / recompute | recompute must exceed (tokens/s) to beat the load |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut load_wins = Vec::new();
    for s in samples {
        let (load, recompute) = (median(&s.loads), median(&s.recomputes));
        load_wins.push(load < recompute);
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.4} | {:.0} |",
            s.n,
            s.n * kv_bytes_per_token,
            ms(load),
            ms(recompute),
            load.as_secs_f64() / recompute.as_secs_f64(),
            s.n as f64 / load.as_secs_f64()
        );
    }
    for s in samples {
        let list = |d: &[Duration]| {
            let each: Vec<String> = d.iter().map(|d| format!("{:.4}", ms(*d))).collect();
            each.join(",")
        };
        println!(
            "RESULT {{\"n\":{},\"load_ms\":[{}],\"recompute_ms\":[{}]}}",
            s.n,
            list(&s.loads),
            list(&s.recomputes)
        );
    }
    let from = load_wins
        .iter()
        .rposition(|wins| !wins)
        .map_or(0, |i| i + 1);
    match samples.get(from) {
        Some(s) if from == 0 => println!(
            "crossover: loading was faster at every N measured, from N = {} (the smallest): \
             recompute nothing remote on this machine and model",
            s.n
        ),
        Some(s) => println!(
            "crossover: loading is faster from N = {} tokens on (recompute below it: \
             kv_recompute_threshold = {} on this machine and model)",
            s.n, s.n
        ),
        None => println!(
            "crossover: recomputing was faster at every N measured, up to {}",
            samples.last().map_or(0, |s| s.n)
        ),
    }
}

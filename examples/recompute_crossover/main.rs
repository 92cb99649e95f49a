//! Where loading KV from a remote engine starts to beat recomputing it, the question behind
//! vLLM's `kv_recompute_threshold` (default 64 tokens: a request recomputes fewer remote
//! tokens than that itself). For each token count N it measures, alternating which goes
//! first, once per round:
//!
//! - **load**: N tokens' KV read from a prefill process (this program again, a child)
//!   through `nixl-connector` over UCX, on a connection handshaken before the first round:
//!   the decode's scheduler schedules the load, its worker posts the READ (the finish
//!   notification rides on it), and the scheduler steps until the load is reported done;
//! - **recompute**: the same N tokens computed by `kv-model` (f32, CPU) into the same
//!   blocks, after a prefix of `--prefix` tokens that both engines already hold.
//!
//! Each round checks that the loaded KV equals the recomputed KV bit for bit. It prints the
//! medians per N (load ms, recompute ms, their ratio, and the recompute rate that would beat
//! the load) and the crossover.
//!
//! ```sh
//! cargo run --release --example recompute_crossover -- --layers 4 --prefix 256 --rounds 5
//! ```

mod engine;
mod load;
mod prefill;
mod report;

use std::process::ExitCode;

use clap::Parser;
use nixl_rs::cli::parse_positive;

use engine::{Setup, BLOCK};
use prefill::PrefillProcess;
use report::Samples;

/// Load against recompute of N tokens' KV, per N.
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Args {
    /// Decoder layers of the seeded model (8 query heads over 4 KV heads of 16 elements,
    /// hidden 64: the demo's model mode, whose default is 4).
    #[arg(long, default_value_t = 4, value_parser = parse_positive::<usize>)]
    layers: usize,
    /// Tokens both engines hold before the N (a multiple of 16).
    #[arg(long, default_value_t = 256)]
    prefix: usize,
    /// The token counts N, ascending, each a multiple of 16.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "16,32,64,128,256,512,1024"
    )]
    tokens: Vec<usize>,
    /// Rounds; each measures every N once each way.
    #[arg(long, default_value_t = 5, value_parser = parse_positive::<usize>)]
    rounds: usize,
    /// Run as the prefill process (the benchmark starts it).
    #[arg(long, hide = true)]
    serve_prefill: bool,
}

impl Args {
    fn check(&self) -> Result<(), String> {
        let blocks = |n: &usize| *n > 0 && n % BLOCK == 0;
        if self.prefix % BLOCK != 0 || !self.tokens.iter().all(blocks) {
            return Err(format!(
                "--prefix and every --tokens must be multiples of {BLOCK} (tokens above 0)"
            ));
        }
        if self.tokens.windows(2).any(|w| w[0] > w[1]) {
            return Err("--tokens must be ascending".into());
        }
        Ok(())
    }
}

/// The benchmark: the decode's side, the prefill a child.
async fn bench(args: &Args, setup: &Setup) -> Result<Vec<Samples>, String> {
    let mut own_args: Vec<String> = std::env::args().skip(1).collect();
    own_args.push("--serve-prefill".into());
    let mut prefill = PrefillProcess::start(&own_args)?;
    let blocks = setup.prompt.len() / BLOCK;
    let num_blocks = setup.spec.num_blocks;
    // The decode's prompt scattered over its pool, the prefill's in consecutive blocks.
    let mut decode = setup.engine(
        "recompute-decode",
        (0..blocks).map(|i| (i * 7 + 3) % num_blocks).collect(),
    );
    decode.recompute(setup, &(0..args.prefix).collect::<Vec<_>>());
    prefill.ready()?;
    let first = args.prefix / BLOCK;
    // The handshake, a first load and a first recompute, before any timing.
    let params = prefill.finish("warm-up", BLOCK)?;
    let local = decode.table[first..first + 1].to_vec();
    load::load(&mut decode, "warm-up", &params, &local).await?;
    decode.recompute(
        setup,
        &(args.prefix..args.prefix + BLOCK).collect::<Vec<_>>(),
    );

    let mut samples: Vec<Samples> = args
        .tokens
        .iter()
        .map(|&n| Samples {
            n,
            loads: Vec::new(),
            recomputes: Vec::new(),
        })
        .collect();
    for round in 0..args.rounds {
        for s in &mut samples {
            let n = s.n;
            let tokens: Vec<usize> = (args.prefix..args.prefix + n).collect();
            let local = decode.table[first..first + n / BLOCK].to_vec();
            let (mut loaded, mut computed) = (Vec::new(), Vec::new());
            // Load first in even rounds, recompute first in odd ones.
            for load_now in [round % 2 == 0, round % 2 == 1] {
                decode.zero(setup, &tokens);
                if load_now {
                    let id = format!("round-{round}-n-{n}");
                    let params = prefill.finish(&id, n)?;
                    s.loads
                        .push(load::load(&mut decode, &id, &params, &local).await?);
                    loaded = decode.snapshot(setup, &tokens);
                } else {
                    s.recomputes.push(decode.recompute(setup, &tokens));
                    computed = decode.snapshot(setup, &tokens);
                }
            }
            let same = loaded.len() == computed.len()
                && loaded
                    .iter()
                    .zip(&computed)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                return Err(format!(
                    "round {round}, N {n}: the loaded KV differs from the recomputed KV"
                ));
            }
        }
        eprintln!("recompute_crossover: round {}/{}", round + 1, args.rounds);
    }
    prefill.close()?;
    Ok(samples)
}

/// Runs the prefill or the benchmark; prints the benchmark's setup, table and crossover.
async fn run(args: &Args) -> Result<(), String> {
    args.check()?;
    let max_n = *args.tokens.last().ok_or("no --tokens")?;
    let setup = Setup::new(args.layers, args.prefix, max_n);
    if args.serve_prefill {
        return prefill::serve(&setup).await;
    }
    let samples = bench(args, &setup).await?;
    let c = setup.model.config();
    println!(
        "model: kv-model (seeded, f32, CPU, one thread), {} parameters: {} layers, hidden {}, {} query heads over \
         {} KV heads of {}, MLP {}, vocabulary {}; blocks of {BLOCK} tokens, {} bytes of KV a \
         token; {} tokens of prefix cached on both engines",
        setup.parameters(),
        c.layers,
        c.hidden,
        c.q_heads,
        c.kv_heads,
        c.head_dim,
        c.ffn,
        c.vocab,
        setup.kv_bytes_per_token(),
        args.prefix
    );
    println!(
        "load: nixl-connector, native protocol, TP 1 -> 1, host memory, UCX between two \
         processes of this host, handshaken before; medians of {} rounds, load and recompute \
         alternating, every load checked bit for bit against the recompute",
        args.rounds
    );
    report::print(&samples, setup.kv_bytes_per_token());
    let tokens: Vec<String> = args.tokens.iter().map(usize::to_string).collect();
    println!(
        "reproduce: cargo run --release --example recompute_crossover -- --layers {} --prefix {} \
         --tokens {} --rounds {}",
        args.layers,
        args.prefix,
        tokens.join(","),
        args.rounds
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match runtime.block_on(run(&args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let side = if args.serve_prefill {
                "prefill"
            } else {
                "decode"
            };
            eprintln!("recompute_crossover ({side}): {err}");
            ExitCode::FAILURE
        }
    }
}

//! Fuzzes `Agent::load_remote_metadata` with mutants of real metadata. Each batch of
//! inputs runs in a child process, so a crash does not stop the run; a crashing input is
//! minimised and saved. Exits 1 if any input crashed (or hung) a child.
//!
//! ```sh
//! cargo run --release --example fuzz_metadata -- --seconds 60          # what .ci/run does
//! cargo run --release --example fuzz_metadata -- --seconds 3600 --seed 7   # a longer run
//! cargo run --release --example fuzz_metadata -- --seconds 60 --target python --out /tmp/py
//! ```
//! `--target python` feeds the same inputs to NIXL's official Python API, which does not
//! validate: it shows the harness finding the crashes the crate prevents.

mod child;
mod fields;
mod mutate;
mod rng;
mod runner;
mod seeds;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};

use runner::Outcome;

/// Structure-aware fuzzer of remote-metadata loading.
#[derive(Debug, Parser)]
struct Args {
    /// How long to fuzz.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// PRNG seed (default: from the clock); printed, so a run can be repeated.
    #[arg(long)]
    seed: Option<u64>,
    /// Inputs per child process.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Where crashing inputs (original and minimised) are saved.
    #[arg(long, default_value = "target/fuzz-metadata")]
    out: PathBuf,
    /// What loads the inputs: `rust` (Agent::load_remote_metadata, validated) or `python`
    /// (NIXL's official Python API, unvalidated; shows what the inputs do without the crate).
    #[arg(long, default_value = "rust")]
    target: String,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Internal: load every input of a batch file (run by the parent).
    Child { batch: String },
}

/// A child stuck longer than this on one batch counts as hung.
const BATCH_LIMIT: Duration = Duration::from_secs(60);
/// The run gives up after this many children failed to create a loading agent.
const MAX_HARNESS_ERRORS: usize = 20;
/// Minimising one crashing input stops after this long.
const MINIMISE_LIMIT: Duration = Duration::from_secs(30);
/// A single input (during minimisation) gets this long.
const SINGLE_LIMIT: Duration = Duration::from_secs(20);

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Cmd::Child { batch }) = &args.command {
        return match child::run(batch) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("fuzz child: {err}");
                ExitCode::from(2)
            }
        };
    }
    match fuzz(&args) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("fuzz: {err}");
            ExitCode::from(2)
        }
    }
}

/// Runs the fuzz loop; returns the number of crashing or hanging inputs.
fn fuzz(args: &Args) -> Result<usize, Box<dyn std::error::Error>> {
    let seed = args.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    runner::own_exe()?;
    match args.target.as_str() {
        "rust" => {}
        "python" => runner::use_python(python()?),
        other => return Err(format!("unknown --target {other:?}: rust or python").into()),
    }
    let crash_dir = args.out.join("crashes");
    std::fs::create_dir_all(&crash_dir)?;
    let seeds = seeds::generate()?;
    let corpus = &seeds.corpus;
    eprintln!(
        "fuzz: {} seeds (real metadata), seed {seed}, {} s, {} inputs per child",
        corpus.len(),
        args.seconds,
        args.batch
    );
    let mut rng = rng::Rng::new(seed);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.seconds);
    let (mut tried, mut bad, mut reached, mut harness_errors) = (0usize, 0usize, 0usize, 0usize);
    // The seeds themselves go first: real metadata must load without trouble.
    let mut pending: Vec<Vec<u8>> = corpus.clone();
    while Instant::now() < deadline {
        while pending.len() < args.batch {
            let base = rng.pick(corpus);
            pending.push(mutate::mutate(&mut rng, base, corpus));
        }
        let runner::Tally {
            outcome,
            started,
            reached: to_nixl,
        } = runner::run_batch(&pending, &args.out, BATCH_LIMIT)?;
        reached += to_nixl;
        match outcome {
            Outcome::Completed => {
                tried += pending.len();
                pending.clear();
            }
            Outcome::HarnessError { index } => {
                // Inputs before `index` were tried; `index` itself was not loaded: retry it.
                tried += index;
                harness_errors += 1;
                eprintln!("fuzz: a child could not create its loading agent (see child-stderr.log); retrying");
                if harness_errors > MAX_HARNESS_ERRORS {
                    return Err("children keep failing to create a loading agent".into());
                }
                pending.drain(..index);
            }
            Outcome::Crashed { index, .. } | Outcome::Hung { index } => {
                tried += started;
                bad += 1;
                let input = pending[index].clone();
                save(&crash_dir, bad, &input, outcome)?;
                pending.drain(..=index);
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "fuzz: {tried} inputs in {secs:.0} s ({:.0}/s), {reached} reached NIXL, {bad} crashed or hung a child, {harness_errors} retried after a child could not create its agent{}",
        tried as f64 / secs,
        if bad > 0 { format!("; inputs in {}", crash_dir.display()) } else { String::new() }
    );
    Ok(bad)
}

/// The venv interpreter from scripts/python-venv.sh.
fn python() -> Result<PathBuf, Box<dyn std::error::Error>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/python-venv.sh");
    let out = std::process::Command::new(script)
        .stderr(std::process::Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err("scripts/python-venv.sh failed".into());
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()).join("bin/python"))
}

/// Saves a crashing input and its minimised form.
fn save(dir: &std::path::Path, n: usize, input: &[u8], outcome: Outcome) -> std::io::Result<()> {
    eprintln!(
        "fuzz: input of {} bytes: {outcome:?}; minimising",
        input.len()
    );
    std::fs::write(dir.join(format!("crash-{n}.bin")), input)?;
    let small = if matches!(outcome, Outcome::Crashed { .. }) {
        runner::minimise(
            input,
            dir,
            SINGLE_LIMIT,
            300,
            Instant::now() + MINIMISE_LIMIT,
        )
    } else {
        input.to_vec()
    };
    std::fs::write(dir.join(format!("crash-{n}-min.bin")), &small)?;
    eprintln!(
        "fuzz: saved crash-{n}.bin and crash-{n}-min.bin ({} bytes)",
        small.len()
    );
    Ok(())
}

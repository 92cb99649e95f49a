//! The decode engine of the demo's model mode: waits for the prefill's handoff file
//! (`model_prefill`), loads the prompt's KV through the connector, generates the tokens,
//! then serves the same prompt alone (one process) and checks that the tokens are equal and
//! every logit lies within 1e-4. Prints the prompt, both runs' tokens and the time to first
//! token, split into prefill compute, KV transfer and the first decode step; exits 1 when
//! the runs differ.
//!
//! ```sh
//! cargo run --release --example model_decode -- --handoff /tmp/handoff.json
//! ```

mod model_args;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use kv_model::{argmax, Generation};
use nixl_rs::cli::parse_positive;
use nixl_rs::model_serving::handoff::Handoff;
use nixl_rs::model_serving::scenario::{logits_close, model, Scenario, TOLERANCE};
use nixl_rs::model_serving::serving::DecodeEngine;
use nixl_rs::stats::gb_per_s;

/// Model-mode decode: loads the prefill's KV, generates, and compares with one process.
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Args {
    #[command(flatten)]
    model: model_args::ModelArgs,
    /// The handoff file the prefill writes (JSON); waited for.
    #[arg(long)]
    handoff: PathBuf,
    /// Seconds to wait for the handoff, and then for the load.
    #[arg(long, default_value_t = 120, value_parser = parse_positive::<u64>)]
    timeout_s: u64,
}

/// One run's tokens (the first token, then the generated ones), their logits (from the
/// first generated token on) and its time to first token in parts, in seconds.
struct Run {
    generation: Generation,
    compute_s: f64,
    transfer_s: f64,
    first_step_s: f64,
}

impl Run {
    fn ttft_s(&self) -> f64 {
        self.compute_s + self.transfer_s + self.first_step_s
    }
}

/// Generates the scenario's steps on `engine` from `first` at the prompt's end, the first
/// step timed apart; the tokens start with `first`.
fn generate(engine: &DecodeEngine, scenario: &Scenario, first: usize) -> (Generation, f64) {
    let start = Instant::now();
    let mut generation = engine.generate(first, scenario.prompt_len, 1);
    let first_step_s = start.elapsed().as_secs_f64();
    let rest = engine.generate(
        generation.tokens[0],
        scenario.prompt_len + 1,
        scenario.steps - 1,
    );
    generation.tokens.insert(0, first);
    generation.tokens.extend(rest.tokens);
    generation.logits.extend(rest.logits);
    (generation, first_step_s)
}

/// The run through the prefill of `handoff_path`.
async fn prefill_decode(
    scenario: &Scenario,
    handoff_path: &Path,
    wait: Duration,
) -> Result<(Run, usize), String> {
    let mut engine = DecodeEngine::new(scenario, "model-decode");
    let start = Instant::now();
    while !handoff_path.exists() {
        if start.elapsed() > wait {
            return Err(format!(
                "no handoff at {} within {wait:?}",
                handoff_path.display()
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let handoff = Handoff::read(handoff_path).map_err(|err| format!("read the handoff: {err}"))?;
    let start = Instant::now();
    engine.load(&handoff.params, wait).await?;
    let transfer_s = start.elapsed().as_secs_f64();
    let (generation, first_step_s) = generate(&engine, scenario, handoff.first_token);
    let run = Run {
        generation,
        compute_s: handoff.prefill_compute_s,
        transfer_s,
        first_step_s,
    };
    Ok((run, engine.loaded_bytes()))
}

/// The same prompt served by one process alone: a decode engine computing it itself.
fn one_process(scenario: &Scenario) -> Run {
    let engine = DecodeEngine::new(scenario, "model-one-process");
    let start = Instant::now();
    let logits = engine.compute_prompt(scenario.prompt_len);
    let compute_s = start.elapsed().as_secs_f64();
    let (generation, first_step_s) = generate(&engine, scenario, argmax(&logits));
    Run {
        generation,
        compute_s,
        transfer_s: 0.0,
        first_step_s,
    }
}

/// Where the two runs differ, if they do.
fn compare(pd: &Generation, one: &Generation) -> Result<(), String> {
    if pd.tokens != one.tokens {
        return Err("the tokens differ".into());
    }
    for (step, (got, want)) in pd.logits.iter().zip(&one.logits).enumerate() {
        logits_close(got, want).map_err(|err| format!("decode step {step}: {err}"))?;
    }
    Ok(())
}

fn ms(seconds: f64) -> String {
    format!("{:.1} ms", seconds * 1e3)
}

fn main() -> ExitCode {
    let args = Args::parse();
    model_args::block_on(run(&args))
}

async fn run(args: &Args) -> ExitCode {
    let scenario = args.model.scenario();
    let wait = Duration::from_secs(args.timeout_s);
    let (pd, kv_bytes) = match prefill_decode(&scenario, &args.handoff, wait).await {
        Ok(done) => done,
        Err(err) => {
            eprintln!("model_decode: {err}");
            return ExitCode::FAILURE;
        }
    };
    let one = one_process(&scenario);

    let config = *model(&scenario).config();
    println!(
        "model: {} layers, {} query heads over {} KV heads of {}, hidden {}, vocabulary {}; \
         TP 1 -> 1, {} protocol",
        config.layers,
        config.q_heads,
        config.kv_heads,
        config.head_dim,
        config.hidden,
        config.vocab,
        if scenario.vllm { "vllm" } else { "native" }
    );
    println!(
        "prompt ({} tokens): {:?}",
        scenario.prompt_len,
        scenario.prompt(config.vocab)
    );
    println!("prefill/decode tokens: {:?}", pd.generation.tokens);
    println!("one process tokens:    {:?}", one.generation.tokens);
    println!(
        "ttft prefill/decode: {} = prefill compute {} + KV transfer {} + first decode step {}",
        ms(pd.ttft_s()),
        ms(pd.compute_s),
        ms(pd.transfer_s),
        ms(pd.first_step_s)
    );
    println!(
        "ttft one process:    {} = prefill compute {} + first decode step {}",
        ms(one.ttft_s()),
        ms(one.compute_s),
        ms(one.first_step_s)
    );
    println!(
        "KV transfer: {kv_bytes} bytes in {} ({:.3} GB/s, the connector's handshake included)",
        ms(pd.transfer_s),
        gb_per_s(kv_bytes as u64, Duration::from_secs_f64(pd.transfer_s))
    );
    println!(
        "RESULT {{\"pd_ttft_s\":{},\"prefill_compute_s\":{},\"transfer_s\":{},\"first_step_s\":{},\
         \"one_ttft_s\":{},\"one_compute_s\":{},\"one_first_step_s\":{},\"kv_bytes\":{kv_bytes}}}",
        pd.ttft_s(),
        pd.compute_s,
        pd.transfer_s,
        pd.first_step_s,
        one.ttft_s(),
        one.compute_s,
        one.first_step_s
    );
    match compare(&pd.generation, &one.generation) {
        Ok(()) => {
            println!(
                "model_decode: PASSED ({} tokens equal, every logit within {TOLERANCE})",
                pd.generation.tokens.len()
            );
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("model_decode: FAILED: {err}");
            ExitCode::FAILURE
        }
    }
}

//! The demo's model mode end to end over real NIXL: `model_prefill` computes a prompt's KV
//! with the seeded model, `model_decode` (another process) loads it through the connector
//! and generates; their tokens equal one process's, in both protocols, and the output names
//! the prompt, both runs' tokens and the time to first token in parts.

mod demo_support;

use std::process::Command;

use demo_support::{example, Proc};

/// A model small enough for debug builds: 2 layers, a prompt of 3 blocks and a bit.
const MODEL_ARGS: [&str; 6] = ["--layers", "2", "--prompt-len", "40", "--steps", "8"];

#[test]
fn model_mode_tokens_equal_one_process() {
    for protocol in ["native", "vllm"] {
        let dir = tempfile::tempdir().unwrap();
        let handoff = dir.path().join("handoff.json");
        let handoff = handoff.to_str().unwrap();
        let mut args = vec!["--handoff", handoff, "--protocol", protocol];
        args.extend(MODEL_ARGS);
        let mut prefill = Proc::example("model_prefill", &args);
        let decode = Command::new(example("model_decode"))
            .args(&args)
            .output()
            .expect("run model_decode");
        let text = String::from_utf8_lossy(&decode.stdout).into_owned()
            + &String::from_utf8_lossy(&decode.stderr);
        assert!(decode.status.success(), "{protocol}: {text}");
        for expected in [
            "prompt (40 tokens): [",
            "prefill/decode tokens: [",
            "one process tokens:    [",
            "= prefill compute ",
            " + KV transfer ",
            " + first decode step ",
            "model_decode: PASSED (9 tokens equal",
        ] {
            assert!(
                text.contains(expected),
                "{protocol}: no {expected:?} in {text}"
            );
        }
        let tokens = |tag: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(tag))
                .map(str::trim)
                .map(str::to_owned)
        };
        assert_eq!(
            tokens("prefill/decode tokens:"),
            tokens("one process tokens:"),
            "{protocol}: {text}"
        );
        let status = prefill.finish();
        assert!(status.success(), "{protocol}: {}", prefill.output());
        assert!(
            prefill.output().contains("released"),
            "{}",
            prefill.output()
        );
    }
}

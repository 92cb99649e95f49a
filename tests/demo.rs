//! The prefill/decode demo as real processes on loopback: a full run with every byte
//! checked (in pull and push mode), conversations of three turns read back, concurrent
//! decode workers, detected corruption, refused geometry and configuration, and
//! scripts/demo.sh itself.

mod demo_support;

use demo_support::{decode, run_decode, run_script, Prefill, Proc, CACHE_ARGS};

const WORK: [&str; 6] = [
    "--requests",
    "20",
    "--blocks-per-request",
    "4",
    "--in-flight",
    "3",
];

#[test]
fn loopback_run_checks_every_byte() {
    let prefill = Prefill::start(&["--sessions", "1"]);
    let (status, out) = run_decode(prefill.addr, &WORK);
    assert!(status.success(), "decode failed:\n{out}");
    assert!(out.contains("requests:  20/20"), "{out}");
    // 20 requests x 4 blocks x 4 layers of 4 KiB.
    assert!(out.contains("blocks:    320 "), "{out}");
    assert!(out.contains("bytes:     1310720 "), "{out}");
    assert!(out.contains("GB/s"), "{out}");
    assert!(out.contains("p50") && out.contains("p99"), "{out}");
    assert!(
        out.contains("errors:    none, every byte verified"),
        "{out}"
    );
    let pout = prefill.finish_with("1 sessions (0 ended early), 20 requests served");
    assert!(pout.contains("done: 20/20 requests"), "{pout}");
}

/// The connectors speak vLLM's protocol (a ZMQ ROUTER per engine, the compatibility hash,
/// vLLM's JSON params, `request:consumers` notifications) at the demo's default shape: 32
/// layers of 512 blocks of 16 KiB, requests of 16 blocks, 4 in flight.
#[test]
fn vllm_protocol_run_at_the_default_shape_checks_every_byte() {
    let vllm = ["--protocol", "vllm"];
    let mut args = vec!["--listen", "127.0.0.1:0", "--sessions", "1"];
    args.extend(vllm);
    let mut prefill = Proc::example("prefill", &args);
    let line = prefill.expect_line("listening", |l| l.contains(" listening on "));
    assert!(line.contains("connector protocol vllm"), "{line}");
    let addr = line
        .split(" listening on ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("prefill's address")
        .to_string();
    let mut args = vec!["--prefill", &addr, "--requests", "12"];
    args.extend(vllm);
    let mut decode = Proc::example("decode", &args);
    let status = decode.finish();
    let out = decode.output();
    assert!(status.success(), "decode failed:\n{out}");
    assert!(out.contains("connector protocol vllm"), "{out}");
    assert!(out.contains("requests:  12/12"), "{out}");
    // 12 requests x 16 blocks x 32 layers of 16 KiB.
    assert!(out.contains("blocks:    6144 "), "{out}");
    assert!(out.contains("bytes:     100663296 "), "{out}");
    assert!(
        out.contains("errors:    none, every byte verified"),
        "{out}"
    );
    let status = prefill.finish();
    let pout = prefill.output();
    assert!(status.success(), "prefill failed:\n{pout}");
    assert!(
        pout.contains(
            "1 sessions (0 ended early), 12 requests served (0 freed when their lease ended)"
        ),
        "{pout}"
    );

    // A decode speaking the native protocol is refused by name.
    let mut prefill = Prefill::start(&["--sessions", "1", "--protocol", "vllm"]);
    let (status, out) = run_decode(prefill.addr, &WORK);
    assert!(!status.success(), "{out}");
    assert!(out.contains("give both the same --protocol"), "{out}");
    prefill.proc.kill();
}

#[test]
fn prefix_hits_and_aborts_in_a_verified_run() {
    let prefill = Prefill::start(&["--sessions", "2"]);
    let mut args = WORK.to_vec();
    args.extend(["--prefix-hit-blocks", "1", "--abort-every", "3"]);
    let (status, out) = run_decode(prefill.addr, &args);
    assert!(status.success(), "decode failed:\n{out}");
    assert!(out.contains("requests:  20/20"), "{out}");
    // Every 3rd request aborted, alternately before its load (the 3rd, 9th, 15th) and
    // during it (6th, 12th, 18th); the 14 others verified, 3 of their 4 blocks pulled (x 4
    // layers), the first computed from decode's own prefix cache.
    assert!(
        out.contains("aborted:   3 before their load, 3 during it"),
        "{out}"
    );
    assert!(out.contains("prefix:    17 request blocks"), "{out}");
    assert!(out.contains("blocks:    168 "), "{out}");
    assert!(
        out.contains("errors:    none, every byte verified"),
        "{out}"
    );

    // A full prefix hit reads nothing; prefill frees on the notification all the same.
    args.truncate(WORK.len());
    args.extend(["--prefix-hit-blocks", "4"]);
    let (status, out) = run_decode(prefill.addr, &args);
    assert!(status.success(), "decode failed:\n{out}");
    assert!(out.contains("blocks:    0 "), "{out}");
    assert!(out.contains("prefix:    80 request blocks"), "{out}");
    assert!(out.contains("every byte verified"), "{out}");

    // Aborted requests were freed on decode's notification, not by their lease.
    prefill.finish_with(
        "2 sessions (0 ended early), 40 requests served (0 freed when their lease ended)",
    );
}

/// Push mode (`--transfer-mode push` on both sides: the decode registers its blocks, the
/// prefill WRITEs into them): every byte verified, prefix hits and aborts as in pull mode,
/// and every request freed by its WRITE's end or the decode's cancel, none by its lease.
#[test]
fn push_mode_with_prefix_hits_and_aborts_checks_every_byte() {
    let push = ["--transfer-mode", "push"];
    let prefill = Prefill::start(&["--sessions", "2", "--transfer-mode", "push"]);
    let mut args = WORK.to_vec();
    args.extend(push);
    args.extend(["--prefix-hit-blocks", "1", "--abort-every", "3"]);
    let (status, out) = run_decode(prefill.addr, &args);
    assert!(status.success(), "decode failed:\n{out}");
    assert!(out.contains("requests:  20/20"), "{out}");
    assert!(
        out.contains("aborted:   3 before their load, 3 during it"),
        "{out}"
    );
    assert!(out.contains("blocks:    168 "), "{out}");
    assert!(
        out.contains("errors:    none, every byte verified"),
        "{out}"
    );
    // A full prefix hit writes nothing; the decode's cancel frees the prefill's blocks.
    args.truncate(WORK.len() + push.len());
    args.extend(["--prefix-hit-blocks", "4"]);
    let (status, out) = run_decode(prefill.addr, &args);
    assert!(status.success(), "decode failed:\n{out}");
    assert!(out.contains("blocks:    0 "), "{out}");
    assert!(out.contains("every byte verified"), "{out}");
    prefill.finish_with(
        "2 sessions (0 ended early), 40 requests served (0 freed when their lease ended)",
    );
}

/// Push mode in vLLM's protocol (`--protocol vllm --transfer-mode push` on both sides: the
/// decode's `PUSH_REG:` registrations, the prefill's WRITEs with vLLM's notifications):
/// every byte verified, every request freed by its WRITE's end, none by its lease.
#[test]
fn vllm_push_mode_checks_every_byte() {
    let flags = ["--protocol", "vllm", "--transfer-mode", "push"];
    let mut args = vec!["--sessions", "1"];
    args.extend(flags);
    let prefill = Prefill::start(&args);
    let mut args = WORK.to_vec();
    args.extend(flags);
    let (status, out) = run_decode(prefill.addr, &args);
    assert!(status.success(), "decode failed:\n{out}");
    assert!(out.contains("requests:  20/20"), "{out}");
    assert!(
        out.contains("errors:    none, every byte verified"),
        "{out}"
    );
    prefill.finish_with(
        "1 sessions (0 ended early), 20 requests served (0 freed when their lease ended)",
    );
}

#[test]
fn concurrent_decodes_share_one_prefill() {
    let prefill = Prefill::start(&["--sessions", "2"]);
    let mut a = decode(prefill.addr, &WORK);
    let mut b = decode(prefill.addr, &WORK);
    for d in [&mut a, &mut b] {
        let status = d.finish();
        assert!(status.success(), "decode failed:\n{}", d.output());
        assert!(d.output().contains("every byte verified"), "{}", d.output());
    }
    prefill.finish_with("2 sessions (0 ended early), 40 requests served");
}

#[test]
fn corrupted_block_is_reported() {
    let mut prefill = Prefill::start(&["--sessions", "1", "--corrupt-request", "3"]);
    let (status, out) = run_decode(prefill.addr, &WORK);
    assert!(!status.success(), "decode must fail on a mismatch:\n{out}");
    assert!(out.contains("errors:    1 mismatching blocks"), "{out}");
    assert!(out.contains("request 3 layer 0"), "{out}");
    assert!(out.contains("first wrong byte at offset 0"), "{out}");
    // Prefill served the session in full: the corruption is only in the data.
    assert!(prefill.proc.finish().success(), "{}", prefill.proc.output());
}

#[test]
fn mismatched_geometry_is_refused_and_prefill_keeps_serving() {
    let mut prefill = Prefill::start(&["--sessions", "1"]);
    let mut args = WORK.to_vec();
    args.extend(["--block-size", "8KiB"]);
    let (status, out) = run_decode(prefill.addr, &args);
    assert!(!status.success(), "{out}");
    assert!(out.contains("rejected by the peer"), "{out}");
    assert!(out.contains("cache geometry differs"), "{out}");
    let (status, out) = run_decode(prefill.addr, &WORK);
    assert!(status.success(), "{out}");
    assert!(prefill.proc.finish().success(), "{}", prefill.proc.output());
    assert!(prefill.proc.output().contains("1 connections rejected"));
}

#[test]
fn decode_cache_too_small_for_in_flight_is_a_config_error() {
    let prefill = Prefill::start(&[]);
    let (status, out) = run_decode(
        prefill.addr,
        &["--blocks-per-request", "32", "--in-flight", "4"],
    );
    assert!(!status.success(), "{out}");
    assert!(
        out.contains("need 128 blocks; the decode cache has 64"),
        "{out}"
    );
}

#[test]
fn configured_backends_are_checked() {
    let config = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu","kv_connector_extra_config":{"backends":["NO_SUCH_PLUGIN"]}}"#;
    let mut args = vec!["--listen", "127.0.0.1:0", "--kv-transfer-config", config];
    args.extend(CACHE_ARGS);
    let mut prefill = Proc::example("prefill", &args);
    let status = prefill.finish();
    let out = prefill.output();
    assert!(!status.success(), "{out}");
    assert!(out.contains("\"NO_SUCH_PLUGIN\" is not available"), "{out}");
    assert!(
        out.contains("UCX"),
        "the error lists the available plugins: {out}"
    );

    let consumer = r#"{"kv_role":"kv_consumer","kv_buffer_device":"cpu"}"#;
    let mut args = vec!["--listen", "127.0.0.1:0", "--kv-transfer-config", consumer];
    args.extend(CACHE_ARGS);
    let mut prefill = Proc::example("prefill", &args);
    assert!(!prefill.finish().success());
    assert!(prefill.output().contains("this worker is a Producer"));
}

#[test]
fn platform_flag_goes_through_the_registry() {
    let mut args = vec!["--listen", "127.0.0.1:0", "--platform", "no-such-device"];
    args.extend(CACHE_ARGS);
    let mut prefill = Proc::example("prefill", &args);
    assert!(!prefill.finish().success());
    assert!(
        prefill.output().contains("no-such-device"),
        "{}",
        prefill.output()
    );

    // TPU keeps its KV cache in host memory as far as NIXL is concerned: allowed.
    let prefill = Prefill::start(&["--platform", "tpu", "--sessions", "1"]);
    assert!(prefill.proc.output().contains("platform tpu"));
    let (status, out) = run_decode(prefill.addr, &WORK);
    assert!(status.success(), "{out}");
}

#[test]
fn demo_script_passes() {
    let (status, text) = run_script(
        "demo.sh",
        &["--", "--requests", "12", "--blocks-per-request", "4"],
    );
    assert!(status.success(), "{text}");
    assert!(text.contains("requests:  12/12"), "{text}");
    assert!(text.contains("authenticated side channel"), "{text}");
    assert!(text.contains("demo: PASSED"), "{text}");

    let (status, text) = run_script("demo.sh", &["--protocol", "vllm", "--", "--requests", "12"]);
    assert!(status.success(), "{text}");
    assert!(text.contains("connector protocol vllm"), "{text}");
    assert!(text.contains("demo: PASSED"), "{text}");
}

/// The number just before `unit` in the first line of `text` that contains `marker` and
/// `unit`, e.g. `read back 30 tokens`.
fn count_before(text: &str, marker: &str, unit: &str) -> u64 {
    let line = text
        .lines()
        .find(|l| l.contains(marker) && l.contains(unit))
        .unwrap_or_else(|| panic!("no line with {marker:?} and {unit:?}:\n{text}"));
    let before = line.split(unit).next().unwrap_or("");
    let number = before.split_whitespace().last().unwrap_or("");
    number
        .parse()
        .unwrap_or_else(|_| panic!("no count before {unit:?} in {line:?}"))
}

/// `scripts/demo.sh --turns 3`, both protocols, at a small shape: 6 conversations of 3 turns
/// of 4 new blocks each (blocks stand for tokens), answers of 1 to 4 blocks. Decode loads
/// only each turn's new blocks (its prefix cache holds the rest, checked again), prefill
/// reads the answers back but those under its threshold of 2 tokens, and both sides check
/// every byte.
#[test]
fn demo_script_runs_conversations_of_three_turns() {
    for protocol in ["native", "vllm"] {
        let (status, text) = run_script(
            "demo.sh",
            &[
                "--protocol",
                protocol,
                "--turns",
                "3",
                "--",
                "--requests",
                "6",
                "--blocks-per-request",
                "4",
                "--in-flight",
                "3",
            ],
        );
        assert!(status.success(), "{protocol}: {text}");
        assert!(
            text.contains(&format!("connector protocol {protocol}")),
            "{text}"
        );
        assert!(text.contains("requests:  18/18"), "{text}");
        assert!(
            text.contains("errors:    none, every byte verified"),
            "{text}"
        );
        assert!(text.contains("every read-back byte verified"), "{text}");
        // Decode loads 3 x 4 new blocks per conversation (x 4 layers).
        assert!(
            text.contains("6 conversations of 3 turns: 72 tokens (blocks) loaded from prefill"),
            "{text}"
        );
        assert!(text.contains("blocks:    288 "), "{text}");
        let answered = count_before(&text, "turns answered with", " tokens of decode's own");
        let read = count_before(&text, "read back", " tokens from the decode");
        let recomputed = count_before(&text, "read back", " (below the recompute threshold");
        assert!(read > 0, "{text}");
        // Conversations 0-5 answer turns 1 and 2 with 1 + (c + turn) % 4 blocks: 32, of
        // which 2 answers of one block are under the threshold.
        assert_eq!((answered, read + recomputed), (32, 32), "{text}");
        assert!(recomputed >= 2, "{text}");
        assert!(
            text.contains("from prefill's own prefix cache, 48 new"),
            "{text}"
        );
        assert!(text.contains("demo: PASSED"), "{text}");
    }
}

/// A wrong byte in an answer decode keeps is caught on both sides: by prefill, which reads
/// it back, and by decode, whose prefix cache holds it for the next turn.
#[test]
fn a_corrupted_answer_is_caught_where_it_is_read_back() {
    let mut prefill = Prefill::start(&["--sessions", "1", "--recompute-threshold", "2"]);
    let args = [
        "--requests",
        "2",
        "--blocks-per-request",
        "4",
        "--turns",
        "2",
        "--corrupt-answer",
        "0",
    ];
    let (status, out) = run_decode(prefill.addr, &args);
    assert!(!status.success(), "decode must fail on a mismatch:\n{out}");
    assert!(
        out.contains("request 0 layer 0 decode's answer block 4: first wrong byte at offset 0"),
        "{out}"
    );
    let status = prefill.proc.finish();
    let pout = prefill.proc.output();
    assert!(
        !status.success(),
        "prefill must fail on a mismatch:\n{pout}"
    );
    assert!(pout.contains("1 read-back blocks mismatch"), "{pout}");
    assert!(
        pout.contains("request 0 layer 0 decode's answer block 4: first wrong byte at offset 0"),
        "{pout}"
    );
}

/// With `--secret-file` the connectors' side channels authenticate each other: a decode with
/// the prefill's secret runs, one without it or with another is refused in its handshake,
/// naming why (their sessions end early), and the prefill goes on serving.
#[test]
fn a_decode_without_the_prefills_secret_is_refused() {
    let dir = std::env::temp_dir().join(format!("nixl-demo-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ours, other) = (dir.join("secret"), dir.join("other"));
    std::fs::write(&ours, "0123456789abcdef0123456789abcdef\n").unwrap();
    std::fs::write(&other, "fedcba9876543210fedcba9876543210\n").unwrap();
    // Secret files are their owner's alone (the connector refuses others).
    for file in [&ours, &other] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let secret = ["--secret-file", ours.to_str().unwrap()];
    let mut args = vec!["--sessions", "3"];
    args.extend(secret);
    let mut prefill = Prefill::start(&args);
    assert!(prefill.proc.output().contains("authenticated side channel"));
    for refused in [vec![], vec!["--secret-file", other.to_str().unwrap()]] {
        let mut args = WORK.to_vec();
        args.extend(&refused);
        let (status, out) = run_decode(prefill.addr, &args);
        assert!(!status.success(), "{out}");
        assert!(out.contains("not authenticated"), "{out}");
    }
    let mut args = WORK.to_vec();
    args.extend(secret);
    let (status, out) = run_decode(prefill.addr, &args);
    assert!(status.success(), "{out}");
    prefill.proc.finish();
    let pout = prefill.proc.output();
    assert!(
        pout.contains("3 sessions (2 ended early), 20 requests served"),
        "{pout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

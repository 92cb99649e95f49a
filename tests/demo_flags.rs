//! The demo binaries' command line and logs: zero counts and timeouts refused at parsing,
//! naming the flag; colour in logs only on a terminal, and never with `NO_COLOR`; engines of
//! several ranks (`--tp`, `--pp`, one connector worker per rank in each process) in both
//! protocols, every byte of every rank verified, through the binaries and scripts/demo.sh,
//! and the parallel settings the demo does not run refused with the reason.

mod demo_support;

use std::fs::File;
use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use demo_support::{
    decode_env, example, free_port, run_decode, run_script, Prefill, CACHE_ARGS, WAIT,
};

const ESC: &str = "\x1b[";

#[test]
fn zero_counts_and_timeouts_are_refused_naming_the_flag() {
    let common = ["--layers", "--blocks", "--block-size", "--max-frame"];
    let decode_flags = [
        "--requests",
        "--blocks-per-request",
        "--in-flight",
        "--connect-timeout-s",
        "--xfer-timeout-s",
        "--progress-interval-ms",
        "--abort-every",
        "--turns",
        "--answer-blocks",
    ];
    let prefill_flags = [
        "--sessions",
        "--handshake-timeout-s",
        "--max-pending-handshakes",
        "--max-pending-handshake-bytes",
    ];
    let cases = common
        .iter()
        .chain(&decode_flags)
        .map(|flag| ("decode", flag))
        .chain(
            common
                .iter()
                .chain(&prefill_flags)
                .map(|flag| ("prefill", flag)),
        );
    for (binary, flag) in cases {
        let start = Instant::now();
        let out = Command::new(example(binary))
            .args([flag, "0"])
            .output()
            .unwrap_or_else(|err| panic!("run {binary}: {err}"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{binary} {flag} 0: {stderr}");
        assert!(
            stderr.contains(&format!("'{flag} <")),
            "{binary} {flag} 0 does not name the flag: {stderr}"
        );
        assert!(
            stderr.contains("must be at least 1") || stderr.contains("must be non-zero"),
            "{binary} {flag} 0: {stderr}"
        );
        // Refused at parsing, before any NIXL agent exists.
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{binary} {flag} 0"
        );
    }
}

#[test]
fn the_largest_timeouts_mean_no_limit_instead_of_a_panic() {
    // u64::MAX seconds overflow any deadline the clock can hold (#30 item 3).
    let mut prefill = Prefill::start(&["--sessions", "1"]);
    let max = u64::MAX.to_string();
    let (status, out) = run_decode(
        prefill.addr,
        &[
            "--requests",
            "2",
            "--connect-timeout-s",
            &max,
            "--xfer-timeout-s",
            &max,
            "--progress-interval-ms",
            &max,
        ],
    );
    assert!(status.success(), "decode failed:\n{out}");
    assert!(out.contains("every byte verified"), "{out}");
    assert!(prefill.proc.finish().success(), "{}", prefill.proc.output());
}

/// The log lines of `out` that contain `text`.
fn lines_with<'a>(out: &'a str, text: &str) -> Vec<&'a str> {
    out.lines().filter(|l| l.contains(text)).collect()
}

#[test]
fn logs_to_a_pipe_carry_no_colour() {
    let mut prefill = Prefill::start_env(&["--sessions", "1"], &[("RUST_LOG", "debug")]);
    let args = ["--requests", "4", "--blocks-per-request", "4"];
    let mut decode = decode_env(prefill.addr, &args, &[("RUST_LOG", "info")]);
    assert!(decode.finish().success(), "{}", decode.output());
    assert!(prefill.proc.finish().success(), "{}", prefill.proc.output());
    for (name, out, level) in [
        ("decode", decode.output(), "INFO"),
        ("prefill", prefill.proc.output(), "DEBUG"),
    ] {
        assert!(
            !lines_with(&out, level).is_empty(),
            "{name} logged nothing to check:\n{out}"
        );
        assert!(!out.contains(ESC), "{name} wrote colour to a pipe:\n{out}");
    }
}

/// Runs decode against a port nobody listens on, with its stderr on a new terminal, and
/// returns its tracing lines about the retries.
fn retry_lines_on_a_terminal(no_color: Option<&str>) -> Vec<String> {
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes the two descriptors it opens; the other arguments may be null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened and are owned by nobody else.
    let (mut master, slave) = unsafe { (File::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let port = free_port().to_string();
    let mut cmd = Command::new(example("decode"));
    cmd.args(["--prefill", &format!("127.0.0.1:{port}")])
        .args(["--connect-timeout-s", "1"])
        .args(CACHE_ARGS)
        .env("RUST_LOG", "nixl_rs=debug")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(slave));
    if let Some(value) = no_color {
        cmd.env("NO_COLOR", value);
    }
    let mut child = cmd.spawn().expect("start decode");
    // Close this process's copy of the terminal's far end, so that reading ends with decode.
    drop(cmd);
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        // The terminal reports EIO once decode has exited.
        while let Ok(n @ 1..) = master.read(&mut buf) {
            out.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&out).into_owned()
    });
    let start = Instant::now();
    while child.try_wait().expect("poll decode").is_none() {
        assert!(start.elapsed() < WAIT, "decode did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = reader.join().expect("the terminal reader");
    let lines: Vec<String> = lines_with(&out, "not reachable yet")
        .into_iter()
        .map(String::from)
        .collect();
    assert!(!lines.is_empty(), "no retry lines:\n{out}");
    lines
}

#[test]
fn colour_on_a_terminal_unless_no_color() {
    let coloured = |lines: &[String]| lines.iter().all(|l| l.contains(ESC));
    let plain = |lines: &[String]| lines.iter().all(|l| !l.contains(ESC));
    let lines = retry_lines_on_a_terminal(None);
    assert!(coloured(&lines), "{lines:?}");
    let lines = retry_lines_on_a_terminal(Some("1"));
    assert!(plain(&lines), "NO_COLOR=1: {lines:?}");
    // An empty NO_COLOR does not count.
    let lines = retry_lines_on_a_terminal(Some(""));
    assert!(coloured(&lines), "NO_COLOR='': {lines:?}");
}

/// Prefill with `prefill` flags serves one decode with `decode` flags, both speaking
/// `protocol`: the decode checks every byte of every rank and both exit 0, each naming its
/// ranks at start.
fn parallel_run(protocol: &str, prefill: &[&str], decode: &[&str]) {
    let mut args = vec!["--sessions", "1", "--protocol", protocol];
    args.extend(prefill);
    let mut server = Prefill::start(&args);
    let mut args = vec!["--requests", "16", "--protocol", protocol];
    args.extend(decode);
    let (status, out) = run_decode(server.addr, &args);
    let context = format!("{protocol}: prefill {prefill:?} -> decode {decode:?}");
    assert!(status.success(), "{context}: decode failed:\n{out}");
    assert!(out.contains("every byte verified"), "{context}:\n{out}");
    assert!(out.contains("requests:  16/16"), "{context}:\n{out}");
    assert!(
        server.proc.finish().success(),
        "{context}:\n{}",
        server.proc.output()
    );
    let (prefill_ranks, decode_ranks) = (ranks(prefill), ranks(decode));
    let named =
        |out: &str, n: usize| n == 1 || out.contains(&format!(", {n} ranks in this process"));
    assert!(named(&server.proc.output(), prefill_ranks), "{context}");
    assert!(named(&out, decode_ranks), "{context}:\n{out}");
}

/// The ranks `flags` ask for (`--tp` × `--pp`).
fn ranks(flags: &[&str]) -> usize {
    let size = |name: &str| {
        flags
            .iter()
            .position(|f| *f == name)
            .map_or(1, |i| flags[i + 1].parse::<usize>().unwrap())
    };
    size("--tp") * size("--pp")
}

#[test]
fn a_prefill_of_two_stages_of_two_ranks_feeds_a_decode_of_one_in_both_protocols() {
    for protocol in ["native", "vllm"] {
        let prefill = ["--pp", "2", "--tp", "2", "--kv-heads", "2"];
        parallel_run(protocol, &prefill, &["--kv-heads", "2"]);
    }
}

#[test]
fn a_prefill_of_one_rank_feeds_a_decode_of_two_stages_in_both_protocols() {
    for protocol in ["native", "vllm"] {
        parallel_run(protocol, &[], &["--pp", "2"]);
    }
}

#[test]
fn uneven_stages_and_tp_on_both_sides_check_every_byte() {
    // 4 layers over 3 stages (2, 1, 1) read by 2 stages of TP 2, and TP 2 read by TP 4.
    parallel_run(
        "native",
        &["--pp", "3", "--kv-heads", "4"],
        &["--pp", "2", "--tp", "2", "--kv-heads", "4"],
    );
    parallel_run(
        "vllm",
        &["--tp", "2", "--kv-heads", "4"],
        &["--tp", "4", "--kv-heads", "4"],
    );
}

#[test]
fn demo_script_runs_parallel_engines() {
    let args = [
        "--prefill-pp",
        "2",
        "--prefill-tp",
        "2",
        "--decode-pp",
        "2",
        "--",
        "--requests",
        "12",
    ];
    let (status, text) = run_script("demo.sh", &args);
    assert!(status.success(), "{text}");
    assert!(text.contains("every byte verified"), "{text}");
    assert!(
        text.contains("4 ranks in this process: TP 2 x PP 2, 2 KV heads"),
        "{text}"
    );
    assert!(
        text.contains("2 ranks in this process: TP 1 x PP 2, 2 KV heads"),
        "{text}"
    );
    assert!(text.contains("demo: PASSED"), "{text}");
}

/// Runs `binary` with the small cache and `args` to its end, expecting it to fail; its
/// output.
fn refused(binary: &str, args: &[&str]) -> String {
    let out = Command::new(example(binary))
        .args(CACHE_ARGS)
        .args(args)
        .output()
        .unwrap_or_else(|err| panic!("run {binary}: {err}"));
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{binary} {args:?} ran:\n{text}");
    text
}

#[test]
fn parallel_settings_the_demo_does_not_run_are_refused_with_the_reason() {
    let port = format!("127.0.0.1:{}", free_port());
    let decode = |extra: &[&str]| {
        let mut args = vec!["--prefill", port.as_str(), "--connect-timeout-s", "1"];
        args.extend(extra);
        refused("decode", &args)
    };
    let out = decode(&["--dcp", "2"]);
    assert!(out.contains("--dcp 2") && out.contains("MLA"), "{out}");
    let out = decode(&["--tp", "2"]);
    assert!(
        out.contains("--kv-heads 1 cannot be shared by --tp 2"),
        "{out}"
    );
    let out = decode(&["--pp", "5"]);
    assert!(out.contains("--pp 5 stages of 4 layers"), "{out}");
    let out = decode(&["--tp", "2", "--kv-heads", "2", "--transfer-mode", "push"]);
    assert!(out.contains("several ranks run in pull mode"), "{out}");
    let out = refused(
        "prefill",
        &["--listen", "127.0.0.1:0", "--tp", "2", "--kv-heads", "3"],
    );
    assert!(
        out.contains("--kv-heads 3 cannot be shared by --tp 2"),
        "{out}"
    );
    // Conversations on several ranks, and blocks of other KV heads than the prefill's.
    let mut server = Prefill::start(&["--sessions", "1", "--kv-heads", "2"]);
    let (status, out) = run_decode(server.addr, &["--requests", "2"]);
    assert!(!status.success(), "{out}");
    assert!(out.contains("give both the same --kv-heads"), "{out}");
    server.proc.kill();
    let out = decode(&["--turns", "2", "--pp", "2"]);
    assert!(out.contains("--turns 2 with --tp 1 --pp 2"), "{out}");
    let (status, text) = run_script("demo.sh", &["--dcp", "2"]);
    assert_eq!(status.code(), Some(2), "{text}");
    assert!(
        text.contains("needs an MLA cache") || text.contains("shards an MLA cache"),
        "{text}"
    );
}

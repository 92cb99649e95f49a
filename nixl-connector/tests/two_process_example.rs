//! The two-process example (`examples/kv_prefill.rs`, `examples/kv_decode.rs`) runs as its
//! docs say: the prefill's params line goes to the decode, which reads the blocks over NIXL
//! and checks every byte, and both exit 0.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Bound on each wait; only a guard against hangs.
const WAIT: Duration = Duration::from_secs(90);

/// Builds the two examples into this test's target folder and returns their folder.
fn examples_dir() -> PathBuf {
    // The test runs as target/<profile>/deps/<name>-<hash>.
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let mut build = Command::new(env!("CARGO"));
    build
        .args(["build", "-p", "nixl-connector", "--example", "kv_prefill"])
        .args(["--example", "kv_decode"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env(
            "CARGO_TARGET_DIR",
            profile_dir.parent().expect("target folder"),
        );
    if profile_dir
        .file_name()
        .is_some_and(|name| name == "release")
    {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo build for the examples");
    assert!(status.success(), "building the examples failed: {status}");
    profile_dir.join("examples")
}

/// Waits for `child` to exit within [`WAIT`]; returns its exit code and stderr.
fn finish(name: &str, mut child: Child) -> (Option<i32>, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > WAIT {
            child.kill().ok();
            panic!("{name} still running after {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        pipe.read_to_string(&mut stderr).expect("read stderr");
    }
    (status.code(), stderr)
}

#[test]
fn the_decode_reads_every_byte_the_prefill_holds_for_it() {
    let examples = examples_dir();
    let mut prefill = Command::new(examples.join("kv_prefill"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kv_prefill");
    let stdout = prefill.stdout.take().expect("prefill stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let line = BufReader::new(stdout).lines().next();
        tx.send(line).ok();
    });
    let params = match rx.recv_timeout(WAIT) {
        Ok(Some(Ok(line))) => line,
        other => {
            prefill.kill().ok();
            panic!("kv_prefill printed no params line: {other:?}");
        }
    };
    assert!(params.contains("\"do_remote_prefill\":true"), "{params}");

    let mut decode = Command::new(examples.join("kv_decode"))
        .arg(&params)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kv_decode");
    let decode_out = decode.stdout.take().expect("decode stdout");
    let (decode_code, decode_err) = finish("kv_decode", decode);
    let mut decode_stdout = String::new();
    BufReader::new(decode_out)
        .read_to_string(&mut decode_stdout)
        .expect("read decode stdout");
    let (prefill_code, prefill_err) = finish("kv_prefill", prefill);

    assert_eq!(decode_code, Some(0), "kv_decode failed:\n{decode_err}");
    assert_eq!(prefill_code, Some(0), "kv_prefill failed:\n{prefill_err}");
    assert!(
        decode_stdout.contains(
            "262144 bytes (8 blocks x 4 layers) read from kv-prefill, every byte checked"
        ),
        "{decode_stdout}"
    );
    assert!(
        prefill_err.contains("the decode read prefill-req-7"),
        "{prefill_err}"
    );
}

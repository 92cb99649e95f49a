//! The prefill/decode demo with agent metadata exchanged through a private etcd server
//! (NIXL's own etcd support) instead of the side channel. Without a working etcd (Debian etcd-server; scripts/setup.sh
//! installs it) it fails under CI, and elsewhere is skipped and listed in the test summary.

mod common;
mod demo_support;

use std::process::Command;
use std::time::{Duration, Instant};

use demo_support::{examples_dir, run_decode, run_script, Etcd, Prefill, Proc, CACHE_ARGS};

fn etcd_or_skip(test: &str) -> Option<Etcd> {
    match Etcd::start() {
        Ok(etcd) => Some(etcd),
        Err(reason) => {
            common::skip(test, &reason);
            None
        }
    }
}

#[test]
fn metadata_through_etcd() {
    let Some(etcd) = etcd_or_skip("metadata_through_etcd") else {
        return;
    };
    let etcd_args = ["--metadata", "etcd", "--etcd-endpoints", &etcd.endpoint];
    let mut prefill_args = vec!["--sessions", "2"];
    prefill_args.extend(etcd_args);
    let mut prefill = Prefill::start(&prefill_args);
    assert!(prefill.proc.output().contains("metadata via etcd"));
    // Two decodes one after the other: each fetches prefill's metadata from etcd, and
    // prefill fetches each decode's.
    for _ in 0..2 {
        let mut args = vec!["--requests", "10", "--blocks-per-request", "4"];
        args.extend(etcd_args);
        let (status, out) = run_decode(prefill.addr, &args);
        assert!(status.success(), "{out}");
        assert!(out.contains("metadata via etcd"), "{out}");
        assert!(out.contains("every byte verified"), "{out}");
    }
    assert!(prefill.proc.finish().success(), "{}", prefill.proc.output());
}

#[test]
fn etcd_down_fails_at_once_naming_the_endpoint() {
    let Some(mut etcd) = etcd_or_skip("etcd_down_fails_at_once_naming_the_endpoint") else {
        return;
    };
    let endpoint = etcd.endpoint.clone();
    let etcd_args = ["--metadata", "etcd", "--etcd-endpoints", &endpoint];
    let prefill = Prefill::start(&etcd_args);
    etcd.stop();

    // Before, decode's failed store was only a NIXL log line, and prefill's refusal came 10 s
    // later; now decode stops before its Hello.
    let mut args = vec!["--requests", "4", "--blocks-per-request", "4"];
    args.extend(etcd_args);
    let start = Instant::now();
    let (status, out) = run_decode(prefill.addr, &args);
    let took = start.elapsed();
    eprintln!("decode with etcd down exited after {took:?}");
    assert!(!status.success(), "{out}");
    assert!(took < Duration::from_secs(5), "took {took:?}:\n{out}");
    let error = out
        .lines()
        .find(|l| l.starts_with("decode: error:"))
        .unwrap_or_else(|| panic!("no error line:\n{out}"));
    assert!(error.contains("etcd does not answer"), "{error}");
    assert!(error.contains(&format!("{endpoint}: ")), "{error}");
    assert!(
        !prefill.proc.output().contains("rejected"),
        "decode never got as far as prefill: {}",
        prefill.proc.output()
    );

    // A prefill started while etcd is down says so at once too.
    let mut prefill_args = vec!["--listen", "127.0.0.1:0"];
    prefill_args.extend(CACHE_ARGS);
    prefill_args.extend(etcd_args);
    let start = Instant::now();
    let mut second = Proc::example("prefill", &prefill_args);
    assert!(!second.finish().success(), "{}", second.output());
    assert!(start.elapsed() < Duration::from_secs(5));
    let out = second.output();
    assert!(
        out.contains("prefill: error: etcd does not answer"),
        "{out}"
    );
    assert!(out.contains(&endpoint), "{out}");
}

#[test]
fn etcd_mode_without_endpoints_is_refused() {
    let mut args = vec!["--listen", "127.0.0.1:0", "--metadata", "etcd"];
    args.extend(CACHE_ARGS);
    let mut cmd = Command::new(examples_dir().join("prefill"));
    cmd.args(&args).env_remove("NIXL_ETCD_ENDPOINTS");
    let out = cmd.output().expect("run prefill");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(text.contains("needs NIXL_ETCD_ENDPOINTS"), "{text}");
}

#[test]
fn demo_script_with_etcd() {
    if etcd_or_skip("demo_script_with_etcd").is_none() {
        return;
    }
    let (status, text) = run_script(
        "demo.sh",
        &[
            "--etcd",
            "--",
            "--requests",
            "8",
            "--blocks-per-request",
            "4",
        ],
    );
    assert!(status.success(), "{text}");
    assert!(text.contains("metadata via etcd"), "{text}");
    assert!(text.contains("demo: PASSED"), "{text}");
}

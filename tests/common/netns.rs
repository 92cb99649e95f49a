//! Whether this process can make network namespaces (root and a working `ip netns`), for
//! the tests that put engines on "hosts" of their own.

use std::process::Command;
use std::sync::OnceLock;

/// Why namespaces cannot be used here, if they cannot. The probe runs once per process:
/// tests of one binary run on parallel threads of one process, and probes of theirs named
/// by the process id would collide.
pub fn netns_unavailable() -> Option<String> {
    static ANSWER: OnceLock<Option<String>> = OnceLock::new();
    ANSWER.get_or_init(probe).clone()
}

/// Adds and deletes a namespace named after this process.
fn probe() -> Option<String> {
    let uid = Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Some("not running as root".into());
    }
    let probe = format!("nixl-probe-{}", std::process::id());
    // A namespace of this name left by a killed process of the same id is stale.
    let _ = Command::new("ip").args(["netns", "del", &probe]).output();
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Ok(out) if out.status.success() => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).status();
            None
        }
        Ok(out) => Some(format!(
            "`ip netns add` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(err) => Some(format!("cannot run `ip`: {err}")),
    }
}

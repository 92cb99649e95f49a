//! Child processes that run one ignored "role" test of the same test binary (a peer, a
//! prefill, a decode rank), and what they print (shared with the connector's tests).

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, Stdio};

/// This test binary, started again in a child process to run only the ignored test `role`,
/// with `env` set; its stdin and stdout are piped, its stderr goes to `stderr`.
pub fn role_process(role: &str, env: &[(&str, &str)], stderr: Stdio) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            role,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|err| panic!("start {role}: {err}"))
}

/// A child's stdout, line by line.
pub type ChildLines = Lines<BufReader<ChildStdout>>;

/// `child`'s stdout, line by line (it can be taken once).
pub fn stdout_lines(child: &mut Child) -> ChildLines {
    BufReader::new(
        child
            .stdout
            .take()
            .expect("the child's stdout, piped and not yet taken"),
    )
    .lines()
}

/// What follows `tag` on the next line of `lines` that holds it (libtest may have printed
/// the test's name before it on the same line); `None` if the output ends first.
pub fn after_tag(lines: &mut ChildLines, tag: &str) -> Option<String> {
    lines
        .map_while(Result::ok)
        .find_map(|line| line.find(tag).map(|at| line[at + tag.len()..].to_string()))
}

/// Sends `signal` to `child` (e.g. `libc::SIGSTOP` to stall it, `libc::SIGCONT` to resume it).
///
/// # Panics
/// If kill(2) fails.
pub fn signal(child: &Child, signal: libc::c_int) {
    // SAFETY: kill(2) touches no memory of ours; the pid is our child's, which is not reaped
    // while the caller holds the `Child` unwaited, so no other process has it.
    let sent = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
    assert_eq!(
        sent,
        0,
        "signal {signal}: {}",
        std::io::Error::last_os_error()
    );
}

/// Whether every thread of `child` is stopped (state `T` in /proc), as after SIGSTOP.
pub fn all_threads_stopped(child: &Child) -> bool {
    let tasks = format!("/proc/{}/task", child.id());
    std::fs::read_dir(tasks).unwrap().all(|task| {
        let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
        // The state follows the command name, which is in parentheses.
        stat.rfind(')')
            .and_then(|end| stat[end + 1..].split_whitespace().next())
            == Some("T")
    })
}

/// `bytes` as lowercase hex, for a role to print.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes that [`hex`] printed as `text`.
pub fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

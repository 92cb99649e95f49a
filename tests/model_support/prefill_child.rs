//! The prefill engine's child process: its stdout read line by line, its stderr collected
//! to be shown when it fails, and killed if the decode fails before it ends.

use std::io::Read;
use std::process::{Child, Stdio};
use std::thread::JoinHandle;

use crate::common::{role_process, stdout_lines, ChildLines};

/// A running prefill role.
pub struct PrefillChild {
    child: Child,
    stderr: Option<JoinHandle<String>>,
}

impl PrefillChild {
    /// Starts role test `role` of this binary with `env`, and returns it with its stdout.
    pub fn start(role: &str, env: &[(&str, &str)]) -> (Self, ChildLines) {
        let mut child = role_process(role, env, Stdio::piped());
        let mut stderr = child.stderr.take().expect("the child's stderr, piped");
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let lines = stdout_lines(&mut child);
        let child = PrefillChild {
            child,
            stderr: Some(stderr),
        };
        (child, lines)
    }

    /// Kills the child if it still runs, and panics with `what` and all it wrote to stderr.
    pub fn fail(&mut self, what: &str) -> ! {
        let _ = self.child.kill();
        let status = match self.child.wait() {
            Ok(status) => status.to_string(),
            Err(err) => err.to_string(),
        };
        panic!(
            "{what} (the prefill: {status}); its stderr:\n{}",
            self.stderr_text()
        );
    }

    /// Waits for the child to exit (its stdout read to the end, so that no write of its
    /// meets a closed pipe), and panics with its stderr unless it succeeded.
    pub fn wait_success(&mut self) {
        let status = self.child.wait().unwrap();
        if !status.success() {
            self.fail(&format!("the prefill exited with {status}"));
        }
    }

    /// What the child wrote to stderr, once it has exited.
    fn stderr_text(&mut self) -> String {
        self.stderr
            .take()
            .map(|thread| thread.join().unwrap_or_default())
            .unwrap_or_default()
    }
}

impl Drop for PrefillChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

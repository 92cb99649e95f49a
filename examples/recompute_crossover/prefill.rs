//! The prefill engine, a child process: it computes the prompt into its blocks, then for each
//! line `<request id> <N>` on its stdin finishes a request of the prefix and N tokens
//! (holding their blocks) and answers the request's `kv_transfer_params` as one JSON line;
//! it releases each request on the decode's notification, and exits once its stdin closes
//! and every request is released.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use nixl_connector::{FinishStatus, KvTransferParams};

use crate::engine::{Engine, Setup, BLOCK};

/// How long the prefill waits for the decode's last notifications once its stdin closed.
const RELEASE_DEADLINE: Duration = Duration::from_secs(30);

/// The prefill's side: serves the requests its stdin asks for (the prompt of `setup`).
///
/// # Errors
/// A malformed request line, or a scheduler step or release that failed.
pub async fn serve(setup: &Setup) -> Result<(), String> {
    let mut prefill = setup.engine(
        "recompute-prefill",
        (0..setup.prompt.len() / BLOCK).collect(),
    );
    setup
        .model
        .prefill(&setup.prompt, &mut [prefill.cache(setup)]);
    let (lines, mut requests) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    println!("ready");
    let (mut held, mut released) = (0, 0);
    let mut closed_at = None;
    while closed_at.map_or(true, |at: Instant| at.elapsed() < RELEASE_DEADLINE) {
        tokio::select! {
            line = requests.recv(), if closed_at.is_none() => match line {
                Some(line) => {
                    let params = finish(setup, &mut prefill, &line)?;
                    held += 1;
                    println!("{}", serde_json::to_string(&params).map_err(|e| e.to_string())?);
                }
                None => closed_at = Some(Instant::now()),
            },
            _ = prefill.ranks[0].notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
        let output = prefill
            .scheduler
            .step(&prefill.ranks)
            .map_err(|e| e.to_string())?;
        released += output.finished_sending.len();
        if closed_at.is_some() && released == held {
            return Ok(());
        }
    }
    Err(format!(
        "{released} of {held} requests released by the decode's notifications"
    ))
}

/// Finishes the request `line` names (`<id> <N>`): its blocks of the prefix and N tokens
/// held for a decode; the params that name them.
fn finish(setup: &Setup, prefill: &mut Engine, line: &str) -> Result<KvTransferParams, String> {
    let (id, n) = line
        .split_once(' ')
        .and_then(|(id, n)| Some((id, n.parse::<usize>().ok()?)))
        .ok_or_else(|| format!("a request line is `<id> <N>`, not {line:?}"))?;
    let tokens = setup.prefix + n;
    let asked = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let finished = prefill.scheduler.request_finished(
        id,
        &prefill.table[..tokens / BLOCK],
        tokens,
        Some(&asked),
        FinishStatus::LengthCapped,
    );
    prefill
        .scheduler
        .step(&prefill.ranks)
        .map_err(|e| e.to_string())?;
    finished
        .kv_transfer_params
        .ok_or_else(|| format!("no params for request {id}"))
}

/// The decode's handle on the prefill process.
pub struct PrefillProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl PrefillProcess {
    /// Starts this program again as the prefill, with `args` (its own command line, which
    /// says `--serve-prefill`).
    ///
    /// # Errors
    /// If the process cannot start.
    pub fn start(args: &[String]) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("start the prefill process: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("a piped stdout"));
        Ok(PrefillProcess {
            child,
            stdin,
            stdout,
        })
    }

    /// Its next line.
    fn line(&mut self) -> Result<String, String> {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(0) => Err("the prefill process exited".into()),
            Ok(_) => Ok(line.trim_end().to_string()),
            Err(e) => Err(format!("read from the prefill process: {e}")),
        }
    }

    /// Waits until the prefill has computed its prompt.
    ///
    /// # Errors
    /// If it exited or said something else.
    pub fn ready(&mut self) -> Result<(), String> {
        match self.line()?.as_str() {
            "ready" => Ok(()),
            other => Err(format!("the prefill process said {other:?}, not ready")),
        }
    }

    /// Has the prefill finish request `id` of the prefix and `n` tokens; its params.
    ///
    /// # Errors
    /// If the prefill is gone or answered no params.
    pub fn finish(&mut self, id: &str, n: usize) -> Result<KvTransferParams, String> {
        let stdin = self.stdin.as_mut().ok_or("the prefill's stdin is closed")?;
        writeln!(stdin, "{id} {n}")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("write to the prefill process: {e}"))?;
        let line = self.line()?;
        serde_json::from_str(&line).map_err(|e| format!("the prefill's params {line:?}: {e}"))
    }

    /// Closes its stdin and waits for it to exit, every request released.
    ///
    /// # Errors
    /// If it failed.
    pub fn close(mut self) -> Result<(), String> {
        drop(self.stdin.take());
        let status = self
            .child
            .wait()
            .map_err(|e| format!("wait for the prefill process: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("the prefill process exited with {status}"))
        }
    }
}

impl Drop for PrefillProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

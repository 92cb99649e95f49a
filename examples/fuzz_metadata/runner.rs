//! The parent side: runs a batch in a child process and reports how it ended.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::child;

/// How a batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every input was tried and the child exited cleanly.
    Completed,
    /// The child died on input `index` (killed by `signal`, or exited with `code`).
    Crashed {
        /// Position of the input in the batch.
        index: usize,
        /// The signal that ended the child, if one did.
        signal: Option<i32>,
        /// Its exit code otherwise.
        code: Option<i32>,
    },
    /// The child could not create a loading agent before trying input `index` (not the
    /// input's doing; the input was not loaded).
    HarnessError {
        /// Position of the input in the batch.
        index: usize,
    },
    /// The child was still on input `index` when the time limit struck.
    Hung {
        /// Position of the input in the batch.
        index: usize,
    },
}

/// The Python interpreter to load inputs with instead of the crate (`--target python`).
static PYTHON: OnceLock<std::path::PathBuf> = OnceLock::new();

/// Loads inputs with NIXL's official Python API (no validation) from now on.
pub fn use_python(interpreter: std::path::PathBuf) {
    let _ = PYTHON.set(interpreter);
}

fn python() -> Option<&'static std::path::PathBuf> {
    PYTHON.get()
}

/// This executable, resolved once: a rebuild replacing the file mid-run then still leaves
/// a runnable path (a fresh lookup would name the deleted file).
pub fn own_exe() -> std::io::Result<&'static std::path::PathBuf> {
    static EXE: OnceLock<std::path::PathBuf> = OnceLock::new();
    if let Some(exe) = EXE.get() {
        return Ok(exe);
    }
    let exe = std::env::current_exe()?;
    Ok(EXE.get_or_init(|| exe))
}

/// What a batch did.
#[derive(Debug, Clone, Copy)]
pub struct Tally {
    /// How it ended.
    pub outcome: Outcome,
    /// Inputs the child started on.
    pub started: usize,
    /// Inputs that passed validation and reached NIXL.
    pub reached: usize,
}

/// Runs `inputs` in one child; `scratch` is where the batch file goes.
pub fn run_batch(inputs: &[Vec<u8>], scratch: &Path, limit: Duration) -> std::io::Result<Tally> {
    let file = scratch.join(format!("batch-{}.bin", std::process::id()));
    std::fs::write(&file, child::join(inputs))?;
    let mut command = match python() {
        Some(py) => {
            let mut c = Command::new(py);
            c.arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/examples/fuzz_metadata/load_each.py"
            ));
            c
        }
        None => {
            let mut c = Command::new(own_exe()?);
            c.arg("child");
            c
        }
    };
    let mut proc = command
        .arg(&file)
        .env("NIXL_LOG_LEVEL", "FATAL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(child_log(scratch))
        .spawn()?;
    let lines = Arc::new(Mutex::new((None::<usize>, false, 0usize, false)));
    let reader = {
        let lines = Arc::clone(&lines);
        let stdout = proc.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let mut state = lines.lock().unwrap();
                match line.trim().parse::<usize>() {
                    Ok(i) => state.0 = Some(i),
                    Err(_) if line.trim() == "done" => state.1 = true,
                    Err(_) if line.trim() == "reached-nixl" => state.2 += 1,
                    Err(_) if line.starts_with("harness-error") => state.3 = true,
                    Err(_) => {}
                }
            }
        })
    };
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = proc.try_wait()? {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = proc.kill();
            let _ = proc.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let _ = reader.join();
    let (last, done, reached, harness_error) = *lines.lock().unwrap();
    let started = last.map_or(0, |i| i + 1);
    let index = last.unwrap_or(0);
    let outcome = match status {
        None => Outcome::Hung { index },
        Some(s) if s.success() && done => Outcome::Completed,
        Some(_) if harness_error => Outcome::HarnessError { index },
        Some(s) => Outcome::Crashed {
            index,
            signal: s.signal(),
            code: s.code(),
        },
    };
    Ok(Tally {
        outcome,
        started,
        reached,
    })
}

/// Where children's stderr goes: `child-stderr.log` in `scratch`, appended (the log is
/// cut when it passes 64 MiB).
fn child_log(scratch: &Path) -> Stdio {
    let path = scratch.join("child-stderr.log");
    if std::fs::metadata(&path).is_ok_and(|m| m.len() > 64 << 20) {
        let _ = std::fs::remove_file(&path);
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_or_else(|_| Stdio::null(), Stdio::from)
}

/// Whether `input` alone still crashes a child.
pub fn crashes(input: &[u8], scratch: &Path, limit: Duration) -> bool {
    matches!(
        run_batch(&[input.to_vec()], scratch, limit),
        Ok(Tally {
            outcome: Outcome::Crashed { .. },
            ..
        })
    )
}

/// Shrinks a crashing input by deleting chunks while it still crashes; at most
/// `max_tries` child runs, and none started after `until`.
pub fn minimise(
    input: &[u8],
    scratch: &Path,
    limit: Duration,
    max_tries: usize,
    until: Instant,
) -> Vec<u8> {
    let mut best = input.to_vec();
    let mut tries = 0;
    let mut chunk = best.len().div_ceil(2).max(1);
    let more = |tries: usize| tries < max_tries && Instant::now() < until;
    while chunk >= 1 && more(tries) {
        let mut at = 0;
        let mut shrunk = false;
        while at < best.len() && more(tries) {
            let end = (at + chunk).min(best.len());
            let mut candidate = best[..at].to_vec();
            candidate.extend_from_slice(&best[end..]);
            tries += 1;
            if !candidate.is_empty() && crashes(&candidate, scratch, limit) {
                best = candidate;
                shrunk = true;
            } else {
                at += chunk;
            }
        }
        if !shrunk {
            if chunk == 1 {
                break;
            }
            chunk /= 2;
        }
    }
    best
}

//! The decode's side of the prefill process: starting it, and what it prints.

use std::process::Stdio;
use std::time::Duration;

use nixl_connector::{KvTransferParams, Protocol, TransferMode};

use crate::common::{self, after_tag, role_process, stdout_lines};
use crate::settings::{
    Wire, ENGINE_ENV, MODE_ENV, PREFILL_PP_ENV, PROTOCOL_ENV, SECONDS_ENV, TARGET_ENV, TCP_ONLY,
    UCX_TLS,
};

/// What the prefill process printed.
pub enum Line {
    Request {
        seed: u64,
        blocks: usize,
        /// When the prefill made it (and its lease began), on [`monotonic`]'s clock.
        made: Duration,
        params: Box<KvTransferParams>,
    },
    Resumed,
    End {
        freed_twice: u64,
        late_writes: u64,
    },
}

/// The time on this machine's monotonic clock, which the prefill process and the decode
/// share (`CLOCK_MONOTONIC`).
pub fn monotonic() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes only the timespec it is given, which lives here.
    let read = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    assert_eq!(
        read,
        0,
        "clock_gettime: {}",
        std::io::Error::last_os_error()
    );
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// Reads the prefill process's lines (after its port) in a thread, into a channel that
/// closes when the process's stdout does.
pub fn read_lines(mut lines: common::ChildLines) -> tokio::sync::mpsc::UnboundedReceiver<Line> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in lines.by_ref().map_while(Result::ok) {
            if line.contains("RESUMED") {
                if tx.send(Line::Resumed).is_err() {
                    break;
                }
                continue;
            }
            let Some(at) = line.find("REQ ").or_else(|| line.find("END ")) else {
                continue;
            };
            let mut words = line[at..].splitn(5, ' ');
            let parsed = match words.next() {
                Some("REQ") => Line::Request {
                    seed: words.next().unwrap().parse().unwrap(),
                    blocks: words.next().unwrap().parse().unwrap(),
                    made: Duration::from_micros(words.next().unwrap().parse().unwrap()),
                    params: Box::new(serde_json::from_str(words.next().unwrap()).unwrap()),
                },
                _ => Line::End {
                    freed_twice: words.next().unwrap().parse().unwrap(),
                    late_writes: words.next().unwrap().trim().parse().unwrap(),
                },
            };
            if tx.send(parsed).is_err() {
                break;
            }
        }
    });
    rx
}

/// A prefill process: the child, its stages' agents' names and what it prints.
pub struct PrefillProcess {
    pub child: std::process::Child,
    pub engine: String,
    pub port: u16,
    /// Stage by stage.
    pub agents: Vec<String>,
    /// Its pipeline stages.
    pub pp: usize,
    pub lines: tokio::sync::mpsc::UnboundedReceiver<Line>,
}

impl PrefillProcess {
    /// Tells the prefill that the decode's engine is up (`GO`): it makes requests from then
    /// on, so that none waits unread while its lease runs.
    pub fn go(&mut self) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().expect("the prefill's stdin");
        stdin.write_all(b"GO\n").unwrap();
    }
}

/// Starts a prefill process of engine `engine` of `pp` stages on `wire` that makes `target`
/// requests (or runs for `seconds`).
pub fn start_prefill(
    engine: &str,
    (pp, wire): (usize, Wire),
    target: u64,
    seconds: Option<u64>,
) -> PrefillProcess {
    let (target, stages) = (target.to_string(), pp.to_string());
    let seconds = seconds.map(|s| s.to_string());
    let mode = match wire.mode {
        TransferMode::Pull => "pull",
        TransferMode::Push => "push",
    };
    let protocol = match wire.protocol {
        Protocol::Vllm => "vllm",
        _ => "native",
    };
    let mut env = vec![
        (TARGET_ENV, target.as_str()),
        (ENGINE_ENV, engine),
        (UCX_TLS, TCP_ONLY),
        (PREFILL_PP_ENV, stages.as_str()),
        (MODE_ENV, mode),
        (PROTOCOL_ENV, protocol),
    ];
    if let Some(seconds) = &seconds {
        env.push((SECONDS_ENV, seconds.as_str()));
    }
    let mut child = role_process("soak_prefill_role", &env, Stdio::inherit());
    let mut lines = stdout_lines(&mut child);
    let printed = after_tag(&mut lines, "PORT ").expect("the prefill prints its port");
    let (port, agents) = printed.trim().split_once(' ').unwrap();
    let agents: Vec<String> = agents.split(',').map(String::from).collect();
    assert_eq!(agents.len(), pp, "{printed}");
    PrefillProcess {
        port: port.parse().unwrap(),
        agents,
        pp,
        engine: engine.into(),
        lines: read_lines(lines),
        child,
    }
}

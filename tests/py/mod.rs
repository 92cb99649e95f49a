//! NIXL's official Python API in a child process (tests/py/peer.py), for interop tests.
//! The venv comes from scripts/python-venv.sh (built once, cached under target/).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;

/// The Python interpreter of the venv holding the vendored NIXL wheel (the venv is made
/// once per test process, so parallel tests do not race to create it).
pub fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(make_venv).clone()
}

fn make_venv() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(root.join("scripts/python-venv.sh"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/python-venv.sh");
    assert!(out.status.success(), "scripts/python-venv.sh failed");
    let venv = String::from_utf8(out.stdout).expect("venv path");
    PathBuf::from(venv.trim()).join("bin/python")
}

/// Metadata of every kind made by the Python agent, and its registered buffer.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// `get_agent_metadata()`.
    pub full: Vec<u8>,
    /// Partial metadata of the buffer with connection info.
    pub partial_conn: Vec<u8>,
    /// Partial metadata of the buffer without connection info.
    pub partial: Vec<u8>,
    /// Connection info only (empty descriptor list).
    pub conn: Vec<u8>,
    /// Address of the registered buffer.
    pub addr: usize,
    /// Its length.
    pub len: usize,
}

/// A running tests/py/peer.py.
pub struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// What the peer printed at start.
    pub info: PeerInfo,
}

impl Peer {
    /// Starts a Python agent named `name` with `len` registered bytes.
    pub fn start(name: &str, len: usize) -> Peer {
        Peer::start_with_env(name, len, &[])
    }

    /// Like [`Peer::start`], with extra environment variables (e.g. UCX settings).
    pub fn start_with_env(name: &str, len: usize, env: &[(&str, &str)]) -> Peer {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/peer.py");
        let mut child = Command::new(python())
            .arg(script)
            .arg(name)
            .arg(len.to_string())
            .env("NIXL_LOG_LEVEL", "WARN")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start tests/py/peer.py");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut peer = Peer {
            child,
            stdin,
            stdout,
            info: PeerInfo {
                full: vec![],
                partial_conn: vec![],
                partial: vec![],
                conn: vec![],
                addr: 0,
                len: 0,
            },
        };
        let line = peer.answer();
        let v: serde_json::Value = serde_json::from_str(&line).expect("peer JSON");
        let hex = |k: &str| unhex(v[k].as_str().expect(k));
        peer.info = PeerInfo {
            full: hex("full"),
            partial_conn: hex("partial_conn"),
            partial: hex("partial"),
            conn: hex("conn"),
            addr: v["addr"].as_u64().unwrap() as usize,
            len: v["len"].as_u64().unwrap() as usize,
        };
        peer
    }

    /// The next answer line, without its "@@ " prefix.
    fn answer(&mut self) -> String {
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).expect("read peer");
            assert!(n > 0, "the Python peer exited");
            if let Some(rest) = line.strip_prefix("@@ ") {
                return rest.trim_end().to_string();
            }
        }
    }

    /// Sends one command and returns its answer.
    pub fn call(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").expect("write peer");
        self.stdin.flush().unwrap();
        self.answer()
    }

    /// The Python agent loads `metadata`; returns the name it reports.
    pub fn load(&mut self, metadata: &[u8]) -> String {
        self.call(&format!("load {}", hex(metadata)))
    }

    /// The Python agent's registered buffer.
    pub fn dump(&mut self) -> Vec<u8> {
        unhex(&self.call("dump"))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// The initial contents of the peer's buffer: (i * 7 + 3) % 256.
pub fn peer_pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 7 + 3) % 256) as u8).collect()
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes of lowercase or uppercase hex `s`.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

//! Helpers of the prefill/decode demo tests: locating (and building) the example binaries,
//! running them as processes with their output collected line by line, and a private etcd.
//!
//! Every demo test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use nixl_rs::protocol::Message;

/// Upper bound for any wait in these tests; only a guard against hangs.
pub const WAIT: Duration = Duration::from_secs(120);

/// Small caches, so that many runs fit on two cores at once (also in debug builds).
pub const CACHE_ARGS: [&str; 6] = ["--layers", "4", "--blocks", "64", "--block-size", "4KiB"];

/// The directory holding the demo's examples of this test's profile (`prefill` and
/// `decode`, and the model mode's `model_prefill` and `model_decode`), built once per test
/// process (`cargo test --test X` does not build examples by itself).
pub fn examples_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // The test runs as target/<profile>/deps/<name>-<hash>.
        let exe = std::env::current_exe().expect("test executable path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>/deps");
        let target_dir = profile_dir.parent().expect("target directory");
        let mut build = Command::new(env!("CARGO"));
        build
            .args(["build", "-p", "nixl-rs", "--example", "prefill"])
            .args(["--example", "decode"])
            .args(["--example", "model_prefill", "--example", "model_decode"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("CARGO_TARGET_DIR", target_dir);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build for the examples");
        assert!(status.success(), "building the examples failed: {status}");
        profile_dir.join("examples")
    })
}

/// Path of example `name`.
pub fn example(name: &str) -> PathBuf {
    examples_dir().join(name)
}

/// Output lines of a process, shared with the threads that read them.
#[derive(Default)]
struct Lines {
    lines: Mutex<Vec<String>>,
    changed: Condvar,
    /// Output streams not yet read to their end.
    open: AtomicUsize,
}

/// A child process whose stdout and stderr are collected line by line; killed when dropped.
pub struct Proc {
    name: String,
    child: Child,
    lines: Arc<Lines>,
    status: Option<ExitStatus>,
    /// When the exit was first seen.
    exited_at: Option<Instant>,
}

impl Proc {
    /// Starts `cmd` with its output piped.
    pub fn spawn(name: &str, mut cmd: Command) -> Proc {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|err| panic!("start {name}: {err}"));
        let lines = Arc::new(Lines::default());
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        collect(stdout, lines.clone());
        collect(stderr, lines.clone());
        Proc {
            name: name.to_string(),
            child,
            lines,
            status: None,
            exited_at: None,
        }
    }

    /// Starts example `example` with `args`.
    pub fn example(example_name: &str, args: &[&str]) -> Proc {
        Proc::example_env(example_name, args, &[])
    }

    /// Starts example `example` with `args` and the environment variables `env` set.
    pub fn example_env(example_name: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(example(example_name));
        cmd.args(args).envs(env.iter().copied());
        Proc::spawn(example_name, cmd)
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Everything printed so far.
    pub fn output(&self) -> String {
        self.lines.lines.lock().unwrap().join("\n")
    }

    /// Waits until a line satisfies `pred` and returns it; `None` after `timeout`, or once
    /// the process closed its output without such a line.
    pub fn wait_line(&self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Option<String> {
        let deadline = Instant::now() + timeout;
        let mut lines = self.lines.lines.lock().unwrap();
        loop {
            if let Some(line) = lines.iter().find(|l| pred(l)) {
                return Some(line.clone());
            }
            if self.lines.open.load(Ordering::SeqCst) == 0 {
                return None;
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            lines = self
                .lines
                .changed
                .wait_timeout(lines, left.min(Duration::from_millis(100)))
                .unwrap()
                .0;
        }
    }

    /// Like [`wait_line`](Self::wait_line), panicking with the output on timeout.
    pub fn expect_line(&self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        self.wait_line(WAIT, pred).unwrap_or_else(|| {
            panic!(
                "{} never printed {what}; output:\n{}",
                self.name,
                self.output()
            )
        })
    }

    /// Waits for the process to exit; `None` after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.status {
                return Some(status);
            }
            if let Some(status) = self.child.try_wait().expect("poll child") {
                self.status = Some(status);
                self.exited_at = Some(Instant::now());
                self.wait_for_readers();
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// When the process was first seen to have exited.
    pub fn exited_at(&self) -> Option<Instant> {
        self.exited_at
    }

    /// Waits until both output streams are read to their end, so that [`output`](Self::output)
    /// holds every line. Bounded: a grandchild that inherited the pipes may keep them open.
    fn wait_for_readers(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut lines = self.lines.lines.lock().unwrap();
        while self.lines.open.load(Ordering::SeqCst) > 0 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return;
            };
            lines = self.lines.changed.wait_timeout(lines, left).unwrap().0;
        }
    }

    /// Waits (bounded by [`WAIT`]) for the exit status, panicking with the output on timeout.
    pub fn finish(&mut self) -> ExitStatus {
        self.wait_exit(WAIT).unwrap_or_else(|| {
            panic!(
                "{} did not exit within {WAIT:?}; output:\n{}",
                self.name,
                self.output()
            )
        })
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.status.is_none() && self.child.try_wait().expect("poll child").is_none()
    }

    /// Sends SIGKILL and reaps the process.
    pub fn kill(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn collect(stream: impl Read + Send + 'static, lines: Arc<Lines>) {
    lines.open.fetch_add(1, Ordering::SeqCst);
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            lines.lines.lock().unwrap().push(line);
            lines.changed.notify_all();
        }
        // Counted down under the lock, so a waiter cannot miss the notification.
        let _held = lines.lines.lock().unwrap();
        lines.open.fetch_sub(1, Ordering::SeqCst);
        lines.changed.notify_all();
    });
}

/// A prefill worker on a free loopback port.
pub struct Prefill {
    /// The process.
    pub proc: Proc,
    /// Its control-channel address.
    pub addr: SocketAddr,
}

impl Prefill {
    /// Starts prefill with the small cache and `extra` flags, and waits until it listens.
    pub fn start(extra: &[&str]) -> Prefill {
        Prefill::start_env(extra, &[])
    }

    /// Like [`start`](Self::start), with the environment variables `env` set.
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Prefill {
        let mut args = vec!["--listen", "127.0.0.1:0"];
        args.extend(CACHE_ARGS);
        args.extend(extra);
        let proc = Proc::example_env("prefill", &args, env);
        let line = proc.expect_line("its address", |l| l.contains(" listening on "));
        let addr = line
            .split(" listening on ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        Prefill { proc, addr }
    }

    /// Waits for it to exit, and checks it succeeded and printed `served` (e.g. "2 sessions
    /// (0 ended early), 40 requests served"); its output.
    pub fn finish_with(mut self, served: &str) -> String {
        let status = self.proc.finish();
        let out = self.proc.output();
        assert!(status.success(), "prefill failed:\n{out}");
        assert!(out.contains(served), "{out}");
        out
    }

    /// Its connector's side channel, as its start line names it.
    pub fn side_channel(&self) -> SocketAddr {
        let out = self.proc.output();
        let line = out
            .lines()
            .find(|l| l.starts_with("prefill: agent ") && l.contains(" side channel "))
            .expect("prefill's start line names its connector side channel");
        let rest = line.rsplit(" side channel ").next().unwrap();
        rest.trim_end_matches(')').parse().unwrap()
    }
}

/// Starts decode against `prefill` with the small cache and `extra` flags.
pub fn decode(prefill: SocketAddr, extra: &[&str]) -> Proc {
    decode_env(prefill, extra, &[])
}

/// Like [`decode`], with the environment variables `env` set.
pub fn decode_env(prefill: SocketAddr, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let addr = prefill.to_string();
    let mut args = vec!["--prefill", addr.as_str()];
    args.extend(CACHE_ARGS);
    args.extend(extra);
    Proc::example_env("decode", &args, env)
}

/// Runs decode to the end and returns its exit status and output.
pub fn run_decode(prefill: SocketAddr, extra: &[&str]) -> (ExitStatus, String) {
    let mut proc = decode(prefill, extra);
    let status = proc.finish();
    (status, proc.output())
}

/// Runs `scripts/<script>` with `args`, on this test's example binaries and the small cache;
/// returns its exit status and its stdout followed by its stderr.
pub fn run_script(script: &str, args: &[&str]) -> (ExitStatus, String) {
    let out = Command::new(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("scripts")
            .join(script),
    )
    .args(args)
    .env("NIXL_DEMO_BIN_DIR", examples_dir())
    .env("NIXL_DEMO_CACHE_ARGS", CACHE_ARGS.join(" "))
    .output()
    .unwrap_or_else(|err| panic!("run scripts/{script} {args:?}: {err}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

/// Reads what the peer sends on `stream` until it closes the connection (or [`WAIT`]
/// passes), as side-channel messages.
pub fn read_replies(stream: &mut std::net::TcpStream) -> Vec<Message> {
    stream
        .set_read_timeout(Some(WAIT))
        .expect("set a read timeout");
    let mut buf = Vec::new();
    let _ = stream.read_to_end(&mut buf);
    // Frames as the control channel writes them: a 4-byte big-endian length, the body.
    let mut rest = buf.as_slice();
    let mut replies = Vec::new();
    while let Some((header, tail)) = rest.split_first_chunk::<4>() {
        let len = u32::from_be_bytes(*header) as usize;
        let Some((body, tail)) = tail.split_at_checked(len) else {
            break;
        };
        replies.push(Message::decode(body).expect("the peer's reply parses"));
        rest = tail;
    }
    replies
}

/// The text of the one Error message `replies` should be.
pub fn refusal(replies: &[Message]) -> &str {
    match replies {
        [Message::Error { message }] => message,
        other => panic!("expected one Error reply, got {other:?}"),
    }
}

/// A TCP port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// A memory figure of process `pid` from `/proc/<pid>/status` in KiB, e.g. `VmRSS` or
/// `VmHWM` (its peak).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|err| panic!("read /proc/{pid}/status: {err}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// The path of a program on `PATH`.
pub fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// A private etcd server on loopback with a temporary data directory; killed when dropped.
pub struct Etcd {
    proc: Proc,
    _data: tempfile::TempDir,
    /// The client URL, for `--etcd-endpoints`.
    pub endpoint: String,
    /// The `https://` client URL of an etcd started with [`Etcd::start_tls`].
    pub tls_endpoint: Option<String>,
}

impl Etcd {
    /// Starts etcd on two ports that were free a moment ago (its HTTP gateway, which the
    /// connector fetches metadata through, dials the client port as configured, so port 0
    /// will not do), trying other ports if another process took one meanwhile; or says why
    /// it cannot.
    pub fn start() -> Result<Etcd, String> {
        let binary = which("etcd")
            .ok_or("no etcd binary on PATH (Debian etcd-server; scripts/setup.sh installs it)")?;
        let mut last = String::new();
        for _ in 0..5 {
            match Etcd::start_on(&binary, free_port(), free_port(), None) {
                Ok(etcd) => return Ok(etcd),
                Err(why) => last = why,
            }
        }
        Err(last)
    }

    /// As [`Etcd::start`], serving TLS too, on a third port ([`Etcd::tls_endpoint`]), with
    /// the certificate and key of the PEM files `cert` and `key`; with `client_ca`, a client
    /// there needs a certificate that CA signed (`--client-cert-auth`).
    pub fn start_tls(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Etcd, String> {
        let binary = which("etcd")
            .ok_or("no etcd binary on PATH (Debian etcd-server; scripts/setup.sh installs it)")?;
        let mut last = String::new();
        for _ in 0..5 {
            let tls = Some((cert, key, client_ca, free_port()));
            match Etcd::start_on(&binary, free_port(), free_port(), tls) {
                Ok(etcd) => return Ok(etcd),
                Err(why) => last = why,
            }
        }
        Err(last)
    }

    fn start_on(
        binary: &Path,
        client: u16,
        peer: u16,
        tls: Option<(&Path, &Path, Option<&Path>, u16)>,
    ) -> Result<Etcd, String> {
        let data = tempfile::tempdir().map_err(|e| e.to_string())?;
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let tls_url = tls.map(|(_, _, _, port)| format!("https://127.0.0.1:{port}"));
        let client_urls = match &tls_url {
            Some(tls_url) => format!("{client_url},{tls_url}"),
            None => client_url.clone(),
        };
        let mut cmd = Command::new(binary);
        if let Some((cert, key, client_ca, _)) = tls {
            cmd.arg("--cert-file").arg(cert).arg("--key-file").arg(key);
            if let Some(ca) = client_ca {
                cmd.arg("--client-cert-auth")
                    .arg("--trusted-ca-file")
                    .arg(ca);
            }
        }
        cmd.arg("--name")
            .arg("demo")
            .arg("--data-dir")
            .arg(data.path())
            .args(["--listen-client-urls", &client_urls])
            .args(["--advertise-client-urls", &client_urls])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("demo={peer_url}")]);
        let mut proc = Proc::spawn("etcd", cmd);
        // etcd 3.4 says when it listens: "serving insecure client requests on 127.0.0.1:N".
        const SERVING: &str = "serving insecure client requests on ";
        if proc
            .wait_line(Duration::from_secs(30), |l| l.contains(SERVING))
            .is_none()
        {
            proc.kill();
            return Err(format!(
                "etcd never said it serves on port {client}:\n{}",
                proc.output()
            ));
        }
        // And, serving TLS, "serving client requests on 127.0.0.1:N".
        const SERVING_TLS: &str = "serving client requests on ";
        if tls_url.is_some()
            && proc
                .wait_line(Duration::from_secs(30), |l| l.contains(SERVING_TLS))
                .is_none()
        {
            proc.kill();
            return Err(format!("etcd never served TLS:\n{}", proc.output()));
        }
        let mut etcd = Etcd {
            proc,
            _data: data,
            endpoint: client_url,
            tls_endpoint: tls_url,
        };
        etcd.wait_healthy(client)?;
        Ok(etcd)
    }

    /// Sends one request of etcd's JSON gateway (plain HTTP) and checks that it succeeded.
    pub fn request(&self, path: &str, body: &str) {
        use std::io::Write;
        let host = self.endpoint.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(host).expect("connect to etcd");
        let request = format!(
            "POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).expect("ask etcd");
        let mut answer = String::new();
        stream.read_to_string(&mut answer).expect("etcd's answer");
        assert!(answer.starts_with("HTTP/1.0 200"), "{path}: {answer}");
    }

    /// Turns etcd's authentication on, with user `root` (role `root`) and `password`.
    pub fn enable_auth(&self, password: &str) {
        let user = format!(r#"{{"name":"root","password":"{password}"}}"#);
        self.request("/v3/auth/user/add", &user);
        self.request("/v3/auth/role/add", r#"{"name":"root"}"#);
        self.request("/v3/auth/user/grant", r#"{"user":"root","role":"root"}"#);
        self.request("/v3/auth/enable", "{}");
    }

    /// Kills etcd, as if it went down.
    pub fn stop(&mut self) {
        self.proc.kill();
    }

    fn wait_healthy(&mut self, port: u16) -> Result<(), String> {
        use std::io::Write;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if !self.proc.is_running() {
                return Err(format!("etcd exited:\n{}", self.proc.output()));
            }
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                let mut reply = String::new();
                let asked = s.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_ok();
                if asked
                    && s.read_to_string(&mut reply).is_ok()
                    && reply.contains("\"health\":\"true\"")
                {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "etcd not healthy on port {port}:\n{}",
            self.proc.output()
        ))
    }
}

//! Hostile peers on the control channel: a client that sends a byte a second, many clients
//! declaring huge frames, fifty that connect and say nothing, and fake prefill servers that
//! stall or never answer. Each is cut off by a total deadline or a bound, says so, and a
//! real decode still completes.

mod demo_support;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use demo_support::{decode, read_replies, refusal, run_decode, status_kib, Prefill, Proc, WAIT};

const WORK: [&str; 4] = ["--requests", "10", "--blocks-per-request", "4"];

/// Slack on top of a deadline for a loaded two-core machine.
const SLACK: Duration = Duration::from_secs(2);

/// Body length the hostile peers declare in their frame header.
const DECLARED: u32 = 1000;

/// Sends a frame header declaring [`DECLARED`] bytes, then one byte a second until the peer
/// goes away.
fn trickle(mut stream: TcpStream) {
    if stream.write_all(&DECLARED.to_be_bytes()).is_err() {
        return;
    }
    loop {
        thread::sleep(Duration::from_secs(1));
        if stream.write_all(&[0]).is_err() {
            return;
        }
    }
}

/// A client of prefill's control channel trickling a Hello one byte a second, and reading
/// prefill's replies until it closes the connection.
struct SlowClient {
    stream: TcpStream,
    writer: JoinHandle<()>,
    /// How long the connection stayed open, and prefill's refusal.
    reader: JoinHandle<(Duration, String)>,
}

impl SlowClient {
    fn start(addr: SocketAddr) -> SlowClient {
        let stream = TcpStream::connect(addr).expect("connect to prefill");
        let connected = Instant::now();
        let writer_half = stream.try_clone().expect("clone the client socket");
        let mut reader_half = stream.try_clone().expect("clone the client socket");
        SlowClient {
            stream,
            writer: thread::spawn(move || trickle(writer_half)),
            reader: thread::spawn(move || {
                let replies = read_replies(&mut reader_half);
                (connected.elapsed(), refusal(&replies).to_string())
            }),
        }
    }

    /// Waits until prefill has closed the connection: how long it stayed open, and why.
    fn finish(self) -> (Duration, String) {
        let closed = self.reader.join().expect("the reading thread");
        let _ = self.stream.shutdown(Shutdown::Both);
        self.writer.join().expect("the trickling thread");
        closed
    }
}

#[test]
fn slow_byte_client_is_cut_off_at_the_handshake_deadline() {
    let deadline = Duration::from_secs(4);
    let mut prefill = Prefill::start(&["--handshake-timeout-s", "4"]);
    let clients: Vec<_> = (0..3).map(|_| SlowClient::start(prefill.addr)).collect();

    let start = Instant::now();
    let (status, out) = run_decode(prefill.addr, &WORK);
    eprintln!("decode beside 3 slow clients took {:?}", start.elapsed());
    assert!(
        status.success(),
        "decode failed beside slow clients:\n{out}"
    );
    assert!(out.contains("every byte verified"), "{out}");

    for client in clients {
        let (held, message) = client.finish();
        eprintln!("slow client held {held:?}: {message}");
        assert!(
            held >= deadline - Duration::from_millis(500) && held <= deadline + SLACK,
            "a client sending a byte a second was held {held:?} by a {deadline:?} deadline"
        );
        assert!(
            message.contains("decode sent only")
                && message.contains(&format!("of {} bytes of its Hello frame", DECLARED + 4))
                && message.contains("then the 4s handshake deadline passed"),
            "{message}"
        );
    }
    assert!(prefill.proc.is_running(), "{}", prefill.proc.output());
}

/// A fake prefill on a free port: accepts one connection, reports when, then trickles a
/// frame one byte a second (`trickling`) or stays silent until decode goes away.
fn fake_prefill(trickling: bool) -> (SocketAddr, mpsc::Receiver<Instant>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a fake prefill");
    let addr = listener.local_addr().expect("its address");
    let (accepted_tx, accepted) = mpsc::channel();
    thread::spawn(move || {
        let Ok((mut stream, _)) = listener.accept() else {
            return;
        };
        let _ = accepted_tx.send(Instant::now());
        if trickling {
            trickle(stream);
        } else {
            // Read decode's Hello and whatever follows until it hangs up; never answer.
            let _ = stream.read_to_end(&mut Vec::new());
        }
    });
    (addr, accepted)
}

/// Runs decode with a 3 s connect deadline against `addr`; how long after the fake prefill
/// accepted the connection decode exited, and decode's error line.
fn decode_against(addr: SocketAddr, accepted: &mpsc::Receiver<Instant>) -> (Duration, String) {
    let mut args = vec!["--connect-timeout-s", "3"];
    args.extend(WORK);
    let mut decode = decode(addr, &args);
    let accepted = accepted
        .recv_timeout(WAIT)
        .unwrap_or_else(|_| panic!("decode never connected:\n{}", decode.output()));
    let status = decode.finish();
    let took = accepted.elapsed();
    let out = decode.output();
    assert!(!status.success(), "{out}");
    let error = out
        .lines()
        .find(|l| l.starts_with("decode: error:"))
        .unwrap_or_else(|| panic!("no error line:\n{out}"))
        .to_string();
    (took, error)
}

#[test]
fn slow_prefill_is_cut_off_at_the_connect_deadline() {
    let (addr, accepted) = fake_prefill(true);
    let (took, error) = decode_against(addr, &accepted);
    eprintln!("decode gave up after {took:?}: {error}");
    assert!(
        took <= Duration::from_secs(3) + SLACK,
        "decode waited {took:?} on a prefill sending a byte a second, with a 3 s deadline"
    );
    assert!(
        error.contains(&format!("prefill at {addr} sent only"))
            && error.contains(&format!("of {} bytes of its handshake frame", DECLARED + 4))
            && error.contains("then the 3s deadline passed"),
        "{error}"
    );
}

#[test]
fn silent_prefill_is_named_as_such() {
    let (addr, accepted) = fake_prefill(false);
    let (took, error) = decode_against(addr, &accepted);
    eprintln!("decode gave up after {took:?}: {error}");
    assert!(
        took <= Duration::from_secs(3) + SLACK,
        "decode waited {took:?} on a silent prefill, with a 3 s deadline"
    );
    assert!(
        error.contains(&format!(
            "prefill at {addr} accepted the connection but sent no handshake within 3s"
        )),
        "{error}"
    );
    assert!(!error.contains("os error"), "{error}");
}

#[test]
fn pending_handshakes_are_bounded_in_count_and_bytes() {
    const MAX_PENDING: usize = 8;
    const CLIENTS: usize = 20;
    const BUDGET_MIB: u64 = 32;
    let prefill = Prefill::start(&[
        "--max-frame",
        "16MiB",
        "--max-pending-handshakes",
        "8",
        "--max-pending-handshake-bytes",
        "32MiB",
        "--handshake-timeout-s",
        "60",
    ]);
    let pid = prefill.proc.id();
    let rss_before = status_kib(pid, "VmRSS");

    // 20 clients connect before any sends: at most 8 are pending, each newcomer past the
    // eighth closes the oldest.
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| TcpStream::connect(prefill.addr).expect("connect to prefill"))
        .collect();
    wait_for_lines(&prefill.proc, EVICTED, CLIENTS - MAX_PENDING);

    // Each then sends a frame just under the 16 MiB frame limit, all but its last byte.
    let declared: u32 = (16 << 20) - 4;
    let body = Arc::new(vec![7u8; declared as usize - 1]);
    let writers: Vec<_> = clients
        .iter()
        .map(|c| {
            let mut stream = c.try_clone().expect("clone a client socket");
            let body = body.clone();
            thread::spawn(move || {
                stream.set_write_timeout(Some(WAIT)).unwrap();
                let _ = stream.write_all(&declared.to_be_bytes());
                let _ = stream.write_all(&body);
            })
        })
        .collect();
    for writer in writers {
        writer.join().expect("a writer thread");
    }
    // Two whole frames fit the 32 MiB limit (each is charged 16 MiB less its free 64 KiB);
    // each of the other six admitted handshakes is refused when its frame would pass it.
    let byte_refusals = "refused a control-channel connection: pending handshakes hold";
    wait_for_lines(&prefill.proc, byte_refusals, MAX_PENDING - 2);
    let peak_growth_mib = status_kib(pid, "VmHWM").saturating_sub(rss_before) / 1024;
    eprintln!(
        "prefill: VmRSS {} MiB before, peak RSS {peak_growth_mib} MiB higher",
        rss_before / 1024
    );
    let out = prefill.proc.output();
    assert!(out.contains("the limit of 33554432 bytes"), "{out}");
    // Unbounded, 20 frames of 16 MiB would cost 320 MiB; here the bound is the byte limit,
    // 64 KiB per pending handshake, and slack for the allocator and the threads.
    assert!(
        peak_growth_mib <= BUDGET_MIB + 24,
        "prefill's peak RSS grew by {peak_growth_mib} MiB with a {BUDGET_MIB} MiB limit"
    );

    // With two handshakes still pending and holding their 32 MiB, a real decode completes.
    let (status, decode_out) = run_decode(prefill.addr, &WORK);
    assert!(
        status.success(),
        "{decode_out}\nprefill:\n{}",
        prefill.proc.output()
    );
    assert!(decode_out.contains("every byte verified"), "{decode_out}");
    drop(clients);
}

/// What prefill logs when it closes the oldest pending handshake for a new connection.
const EVICTED: &str = "closed a pending control-channel handshake to make room";

/// Connects to `addr` and says nothing until the peer closes the connection, then
/// reconnects after 100 ms, until `until`; returns how many times it connected.
fn hold_silently(addr: SocketAddr, until: Instant) -> u64 {
    let mut connections = 0;
    while let Some(left) = until.checked_duration_since(Instant::now()) {
        if let Ok(mut stream) = TcpStream::connect(addr) {
            connections += 1;
            let _ = stream.set_read_timeout(Some(left.max(Duration::from_millis(1))));
            let mut buf = [0u8; 256];
            while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
        }
        thread::sleep(Duration::from_millis(100));
    }
    connections
}

#[test]
fn fifty_silent_connections_for_14_s_do_not_keep_a_decode_out() {
    const HOLD: Duration = Duration::from_secs(14);
    // A handshake deadline past the hold: only being closed for a newer connection frees a
    // silent peer's place while they hold them.
    let prefill = Prefill::start(&["--handshake-timeout-s", "30"]);
    let side_channel = prefill.side_channel();
    // 50 silent peers on the control channel and 50 on the connector's side channel (16
    // places each, the default); each one closed reconnects 100 ms later.
    let until = Instant::now() + HOLD;
    let holders: Vec<_> = [prefill.addr, side_channel]
        .into_iter()
        .flat_map(|addr| (0..50).map(move |_| thread::spawn(move || hold_silently(addr, until))))
        .collect();
    wait_for_lines(&prefill.proc, EVICTED, 50 - 16);

    let start = Instant::now();
    let (status, out) = run_decode(
        prefill.addr,
        &["--requests", "256", "--blocks-per-request", "4"],
    );
    let decoded_at = Instant::now();
    eprintln!(
        "decode of 256 requests beside 100 silent peers took {:?}",
        decoded_at - start
    );
    assert!(
        status.success(),
        "{out}\nprefill:\n{}",
        prefill.proc.output()
    );
    assert!(out.contains("every byte verified"), "{out}");
    assert!(
        decoded_at < until,
        "the decode ended after the silent peers left"
    );
    let connections: u64 = holders
        .into_iter()
        .map(|h| h.join().expect("a silent peer"))
        .sum();
    let evicted = prefill
        .proc
        .output()
        .lines()
        .filter(|l| l.contains(EVICTED))
        .count();
    eprintln!("{connections} silent connections; prefill closed {evicted} control-channel handshakes for newer ones");
    assert!(evicted >= 50 - 16);
}

/// Waits until `proc` has printed `count` lines containing `text`.
fn wait_for_lines(proc: &Proc, text: &str, count: usize) {
    let start = Instant::now();
    loop {
        let out = proc.output();
        let seen = out.lines().filter(|l| l.contains(text)).count();
        if seen >= count {
            return;
        }
        assert!(
            start.elapsed() < WAIT,
            "{seen} of {count} lines {text:?}:\n{out}"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

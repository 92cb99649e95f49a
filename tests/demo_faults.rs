//! Faults around the prefill/decode demo: a prefill that dies mid-run, a decode that dies
//! mid-run (also amid read-backs of conversations of several turns), and garbage, truncated, oversized or silent clients on prefill's control channel.

mod demo_support;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use demo_support::{decode, read_replies, refusal, run_decode, Prefill, WAIT};
use nixl_rs::protocol::{Hello, Message, PROTOCOL_VERSION};

/// Enough requests that a run is still going when the test interferes.
const ENDLESS: [&str; 10] = [
    "--requests",
    "100000000",
    "--blocks-per-request",
    "4",
    "--in-flight",
    "3",
    "--progress-interval-ms",
    "100",
    "--connect-timeout-s",
    "60",
];

const WORK: [&str; 4] = ["--requests", "10", "--blocks-per-request", "4"];

/// The number of requests done in a decode progress line.
fn requests_done(line: &str) -> u64 {
    line.split("progress: ")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[test]
fn killed_prefill_is_reported_within_5_seconds() {
    let mut prefill = Prefill::start(&[]);
    let mut decode = decode(prefill.addr, &ENDLESS);
    decode.expect_line("progress", |l| requests_done(l) > 0);
    prefill.proc.kill();
    let killed = Instant::now();
    let status = decode.wait_exit(Duration::from_secs(5)).unwrap_or_else(|| {
        panic!(
            "decode still running 5 s after prefill died:\n{}",
            decode.output()
        )
    });
    // The exit as first seen, not counting the wait for the last output lines.
    let waited = decode.exited_at().expect("exited") - killed;
    let out = decode.output();
    assert!(!status.success(), "{out}");
    assert!(waited <= Duration::from_secs(5), "took {waited:?}");
    let error = out
        .lines()
        .find(|l| l.starts_with("decode: error:"))
        .unwrap_or_else(|| panic!("no error line:\n{out}"));
    // Whether decode first sees its loads fail or the channel close, the report is
    // prefill's death (it closes with the process, a moment after the memory goes).
    assert!(
        error.starts_with("decode: error: prefill closed the control channel after ")
            && error.contains(" requests (did it die?)"),
        "{error}"
    );
}

/// A prefill that stops (SIGSTOP: its connections stay open, it sends nothing) cannot hold
/// decode: with nothing announced and no load ending for `--xfer-timeout-s`, or a load in
/// flight past it, decode fails.
#[test]
fn a_stopped_prefill_fails_decode_after_the_idle_timeout() {
    let mut prefill = Prefill::start(&[]);
    let mut args = ENDLESS.to_vec();
    args.extend(["--xfer-timeout-s", "2"]);
    let mut decode = decode(prefill.addr, &args);
    decode.expect_line("progress", |l| requests_done(l) > 0);
    // SAFETY: kill(2) with the pid of a child this test started and still owns.
    assert_eq!(
        unsafe { libc::kill(prefill.proc.id() as i32, libc::SIGSTOP) },
        0
    );
    let stopped = Instant::now();
    let status = decode.wait_exit(Duration::from_secs(10));
    let took = stopped.elapsed();
    // SAFETY: as above; the prefill goes on, then is killed on drop.
    unsafe { libc::kill(prefill.proc.id() as i32, libc::SIGCONT) };
    let out = decode.output();
    let status =
        status.unwrap_or_else(|| panic!("decode still running 10 s after prefill stopped:\n{out}"));
    assert!(!status.success(), "{out}");
    assert!(
        took >= Duration::from_secs(2),
        "failed after {took:?}:\n{out}"
    );
    let error = out
        .lines()
        .find(|l| l.starts_with("decode: error:"))
        .unwrap_or_else(|| panic!("no error line:\n{out}"));
    // Which of the two deadlines fires first is a race: a load posted just before the stop
    // can wait on the stopped peer (where UCX cannot read its memory directly, it emulates a
    // READ through the peer's progress) while the idle clock runs. Both are the 2 s limit
    // reporting the stall (CI saw the load's once).
    assert!(
        error.contains("no announcement from prefill and no load ended for 2s")
            || error.contains("did not complete within 2s"),
        "{error}"
    );
    prefill.proc.kill();
}

#[test]
fn killed_decode_leaves_prefill_serving() {
    let mut prefill = Prefill::start(&[]);
    let mut doomed = decode(prefill.addr, &ENDLESS);
    doomed.expect_line("progress", |l| requests_done(l) > 0);
    doomed.kill();
    prefill
        .proc
        .expect_line("the ended session", |l| l.contains("ended early"));
    assert!(prefill.proc.is_running(), "{}", prefill.proc.output());

    // Its blocks went back to the pool: a new decode gets the whole cache.
    let (status, out) = run_decode(
        prefill.addr,
        &[
            "--requests",
            "10",
            "--blocks-per-request",
            "16",
            "--in-flight",
            "4",
        ],
    );
    assert!(status.success(), "{out}");
    assert!(out.contains("every byte verified"), "{out}");
    prefill
        .proc
        .expect_line("the second session", |l| l.contains("done: 10/10 requests"));
    assert!(prefill.proc.is_running());
}

/// A decode killed amid conversations of several turns, read-backs from it in flight, leaves
/// prefill serving with every block back: the next decode's last turns take all 64 of them.
#[test]
fn killed_decode_amid_read_backs_leaves_every_block_free() {
    let mut prefill = Prefill::start(&["--recompute-threshold", "1"]);
    let mut doomed = decode(
        prefill.addr,
        &[
            "--requests",
            "100000000",
            "--blocks-per-request",
            "4",
            "--in-flight",
            "3",
            "--turns",
            "3",
            "--progress-interval-ms",
            "50",
        ],
    );
    doomed.expect_line("progress", |l| requests_done(l) > 30);
    doomed.kill();
    prefill
        .proc
        .expect_line("the ended session", |l| l.contains("ended early"));
    assert!(prefill.proc.is_running(), "{}", prefill.proc.output());

    // Turn 3's prompt is 3 x 20 new blocks and 2 answers of 2: the whole cache, which a
    // block the ended session kept would leave short.
    let whole = [
        "--requests",
        "2",
        "--blocks-per-request",
        "20",
        "--in-flight",
        "1",
        "--turns",
        "3",
        "--answer-blocks",
        "2",
        "--xfer-timeout-s",
        "10",
    ];
    let (status, out) = run_decode(prefill.addr, &whole);
    assert!(status.success(), "{out}");
    assert!(out.contains("every byte verified"), "{out}");
    prefill
        .proc
        .expect_line("the second session", |l| l.contains("done: 6/6 requests"));
    assert!(prefill.proc.is_running());
}

/// Connects, sends `bytes`, optionally half-closes, and returns prefill's reply frames.
fn poke(addr: SocketAddr, bytes: &[u8], close_write: bool) -> Vec<Message> {
    let mut s = TcpStream::connect(addr).expect("connect to prefill");
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(bytes).expect("send");
    if close_write {
        s.shutdown(std::net::Shutdown::Write).unwrap();
    }
    read_replies(&mut s)
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

#[test]
fn bad_control_channel_input_is_rejected_without_harm() {
    let mut prefill = Prefill::start(&["--max-frame", "64KiB", "--handshake-timeout-s", "2"]);
    let addr = prefill.addr;

    // Garbage: an HTTP request reads as a 1.2 GB length prefix.
    let too_long = "declared a frame longer than the 65536-byte cap";
    let replies = poke(addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", true);
    assert!(refusal(&replies).contains(too_long), "{replies:?}");

    // Oversized: one byte over the limit, and the largest length there is.
    let replies = poke(addr, &(64u32 * 1024 + 1).to_be_bytes(), true);
    assert!(refusal(&replies).contains(too_long), "{replies:?}");
    let replies = poke(addr, &u32::MAX.to_be_bytes(), true);
    assert!(refusal(&replies).contains(too_long), "{replies:?}");

    // Truncated: a header cut short, and a body cut short.
    let replies = poke(addr, &[0, 0], true);
    assert!(
        refusal(&replies)
            .contains("truncated frame: decode closed the connection after 2 of 4 header bytes"),
        "{replies:?}"
    );
    let replies = poke(addr, &[0, 0, 0, 100, 1, 2, 3], true);
    assert!(
        refusal(&replies).contains("after 7 of 104 bytes of its Hello frame"),
        "{replies:?}"
    );

    // Well framed, but not a message, or not the expected one.
    let replies = poke(addr, &frame(&[99, 1, 2]), true);
    assert!(
        refusal(&replies).contains("undecodable message of 3 bytes"),
        "{replies:?}"
    );
    let replies = poke(
        addr,
        &frame(&Message::Complete { requests: 1 }.encode()),
        true,
    );
    assert!(refusal(&replies).contains("expected Hello, got Complete"));
    let hello_speaking = |version, protocol: &str| {
        Message::Hello(Hello {
            version,
            agent: "intruder".into(),
            layers: 4,
            block_bytes: 4096,
            requests: 1,
            turns: 1,
            answer_blocks: 0,
            blocks_per_request: 1,
            in_flight: 1,
            connector_protocol: protocol.into(),
        })
        .encode()
    };
    let hello = |version| hello_speaking(version, "native");
    let replies = poke(addr, &frame(&hello(PROTOCOL_VERSION - 1)), true);
    assert!(
        refusal(&replies).contains(&format!(
            "protocol version {} is not {PROTOCOL_VERSION}",
            PROTOCOL_VERSION - 1
        )),
        "an older protocol: {replies:?}"
    );
    let replies = poke(
        addr,
        &frame(&hello_speaking(PROTOCOL_VERSION, "vllm")),
        true,
    );
    assert!(
        refusal(&replies).contains("speaks the \"vllm\" protocol, prefill's native"),
        "another connector protocol: {replies:?}"
    );
    let mut cut = hello(PROTOCOL_VERSION);
    cut.truncate(cut.len() - 3);
    let replies = poke(addr, &frame(&cut), true);
    assert!(
        refusal(&replies).contains("undecodable message"),
        "{replies:?}"
    );

    // Silent: connects and says nothing until the handshake timeout.
    let replies = poke(addr, &[], false);
    assert!(
        refusal(&replies).contains("timed out: no Hello within 2s"),
        "{replies:?}"
    );

    // Connects and leaves at once.
    drop(TcpStream::connect(addr).unwrap());

    let (status, out) = run_decode(addr, &WORK);
    assert!(status.success(), "prefill must still serve:\n{out}");
    assert!(prefill.proc.is_running());
    prefill.proc.expect_line("the last rejection", |l| {
        l.contains("the peer closed the connection")
    });
    let rejected = prefill
        .proc
        .output()
        .lines()
        .filter(|l| l.starts_with("prefill: rejected connection"))
        .count();
    assert_eq!(rejected, 12, "{}", prefill.proc.output());
}

//! decode pointed at something that is not a prefill's control channel: a prefill's
//! connector side channel (the other port a prefill prints), a web server, a ZMQ socket.
//! Its error says what it reached, that a Welcome from a prefill's control channel was
//! expected, and which address to give; it never calls the control channel a side channel.

mod demo_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::thread;

use demo_support::{run_decode, Prefill};

const WORK: [&str; 6] = [
    "--requests",
    "1",
    "--blocks-per-request",
    "1",
    "--connect-timeout-s",
    "5",
];

/// What every such error says, whatever was reached.
const EXPECTED: &str = "decode expected a Welcome from a prefill's control channel";
const HINT: &str = "point --prefill at the address the prefill prints as `listening on ADDR`";

/// decode's error line against `addr`; it must fail.
fn decode_error(addr: SocketAddr) -> String {
    let (status, out) = run_decode(addr, &WORK);
    assert!(!status.success(), "{out}");
    let error = out
        .lines()
        .find(|l| l.starts_with("decode: error:"))
        .unwrap_or_else(|| panic!("no error line:\n{out}"))
        .to_string();
    assert!(error.contains(EXPECTED), "{error}");
    assert!(error.contains(HINT), "{error}");
    assert!(!error.contains("side channel with"), "{error}");
    assert!(!error.contains("side-channel protocol"), "{error}");
    error
}

/// A one-connection server on a free port that reads decode's Hello, then sends `answer`.
fn fake_server(answer: &'static [u8]) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a fake server");
    let addr = listener.local_addr().expect("its address");
    thread::spawn(move || {
        let Ok((mut stream, _)) = listener.accept() else {
            return;
        };
        let _ = stream.read(&mut [0; 256]);
        let _ = stream.write_all(answer);
    });
    addr
}

#[test]
fn decode_at_a_prefills_side_channel_says_it_reached_no_control_channel() {
    let prefill = Prefill::start(&[]);
    let side_channel = prefill.side_channel();
    let error = decode_error(side_channel);
    assert!(
        error.contains(&format!(
            "{side_channel} closed the connection without answering decode's Hello"
        )) && error.contains(&format!(
            "{side_channel} is not a prefill's control channel (a prefill's connector side \
             channel, for one, closes on a Hello)"
        )),
        "{error}"
    );
}

#[test]
fn decode_at_a_web_server_says_it_answered_in_http() {
    let addr = fake_server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
    let error = decode_error(addr);
    assert!(
        error.contains(&format!(
            "{addr} is not a prefill's control channel: it answered in HTTP, so it is a web \
             server; its first bytes, 48 54 54 50, are no control-channel frame"
        )),
        "{error}"
    );
}

#[test]
fn decode_at_a_zmq_socket_says_it_sent_a_zeromq_greeting() {
    // ZMTP 3's greeting starts with 0xff, eight bytes, 0x7f.
    let addr = fake_server(&[0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3]);
    let error = decode_error(addr);
    assert!(
        error.contains(&format!(
            "{addr} is not a prefill's control channel: it sent what looks like a ZeroMQ greeting"
        )),
        "{error}"
    );
}

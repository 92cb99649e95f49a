//! The native side channel and notifications against an attacker's own client in Python
//! (tests/py/attacker.py, written from the wire format, not the crate's code), over real
//! NIXL agents: a relay between a real decode and a real prefill sees no metadata, and the
//! decode still handshakes and reads through it; a byte it changes either way is refused;
//! an agent that handshook but never got a request's params, and an agent that took a
//! reader's NIXL name, send finish notifications and heartbeats and free nothing; a garbage
//! storm leaves a bounded number of log lines; a secret file readable by others is refused.

#[path = "../nixl-connector/tests/common/mod.rs"]
mod common;
mod py;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{block, capability, fill, pattern, remote, spec, worker_with};
use nixl_connector::{KvConnectorWorker, RemoteBlocks, SharedSecret};
use serde_json::Value;

const SECRET: &str = "the attacked deployment's shared secret";

/// The attacker's client running `args`, its answer lines read as they come.
struct Attacker {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: BufReader<ChildStdout>,
}

impl Attacker {
    fn start(args: &[&str]) -> Attacker {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/attacker.py");
        let mut child = Command::new(py::python())
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the attacker");
        let stdin = child.stdin.take();
        let lines = BufReader::new(child.stdout.take().unwrap());
        Attacker {
            child,
            stdin,
            lines,
        }
    }

    /// The next answer line.
    fn next(&mut self) -> Value {
        loop {
            let mut line = String::new();
            assert!(
                self.lines.read_line(&mut line).unwrap() > 0,
                "the attacker ended"
            );
            if let Some(json) = line.strip_prefix("@@ ") {
                return serde_json::from_str(json).unwrap();
            }
        }
    }

    /// Every answer line until it ends (stdin closed first).
    fn finish(mut self) -> Vec<Value> {
        drop(self.stdin.take());
        let mut all = Vec::new();
        for line in (&mut self.lines).lines() {
            if let Some(json) = line.unwrap().strip_prefix("@@ ") {
                all.push(serde_json::from_str(json).unwrap());
            }
        }
        self.child.wait().unwrap();
        all
    }
}

fn engine(name: &str) -> KvConnectorWorker {
    common::init_tracing();
    let spec = spec(2);
    let secret = SharedSecret::new(SECRET.as_bytes()).unwrap();
    let worker = worker_with(name, 0, 1, &spec, |c| c.secret = Some(secret));
    fill(&worker, &spec);
    worker
}

fn port(worker: &KvConnectorWorker) -> u16 {
    worker.side_channel_addr().unwrap().port()
}

/// A relay in `mode` in front of `prefill`, and the port it listens on.
fn relay(prefill: &KvConnectorWorker, mode: &str) -> (Attacker, u16) {
    let mut relay = Attacker::start(&["relay", "0", &port(prefill).to_string(), mode]);
    let port = relay.next()["port"].as_u64().unwrap() as u16;
    (relay, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_sees_no_metadata_and_the_decode_reads_through_an_honest_one() {
    let spec = spec(2);
    let prefill = engine("pf-relayed");
    let decode = engine("dc-relayed");
    let (relay, relay_port) = relay(&prefill, "honest");
    prefill.hold_for_decode(
        "r",
        Instant::now() + Duration::from_secs(60),
        Some(&capability()),
    );
    let from = RemoteBlocks {
        port: relay_port,
        ..remote(&prefill, "pf-relayed", "r", vec![3, 7], 1)
    };
    decode.start_load("r", &[0, 1], &from).unwrap();
    let done =
        common::poll_until(&decode, Duration::from_secs(10), |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["r"]);
    assert!(decode.load_errors().is_empty());
    for layer in 0..spec.num_regions() {
        for (local, far) in [(0, 3), (1, 7)] {
            let want: Vec<u8> = (0..spec.block_len(0))
                .map(|o| pattern(layer, far, o))
                .collect();
            assert_eq!(block(&decode, &spec, layer, local), want, "layer {layer}");
        }
    }
    let frames = relay.finish();
    assert!(
        frames.len() >= 4,
        "hello, challenge, proof, answer: {frames:?}"
    );
    let secrets = [
        prefill.agent().name().as_bytes().to_vec(),
        decode.agent().name().as_bytes().to_vec(),
        b"agent_metadata".to_vec(),
        b"region_base_addrs".to_vec(),
    ];
    for frame in &frames {
        let bytes = py::unhex(frame["hex"].as_str().unwrap());
        for secret in &secrets {
            assert!(
                !bytes.windows(secret.len()).any(|w| w == secret.as_slice()),
                "the relay saw {:?} in a frame {}",
                String::from_utf8_lossy(secret),
                frame["direction"]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_a_relay_changes_either_way_is_refused() {
    let prefill = engine("pf-tampered");
    let decode = engine("dc-tampered");
    for mode in ["tamper-proof", "tamper-answer"] {
        let (relay, relay_port) = relay(&prefill, mode);
        let err = decode
            .handshake_with("pf-tampered", "127.0.0.1", relay_port, 1)
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("not authenticated"), "{mode}: {text}");
        relay.finish();
    }
    assert!(prefill.side_channel_refusals().unauthenticated >= 1);
    // Directly, the prefill still serves a reader (a fresh one: this decode backs off
    // from the engine whose handshakes failed).
    engine("dc-direct")
        .handshake_with("pf-tampered", "127.0.0.1", port(&prefill), 1)
        .await
        .unwrap();
}

/// Sends `message` to `prefill` from the Python NIXL agent `peer`, which loaded its metadata.
fn notify(peer: &mut py::Peer, prefill: &KvConnectorWorker, message: &[u8]) {
    peer.call(&format!(
        "notify {} {}",
        prefill.agent().name(),
        py::hex(message)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_without_the_params_and_impostors_free_nothing() {
    let prefill = engine("pf-forged");
    let decode = engine("dc-forged");
    let far = Instant::now() + Duration::from_secs(60);
    prefill.hold_for_decode("victim", far, Some(&capability()));
    // The real decode handshakes first: its agent's name is a reader's.
    decode
        .handshake_with("pf-forged", "127.0.0.1", port(&prefill), 1)
        .await
        .unwrap();

    // An attacker with the secret handshakes as a reader of its own, with the metadata of a
    // NIXL agent of its own (a real decode's message, its agent renamed).
    let mut thief = py::Peer::start("thief-agent", 64);
    let mut ours = decode.handshake().unwrap();
    ours.agent_name = "thief-agent".into();
    let message = rmp_serde::to_vec_named(&ours).unwrap();
    let mut prove = Attacker::start(&[
        "prove",
        &port(&prefill).to_string(),
        SECRET,
        &py::hex(&message),
    ]);
    let answer = prove.next();
    prove.finish();
    let metadata = answer["agent_metadata"]
        .as_str()
        .expect("the attacker's handshake passed");
    thief.load(&py::unhex(metadata));
    // An impostor: a NIXL agent that took the real decode's name.
    let mut impostor = py::Peer::start(decode.agent().name(), 64);
    impostor.load(&py::unhex(metadata));

    let wrong_tag = "ab".repeat(32);
    for (peer, sender) in [
        (&mut thief, "thief-agent"),
        (&mut impostor, decode.agent().name()),
    ] {
        for message in [
            "victim:1".to_string(),
            format!("victim:1:{wrong_tag}"),
            format!("HB:victim#{wrong_tag}"),
            "HB:victim".to_string(),
        ] {
            notify(peer, &prefill, message.as_bytes());
        }
        tracing::info!(sender, "forged notifications sent");
    }
    // Every one arrives, and is refused or malformed; the request stays held.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let freed = prefill.finished();
        assert!(
            freed.sending.is_empty(),
            "a forged notification freed {freed:?}"
        );
        let notes = prefill.notification_stats();
        if notes.refused + notes.malformed >= 8 {
            assert!(notes.refused >= 3, "{notes:?}");
            assert_eq!(notes.leases_extended, 0, "{notes:?}");
            break;
        }
        assert!(Instant::now() < deadline, "notifications lost: {notes:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The real decode, which got the params, frees it.
    decode
        .start_load(
            "victim",
            &[0],
            &remote(&prefill, "pf-forged", "victim", vec![2], 1),
        )
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if prefill.finished().sending == ["victim"] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the real decode's notification did not free it"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(thief);
    drop(impostor);
}

/// A log writer that counts the warning lines of the side channel.
#[derive(Clone, Default)]
struct Counted(Arc<Mutex<Vec<u8>>>);

impl Write for Counted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_garbage_storm_leaves_a_bounded_log_and_the_server_serves() {
    let log = Counted::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let spec = spec(2);
            let secret = || Some(SharedSecret::new(SECRET.as_bytes()).unwrap());
            let prefill = worker_with("pf-storm", 0, 1, &spec, |c| c.secret = secret());
            fill(&prefill, &spec);
            let decode = worker_with("dc-storm", 0, 1, &spec, |c| c.secret = secret());
            let storm = Attacker::start(&["storm", &port(&prefill).to_string(), "3"]);
            let answers = tokio::task::spawn_blocking(move || storm.finish())
                .await
                .unwrap();
            let connections = answers[0]["connections"].as_u64().unwrap();
            // Let the last refusals land before counting.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let refusals = prefill.side_channel_refusals();
            decode
                .handshake_with("pf-storm", "127.0.0.1", port(&prefill), 1)
                .await
                .expect("the server still serves a real reader");
            let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
            let lines = text.lines().filter(|l| l.contains("side channel")).count();
            // Each of the 7 kinds is logged at most 1 + log2(its count) times.
            let bound = 7 * (1 + 64 - connections.leading_zeros() as usize);
            assert!(connections >= 200, "the storm ran: {connections}");
            assert!(
                refusals.total() >= connections / 2,
                "{refusals:?} of {connections}"
            );
            assert!(
                lines <= bound,
                "{lines} log lines for {connections} connections (bound {bound}): {refusals:?}"
            );
        });
    });
}

#[test]
fn a_secret_file_readable_by_others_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secret");
    std::fs::write(&file, SECRET).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut config = nixl::kv_config::KvTransferConfig::from_json(
        r#"{"kv_connector": "NixlConnector", "kv_role": "kv_both"}"#,
    )
    .unwrap();
    config.kv_connector_extra_config.insert(
        "auth_secret_file".into(),
        Value::String(file.display().to_string()),
    );
    let err = SharedSecret::from_kv_transfer_config(&config)
        .unwrap_err()
        .to_string();
    assert!(err.contains("chmod 600") && err.contains("0644"), "{err}");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(SharedSecret::from_kv_transfer_config(&config)
        .unwrap()
        .is_some());
}

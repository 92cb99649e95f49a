//! A prefill process that answers the handshake with the decode's own UCX worker address
//! (it has it from the decode's handshake), under its own agent name and with the decode's
//! own layer addresses, cannot make the decode read its own memory: the load fails, naming
//! the refusal, and the decode's cache keeps its bytes.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{block, fill, pattern, poll_until, printed_port, remote, role_process, spec, worker};
use nixl_connector::{Channel, HandshakeMessage};
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

const ROLE_ENV: &str = "NIXL_CONNECTOR_TEST_FORGER_ROLE";
const FORGER_AGENT: &str = "pf-forger-agent";

/// The side channel's request, as the connector encodes it.
#[derive(Serialize, Deserialize)]
enum Request {
    Handshake(Box<HandshakeMessage>),
}

/// The side channel's answer, as the connector encodes it.
#[derive(Serialize, Deserialize)]
enum Response {
    Accepted(Box<HandshakeMessage>),
}

/// `metadata` with its agent name replaced by `name` (the container's first field).
fn renamed(metadata: &[u8], name: &str) -> Vec<u8> {
    const NAME_LEN_AT: usize = b"nixlSerDes|Agent".len();
    let old = u64::from_le_bytes(metadata[NAME_LEN_AT..NAME_LEN_AT + 8].try_into().unwrap());
    let mut out = metadata[..NAME_LEN_AT].to_vec();
    out.extend_from_slice(&(name.len() as u64).to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&metadata[NAME_LEN_AT + 8 + old as usize..]);
    out
}

/// The forging prefill, run in a child process: answers every handshake with the reader's
/// own metadata and cache addresses under its own names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill of a_prefill_answering_with_the_decodes_own_worker_is_refused, which starts it"]
async fn forger_role() {
    assert!(
        std::env::var_os(ROLE_ENV).is_some(),
        "run by the parent test"
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("PORT {}", listener.local_addr().unwrap().port());
    let serve = async {
        loop {
            let (stream, peer) = listener.accept().await.unwrap();
            let mut channel = Channel::new(stream, peer.to_string(), 1 << 20);
            let Ok(Request::Handshake(theirs)) = channel.recv().await else {
                continue;
            };
            let forged = HandshakeMessage {
                engine_id: "pf-forger".to_string(),
                agent_name: FORGER_AGENT.to_string(),
                agent_metadata: renamed(&theirs.agent_metadata, FORGER_AGENT),
                ..*theirs
            };
            let _ = channel.send(&Response::Accepted(Box::new(forged))).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(60), serve).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_answering_with_the_decodes_own_worker_is_refused() {
    common::init_tracing();
    let mut child = role_process("forger_role", &[(ROLE_ENV, "1")], Stdio::null());
    let port = printed_port(&mut child);
    let spec = spec(2);
    let decode = worker("dc-forged", 0, 1, &spec);
    // The decode's own cache holds what a prefill would have: the forged load would read
    // its blocks 4 and 5 into its blocks 0 and 1.
    fill(&decode, &spec);
    let mut from = remote(&decode, "pf-forger", "forged", vec![4, 5], 1);
    from.port = port;
    decode.start_load("forged", &[0, 1], &from).unwrap();
    let done = poll_until(&decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(done.recving, ["forged"]);
    assert_eq!(decode.load_errors(), [0, 1]);
    let failure = decode.metrics()[0]
        .failure
        .clone()
        .expect("the load failed");
    assert!(failure.contains("leads into this process"), "{failure}");
    for layer in 0..spec.num_regions() {
        for id in 0..spec.num_blocks {
            let want: Vec<u8> = (0..spec.block_len(0))
                .map(|o| pattern(layer, id, o))
                .collect();
            assert!(
                block(&decode, &spec, layer, id) == want,
                "layer {layer} block {id} changed"
            );
        }
    }
}

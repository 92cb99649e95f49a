//! nixl-connector's vLLM protocol pieces against a Python peer that speaks vLLM 0.33's
//! side channel with vLLM's own wire libraries (pyzmq REQ/ROUTER, msgspec), written from
//! the wire format (tests/py/vllm_peer.py): the handshake both ways, the compatibility
//! hash, the notification formats, and hostile requests.

mod py;
#[path = "../nixl-connector/tests/vllm_support/mod.rs"]
mod vllm_support;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use nixl_connector::vllm::notify::{encode_done, encode_heartbeat, parse, NotificationLimits};
use nixl_connector::vllm::{
    Compatibility, CompatibilityFactors, MetadataClient, MetadataServer, NixlAgentMetadata,
    NixlHandshakePayload, SpeculativeFactors, VllmChannelLimits, VllmNotification,
};
use nixl_connector::Error;
use py::{hex, unhex};
use serde_json::{json, Value};
use vllm_support::factors;

/// A running tests/py/vllm_peer.py.
struct VllmPeer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl VllmPeer {
    fn start() -> VllmPeer {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/vllm_peer.py");
        let mut child = Command::new(py::python())
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start tests/py/vllm_peer.py");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        VllmPeer {
            child,
            stdin,
            stdout,
        }
    }

    /// Sends one command and returns its answer (blocking: run it off the async workers).
    fn call(&mut self, command: &str) -> String {
        tokio::task::block_in_place(|| {
            writeln!(self.stdin, "{command}").expect("write peer");
            self.stdin.flush().unwrap();
            loop {
                let mut line = String::new();
                let n = self.stdout.read_line(&mut line).expect("read peer");
                assert!(n > 0, "the Python peer exited");
                if let Some(rest) = line.strip_prefix("@@ ") {
                    return rest.trim_end().to_string();
                }
            }
        })
    }

    fn json(&mut self, command: &str) -> Value {
        serde_json::from_str(&self.call(command)).expect("peer JSON")
    }
}

impl Drop for VllmPeer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// What the Python prefill serves for `rank` (its `metadata()`).
fn python_metadata(rank: u64) -> NixlAgentMetadata {
    NixlAgentMetadata {
        engine_id: "py-prefill".into(),
        agent_metadata: format!("py-agent-md-{rank}").into_bytes(),
        kv_caches_base_addr: vec![0x7F00_0000_0000 + rank * 0x1000, u64::MAX],
        device_id: rank,
        num_blocks: 32,
        block_lens: vec![4096, 4096],
        block_strides: vec![4096, 8192],
        kv_cache_layout: "HND".into(),
        block_size: 16,
        attn_backend_name: "FLASH_ATTN".into(),
        region_num_blocks: Some(vec![32, 32]),
        region_group_ids: Some(vec![0, 1]),
        region_names: Some(vec!["model.layers.0".into(), "model.layers.1".into()]),
        region_mem_types: Some(vec!["VRAM".into(), "VRAM".into()]),
        region_members: vec![
            vec!["model.layers.0.attn".into()],
            vec!["model.layers.1.attn".into(), "x".into()],
        ],
        packed_member_layouts: BTreeMap::from([("model.layers.0.attn".into(), (0, 2048))]),
        ..NixlAgentMetadata::default()
    }
}

/// What the Rust prefill serves for `rank`: every optional field set, odd values included.
fn rust_metadata(rank: u64) -> NixlAgentMetadata {
    NixlAgentMetadata {
        engine_id: "rust-prefill".into(),
        agent_metadata: (0..=255u8).cycle().take(3000).collect(),
        kv_caches_base_addr: vec![0x7f12_3456_0000 + rank, 1, u64::MAX],
        device_id: rank,
        num_blocks: 70_000,
        block_lens: vec![65_536, 300, 200],
        block_strides: vec![65_536, 300, 1 << 33],
        kv_cache_layout: "NHD".into(),
        block_size: 16,
        ssm_sizes: (1024, 1 << 20),
        attn_backend_name: "FLASHINFER".into(),
        physical_blocks_per_logical_kv_block: 2,
        region_num_blocks: Some(vec![70_000, 10, 0]),
        region_group_ids: Some(vec![0, 1, 2]),
        region_names: Some(vec!["a".into(), "ü€".into(), "x".repeat(40)]),
        region_mem_types: Some(vec!["DRAM".into(), "VRAM".into(), "VRAM".into()]),
        dcp_size: 2,
        pcp_size: 1,
        ple_block_len: Some(512),
        region_members: vec![vec![], vec!["l1".into(), "l2".into()], vec!["l3".into()]],
        packed_member_layouts: BTreeMap::from([
            ("l1".into(), (0, 300)),
            ("l2".into(), (300, 70_000)),
        ]),
    }
}

fn limits() -> VllmChannelLimits {
    VllmChannelLimits {
        deadline: Duration::from_secs(5),
        max_connections: 8,
        ..VllmChannelLimits::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_fetches_from_a_python_prefill_and_checks_its_hash() {
    let mut peer = VllmPeer::start();
    let ours = Compatibility::new(&factors(), true);
    let port: u16 = peer
        .call(&format!("serve {} 0:0,0:1 0 0", ours.hash))
        .parse()
        .unwrap();

    // Both ranks on one REQ connection, as vLLM's decode asks them.
    let mut client = MetadataClient::connect("127.0.0.1", port, limits())
        .await
        .unwrap();
    for rank in 0..2 {
        let reply = client.get_meta(0, rank).await.unwrap();
        let meta = ours.check(&reply.payload, client.peer()).unwrap();
        assert_eq!(meta, python_metadata(u64::from(rank)));
        assert!(reply.remote_clock > 0.0 && reply.rtt() >= 0.0);
    }

    // Another hash is refused, naming both; accepted with the check off.
    let other = Compatibility::new(
        &CompatibilityFactors {
            cache_dtype: "fp8".into(),
            ..factors()
        },
        true,
    );
    let reply = client.get_meta(0, 0).await.unwrap();
    let err = other.check(&reply.payload, client.peer()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::CompatibilityMismatch { .. }), "{text}");
    assert!(
        text.contains(&ours.hash) && text.contains(&other.hash),
        "{text}"
    );
    let off = Compatibility {
        enforce: false,
        ..other
    };
    assert_eq!(off.check(&reply.payload, "py").unwrap(), python_metadata(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_from_a_newer_python_prefill_are_ignored_and_oversized_payloads_refused() {
    let mut peer = VllmPeer::start();
    let ours = Compatibility::new(&factors(), true);
    let port: u16 = peer
        .call(&format!("serve {} 0:0 1 0", ours.hash))
        .parse()
        .unwrap();
    let mut client = MetadataClient::connect("127.0.0.1", port, limits())
        .await
        .unwrap();
    let reply = client.get_meta(0, 0).await.unwrap();
    assert_eq!(
        ours.check(&reply.payload, "py").unwrap(),
        python_metadata(0)
    );

    let small = VllmChannelLimits {
        max_payload: 64 << 10,
        ..limits()
    };
    let port: u16 = peer
        .call(&format!("serve {} 0:0 0 100000", ours.hash))
        .parse()
        .unwrap();
    let start = Instant::now();
    let mut client = MetadataClient::connect("127.0.0.1", port, small)
        .await
        .unwrap();
    let err = client.get_meta(0, 0).await.unwrap_err().to_string();
    assert!(err.contains("over the 65536-byte cap"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

async fn rust_prefill(limits: VllmChannelLimits) -> (MetadataServer, String) {
    let server = MetadataServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), limits)
        .await
        .unwrap();
    let hash = factors().hash();
    for rank in 0..2 {
        let payload = NixlHandshakePayload::new(&hash, &rust_metadata(rank));
        server.publish(0, rank as u32, &payload);
    }
    (server, hash)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_fetches_from_a_rust_prefill_in_vllms_field_layout() {
    let mut peer = VllmPeer::start();
    let (server, hash) = rust_prefill(limits()).await;
    let port = server.local_addr().port();

    for rank in 0..2u64 {
        let got = peer.json(&format!("fetch {port} 0 {rank} {hash} 1"));
        let meta = &got["meta"];
        let ours = rust_metadata(rank);
        assert_eq!(meta["engine_id"], "rust-prefill", "{got}");
        assert_eq!(meta["agent_metadata"], hex(&ours.agent_metadata));
        assert_eq!(meta["kv_caches_base_addr"], json!(ours.kv_caches_base_addr));
        assert_eq!(meta["device_id"], rank);
        assert_eq!(meta["num_blocks"], 70_000);
        assert_eq!(meta["block_strides"], json!([65_536, 300, 1u64 << 33]));
        assert_eq!(meta["ssm_sizes"], json!([1024, 1 << 20]));
        assert_eq!(meta["region_names"], json!(["a", "ü€", "x".repeat(40)]));
        assert_eq!(meta["ple_block_len"], 512);
        assert_eq!(meta["dcp_size"], 2);
        assert_eq!(meta["region_members"], json!([[], ["l1", "l2"], ["l3"]]));
        assert_eq!(
            meta["packed_member_layouts"],
            json!({"l1": [0, 300], "l2": [300, 70_000]})
        );
        assert_eq!(got["ssm_sizes_is_tuple"], true);
        // msgspec re-encodes what it decoded to exactly our bytes.
        assert_eq!(got["same_bytes"], true, "{got}");
        assert_eq!(got["payload_same_bytes"], true, "{got}");
        assert!(got["remote_perf"].as_f64().unwrap() >= 0.0);
    }

    // The Python decode refuses another hash, naming both; not with its check off.
    let got = peer.json(&format!("fetch {port} 0 0 {} 1", "f".repeat(64)));
    assert_eq!(got["mismatch"], json!(["f".repeat(64), hash]), "{got}");
    let got = peer.json(&format!("fetch {port} 0 0 {} 0", "f".repeat(64)));
    assert_eq!(got["meta"]["engine_id"], "rust-prefill", "{got}");

    // A rank the Rust prefill lacks: an error reply vLLM's decoder fails on at once.
    let start = Instant::now();
    let got = peer.json(&format!("fetch {port} 0 5 {hash} 1"));
    assert!(start.elapsed() < Duration::from_secs(2));
    let error = got["error"].as_str().unwrap();
    assert!(error.contains("compatibility_hash"), "{got}");
    let reason = got["raw"]["error"].as_str().unwrap();
    assert!(reason.contains("no pp_rank 0 tp_rank 5"), "{got}");
    assert!(peer.json(&format!("fetch {port} 0 1 {hash} 1"))["meta"].is_object());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_python_requests_are_bounded_and_prompt_peers_still_served() {
    let mut peer = VllmPeer::start();
    let (server, hash) = rust_prefill(limits()).await;
    let port = server.local_addr().port();

    // Garbage, a string, wrong arity: an error reply each, at once.
    for (request, expect) in [
        (&b"\xc1\xc1"[..], "not a metadata request"),
        (b"hello", "not a metadata request"),
        (b"\x92\xc4\x0cget_meta_msg\x00", "not a metadata request"),
        (b"\x93\xc4\x03bad\x00\x00", "unknown request"),
    ] {
        let got = peer.json(&format!("raw {port} {}", hex(request)));
        let reason = got["frames"][0]["error"].as_str().unwrap_or_default();
        assert!(reason.contains(expect), "{got}");
        assert!(
            got["vllm"].as_str().unwrap().contains("compatibility_hash"),
            "{got}"
        );
    }

    // A request over the cap: its connection is closed, so it gets no reply.
    let got = peer.json(&format!("raw {port} {}", hex(&[0x90; 4096])));
    assert_eq!(got["error"], "timeout", "{got}");

    // Idle REQ sockets fill every slot; a prompt decode is still served, at once.
    assert_eq!(peer.call(&format!("idle {port} 40")), "ok");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(server.connections() <= limits().max_connections);
    let start = Instant::now();
    let got = peer.json(&format!("fetch {port} 0 0 {hash} 1"));
    assert!(got["meta"].is_object(), "{got}");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compatibility_hashes_match_pythons_byte_for_byte() {
    let mut peer = VllmPeer::start();
    let eagle = SpeculativeFactors {
        method: "eagle3".into(),
        model: "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B".into(),
        revision: None,
        code_revision: Some("abc".into()),
        parallel_drafting: false,
        kv_cache_dtype: "auto".into(),
        auxiliary_layer_ids: Some(vec![1, 15, 29, -1]),
    };
    let sets = [
        factors(),
        CompatibilityFactors {
            speculative_config: Some(eagle.clone()),
            ..factors()
        },
        CompatibilityFactors {
            speculative_config: Some(SpeculativeFactors {
                auxiliary_layer_ids: None,
                revision: Some("main".into()),
                ..eagle
            }),
            is_hma_enabled: false,
            ..factors()
        },
        CompatibilityFactors {
            model: "/models/модель ü€😀 \"q\" \\ \t\n\u{1}\u{7f}".into(),
            dtype: "torch.float16".into(),
            num_kv_heads: u64::MAX,
            head_size: 0,
            transfer_mode: "push".into(),
            ..factors()
        },
    ];
    for factors in sets {
        let json = serde_json::to_string(&factors).unwrap();
        let python = peer.json(&format!("hash {}", hex(json.as_bytes())));
        assert_eq!(python["json"], factors.json(), "{json}");
        assert_eq!(python["hash"], factors.hash(), "{json}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_match_vllms_both_ways() {
    let mut peer = VllmPeer::start();
    let limits = NotificationLimits::default();
    for (id, consumers) in [("cmpl-7f3a-0-1a2b3c4d", 1u32), ("a:b:c", 4), ("ü€ 😀", 2)] {
        let python = unhex(&peer.call(&format!("notify_done {} {consumers}", hex(id.as_bytes()))));
        assert_eq!(encode_done(id, consumers).unwrap(), python);
        assert_eq!(
            parse(&python, &limits).unwrap(),
            VllmNotification::Done {
                request_id: id,
                consumers
            }
        );
        let read = peer.json(&format!("parse_notif {}", hex(&python)));
        assert_eq!(read, json!({"id": id, "consumers": consumers}));
    }
    let ids = ["r1", "r:2", "ü"];
    let joined: Vec<String> = ids.iter().map(|id| hex(id.as_bytes())).collect();
    let python = unhex(&peer.call(&format!("notify_hb {}", joined.join(","))));
    assert_eq!(encode_heartbeat(ids).unwrap(), python);
    assert_eq!(
        parse(&python, &limits).unwrap(),
        VllmNotification::Heartbeat {
            request_ids: ids.to_vec()
        }
    );
    assert_eq!(
        peer.json(&format!("parse_notif {}", hex(&python))),
        json!({"hb": ids})
    );
}

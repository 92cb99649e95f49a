//! nixl-connector's vLLM protocol against a Python peer that speaks vLLM 0.33's side
//! channel with vLLM's own wire libraries (pyzmq REQ/ROUTER, msgspec) and moves KV blocks
//! with NIXL's Python agent, written from the wire format (tests/py/vllm_peer.py): the
//! handshake both ways, the compatibility hash, the notification formats, hostile requests;
//! and whole loads both ways between a connector worker in vLLM mode and the Python engine,
//! every byte checked, the notifications and heartbeats compared byte for byte, also after
//! either engine registered its KV cache again (vLLM's sleep mode, a new registration
//! generation).

mod py;
mod vllm_peer_support;
#[path = "../nixl-connector/tests/vllm_support/mod.rs"]
mod vllm_support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::kv_config::KvTransferConfig;
use nixl::platform::BuiltinPlatform;
use nixl_connector::vllm::notify::{encode_done, encode_heartbeat, parse, NotificationLimits};
use nixl_connector::vllm::{
    Compatibility, CompatibilityFactors, MetadataClient, MetadataServer, NixlAgentMetadata,
    NixlHandshakePayload, SpeculativeFactors, VllmChannelLimits, VllmNotification,
};
use nixl_connector::{
    Error, FinishStatus, KvCacheGroups, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker,
    KvTransferParams, LoadOutcome, NotificationStats, SchedulerConfig, WorkerConfig, WorkerOutput,
    KV_CACHE_GROUPS_KEY,
};
use py::{hex, unhex};
use serde_json::{json, Value};
use vllm_peer_support::{
    fill_rust_prefill, kv_spec, python_byte_of, rust_byte_of, vllm_engine_with, vllm_kv, VllmPeer,
    BLOCKS, BLOCK_LEN, REGIONS,
};
use vllm_support::factors;

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

/// The bytes of region `region` of a Python prefill, as tests/py/vllm_peer.py's `kv_byte`
/// fills them (byte `i` from the region's start).
fn python_byte(region: usize, i: usize) -> u8 {
    python_byte_of(0, region, i)
}

/// A vLLM-mode engine of TP 1: its worker (cache of [`kv_spec`], its own ROUTER) and its
/// scheduler.
fn vllm_engine(
    engine: &str,
    factors: &CompatibilityFactors,
) -> (KvConnectorWorker, KvConnectorScheduler) {
    vllm_engine_with(engine, vllm_kv(factors))
}

/// The sliding window of the hybrid engines' second KV cache group, in tokens: with blocks
/// of 16 tokens it needs 3 blocks (2 it spans, one more for a window starting inside one).
const WINDOW_TOKENS: usize = 20;

/// [`vllm_kv`] for a hybrid model: a full-attention KV cache group and one of a sliding
/// window of [`WINDOW_TOKENS`], sharing every region.
fn hybrid_kv(factors: &CompatibilityFactors) -> KvTransferConfig {
    let mut kv = vllm_kv(factors);
    kv.kv_connector_extra_config.insert(
        KV_CACHE_GROUPS_KEY.into(),
        json!({"block_size": 16, "groups": ["full_attention", {"sliding_window": {"window_tokens": WINDOW_TOKENS}}]}),
    );
    kv
}

/// A Python prefill engine serving [`kv_spec`]'s geometry under `hash`; `extra` adds keys
/// vLLM 0.33 does not know, `lie` claims base addresses past its buffers. Its port.
fn python_prefill(peer: &mut VllmPeer, hash: &str, extra: bool, lie: bool) -> u16 {
    let got = peer.json(&format!(
        "kv_prefill {hash} {} {} py-engine {REGIONS} {BLOCKS} {BLOCK_LEN} 16",
        u8::from(extra),
        u8::from(lie)
    ));
    got["port"].as_u64().unwrap() as u16
}

/// Loads the Python prefill's `request` in `remote` blocks into `local` through the decode's
/// scheduler and worker, from vLLM's JSON params; the outcome.
async fn load_from_python(
    peer: &mut VllmPeer,
    (decode, scheduler): (&KvConnectorWorker, &mut KvConnectorScheduler),
    request: &str,
    remote: &[usize],
    local: &[usize],
) -> LoadOutcome {
    let blocks: Vec<String> = remote.iter().map(usize::to_string).collect();
    let json = peer.call(&format!(
        "kv_finish {} {}",
        hex(request.as_bytes()),
        blocks.join(",")
    ));
    let params = KvTransferParams::from_vllm_json(&json).unwrap();
    scheduler.on_new_request(request, Some(&params));
    scheduler
        .update_state_after_alloc(request, local, &params)
        .unwrap();
    decode.start_load_kv(&scheduler.build_connector_meta());
    let start = Instant::now();
    loop {
        let finished = decode.finished();
        if finished.recving.iter().any(|r| r == request) {
            let errors = decode.load_errors();
            let output = WorkerOutput {
                tp_rank: 0,
                pp_rank: 0,
                finished,
                load_errors: errors,
            };
            let mut outcomes = scheduler
                .update_connector_output(&[output])
                .unwrap()
                .load_outcomes;
            assert_eq!(outcomes.len(), 1, "{outcomes:?}");
            return outcomes.remove(0);
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the load never ended"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Writes 0xEE over every region of `decode`'s cache of [`BLOCKS`] blocks of `len` bytes,
/// where a load leaves blocks untouched.
fn fill_untouched(decode: &KvConnectorWorker, len: usize) {
    let cache = decode.kv_caches().unwrap();
    for region in 0..REGIONS {
        cache.write(region, 0, &vec![0xEE; BLOCKS * len]).unwrap();
    }
}

/// Checks that `local` blocks of `decode` hold the Python prefill's `remote` blocks.
fn holds_python_blocks(decode: &KvConnectorWorker, local: &[usize], remote: &[usize]) {
    holds_python_blocks_of(decode, 0, local, remote);
}

/// [`holds_python_blocks`] of the Python prefill's registration after `salt` others.
fn holds_python_blocks_of(
    decode: &KvConnectorWorker,
    salt: usize,
    local: &[usize],
    remote: &[usize],
) {
    let cache = decode.kv_caches().unwrap();
    for region in 0..REGIONS {
        for (&l, &r) in local.iter().zip(remote) {
            let mut got = vec![0u8; BLOCK_LEN];
            cache.read(region, l * BLOCK_LEN, &mut got).unwrap();
            let want: Vec<u8> = (0..BLOCK_LEN)
                .map(|o| python_byte_of(salt, region, r * BLOCK_LEN + o))
                .collect();
            assert!(got == want, "region {region} local block {l} (remote {r})");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_pulls_every_byte_from_a_python_prefill_then_notifies_and_heartbeats() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let port = python_prefill(&mut peer, &hash, false, false);
    let (decode, mut scheduler) = vllm_engine("rs-decode", &factors());

    let (remote, local) = ([3, 9, 14], [0, 1, 2]);
    let outcome = load_from_python(
        &mut peer,
        (&decode, &mut scheduler),
        "py-req-1",
        &remote,
        &local,
    )
    .await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds_python_blocks(&decode, &local, &remote);
    assert!(decode.load_errors().is_empty());

    // Two requests wait for blocks: the next step heartbeats the Python engine for both.
    for request in ["py-wait-1", "py-wait-2"] {
        let json = peer.call(&format!("kv_finish {} 1", hex(request.as_bytes())));
        let params = KvTransferParams::from_vllm_json(&json).unwrap();
        assert_eq!(params.remote_port, Some(port));
        scheduler.on_new_request(request, Some(&params));
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let meta = scheduler.build_connector_meta();
    assert_eq!(meta.heartbeats.len(), 1, "{meta:?}");
    decode.start_load_kv(&meta);

    let notes = peer.json("kv_notifs 2 10");
    let agent = decode.agent().name();
    assert_eq!(notes[0]["from"], agent, "{notes}");
    assert_eq!(unhex(notes[0]["hex"].as_str().unwrap()), b"py-req-1:1");
    assert_eq!(notes[0]["vllm"], json!({"id": "py-req-1", "consumers": 1}));
    assert_eq!(notes[1]["from"], agent, "{notes}");
    let heartbeat = unhex(notes[1]["hex"].as_str().unwrap());
    assert!(
        heartbeat == b"HB:py-wait-1,py-wait-2" || heartbeat == b"HB:py-wait-2,py-wait-1",
        "{notes}"
    );
    let mut ids: Vec<String> =
        serde_json::from_value(notes[1]["vllm"]["hb"].clone()).expect("a heartbeat");
    ids.sort();
    assert_eq!(ids, ["py-wait-1", "py-wait-2"]);
}

/// Bytes of one KV head's K (or V) of one token in [`kv_spec`]: its blocks are vLLM 0.33's
/// `LBHNC`, 8 heads of 16 tokens of 4 bytes of K then 4 of V.
const HEAD_BYTES: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_tp2_reads_each_heads_packed_k_and_v_from_a_python_prefill() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    python_prefill(&mut peer, &hash, false, false);
    let full = KvCacheSpec::lbhnc(REGIONS, BLOCKS, 16, 8, 1, HEAD_BYTES);
    assert_eq!(
        full,
        kv_spec(),
        "the Python prefill's cache is vLLM's LBHNC"
    );
    let spec = KvCacheSpec::lbhnc(REGIONS, BLOCKS, 16, 8, 2, HEAD_BYTES);
    let kv = vllm_kv(&factors());
    let ranks = rust_decode_ranks("rs-decode-tp2", 2, &kv, &spec);
    let mut scheduler = KvConnectorScheduler::new(
        SchedulerConfig::new("rs-decode-tp2", "127.0.0.1", 0, 2, &kv).unwrap(),
    );
    let (remote, local) = ([4usize, 12], [7usize, 2]);
    let json = peer.call(&format!("kv_finish {} 4,12", hex(b"py-req-tp2")));
    let params = KvTransferParams::from_vllm_json(&json).unwrap();
    scheduler.on_new_request("py-req-tp2", Some(&params));
    scheduler
        .update_state_after_alloc("py-req-tp2", &local, &params)
        .unwrap();
    let outcomes = load_on_ranks(&ranks, &mut scheduler, |outputs| {
        for output in outputs {
            assert!(output.load_errors.is_empty(), "{:?}", output.load_errors);
        }
    })
    .await;
    assert!(
        matches!(&outcomes[..], [LoadOutcome::Loaded { .. }]),
        "{outcomes:?}"
    );
    // Rank r holds heads 4r..4r+4: in a block of [8 heads, 16 tokens, 4 K + 4 V bytes],
    // its half of the Python block.
    let len = spec.block_len(0);
    for (r, rank) in ranks.iter().enumerate() {
        let cache = rank.kv_caches().unwrap();
        for region in 0..REGIONS {
            for (&l, &b) in local.iter().zip(&remote) {
                let mut got = vec![0u8; len];
                cache.read(region, l * len, &mut got).unwrap();
                for (o, &byte) in got.iter().enumerate() {
                    let (head, token, c) = (
                        o / (16 * 2 * HEAD_BYTES),
                        (o / (2 * HEAD_BYTES)) % 16,
                        o % (2 * HEAD_BYTES),
                    );
                    let at = (((4 * r + head) * 16 + token) * 2 * HEAD_BYTES) + c;
                    assert_eq!(
                        byte,
                        python_byte(region, b * BLOCK_LEN + at),
                        "rank {r} region {region} block {l}: head {head} token {token} {} byte {}",
                        if c < HEAD_BYTES { "K" } else { "V" },
                        c % HEAD_BYTES
                    );
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_reads_every_byte_from_a_rust_prefill_whose_notification_frees_it() {
    let mut peer = VllmPeer::start();
    let (prefill, mut scheduler) = vllm_engine("rs-prefill", &factors());
    fill_rust_prefill(&prefill, 0);
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let remote = [5, 2, 11];
    let finished = scheduler.request_finished(
        "rs-req-1",
        &remote,
        43,
        Some(&for_decode),
        FinishStatus::LengthCapped,
    );
    prefill.start_load_kv(&scheduler.build_connector_meta());
    let params: Value =
        serde_json::from_str(&finished.kv_transfer_params.unwrap().to_vllm_json()).unwrap();
    let port = params["remote_port"].as_u64().unwrap();
    assert_eq!(params["remote_block_ids"], json!([remote]));
    assert_eq!(
        params["remote_num_tokens"], 43,
        "vLLM's num_computed_tokens"
    );
    let hash = factors().hash();

    // Another hash: the Python decode refuses before it decodes the metadata.
    let other = "0".repeat(64);
    let got = peer.json(&format!(
        "kv_decode {port} {other} 1 rs-prefill 5,2,11 {} 1",
        hex(b"rs-req-1")
    ));
    assert_eq!(got["mismatch"], json!([other, hash]), "{got}");

    let got = peer.json(&format!(
        "kv_decode {port} {hash} 1 rs-prefill 5,2,11 {} 1",
        hex(b"rs-req-1")
    ));
    assert_eq!(got["agent"], prefill.agent().name(), "{got}");
    assert_eq!(got["meta"]["kv_cache_layout"], "LBHNC");
    assert_eq!(got["meta"]["block_lens"], json!([BLOCK_LEN, BLOCK_LEN]));
    assert_eq!(got["meta"]["region_group_ids"], json!([0, 0]));
    assert_eq!(got["meta"]["region_mem_types"], json!(["DRAM", "DRAM"]));
    assert_eq!(got["remote_perf_is_float"], true);
    let data = unhex(got["data"].as_str().expect("the blocks read"));
    assert!(
        data == rust_blocks_of(0, &remote),
        "the Python decode read other bytes"
    );

    // The READ's notification "rs-req-1:1" frees the request.
    freed_by_notification(&prefill, "rs-req-1").await;
    assert_eq!(prefill.send_stats().freed_on_notification, 1);
}

/// Loads a Python prefill's request of several KV cache groups into `local` (one list per
/// group, before the decode's clipping) through the decode's scheduler and worker, from
/// vLLM's JSON `params`: the outcome (a refused load's says why).
async fn load_groups_from_python(
    (decode, scheduler): (&KvConnectorWorker, &mut KvConnectorScheduler),
    request: &str,
    params: &str,
    local: &[Vec<usize>],
) -> LoadOutcome {
    let params = KvTransferParams::from_vllm_json(params).unwrap();
    scheduler.on_new_request(request, Some(&params));
    scheduler
        .update_state_after_alloc_groups(request, local, &params)
        .unwrap();
    let mut outcomes = load_on_ranks(std::slice::from_ref(decode), scheduler, |_| {}).await;
    outcomes.pop().unwrap()
}

/// The ranks `0..tp` of a Rust decode engine speaking vLLM's protocol with `kv`, each
/// registering a host cache of `spec`.
fn rust_decode_ranks(
    engine: &str,
    tp: usize,
    kv: &KvTransferConfig,
    spec: &KvCacheSpec,
) -> Vec<KvConnectorWorker> {
    (0..tp)
        .map(|rank| {
            let mut config = WorkerConfig::new(engine, rank, tp, kv.clone());
            config.platform = Arc::new(BuiltinPlatform::CPU);
            let worker = KvConnectorWorker::new(config).unwrap();
            worker.register_host_kv_caches(spec.clone()).unwrap();
            worker
        })
        .collect()
}

/// Starts the loads `scheduler` schedules on every one of a decode's `ranks`, then steps it
/// with every rank's output (each step's seen first by `inspect`) until loads end: their
/// outcomes.
async fn load_on_ranks(
    ranks: &[KvConnectorWorker],
    scheduler: &mut KvConnectorScheduler,
    mut inspect: impl FnMut(&[WorkerOutput]),
) -> Vec<LoadOutcome> {
    let meta = scheduler.build_connector_meta();
    for rank in ranks {
        rank.start_load_kv(&meta);
    }
    let start = Instant::now();
    loop {
        let outputs: Vec<WorkerOutput> = ranks.iter().map(KvConnectorWorker::output).collect();
        inspect(&outputs);
        let step = scheduler.update_connector_output(&outputs).unwrap();
        if !step.load_outcomes.is_empty() {
            return step.load_outcomes;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "no load ended");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// vLLM 0.33's hybrid models: a Python prefill of two KV cache groups sharing every region
/// (`region_group_ids` -1) hands one list of block ids per group, its sliding-window group
/// clipped to the blocks of the window; a Rust decode of the same groups clips its own
/// lists, pairs each group with the tail of the prefill's, and reads every byte of both,
/// leaving its blocks out of the window untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_two_kv_cache_groups_reads_each_groups_blocks_from_a_python_prefill() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let got = peer.json(&format!(
        "kv_prefill {hash} 0 0 py-hybrid {REGIONS} {BLOCKS} {BLOCK_LEN} 16 -1,-1"
    ));
    let port = got["port"].as_u64().unwrap();
    let (decode, mut scheduler) = vllm_engine_with("rs-decode-hybrid", hybrid_kv(&factors()));
    let cache = decode.kv_caches().unwrap();
    let untouched = vec![0xEEu8; BLOCK_LEN];
    for region in 0..REGIONS {
        for block in [1, 2] {
            cache.write(region, block * BLOCK_LEN, &untouched).unwrap();
        }
    }

    // The full-attention group's 4 blocks, and the window group's last 3 of its 5.
    let json = peer.call(&format!(
        "kv_finish {} 1,3,9,14;2,4,5,6,7 {WINDOW_TOKENS}",
        hex(b"py-hybrid-1")
    ));
    let vllm: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(vllm["remote_block_ids"], json!([[1, 3, 9, 14], [5, 6, 7]]));
    let params = KvTransferParams::from_vllm_json(&json).unwrap();
    assert_eq!(params.remote_port, Some(port as u16));
    // The decode's window group allocated 5 blocks too; 1 and 2 are out of the window.
    let local = [vec![0, 8, 10, 11], vec![1, 2, 12, 13, 15]];
    let outcome =
        load_groups_from_python((&decode, &mut scheduler), "py-hybrid-1", &json, &local).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds_python_blocks(
        &decode,
        &[0, 8, 10, 11, 12, 13, 15],
        &[1, 3, 9, 14, 5, 6, 7],
    );
    for region in 0..REGIONS {
        for block in [1, 2] {
            let mut got = vec![0u8; BLOCK_LEN];
            cache.read(region, block * BLOCK_LEN, &mut got).unwrap();
            assert!(
                got == untouched,
                "region {region} block {block}: out of the window, read"
            );
        }
    }
    let notes = peer.json("kv_notifs 1 10");
    assert_eq!(
        notes[0]["vllm"],
        json!({"id": "py-hybrid-1", "consumers": 1})
    );
}

/// vLLM 0.33's hybrid models whose KV cache groups have regions of their own
/// (`region_group_ids` [0, 1]: layer 0 the full-attention group's, layer 1 the window's): a
/// Rust decode of the same layout reads each group's blocks only in its own region (vLLM's
/// `_compute_desc_ids` with region group mapping), leaving every other block untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_reads_each_groups_blocks_only_in_its_own_regions() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    peer.json(&format!(
        "kv_prefill {hash} 0 0 py-own {REGIONS} {BLOCKS} {BLOCK_LEN} 16 0,1"
    ));
    let mut kv = hybrid_kv(&factors());
    kv.kv_connector_extra_config.insert(
        KV_CACHE_GROUPS_KEY.into(),
        json!({"block_size": 16, "groups": ["full_attention", {"sliding_window": {"window_tokens": WINDOW_TOKENS}}], "region_groups": [0, 1]}),
    );
    let (decode, mut scheduler) = vllm_engine_with("rs-decode-own", kv);
    fill_untouched(&decode, BLOCK_LEN);
    let cache = decode.kv_caches().unwrap();
    let json = peer.call(&format!(
        "kv_finish {} 1,3,9,14;2,4,5,6,7 {WINDOW_TOKENS}",
        hex(b"py-own-1")
    ));
    let local = [vec![0, 8, 10, 11], vec![1, 2, 12, 13, 15]];
    let outcome =
        load_groups_from_python((&decode, &mut scheduler), "py-own-1", &json, &local).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    // Region r holds group r's blocks; every other block of it is as it was.
    let groups: [&[(usize, usize)]; 2] = [
        &[(0, 1), (8, 3), (10, 9), (11, 14)],
        &[(12, 5), (13, 6), (15, 7)],
    ];
    for (region, pairs) in groups.iter().enumerate() {
        for block in 0..BLOCKS {
            let mut got = vec![0u8; BLOCK_LEN];
            cache.read(region, block * BLOCK_LEN, &mut got).unwrap();
            let want: Vec<u8> = match pairs.iter().find(|(l, _)| *l == block) {
                Some(&(_, r)) => (0..BLOCK_LEN)
                    .map(|o| python_byte(region, r * BLOCK_LEN + o))
                    .collect(),
                None => vec![0xEE; BLOCK_LEN],
            };
            assert!(got == want, "region {region} block {block}");
        }
    }
}

/// Region `region` of a decode of [`kv_spec`] (8 KV heads of 8-byte tokens, blocks of 16
/// tokens, HND) that held 0xEE everywhere, after a load of `units` (local block, unit of
/// `remote_tokens` tokens in it, remote block) from a Python prefill of blocks of
/// `remote_tokens` tokens of the same heads.
fn decode_after(region: usize, units: &[(usize, usize, usize)], remote_tokens: usize) -> Vec<u8> {
    const HEADS: usize = 8;
    const TOKEN: usize = 8;
    let mut out = vec![0xEE; BLOCKS * BLOCK_LEN];
    for &(local, unit, remote) in units {
        for head in 0..HEADS {
            for token in 0..remote_tokens {
                for byte in 0..TOKEN {
                    let at = local * BLOCK_LEN
                        + head * 16 * TOKEN
                        + (unit * remote_tokens + token) * TOKEN
                        + byte;
                    let from = remote * HEADS * remote_tokens * TOKEN
                        + head * remote_tokens * TOKEN
                        + token * TOKEN
                        + byte;
                    out[at] = python_byte(region, from);
                }
            }
        }
    }
    out
}

/// Checks every byte of `decode`'s cache against [`decode_after`].
fn holds_python_units(
    decode: &KvConnectorWorker,
    units: &[(usize, usize, usize)],
    remote_tokens: usize,
) {
    holds_python_units_and(decode, units, remote_tokens, |_, _| {});
}

/// [`holds_python_units`], with what else each region must hold (a state block's bytes)
/// written into its expected bytes by `and(region, want)`.
fn holds_python_units_and(
    decode: &KvConnectorWorker,
    units: &[(usize, usize, usize)],
    remote_tokens: usize,
    and: impl Fn(usize, &mut [u8]),
) {
    let cache = decode.kv_caches().unwrap();
    for region in 0..REGIONS {
        let mut want = decode_after(region, units, remote_tokens);
        and(region, &mut want);
        let mut got = vec![0u8; want.len()];
        cache.read(region, 0, &mut got).unwrap();
        if let Some(at) = (0..want.len()).find(|&i| got[i] != want[i]) {
            panic!(
                "region {region}: byte {} of block {} is {:#04x}, want {:#04x}",
                at % BLOCK_LEN,
                at / BLOCK_LEN,
                got[at],
                want[at]
            );
        }
    }
}

/// A hybrid vLLM 0.33 prefill whose kernel blocks are smaller than its logical ones
/// (`physical_blocks_per_logical_kv_block` 2: block ids of 32 tokens, kernel blocks of 16,
/// as vLLM's HMA has them when the attention kernel's block is smaller): a Rust decode of
/// 16-token blocks reads each group's kernel blocks at their tokens of a 70-token prompt,
/// the prefill's window clipped in its 32-token blocks (2 ids), the decode's in its own (3
/// blocks); the kernel blocks past the prompt's last token are not read, nor is anything
/// outside the groups' lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_two_kv_cache_groups_reads_the_kernel_blocks_of_larger_python_blocks() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    peer.json(&format!(
        "kv_prefill {hash} 0 0 py-ppl {REGIONS} {BLOCKS} {BLOCK_LEN} 16 -1,-1 2"
    ));
    let (decode, mut scheduler) = vllm_engine_with("rs-decode-ppl", hybrid_kv(&factors()));
    fill_untouched(&decode, BLOCK_LEN);
    let json = peer.call(&format!(
        "kv_finish {} 1,4,6;2,5,7 {WINDOW_TOKENS} 70",
        hex(b"py-ppl-1")
    ));
    let vllm: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(vllm["remote_block_ids"], json!([[1, 4, 6], [5, 7]]));
    let local = [vec![0, 3, 5, 6, 9], vec![1, 2, 10, 11, 12]];
    let outcome =
        load_groups_from_python((&decode, &mut scheduler), "py-ppl-1", &json, &local).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    // Ids 1, 4, 6 are kernel blocks 2 3, 8 9, 12 (13 past the prompt); the window's 5, 7
    // are 10 11, 14 (15 past it), at the prompt's kernel blocks 2 to 4.
    holds_python_units(
        &decode,
        &[
            (0, 0, 2),
            (3, 0, 3),
            (5, 0, 8),
            (6, 0, 9),
            (9, 0, 12),
            (10, 0, 10),
            (11, 0, 11),
            (12, 0, 14),
        ],
        16,
    );
    let notes = peer.json("kv_notifs 1 10");
    assert_eq!(notes[0]["vllm"], json!({"id": "py-ppl-1", "consumers": 1}));
}

/// A vLLM 0.33 prefill (one KV cache group) whose block ids are two 16-token kernel blocks
/// each, for a 40-token prompt: a Rust decode of 16-token blocks reads the three kernel
/// blocks holding the prompt, not the fourth past its end, where it refused the load (the
/// kernel blocks named more tokens than `remote_num_tokens`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_reads_the_kernel_blocks_of_a_python_prompt_ending_inside_a_block_id() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    peer.json(&format!(
        "kv_prefill {hash} 0 0 py-ppl-one {REGIONS} {BLOCKS} {BLOCK_LEN} 16 - 2"
    ));
    let (decode, mut scheduler) = vllm_engine("rs-decode-ppl-one", &factors());
    fill_untouched(&decode, BLOCK_LEN);
    let json = peer.call(&format!("kv_finish {} 2,5 0 40", hex(b"py-ppl-one-1")));
    let outcome = load_groups_from_python(
        (&decode, &mut scheduler),
        "py-ppl-one-1",
        &json,
        &[vec![7, 1, 12]],
    )
    .await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    // Ids 2 and 5: kernel blocks 4 5 and 10 (11 holds no token of the prompt).
    holds_python_units(&decode, &[(7, 0, 4), (1, 0, 5), (12, 0, 10)], 16);
}

/// A hybrid vLLM 0.33 prefill of 8-token blocks read by a Rust decode of 16-token blocks
/// (vLLM's `block_size_ratio` 2): each decode block takes two prefill blocks, a head at a
/// time, at their tokens of a 60-token prompt; the prefill's window clipped to 4 of its
/// blocks, the decode's to 3 of its own, the first of which holds tokens the prefill's
/// list does not name and is not read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_two_kv_cache_groups_reads_smaller_python_blocks_into_its_own() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let (small_blocks, small_len) = (2 * BLOCKS, BLOCK_LEN / 2);
    peer.json(&format!(
        "kv_prefill {hash} 0 0 py-ratio {REGIONS} {small_blocks} {small_len} 8 -1,-1"
    ));
    let (decode, mut scheduler) = vllm_engine_with("rs-decode-ratio", hybrid_kv(&factors()));
    fill_untouched(&decode, BLOCK_LEN);
    let json = peer.call(&format!(
        "kv_finish {} 3,5,7,9,11,13,15,17;20,21,22,23,24,25,26,27 {WINDOW_TOKENS} 60",
        hex(b"py-ratio-1")
    ));
    let vllm: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        vllm["remote_block_ids"][1],
        json!([24, 25, 26, 27]),
        "ceil(20 / 8) + 1 blocks"
    );
    let local = [vec![0, 2, 4, 6], vec![1, 3, 8, 9]];
    let outcome =
        load_groups_from_python((&decode, &mut scheduler), "py-ratio-1", &json, &local).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds_python_units(
        &decode,
        &[
            (0, 0, 3),
            (0, 1, 5),
            (2, 0, 7),
            (2, 1, 9),
            (4, 0, 11),
            (4, 1, 13),
            (6, 0, 15),
            (6, 1, 17),
            (8, 0, 24),
            (8, 1, 25),
            (9, 0, 26),
            (9, 1, 27),
        ],
        8,
    );
}

/// A Rust prefill of two KV cache groups publishes its regions as shared by every group
/// (vLLM's `region_group_ids` -1, what a vLLM decode of the same hybrid model compares
/// with its own) and hands one list per group, the window group's clipped; a Python decode
/// reads them all across every region, as vLLM's does, and its notification frees the
/// request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_reads_both_kv_cache_groups_of_a_rust_prefill() {
    let mut peer = VllmPeer::start();
    let (prefill, mut scheduler) = vllm_engine_with("rs-prefill-hybrid", hybrid_kv(&factors()));
    fill_rust_prefill(&prefill, 0);
    let blocks = [vec![5, 2, 11, 3], vec![0, 0, 7, 8, 9]];
    let params = finish_groups_for_decode((&prefill, &mut scheduler), "rs-hybrid-1", &blocks, 60);
    assert_eq!(
        params["remote_block_ids"],
        json!([[5, 2, 11, 3], [7, 8, 9]])
    );
    let port = params["remote_port"].as_u64().unwrap();
    let hash = factors().hash();
    let got = peer.json(&format!(
        "kv_decode {port} {hash} 1 rs-prefill-hybrid 5,2,11,3,7,8,9 {} 1",
        hex(b"rs-hybrid-1")
    ));
    assert_eq!(got["meta"]["region_group_ids"], json!([-1, -1]), "{got}");
    let data = unhex(got["data"].as_str().expect("the blocks read"));
    assert!(
        data == rust_blocks_of(0, &[5, 2, 11, 3, 7, 8, 9]),
        "the Python decode read other bytes"
    );
    freed_by_notification(&prefill, "rs-hybrid-1").await;
}

/// The conv sub-projections (Mamba2's x, B, C) and temporal state of the SSM engines'
/// Mamba page, in bytes, as the Python peer takes them: 104 bytes of a 1 KiB page, the rest
/// padding.
const SSM_CONV: [usize; 3] = [24, 8, 8];
const SSM_TEMPORAL: usize = 64;
const SSM_ARG: &str = "24,8,8/64";

/// [`vllm_kv`] for a hybrid model of a full-attention KV cache group and a Mamba group of
/// one speculative block, sharing every region (vLLM's Nemotron-H-style registration), at
/// TP `tp`: a rank holds a `tp`-th of each part of the state.
fn ssm_kv(factors: &CompatibilityFactors, tp: usize) -> KvTransferConfig {
    let mut kv = vllm_kv(factors);
    let conv: Vec<usize> = SSM_CONV.iter().map(|c| c / tp).collect();
    kv.kv_connector_extra_config.insert(
        KV_CACHE_GROUPS_KEY.into(),
        json!({"block_size": 16, "groups": ["full_attention", {"ssm": {"speculative_blocks": 1}}],
            "ssm_state": {"conv_bytes": conv, "temporal_bytes": SSM_TEMPORAL / tp}}),
    );
    kv
}

/// [`ssm_kv`] at TP 1 with `kv_cache_groups.{key}` set to `value`.
fn ssm_kv_with(key: &str, value: Value) -> KvTransferConfig {
    let mut kv = ssm_kv(&factors(), 1);
    kv.kv_connector_extra_config
        .get_mut(KV_CACHE_GROUPS_KEY)
        .unwrap()[key] = value;
    kv
}

/// vLLM 0.33's hybrid Mamba models: a Python prefill of a full-attention group and a Mamba
/// group sharing every region publishes its `ssm_sizes` and hands the Mamba group's
/// state-bearing block only (vLLM's `clip_ssm_state_blocks`); a Rust decode of the same
/// groups clips its own list, reads the attention blocks whole in every region and, of the
/// state block, only the conv sub-projections and the temporal state, leaving the page's
/// padding and every other block untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_attention_and_ssm_groups_reads_the_state_block_from_a_python_prefill() {
    reads_attention_and_ssm_from_python("py-ssm", [-1, -1]).await;
}

/// Regions of their own with a Mamba group (vLLM's `region_group_ids` 1 and 0: the Mamba
/// group's region, the attention's): a Rust decode of the same region groups reads the
/// attention blocks in both regions and the state only in the Mamba group's, as vLLM's
/// `_compute_desc_ids` with Mamba groups and its `_ssm_region_indices` read them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_reads_the_ssm_state_only_in_the_mamba_groups_regions() {
    reads_attention_and_ssm_from_python("py-ssm-own", [1, 0]).await;
}

/// A Rust decode of a full-attention and a Mamba group whose regions' groups are
/// `region_groups` (vLLM's `region_group_ids`, the same on the Python prefill) loads request
/// `tag`-1 from a Python prefill: the attention blocks whole in every region, the state
/// block's conv sub-projections and temporal state in the regions of the Mamba group (1)
/// and the shared ones (-1), nothing else.
async fn reads_attention_and_ssm_from_python(tag: &str, region_groups: [i64; 2]) {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let groups = format!("{},{}", region_groups[0], region_groups[1]);
    peer.json(&format!(
        "kv_prefill {hash} 0 0 {tag} {REGIONS} {BLOCKS} {BLOCK_LEN} 16 {groups} 1 {SSM_ARG}"
    ));
    let kv = ssm_kv_with("region_groups", json!(region_groups));
    let (decode, mut scheduler) = vllm_engine_with(&format!("rs-decode-{tag}"), kv);
    fill_untouched(&decode, BLOCK_LEN);
    let cache = decode.kv_caches().unwrap();
    // The Mamba group's list: a null block, the state, a speculative scratch block.
    let request = format!("{tag}-1");
    let json = peer.call(&format!(
        "kv_finish {} 1,3,9;0,6,7 ssm:1",
        hex(request.as_bytes())
    ));
    let vllm: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(vllm["remote_block_ids"], json!([[1, 3, 9], [6]]));
    let local = [vec![0, 8, 10], vec![11, 12, 13]];
    let outcome = load_groups_from_python((&decode, &mut scheduler), &request, &json, &local).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    let state: usize = SSM_CONV.iter().sum::<usize>() + SSM_TEMPORAL;
    let state_regions: Vec<usize> = (0..REGIONS)
        .filter(|&r| matches!(region_groups[r], -1 | 1))
        .collect();
    for region in 0..REGIONS {
        for block in 0..BLOCKS {
            let mut got = vec![0u8; BLOCK_LEN];
            cache.read(region, block * BLOCK_LEN, &mut got).unwrap();
            let python = |r: usize, o: usize| python_byte(region, r * BLOCK_LEN + o);
            let want: Vec<u8> = match block {
                0 | 8 | 10 => {
                    let r = [1, 3, 9][[0, 8, 10].iter().position(|&b| b == block).unwrap()];
                    (0..BLOCK_LEN).map(|o| python(r, o)).collect()
                }
                // The state block (the one before the scratch block 13): its state only.
                12 if state_regions.contains(&region) => (0..BLOCK_LEN)
                    .map(|o| if o < state { python(6, o) } else { 0xEE })
                    .collect(),
                _ => vec![0xEE; BLOCK_LEN],
            };
            assert!(got == want, "region {region} block {block}");
        }
    }
    let notes = peer.json("kv_notifs 1 10");
    assert_eq!(notes[0]["vllm"], json!({"id": request, "consumers": 1}));
    let metrics = decode.metrics();
    let attention = 3 * REGIONS * BLOCK_LEN;
    assert_eq!(
        metrics.iter().map(|m| m.bytes).sum::<u64>(),
        (attention + state_regions.len() * state) as u64,
        "{metrics:?}"
    );
}

/// Engines of different `physical_blocks_per_logical_kv_block` with Mamba groups, which
/// vLLM 0.33 reads without prefix caching: a Rust decode of one 16-token kernel block per
/// id reads from a Python prefill of two per id each attention kernel block at its tokens,
/// and the Mamba group's state from the prefill's page of its id's two kernel blocks into
/// its own one-block page; every other byte untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_ssm_groups_reads_a_python_prefill_of_two_kernel_blocks_per_id() {
    // Four 16-token blocks; the state in block 6 (before scratch 7).
    let local = [vec![2, 5, 10, 11], vec![4, 6, 7]];
    let units = [(2, 0, 2), (5, 0, 3), (10, 0, 8), (11, 0, 9)];
    reads_python_ssm_of_two_kernel_blocks_per_id("py-ssm-ppl", (16, &local), &units, 6).await;
}

/// vLLM's hybrid Mamba models with block ids of two kernel blocks on both engines
/// (`physical_blocks_per_logical_kv_block` 2, the attention kernel's block half the
/// logical one): a Rust decode reads each attention id as its two kernel blocks, and the
/// Mamba group's state block as one page of its id's two kernel blocks (vLLM's
/// `_logical_to_kernel_block_ids` leaves SSM groups alone; `_build_mamba_local` strides by
/// the page), its state from the prefill's page of its id; every other byte untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_ssm_groups_reads_the_state_page_of_two_kernel_blocks_per_id() {
    // Ids 2 and 5 (kernel blocks 4, 5, 10, 11); the state in id 6 (before scratch 7), its
    // page from kernel block 12.
    let local = [vec![2, 5], vec![4, 6, 7]];
    let units = [(4, 0, 2), (5, 0, 3), (10, 0, 8), (11, 0, 9)];
    reads_python_ssm_of_two_kernel_blocks_per_id("py-ssm-ppl2", (32, &local), &units, 12).await;
}

/// A Rust decode whose KV cache groups count blocks of `block_size` tokens over its
/// 16-token registered blocks loads a 60-token prompt's `local` blocks (one list per group)
/// from a Python prefill of block ids of two 16-token kernel blocks (ids 1 and 4, kernel
/// blocks 2, 3, 8, 9; the state in id 3, its page from kernel block 6), the request
/// `tag`-1: the attention as `units` (local kernel block, unit, remote kernel block), the
/// state into the page from kernel block `state_page`, nothing else.
async fn reads_python_ssm_of_two_kernel_blocks_per_id(
    tag: &str,
    (block_size, local): (usize, &[Vec<usize>; 2]),
    units: &[(usize, usize, usize)],
    state_page: usize,
) {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    peer.json(&format!(
        "kv_prefill {hash} 0 0 {tag} {REGIONS} {BLOCKS} {BLOCK_LEN} 16 -1,-1 2 {SSM_ARG}"
    ));
    let kv = ssm_kv_with("block_size", json!(block_size));
    let (decode, mut scheduler) = vllm_engine_with(&format!("rs-decode-{tag}"), kv);
    fill_untouched(&decode, BLOCK_LEN);
    let request = format!("{tag}-1");
    let json = peer.call(&format!(
        "kv_finish {} 1,4;0,3,7 ssm:1 60",
        hex(request.as_bytes())
    ));
    let vllm: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(vllm["remote_block_ids"], json!([[1, 4], [3]]));
    let outcome = load_groups_from_python((&decode, &mut scheduler), &request, &json, local).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    let state: usize = SSM_CONV.iter().sum::<usize>() + SSM_TEMPORAL;
    holds_python_units_and(&decode, units, 16, |region, want| {
        for o in 0..state {
            want[state_page * BLOCK_LEN + o] = python_byte(region, 6 * BLOCK_LEN + o);
        }
    });
    assert_eq!(
        decode.metrics().iter().map(|m| m.bytes).sum::<u64>(),
        (units.len() * REGIONS * BLOCK_LEN + REGIONS * state) as u64
    );
}

/// vLLM moves a Mamba state page whole whatever the attention blocks' sizes (its
/// `_map_block_ids_for_block_size_ratio` leaves SSM groups alone): a Rust decode of 16-token
/// blocks reads from a Python prefill of 8-token blocks (`block_size_ratio` 2) each
/// attention block as two prefill blocks, a head at a time, and the Mamba group's state
/// block, its conv sub-projections and temporal state only, from the prefill's smaller
/// page; every other byte untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_ssm_groups_reads_the_state_block_of_a_python_prefill_of_smaller_blocks() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    let (small_blocks, small_len) = (2 * BLOCKS, BLOCK_LEN / 2);
    peer.json(&format!(
        "kv_prefill {hash} 0 0 py-ssm-ratio {REGIONS} {small_blocks} {small_len} 8 -1,-1 1 {SSM_ARG}"
    ));
    let (decode, mut scheduler) = vllm_engine_with("rs-decode-ssm-ratio", ssm_kv(&factors(), 1));
    fill_untouched(&decode, BLOCK_LEN);
    // A 31-token prompt: four 8-token prefill blocks, two 16-token decode blocks.
    let json = peer.call(&format!(
        "kv_finish {} 3,5,7,9;0,6,7 ssm:1 31",
        hex(b"py-ssm-ratio-1")
    ));
    let local = [vec![0, 2], vec![11, 12, 13]];
    let outcome =
        load_groups_from_python((&decode, &mut scheduler), "py-ssm-ratio-1", &json, &local).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    let units = [(0, 0, 3), (0, 1, 5), (2, 0, 7), (2, 1, 9)];
    let state: usize = SSM_CONV.iter().sum::<usize>() + SSM_TEMPORAL;
    holds_python_units_and(&decode, &units, 8, |region, want| {
        // The state block (the one before the scratch block 13): its state only.
        for o in 0..state {
            want[12 * BLOCK_LEN + o] = python_byte(region, 6 * small_len + o);
        }
    });
    let attention = 2 * REGIONS * BLOCK_LEN;
    assert_eq!(
        decode.metrics().iter().map(|m| m.bytes).sum::<u64>(),
        (attention + REGIONS * state) as u64
    );
}

/// A Rust decode of TP 2 from a Python prefill of TP 1 of a full-attention group and a
/// Mamba group: each rank reads its half of every conv sub-projection and of the temporal
/// state (vLLM's `_build_mamba_remote` with a TP ratio of 2) into its own page, whose
/// padding stays untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_of_tp2_reads_its_half_of_the_ssm_state_from_a_python_prefill() {
    let mut peer = VllmPeer::start();
    let hash = factors().hash();
    peer.json(&format!(
        "kv_prefill {hash} 0 0 py-ssm-tp {REGIONS} {BLOCKS} {BLOCK_LEN} 16 -1,-1 1 {SSM_ARG}"
    ));
    let spec = KvCacheSpec::lbhnc(REGIONS, BLOCKS, 16, 8, 2, HEAD_BYTES);
    let kv = ssm_kv(&factors(), 2);
    let len = spec.block_len(0);
    let ranks = rust_decode_ranks("rs-decode-ssm-tp2", 2, &kv, &spec);
    for rank in &ranks {
        fill_untouched(rank, len);
    }
    let mut scheduler = KvConnectorScheduler::new(
        SchedulerConfig::new("rs-decode-ssm-tp2", "127.0.0.1", 0, 2, &kv).unwrap(),
    )
    .with_kv_cache_groups(KvCacheGroups::from_kv_transfer_config(&kv).unwrap());
    let json = peer.call(&format!("kv_finish {} 1,3;0,6,7 ssm:1", hex(b"py-ssm-tp2")));
    let params = KvTransferParams::from_vllm_json(&json).unwrap();
    scheduler.on_new_request("py-ssm-tp2", Some(&params));
    scheduler
        .update_state_after_alloc_groups("py-ssm-tp2", &[vec![7, 2], vec![9, 10, 11]], &params)
        .unwrap();
    let outcomes = load_on_ranks(&ranks, &mut scheduler, |outputs| {
        for output in outputs {
            assert!(output.load_errors.is_empty(), "{:?}", output.load_errors);
        }
    })
    .await;
    assert!(
        matches!(&outcomes[..], [LoadOutcome::Loaded { .. }]),
        "{outcomes:?}"
    );
    // Part k of the model's state holds its bytes j in order; the Python rank all of them
    // from its page's start, rank r of TP 2 its half (j from r * size / 2) from its own.
    let parts: Vec<usize> = SSM_CONV.iter().copied().chain([SSM_TEMPORAL]).collect();
    for (r, rank) in ranks.iter().enumerate() {
        let cache = rank.kv_caches().unwrap();
        for region in 0..REGIONS {
            let mut want = vec![0xEEu8; len];
            for (k, &size) in parts.iter().enumerate() {
                let before: usize = parts[..k].iter().sum();
                for j in r * size / 2..(r + 1) * size / 2 {
                    let local = before / 2 + j - r * size / 2;
                    want[local] = python_byte(region, 6 * BLOCK_LEN + before + j);
                }
            }
            let mut got = vec![0u8; len];
            cache.read(region, 10 * len, &mut got).unwrap();
            assert!(got == want, "rank {r} region {region}: the state block");
        }
    }
}

/// A Rust prefill of a full-attention group and a Mamba group publishes the `ssm_sizes` of
/// its state and hands the Mamba group's state-bearing block only; a Python decode reads
/// the attention blocks and, of the state block, each conv sub-projection and the temporal
/// state as vLLM's decode lays out its descriptors, and its notification frees the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_reads_the_ssm_state_of_a_rust_prefill() {
    let mut peer = VllmPeer::start();
    let (prefill, mut scheduler) = vllm_engine_with("rs-prefill-ssm", ssm_kv(&factors(), 1));
    fill_rust_prefill(&prefill, 0);
    let params = finish_groups_for_decode(
        (&prefill, &mut scheduler),
        "rs-ssm-1",
        &[vec![5, 2, 11], vec![0, 7, 8]],
        47,
    );
    assert_eq!(params["remote_block_ids"], json!([[5, 2, 11], [7]]));
    let port = params["remote_port"].as_u64().unwrap();
    let hash = factors().hash();
    let got = peer.json(&format!(
        "kv_decode {port} {hash} 1 rs-prefill-ssm 5,2,11 {} 1 {SSM_ARG}:7",
        hex(b"rs-ssm-1")
    ));
    assert_eq!(got["meta"]["ssm_sizes"], json!([40, 64]), "{got}");
    assert_eq!(got["meta"]["region_group_ids"], json!([-1, -1]), "{got}");
    let data = unhex(got["data"].as_str().expect("the blocks read"));
    let mut want = rust_blocks_of(0, &[5, 2, 11]);
    let state: usize = SSM_CONV.iter().sum::<usize>() + SSM_TEMPORAL;
    for region in 0..REGIONS {
        want.extend((0..state).map(|o| rust_byte_of(0, region, 7 * BLOCK_LEN + o)));
    }
    assert!(data == want, "the Python decode read other bytes");
    freed_by_notification(&prefill, "rs-ssm-1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_vllm_heartbeat_for_5000_requests_extends_every_lease_of_a_rust_prefill() {
    // vLLM's _send_heartbeats sends one message per engine, whatever its length: 5,000
    // ids of 48 characters (#30 item 1; 16 KiB, the old limit, held about 334).
    const N: usize = 5000;
    let mut peer = VllmPeer::start();
    let (prefill, _) = vllm_engine("rs-prefill-hb", &factors());
    let far = Instant::now() + Duration::from_secs(600);
    for i in 0..N {
        prefill.hold_for_decode(&format!("{:x>48}", format!("rs-hb-{i}")), far, None);
    }
    let port = prefill.side_channel_addr().unwrap().port();
    let got = peer.json(&format!(
        "kv_heartbeat {port} {} 1 rs-prefill-hb {N} rs-hb",
        factors().hash()
    ));
    assert_eq!(got["bytes"], json!(3 + N * 49 - 1), "{got}");
    let start = Instant::now();
    let arrived = |n: NotificationStats| n.heartbeats + n.malformed > 0;
    while !arrived(prefill.notification_stats()) {
        assert!(start.elapsed() < Duration::from_secs(10), "nothing arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let notes = prefill.notification_stats();
    assert_eq!(
        (notes.heartbeats, notes.leases_extended, notes.malformed),
        (1, N as u64, 0),
        "{notes:?}"
    );
    assert_eq!(notes.unknown_heartbeat_ids, 0, "{notes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_ignores_new_keys_refuses_another_hash_and_false_addresses() {
    let hash = factors().hash();
    let mut peer = VllmPeer::start();
    python_prefill(&mut peer, &hash, true, false);
    let (decode, mut scheduler) = vllm_engine("rs-decode-x", &factors());
    let outcome =
        load_from_python(&mut peer, (&decode, &mut scheduler), "py-new", &[7], &[4]).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds_python_blocks(&decode, &[4], &[7]);

    let other = CompatibilityFactors {
        dtype: "torch.float16".into(),
        ..factors()
    };
    let (strict, mut strict_scheduler) = vllm_engine("rs-decode-other", &other);
    let outcome = load_from_python(
        &mut peer,
        (&strict, &mut strict_scheduler),
        "py-other",
        &[7],
        &[4],
    )
    .await;
    let LoadOutcome::Failed { reason, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(
        reason.contains(&hash) && reason.contains(&other.hash()),
        "{reason}"
    );

    // Base addresses past what the Python agent registered: NIXL's loaded metadata does
    // not advertise them, so nothing is read.
    let mut liar = VllmPeer::start();
    python_prefill(&mut liar, &hash, false, true);
    let (victim, mut victim_scheduler) = vllm_engine("rs-decode-lied-to", &factors());
    let outcome = load_from_python(
        &mut liar,
        (&victim, &mut victim_scheduler),
        "py-lie",
        &[1],
        &[2],
    )
    .await;
    let LoadOutcome::Failed { reason, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(reason.contains("metadata advertises"), "{reason}");
    let mut block = vec![1u8; BLOCK_LEN];
    victim
        .kv_caches()
        .unwrap()
        .read(0, 2 * BLOCK_LEN, &mut block)
        .unwrap();
    assert!(block.iter().all(|&b| b == 0));
}

/// Finishes `request` of `blocks` (one list per KV cache group) and `tokens` computed tokens on
/// a Rust prefill for a decode, checks that it holds the blocks for it and starts the hold:
/// the params, as vLLM's JSON.
fn finish_groups_for_decode(
    (prefill, scheduler): (&KvConnectorWorker, &mut KvConnectorScheduler),
    request: &str,
    blocks: &[Vec<usize>],
    tokens: usize,
) -> Value {
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let finished = scheduler
        .request_finished_all_groups(
            request,
            blocks,
            tokens,
            Some(&for_decode),
            FinishStatus::LengthCapped,
        )
        .unwrap();
    assert!(finished.delay_free_blocks);
    prefill.start_load_kv(&scheduler.build_connector_meta());
    serde_json::from_str(&finished.kv_transfer_params.unwrap().to_vllm_json()).unwrap()
}

/// Waits (at most 10 s) for the Python decode's notification to a Rust `prefill`, and checks
/// that it freed `request`.
async fn freed_by_notification(prefill: &KvConnectorWorker, request: &str) {
    tokio::time::timeout(Duration::from_secs(10), prefill.notified())
        .await
        .expect("the Python decode's notification");
    assert_eq!(prefill.finished().sending, [request]);
}

/// Finishes `request` in `remote` blocks on a Rust prefill for a decode, and has the Python
/// peer's vLLM decode (`kv_load`) read it from the params: what it answered, once the
/// prefill reported the request sent (freed by the decode's notification), and the
/// params' registration generation.
async fn python_load_from_rust(
    peer: &mut VllmPeer,
    (prefill, scheduler): (&KvConnectorWorker, &mut KvConnectorScheduler),
    request: &str,
    remote: &[usize],
) -> (Value, u64) {
    let for_decode = KvTransferParams {
        do_remote_decode: true,
        ..Default::default()
    };
    let finished = scheduler.request_finished(
        request,
        remote,
        16,
        Some(&for_decode),
        FinishStatus::LengthCapped,
    );
    prefill.start_load_kv(&scheduler.build_connector_meta());
    let json = finished.kv_transfer_params.unwrap().to_vllm_json();
    let params: Value = serde_json::from_str(&json).unwrap();
    let got = peer.json(&format!(
        "kv_load {} {} 1",
        hex(json.as_bytes()),
        factors().hash()
    ));
    assert!(got["data"].is_string(), "{request}: nothing read: {got}");
    freed_by_notification(prefill, request).await;
    let generation = params["remote_registration_generation"].as_u64().unwrap();
    (got, generation)
}

/// What a Python decode reading `remote` blocks of a Rust prefill filled with
/// [`rust_byte_of`] `salt` gets: every region's blocks in turn.
fn rust_blocks_of(salt: usize, remote: &[usize]) -> Vec<u8> {
    let mut want = Vec::new();
    for region in 0..REGIONS {
        for &block in remote {
            want.extend((0..BLOCK_LEN).map(|o| rust_byte_of(salt, region, block * BLOCK_LEN + o)));
        }
    }
    want
}

/// vLLM's sleep mode on a Rust prefill (#32 item 7): the worker registers its KV cache
/// again (new buffers, other bytes), and the engine's side channel starts a new registration
/// generation, which the params of the requests finished from then on carry. A Python vLLM
/// decode that loaded the engine at the generation before drops it and handshakes again
/// (vLLM's `_read_blocks_for_req`), then reads the new buffers' bytes, not the old ones; at
/// the same generation it reads without a handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_decode_handshakes_again_with_a_rust_prefill_registered_again() {
    let mut peer = VllmPeer::start();
    let (mut prefill, mut scheduler) = vllm_engine("rs-prefill-rereg", &factors());
    fill_rust_prefill(&prefill, 0);
    let remote = [5, 2, 11];
    let engine = (&prefill, &mut scheduler);
    let (got, generation) = python_load_from_rust(&mut peer, engine, "rs-rereg-1", &remote).await;
    assert_eq!(generation, 1);
    assert_eq!(got["handshaken"], true, "{got}");
    let data = unhex(got["data"].as_str().expect("the blocks read"));
    assert!(
        data == rust_blocks_of(0, &remote),
        "the first registration's bytes"
    );

    prefill.register_host_kv_caches_again(kv_spec()).unwrap();
    assert_eq!(prefill.registration_generation(), 2);
    fill_rust_prefill(&prefill, 1);
    let (new, old) = (rust_blocks_of(1, &remote), rust_blocks_of(0, &remote));
    assert!(new != old);
    let engine = (&prefill, &mut scheduler);
    let (got, generation) = python_load_from_rust(&mut peer, engine, "rs-rereg-2", &remote).await;
    assert_eq!(generation, 2);
    assert_eq!(got["handshaken"], true, "a newer generation: {got}");
    let data = unhex(got["data"].as_str().expect("the blocks read"));
    assert!(
        data != old,
        "the Python decode read the old registration's bytes"
    );
    assert!(data == new, "the Python decode read other bytes");

    let engine = (&prefill, &mut scheduler);
    let (got, generation) = python_load_from_rust(&mut peer, engine, "rs-rereg-3", &remote).await;
    assert_eq!(generation, 2);
    assert_eq!(got["handshaken"], false, "the same generation: {got}");
    assert!(unhex(got["data"].as_str().unwrap()) == new);
}

/// vLLM's sleep mode on a Python prefill (#32 item 7): it deregisters its KV cache,
/// registers new buffers (other bytes; the old ones kept, unregistered) and serves the changed
/// payload as a new registration generation, which its params carry. A Rust decode in vLLM
/// mode that loaded the engine at the generation before forgets it, handshakes again and
/// reads the new buffers' bytes, not the old ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_decode_handshakes_again_with_a_python_prefill_registered_again() {
    let mut peer = VllmPeer::start();
    python_prefill(&mut peer, &factors().hash(), false, false);
    let (decode, mut scheduler) = vllm_engine("rs-decode-rereg", &factors());
    let remote = [3, 9];
    let engine = (&decode, &mut scheduler);
    let outcome = load_from_python(&mut peer, engine, "py-rereg-1", &remote, &[0, 1]).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds_python_blocks(&decode, &[0, 1], &remote);
    assert_eq!(peer.call("kv_served"), "1", "one handshake");

    let got = peer.json("kv_reregister");
    assert_eq!(got, json!({"generation": 2, "salt": 1}));
    let params = peer.json(&format!("kv_finish {} 3,9", hex(b"py-rereg-2")));
    assert_eq!(params["remote_registration_generation"], 2, "{params}");
    let engine = (&decode, &mut scheduler);
    let outcome = load_from_python(&mut peer, engine, "py-rereg-2", &remote, &[2, 3]).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds_python_blocks_of(&decode, 1, &[2, 3], &remote);
    assert_eq!(peer.call("kv_served"), "2", "a handshake again");
    let notes = peer.json("kv_notifs 2 10");
    assert_eq!(
        notes[0]["vllm"],
        json!({"id": "py-rereg-1", "consumers": 1})
    );
    assert_eq!(
        notes[1]["vllm"],
        json!({"id": "py-rereg-2", "consumers": 1})
    );
}

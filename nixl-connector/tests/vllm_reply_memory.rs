//! A hostile prefill's handshake reply makes a decode allocate only in proportion to its
//! size: a reply at the frame cap made of empty strings (one byte each on the wire, a
//! 24-byte `String` each decoded) is refused before it is decoded, and the decode's peak
//! RSS grows by less than twice the frame cap (by at most one and a half times). The
//! decode runs in a child process, so that its peak (`VmHWM`) measures the fetch and
//! nothing else. Real metadata of a real NIXL agent with many regions still decodes
//! within the caps.

mod common;
mod vllm_support;

use std::net::SocketAddr;
use std::process::Stdio;

use common::{after_tag, role_process, stdout_lines};
use nixl_connector::vllm::{
    fetch_meta, Compatibility, MetadataServer, NixlAgentMetadata, NixlHandshakePayload,
    VllmChannelLimits,
};
use nixl_connector::Error;
use vllm_support::{factors, metadata};

const PORT_ENV: &str = "NIXL_RS_TEST_REPLY_MEMORY_PORT";

/// Regions of the real agent's metadata, and layer names per region.
const REGIONS: usize = 512;
const LAYERS_PER_REGION: usize = 4;

/// The decode, run as a child: fetches rank (0, 0), the hostile reply, and prints how much
/// its peak RSS grew and the error; then fetches rank (0, 1), real metadata, and prints
/// how many regions it decoded.
#[test]
#[ignore = "the decode of a_hostile_reply_costs_at_most_twice_the_frame_cap, which starts it"]
fn decode_role() {
    let port: u16 = std::env::var(PORT_ENV)
        .expect("run by the parent test")
        .parse()
        .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let compat = Compatibility::new(&factors(), true);
    let limits = VllmChannelLimits::default();
    let fetch = |tp_rank| {
        let reply = runtime
            .block_on(fetch_meta("127.0.0.1", port, 0, tp_rank, limits))
            .unwrap();
        compat.check(&reply.payload, "hostile prefill")
    };
    // Warm up what the first fetch sets up once (the runtime's I/O driver, a connection).
    let _ = fetch(1).unwrap();
    let before = common::status_kib("VmRSS") * 1024;
    let result = fetch(0);
    let growth = (common::status_kib("VmHWM") * 1024).saturating_sub(before);
    println!("GROWTH {growth}");
    let err = result.expect_err("the hostile reply is refused");
    println!("ERROR {}", err.to_string().replace('\n', " "));
    assert!(matches!(err, Error::Protocol { .. }), "{err:?}");
    println!("REGIONS {}", fetch(1).unwrap().kv_caches_base_addr.len());
}

/// `base` encoded, with its `region_names` (nil) replaced by an array of `count` empty
/// strings, written byte by byte so that this process never holds them as `String`s.
fn with_empty_names(base: &NixlAgentMetadata, count: usize) -> Vec<u8> {
    let bytes = base.encode();
    let key = b"\xacregion_names\xc0";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("region_names, nil, in the encoding")
        + key.len()
        - 1;
    let mut out = bytes[..at].to_vec();
    out.push(0xdd);
    out.extend_from_slice(&u32::try_from(count).unwrap().to_be_bytes());
    out.resize(out.len() + count, 0xa0);
    out.extend_from_slice(&bytes[at + 1..]);
    out
}

#[test]
fn a_hostile_reply_costs_at_most_twice_the_frame_cap() {
    let cap = VllmChannelLimits::default().max_payload;
    let hash = factors().hash();
    // Rank 0: a reply one frame cap long, nearly all of it empty strings.
    let base = NixlAgentMetadata {
        region_names: None,
        ..metadata("pf", 0)
    };
    let hostile = with_empty_names(&base, cap - 4096);
    let hostile = NixlHandshakePayload {
        compatibility_hash: hash.clone(),
        agent_metadata_bytes: hostile,
    };
    let frame = hostile.encode().len();
    assert!(frame <= cap && frame > cap - 4096, "{frame} bytes");
    // Rank 1: a real agent's metadata with REGIONS registered regions, each named and
    // with its layers.
    let agent = nixl::Agent::new(&format!("reply-memory-{}", std::process::id())).unwrap();
    agent.create_backend("UCX").unwrap();
    let regs: Vec<_> = (0..REGIONS)
        .map(|_| agent.register_memory(vec![0u8; 4096], &[]).unwrap())
        .collect();
    let addrs: Vec<u64> = regs.iter().map(|r| r.regions()[0].addr as u64).collect();
    let real = NixlAgentMetadata {
        agent_metadata: agent.local_metadata().unwrap(),
        kv_caches_base_addr: addrs,
        block_lens: vec![4096; REGIONS],
        block_strides: vec![4096; REGIONS],
        region_num_blocks: Some(vec![1; REGIONS]),
        region_group_ids: Some(vec![0; REGIONS]),
        region_names: Some((0..REGIONS).map(|r| format!("region.{r}")).collect()),
        region_mem_types: Some(vec!["DRAM".into(); REGIONS]),
        region_members: (0..REGIONS)
            .map(|r| {
                (0..LAYERS_PER_REGION)
                    .map(|l| format!("model.layers.{}.self_attn.attn", r * LAYERS_PER_REGION + l))
                    .collect()
            })
            .collect(),
        ..metadata("pf", 1)
    };

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = runtime
        .block_on(MetadataServer::bind(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            VllmChannelLimits::default(),
        ))
        .unwrap();
    server.publish(0, 0, &hostile);
    server.publish(0, 1, &NixlHandshakePayload::new(&hash, &real));
    let port = server.local_addr().port().to_string();
    let mut child = role_process("decode_role", &[(PORT_ENV, &port)], Stdio::inherit());
    let mut lines = stdout_lines(&mut child);
    let growth: u64 = after_tag(&mut lines, "GROWTH ")
        .expect("the decode prints its growth")
        .parse()
        .unwrap();
    eprintln!("peak RSS growth {growth} bytes for a {frame}-byte reply (cap {cap})");
    let error = after_tag(&mut lines, "ERROR ").expect("the decode prints its error");
    let regions = after_tag(&mut lines, "REGIONS ");
    let status = child.wait().unwrap();
    assert!(status.success(), "the decode failed: {status}");
    assert!(
        error.contains("more than 65536 MessagePack values"),
        "{error}"
    );
    // Within twice the cap, and in fact within one and a half: the frame as read, and the
    // metadata kept in the frame's memory rather than in a copy beside it.
    assert!(
        growth <= (cap + cap / 2) as u64,
        "the decode's peak RSS grew by {growth} bytes for a reply of {frame}, more than \
         one and a half times the frame cap ({cap})"
    );
    assert_eq!(regions.as_deref(), Some(REGIONS.to_string().as_str()));
    drop(regs);
}

//! Shared by the vLLM protocol tests: compatibility factors, a rank's metadata, vLLM's
//! tensors of a hybrid model's rank, and raw ZMTP bytes written from the spec (not with the
//! code under test) for peers that misbehave.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ops::Range;

use nixl_connector::vllm::{CompatibilityFactors, NixlAgentMetadata};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Qwen3-0.6B on vLLM 0.33.0.
pub fn factors() -> CompatibilityFactors {
    serde_json::from_str(
        r#"{"vllm_version": "0.33.0", "model": "Qwen/Qwen3-0.6B", "dtype": "torch.bfloat16",
            "num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 28,
            "attn_backend_name": "FLASH_ATTN", "cache_dtype": "auto", "is_hma_enabled": true}"#,
    )
    .unwrap()
}

/// vLLM's KV tensors of a rank holding `layers` of a hybrid model of two groups, full
/// attention (group 0) at the even layers and a sliding window (group 1) at the odd ones:
/// tensor `i` shared by the rank's layer `i` of each group (vLLM's
/// `get_kv_cache_config_from_groups`; tests/py/vllm_peer.py's `hma_regions`), each region's
/// (layer, group) in group order.
pub fn hma_regions(layers: Range<usize>) -> Vec<Vec<(usize, usize)>> {
    let group = |g: usize| {
        layers
            .clone()
            .filter(move |l| l % 2 == g)
            .collect::<Vec<_>>()
    };
    let (full, window) = (group(0), group(1));
    (0..full.len().max(window.len()))
        .map(|i| {
            [(full.get(i), 0), (window.get(i), 1)]
                .into_iter()
                .filter_map(|(layer, g)| layer.map(|&l| (l, g)))
                .collect()
        })
        .collect()
}

/// Rank `rank` of `engine`: two DRAM regions, every optional field set.
pub fn metadata(engine: &str, rank: u64) -> NixlAgentMetadata {
    NixlAgentMetadata {
        engine_id: engine.into(),
        agent_metadata: vec![rank as u8; 100],
        kv_caches_base_addr: vec![0x7f00_0000_0000 + rank, 0x7f00_1000_0000],
        device_id: rank,
        num_blocks: 64,
        block_lens: vec![8192, 8192],
        block_strides: vec![8192, 8192],
        kv_cache_layout: "HND".into(),
        block_size: 16,
        attn_backend_name: "FLASH_ATTN".into(),
        region_num_blocks: Some(vec![64, 64]),
        region_group_ids: Some(vec![0, 0]),
        region_names: Some(vec!["layer.0".into(), "layer.1".into()]),
        region_mem_types: Some(vec!["DRAM".into(), "DRAM".into()]),
        ple_block_len: Some(9),
        region_members: vec![vec!["layer.0".into()], vec!["layer.1".into()]],
        packed_member_layouts: BTreeMap::from([("layer.0".into(), (0, 8192))]),
        ..NixlAgentMetadata::default()
    }
}

/// A ZMTP 3.1 greeting with the NULL mechanism, as libzmq sends it.
pub fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[8] = 1;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// One frame: `flags` (1 MORE, 4 COMMAND; LONG is added for bodies over 255 bytes).
pub fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = if body.len() > 255 {
        let mut f = vec![flags | 2];
        f.extend_from_slice(&(body.len() as u64).to_be_bytes());
        f
    } else {
        vec![flags, body.len() as u8]
    };
    out.extend_from_slice(body);
    out
}

/// The NULL mechanism's READY command of a `socket_type` socket.
pub fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = b"\x05READY\x0bSocket-Type".to_vec();
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    frame(4, &body)
}

/// Greeting and READY of a `socket_type` socket.
pub fn hello(socket_type: &str) -> Vec<u8> {
    [greeting(), ready(socket_type)].concat()
}

/// A REQ message: the empty delimiter, then `parts`.
pub fn message(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = frame(1, b"");
    for (i, part) in parts.iter().enumerate() {
        out.extend(frame(u8::from(i + 1 < parts.len()), part));
    }
    out
}

/// Reads one frame: its flags and body.
pub async fn read_frame(stream: &mut TcpStream) -> (u8, Vec<u8>) {
    let flags = stream.read_u8().await.unwrap();
    let len = if flags & 2 != 0 {
        stream.read_u64().await.unwrap() as usize
    } else {
        usize::from(stream.read_u8().await.unwrap())
    };
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await.unwrap();
    (flags, body)
}

/// Reads one REQ reply: the parts after the delimiter.
pub async fn read_reply(stream: &mut TcpStream) -> Vec<Vec<u8>> {
    assert_eq!(read_frame(stream).await, (1, vec![]));
    let mut parts = Vec::new();
    loop {
        let (flags, body) = read_frame(stream).await;
        parts.push(body);
        if flags & 1 == 0 {
            return parts;
        }
    }
}

//! The messages of vLLM's handshake, as msgspec writes them: a decode's request for a rank's
//! metadata, the prefill's [`NixlHandshakePayload`] holding its [`NixlAgentMetadata`], and
//! the prefill's clock.
//!
//! vLLM declares both payload types as dataclasses, which msgspec encodes as MessagePack
//! maps keyed by field name, every field present and in declaration order (`None` as nil,
//! tuples as arrays, `bytes` as bin). [`rmp_serde::to_vec_named`] over these structs gives
//! the same bytes. Decoding ignores unknown keys and gives absent optional keys their
//! defaults, as msgspec does.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::msgpack;

/// The first element of a metadata request: `b"get_meta_msg"`.
pub const GET_META_MSG: &[u8] = b"get_meta_msg";

/// The vLLM NIXL connector version this module speaks (vLLM 0.33's `NIXL_CONNECTOR_VERSION`).
pub const NIXL_CONNECTOR_VERSION: u32 = 15;

/// Longest compatibility hash accepted from a peer (a SHA-256 hex digest has 64 characters).
pub const MAX_HASH_LEN: usize = 128;

/// Most MessagePack values (each map, array, string and number counts one) a peer's
/// [`NixlAgentMetadata`] may hold. A real one holds about 30 plus a few per KV cache region
/// and per layer name: a model of 1000 regions of 4 layers each stays under 12 000. Each
/// value can cost a decoder tens of bytes beyond its wire size (an empty string, one byte,
/// is a 24-byte `String`), so the cap bounds that overhead to a few MiB.
pub const MAX_METADATA_VALUES: usize = 1 << 16;

/// vLLM's `NixlHandshakePayload`: the compatibility hash, checked before the agent metadata
/// is decoded, and the encoded [`NixlAgentMetadata`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlHandshakePayload {
    /// The sender's [compatibility hash](super::compat).
    pub compatibility_hash: String,
    /// The sender's [`NixlAgentMetadata`], MessagePack-encoded.
    #[serde(with = "serde_bytes")]
    pub agent_metadata_bytes: Vec<u8>,
}

impl NixlHandshakePayload {
    /// The payload carrying `metadata` under `compatibility_hash`.
    pub fn new(compatibility_hash: &str, metadata: &NixlAgentMetadata) -> Self {
        NixlHandshakePayload {
            compatibility_hash: compatibility_hash.to_string(),
            agent_metadata_bytes: metadata.encode(),
        }
    }

    /// The MessagePack map vLLM's listener sends.
    pub fn encode(&self) -> Vec<u8> {
        encode_named(self)
    }

    /// Decodes the agent metadata it carries (check the hash first: see
    /// [`Compatibility::check`](super::compat::Compatibility::check)).
    ///
    /// # Errors
    /// A message naming what does not decode.
    pub fn agent_metadata(&self) -> Result<NixlAgentMetadata, String> {
        NixlAgentMetadata::decode(&self.agent_metadata_bytes)
    }
}

/// vLLM's `NixlAgentMetadata`: one rank's KV cache registration, as a decode needs it to
/// read. The fields keep vLLM's names, order and meaning; the ones after
/// `physical_blocks_per_logical_kv_block` are optional on the wire.
///
/// Addresses and lengths here are the peer's claims: check them before using them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlAgentMetadata {
    /// The engine's id.
    pub engine_id: String,
    /// The NIXL agent's metadata (`get_agent_metadata()`).
    #[serde(with = "serde_bytes")]
    pub agent_metadata: Vec<u8>,
    /// Base address of each registered region.
    pub kv_caches_base_addr: Vec<u64>,
    /// The device id NIXL describes the memory with.
    pub device_id: u64,
    /// Blocks per region.
    pub num_blocks: u64,
    /// Bytes of one block, per layer.
    pub block_lens: Vec<u64>,
    /// Bytes from one block to the next, per layer.
    pub block_strides: Vec<u64>,
    /// The KV cache layout's name, e.g. `"HND"` or `"NHD"`.
    pub kv_cache_layout: String,
    /// Tokens per block.
    pub block_size: u64,
    /// The Mamba conv and SSM state sizes (`(0, 0)` without Mamba layers).
    pub ssm_sizes: (u64, u64),
    /// The attention backend's name, e.g. `"FLASH_ATTN"`.
    pub attn_backend_name: String,
    /// Kernel blocks per logical KV block.
    pub physical_blocks_per_logical_kv_block: u64,
    /// Blocks of each region, when regions differ.
    #[serde(default)]
    pub region_num_blocks: Option<Vec<u64>>,
    /// The KV cache group of each region (vLLM's `-1`: a region shared by several).
    #[serde(default)]
    pub region_group_ids: Option<Vec<i64>>,
    /// The name of each region.
    #[serde(default)]
    pub region_names: Option<Vec<String>>,
    /// The memory type of each region, e.g. `"VRAM"`.
    #[serde(default)]
    pub region_mem_types: Option<Vec<String>>,
    /// Decode context parallel size.
    #[serde(default = "one")]
    pub dcp_size: u64,
    /// Prefill context parallel size.
    #[serde(default = "one")]
    pub pcp_size: u64,
    /// Page length of the PLE short-conv state, when the model has one.
    #[serde(default)]
    pub ple_block_len: Option<u64>,
    /// The layer names sharing each region, in region order.
    #[serde(default)]
    pub region_members: Vec<Vec<String>>,
    /// Packed member name → (byte offset in its region's block, bytes per page).
    #[serde(default)]
    pub packed_member_layouts: BTreeMap<String, (u64, u64)>,
}

fn one() -> u64 {
    1
}

impl Default for NixlAgentMetadata {
    /// Empty and zero, except vLLM's defaults of 1 for `dcp_size`, `pcp_size` and
    /// `physical_blocks_per_logical_kv_block`: fill in the rest.
    fn default() -> Self {
        NixlAgentMetadata {
            engine_id: String::new(),
            agent_metadata: Vec::new(),
            kv_caches_base_addr: Vec::new(),
            device_id: 0,
            num_blocks: 0,
            block_lens: Vec::new(),
            block_strides: Vec::new(),
            kv_cache_layout: String::new(),
            block_size: 0,
            ssm_sizes: (0, 0),
            attn_backend_name: String::new(),
            physical_blocks_per_logical_kv_block: 1,
            region_num_blocks: None,
            region_group_ids: None,
            region_names: None,
            region_mem_types: None,
            dcp_size: 1,
            pcp_size: 1,
            ple_block_len: None,
            region_members: Vec::new(),
            packed_member_layouts: BTreeMap::new(),
        }
    }
}

impl NixlAgentMetadata {
    /// The MessagePack map vLLM's `NixlAgentMetadata` encodes to.
    pub fn encode(&self) -> Vec<u8> {
        encode_named(self)
    }

    /// Decodes a peer's metadata: unknown keys are ignored, absent optional ones take
    /// their defaults. Bytes holding more than [`MAX_METADATA_VALUES`] MessagePack values
    /// are refused before anything is allocated, so decoding allocates at most the bytes'
    /// contents and a bounded overhead, whatever a peer sends.
    ///
    /// # Errors
    /// A message naming what does not decode (e.g. a missing required field), or the cap.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        msgpack::decode_within(bytes, MAX_METADATA_VALUES)
            .map_err(|err| format!("undecodable NixlAgentMetadata: {err}"))
    }
}

/// Encodes a struct as a MessagePack map keyed by field name.
fn encode_named<T: Serialize>(value: &T) -> Vec<u8> {
    // Only I/O errors or maps of unknown length fail, and neither can happen here.
    rmp_serde::to_vec_named(value).expect("encode a struct into memory")
}

/// A metadata request `[b"get_meta_msg", pp_rank, tp_rank]`, as msgspec encodes the tuple.
pub fn encode_request(pp_rank: u32, tp_rank: u32) -> Vec<u8> {
    let request = (serde_bytes::Bytes::new(GET_META_MSG), pp_rank, tp_rank);
    rmp_serde::to_vec(&request).expect("encode a tuple into memory")
}

/// A request's ranks, or why it is not a metadata request.
///
/// # Errors
/// A message for the peer: not a 3-element array, a first element other than
/// `get_meta_msg`, or ranks that are not integers.
pub fn decode_request(bytes: &[u8]) -> Result<(i64, i64), String> {
    let (tag, pp_rank, tp_rank): (serde_bytes::ByteBuf, i64, i64) = msgpack::decode(bytes)
        .map_err(|err| {
            format!("not a metadata request [b\"get_meta_msg\", pp_rank, tp_rank]: {err}")
        })?;
    if tag.as_slice() != GET_META_MSG {
        let shown = String::from_utf8_lossy(&tag[..tag.len().min(32)]).into_owned();
        return Err(format!(
            "unknown request {shown:?}; the only request is \"get_meta_msg\""
        ));
    }
    Ok((pp_rank, tp_rank))
}

/// The second reply frame: the prefill's clock (see [`perf_counter`](super::clock::perf_counter)).
pub fn encode_clock(seconds: f64) -> Vec<u8> {
    rmp_serde::to_vec(&seconds).expect("encode a float into memory")
}

/// A peer's clock frame: a finite number of seconds.
///
/// # Errors
/// A message when it is not one number or not finite.
pub fn decode_clock(bytes: &[u8]) -> Result<f64, String> {
    let seconds: f64 =
        msgpack::decode(bytes).map_err(|err| format!("undecodable clock frame: {err}"))?;
    if !seconds.is_finite() {
        return Err(format!("the clock frame is {seconds}, not a finite time"));
    }
    Ok(seconds)
}

/// The first reply frame of an error reply: `{"error": reason}`. vLLM's decode fails on it
/// at once ("missing required field `compatibility_hash`") instead of waiting 5 s.
pub fn encode_error(reason: &str) -> Vec<u8> {
    encode_named(&ErrorReply {
        error: reason.to_string(),
    })
}

#[derive(Serialize)]
struct ErrorReply {
    error: String,
}

/// The first reply frame: the payload, or the server's error (its metadata borrowed).
#[derive(Deserialize)]
struct Reply<'a> {
    #[serde(default)]
    compatibility_hash: Option<String>,
    #[serde(default, borrow)]
    agent_metadata_bytes: Option<&'a serde_bytes::Bytes>,
    #[serde(default)]
    error: Option<String>,
}

/// What a server's first reply frame says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyFrame {
    /// The rank's payload.
    Payload(NixlHandshakePayload),
    /// The server's reason for not answering with one.
    Error(String),
}

/// A first reply frame taken apart: its hash and where in the frame its metadata lies, or
/// the server's error.
enum ParsedReply {
    Payload {
        compatibility_hash: String,
        metadata: std::ops::Range<usize>,
    },
    Error(String),
}

/// Takes a first reply frame apart without copying its metadata.
fn parse_reply(bytes: &[u8]) -> Result<ParsedReply, String> {
    let reply: Reply<'_> =
        msgpack::decode(bytes).map_err(|err| format!("undecodable NixlHandshakePayload: {err}"))?;
    if let Some(error) = reply.error {
        return Ok(ParsedReply::Error(error));
    }
    match (reply.compatibility_hash, reply.agent_metadata_bytes) {
        (Some(hash), _) if hash.len() > MAX_HASH_LEN => Err(format!(
            "its compatibility_hash has {} bytes, more than {MAX_HASH_LEN}",
            hash.len()
        )),
        (Some(compatibility_hash), Some(metadata)) => {
            // Borrowed from `bytes`, so it lies inside them.
            let start = (metadata.as_ptr() as usize)
                .checked_sub(bytes.as_ptr() as usize)
                .filter(|start| start + metadata.len() <= bytes.len())
                .ok_or("agent_metadata_bytes outside the frame")?;
            Ok(ParsedReply::Payload {
                compatibility_hash,
                metadata: start..start + metadata.len(),
            })
        }
        (None, _) => Err("NixlHandshakePayload without compatibility_hash".into()),
        (_, None) => Err("NixlHandshakePayload without agent_metadata_bytes".into()),
    }
}

/// Decodes a first reply frame.
///
/// # Errors
/// A message when it is neither a payload nor an error map, or its hash is longer than
/// [`MAX_HASH_LEN`].
pub fn decode_reply(bytes: &[u8]) -> Result<ReplyFrame, String> {
    Ok(match parse_reply(bytes)? {
        ParsedReply::Payload {
            compatibility_hash,
            metadata,
        } => ReplyFrame::Payload(NixlHandshakePayload {
            compatibility_hash,
            agent_metadata_bytes: bytes[metadata].to_vec(),
        }),
        ParsedReply::Error(error) => ReplyFrame::Error(error),
    })
}

/// [`decode_reply`] of a frame it takes: the payload's metadata keeps the frame's memory
/// (moved to its start) instead of a copy, so a reply never takes twice its frame.
///
/// # Errors
/// As [`decode_reply`].
pub(crate) fn decode_reply_frame(mut frame: Vec<u8>) -> Result<ReplyFrame, String> {
    Ok(match parse_reply(&frame)? {
        ParsedReply::Payload {
            compatibility_hash,
            metadata,
        } => {
            frame.truncate(metadata.end);
            frame.drain(..metadata.start);
            ReplyFrame::Payload(NixlHandshakePayload {
                compatibility_hash,
                agent_metadata_bytes: frame,
            })
        }
        ParsedReply::Error(error) => ReplyFrame::Error(error),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> NixlAgentMetadata {
        NixlAgentMetadata {
            engine_id: "e".into(),
            agent_metadata: vec![1, 2],
            kv_caches_base_addr: vec![1 << 40, 300],
            num_blocks: 10,
            block_lens: vec![4096],
            block_strides: vec![4096],
            kv_cache_layout: "HND".into(),
            block_size: 16,
            attn_backend_name: "FLASH_ATTN".into(),
            ..NixlAgentMetadata::default()
        }
    }

    /// msgspec 0.23's bytes for `sample()` built as vLLM's dataclass (tests/py/vllm_peer.py
    /// checks the same in the suite for a fuller value).
    const MSGSPEC_SAMPLE: &str = "de0015a9656e67696e655f6964a165ae6167656e745f6d65746164617461c4020102b36b765f6361636865735f626173655f6164647292cf0000010000000000cd012ca96465766963655f696400aa6e756d5f626c6f636b730aaa626c6f636b5f6c656e7391cd1000ad626c6f636b5f7374726964657391cd1000af6b765f63616368655f6c61796f7574a3484e44aa626c6f636b5f73697a6510a973736d5f73697a6573920000b16174746e5f6261636b656e645f6e616d65aa464c4153485f4154544ed924706879736963616c5f626c6f636b735f7065725f6c6f676963616c5f6b765f626c6f636b01b1726567696f6e5f6e756d5f626c6f636b73c0b0726567696f6e5f67726f75705f696473c0ac726567696f6e5f6e616d6573c0b0726567696f6e5f6d656d5f7479706573c0a86463705f73697a6501a87063705f73697a6501ad706c655f626c6f636b5f6c656ec0ae726567696f6e5f6d656d6265727390b57061636b65645f6d656d6265725f6c61796f75747380";

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn metadata_encodes_as_msgspec_does() {
        assert_eq!(hex(&sample().encode()), MSGSPEC_SAMPLE);
        assert_eq!(NixlAgentMetadata::decode(&sample().encode()), Ok(sample()));
    }

    #[test]
    fn payload_and_request_encode_as_msgspec_does() {
        let payload = NixlHandshakePayload {
            compatibility_hash: "ab".into(),
            agent_metadata_bytes: b"xy".to_vec(),
        };
        assert_eq!(
            hex(&payload.encode()),
            "82b2636f6d7061746962696c6974795f68617368a26162b46167656e745f6d657461646174615f6279746573c4027879"
        );
        assert_eq!(
            hex(&encode_request(0, 3)),
            "93c40c6765745f6d6574615f6d73670003"
        );
        assert_eq!(hex(&encode_clock(1.0)), "cb3ff0000000000000");
    }

    #[test]
    fn absent_optional_keys_default_and_unknown_keys_are_ignored() {
        #[derive(Serialize)]
        struct Minimal<'a> {
            engine_id: &'a str,
            #[serde(with = "serde_bytes")]
            agent_metadata: &'a [u8],
            kv_caches_base_addr: [u64; 1],
            device_id: u64,
            num_blocks: u64,
            block_lens: [u64; 1],
            block_strides: [u64; 1],
            kv_cache_layout: &'a str,
            block_size: u64,
            ssm_sizes: (u64, u64),
            attn_backend_name: &'a str,
            physical_blocks_per_logical_kv_block: u64,
            a_field_from_the_future: Vec<Vec<u8>>,
        }
        let bytes = rmp_serde::to_vec_named(&Minimal {
            engine_id: "e",
            agent_metadata: &[1, 2],
            kv_caches_base_addr: [7],
            device_id: 0,
            num_blocks: 10,
            block_lens: [4096],
            block_strides: [4096],
            kv_cache_layout: "HND",
            block_size: 16,
            ssm_sizes: (0, 0),
            attn_backend_name: "FLASH_ATTN",
            physical_blocks_per_logical_kv_block: 1,
            a_field_from_the_future: vec![vec![1]],
        })
        .unwrap();
        let decoded = NixlAgentMetadata::decode(&bytes).unwrap();
        assert_eq!(
            decoded,
            NixlAgentMetadata {
                kv_caches_base_addr: vec![7],
                ..sample()
            }
        );
    }

    #[test]
    fn a_missing_required_field_is_named() {
        let bytes =
            rmp_serde::to_vec_named(&std::collections::BTreeMap::from([("engine_id", "e")]))
                .unwrap();
        let err = NixlAgentMetadata::decode(&bytes).unwrap_err();
        assert!(err.contains("agent_metadata"), "{err}");
    }

    #[test]
    fn metadata_of_more_values_than_the_cap_is_refused() {
        let names = vec![String::new(); MAX_METADATA_VALUES];
        let bytes = NixlAgentMetadata {
            region_names: Some(names),
            ..sample()
        }
        .encode();
        let err = NixlAgentMetadata::decode(&bytes).unwrap_err();
        assert!(
            err.contains(&format!(
                "more than {MAX_METADATA_VALUES} MessagePack values"
            )),
            "{err}"
        );
    }

    #[test]
    fn requests_decode_strictly() {
        assert_eq!(decode_request(&encode_request(1, 2)), Ok((1, 2)));
        // msgspec's str form is taken too; negative ranks decode and are refused later.
        let as_str = rmp_serde::to_vec(&("get_meta_msg", 0, -1)).unwrap();
        assert_eq!(decode_request(&as_str), Ok((0, -1)));
        let other = rmp_serde::to_vec(&(serde_bytes::Bytes::new(b"get_all"), 0, 0)).unwrap();
        assert!(decode_request(&other)
            .unwrap_err()
            .contains("unknown request"));
        let four = rmp_serde::to_vec(&(serde_bytes::Bytes::new(GET_META_MSG), 0, 0, 0)).unwrap();
        assert!(decode_request(&four).is_err());
        assert!(decode_request(b"\xc1").is_err());
        assert!(decode_request(b"").is_err());
    }

    #[test]
    fn replies_decode_to_a_payload_or_an_error() {
        let payload = NixlHandshakePayload::new("h", &sample());
        assert_eq!(
            decode_reply(&payload.encode()),
            Ok(ReplyFrame::Payload(payload.clone()))
        );
        assert_eq!(payload.agent_metadata(), Ok(sample()));
        assert_eq!(
            decode_reply(&encode_error("no rank 3")),
            Ok(ReplyFrame::Error("no rank 3".into()))
        );
        // Taking the frame gives the same, its metadata moved to the frame's start.
        for frame in [payload.encode(), encode_error("no rank 3"), vec![0xc1]] {
            assert_eq!(decode_reply_frame(frame.clone()), decode_reply(&frame));
        }
        let long = NixlHandshakePayload {
            compatibility_hash: "x".repeat(MAX_HASH_LEN + 1),
            agent_metadata_bytes: vec![],
        };
        assert!(decode_reply(&long.encode())
            .unwrap_err()
            .contains("more than"));
        assert!(decode_reply(&encode_clock(1.0)).is_err());
    }

    #[test]
    fn clocks_are_finite_numbers() {
        assert_eq!(decode_clock(&encode_clock(12.5)), Ok(12.5));
        assert_eq!(decode_clock(&rmp_serde::to_vec(&7u8).unwrap()), Ok(7.0));
        assert_eq!(decode_clock(&rmp_serde::to_vec(&1.5f32).unwrap()), Ok(1.5));
        assert!(decode_clock(&encode_clock(f64::NAN)).is_err());
        assert!(decode_clock(&encode_clock(f64::INFINITY)).is_err());
        assert!(decode_clock(b"\xa1x").is_err());
    }
}

//! The demo's control channel, where decode asks prefill for requests and prefill hands
//! over each request's [`KvTransferParams`] (the part a proxy plays between vLLM engines).
//! It is the connector's wire format ([`nixl_connector::Channel`]: length-delimited
//! MessagePack frames with a size cap); agent metadata and the KV-cache handshake go through
//! the connector's own side channel.
//!
//! A session:
//! 1. decode → prefill [`Message::Hello`]: who it is, its cache geometry, what it wants;
//! 2. prefill → decode [`Message::Welcome`]: its engine and cache geometry (or
//!    [`Message::Error`] saying why it refuses, or [`Message::Busy`]: try again shortly);
//! 3. prefill → decode [`Message::Announce`] per request: the transfer params of a finished
//!    prefill request ([`Message::AnnounceVllm`], vLLM's JSON of them, when the connectors
//!    speak vLLM's protocol); decode loads it with the connector, whose notification frees
//!    it;
//! 4. in conversations of several turns ([`Hello::turns`], see
//!    [`conversation`](crate::conversation)), decode → prefill [`Message::Turn`] once a turn
//!    is answered: the params naming the blocks decode keeps for the next turn
//!    ([`Message::TurnVllm`] in vLLM's protocol); prefill reads back what its prefix cache
//!    lacks and announces the next turn as in 3;
//! 5. prefill → decode [`Message::Complete`] once every request was acknowledged.

use nixl_connector::KvTransferParams;
use serde::{Deserialize, Serialize};

/// Version of the protocol; both sides must speak the same.
pub const PROTOCOL_VERSION: u32 = 5;

/// Default largest control-channel frame (1 MiB; a Hello takes under 100 bytes, an
/// announcement about 10 bytes per block).
pub const DEFAULT_MAX_FRAME: usize = 1 << 20;

/// decode → prefill: who the decode worker is and what it wants.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub version: u32,
    /// The decode agent's name.
    pub agent: String,
    /// Layers of the decode cache; must equal prefill's.
    pub layers: u32,
    /// Block size of the decode cache; must equal prefill's.
    pub block_bytes: u64,
    /// Requests to serve in this session (conversations of [`turns`](Self::turns) turns, each
    /// turn a request).
    pub requests: u64,
    /// Turns per conversation (1: every request stands alone).
    pub turns: u32,
    /// The most blocks decode answers a turn with (0 with one turn).
    pub answer_blocks: u32,
    /// Blocks per request.
    pub blocks_per_request: u32,
    /// Most requests announced and not yet acknowledged at any time.
    pub in_flight: u32,
    /// The protocol the decode's connector speaks ([`nixl_connector::Protocol`]'s name:
    /// `native` or `vllm`); prefill's must be the same.
    pub connector_protocol: String,
}

/// prefill → decode: the prefill engine, where its connector's side channel listens, and
/// its cache geometry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The prefill engine's id (also its agent's name).
    pub engine: String,
    /// The port of its connector's side channel (on the host decode reached it at).
    pub side_channel_port: u16,
    /// Layers of the prefill cache.
    pub layers: u32,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Blocks per layer.
    pub blocks: u32,
    /// Its TP ranks per stage (absent from an older prefill's: 1).
    #[serde(default = "one")]
    pub tp: u32,
    /// Its pipeline stages (absent: 1).
    #[serde(default = "one")]
    pub pp: u32,
    /// The KV heads of every block (absent: 1).
    #[serde(default = "one")]
    pub kv_heads: u32,
}

/// The default of a [`Welcome`]'s parallel sizes.
fn one() -> u32 {
    1
}

/// One control-channel message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Welcome`].
    Welcome(Welcome),
    /// A request is ready: where to read it (its request id is a number, which the demo's
    /// block pattern depends on).
    Announce(Box<KvTransferParams>),
    /// [`Message::Announce`] when the connectors speak vLLM's protocol: the params as vLLM's
    /// JSON `kv_transfer_params` (what vLLM's `request_finished` returns and a proxy hands
    /// to the decode).
    AnnounceVllm(String),
    /// decode → prefill: a turn was answered; the params (decode's, `do_remote_decode`) name
    /// the blocks it keeps for the next turn, and their request id
    /// ([`TurnId`](crate::conversation::TurnId)) the conversation and turn.
    Turn(Box<KvTransferParams>),
    /// [`Message::Turn`] when the connectors speak vLLM's protocol: vLLM's JSON of the params.
    TurnVllm(String),
    /// Every request of the session was pulled and acknowledged.
    Complete {
        /// Requests served.
        requests: u64,
    },
    /// The sender gives up on the session, and why.
    Error {
        /// Human-readable reason.
        message: String,
    },
    /// prefill → decode, instead of a Welcome: no room for this handshake now (too many
    /// pending); decode tries again after a pause.
    Busy {
        /// Human-readable reason.
        message: String,
    },
}

impl Message {
    /// Short name of the message kind, for errors and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello(_) => "Hello",
            Message::Welcome(_) => "Welcome",
            Message::Announce(_) => "Announce",
            Message::AnnounceVllm(_) => "AnnounceVllm",
            Message::Turn(_) => "Turn",
            Message::TurnVllm(_) => "TurnVllm",
            Message::Complete { .. } => "Complete",
            Message::Error { .. } => "Error",
            Message::Busy { .. } => "Busy",
        }
    }

    /// The message as one frame's body (a MessagePack map), e.g. for tests that speak the
    /// protocol by hand.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Parses a frame's body.
    ///
    /// # Errors
    /// The MessagePack decoder's message when the bytes are not a message.
    pub fn decode(body: &[u8]) -> Result<Message, String> {
        rmp_serde::from_slice(body).map_err(|err| err.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_truncation_is_refused() {
        let samples = [
            Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                agent: "decode-1".into(),
                layers: 32,
                block_bytes: 16384,
                requests: 100,
                turns: 3,
                answer_blocks: 4,
                blocks_per_request: 16,
                in_flight: 4,
                connector_protocol: "vllm".into(),
            }),
            Message::Announce(Box::new(KvTransferParams {
                do_remote_prefill: true,
                remote_block_ids: vec![1, 5, 7],
                remote_request_id: Some("9".into()),
                ..Default::default()
            })),
            Message::AnnounceVllm(r#"{"remote_block_ids": [[1, 5]]}"#.into()),
            Message::Turn(Box::new(KvTransferParams {
                do_remote_decode: true,
                remote_block_ids: vec![2, 3],
                remote_request_id: Some("9.1".into()),
                remote_num_tokens: Some(2),
                ..Default::default()
            })),
            Message::Complete { requests: 100 },
        ];
        for m in samples {
            let body = m.encode();
            assert_eq!(Message::decode(&body).unwrap(), m);
            for cut in 0..body.len() {
                assert!(Message::decode(&body[..cut]).is_err(), "{m:?} cut at {cut}");
            }
        }
    }
}

//! vLLM's NixlConnector protocol (pull mode, connector version 15, vLLM 0.33), so that a
//! Rust engine and a vLLM engine can serve as each other's prefill and decode.
//!
//! A worker and a scheduler speak it when their [`Protocol`](crate::Protocol) is
//! [`Vllm`](crate::Protocol::Vllm) (`kv_connector_extra_config.protocol: "vllm"`); the
//! pieces here are public for engines and tests that speak it themselves. The crate README's
//! "Working with vLLM" section gives the config on each side and what is not supported.
//!
//! # The side channel
//! One ZMQ ROUTER socket per prefill engine ([`MetadataServer`]) at vLLM's `remote_host`,
//! `remote_port`. A decode connects a REQ socket ([`MetadataClient`]) and sends the
//! MessagePack array `[b"get_meta_msg", pp_rank, tp_rank]`; the reply has two frames, the
//! rank's [`NixlHandshakePayload`] and the prefill's clock ([`clock::perf_counter`]). ZMQ
//! here is this module's own ZMTP 3.x over tokio (REQ, ROUTER, NULL security), so that
//! every frame has a cap checked before anything is allocated for it; see the crate
//! README for why no ZMQ crate is used.
//!
//! # The handshake payload
//! [`NixlHandshakePayload`] carries the prefill's [compatibility hash](compat) and its
//! MessagePack-encoded [`NixlAgentMetadata`]. A decode checks the hash before it decodes
//! the metadata ([`Compatibility::check`]). The metadata's geometry converts into the
//! connector's [`KvCacheSpec`](crate::KvCacheSpec) ([`NixlAgentMetadata::kv_cache_spec`]),
//! which [`check_compatible`](crate::check_compatible) compares and plans reads from.
//!
//! # Between engines
//! [`VllmKvTransferParams`] is vLLM's JSON `kv_transfer_params`, converting to and from the
//! connector's [`KvTransferParams`](crate::KvTransferParams). After its READ, a decode
//! notifies the prefill in vLLM's text format ([`notify`]).
//!
//! # Push mode
//! `NixlPushConnector`'s decode registers its blocks with each prefill rank in a NIXL
//! notification ([`push_reg`]); the prefill WRITEs into them with vLLM's done notification.

mod client;
pub mod clock;
pub mod compat;
mod geometry;
mod handshake;
mod limits;
mod msgpack;
pub mod notify;
mod params;
pub mod payload;
pub mod push_reg;
mod server;
mod zmtp;

pub use client::{fetch_meta, MetaReply, MetadataClient};
pub use compat::{Compatibility, CompatibilityFactors, SpeculativeFactors};
pub(crate) use geometry::RankRegistration;
pub(crate) use handshake::VllmWorker;
pub use handshake::EXPIRY_SAFETY_MARGIN;
pub use limits::VllmChannelLimits;
pub use notify::{NotificationLimits, VllmNotification};
pub use params::{VllmBlockIds, VllmKvTransferParams};
pub use payload::{NixlAgentMetadata, NixlHandshakePayload};
pub use server::MetadataServer;

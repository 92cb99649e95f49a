//! The prefill/decode demo, a thin client of the `nixl-connector` KV connector, and shared
//! code for the workspace's integration tests.
//!
//! A disaggregated LLM serving stack splits inference in two: a *prefill* worker computes
//! each request's KV cache, a *decode* worker pulls those KV-cache blocks and generates
//! tokens. This crate's `prefill` and `decode` examples show the transfer half with real
//! processes and real NIXL:
//!
//! - each worker is a connector worker ([`nixl_connector::KvConnectorWorker`]) with a KV
//!   cache of `layers x blocks x block_bytes`, one registered region per layer, set up from
//!   vLLM's `--kv-transfer-config` through the platform registry ([`config`]);
//! - decode connects to prefill's control channel ([`protocol`]: the connector's
//!   length-delimited MessagePack frames), playing the part a proxy plays between vLLM
//!   engines; agent metadata travels in the connector's own handshake or through etcd;
//! - [`prefill`] fills blocks with a checkable [`pattern`], finishes each request through
//!   the connector's scheduler (which holds its blocks) and announces its transfer params;
//!   [`decode`] loads them through its scheduler and worker (a prepared READ, the
//!   notification naming the request), verifies every byte, and prefill frees the blocks
//!   when the connector reports the notification;
//! - with `decode --turns N`, requests are [`conversation`]s of N turns: decode keeps each
//!   answered turn's blocks, and prefill reads back what its prefix cache lacks of them
//!   (vLLM 0.33's bidirectional KV transfer), checking every byte;
//! - with `--tp`/`--pp`, each engine is several ranks in its process, one connector worker
//!   each holding its stage's layers and its share of every block's heads ([`parallel`]);
//! - [`stats`] turns the run into a summary (requests, bytes, GB/s, latency percentiles);
//! - [`prometheus`] serves the connector's `vllm:nixl_*` metrics to Prometheus;
//! - `model_serving` serves a real model (`kv-model`) prefill → decode through the
//!   connector, for the model tests and the demo's model mode (`model_prefill`,
//!   `model_decode`).
//!
//! The libraries themselves are `nixl-capi-sys` (raw bindings, folder `nixl-sys/`), `nixl`
//! (the safe API) and `nixl-connector` (the KV connector).

#![warn(missing_docs)]

pub mod admission;
pub mod block_pool;
pub mod cli;
pub mod config;
pub mod conversation;
pub mod decode;
pub mod error;
pub mod kv_cache;
pub mod metered;
// The model's engines speak vLLM's protocol as well as the native one.
#[cfg(feature = "vllm")]
pub mod model_serving;
pub mod not_a_prefill;
pub mod parallel;
pub mod pattern;
pub mod prefill;
pub mod prometheus;
pub mod protocol;
pub mod stats;

pub use error::{Error, Result};

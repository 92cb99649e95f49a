//! The prefill/decode demo of the `nixl` crate, and shared code for the workspace's
//! integration tests.
//!
//! A disaggregated LLM serving stack splits inference in two: a *prefill* worker computes
//! each request's KV cache, a *decode* worker pulls those KV-cache blocks and generates
//! tokens. This crate's `prefill` and `decode` examples show the transfer half with real
//! processes and real NIXL:
//!
//! - each worker holds a [`kv_cache::KvCache`] of `layers x blocks x block_bytes`, one
//!   registered region per layer, set up from vLLM's `--kv-transfer-config` through the
//!   platform registry ([`config`]);
//! - decode connects to prefill's TCP [`side_channel`], and the two exchange agent metadata
//!   there or through etcd ([`etcd_metadata`]) and prefill's cache layout;
//! - [`prefill`] fills blocks with a checkable [`pattern`] and announces each request's
//!   blocks; [`decode`] READs them with prepared descriptor lists, the NIXL notification
//!   carrying the request id, verifies every byte, and prefill frees the blocks when the
//!   notification arrives;
//! - [`stats`] turns the run into a summary (requests, bytes, GB/s, latency percentiles).
//!
//! The libraries themselves are `nixl-sys` (raw bindings) and `nixl` (the safe API).

#![warn(missing_docs)]

pub mod admission;
pub mod block_pool;
pub mod cli;
pub mod codec;
pub mod config;
pub mod deadline;
pub mod decode;
pub mod error;
pub mod etcd_metadata;
pub mod framing;
pub mod kv_cache;
pub mod pattern;
pub mod prefill;
pub mod side_channel;
pub mod stats;

pub use error::{Error, Result};

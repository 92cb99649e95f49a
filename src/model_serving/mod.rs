//! Prefill → decode with a real model (`kv-model`) as the oracle: the prefill engine (its
//! TP ranks in its process) computes a prompt's KV into its registered blocks and finishes
//! the request with `kv_transfer_params`; the decode engine (another process, its ranks
//! inside it) loads the blocks through the connector, computes the prefix-hit blocks
//! itself, and generates tokens, which must equal one process's run of the same model.
//!
//! A scenario with a second turn serves a conversation: the prefill reads the first turn's
//! KV back from the decode that kept it ([`read_back`]).
//!
//! The model tests (`tests/model_pd.rs`) and the demo's model mode (the `model_prefill` and
//! `model_decode` examples) serve it.

pub mod engine;
pub mod handoff;
mod params;
pub mod read_back;
pub mod scenario;
pub mod serving;
mod steps;

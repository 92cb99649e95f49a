//! A small decoder-only transformer of the Llama family (RMSNorm, rotary position
//! embedding, grouped-query attention, SwiGLU MLP), with weights from a fixed seed, in f32
//! on the CPU, decoding greedily.
//!
//! Its attention reads K and V through a [`KvCache`]: a plain contiguous one
//! ([`ContiguousKv`], one process's reference), or a paged one ([`PagedKv`]) whose blocks
//! are the bytes of a KV cache laid out as a [`nixl_connector::KvCacheSpec`] describes it,
//! read and written in place (in the registered memory itself, through [`KvMemory`]).
//!
//! An engine of TP `tp` runs one [`KvCache`] per rank: each rank computes the query heads
//! of its KV heads, and the ranks' attention outputs are summed (the all-reduce).
//!
//! A model with a sliding window ([`ModelConfig::sliding_window`]) is hybrid: its window
//! layers form a second KV cache group, with a block table of its own, whose regions are
//! the layers' own or shared with the full-attention layers ([`GroupRegions`]).

mod config;
mod contiguous;
mod generate;
mod group_regions;
mod kv_cache;
mod memory;
mod model;
mod ops;
mod paged;
mod seeded;
mod weights;

pub use config::ModelConfig;
pub use contiguous::ContiguousKv;
pub use generate::{argmax, greedy, Generation};
pub use group_regions::GroupRegions;
pub use kv_cache::{kv_heads_of_rank, KvCache};
pub use memory::KvMemory;
pub use model::Model;
pub use paged::{KvPacking, PagedKv, PagedLayout};
pub use weights::Weights;

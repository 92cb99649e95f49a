//! The KV geometry: the shape of a worker's KV cache (`spec`), its KV cache groups
//! (`groups`), the state a block of an SSM group holds and how it is read (`ssm`) and the
//! groups' side of it (`ssm_groups`), which remote ranks a rank reads from (`tp_mapping`),
//! how a block takes its bytes from one remote rank (`read_plan`), which remote blocks a
//! load reads into which local ones (`block_map`), and, from all of these, the descriptors
//! of one load's READ from one remote rank (`load_reads`, the planner the worker posts
//! from); and, for engines split further, the layers of each pipeline stage (`pipeline`),
//! the layers each region holds by name and two ranks' regions paired by them
//! (`region_layers`),
//! the blocks of each decode-context-parallel rank (`dcp`), and a remote engine's sizes of
//! both and of TP (`engine_layout`).

pub(crate) mod block_map;
pub(crate) mod dcp;
pub(crate) mod engine_layout;
pub(crate) mod groups;
pub(crate) mod load_reads;
pub(crate) mod pipeline;
pub(crate) mod push_cut;
pub(crate) mod read_plan;
#[cfg(test)]
mod read_runs_tests;
pub(crate) mod region_layers;
pub(crate) mod spec;
pub(crate) mod ssm;
pub(crate) mod ssm_groups;
pub(crate) mod tp_mapping;

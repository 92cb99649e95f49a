//! The KV geometry: the shape of a worker's KV cache (`spec`), its KV cache groups
//! (`groups`) and the state of their SSM groups (`ssm`), which remote ranks a rank reads from (`tp_mapping`), how a block takes its
//! bytes from one remote rank (`read_plan`), and which remote blocks a load reads into which
//! local ones (`block_map`).

pub(crate) mod block_map;
pub(crate) mod groups;
pub(crate) mod read_plan;
pub(crate) mod spec;
pub(crate) mod ssm;
pub(crate) mod tp_mapping;

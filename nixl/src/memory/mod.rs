//! Memory: what can be registered safely, asking backends about it, registering it,
//! copying in and out of it while transfers may race, and detecting CUDA for VRAM.

pub(crate) mod atomic_copy;
pub(crate) mod cuda;
pub(crate) mod query;
pub(crate) mod registrable;
pub(crate) mod registration;

//! Memory: its kinds, what can be registered safely, asking backends about it, registering
//! it, copying in and out of it while transfers may race, detecting CUDA for VRAM, the
//! index of registered regions, and memory views for device-initiated transfers.

pub(crate) mod atomic_copy;
pub(crate) mod cuda;
pub(crate) mod mem_type;
pub(crate) mod mem_view;
pub(crate) mod query;
pub(crate) mod region_index;
pub(crate) mod registrable;
pub(crate) mod registration;

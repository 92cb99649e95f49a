//! The boundary with NIXL's C API: the library found and loaded at run time, the C API's
//! plain data (NIXL's statuses, memory kinds and descriptors), one owner type per C handle,
//! and the raw helpers (names, strings, lists). It knows only `nixl-capi-sys`, the error
//! type and plain data; everything above calls NIXL through it.

pub(crate) mod descriptor;
pub(crate) mod handles;
pub(crate) mod library;
pub(crate) mod mem_type;
pub(crate) mod raw;
pub(crate) mod status;

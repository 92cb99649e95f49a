//! Raw FFI bindings to NIXL's C API, `libnixl_capi.so` (NIXL 1.5.1).
//!
//! The declarations come from this crate's own header, `nixl_capi.h`, through bindgen.
//! Nothing here is safe to call without reading NIXL's ownership rules (summarised at the
//! top of the header); the `nixl` crate is the safe interface.
//!
//! Enums are modules of constants (`nixl_capi_status_t::NIXL_CAPI_SUCCESS`), so a value
//! the library returns that this header does not know is still a valid Rust value.
//!
//! # Finding the library
//! The build script looks at `NIXL_LIB_DIR`, `NIXL_PREFIX`, pkg-config package `nixl`,
//! `/opt/nvidia/nvda_nixl`, then the workspace's vendored wheel, and fails with a message
//! naming these when none has NIXL. Dependents read `DEP_NIXL_LIB_DIR` and
//! `DEP_NIXL_PLUGIN_DIR` in their build scripts (for example to set an rpath).

#![no_std]
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
#![allow(clippy::all)]
#![allow(missing_docs)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// The NIXL release whose C API the header declares.
pub const NIXL_VERSION: &str = "1.5.1";

/// The directory holding the `libnixl_capi.so` this crate was linked against.
pub const LIB_DIR: &str = env!("NIXL_SYS_LIB_DIR");

/// The directory NIXL loads backend plugins from for that library.
pub const PLUGIN_DIR: &str = env!("NIXL_SYS_PLUGIN_DIR");

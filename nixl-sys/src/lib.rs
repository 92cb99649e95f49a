//! Raw FFI bindings to NIXL's C API, `libnixl_capi.so` (NIXL 1.5.1), loaded at run time.
//!
//! The declarations come from this crate's own header, `nixl_capi.h`, through bindgen in its
//! dynamic-library mode: [`NixlCapi`] holds an opened library and one function pointer per
//! `nixl_capi_*` function, and its methods call them. Nothing here links NIXL, so building
//! and documenting this crate needs no NIXL installation (and no libclang: the generated
//! `src/bindings.rs` is shipped, and `tests/bindings_drift.rs` regenerates it to check it).
//!
//! Nothing here is safe to call without reading NIXL's ownership rules (summarised at the
//! top of the header); the `nixl` crate is the safe interface, and the one that finds and
//! loads the library.
//!
//! Enums are modules of constants (`nixl_capi_status_t::NIXL_CAPI_SUCCESS`), so a value
//! the library returns that this header does not know is still a valid Rust value.
//!
//! # Finding the library
//! [`discovery`] lists where the library is looked for, in order. The build script runs the
//! first steps of it (`NIXL_LIB_DIR`, `NIXL_PREFIX`, then this workspace's vendored wheel)
//! and records the folder it found as [`BUILD_LIB_DIR`], one step of the run-time search;
//! a build that finds nothing still succeeds.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
#![allow(clippy::all)]

pub mod discovery;

#[allow(missing_docs)]
mod bindings {
    include!("bindings.rs");
}

pub use bindings::*;

/// The libloading that [`NixlCapi::from_library`] takes its library from.
pub use libloading;

/// The NIXL release whose C API the header declares; the loaded library must be this one. Each
/// version of this crate is for one NIXL release (0.1.x: NIXL 1.5.1); another release,
/// patch releases included, is refused, since NIXL's C API promises no compatibility.
pub const NIXL_VERSION: &str = "1.5.1";

/// The command that installs the NIXL release this crate is for. `--no-deps`: loading the
/// library needs none of the wheel's declared dependencies (torch and a score of CUDA wheels).
pub const PIP_INSTALL: &str = "pip install --no-deps nixl-cu12==1.5.1";

/// The folder holding the `libnixl_capi.so` found when this crate was built, if any.
pub const BUILD_LIB_DIR: Option<&str> = match option_env!("NIXL_CAPI_SYS_BUILD_LIB_DIR") {
    Some(dir) if !dir.is_empty() => Some(dir),
    _ => None,
};

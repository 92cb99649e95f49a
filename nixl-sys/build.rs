//! Records where NIXL is at build time, as one step of the run-time search (nothing is
//! linked: the `nixl` crate loads the library at run time).
//!
//! It looks at `NIXL_LIB_DIR`, then `NIXL_PREFIX`, then, inside the nixl-rs workspace, the
//! wheel that `vendor/install-nixl.sh` unpacks; the folder found becomes
//! `nixl_capi_sys::BUILD_LIB_DIR` and the links metadata `DEP_NIXL_CAPI_LIB_DIR`. Finding
//! nothing is not an error, and a docs.rs build (`DOCS_RS` set) does not look at all.

use std::env;
use std::path::PathBuf;

#[allow(dead_code)]
#[path = "src/discovery.rs"]
mod discovery;

fn main() {
    for var in ["NIXL_LIB_DIR", "NIXL_PREFIX", "DOCS_RS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/discovery.rs");

    let found = if env::var_os("DOCS_RS").is_some() {
        None
    } else {
        find_at_build_time()
    };
    let found = found.map(|dir| dir.canonicalize().unwrap_or(dir));
    let shown = found
        .as_ref()
        .map(|dir| dir.display().to_string())
        .unwrap_or_default();
    println!("cargo:rustc-env=NIXL_CAPI_SYS_BUILD_LIB_DIR={shown}");
    if found.is_some() {
        println!("cargo:lib_dir={shown}");
    }
}

/// The library folder of `NIXL_LIB_DIR`, `NIXL_PREFIX` or the workspace's wheel.
fn find_at_build_time() -> Option<PathBuf> {
    let env = discovery::SearchEnv::from_process(None);
    if let Some(step) = discovery::explicit_step(&env) {
        return step.find().map(PathBuf::from);
    }
    // Only inside the nixl-rs workspace; a packaged crate has no vendor/ beside it.
    let vendor = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR")?).join("../vendor");
    if !vendor.join("install-nixl.sh").is_file() {
        return None;
    }
    println!("cargo:rerun-if-changed={}", vendor.display());
    let wheel = vendor.join("nixl/.nixl_cu12.mesonpy.libs");
    wheel.join(discovery::CAPI_LIB).is_file().then_some(wheel)
}

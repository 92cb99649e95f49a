//! The real `libnixl_capi.so` for these tests: the first one the search order finds.

use std::path::PathBuf;

use nixl_capi_sys::discovery::{search_order, SearchEnv, CAPI_LIB};

/// Path of the library the search finds; panics with the places searched when none has it
/// (`scripts/setup.sh` installs the pinned wheel).
pub fn library_path() -> PathBuf {
    let env = SearchEnv::from_process(nixl_capi_sys::BUILD_LIB_DIR.map(PathBuf::from));
    let steps = search_order(&env);
    steps
        .iter()
        .find_map(|step| step.find())
        .map(|dir| dir.join(CAPI_LIB))
        .unwrap_or_else(|| panic!("no {CAPI_LIB} found; searched {steps:#?}; run scripts/setup.sh"))
}

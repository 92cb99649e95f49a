//! NIXL's C API library, found and loaded at run time, once per process.
//!
//! The first call that needs NIXL (creating an agent or any NIXL object) runs the search of
//! [`nixl_capi_sys::discovery`] and loads the first `libnixl_capi.so` of NIXL 1.5.1 it finds, by
//! its full path; a failed search is an [`Error::Library`](crate::Error::Library) and is run
//! again by the next call. NIXL loads its backend plugins from `plugins/` beside the library
//! (or from `NIXL_PLUGIN_DIR`, which NIXL itself reads); this crate sets no environment
//! variable, so loading never races with threads reading the environment.
//!
//! Every NIXL call goes through [`capi`], which only code holding a NIXL object reaches:
//! such an object exists only after [`load`] succeeded.

mod failure;
mod search;
mod version;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

use nixl_capi_sys::NixlCapi;

pub use failure::{LibraryError, SearchOutcome, SearchStep};

/// The loaded library, for the rest of the process (never unloaded).
static LOADED: OnceLock<Loaded> = OnceLock::new();

/// Held while a search runs, so that two threads never load twice.
static SEARCHING: Mutex<()> = Mutex::new(());

/// The C API and what was loaded.
pub(crate) struct Loaded {
    capi: NixlCapi,
    info: LoadedLibrary,
}

impl Loaded {
    /// Which library was loaded.
    pub(crate) fn info(&self) -> &LoadedLibrary {
        &self.info
    }
}

/// The NIXL library this process loaded; its `Display` says which release, where, and which
/// step of the search found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedLibrary {
    path: PathBuf,
    version: String,
    found_by: String,
}

impl LoadedLibrary {
    /// Full path of the `libnixl_capi.so` that was loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// NIXL's version, as compiled into the library.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The step of the search order that found it, e.g. `NIXL_PREFIX=/opt/nixl`.
    pub fn found_by(&self) -> &str {
        &self.found_by
    }
}

impl std::fmt::Display for LoadedLibrary {
    /// E.g. `NIXL 1.5.1 at /opt/venv/…/libnixl_capi.so (found by VIRTUAL_ENV=/opt/venv)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NIXL {} at {} (found by {})",
            self.version,
            self.path.display(),
            self.found_by
        )
    }
}

/// Loads NIXL if this process has not yet, searching in the documented order.
pub(crate) fn load() -> Result<&'static Loaded, LibraryError> {
    if let Some(loaded) = LOADED.get() {
        return Ok(loaded);
    }
    let _searching = SEARCHING.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(loaded) = LOADED.get() {
        return Ok(loaded);
    }
    let (capi, info) = search::load_first()?;
    tracing::info!(path = %info.path.display(), version = %info.version, found_by = %info.found_by, "loaded NIXL");
    Ok(LOADED.get_or_init(|| Loaded { capi, info }))
}

/// NIXL's C API. Only reached by code that holds a NIXL object, and every NIXL object is
/// made after [`load`] succeeded (agents in `AgentBuilder::build`, the others in their
/// owners' `create`), so the library is always there.
pub(crate) fn capi() -> &'static NixlCapi {
    match LOADED.get() {
        Some(loaded) => &loaded.capi,
        None => unreachable!("a NIXL call before NIXL was loaded"),
    }
}

//! Runs the search order: the first library of NIXL 1.5.1 that opens is the one loaded.

use std::ffi::{c_void, CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nixl_capi_sys::discovery::{search_order, LooksIn, SearchEnv, Step, CAPI_LIB};
use nixl_capi_sys::libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use nixl_capi_sys::NixlCapi;

use super::failure::{LibraryError, SearchOutcome, SearchStep};
use super::version;
use super::LoadedLibrary;

/// Searches in order and loads the first usable library; otherwise says what each step saw.
pub(super) fn load_first() -> Result<(NixlCapi, LoadedLibrary), LibraryError> {
    let env = SearchEnv::from_process(nixl_capi_sys::BUILD_LIB_DIR.map(PathBuf::from));
    let mut looked_at = Vec::new();
    for step in search_order(&env) {
        match try_step(&step) {
            Ok((capi, path, version)) => {
                let info = LoadedLibrary {
                    path,
                    version,
                    found_by: step.name,
                };
                warn_without_plugins(&info.path);
                return Ok((capi, info));
            }
            Err(outcome) => looked_at.push(SearchStep {
                place: step.name,
                outcome,
            }),
        }
    }
    Err(LibraryError { looked_at })
}

/// The library of one step, with its path and version, or what stood in the way.
fn try_step(step: &Step) -> Result<(NixlCapi, PathBuf, String), SearchOutcome> {
    match &step.looks_in {
        LooksIn::Nowhere(why) => Err(SearchOutcome::Skipped(why)),
        LooksIn::Dirs(dirs) => {
            let dir = step
                .find()
                .ok_or_else(|| SearchOutcome::Missing(dirs.clone()))?;
            let path = dir.join(CAPI_LIB);
            // Checked before loading, so that another release's code never runs.
            let version = checked_version(&path)?;
            Ok((open(&path)?, path, version))
        }
        LooksIn::SystemLoader => {
            let capi = open(Path::new(CAPI_LIB))?;
            let path = path_of(&capi).ok_or_else(|| SearchOutcome::Unloadable {
                path: PathBuf::from(CAPI_LIB),
                reason: "the system loader opened it but dladdr cannot say from where".into(),
            })?;
            let version = checked_version(&path)?;
            Ok((capi, path, version))
        }
    }
}

/// The version of the NIXL that `path` belongs to, if it is the one the header declares.
fn checked_version(path: &Path) -> Result<String, SearchOutcome> {
    let dir = path.parent().unwrap_or(Path::new("."));
    match version::read(dir) {
        Ok(found) if found == nixl_capi_sys::NIXL_VERSION => Ok(found),
        Ok(found) => Err(SearchOutcome::WrongVersion {
            path: path.to_path_buf(),
            found,
        }),
        Err(reason) => Err(SearchOutcome::UnknownVersion {
            path: path.to_path_buf(),
            reason,
        }),
    }
}

/// Opens the library and reads every function of the header from it.
fn open(path: &Path) -> Result<NixlCapi, SearchOutcome> {
    let unloadable = |err: nixl_capi_sys::libloading::Error| SearchOutcome::Unloadable {
        path: path.to_path_buf(),
        reason: err.to_string(),
    };
    // RTLD_NOW: a missing dependency or symbol fails here rather than at a later call.
    // RTLD_NODELETE: NIXL's code stays mapped for the process's life, whatever is dropped.
    let flags = RTLD_NOW | RTLD_LOCAL | libc::RTLD_NODELETE;
    // SAFETY: this runs the initialisers of NIXL's libraries and of their dependencies,
    // which set up only those libraries' own state.
    let library = unsafe { Library::open(Some(path), flags) }.map_err(unloadable)?;
    // SAFETY: every symbol is read with the signature the header declares for it (the
    // version was checked, or is checked next for the system loader's find).
    unsafe { NixlCapi::from_library(library) }.map_err(unloadable)
}

/// The file the system loader opened, from the address of one of its functions.
fn path_of(capi: &NixlCapi) -> Option<PathBuf> {
    // SAFETY: Dl_info is pointers and nothing else, for which zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let address = capi.nixl_capi_create_agent as *const c_void;
    // SAFETY: `address` is inside a loaded library; `info` is a valid out-pointer.
    if unsafe { libc::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's file name is a NUL-terminated string owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(OsStr::from_bytes(name.to_bytes())))
}

/// Logs when NIXL will find no backend plugins beside the library it loads.
fn warn_without_plugins(path: &Path) {
    if std::env::var_os("NIXL_PLUGIN_DIR").is_some() {
        return;
    }
    let plugins = path.with_file_name("plugins");
    if !plugins.is_dir() {
        tracing::warn!(
            plugins = %plugins.display(),
            "NIXL finds its backend plugins (UCX, POSIX, ...) in this folder, which does not exist; set NIXL_PLUGIN_DIR"
        );
    }
}

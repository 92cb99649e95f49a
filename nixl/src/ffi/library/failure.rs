//! Why NIXL could not be loaded: each place looked at and what stood in the way, in a
//! message that says how to install NIXL.

use std::fmt;
use std::path::PathBuf;

use nixl_capi_sys::discovery::CAPI_LIB;
use nixl_capi_sys::{NIXL_VERSION, PIP_INSTALL};

/// NIXL's C API library could not be loaded: none was found, or none that was found is
/// NIXL 1.5.1 and opens. [`Display`](fmt::Display) lists every place looked at, in order,
/// and how to install NIXL; so does `Debug` (what `fn main() -> Result<(), Box<dyn Error>>`
/// prints), while `{:#?}` shows the fields.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LibraryError {
    /// Each step of the search order and what it found, in order.
    pub looked_at: Vec<SearchStep>,
}

/// One step of the search order and what it found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SearchStep {
    /// The step, e.g. `NIXL_PREFIX=/opt/nixl` or `the system loader`.
    pub place: String,
    /// Why it gave no library.
    pub outcome: SearchOutcome,
}

/// Why one step of the search gave no library.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SearchOutcome {
    /// The step looks nowhere, e.g. its variable is not set.
    Skipped(&'static str),
    /// None of these folders holds `libnixl_capi.so`.
    Missing(Vec<PathBuf>),
    /// The library belongs to another NIXL release.
    WrongVersion {
        /// The library.
        path: PathBuf,
        /// Its NIXL version.
        found: String,
    },
    /// The library's NIXL version cannot be read.
    UnknownVersion {
        /// The library.
        path: PathBuf,
        /// Why not.
        reason: String,
    },
    /// The library could not be opened, or lacks a function of the C API.
    Unloadable {
        /// The library.
        path: PathBuf,
        /// The loader's message.
        reason: String,
    },
}

impl LibraryError {
    /// The first library found of another NIXL release: its path and version.
    pub fn version_mismatch(&self) -> Option<(&PathBuf, &str)> {
        self.looked_at.iter().find_map(|step| match &step.outcome {
            SearchOutcome::WrongVersion { path, found } => Some((path, found.as_str())),
            _ => None,
        })
    }
}

impl fmt::Display for SearchOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SearchOutcome::Skipped(why) => f.write_str(why),
            SearchOutcome::Missing(dirs) => match dirs.as_slice() {
                [dir] => write!(f, "no {CAPI_LIB} in {}", dir.display()),
                dirs => {
                    let shown: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
                    write!(f, "no {CAPI_LIB} in any of {}", shown.join(", "))
                }
            },
            SearchOutcome::WrongVersion { path, found } => write!(
                f,
                "{} is NIXL {found}, but this nixl-rs is for NIXL {NIXL_VERSION} (version mismatch)",
                path.display()
            ),
            SearchOutcome::UnknownVersion { path, reason } => write!(
                f,
                "{}: cannot tell its NIXL version ({reason}); this nixl-rs is for NIXL {NIXL_VERSION}",
                path.display()
            ),
            SearchOutcome::Unloadable { path, reason } => {
                write!(f, "{} cannot be loaded: {reason}", path.display())
            }
        }
    }
}

impl fmt::Display for LibraryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NIXL {NIXL_VERSION} could not be loaded")?;
        if let Some((path, found)) = self.version_mismatch() {
            write!(f, " (version mismatch: {} is NIXL {found})", path.display())?;
        }
        writeln!(
            f,
            ". nixl-rs loads {CAPI_LIB} at run time and looked, in order, at:"
        )?;
        for step in &self.looked_at {
            writeln!(f, "  - {}: {}", step.place, step.outcome)?;
        }
        write!(
            f,
            "To install NIXL {NIXL_VERSION}: `{PIP_INSTALL}` in the active venv (or in any venv, \
             then set NIXL_PREFIX to that venv), or point NIXL_PREFIX at a NIXL {NIXL_VERSION} \
             install prefix (e.g. a source build's meson --prefix), or NIXL_LIB_DIR at the folder \
             holding {CAPI_LIB}."
        )
    }
}

impl fmt::Debug for LibraryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            f.debug_struct("LibraryError")
                .field("looked_at", &self.looked_at)
                .finish()
        } else {
            fmt::Display::fmt(self, f)
        }
    }
}

impl std::error::Error for LibraryError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_gives_the_install_command_without_the_wheels_dependencies() {
        let error = LibraryError {
            looked_at: vec![SearchStep {
                place: "NIXL_LIB_DIR=/nowhere".into(),
                outcome: SearchOutcome::Missing(vec![PathBuf::from("/nowhere")]),
            }],
        };
        let message = error.to_string();
        assert!(
            message.contains("`pip install --no-deps nixl-cu12==1.5.1`"),
            "{message}"
        );
        // What `main` returning it prints is the message; `{:#?}` still shows the fields.
        assert_eq!(format!("{error:?}"), message);
        assert!(format!("{error:#?}").contains("looked_at"));
    }
}

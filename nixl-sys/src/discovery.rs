//! Where NIXL's C API library is looked for, in order: plain path logic, no loading.
//!
//! The order (the `nixl` crate loads the first library found that is usable):
//! 1. `NIXL_LIB_DIR`: the folder holding `libnixl_capi.so`;
//! 2. `NIXL_PREFIX`: an install prefix (`lib/x86_64-linux-gnu`, `lib/aarch64-linux-gnu`,
//!    `lib64`, `lib`), a venv root (`lib/python3.*/site-packages`) or a site-packages folder,
//!    the last two holding the `nixl-cu12` or `nixl-cu13` wheel;
//! 3. the NIXL found when this crate was built, if any;
//! 4. the `nixl-cu12` / `nixl-cu13` wheel in the active venv (`VIRTUAL_ENV`);
//! 5. the same wheels in the active conda environment (`CONDA_PREFIX`);
//! 6. the same wheels in the site-packages of the first `python3` on `PATH` (the folder above
//!    the `bin/` holding it, links not followed: a venv that is only on `PATH`, as in a
//!    Dockerfile's `ENV PATH=/opt/venv/bin:$PATH`); Python is not run, and only absolute
//!    `PATH` entries count;
//! 7. the same wheels in the user site (`PYTHONUSERBASE`, else `~/.local`);
//! 8. `/opt/nvidia/nvda_nixl`, NIXL's default source-install prefix;
//! 9. the system loader (`ld.so.cache`, `LD_LIBRARY_PATH`).
//!
//! `NIXL_LIB_DIR` and `NIXL_PREFIX` are explicit: when one is set, only it is searched (the
//! first of the two wins), so a wrong value is reported instead of silently replaced; one
//! that names no folder says so.
//!
//! The build script includes this file too, to find NIXL at build time.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// File name of NIXL's C API library.
pub const CAPI_LIB: &str = "libnixl_capi.so";

/// NIXL's default source-install prefix (`meson setup --prefix`).
pub const DEFAULT_PREFIX: &str = "/opt/nvidia/nvda_nixl";

/// The Python packages of NIXL's wheels, in the order they are tried.
pub const WHEEL_PACKAGES: [&str; 2] = ["nixl_cu12", "nixl_cu13"];

/// Library folders of a prefix, in the order they are tried.
const PREFIX_LIB_DIRS: [&str; 4] = [
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib64",
    "lib",
];

/// What the search reads from the environment, read once so that one search sees one state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SearchEnv {
    /// `NIXL_LIB_DIR`.
    pub lib_dir: Option<PathBuf>,
    /// `NIXL_PREFIX`.
    pub prefix: Option<PathBuf>,
    /// The library folder found when this crate was built.
    pub build_time: Option<PathBuf>,
    /// `VIRTUAL_ENV`, the active venv.
    pub virtual_env: Option<PathBuf>,
    /// `CONDA_PREFIX`, the active conda environment.
    pub conda_prefix: Option<PathBuf>,
    /// The first `python3` on `PATH`, as named there (links not followed).
    pub path_python: Option<PathBuf>,
    /// Python's user base: `PYTHONUSERBASE`, else `$HOME/.local`.
    pub user_base: Option<PathBuf>,
    /// NIXL's default source-install prefix ([`DEFAULT_PREFIX`]).
    pub default_prefix: PathBuf,
}

impl SearchEnv {
    /// Reads the process environment; `build_time` is the library folder found at build
    /// time, if any. An empty variable counts as unset.
    pub fn from_process(build_time: Option<PathBuf>) -> Self {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        let user_base = var("PYTHONUSERBASE")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|home| PathBuf::from(home).join(".local")));
        SearchEnv {
            lib_dir: var("NIXL_LIB_DIR").map(PathBuf::from),
            prefix: var("NIXL_PREFIX").map(PathBuf::from),
            build_time,
            virtual_env: var("VIRTUAL_ENV").map(PathBuf::from),
            conda_prefix: var("CONDA_PREFIX").map(PathBuf::from),
            path_python: var("PATH").and_then(|path| python_on_path(&path)),
            user_base,
            default_prefix: PathBuf::from(DEFAULT_PREFIX),
        }
    }
}

/// Where one step of the search looks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LooksIn {
    /// Nowhere; the reason (e.g. "not set").
    Nowhere(&'static str),
    /// These folders, in order; the first that holds [`CAPI_LIB`] is the step's find.
    Dirs(Vec<PathBuf>),
    /// `dlopen` of the bare file name, which the system loader resolves.
    SystemLoader,
}

/// One step of the search order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The step as messages name it, e.g. `NIXL_PREFIX=/opt/nixl`.
    pub name: String,
    /// Where it looks.
    pub looks_in: LooksIn,
}

impl Step {
    /// The first of the step's folders that holds [`CAPI_LIB`].
    pub fn find(&self) -> Option<&Path> {
        match &self.looks_in {
            LooksIn::Dirs(dirs) => dirs
                .iter()
                .map(PathBuf::as_path)
                .find(|dir| dir.join(CAPI_LIB).is_file()),
            LooksIn::Nowhere(_) | LooksIn::SystemLoader => None,
        }
    }
}

/// The search order for `env`, every step included (those that look nowhere say why).
pub fn search_order(env: &SearchEnv) -> Vec<Step> {
    if let Some(step) = explicit_step(env) {
        return vec![step];
    }
    let unset = |name: &str| Step {
        name: name.to_string(),
        looks_in: LooksIn::Nowhere("not set"),
    };
    vec![
        unset("NIXL_LIB_DIR"),
        unset("NIXL_PREFIX"),
        match &env.build_time {
            Some(dir) => Step {
                name: format!("the NIXL found at build time ({})", dir.display()),
                looks_in: LooksIn::Dirs(vec![dir.clone()]),
            },
            None => Step {
                name: "the NIXL found at build time".to_string(),
                looks_in: LooksIn::Nowhere("none was found when nixl-capi-sys was built"),
            },
        },
        match &env.virtual_env {
            Some(venv) => Step {
                name: format!("VIRTUAL_ENV={}", venv.display()),
                looks_in: wheels_of(venv),
            },
            None => unset("VIRTUAL_ENV"),
        },
        match &env.conda_prefix {
            Some(conda) => Step {
                name: format!("CONDA_PREFIX={}", conda.display()),
                looks_in: wheels_of(conda),
            },
            None => unset("CONDA_PREFIX"),
        },
        match &env.path_python {
            Some(python) => Step {
                name: format!("the python3 on PATH ({})", python.display()),
                looks_in: match python.parent().and_then(Path::parent) {
                    Some(root) => wheels_of(root),
                    None => LooksIn::Nowhere("it is not in a bin/ folder"),
                },
            },
            None => Step {
                name: "the python3 on PATH".to_string(),
                looks_in: LooksIn::Nowhere("there is none"),
            },
        },
        match &env.user_base {
            Some(base) => Step {
                name: format!("the Python user site under {}", base.display()),
                looks_in: wheels_of(base),
            },
            None => Step {
                name: "the Python user site".to_string(),
                looks_in: LooksIn::Nowhere("neither PYTHONUSERBASE nor HOME is set"),
            },
        },
        Step {
            name: env.default_prefix.display().to_string(),
            looks_in: LooksIn::Dirs(prefix_dirs(&env.default_prefix)),
        },
        Step {
            name: "the system loader".to_string(),
            looks_in: LooksIn::SystemLoader,
        },
    ]
}

/// The one step of an explicit `NIXL_LIB_DIR` or `NIXL_PREFIX`, if either is set.
pub fn explicit_step(env: &SearchEnv) -> Option<Step> {
    if let Some(dir) = &env.lib_dir {
        return Some(Step {
            name: format!("NIXL_LIB_DIR={}", dir.display()),
            looks_in: configured(dir, || vec![dir.clone()]),
        });
    }
    env.prefix.as_ref().map(|prefix| Step {
        name: format!("NIXL_PREFIX={}", prefix.display()),
        looks_in: configured(prefix, || prefix_dirs(prefix)),
    })
}

/// Where a configured path looks: its folders, or nowhere when it names no folder.
fn configured(path: &Path, dirs: impl FnOnce() -> Vec<PathBuf>) -> LooksIn {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => LooksIn::Dirs(dirs()),
        Ok(_) => LooksIn::Nowhere("it is not a folder (nothing else is searched while it is set)"),
        Err(_) => LooksIn::Nowhere("it does not exist (nothing else is searched while it is set)"),
    }
}

/// The first `python3` in the absolute folders of `path` (a `PATH` value) that is an
/// executable file, as named there: a venv's `bin/python3` is a link, and the venv is where
/// the link is.
pub fn python_on_path(path: &std::ffi::OsStr) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(path)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join("python3"))
        .find(|python| {
            std::fs::metadata(python)
                .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        })
}

/// Library folders of `prefix` read as an install prefix, a venv root or a site-packages
/// folder (or an unpacked wheel), in that order.
pub fn prefix_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = PREFIX_LIB_DIRS.iter().map(|sub| prefix.join(sub)).collect();
    dirs.extend(wheel_dirs_in_venv(prefix));
    dirs.extend(wheel_dirs(prefix));
    dirs
}

/// Where the wheels of the venv (or user base) `root` would be.
fn wheels_of(root: &Path) -> LooksIn {
    let dirs = wheel_dirs_in_venv(root);
    if dirs.is_empty() {
        LooksIn::Nowhere("it has no lib/python3.*/site-packages folder")
    } else {
        LooksIn::Dirs(dirs)
    }
}

/// The wheels' library folders in every `site-packages` of the venv (or user base) `root`.
fn wheel_dirs_in_venv(root: &Path) -> Vec<PathBuf> {
    site_packages(root)
        .iter()
        .flat_map(|site| wheel_dirs(site))
        .collect()
}

/// The wheels' library folders inside one site-packages folder.
fn wheel_dirs(site: &Path) -> Vec<PathBuf> {
    WHEEL_PACKAGES
        .iter()
        .map(|package| site.join(format!(".{package}.mesonpy.libs")))
        .collect()
}

/// `lib/python3.*/site-packages` and `lib64/python3.*/site-packages` under `root`, sorted.
fn site_packages(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for lib in ["lib", "lib64"] {
        let Ok(entries) = std::fs::read_dir(root.join(lib)) else {
            continue;
        };
        let mut pythons: Vec<OsString> = entries
            .filter_map(|entry| entry.ok().map(|e| e.file_name()))
            .filter(|name| name.to_string_lossy().starts_with("python3"))
            .collect();
        pythons.sort();
        found.extend(
            pythons
                .into_iter()
                .map(|python| root.join(lib).join(python).join("site-packages")),
        );
    }
    found
}

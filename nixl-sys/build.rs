//! Finds NIXL's C API library, generates bindings from `nixl_capi.h`, and links `nixl_capi`.
//!
//! Discovery order (the first that applies wins; an explicit variable that points at the
//! wrong place is an error, never a reason to look elsewhere):
//! 1. `NIXL_LIB_DIR`: the directory holding `libnixl_capi.so`.
//! 2. `NIXL_PREFIX`: an install prefix (`meson install --prefix`, or an unpacked wheel).
//! 3. pkg-config, package `nixl`.
//! 4. NIXL's default source-install prefix, `/opt/nvidia/nvda_nixl`.
//! 5. The vendored wheel installed by `vendor/install-nixl.sh` in this workspace.
//!
//! Published to dependents (`links = "nixl"`): `DEP_NIXL_LIB_DIR`, `DEP_NIXL_PLUGIN_DIR`,
//! `DEP_NIXL_INCLUDE`, `DEP_NIXL_VERSION`, `DEP_NIXL_SOURCE`.

use std::env;
use std::path::{Path, PathBuf};

const NIXL_VERSION: &str = "1.5.1";
const CAPI_LIB: &str = "libnixl_capi.so";
const DEFAULT_PREFIX: &str = "/opt/nvidia/nvda_nixl";
const WHEEL_LIB_SUBDIR: &str = ".nixl_cu12.mesonpy.libs";

/// A NIXL installation: where `libnixl_capi.so` lives and how it was found.
struct Found {
    lib_dir: PathBuf,
    source: &'static str,
}

fn main() {
    for var in ["NIXL_PREFIX", "NIXL_LIB_DIR", "NIXL_PLUGIN_DIR"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=nixl_capi.h");

    let manifest_dir =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let vendored = manifest_dir.join("../vendor/nixl").join(WHEEL_LIB_SUBDIR);
    println!("cargo:rerun-if-changed={}", vendored.display());

    let found = match find_nixl(&vendored) {
        Ok(found) => found,
        Err(reason) => fail(&reason),
    };
    let lib_dir = found.lib_dir.canonicalize().unwrap_or(found.lib_dir);
    let plugin_dir = env::var_os("NIXL_PLUGIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| lib_dir.join("plugins"));

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=nixl_capi");
    // The wheel's libraries resolve each other through $ORIGIN rpaths; give the linker the
    // same folders so it can check libnixl_capi's own dependencies at link time.
    let bundled = lib_dir.join("../nixl_cu12.libs");
    println!("cargo:rustc-link-arg=-Wl,-rpath-link,{}", lib_dir.display());
    if bundled.is_dir() {
        println!("cargo:rustc-link-arg=-Wl,-rpath-link,{}", bundled.display());
    }
    // Only this package's own tests get this; dependents embed DEP_NIXL_LIB_DIR themselves.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());

    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:plugin_dir={}", plugin_dir.display());
    println!("cargo:include={}", manifest_dir.display());
    println!("cargo:version={NIXL_VERSION}");
    println!("cargo:source={}", found.source);
    println!("cargo:rustc-env=NIXL_SYS_LIB_DIR={}", lib_dir.display());
    println!(
        "cargo:rustc-env=NIXL_SYS_PLUGIN_DIR={}",
        plugin_dir.display()
    );

    generate_bindings(&manifest_dir.join("nixl_capi.h"));
}

/// Applies the discovery order documented at the top of this file.
fn find_nixl(vendored: &Path) -> Result<Found, String> {
    if let Some(dir) = env::var_os("NIXL_LIB_DIR") {
        let dir = PathBuf::from(dir);
        return if dir.join(CAPI_LIB).is_file() {
            Ok(Found {
                lib_dir: dir,
                source: "NIXL_LIB_DIR",
            })
        } else {
            Err(format!(
                "NIXL_LIB_DIR={} does not contain {CAPI_LIB}.",
                dir.display()
            ))
        };
    }
    if let Some(prefix) = env::var_os("NIXL_PREFIX") {
        let prefix = PathBuf::from(prefix);
        return lib_dir_under_prefix(&prefix)
            .map(|lib_dir| Found { lib_dir, source: "NIXL_PREFIX" })
            .ok_or_else(|| {
                format!(
                    "NIXL_PREFIX={} has no {CAPI_LIB} in lib/x86_64-linux-gnu, lib/aarch64-linux-gnu, lib64, lib or {WHEEL_LIB_SUBDIR}.",
                    prefix.display()
                )
            });
    }
    if let Some(lib_dir) = from_pkg_config() {
        return Ok(Found {
            lib_dir,
            source: "pkg-config",
        });
    }
    if let Some(lib_dir) = lib_dir_under_prefix(Path::new(DEFAULT_PREFIX)) {
        return Ok(Found {
            lib_dir,
            source: "default-prefix",
        });
    }
    if vendored.join(CAPI_LIB).is_file() {
        return Ok(Found {
            lib_dir: vendored.to_path_buf(),
            source: "vendored",
        });
    }
    Err("no NIXL installation was found.".to_string())
}

/// The library directory of a NIXL install prefix, if it holds the C API library.
fn lib_dir_under_prefix(prefix: &Path) -> Option<PathBuf> {
    [
        "lib/x86_64-linux-gnu",
        "lib/aarch64-linux-gnu",
        "lib64",
        "lib",
        WHEEL_LIB_SUBDIR,
        "",
    ]
    .iter()
    .map(|sub| prefix.join(sub))
    .find(|dir| dir.join(CAPI_LIB).is_file())
}

/// Asks pkg-config for package `nixl` and returns the link directory holding the C API.
fn from_pkg_config() -> Option<PathBuf> {
    let lib = pkg_config::Config::new()
        .cargo_metadata(false)
        .env_metadata(true)
        .probe("nixl")
        .ok()?;
    lib.link_paths
        .into_iter()
        .find(|dir| dir.join(CAPI_LIB).is_file())
}

/// Stops the build with one message that says how to fix it.
fn fail(reason: &str) -> ! {
    panic!(
        "\n\nnixl-sys: {reason}\n\n\
         nixl-sys links NIXL's C API library ({CAPI_LIB}, NIXL {NIXL_VERSION}). It looks, in order, at:\n\
         \x20 NIXL_LIB_DIR   a directory containing {CAPI_LIB}\n\
         \x20 NIXL_PREFIX    a NIXL install prefix (e.g. the meson --prefix of a source build)\n\
         \x20 pkg-config     package `nixl` (PKG_CONFIG_PATH)\n\
         \x20 {DEFAULT_PREFIX}  NIXL's default source-install prefix\n\
         \x20 vendor/nixl    the pinned wheel, installed by `vendor/install-nixl.sh`\n\n\
         To fix: run `vendor/install-nixl.sh` from the workspace root (downloads nixl-cu12=={NIXL_VERSION}\n\
         from PyPI and checks its sha256), or set NIXL_PREFIX to your NIXL install.\n\n"
    );
}

/// Runs bindgen over our header, keeping only NIXL's C API.
fn generate_bindings(header: &Path) {
    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_function("nixl_capi_.*")
        .allowlist_type("nixl_capi_.*")
        .allowlist_var("NIXL_CAPI_.*")
        .default_enum_style(bindgen::EnumVariation::ModuleConsts)
        .use_core()
        .ctypes_prefix("::core::ffi")
        .layout_tests(true)
        .derive_default(true)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .unwrap_or_else(|err| {
            panic!(
                "\n\nnixl-sys: bindgen could not read {}: {err}\n\
                 bindgen needs libclang: on Debian/Ubuntu run `apt-get install libclang-dev`,\n\
                 or point LIBCLANG_PATH at the directory holding libclang.so.\n\n",
                header.display()
            )
        });
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("bindings.rs");
    bindings
        .write_to_file(&out)
        .unwrap_or_else(|err| panic!("nixl-sys: cannot write {}: {err}", out.display()));
}

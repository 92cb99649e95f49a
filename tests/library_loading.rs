//! The NIXL this process loaded: its version and where it came from, and that NIXL's plugins
//! and (for the wheel, which bundles UCX) UCX's own modules are loaded from beside it, though
//! it was opened by its full path with no LD_LIBRARY_PATH.

mod common;

use std::path::{Path, PathBuf};

use common::unique_name;
use nixl::Agent;

/// Files mapped into this process.
fn mapped_files() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/maps")
        .expect("read /proc/self/maps")
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/'))
        .map(|path| {
            Path::new(path)
                .canonicalize()
                .unwrap_or_else(|_| PathBuf::from(path))
        })
        .collect()
}

#[test]
fn the_loaded_library_is_nixl_1_5_1_and_says_how_it_was_found() {
    let library = nixl::load_library().expect("NIXL loads");
    assert_eq!(library.version(), "1.5.1");
    assert!(library.path().is_absolute(), "{}", library.path().display());
    assert!(library.path().ends_with("libnixl_capi.so"));
    let expected_step = if std::env::var_os("NIXL_LIB_DIR").is_some() {
        "NIXL_LIB_DIR="
    } else if std::env::var_os("NIXL_PREFIX").is_some() {
        "NIXL_PREFIX="
    } else {
        "the NIXL found at build time"
    };
    assert!(
        library.found_by().starts_with(expected_step),
        "{}",
        library.found_by()
    );
    // Loaded once: the same library whatever asks again.
    assert!(std::ptr::eq(library, nixl::load_library().unwrap()));
}

#[test]
fn plugins_and_bundled_ucx_modules_come_from_beside_the_loaded_library() {
    let agent = Agent::new(&unique_name("loading")).expect("agent");
    let _ucx = agent.create_backend("UCX").expect("UCX backend");
    let lib_dir = nixl::load_library()
        .unwrap()
        .path()
        .parent()
        .unwrap()
        .canonicalize()
        .unwrap();
    let mapped = mapped_files();
    let ucx_plugin = lib_dir.join("plugins/libplugin_UCX.so");
    assert!(
        mapped.contains(&ucx_plugin),
        "{} not mapped",
        ucx_plugin.display()
    );

    // The wheel's UCX lives in ../nixl_cu12.libs, found through $ORIGIN paths.
    let bundled_ucx = lib_dir.join("../nixl_cu12.libs/ucx");
    if let Ok(bundled_ucx) = bundled_ucx.canonicalize() {
        let modules: Vec<&PathBuf> = mapped
            .iter()
            .filter(|file| file.parent() == Some(bundled_ucx.as_path()))
            .collect();
        assert!(
            modules
                .iter()
                .any(|m| m.to_string_lossy().contains("libuct_")),
            "no UCX transport module from {} is loaded: {modules:?}",
            bundled_ucx.display()
        );
    }
}

//! `scripts/find-libclang.sh`, which `scripts/setup.sh` uses to decide whether to install
//! libclang-dev, accepts exactly the files bindgen's clang-sys loads and never libclang-cpp.

use std::fs::File;
use std::path::Path;
use std::process::{Command, Output};

/// Runs the detection over `dir` alone (as an argument, or as `LIBCLANG_PATH`).
fn find(dir_arg: Option<&Path>, libclang_path: Option<&Path>) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/find-libclang.sh");
    let mut cmd = Command::new(script);
    cmd.env_remove("LIBCLANG_PATH");
    if let Some(dir) = dir_arg {
        cmd.arg(dir);
    }
    if let Some(path) = libclang_path {
        cmd.env("LIBCLANG_PATH", path);
    }
    cmd.output().expect("run scripts/find-libclang.sh")
}

/// A temporary directory holding empty files with these names.
fn dir_with(names: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temporary directory");
    for name in names {
        File::create(dir.path().join(name)).expect("create library file");
    }
    dir
}

fn found(out: &Output) -> Option<String> {
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn only_libclang_cpp_reads_as_missing() {
    let dir = dir_with(&["libclang-cpp.so.14", "libclang-cpp.so"]);
    assert_eq!(found(&find(Some(dir.path()), None)), None);
    assert_eq!(found(&find(None, Some(dir.path()))), None);
    assert_eq!(
        found(&find(None, Some(&dir.path().join("libclang-cpp.so.14")))),
        None
    );
}

#[test]
fn every_name_clang_sys_loads_reads_as_present() {
    for name in [
        "libclang.so",
        "libclang-14.so",
        "libclang.so.1",
        "libclang-14.so.1",
    ] {
        let dir = dir_with(&["libclang-cpp.so.14", name]);
        let want = dir.path().join(name).display().to_string();
        assert_eq!(
            found(&find(Some(dir.path()), None)).as_deref(),
            Some(want.as_str()),
            "{name} in a directory"
        );
        assert_eq!(
            found(&find(None, Some(dir.path()))).as_deref(),
            Some(want.as_str()),
            "{name} through LIBCLANG_PATH=<dir>"
        );
        assert_eq!(
            found(&find(None, Some(&dir.path().join(name)))).as_deref(),
            Some(want.as_str()),
            "{name} through LIBCLANG_PATH=<file>"
        );
    }
}

#[test]
fn libclang_path_is_the_only_place_looked_at() {
    let elsewhere = dir_with(&["libclang-14.so.1"]);
    let empty = dir_with(&[]);
    // The argument directory holds a libclang, but LIBCLANG_PATH points at an empty one.
    assert_eq!(
        found(&find(Some(elsewhere.path()), Some(empty.path()))),
        None
    );
}

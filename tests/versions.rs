//! Versions that can be published: the library crates share one plain semver version (no
//! build metadata, which crates.io ignores), and the README's Versions table says which NIXL
//! that version loads, the one the raw crate's header declares.

use std::path::Path;

/// The `version = "..."` of the `[package]` of the manifest at `path`.
fn package_version(path: &str) -> String {
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|err| panic!("read {path}: {err}"));
    let package = format!("\n{manifest}");
    let package = package
        .split("\n[")
        .find(|section| section.starts_with("package]"))
        .unwrap_or_else(|| panic!("{path} has no [package]"));
    package
        .lines()
        .find_map(|line| line.strip_prefix("version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or_else(|| panic!("{path} has no literal version"))
        .to_string()
}

#[test]
fn the_library_crates_share_a_plain_version_whose_nixl_the_readme_names() {
    let versions: Vec<String> = [
        "nixl-sys/Cargo.toml",
        "nixl/Cargo.toml",
        "nixl-connector/Cargo.toml",
    ]
    .into_iter()
    .map(package_version)
    .collect();
    let version = &versions[0];
    assert!(versions.iter().all(|v| v == version), "{versions:?}");
    let parts: Vec<&str> = version.split('.').collect();
    assert!(
        parts.len() == 3 && parts.iter().all(|p| p.parse::<u64>().is_ok()),
        "{version} is not plain MAJOR.MINOR.PATCH (crates.io ignores build metadata)"
    );

    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("read README.md");
    let row = format!(
        "| {}.{}.x | {} |",
        parts[0],
        parts[1],
        nixl_capi_sys::NIXL_VERSION
    );
    assert!(
        readme.contains(&row),
        "README's Versions table lacks the row {row}"
    );
}

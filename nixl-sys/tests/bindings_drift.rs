//! `src/bindings.rs` is bindgen's output for `nixl_capi.h`, shipped so that building needs
//! neither NIXL nor libclang. This test runs bindgen again (it needs libclang, which
//! `scripts/setup.sh` installs) and fails when the shipped file differs.
//!
//! To regenerate after changing the header: `scripts/gen-bindings.sh`, which runs this test
//! with `NIXL_CAPI_SYS_WRITE_BINDINGS=1`.

use std::path::Path;

/// bindgen's output for the header: only NIXL's C API, loaded at run time into `NixlCapi`,
/// every function required, layout checks on.
fn generate(header: &Path) -> String {
    bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_function("nixl_capi_.*")
        .allowlist_type("nixl_capi_.*")
        .allowlist_var("NIXL_CAPI_.*")
        .default_enum_style(bindgen::EnumVariation::ModuleConsts)
        .ctypes_prefix("::core::ffi")
        .dynamic_library_name("NixlCapi")
        .dynamic_link_require_all(true)
        .layout_tests(true)
        .derive_default(true)
        .generate_comments(false)
        .formatter(bindgen::Formatter::Prettyplease)
        .generate()
        .unwrap_or_else(|err| panic!("bindgen could not read {}: {err}", header.display()))
        .to_string()
}

#[test]
fn shipped_bindings_match_the_header() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let shipped_path = root.join("src/bindings.rs");
    let generated = generate(&root.join("nixl_capi.h"));
    if std::env::var_os("NIXL_CAPI_SYS_WRITE_BINDINGS").is_some() {
        std::fs::write(&shipped_path, &generated)
            .unwrap_or_else(|err| panic!("cannot write {}: {err}", shipped_path.display()));
        return;
    }
    let shipped = std::fs::read_to_string(&shipped_path)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", shipped_path.display()));
    if shipped != generated {
        let line = shipped
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map_or(
                shipped.lines().count().min(generated.lines().count()),
                |i| i,
            );
        panic!(
            "{} differs from bindgen's output for nixl_capi.h from line {} on;\n\
             run scripts/gen-bindings.sh and commit the result",
            shipped_path.display(),
            line + 1
        );
    }
}

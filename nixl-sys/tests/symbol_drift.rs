//! The header must declare exactly the `nixl_capi_*` functions that the real
//! `libnixl_capi.so` exports: none missing, none invented.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use object::{Object, ObjectSymbol};

const HEADER: &str = include_str!("../nixl_capi.h");

/// Function names declared in the header: an identifier `nixl_capi_*` followed by `(`.
fn declared_functions(header: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = header;
    while let Some(start) = rest.find("nixl_capi_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if tail[end..].trim_start().starts_with('(') {
            names.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    names
}

/// Function names the shared library exports with the `nixl_capi_` prefix.
fn exported_functions(library: &Path) -> BTreeSet<String> {
    let bytes = std::fs::read(library)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", library.display()));
    let file = object::File::parse(&*bytes)
        .unwrap_or_else(|err| panic!("cannot parse {}: {err}", library.display()));
    file.dynamic_symbols()
        .filter(|sym| sym.is_definition() && sym.kind() == object::SymbolKind::Text)
        .filter_map(|sym| sym.name().ok())
        .filter(|name| name.starts_with("nixl_capi_"))
        .map(str::to_string)
        .collect()
}

#[test]
fn header_declares_exactly_the_exported_functions() {
    let library = common::library_path();
    let exported = exported_functions(&library);
    let declared = declared_functions(HEADER);

    let missing: Vec<_> = exported.difference(&declared).collect();
    let invented: Vec<_> = declared.difference(&exported).collect();
    assert!(
        missing.is_empty() && invented.is_empty(),
        "nixl_capi.h drifted from {}:\n  exported but not declared: {missing:?}\n  declared but not exported: {invented:?}",
        library.display()
    );
    assert!(
        exported.len() >= 100,
        "only {} nixl_capi_* symbols found",
        exported.len()
    );
}

#[test]
fn header_parser_finds_declarations_and_ignores_types() {
    let text = "typedef struct nixl_capi_agent_s *nixl_capi_agent_t;\n\
                nixl_capi_status_t nixl_capi_create_agent(const char *name, nixl_capi_agent_t *a);\n\
                bool nixl_capi_is_stub (void);";
    let names: Vec<_> = declared_functions(text).into_iter().collect();
    assert_eq!(names, ["nixl_capi_create_agent", "nixl_capi_is_stub"]);
}

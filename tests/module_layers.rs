//! The `nixl` crate's files form layers: no file's code reaches, through `crate::` paths, a
//! file that reaches back to it, and the FFI boundary (`raw.rs`, `handles.rs`) knows only
//! `nixl-sys`, the loaded library, the error type and plain data.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every module of nixl/src and the modules its code names through `crate::`.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("nixl/src");
    let mut graph = BTreeMap::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read nixl/src") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let relative = path.strip_prefix(&src).unwrap().with_extension("");
            let mut module = relative.to_str().unwrap().replace('/', "::");
            if let Some(parent) = module.strip_suffix("::mod") {
                module = parent.to_string();
            }
            if module == "lib" {
                continue;
            }
            // Code only: a doc link to another module is a reference, not a dependency.
            let text: String = std::fs::read_to_string(&path)
                .expect("read source")
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let mut used = BTreeSet::new();
            for (at, _) in text.match_indices("crate::") {
                let rest = &text[at + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                // `crate::platform::registry` names the submodule when it exists.
                let top = if name == "platform" {
                    let sub: String = rest["platform::".len().min(rest.len())..]
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                        .collect();
                    if sub.is_empty() || !src.join("platform").join(format!("{sub}.rs")).exists() {
                        name.clone()
                    } else {
                        format!("platform::{sub}")
                    }
                } else {
                    name
                };
                if !top.is_empty() && top != module && !module.starts_with(&format!("{top}::")) {
                    used.insert(top);
                }
            }
            graph.insert(module, used);
        }
    }
    graph
}

/// A cycle through `start`, if there is one.
fn cycle_from(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![(start.to_string(), vec![start.to_string()])];
    let mut seen = BTreeSet::new();
    while let Some((node, path)) = stack.pop() {
        for next in graph.get(&node).into_iter().flatten() {
            if next == start {
                let mut cycle = path.clone();
                cycle.push(start.to_string());
                return Some(cycle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push((next.clone(), longer));
            }
        }
    }
    None
}

#[test]
fn no_file_reaches_back_to_itself() {
    let graph = imports();
    let cycles: Vec<String> = graph
        .keys()
        .filter_map(|module| cycle_from(&graph, module))
        .map(|cycle| cycle.join(" -> "))
        .collect();
    assert!(
        cycles.is_empty(),
        "cycles among nixl's files:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_ffi_boundary_knows_only_the_library_the_error_type_and_plain_data() {
    let graph = imports();
    for module in ["raw", "handles"] {
        let used = &graph[module];
        let allowed: BTreeSet<String> = ["error", "handles", "library", "mem_type", "status"]
            .into_iter()
            .map(String::from)
            .collect();
        assert!(
            used.is_subset(&allowed),
            "{module}.rs uses {:?}",
            used.difference(&allowed).collect::<Vec<_>>()
        );
    }
}

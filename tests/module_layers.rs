//! The `nixl` crate's files form layers: no file's code reaches, through `crate::`,
//! `super::` or `self::` paths (grouped `use` imports included), a file that reaches back
//! to it, and the FFI boundary (`ffi/raw.rs`, `ffi/handles.rs`) knows only `nixl-capi-sys`,
//! the loaded library, the error type and plain data. Its folders are floors
//! ([`NIXL_FLOORS`]): a file reaches only files of its own floor and of the floors below.
//!
//! A file's own ancestors (`peers/wire/mod.rs` and `peers/mod.rs` for
//! `peers/wire/reader.rs`) do not count as reached:
//! a parent module holds its children. `super::` is read relative to the file, so one
//! inside an inline module (`mod tests { use super::*; }`) counts as the file's parent.
//! Paths to the public API that `lib.rs` re-exports (`crate::Agent`) name no module and are
//! not counted; only a unit test (`peers/recheck.rs`'s) uses one.
//!
//! The same holds for `nixl-connector`'s files and folders ([`CONNECTOR_FLOORS`]), where
//! only `lib.rs` and the engine's step reach the worker, and where no file names an item
//! through `lib.rs`'s re-exports: each names the module that defines it, so that the floors
//! see every import.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// `nixl`'s floors, bottom up: the folders (and the files at the crate root) of each floor.
/// A file reaches only files of its own floor and of the floors below it.
/// - the boundary with the C API, and the one error type its checks return (which names
///   the library's failures, NIXL's statuses and memory kinds);
/// - what is known of peers: validated metadata, the agents of this process, where metadata
///   leads;
/// - the agent core: its handle, lock, backends, completion driver and notification hub;
/// - memory, then descriptor lists, then transfers, then notifications, then metadata
///   exchange: each the public `Agent`'s methods of that concept and what they need;
/// - the platforms, then vLLM's config, which builds a whole agent.
const NIXL_FLOORS: &[&[&str]] = &[
    &["ffi", "error"],
    &["peers"],
    &["agent"],
    &["memory"],
    &["descriptors"],
    &["transfer"],
    &["notifications"],
    &["metadata"],
    &["platform"],
    &["kv_config"],
];

/// `nixl-connector`'s floors, bottom up, as [`NIXL_FLOORS`]:
/// - the one error type, then why a load failed, then the metrics (which count failures);
/// - the KV geometry: the cache's shape, TP mapping, read plans, block maps;
/// - the transport between engines: the handshake message, the transfer params, the side
///   channel and what guards it, etcd;
/// - vLLM's protocol (the `vllm` feature), which speaks with the same geometry and params;
/// - the settings: the lease and the multi-turn settings (which share its bounds), then
///   the configuration, which names both protocols;
/// - the scheduler half (with the outcomes and outputs it aggregates, and their wire);
/// - the worker half (loads, handshakes with remotes, sends, staging, the state they
///   share), which takes the scheduler's metadata;
/// - the engine's step, which drives both halves.
const CONNECTOR_FLOORS: &[&[&str]] = &[
    &["error"],
    &["failure"],
    &["metrics"],
    &["geometry"],
    &["transport"],
    &["vllm"],
    &["lease", "multi_turn", "transfer_mode"],
    &["config"],
    &["scheduler"],
    &["worker"],
    &["engine_step"],
];

/// Every module of nixl/src (`peers::wire::reader` for peers/wire/reader.rs) and its
/// code, comment lines left out (a doc link to another module is a reference, not a
/// dependency).
fn sources() -> BTreeMap<String, String> {
    sources_in("nixl/src")
}

/// Every module of the crate whose sources are in `crate_src` (relative to the workspace)
/// and its code, as [`sources`] reads them.
fn sources_in(crate_src: &str) -> BTreeMap<String, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(crate_src);
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read the crate's sources") {
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
            let code = std::fs::read_to_string(&path)
                .expect("read source")
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            out.insert(module, code);
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Reads a use tree at the start of `text` (`a::b`, `a::{b, c::d}`, `a::*`, `a as b`),
/// appending each path it names to `out` after `prefix`.
fn use_tree(text: &str, prefix: &[String], out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix.to_vec();
    let mut at = 0;
    loop {
        let rest = &text[at..];
        let skipped = rest.len() - rest.trim_start().len();
        at += skipped;
        let rest = &text[at..];
        if let Some(inner) = rest.strip_prefix('{') {
            at += 1;
            let mut used = 0;
            loop {
                let inside = &inner[used..];
                let blank = inside.len() - inside.trim_start().len();
                used += blank;
                if inner[used..].starts_with('}') {
                    return at + used + 1;
                }
                used += use_tree(&inner[used..], &path, out);
                let inside = &inner[used..];
                used += inside.len() - inside.trim_start().len();
                match inner[used..].chars().next() {
                    Some(',') => used += 1,
                    Some('}') => return at + used + 1,
                    _ => return at + used,
                }
            }
        }
        let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
        if name.is_empty() {
            break;
        }
        at += name.len();
        if name != "self" {
            path.push(name);
        }
        if text[at..].starts_with("::") {
            at += 2;
            continue;
        }
        break;
    }
    if text[at..].trim_start().starts_with("as ") {
        let rest = text[at..].trim_start();
        at = text.len() - rest.len() + 3;
        let rest = text[at..].trim_start();
        at = text.len() - rest.len() + rest.chars().take_while(|&c| is_ident(c)).count();
    }
    if path.len() > prefix.len() {
        out.push(path);
    }
    at
}

/// The module paths `code` of module `module` names through `crate::`, `super::` and
/// `self::`, made absolute (`["wire", "reader", "Parsed"]`).
fn paths(module: &str, code: &str) -> Vec<Vec<String>> {
    let own: Vec<String> = module.split("::").map(String::from).collect();
    let mut out = Vec::new();
    for (at, _) in code.match_indices("::") {
        let before = &code[..at];
        let word: String = {
            let rev: String = before.chars().rev().take_while(|&c| is_ident(c)).collect();
            rev.chars().rev().collect()
        };
        let start = at - word.len();
        // Only the first segment of a path: `a::crate::` is no path of ours.
        let preceded = code[..start].ends_with("::");
        if preceded || start > 0 && code[..start].ends_with(is_ident) {
            continue;
        }
        let mut base = match word.as_str() {
            "crate" => Vec::new(),
            "self" => own.clone(),
            "super" => own[..own.len() - 1].to_vec(),
            _ => continue,
        };
        let mut rest = at + 2;
        // `super::super::` climbs further.
        while word == "super" && code[rest..].starts_with("super::") {
            base.pop();
            rest += "super::".len();
        }
        use_tree(&code[rest..], &base, &mut out);
    }
    out
}

/// The longest prefix of `path` that is one of `modules`.
fn resolve(path: &[String], modules: &BTreeSet<String>) -> Option<String> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|m| modules.contains(m))
}

/// Every module of nixl/src and the modules its code reaches (its ancestors and itself left
/// out).
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    imports_of(sources())
}

/// Every module of `sources` (as [`sources_in`] reads them) and the modules its code
/// reaches, as [`imports`] finds them.
fn imports_of(sources: BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let modules: BTreeSet<String> = sources.keys().cloned().collect();
    sources
        .iter()
        .map(|(module, code)| {
            let used = paths(module, code)
                .iter()
                .filter_map(|path| resolve(path, &modules))
                .filter(|target| target != module && !module.starts_with(&format!("{target}::")))
                .collect();
            (module.clone(), used)
        })
        .collect()
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

/// The cycles among the modules of `graph`, one line each.
fn cycles_in(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    graph
        .keys()
        .filter_map(|module| cycle_from(graph, module))
        .map(|cycle| cycle.join(" -> "))
        .collect()
}

#[test]
fn no_file_reaches_back_to_itself() {
    let cycles = cycles_in(&imports());
    assert!(
        cycles.is_empty(),
        "cycles among nixl's files:\n{}",
        cycles.join("\n")
    );
}

/// The floor of `module` (its first path segment) in `floors`.
fn floor_of(floors: &[&[&str]], module: &str) -> Option<usize> {
    let top = module.split("::").next().unwrap();
    floors.iter().position(|floor| floor.contains(&top))
}

/// Each import of `graph` from a lower floor of `floors` into a higher one (`a -> b`), and
/// each module on no floor.
fn upward_imports(graph: &BTreeMap<String, BTreeSet<String>>, floors: &[&[&str]]) -> Vec<String> {
    let mut wrong = Vec::new();
    for (module, used) in graph {
        let Some(floor) = floor_of(floors, module) else {
            wrong.push(format!("{module} is on no floor"));
            continue;
        };
        for target in used {
            match floor_of(floors, target) {
                Some(above) if above > floor => wrong.push(format!("{module} -> {target}")),
                Some(_) => {}
                None => wrong.push(format!("{target} is on no floor")),
            }
        }
    }
    wrong
}

#[test]
fn nixl_folders_import_only_the_floors_below() {
    let wrong = upward_imports(&imports(), NIXL_FLOORS);
    assert!(
        wrong.is_empty(),
        "nixl imports from a lower floor into a higher one (floors, bottom up: {NIXL_FLOORS:?}):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn an_upward_import_is_seen() {
    let sources = BTreeMap::from([
        (
            "ffi::raw".to_string(),
            "use crate::error::Result;".to_string(),
        ),
        (
            "error".to_string(),
            "use crate::ffi::status::Status;".to_string(),
        ),
        ("ffi::status".to_string(), String::new()),
        (
            "peers::wire".to_string(),
            "fn f() { crate::transfer::xfer::XferRequest::new(); }".to_string(),
        ),
        (
            "transfer::xfer".to_string(),
            "use crate::peers::wire;".to_string(),
        ),
    ]);
    assert_eq!(
        upward_imports(&imports_of(sources), NIXL_FLOORS),
        ["peers::wire -> transfer::xfer"]
    );
}

#[test]
fn the_ffi_boundary_knows_only_the_library_the_error_type_and_plain_data() {
    let graph = imports();
    for module in ["ffi::raw", "ffi::handles"] {
        let used = &graph[module];
        let allowed: BTreeSet<String> = [
            "error",
            "ffi::handles",
            "ffi::library",
            "ffi::status",
            "ffi::mem_type",
        ]
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

#[test]
fn grouped_imports_and_super_paths_are_read() {
    let strings = |paths: Vec<Vec<String>>| -> Vec<String> {
        paths.into_iter().map(|p| p.join("::")).collect()
    };
    let code = "use crate::{driver::{lock, Shared}, error::Result as R, self as _};\n\
                use super::{reader::Parsed, *};\n\
                fn f() { super::super::top::g(); crate::xfer::XferRequest::new(); }\n\
                use self::child::Thing;\n\
                pub(crate) fn h() {} pub(super) fn i() {} let x = a::crate_like::y;";
    assert_eq!(
        strings(paths("wire::reader", code)),
        [
            "driver::lock",
            "driver::Shared",
            "error::Result",
            "wire::reader::Parsed",
            "top::g",
            "xfer::XferRequest::new",
            "wire::reader::child::Thing",
        ]
    );
    // On the real sources: wire/'s files name each other only through `super::` paths
    // (layout.rs through `use super::ucx_rkey;`).
    let graph = imports();
    assert!(
        graph["peers::wire::layout"].contains("peers::wire::ucx_rkey"),
        "{:?}",
        graph["peers::wire::layout"]
    );
    assert!(graph["peers::wire::ucx_rkey"].contains("peers::wire::reader"));
}

#[test]
fn no_connector_file_reaches_back_to_itself_and_its_folders_import_only_the_floors_below() {
    let graph = imports_of(sources_in("nixl-connector/src"));
    let cycles = cycles_in(&graph);
    assert!(
        cycles.is_empty(),
        "cycles among nixl-connector's files:\n{}",
        cycles.join("\n")
    );
    let wrong = upward_imports(&graph, CONNECTOR_FLOORS);
    assert!(
        wrong.is_empty(),
        "nixl-connector imports from a lower floor into a higher one (floors, bottom up: \
         {CONNECTOR_FLOORS:?}):\n{}",
        wrong.join("\n")
    );
    // The state the loads, the handshakes and the staging share sits below all three.
    for module in ["worker::load", "worker::connect", "worker::host_buffer"] {
        assert!(
            graph[module].contains("worker::shared"),
            "{module}: {:?}",
            graph[module]
        );
    }
}

/// Each path of `sources` that names no module of the crate (`crate::Foo`, an item
/// `lib.rs` re-exports), as `module: path`: an import the floors cannot see.
fn paths_through_lib_rs(sources: &BTreeMap<String, String>) -> Vec<String> {
    let tops: BTreeSet<&str> = sources
        .keys()
        .map(|module| module.split("::").next().unwrap())
        .collect();
    let mut found = Vec::new();
    for (module, code) in sources {
        for path in paths(module, code) {
            if !tops.contains(path[0].as_str()) {
                found.push(format!("{module}: crate::{}", path.join("::")));
            }
        }
    }
    found
}

#[test]
fn connector_files_name_items_by_the_module_that_defines_them() {
    let found = paths_through_lib_rs(&sources_in("nixl-connector/src"));
    assert!(
        found.is_empty(),
        "nixl-connector files name items through lib.rs's re-exports, which the floors cannot \
         see; name them by the module that defines them (crate::geometry::spec::KvCacheSpec):\n{}",
        found.join("\n")
    );
}

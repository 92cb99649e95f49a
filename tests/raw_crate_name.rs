//! One name for the raw crate: the sources and docs call it `nixl-capi-sys` (in code
//! `nixl_capi_sys`), never `nixl-sys`, which is NVIDIA's crate of that name; a paragraph that
//! names `nixl-sys` is about NVIDIA's crate and says so. The folder `nixl-sys/` keeps its name,
//! so paths (`nixl-sys/...`) are not names of the crate.

use std::path::{Path, PathBuf};

/// Folders of the workspace that hold no sources or docs of ours.
const SKIPPED: [&str; 4] = ["target", "vendor", ".git", "bench"];

/// The `.rs` and `.md` files under `dir`, recursively.
fn sources(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read a workspace folder") {
        let path = entry.expect("folder entry").path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if path.is_dir() {
            if !SKIPPED.contains(&name.as_ref()) {
                sources(&path, found);
            }
        } else if name.ends_with(".rs") || name.ends_with(".md") {
            found.push(path);
        }
    }
}

/// Whether `text` names the crate `nixl-sys` (a path into the folder does not count).
fn names_nixl_sys(text: &str) -> bool {
    text.match_indices("nixl-sys")
        .any(|(at, _)| !text[at + "nixl-sys".len()..].starts_with('/'))
}

#[test]
fn the_raw_crate_is_called_nixl_capi_sys_and_nvidias_crate_is_named_as_nvidias() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(root, &mut files);
    let this_file = root.join(file!());
    let mut wrong = Vec::new();
    for file in files.iter().filter(|file| **file != this_file) {
        let text = std::fs::read_to_string(file).expect("read a source file");
        let shown = file.strip_prefix(root).unwrap_or(file).display();
        if text.contains("nixl_sys") {
            wrong.push(format!("{shown}: uses the name nixl_sys"));
        }
        // Paragraphs: of Markdown, or of a comment (a line without `//` ends one).
        let mut paragraph = String::new();
        for line in text.lines().chain([""]) {
            let comment = line.trim_start().starts_with("//");
            let blank = line.trim_start_matches(['/', '!', ' ']).trim().is_empty();
            if blank || (file.extension().is_some_and(|e| e == "rs") && !comment) {
                if names_nixl_sys(&paragraph) && !paragraph.contains("NVIDIA") {
                    wrong.push(format!("{shown}: {}", paragraph.trim()));
                }
                paragraph.clear();
            } else {
                paragraph.push_str(line);
                paragraph.push('\n');
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

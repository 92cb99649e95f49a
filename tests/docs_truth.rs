//! The documents a newcomer reads first (`README.md`, `nixl-connector/README.md`,
//! `docs/architecture.md`) stay true to the code. No NIXL is needed: the test reads the
//! documents and the sources as text.
//!
//! What is read: every code span (`` `...` ``) and link of a document, outside fenced code.
//! A document is read in blocks: a paragraph, a list item (without its nested items), a
//! table row or a heading.
//!
//! **Paths.** A span names a path when it has no whitespace, no `:` and no other character
//! of a command, address or pattern, is not absolute, and holds a `/` or ends as a file does
//! (`.rs`, `.sh`, `.md`, ...: [`paths::is_path`]). Each must exist:
//! - a path with a `/` (`worker/load.rs`, `tests/demo.rs`, `bench/results/`) relative to
//!   the repository root, to a folder its block named before it, or to one of its
//!   document's bases ([`DOCUMENTS`]: the crate folders the document is about);
//! - a bare file name (`failure.rs`) in a folder its block named before it (`` `worker/` ``)
//!   when the block named one, as a reader would take it; otherwise at the root, in a base
//!   or anywhere below a base;
//! - a name ending in `/` is a folder, and a `*` in the last part matches any text there.
//!
//! Links (`[text](target)`) are relative to their document's folder, as Markdown has them,
//! and an anchor (`#security`) must be a heading of the document it points into.
//! [`NOT_REPOSITORY_PATHS`] lists the path-like spans that name no file of this
//! repository.
//!
//! **Rust names.** Every `a::b` path in a span (`Type::method`, `module::Item`,
//! `nixl::Item`, an enum's variant, a struct's field) and every span that is exactly
//! `Type.field` must be an item of this repository's sources ([`names::Sources::check`]):
//! - `nixl::Item`, `nixl_connector::Item`, `nixl_capi_sys::Item`: the crate's `lib.rs`
//!   defines or re-exports it; with more parts, the last module has the item;
//! - `Type::member`: a file that defines or implements `Type` has the member as a method,
//!   constant, field or variant;
//! - `module::item`: a file of the module (`module.rs` or below `module/`) defines it,
//!   re-exports it or holds it as a child module.
//!
//! Only the last two parts of a longer path are checked. Paths into other crates
//! ([`OTHER_CRATES`]) and the names in [`NOT_RUST_ITEMS`] are not this repository's items.
//!
//! **Names beside files.** Where a name's span is followed by ` (` and a `.rs` file's span
//! (`` `ConnectorMetadata` (`scheduler/metadata.rs`) ``), the file defines the name; where a
//! file's span is followed by ` (` and names (`` `load.rs` (`Load`, `try_now`) ``), the file
//! defines each of them.
//!
//! **Metrics.** The table of the connector README's "Metrics" section lists every series
//! named in `nixl-connector/src/metrics/series.rs` once, and no other; no document names a
//! `vllm:nixl_` series that file lacks.
//!
//! **Lines.** No line of the documents is longer than [`MAX_LINE`] characters.
//!
//! A failure names the document, the line and what is missing.

#[path = "docs_truth/markdown.rs"]
mod markdown;
#[path = "docs_truth/names.rs"]
mod names;
#[path = "docs_truth/paths.rs"]
mod paths;

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::Path;
use std::sync::OnceLock;

use names::Sources;
use paths::Places;

/// A document the test reads, and the folders (relative to the repository root) its
/// relative paths may start in, besides the root.
struct Document {
    path: &'static str,
    bases: &'static [&'static str],
}

/// The documents, and their bases: the crates each one describes.
const DOCUMENTS: &[Document] = &[
    Document {
        path: "README.md",
        bases: &["nixl/src"],
    },
    Document {
        path: "nixl-connector/README.md",
        bases: &[
            "nixl-connector",
            "nixl-connector/src",
            "nixl-connector/tests",
        ],
    },
    Document {
        path: "docs/architecture.md",
        bases: &[
            "nixl-sys",
            "nixl/src",
            "nixl-connector",
            "nixl-connector/src",
            "nixl-connector/tests",
        ],
    },
];

/// Path-like spans that name no file of this repository: vLLM's Python sources
/// (`pull_scheduler.py`, ...), the folders of a NIXL installation, a file the metadata
/// fuzzer writes, the wheel `vendor/install-nixl.sh` unpacks (not committed), and build
/// output (`target/`).
const NOT_REPOSITORY_PATHS: &[&str] = &[
    "pull_scheduler.py",
    "base_worker.py",
    "tp_mapping.py",
    "utils.py",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "plugins/",
    "bin/",
    "child-stderr.log",
    "vendor/nixl/",
    "target/",
];

/// The first parts of Rust paths into other crates (`std::process::exit`, `mem::forget`,
/// `tokio::time::timeout`).
const OTHER_CRATES: &[&str] = &[
    "std",
    "core",
    "alloc",
    "mem",
    "tokio",
    "serde",
    "serde_json",
    "futures",
    "metrics",
    "tracing",
    "libc",
];

/// Names with a Rust path's form that are no Rust item of this repository: NIXL's C++
/// classes and methods, and a vLLM Python attribute.
const NOT_RUST_ITEMS: &[&str] = &[
    "nixlMemSection::emplace",
    "nixlUcxChunkBackendReqH::complete",
    "nixlUcxDedicatedThread::run",
    "TransferTopology.block_size_ratio",
];

/// The longest line a document may have, in characters.
const MAX_LINE: usize = 300;

/// The file naming every metric series, and the document whose table lists them.
const SERIES_FILE: &str = "nixl-connector/src/metrics/series.rs";
const METRICS_DOCUMENT: &str = "nixl-connector/README.md";

/// What a series name starts with.
const SERIES_PREFIX: &str = "vllm:nixl_";

/// What a check found wrong: where, and what.
struct Finding {
    /// The document's path.
    document: &'static str,
    /// The line (from 1).
    line: usize,
    /// What is missing or wrong.
    what: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.document, self.line, self.what)
    }
}

/// The findings of one kind of check, and how many checks of that kind were made.
#[derive(Default)]
struct Checked {
    /// Checks made.
    count: usize,
    /// Checks failed.
    findings: Vec<Finding>,
}

impl Checked {
    fn record(&mut self, document: &'static str, line: usize, result: Result<(), String>) {
        self.count += 1;
        if let Err(what) = result {
            self.findings.push(Finding {
                document,
                line,
                what,
            });
        }
    }

    /// Fails, listing every finding, unless there is none; and fails when fewer than
    /// `at_least` spans were checked (the reading itself broke).
    fn assert_none(&self, kind: &str, at_least: usize) {
        let listed: Vec<String> = self.findings.iter().map(|f| f.to_string()).collect();
        assert!(
            listed.is_empty(),
            "{} of {} {kind} in the documents are not true:\n{}",
            listed.len(),
            self.count,
            listed.join("\n")
        );
        assert!(
            self.count >= at_least,
            "only {} {kind} were found in the documents (at least {at_least} expected)",
            self.count
        );
    }
}

/// The checks made on the documents, by kind.
#[derive(Default)]
struct Survey {
    /// Paths and links.
    paths: Checked,
    /// Rust names.
    names: Checked,
    /// Names beside files.
    pairs: Checked,
}

/// The repository root.
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The text of the file at `path`, relative to the root.
fn read(path: &str) -> String {
    fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// The checks of every document's paths, links, names and names beside files, made once
/// for the tests that read them.
fn survey() -> &'static Survey {
    static SURVEY: OnceLock<Survey> = OnceLock::new();
    SURVEY.get_or_init(read_documents)
}

/// Reads every document and makes the checks.
fn read_documents() -> Survey {
    let sources = Sources::load(root());
    let mut survey = Survey::default();
    for document in DOCUMENTS {
        let text = read(document.path);
        let places = Places {
            root: root(),
            bases: document.bases,
        };
        for block in markdown::blocks(&text) {
            survey_block(&mut survey, document, &places, &sources, &block);
        }
    }
    survey
}

/// Checks one block: its paths (the folders it names are where its bare file names are
/// looked for), its Rust names, its names beside files and its links.
fn survey_block(
    survey: &mut Survey,
    document: &Document,
    places: &Places<'_>,
    sources: &Sources,
    block: &markdown::Block,
) {
    let spans = markdown::code_spans(&block.text);
    let mut folders = Vec::new();
    let mut files: Vec<Option<String>> = vec![None; spans.len()];
    for (index, span) in spans.iter().enumerate() {
        let line = block.line_at(span.start);
        if paths::is_path(&span.text) && !not_repository_path(&span.text) {
            let found = places.resolve(&span.text, &folders);
            if let Ok(path) = &found {
                if span.text.ends_with('/') {
                    folders.push(path.clone());
                }
                files[index] = Some(places.show(path));
            }
            let result = found
                .map(drop)
                .map_err(|looked| format!("`{}` names no file or folder ({looked})", span.text));
            survey.paths.record(document.path, line, result);
        }
        for name in rust_names(&span.text) {
            let result = sources.check(&name).map_err(|e| format!("`{name}`: {e}"));
            survey.names.record(document.path, line, result);
        }
    }
    check_pairs(survey, document, block, &spans, &files, sources);
    for (target, at) in markdown::links(&block.text) {
        if let Some(result) = check_link(document.path, &target) {
            survey
                .paths
                .record(document.path, block.line_at(at), result);
        }
    }
}

/// Checks the names beside files of a block: `` `Name` (`file.rs`) `` and
/// `` `file.rs` (`Name`, `Name` and `Name`) ``.
fn check_pairs(
    survey: &mut Survey,
    document: &Document,
    block: &markdown::Block,
    spans: &[markdown::Span],
    files: &[Option<String>],
    sources: &Sources,
) {
    let gap = |i: usize| &block.text[spans[i].end..spans[i + 1].start];
    let rust_file = |i: usize| files[i].as_deref().filter(|f| f.ends_with(".rs"));
    for i in 0..spans.len().saturating_sub(1) {
        if gap(i) != " (" {
            continue;
        }
        if let (true, Some(file)) = (is_rust_name(&spans[i].text), rust_file(i + 1)) {
            let line = block.line_at(spans[i].start);
            let result = sources.check_defined_in(file, &spans[i].text);
            survey.pairs.record(document.path, line, result);
        }
        if let Some(file) = rust_file(i) {
            let mut j = i + 1;
            while j < spans.len() && is_rust_name(&spans[j].text) {
                let line = block.line_at(spans[j].start);
                let result = sources.check_defined_in(file, &spans[j].text);
                survey.pairs.record(document.path, line, result);
                if j + 1 == spans.len() || !matches!(gap(j), ", " | " and " | ", and ") {
                    break;
                }
                j += 1;
            }
        }
    }
}

/// Checks a link's target, relative to `document`'s folder, and its anchor; `None` for a
/// link out of the repository.
fn check_link(document: &str, target: &str) -> Option<Result<(), String>> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
    let folder = Path::new(document).parent().unwrap_or(Path::new(""));
    let path = if file.is_empty() {
        root().join(document)
    } else {
        root().join(folder).join(file)
    };
    if !path.exists() {
        return Some(Err(format!("the link `{target}` leads to no file")));
    }
    if anchor.is_empty() || path.extension().map_or(true, |e| e != "md") {
        return Some(Ok(()));
    }
    let text = fs::read_to_string(&path).unwrap_or_default();
    let anchors: Vec<String> = markdown::blocks(&text)
        .iter()
        .filter(|b| b.text.starts_with('#'))
        .map(|b| markdown::anchor(&b.section))
        .collect();
    Some(if anchors.iter().any(|a| a == anchor) {
        Ok(())
    } else {
        Err(format!("the link `{target}` names no heading of its file"))
    })
}

/// Whether `span` is one of [`NOT_REPOSITORY_PATHS`], or below one that is a folder.
fn not_repository_path(span: &str) -> bool {
    NOT_REPOSITORY_PATHS
        .iter()
        .any(|p| span == *p || (p.ends_with('/') && span.starts_with(p)))
}

/// Whether `text` is one Rust name: `a`, `a::b`, `a::b()`, `a!`.
fn is_rust_name(text: &str) -> bool {
    let text = text.trim_end_matches("()").trim_end_matches('!');
    !text.is_empty()
        && text.split("::").all(|part| {
            part.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

/// The Rust names of a span that the test checks: each `a::b...` path in it, or the span
/// itself when it is exactly `Type.field` (and no file name: `Cargo.toml`); less
/// [`OTHER_CRATES`] and [`NOT_RUST_ITEMS`].
fn rust_names(span: &str) -> Vec<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = Vec::new();
    if let (false, Some((ty, field))) = (paths::is_path(span), span.split_once('.')) {
        let is_ident = |s: &str| !s.is_empty() && s.chars().all(ident);
        if ty.starts_with(|c: char| c.is_ascii_uppercase())
            && is_ident(ty)
            && field.starts_with(|c: char| c.is_ascii_lowercase())
            && is_ident(field)
        {
            names.push(span.to_string());
        }
    }
    let bytes = span.as_bytes();
    let mut at = 0;
    while at < span.len() {
        let starts_path = span[at..].starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && (at == 0 || !(ident(bytes[at - 1] as char) || bytes[at - 1] == b':'));
        if !starts_path {
            at += span[at..].chars().next().map_or(1, char::len_utf8);
            continue;
        }
        let mut end = at;
        loop {
            end += span[end..].chars().take_while(|&c| ident(c)).count();
            let next = &span[end..];
            if next.starts_with("::") && next[2..].starts_with(|c: char| ident(c)) {
                end += 2;
            } else {
                break;
            }
        }
        let path = &span[at..end];
        if path.contains("::") {
            names.push(path.to_string());
        }
        at = end;
    }
    names.retain(|name| {
        let first = name.split("::").next().unwrap_or_default();
        !OTHER_CRATES.contains(&first) && !NOT_RUST_ITEMS.contains(&name.as_str())
    });
    names
}

#[test]
fn every_path_and_link_leads_somewhere() {
    survey().paths.assert_none("paths and links", 200);
}

#[test]
fn every_rust_name_is_an_item_of_the_sources() {
    survey().names.assert_none("Rust names", 150);
}

#[test]
fn every_name_beside_a_file_is_defined_there() {
    survey().pairs.assert_none("names beside files", 50);
}

#[test]
fn the_metrics_table_lists_every_series_and_no_other() {
    let series: Vec<String> = read(SERIES_FILE)
        .lines()
        .filter(|line| line.starts_with("pub const ") && line.contains(": &str = "))
        .filter_map(|line| line.split('"').nth(1))
        .map(str::to_string)
        .collect();
    assert!(series.len() >= 20, "{SERIES_FILE} names only {series:?}");
    let text = read(METRICS_DOCUMENT);
    let mut listed: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for block in markdown::blocks(&text) {
        if block.section == "Metrics" && block.text.starts_with('|') {
            for (name, at) in series_names(&block.text) {
                listed.entry(name).or_default().push(block.line_at(at));
            }
        }
    }
    let mut wrong: Vec<String> = Vec::new();
    for name in &series {
        match listed.get(name).map(Vec::as_slice) {
            None => wrong.push(format!(
                "{METRICS_DOCUMENT}: the Metrics table lacks `{name}` ({SERIES_FILE})"
            )),
            Some([_]) => {}
            Some(lines) => wrong.push(format!(
                "{METRICS_DOCUMENT}:{lines:?}: the Metrics table lists `{name}` more than once"
            )),
        }
    }
    for (name, lines) in &listed {
        if !series.contains(name) {
            wrong.push(format!(
                "{METRICS_DOCUMENT}:{}: the Metrics table lists `{name}`, which {SERIES_FILE} lacks",
                lines[0]
            ));
        }
    }
    for document in DOCUMENTS {
        let text = read(document.path);
        for block in markdown::blocks(&text) {
            for (name, at) in series_names(&block.text) {
                if !series.contains(&name) {
                    wrong.push(format!(
                        "{}:{}: `{name}` is no series of {SERIES_FILE}",
                        document.path,
                        block.line_at(at)
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The series names (`vllm:nixl_` and at least one more name character) in `text`, each
/// with its offset.
fn series_names(text: &str) -> Vec<(String, usize)> {
    text.match_indices(SERIES_PREFIX)
        .filter_map(|(at, _)| {
            let rest = &text[at + SERIES_PREFIX.len()..];
            let length = rest
                .chars()
                .take_while(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                .count();
            (length > 0).then(|| (text[at..at + SERIES_PREFIX.len() + length].to_string(), at))
        })
        .collect()
}

#[test]
fn no_line_is_longer_than_the_limit() {
    let mut long = Vec::new();
    for document in DOCUMENTS {
        for (index, line) in read(document.path).lines().enumerate() {
            let length = line.chars().count();
            if length > MAX_LINE {
                long.push(format!(
                    "{}:{}: {length} characters (at most {MAX_LINE}): {}...",
                    document.path,
                    index + 1,
                    line.chars().take(60).collect::<String>()
                ));
            }
        }
    }
    assert!(long.is_empty(), "{}", long.join("\n"));
}

/// The root README's connector example is the code `nixl-connector/examples/readme_connector.rs`
/// compiles, word for word (the lines between its `README BEGIN` and `README END` markers,
/// less their indent), so that the example in the front page builds against the API.
#[test]
fn the_front_pages_connector_example_is_the_one_that_compiles() {
    let readme = read("README.md");
    let section = readme
        .find("## Using the connector")
        .expect("README.md has a \"Using the connector\" section");
    let start = readme[section..]
        .find("```rust\n")
        .map(|at| section + at + "```rust\n".len())
        .expect("the section has a Rust code block");
    let end = start + readme[start..].find("```\n").expect("the code block ends");
    let example = read("nixl-connector/examples/readme_connector.rs");
    let compiled: Vec<&str> = example
        .lines()
        .skip_while(|line| !line.contains("// README BEGIN"))
        .skip(1)
        .take_while(|line| !line.contains("// README END"))
        .map(|line| line.strip_prefix("    ").unwrap_or(line))
        .collect();
    let shown: Vec<&str> = readme[start..end].lines().collect();
    assert_eq!(
        shown, compiled,
        "README.md's connector example differs from nixl-connector/examples/readme_connector.rs \
         between its README markers: change both"
    );
}

//! Which code spans name a file or folder of the repository, and where each is looked for.

use std::fs;
use std::path::{Path, PathBuf};

/// File endings that make a span without a `/` a file name.
const FILE_ENDINGS: &[&str] = &[
    ".rs", ".sh", ".md", ".py", ".toml", ".log", ".svg", ".jsonl", ".json", ".h", ".bin",
];

/// Characters no repository path in these documents holds: a span with one is a command,
/// an address, a Rust path, a pattern of text or an example value.
const NOT_IN_PATHS: &[char] = &[
    ':', '=', '<', '>', '"', '\'', '[', ']', '(', ')', '{', '}', '|', ',', ';', '!', '@', '$', '%',
    '^', '&', '+', '\\', '~', '#',
];

/// Whether a code span names a path: no whitespace or [`NOT_IN_PATHS`] character, not
/// absolute (a system path), not starting with a digit (an address or a network), and
/// either holding a `/` or ending as a file does ([`FILE_ENDINGS`]).
pub fn is_path(span: &str) -> bool {
    !span.is_empty()
        && !span.contains(char::is_whitespace)
        && !span.contains(NOT_IN_PATHS)
        && !span.starts_with('/')
        && !span.starts_with(|c: char| c.is_ascii_digit())
        && (span.contains('/') || FILE_ENDINGS.iter().any(|e| span.ends_with(e)))
}

/// Where a document's paths are looked for: the repository root and the folders a
/// document's section is about.
pub struct Places<'a> {
    /// The repository root.
    pub root: &'a Path,
    /// Folders (relative to the root) that a relative path may start in; a bare file name
    /// may sit anywhere below one of them.
    pub bases: &'a [&'a str],
}

impl Places<'_> {
    /// The file or folder `span` names, given the folders its block named before it
    /// (`folders`), or where it was looked for.
    ///
    /// A bare file name (no `/`) is looked for in the block's folders when the block named
    /// any, else at the root, in the bases and anywhere below the bases. Any other path (a
    /// folder's name ends in `/`) is looked for in the block's folders, at the root and in
    /// the bases. A `*` in the last part matches any text there.
    pub fn resolve(&self, span: &str, folders: &[PathBuf]) -> Result<PathBuf, String> {
        let want_dir = span.ends_with('/');
        let rel = span.trim_end_matches('/');
        let bare = !span.contains('/');
        let bases = self.bases.iter().map(|b| self.root.join(b));
        let mut starts: Vec<PathBuf> = folders.to_vec();
        if !bare || folders.is_empty() {
            starts.push(self.root.to_path_buf());
            starts.extend(bases.clone());
        }
        let fits = |p: &Path| if want_dir { p.is_dir() } else { p.exists() };
        for start in &starts {
            if let Some(found) = matching(&start.join(rel)).into_iter().find(|p| fits(p)) {
                return Ok(found);
            }
        }
        if bare && folders.is_empty() {
            for base in bases.filter(|b| b.as_path() != self.root) {
                if let Some(found) = below(&base, rel).into_iter().find(|p| fits(p)) {
                    return Ok(found);
                }
            }
        }
        let shown: Vec<String> = starts
            .iter()
            .map(|s| match self.show(s) {
                root if root == "." => root,
                folder => format!("{folder}/"),
            })
            .collect();
        let below_bases = if bare && folders.is_empty() {
            " or below the latter"
        } else {
            ""
        };
        Err(format!("looked in {}{below_bases}", shown.join(", ")))
    }

    /// `path` relative to the root (`.` for the root itself).
    pub fn show(&self, path: &Path) -> String {
        match path.strip_prefix(self.root) {
            Ok(rel) if rel.as_os_str().is_empty() => ".".to_string(),
            Ok(rel) => rel.display().to_string(),
            Err(_) => path.display().to_string(),
        }
    }
}

/// `path` itself, or, when its last part holds a `*`, the entries of its folder that match.
fn matching(path: &Path) -> Vec<PathBuf> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let Some((prefix, suffix)) = name.split_once('*') else {
        return vec![path.to_path_buf()];
    };
    let Some(Ok(entries)) = path.parent().map(fs::read_dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            n.len() >= prefix.len() + suffix.len() && n.starts_with(prefix) && n.ends_with(suffix)
        })
        .collect()
}

/// The files and folders named `name` anywhere below `dir`.
fn below(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        if entry.file_name() == name {
            found.push(path.clone());
        }
        if path.is_dir() {
            found.extend(below(&path, name));
        }
    }
    found
}

//! Whether a Rust name a document gives (`module::Item`, `Type::method`, `Type.field`, a
//! crate's `nixl::Item`) is an item of this repository's sources, by a textual search.

use std::fs;
use std::path::Path;

/// The crates' source folders, and the names the crates are known by in Rust paths.
const CRATES: &[(&str, &str)] = &[
    ("nixl", "nixl/src"),
    ("nixl_connector", "nixl-connector/src"),
    ("nixl_capi_sys", "nixl-sys/src"),
    ("nixl_rs", "src"),
];

/// Keywords that define the name after them.
const DEFINING: &[&str] = &[
    "fn",
    "struct",
    "enum",
    "trait",
    "type",
    "const",
    "static",
    "mod",
    "union",
    "macro_rules!",
];

/// Every Rust file of the crates' sources, with its text.
pub struct Sources {
    files: Vec<(String, String)>,
}

impl Sources {
    /// Reads every `.rs` file below the crates' source folders ([`CRATES`]).
    pub fn load(root: &Path) -> Sources {
        let mut files = Vec::new();
        for (_, dir) in CRATES {
            collect(root, &root.join(dir), &mut files);
        }
        Sources { files }
    }

    /// Checks a name of the form `a::b::c` (at least two parts) or `Type.field`; the error
    /// says what is missing.
    pub fn check(&self, name: &str) -> Result<(), String> {
        if let Some((ty, field)) = name.split_once('.') {
            return self.check_member(ty, field);
        }
        let parts: Vec<&str> = name.split("::").collect();
        if let Some((_, dir)) = CRATES.iter().find(|(krate, _)| *krate == parts[0]) {
            if parts.len() == 2 {
                let lib = self.file(&format!("{dir}/lib.rs"));
                return if defines(lib, parts[1]) || reexports(lib, parts[1]) {
                    Ok(())
                } else {
                    Err(format!(
                        "`{dir}/lib.rs` neither defines nor re-exports `{}`",
                        parts[1]
                    ))
                };
            }
            let n = parts.len();
            return self.check_in_module(parts[n - 2], parts[n - 1], Some(dir));
        }
        let n = parts.len();
        let (qualifier, item) = (parts[n - 2], parts[n - 1]);
        if qualifier.starts_with(|c: char| c.is_ascii_uppercase()) {
            self.check_member(qualifier, item)
        } else {
            self.check_in_module(qualifier, item, None)
        }
    }

    /// Checks that the file at `path` (relative to the root) defines `name`: an item or a
    /// trait it implements (`Drop`); for `Type::member`, a member of a type the file
    /// defines or implements; for `module::item`, an item of the file when it is that
    /// module's.
    pub fn check_defined_in(&self, path: &str, name: &str) -> Result<(), String> {
        let text = self.file(path);
        let name = name.trim_end_matches("()").trim_end_matches('!');
        let found = match name.rsplit_once("::") {
            Some((qualifier, member)) => {
                let last = qualifier.rsplit("::").next().unwrap_or(qualifier);
                if last.starts_with(|c: char| c.is_ascii_uppercase()) {
                    (defines(text, last) || implements(text, last)) && has_member(text, member)
                } else {
                    let module = path.ends_with(&format!("/{last}.rs"))
                        || path.contains(&format!("/{last}/"));
                    module && defines(text, member)
                }
            }
            None => defines(text, name) || implements(text, name),
        };
        if found {
            Ok(())
        } else {
            Err(format!("`{path}` does not define `{name}`"))
        }
    }

    /// `Type::member` or `Type.member`: a file that defines or implements `Type` has the
    /// member (a method, constant, field or variant).
    fn check_member(&self, ty: &str, member: &str) -> Result<(), String> {
        let files: Vec<&str> = self
            .files
            .iter()
            .filter(|(_, text)| defines(text, ty) || implements(text, ty))
            .map(|(_, text)| text.as_str())
            .collect();
        if files.is_empty() {
            return Err(format!("no file defines or implements `{ty}`"));
        }
        let derived = member == "default" && files.iter().any(|t| t.contains("Default"));
        if derived || files.iter().any(|t| has_member(t, member)) {
            Ok(())
        } else {
            Err(format!(
                "no file that defines or implements `{ty}` has `{member}`"
            ))
        }
    }

    /// `module::item`: a file of the module (`module.rs`, or any file below a folder
    /// `module/`, of `krate`'s folder when given) defines or re-exports `item`, or holds it
    /// as a child module.
    fn check_in_module(&self, module: &str, item: &str, krate: Option<&str>) -> Result<(), String> {
        let files: Vec<&(String, String)> = self
            .files
            .iter()
            .filter(|(path, _)| krate.map_or(true, |k| path.starts_with(&format!("{k}/"))))
            .filter(|(path, _)| {
                path.ends_with(&format!("/{module}.rs")) || path.contains(&format!("/{module}/"))
            })
            .collect();
        if files.is_empty() {
            return Err(format!("no module `{module}`"));
        }
        let child = |path: &String| {
            path.ends_with(&format!("/{module}/{item}.rs"))
                || path.contains(&format!("/{module}/{item}/"))
        };
        if files
            .iter()
            .any(|(path, text)| defines(text, item) || reexports(text, item) || child(path))
        {
            Ok(())
        } else {
            Err(format!("module `{module}` has no `{item}`"))
        }
    }

    fn file(&self, path: &str) -> &str {
        self.files
            .iter()
            .find(|(p, _)| p == path)
            .map_or("", |(_, text)| text.as_str())
    }
}

fn collect(root: &Path, dir: &Path, files: &mut Vec<(String, String)>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        if path.is_dir() {
            collect(root, &path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = fs::read_to_string(&path).expect("read a source file");
            let rel = path.strip_prefix(root).unwrap_or(&path);
            files.push((rel.display().to_string(), text));
        }
    }
}

/// The offsets where `word` stands in `text` as a whole identifier.
fn occurrences<'a>(text: &'a str, word: &'a str) -> impl Iterator<Item = usize> + 'a {
    let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    text.match_indices(word)
        .map(|(at, _)| at)
        .filter(move |&at| {
            !ident(text[..at].chars().next_back()) && !ident(text[at + word.len()..].chars().next())
        })
}

/// Whether `text` defines `name` with one of the [`DEFINING`] keywords.
fn defines(text: &str, name: &str) -> bool {
    occurrences(text, name).any(|at| {
        let before = text[..at].trim_end();
        DEFINING.iter().any(|kw| {
            before.ends_with(kw)
                && !before[..before.len() - kw.len()]
                    .ends_with(|c: char| c.is_alphanumeric() || c == '_')
        })
    })
}

/// Whether `text` has an `impl` line naming `ty`.
fn implements(text: &str, ty: &str) -> bool {
    text.lines().any(|line| {
        let line = line.trim_start();
        let line = line.strip_prefix("unsafe ").unwrap_or(line);
        line.starts_with("impl") && occurrences(line, ty).next().is_some()
    })
}

/// Whether a `use` declaration of `text` (`use`, `pub use`, `pub(crate) use`, ...) names
/// `name`: a re-export, or an import that a module's file brings into the module.
fn reexports(text: &str, name: &str) -> bool {
    occurrences(text, "use").any(|at| {
        let line_start = text[..at].rfind('\n').map_or(0, |n| n + 1);
        let visibility = text[line_start..at].trim();
        let statement = &text[at..];
        let end = statement.find(';').unwrap_or(statement.len());
        (visibility.is_empty() || visibility.starts_with("pub"))
            && statement[3..].starts_with(' ')
            && occurrences(&statement[..end], name).next().is_some()
    })
}

/// Whether `text` has `member`: a method, constant or associated type, a struct field or
/// an enum variant (a line that starts with it, after `pub`, followed by `:`, `,`, `(`,
/// `{`, `=` or nothing).
fn has_member(text: &str, member: &str) -> bool {
    defines(text, member)
        || text.lines().any(|line| {
            let line = line.trim_start();
            let line = ["pub(crate) ", "pub(super) ", "pub "]
                .iter()
                .find_map(|p| line.strip_prefix(p))
                .unwrap_or(line);
            line.strip_prefix(member).is_some_and(|after| {
                let after = after.trim_start();
                after.is_empty() || after.starts_with([':', ',', '(', '{', '='])
            })
        })
}

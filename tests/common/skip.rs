//! Skips that say so (shared with the connector's tests): listed by scripts/test.sh, and
//! failures under CI.

/// Records that `test` could not run because `reason` (a missing prerequisite), so that
/// scripts/test.sh lists it in its summary. Under CI (`CI` set) a missing prerequisite is
/// a failure, not a skip.
pub fn skip(test: &str, reason: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "{test}: prerequisite missing under CI: {reason}"
    );
    eprintln!("skipping {test}: {reason}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.txt");
    let line = format!("{test}: {reason}\n");
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, line.as_bytes()));
    if let Err(err) = written {
        eprintln!("cannot record the skip in {}: {err}", path.display());
    }
}

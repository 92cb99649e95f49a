//! Every public error type of the crates (`nixl`, `nixl-connector`, the demo's), formatted as
//! `Display` and as `Debug`: both say what went wrong in readable text. `Debug` matters as
//! much as `Display`: it is what `fn main() -> Result<(), Box<dyn Error>>` prints (and
//! `unwrap`). NIXL's not-found error, which only a failed load makes, comes from a child
//! process that finds no NIXL; that child returns it from a test the way `main` would.

mod common;

use std::io;
use std::process::Stdio;
use std::time::Duration;

use nixl::{MemType, Status};

/// Set in the child process of `the_library_error_reads_as_its_message_from_main`.
const NO_NIXL_ENV: &str = "NIXL_RS_TEST_NO_NIXL";

/// Marks the child's lines: each error's Debug form, on the lines after it.
const DEBUG_TAG: &str = "DEBUG OF";

/// One sample of each kind of error a user meets, with its type's name.
fn samples() -> Vec<(&'static str, Box<dyn std::error::Error>)> {
    let nixl_status = || nixl::Error::Nixl {
        operation: "post transfer request",
        status: Status::Backend,
        hint: Some("check that the remote agent's metadata is loaded"),
    };
    let refused = || io::Error::new(io::ErrorKind::ConnectionRefused, "connection refused");
    vec![
        ("nixl::Error", Box::new(nixl_status())),
        (
            "nixl::Error",
            Box::new(nixl::Agent::new("").expect_err("an empty agent name is refused")),
        ),
        (
            "nixl::ParseMemTypeError",
            Box::new("HBM".parse::<MemType>().unwrap_err()),
        ),
        (
            "nixl_connector::Error",
            Box::new(nixl_connector::Error::from(nixl_status())),
        ),
        (
            "nixl_connector::Error",
            Box::new(nixl_connector::Error::Io {
                operation: "connect to the side channel",
                peer: "127.0.0.1:5600".into(),
                source: refused(),
            }),
        ),
        (
            "nixl_connector::Error",
            Box::new(nixl_connector::Error::Deadline {
                operation: "handshake",
                peer: "127.0.0.1:5600".into(),
                deadline: Duration::from_secs(5),
            }),
        ),
        (
            "nixl_rs::Error",
            Box::new(nixl_rs::Error::from(nixl_connector::Error::from(
                nixl_status(),
            ))),
        ),
        (
            "nixl_rs::Error",
            Box::new(nixl_rs::Error::io("connect to the prefill", refused())),
        ),
        (
            "nixl_rs::Error",
            Box::new(nixl_rs::Error::Config("--blocks must be at least 1".into())),
        ),
    ]
}

/// Readable: not empty, and no escaped line break or quote soup a reader must decode.
fn assert_readable(kind: &str, form: &str, text: &str) {
    assert!(!text.trim().is_empty(), "{kind} {form} is empty");
    assert!(
        !text.contains("\\n") && !text.contains("\\\""),
        "{kind} {form} has escaped text: {text}"
    );
}

#[test]
fn every_public_error_type_reads_well_as_display_and_debug() {
    for (kind, error) in samples() {
        let display = error.to_string();
        let debug = format!("{error:?}");
        assert_readable(kind, "Display", &display);
        assert_readable(kind, "Debug", &debug);
    }
}

#[test]
fn the_loaded_library_displays_its_release_path_and_finder() {
    let library = nixl::load_library().expect("NIXL loads");
    assert_eq!(
        library.to_string(),
        format!(
            "NIXL 1.5.1 at {} (found by {})",
            library.path().display(),
            library.found_by()
        )
    );
}

/// Run in a child process whose NIXL_LIB_DIR names no folder: prints the library error's
/// Debug form inside each crate's error, then returns it as `main` would.
#[test]
#[ignore = "the child process of the_library_error_reads_as_its_message_from_main"]
fn no_nixl_role() -> Result<(), Box<dyn std::error::Error>> {
    assert!(
        std::env::var_os(NO_NIXL_ENV).is_some(),
        "run only as a child"
    );
    let error = || nixl::Agent::new("no-nixl").expect_err("no NIXL to load");
    let connector = nixl_connector::Error::from(error());
    println!("{DEBUG_TAG} nixl_connector::Error\n{connector:?}");
    let demo = nixl_rs::Error::from(nixl_connector::Error::from(error()));
    println!("{DEBUG_TAG} nixl_rs::Error\n{demo:?}");
    nixl::Agent::new("no-nixl")?;
    Ok(())
}

#[test]
fn the_library_error_reads_as_its_message_from_main() {
    let root = tempfile::tempdir().expect("temporary folder");
    let missing = root.path().join("gone");
    let child = common::role_process(
        "no_nixl_role",
        &[
            (NO_NIXL_ENV, "1"),
            ("NIXL_LIB_DIR", missing.to_str().unwrap()),
        ],
        Stdio::piped(),
    );
    let out = child.wait_with_output().expect("wait for the child");
    assert!(!out.status.success(), "the child found NIXL");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let step = format!(
        "  - NIXL_LIB_DIR={}: it does not exist (nothing else is searched while it is set)\n",
        missing.display()
    );
    let from_main = "Error: Library(NIXL 1.5.1 could not be loaded. ";
    assert!(stderr.contains(from_main), "{stderr}");
    assert!(stderr.contains(&step), "{stderr}");
    assert!(
        stderr.contains("To install NIXL 1.5.1: `pip install --no-deps nixl-cu12==1.5.1`"),
        "{stderr}"
    );
    for (kind, wrapped) in [
        (
            "nixl_connector::Error",
            "Nixl(Library(NIXL 1.5.1 could not be loaded. ",
        ),
        (
            "nixl_rs::Error",
            "Connector(Nixl(Library(NIXL 1.5.1 could not be loaded. ",
        ),
    ] {
        let tag = format!("{DEBUG_TAG} {kind}\n{wrapped}");
        assert!(stdout.contains(&tag), "{kind}: {stdout}");
    }
    assert!(stdout.contains(&step), "{stdout}");
    for text in [&stdout, &stderr] {
        assert!(!text.contains("SearchStep {"), "{text}");
        assert_readable("the library error", "Debug", text);
    }
}

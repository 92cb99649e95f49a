//! `nixl` used as a dependent uses it: a fresh cargo project in a temporary folder outside
//! this workspace (its program is tests/data/dependent/main.rs), depending on `nixl` by path,
//! with no build script and no nixl-capi-sys dependency, built offline against this workspace's
//! Cargo.lock and target folder (so little is compiled again) and run with LD_LIBRARY_PATH
//! unset: as built; with NIXL found only through a venv holding the pip-installed wheel; with
//! no NIXL anywhere; with a NIXL of another version.

mod py;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Bound on one run of the dependent (building it is bounded by cargo alone).
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// What one run of the dependent printed, and how it ended.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// The dependent's binary, built once per test process.
fn dependent() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(build)
}

/// Writes the project, builds it into this workspace's target folder and returns the binary.
fn build() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The test runs as target/<profile>/deps/<name>-<hash>.
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let target_dir = profile_dir.parent().expect("target folder");

    let project = tempfile::tempdir().expect("temporary folder");
    let manifest = format!(
        "[package]\nname = \"nixl-dependent-check\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
         publish = false\n\n[dependencies]\nnixl = {{ path = {:?} }}\n\n[workspace]\n",
        workspace.join("nixl")
    );
    std::fs::write(project.path().join("Cargo.toml"), manifest).expect("write Cargo.toml");
    std::fs::copy(
        workspace.join("Cargo.lock"),
        project.path().join("Cargo.lock"),
    )
    .expect("copy Cargo.lock");
    std::fs::create_dir(project.path().join("src")).expect("create src");
    std::fs::copy(
        workspace.join("tests/data/dependent/main.rs"),
        project.path().join("src/main.rs"),
    )
    .expect("copy main.rs");

    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .args(["build", "--offline", "--quiet"])
        .current_dir(project.path())
        .env("CARGO_TARGET_DIR", target_dir)
        .env_remove("LD_LIBRARY_PATH");
    if profile_dir
        .file_name()
        .is_some_and(|name| name == "release")
    {
        cargo.arg("--release");
    }
    let status = cargo.status().expect("run cargo build for the dependent");
    assert!(status.success(), "building the dependent failed: {status}");
    assert!(
        !project.path().join("build.rs").exists(),
        "the dependent must have no build script"
    );
    profile_dir.join("nixl-dependent-check")
}

/// Runs the dependent with LD_LIBRARY_PATH unset and the environment changed by `setup`.
fn run(setup: impl FnOnce(&mut Command)) -> Run {
    let mut command = Command::new(dependent());
    command
        .env_remove("LD_LIBRARY_PATH")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    setup(&mut command);
    let mut child = command.spawn().expect("start the dependent");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the dependent") {
            break status;
        }
        if start.elapsed() > RUN_LIMIT {
            child.kill().ok();
            panic!("the dependent ran for more than {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    Run {
        code: status.code(),
        stdout,
        stderr,
    }
}

/// Asserts the run moved and checked the whole MiB; returns its report of the library.
fn assert_moved(run: &Run) -> &str {
    assert_eq!(
        run.code,
        Some(0),
        "the dependent failed:\n{}\n{}",
        run.stdout,
        run.stderr
    );
    assert!(
        run.stdout
            .contains("moved 1048576 bytes from b to a, every byte checked"),
        "{}",
        run.stdout
    );
    run.stdout.lines().next().unwrap_or_default()
}

/// Asserts the run ended with the loading error (exit code 1, no crash, no panic).
fn assert_refused(run: &Run) {
    assert_eq!(
        run.code,
        Some(1),
        "expected a clean failure:\n{}\n{}",
        run.stdout,
        run.stderr
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    assert!(
        run.stderr.contains("NIXL 1.5.1 could not be loaded"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr
            .contains("pip install --no-deps nixl-cu12==1.5.1"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_dependent_moves_one_mib_with_the_nixl_found_as_built() {
    let run = run(|_| {});
    let report = assert_moved(&run);
    assert!(report.starts_with("loaded NIXL 1.5.1 from "), "{report}");
}

#[test]
fn a_dependent_finds_nixl_only_through_a_venv_given_as_nixl_prefix() {
    let python = py::python();
    let venv = python
        .parent()
        .and_then(Path::parent)
        .expect("venv of bin/python");
    let run = run(|command| {
        command.env_remove("NIXL_LIB_DIR").env("NIXL_PREFIX", venv);
    });
    let report = assert_moved(&run);
    let from = format!(
        "from {}/lib/python3.11/site-packages/.nixl_cu12.mesonpy.libs/",
        venv.display()
    );
    assert!(report.contains(&from), "{report}");
    assert!(
        report.ends_with(&format!("(via NIXL_PREFIX={})", venv.display())),
        "{report}"
    );
}

#[test]
fn a_dependent_without_nixl_anywhere_says_where_it_looked_and_exits_non_zero() {
    let empty = tempfile::tempdir().expect("temporary folder");
    let run = run(|command| {
        command
            .env_remove("NIXL_LIB_DIR")
            .env("NIXL_PREFIX", empty.path())
            .env("VIRTUAL_ENV", empty.path())
            .env("PYTHONUSERBASE", empty.path())
            .env("HOME", empty.path());
    });
    assert_refused(&run);
    let place = format!(
        "NIXL_PREFIX={}: no libnixl_capi.so in any of ",
        empty.path().display()
    );
    assert!(run.stderr.contains(&place), "{}", run.stderr);
}

#[test]
fn a_dependent_refuses_nixl_of_another_version() {
    let loaded = nixl::load_library().expect("NIXL for this test");
    let lib_dir = loaded.path().parent().expect("library folder");
    let common = std::fs::read(lib_dir.join("libnixl_common.so")).expect("read libnixl_common");
    let marker = b"NIXL version: \x001.5.1\x00";
    let at = common
        .windows(marker.len())
        .position(|w| w == marker)
        .expect("NIXL's version string");
    // An older minor, and the patch releases either side (1.5.0 is what pip gives for
    // nixl-cu12==1.5.0): this release loads 1.5.1 only, on purpose (README, Versions).
    for version in ["1.4.9", "1.5.0", "1.5.2"] {
        let other = tempfile::tempdir().expect("temporary folder");
        std::fs::copy(loaded.path(), other.path().join("libnixl_capi.so")).expect("copy");
        let mut patched = common.clone();
        let with = format!("NIXL version: \0{version}\0");
        patched[at..at + marker.len()].copy_from_slice(with.as_bytes());
        std::fs::write(other.path().join("libnixl_common.so"), patched).expect("write");

        let run = run(|command| {
            command.env("NIXL_LIB_DIR", other.path());
        });
        assert_refused(&run);
        let mismatch = format!(
            "{}/libnixl_capi.so is NIXL {version}, but this nixl-rs is for NIXL 1.5.1 (version mismatch)",
            other.path().display()
        );
        assert!(run.stderr.contains(&mismatch), "{}", run.stderr);
    }
}

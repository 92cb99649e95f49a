//! The search order over made-up installations (empty files stand in for the library; the
//! search only looks for it).

use std::fs;
use std::path::{Path, PathBuf};

use nixl_capi_sys::discovery::{python_on_path, search_order, LooksIn, SearchEnv, Step, CAPI_LIB};

/// An environment with nothing set, whose default prefix is `root/opt` (absent).
fn bare(root: &Path) -> SearchEnv {
    SearchEnv {
        default_prefix: root.join("opt"),
        ..SearchEnv::default()
    }
}

/// Puts a stand-in library into `dir` and returns `dir`.
fn install(dir: PathBuf) -> PathBuf {
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(CAPI_LIB), b"").unwrap();
    dir
}

/// The first folder, over all steps, that holds the library, with its step's name.
fn first_find(env: &SearchEnv) -> Option<(String, PathBuf)> {
    search_order(env).iter().find_map(|step| {
        step.find()
            .map(|dir| (step.name.clone(), dir.to_path_buf()))
    })
}

#[test]
fn nothing_set_lists_every_step_in_order() {
    let root = tempfile::tempdir().unwrap();
    let steps = search_order(&bare(root.path()));
    let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    let opt = root.path().join("opt").display().to_string();
    assert_eq!(
        names,
        [
            "NIXL_LIB_DIR",
            "NIXL_PREFIX",
            "the NIXL found at build time",
            "VIRTUAL_ENV",
            "CONDA_PREFIX",
            "the python3 on PATH",
            "the Python user site",
            opt.as_str(),
            "the system loader",
        ]
    );
    assert_eq!(steps[0].looks_in, LooksIn::Nowhere("not set"));
    assert_eq!(steps[8].looks_in, LooksIn::SystemLoader);
    assert!(steps.iter().all(|s| s.find().is_none()));
}

#[test]
fn nixl_prefix_takes_a_venv_root_a_site_packages_folder_or_an_install_prefix() {
    let root = tempfile::tempdir().unwrap();
    let venv = root.path().join("venv");
    let site = venv.join("lib/python3.11/site-packages");
    let lib = install(site.join(".nixl_cu12.mesonpy.libs"));
    let prefix = root.path().join("prefix");
    let prefix_lib = install(prefix.join("lib64"));
    for (given, expected) in [(&venv, &lib), (&site, &lib), (&prefix, &prefix_lib)] {
        let env = SearchEnv {
            prefix: Some(given.clone()),
            ..bare(root.path())
        };
        let expected_name = format!("NIXL_PREFIX={}", given.display());
        assert_eq!(first_find(&env), Some((expected_name, expected.clone())));
    }
}

#[test]
fn an_explicit_variable_is_the_only_place_searched() {
    let root = tempfile::tempdir().unwrap();
    let elsewhere = install(root.path().join("elsewhere"));
    let empty = root.path().join("empty");
    fs::create_dir_all(&empty).unwrap();
    let env = SearchEnv {
        lib_dir: Some(empty.clone()),
        prefix: Some(elsewhere.clone()),
        build_time: Some(elsewhere.clone()),
        ..bare(root.path())
    };
    let steps = search_order(&env);
    assert_eq!(
        steps,
        [Step {
            name: format!("NIXL_LIB_DIR={}", empty.display()),
            looks_in: LooksIn::Dirs(vec![empty.clone()]),
        }]
    );
    assert_eq!(first_find(&env), None);
    // NIXL_PREFIX alone is just as exclusive.
    let env = SearchEnv {
        lib_dir: None,
        prefix: Some(empty),
        ..env
    };
    assert_eq!(search_order(&env).len(), 1);
    assert_eq!(first_find(&env), None);
}

#[test]
fn the_build_time_find_comes_before_the_venv_and_a_cu13_wheel_is_found() {
    let root = tempfile::tempdir().unwrap();
    let venv = root.path().join("venv");
    let cu13 = install(venv.join("lib/python3.12/site-packages/.nixl_cu13.mesonpy.libs"));
    let env = SearchEnv {
        virtual_env: Some(venv.clone()),
        ..bare(root.path())
    };
    let venv_name = format!("VIRTUAL_ENV={}", venv.display());
    assert_eq!(first_find(&env), Some((venv_name, cu13)));

    let built = install(root.path().join("built"));
    let env = SearchEnv {
        build_time: Some(built.clone()),
        ..env
    };
    let built_name = format!("the NIXL found at build time ({})", built.display());
    assert_eq!(first_find(&env), Some((built_name, built)));
}

#[test]
fn the_user_site_then_the_default_prefix() {
    let root = tempfile::tempdir().unwrap();
    let opt_lib = install(root.path().join("opt/lib/x86_64-linux-gnu"));
    let user = root.path().join("home/.local");
    let env = SearchEnv {
        user_base: Some(user.clone()),
        ..bare(root.path())
    };
    let opt_name = root.path().join("opt").display().to_string();
    assert_eq!(first_find(&env), Some((opt_name, opt_lib)));
    let user_step = &search_order(&env)[6];
    assert_eq!(
        user_step.looks_in,
        LooksIn::Nowhere("it has no lib/python3.*/site-packages folder")
    );

    let user_lib = install(user.join("lib/python3.11/site-packages/.nixl_cu12.mesonpy.libs"));
    let user_name = format!("the Python user site under {}", user.display());
    assert_eq!(first_find(&env), Some((user_name, user_lib)));
}

#[test]
fn a_configured_path_that_names_no_folder_says_so() {
    let root = tempfile::tempdir().unwrap();
    let missing = root.path().join("missing");
    let file = root.path().join("file");
    fs::write(&file, b"").unwrap();
    for (env, name, why) in [
        (
            SearchEnv {
                prefix: Some(missing.clone()),
                ..bare(root.path())
            },
            format!("NIXL_PREFIX={}", missing.display()),
            "it does not exist (nothing else is searched while it is set)",
        ),
        (
            SearchEnv {
                lib_dir: Some(missing.clone()),
                ..bare(root.path())
            },
            format!("NIXL_LIB_DIR={}", missing.display()),
            "it does not exist (nothing else is searched while it is set)",
        ),
        (
            SearchEnv {
                lib_dir: Some(file.clone()),
                ..bare(root.path())
            },
            format!("NIXL_LIB_DIR={}", file.display()),
            "it is not a folder (nothing else is searched while it is set)",
        ),
    ] {
        assert_eq!(
            search_order(&env),
            [Step {
                name,
                looks_in: LooksIn::Nowhere(why),
            }]
        );
    }
}

#[test]
fn the_venv_then_conda_then_the_python3_on_path_then_the_user_site() {
    let root = tempfile::tempdir().unwrap();
    let wheel = |env: &str| {
        install(
            root.path()
                .join(env)
                .join("lib/python3.12/site-packages/.nixl_cu12.mesonpy.libs"),
        )
    };
    let (venv, conda, on_path, user) = (wheel("venv"), wheel("conda"), wheel("opt"), wheel("user"));
    let python = root.path().join("opt/bin/python3");
    let mut env = SearchEnv {
        virtual_env: Some(root.path().join("venv")),
        conda_prefix: Some(root.path().join("conda")),
        path_python: Some(python.clone()),
        user_base: Some(root.path().join("user")),
        ..bare(root.path())
    };
    let names = [
        format!("VIRTUAL_ENV={}", root.path().join("venv").display()),
        format!("CONDA_PREFIX={}", root.path().join("conda").display()),
        format!("the python3 on PATH ({})", python.display()),
        format!(
            "the Python user site under {}",
            root.path().join("user").display()
        ),
    ];
    assert_eq!(first_find(&env), Some((names[0].clone(), venv)));
    env.virtual_env = None;
    assert_eq!(first_find(&env), Some((names[1].clone(), conda)));
    env.conda_prefix = None;
    assert_eq!(first_find(&env), Some((names[2].clone(), on_path)));
    env.path_python = None;
    assert_eq!(first_find(&env), Some((names[3].clone(), user)));
    let steps = search_order(&env);
    assert_eq!(steps[4].looks_in, LooksIn::Nowhere("not set"));
    assert_eq!(steps[5].looks_in, LooksIn::Nowhere("there is none"));
}

#[test]
fn the_python3_on_path_is_the_first_executable_one_as_named_there() {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let root = tempfile::tempdir().unwrap();
    let dir = |name: &str| {
        let dir = root.path().join(name);
        fs::create_dir_all(&dir).unwrap();
        dir
    };
    let (empty, plain, venv_bin, system) =
        (dir("empty"), dir("plain"), dir("venv/bin"), dir("usr/bin"));
    fs::write(plain.join("python3"), b"").unwrap(); // not executable
    let real = system.join("python3");
    fs::write(&real, b"").unwrap();
    fs::set_permissions(&real, fs::Permissions::from_mode(0o755)).unwrap();
    symlink(&real, venv_bin.join("python3")).unwrap();
    let path = std::env::join_paths(["relative", empty.to_str().unwrap(), plain.to_str().unwrap()])
        .unwrap();
    assert_eq!(python_on_path(&path), None);
    let path = std::env::join_paths([&empty, &plain, &venv_bin, &system]).unwrap();
    assert_eq!(python_on_path(&path), Some(venv_bin.join("python3")));
}

/// Set in the child process of `the_process_environment_gives_conda_and_the_python3_on_path`.
const CHILD_ENV: &str = "NIXL_CAPI_SYS_TEST_FROM_PROCESS";

/// Run as a child process with a made-up environment: prints each step's name and find.
#[test]
#[ignore = "the child process of the_process_environment_gives_conda_and_the_python3_on_path"]
fn from_process_role() {
    assert!(std::env::var_os(CHILD_ENV).is_some(), "run only as a child");
    for step in search_order(&SearchEnv::from_process(None)) {
        let find = step.find().map(|dir| dir.display().to_string());
        println!("{} => {}", step.name, find.unwrap_or_default());
    }
}

#[test]
fn the_process_environment_gives_conda_and_the_python3_on_path() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().unwrap();
    let conda = root.path().join("conda");
    let conda_lib = install(conda.join("lib/python3.11/site-packages/.nixl_cu12.mesonpy.libs"));
    let venv = root.path().join("venv");
    let venv_lib = install(venv.join("lib/python3.12/site-packages/.nixl_cu13.mesonpy.libs"));
    fs::create_dir_all(venv.join("bin")).unwrap();
    let python = venv.join("bin/python3");
    fs::write(&python, b"").unwrap();
    fs::set_permissions(&python, fs::Permissions::from_mode(0o755)).unwrap();
    let path = std::env::join_paths([root.path().join("empty"), venv.join("bin")]).unwrap();

    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "from_process_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("PATH", &path)
        .env("CONDA_PREFIX", &conda)
        .env("HOME", root.path())
        .env_remove("NIXL_LIB_DIR")
        .env_remove("NIXL_PREFIX")
        .env_remove("VIRTUAL_ENV")
        .env_remove("PYTHONUSERBASE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let conda_line = format!(
        "CONDA_PREFIX={} => {}",
        conda.display(),
        conda_lib.display()
    );
    let path_line = format!(
        "the python3 on PATH ({}) => {}",
        python.display(),
        venv_lib.display()
    );
    assert!(stdout.contains(&conda_line), "{stdout}");
    assert!(stdout.contains(&path_line), "{stdout}");
    assert!(
        stdout.find(&conda_line) < stdout.find(&path_line),
        "{stdout}"
    );
}

//! The search order over made-up installations (empty files stand in for the library; the
//! search only looks for it).

use std::fs;
use std::path::{Path, PathBuf};

use nixl_capi_sys::discovery::{search_order, LooksIn, SearchEnv, Step, CAPI_LIB};

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
            "the Python user site",
            opt.as_str(),
            "the system loader",
        ]
    );
    assert_eq!(steps[0].looks_in, LooksIn::Nowhere("not set"));
    assert_eq!(steps[6].looks_in, LooksIn::SystemLoader);
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
    let user_step = &search_order(&env)[4];
    assert_eq!(
        user_step.looks_in,
        LooksIn::Nowhere("it has no lib/python3.*/site-packages folder")
    );

    let user_lib = install(user.join("lib/python3.11/site-packages/.nixl_cu12.mesonpy.libs"));
    let user_name = format!("the Python user site under {}", user.display());
    assert_eq!(first_find(&env), Some((user_name, user_lib)));
}

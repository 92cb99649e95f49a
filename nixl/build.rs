//! Lets this crate's tests and doctests find libnixl at run time without `LD_LIBRARY_PATH`.

fn main() {
    if let Ok(lib_dir) = std::env::var("DEP_NIXL_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
}

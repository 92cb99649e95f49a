//! Lets the connector's tests and examples find libnixl at run time without
//! `LD_LIBRARY_PATH`: embeds the library directory that nixl-sys linked against as an rpath.

fn main() {
    if let Ok(lib_dir) = std::env::var("DEP_NIXL_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
}

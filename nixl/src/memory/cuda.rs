//! Detecting a CUDA device without linking CUDA, so VRAM requests fail cleanly without a GPU.
//!
//! The driver library is loaded and initialised once per process and never unloaded:
//! closing libcuda after `cuInit` would pull the driver out from under any CUDA user in the
//! process, and reopening it on every VRAM registration is wasted work.

use std::ffi::{c_int, c_uint, CStr};
use std::sync::OnceLock;

use crate::error::{Error, Result};

type CuDeviceGetCount = extern "C" fn(*mut c_int) -> c_int;

/// Succeeds when the CUDA driver loads and reports at least one device.
pub(crate) fn require_device(operation: &'static str) -> Result<()> {
    device_count()
        .and_then(|count| match count {
            0 => Err("the CUDA driver reports 0 devices".to_string()),
            _ => Ok(()),
        })
        .map_err(|detail| Error::NoCudaDevice { operation, detail })
}

/// Number of CUDA devices, asked of the driver library.
fn device_count() -> std::result::Result<c_int, String> {
    static DRIVER: OnceLock<std::result::Result<CuDeviceGetCount, String>> = OnceLock::new();
    let count = DRIVER.get_or_init(load_driver).clone()?;
    let mut devices = 0;
    match count(&mut devices) {
        0 => Ok(devices),
        code => Err(format!("cuDeviceGetCount failed with CUresult {code}")),
    }
}

/// Loads libcuda for good, initialises it, and returns its `cuDeviceGetCount`.
fn load_driver() -> std::result::Result<CuDeviceGetCount, String> {
    const LIB: &CStr = c"libcuda.so.1";
    // SAFETY: dlopen with a valid C string. The handle is never closed, so the symbols
    // taken from it stay valid for the life of the process.
    let handle = unsafe { libc::dlopen(LIB.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err("the CUDA driver library libcuda.so.1 cannot be loaded".to_string());
    }
    // SAFETY: live handle and valid symbol names.
    let (init, count) = unsafe {
        (
            libc::dlsym(handle, c"cuInit".as_ptr()),
            libc::dlsym(handle, c"cuDeviceGetCount".as_ptr()),
        )
    };
    if init.is_null() || count.is_null() {
        return Err("libcuda.so.1 lacks cuInit or cuDeviceGetCount".to_string());
    }
    type CuInit = extern "C" fn(c_uint) -> c_int;
    // SAFETY: the driver API's documented signatures: CUresult cuInit(unsigned int) and
    // CUresult cuDeviceGetCount(int *); the library stays loaded.
    let (init, count) = unsafe {
        (
            std::mem::transmute::<*mut libc::c_void, CuInit>(init),
            std::mem::transmute::<*mut libc::c_void, CuDeviceGetCount>(count),
        )
    };
    match init(0) {
        0 => Ok(count),
        code => Err(format!("cuInit failed with CUresult {code}")),
    }
}

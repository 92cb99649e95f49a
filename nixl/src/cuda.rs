//! Detecting a CUDA device without linking CUDA, so VRAM requests fail cleanly without a GPU.

use std::ffi::{c_int, c_uint, CStr};

use crate::error::{Error, Result};

/// Succeeds when the CUDA driver loads and reports at least one device.
pub(crate) fn require_device(operation: &'static str) -> Result<()> {
    device_count()
        .and_then(|count| match count {
            0 => Err("the CUDA driver reports 0 devices".to_string()),
            _ => Ok(()),
        })
        .map_err(|detail| Error::NoCudaDevice { operation, detail })
}

/// Number of CUDA devices, asked of the driver library at run time.
fn device_count() -> std::result::Result<c_int, String> {
    const LIB: &CStr = c"libcuda.so.1";
    // SAFETY: dlopen with a valid C string; the handle is closed below.
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
    let result = if init.is_null() || count.is_null() {
        Err("libcuda.so.1 lacks cuInit or cuDeviceGetCount".to_string())
    } else {
        type CuInit = extern "C" fn(c_uint) -> c_int;
        type CuDeviceGetCount = extern "C" fn(*mut c_int) -> c_int;
        // SAFETY: the driver API's documented signatures: CUresult cuInit(unsigned int) and
        // CUresult cuDeviceGetCount(int *).
        let (init, count) = unsafe {
            (
                std::mem::transmute::<*mut libc::c_void, CuInit>(init),
                std::mem::transmute::<*mut libc::c_void, CuDeviceGetCount>(count),
            )
        };
        let mut devices = 0;
        match init(0) {
            0 => match count(&mut devices) {
                0 => Ok(devices),
                code => Err(format!("cuDeviceGetCount failed with CUresult {code}")),
            },
            code => Err(format!("cuInit failed with CUresult {code}")),
        }
    };
    // SAFETY: opened above, closed once.
    unsafe { libc::dlclose(handle) };
    result
}

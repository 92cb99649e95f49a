//! The boundary with the C API: what the owners of its helper objects (optional arguments,
//! parameters) can do, and conversions of names, strings and lists. It knows only
//! `nixl-capi-sys`, the error type and plain data.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr;

use nixl_capi_sys as sys;

use crate::error::{check, Error, Result};
use crate::ffi::handles::{OptArgs, Params};
use crate::ffi::library::capi;
use crate::ffi::mem_type::MemType;

/// Validates a name that crosses into NIXL as a C string: not empty, no NUL byte.
pub(crate) fn c_name(what: &'static str, name: &str) -> Result<CString> {
    if name.is_empty() {
        return Err(Error::InvalidName {
            what,
            value: String::new(),
            reason: "it is empty",
        });
    }
    CString::new(name).map_err(|_| Error::InvalidName {
        what,
        value: name.to_string(),
        reason: "it contains a NUL byte",
    })
}

/// Copies a C string NIXL lends us.
///
/// # Safety
/// `ptr` is null or points to a NUL-terminated string valid for this call.
pub(crate) unsafe fn lossy_string(ptr: *const c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// Copies and frees a buffer NIXL allocated with `malloc`.
///
/// # Safety
/// `data` is null (then `len` is ignored) or a malloc'd block of at least `len` bytes that
/// nothing else frees.
pub(crate) unsafe fn take_malloced(data: *mut c_void, len: usize) -> Vec<u8> {
    if data.is_null() {
        return Vec::new();
    }
    // SAFETY: `data` holds `len` initialised bytes per the caller's contract.
    let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec();
    // SAFETY: malloc'd by NIXL and owned by us from here on.
    unsafe { libc::free(data) };
    bytes
}

impl OptArgs {
    /// Empty optional arguments (NIXL's defaults).
    pub(crate) fn new() -> Result<Self> {
        // SAFETY: NIXL stores a new handle through the out-pointer.
        OptArgs::create("create optional arguments", |out| unsafe {
            capi().nixl_capi_create_opt_args(out)
        })
    }

    /// Adds a backend NIXL may use.
    ///
    /// # Safety
    /// `backend` is a live backend handle that outlives every use of these arguments.
    pub(crate) unsafe fn add_backend(&self, backend: sys::nixl_capi_backend_t) -> Result<()> {
        // SAFETY: both handles are live (the caller vouches for the backend).
        check(
            unsafe { capi().nixl_capi_opt_args_add_backend(self.raw(), backend) },
            "add backend to optional arguments",
        )
    }

    /// The C pointer of optional arguments, or null for NIXL's defaults.
    pub(crate) fn ptr(args: Option<&OptArgs>) -> sys::nixl_capi_opt_args_t {
        args.map_or(ptr::null_mut(), OptArgs::raw)
    }

    pub(crate) fn set_notification(&self, message: &[u8]) -> Result<()> {
        // SAFETY: live handle; NIXL copies the bytes.
        check(
            unsafe {
                capi().nixl_capi_opt_args_set_notif_msg(
                    self.raw(),
                    message.as_ptr().cast(),
                    message.len(),
                )
            },
            "set notification message",
        )?;
        // SAFETY: live handle.
        check(
            unsafe { capi().nixl_capi_opt_args_set_has_notif(self.raw(), true) },
            "enable notification",
        )
    }

    pub(crate) fn set_skip_desc_merge(&self, skip: bool) -> Result<()> {
        // SAFETY: live handle.
        check(
            unsafe { capi().nixl_capi_opt_args_set_skip_desc_merge(self.raw(), skip) },
            "set skip_desc_merge",
        )
    }

    pub(crate) fn set_custom_param(&self, value: &[u8]) -> Result<()> {
        // SAFETY: live handle; NIXL copies the bytes.
        check(
            unsafe {
                capi().nixl_capi_opt_args_set_custom_param(
                    self.raw(),
                    value.as_ptr().cast(),
                    value.len(),
                )
            },
            "set custom backend parameter",
        )
    }

    pub(crate) fn set_socket(&self, ip: &str, port: u16) -> Result<()> {
        let ip = c_name("IP address", ip)?;
        // SAFETY: live handle; NIXL copies the string.
        check(
            unsafe { capi().nixl_capi_opt_args_set_ip_addr(self.raw(), ip.as_ptr()) },
            "set metadata peer address",
        )?;
        // SAFETY: live handle.
        check(
            unsafe { capi().nixl_capi_opt_args_set_port(self.raw(), port) },
            "set metadata peer port",
        )
    }
}

impl Params {
    /// Builds a params handle holding `map`.
    pub(crate) fn from_map(map: &BTreeMap<String, String>) -> Result<Self> {
        // SAFETY: NIXL stores a new handle through the out-pointer.
        let params = Params::create("create backend parameters", |out| unsafe {
            capi().nixl_capi_create_params(out)
        })?;
        for (key, value) in map {
            let key = c_name("backend parameter name", key)?;
            let value = CString::new(value.as_str()).map_err(|_| Error::InvalidArgument {
                operation: "create backend parameters",
                reason: format!("value of {key:?} contains a NUL byte"),
            })?;
            // SAFETY: live handle; NIXL copies both strings.
            check(
                unsafe { capi().nixl_capi_params_add(params.raw(), key.as_ptr(), value.as_ptr()) },
                "add backend parameter",
            )?;
        }
        Ok(params)
    }

    /// Copies the key/value pairs out.
    pub(crate) fn to_map(&self) -> Result<BTreeMap<String, String>> {
        let mut map = BTreeMap::new();
        let mut empty = true;
        // SAFETY: live handle.
        check(
            unsafe { capi().nixl_capi_params_is_empty(self.raw(), &mut empty) },
            "read backend parameters",
        )?;
        if empty {
            return Ok(map);
        }
        let mut iter = ptr::null_mut();
        // SAFETY: live handle; the iterator is destroyed below, before the params.
        check(
            unsafe { capi().nixl_capi_params_create_iterator(self.raw(), &mut iter) },
            "iterate backend parameters",
        )?;
        let mut has_next = true;
        let mut result = Ok(());
        while has_next {
            let (mut key, mut value) = (ptr::null(), ptr::null());
            // SAFETY: live iterator; the strings are borrowed from the params and copied at once.
            let status = unsafe {
                capi().nixl_capi_params_iterator_next(iter, &mut key, &mut value, &mut has_next)
            };
            if let Err(err) = check(status, "iterate backend parameters") {
                result = Err(err);
                break;
            }
            if !key.is_null() {
                // SAFETY: NUL-terminated strings owned by the params, valid until it changes.
                map.insert(unsafe { lossy_string(key) }, unsafe { lossy_string(value) });
            }
        }
        // SAFETY: created above and destroyed once.
        let destroyed = check(
            unsafe { capi().nixl_capi_params_destroy_iterator(iter) },
            "destroy parameter iterator",
        );
        result.and(destroyed).map(|()| map)
    }
}

/// Copies the memory types out of an owned `nixl_capi_mem_list_t` and destroys it.
///
/// # Safety
/// `list` is a live list NIXL returned to us, not used after this call.
pub(crate) unsafe fn take_mem_list(list: sys::nixl_capi_mem_list_t) -> Result<Vec<MemType>> {
    let mut size = 0;
    // SAFETY: live list per the caller's contract.
    let mut result = check(
        unsafe { capi().nixl_capi_mem_list_size(list, &mut size) },
        "read memory types",
    );
    let mut types = Vec::with_capacity(size);
    for index in 0..size {
        if result.is_err() {
            break;
        }
        let mut value = 0;
        // SAFETY: index < size.
        result = check(
            unsafe { capi().nixl_capi_mem_list_get(list, index, &mut value) },
            "read memory types",
        );
        if result.is_ok() {
            result = MemType::from_raw(value)
                .map(|t| types.push(t))
                .ok_or(Error::UnknownMemType {
                    operation: "read memory types",
                    value: i64::from(value),
                });
        }
    }
    // SAFETY: owned and destroyed once.
    let destroyed = check(
        unsafe { capi().nixl_capi_destroy_mem_list(list) },
        "destroy memory-type list",
    );
    result.and(destroyed).map(|()| types)
}

/// Copies the strings out of an owned `nixl_capi_string_list_t` and destroys it.
///
/// # Safety
/// `list` is a live list NIXL returned to us, not used after this call.
pub(crate) unsafe fn take_string_list(list: sys::nixl_capi_string_list_t) -> Result<Vec<String>> {
    let mut size = 0;
    // SAFETY: live list per the caller's contract.
    let mut result = check(
        unsafe { capi().nixl_capi_string_list_size(list, &mut size) },
        "read string list",
    );
    let mut strings = Vec::with_capacity(size);
    for index in 0..size {
        if result.is_err() {
            break;
        }
        let mut s = ptr::null();
        // SAFETY: index < size; the string is borrowed from the list and copied at once.
        result = check(
            unsafe { capi().nixl_capi_string_list_get(list, index, &mut s) },
            "read string list",
        );
        // SAFETY: NUL-terminated string owned by the list.
        strings.push(unsafe { lossy_string(s) });
    }
    // SAFETY: owned and destroyed once.
    let destroyed = check(
        unsafe { capi().nixl_capi_destroy_string_list(list) },
        "destroy string list",
    );
    result.and(destroyed).map(|()| strings)
}

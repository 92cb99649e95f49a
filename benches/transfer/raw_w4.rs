//! The floor of the whole of W4 through NIXL's C API: two agents made with the C API alone,
//! then, per run, two lists of [`BUILD_DESCS`] descriptors (storage reserved, one
//! `nixl_capi_xfer_dlist_add_desc` call per descriptor) and `nixl_capi_create_xfer_req`,
//! with nothing checked on the Rust side. What the `nixl` crate adds to W4 is its time
//! above this; what is left below Python's W4 is NIXL's C API's (one call per descriptor,
//! where NIXL's Python bindings build the C++ list from a NumPy array in one call).

use std::ffi::CString;
use std::time::Instant;

use nixl_capi_sys as sys;
use sys::nixl_capi_status_t::NIXL_CAPI_SUCCESS as OK;

use super::{raw_capi, thread_cpu_ms, Res, BUILD_DESC, BUILD_DESCS, BUILD_REPS, BUILD_STRIDE};

/// Fails with `what` unless `status` is success.
fn ok(status: sys::nixl_capi_status_t::Type, what: &str) -> Res<()> {
    if status == OK {
        Ok(())
    } else {
        Err(format!("{what}: NIXL status {status}").into())
    }
}

/// An agent of the C API with a UCX backend and one registered buffer.
struct RawAgent {
    agent: sys::nixl_capi_agent_t,
    backend: sys::nixl_capi_backend_t,
    registered: sys::nixl_capi_reg_dlist_t,
    buffer: Vec<u8>,
}

impl RawAgent {
    /// Agent `name` (no progress thread: nothing is posted), its UCX backend with the
    /// plugin's defaults, and a registered buffer of `len` bytes.
    fn new(name: &str, len: usize) -> Res<RawAgent> {
        let capi = raw_capi()?;
        let name = CString::new(name)?;
        let config = sys::nixl_capi_agent_config_t {
            enable_prog_thread: false,
            enable_listen_thread: false,
            listen_port: 0,
            thread_sync: sys::nixl_capi_thread_sync_t::NIXL_CAPI_THREAD_SYNC_RW,
            num_workers: 1,
            pthr_delay_us: 0,
            lthr_delay_us: 0,
            capture_telemetry: false,
        };
        let mut raw = RawAgent {
            agent: std::ptr::null_mut(),
            backend: std::ptr::null_mut(),
            registered: std::ptr::null_mut(),
            buffer: vec![0u8; len],
        };
        // SAFETY: valid C string and config; out-pointer to a field of ours.
        let status = unsafe {
            capi.nixl_capi_create_configured_agent(name.as_ptr(), &config, &mut raw.agent)
        };
        ok(status, "create raw agent")?;
        let mut params = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        ok(
            unsafe { capi.nixl_capi_create_params(&mut params) },
            "create params",
        )?;
        let ucx = CString::new("UCX")?;
        // SAFETY: live agent and params, valid C string, out-pointer to a field of ours.
        let status = unsafe {
            capi.nixl_capi_create_backend(raw.agent, ucx.as_ptr(), params, &mut raw.backend)
        };
        // SAFETY: created above, destroyed once.
        unsafe { capi.nixl_capi_destroy_params(params) };
        ok(status, "create raw UCX backend")?;
        // SAFETY: out-pointer to a field of ours.
        let status = unsafe {
            capi.nixl_capi_create_reg_dlist(
                sys::nixl_capi_mem_type_t::NIXL_CAPI_MEM_DRAM,
                &mut raw.registered,
            )
        };
        ok(status, "create registration list")?;
        let addr = raw.buffer.as_mut_ptr() as usize;
        // SAFETY: live list; NIXL copies the numbers.
        let status = unsafe {
            capi.nixl_capi_reg_dlist_add_desc(raw.registered, addr, len, 0, std::ptr::null(), 0)
        };
        ok(status, "describe raw buffer")?;
        // SAFETY: live agent and list; the buffer lives in `raw` until it is deregistered.
        let status =
            unsafe { capi.nixl_capi_register_mem(raw.agent, raw.registered, std::ptr::null_mut()) };
        ok(status, "register raw buffer")?;
        Ok(raw)
    }

    /// Loads `other`'s metadata into this agent.
    fn load(&self, other: &RawAgent) -> Res<()> {
        let capi = raw_capi()?;
        let (mut data, mut len) = (std::ptr::null_mut(), 0);
        // SAFETY: live agent; NIXL stores a malloc'd buffer and its length.
        ok(
            unsafe { capi.nixl_capi_get_local_md(other.agent, &mut data, &mut len) },
            "get raw metadata",
        )?;
        let mut name = std::ptr::null_mut();
        // SAFETY: live agent; `data` holds `len` bytes.
        let status = unsafe { capi.nixl_capi_load_remote_md(self.agent, data, len, &mut name) };
        // SAFETY: both malloc'd by NIXL, freed once.
        unsafe {
            libc::free(data);
            libc::free(name.cast());
        }
        ok(status, "load raw metadata")
    }
}

impl Drop for RawAgent {
    fn drop(&mut self) {
        let Ok(capi) = raw_capi() else { return };
        // SAFETY: each handle was created by this value and is released once, in order: the
        // buffer is deregistered before the agent and the memory go.
        unsafe {
            capi.nixl_capi_deregister_mem(self.agent, self.registered, std::ptr::null_mut());
            capi.nixl_capi_destroy_reg_dlist(self.registered);
            capi.nixl_capi_destroy_backend(self.backend);
            capi.nixl_capi_destroy_agent(self.agent);
        }
    }
}

/// A C list of [`BUILD_DESCS`] descriptors at `base`, storage reserved first.
fn list(base: usize) -> Res<sys::nixl_capi_xfer_dlist_t> {
    let capi = raw_capi()?;
    let mut list = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    let status = unsafe {
        capi.nixl_capi_create_xfer_dlist(sys::nixl_capi_mem_type_t::NIXL_CAPI_MEM_DRAM, &mut list)
    };
    ok(status, "create raw list")?;
    let mut good = true;
    // SAFETY: live list created above; NIXL only copies the numbers.
    unsafe {
        good &= capi.nixl_capi_xfer_dlist_resize(list, BUILD_DESCS) == OK;
        good &= capi.nixl_capi_xfer_dlist_clear(list) == OK;
        for i in 0..BUILD_DESCS {
            good &=
                capi.nixl_capi_xfer_dlist_add_desc(list, base + i * BUILD_STRIDE, BUILD_DESC, 0)
                    == OK;
        }
    }
    if good {
        Ok(list)
    } else {
        Err("raw list calls failed".into())
    }
}

/// W4 through the bare C calls: the median run's (total, both lists, create) in ms, and the
/// measuring thread's CPU time for the whole.
pub fn floor() -> Res<[f64; 4]> {
    let capi = raw_capi()?;
    let len = BUILD_DESCS * BUILD_STRIDE;
    let (a, b) = (RawAgent::new("RA", len)?, RawAgent::new("RB", len)?);
    a.load(&b)?;
    let remote_name = CString::new("RB")?;
    let (a_base, b_base) = (a.buffer.as_ptr() as usize, b.buffer.as_ptr() as usize);
    let mut runs = Vec::with_capacity(BUILD_REPS);
    for _ in 0..BUILD_REPS {
        let cpu0 = thread_cpu_ms();
        let t0 = Instant::now();
        let (local, remote) = (list(a_base)?, list(b_base)?);
        let t1 = Instant::now();
        let mut req = std::ptr::null_mut();
        // SAFETY: live agent and lists, valid C string, out-pointer to a local.
        let status = unsafe {
            capi.nixl_capi_create_xfer_req(
                a.agent,
                sys::nixl_capi_xfer_op_t::NIXL_CAPI_XFER_OP_WRITE,
                local,
                remote,
                remote_name.as_ptr(),
                &mut req,
                std::ptr::null_mut(),
            )
        };
        let t2 = Instant::now();
        let cpu = thread_cpu_ms() - cpu0;
        // SAFETY: the request was never posted; it is released, then its wrapper freed, and
        // the lists destroyed, each once.
        unsafe {
            if status == OK {
                capi.nixl_capi_release_xfer_req(a.agent, req);
                capi.nixl_capi_destroy_xfer_req(req);
            }
            capi.nixl_capi_destroy_xfer_dlist(local);
            capi.nixl_capi_destroy_xfer_dlist(remote);
        }
        ok(status, "create raw request")?;
        let ms = |x: Instant, y: Instant| (y - x).as_secs_f64() * 1e3;
        runs.push([ms(t0, t2), ms(t0, t1), ms(t1, t2), cpu]);
    }
    // The agent that loaded the other's metadata goes first.
    drop(a);
    drop(b);
    runs.sort_by(|x, y| x[0].total_cmp(&y[0]));
    Ok(runs[runs.len() / 2])
}

//! Smoke tests through the raw bindings alone, against the real library.

mod common;

use std::ffi::{CStr, CString};
use std::ptr;
use std::sync::OnceLock;

use nixl_capi_sys::*;

type Status = nixl_capi_status_t::Type;
const OK: Status = nixl_capi_status_t::NIXL_CAPI_SUCCESS;
const IN_PROG: Status = nixl_capi_status_t::NIXL_CAPI_IN_PROG;
const DRAM: nixl_capi_mem_type_t::Type = nixl_capi_mem_type_t::NIXL_CAPI_MEM_DRAM;

/// The real library, loaded once for the whole test binary.
fn capi() -> &'static NixlCapi {
    static CAPI: OnceLock<NixlCapi> = OnceLock::new();
    CAPI.get_or_init(|| {
        let path = common::library_path();
        // SAFETY: NIXL's C API library; its initialisers only set up NIXL's own state.
        unsafe { NixlCapi::new(&path) }
            .unwrap_or_else(|err| panic!("cannot load {}: {err}", path.display()))
    })
}

fn check(status: Status, what: &str) {
    assert_eq!(status, OK, "{what} returned {status}");
}

/// An agent whose progress thread sleeps 1 ms between polls, so it does not spin a core.
fn agent(name: &str) -> nixl_capi_agent_t {
    let name = CString::new(name).unwrap();
    let cfg = nixl_capi_agent_config_t {
        enable_prog_thread: true,
        enable_listen_thread: false,
        listen_port: 0,
        thread_sync: nixl_capi_thread_sync_t::NIXL_CAPI_THREAD_SYNC_STRICT,
        num_workers: 1,
        pthr_delay_us: 1000,
        lthr_delay_us: 100_000,
        capture_telemetry: false,
    };
    let mut agent = ptr::null_mut();
    // SAFETY: valid NUL-terminated name, valid config, out-pointer to a local.
    check(
        unsafe { capi().nixl_capi_create_configured_agent(name.as_ptr(), &cfg, &mut agent) },
        "create agent",
    );
    agent
}

fn plugins(agent: nixl_capi_agent_t) -> Vec<String> {
    let mut list = ptr::null_mut();
    let mut size = 0;
    // SAFETY: live agent; the strings are borrowed from `list` and copied before it is destroyed.
    unsafe {
        check(
            capi().nixl_capi_get_available_plugins(agent, &mut list),
            "get plugins",
        );
        check(
            capi().nixl_capi_string_list_size(list, &mut size),
            "list size",
        );
        let names = (0..size)
            .map(|i| {
                let mut s = ptr::null();
                check(
                    capi().nixl_capi_string_list_get(list, i, &mut s),
                    "list get",
                );
                CStr::from_ptr(s).to_string_lossy().into_owned()
            })
            .collect();
        check(capi().nixl_capi_destroy_string_list(list), "destroy list");
        names
    }
}

fn ucx_backend(agent: nixl_capi_agent_t) -> nixl_capi_backend_t {
    let ucx = CString::new("UCX").unwrap();
    let mut mems = ptr::null_mut();
    let mut params = ptr::null_mut();
    let mut backend = ptr::null_mut();
    // SAFETY: live agent; params and mems are destroyed after the backend is made.
    unsafe {
        check(
            capi().nixl_capi_get_plugin_params(agent, ucx.as_ptr(), &mut mems, &mut params),
            "plugin params",
        );
        check(
            capi().nixl_capi_create_backend(agent, ucx.as_ptr(), params, &mut backend),
            "create backend",
        );
        check(capi().nixl_capi_destroy_mem_list(mems), "destroy mems");
        check(capi().nixl_capi_destroy_params(params), "destroy params");
    }
    backend
}

#[test]
fn agent_plugins_params_backend() {
    let a = agent("raw-smoke");
    let names = plugins(a);
    assert!(
        names.iter().any(|n| n == "UCX"),
        "UCX missing from {names:?}"
    );
    assert!(
        names.iter().any(|n| n == "POSIX"),
        "POSIX missing from {names:?}"
    );

    let ucx = CString::new("UCX").unwrap();
    let mut mems = ptr::null_mut();
    let mut params = ptr::null_mut();
    // SAFETY: live agent; the iterator and lists are destroyed before the agent.
    unsafe {
        check(
            capi().nixl_capi_get_plugin_params(a, ucx.as_ptr(), &mut mems, &mut params),
            "plugin params",
        );
        let mut n_mems = 0;
        check(
            capi().nixl_capi_mem_list_size(mems, &mut n_mems),
            "mem list size",
        );
        let types: Vec<_> = (0..n_mems)
            .map(|i| {
                let mut t = 0;
                check(
                    capi().nixl_capi_mem_list_get(mems, i, &mut t),
                    "mem list get",
                );
                t
            })
            .collect();
        assert!(
            types.contains(&DRAM),
            "UCX memory types {types:?} lack DRAM"
        );

        let mut iter = ptr::null_mut();
        check(
            capi().nixl_capi_params_create_iterator(params, &mut iter),
            "iterator",
        );
        let mut keys = Vec::new();
        let mut has_next = true;
        while has_next {
            let (mut k, mut v) = (ptr::null(), ptr::null());
            check(
                capi().nixl_capi_params_iterator_next(iter, &mut k, &mut v, &mut has_next),
                "next",
            );
            if !k.is_null() {
                keys.push(CStr::from_ptr(k).to_string_lossy().into_owned());
            }
        }
        check(
            capi().nixl_capi_params_destroy_iterator(iter),
            "destroy iterator",
        );
        assert!(!keys.is_empty(), "UCX has no default params");
        check(capi().nixl_capi_destroy_mem_list(mems), "destroy mems");
        check(capi().nixl_capi_destroy_params(params), "destroy params");

        let backend = ucx_backend(a);
        check(capi().nixl_capi_destroy_backend(backend), "destroy backend");
        check(capi().nixl_capi_destroy_agent(a), "destroy agent");
    }
}

#[test]
fn two_agents_write_one_mib_over_ucx() {
    const LEN: usize = 1 << 20;
    let src: Vec<u8> = (0..LEN).map(|i| (i * 7 % 251) as u8).collect();
    let mut dst = vec![0u8; LEN];

    let (a, b) = (agent("raw-writer"), agent("raw-target"));
    let (ba, bb) = (ucx_backend(a), ucx_backend(b));
    // SAFETY: the buffers outlive the registrations and the transfer, which completes
    // before anything is deregistered or destroyed; every handle is destroyed once.
    unsafe {
        let reg = |agent, backend, addr: *const u8| {
            let mut list = ptr::null_mut();
            check(
                capi().nixl_capi_create_reg_dlist(DRAM, &mut list),
                "reg dlist",
            );
            check(
                capi().nixl_capi_reg_dlist_add_desc(list, addr as usize, LEN, 0, ptr::null(), 0),
                "add",
            );
            let mut opts = ptr::null_mut();
            check(capi().nixl_capi_create_opt_args(&mut opts), "opt args");
            check(
                capi().nixl_capi_opt_args_add_backend(opts, backend),
                "add backend",
            );
            check(capi().nixl_capi_register_mem(agent, list, opts), "register");
            (list, opts)
        };
        let (reg_a, opts_a) = reg(a, ba, src.as_ptr());
        let (reg_b, opts_b) = reg(b, bb, dst.as_mut_ptr());

        let mut md = ptr::null_mut();
        let mut md_len = 0;
        check(
            capi().nixl_capi_get_local_md(b, &mut md, &mut md_len),
            "local md",
        );
        let mut remote_name = ptr::null_mut();
        check(
            capi().nixl_capi_load_remote_md(a, md, md_len, &mut remote_name),
            "load md",
        );
        libc::free(md);
        assert_eq!(CStr::from_ptr(remote_name).to_str().unwrap(), "raw-target");

        let xfer = |addr: *const u8| {
            let mut list = ptr::null_mut();
            check(
                capi().nixl_capi_create_xfer_dlist(DRAM, &mut list),
                "xfer dlist",
            );
            check(
                capi().nixl_capi_xfer_dlist_add_desc(list, addr as usize, LEN, 0),
                "add",
            );
            list
        };
        let (local, remote) = (xfer(src.as_ptr()), xfer(dst.as_ptr()));
        let mut req = ptr::null_mut();
        check(
            capi().nixl_capi_create_xfer_req(
                a,
                nixl_capi_xfer_op_t::NIXL_CAPI_XFER_OP_WRITE,
                local,
                remote,
                remote_name,
                &mut req,
                opts_a,
            ),
            "create request",
        );
        let mut status = capi().nixl_capi_post_xfer_req(a, req, ptr::null_mut());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while status == IN_PROG {
            assert!(
                std::time::Instant::now() < deadline,
                "the 1 MiB WRITE did not finish within 60 s"
            );
            status = capi().nixl_capi_get_xfer_status(a, req);
        }
        check(status, "transfer");
        assert!(dst == src, "destination differs from source after WRITE");

        check(capi().nixl_capi_release_xfer_req(a, req), "release request");
        check(capi().nixl_capi_destroy_xfer_req(req), "destroy request");
        check(capi().nixl_capi_destroy_xfer_dlist(local), "destroy local");
        check(
            capi().nixl_capi_destroy_xfer_dlist(remote),
            "destroy remote",
        );
        check(
            capi().nixl_capi_invalidate_remote_md(a, remote_name),
            "invalidate",
        );
        libc::free(remote_name.cast());
        check(
            capi().nixl_capi_deregister_mem(a, reg_a, opts_a),
            "deregister a",
        );
        check(
            capi().nixl_capi_deregister_mem(b, reg_b, opts_b),
            "deregister b",
        );
        for (list, opts) in [(reg_a, opts_a), (reg_b, opts_b)] {
            check(capi().nixl_capi_destroy_reg_dlist(list), "destroy reg");
            check(capi().nixl_capi_destroy_opt_args(opts), "destroy opts");
        }
        check(capi().nixl_capi_destroy_backend(ba), "destroy backend a");
        check(capi().nixl_capi_destroy_backend(bb), "destroy backend b");
        check(capi().nixl_capi_destroy_agent(a), "destroy a");
        check(capi().nixl_capi_destroy_agent(b), "destroy b");
    }
}

//! One owner per C object type that NIXL frees with a plain destroy call, all made by
//! [`foreign_handle!`]: the owner holds the handle, creates it through NIXL's create call
//! (loading NIXL first if this process has not yet), and destroys it exactly once in
//! `Drop`, logging a failure rather than panicking. Adding a
//! C object type is one declaration here; its methods live with the code that uses it.
//!
//! Objects whose release needs their agent (transfer requests, prepared lists, memory
//! views) have owners of their own next to their users.

use nixl_capi_sys as sys;

use crate::error::{check, Result};
use crate::ffi::library::{self, capi};

/// Declares `$name`, the owner of one `$raw` handle destroyed by the C API's `$destroy`.
macro_rules! foreign_handle {
    ($(#[$doc:meta])* $name:ident($raw:ty), destroy: $destroy:ident, what: $what:literal) => {
        $(#[$doc])*
        pub(crate) struct $name {
            raw: $raw,
        }

        impl $name {
            /// Makes one with `create`, NIXL's create call, which stores the new handle
            /// through its argument; a failure becomes an error naming `operation`. NIXL is
            /// loaded first, if it was not yet.
            pub(crate) fn create(
                operation: &'static str,
                create: impl FnOnce(*mut $raw) -> sys::nixl_capi_status_t::Type,
            ) -> Result<Self> {
                library::load()?;
                let mut raw: $raw = std::ptr::null_mut();
                check(create(&mut raw), operation)?;
                Ok($name { raw })
            }

            /// The handle, for NIXL calls; valid while `self` lives.
            pub(crate) fn raw(&self) -> $raw {
                self.raw
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: an owned live handle, destroyed only here.
                let status = unsafe { capi().$destroy(self.raw) };
                if let Err(err) = check(status, concat!("destroy ", $what)) {
                    tracing::error!(%err, concat!("leaking NIXL ", $what));
                }
            }
        }
    };
}

/// Lets `$name`, made by [`foreign_handle!`], take over handles NIXL hands out.
macro_rules! adopts_handed_out {
    ($name:ident($raw:ty)) => {
        impl $name {
            /// Takes over a handle NIXL handed out.
            ///
            /// # Safety
            /// `raw` is live and nothing else destroys it.
            pub(crate) unsafe fn from_raw(raw: $raw) -> Self {
                $name { raw }
            }
        }
    };
}

foreign_handle!(
    /// An owned `nixl_capi_opt_args_t`: optional arguments of a call.
    OptArgs(sys::nixl_capi_opt_args_t),
    destroy: nixl_capi_destroy_opt_args,
    what: "optional arguments"
);

foreign_handle!(
    /// An owned `nixl_capi_params_t`: backend parameters.
    Params(sys::nixl_capi_params_t),
    destroy: nixl_capi_destroy_params,
    what: "backend parameters"
);

foreign_handle!(
    /// An owned `nixl_capi_reg_dlist_t`: descriptors to register.
    RegDlist(sys::nixl_capi_reg_dlist_t),
    destroy: nixl_capi_destroy_reg_dlist,
    what: "registration list"
);

foreign_handle!(
    /// An owned `nixl_capi_xfer_dlist_t`: descriptors to transfer.
    XferDlistHandle(sys::nixl_capi_xfer_dlist_t),
    destroy: nixl_capi_destroy_xfer_dlist,
    what: "descriptor list"
);

foreign_handle!(
    /// An owned `nixl_capi_remote_dlist_t`: descriptors of peers' memory, each naming its agent.
    PeerDlist(sys::nixl_capi_remote_dlist_t),
    destroy: nixl_capi_destroy_remote_dlist,
    what: "peer descriptor list"
);

foreign_handle!(
    /// An owned `nixl_capi_notif_map_t`: notifications by sender.
    NotifMap(sys::nixl_capi_notif_map_t),
    destroy: nixl_capi_destroy_notif_map,
    what: "notification map"
);

foreign_handle!(
    /// An owned `nixl_capi_query_resp_list_t`: answers of a memory query.
    QueryResponses(sys::nixl_capi_query_resp_list_t),
    destroy: nixl_capi_destroy_query_resp_list,
    what: "query responses"
);

foreign_handle!(
    /// An owned `nixl_capi_backend_t`: the wrapper NIXL hands out for a backend (the backend
    /// itself belongs to its agent).
    BackendHandle(sys::nixl_capi_backend_t),
    destroy: nixl_capi_destroy_backend,
    what: "backend handle"
);

adopts_handed_out!(Params(sys::nixl_capi_params_t));

// SAFETY: a plain owned list; mutation needs `&mut` on its owner, and shared access only
// passes the handle to NIXL calls that read it.
unsafe impl Send for XferDlistHandle {}
// SAFETY: as above.
unsafe impl Sync for XferDlistHandle {}
// SAFETY: the wrapper refers to a backend owned by the agent; every call that uses it goes
// through the agent, which provides the locking.
unsafe impl Send for BackendHandle {}

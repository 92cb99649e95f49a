//! Asking backends about memory before registering it (e.g. whether files exist).

use std::collections::BTreeMap;
use std::ptr;

use nixl_sys as sys;

use crate::agent::Agent;
use crate::backend::Backend;
use crate::descriptor::RegDesc;
use crate::error::{check, Result};
use crate::mem_type::MemType;
use crate::raw::{OptArgs, Params};
use crate::registration::RegDlist;

/// An owned `nixl_capi_query_resp_list_t`.
struct QueryResponses {
    raw: sys::nixl_capi_query_resp_list_t,
}

impl QueryResponses {
    fn new() -> Result<Self> {
        let mut raw = ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(
            unsafe { sys::nixl_capi_create_query_resp_list(&mut raw) },
            "create query responses",
        )?;
        Ok(QueryResponses { raw })
    }

    /// Copies the answers out: one per descriptor, `None` where the backend had none.
    fn to_vec(&self) -> Result<Vec<Option<BTreeMap<String, String>>>> {
        const OP: &str = "read query responses";
        let mut size = 0;
        // SAFETY: live list.
        check(
            unsafe { sys::nixl_capi_query_resp_list_size(self.raw, &mut size) },
            OP,
        )?;
        (0..size)
            .map(|index| {
                let mut has_value = false;
                // SAFETY: index < size.
                check(
                    unsafe {
                        sys::nixl_capi_query_resp_list_has_value(self.raw, index, &mut has_value)
                    },
                    OP,
                )?;
                if !has_value {
                    return Ok(None);
                }
                let mut params = ptr::null_mut();
                // SAFETY: index < size and it has a value; the params are ours to destroy.
                check(
                    unsafe {
                        sys::nixl_capi_query_resp_list_get_params(self.raw, index, &mut params)
                    },
                    OP,
                )?;
                Params::from_raw(params).to_map().map(Some)
            })
            .collect()
    }
}

impl Drop for QueryResponses {
    fn drop(&mut self) {
        // SAFETY: owned handle, destroyed only here.
        let status = unsafe { sys::nixl_capi_destroy_query_resp_list(self.raw) };
        if let Err(err) = check(status, "destroy query responses") {
            tracing::error!(%err, "leaking NIXL query responses");
        }
    }
}

impl Agent {
    /// Asks `backends` (empty: every capable backend) about memory that is not necessarily
    /// registered, e.g. FILE descriptors whose metadata names a path. One answer per
    /// descriptor: the backend's key/value description, or `None` where it has nothing.
    pub fn query_memory(
        &self,
        mem_type: MemType,
        descs: &[RegDesc],
        backends: &[&Backend],
    ) -> Result<Vec<Option<BTreeMap<String, String>>>> {
        const OP: &str = "query memory";
        let list = RegDlist::build(OP, mem_type, descs)?;
        let args = OptArgs::with_backends(&self.inner, OP, backends)?;
        let responses = QueryResponses::new()?;
        let status = self.inner.with(|agent| {
            // SAFETY: live agent, list, responses and args.
            unsafe { sys::nixl_capi_query_mem(agent, list.raw(), responses.raw, args.raw()) }
        });
        check(status, OP)?;
        responses.to_vec()
    }
}

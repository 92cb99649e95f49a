//! Asking backends about memory before registering it (e.g. whether files exist).

use std::collections::BTreeMap;
use std::ptr;

use crate::agent::backend::backend_args;
use crate::agent::backend::Backend;
use crate::agent::Agent;
use crate::error::{check, Result};
use crate::ffi::descriptor::RegDesc;
use crate::ffi::handles::RegDlist;
use crate::ffi::handles::{Params, QueryResponses};
use crate::ffi::library::capi;
use crate::ffi::mem_type::MemType;

impl QueryResponses {
    fn new() -> Result<Self> {
        // SAFETY: NIXL stores a new handle through the out-pointer.
        QueryResponses::create("create query responses", |out| unsafe {
            capi().nixl_capi_create_query_resp_list(out)
        })
    }

    /// Copies the answers out: one per descriptor, `None` where the backend had none.
    fn to_vec(&self) -> Result<Vec<Option<BTreeMap<String, String>>>> {
        const OP: &str = "read query responses";
        let mut size = 0;
        // SAFETY: live list.
        check(
            unsafe { capi().nixl_capi_query_resp_list_size(self.raw(), &mut size) },
            OP,
        )?;
        (0..size)
            .map(|index| {
                let mut has_value = false;
                // SAFETY: index < size.
                check(
                    unsafe {
                        capi().nixl_capi_query_resp_list_has_value(
                            self.raw(),
                            index,
                            &mut has_value,
                        )
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
                        capi().nixl_capi_query_resp_list_get_params(self.raw(), index, &mut params)
                    },
                    OP,
                )?;
                // SAFETY: handed to us above, destroyed by the owner only.
                unsafe { Params::from_raw(params) }.to_map().map(Some)
            })
            .collect()
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
        let args = backend_args(&self.inner, OP, backends)?;
        let responses = QueryResponses::new()?;
        let status = self.inner.with(|agent| {
            // SAFETY: live agent, list, responses and args.
            unsafe { capi().nixl_capi_query_mem(agent, list.raw(), responses.raw(), args.raw()) }
        });
        check(status, OP)?;
        responses.to_vec()
    }
}

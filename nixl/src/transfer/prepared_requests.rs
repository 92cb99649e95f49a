//! Requests made from prepared lists: index slices of a prepared local and a prepared
//! remote list, paired descriptor by descriptor.

use std::ffi::c_int;
use std::ptr;
use std::sync::Arc;

use crate::agent::Agent;
use crate::descriptors::prepared::{PreparedLocal, PreparedRemote};
use crate::descriptors::prepared_handle::PreparedShared;
use crate::error::{check, Error, Result};
use crate::ffi::descriptor::check_pairing;
use crate::ffi::handles::OptArgs;
use crate::ffi::library::capi;
use crate::peers::recheck;
use crate::transfer::options::{XferOp, XferOptions};
use crate::transfer::xfer::XferRequest;

/// Converts indices to NIXL's `int`s, checking each against the list length.
fn to_c_indices(operation: &'static str, indices: &[usize], len: usize) -> Result<Vec<c_int>> {
    indices
        .iter()
        .map(|&index| match c_int::try_from(index) {
            Ok(i) if index < len => Ok(i),
            _ => Err(Error::IndexOutOfRange {
                operation,
                index,
                len,
                items: "descriptors of the prepared list",
            }),
        })
        .collect()
}

impl Agent {
    /// Makes a request from prepared lists: local descriptor `local_indices[i]` pairs with
    /// remote descriptor `remote_indices[i]`.
    ///
    /// # Errors
    /// [`Error::IndexOutOfRange`] for an index past a list's end, [`Error::LengthMismatch`]
    /// when the index slices or the paired lengths differ, [`Error::Nixl`] if NIXL refuses.
    pub fn make_xfer_req(
        &self,
        op: XferOp,
        local: &PreparedLocal,
        local_indices: &[usize],
        remote: &PreparedRemote,
        remote_indices: &[usize],
        options: &XferOptions,
    ) -> Result<XferRequest> {
        const OP: &str = "make transfer request";
        for shared in [&local.shared.agent, &remote.shared.agent] {
            if !Arc::ptr_eq(shared, &self.inner) {
                return Err(Error::InvalidArgument {
                    operation: OP,
                    reason: format!("the prepared list belongs to agent {:?}", shared.name),
                });
            }
        }
        let l = to_c_indices(OP, local_indices, local.shared.lens.len())?;
        let r = to_c_indices(OP, remote_indices, remote.shared.lens.len())?;
        check_pairing(
            OP,
            local_indices.iter().map(|&i| local.shared.lens[i]),
            remote_indices.iter().map(|&i| remote.shared.lens[i]),
        )?;
        self.make_request(
            op,
            (&local.shared, &l),
            (&remote.shared, &r),
            &remote.remote_agent,
            options,
        )
    }

    /// Makes a request from prepared handles, each with its checked indices.
    pub(crate) fn make_request(
        &self,
        op: XferOp,
        (local, local_indices): (&Arc<PreparedShared>, &[c_int]),
        (remote, remote_indices): (&Arc<PreparedShared>, &[c_int]),
        remote_agent: &str,
        options: &XferOptions,
    ) -> Result<XferRequest> {
        const OP: &str = "make transfer request";
        // The remote list may have been prepared while this process had other workers.
        recheck::recheck(&self.inner.loaded, remote_agent)?;
        let args = options.to_raw(&self.inner, OP)?;
        let mut raw = ptr::null_mut();
        let status = self.inner.with(|agent| {
            // SAFETY: live agent, handles and args; index arrays valid for their lengths.
            unsafe {
                capi().nixl_capi_make_xfer_req(
                    agent,
                    op.to_raw(),
                    local.raw,
                    local_indices.as_ptr(),
                    local_indices.len(),
                    remote.raw,
                    remote_indices.as_ptr(),
                    remote_indices.len(),
                    &mut raw,
                    OptArgs::ptr(args.as_ref()),
                )
            }
        });
        check(status, OP).map_err(|err| self.explain_request_failure(err, remote_agent))?;
        // The prepared local list holds the registrations; the request holds both lists.
        Ok(XferRequest::new(
            self.inner.clone(),
            raw,
            Vec::new(),
            vec![local.clone(), remote.clone()],
            remote_agent.to_string(),
        ))
    }
}

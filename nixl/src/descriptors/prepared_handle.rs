//! The owner of a prepared descriptor list's handle, shared by the public prepared lists,
//! the lists prepared for reuse, and the requests made from them.

use std::ptr;
use std::sync::Arc;

use nixl_capi_sys as sys;

use crate::agent::backend::{backend_args, Backend};
use crate::agent::{Agent, AgentInner};
use crate::descriptors::xfer_dlist::XferDlist;
use crate::error::{check, Error, Result};
use crate::ffi::handles::OptArgs;
use crate::ffi::library::capi;
use crate::peers::local_peers::Hold;

/// The owner of a prepared-list handle, shared by the list and the requests made from it.
pub(crate) struct PreparedShared {
    pub(crate) agent: Arc<AgentInner>,
    pub(crate) raw: sys::nixl_capi_xfer_dlist_handle_t,
    pub(crate) lens: Vec<usize>,
    /// Held so that the list's memory stays registered while the handle exists.
    _keep: Vec<Hold>,
}

// SAFETY: the handle is only read by NIXL calls made through the agent's locking.
unsafe impl Send for PreparedShared {}
// SAFETY: as above.
unsafe impl Sync for PreparedShared {}

impl PreparedShared {
    /// Number of descriptors in the prepared list.
    pub(crate) fn len(&self) -> usize {
        self.lens.len()
    }
}

impl Drop for PreparedShared {
    fn drop(&mut self) {
        // SAFETY: live agent and handle, released once; no request uses it any more.
        let status = self
            .agent
            .with(|agent| unsafe { capi().nixl_capi_release_xfer_dlist_handle(agent, self.raw) });
        if let Err(err) = check(status, "release prepared list") {
            self.agent.leaks.failed_release();
            tracing::error!(agent = %self.agent.name, %err, "prepared list not released cleanly");
        }
    }
}

impl Agent {
    /// Prepares `list` for `agent_name` (empty: this agent as the initiator).
    pub(crate) fn prepare(
        &self,
        agent_name: &str,
        list: &XferDlist,
        backends: &[&Backend],
        keep: Vec<Hold>,
    ) -> Result<Arc<PreparedShared>> {
        const OP: &str = "prepare descriptor list";
        if list.descs().is_empty() {
            return Err(Error::EmptyDescList { operation: OP });
        }
        // An empty name stands for this agent as the initiator.
        let name = std::ffi::CString::new(agent_name).map_err(|_| Error::InvalidName {
            what: "remote agent name",
            value: agent_name.to_string(),
            reason: "it contains a NUL byte",
        })?;
        let args = (!backends.is_empty())
            .then(|| backend_args(&self.inner, OP, backends))
            .transpose()?;
        let mut raw = ptr::null_mut();
        let status = self.inner.with(|agent| {
            // SAFETY: live agent, list and args; valid C string; out-pointer to a local.
            unsafe {
                capi().nixl_capi_prep_xfer_dlist(
                    agent,
                    name.as_ptr(),
                    list.raw(),
                    &mut raw,
                    OptArgs::ptr(args.as_ref()),
                )
            }
        });
        check(status, OP).map_err(|err| self.explain_request_failure(err, agent_name))?;
        Ok(Arc::new(PreparedShared {
            agent: self.inner.clone(),
            raw,
            lens: list.descs().iter().map(|d| d.len).collect(),
            _keep: keep,
        }))
    }
}

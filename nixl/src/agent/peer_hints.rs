//! What probably went wrong with a remote agent: the hints added to NIXL's failures.

use std::ptr;

use nixl_capi_sys as sys;

use crate::agent::{Agent, AgentInner};
use crate::error::{check, Error, Result, HINT_LOAD_REMOTE_MD};
use crate::ffi::library::capi;
use crate::ffi::raw::c_name;
use crate::ffi::status::Status;

/// Whether `agent` has `remote_agent`'s metadata loaded and, given a C descriptor list
/// (`list` not null), whether it covers all of it.
pub(crate) fn remote_metadata_loaded(
    agent: &AgentInner,
    remote_agent: &str,
    list: sys::nixl_capi_xfer_dlist_t,
) -> Result<bool> {
    let name = c_name("remote agent name", remote_agent)?;
    // SAFETY: live agent; valid C string; list null or live (the caller's).
    let status =
        agent.with(|agent| unsafe { capi().nixl_capi_check_remote_md(agent, name.as_ptr(), list) });
    match check(status, "check remote metadata") {
        Ok(()) => Ok(true),
        Err(err) if err.status() == Some(Status::NotFound) => Ok(false),
        Err(err) => Err(err),
    }
}

impl Agent {
    /// Adds a hint to a NIXL failure that has none: load the metadata first when
    /// `remote_agent` is another agent whose metadata is not loaded, else `otherwise`.
    pub(crate) fn hint_for_peer(
        &self,
        err: Error,
        remote_agent: &str,
        otherwise: Option<&'static str>,
    ) -> Error {
        let Error::Nixl {
            operation,
            status,
            hint: None,
        } = err
        else {
            return err;
        };
        // Only a definite "not loaded" earns the hint; a failed check adds nothing.
        let missing = remote_agent != self.inner.name
            && matches!(
                remote_metadata_loaded(&self.inner, remote_agent, ptr::null_mut()),
                Ok(false)
            );
        let hint = if missing {
            Some(HINT_LOAD_REMOTE_MD)
        } else {
            otherwise
        };
        Error::Nixl {
            operation,
            status,
            hint,
        }
    }

    /// Adds the most likely fix to a failed request creation.
    pub(crate) fn explain_request_failure(&self, err: Error, remote_agent: &str) -> Error {
        const HINT_REGISTRATIONS: &str = "check that every descriptor lies inside memory registered on both sides, with a backend both sides share";
        self.hint_for_peer(err, remote_agent, Some(HINT_REGISTRATIONS))
    }
}

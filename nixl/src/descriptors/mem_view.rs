//! Memory views: handles NIXL prepares for device-initiated transfers (GPU kernels using
//! NIXL's device API). Host code only prepares, passes on and releases them.

use std::ffi::CString;
use std::ptr;
use std::sync::Arc;

use nixl_capi_sys as sys;

use crate::agent::backend::backend_args;
use crate::agent::backend::Backend;
use crate::agent::{Agent, AgentInner};
use crate::descriptors::desc_list::LocalDescList;
use crate::error::{check, Error, Result};
use crate::ffi::descriptor::{validate, XferDesc};
use crate::ffi::handles::PeerDlist;
use crate::ffi::library::capi;
use crate::ffi::mem_type::MemType;
use crate::ffi::raw::c_name;
use crate::peers::local_peers::{self, Hold};
use crate::peers::recheck;

/// A descriptor of another agent's memory, naming that agent (a view can span peers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerDesc {
    /// The memory range on the peer.
    pub desc: XferDesc,
    /// The agent that owns it.
    pub agent: String,
}

/// A prepared memory view. It holds the registrations of local memory it covers and is
/// released when dropped.
pub struct MemView {
    agent: Arc<AgentInner>,
    raw: sys::nixl_capi_mem_view_t,
    _keep: Vec<Hold>,
}

// SAFETY: the handle is only passed to NIXL calls made through the agent's locking.
unsafe impl Send for MemView {}
// SAFETY: as above; shared access never uses the handle.
unsafe impl Sync for MemView {}

impl std::fmt::Debug for MemView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemView")
            .field("agent", &self.agent.name)
            .finish_non_exhaustive()
    }
}

impl MemView {
    /// The opaque handle, to hand to device code through NIXL's device API. It stays valid
    /// while this view lives.
    pub fn as_raw(&self) -> *mut std::ffi::c_void {
        self.raw.cast()
    }
}

impl Drop for MemView {
    fn drop(&mut self) {
        // SAFETY: prepared by this agent, released once.
        let status = self
            .agent
            .with(|agent| unsafe { capi().nixl_capi_release_mem_view(agent, self.raw) });
        if let Err(err) = check(status, "release memory view") {
            self.agent.leaks.failed_release();
            tracing::error!(agent = %self.agent.name, %err, "memory view not released cleanly");
        }
    }
}

impl PeerDlist {
    fn build(operation: &'static str, mem_type: MemType, descs: &[PeerDesc]) -> Result<Self> {
        // SAFETY: NIXL stores a new handle through the out-pointer.
        let list = PeerDlist::create(operation, |out| unsafe {
            capi().nixl_capi_create_remote_dlist(mem_type.to_raw(), out)
        })?;
        for (index, peer) in descs.iter().enumerate() {
            validate(operation, mem_type, index, peer.desc.addr, peer.desc.len)?;
            let name: CString = c_name("remote agent name", &peer.agent)?;
            // SAFETY: live list, valid C string; NIXL copies both.
            let status = unsafe {
                capi().nixl_capi_remote_dlist_add_desc(
                    list.raw(),
                    peer.desc.addr,
                    peer.desc.len,
                    peer.desc.dev_id,
                    name.as_ptr(),
                )
            };
            check(status, operation)?;
        }
        Ok(list)
    }
}

impl Agent {
    /// Prepares a view of local registered memory for device-initiated transfers.
    ///
    /// # Errors
    /// [`Error::EmptyDescList`]; [`Error::Nixl`] when no backend supports memory views
    /// (UCX needs a GPU build with device API support for them).
    pub fn prepare_local_mem_view(
        &self,
        list: &LocalDescList,
        backends: &[&Backend],
    ) -> Result<MemView> {
        const OP: &str = "prepare local memory view";
        if list.is_empty() {
            return Err(Error::EmptyDescList { operation: OP });
        }
        list.check_owner(OP, &self.inner)?;
        let args = backend_args(&self.inner, OP, backends)?;
        let mut raw = ptr::null_mut();
        // SAFETY: live agent, list and args; out-pointer to a local.
        let status = self.inner.with(|agent| unsafe {
            capi().nixl_capi_prep_mem_view_local(agent, list.list.raw(), &mut raw, args.raw())
        });
        check(status, OP)?;
        Ok(MemView {
            agent: self.inner.clone(),
            raw,
            _keep: list.holds(),
        })
    }

    /// Prepares a view of peers' memory (each descriptor names its agent, whose metadata
    /// must be loaded) for device-initiated transfers.
    pub fn prepare_remote_mem_view(
        &self,
        mem_type: MemType,
        descs: &[PeerDesc],
        backends: &[&Backend],
    ) -> Result<MemView> {
        const OP: &str = "prepare remote memory view";
        if descs.is_empty() {
            return Err(Error::EmptyDescList { operation: OP });
        }
        let list = PeerDlist::build(OP, mem_type, descs)?;
        let mut keep = Vec::new();
        for peer in descs {
            recheck::recheck(&self.inner.loaded, &peer.agent)?;
            keep.extend(local_peers::hold_targets(
                OP,
                &self.inner.loaded,
                &peer.agent,
                mem_type,
                std::slice::from_ref(&peer.desc),
            )?);
        }
        let args = backend_args(&self.inner, OP, backends)?;
        let mut raw = ptr::null_mut();
        // SAFETY: live agent, list and args; out-pointer to a local.
        let status = self.inner.with(|agent| unsafe {
            capi().nixl_capi_prep_mem_view_remote(agent, list.raw(), &mut raw, args.raw())
        });
        check(status, OP)?;
        Ok(MemView {
            agent: self.inner.clone(),
            raw,
            _keep: keep,
        })
    }
}

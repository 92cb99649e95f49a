//! A C descriptor list together with a Rust copy of its descriptors.

use nixl_capi_sys as sys;

use crate::error::{check, Result};
use crate::ffi::descriptor::{validate, XferDesc};
use crate::ffi::handles::XferDlistHandle;
use crate::ffi::library::capi;
use crate::ffi::mem_type::MemType;

/// A C descriptor list with a Rust copy of its descriptors.
pub(crate) struct XferDlist {
    handle: XferDlistHandle,
    mem_type: MemType,
    descs: Vec<XferDesc>,
}

impl XferDlist {
    pub(crate) fn new(mem_type: MemType, capacity: usize) -> Result<Self> {
        Self::with_descs(mem_type, capacity, Vec::with_capacity(capacity))
    }

    /// A C list with room for `capacity` descriptors, and `descs` as the Rust copy.
    fn with_descs(mem_type: MemType, capacity: usize, descs: Vec<XferDesc>) -> Result<Self> {
        // SAFETY: NIXL stores a new handle through the out-pointer.
        let handle = XferDlistHandle::create("create descriptor list", |out| unsafe {
            capi().nixl_capi_create_xfer_dlist(mem_type.to_raw(), out)
        })?;
        let list = XferDlist {
            handle,
            mem_type,
            descs,
        };
        if capacity > 0 {
            // Growing then clearing leaves NIXL's vector with room for `capacity`
            // descriptors, so the adds that follow never reallocate.
            // SAFETY: live list.
            check(
                unsafe { capi().nixl_capi_xfer_dlist_resize(list.raw(), capacity) },
                "reserve descriptor list",
            )?;
            // SAFETY: live list.
            check(
                unsafe { capi().nixl_capi_xfer_dlist_clear(list.raw()) },
                "reserve descriptor list",
            )?;
        }
        Ok(list)
    }

    /// A list holding `descs`, which becomes the Rust copy without being copied again.
    pub(crate) fn from_vec(
        mem_type: MemType,
        operation: &'static str,
        descs: Vec<XferDesc>,
    ) -> Result<Self> {
        let mut list = XferDlist::with_descs(mem_type, descs.len(), Vec::new())?;
        for (index, desc) in descs.iter().enumerate() {
            list.add(operation, index, desc)?;
        }
        list.descs = descs;
        Ok(list)
    }

    pub(crate) fn push(&mut self, operation: &'static str, desc: XferDesc) -> Result<()> {
        self.add(operation, self.descs.len(), &desc)?;
        self.descs.push(desc);
        Ok(())
    }

    /// Checks `desc` (the list's descriptor number `index`) and appends it to the C list.
    fn add(&self, operation: &'static str, index: usize, desc: &XferDesc) -> Result<()> {
        validate(operation, self.mem_type, index, desc.addr, desc.len)?;
        // SAFETY: live list; NIXL copies the descriptor.
        let status = unsafe {
            capi().nixl_capi_xfer_dlist_add_desc(self.raw(), desc.addr, desc.len, desc.dev_id)
        };
        check(status, operation)
    }

    pub(crate) fn clear(&mut self) -> Result<()> {
        // SAFETY: live list.
        check(
            unsafe { capi().nixl_capi_xfer_dlist_clear(self.raw()) },
            "clear descriptor list",
        )?;
        self.descs.clear();
        Ok(())
    }

    pub(crate) fn raw(&self) -> sys::nixl_capi_xfer_dlist_t {
        self.handle.raw()
    }

    pub(crate) fn descs(&self) -> &[XferDesc] {
        &self.descs
    }

    pub(crate) fn mem_type(&self) -> MemType {
        self.mem_type
    }
}

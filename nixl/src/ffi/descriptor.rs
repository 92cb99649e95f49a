//! Descriptors: one contiguous range of memory each.

use crate::error::{check, Error, Result};
use crate::ffi::handles::RegDlist;
use crate::ffi::library::capi;
use crate::ffi::mem_type::MemType;

/// A range to register: address (or offset), length, device id and backend metadata.
///
/// What `addr` and `dev_id` mean depends on the [`MemType`]: for DRAM a virtual address and
/// 0, for VRAM a device address and the GPU index, for FILE an offset and the file descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RegDesc {
    /// Start address, or offset for FILE/BLOCK/OBJECT.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Device index, file descriptor, or object id.
    pub dev_id: u64,
    /// Backend-specific bytes (e.g. an object key); empty for DRAM.
    pub metadata: Vec<u8>,
}

/// A range to transfer: address (or offset), length and device id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct XferDesc {
    /// Start address, or offset for FILE/BLOCK/OBJECT.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Device index, file descriptor, or object id.
    pub dev_id: u64,
}

impl XferDesc {
    /// A descriptor over `len` bytes at `addr` on device `dev_id`.
    pub fn new(addr: usize, len: usize, dev_id: u64) -> Self {
        XferDesc { addr, len, dev_id }
    }
}

/// Rejects a descriptor of length zero, a null DRAM/VRAM address, or one whose end lies
/// past the end of the address space.
pub(crate) fn validate(
    operation: &'static str,
    mem_type: MemType,
    index: usize,
    addr: usize,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Err(Error::ZeroLength { operation, index });
    }
    if addr == 0 && matches!(mem_type, MemType::Dram | MemType::Vram) {
        return Err(Error::NullAddress { operation, index });
    }
    if addr.checked_add(len).is_none() {
        return Err(Error::InvalidArgument {
            operation,
            reason: format!(
                "descriptor {index} ({addr:#x}, {len} bytes) ends past the end of the address space"
            ),
        });
    }
    Ok(())
}

impl RegDlist {
    /// Builds a C registration list from descriptors, checking each one.
    pub(crate) fn build(
        operation: &'static str,
        mem_type: MemType,
        descs: &[RegDesc],
    ) -> Result<Self> {
        // SAFETY: NIXL stores a new handle through the out-pointer.
        let list = RegDlist::create("create registration list", |out| unsafe {
            capi().nixl_capi_create_reg_dlist(mem_type.to_raw(), out)
        })?;
        for (index, d) in descs.iter().enumerate() {
            validate(operation, mem_type, index, d.addr, d.len)?;
            // SAFETY: live list; NIXL copies the descriptor and its metadata bytes.
            let status = unsafe {
                capi().nixl_capi_reg_dlist_add_desc(
                    list.raw(),
                    d.addr,
                    d.len,
                    d.dev_id,
                    d.metadata.as_ptr().cast(),
                    d.metadata.len(),
                )
            };
            check(status, "add registration descriptor")?;
        }
        Ok(list)
    }
}

/// Checks that two sides pair up: same count, same length pairwise.
pub(crate) fn check_pairing(
    operation: &'static str,
    local: impl ExactSizeIterator<Item = usize>,
    remote: impl ExactSizeIterator<Item = usize>,
) -> Result<()> {
    if local.len() == 0 {
        return Err(Error::EmptyDescList { operation });
    }
    if local.len() != remote.len() {
        return Err(Error::LengthMismatch {
            operation,
            what: "descriptor count".to_string(),
            local: local.len(),
            remote: remote.len(),
        });
    }
    for (index, (l, r)) in local.zip(remote).enumerate() {
        if l != r {
            return Err(Error::LengthMismatch {
                operation,
                what: format!("length of descriptor {index}"),
                local: l,
                remote: r,
            });
        }
    }
    Ok(())
}

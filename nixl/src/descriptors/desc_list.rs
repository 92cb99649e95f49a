//! Transfer descriptor lists: local ones built from registrations, remote ones from addresses.

use std::sync::Arc;

use crate::agent::AgentInner;
use crate::descriptors::reuse::Reuse;
use crate::descriptors::xfer_dlist::XferDlist;
use crate::error::{Error, Result};
use crate::ffi::descriptor::XferDesc;
use crate::ffi::mem_type::MemType;
use crate::memory::registration::{RegInner, Registration};
use crate::peers::local_peers::{self, Hold};
use crate::peers::recheck;
use crate::peers::wire::LoadedMetadata;

/// The accessors both list types share, reading the `list: XferDlist` field.
macro_rules! list_accessors {
    () => {
        /// Removes every descriptor (a local list keeps holding its registrations until it
        /// is dropped).
        pub fn clear(&mut self) -> Result<()> {
            self.reuse.reset();
            self.list.clear()
        }

        /// The descriptors, in order.
        pub fn descs(&self) -> &[XferDesc] {
            self.list.descs()
        }

        /// Number of descriptors.
        pub fn len(&self) -> usize {
            self.list.descs().len()
        }

        /// Whether the list has no descriptors.
        pub fn is_empty(&self) -> bool {
            self.list.descs().is_empty()
        }

        /// The memory type of the list.
        pub fn mem_type(&self) -> MemType {
            self.list.mem_type()
        }
    };
}

/// Descriptors of this agent's own registered memory, for the local side of a transfer.
///
/// Every descriptor comes from a [`Registration`] and is bounds-checked against it; the
/// list holds those registrations, so their memory stays registered while the list (or a
/// request made from it) exists.
pub struct LocalDescList {
    pub(crate) list: XferDlist,
    pub(crate) keep: Vec<Arc<RegInner>>,
    pub(crate) reuse: Reuse,
}

impl std::fmt::Debug for LocalDescList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalDescList")
            .field("mem_type", &self.list.mem_type())
            .field("descs", &self.list.descs().len())
            .finish()
    }
}

impl LocalDescList {
    /// An empty list of `mem_type` descriptors.
    pub fn new(mem_type: MemType) -> Result<Self> {
        Self::with_capacity(mem_type, 0)
    }

    /// An empty list with room for `capacity` descriptors.
    pub fn with_capacity(mem_type: MemType, capacity: usize) -> Result<Self> {
        Ok(LocalDescList {
            list: XferDlist::new(mem_type, capacity)?,
            keep: Vec::new(),
            reuse: Reuse::default(),
        })
    }

    /// Adds `len` bytes at `offset` of region `region` of `reg`.
    ///
    /// # Errors
    /// [`Error::MemTypeMismatch`] if `reg` is not of the list's memory type,
    /// [`Error::OutOfBounds`] / [`Error::IndexOutOfRange`] for a range outside `reg`,
    /// [`Error::ZeroLength`] for `len == 0`.
    pub fn push(
        &mut self,
        reg: &Registration,
        region: usize,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "add local descriptor";
        self.reuse.reset();
        self.hold(OP, reg)?;
        let addr = reg.locate(OP, region, offset, len)?;
        let dev_id = reg.inner.regions[region].dev_id;
        self.list.push(OP, XferDesc { addr, len, dev_id })
    }

    /// Adds the whole of region `region` of `reg`.
    pub fn push_region(&mut self, reg: &Registration, region: usize) -> Result<()> {
        let len = reg.regions().get(region).map_or(0, |d| d.len);
        self.push(reg, region, 0, len)
    }

    /// Adds one descriptor of `block_len` bytes per block index, blocks laid out back to back
    /// in region `region` of `reg` (a KV cache's layout).
    pub fn push_blocks(
        &mut self,
        reg: &Registration,
        region: usize,
        block_len: usize,
        blocks: impl IntoIterator<Item = usize>,
    ) -> Result<()> {
        for block in blocks {
            let offset = block
                .checked_mul(block_len)
                .ok_or_else(|| Error::OutOfBounds {
                    operation: "add local descriptor",
                    region,
                    offset: usize::MAX,
                    len: block_len,
                    region_len: reg.regions().get(region).map_or(0, |d| d.len),
                })?;
            self.push(reg, region, offset, block_len)?;
        }
        Ok(())
    }

    list_accessors!();

    /// Holds on every registration of the list, for a request or prepared list made from it.
    pub(crate) fn holds(&self) -> Vec<Hold> {
        self.keep.iter().map(|reg| reg.clone() as Hold).collect()
    }

    /// Checks that every registration in the list belongs to `agent`: NIXL would resolve
    /// the addresses against `agent`'s own registrations, which the list does not hold.
    pub(crate) fn check_owner(
        &self,
        operation: &'static str,
        agent: &Arc<AgentInner>,
    ) -> Result<()> {
        match self.keep.iter().find(|reg| !Arc::ptr_eq(&reg.agent, agent)) {
            None => Ok(()),
            Some(foreign) => Err(Error::InvalidArgument {
                operation,
                reason: format!(
                    "the local list holds memory registered on agent {:?}, not {:?}; register \
                     it on the agent that makes the request",
                    foreign.agent.name, agent.name
                ),
            }),
        }
    }

    fn hold(&mut self, operation: &'static str, reg: &Registration) -> Result<()> {
        if reg.mem_type() != self.list.mem_type() {
            return Err(Error::MemTypeMismatch {
                operation,
                expected: self.list.mem_type(),
                found: reg.mem_type(),
            });
        }
        if !self
            .keep
            .iter()
            .rev()
            .any(|held| Arc::ptr_eq(held, &reg.inner))
        {
            self.keep.push(reg.inner.clone());
        }
        Ok(())
    }
}

/// Descriptors of a remote agent's memory (or of a file this agent registered), for the
/// remote side of a transfer. NIXL checks them against the remote agent's metadata.
pub struct RemoteDescList {
    pub(crate) list: XferDlist,
    pub(crate) reuse: Reuse,
}

impl std::fmt::Debug for RemoteDescList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteDescList")
            .field("mem_type", &self.list.mem_type())
            .field("descs", &self.list.descs().len())
            .finish()
    }
}

impl RemoteDescList {
    /// An empty list of `mem_type` descriptors.
    pub fn new(mem_type: MemType) -> Result<Self> {
        Ok(RemoteDescList {
            list: XferDlist::new(mem_type, 0)?,
            reuse: Reuse::default(),
        })
    }

    /// A list holding `descs`.
    pub fn from_descs(mem_type: MemType, descs: &[XferDesc]) -> Result<Self> {
        Self::from_vec(mem_type, descs.to_vec())
    }

    /// A list holding `descs`, taking the vector over instead of copying it.
    pub fn from_vec(mem_type: MemType, descs: Vec<XferDesc>) -> Result<Self> {
        Ok(RemoteDescList {
            list: XferDlist::from_vec(mem_type, "add remote descriptor", descs)?,
            reuse: Reuse::default(),
        })
    }

    /// Adds one descriptor.
    pub fn push(&mut self, desc: XferDesc) -> Result<()> {
        self.reuse.reset();
        self.list.push("add remote descriptor", desc)
    }

    /// What a transfer to or from these descriptors of `remote_agent`'s memory must hold
    /// ([`local_peers::hold_targets`]): the live registrations that cover them when the agent
    /// lives in this process; none, once each lies in what its `loaded` metadata advertises,
    /// when it lives in another.
    pub(crate) fn hold_targets(
        &self,
        operation: &'static str,
        loaded: &LoadedMetadata,
        remote_agent: &str,
    ) -> Result<Vec<Hold>> {
        recheck::recheck(loaded, remote_agent)?;
        local_peers::hold_targets(
            operation,
            loaded,
            remote_agent,
            self.mem_type(),
            self.descs(),
        )
    }

    list_accessors!();
}

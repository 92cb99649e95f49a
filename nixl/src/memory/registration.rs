//! Memory registration: `register_memory(descs, backends)` and the guard that deregisters.

use std::sync::Arc;

use crate::agent::backend::backend_args;
use crate::agent::backend::Backend;
use crate::agent::{Agent, AgentInner};
use crate::error::{check, Error, Result};
use crate::ffi::descriptor::RegDesc;
use crate::ffi::handles::{OptArgs, RegDlist};
use crate::ffi::library::capi;
use crate::ffi::mem_type::MemType;
use crate::memory::atomic_copy::{self, Region};
use crate::memory::registrable::RegisterMemory;
use crate::peers::local_peers::{self, Target};

/// Registered memory. Deregisters (with the same backends) when the last user is gone.
///
/// It keeps the memory alive: owned memory (`Vec<u8>`, [`crate::HostBuffer`], ...) lives in
/// the registration, borrowed memory (`&'m mut [u8]`) stays borrowed for `'m`. Descriptor
/// lists, prepared lists and transfer requests built from it hold it too, so memory is never
/// deregistered or freed under a transfer.
///
/// Remote agents that loaded this agent's metadata can write into registered memory at any
/// time; read and write it through [`read`](Self::read) and [`write`](Self::write), which copy.
pub struct Registration {
    pub(crate) inner: Arc<RegInner>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("agent", &self.inner.agent.name)
            .field("mem_type", &self.inner.mem_type)
            .field("regions", &self.inner.regions.len())
            .field(
                "backends",
                &self
                    .inner
                    .backends
                    .iter()
                    .map(Backend::plugin)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

pub(crate) struct RegInner {
    pub(crate) agent: Arc<AgentInner>,
    pub(crate) mem_type: MemType,
    pub(crate) regions: Vec<RegDesc>,
    backends: Vec<Backend>,
    dlist: RegDlist,
    opts: OptArgs,
    registered: bool,
    memory: Option<Box<dyn Send + Sync>>,
}

// SAFETY: the C handles inside are used only under the agent's locking rules, and the
// memory box is Send + Sync.
unsafe impl Send for RegInner {}
// SAFETY: as above; shared access never mutates the C handles.
unsafe impl Sync for RegInner {}

impl RegInner {
    fn deregister_now(&mut self) -> Result<()> {
        if !self.registered {
            return Ok(());
        }
        let status = self
            .agent
            // SAFETY: live agent, list and options; the list was registered with these options.
            .with(|agent| unsafe {
                capi().nixl_capi_deregister_mem(agent, self.dlist.raw(), self.opts.raw())
            });
        check(status, "deregister memory")?;
        self.registered = false;
        tracing::debug!(agent = %self.agent.name, regions = self.regions.len(), "deregistered memory");
        Ok(())
    }
}

impl Target for RegInner {
    fn mem_type(&self) -> MemType {
        self.mem_type
    }

    fn regions(&self) -> &[RegDesc] {
        &self.regions
    }
}

impl Drop for RegInner {
    fn drop(&mut self) {
        if let Err(err) = self.deregister_now() {
            // NIXL may still let peers reach this memory: keep it allocated rather than free it.
            tracing::error!(agent = %self.agent.name, %err, "deregistration failed; leaking the memory to stay safe");
            self.agent.leaks.registration();
            std::mem::forget(self.memory.take());
        }
    }
}

impl Registration {
    /// The memory type of every region.
    pub fn mem_type(&self) -> MemType {
        self.inner.mem_type
    }

    /// The registered regions, in order.
    pub fn regions(&self) -> &[RegDesc] {
        &self.inner.regions
    }

    /// The backends it was registered with (empty: every capable backend).
    pub fn backends(&self) -> &[Backend] {
        &self.inner.backends
    }

    /// Checks that `offset..offset+len` lies inside region `region` and returns its address.
    pub(crate) fn locate(
        &self,
        operation: &'static str,
        region: usize,
        offset: usize,
        len: usize,
    ) -> Result<usize> {
        let desc = self
            .inner
            .regions
            .get(region)
            .ok_or_else(|| Error::IndexOutOfRange {
                operation,
                index: region,
                len: self.inner.regions.len(),
                items: "regions of the registration",
            })?;
        match offset.checked_add(len) {
            Some(end) if end <= desc.len => Ok(desc.addr + offset),
            _ => Err(Error::OutOfBounds {
                operation,
                region,
                offset,
                len,
                region_len: desc.len,
            }),
        }
    }

    fn host_ptr(
        &self,
        operation: &'static str,
        region: usize,
        offset: usize,
        len: usize,
    ) -> Result<*mut u8> {
        if self.inner.mem_type != MemType::Dram {
            return Err(Error::MemTypeMismatch {
                operation,
                expected: MemType::Dram,
                found: self.inner.mem_type,
            });
        }
        Ok(self.locate(operation, region, offset, len)? as *mut u8)
    }

    /// DRAM region `region`, once `offset..offset + len` was checked to lie inside it.
    fn host_region(
        &self,
        operation: &'static str,
        region: usize,
        offset: usize,
        len: usize,
    ) -> Result<Region> {
        self.host_ptr(operation, region, offset, len)?;
        let desc = &self.inner.regions[region];
        // SAFETY: a live DRAM region the registration keeps alive (and writable: the
        // registration owns the memory); no Rust reference to it exists (the registration
        // never lends it, but through the `unsafe` `region_slice`), so every other access is
        // a copy of this module over the same region, or NIXL's own.
        Ok(unsafe { Region::new(desc.addr as *mut u8, desc.len) })
    }

    /// Copies bytes out of DRAM region `region`, starting at `offset`, into `out`.
    ///
    /// Safe while transfers or peers write the same bytes: the copy is made of relaxed
    /// atomic loads, so a racing write can leave `out` torn (each byte old or new), never
    /// undefined. Each byte of a region is always accessed with the same atomic size (the
    /// region's aligned 8-byte words as words, the bytes at its unaligned ends one by one),
    /// so copies at different offsets racing each other are torn too, never undefined. Read
    /// after the transfer that fills the bytes has finished (or after its notification) to
    /// see all of it.
    pub fn read(&self, region: usize, offset: usize, out: &mut [u8]) -> Result<()> {
        let at = self.host_region("read registered memory", region, offset, out.len())?;
        // SAFETY: `offset..offset + out.len()` was checked to lie inside the region.
        unsafe { atomic_copy::copy_out(&at, offset, out) };
        Ok(())
    }

    /// Copies `data` into DRAM region `region`, starting at `offset`.
    ///
    /// Safe while other threads read or write the same bytes (relaxed atomic stores, and
    /// compare-exchange for part of a word, as in [`read`](Self::read)); what a transfer
    /// racing with the write moves may be torn.
    pub fn write(&self, region: usize, offset: usize, data: &[u8]) -> Result<()> {
        let at = self.host_region("write registered memory", region, offset, data.len())?;
        // SAFETY: `offset..offset + data.len()` was checked to lie inside the region.
        unsafe { atomic_copy::copy_in(&at, offset, data) };
        Ok(())
    }

    /// Borrows DRAM region `region` as a slice.
    ///
    /// # Safety
    /// No transfer may write into the region while the slice lives: no local READ in flight
    /// into it, and no remote agent writing to it.
    pub unsafe fn region_slice(&self, region: usize) -> Result<&[u8]> {
        let len = self.inner.regions.get(region).map_or(0, |d| d.len);
        let ptr = self.host_ptr("borrow registered memory", region, 0, len)?;
        // SAFETY: live DRAM region of `len` bytes; the caller rules out concurrent writes.
        Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
    }

    /// Deregisters now and reports the outcome.
    ///
    /// Consumes the registration, so it cannot be deregistered twice: a second call does
    /// not compile.
    ///
    /// ```compile_fail,E0382
    /// # fn main() -> nixl::Result<()> {
    /// let agent = nixl::Agent::new("doc-deregister-twice")?;
    /// let registration = agent.register_memory(vec![0u8; 64], &[])?;
    /// registration.deregister()?;
    /// registration.deregister()?; // error[E0382]: use of moved value
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`Error::RegistrationInUse`] while descriptor lists or requests still hold it (it is
    /// then deregistered when the last of them is dropped); [`Error::Nixl`] if NIXL fails.
    pub fn deregister(self) -> Result<()> {
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => inner.deregister_now(),
            Err(shared) => Err(Error::RegistrationInUse {
                users: Arc::strong_count(&shared) - 1,
            }),
        }
    }
}

impl Agent {
    /// Registers `memory` with `backends` (empty: every backend that supports its memory
    /// type, as NIXL does) in one call, and returns the registration that owns it.
    ///
    /// The memory must be `'static`: a request can be leaked (`mem::forget`,
    /// [`XferRequest::abandon`](crate::XferRequest::abandon)) while NIXL still writes into
    /// its memory, so no borrow may end under it. Borrowing a local buffer therefore does
    /// not compile:
    ///
    /// ```compile_fail,E0597
    /// use nixl::{Agent, LocalDescList, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};
    /// # fn main() -> nixl::Result<()> {
    /// # let peer = Agent::new("doc-borrow-peer")?;
    /// # peer.create_backend("UCX")?;
    /// # let theirs = peer.register_memory(vec![1u8; 4096], &[])?;
    /// let agent = Agent::new("doc-borrow")?;
    /// let ucx = agent.create_backend("UCX")?;
    /// let mut buf = vec![0u8; 4096];
    /// let reg = agent.register_memory(&mut buf[..], &[&ucx])?; // error[E0597]
    /// # agent.load_remote_metadata(&peer.local_metadata()?)?;
    /// let mut local = LocalDescList::new(MemType::Dram)?;
    /// local.push_region(&reg, 0)?;
    /// let remote = RemoteDescList::from_descs(
    ///     MemType::Dram,
    ///     &[XferDesc::new(theirs.regions()[0].addr, 4096, 0)],
    /// )?;
    /// let mut request =
    ///     agent.create_xfer_req(XferOp::Read, &local, &remote, "doc-borrow-peer", &XferOptions::new())?;
    /// request.post()?;
    /// request.abandon(); // NIXL may still write into `buf`...
    /// drop(buf); // ...which would be freed here
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Memory that is not `'static` can only be registered with the `unsafe`
    /// [`register_raw`](Self::register_raw).
    ///
    /// # Errors
    /// [`Error::EmptyDescList`], [`Error::ZeroLength`], [`Error::NullAddress`] for bad regions,
    /// [`Error::InvalidArgument`] for a backend of another agent, [`Error::NoCudaDevice`] for
    /// VRAM without a GPU, and [`Error::Nixl`] when NIXL or a backend refuses.
    pub fn register_memory<M>(&self, memory: M, backends: &[&Backend]) -> Result<Registration>
    where
        M: RegisterMemory + 'static,
    {
        // Own the memory first, then take its addresses from the exclusive borrow of it.
        let mut memory = Box::new(memory);
        let mem_type = memory.mem_type();
        let regions = memory.regions();
        // SAFETY: `RegisterMemory` guarantees the regions stay valid while `memory` lives,
        // and the registration owns `memory` (never moving it out of its box) until after it
        // deregisters; if deregistration fails, or the registration is leaked, it is never
        // freed. `'static` means no borrow can end while NIXL may still use the memory.
        unsafe { self.register(mem_type, regions, backends, Some(memory)) }
    }

    /// Registers raw descriptors with `backends` (empty: every capable backend).
    ///
    /// # Safety
    /// Every descriptor must describe memory (or a file range, for FILE) that stays valid for
    /// NIXL to read and write until the returned registration and everything made from it
    /// (descriptor lists, prepared lists, requests) have been dropped. Where regions overlap
    /// (within this registration or with another one), [`Registration::read`] and
    /// [`Registration::write`] must not copy the shared bytes through two of them at once:
    /// each copies a region's bytes with atomics of one size chosen from the region's
    /// bounds, and regions with other bounds may choose another size for the same bytes.
    pub unsafe fn register_raw(
        &self,
        mem_type: MemType,
        descs: &[RegDesc],
        backends: &[&Backend],
    ) -> Result<Registration> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.register(mem_type, descs.to_vec(), backends, None) }
    }

    /// # Safety
    /// The regions stay valid while the returned registration lives (see callers).
    unsafe fn register(
        &self,
        mem_type: MemType,
        regions: Vec<RegDesc>,
        backends: &[&Backend],
        memory: Option<Box<dyn Send + Sync>>,
    ) -> Result<Registration> {
        const OP: &str = "register memory";
        let _span = tracing::debug_span!("register_memory", agent = %self.inner.name, %mem_type, regions = regions.len()).entered();
        if regions.is_empty() {
            return Err(Error::EmptyDescList { operation: OP });
        }
        if mem_type == MemType::Vram {
            crate::memory::cuda::require_device(OP)?;
        }
        let dlist = RegDlist::build(OP, mem_type, &regions)?;
        let opts = backend_args(&self.inner, OP, backends)?;
        // SAFETY: live agent, list and options; the caller keeps the memory valid.
        let status = self
            .inner
            .with(|agent| unsafe { capi().nixl_capi_register_mem(agent, dlist.raw(), opts.raw()) });
        check(status, OP).map_err(|err| {
            tracing::warn!(%err, "registration failed");
            err
        })?;
        tracing::debug!("registered memory");
        let inner = Arc::new(RegInner {
            agent: self.inner.clone(),
            mem_type,
            regions,
            backends: backends.iter().map(|b| (*b).clone()).collect(),
            dlist,
            opts,
            registered: true,
            memory,
        });
        local_peers::track(self.inner.id, inner.clone());
        Ok(Registration { inner })
    }
}

//! Memory that can be registered safely: the [`RegisterMemory`] trait and its implementations.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::ffi::descriptor::RegDesc;
use crate::ffi::mem_type::MemType;

/// Memory a [`crate::Registration`] can own.
///
/// [`crate::Agent::register_memory`] takes the value over (it must be `'static`: owned, or a
/// `&'static mut` borrow), boxes it, and only then asks for its regions, so the addresses it
/// hands NIXL come from an exclusive borrow of memory that nothing else can reach. Borrowed
/// memory with a shorter lifetime can only be registered with the `unsafe`
/// [`crate::Agent::register_raw`]: a request may outlive every borrow once it is leaked
/// (`mem::forget`, [`crate::XferRequest::abandon`]), and NIXL may still write into its memory.
///
/// # Safety
/// Implementors promise that every region [`regions`](Self::regions) describes is valid for
/// NIXL to read and write (for DRAM: allocated, writable, not freed or moved) for as long as
/// the value lives, that moving the value does not move the regions, that the regions do not
/// overlap, and that the addresses are derived from `&mut self` (e.g. `as_mut_ptr`), never
/// from a shared reference.
pub unsafe trait RegisterMemory: Send + Sync {
    /// The memory type of every region.
    fn mem_type(&self) -> MemType;
    /// The regions to register, in order. Called once, after the registration owns `self`.
    fn regions(&mut self) -> Vec<RegDesc>;
}

fn dram(ptr: *mut u8, len: usize) -> RegDesc {
    RegDesc {
        addr: ptr as usize,
        len,
        dev_id: 0,
        metadata: Vec::new(),
    }
}

// SAFETY: a Vec's heap buffer does not move when the Vec moves, and the registration owns it.
unsafe impl RegisterMemory for Vec<u8> {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn regions(&mut self) -> Vec<RegDesc> {
        vec![dram(self.as_mut_ptr(), self.len())]
    }
}

// SAFETY: as for Vec<u8>.
unsafe impl RegisterMemory for Box<[u8]> {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn regions(&mut self) -> Vec<RegDesc> {
        vec![dram(self.as_mut_ptr(), self.len())]
    }
}

// SAFETY: a `'static` exclusive borrow (e.g. from `Box::leak`) is never freed and, held by
// the registration, never aliased.
unsafe impl RegisterMemory for &'static mut [u8] {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn regions(&mut self) -> Vec<RegDesc> {
        vec![dram(self.as_mut_ptr(), self.len())]
    }
}

// SAFETY: each inner buffer is a separate heap allocation owned by the outer Vec.
unsafe impl RegisterMemory for Vec<Vec<u8>> {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn regions(&mut self) -> Vec<RegDesc> {
        self.iter_mut()
            .map(|b| dram(b.as_mut_ptr(), b.len()))
            .collect()
    }
}

// SAFETY: as for Vec<Vec<u8>>.
unsafe impl RegisterMemory for Vec<HostBuffer> {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn regions(&mut self) -> Vec<RegDesc> {
        self.iter().map(|b| dram(b.ptr.as_ptr(), b.len)).collect()
    }
}

// SAFETY: the buffer owns its allocation and never moves it.
unsafe impl RegisterMemory for HostBuffer {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn regions(&mut self) -> Vec<RegDesc> {
        vec![dram(self.ptr.as_ptr(), self.len)]
    }
}

/// Zeroed host memory for transfers, mapped straight from the kernel: page-aligned, and
/// 2 MiB-aligned and advised for transparent huge pages when it is 2 MiB or larger (as
/// NumPy's large arrays are). No page is touched before the advice, so Linux can back the
/// buffer with huge pages from the first fault.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// Start and length of the whole mapping, which may begin before `ptr`.
    map: (NonNull<u8>, usize),
}

// SAFETY: a plain owned mapping with no thread affinity.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only reads through `&[u8]`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    const HUGE_PAGE: usize = 2 << 20;

    /// Maps `len` zeroed bytes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0` or a size that overflows;
    /// [`Error::Io`] when the kernel refuses the mapping.
    pub fn zeroed(len: usize) -> Result<Self> {
        const OP: &str = "allocate host buffer";
        let huge = len >= Self::HUGE_PAGE;
        let slack = if huge { Self::HUGE_PAGE } else { 0 };
        let map_len =
            len.checked_add(slack)
                .filter(|_| len > 0)
                .ok_or_else(|| Error::InvalidArgument {
                    operation: OP,
                    reason: format!("cannot allocate {len} bytes"),
                })?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::Io {
                operation: OP,
                source: std::io::Error::last_os_error(),
            });
        }
        let out_of_memory = || Error::Io {
            operation: OP,
            source: std::io::ErrorKind::OutOfMemory.into(),
        };
        let base = NonNull::new(base.cast::<u8>()).ok_or_else(out_of_memory)?;
        // Computed from the address: `align_offset` may give up and answer `usize::MAX`.
        let misalignment = base.as_ptr() as usize % Self::HUGE_PAGE;
        let offset = if huge && misalignment != 0 {
            Self::HUGE_PAGE - misalignment
        } else {
            0
        };
        // SAFETY: `offset < slack`, so the aligned start and `len` bytes lie inside the mapping.
        let ptr = NonNull::new(unsafe { base.as_ptr().add(offset) }).ok_or_else(out_of_memory)?;
        if huge {
            // SAFETY: advisory call on our own untouched mapping; failure only means no huge pages.
            unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        let map = (base, map_len);
        Ok(HostBuffer { ptr, len, map })
    }

    /// [`zeroed`](Self::zeroed), with every page backed now ([`populate`](Self::populate)):
    /// for memory that will be used whole, such as a KV cache.
    ///
    /// # Errors
    /// Those of [`zeroed`](Self::zeroed) and [`populate`](Self::populate).
    pub fn backed(len: usize) -> Result<Self> {
        let mut buffer = Self::zeroed(len)?;
        buffer.populate()?;
        Ok(buffer)
    }

    /// Backs every page of the buffer with memory now, so that the first transfers into it
    /// do not stop on page faults. The bytes stay zero. Call it before registering a buffer
    /// that will be used whole, such as a KV cache: a fresh mapping is backed page by page
    /// at first touch, and a first READ into it pays each fault inside the transfer.
    ///
    /// # Errors
    /// [`Error::Io`] when the kernel cannot back the buffer (out of memory).
    pub fn populate(&mut self) -> Result<()> {
        // SAFETY: advisory call on our own mapping, exclusively borrowed; it keeps the
        // contents and only faults the pages in.
        let rc = unsafe {
            libc::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) {
            return Err(Error::Io {
                operation: "back a host buffer with memory",
                source: err,
            });
        }
        // A kernel before 5.14 has no MADV_POPULATE_WRITE: write each page's first byte,
        // which is zero already.
        const PAGE: usize = 4096;
        let bytes: &mut [u8] = self;
        for offset in (0..bytes.len()).step_by(PAGE) {
            // SAFETY: `offset < len`, inside the buffer; volatile so the store is kept.
            unsafe { std::ptr::write_volatile(bytes.as_mut_ptr().add(offset), 0) };
        }
        Ok(())
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised (zeroed) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: the whole mapping made in `zeroed`, unmapped once; no reference into it
        // outlives `self`.
        if unsafe { libc::munmap(self.map.0.as_ptr().cast(), self.map.1) } != 0 {
            tracing::error!(err = %std::io::Error::last_os_error(), "munmap of a host buffer failed");
        }
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

/// A byte range of an open file, registered as NIXL FILE memory (POSIX and GDS backends).
///
/// The registration owns the [`File`], so its descriptor stays open while registered.
#[derive(Debug)]
pub struct FileRegion {
    file: File,
    offset: usize,
    len: usize,
}

impl FileRegion {
    /// The `len` bytes of `file` starting at `offset`.
    ///
    /// # Errors
    /// [`Error::ZeroLength`] for `len == 0`.
    pub fn new(file: File, offset: usize, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::ZeroLength {
                operation: "describe file region",
                index: 0,
            });
        }
        Ok(FileRegion { file, offset, len })
    }

    /// The open file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The file descriptor NIXL uses as the descriptors' `dev_id`.
    pub fn fd(&self) -> u64 {
        u64::try_from(self.file.as_raw_fd()).unwrap_or_default()
    }
}

// SAFETY: the file stays open (and the fd valid) while the value lives; NIXL only does
// positioned I/O within the described range.
unsafe impl RegisterMemory for FileRegion {
    fn mem_type(&self) -> MemType {
        MemType::File
    }
    fn regions(&mut self) -> Vec<RegDesc> {
        vec![RegDesc {
            addr: self.offset,
            len: self.len,
            dev_id: self.fd(),
            metadata: Vec::new(),
        }]
    }
}

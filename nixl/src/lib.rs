//! Safe Rust API for NVIDIA's NIXL transfer library.
//!
//! NIXL moves memory (DRAM, VRAM, files, objects) between agents through pluggable backends
//! (UCX, POSIX, GDS, ...). LLM serving stacks use it to move KV-cache blocks between prefill
//! and decode workers. This crate wraps NIXL's C API (`nixl-capi-sys`) so that safe code cannot
//! free or deregister memory under a transfer, use a handle after its agent is gone, or
//! crash on bad input: every failure is an [`Error`].
//!
//! # Quick start
//! Two agents in one process: B registers a buffer, A reads it over UCX, then notifies B.
//! ```
//! use std::time::Duration;
//! use nixl::{Agent, LocalDescList, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};
//!
//! # fn main() -> nixl::Result<()> {
//! let a = Agent::new("quick-a")?;
//! let b = Agent::new("quick-b")?;
//! let ucx_a = a.create_backend("UCX")?;
//! let ucx_b = b.create_backend("UCX")?;
//!
//! // Register memory; each registration owns its buffer and deregisters on drop.
//! let dst = a.register_memory(vec![0u8; 4096], &[&ucx_a])?;
//! let src = b.register_memory(vec![7u8; 4096], &[&ucx_b])?;
//!
//! // Exchange metadata (here in-process; normally over a side channel).
//! let remote = a.load_remote_metadata(&b.local_metadata()?)?;
//! assert_eq!(remote, "quick-b");
//!
//! // READ B's buffer into A's, with a notification for B.
//! let mut local = LocalDescList::new(MemType::Dram)?;
//! local.push_region(&dst, 0)?;
//! let remote_list = RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(src.regions()[0].addr, 4096, 0)])?;
//! let options = XferOptions::new().notification(b"block 0 read".to_vec());
//! let mut request = a.create_xfer_req(XferOp::Read, &local, &remote_list, &remote, &options)?;
//! request.post_and_wait(Duration::from_secs(10))?;
//!
//! let mut bytes = [0u8; 4096];
//! dst.read(0, 0, &mut bytes)?;
//! assert!(bytes.iter().all(|&b| b == 7));
//!
//! // B receives the notification (any bytes).
//! let notes = loop {
//!     let notes = b.notifications()?;
//!     if !notes.is_empty() { break notes; }
//! };
//! assert_eq!(notes["quick-a"], vec![b"block 0 read".to_vec()]);
//! # Ok(())
//! # }
//! ```
//!
//! # Finding NIXL
//! NIXL is loaded at run time, once per process, when the first agent (or any NIXL object)
//! is made: a program that depends on this crate needs no build script and no
//! `LD_LIBRARY_PATH`. `libnixl_capi.so` is looked for, in order, in:
//! 1. `NIXL_LIB_DIR`, the folder holding it;
//! 2. `NIXL_PREFIX`: an install prefix (`lib/x86_64-linux-gnu`, `lib64`, `lib`), a venv root
//!    or a site-packages folder holding the `nixl-cu12` / `nixl-cu13` wheel;
//! 3. the NIXL found when `nixl-capi-sys` was built (its `NIXL_LIB_DIR` / `NIXL_PREFIX`, or
//!    the nixl-rs workspace's vendored wheel);
//! 4. the `nixl-cu12` / `nixl-cu13` wheel in the active venv (`VIRTUAL_ENV`);
//! 5. the same in the active conda environment (`CONDA_PREFIX`);
//! 6. the same in the site-packages of the first `python3` on `PATH` (the folder above its
//!    `bin/`, links not followed; Python is not run): a venv that is only on `PATH`, as
//!    after a Dockerfile's `ENV PATH=/opt/venv/bin:$PATH`;
//! 7. the same in the Python user site (`PYTHONUSERBASE`, else `~/.local`);
//! 8. `/opt/nvidia/nvda_nixl`, NIXL's default source-install prefix;
//! 9. the system loader (`ld.so.cache`, `LD_LIBRARY_PATH`).
//!
//! When `NIXL_LIB_DIR` or `NIXL_PREFIX` is set, only it is searched (one that names no
//! folder says so). The library must be NIXL 1.5.1: its version is read from the
//! installation before anything of it runs. It is
//! opened by its full path, so the wheel's libraries still find each other (and UCX its
//! modules) through their `$ORIGIN` paths, and NIXL loads its backend plugins from
//! `plugins/` beside it (or from `NIXL_PLUGIN_DIR`, which NIXL reads itself; this crate
//! sets no environment variable). When nothing fits, creating the agent returns
//! [`Error::Library`], whose message lists every place looked at and what was there, and
//! says how to install NIXL (`pip install --no-deps nixl-cu12==1.5.1`; the wheel needs none
//! of the packages it lists, torch among them). [`load_library`] loads NIXL up front and
//! says which library it is.
//!
//! # Ownership and safety
//! Everything made from an [`Agent`] holds it (`Arc`), so the agent outlives its backends,
//! registrations, lists and requests. A [`Registration`] owns its memory (`'static` only:
//! `Vec<u8>`, [`HostBuffer`], [`FileRegion`], `&'static mut [u8]`, ...) and is held by every
//! [`LocalDescList`], prepared list and [`XferRequest`] made from it; it deregisters when
//! the last of them is dropped, or explicitly with [`Registration::deregister`], which
//! reports failures (it takes the registration, so deregistering twice does not compile).
//!
//! The model, exactly:
//! - **Leaks are safe.** Memory NIXL may still write is freed only after NIXL reported the
//!   request done. Leaking a request (`mem::forget`, [`XferRequest::abandon`], a leaked
//!   `Arc`) leaks its memory with it; since registered memory is `'static`, no borrow can
//!   end under it. Borrowed memory needs the `unsafe` [`Agent::register_raw`].
//! - **Errors mean "maybe in flight".** A request whose post or status failed is never
//!   considered done: it is leaked, with its memory, when dropped, and
//!   [`Agent::leak_stats`] counts it. A request dropped while still in flight is handed to
//!   the agent's completion driver, which releases it once NIXL reports it done; dropping
//!   never blocks.
//! - **Agents of this process.** When a request's remote agent lives in this process (or is
//!   this agent, e.g. DRAM to its own FILE), each remote descriptor is resolved to a live
//!   registration of it, which the request holds; a descriptor of memory that agent no
//!   longer has registered is refused even if NIXL's copy of its metadata still lists it.
//! - **Metadata never leads into this process under another name.** Agents of this process
//!   are recognised by their UCX worker, never by name alone. Metadata whose worker is one of
//!   this process's loads only under that agent's exact name, and is then held to that
//!   agent's live registrations as above; under any other name
//!   [`Agent::load_remote_metadata`] refuses it with [`Error::MetadataLeadsIntoThisProcess`].
//!   A peer can therefore not make NIXL read or write this process's own memory, not even by
//!   sending back this process's own worker address. Once this process's UCX workers
//!   changed after a load (a new worker can own an address the metadata names), the
//!   metadata is checked again at the next request to its agent, which is refused while it
//!   leads into this process. Under `UCX_UNIFIED_MODE=y` a worker
//!   address carries no lengths and can be neither bounded nor compared, so UCX connection
//!   info is refused ([`Error::InvalidMetadata`]).
//!   A worker is this process's when the metadata names its UUID or any transport address
//!   that reaches this process, compared by what UCX would reach, not byte for byte, against
//!   every live agent's worker:
//!   - cma or POSIX `/proc` access to this pid or to any thread id of this process (by the
//!     `Tgid` in `/proc/<id>/status`, within this process's pid namespace; an id no live
//!     thread has is refused, since a later thread could take it);
//!   - XPMEM, or a live agent's worker's shared-memory FIFO, loopback interface or TCP
//!     listener;
//!   - a System V segment this process created (looked up in `/proc/sysvipc`; ids compared
//!     as the C `int` UCX passes to `shmat`, and ids that do not fit one are refused).
//! - **Agents of other processes.** A request to an agent in another process may name only
//!   memory its loaded metadata advertised; any other remote descriptor is refused before
//!   NIXL sees it, with its index, address and length.
//! - **Racing copies.** [`Registration::read`] and [`Registration::write`] copy with relaxed
//!   atomics, each byte of a region always with one access size (its whole aligned words as
//!   8-byte words, the bytes at its unaligned ends one by one), so racing transfers or
//!   threads make them torn, never undefined (the copies' tests run under Miri).
//! - **This process as a deputy.** A peer's same-host transports (cma, posix, sysv, xpmem)
//!   can name a *third* process on this host: a READ from the peer then copies that
//!   process's memory into this process's registered memory, which the peer can READ in
//!   turn (a WRITE goes the other way). UCX checks nothing beyond the OS's own rules (cma
//!   needs ptrace rights over the target, usually the same user).
//!   [`AgentBuilder::refuse_same_host_transports`] (`AgentConfig::refuse_same_host_transports`;
//!   in `nixl-connector`, `kv_connector_extra_config.refuse_same_host_transports: true`)
//!   refuses another process's metadata offering one of them on this host
//!   ([`Error::SameHostTransportRefused`]). Cross-host deployments never need them and
//!   should turn it on; a same-host peer then runs with `UCX_TLS=^cma,posix,sysv,xpmem` and
//!   is reached over TCP or the NIC. It is off by default because single-machine
//!   deployments (vLLM's one-node prefill/decode, the nixl-rs demo and tests) exchange
//!   metadata with UCX's default transports, which include them; there, run unrelated
//!   processes as other users, so that the OS refuses cma to them.
//! - **Unsafe opt-ins.** UCX worker threads (`num_threads`), which crash NIXL 1.5.1, and
//!   further UCX workers (`num_workers` above 1), whose TCP listeners no metadata shows, only
//!   through [`Agent::create_backend_with_unchecked`]; memory that is not `'static` only
//!   through [`Agent::register_raw`].
//! - **Not protected:**
//!   - a peer in *another* process that holds stale metadata after this agent deregistered
//!     memory. UCX may still reach that memory while it stays mapped (over cma, a peer that
//!     kept this process's old metadata still READs the old addresses); only a NIC's memory
//!     keys end with the registration, and only a protocol between the two sides (deregister
//!     after the peer confirms, or a registration generation that makes the peer handshake
//!     again, as `nixl-connector` has) keeps peers off old memory. The same holds for
//!     memory registered with `register_raw`, whose contract is the caller's;
//!   - metadata NIXL loads itself ([`MetadataPeer`]: its socket listener and etcd modes) is
//!     neither validated nor checked for where it leads: NIXL offers no hook before it loads
//!     it. Use those modes with trusted peers only; requests to such an agent are held to
//!     the registrations of an agent of this process of that name, if any;
//!   - addresses of transports not interpreted here (InfiniBand, ...) are compared byte for
//!     byte with this process's workers' (their NICs check memory keys, so they reach
//!     registered memory only), and POSIX shared memory named by id
//!     (`UCX_POSIX_USE_PROC_LINK=n`) is compared with live agents' workers only;
//!   - the TCP listeners of a UCX backend's further workers, which no metadata shows and
//!     which this process cannot tell from listening sockets its parent leaked to it, are
//!     not recognised: the safe API refuses further workers (`num_workers` above 1,
//!     [`Error::RefusedBackendParam`]), and only [`Agent::create_backend_with_unchecked`]
//!     makes them.
//!
//! # Async
//! A posted [`XferRequest`] can be awaited (`request.await`, see [`Completion`]), and
//! notifications awaited per task ([`Agent::notification`], [`Agent::notification_stream`]).
//! Each agent's completion driver (one thread, started on first use) polls what is awaited
//! and wakes the tasks through std [`Waker`](std::task::Waker)s, so any runtime works.
//!
//! ```
//! # use nixl::*;
//! # fn main() -> nixl::Result<()> {
//! # let a = Agent::new("async-a")?;
//! # let b = Agent::new("async-b")?;
//! # let (ucx_a, ucx_b) = (a.create_backend("UCX")?, b.create_backend("UCX")?);
//! # let dst = a.register_memory(vec![0u8; 4096], &[&ucx_a])?;
//! # let src = b.register_memory(vec![7u8; 4096], &[&ucx_b])?;
//! # let remote = a.load_remote_metadata(&b.local_metadata()?)?;
//! # let mut local = LocalDescList::new(MemType::Dram)?;
//! # local.push_region(&dst, 0)?;
//! # let remote_list = RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(src.regions()[0].addr, 4096, 0)])?;
//! let waiting = b.notification(NotificationFilter::any().from_sender("async-a").prefix("block"))?;
//! let mut request = a.create_xfer_req(XferOp::Read, &local, &remote_list, &remote,
//!     &XferOptions::new().notification(b"block 0 read".to_vec()))?;
//! # futures_executor_stand_in(async {
//! request.post()?;
//! let request = request.await?; // done; can be posted again
//! assert_eq!(waiting.await.message, b"block 0 read");
//! # drop(request);
//! # Ok::<(), nixl::Error>(())
//! # })?;
//! # Ok(())
//! # }
//! # fn futures_executor_stand_in<F: std::future::Future>(f: F) -> F::Output {
//! #     let waker = std::task::Waker::noop();
//! #     let mut cx = std::task::Context::from_waker(&waker);
//! #     let mut f = std::pin::pin!(f);
//! #     loop {
//! #         if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; }
//! #         std::thread::yield_now();
//! #     }
//! # }
//! ```
//!
//! # Thread safety
//! [`Agent`], [`Backend`], [`Registration`], descriptor lists and prepared lists are
//! `Send + Sync`; [`XferRequest`] is `Send`. See [`Agent`] for how locking follows NIXL's
//! [`ThreadSync`] modes.
//!
//! # Platforms and configuration
//! [`platform`] decides, per hardware platform, which kv-buffer devices NIXL may use and as
//! which memory type; [`kv_config`] reads vLLM's `kv_transfer_config` JSON, including the
//! backends to create.

#![warn(missing_docs)]

// The crate's folders are floors, declared here bottom up, each importing only the floors
// below it: tests/module_layers.rs names their order (NIXL_FLOORS) and checks it, and
// docs/architecture.md draws them.
mod error;
mod ffi;

mod peers;

mod agent;

mod memory;

mod descriptors;

mod transfer;

mod notifications;

mod metadata;

pub mod platform;

pub mod kv_config;

pub use agent::backend::{Backend, PluginInfo};
pub use agent::driver_stats::DriverStats;
pub use agent::leaks::LeakStats;
pub use agent::notify_hub::{Notification, NotificationFilter};
pub use agent::{Agent, AgentBuilder, AgentConfig, ThreadSync};
pub use descriptors::desc_list::{LocalDescList, RemoteDescList};
pub use descriptors::mem_view::{MemView, PeerDesc};
pub use descriptors::prepared::{PreparedLocal, PreparedRemote};
pub use error::{Error, Result};
pub use ffi::descriptor::{RegDesc, XferDesc};
pub use ffi::library::{LibraryError, LoadedLibrary, SearchOutcome, SearchStep};
pub use ffi::mem_type::{MemType, ParseMemTypeError};
pub use ffi::status::Status;
pub use memory::registrable::{FileRegion, HostBuffer, RegisterMemory};
pub use memory::registration::Registration;
pub use metadata::exchange::MetadataPeer;
pub use notifications::notification::Notifications;
pub use notifications::notification_wait::{NextNotification, NotificationStream};
pub use peers::wire::{metadata_agent_name, validate_metadata};
pub use transfer::completion::Completion;
pub use transfer::options::{XferOp, XferOptions};
pub use transfer::xfer::{CostEstimate, CostMethod, XferRequest, XferStatus, XferTelemetry};

/// Loads NIXL's C API library if this process has not yet, and says which one it is.
///
/// Creating an agent (or any NIXL object) loads it too; calling this first reports the
/// library at start-up, or fails early. See "Finding NIXL" in the crate documentation for
/// the search order.
///
/// # Errors
/// [`Error::Library`], listing every place searched and how to install NIXL, when no
/// library of NIXL 1.5.1 was found that loads.
pub fn load_library() -> Result<&'static LoadedLibrary> {
    Ok(ffi::library::load()?.info())
}

//! Safe Rust API for NVIDIA's NIXL transfer library.
//!
//! NIXL moves memory (DRAM, VRAM, files, objects) between agents through pluggable backends
//! (UCX, POSIX, GDS, ...). LLM serving stacks use it to move KV-cache blocks between prefill
//! and decode workers. This crate wraps NIXL's C API (`nixl-sys`) so that safe code cannot
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
//! # Ownership and safety
//! Everything made from an [`Agent`] holds it (`Arc`), so the agent outlives its backends,
//! registrations, lists and requests. A [`Registration`] owns its memory (`'static` only:
//! `Vec<u8>`, [`HostBuffer`], [`FileRegion`], `&'static mut [u8]`, ...) and is held by every
//! [`LocalDescList`], prepared list and [`XferRequest`] made from it; it deregisters when
//! the last of them is dropped, or explicitly with [`Registration::deregister`], which
//! reports failures.
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
//! - **Racing copies.** [`Registration::read`] and [`Registration::write`] copy with relaxed
//!   atomics, so racing transfers or threads make them torn, never undefined.
//! - **Not protected:** a peer in *another* process that holds stale metadata after this
//!   agent deregistered memory. UCX may still reach that memory (e.g. over CMA); only a
//!   protocol between the two sides (deregister after the peer confirms) prevents it. The
//!   same holds for memory registered with `register_raw`, whose contract is the caller's.
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

mod agent;
mod atomic_copy;
mod backend;
mod completion;
mod cuda;
mod desc_list;
mod descriptor;
mod driver;
mod driver_stats;
mod error;
mod handles;
pub mod kv_config;
mod leaks;
mod local_peers;
mod mem_type;
mod mem_view;
mod memory;
mod metadata;
mod notif_map;
mod notification;
mod notification_wait;
mod notify_hub;
mod options;
mod peer_hints;
pub mod platform;
mod prepared;
mod prepared_handle;
mod query;
mod raw;
mod registration;
mod requests;
mod reuse;
mod status;
mod wire;
mod xfer;
mod xfer_dlist;

pub use agent::{Agent, AgentBuilder, AgentConfig, ThreadSync};
pub use backend::{Backend, PluginInfo};
pub use completion::Completion;
pub use desc_list::{LocalDescList, RemoteDescList};
pub use descriptor::{RegDesc, XferDesc};
pub use driver_stats::DriverStats;
pub use error::{Error, Result};
pub use leaks::LeakStats;
pub use mem_type::{MemType, ParseMemTypeError};
pub use mem_view::{MemView, PeerDesc};
pub use memory::{FileRegion, HostBuffer, RegisterMemory};
pub use metadata::MetadataPeer;
pub use notification::Notifications;
pub use notification_wait::{NextNotification, NotificationStream};
pub use notify_hub::{Notification, NotificationFilter};
pub use options::{XferOp, XferOptions};
pub use prepared::{PreparedLocal, PreparedRemote};
pub use registration::Registration;
pub use status::Status;
pub use wire::validate_metadata;
pub use xfer::{CostEstimate, CostMethod, XferRequest, XferStatus, XferTelemetry};

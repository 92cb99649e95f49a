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
//! # Ownership
//! Everything made from an [`Agent`] holds it (`Arc`), so the agent outlives its backends,
//! registrations, lists and requests. A [`Registration`] owns or borrows its memory and is
//! held by every [`LocalDescList`], prepared list and [`XferRequest`] made from it; it
//! deregisters when the last of them is dropped, or explicitly with
//! [`Registration::deregister`], which reports failures. A request dropped while in flight
//! first waits for it (NIXL can still land data after a release).
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
mod backend;
mod cuda;
mod desc_list;
mod descriptor;
mod error;
pub mod kv_config;
mod mem_type;
mod mem_view;
mod memory;
mod metadata;
mod notification;
pub mod platform;
mod prepared;
mod query;
mod raw;
mod registration;
mod reuse;
mod status;
mod wire;
mod xfer;

pub use agent::{Agent, AgentBuilder, AgentConfig, ThreadSync};
pub use backend::{Backend, PluginInfo};
pub use desc_list::{LocalDescList, RemoteDescList};
pub use descriptor::{RegDesc, XferDesc};
pub use error::{Error, Result};
pub use mem_type::MemType;
pub use mem_view::{MemView, PeerDesc};
pub use memory::{FileRegion, HostBuffer, RegisterMemory};
pub use metadata::MetadataPeer;
pub use notification::Notifications;
pub use prepared::{PreparedLocal, PreparedRemote};
pub use registration::Registration;
pub use status::Status;
pub use wire::validate_metadata;
pub use xfer::{
    CostEstimate, CostMethod, XferOp, XferOptions, XferRequest, XferStatus, XferTelemetry,
};

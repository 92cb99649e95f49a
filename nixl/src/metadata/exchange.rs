//! Metadata exchange: what a remote agent needs to reach this agent's memory.

use std::ptr;

use crate::agent::backend::Backend;
use crate::agent::backend::{backend_args, partial_metadata};
use crate::agent::peer_hints::remote_metadata_loaded;
use crate::agent::{Agent, AgentInner};
use crate::descriptors::desc_list::RemoteDescList;
use crate::error::{check, check_hint, Error, Result};
use crate::ffi::handles::OptArgs;
use crate::ffi::handles::RegDlist;
use crate::ffi::library::capi;
use crate::ffi::mem_type::MemType;
use crate::ffi::raw::{c_name, take_malloced};
use crate::ffi::status::Status;
use crate::memory::registration::Registration;
use crate::peers::designation;
use crate::peers::local_peers;
use crate::peers::same_host;
use crate::peers::wire::PeerKind;

/// Where [`Agent::send_local_metadata`] and friends exchange metadata.
///
/// # Trust
/// Metadata that arrives through a peer (the listener thread for [`MetadataPeer::Socket`],
/// the etcd watch for [`MetadataPeer::Etcd`]) is loaded by NIXL itself, on its own thread,
/// with no hook for this crate: it is **not** validated, and NIXL 1.5.1 / UCX crash on
/// malformed metadata; nor is it checked for leading into this process (a peer could send
/// this process's own worker address), nor are requests to such an agent held to the memory
/// it advertised (only, by name, to an agent of this process of that name, if any). Use
/// these modes only with peers and an etcd you trust. Bytes the crate receives itself go
/// through [`Agent::load_remote_metadata`], which validates them and checks where they lead
/// first (see [`validate_metadata`](crate::validate_metadata)); prefer that path for
/// metadata from an untrusted side channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetadataPeer {
    /// The etcd server(s) in the `NIXL_ETCD_ENDPOINTS` environment variable, read when the
    /// agent is created.
    Etcd,
    /// The NIXL metadata listener of another agent (built with `listener_thread(true)`).
    Socket {
        /// IP address of the peer.
        ip: String,
        /// Its listener port.
        port: u16,
    },
}

impl MetadataPeer {
    fn to_args(
        &self,
        agent: &AgentInner,
        operation: &'static str,
        backends: &[&Backend],
    ) -> Result<OptArgs> {
        let args = backend_args(agent, operation, backends)?;
        if let MetadataPeer::Socket { ip, port } = self {
            args.set_socket(ip, *port)?;
        }
        Ok(args)
    }
}

/// Builds the registration list of `regs` for partial metadata (all of one memory type).
fn partial_list(operation: &'static str, regs: &[&Registration]) -> Result<RegDlist> {
    let mem_type = regs.first().map_or(MemType::Dram, |r| r.mem_type());
    let mut descs = Vec::new();
    for reg in regs {
        if reg.mem_type() != mem_type {
            return Err(Error::MemTypeMismatch {
                operation,
                expected: mem_type,
                found: reg.mem_type(),
            });
        }
        descs.extend_from_slice(reg.regions());
    }
    RegDlist::build(operation, mem_type, &descs)
}

/// Hint for a load NIXL refused as an invalid parameter.
const HINT_RELOAD: &str = "the bytes are not complete NIXL metadata, or an earlier failed load of the same agent's metadata left its connection info behind (NIXL 1.5.1 then refuses every later load of that agent on this agent)";

impl Agent {
    /// This agent's full metadata: connection info and every registration.
    pub fn local_metadata(&self) -> Result<Vec<u8>> {
        let (mut data, mut len) = (ptr::null_mut(), 0);
        // SAFETY: live agent; on success `data` is a malloc'd buffer we own.
        let status = self
            .inner
            .with(|agent| unsafe { capi().nixl_capi_get_local_md(agent, &mut data, &mut len) });
        check(status, "get local metadata")?;
        // SAFETY: malloc'd by NIXL, `len` bytes, freed once here.
        Ok(unsafe { take_malloced(data, len) })
    }

    /// Metadata for just `regs` (none: connection info only) as seen through `backends`.
    pub fn local_partial_metadata(
        &self,
        regs: &[&Registration],
        backends: &[&Backend],
    ) -> Result<Vec<u8>> {
        const OP: &str = "get partial local metadata";
        partial_metadata(&self.inner, OP, &partial_list(OP, regs)?, backends)
    }

    /// Loads a remote agent's metadata and returns that agent's name.
    ///
    /// The bytes are untrusted: [`validate_metadata`](crate::validate_metadata) checks them
    /// before NIXL sees them, so malformed metadata (which crashes NIXL 1.5.1 and UCX) comes
    /// back as an error instead.
    ///
    /// They are also a claim about where the agent lives. Metadata whose UCX worker is one of
    /// this process's (its UUID, or any transport address that reaches this process: cma to
    /// this pid, a shared-memory FIFO, the TCP listener of a live agent's worker, ...) is an
    /// agent of this process only under that agent's exact name, and requests to it are then
    /// held to that agent's live registrations. Under any other name it is refused, so that no peer can make
    /// NIXL read or write this process's own memory. For an agent in another process, the
    /// memory its metadata advertises (all loads of it together, until it is invalidated)
    /// bounds the remote descriptors of requests to it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for empty bytes; [`Error::InvalidMetadata`] for bytes NIXL's
    /// serializer could not have produced (garbage, truncated, out-of-range fields, a UCX
    /// transport address shorter than what UCX reads), with the offset and the reason;
    /// [`Error::MetadataLeadsIntoThisProcess`] for metadata whose UCX worker is in this
    /// process under a name that is not its agent's;
    /// [`Error::SameHostTransportRefused`] for another process's metadata offering a
    /// same-host transport on this host, when this agent refuses them
    /// ([`AgentConfig::refuse_same_host_transports`](crate::AgentConfig::refuse_same_host_transports));
    /// [`Error::Nixl`] for metadata NIXL refuses or an agent it cannot connect to.
    ///
    /// NIXL 1.5.1 caveat: metadata that fails inside NIXL after its connection info was
    /// loaded leaves that connection info in the backend, without the agent counting as
    /// loaded; every later load of the same remote agent's metadata on this agent then fails
    /// with [`Status::InvalidParam`], and
    /// [`invalidate_remote_metadata`](Self::invalidate_remote_metadata) cannot clear it.
    /// Validation refuses truncated metadata before that can happen.
    pub fn load_remote_metadata(&self, metadata: &[u8]) -> Result<String> {
        const OP: &str = "load remote metadata";
        if metadata.is_empty() {
            return Err(Error::InvalidArgument {
                operation: OP,
                reason: "the metadata is empty".to_string(),
            });
        }
        // Bytes identical to those an agent was last loaded from passed the checks then.
        let workers = local_peers::workers_generation();
        let learned = if self.inner.loaded.is_loaded(metadata, workers) {
            None
        } else {
            let rejected = |err: Error| {
                tracing::warn!(agent = %self.inner.name, %err, "remote metadata rejected");
                err
            };
            let peer = crate::peers::wire::inspect_metadata(metadata).map_err(rejected)?;
            let kind = designation::classify(&peer).map_err(rejected)?;
            if self.inner.config.refuse_same_host_transports && kind == Some(PeerKind::Remote) {
                same_host::refuse(&peer).map_err(rejected)?;
            }
            Some((kind, peer.regions))
        };
        let mut name = ptr::null_mut();
        let status = self.inner.with(|agent| {
            // SAFETY: live agent, bytes valid for their length; on success `name` is malloc'd.
            unsafe {
                capi().nixl_capi_load_remote_md(
                    agent,
                    metadata.as_ptr().cast(),
                    metadata.len(),
                    &mut name,
                )
            }
        });
        check_hint(status, OP, Status::InvalidParam, HINT_RELOAD).map_err(|err| {
            tracing::warn!(agent = %self.inner.name, %err, "remote metadata not loaded");
            err
        })?;
        // SAFETY: NUL-terminated malloc'd string; its length excludes the NUL.
        let len = unsafe { libc::strlen(name) };
        // SAFETY: malloc'd by NIXL, `len` bytes, freed once here.
        let bytes = unsafe { take_malloced(name.cast(), len) };
        // Validated above as UTF-8 without NUL bytes, so this is the name exactly.
        let remote = String::from_utf8_lossy(&bytes).into_owned();
        tracing::debug!(agent = %self.inner.name, remote = %remote, "loaded remote metadata");
        if let Some((kind, regions)) = learned {
            self.inner
                .loaded
                .remember(&remote, metadata, workers, kind, &regions);
        }
        Ok(remote)
    }

    /// Whether metadata of `remote_agent` is loaded.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a name NIXL cannot take; [`Error::Nixl`] if NIXL fails
    /// other than by not knowing the agent.
    pub fn has_remote_metadata(&self, remote_agent: &str) -> Result<bool> {
        self.check_remote_metadata(remote_agent, None)
    }

    /// Whether `remote_agent`'s metadata is loaded and, given `descs`, covers all of them.
    pub fn check_remote_metadata(
        &self,
        remote_agent: &str,
        descs: Option<&RemoteDescList>,
    ) -> Result<bool> {
        let list = descs.map_or(ptr::null_mut(), |d| d.list.raw());
        remote_metadata_loaded(&self.inner, remote_agent, list)
    }

    /// Forgets `remote_agent`'s metadata and disconnects from it.
    pub fn invalidate_remote_metadata(&self, remote_agent: &str) -> Result<()> {
        let name = c_name("remote agent name", remote_agent)?;
        // SAFETY: live agent; valid C string.
        let status = self
            .inner
            .with(|agent| unsafe { capi().nixl_capi_invalidate_remote_md(agent, name.as_ptr()) });
        check_hint(
            status,
            "invalidate remote metadata",
            Status::NotFound,
            "no metadata of that agent is loaded",
        )?;
        self.inner.loaded.forget(remote_agent);
        Ok(())
    }

    /// Publishes this agent's full metadata to `peer`.
    pub fn send_local_metadata(&self, peer: &MetadataPeer) -> Result<()> {
        let args = peer.to_args(&self.inner, "send local metadata", &[])?;
        // SAFETY: live agent and args.
        let status = self
            .inner
            .with(|agent| unsafe { capi().nixl_capi_send_local_md(agent, args.raw()) });
        check(status, "send local metadata")
    }

    /// Publishes metadata of `regs` only (none: connection info only) to `peer`.
    pub fn send_local_partial_metadata(
        &self,
        regs: &[&Registration],
        backends: &[&Backend],
        peer: &MetadataPeer,
    ) -> Result<()> {
        const OP: &str = "send partial local metadata";
        let list = partial_list(OP, regs)?;
        let args = peer.to_args(&self.inner, OP, backends)?;
        // SAFETY: live agent, list and args.
        let status = self.inner.with(|agent| unsafe {
            capi().nixl_capi_send_local_partial_md(agent, list.raw(), args.raw())
        });
        check(status, OP)
    }

    /// Asks `peer` for `remote_agent`'s metadata; it is loaded in the background, so poll
    /// [`has_remote_metadata`](Self::has_remote_metadata) until it is there.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a [`MetadataPeer::Socket`] peer when this agent runs no
    /// listener thread: NIXL 1.5.1 receives the answer on that thread, so without it the
    /// metadata would never arrive. [`Error::Nixl`] if NIXL refuses the request.
    pub fn fetch_remote_metadata(&self, remote_agent: &str, peer: &MetadataPeer) -> Result<()> {
        let name = c_name("remote agent name", remote_agent)?;
        if matches!(peer, MetadataPeer::Socket { .. }) && !self.inner.config.listener_thread {
            return Err(Error::InvalidArgument {
                operation: "fetch remote metadata",
                reason: "the answer of a socket peer arrives on this agent's listener thread; \
                         build the agent with listener_thread(true)"
                    .to_string(),
            });
        }
        let args = peer.to_args(&self.inner, "fetch remote metadata", &[])?;
        // SAFETY: live agent and args; valid C string.
        let status = self.inner.with(|agent| unsafe {
            capi().nixl_capi_fetch_remote_md(agent, name.as_ptr(), args.raw())
        });
        check(status, "fetch remote metadata")
    }

    /// Withdraws this agent's metadata from `peer`.
    pub fn invalidate_local_metadata(&self, peer: &MetadataPeer) -> Result<()> {
        let args = peer.to_args(&self.inner, "invalidate local metadata", &[])?;
        // SAFETY: live agent and args.
        let status = self
            .inner
            .with(|agent| unsafe { capi().nixl_capi_invalidate_local_md(agent, args.raw()) });
        check(status, "invalidate local metadata")
    }

    /// Connects to `remote_agent` now instead of at the first transfer.
    pub fn make_connection(&self, remote_agent: &str, backends: &[&Backend]) -> Result<()> {
        let name = c_name("remote agent name", remote_agent)?;
        let args = backend_args(&self.inner, "make connection", backends)?;
        // SAFETY: live agent and args; valid C string.
        let status = self.inner.with(|agent| unsafe {
            capi().nixl_capi_agent_make_connection(agent, name.as_ptr(), args.raw())
        });
        check(status, "make connection").map_err(|err| self.hint_for_peer(err, remote_agent, None))
    }

    /// Whether the linked NIXL is a stub build that cannot move data.
    pub fn is_stub_library() -> bool {
        // SAFETY: no arguments, no state.
        unsafe { capi().nixl_capi_is_stub() }
    }
}

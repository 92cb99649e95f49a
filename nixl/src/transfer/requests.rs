//! Making transfer requests: from descriptor lists, cut for worker threads when large, and
//! from prepared handles once a list is reused.

use std::ptr;

use crate::agent::backend::Backend;
use crate::agent::Agent;
use crate::descriptors::desc_list::{LocalDescList, RemoteDescList};
use crate::descriptors::reuse::ReuseKey;
use crate::descriptors::xfer_dlist::XferDlist;
use crate::error::{check, Error, Result};
use crate::ffi::descriptor::{check_pairing, XferDesc};
use crate::ffi::handles::OptArgs;
use crate::ffi::library::capi;
use crate::ffi::mem_type::MemType;
use crate::ffi::raw::c_name;
use crate::ffi::status::Status;
use crate::transfer::options::{XferOp, XferOptions};
use crate::transfer::xfer::XferRequest;

/// Descriptors of at least this many bytes are cut in two by [`Agent::create_xfer_req`].
const CUT_AT: usize = 8 << 20;

/// Copies of the two lists with every pair of DRAM/VRAM descriptors of [`CUT_AT`] bytes or
/// more cut into two page-aligned halves, so that a backend with worker threads (UCX's
/// `num_threads`) can move the halves in parallel; `None` when nothing is that large.
fn cut_large_descriptors(
    local: &XferDlist,
    remote: &XferDlist,
) -> Result<Option<(XferDlist, XferDlist)>> {
    const OP: &str = "cut large descriptors";
    let memory = |list: &XferDlist| matches!(list.mem_type(), MemType::Dram | MemType::Vram);
    if !memory(local) || !memory(remote) || local.descs().iter().all(|d| d.len < CUT_AT) {
        return Ok(None);
    }
    let extra = local.descs().iter().filter(|d| d.len >= CUT_AT).count();
    let capacity = local.descs().len() + extra;
    let (mut l, mut r) = (
        XferDlist::new(local.mem_type(), capacity)?,
        XferDlist::new(remote.mem_type(), capacity)?,
    );
    for (ld, rd) in local.descs().iter().zip(remote.descs()) {
        if ld.len < CUT_AT {
            l.push(OP, *ld)?;
            r.push(OP, *rd)?;
            continue;
        }
        let half = (ld.len / 2) & !4095;
        for (offset, len) in [(0, half), (half, ld.len - half)] {
            // Every descriptor was checked not to run past the address space, so the halves
            // cannot either; checked all the same.
            let at = |addr: usize| {
                addr.checked_add(offset)
                    .ok_or_else(|| Error::InvalidArgument {
                        operation: OP,
                        reason: format!("descriptor at {addr:#x} runs past the address space"),
                    })
            };
            l.push(OP, XferDesc::new(at(ld.addr)?, len, ld.dev_id))?;
            r.push(OP, XferDesc::new(at(rd.addr)?, len, rd.dev_id))?;
        }
    }
    Ok(Some((l, r)))
}

/// The lengths of a list's descriptors.
fn lens(list: &XferDlist) -> impl ExactSizeIterator<Item = usize> + '_ {
    list.descs().iter().map(|d| d.len)
}

impl Agent {
    /// Creates a request moving `local` to or from `remote` on `remote_agent`.
    ///
    /// `remote_agent` may be this agent's own name (e.g. DRAM to a FILE it registered).
    /// DRAM/VRAM descriptor pairs of 8 MiB or more are handed to NIXL cut into two
    /// page-aligned halves (unmerged), so that a UCX backend with worker threads
    /// (`num_threads=2`, `split_batch_size` of 2 or less; only through the `unsafe`
    /// [`Agent::create_backend_with_unchecked`]) moves
    /// them in parallel; the bytes moved are the same.
    ///
    /// Lists that serve more than one request are prepared once: from the second request
    /// with the same agent, `remote_agent` and backends on, requests are made from prepared
    /// handles (as [`Agent::make_xfer_req`] does with every index in order), which skips
    /// NIXL's lookup of each descriptor and lets it merge adjacent descriptors unless
    /// [`XferOptions::skip_desc_merge`] is set. Changing a list starts over.
    ///
    /// # Errors
    /// [`Error::EmptyDescList`] / [`Error::LengthMismatch`] when the sides do not pair up;
    /// [`Error::InvalidArgument`] naming the first remote descriptor (index, address,
    /// length) outside the remote agent's memory: outside its live registrations when it
    /// lives in this process, outside what its loaded metadata advertises when it lives in
    /// another; [`Error::Nixl`] with a hint when the remote agent's metadata is not loaded,
    /// the addresses lie outside registered memory, or no backend serves both sides.
    pub fn create_xfer_req(
        &self,
        op: XferOp,
        local: &LocalDescList,
        remote: &RemoteDescList,
        remote_agent: &str,
        options: &XferOptions,
    ) -> Result<XferRequest> {
        const OP: &str = "create transfer request";
        check_pairing(OP, lens(&local.list), lens(&remote.list))?;
        local.check_owner(OP, &self.inner)?;
        let cut = cut_large_descriptors(&local.list, &remote.list)?;
        if cut.is_none() {
            if let Some(request) = self.reused_request(op, local, remote, remote_agent, options)? {
                return Ok(request);
            }
        }
        let name = c_name("remote agent name", remote_agent)?;
        let targets = remote.hold_targets(OP, &self.inner.loaded, remote_agent)?;
        let (local_raw, remote_raw, args) = match &cut {
            Some((l, r)) => {
                let options = XferOptions {
                    skip_desc_merge: true,
                    ..options.clone()
                };
                (l.raw(), r.raw(), options.to_raw(&self.inner, OP)?)
            }
            None => (
                local.list.raw(),
                remote.list.raw(),
                options.to_raw(&self.inner, OP)?,
            ),
        };
        let mut raw = ptr::null_mut();
        let status = self.inner.with(|agent| {
            // SAFETY: live agent, lists and args; valid C string; out-pointer to a local.
            unsafe {
                capi().nixl_capi_create_xfer_req(
                    agent,
                    op.to_raw(),
                    local_raw,
                    remote_raw,
                    name.as_ptr(),
                    &mut raw,
                    OptArgs::ptr(args.as_ref()),
                )
            }
        });
        check(status, OP).map_err(|err| self.explain_request_failure(err, remote_agent))?;
        tracing::trace!(agent = %self.inner.name, remote = remote_agent, ?op, descs = local.len(), "created transfer request");
        let mut keep = local.holds();
        keep.extend(targets);
        Ok(XferRequest::new(
            self.inner.clone(),
            raw,
            keep,
            Vec::new(),
            remote_agent.to_string(),
        ))
    }

    /// A request made from the prepared handles of `local` and `remote`, once both were
    /// used before with this agent, `remote_agent` and the same backends; `None` otherwise
    /// (the caller then makes a plain request).
    pub(crate) fn reused_request(
        &self,
        op: XferOp,
        local: &LocalDescList,
        remote: &RemoteDescList,
        remote_agent: &str,
        options: &XferOptions,
    ) -> Result<Option<XferRequest>> {
        let ids: Vec<usize> = options.backends.iter().map(|b| b.raw() as usize).collect();
        let local_key = ReuseKey::new(&self.inner, "", &ids);
        let remote_key = local_key.for_peer(remote_agent);
        // The backend list is only needed when a list is prepared, not on every request.
        let chosen = || options.backends.iter().collect::<Vec<&Backend>>();
        let local_handle = local.reuse.handle(local_key, || {
            self.prepare("", &local.list, &chosen(), local.holds())
        });
        let remote_handle = remote.reuse.handle(remote_key, || {
            let targets =
                remote.hold_targets("prepare descriptor list", &self.inner.loaded, remote_agent)?;
            self.prepare(remote_agent, &remote.list, &chosen(), targets)
        });
        let (Some((local_handle, indices)), Some((remote_handle, _))) =
            (local_handle, remote_handle)
        else {
            return Ok(None);
        };
        match self.make_request(
            op,
            (&local_handle, &indices),
            (&remote_handle, &indices),
            remote_agent,
            options,
        ) {
            Err(err) if err.status() == Some(Status::NotFound) => {
                // The peer's metadata was invalidated or replaced since the preparation.
                local.reuse.forget();
                remote.reuse.forget();
                Ok(None)
            }
            made => made.map(Some),
        }
    }
}

//! Transfer requests: create, post, poll, wait, repost, and release safely.

use std::any::Any;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_sys as sys;

use crate::agent::{Agent, AgentInner};
use crate::backend::backend_args;
use crate::backend::{describe_backend, Backend};
use crate::desc_list::{LocalDescList, RemoteDescList, XferDlist};
use crate::descriptor::XferDesc;
use crate::driver::{Entry, Pollable, Slot};
use crate::error::{check, check_progress, with_hint, Error, Progress, Result, HINT_STALE_REQUEST};
use crate::handles::OptArgs;
use crate::local_peers::{self, Hold};
use crate::mem_type::MemType;
use crate::prepared::PreparedShared;
use crate::raw::c_name;
use crate::status::Status;

/// Direction of a transfer, seen from the agent that makes the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XferOp {
    /// Copy remote memory into local memory.
    Read,
    /// Copy local memory into remote memory.
    Write,
}

impl XferOp {
    pub(crate) fn to_raw(self) -> sys::nixl_capi_xfer_op_t::Type {
        match self {
            XferOp::Read => sys::nixl_capi_xfer_op_t::NIXL_CAPI_XFER_OP_READ,
            XferOp::Write => sys::nixl_capi_xfer_op_t::NIXL_CAPI_XFER_OP_WRITE,
        }
    }
}

/// Where a posted request stands. Failures are errors, not statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XferStatus {
    /// Every byte has landed.
    Done,
    /// Still moving.
    InProgress,
}

/// Optional settings of a request, built with [`XferOptions::new`] and its setters.
#[non_exhaustive]
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct XferOptions {
    /// Backends NIXL may use (empty: NIXL chooses among those both sides registered with).
    pub backends: Vec<Backend>,
    /// Bytes delivered to the remote agent as a notification when the transfer completes.
    pub notification: Option<Vec<u8>>,
    /// Keep adjacent descriptors separate instead of merging them.
    pub skip_desc_merge: bool,
    /// Backend-specific bytes passed through to the backend.
    pub custom_param: Option<Vec<u8>>,
}

impl XferOptions {
    /// No options: NIXL's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Restricts the request to `backend` (call again to allow more).
    pub fn backend(mut self, backend: &Backend) -> Self {
        self.backends.push(backend.clone());
        self
    }

    /// Sends `message` to the remote agent when the transfer completes.
    pub fn notification(mut self, message: impl Into<Vec<u8>>) -> Self {
        self.notification = Some(message.into());
        self
    }

    /// Sets whether adjacent descriptors are merged.
    pub fn skip_desc_merge(mut self, skip: bool) -> Self {
        self.skip_desc_merge = skip;
        self
    }

    /// Sets backend-specific bytes.
    pub fn custom_param(mut self, value: impl Into<Vec<u8>>) -> Self {
        self.custom_param = Some(value.into());
        self
    }

    pub(crate) fn to_raw(
        &self,
        agent: &Arc<AgentInner>,
        operation: &'static str,
    ) -> Result<Option<OptArgs>> {
        let defaults = self.backends.is_empty()
            && self.notification.is_none()
            && !self.skip_desc_merge
            && self.custom_param.is_none();
        if defaults {
            // NIXL treats null optional arguments as all defaults; skip making a C object.
            return Ok(None);
        }
        let args = backend_args(agent, operation, &self.backends.iter().collect::<Vec<_>>())?;
        if let Some(message) = &self.notification {
            args.set_notification(message)?;
        }
        if self.skip_desc_merge {
            args.set_skip_desc_merge(true)?;
        }
        if let Some(value) = &self.custom_param {
            args.set_custom_param(value)?;
        }
        Ok(Some(args))
    }
}

/// NIXL's estimate of how long a request takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostEstimate {
    /// Expected duration.
    pub duration: Duration,
    /// Error margin of the estimate.
    pub error_margin: Duration,
    /// How it was estimated (NIXL 1.5.1 knows only the backend's analytical model).
    pub method: CostMethod,
}

/// How a [`CostEstimate`] was made.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostMethod {
    /// The backend's analytical model.
    AnalyticalBackend,
    /// A method this crate does not know.
    Other(i32),
}

/// Telemetry NIXL recorded for a request (agent built with telemetry on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XferTelemetry {
    /// Start time, microseconds on NIXL's steady clock.
    pub start_time_us: u64,
    /// Time spent posting.
    pub post_duration: Duration,
    /// Time from post to completion.
    pub xfer_duration: Duration,
    /// Bytes moved.
    pub total_bytes: u64,
    /// Descriptors in the request.
    pub desc_count: u64,
}

/// A transfer request.
///
/// It holds the registrations of its local memory and, when the remote agent lives in this
/// process, of the remote memory it targets: while it exists, that memory stays registered
/// and alive.
///
/// # In flight
/// From a post until NIXL reports the request done, it is *in flight*, and NIXL may write
/// into its memory. An error from [`post`](Self::post) or [`status`](Self::status) does not
/// end that: part of the request may already be posted and still land, and NIXL keeps
/// answering the same error, so such a request stays in flight for good.
///
/// Dropping an in-flight request never blocks: the agent's completion driver takes it over
/// and releases it (and the memory it holds) once NIXL reports it done. A request that
/// failed, or was [`abandon`](Self::abandon)ed, is leaked with the memory it holds, never
/// released or freed under a transfer; such leaks are logged and counted in
/// [`Agent::leak_stats`]. `mem::forget` on a request leaks the same way, uncounted.
///
/// # Awaiting
/// A posted request can be awaited (`request.await`, see [`crate::Completion`]): the agent's
/// completion driver polls it and wakes the task, under any async runtime.
///
/// # Thread safety
/// `Send` but not `Sync`: methods that talk to NIXL take `&mut self`.
pub struct XferRequest {
    agent: Arc<AgentInner>,
    raw: sys::nixl_capi_xfer_req_t,
    keep: Vec<Hold>,
    prepared: Vec<Arc<PreparedShared>>,
    remote_agent: String,
    posted: bool,
    in_flight: bool,
    /// Set once post or status failed: NIXL can no longer tell when the request is done.
    failed: bool,
}

// SAFETY: the request handle is used only through `&mut self` and the agent's locking.
unsafe impl Send for XferRequest {}

impl std::fmt::Debug for XferRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XferRequest")
            .field("agent", &self.agent.name)
            .field("remote_agent", &self.remote_agent)
            .field("posted", &self.posted)
            .field("in_flight", &self.in_flight)
            .field("failed", &self.failed)
            .finish()
    }
}

impl XferRequest {
    pub(crate) fn new(
        agent: Arc<AgentInner>,
        raw: sys::nixl_capi_xfer_req_t,
        keep: Vec<Hold>,
        prepared: Vec<Arc<PreparedShared>>,
        remote_agent: String,
    ) -> Self {
        XferRequest {
            agent,
            raw,
            keep,
            prepared,
            remote_agent,
            posted: false,
            in_flight: false,
            failed: false,
        }
    }

    /// The remote agent this request moves data with.
    pub fn remote_agent(&self) -> &str {
        &self.remote_agent
    }

    /// Whether the request was posted and has not been seen to finish (a failed request
    /// stays in flight: see the type's docs).
    pub fn is_in_flight(&self) -> bool {
        self.in_flight
    }

    /// Whether a post or status call failed, so that NIXL can no longer report the request
    /// done: it stays in flight and is leaked when dropped.
    pub fn has_failed(&self) -> bool {
        self.failed
    }

    /// Posts (or reposts, once finished) the request.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if it is still in flight; [`Error::Nixl`] if NIXL refuses,
    /// with status `NotFound` when the remote agent's metadata was invalidated since the
    /// request was made (NIXL then never touches the old metadata; make a new request).
    pub fn post(&mut self) -> Result<XferStatus> {
        self.post_raw(None)
    }

    /// Posts the request with a notification for the remote agent, replacing any set at creation.
    pub fn post_with_notification(&mut self, message: &[u8]) -> Result<XferStatus> {
        let args = OptArgs::new()?;
        args.set_notification(message)?;
        self.post_raw(Some(&args))
    }

    fn post_raw(&mut self, args: Option<&OptArgs>) -> Result<XferStatus> {
        const OP: &str = "post transfer";
        if self.failed {
            return Err(Error::InvalidArgument {
                operation: OP,
                reason: "an earlier post or status of this request failed, and parts of it may \
                         still be in flight; make a new request"
                    .to_string(),
            });
        }
        if self.in_flight && self.status()? == XferStatus::InProgress {
            return Err(Error::InvalidArgument {
                operation: OP,
                reason: "the request is still in flight; wait for it before reposting".to_string(),
            });
        }
        let args = OptArgs::ptr(args);
        // SAFETY: live agent and request; args is null or live.
        let status = self
            .agent
            .with(|agent| unsafe { sys::nixl_capi_post_xfer_req(agent, self.raw, args) });
        self.posted = true;
        // Until NIXL says otherwise, part of the request may be on its way.
        self.in_flight = true;
        let progress = check_progress(status, OP).map_err(|err| {
            self.failed = true;
            tracing::warn!(agent = %self.agent.name, remote = %self.remote_agent, %err, "transfer failed at post; it may be partly in flight");
            with_hint(err, Status::NotFound, HINT_STALE_REQUEST)
        })?;
        self.in_flight = progress == Progress::InProgress;
        tracing::trace!(agent = %self.agent.name, remote = %self.remote_agent, ?progress, "posted transfer");
        Ok(to_status(progress))
    }

    /// Polls the request once.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] before the first post; [`Error::Nixl`] if the transfer failed.
    pub fn status(&mut self) -> Result<XferStatus> {
        if !self.posted {
            return Err(Error::InvalidArgument {
                operation: "get transfer status",
                reason: "the request has not been posted".to_string(),
            });
        }
        if !self.in_flight {
            return Ok(XferStatus::Done);
        }
        // SAFETY: live agent and request.
        let status = self
            .agent
            .with(|agent| unsafe { sys::nixl_capi_get_xfer_status(agent, self.raw) });
        match check_progress(status, "transfer") {
            Ok(progress) => {
                self.in_flight = progress == Progress::InProgress;
                if !self.in_flight {
                    tracing::trace!(agent = %self.agent.name, remote = %self.remote_agent, "transfer done");
                }
                Ok(to_status(progress))
            }
            Err(err) => {
                // Other parts of the request may still land: it stays in flight.
                self.failed = true;
                tracing::warn!(agent = %self.agent.name, remote = %self.remote_agent, %err, "transfer failed; it may be partly in flight");
                Err(err)
            }
        }
    }

    /// Polls until the request is done, or `timeout` passes.
    ///
    /// The calling thread drives the transfer while it polls (UCX moves the bytes inside the
    /// poll), so it polls without sleeping, yielding the core every few polls.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the deadline passes (the request stays in flight and can be
    /// waited for again); [`Error::Nixl`] if the transfer failed.
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut polls: u32 = 0;
        loop {
            if self.status()? == XferStatus::Done {
                return Ok(());
            }
            polls = polls.wrapping_add(1);
            if polls % 64 == 0 {
                if start.elapsed() >= timeout {
                    return Err(Error::Timeout {
                        operation: "wait for transfer",
                        waited: start.elapsed(),
                    });
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Posts the request and waits for it (see [`wait`](Self::wait)).
    pub fn post_and_wait(&mut self, timeout: Duration) -> Result<()> {
        match self.post()? {
            XferStatus::Done => Ok(()),
            XferStatus::InProgress => self.wait(timeout),
        }
    }

    /// NIXL's estimate of the request's duration.
    pub fn estimate_cost(&self) -> Result<CostEstimate> {
        let (mut duration, mut margin, mut method) = (0i64, 0i64, 0);
        let status = self.agent.with(|agent| {
            // SAFETY: live agent and request; out-pointers to locals.
            unsafe {
                sys::nixl_capi_estimate_xfer_cost(
                    agent,
                    self.raw,
                    ptr::null_mut(),
                    &mut duration,
                    &mut margin,
                    &mut method,
                )
            }
        });
        const OP: &str = "estimate transfer cost";
        check(status, OP)?;
        let micros = |what: &str, v: i64| {
            u64::try_from(v)
                .map(Duration::from_micros)
                .map_err(|_| Error::InvalidArgument {
                    operation: OP,
                    reason: format!("NIXL estimated a negative {what} of {v} µs"),
                })
        };
        Ok(CostEstimate {
            duration: micros("duration", duration)?,
            error_margin: micros("error margin", margin)?,
            method: match method {
                sys::nixl_capi_cost_t::NIXL_CAPI_COST_ANALYTICAL_BACKEND => {
                    CostMethod::AnalyticalBackend
                }
                other => CostMethod::Other(i32::try_from(other).unwrap_or(i32::MAX)),
            },
        })
    }

    /// The plugin name of the backend NIXL chose for this request.
    pub fn backend(&self) -> Result<String> {
        const OP: &str = "query transfer backend";
        let mut raw = ptr::null_mut();
        // SAFETY: live agent and request; the returned handle is ours to destroy.
        let status = self
            .agent
            .with(|agent| unsafe { sys::nixl_capi_query_xfer_backend(agent, self.raw, &mut raw) });
        check(status, OP)?;
        let described = describe_backend(&self.agent, raw);
        // SAFETY: returned to us above, destroyed once; frees only the wrapper.
        let destroyed = check(
            unsafe { sys::nixl_capi_destroy_backend(raw) },
            "destroy backend handle",
        );
        let chosen = described?;
        destroyed?;
        let handles = self
            .agent
            .backends
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (plugin, handle) in handles.iter() {
            if describe_backend(&self.agent, handle.raw())? == chosen {
                return Ok(plugin.clone());
            }
        }
        Err(Error::InvalidArgument {
            operation: OP,
            reason: "NIXL chose a backend this agent did not create".into(),
        })
    }

    /// Telemetry of the last run of this request.
    ///
    /// # Errors
    /// [`Error::Nixl`] with [`Status::NoTelemetry`] unless the agent was built with telemetry on.
    pub fn telemetry(&self) -> Result<XferTelemetry> {
        let mut raw = sys::nixl_capi_xfer_telemetry_s::default();
        // SAFETY: live agent and request; NIXL fills the struct we own.
        let status = self
            .agent
            .with(|agent| unsafe { sys::nixl_capi_get_xfer_telemetry(agent, self.raw, &mut raw) });
        check(status, "get transfer telemetry").map_err(|err| {
            with_hint(
                err,
                Status::NoTelemetry,
                "build the agent with .telemetry(true)",
            )
        })?;
        Ok(XferTelemetry {
            start_time_us: raw.start_time_us,
            post_duration: Duration::from_micros(raw.post_duration_us),
            xfer_duration: Duration::from_micros(raw.xfer_duration_us),
            total_bytes: raw.total_bytes,
            desc_count: raw.desc_count,
        })
    }

    /// Gives up on the request without waiting: if it may still be in flight, the request
    /// and the memory it holds are leaked (never freed under a transfer that may still
    /// land) and counted in [`Agent::leak_stats`]; otherwise it is released as on drop.
    ///
    /// Use it when the peer is known to be gone and the request would never finish: the
    /// driver would otherwise poll it for as long as the process lives.
    pub fn abandon(mut self) {
        if self.in_flight {
            self.leak("abandoned while in flight");
            std::mem::forget(self);
        }
    }

    /// Leaks the request handle and the memory it holds (used where NIXL may still write),
    /// logging and counting it.
    fn leak(&mut self, why: &str) {
        tracing::error!(
            agent = %self.agent.name, remote = %self.remote_agent,
            "transfer request {why}: leaking it and its memory rather than freeing memory NIXL may still write"
        );
        self.agent.leaks.request();
        std::mem::forget(std::mem::take(&mut self.keep));
        std::mem::forget(std::mem::take(&mut self.prepared));
    }

    /// Moves the request out, leaving an inert shell whose drop does nothing.
    fn take(&mut self) -> XferRequest {
        let moved = XferRequest {
            agent: self.agent.clone(),
            raw: self.raw,
            keep: std::mem::take(&mut self.keep),
            prepared: std::mem::take(&mut self.prepared),
            remote_agent: std::mem::take(&mut self.remote_agent),
            posted: self.posted,
            in_flight: self.in_flight,
            failed: self.failed,
        };
        self.raw = ptr::null_mut();
        moved
    }

    /// Hands the request to its agent's completion driver whatever its load, with the
    /// outcome going to `slot`; leaks it if the driver cannot start.
    pub(crate) fn hand_to_driver(mut self, slot: Arc<Slot>) {
        match self.agent.driver() {
            Ok(driver) => {
                let shared = driver.shared.clone();
                // Forced admission cannot fail.
                let _ = shared.submit(
                    Entry {
                        item: Box::new(self),
                        slot,
                    },
                    true,
                    None,
                );
            }
            Err(err) => {
                self.leak(&format!(
                    "in flight, and the completion driver cannot start ({err})"
                ));
                std::mem::forget(self);
            }
        }
    }

    pub(crate) fn agent_inner(&self) -> &Arc<AgentInner> {
        &self.agent
    }

    /// Whether the request was ever posted.
    pub fn is_posted(&self) -> bool {
        self.posted
    }
}

fn to_status(progress: Progress) -> XferStatus {
    match progress {
        Progress::Done => XferStatus::Done,
        Progress::InProgress => XferStatus::InProgress,
    }
}

impl Pollable for XferRequest {
    fn poll_done(&mut self) -> Result<bool> {
        self.status().map(|status| status == XferStatus::Done)
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

impl Drop for XferRequest {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return; // moved out by `take`
        }
        if self.in_flight {
            if self.failed {
                self.leak("failed while it may have been in flight");
                return;
            }
            // Never block: the driver releases it once NIXL reports it done.
            tracing::debug!(agent = %self.agent.name, remote = %self.remote_agent, "dropping an in-flight request: the completion driver takes it over");
            let slot = Arc::new(Slot::default());
            slot.cancel();
            self.take().hand_to_driver(slot);
            return;
        }
        // SAFETY: live agent and request, seen done (or never posted).
        let released = self
            .agent
            .with(|agent| unsafe { sys::nixl_capi_release_xfer_req(agent, self.raw) });
        if let Err(err) = check(released, "release transfer request") {
            self.agent.leaks.failed_release();
            self.leak(&format!("not released ({err})"));
            return;
        }
        // SAFETY: released above; frees the wrapper once.
        if let Err(err) = check(
            unsafe { sys::nixl_capi_destroy_xfer_req(self.raw) },
            "destroy transfer request",
        ) {
            tracing::error!(%err, "leaking NIXL transfer request wrapper");
        }
    }
}

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

impl Agent {
    /// Creates a request moving `local` to or from `remote` on `remote_agent`.
    ///
    /// `remote_agent` may be this agent's own name (e.g. DRAM to a FILE it registered).
    /// DRAM/VRAM descriptor pairs of 8 MiB or more are handed to NIXL cut into two
    /// page-aligned halves (unmerged), so that a UCX backend with worker threads
    /// (`num_threads=2`, `split_batch_size` of 2 or less; see [`Agent::create_backend`]) moves
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
    /// [`Error::Nixl`] with a hint when the remote agent's metadata is not loaded, the
    /// addresses lie outside registered memory, or no backend serves both sides.
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
        let targets =
            local_peers::hold_targets(OP, remote_agent, remote.mem_type(), remote.descs())?;
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
                sys::nixl_capi_create_xfer_req(
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

    /// Adds the most likely fix to a failed request creation.
    pub(crate) fn explain_request_failure(&self, err: Error, remote_agent: &str) -> Error {
        const HINT_REGISTRATIONS: &str = "check that every descriptor lies inside memory registered on both sides, with a backend both sides share";
        self.hint_for_peer(err, remote_agent, Some(HINT_REGISTRATIONS))
    }
}

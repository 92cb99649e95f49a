//! A transfer request once made: post, poll, wait, repost, and release safely (making one
//! is `requests.rs`'s).

use std::any::Any;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl_capi_sys as sys;

use crate::agent::backend::describe_backend;
use crate::agent::driver::{Entry, Pollable, Slot};
use crate::agent::AgentInner;
use crate::descriptors::prepared_handle::PreparedShared;
use crate::error::{check, check_progress, with_hint, Error, Progress, Result, HINT_STALE_REQUEST};
use crate::ffi::handles::OptArgs;
use crate::ffi::library::capi;
use crate::ffi::status::Status;
use crate::peers::local_peers::Hold;

/// Where a posted request stands. Failures are errors, not statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XferStatus {
    /// Every byte has landed.
    Done,
    /// Still moving.
    InProgress,
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
/// [`Agent::leak_stats`](crate::Agent::leak_stats). `mem::forget` on a request leaks the same way, uncounted.
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
            .with(|agent| unsafe { capi().nixl_capi_post_xfer_req(agent, self.raw, args) });
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
            .with(|agent| unsafe { capi().nixl_capi_get_xfer_status(agent, self.raw) });
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
                capi().nixl_capi_estimate_xfer_cost(
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
        let status = self.agent.with(|agent| unsafe {
            capi().nixl_capi_query_xfer_backend(agent, self.raw, &mut raw)
        });
        check(status, OP)?;
        let described = describe_backend(&self.agent, raw);
        // SAFETY: returned to us above, destroyed once; frees only the wrapper.
        let destroyed = check(
            unsafe { capi().nixl_capi_destroy_backend(raw) },
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
        let status = self.agent.with(|agent| unsafe {
            capi().nixl_capi_get_xfer_telemetry(agent, self.raw, &mut raw)
        });
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
    /// land) and counted in [`Agent::leak_stats`](crate::Agent::leak_stats); otherwise it is released as on drop.
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
            .with(|agent| unsafe { capi().nixl_capi_release_xfer_req(agent, self.raw) });
        if let Err(err) = check(released, "release transfer request") {
            self.agent.leaks.failed_release();
            self.leak(&format!("not released ({err})"));
            return;
        }
        // SAFETY: released above; frees the wrapper once.
        if let Err(err) = check(
            unsafe { capi().nixl_capi_destroy_xfer_req(self.raw) },
            "destroy transfer request",
        ) {
            tracing::error!(%err, "leaking NIXL transfer request wrapper");
        }
    }
}

//! The agent core: the NIXL agent's C handle, configuration, locking and backend handles
//! (this file); its backends (`backend`, with the parameters set unless the creator did and
//! those the safe API refuses); its completion driver (`driver`, `driver_stats`) and the hub
//! that hands notifications to waiting tasks (`notify_hub`); its counts of leaked requests
//! (`leaks`); the hints it adds to NIXL's failures about a remote agent (`peer_hints`); and
//! the guard that leaves agents to an exiting process (`exit_guard`). It knows nothing of the
//! registrations, lists and requests above it, which use it.

pub(crate) mod backend;
pub(crate) mod backend_defaults;
pub(crate) mod driver;
pub(crate) mod driver_stats;
pub(crate) mod exit_guard;
pub(crate) mod leaks;
pub(crate) mod notify_hub;
pub(crate) mod peer_hints;
pub(crate) mod refused_params;

use std::ptr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use nixl_capi_sys as sys;

use crate::agent::driver::{Driver, Shared};
use crate::agent::driver_stats::DriverStats;
use crate::agent::leaks::{LeakCounters, LeakStats};
use crate::error::{check, Result};
use crate::ffi::handles::BackendHandle;
use crate::ffi::library::capi;
use crate::ffi::raw::c_name;
use crate::peers::local_peers;
use crate::peers::wire::LoadedMetadata;

/// How NIXL locks an agent's internal state across threads.
///
/// Whatever is chosen, [`Agent`] stays safe to share between threads: with
/// [`ThreadSync::None`] this crate serialises every call on the agent itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ThreadSync {
    /// NIXL takes no locks; this crate then serialises all calls with a mutex.
    None,
    /// NIXL serialises every call with one lock.
    Strict,
    /// NIXL lets data-path calls (transfers, status) run in parallel and serialises
    /// control-path calls (registration, metadata, backends). The default.
    #[default]
    ReadWrite,
}

impl ThreadSync {
    fn to_raw(self) -> sys::nixl_capi_thread_sync_t::Type {
        use sys::nixl_capi_thread_sync_t as raw;
        match self {
            ThreadSync::None => raw::NIXL_CAPI_THREAD_SYNC_NONE,
            ThreadSync::Strict => raw::NIXL_CAPI_THREAD_SYNC_STRICT,
            ThreadSync::ReadWrite => raw::NIXL_CAPI_THREAD_SYNC_RW,
        }
    }
}

/// Every setting of a NIXL agent. Built with [`Agent::builder`], or from
/// [`AgentConfig::default`] with fields changed and passed to [`AgentBuilder::config`].
///
/// New settings may come with new NIXL versions, so it cannot be built field by field:
///
/// ```compile_fail,E0639
/// let config = nixl::AgentConfig {
///     progress_thread: false,
///     ..nixl::AgentConfig::default()
/// };
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// Run NIXL's progress thread, which advances transfers and receives notifications
    /// in the background. Without it, an agent that is the passive side of a transfer makes
    /// progress only while one of its own calls polls (e.g. [`Agent::notifications`]), so a
    /// peer's transfer into or out of its memory may not finish until then.
    pub progress_thread: bool,
    /// Sleep between progress-thread polls. Zero makes the thread spin a whole core.
    pub progress_delay: Duration,
    /// Run NIXL's metadata listener thread (socket metadata exchange).
    pub listener_thread: bool,
    /// TCP port of the metadata listener; 0 lets the OS choose.
    pub listen_port: u16,
    /// Sleep between listener-thread polls.
    pub listener_delay: Duration,
    /// NIXL's locking mode.
    pub thread_sync: ThreadSync,
    /// Record per-request telemetry ([`crate::XferRequest::telemetry`]).
    pub telemetry: bool,
    /// Refuse the metadata of agents in other processes that offers a same-host transport
    /// (cma, posix, sysv, xpmem) on this host
    /// ([`Error::SameHostTransportRefused`](crate::Error::SameHostTransportRefused)). Through
    /// those a peer can name a third process of this host, which this process would then
    /// read from or write to on the peer's behalf. Cross-host deployments never need them;
    /// same-host peers then run with `UCX_TLS=^cma,posix,sysv,xpmem`. Off by default,
    /// because NIXL's and vLLM's same-host deployments (prefill and decode on one machine)
    /// use these transports with UCX's default settings.
    pub refuse_same_host_transports: bool,
}

impl Default for AgentConfig {
    /// Progress thread on with a 1 ms delay (an idle agent then costs a few percent of a
    /// core instead of a whole one), no listener, read-write locking, telemetry off,
    /// same-host transports of peers allowed.
    fn default() -> Self {
        AgentConfig {
            progress_thread: true,
            progress_delay: Duration::from_millis(1),
            listener_thread: false,
            listen_port: 0,
            listener_delay: Duration::from_millis(100),
            thread_sync: ThreadSync::ReadWrite,
            telemetry: false,
            refuse_same_host_transports: false,
        }
    }
}

/// Builds an [`Agent`] from a name and an [`AgentConfig`].
#[derive(Debug, Clone)]
#[must_use = "call build() to create the agent"]
pub struct AgentBuilder {
    name: String,
    config: AgentConfig,
}

impl AgentBuilder {
    /// Turns the progress thread on or off.
    pub fn progress_thread(mut self, on: bool) -> Self {
        self.config.progress_thread = on;
        self
    }

    /// Sets the progress thread's sleep between polls (rounded down to microseconds).
    pub fn progress_delay(mut self, delay: Duration) -> Self {
        self.config.progress_delay = delay;
        self
    }

    /// Turns the metadata listener thread on or off.
    pub fn listener_thread(mut self, on: bool) -> Self {
        self.config.listener_thread = on;
        self
    }

    /// Sets the metadata listener's TCP port (0: chosen by the OS).
    pub fn listen_port(mut self, port: u16) -> Self {
        self.config.listen_port = port;
        self
    }

    /// Sets the listener thread's sleep between polls.
    pub fn listener_delay(mut self, delay: Duration) -> Self {
        self.config.listener_delay = delay;
        self
    }

    /// Sets NIXL's locking mode.
    pub fn thread_sync(mut self, mode: ThreadSync) -> Self {
        self.config.thread_sync = mode;
        self
    }

    /// Turns per-request telemetry on or off.
    pub fn telemetry(mut self, on: bool) -> Self {
        self.config.telemetry = on;
        self
    }

    /// Refuses (or allows) peers' same-host transports on this host
    /// ([`AgentConfig::refuse_same_host_transports`]).
    pub fn refuse_same_host_transports(mut self, on: bool) -> Self {
        self.config.refuse_same_host_transports = on;
        self
    }

    /// Replaces the whole configuration.
    pub fn config(mut self, config: AgentConfig) -> Self {
        self.config = config;
        self
    }

    /// Creates the agent.
    ///
    /// # Errors
    /// [`Error::InvalidName`](crate::Error::InvalidName) for an empty name or one with a NUL
    /// byte; [`Error::Library`](crate::Error::Library) if NIXL cannot be found or loaded
    /// (this is where a process loads it); [`Error::Nixl`](crate::Error::Nixl) if NIXL
    /// cannot create it.
    pub fn build(self) -> Result<Agent> {
        let name = c_name("agent name", &self.name)?;
        crate::ffi::library::load()?;
        let cfg = &self.config;
        let raw_cfg = sys::nixl_capi_agent_config_t {
            enable_prog_thread: cfg.progress_thread,
            enable_listen_thread: cfg.listener_thread,
            listen_port: i32::from(cfg.listen_port),
            thread_sync: cfg.thread_sync.to_raw(),
            // NIXL 1.5.1's C API ignores this field; a backend parameter (UCX:
            // `num_workers`) sets workers.
            num_workers: 1,
            pthr_delay_us: micros(cfg.progress_delay),
            lthr_delay_us: micros(cfg.listener_delay),
            capture_telemetry: cfg.telemetry,
        };
        let mut raw = ptr::null_mut();
        // SAFETY: valid C string and config, out-pointer to a local.
        let status =
            unsafe { capi().nixl_capi_create_configured_agent(name.as_ptr(), &raw_cfg, &mut raw) };
        check(status, "create agent")?;
        tracing::debug!(agent = %self.name, config = ?self.config, "created NIXL agent");
        crate::agent::exit_guard::install();
        let inner = Arc::new(AgentInner {
            raw,
            id: local_peers::next_id(),
            serialize: (cfg.thread_sync == ThreadSync::None).then(|| Mutex::new(())),
            backends: Mutex::new(Vec::new()),
            leaks: LeakCounters::default(),
            loaded: LoadedMetadata::default(),
            driver: OnceLock::new(),
            driver_start: Mutex::new(()),
            name: self.name,
            config: self.config,
            on_destroyed: Mutex::new(Vec::new()),
        });
        local_peers::add_agent(inner.id, &inner.name);
        Ok(Agent { inner })
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A NIXL agent.
///
/// Cheap to clone: clones share one NIXL agent, which is destroyed when the last clone and
/// the last object made from it (backend, registration, list, request) are gone.
///
/// # Thread safety
/// `Agent` is `Send + Sync`: every method takes `&self` and may be called from any number of
/// threads at once. The locking follows NIXL's own rules for the chosen [`ThreadSync`]:
/// with `ReadWrite` (the default) or `Strict`, NIXL locks internally and this crate adds no
/// lock; with `None`, NIXL does no locking, so this crate serialises every call on the
/// agent with one mutex. Objects that change state ([`crate::XferRequest`],
/// descriptor lists) take `&mut self` for those changes, so one such object is never used by
/// two threads at once; they are `Send` and can move between threads.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<AgentInner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// Creates an agent with the default [`AgentConfig`].
    pub fn new(name: &str) -> Result<Agent> {
        Agent::builder(name).build()
    }

    /// Starts building an agent named `name`.
    pub fn builder(name: &str) -> AgentBuilder {
        AgentBuilder {
            name: name.to_string(),
            config: AgentConfig::default(),
        }
    }

    /// The agent's name, as remote agents know it.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Runs `hook` once this agent is destroyed: on the thread that drops its last reference
    /// (the agent, or any object made from it), right after NIXL's agent and backends are
    /// gone. An agent whose last reference goes while the process exits is not destroyed
    /// (UCX is being torn down then), and `hook` does not run.
    pub fn on_destroyed(&self, hook: impl FnOnce() + Send + 'static) {
        self.inner
            .on_destroyed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Box::new(hook));
    }

    /// The configuration the agent was created with.
    pub fn config(&self) -> &AgentConfig {
        &self.inner.config
    }

    /// What this agent leaked so far rather than free memory NIXL might still use: requests
    /// given up in flight, failed deregistrations, refused releases. Each is also logged.
    pub fn leak_stats(&self) -> LeakStats {
        self.inner.leaks.snapshot()
    }

    /// What this agent's completion driver has done so far (all zero before the agent's
    /// first asynchronous use): requests awaited through it or dropped in flight into it,
    /// waits for room, and the requests it holds now.
    pub fn driver_stats(&self) -> DriverStats {
        self.inner
            .driver
            .get()
            .map_or_else(DriverStats::default, |driver| driver.shared.stats())
    }
}

/// The owner of the C agent handle. Everything made from an agent holds an `Arc` of this.
pub(crate) struct AgentInner {
    raw: sys::nixl_capi_agent_t,
    /// Unique in this process, so that its registrations and workers are known by agent,
    /// not by name.
    pub(crate) id: u64,
    serialize: Option<Mutex<()>>,
    /// Plugin name and C handle of every backend created on this agent, freed with it.
    pub(crate) backends: Mutex<Vec<(String, BackendHandle)>>,
    /// What was leaked rather than freed under NIXL.
    pub(crate) leaks: LeakCounters,
    /// The metadata each remote agent was last loaded from (reloads of the same bytes are
    /// not validated again).
    pub(crate) loaded: LoadedMetadata,
    /// The completion driver, started on first asynchronous use.
    driver: OnceLock<Driver>,
    /// Held while the driver starts, so that only one starts.
    driver_start: Mutex<()>,
    pub(crate) name: String,
    pub(crate) config: AgentConfig,
    /// Run once the agent is destroyed ([`Agent::on_destroyed`]).
    on_destroyed: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
}

// SAFETY: the handle is only used through `with`, which serialises calls when NIXL itself
// does no locking (ThreadSync::None); in the other modes NIXL's agent is thread-safe.
unsafe impl Send for AgentInner {}
// SAFETY: as above.
unsafe impl Sync for AgentInner {}

impl AgentInner {
    /// Runs `f` with the raw agent, holding the crate's lock where NIXL has none.
    pub(crate) fn with<R>(&self, f: impl FnOnce(sys::nixl_capi_agent_t) -> R) -> R {
        let _guard = self
            .serialize
            .as_ref()
            .map(|lock| lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        f(self.raw)
    }

    /// The agent's completion driver, started on first use.
    pub(crate) fn driver(&self) -> Result<&Driver> {
        if let Some(driver) = self.driver.get() {
            return Ok(driver);
        }
        let _starting = self
            .driver_start
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(driver) = self.driver.get() {
            return Ok(driver);
        }
        let driver = Driver::start(&self.name)?;
        Ok(self.driver.get_or_init(|| driver))
    }

    /// The driver's shared state, when tasks await notifications through it.
    pub(crate) fn active_hub(&self) -> Option<Arc<Shared>> {
        let shared = &self.driver.get()?.shared;
        crate::agent::driver::lock(&shared.hub)
            .active
            .then(|| shared.clone())
    }
}

impl Drop for AgentInner {
    fn drop(&mut self) {
        local_peers::remove_agent(self.id);
        let hooks = std::mem::take(
            self.on_destroyed
                .get_mut()
                .unwrap_or_else(|p| p.into_inner()),
        );
        let Some(_destroying) = crate::agent::exit_guard::begin() else {
            // The process is exiting and UCX may be cleaning up already (see exit_guard):
            // leave the agent and its backends to the process.
            std::mem::forget(std::mem::take(
                self.backends.get_mut().unwrap_or_else(|p| p.into_inner()),
            ));
            return;
        };
        self.destroy();
        for hook in hooks {
            hook();
        }
    }
}

impl AgentInner {
    /// Stops the driver, frees the backends and destroys the NIXL agent.
    fn destroy(&mut self) {
        if let Some(driver) = self.driver.get() {
            driver.stop();
        }
        // The backend handle wrappers go first (no Backend value is left to use them).
        drop(std::mem::take(
            self.backends.get_mut().unwrap_or_else(|p| p.into_inner()),
        ));
        // SAFETY: the last reference is gone, so no child object can use the handle again.
        let status = unsafe { capi().nixl_capi_destroy_agent(self.raw) };
        match check(status, "destroy agent") {
            Ok(()) => tracing::debug!(agent = %self.name, "destroyed NIXL agent"),
            Err(err) => {
                tracing::error!(agent = %self.name, %err, "NIXL agent not destroyed cleanly")
            }
        }
    }
}

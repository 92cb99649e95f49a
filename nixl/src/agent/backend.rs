//! Plugins (what NIXL can load) and backends (loaded plugin instances on an agent).

use std::collections::BTreeMap;
use std::ptr;
use std::sync::Arc;

use nixl_capi_sys as sys;

use crate::agent::backend_defaults;
use crate::agent::refused_params::{self, RefusedParams};
use crate::agent::{Agent, AgentInner};
use crate::error::{check, Error, Result};
use crate::ffi::handles::Params;
use crate::ffi::handles::{BackendHandle, OptArgs, RegDlist};
use crate::ffi::library::capi;
use crate::ffi::mem_type::MemType;
use crate::ffi::raw::{c_name, take_malloced, take_mem_list, take_string_list};
use crate::peers::local_peers;

/// What a plugin supports before any backend is created from it.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginInfo {
    /// The plugin's name (`UCX`, `POSIX`, ...).
    pub name: String,
    /// Memory types its backends can register and move.
    pub mem_types: Vec<MemType>,
    /// Its parameters and their default values.
    pub params: BTreeMap<String, String>,
}

/// A backend: an instance of a plugin created on an agent.
///
/// Cheap to clone. It keeps its agent alive, so it can never outlive it.
#[derive(Clone)]
pub struct Backend {
    inner: Arc<BackendInner>,
}

struct BackendInner {
    agent: Arc<AgentInner>,
    raw: sys::nixl_capi_backend_t,
    plugin: String,
}

// SAFETY: the handle is an immutable reference to a backend owned by the agent; all calls
// that use it go through the agent, which provides the locking. The agent frees it.
unsafe impl Send for BackendInner {}
// SAFETY: as above.
unsafe impl Sync for BackendInner {}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("plugin", &self.inner.plugin)
            .field("agent", &self.inner.agent.name)
            .finish()
    }
}

impl PartialEq for Backend {
    fn eq(&self, other: &Self) -> bool {
        self.inner.raw == other.inner.raw
    }
}

impl Eq for Backend {}

impl Backend {
    /// The plugin this backend was created from.
    pub fn plugin(&self) -> &str {
        &self.inner.plugin
    }

    /// The name of the agent that owns this backend.
    pub fn agent_name(&self) -> &str {
        &self.inner.agent.name
    }

    /// The parameters the backend runs with.
    pub fn params(&self) -> Result<BTreeMap<String, String>> {
        self.query().map(|(_, params)| params)
    }

    /// The memory types the backend supports.
    pub fn mem_types(&self) -> Result<Vec<MemType>> {
        self.query().map(|(types, _)| types)
    }

    fn query(&self) -> Result<BackendDescription> {
        describe_backend(&self.inner.agent, self.inner.raw)
    }

    pub(crate) fn raw(&self) -> sys::nixl_capi_backend_t {
        self.inner.raw
    }

    /// Whether this backend belongs to `agent`.
    pub(crate) fn belongs_to(&self, agent: &AgentInner) -> bool {
        std::ptr::eq(Arc::as_ptr(&self.inner.agent), agent)
    }
}

/// Optional arguments naming these backends of `agent` (none: NIXL chooses).
///
/// # Errors
/// [`Error::InvalidArgument`] for a backend created on another agent.
pub(crate) fn backend_args(
    agent: &AgentInner,
    operation: &'static str,
    backends: &[&Backend],
) -> Result<OptArgs> {
    if let Some(foreign) = backends.iter().find(|b| !b.belongs_to(agent)) {
        return Err(Error::InvalidArgument {
            operation,
            reason: format!(
                "backend {} belongs to agent {:?}, not {:?}",
                foreign.plugin(),
                foreign.agent_name(),
                agent.name
            ),
        });
    }
    let args = OptArgs::new()?;
    for backend in backends {
        // SAFETY: the backend handle stays valid while its agent lives, and every user of
        // these arguments holds that agent.
        unsafe { args.add_backend(backend.raw()) }?;
    }
    Ok(args)
}

/// `agent`'s metadata for just the registrations in `list` (empty: connection info only) as
/// seen through `backends`.
pub(crate) fn partial_metadata(
    agent: &AgentInner,
    operation: &'static str,
    list: &RegDlist,
    backends: &[&Backend],
) -> Result<Vec<u8>> {
    let args = backend_args(agent, operation, backends)?;
    let (mut data, mut len) = (ptr::null_mut(), 0);
    let status = agent.with(|agent| {
        // SAFETY: live agent, list and args; on success `data` is a malloc'd buffer we own.
        unsafe {
            capi().nixl_capi_get_local_partial_md(
                agent,
                list.raw(),
                &mut data,
                &mut len,
                args.raw(),
            )
        }
    });
    check(status, operation)?;
    // SAFETY: malloc'd by NIXL, `len` bytes, freed once here.
    Ok(unsafe { take_malloced(data, len) })
}

/// Parameters a NIXL 1.5.1 plugin reads although its advertised defaults do not list them.
fn unadvertised_params(plugin: &str) -> &'static [&'static str] {
    match plugin {
        "UCX" => &[
            "num_threads",
            "split_batch_size",
            "ucx_ep_close_force",
            "ucx_num_device_channels",
            "engine_config",
        ],
        _ => &[],
    }
}

/// A backend's memory types and parameters.
pub(crate) type BackendDescription = (Vec<MemType>, BTreeMap<String, String>);

/// Reads the memory types and parameters of a backend handle of `agent`.
pub(crate) fn describe_backend(
    agent: &AgentInner,
    raw: sys::nixl_capi_backend_t,
) -> Result<BackendDescription> {
    let (mut mems, mut params) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: live agent and backend; out-pointers to locals, owned by us on success.
    let status = agent.with(|agent| unsafe {
        capi().nixl_capi_get_backend_params(agent, raw, &mut mems, &mut params)
    });
    check(status, "get backend parameters")?;
    // SAFETY: handed to us above, destroyed by the owner only.
    let params = unsafe { Params::from_raw(params) };
    // SAFETY: returned to us above and not used again.
    let types = unsafe { take_mem_list(mems) }?;
    Ok((types, params.to_map()?))
}

impl Agent {
    /// Every backend created on this agent so far.
    pub fn backends(&self) -> Vec<Backend> {
        let handles = self
            .inner
            .backends
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        handles
            .iter()
            .map(|(plugin, handle)| Backend {
                inner: Arc::new(BackendInner {
                    agent: self.inner.clone(),
                    raw: handle.raw(),
                    plugin: plugin.clone(),
                }),
            })
            .collect()
    }

    /// [`Error::BackendExists`] if the agent has a backend of `plugin`.
    fn check_no_backend_of(&self, plugin: &str) -> Result<()> {
        let handles = self
            .inner
            .backends
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if handles.iter().any(|(created, _)| created == plugin) {
            return Err(Error::BackendExists {
                plugin: plugin.to_string(),
                agent: self.inner.name.clone(),
            });
        }
        Ok(())
    }

    /// Names of the plugins NIXL can load (from its plugin directory).
    pub fn available_plugins(&self) -> Result<Vec<String>> {
        let mut list = ptr::null_mut();
        // SAFETY: live agent, out-pointer to a local.
        let status = self
            .inner
            .with(|agent| unsafe { capi().nixl_capi_get_available_plugins(agent, &mut list) });
        check(status, "list available plugins")?;
        // SAFETY: returned to us above and not used again.
        unsafe { take_string_list(list) }
    }

    /// A plugin's supported memory types and default parameters.
    ///
    /// # Errors
    /// [`Error::UnknownPlugin`] (listing the available ones) if NIXL has no such plugin;
    /// [`Error::Nixl`] if NIXL lists it but cannot describe it; [`Error::UnknownMemType`]
    /// for a memory type this crate does not know.
    pub fn plugin_info(&self, plugin: &str) -> Result<PluginInfo> {
        let name = c_name("plugin name", plugin)?;
        let (mut mems, mut params) = (ptr::null_mut(), ptr::null_mut());
        let status = self.inner.with(|agent| {
            // SAFETY: live agent, valid C string, out-pointers to locals.
            unsafe {
                capi().nixl_capi_get_plugin_params(agent, name.as_ptr(), &mut mems, &mut params)
            }
        });
        if let Err(err) = check(status, "get plugin parameters") {
            // Only a plugin NIXL does not list is unknown; any other failure is NIXL's own.
            let available = self.available_plugins()?;
            if available.iter().any(|p| p == plugin) {
                return Err(err);
            }
            return Err(Error::UnknownPlugin {
                name: plugin.to_string(),
                available,
            });
        }
        // SAFETY: handed to us above, destroyed by the owner only.
        let params = unsafe { Params::from_raw(params) };
        // SAFETY: returned to us above and not used again.
        let mem_types = unsafe { take_mem_list(mems) }?;
        Ok(PluginInfo {
            name: plugin.to_string(),
            mem_types,
            params: params.to_map()?,
        })
    }

    /// Creates a backend from `plugin` with the plugin's own default parameters.
    ///
    /// For UCX that means one worker and no worker threads: the thread that polls a request
    /// does the copy, which measured faster than two worker threads for bulk, KV-block and
    /// 4 KiB transfers (figures: the README's Benchmarks section). Worker threads
    /// (`num_threads`) and further workers (`num_workers`) are refused by the safe API: see
    /// [`create_backend_with`](Self::create_backend_with), which also says why a UCX
    /// backend's worker lock is UCX's mutex.
    pub fn create_backend(&self, plugin: &str) -> Result<Backend> {
        self.create_backend_with(plugin, std::iter::empty::<(&str, &str)>())
    }

    /// Creates a backend from `plugin`, overriding some of its default parameters.
    ///
    /// Keys are checked against the plugin's advertised parameters plus the ones its backend
    /// reads without advertising them (UCX: `num_threads`, `split_batch_size`,
    /// `ucx_ep_close_force`, `ucx_num_device_channels`, `engine_config`).
    ///
    /// A UCX backend's `engine_config` gets `USE_MT_MUTEX=y` (UCX's worker lock a mutex
    /// rather than a spinlock, so that threads waiting for the worker sleep instead of spinning
    /// against the one using it) unless it names `USE_MT_MUTEX` itself; the environment
    /// variable `UCX_USE_MT_MUTEX` still wins, as NIXL lets it.
    ///
    /// Two UCX settings are refused, each only available through the `unsafe`
    /// [`create_backend_with_unchecked`](Self::create_backend_with_unchecked):
    /// - **Worker threads** (`num_threads` other than 0). NIXL 1.5.1's UCX worker-thread mode
    ///   has a race in which a worker thread completes its part of a request after the request
    ///   was reposted or released, and the process dies with a segfault in
    ///   `nixlUcxDedicatedThread::run()` (`libplugin_UCX.so`; a write through a null pointer in
    ///   `nixlUcxChunkBackendReqH::complete`). Reposting one request of 16 × 4 KiB descriptors
    ///   in a loop with `num_threads=2`, `split_batch_size=1` crashed 6 of 11 runs, after 0.5
    ///   to 16 s. Safe code cannot rule that out.
    /// - **Further workers** (`num_workers` other than 1; NIXL reads 0 as 1). Each UCX worker
    ///   listens on its own TCP port, and the backend's metadata shows its first worker only.
    ///   [`load_remote_metadata`](Agent::load_remote_metadata) refuses metadata that leads to
    ///   a worker of this process, but cannot recognise the listener of a worker that no
    ///   metadata shows among the listening sockets of the process. A peer whose metadata
    ///   named such a worker would read and write this process's memory.
    ///
    /// # Errors
    /// [`Error::UnknownPlugin`] for a plugin NIXL does not have,
    /// [`Error::BackendExists`] when the agent already has a backend of `plugin`,
    /// [`Error::UnknownBackendParam`] for a key the plugin does not define,
    /// [`Error::RefusedBackendParam`] for UCX `num_threads` other than 0 or `num_workers`
    /// other than 0 or 1, and
    /// [`Error::Nixl`] when NIXL rejects a value or cannot start the backend.
    pub fn create_backend_with<K, V>(
        &self,
        plugin: &str,
        overrides: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Backend>
    where
        K: Into<String>,
        V: Into<String>,
    {
        let params = self.backend_params(plugin, overrides)?;
        self.create_backend_from(plugin, params, RefusedParams::Refuse)
    }

    /// Creates a backend as [`create_backend_with`](Self::create_backend_with) does, but
    /// without refusing UCX worker threads (`num_threads` other than 0) or further workers
    /// (`num_workers` above 1), for benchmarks of those modes. Each one it allows is logged
    /// as a warning.
    ///
    /// # Safety
    /// NIXL 1.5.1's UCX worker-thread mode is not memory-safe: a worker thread can complete
    /// its part of a request after the request was reposted or released, and then writes
    /// through a null pointer (a segfault in `nixlUcxDedicatedThread::run()`). No rule of use
    /// is known that avoids it; it was seen while one request was reposted in a loop, and
    /// once while a 64 MiB request split over the threads was reposted. The caller accepts
    /// that the process may crash, or worse, while requests made through the returned backend
    /// exist, and so uses it only where that is acceptable (a benchmark), never in serving.
    ///
    /// A backend with more than one UCX worker (further workers, or the workers of its
    /// threads) has workers whose TCP listeners no metadata shows. The caller loads metadata
    /// into any agent of this process only from peers it trusts, as
    /// [`load_remote_metadata`](Agent::load_remote_metadata) cannot tell that metadata naming
    /// such a worker leads into this process.
    ///
    /// # Errors
    /// As [`create_backend_with`](Self::create_backend_with), but never
    /// [`Error::RefusedBackendParam`].
    pub unsafe fn create_backend_with_unchecked<K, V>(
        &self,
        plugin: &str,
        overrides: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Backend>
    where
        K: Into<String>,
        V: Into<String>,
    {
        let params = self.backend_params(plugin, overrides)?;
        self.create_backend_from(plugin, params, RefusedParams::AllowWithWarning)
    }

    /// The plugin's default parameters with `overrides` applied, each key checked.
    fn backend_params<K, V>(
        &self,
        plugin: &str,
        overrides: impl IntoIterator<Item = (K, V)>,
    ) -> Result<BTreeMap<String, String>>
    where
        K: Into<String>,
        V: Into<String>,
    {
        self.check_no_backend_of(plugin)?;
        let info = self.plugin_info(plugin)?;
        let extra = unadvertised_params(plugin);
        let mut params = info.params.clone();
        for (key, value) in overrides {
            let key = key.into();
            if !params.contains_key(&key) && !extra.contains(&key.as_str()) {
                let mut known: Vec<String> = info.params.keys().cloned().collect();
                known.extend(extra.iter().map(|k| k.to_string()));
                return Err(Error::UnknownBackendParam {
                    plugin: plugin.to_string(),
                    key,
                    known,
                });
            }
            params.insert(key, value.into());
        }
        backend_defaults::apply(plugin, &mut params);
        Ok(params)
    }

    /// Creates a backend of `plugin` with exactly `params`, the parameters the safe API
    /// refuses refused or allowed as `refused` says.
    fn create_backend_from(
        &self,
        plugin: &str,
        params: BTreeMap<String, String>,
        refused: RefusedParams,
    ) -> Result<Backend> {
        for refusal in refused_params::refusals(plugin, &params) {
            match refused {
                RefusedParams::Refuse => return Err(refusal),
                RefusedParams::AllowWithWarning => tracing::warn!(
                    agent = %self.inner.name,
                    plugin,
                    %refusal,
                    "allowed by Agent::create_backend_with_unchecked"
                ),
            }
        }
        let name = c_name("plugin name", plugin)?;
        let raw_params = Params::from_map(&params)?;
        let handle = self
            .inner
            .with(|agent| {
                BackendHandle::create("create backend", |out| {
                    // SAFETY: live agent and params, valid C string; NIXL stores the new
                    // handle through the out-pointer.
                    unsafe {
                        capi().nixl_capi_create_backend(agent, name.as_ptr(), raw_params.raw(), out)
                    }
                })
            })
            .map_err(|err| {
                // Another thread may have created the same backend in the meantime.
                let err = self.check_no_backend_of(plugin).err().unwrap_or(err);
                tracing::warn!(agent = %self.inner.name, plugin, %err, "backend creation failed");
                err
            })?;
        let raw = handle.raw();
        tracing::debug!(agent = %self.inner.name, plugin, ?params, "created backend");
        let mut handles = self
            .inner
            .backends
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        handles.push((plugin.to_string(), handle));
        drop(handles);
        let backend = Backend {
            inner: Arc::new(BackendInner {
                agent: self.inner.clone(),
                raw,
                plugin: plugin.to_string(),
            }),
        };
        if plugin == "UCX" {
            self.record_ucx_worker(&backend);
        }
        Ok(backend)
    }

    /// Records the UCX worker of `backend`, from its connection info, as one of this
    /// process's: metadata that leads to it is then recognised as this process's whatever
    /// name it gives.
    fn record_ucx_worker(&self, backend: &Backend) {
        const OP: &str = "get partial local metadata";
        let learned = RegDlist::build(OP, MemType::Dram, &[])
            .and_then(|list| partial_metadata(&self.inner, OP, &list, &[backend]))
            .and_then(|md| Ok(crate::peers::wire::inspect_metadata(&md)?.worker));
        match learned {
            Ok(Some(worker)) => local_peers::add_worker(self.inner.id, worker),
            Ok(None) => {
                tracing::error!(agent = %self.inner.name, "a UCX backend without UCX connection info: metadata leading to its worker cannot be recognised as this process's")
            }
            Err(err) => {
                tracing::error!(agent = %self.inner.name, %err, "cannot read this UCX backend's own address: metadata leading to its worker cannot be recognised as this process's")
            }
        }
    }
}

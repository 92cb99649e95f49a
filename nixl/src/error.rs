//! The crate's one error type, and the `check` layer that turns NIXL statuses into it.

use std::time::Duration;

use nixl_capi_sys::nixl_capi_status_t as raw;

use crate::ffi::library::LibraryError;
use crate::ffi::mem_type::MemType;
use crate::ffi::status::Status;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong. Each variant names the operation and, where NIXL
/// reported it, NIXL's status, plus what to do about it where that is known.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// NIXL's C API library could not be loaded (not found, another release, or unusable);
    /// the message lists every place looked at and how to install NIXL.
    #[error(transparent)]
    Library(#[from] LibraryError),
    /// A NIXL call failed.
    #[error("{operation} failed: NIXL returned {status}{}", hint.map(|h| format!("; {h}")).unwrap_or_default())]
    Nixl {
        /// What was being done.
        operation: &'static str,
        /// The status NIXL returned.
        status: Status,
        /// What usually fixes it, where known.
        hint: Option<&'static str>,
    },
    /// An agent, plugin or remote-agent name was rejected before reaching NIXL.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        /// Which kind of name.
        what: &'static str,
        /// The rejected name (lossy if it was not UTF-8).
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// An argument was rejected before reaching NIXL.
    #[error("{operation}: {reason}")]
    InvalidArgument {
        /// What was being done.
        operation: &'static str,
        /// Why the argument is wrong.
        reason: String,
    },
    /// No plugin (backend) of that name can be loaded. The message suggests the available
    /// plugin whose name differs only in case, if there is one.
    #[error("NIXL plugin {name:?} is not available{}; available plugins: [{}]", same_but_case(name, available), available.join(", "))]
    UnknownPlugin {
        /// The requested plugin.
        name: String,
        /// The plugins NIXL found.
        available: Vec<String>,
    },
    /// The agent already has a backend of this plugin (NIXL makes one per plugin).
    #[error("{plugin} is already created on this agent ({agent:?}); use that backend (Agent::backends lists them)")]
    BackendExists {
        /// The plugin.
        plugin: String,
        /// The agent's name.
        agent: String,
    },
    /// A backend parameter the plugin does not define.
    #[error("plugin {plugin:?} has no parameter {key:?}; its parameters are: [{}]", known.join(", "))]
    UnknownBackendParam {
        /// The plugin.
        plugin: String,
        /// The unknown key.
        key: String,
        /// The keys the plugin defines.
        known: Vec<String>,
    },
    /// A backend parameter value the safe API refuses: NIXL is known to crash with it, or it
    /// would let a peer's metadata lead into this process unrecognised.
    #[error("plugin {plugin:?} parameter {key}={value:?} is refused: {reason}")]
    RefusedBackendParam {
        /// The plugin.
        plugin: String,
        /// The parameter.
        key: String,
        /// The refused value.
        value: String,
        /// Why, and what to do instead.
        reason: &'static str,
    },
    /// A descriptor list that must not be empty was empty.
    #[error("{operation}: the descriptor list is empty")]
    EmptyDescList {
        /// What was being done.
        operation: &'static str,
    },
    /// A descriptor covers zero bytes.
    #[error("{operation}: descriptor {index} has length 0")]
    ZeroLength {
        /// What was being done.
        operation: &'static str,
        /// Position of the descriptor in its list.
        index: usize,
    },
    /// A DRAM or VRAM descriptor has address 0.
    #[error("{operation}: descriptor {index} has a null address")]
    NullAddress {
        /// What was being done.
        operation: &'static str,
        /// Position of the descriptor in its list.
        index: usize,
    },
    /// A range is not inside the registered region it was taken from.
    #[error("{operation}: bytes {offset}..{end} are outside region {region} of the registration, which has {region_len} bytes", end = offset.saturating_add(*len))]
    OutOfBounds {
        /// What was being done.
        operation: &'static str,
        /// Region index within the registration.
        region: usize,
        /// Start of the requested range within the region.
        offset: usize,
        /// Length of the requested range.
        len: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// Local and remote sides of a transfer do not pair up.
    #[error("{operation}: {what}: local {local}, remote {remote}; both sides need the same number of descriptors of equal lengths")]
    LengthMismatch {
        /// What was being done.
        operation: &'static str,
        /// What differs (descriptor count, or the length of descriptor i).
        what: String,
        /// The local value.
        local: usize,
        /// The remote value.
        remote: usize,
    },
    /// Two things that must share a memory type do not.
    #[error("{operation}: expected {expected} memory, found {found}")]
    MemTypeMismatch {
        /// What was being done.
        operation: &'static str,
        /// The memory type required.
        expected: MemType,
        /// The memory type given.
        found: MemType,
    },
    /// An index into a list (a registration's regions, a prepared list) is out of range.
    #[error("{operation}: index {index} is out of range for the {len} {items}")]
    IndexOutOfRange {
        /// What was being done.
        operation: &'static str,
        /// The offending index.
        index: usize,
        /// Number of items in the list.
        len: usize,
        /// What the list holds, e.g. `regions of the registration`.
        items: &'static str,
    },
    /// A deadline passed before the operation finished.
    #[error("{operation}: not finished after {waited:?}; the request is still in flight and keeps its memory registered")]
    Timeout {
        /// What was being waited for.
        operation: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// Memory cannot be deregistered while transfers or descriptor lists still use it.
    #[error("deregister memory: still used by {users} descriptor list(s) or request(s); it is deregistered when the last of them is dropped")]
    RegistrationInUse {
        /// How many other holders there are.
        users: usize,
    },
    /// A platform device type nobody registered.
    #[error("unknown platform device type {device_type:?}; registered platforms: [{}]", known.join(", "))]
    UnknownDeviceType {
        /// The device type asked for.
        device_type: String,
        /// The registered device types.
        known: Vec<String>,
    },
    /// The platform does not support that kv-buffer device with NIXL.
    #[error("{device_type} with {kv_buffer_device} kv_buffer is not supported; supported kv_buffer devices: [{}]", supported.join(", "))]
    UnsupportedKvBufferDevice {
        /// The platform's device type.
        device_type: String,
        /// The kv-buffer device asked for.
        kv_buffer_device: String,
        /// What the platform supports.
        supported: Vec<String>,
    },
    /// Neither the platform nor the defaults say how NIXL sees this kv-buffer device.
    #[error("no NIXL memory type is known for kv_buffer_device {kv_buffer_device:?} (cuda -> VRAM, cpu -> DRAM); the platform must override it")]
    NoMemoryType {
        /// The kv-buffer device.
        kv_buffer_device: String,
    },
    /// A kv_transfer_config is malformed.
    #[error("kv_transfer_config: {reason}")]
    Config {
        /// What is wrong and where.
        reason: String,
    },
    /// VRAM was asked for on a machine with no usable CUDA device.
    #[error("{operation}: no CUDA device is present ({detail}); use kv_buffer_device \"cpu\" (DRAM) on this machine")]
    NoCudaDevice {
        /// What was being done.
        operation: &'static str,
        /// What was found instead.
        detail: String,
    },
    /// NIXL reported a memory type this crate does not know.
    #[error("{operation}: NIXL reported memory type {value}, which this crate does not know (DRAM=0, VRAM=1, BLOCK=2, OBJECT=3, FILE=4); update nixl-rs to match the NIXL library")]
    UnknownMemType {
        /// What was being done.
        operation: &'static str,
        /// The raw value.
        value: i64,
    },
    /// Remote metadata that NIXL 1.5.1's serializer could not have produced; it was
    /// rejected before NIXL parsed it (see [`validate_metadata`](crate::validate_metadata)).
    #[error("invalid metadata at byte {offset}: {reason}")]
    InvalidMetadata {
        /// Offset of the first offending byte.
        offset: usize,
        /// What is wrong there.
        reason: String,
    },
    /// Remote metadata whose UCX worker is in this process, under a name that is not the
    /// name of that worker's agent: loaded, it would let NIXL reach this process's own
    /// memory at addresses the peer chooses.
    #[error("load remote metadata: the metadata of agent {agent:?} leads into this process: {reason}; metadata of a worker of this process loads only under its own agent's name, so that no peer can make NIXL reach this process's own memory")]
    MetadataLeadsIntoThisProcess {
        /// The agent name the metadata declares.
        agent: String,
        /// What in it leads into this process.
        reason: String,
    },
    /// Remote metadata of an agent in another process offering a same-host transport (cma,
    /// posix, sysv, xpmem) on this host, refused by an agent built with
    /// [`AgentConfig::refuse_same_host_transports`](crate::AgentConfig::refuse_same_host_transports).
    #[error("load remote metadata: the metadata of agent {agent:?} offers {transport} on this host, and this agent refuses same-host transports (AgentConfig::refuse_same_host_transports): through them a peer can name another process of this host, whose memory this process would then move for the peer; run same-host peers with UCX_TLS=^cma,posix,sysv,xpmem, or build this agent without the setting")]
    SameHostTransportRefused {
        /// The agent name the metadata declares.
        agent: String,
        /// The transport address, as the error names it.
        transport: String,
    },
    /// An operating-system call failed.
    #[error("{operation}: {source}")]
    Io {
        /// What was being done.
        operation: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// NIXL's status, when NIXL reported the failure.
    pub fn status(&self) -> Option<Status> {
        match self {
            Error::Nixl { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// `" (did you mean \"UCX\"? plugin names are case-sensitive)"` when an available plugin's
/// name differs from `name` only in case; otherwise nothing.
fn same_but_case(name: &str, available: &[String]) -> String {
    available
        .iter()
        .find(|plugin| plugin.eq_ignore_ascii_case(name))
        .map(|plugin| format!(" (did you mean {plugin:?}? plugin names are case-sensitive)"))
        .unwrap_or_default()
}

/// Outcome of a call that may still be running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    Done,
    InProgress,
}

/// Turns a status into `Ok(())`, or an error naming `operation`. In-progress is an error here.
pub(crate) fn check(status: raw::Type, operation: &'static str) -> Result<()> {
    match check_progress(status, operation)? {
        Progress::Done => Ok(()),
        Progress::InProgress => Err(Error::Nixl {
            operation,
            status: Status::Other(status),
            hint: None,
        }),
    }
}

/// Like [`check`], with a hint attached to a given failure status.
pub(crate) fn check_hint(
    status: raw::Type,
    operation: &'static str,
    when: Status,
    hint: &'static str,
) -> Result<()> {
    check(status, operation).map_err(|err| with_hint(err, when, hint))
}

/// Turns a status into done / in progress, or an error naming `operation`.
pub(crate) fn check_progress(status: raw::Type, operation: &'static str) -> Result<Progress> {
    match status {
        raw::NIXL_CAPI_SUCCESS => Ok(Progress::Done),
        raw::NIXL_CAPI_IN_PROG => Ok(Progress::InProgress),
        code => Err(Error::Nixl {
            operation,
            status: Status::from_raw(code).unwrap_or(Status::Other(code)),
            hint: None,
        }),
    }
}

/// Adds `hint` to a NIXL error whose status is `when`.
pub(crate) fn with_hint(err: Error, when: Status, hint: &'static str) -> Error {
    match err {
        Error::Nixl {
            operation,
            status,
            hint: None,
        } if status == when => Error::Nixl {
            operation,
            status,
            hint: Some(hint),
        },
        other => other,
    }
}

/// Hint for a remote agent NIXL does not know.
pub(crate) const HINT_LOAD_REMOTE_MD: &str =
    "the remote agent's metadata is not loaded: call Agent::load_remote_metadata (or fetch_remote_metadata) first";

/// Hint for a request whose remote agent's metadata was invalidated after it was made
/// (NIXL refuses to post it rather than use the freed metadata).
pub(crate) const HINT_STALE_REQUEST: &str =
    "the remote agent's metadata was invalidated after this request was made: load it again if needed and make a new request";

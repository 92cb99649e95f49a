//! NIXL's status codes as a Rust type.

use std::fmt;

use nixl_capi_sys::nixl_capi_status_t as raw;

/// A failure status returned by NIXL's C API.
///
/// Success (`0`) and in-progress (`1`) are not failures and never appear here.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// `-1`: an argument was rejected (null, malformed, out of range, wrong type).
    InvalidParam,
    /// `-2`: a backend failed, or NIXL folded a more specific error into this one (NIXL 1.5.1
    /// reports "no backend can serve this request" this way).
    Backend,
    /// `-3`: the object is in a state that does not allow the call.
    InvalidState,
    /// `-4`: NIXL caught a C++ exception.
    Exception,
    /// `-5`: telemetry was requested but is not enabled on the agent.
    NoTelemetry,
    /// `-6`: not found, e.g. no metadata of that remote agent is loaded.
    NotFound,
    /// A code this version of the crate does not know.
    Other(i32),
}

impl Status {
    /// Converts a raw failure code; `None` for success and in-progress.
    pub fn from_raw(code: raw::Type) -> Option<Self> {
        Some(match code {
            raw::NIXL_CAPI_SUCCESS | raw::NIXL_CAPI_IN_PROG => return None,
            raw::NIXL_CAPI_ERROR_INVALID_PARAM => Status::InvalidParam,
            raw::NIXL_CAPI_ERROR_BACKEND => Status::Backend,
            raw::NIXL_CAPI_ERROR_INVALID_STATE => Status::InvalidState,
            raw::NIXL_CAPI_ERROR_EXCEPTION => Status::Exception,
            raw::NIXL_CAPI_ERROR_NO_TELEMETRY => Status::NoTelemetry,
            raw::NIXL_CAPI_ERROR_NOT_FOUND => Status::NotFound,
            other => Status::Other(other),
        })
    }

    /// The raw numeric code.
    pub fn code(self) -> i32 {
        match self {
            Status::InvalidParam => raw::NIXL_CAPI_ERROR_INVALID_PARAM,
            Status::Backend => raw::NIXL_CAPI_ERROR_BACKEND,
            Status::InvalidState => raw::NIXL_CAPI_ERROR_INVALID_STATE,
            Status::Exception => raw::NIXL_CAPI_ERROR_EXCEPTION,
            Status::NoTelemetry => raw::NIXL_CAPI_ERROR_NO_TELEMETRY,
            Status::NotFound => raw::NIXL_CAPI_ERROR_NOT_FOUND,
            Status::Other(code) => code,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Status::InvalidParam => "invalid parameter",
            Status::Backend => "backend error",
            Status::InvalidState => "invalid state",
            Status::Exception => "exception",
            Status::NoTelemetry => "telemetry not enabled",
            Status::NotFound => "not found",
            Status::Other(_) => "unknown status",
        };
        write!(f, "{name} ({})", self.code())
    }
}

//! What a request does and how: its direction ([`XferOp`]) and optional settings
//! ([`XferOptions`]).

use std::sync::Arc;

use nixl_capi_sys as sys;

use crate::agent::backend::{backend_args, Backend};
use crate::agent::AgentInner;
use crate::error::Result;
use crate::ffi::handles::OptArgs;

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

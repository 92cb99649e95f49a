//! Prepared descriptor lists: prepare once, then make requests from index slices.

use std::sync::Arc;

use crate::agent::backend::Backend;
use crate::agent::Agent;
use crate::descriptors::desc_list::{LocalDescList, RemoteDescList};
use crate::descriptors::prepared_handle::PreparedShared;
use crate::error::Result;
use crate::ffi::raw::c_name;

/// A local descriptor list prepared for repeated requests (vLLM's pattern).
///
/// It holds the registrations of its memory, like [`LocalDescList`].
#[derive(Clone)]
pub struct PreparedLocal {
    pub(crate) shared: Arc<PreparedShared>,
}

/// A remote agent's descriptor list prepared for repeated requests.
#[derive(Clone)]
pub struct PreparedRemote {
    pub(crate) shared: Arc<PreparedShared>,
    pub(crate) remote_agent: String,
}

impl std::fmt::Debug for PreparedLocal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedLocal")
            .field("descs", &self.shared.lens.len())
            .finish()
    }
}

impl std::fmt::Debug for PreparedRemote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedRemote")
            .field("remote_agent", &self.remote_agent)
            .field("descs", &self.shared.lens.len())
            .finish()
    }
}

impl PreparedLocal {
    /// Number of descriptors (valid indices are `0..len()`).
    pub fn len(&self) -> usize {
        self.shared.lens.len()
    }

    /// Whether the list has no descriptors.
    pub fn is_empty(&self) -> bool {
        self.shared.lens.is_empty()
    }
}

impl PreparedRemote {
    /// Number of descriptors (valid indices are `0..len()`).
    pub fn len(&self) -> usize {
        self.shared.lens.len()
    }

    /// Whether the list has no descriptors.
    pub fn is_empty(&self) -> bool {
        self.shared.lens.is_empty()
    }

    /// The agent whose memory the list describes.
    pub fn remote_agent(&self) -> &str {
        &self.remote_agent
    }
}

impl Agent {
    /// Prepares a local list once, for many requests made with [`Agent::make_xfer_req`].
    pub fn prepare_local(
        &self,
        list: &LocalDescList,
        backends: &[&Backend],
    ) -> Result<PreparedLocal> {
        list.check_owner("prepare descriptor list", &self.inner)?;
        let shared = self.prepare("", &list.list, backends, list.holds())?;
        Ok(PreparedLocal { shared })
    }

    /// Prepares a list of `remote_agent`'s memory (its metadata must be loaded).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming the first descriptor
    /// outside the remote agent's memory, as [`Agent::create_xfer_req`] checks it;
    /// [`Error::Nixl`](crate::Error::Nixl) if NIXL refuses.
    pub fn prepare_remote(
        &self,
        remote_agent: &str,
        list: &RemoteDescList,
        backends: &[&Backend],
    ) -> Result<PreparedRemote> {
        const OP: &str = "prepare descriptor list";
        c_name("remote agent name", remote_agent)?;
        let targets = list.hold_targets(OP, &self.inner.loaded, remote_agent)?;
        let shared = self.prepare(remote_agent, &list.list, backends, targets)?;
        Ok(PreparedRemote {
            shared,
            remote_agent: remote_agent.to_string(),
        })
    }
}

//! What valid metadata says about its agent, for the checks that follow a load: its name,
//! its UCX worker and the memory it advertises.

use super::layout::{self, BasicDesc, Visitor};
use super::reader::Parsed;
use super::ucx_transports::Worker;
use crate::ffi::mem_type::MemType;

/// Metadata of a remote agent, checked and taken apart.
#[derive(Debug, Default)]
pub(crate) struct PeerMetadata<'a> {
    /// The agent's name.
    pub name: &'a str,
    /// Its UCX worker, when the metadata carries UCX connection info.
    pub worker: Option<Worker>,
    /// The memory its sections advertise (every backend's, in order).
    pub regions: Vec<Advertised>,
}

/// One descriptor the metadata advertises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Advertised {
    /// The section's memory type.
    pub mem_type: MemType,
    /// Address, length and device id.
    pub desc: BasicDesc,
}

impl<'a> Visitor<'a> for PeerMetadata<'a> {
    fn agent_name(&mut self, name: &'a str) {
        self.name = name;
    }

    fn ucx_worker(&mut self, worker: Worker) {
        self.worker = Some(worker);
    }

    fn descriptor(&mut self, mem_type: u32, desc: BasicDesc) {
        // Memory types were checked to be NIXL's (0..=4), in its order.
        if let Some(&mem_type) = usize::try_from(mem_type)
            .ok()
            .and_then(|at| MemType::ALL.get(at))
        {
            self.regions.push(Advertised { mem_type, desc });
        }
    }
}

/// Checks `bytes` as [`layout::check`] does and takes them apart.
pub(crate) fn inspect(bytes: &[u8]) -> Parsed<PeerMetadata<'_>> {
    let mut peer = PeerMetadata::default();
    layout::walk(bytes, &mut peer)?;
    Ok(peer)
}

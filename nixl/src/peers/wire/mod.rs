//! Validation of untrusted agent metadata before NIXL parses it.
//!
//! NIXL 1.5.1 and its bundled UCX 1.23 trust the metadata bytes they load: a wrong memory
//! type, a bad UCX address version or a length past the end crashes the process. This
//! module parses the serialized format in safe Rust (no panics, no allocation sized by
//! the input) and rejects anything NIXL's serializer could not have produced: the
//! container ([`serdes`]), the agent name, connection info and memory sections
//! ([`layout`]), the UCX worker address ([`ucx_address`]), what each of its transport
//! addresses leads to ([`ucx_transports`]) and UCX remote keys ([`ucx_rkey`]). Connection
//! info and descriptor blobs of backends other than UCX are only bounds-checked: NIXL hands
//! them to that backend's plugin as they are. [`peer`] takes valid metadata apart (name,
//! UCX worker, advertised memory) for the checks of a load, and [`loaded`] keeps what an
//! agent learned from each remote agent's metadata.

mod layout;
mod loaded;
mod peer;
mod reader;
mod serdes;
mod ucx_address;
mod ucx_rkey;
mod ucx_transports;

use crate::error::{Error, Result};

pub(crate) use loaded::{AdvertisedIndex, LoadedMetadata, PeerKind};
pub(crate) use peer::PeerMetadata;
#[cfg(test)]
pub(crate) use ucx_transports::ROOT_PID_NS;
pub(crate) use ucx_transports::{Destination, Host, Worker};

/// Checks that `metadata` is well-formed NIXL 1.5.1 agent metadata (full, partial or
/// connection-only) with well-formed UCX connection info and remote keys.
///
/// [`Agent::load_remote_metadata`](crate::Agent::load_remote_metadata) calls this before
/// NIXL sees the bytes; call it yourself to vet bytes before storing or forwarding them.
///
/// # Errors
/// [`Error::InvalidMetadata`] with the offset of the first offending byte and the reason.
pub fn validate_metadata(metadata: &[u8]) -> Result<()> {
    layout::check(metadata).map_err(invalid)
}

/// The name of the agent whose metadata `metadata` is, once it is checked as
/// [`Agent::load_remote_metadata`](crate::Agent::load_remote_metadata) checks it: e.g. to
/// tell, before loading, whether metadata of that agent is loaded already.
///
/// # Errors
/// As [`validate_metadata`], and [`Error::InvalidMetadata`] for a UCX transport address
/// shorter than what UCX reads of it.
pub fn metadata_agent_name(metadata: &[u8]) -> Result<String> {
    inspect_metadata(metadata).map(|peer| peer.name.to_string())
}

/// Checks `metadata` as [`validate_metadata`] does and takes it apart.
///
/// # Errors
/// As [`validate_metadata`], and [`Error::InvalidMetadata`] for a UCX transport address
/// shorter than what UCX reads of it.
pub(crate) fn inspect_metadata(metadata: &[u8]) -> Result<PeerMetadata<'_>> {
    peer::inspect(metadata).map_err(invalid)
}

fn invalid(reject: reader::Reject) -> Error {
    Error::InvalidMetadata {
        offset: reject.offset,
        reason: reject.reason,
    }
}

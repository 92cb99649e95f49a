//! Validation of untrusted agent metadata before NIXL parses it.
//!
//! NIXL 1.5.1 and its bundled UCX 1.23 trust the metadata bytes they load: a wrong memory
//! type, a bad UCX address version or a length past the end crashes the process. This
//! module parses the serialized format in safe Rust (no panics, no allocation sized by
//! the input) and rejects anything NIXL's serializer could not have produced: the
//! container ([`serdes`]), the agent name, connection info and memory sections
//! ([`layout`]), the UCX worker address ([`ucx_address`]) and UCX remote keys
//! ([`ucx_rkey`]). Connection info and descriptor blobs of backends other than UCX are
//! only bounds-checked: NIXL hands them to that backend's plugin as they are.

mod layout;
mod loaded;
mod reader;
mod serdes;
mod ucx_address;
mod ucx_rkey;

use crate::error::{Error, Result};

pub(crate) use loaded::LoadedMetadata;

/// Checks that `metadata` is well-formed NIXL 1.5.1 agent metadata (full, partial or
/// connection-only) with well-formed UCX connection info and remote keys.
///
/// [`Agent::load_remote_metadata`](crate::Agent::load_remote_metadata) calls this before
/// NIXL sees the bytes; call it yourself to vet bytes before storing or forwarding them.
///
/// # Errors
/// [`Error::InvalidMetadata`] with the offset of the first offending byte and the reason.
pub fn validate_metadata(metadata: &[u8]) -> Result<()> {
    layout::check(metadata).map_err(|reject| Error::InvalidMetadata {
        offset: reject.offset,
        reason: reject.reason,
    })
}

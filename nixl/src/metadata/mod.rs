//! Metadata: exchanging it with remote agents, validating the untrusted bytes before NIXL
//! parses them (`wire`), deciding whether they lead into this process, and the hints added
//! to failures about a remote agent.

pub(crate) mod designation;
pub(crate) mod exchange;
pub(crate) mod peer_hints;
pub(crate) mod process_endpoints;
pub(crate) mod wire;

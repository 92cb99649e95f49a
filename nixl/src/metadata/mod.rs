//! Metadata: exchanging it with remote agents, validating the untrusted bytes before NIXL
//! parses them (`wire`), deciding whether they lead into this process (at the load, and again
//! at a request once this process's workers changed), and the hints added to failures about
//! a remote agent.

pub(crate) mod designation;
pub(crate) mod exchange;
pub(crate) mod peer_hints;
pub(crate) mod process_endpoints;
pub(crate) mod recheck;
pub(crate) mod same_host;
pub(crate) mod wire;

//! What is known of other agents, below the agent that uses it: their metadata validated
//! before NIXL parses it (`wire`), the agents of this process and the registrations a
//! transfer to them holds, this process's endpoints, whether metadata leads into this
//! process (at the load, and again at a request once this process's workers changed), and
//! peers' same-host transports.

pub(crate) mod designation;
pub(crate) mod local_peers;
pub(crate) mod process_endpoints;
pub(crate) mod recheck;
pub(crate) mod region_index;
pub(crate) mod same_host;
pub(crate) mod wire;

//! Transfers: what a request does and how, making requests, the request itself, awaiting
//! it through the agent's completion driver, counting what was leaked, and the agents of
//! this process whose registrations a transfer to them holds.

pub(crate) mod completion;
pub(crate) mod driver;
pub(crate) mod driver_stats;
pub(crate) mod leaks;
pub(crate) mod local_peers;
pub(crate) mod options;
pub(crate) mod requests;
pub(crate) mod xfer;

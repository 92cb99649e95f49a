//! Transfers: what a request does and how, making requests (from plain or prepared lists),
//! the request itself, and awaiting it through the agent's completion driver.

pub(crate) mod completion;
pub(crate) mod options;
pub(crate) mod prepared_requests;
pub(crate) mod requests;
pub(crate) mod xfer;

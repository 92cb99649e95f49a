//! Descriptor lists: plain lists built from registrations or remote addresses, the C lists
//! beneath them, lists prepared once for many requests, the state a list keeps to be
//! prepared when it is reused, and memory views of lists for device-initiated transfers.

pub(crate) mod desc_list;
pub(crate) mod mem_view;
pub(crate) mod prepared;
pub(crate) mod prepared_handle;
pub(crate) mod reuse;
pub(crate) mod xfer_dlist;

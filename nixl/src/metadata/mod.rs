//! Metadata exchange: the agent's own metadata, and loading, checking and invalidating
//! remote agents' (validated and checked for where it leads by `peers` first), directly or
//! through NIXL's socket listener and etcd.

pub(crate) mod exchange;

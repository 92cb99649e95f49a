//! Notifications: sending them, taking them out of NIXL's C map, and awaiting them (the
//! hub that hands each message to one waiting task is the agent's, fed by its driver).

pub(crate) mod notif_map;
pub(crate) mod notification;
pub(crate) mod notification_wait;

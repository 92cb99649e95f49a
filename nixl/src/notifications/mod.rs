//! Notifications: sending them, taking them out of NIXL's C map, the hub that hands each
//! message to one waiting task, and awaiting them.

pub(crate) mod notif_map;
pub(crate) mod notification;
pub(crate) mod notification_wait;
pub(crate) mod notify_hub;

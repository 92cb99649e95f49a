//! Taking notifications out of NIXL: its notification map, read out with the exact bytes
//! of each sender's name.

use std::ffi::CStr;
use std::ptr;

use crate::agent::backend::{backend_args, Backend};
use crate::agent::notify_hub::Notification;
use crate::agent::AgentInner;
use crate::error::{check, Result};
use crate::ffi::handles::{NotifMap, OptArgs};
use crate::ffi::library::capi;

impl NotifMap {
    fn new() -> Result<Self> {
        // SAFETY: NIXL stores a new handle through the out-pointer.
        NotifMap::create("create notification map", |out| unsafe {
            capi().nixl_capi_create_notif_map(out)
        })
    }

    /// Copies every message out, with the exact bytes of each sender's name, in arrival
    /// order per sender.
    fn take(&self) -> Result<Vec<Notification>> {
        const OP: &str = "read notifications";
        let mut agents = 0;
        // SAFETY: live map.
        check(
            unsafe { capi().nixl_capi_notif_map_size(self.raw(), &mut agents) },
            OP,
        )?;
        let mut out = Vec::new();
        for index in 0..agents {
            let mut name_ptr = ptr::null();
            // SAFETY: index < size; the name is borrowed from the map and used below only.
            check(
                unsafe {
                    capi().nixl_capi_notif_map_get_agent_at(self.raw(), index, &mut name_ptr)
                },
                OP,
            )?;
            if name_ptr.is_null() {
                continue;
            }
            // SAFETY: a NUL-terminated string owned by the map, which outlives this loop.
            let name = unsafe { CStr::from_ptr(name_ptr) };
            let mut count = 0;
            // SAFETY: live map and a name it contains.
            check(
                unsafe {
                    capi().nixl_capi_notif_map_get_notifs_size(
                        self.raw(),
                        name.as_ptr(),
                        &mut count,
                    )
                },
                OP,
            )?;
            for n in 0..count {
                let (mut data, mut len) = (ptr::null(), 0);
                // SAFETY: n < count; the bytes are borrowed from the map and copied at once.
                check(
                    unsafe {
                        capi().nixl_capi_notif_map_get_notif(
                            self.raw(),
                            name.as_ptr(),
                            n,
                            &mut data,
                            &mut len,
                        )
                    },
                    OP,
                )?;
                let message = if data.is_null() {
                    Vec::new()
                } else {
                    // SAFETY: `len` bytes at `data`, owned by the map.
                    unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec()
                };
                out.push(Notification {
                    sender: name.to_bytes().to_vec(),
                    message,
                });
            }
        }
        Ok(out)
    }
}

/// Optional arguments naming `backends`, or none (NIXL's defaults) for an empty slice.
pub(crate) fn optional_backend_args(
    agent: &AgentInner,
    operation: &'static str,
    backends: &[&Backend],
) -> Result<Option<OptArgs>> {
    if backends.is_empty() {
        Ok(None)
    } else {
        backend_args(agent, operation, backends).map(Some)
    }
}

/// Takes the notifications NIXL holds for `agent` (through `backends`; empty: all).
pub(crate) fn take_from_nixl(
    agent: &AgentInner,
    backends: &[&Backend],
) -> Result<Vec<Notification>> {
    let map = NotifMap::new()?;
    let args = optional_backend_args(agent, "get notifications", backends)?;
    // SAFETY: live agent and map; args null or live.
    let status = agent.with(|raw| unsafe {
        capi().nixl_capi_get_notifs(raw, map.raw(), OptArgs::ptr(args.as_ref()))
    });
    check(status, "get notifications")?;
    map.take()
}

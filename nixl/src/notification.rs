//! Notifications: small byte messages between agents, delivered through the backends.

use std::collections::HashMap;
use std::ffi::CStr;
use std::ptr;

use nixl_sys as sys;

use crate::agent::{Agent, AgentInner};
use crate::backend::backend_args;
use crate::backend::Backend;
use crate::driver::lock;
use crate::error::{check, Result};
use crate::handles::{NotifMap, OptArgs};
use crate::notify_hub::{self, Notification};
use crate::raw::c_name;

/// New notifications, by sending agent, in arrival order. Messages are arbitrary bytes.
pub type Notifications = HashMap<String, Vec<Vec<u8>>>;

impl NotifMap {
    fn new() -> Result<Self> {
        // SAFETY: NIXL stores a new handle through the out-pointer.
        NotifMap::create("create notification map", |out| unsafe {
            sys::nixl_capi_create_notif_map(out)
        })
    }

    /// Copies every message out, with the exact bytes of each sender's name, in arrival
    /// order per sender.
    fn take(&self) -> Result<Vec<Notification>> {
        const OP: &str = "read notifications";
        let mut agents = 0;
        // SAFETY: live map.
        check(
            unsafe { sys::nixl_capi_notif_map_size(self.raw(), &mut agents) },
            OP,
        )?;
        let mut out = Vec::new();
        for index in 0..agents {
            let mut name_ptr = ptr::null();
            // SAFETY: index < size; the name is borrowed from the map and used below only.
            check(
                unsafe { sys::nixl_capi_notif_map_get_agent_at(self.raw(), index, &mut name_ptr) },
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
                    sys::nixl_capi_notif_map_get_notifs_size(self.raw(), name.as_ptr(), &mut count)
                },
                OP,
            )?;
            for n in 0..count {
                let (mut data, mut len) = (ptr::null(), 0);
                // SAFETY: n < count; the bytes are borrowed from the map and copied at once.
                check(
                    unsafe {
                        sys::nixl_capi_notif_map_get_notif(
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
fn optional_backend_args(
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

impl Agent {
    /// Sends `message` (any bytes) to `remote_agent`, whose metadata must be loaded.
    pub fn send_notification(&self, remote_agent: &str, message: &[u8]) -> Result<()> {
        self.send_notification_via(remote_agent, message, &[])
    }

    /// Sends `message` to `remote_agent` through one of `backends` (empty: NIXL chooses).
    pub fn send_notification_via(
        &self,
        remote_agent: &str,
        message: &[u8],
        backends: &[&Backend],
    ) -> Result<()> {
        let name = c_name("remote agent name", remote_agent)?;
        let args = optional_backend_args(&self.inner, "send notification", backends)?;
        let status = self.inner.with(|agent| {
            // SAFETY: live agent, valid C string, `message` valid for its length.
            unsafe {
                sys::nixl_capi_gen_notif(
                    agent,
                    name.as_ptr(),
                    message.as_ptr().cast(),
                    message.len(),
                    OptArgs::ptr(args.as_ref()),
                )
            }
        });
        check(status, "send notification")
            .map_err(|err| self.hint_for_peer(err, remote_agent, None))
    }

    /// Takes every notification that arrived since the last call.
    ///
    /// Once any task awaits notifications ([`Agent::notification`],
    /// [`Agent::notification_stream`]), NIXL's notifications go through the agent's hub:
    /// this call then returns those that no waiter or stream takes, so no message is lost
    /// or seen twice. Sender names that are not UTF-8 appear lossily here; the async API
    /// keeps their exact bytes.
    pub fn notifications(&self) -> Result<Notifications> {
        self.notifications_via(&[])
    }

    /// Takes the notifications that arrived through `backends` (empty: every backend).
    pub fn notifications_via(&self, backends: &[&Backend]) -> Result<Notifications> {
        let notes = match self.inner.active_hub() {
            Some(shared) if backends.is_empty() => {
                notify_hub::pull(&self.inner, &shared)?;
                lock(&shared.hub).take_unclaimed()
            }
            _ => take_from_nixl(&self.inner, backends)?,
        };
        let mut by_sender = Notifications::new();
        for note in notes {
            by_sender
                .entry(String::from_utf8_lossy(&note.sender).into_owned())
                .or_default()
                .push(note.message);
        }
        if !by_sender.is_empty() {
            tracing::trace!(agent = %self.inner.name, senders = by_sender.len(), "received notifications");
        }
        Ok(by_sender)
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
        sys::nixl_capi_get_notifs(raw, map.raw(), OptArgs::ptr(args.as_ref()))
    });
    check(status, "get notifications")?;
    map.take()
}

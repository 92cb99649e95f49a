//! Notifications: small byte messages between agents, delivered through the backends.

use std::collections::HashMap;

use crate::agent::backend::Backend;
use crate::agent::driver::lock;
use crate::agent::Agent;
use crate::error::{check, Result};
use crate::ffi::handles::OptArgs;
use crate::ffi::library::capi;
use crate::ffi::raw::c_name;
use crate::notifications::notif_map::{optional_backend_args, take_from_nixl};

/// New notifications, by sending agent, in arrival order. Messages are arbitrary bytes.
pub type Notifications = HashMap<String, Vec<Vec<u8>>>;

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
                capi().nixl_capi_gen_notif(
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
                shared.pull()?;
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

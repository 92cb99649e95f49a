//! How a worker's side channel answers readers' claims on requests kept for a read-back: it
//! reaches the worker's held requests ([`Sends::claim`](crate::worker::sending::Sends)).

use std::sync::Weak;
use std::time::Instant;

use crate::transport::handshake::KeptClaim;
use crate::transport::side_channel::KeptRequests;
use crate::worker::shared::Shared;

/// The worker's held requests as its side channel reaches them to answer claims: through a
/// weak reference, so that the side channel (part of the worker) does not keep the worker's
/// parts alive.
pub(crate) struct ClaimsOf(pub(crate) Weak<Shared>);

impl KeptRequests for ClaimsOf {
    fn claim(&self, reader: &[u8], claims: &[KeptClaim]) -> Vec<String> {
        let Some(shared) = self.0.upgrade() else {
            return Vec::new();
        };
        let claimed = shared.sends.lock().claim(reader, claims, Instant::now());
        claimed
    }
}

//! Limits of vLLM's side channel, on both ends.

use std::time::Duration;

/// Caps and deadlines of the vLLM side channel ([`MetadataClient`](super::MetadataClient)
/// and [`MetadataServer`](super::MetadataServer)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VllmChannelLimits {
    /// Largest handshake payload a client takes, in bytes (the payload frame).
    pub max_payload: usize,
    /// Largest request a server takes, in bytes (a real one has about 20).
    pub max_request: usize,
    /// Total time for one exchange: a client's connect and ZMTP handshake, then each
    /// request and its reply (vLLM's decode waits 5 s for a reply); a server's ZMTP
    /// handshake, and each reply it writes.
    pub deadline: Duration,
    /// How long a server keeps a connection that has not sent (all of) its next request.
    pub idle: Duration,
    /// Most connections a server holds. A connection beyond it closes the least recently
    /// active connection that is not being answered, so idle peers never lock out prompt
    /// ones.
    pub max_connections: usize,
}

impl Default for VllmChannelLimits {
    /// 16 MiB payloads, 1 KiB requests, 5 s per exchange, 30 s idle, 64 connections.
    fn default() -> Self {
        VllmChannelLimits {
            max_payload: 16 << 20,
            max_request: 1024,
            deadline: Duration::from_secs(5),
            idle: Duration::from_secs(30),
            max_connections: 64,
        }
    }
}

//! What crosses between engines, and how, in the connector's native protocol: the
//! handshake message and the transfer params; framed MessagePack (`wire`); the side channel
//! with its shared-secret authentication and sealing, network allowlist, cap on handshakes
//! in progress, accepted readers and counted refusals; the release marks that tell a reader
//! whether its READ outlived the lease; and agent metadata through etcd, with
//! etcd's authentication and TLS, sealed under the shared secret when there is one.

pub mod auth;
pub mod capability;
pub mod etcd;
pub(crate) mod etcd_auth;
pub(crate) mod etcd_tls;
pub mod handshake;
pub(crate) mod params;
pub mod peer_networks;
pub mod pending;
pub(crate) mod push_wire;
pub(crate) mod readers;
pub mod refusals;
pub mod release_marks;
pub(crate) mod sealing;
pub mod side_channel;
pub(crate) mod wire;

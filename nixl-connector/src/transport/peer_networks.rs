//! The networks a side channel answers (an allowlist of CIDR blocks), checked when a
//! connection is accepted, for both protocols' listeners; and the warning for a listener
//! open to any network with nothing else guarding it.

use std::net::{IpAddr, SocketAddr};

use nixl::kv_config::KvTransferConfig;
use serde_json::Value;

use crate::error::{Error, Result};

/// The `kv_connector_extra_config` key listing the peer networks a side channel answers,
/// e.g. `["10.0.0.0/8", "fd00::/8"]`.
pub const ALLOWED_PEERS_KEY: &str = "allowed_peer_networks";

/// One network in CIDR notation, e.g. `10.1.0.0/16` or `fd00::/8`; an address without a
/// prefix length is the one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerNetwork {
    addr: IpAddr,
    prefix: u8,
}

impl PeerNetwork {
    /// Whether `ip` is in this network (an IPv4 address mapped into IPv6 counts as the IPv4
    /// address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::str::FromStr for PeerNetwork {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let bad = |why: String| {
            Error::invalid(
                "read a peer network",
                format!("{text:?}: {why}; write a network as ADDRESS/PREFIX, e.g. 10.0.0.0/8 or fd00::/8"),
            )
        };
        let (addr, prefix) = match text.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (text, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| bad("not an IP address".into()))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix =
            match prefix {
                None => max,
                Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(|| {
                    bad(format!("the prefix length is not a number from 0 to {max}"))
                })?,
            };
        Ok(PeerNetwork { addr, prefix })
    }
}

impl std::fmt::Display for PeerNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// The networks a side channel answers: any (`None` networks, the default) or only those
/// listed. A connection from elsewhere is closed as it is accepted, before a byte is read
/// or sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerNetworks(Option<Vec<PeerNetwork>>);

impl PeerNetworks {
    /// Only the peers in `networks` (none, when empty).
    pub fn only(networks: Vec<PeerNetwork>) -> Self {
        PeerNetworks(Some(networks))
    }

    /// The allowlist of `kv_connector_extra_config.allowed_peer_networks` (a list of CIDR
    /// strings); any network when the key is absent.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value that is not a list of strings, or a network
    /// that does not parse.
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Self> {
        let Some(value) = config.kv_connector_extra_config.get(ALLOWED_PEERS_KEY) else {
            return Ok(PeerNetworks::default());
        };
        let not_a_list = || {
            Error::invalid(
                "read the peer networks",
                format!("kv_connector_extra_config.{ALLOWED_PEERS_KEY} is {value}; give a list of networks, e.g. [\"10.0.0.0/8\"]"),
            )
        };
        let Value::Array(items) = value else {
            return Err(not_a_list());
        };
        let networks = items
            .iter()
            .map(|item| item.as_str().ok_or_else(not_a_list)?.parse())
            .collect::<Result<Vec<_>>>()?;
        Ok(PeerNetworks::only(networks))
    }

    /// Whether only listed networks are answered.
    pub fn is_restricted(&self) -> bool {
        self.0.is_some()
    }

    /// Whether a peer at `ip` is answered.
    pub fn allows(&self, ip: IpAddr) -> bool {
        self.0
            .as_ref()
            .map_or(true, |networks| networks.iter().any(|n| n.contains(ip)))
    }
}

/// Warns when `listener` (named `what`) is bound to an address other than loopback and
/// neither a secret (`authenticated`) nor an allowlist guards it.
pub(crate) fn warn_if_open(
    what: &str,
    listener: SocketAddr,
    authenticated: bool,
    peers: &PeerNetworks,
) {
    if !listener.ip().is_loopback() && !authenticated && !peers.is_restricted() {
        tracing::warn!(%listener, "{what} listens on a non-loopback address with neither a shared secret nor an allowlist of peer networks: anyone who reaches it gets this engine's agent metadata and can read and write its registered KV cache; set kv_connector_extra_config.{ALLOWED_PEERS_KEY} (and, in the native protocol, a shared secret), or bind a loopback or private interface");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_parse_and_contain() {
        let net: PeerNetwork = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains("10.1.200.3".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.0.1".parse().unwrap()));
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(!net.contains("::1".parse().unwrap()));
        let any: PeerNetwork = "0.0.0.0/0".parse().unwrap();
        assert!(any.contains("192.0.2.1".parse().unwrap()));
        let one: PeerNetwork = "127.0.0.1".parse().unwrap();
        assert_eq!(one.to_string(), "127.0.0.1/32");
        assert!(!one.contains("127.0.0.2".parse().unwrap()));
        let v6: PeerNetwork = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("fe80::1".parse().unwrap()));
        for bad in [
            "10.0.0.0/33",
            "fd00::/129",
            "10.0.0/8",
            "x/1",
            "10.0.0.0/-1",
            "",
        ] {
            assert!(bad.parse::<PeerNetwork>().is_err(), "{bad}");
        }
        assert!(PeerNetworks::default().allows("192.0.2.1".parse().unwrap()));
        assert!(!PeerNetworks::only(vec![]).allows("127.0.0.1".parse().unwrap()));
    }
}

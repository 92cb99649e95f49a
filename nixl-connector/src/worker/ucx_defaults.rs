//! The UCX settings a worker's UCX backend gets unless the `kv_transfer_config` sets them:
//! how fast a dead peer's operations end, that a peer's failure is an error of its own
//! endpoints rather than of the process, and how large a piece of a READ over TCP is.
//!
//! Measured over TCP between network namespaces (`tests/network_faults/`, the figures in
//! `bench/results/network-faults.md`), with UCX's own defaults:
//! - a READ from a prefill behind a partition stays in flight as long as the partition
//!   lasts (100 s here): TCP retransmits for many minutes (`tcp_retries2`, 15 by default)
//!   before it gives up, and UCX's keepalive only adds data to retransmit;
//! - a decode that dies while the link is down can make the prefill abort when the link
//!   comes back: the dead decode's kernel still delivers its last GET requests and then
//!   resets the connection, and UCX 1.23's software GET over TCP (`ucp_get_req_handler`),
//!   failing to send the reply, calls `ucs_fatal` ("Endpoint timeout").
//!
//! TCP's user timeout makes each kernel drop a connection whose data stays unacknowledged
//! for that long, and UCX's keepalive puts data on every connection each interval, so a
//! READ whose peer vanished ends within about their sum, and a partition longer than the
//! user timeout ends both sides' connection before the link returns (the prefill then has
//! nothing left to answer). A decode that dies behind a partition shorter than the user
//! timeout can still abort the prefill: no UCX setting reaches that path.
//!
//! UCX's TCP transport has no READ of its own: UCX emulates one with active messages (the
//! decode asks; the prefill's UCX copies the data into messages of at most its TCP send
//! segment and sends them; the decode's copies them out of its receive segments). UCX's
//! 8 KiB send segment cuts a 256 KiB run of blocks into 32 messages; 64 KiB cuts it into 4,
//! which doubled the demo's READs across network namespaces (`bench/results/cross-host.md`).
//! It goes no higher because UCX trusts each message to fit the peer's receive segment, 64
//! KiB unless the peer changed it (a vLLM engine's NIXL keeps it): a prefill sending 256
//! KiB messages corrupted the heap of a decode with UCX's defaults, which then crashed
//! (`tests/tcp_segments.rs`). Engines that all raise both segments may go further. The
//! segment sizes only matter to the TCP transport: shared memory and RDMA do not use them.
//!
//! Each default is one `KEY=VALUE` of the UCX backend's `engine_config` (NIXL hands them to
//! `ucp_config_modify`; an environment variable `UCX_<KEY>` still wins), plus NIXL's own
//! `ucx_error_handling_mode`. `kv_connector_extra_config.backend_params.UCX` overrides any
//! of them: a key its `engine_config` names, or its own `ucx_error_handling_mode`.

use nixl::kv_config::KvTransferConfig;
use serde_json::{Map, Value};

use crate::error::Result;

/// TCP's user timeout: how long data may stay unacknowledged before TCP drops the
/// connection (Linux's `TCP_USER_TIMEOUT`; UCX's default leaves the kernel's
/// retransmissions, `tcp_retries2`).
pub(crate) const TCP_USER_TIMEOUT: &str = "10s";

/// UCX's keepalive interval: how often UCX sends on each endpoint's connection, so that
/// an idle connection to a vanished peer has unacknowledged data for the user timeout to
/// end (UCX's default is 20 s). Over TCP, UCX also turns on the kernel's keepalive (idle
/// 10 s by default, UCX's `TCP_KEEPIDLE`) on the sockets it connects, but not on those it
/// accepts: an accepted socket whose peer timed out stays half open (see the README's
/// "Network failures").
pub(crate) const KEEPALIVE_INTERVAL: &str = "5s";

/// The TCP transport's send segment: the largest piece of a READ's data one message
/// carries (UCX's default is 8 KiB), and the most a peer with UCX's default receive segment
/// can take.
pub(crate) const TCP_TX_SEG_SIZE: &str = "64k";

/// NIXL's UCX error handling mode: `peer`, so that a peer's failure fails that peer's
/// requests (NIXL 1.5.1's own default, set here so that another build's cannot change it).
pub(crate) const ERROR_HANDLING_MODE: &str = "peer";

/// The `engine_config` settings of the UCX backend, in order.
fn engine_defaults() -> [(&'static str, &'static str); 3] {
    [
        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT),
        ("KEEPALIVE_INTERVAL", KEEPALIVE_INTERVAL),
        ("TCP_TX_SEG_SIZE", TCP_TX_SEG_SIZE),
    ]
}

/// `config` with the connector's UCX defaults added to
/// `kv_connector_extra_config.backend_params.UCX` where it does not set them; unchanged
/// when the config creates no UCX backend.
///
/// # Errors
/// [`Error::Config`](crate::Error) (through `nixl`) for a malformed `backends` list or
/// `backend_params` map.
pub(crate) fn with_ucx_defaults(config: &KvTransferConfig) -> Result<KvTransferConfig> {
    if !config.backends()?.iter().any(|b| b == "UCX") {
        return Ok(config.clone());
    }
    let mut params = config.backend_params("UCX")?;
    let engine_config = params.entry("engine_config".to_string()).or_default();
    for (key, value) in engine_defaults() {
        let named = engine_config
            .split(',')
            .any(|setting| setting.split('=').next().map(str::trim) == Some(key));
        if named {
            continue;
        }
        if !engine_config.trim().is_empty() {
            engine_config.push(',');
        }
        engine_config.push_str(&format!("{key}={value}"));
    }
    let mode = params
        .entry("ucx_error_handling_mode".to_string())
        .or_insert_with(|| ERROR_HANDLING_MODE.to_string());
    if mode != ERROR_HANDLING_MODE {
        tracing::warn!(
            mode = %mode,
            "kv_connector_extra_config.backend_params.UCX sets ucx_error_handling_mode other \
             than peer: UCX's handling of a failed peer is then not what the connector was \
             tested with"
        );
    }
    let mut config = config.clone();
    let extra = &mut config.kv_connector_extra_config;
    let all = extra
        .entry("backend_params")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(all) = all {
        let ucx = params
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect::<Map<_, _>>();
        all.insert("UCX".to_string(), Value::Object(ucx));
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ucx_params(extra: Value) -> std::collections::BTreeMap<String, String> {
        let json = serde_json::json!({"kv_connector_extra_config": extra}).to_string();
        let config = KvTransferConfig::from_json(&json).unwrap();
        with_ucx_defaults(&config)
            .unwrap()
            .backend_params("UCX")
            .unwrap()
    }

    #[test]
    fn ucx_gets_the_defaults_unless_the_config_sets_them() {
        let params = ucx_params(serde_json::json!({}));
        assert_eq!(
            params["engine_config"],
            "TCP_USER_TIMEOUT=10s,KEEPALIVE_INTERVAL=5s,TCP_TX_SEG_SIZE=64k"
        );
        assert_eq!(params["ucx_error_handling_mode"], "peer");

        let params = ucx_params(serde_json::json!({"backend_params": {"UCX": {
            "engine_config": "TLS=tcp, KEEPALIVE_INTERVAL=1s,TCP_TX_SEG_SIZE=8k",
            "ucx_devices": "eth0",
        }}}));
        assert_eq!(
            params["engine_config"],
            "TLS=tcp, KEEPALIVE_INTERVAL=1s,TCP_TX_SEG_SIZE=8k,TCP_USER_TIMEOUT=10s"
        );
        assert_eq!(params["ucx_devices"], "eth0");

        let params = ucx_params(serde_json::json!({"backend_params": {"UCX": {
            "ucx_error_handling_mode": "none"}}}));
        assert_eq!(params["ucx_error_handling_mode"], "none");
    }

    #[test]
    fn other_backends_are_left_alone() {
        let json = r#"{"kv_connector_extra_config": {"backends": ["POSIX"]}}"#;
        let config = KvTransferConfig::from_json(json).unwrap();
        assert_eq!(with_ucx_defaults(&config).unwrap(), config);
    }
}

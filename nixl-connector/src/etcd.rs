//! Agent metadata through etcd with NIXL's own etcd support
//! ([`MetadataExchange::Etcd`](crate::MetadataExchange::Etcd)): published once at
//! registration, fetched by agent name during a handshake.
//!
//! NIXL stores the metadata from a background thread and only logs a failure, so
//! [`publish`] first checks that etcd answers, and fails at once, naming the endpoint, when
//! it does not. NIXL says nothing when fetched metadata has arrived, so a fetch checks
//! every few milliseconds, within the handshake's total deadline.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use nixl::{Agent, MetadataPeer};

use crate::error::{Error, Result};

/// The environment variable NIXL reads its etcd endpoints from when an agent is created.
pub const ETCD_ENDPOINTS_ENV: &str = "NIXL_ETCD_ENDPOINTS";

/// How long one etcd endpoint may take to answer [`check_reachable`]'s health request.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// Checks that etcd answers at one of `NIXL_ETCD_ENDPOINTS`, then publishes the agent's
/// metadata there.
///
/// # Errors
/// [`Error::InvalidArgument`] without `NIXL_ETCD_ENDPOINTS`; [`check_reachable`]'s errors;
/// NIXL's error when the publication cannot start.
pub fn publish(agent: &Agent) -> Result<()> {
    let endpoints = endpoints()?;
    check_reachable(&endpoints, HEALTH_TIMEOUT)?;
    agent.send_local_metadata(&MetadataPeer::Etcd)?;
    Ok(())
}

/// Checks that at least one of `endpoints` (etcd client URLs separated by commas or
/// semicolons, as in `NIXL_ETCD_ENDPOINTS`) answers within `timeout`: for `http://` URLs, its
/// `/health` must report healthy; for others, a TCP connection must succeed.
///
/// # Errors
/// [`Error::EtcdUnreachable`] naming each endpoint and what went wrong there when none
/// answers.
pub fn check_reachable(endpoints: &str, timeout: Duration) -> Result<()> {
    let mut failures = Vec::new();
    for url in endpoints
        .split([',', ';'])
        .map(str::trim)
        .filter(|u| !u.is_empty())
    {
        match probe(url, timeout) {
            Ok(()) => return Ok(()),
            Err(err) => failures.push(format!("{url}: {err}")),
        }
    }
    if failures.is_empty() {
        failures.push(format!("{ETCD_ENDPOINTS_ENV} names no endpoint"));
    }
    Err(Error::EtcdUnreachable {
        failures: failures.join("; "),
    })
}

/// `NIXL_ETCD_ENDPOINTS`, which NIXL read when the agent was created.
///
/// # Errors
/// [`Error::InvalidArgument`] when it is not set.
pub fn endpoints() -> Result<String> {
    std::env::var(ETCD_ENDPOINTS_ENV).map_err(|_| {
        Error::invalid(
            "exchange metadata through etcd",
            format!(
                "etcd metadata mode needs {ETCD_ENDPOINTS_ENV}, set before the worker is created"
            ),
        )
    })
}

/// Asks one endpoint for its health.
fn probe(url: &str, timeout: Duration) -> std::io::Result<()> {
    let (http, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (scheme.eq_ignore_ascii_case("http"), rest),
        None => (true, url),
    };
    let host = rest.split('/').next().unwrap_or(rest);
    let addrs: Vec<_> = if host.contains(':') && !host.ends_with(']') {
        host.to_socket_addrs()?.collect()
    } else {
        let name = host.trim_start_matches('[').trim_end_matches(']');
        (name, 2379).to_socket_addrs()?.collect()
    };
    let mut last = std::io::Error::other("the host name resolves to no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) if http => return ask_health(stream, host, timeout),
            Ok(_) => return Ok(()),
            Err(err) => last = err,
        }
    }
    Err(last)
}

/// Sends `GET /health` and checks etcd's answer.
fn ask_health(mut stream: TcpStream, host: &str, timeout: Duration) -> std::io::Result<()> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    // One write: `write!` would send each piece of the format on its own.
    stream.write_all(format!("GET /health HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())?;
    let mut reply = Vec::new();
    stream.take(4096).read_to_end(&mut reply)?;
    let reply = String::from_utf8_lossy(&reply);
    if reply.contains("\"health\":\"true\"") {
        return Ok(());
    }
    let status = reply.lines().next().unwrap_or("no reply");
    let body = reply.split("\r\n\r\n").nth(1).unwrap_or("").trim();
    Err(std::io::Error::other(format!(
        "/health answered {status:?} {body}"
    )))
}

/// Asks etcd (through NIXL) for `remote`'s metadata and waits until NIXL has loaded it;
/// the caller bounds the wait (the handshake's total deadline).
///
/// # Errors
/// NIXL's error when the fetch cannot start or the check fails.
pub(crate) async fn fetch(agent: &Agent, remote: &str) -> Result<()> {
    let start = Instant::now();
    agent.fetch_remote_metadata(remote, &MetadataPeer::Etcd)?;
    while !agent.has_remote_metadata(remote)? {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tracing::debug!(%remote, waited = ?start.elapsed(), "loaded metadata from etcd");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_closed_port_is_named() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let err = check_reachable(&url, Duration::from_secs(1)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(&url), "{text}");
        assert!(text.contains("refused"), "{text}");
    }

    #[test]
    fn an_unhealthy_answer_is_quoted() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            // The whole request: bytes left unread when the socket closes make it a reset.
            let mut request = Vec::new();
            let mut byte = [0u8; 1];
            while !request.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap_or(0) == 1 {
                request.push(byte[0]);
            }
            s.write_all(b"HTTP/1.0 503 Service Unavailable\r\n\r\n{\"health\":\"false\"}")
                .unwrap();
        });
        let text = check_reachable(&url, Duration::from_secs(5))
            .unwrap_err()
            .to_string();
        server.join().unwrap();
        assert!(text.contains("503"), "{text}");
        assert!(text.contains("\"health\":\"false\""), "{text}");
    }

    #[test]
    fn no_endpoint_is_an_error() {
        assert!(check_reachable(" , ", Duration::from_secs(1)).is_err());
    }
}

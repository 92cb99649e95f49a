//! Metadata through etcd with NIXL's own etcd support: publish once, fetch by agent name.
//!
//! NIXL stores the metadata from a background thread and only logs a failure, so
//! [`publish`] first checks that etcd answers, and fails at once, naming the endpoint, when
//! it does not.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use nixl::{Agent, MetadataPeer};

use crate::config::ETCD_ENDPOINTS_ENV;
use crate::deadline::Deadline;
use crate::error::{Error, Result};

/// How long one etcd endpoint may take to answer [`check_reachable`]'s health request.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// Checks that etcd answers at one of `NIXL_ETCD_ENDPOINTS`, then publishes the agent's
/// metadata there.
///
/// # Errors
/// [`Error::Config`] without `NIXL_ETCD_ENDPOINTS`; [`check_reachable`]'s errors; NIXL's
/// error when the publication cannot start.
pub fn publish(agent: &Agent) -> Result<()> {
    let endpoints = std::env::var(ETCD_ENDPOINTS_ENV).map_err(|_| {
        Error::Config(format!(
            "etcd metadata mode needs {ETCD_ENDPOINTS_ENV} (or --etcd-endpoints)"
        ))
    })?;
    check_reachable(&endpoints, HEALTH_TIMEOUT)?;
    agent.send_local_metadata(&MetadataPeer::Etcd)?;
    Ok(())
}

/// Checks that at least one of `endpoints` (etcd client URLs separated by commas or
/// semicolons, as in `NIXL_ETCD_ENDPOINTS`) answers within `timeout`: for `http://` URLs, its
/// `/health` must report healthy; for others, a TCP connection must succeed.
///
/// # Errors
/// [`Error::Io`] naming each endpoint and what went wrong there when none answers.
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
    Err(Error::io(
        "etcd does not answer, so this agent's metadata cannot be published (start etcd or \
         fix --etcd-endpoints)",
        std::io::Error::other(failures.join("; ")),
    ))
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
    write!(stream, "GET /health HTTP/1.0\r\nHost: {host}\r\n\r\n")?;
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

/// Asks etcd (through NIXL) for `remote`'s metadata and waits until NIXL has loaded it.
///
/// # Errors
/// NIXL's error when the fetch cannot start; [`Error::Timeout`] when the metadata has not
/// arrived by `deadline` (the peer has not published it, or etcd is unreachable).
pub fn fetch(agent: &Agent, remote: &str, deadline: Deadline) -> Result<()> {
    let start = Instant::now();
    agent.fetch_remote_metadata(remote, &MetadataPeer::Etcd)?;
    while !agent.has_remote_metadata(remote)? {
        if deadline.passed() {
            return Err(Error::Timeout(format!(
                "agent {remote:?}'s metadata did not arrive from etcd within {:?}",
                deadline.limit()
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
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
            let mut request = [0u8; 256];
            let _ = s.read(&mut request);
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

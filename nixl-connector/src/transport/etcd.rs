//! Agent metadata through etcd ([`MetadataExchange::Etcd`](crate::MetadataExchange::Etcd)):
//! NIXL publishes this agent's once at registration, with its own etcd support; a peer's is
//! fetched by the connector itself during a handshake ([`fetch_metadata`], over etcd's
//! HTTP/JSON gateway) and loaded through [`Agent::load_remote_metadata`], which validates the
//! bytes before NIXL sees them. (NIXL's own fetch would load them unchecked, on its thread.)
//!
//! NIXL's layout: an agent's metadata is the value of `<namespace>/<agent name>/metadata`,
//! the namespace being `NIXL_ETCD_NAMESPACE` or [`DEFAULT_NAMESPACE`] (whose trailing slash
//! makes a double one in the key).
//!
//! With etcd credentials ([`EtcdCredentials::from_env`]: `NIXL_CONNECTOR_ETCD_USER` and its
//! password) every request authenticates (`POST /v3/auth/authenticate`, then the token in
//! the `Authorization` header), and the connector publishes and withdraws the metadata
//! itself under NIXL's key, NIXL's own etcd client having no authentication.
//!
//! `https://` endpoints are spoken to through TLS ([`EtcdTls::from_env`]: the CA in
//! `NIXL_CONNECTOR_ETCD_CA_FILE`, optionally a client certificate and key); with any
//! `https://` endpoint the connector publishes and withdraws the metadata itself too, NIXL's
//! client speaking no TLS.
//!
//! With a [`SharedSecret`] the connector publishes the metadata itself too, sealed under a
//! key derived from the secret and bound to its etcd key
//! (`transport/sealing.rs`), and a fetched value must open under the same
//! secret: whoever reads etcd without it learns nothing of the agent's addresses or the
//! registered memory's keys, and an engine without the secret refuses a sealed value by
//! name.
//!
//! NIXL stores the metadata from a background thread and only logs a failure, so
//! [`publish`] first checks that etcd answers, and fails at once, naming the endpoint, when
//! it does not. A fetch may come before NIXL's store has landed, so a key that is not there
//! yet is asked for again after a pause, within the handshake's total deadline.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use base64::prelude::{Engine, BASE64_STANDARD};
use nixl::{Agent, MetadataPeer};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::transport::auth::SharedSecret;
use crate::transport::etcd_auth::{authenticate, delete_at_first, put_at_first};
pub use crate::transport::etcd_auth::{
    EtcdCredentials, ETCD_PASSWORD_ENV, ETCD_PASSWORD_FILE_ENV, ETCD_USER_ENV,
};
use crate::transport::etcd_tls::Endpoint;
pub use crate::transport::etcd_tls::{
    EtcdTls, ETCD_CA_FILE_ENV, ETCD_CERT_FILE_ENV, ETCD_KEY_FILE_ENV,
};
use crate::transport::sealing::{is_sealed_at_rest, open_at_rest, seal_at_rest};
use crate::transport::side_channel::RetryBackoff;

/// The environment variable NIXL reads its etcd endpoints from when an agent is created.
pub const ETCD_ENDPOINTS_ENV: &str = "NIXL_ETCD_ENDPOINTS";

/// The environment variable NIXL reads the namespace of its etcd keys from.
pub const ETCD_NAMESPACE_ENV: &str = "NIXL_ETCD_NAMESPACE";

/// NIXL's namespace when `NIXL_ETCD_NAMESPACE` is not set.
pub const DEFAULT_NAMESPACE: &str = "/nixl/agents/";

/// Room in an answer of etcd beyond the base64 of the value: headers and the JSON around it.
const ANSWER_OVERHEAD: usize = 16 << 10;

/// How long one etcd endpoint may take to answer [`check_reachable`]'s health request, and
/// how long an etcd that answers that it is not healthy is asked again.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// The pause before asking an etcd that answered it is not healthy again.
pub const UNHEALTHY_PAUSE: Duration = Duration::from_millis(100);

/// Checks that etcd answers at one of `NIXL_ETCD_ENDPOINTS`, then publishes the agent's
/// metadata there: through NIXL, or, with [`EtcdCredentials::from_env`], an `https://`
/// endpoint or a `secret`, by the connector, under NIXL's key ([`metadata_key`]). With a
/// `secret` the value is sealed under a key derived from it, bound to its etcd key:
/// whoever reads etcd without the secret learns nothing of the metadata (its agent's
/// addresses and the registered memory's keys), and a value changed or moved to another
/// key does not open.
///
/// # Errors
/// [`Error::InvalidArgument`] without `NIXL_ETCD_ENDPOINTS` or for incomplete credentials;
/// [`check_reachable`]'s errors; NIXL's error when the publication cannot start;
/// [`Error::EtcdPublish`] when no endpoint took the connector's publication.
pub fn publish(agent: &Agent, secret: Option<&SharedSecret>) -> Result<()> {
    let source = EtcdSource::from_env()?.sealed_with(secret.cloned());
    check_reachable(&source.endpoints, HEALTH_TIMEOUT)?;
    if source.nixl_publishes() {
        agent.send_local_metadata(&MetadataPeer::Etcd)?;
    } else {
        let key = metadata_key(&source.namespace, agent.name());
        let value = agent.local_metadata()?;
        let value = match &source.secret {
            Some(secret) => seal_at_rest(secret, &key, &value)?,
            None => value,
        };
        put_at_first(
            &source.spoken(),
            &key,
            &value,
            source.credentials.as_ref(),
            HEALTH_TIMEOUT,
        )?;
    }
    Ok(())
}

/// Withdraws the agent's metadata from etcd, as [`publish`] published it; logs a failure.
pub(crate) fn withdraw(agent: &Agent, source: &EtcdSource) {
    let outcome = if source.nixl_publishes() {
        agent
            .invalidate_local_metadata(&MetadataPeer::Etcd)
            .map_err(|err| err.to_string())
    } else {
        let key = metadata_key(&source.namespace, agent.name());
        delete_at_first(
            &source.spoken(),
            &key,
            source.credentials.as_ref(),
            HEALTH_TIMEOUT,
        )
    };
    if let Err(err) = outcome {
        tracing::warn!(%err, "could not withdraw the agent metadata from etcd");
    }
}

/// Each endpoint of `endpoints` as the connector speaks to it (`https://` ones through
/// `tls`), or why it cannot.
fn spoken(endpoints: &str, tls: Option<&EtcdTls>) -> Vec<std::result::Result<Endpoint, String>> {
    each_endpoint(endpoints)
        .map(|url| endpoint(url, tls).map_err(|why| format!("{url}: {why}")))
        .collect()
}

/// The endpoint `url` as the connector speaks to it, or why it cannot.
fn endpoint(url: &str, tls: Option<&EtcdTls>) -> std::result::Result<Endpoint, String> {
    let (http, host) = parse_endpoint(url);
    let https = is_https(url);
    if !http && !https {
        return Err("only http:// and https:// endpoints can be spoken to".to_string());
    }
    Endpoint::new(&with_port(host), https, tls)
}

/// Whether `url` is an `https://` URL.
fn is_https(url: &str) -> bool {
    url.split_once("://")
        .is_some_and(|(scheme, _)| scheme.eq_ignore_ascii_case("https"))
}

/// Checks that at least one of `endpoints` (etcd client URLs separated by commas or
/// semicolons, as in `NIXL_ETCD_ENDPOINTS`) answers within `timeout`: for `http://` URLs, its
/// `/health` must report healthy; for others, a TCP connection must succeed. An etcd that
/// answers that it is not healthy is often only busy for a moment: it is asked again, every
/// [`UNHEALTHY_PAUSE`], until `timeout` has passed in all.
///
/// # Errors
/// [`Error::EtcdUnreachable`] naming each endpoint and what went wrong there when none
/// answers.
pub fn check_reachable(endpoints: &str, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        let mut failures = Vec::new();
        let mut answered = false;
        for url in each_endpoint(endpoints) {
            match probe(url, timeout) {
                Ok(()) => return Ok(()),
                Err(failure) => {
                    answered |= matches!(failure, ProbeFailure::Unhealthy(_));
                    failures.push(format!("{url}: {failure}"));
                }
            }
        }
        if failures.is_empty() {
            failures.push(format!("{ETCD_ENDPOINTS_ENV} names no endpoint"));
        }
        if !answered || start.elapsed() + UNHEALTHY_PAUSE >= timeout {
            return Err(Error::EtcdUnreachable {
                failures: failures.join("; "),
            });
        }
        std::thread::sleep(UNHEALTHY_PAUSE);
    }
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

/// The endpoints of `endpoints` (etcd client URLs separated by commas or semicolons).
fn each_endpoint(endpoints: &str) -> impl Iterator<Item = &str> {
    endpoints
        .split([',', ';'])
        .map(str::trim)
        .filter(|u| !u.is_empty())
}

/// Whether `url` speaks plain HTTP (no scheme: it does), and its `host[:port]`.
fn parse_endpoint(url: &str) -> (bool, &str) {
    let (http, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (scheme.eq_ignore_ascii_case("http"), rest),
        None => (true, url),
    };
    (http, rest.split('/').next().unwrap_or(rest))
}

/// `host` with etcd's client port (2379) when it names none.
fn with_port(host: &str) -> String {
    if host.contains(':') && !host.ends_with(']') {
        host.to_string()
    } else {
        format!("{host}:2379")
    }
}

/// Why an endpoint did not do.
enum ProbeFailure {
    /// It could not be reached, or did not answer.
    Unreachable(std::io::Error),
    /// It answered that etcd is not healthy; its answer.
    Unhealthy(String),
}

impl std::fmt::Display for ProbeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProbeFailure::Unreachable(err) => err.fmt(f),
            ProbeFailure::Unhealthy(answer) => f.write_str(answer),
        }
    }
}

impl From<std::io::Error> for ProbeFailure {
    fn from(err: std::io::Error) -> Self {
        ProbeFailure::Unreachable(err)
    }
}

/// Asks one endpoint for its health.
fn probe(url: &str, timeout: Duration) -> std::result::Result<(), ProbeFailure> {
    let (http, host) = parse_endpoint(url);
    let addrs: Vec<_> = with_port(host).to_socket_addrs()?.collect();
    let mut last = std::io::Error::other("the host name resolves to no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) if http => return ask_health(stream, host, timeout),
            Ok(_) => return Ok(()),
            Err(err) => last = err,
        }
    }
    Err(last.into())
}

/// Sends `GET /health` and checks etcd's answer.
fn ask_health(
    mut stream: TcpStream,
    host: &str,
    timeout: Duration,
) -> std::result::Result<(), ProbeFailure> {
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
    Err(ProbeFailure::Unhealthy(format!(
        "/health answered {status:?} {body}"
    )))
}

/// Where a worker fetches its peers' metadata: etcd's endpoints and NIXL's namespace, as
/// the environment gave them when the worker (and its agent) was created, and the secret
/// the values are sealed under, if any.
#[derive(Debug, Clone)]
pub(crate) struct EtcdSource {
    pub(crate) endpoints: String,
    pub(crate) namespace: String,
    pub(crate) credentials: Option<EtcdCredentials>,
    pub(crate) tls: Option<EtcdTls>,
    /// The shared secret: values are published sealed under it and must open under it.
    pub(crate) secret: Option<SharedSecret>,
}

impl EtcdSource {
    /// From `NIXL_ETCD_ENDPOINTS`, `NIXL_ETCD_NAMESPACE`, [`EtcdCredentials::from_env`] and
    /// [`EtcdTls::from_env`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `NIXL_ETCD_ENDPOINTS` is not set, for incomplete
    /// credentials, or for TLS files that do not do.
    pub(crate) fn from_env() -> Result<Self> {
        Ok(EtcdSource {
            endpoints: endpoints()?,
            namespace: namespace(),
            credentials: EtcdCredentials::from_env()?,
            tls: EtcdTls::from_env()?,
            secret: None,
        })
    }

    /// The same source, its values sealed under `secret` when there is one.
    pub(crate) fn sealed_with(self, secret: Option<SharedSecret>) -> Self {
        EtcdSource { secret, ..self }
    }

    /// Whether NIXL publishes and withdraws the metadata: no secret to seal it under (NIXL
    /// publishes it as it is), no credentials and no `https://` endpoint, which NIXL's own
    /// etcd client cannot speak to.
    fn nixl_publishes(&self) -> bool {
        self.secret.is_none()
            && self.credentials.is_none()
            && !each_endpoint(&self.endpoints).any(is_https)
    }

    /// The metadata a peer published at `key`, fetched within `deadline` and at most
    /// `max_bytes`, opened under the secret when there is one.
    ///
    /// # Errors
    /// [`fetch_metadata_with`]'s; [`Error::EtcdFetch`] for a value that is not sealed
    /// under this secret (with a secret), or that is sealed (without one).
    pub(crate) async fn fetch(
        &self,
        key: &str,
        max_bytes: usize,
        deadline: Duration,
    ) -> Result<Vec<u8>> {
        let value = fetch_metadata_with(
            &self.endpoints,
            key,
            max_bytes,
            deadline,
            self.credentials.as_ref(),
            self.tls.as_ref(),
        )
        .await?;
        let refused = |reason: &str| Error::EtcdFetch {
            key: key.to_string(),
            reason: reason.to_string(),
        };
        match &self.secret {
            Some(secret) => open_at_rest(secret, key, &value).map_err(|why| {
                refused(&format!("{why}; configure the same shared secret on both engines"))
            }),
            None if is_sealed_at_rest(&value) => Err(refused(
                "the value is sealed under a shared secret, which this engine has none of; configure the same secret on both engines",
            )),
            None => Ok(value),
        }
    }

    /// Each endpoint as the connector speaks to it, or why it cannot.
    fn spoken(&self) -> Vec<std::result::Result<Endpoint, String>> {
        spoken(&self.endpoints, self.tls.as_ref())
    }
}

/// `NIXL_ETCD_NAMESPACE`, or NIXL's default.
pub fn namespace() -> String {
    std::env::var(ETCD_NAMESPACE_ENV).unwrap_or_else(|_| DEFAULT_NAMESPACE.to_string())
}

/// The key NIXL stores `agent`'s full metadata under in `namespace`.
pub fn metadata_key(namespace: &str, agent: &str) -> String {
    format!("{namespace}/{agent}/metadata")
}

/// Fetches the value of `key` (an agent's metadata, see [`metadata_key`]) from the first of
/// `endpoints` that answers, within `deadline` in all; while etcd has no such key yet, or
/// answers that it cannot serve now (a 5xx status), it asks again after a pause
/// ([`RetryBackoff`]). A value of more than `max_bytes` is refused
/// without reading it all: at most `max_bytes` × 4/3 (its base64) and 16 KiB are read from
/// each answer. Only `http://` endpoints can be asked here (`https://` ones through
/// [`fetch_metadata_with`]). Load the bytes with
/// [`Agent::load_remote_metadata`], which validates them.
///
/// # Errors
/// [`Error::EtcdFetch`] naming the key and, for each endpoint, what went wrong there (no
/// answer, an error status, a malformed or oversized answer), or that the key was still
/// absent when the deadline passed.
pub async fn fetch_metadata(
    endpoints: &str,
    key: &str,
    max_bytes: usize,
    deadline: Duration,
) -> Result<Vec<u8>> {
    fetch_metadata_as(endpoints, key, max_bytes, deadline, None).await
}

/// As [`fetch_metadata`], authenticating each request with `credentials` when given (a
/// token from `/v3/auth/authenticate`, within the same deadline).
///
/// # Errors
/// As [`fetch_metadata`]; an endpoint where the authentication fails is named with etcd's
/// answer.
pub async fn fetch_metadata_as(
    endpoints: &str,
    key: &str,
    max_bytes: usize,
    deadline: Duration,
    credentials: Option<&EtcdCredentials>,
) -> Result<Vec<u8>> {
    fetch_metadata_with(endpoints, key, max_bytes, deadline, credentials, None).await
}

/// As [`fetch_metadata_as`], speaking TLS with `tls` to `https://` endpoints (an `https://`
/// endpoint without `tls` is refused), within the same deadline and caps.
///
/// # Errors
/// As [`fetch_metadata_as`]; a failed TLS handshake is named with what to do (the CA that
/// signed etcd's certificate, a name the certificate lists, a client certificate).
pub async fn fetch_metadata_with(
    endpoints: &str,
    key: &str,
    max_bytes: usize,
    deadline: Duration,
    credentials: Option<&EtcdCredentials>,
    tls: Option<&EtcdTls>,
) -> Result<Vec<u8>> {
    let mut backoff = RetryBackoff::default();
    let mut tries = 0;
    // Whether an endpoint said the key is not there (yet), or that etcd cannot answer now;
    // what failed on the others.
    let (mut absent, mut unavailable) = (false, false);
    let mut failures = Vec::new();
    let fetched = tokio::time::timeout(deadline, async {
        loop {
            tries += 1;
            failures.clear();
            for url in each_endpoint(endpoints) {
                match range(url, key, max_bytes, credentials, tls, deadline).await {
                    Ok(Some(value)) => return Some(value),
                    Ok(None) => absent = true,
                    Err(failure) => {
                        unavailable |= failure.unavailable;
                        failures.push(format!("{url}: {}", failure.reason));
                    }
                }
            }
            if !absent && !unavailable {
                // Every endpoint failed: waiting would not help.
                return None;
            }
            tokio::time::sleep(backoff.next_pause()).await;
        }
    })
    .await;
    let mut reasons = match fetched {
        Ok(Some(value)) => return Ok(value),
        Ok(None) => Vec::new(),
        Err(_) if absent => vec![format!(
            "no metadata under it after {tries} tries within {deadline:?} (NIXL stores it when \
             the peer registers its KV caches)"
        )],
        Err(_) => vec![format!("etcd did not answer within {deadline:?}")],
    };
    reasons.append(&mut failures);
    if reasons.is_empty() {
        reasons.push(format!("{ETCD_ENDPOINTS_ENV} names no endpoint"));
    }
    Err(Error::EtcdFetch {
        key: key.to_string(),
        reason: reasons.join("; "),
    })
}

/// etcd's answer to a range request, as its JSON gateway writes it.
#[derive(Deserialize)]
struct RangeAnswer {
    #[serde(default)]
    kvs: Vec<KeyValue>,
}

#[derive(Deserialize)]
struct KeyValue {
    /// Base64; absent for an empty value.
    #[serde(default)]
    value: String,
}

/// Why a range request failed.
#[derive(Debug, PartialEq, Eq)]
struct RangeFailure {
    reason: String,
    /// etcd answered that it cannot serve the request now (a 5xx status): worth asking again.
    unavailable: bool,
}

impl From<String> for RangeFailure {
    fn from(reason: String) -> Self {
        RangeFailure {
            reason,
            unavailable: false,
        }
    }
}

impl From<&str> for RangeFailure {
    fn from(reason: &str) -> Self {
        reason.to_string().into()
    }
}

/// Asks the endpoint `url` for `key`'s value: `None` when there is no such key.
async fn range(
    url: &str,
    key: &str,
    max_bytes: usize,
    credentials: Option<&EtcdCredentials>,
    tls: Option<&EtcdTls>,
    deadline: Duration,
) -> std::result::Result<Option<Vec<u8>>, RangeFailure> {
    let endpoint = endpoint(url, tls)?;
    let auth = match credentials {
        None => String::new(),
        Some(credentials) => {
            let (endpoint, credentials) = (endpoint.clone(), credentials.clone());
            // Bounded by the socket's timeouts; the caller's deadline cuts the wait.
            let token = tokio::task::spawn_blocking(move || {
                authenticate(&endpoint, &credentials, deadline)
            })
            .await
            .map_err(|err| RangeFailure::from(err.to_string()))??;
            format!("Authorization: {token}\r\n")
        }
    };
    let host = &endpoint.host;
    let body = format!(r#"{{"key":"{}"}}"#, BASE64_STANDARD.encode(key));
    let request = format!(
        "POST /v3/kv/range HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         {auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let cap = max_bytes.saturating_mul(4) / 3 + ANSWER_OVERHEAD;
    let answer = endpoint
        .exchange_async(request.as_bytes(), cap as u64 + 1)
        .await?;
    if answer.len() > cap {
        return Err(format!(
            "the answer passes {cap} bytes: the value is larger than the {max_bytes}-byte cap"
        )
        .into());
    }
    let value = value_of(&answer)?;
    match value {
        Some(value) if value.len() > max_bytes => Err(format!(
            "the value has {} bytes, more than the {max_bytes}-byte cap",
            value.len()
        )
        .into()),
        value => Ok(value),
    }
}

/// The value in an HTTP answer to a range request, `None` when it has none.
fn value_of(answer: &[u8]) -> std::result::Result<Option<Vec<u8>>, RangeFailure> {
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("the answer ends inside its headers")?;
    let (head, body) = (
        String::from_utf8_lossy(&answer[..split]),
        &answer[split + 4..],
    );
    let status = head.lines().next().unwrap_or_default();
    let code = status.split_whitespace().nth(1).unwrap_or_default();
    if code != "200" {
        let excerpt = String::from_utf8_lossy(&body[..body.len().min(200)]);
        return Err(RangeFailure {
            reason: format!("/v3/kv/range answered {status:?} {}", excerpt.trim()),
            unavailable: code.starts_with('5'),
        });
    }
    let declared = head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| value.trim().parse::<usize>().ok())?
    });
    if declared.is_some_and(|n| n != body.len()) {
        return Err(format!(
            "the answer's body has {} bytes, its header declares {}",
            body.len(),
            declared.unwrap_or_default()
        )
        .into());
    }
    let parsed: RangeAnswer = serde_json::from_slice(body)
        .map_err(|err| RangeFailure::from(format!("the answer is not etcd's JSON: {err}")))?;
    let Some(first) = parsed.kvs.first() else {
        return Ok(None);
    };
    BASE64_STANDARD
        .decode(&first.value)
        .map(Some)
        .map_err(|err| format!("the value is not base64: {err}").into())
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
        // Unhealthy for good: asked again until the timeout has passed (the thread ends with
        // the test process).
        let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = asked.clone();
        std::thread::spawn(move || {
            for mut s in listener.incoming().flatten() {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // The whole request: bytes left unread when the socket closes make it a reset.
                let mut request = Vec::new();
                let mut byte = [0u8; 1];
                while !request.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap_or(0) == 1 {
                    request.push(byte[0]);
                }
                let answer = b"HTTP/1.0 503 Service Unavailable\r\n\r\n{\"health\":\"false\"}";
                let _ = s.write_all(answer);
            }
        });
        let start = Instant::now();
        let text = check_reachable(&url, Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        assert!(asked.load(std::sync::atomic::Ordering::SeqCst) >= 2);
        assert!(text.contains("503"), "{text}");
        assert!(text.contains("\"health\":\"false\""), "{text}");
    }

    #[test]
    fn answers_are_read_strictly() {
        let ok = |body: &str| {
            format!(
                "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        assert_eq!(value_of(ok("{}").as_bytes()), Ok(None));
        let found = ok(r#"{"kvs":[{"key":"aw==","value":"aGk="}],"count":"1"}"#);
        assert_eq!(value_of(found.as_bytes()), Ok(Some(b"hi".to_vec())));
        let err = |answer: &str| value_of(answer.as_bytes()).unwrap_err();
        let unavailable = err("HTTP/1.0 503 Service Unavailable\r\n\r\n{\"error\":\"x\"}");
        assert!(unavailable.unavailable && unavailable.reason.contains("503"));
        let refused = err("HTTP/1.0 400 Bad Request\r\n\r\n{}");
        assert!(!refused.unavailable && refused.reason.contains("400"));
        let reason = |answer: &str| err(answer).reason;
        assert!(reason("HTTP/1.0 200 OK\r\nContent-Length: 9\r\n\r\n{}").contains("declares 9"));
        assert!(reason(&ok("not json")).contains("not etcd's JSON"));
        assert!(reason(&ok(r#"{"kvs":[{"value":"!!"}]}"#)).contains("not base64"));
        assert!(reason("HTTP/1.0 200 OK\r\nContent-Len").contains("inside its headers"));
    }

    #[tokio::test]
    async fn a_silent_endpoint_is_cut_at_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let deadline = Duration::from_millis(300);
        let err = fetch_metadata(&url, "k", 1024, deadline).await.unwrap_err();
        let text = err.to_string();
        assert!(text.contains("etcd did not answer within 300ms"), "{text}");
        assert!(text.contains("(key \"k\")"), "{text}");
        drop(listener);
    }

    #[tokio::test]
    async fn an_oversized_answer_is_refused_unread() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let head = "HTTP/1.0 200 OK\r\nContent-Length: 100000000\r\n\r\n";
            let _ = s.write_all(head.as_bytes());
            let chunk = vec![b'A'; 1 << 16];
            // Far more than the cap allows; the client stops reading and closes.
            for _ in 0..64 {
                if s.write_all(&chunk).is_err() {
                    break;
                }
            }
        });
        let deadline = Duration::from_secs(10);
        let err = fetch_metadata(&url, "k", 1024, deadline).await.unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("the value is larger than the 1024-byte cap"),
            "{text}"
        );
        server.join().unwrap();
    }

    #[tokio::test]
    async fn only_http_and_https_endpoints_are_asked() {
        let err = fetch_metadata("unix://127.0.0.1:1", "k", 1024, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("only http:// and https://"),
            "{err}"
        );
        let err = fetch_metadata("https://127.0.0.1:1", "k", 1024, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(err.to_string().contains(ETCD_CA_FILE_ENV), "{err}");
    }

    #[test]
    fn no_endpoint_is_an_error() {
        assert!(check_reachable(" , ", Duration::from_secs(1)).is_err());
    }
}

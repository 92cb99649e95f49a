//! etcd's user and password authentication for the connector's etcd paths: a token from
//! `POST /v3/auth/authenticate`, sent in the `Authorization` header of each request of
//! etcd's HTTP/JSON gateway. NIXL's own etcd client has no authentication (nor TLS), so with
//! credentials (or `https://` endpoints) the connector publishes and withdraws the metadata
//! itself, under NIXL's key.

use std::time::Duration;

use base64::prelude::{Engine, BASE64_STANDARD};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::transport::etcd_tls::Endpoint;

/// The environment variable naming the etcd user.
pub const ETCD_USER_ENV: &str = "NIXL_CONNECTOR_ETCD_USER";

/// The environment variable holding the etcd user's password.
pub const ETCD_PASSWORD_ENV: &str = "NIXL_CONNECTOR_ETCD_PASSWORD";

/// The environment variable naming a file holding the etcd user's password (read when
/// [`ETCD_PASSWORD_ENV`] is not set).
pub const ETCD_PASSWORD_FILE_ENV: &str = "NIXL_CONNECTOR_ETCD_PASSWORD_FILE";

/// Most bytes read from etcd's answer to anything but a range request.
const ANSWER_CAP: u64 = 64 << 10;

/// An etcd user and its password. Its `Debug` shows the user only.
#[derive(Clone)]
pub struct EtcdCredentials {
    user: String,
    password: String,
}

impl std::fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl EtcdCredentials {
    /// The credentials of `user` with `password`.
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Self {
        EtcdCredentials {
            user: user.into(),
            password: password.into(),
        }
    }

    /// [`ETCD_USER_ENV`] with [`ETCD_PASSWORD_ENV`] or the file [`ETCD_PASSWORD_FILE_ENV`]
    /// names (its trailing line ends dropped); `None` without a user.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a user without a password, or a password file that
    /// cannot be read.
    pub fn from_env() -> Result<Option<Self>> {
        const OP: &str = "read the etcd credentials";
        let Ok(user) = std::env::var(ETCD_USER_ENV) else {
            return Ok(None);
        };
        let password = match std::env::var(ETCD_PASSWORD_ENV) {
            Ok(password) => password,
            Err(_) => {
                let path = std::env::var(ETCD_PASSWORD_FILE_ENV).map_err(|_| {
                    Error::invalid(
                        OP,
                        format!("{ETCD_USER_ENV} is set without {ETCD_PASSWORD_ENV} or {ETCD_PASSWORD_FILE_ENV}"),
                    )
                })?;
                let text = std::fs::read_to_string(&path)
                    .map_err(|err| Error::invalid(OP, format!("{path}: {err}")))?;
                text.trim_end_matches(['\n', '\r']).to_string()
            }
        };
        Ok(Some(EtcdCredentials::new(user, password)))
    }
}

/// etcd's answer to an authentication.
#[derive(Deserialize)]
struct Token {
    token: String,
}

/// Sends one request of etcd's JSON gateway to `endpoint` and returns the body of a 200
/// answer; why not, otherwise.
fn post(
    endpoint: &Endpoint,
    path: &str,
    body: &str,
    token: Option<&str>,
    timeout: Duration,
) -> std::result::Result<Vec<u8>, String> {
    let host = &endpoint.host;
    let auth = token.map_or(String::new(), |t| format!("Authorization: {t}\r\n"));
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = endpoint.exchange(request.as_bytes(), ANSWER_CAP, timeout)?;
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("the answer ends inside its headers")?;
    let head = String::from_utf8_lossy(&answer[..split]);
    let status = head.lines().next().unwrap_or_default();
    let body = &answer[split + 4..];
    if status.split_whitespace().nth(1) != Some("200") {
        let excerpt = String::from_utf8_lossy(&body[..body.len().min(200)]);
        return Err(format!("{path} answered {status:?} {}", excerpt.trim()));
    }
    Ok(body.to_vec())
}

/// A token for `credentials` from etcd at `endpoint`.
pub(crate) fn authenticate(
    endpoint: &Endpoint,
    credentials: &EtcdCredentials,
    timeout: Duration,
) -> std::result::Result<String, String> {
    let body = serde_json::json!({"name": credentials.user, "password": credentials.password});
    let answer = post(
        endpoint,
        "/v3/auth/authenticate",
        &body.to_string(),
        None,
        timeout,
    )
    .map_err(|why| format!("authenticate as etcd user {:?}: {why}", credentials.user))?;
    serde_json::from_slice::<Token>(&answer)
        .map(|t| t.token)
        .map_err(|err| format!("etcd's authentication answer is not its JSON: {err}"))
}

/// A token for `credentials` when given.
fn token_for(
    endpoint: &Endpoint,
    credentials: Option<&EtcdCredentials>,
    timeout: Duration,
) -> std::result::Result<Option<String>, String> {
    credentials
        .map(|credentials| authenticate(endpoint, credentials, timeout))
        .transpose()
}

/// Stores `value` under `key` at `endpoint`, authenticated with `credentials` when given.
fn put(
    endpoint: &Endpoint,
    key: &str,
    value: &[u8],
    credentials: Option<&EtcdCredentials>,
    timeout: Duration,
) -> std::result::Result<(), String> {
    let token = token_for(endpoint, credentials, timeout)?;
    let body = serde_json::json!({
        "key": BASE64_STANDARD.encode(key),
        "value": BASE64_STANDARD.encode(value),
    });
    let token = token.as_deref();
    post(endpoint, "/v3/kv/put", &body.to_string(), token, timeout).map(drop)
}

/// Deletes `key` at `endpoint`, authenticated with `credentials` when given.
fn delete(
    endpoint: &Endpoint,
    key: &str,
    credentials: Option<&EtcdCredentials>,
    timeout: Duration,
) -> std::result::Result<(), String> {
    let token = token_for(endpoint, credentials, timeout)?;
    let body = serde_json::json!({"key": BASE64_STANDARD.encode(key)});
    post(
        endpoint,
        "/v3/kv/deleterange",
        &body.to_string(),
        token.as_deref(),
        timeout,
    )
    .map(drop)
}

/// Stores `value` under `key` at the first of `endpoints` that takes it (an endpoint that
/// cannot be spoken to is its reason why).
///
/// # Errors
/// [`Error::EtcdPublish`] naming the key and what went wrong at each endpoint.
pub(crate) fn put_at_first(
    endpoints: &[std::result::Result<Endpoint, String>],
    key: &str,
    value: &[u8],
    credentials: Option<&EtcdCredentials>,
    timeout: Duration,
) -> Result<()> {
    let mut failures = Vec::new();
    for endpoint in endpoints {
        match endpoint {
            Ok(endpoint) => match put(endpoint, key, value, credentials, timeout) {
                Ok(()) => return Ok(()),
                Err(why) => failures.push(format!("{}: {why}", endpoint.host)),
            },
            Err(why) => failures.push(why.clone()),
        }
    }
    Err(Error::EtcdPublish {
        key: key.to_string(),
        reason: failures.join("; "),
    })
}

/// Deletes `key` at the first of `endpoints` that takes it; what went wrong, otherwise.
pub(crate) fn delete_at_first(
    endpoints: &[std::result::Result<Endpoint, String>],
    key: &str,
    credentials: Option<&EtcdCredentials>,
    timeout: Duration,
) -> std::result::Result<(), String> {
    let mut failures = Vec::new();
    for endpoint in endpoints {
        match endpoint {
            Ok(endpoint) => match delete(endpoint, key, credentials, timeout) {
                Ok(()) => return Ok(()),
                Err(why) => failures.push(format!("{}: {why}", endpoint.host)),
            },
            Err(why) => failures.push(why.clone()),
        }
    }
    Err(failures.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_is_never_shown() {
        let shown = format!("{:?}", EtcdCredentials::new("nixl", "hunter2"));
        assert!(
            shown.contains("nixl") && !shown.contains("hunter2"),
            "{shown}"
        );
    }
}

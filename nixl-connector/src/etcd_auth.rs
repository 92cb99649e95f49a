//! etcd's user and password authentication for the connector's etcd paths: a token from
//! `POST /v3/auth/authenticate`, sent in the `Authorization` header of each request of
//! etcd's HTTP/JSON gateway. NIXL's own etcd client has no authentication, so with
//! credentials the connector publishes and withdraws the metadata itself, under NIXL's key.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use base64::prelude::{Engine, BASE64_STANDARD};
use serde::Deserialize;

use crate::error::{Error, Result};

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

/// Sends one request of etcd's JSON gateway to `host` (`host:port`) and returns the body of
/// a 200 answer; why not, otherwise.
fn post(
    host: &str,
    path: &str,
    body: &str,
    token: Option<&str>,
    timeout: Duration,
) -> std::result::Result<Vec<u8>, String> {
    let addr = host
        .to_socket_addrs()
        .map_err(|err| err.to_string())?
        .next()
        .ok_or("the host name resolves to no address")?;
    let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| e.to_string())?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: {t}\r\n"));
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    (&mut stream)
        .take(ANSWER_CAP)
        .read_to_end(&mut answer)
        .map_err(|e| e.to_string())?;
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

/// A token for `credentials` from etcd at `host`.
pub(crate) fn authenticate(
    host: &str,
    credentials: &EtcdCredentials,
    timeout: Duration,
) -> std::result::Result<String, String> {
    let body = serde_json::json!({"name": credentials.user, "password": credentials.password});
    let answer = post(
        host,
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

/// Stores `value` under `key` at `host`, authenticated with `credentials`.
fn put(
    host: &str,
    key: &str,
    value: &[u8],
    credentials: &EtcdCredentials,
    timeout: Duration,
) -> std::result::Result<(), String> {
    let token = authenticate(host, credentials, timeout)?;
    let body = serde_json::json!({
        "key": BASE64_STANDARD.encode(key),
        "value": BASE64_STANDARD.encode(value),
    });
    post(host, "/v3/kv/put", &body.to_string(), Some(&token), timeout).map(drop)
}

/// Deletes `key` at `host`, authenticated with `credentials`.
fn delete(
    host: &str,
    key: &str,
    credentials: &EtcdCredentials,
    timeout: Duration,
) -> std::result::Result<(), String> {
    let token = authenticate(host, credentials, timeout)?;
    let body = serde_json::json!({"key": BASE64_STANDARD.encode(key)});
    post(
        host,
        "/v3/kv/deleterange",
        &body.to_string(),
        Some(&token),
        timeout,
    )
    .map(drop)
}

/// Stores `value` under `key` at the first of `hosts` that takes it.
///
/// # Errors
/// [`Error::EtcdPublish`] naming the key and what went wrong at each host.
pub(crate) fn put_at_first<'a>(
    hosts: impl Iterator<Item = &'a str>,
    key: &str,
    value: &[u8],
    credentials: &EtcdCredentials,
    timeout: Duration,
) -> Result<()> {
    let mut failures = Vec::new();
    for host in hosts {
        match put(host, key, value, credentials, timeout) {
            Ok(()) => return Ok(()),
            Err(why) => failures.push(format!("{host}: {why}")),
        }
    }
    Err(Error::EtcdPublish {
        key: key.to_string(),
        reason: failures.join("; "),
    })
}

/// Deletes `key` at the first of `hosts` that takes it; what went wrong, otherwise.
pub(crate) fn delete_at_first<'a>(
    hosts: impl Iterator<Item = &'a str>,
    key: &str,
    credentials: &EtcdCredentials,
    timeout: Duration,
) -> std::result::Result<(), String> {
    let mut failures = Vec::new();
    for host in hosts {
        match delete(host, key, credentials, timeout) {
            Ok(()) => return Ok(()),
            Err(why) => failures.push(format!("{host}: {why}")),
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

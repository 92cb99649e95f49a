//! Mutual authentication of the native side channel with a shared secret: a challenge and
//! response both ways with HMAC-SHA256.
//!
//! The exchange (see [`side_channel`](crate::side_channel)): the reader sends a fresh
//! nonce; the server answers with its own fresh nonce; the reader sends its handshake
//! message with the MAC of both nonces, its role and the message's bytes; only when that
//! MAC checks does the server answer with its handshake message and the MAC of both
//! nonces, its role and its message's bytes, which the reader checks before it reads the
//! message. A peer without the secret learns nothing but the refusal; a recorded exchange
//! replayed fails, since the other side's nonce is new; a MAC of one role is never accepted
//! for the other.

use std::path::Path;

use hmac::{Hmac, Mac};
use nixl::kv_config::KvTransferConfig;
use serde_json::Value;
use sha2::Sha256;

use crate::error::{Error, Result};

/// The `kv_connector_extra_config` key holding the shared secret itself.
pub const SECRET_KEY: &str = "auth_secret";

/// The `kv_connector_extra_config` key naming a file holding the shared secret.
pub const SECRET_FILE_KEY: &str = "auth_secret_file";

/// The environment variable holding the shared secret, read when the config names none.
pub const SECRET_ENV: &str = "NIXL_CONNECTOR_SECRET";

/// The environment variable naming a file holding the shared secret, read when the config
/// and [`SECRET_ENV`] name none.
pub const SECRET_FILE_ENV: &str = "NIXL_CONNECTOR_SECRET_FILE";

/// Fewest bytes a secret may have.
pub const MIN_SECRET_BYTES: usize = 16;

/// Most bytes a secret (or its file) may have.
pub const MAX_SECRET_BYTES: usize = 4096;

/// Bytes of each side's nonce.
pub const NONCE_BYTES: usize = 32;

/// Bytes of a MAC.
pub const MAC_BYTES: usize = 32;

/// What the reader's MAC covers first: its role and the protocol.
const READER_ROLE: &[u8] = b"nixl-connector side channel v1: reader";

/// What the server's MAC covers first: its role and the protocol.
const SERVER_ROLE: &[u8] = b"nixl-connector side channel v1: server";

/// A fresh nonce.
pub(crate) type Nonce = [u8; NONCE_BYTES];

/// The secret the engines of a deployment share, to authenticate each other on the side
/// channel. Its `Debug` shows no byte of it, and nothing in this crate logs it.
#[derive(Clone)]
pub struct SharedSecret(Vec<u8>);

impl std::fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedSecret(<redacted>)")
    }
}

impl SharedSecret {
    /// The secret `bytes`: from [`MIN_SECRET_BYTES`] to [`MAX_SECRET_BYTES`] bytes (e.g. 32
    /// random bytes, or their hex or base64 text).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a shorter or longer secret.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self> {
        let bytes = bytes.into();
        if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&bytes.len()) {
            return Err(Error::invalid(
                "read the shared secret",
                format!(
                    "the secret has {} bytes; give {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} (e.g. `openssl rand -hex 32`)",
                    bytes.len()
                ),
            ));
        }
        Ok(SharedSecret(bytes))
    }

    /// The secret in the file at `path`, without its trailing line ends.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the file when it cannot be read or holds a secret
    /// [`new`](Self::new) refuses.
    pub fn from_file(path: &Path) -> Result<Self> {
        const OP: &str = "read the shared secret file";
        let len = std::fs::metadata(path)
            .map_err(|err| Error::invalid(OP, format!("{}: {err}", path.display())))?
            .len();
        if len > MAX_SECRET_BYTES as u64 + 2 {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} has {len} bytes; a secret has at most {MAX_SECRET_BYTES}",
                    path.display()
                ),
            ));
        }
        let mut bytes = std::fs::read(path)
            .map_err(|err| Error::invalid(OP, format!("{}: {err}", path.display())))?;
        while matches!(bytes.last(), Some(b'\n' | b'\r')) {
            bytes.pop();
        }
        SharedSecret::new(bytes)
            .map_err(|err| Error::invalid(OP, format!("{}: {err}", path.display())))
    }

    /// The secret of a deployment: `kv_connector_extra_config.auth_secret_file` (a path) or
    /// `.auth_secret` (the secret), else the environment's [`SECRET_ENV`] or
    /// [`SECRET_FILE_ENV`]; `None` when none is set (the side channel is then not
    /// authenticated).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value that is not a string, both keys set, or a
    /// secret that [`new`](Self::new) or [`from_file`](Self::from_file) refuses.
    pub fn from_kv_transfer_config(config: &KvTransferConfig) -> Result<Option<Self>> {
        const OP: &str = "read the shared secret";
        let extra = &config.kv_connector_extra_config;
        let string = |key: &str| match extra.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(Error::invalid(
                OP,
                format!("kv_connector_extra_config.{key} is not a string"),
            )),
        };
        match (string(SECRET_KEY)?, string(SECRET_FILE_KEY)?) {
            (Some(_), Some(_)) => Err(Error::invalid(
                OP,
                format!("kv_connector_extra_config sets both {SECRET_KEY} and {SECRET_FILE_KEY}; keep one (a file keeps the secret out of the config)"),
            )),
            (Some(secret), None) => SharedSecret::new(secret).map(Some),
            (None, Some(path)) => SharedSecret::from_file(Path::new(&path)).map(Some),
            (None, None) => {
                if let Some(secret) = std::env::var_os(SECRET_ENV) {
                    return SharedSecret::new(secret.into_encoded_bytes()).map(Some);
                }
                match std::env::var_os(SECRET_FILE_ENV) {
                    Some(path) => SharedSecret::from_file(Path::new(&path)).map(Some),
                    None => Ok(None),
                }
            }
        }
    }

    fn mac(&self, role: &[u8], reader: &Nonce, server: &Nonce, message: &[u8]) -> Hmac<Sha256> {
        let mut mac =
            <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for part in [role, reader, server] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        mac.update(message);
        mac
    }

    /// The MAC of a reader's `message` in the exchange of nonces `reader` and `server`.
    pub(crate) fn reader_mac(&self, reader: &Nonce, server: &Nonce, message: &[u8]) -> Vec<u8> {
        self.mac(READER_ROLE, reader, server, message)
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// The MAC of a server's `message` in the exchange of nonces `reader` and `server`.
    pub(crate) fn server_mac(&self, reader: &Nonce, server: &Nonce, message: &[u8]) -> Vec<u8> {
        self.mac(SERVER_ROLE, reader, server, message)
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Whether `mac` is the reader's MAC of `message` (compared in constant time).
    pub(crate) fn verify_reader(
        &self,
        reader: &Nonce,
        server: &Nonce,
        message: &[u8],
        mac: &[u8],
    ) -> bool {
        self.mac(READER_ROLE, reader, server, message)
            .verify_slice(mac)
            .is_ok()
    }

    /// Whether `mac` is the server's MAC of `message` (compared in constant time).
    pub(crate) fn verify_server(
        &self,
        reader: &Nonce,
        server: &Nonce,
        message: &[u8],
        mac: &[u8],
    ) -> bool {
        self.mac(SERVER_ROLE, reader, server, message)
            .verify_slice(mac)
            .is_ok()
    }
}

/// A fresh random nonce from the operating system.
///
/// # Errors
/// [`Error::Io`] when the operating system gives no randomness.
pub(crate) fn nonce() -> Result<Nonce> {
    let mut nonce = [0; NONCE_BYTES];
    getrandom::fill(&mut nonce).map_err(|err| {
        Error::io(
            "draw a nonce",
            "this host",
            std::io::Error::other(err.to_string()),
        )
    })?;
    Ok(nonce)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_bind_the_roles_both_nonces_and_the_message() {
        let secret = SharedSecret::new(*b"0123456789abcdef").unwrap();
        let (r, s) = (nonce().unwrap(), nonce().unwrap());
        let mac = secret.reader_mac(&r, &s, b"m");
        assert!(secret.verify_reader(&r, &s, b"m", &mac));
        assert!(!secret.verify_server(&r, &s, b"m", &mac), "roles differ");
        assert!(!secret.verify_reader(&s, &r, b"m", &mac), "nonces swapped");
        assert!(!secret.verify_reader(&r, &nonce().unwrap(), b"m", &mac));
        assert!(!secret.verify_reader(&r, &s, b"n", &mac));
        let other = SharedSecret::new(*b"0123456789abcdeF").unwrap();
        assert!(!other.verify_reader(&r, &s, b"m", &mac));
        assert!(!secret.verify_reader(&r, &s, b"m", &mac[..16]));
    }

    #[test]
    fn a_secret_is_never_shown_and_must_have_a_usable_length() {
        let secret = SharedSecret::new(*b"0123456789abcdef").unwrap();
        assert_eq!(format!("{secret:?}"), "SharedSecret(<redacted>)");
        assert!(SharedSecret::new(*b"short").is_err());
        assert!(SharedSecret::new(vec![0; MAX_SECRET_BYTES + 1]).is_err());
    }
}

//! The shared secret that authenticates the native side channel, where it is read from, and
//! the checks on a file holding it.
//!
//! The exchange it authenticates (see [`side_channel`](crate::side_channel)): the reader
//! sends a fresh nonce; the server answers with its own fresh nonce; both derive the
//! exchange's two keys from the secret and both nonces
//! (`transport/sealing.rs`); the reader sends its handshake message sealed
//! under its key; only when that opens does the server answer with its message sealed under
//! its own key, which the reader opens before it reads it. A peer without the secret learns
//! nothing but the refusal, and a relay between two engines sees only sealed bytes; a
//! recorded exchange replayed fails, since the other side's nonce is new; a message of one
//! role never opens as the other's.

use std::path::Path;

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use nixl::kv_config::KvTransferConfig;
use serde_json::Value;

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

/// The `kv_connector_extra_config` key that, set to `true`, lets a secret file be readable
/// by its group or others (refused otherwise).
pub const SECRET_FILE_READABLE_KEY: &str = "auth_secret_file_readable_by_others";

/// The environment variable that, set to `1`, lets a secret file be readable by its group
/// or others, as [`SECRET_FILE_READABLE_KEY`] does.
pub const SECRET_FILE_READABLE_ENV: &str = "NIXL_CONNECTOR_SECRET_FILE_READABLE_BY_OTHERS";

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

    /// The secret in the file at `path`, without its trailing line ends. The file must be
    /// readable by its owner only (mode `0600` or `0400`) and, when `path` is a symlink,
    /// the link must be this process's user's: see [`from_file_with`](Self::from_file_with).
    ///
    /// # Errors
    /// As [`from_file_with`](Self::from_file_with).
    pub fn from_file(path: &Path) -> Result<Self> {
        SharedSecret::from_file_with(path, false)
    }

    /// The secret in the file at `path`, without its trailing line ends; a file readable by
    /// its group or others is refused unless `readable_by_others` (a deployment that shares
    /// the file through a group on purpose), and a symlink owned by a user other than this
    /// process's and root always is (whoever owns the link chooses the secret; root-owned
    /// links are what e.g. Kubernetes' secret volumes mount).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the file when it cannot be read, is readable by
    /// others (the message says `chmod 600`), is a symlink of another user, or holds a
    /// secret [`new`](Self::new) refuses.
    pub fn from_file_with(path: &Path, readable_by_others: bool) -> Result<Self> {
        const OP: &str = "read the shared secret file";
        let named = |reason: String| Error::invalid(OP, format!("{}: {reason}", path.display()));
        let link = std::fs::symlink_metadata(path).map_err(|err| named(err.to_string()))?;
        let user = rustix::process::geteuid().as_raw();
        if link.file_type().is_symlink() && link.uid() != user && link.uid() != 0 {
            return Err(named(format!(
                "a symlink owned by user {}, not this process's user {user}; point the setting at the file itself, or at a link of yours",
                link.uid()
            )));
        }
        let file = std::fs::metadata(path).map_err(|err| named(err.to_string()))?;
        let mode = file.permissions().mode() & 0o777;
        if mode & 0o077 != 0 && !readable_by_others {
            return Err(named(format!(
                "mode {mode:04o} lets its group or others read the secret; run `chmod 600 {}` (or set {SECRET_FILE_READABLE_KEY}: true, or {SECRET_FILE_READABLE_ENV}=1, to allow it)",
                path.display()
            )));
        }
        let len = file.len();
        if len > MAX_SECRET_BYTES as u64 + 2 {
            return Err(named(format!(
                "{len} bytes; a secret has at most {MAX_SECRET_BYTES}"
            )));
        }
        let mut bytes = std::fs::read(path).map_err(|err| named(err.to_string()))?;
        while matches!(bytes.last(), Some(b'\n' | b'\r')) {
            bytes.pop();
        }
        SharedSecret::new(bytes).map_err(|err| named(err.to_string()))
    }

    /// The secret of a deployment: `kv_connector_extra_config.auth_secret_file` (a path) or
    /// `.auth_secret` (the secret), else the environment's [`SECRET_ENV`] or
    /// [`SECRET_FILE_ENV`]; `None` when none is set (the side channel is then not
    /// authenticated). A file must be its owner's alone unless
    /// [`SECRET_FILE_READABLE_KEY`] or [`SECRET_FILE_READABLE_ENV`] allows more (see
    /// [`from_file_with`](Self::from_file_with)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a value that is not a string (or, for
    /// [`SECRET_FILE_READABLE_KEY`], not a boolean), both keys set, or a secret that
    /// [`new`](Self::new) or [`from_file_with`](Self::from_file_with) refuses.
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
        let readable_by_others = match extra.get(SECRET_FILE_READABLE_KEY) {
            None => std::env::var_os(SECRET_FILE_READABLE_ENV).is_some_and(|v| v == "1"),
            Some(Value::Bool(allowed)) => *allowed,
            Some(_) => {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "kv_connector_extra_config.{SECRET_FILE_READABLE_KEY} is not a boolean"
                    ),
                ))
            }
        };
        let from_file = |path: &Path| SharedSecret::from_file_with(path, readable_by_others);
        match (string(SECRET_KEY)?, string(SECRET_FILE_KEY)?) {
            (Some(_), Some(_)) => Err(Error::invalid(
                OP,
                format!("kv_connector_extra_config sets both {SECRET_KEY} and {SECRET_FILE_KEY}; keep one (a file keeps the secret out of the config)"),
            )),
            (Some(secret), None) => SharedSecret::new(secret).map(Some),
            (None, Some(path)) => from_file(Path::new(&path)).map(Some),
            (None, None) => {
                if let Some(secret) = std::env::var_os(SECRET_ENV) {
                    return SharedSecret::new(secret.into_encoded_bytes()).map(Some);
                }
                match std::env::var_os(SECRET_FILE_ENV) {
                    Some(path) => from_file(Path::new(&path)).map(Some),
                    None => Ok(None),
                }
            }
        }
    }

    /// The secret's bytes, for deriving keys ([`sealing`](crate::transport::sealing)).
    pub(crate) fn expose(&self) -> &[u8] {
        &self.0
    }
}

/// A fresh random nonce from the operating system.
///
/// # Errors
/// [`Error::Io`] when the operating system gives no randomness.
pub(crate) fn nonce() -> Result<Nonce> {
    random_bytes("draw a nonce")
}

/// `N` fresh random bytes from the operating system, for `operation` (named in the error).
///
/// # Errors
/// [`Error::Io`] when the operating system gives no randomness.
pub(crate) fn random_bytes<const N: usize>(operation: &'static str) -> Result<[u8; N]> {
    let mut bytes = [0; N];
    getrandom::fill(&mut bytes).map_err(|err| {
        Error::io(
            operation,
            "this host",
            std::io::Error::other(err.to_string()),
        )
    })?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_file_must_be_its_owners_alone() {
        let dir = std::env::temp_dir().join(format!("nixl-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, "0123456789abcdef0123\n").unwrap();
        let chmod =
            |mode| std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        for mode in [0o600, 0o400] {
            chmod(mode);
            assert!(SharedSecret::from_file(&file).is_ok(), "{mode:o}");
        }
        for mode in [0o644, 0o640, 0o604, 0o660] {
            chmod(mode);
            let err = SharedSecret::from_file(&file).unwrap_err().to_string();
            assert!(err.contains("chmod 600"), "{err}");
            assert!(err.contains(&format!("{mode:04o}")), "{err}");
            assert!(SharedSecret::from_file_with(&file, true).is_ok());
        }
        // A link of this process's user is followed.
        chmod(0o600);
        let link = dir.join("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(SharedSecret::from_file(&link).is_ok());
        // Another user's link is refused, whatever it points at (root can make one).
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::lchown(&link, Some(54321), None).unwrap();
            let err = SharedSecret::from_file(&link).unwrap_err().to_string();
            assert!(err.contains("symlink owned by user 54321"), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_secret_is_never_shown_and_must_have_a_usable_length() {
        let secret = SharedSecret::new(*b"0123456789abcdef").unwrap();
        assert_eq!(format!("{secret:?}"), "SharedSecret(<redacted>)");
        assert!(SharedSecret::new(*b"short").is_err());
        assert!(SharedSecret::new(vec![0; MAX_SECRET_BYTES + 1]).is_err());
    }
}

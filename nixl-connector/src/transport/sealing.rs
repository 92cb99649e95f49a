//! Keys derived from the [`SharedSecret`], and the messages sealed under them: each
//! side-channel exchange's two session keys, and values stored where others may read them
//! (etcd).
//!
//! Keys come from HKDF-SHA256 over the secret; sealing is ChaCha20-Poly1305 (both from
//! `ring`). A sealed message can be read only with the secret, and any change to it, or
//! moving it to another exchange, role or place, makes it fail to open.
//!
//! - **An exchange's keys** are salted with both sides' fresh nonces, one key per role: the
//!   reader's seals its handshake, the server's its answer. Each key seals one message, so
//!   the AEAD nonce is fixed, and a message sealed by one role never opens as the other's.
//! - **A value at rest** gets a key of its own from a fresh random salt stored with it, and
//!   its place (the etcd key) is authenticated with it.

use ring::aead::{Aad, LessSafeKey, Nonce as AeadNonce, UnboundKey, CHACHA20_POLY1305};
use ring::hkdf::{Salt, HKDF_SHA256};

use crate::error::Result;
use crate::transport::auth::{random_bytes, Nonce, SharedSecret};

/// Version of the authenticated side-channel exchange: 2 seals both handshakes under keys
/// of the exchange (1 sent them in the clear with a MAC). Peers of another version are
/// refused, naming both.
pub const SIDE_CHANNEL_AUTH_VERSION: u32 = 2;

/// What the exchange's key derivation is salted with first.
const EXCHANGE_LABEL: &[u8] = b"nixl-connector side channel v2";

/// The reader's key's HKDF info, and its sealed message's associated data.
const READER_ROLE: &[u8] = b"nixl-connector side channel v2: reader";

/// The server's key's HKDF info, and its sealed message's associated data.
const SERVER_ROLE: &[u8] = b"nixl-connector side channel v2: server";

/// How a value sealed at rest starts.
const AT_REST_MAGIC: &[u8] = b"nixl-connector sealed v1\n";

/// HKDF info of a value sealed at rest.
const AT_REST_INFO: &[u8] = b"nixl-connector sealed value v1";

/// Bytes of the random salt of a value sealed at rest.
const AT_REST_SALT_BYTES: usize = 32;

/// Which side of an exchange seals a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The side that asks for a handshake (a decode rank).
    Reader,
    /// The side that answers (a prefill rank's side channel).
    Server,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Reader => READER_ROLE,
            Role::Server => SERVER_ROLE,
        }
    }
}

/// The two keys of one side-channel exchange, from the secret and both sides' nonces.
pub(crate) struct SessionKeys {
    reader: LessSafeKey,
    server: LessSafeKey,
}

impl SessionKeys {
    /// The keys of the exchange of nonces `reader` and `server` under `secret`.
    pub(crate) fn derive(secret: &SharedSecret, reader: &Nonce, server: &Nonce) -> Self {
        let mut salt = Vec::with_capacity(EXCHANGE_LABEL.len() + 2 * reader.len());
        salt.extend_from_slice(EXCHANGE_LABEL);
        salt.extend_from_slice(reader);
        salt.extend_from_slice(server);
        let prk = Salt::new(HKDF_SHA256, &salt).extract(secret.expose());
        let key = |role: Role| {
            let info = [role.label()];
            let okm = prk
                .expand(&info, &CHACHA20_POLY1305)
                .expect("HKDF-SHA256 gives 32 bytes of key for any info");
            LessSafeKey::new(UnboundKey::from(okm))
        };
        SessionKeys {
            reader: key(Role::Reader),
            server: key(Role::Server),
        }
    }

    fn key(&self, role: Role) -> &LessSafeKey {
        match role {
            Role::Reader => &self.reader,
            Role::Server => &self.server,
        }
    }

    /// `message` sealed by `role` (each role seals one message per exchange).
    pub(crate) fn seal(&self, role: Role, message: &[u8]) -> Vec<u8> {
        seal_with(self.key(role), role.label(), message)
    }

    /// The message `sealed` holds, if `role` sealed it in this exchange and nothing changed
    /// it.
    pub(crate) fn open(&self, role: Role, sealed: &[u8]) -> Option<Vec<u8>> {
        open_with(self.key(role), role.label(), sealed)
    }
}

/// `message` sealed with `key` (used for this one message), `aad` authenticated with it.
fn seal_with(key: &LessSafeKey, aad: &[u8], message: &[u8]) -> Vec<u8> {
    let mut sealed = message.to_vec();
    key.seal_in_place_append_tag(
        AeadNonce::assume_unique_for_key([0; 12]),
        Aad::from(aad),
        &mut sealed,
    )
    .expect("ChaCha20-Poly1305 seals messages of up to 256 GiB");
    sealed
}

/// What `sealed` holds, if `key` sealed it with `aad` and nothing changed it.
fn open_with(key: &LessSafeKey, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
    let mut buffer = sealed.to_vec();
    let len = key
        .open_in_place(
            AeadNonce::assume_unique_for_key([0; 12]),
            Aad::from(aad),
            &mut buffer,
        )
        .ok()?
        .len();
    buffer.truncate(len);
    Some(buffer)
}

/// The key of a value sealed at rest with `salt`.
fn at_rest_key(secret: &SharedSecret, salt: &[u8]) -> LessSafeKey {
    let prk = Salt::new(HKDF_SHA256, salt).extract(secret.expose());
    let info = [AT_REST_INFO];
    let okm = prk
        .expand(&info, &CHACHA20_POLY1305)
        .expect("HKDF-SHA256 gives 32 bytes of key for any info");
    LessSafeKey::new(UnboundKey::from(okm))
}

/// Whether `value` is a value sealed at rest (by [`seal_at_rest`]).
pub(crate) fn is_sealed_at_rest(value: &[u8]) -> bool {
    value.starts_with(AT_REST_MAGIC)
}

/// `value` sealed under `secret` for storing at `place` (e.g. its etcd key), where anyone
/// may read it: a fresh salt, then the sealed bytes.
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) when the operating system gives no randomness.
pub(crate) fn seal_at_rest(secret: &SharedSecret, place: &str, value: &[u8]) -> Result<Vec<u8>> {
    let salt: [u8; AT_REST_SALT_BYTES] = random_bytes("draw a salt")?;
    let sealed = seal_with(&at_rest_key(secret, &salt), place.as_bytes(), value);
    let mut stored = Vec::with_capacity(AT_REST_MAGIC.len() + salt.len() + sealed.len());
    stored.extend_from_slice(AT_REST_MAGIC);
    stored.extend_from_slice(&salt);
    stored.extend_from_slice(&sealed);
    Ok(stored)
}

/// The value `stored` at `place` held, sealed by [`seal_at_rest`] under `secret`; why not
/// otherwise (not sealed, another secret, another place, or changed).
pub(crate) fn open_at_rest(
    secret: &SharedSecret,
    place: &str,
    stored: &[u8],
) -> std::result::Result<Vec<u8>, &'static str> {
    let rest = stored
        .strip_prefix(AT_REST_MAGIC)
        .ok_or("the value is not sealed; its publisher has no shared secret")?;
    if rest.len() < AT_REST_SALT_BYTES {
        return Err("the sealed value is truncated");
    }
    let (salt, sealed) = rest.split_at(AT_REST_SALT_BYTES);
    open_with(&at_rest_key(secret, salt), place.as_bytes(), sealed).ok_or(
        "the sealed value does not open: another shared secret sealed it, it was sealed for another key, or it was changed",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::auth::nonce;

    fn secret(text: &str) -> SharedSecret {
        SharedSecret::new(text.as_bytes()).unwrap()
    }

    #[test]
    fn an_exchange_opens_only_its_own_roles_messages() {
        let s = secret("0123456789abcdef");
        let (r, v) = (nonce().unwrap(), nonce().unwrap());
        let keys = SessionKeys::derive(&s, &r, &v);
        let sealed = keys.seal(Role::Reader, b"handshake");
        assert!(
            !sealed.windows(9).any(|w| w == b"handshake"),
            "in the clear"
        );
        assert_eq!(
            keys.open(Role::Reader, &sealed).as_deref(),
            Some(&b"handshake"[..])
        );
        assert!(keys.open(Role::Server, &sealed).is_none(), "roles differ");
        let same = SessionKeys::derive(&s, &r, &v);
        assert!(same.open(Role::Reader, &sealed).is_some());
        for other in [
            SessionKeys::derive(&s, &v, &r),
            SessionKeys::derive(&s, &r, &nonce().unwrap()),
            SessionKeys::derive(&secret("0123456789abcdeF"), &r, &v),
        ] {
            assert!(other.open(Role::Reader, &sealed).is_none());
        }
        for at in [0, sealed.len() / 2, sealed.len() - 1] {
            let mut changed = sealed.clone();
            changed[at] ^= 1;
            assert!(keys.open(Role::Reader, &changed).is_none(), "byte {at}");
        }
        assert!(keys
            .open(Role::Reader, &sealed[..sealed.len() - 1])
            .is_none());
        assert!(keys.open(Role::Reader, b"").is_none());
    }

    #[test]
    fn a_value_at_rest_opens_only_with_its_secret_and_place() {
        let s = secret("0123456789abcdef");
        let stored = seal_at_rest(&s, "/ns/agent/metadata", b"metadata").unwrap();
        assert!(is_sealed_at_rest(&stored));
        assert_eq!(
            open_at_rest(&s, "/ns/agent/metadata", &stored).unwrap(),
            b"metadata"
        );
        let again = seal_at_rest(&s, "/ns/agent/metadata", b"metadata").unwrap();
        assert_ne!(stored, again, "a fresh salt each time");
        assert!(open_at_rest(&s, "/ns/other/metadata", &stored).is_err());
        assert!(open_at_rest(
            &secret("another secret, 16+"),
            "/ns/agent/metadata",
            &stored
        )
        .is_err());
        let mut changed = stored.clone();
        *changed.last_mut().unwrap() ^= 1;
        assert!(open_at_rest(&s, "/ns/agent/metadata", &changed).is_err());
        assert!(open_at_rest(&s, "/ns/agent/metadata", b"metadata").is_err());
        assert!(open_at_rest(&s, "/ns/agent/metadata", AT_REST_MAGIC).is_err());
    }
}

//! Reads the version of a NIXL installation without loading it.
//!
//! NIXL has no call that returns its version; its common library holds the version as the
//! string that follows `NIXL version: ` (what NIXL logs at start-up), and every NIXL
//! library folder (a meson install, a wheel) holds that library beside `libnixl_capi.so`.

use std::path::Path;

/// NIXL's common library, which holds the version string.
const COMMON_LIB: &str = "libnixl_common.so";

/// What precedes the version among the library's strings.
const MARKER: &[u8] = b"NIXL version: \0";

/// Longest version string accepted.
const MAX_LEN: usize = 64;

/// The NIXL version of the installation whose libraries are in `dir`, or why it is unknown.
pub(super) fn read(dir: &Path) -> Result<String, String> {
    let path = dir.join(COMMON_LIB);
    let bytes =
        std::fs::read(&path).map_err(|err| format!("cannot read {}: {err}", path.display()))?;
    find(&bytes).ok_or_else(|| format!("{} holds no NIXL version string", path.display()))
}

/// The version string after [`MARKER`] in `bytes`: up to [`MAX_LEN`] characters of digits,
/// letters, `.`, `+`, `-` and `_`, ended by a NUL.
fn find(bytes: &[u8]) -> Option<String> {
    let at = bytes.windows(MARKER.len()).position(|w| w == MARKER)? + MARKER.len();
    let rest = &bytes[at..bytes.len().min(at + MAX_LEN + 1)];
    let len = rest.iter().position(|&b| b == 0)?;
    let version = &rest[..len];
    let allowed = |b: &u8| b.is_ascii_alphanumeric() || b"._+-".contains(b);
    (!version.is_empty() && version.iter().all(allowed))
        .then(|| String::from_utf8_lossy(version).into_owned())
}

#[cfg(test)]
mod tests {
    use super::find;

    #[test]
    fn reads_the_string_after_the_marker() {
        assert_eq!(
            find(b"\0FATAL\0NIXL version: \x001.5.1\0 (git: \0").as_deref(),
            Some("1.5.1")
        );
    }

    #[test]
    fn refuses_a_missing_marker_or_a_string_that_is_no_version() {
        assert_eq!(find(b"NIXL 1.5.1\0"), None);
        assert_eq!(find(b"NIXL version: \0"), None);
        assert_eq!(find(b"NIXL version: \0\0"), None);
        assert_eq!(find(b"NIXL version: \x00a b\0"), None);
        assert_eq!(
            find(&[b"NIXL version: \0".as_slice(), &[b'1'; 100], b"\0"].concat()),
            None
        );
    }
}

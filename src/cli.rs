//! Command-line value parsers shared by the prefill and decode binaries, and whether their
//! logs use colour.

use std::ffi::OsStr;

/// Parses a byte size: a number with an optional `K`/`KiB`, `M`/`MiB` or `G`/`GiB` suffix
/// (powers of 1024), e.g. `16KiB`, `4096`, `1M`.
///
/// # Errors
/// A message for an empty, unknown-suffix, zero or overflowing size.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let number: usize = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 16KiB, 4096, 1MiB)"))?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        "g" | "gib" | "gb" => 30,
        other => return Err(format!("unknown size suffix {other:?} in {s:?}")),
    };
    match number.checked_mul(1usize << shift) {
        Some(0) => Err("a size must be non-zero".to_string()),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{s:?} is too large")),
    }
}

/// Parses a count or duration that must be at least 1, e.g. `--requests` or
/// `--connect-timeout-s` (clap names the flag in its error).
///
/// # Errors
/// A message for a non-number, a zero, or a number too large for `T`.
pub fn parse_positive<T: TryFrom<u64>>(s: &str) -> Result<T, String> {
    let n: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number"))?;
    if n == 0 {
        return Err("must be at least 1".to_string());
    }
    T::try_from(n).map_err(|_| format!("{n} is too large"))
}

/// Parses a connector protocol: `native` or `vllm`.
///
/// # Errors
/// The connector's message for any other name.
pub fn parse_protocol(s: &str) -> Result<nixl_connector::Protocol, String> {
    s.trim()
        .parse()
        .map_err(|err: nixl_connector::Error| err.to_string())
}

/// Parses a transfer mode: `pull` or `push`.
///
/// # Errors
/// The connector's message for any other name.
pub fn parse_transfer_mode(s: &str) -> Result<nixl_connector::TransferMode, String> {
    s.trim()
        .parse()
        .map_err(|err: nixl_connector::Error| err.to_string())
}

/// Whether logs written to a stream use ANSI colour: only when it is a terminal and
/// `NO_COLOR` (the value of the environment variable, if set) is absent or empty.
pub fn use_colour(is_terminal: bool, no_color: Option<&OsStr>) -> bool {
    is_terminal && no_color.map_or(true, OsStr::is_empty)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("16KiB"), Ok(16 << 10));
        assert_eq!(parse_size("16k"), Ok(16 << 10));
        assert_eq!(parse_size("2 MiB"), Ok(2 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn positive_numbers() {
        assert_eq!(parse_positive::<u64>("3"), Ok(3));
        assert_eq!(parse_positive::<u32>(" 7 "), Ok(7));
        assert_eq!(parse_positive::<u64>("0"), Err("must be at least 1".into()));
        assert!(parse_positive::<u64>("-1").is_err());
        assert!(parse_positive::<u64>("x").is_err());
        assert!(parse_positive::<u32>("4294967296").is_err());
    }

    #[test]
    fn protocols() {
        assert_eq!(parse_protocol("vllm"), Ok(nixl_connector::Protocol::Vllm));
        assert_eq!(
            parse_protocol("native"),
            Ok(nixl_connector::Protocol::Native)
        );
        assert!(parse_protocol("zmq").unwrap_err().contains("\"vllm\""));
    }

    #[test]
    fn transfer_modes() {
        use nixl_connector::TransferMode;
        assert_eq!(parse_transfer_mode("push"), Ok(TransferMode::Push));
        assert_eq!(parse_transfer_mode(" pull"), Ok(TransferMode::Pull));
        assert!(parse_transfer_mode("write")
            .unwrap_err()
            .contains("\"push\""));
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_colour(true, None));
        assert!(use_colour(true, Some(OsStr::new(""))));
        assert!(!use_colour(true, Some(OsStr::new("1"))));
        assert!(!use_colour(false, None));
    }
}

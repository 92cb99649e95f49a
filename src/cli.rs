//! Command-line value parsers shared by the prefill and decode binaries.

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
}

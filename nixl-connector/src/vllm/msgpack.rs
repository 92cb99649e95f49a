//! Strict MessagePack decoding of a peer's bytes: exactly one value, nothing after it, a
//! small nesting limit, and no allocation larger than what the bytes hold.

use serde::Deserialize;

/// Deepest nesting a vLLM message has is three (a map holding a list of lists); a little
/// more leaves room for unknown fields, which are skipped.
const MAX_DEPTH: usize = 16;

/// Decodes `bytes` as exactly one MessagePack value of type `T`.
///
/// rmp-serde decodes from a slice without allocating by declared lengths (a declared length
/// beyond the slice is an error, and serde caps what it reserves for a sequence).
///
/// # Errors
/// A message for a person: malformed bytes, bytes after the value, or a value of the wrong
/// shape (naming the field).
pub(crate) fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, String> {
    decode_within(bytes, usize::MAX)
}

/// [`decode`], refusing before anything is allocated bytes that hold more than
/// `max_values` MessagePack values (each array, map, string or number counts one). Each
/// value can become a Rust value many times its one byte (an empty string, 24 bytes), so
/// this, and not the length of `bytes`, bounds what decoding allocates beyond the bytes'
/// contents.
///
/// # Errors
/// As [`decode`], and a message naming the cap for more values.
pub(crate) fn decode_within<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
    max_values: usize,
) -> Result<T, String> {
    let len = value_len(bytes, max_values)?;
    if len != bytes.len() {
        return Err(format!(
            "{} bytes after the MessagePack value",
            bytes.len() - len
        ));
    }
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_DEPTH);
    T::deserialize(&mut de).map_err(|err| err.to_string())
}

/// The length of the one MessagePack value at the start of `bytes`, found without
/// recursion or allocation (a count of values still to read stands in for the stack), or
/// an error once more than `max_values` values were read.
fn value_len(bytes: &[u8], max_values: usize) -> Result<usize, String> {
    let truncated = || "the MessagePack value is cut short".to_string();
    let mut pos = 0usize;
    let mut pending: u64 = 1;
    let take = |pos: &mut usize, n: usize| -> Result<usize, String> {
        let start = *pos;
        let end = start.checked_add(n).filter(|&e| e <= bytes.len());
        *pos = end.ok_or_else(truncated)?;
        Ok(start)
    };
    let be = |pos: &mut usize, n: usize| -> Result<u64, String> {
        let start = take(pos, n)?;
        Ok(bytes[start..start + n]
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    };
    let mut values = 0usize;
    while pending > 0 {
        pending -= 1;
        values += 1;
        if values > max_values {
            return Err(format!(
                "more than {max_values} MessagePack values, the most this message takes"
            ));
        }
        let marker = bytes[take(&mut pos, 1)?];
        let (skip, items) = match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * u64::from(marker & 0x0f)),
            0x90..=0x9f => (0, u64::from(marker & 0x0f)),
            0xa0..=0xbf => (u64::from(marker & 0x1f), 0),
            0xc4 | 0xd9 => (be(&mut pos, 1)?, 0),
            0xc5 | 0xda => (be(&mut pos, 2)?, 0),
            0xc6 | 0xdb => (be(&mut pos, 4)?, 0),
            0xc7 => (be(&mut pos, 1)? + 1, 0),
            0xc8 => (be(&mut pos, 2)? + 1, 0),
            0xc9 => (be(&mut pos, 4)? + 1, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xca | 0xce | 0xd2 => (4, 0),
            0xcb | 0xcf | 0xd3 => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xdc => (0, be(&mut pos, 2)?),
            0xdd => (0, be(&mut pos, 4)?),
            0xde => (0, 2 * be(&mut pos, 2)?),
            0xdf => (0, 2 * be(&mut pos, 4)?),
            0xc1 => return Err("byte 0xc1 is never used in MessagePack".into()),
        };
        take(&mut pos, usize::try_from(skip).map_err(|_| truncated())?)?;
        // Each value still to read needs a byte, so the bytes run out long before this
        // could saturate.
        pending = pending.saturating_add(items);
    }
    Ok(pos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_value_exactly() {
        let bytes = rmp_serde::to_vec(&(1u8, "ab", vec![vec![1u64 << 40]])).unwrap();
        assert_eq!(value_len(&bytes, usize::MAX), Ok(bytes.len()));
        let back: (u8, String, Vec<Vec<u64>>) = decode(&bytes).unwrap();
        assert_eq!(back, (1, "ab".into(), vec![vec![1 << 40]]));
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode::<(u8, String, Vec<Vec<u64>>)>(&longer)
            .unwrap_err()
            .contains("1 bytes after"));
        for cut in 0..bytes.len() {
            assert!(decode::<(u8, String, Vec<Vec<u64>>)>(&bytes[..cut]).is_err());
        }
    }

    #[test]
    fn declared_lengths_beyond_the_bytes_are_refused_without_allocating() {
        // An array of 2^32 - 1 items, a 4 GiB bin, a map of 2^32 - 1 pairs, a 4 GiB ext.
        for bytes in [
            &[0xdd, 0xff, 0xff, 0xff, 0xff][..],
            &[0xc6, 0xff, 0xff, 0xff, 0xff, 1],
            &[0xdf, 0xff, 0xff, 0xff, 0xff],
            &[0xc9, 0xff, 0xff, 0xff, 0xff, 1],
        ] {
            assert!(decode::<serde::de::IgnoredAny>(bytes)
                .unwrap_err()
                .contains("cut short"));
        }
        assert!(decode::<u8>(&[0xc1]).unwrap_err().contains("0xc1"));
    }

    #[test]
    fn more_values_than_the_cap_are_refused_before_decoding() {
        let bytes = rmp_serde::to_vec(&vec![String::new(); 10]).unwrap();
        // The array and its ten strings.
        assert_eq!(value_len(&bytes, 11), Ok(bytes.len()));
        assert_eq!(decode_within::<Vec<String>>(&bytes, 11).unwrap().len(), 10);
        let err = decode_within::<Vec<String>>(&bytes, 10).unwrap_err();
        assert!(err.contains("more than 10 MessagePack values"), "{err}");
    }

    #[test]
    fn deep_nesting_is_refused() {
        let mut bytes = vec![0x91; 10_000];
        bytes.push(0xc0);
        assert_eq!(value_len(&bytes, usize::MAX), Ok(bytes.len()));
        assert!(decode::<serde::de::IgnoredAny>(&bytes).is_err());
    }

    #[test]
    fn every_marker_is_sized() {
        let values: Vec<Vec<u8>> = vec![
            rmp_serde::to_vec(&-1i8).unwrap(),
            rmp_serde::to_vec(&-200i16).unwrap(),
            rmp_serde::to_vec(&-70_000i32).unwrap(),
            rmp_serde::to_vec(&-(1i64 << 40)).unwrap(),
            rmp_serde::to_vec(&200u8).unwrap(),
            rmp_serde::to_vec(&60_000u16).unwrap(),
            rmp_serde::to_vec(&70_000u32).unwrap(),
            rmp_serde::to_vec(&(1u64 << 40)).unwrap(),
            rmp_serde::to_vec(&1.5f32).unwrap(),
            rmp_serde::to_vec(&1.5f64).unwrap(),
            rmp_serde::to_vec(&"x".repeat(300)).unwrap(),
            rmp_serde::to_vec(&"x".repeat(70_000)).unwrap(),
            rmp_serde::to_vec(&serde_bytes::ByteBuf::from(vec![7u8; 300])).unwrap(),
            rmp_serde::to_vec(&vec![0u8; 20]).unwrap(),
            rmp_serde::to_vec(&std::collections::BTreeMap::from([(1u8, 2u8); 1])).unwrap(),
            rmp_serde::to_vec(&Option::<u8>::None).unwrap(),
            rmp_serde::to_vec(&true).unwrap(),
            vec![0xd4, 1, 2],
            vec![0xd5, 1, 2, 3],
            vec![0xd6, 1, 2, 3, 4, 5],
            vec![0xd7, 1, 2, 3, 4, 5, 6, 7, 8, 9],
            [&[0xd8][..], &[0; 17]].concat(),
            vec![0xc7, 2, 1, 9, 9],
            vec![0xc8, 0, 2, 1, 9, 9],
            vec![0xc9, 0, 0, 0, 2, 1, 9, 9],
        ];
        for value in values {
            assert_eq!(
                value_len(&value, usize::MAX),
                Ok(value.len()),
                "{value:02x?}"
            );
            let mut doubled = value.clone();
            doubled.extend_from_slice(&value);
            assert_eq!(
                value_len(&doubled, usize::MAX),
                Ok(value.len()),
                "{value:02x?}"
            );
        }
    }
}

//! Where the interesting fields of a metadata blob are, found by walking NIXL's container
//! (the harness's own light walk; the crate's validator is what is under test).

/// Kinds of field the structure-aware mutations aim at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An 8-byte field length.
    Length,
    /// An 8-byte count (Conns, nixlSecElms, n).
    Count,
    /// A 4-byte memory type.
    MemType,
    /// The first byte of a UCX worker address (version and flags).
    UcxHeader,
    /// Any byte inside a UCX worker address.
    UcxAddress,
    /// Any byte inside a descriptor's backend blob (UCX rkey).
    Rkey,
}

/// A field: its kind, offset and length in bytes.
#[derive(Debug, Clone, Copy)]
pub struct Spot {
    /// What the field is.
    pub kind: Kind,
    /// Offset of its first byte.
    pub offset: usize,
    /// Its length in bytes.
    pub len: usize,
}

/// The fields of `bytes` that parse as NIXL's container, in order (stops at the first
/// thing that does not parse). Every spot lies inside `bytes`: the walk stops at the first
/// field whose payload would reach its end, and a count is marked only where its payload
/// is 8 bytes.
pub fn spots(bytes: &[u8]) -> Vec<Spot> {
    let mut out = Vec::new();
    let mut pos = b"nixlSerDes|".len();
    let tags: &[&[u8]] = &[
        b"nixlSecElms",
        b"nixlDList",
        b"Agent",
        b"Conns",
        b"bknd",
        b"t",
        b"c",
        b"n",
    ];
    let mut last_tag: &[u8] = b"";
    while pos < bytes.len() {
        let tag = tags
            .iter()
            .find(|t| bytes[pos..].starts_with(t))
            .copied()
            .unwrap_or(b"");
        let len_at = pos + tag.len();
        let Some(raw) = bytes.get(len_at..len_at + 8) else {
            break;
        };
        let len = u64::from_le_bytes(raw.try_into().unwrap()) as usize;
        let data = len_at + 8;
        if data.checked_add(len).map_or(true, |end| end >= bytes.len()) {
            break;
        }
        out.push(Spot {
            kind: Kind::Length,
            offset: len_at,
            len: 8,
        });
        match tag {
            // A count is 8 bytes; a mutated length may leave fewer.
            b"Conns" | b"nixlSecElms" | b"n" if len == 8 => out.push(Spot {
                kind: Kind::Count,
                offset: data,
                len: 8,
            }),
            b"t" if len == 4 => out.push(Spot {
                kind: Kind::MemType,
                offset: data,
                len: 4,
            }),
            b"c" if last_tag == b"t" => {
                out.push(Spot {
                    kind: Kind::UcxHeader,
                    offset: data,
                    len: 1,
                });
                out.push(Spot {
                    kind: Kind::UcxAddress,
                    offset: data,
                    len,
                });
            }
            b"" if len > 24 => out.push(Spot {
                kind: Kind::Rkey,
                offset: data + 24,
                len: len - 24,
            }),
            _ => {}
        }
        last_tag = tag;
        pos = data + len + 1;
    }
    out.retain(|spot| spot.len > 0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A container field: tag, 8-byte length, payload, separator.
    fn field(out: &mut Vec<u8>, tag: &[u8], payload: &[u8]) {
        out.extend(tag);
        out.extend((payload.len() as u64).to_le_bytes());
        out.extend(payload);
        out.push(b'|');
    }

    /// Offsets of the count spots of `bytes`.
    fn counts(bytes: &[u8]) -> Vec<usize> {
        spots(bytes)
            .iter()
            .filter(|s| s.kind == Kind::Count)
            .map(|s| s.offset)
            .collect()
    }

    #[test]
    fn a_count_cut_short_at_the_end_is_no_spot() {
        // "Conns" whose payload a mutation cut to 1 byte: no 8-byte count spot may run past it
        // (the harness once panicked slicing one).
        let mut md = b"nixlSerDes|".to_vec();
        field(&mut md, b"Agent", b"a");
        field(&mut md, b"Conns", b"x");
        let found = spots(&md);
        assert!(!found.is_empty());
        assert!(found.iter().all(|s| s.offset + s.len <= md.len()));
        assert!(counts(&md).is_empty());
    }

    #[test]
    fn a_count_cut_short_in_the_middle_of_a_blob_is_no_count() {
        // The cut count is followed by more fields: 8 bytes from its payload lie inside the
        // blob, but they are the next field's bytes, not a count.
        let mut md = b"nixlSerDes|".to_vec();
        field(&mut md, b"Agent", b"a");
        field(&mut md, b"Conns", b"x");
        let real = md.len() + b"nixlSecElms".len() + 8;
        field(&mut md, b"nixlSecElms", &3u64.to_le_bytes());
        field(&mut md, b"bknd", b"UCX");
        assert_eq!(counts(&md), [real], "only the whole count is one");
    }

    #[test]
    fn every_spot_of_every_cut_of_real_metadata_lies_inside_it() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/metadata_corpus");
        let mut files = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "bin") {
                continue;
            }
            let md = std::fs::read(&path).unwrap();
            for cut in 0..=md.len() {
                for spot in spots(&md[..cut]) {
                    assert!(
                        spot.len > 0 && spot.offset + spot.len <= cut,
                        "{}: cut to {cut}: {spot:?}",
                        path.display()
                    );
                }
            }
            files += 1;
        }
        assert!(files >= 20, "{files} corpus files");
    }
}

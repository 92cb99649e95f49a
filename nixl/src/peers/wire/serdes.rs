//! NIXL's serializer container: a `nixlSerDes|` header, then fields, each one tag, an
//! 8-byte little-endian payload length, the payload and a `|` separator.

use super::reader::{Parsed, Reader};

/// The container's first bytes.
const HEADER: &[u8] = b"nixlSerDes|";

/// One field's payload and the absolute offset where the payload starts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Field<'a> {
    /// The payload.
    pub bytes: &'a [u8],
    /// Offset of its first byte within the whole metadata.
    pub offset: usize,
}

/// Reads the fields of a container, in order.
pub(crate) struct Fields<'a> {
    reader: Reader<'a>,
}

impl<'a> Fields<'a> {
    /// Checks the header of `bytes` and positions after it.
    pub fn open(bytes: &'a [u8]) -> Parsed<Self> {
        let mut reader = Reader::new(bytes, 0);
        let head = reader
            .take(HEADER.len(), "container header")
            .map_err(|_| reader.reject_at(0, "too short for the nixlSerDes| header"))?;
        if head != HEADER {
            return Err(reader.reject_at(0, "missing the nixlSerDes| header"));
        }
        Ok(Fields { reader })
    }

    /// The next field, whose tag must be `tag`.
    #[inline]
    pub fn field(&mut self, tag: &str) -> Parsed<Field<'a>> {
        let at = self.reader.offset();
        let found = self.reader.take(tag.len(), "field tag")?;
        // Descriptors have an empty tag: skip the comparison call for them.
        if !tag.is_empty() && found != tag.as_bytes() {
            return Err(self
                .reader
                .reject_at(at, format!("expected the field tag {tag:?}")));
        }
        let len_at = self.reader.offset();
        let len = self.reader.u64("field length")?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&len| len < self.reader.remaining())
            .ok_or_else(|| {
                self.reader.reject_at(
                    len_at,
                    format!(
                        "field {tag:?} claims {len} bytes, only {} follow",
                        self.reader.remaining()
                    ),
                )
            })?;
        let offset = self.reader.offset();
        let bytes = self.reader.take(len, "field payload")?;
        let sep_at = self.reader.offset();
        if self.reader.u8("field separator")? != b'|' {
            return Err(self
                .reader
                .reject_at(sep_at, format!("field {tag:?} is not followed by '|'")));
        }
        Ok(Field { bytes, offset })
    }

    /// The next field as a little-endian integer of exactly `N` bytes.
    #[inline]
    pub fn fixed<const N: usize>(&mut self, tag: &str) -> Parsed<([u8; N], usize)> {
        let field = self.field(tag)?;
        let raw: [u8; N] = field.bytes.try_into().map_err(|_| {
            self.reader.reject_at(
                field.offset,
                format!(
                    "field {tag:?} has {} bytes, expected {N}",
                    field.bytes.len()
                ),
            )
        })?;
        Ok((raw, field.offset))
    }

    /// The next field as an 8-byte count.
    #[inline]
    pub fn count(&mut self, tag: &str) -> Parsed<(u64, usize)> {
        let (raw, offset) = self.fixed::<8>(tag)?;
        Ok((u64::from_le_bytes(raw), offset))
    }

    /// The next field, which must not be empty (NIXL reads an empty one as missing).
    #[inline]
    pub fn non_empty(&mut self, tag: &str, what: &str) -> Parsed<Field<'a>> {
        let field = self.field(tag)?;
        if field.bytes.is_empty() {
            return Err(self
                .reader
                .reject_at(field.offset, format!("{what} is empty")));
        }
        Ok(field)
    }

    /// Bytes left after the fields read so far.
    #[inline]
    pub fn remaining(&self) -> usize {
        self.reader.remaining()
    }

    /// An error at absolute offset `offset`.
    pub fn reject_at(&self, offset: usize, reason: impl Into<String>) -> super::reader::Reject {
        self.reader.reject_at(offset, reason)
    }

    /// Fails unless every byte was read.
    #[inline]
    pub fn finish(&self) -> Parsed<()> {
        self.reader.finish("the metadata")
    }
}

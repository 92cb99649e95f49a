//! A cursor over untrusted bytes: every read is bounds-checked and a failure names the
//! absolute offset in the whole metadata blob.

/// Why bytes were rejected, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reject {
    /// Offset of the offending byte within the whole metadata.
    pub offset: usize,
    /// What is wrong there.
    pub reason: String,
}

/// Shorthand for results of the wire parsers.
pub(crate) type Parsed<T> = Result<T, Reject>;

/// Reads `bytes`, which start at offset `base` of the whole metadata.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    base: usize,
}

impl<'a> Reader<'a> {
    /// A reader over `bytes`, which begin at offset `base` of the whole metadata.
    pub fn new(bytes: &'a [u8], base: usize) -> Self {
        Reader {
            bytes,
            pos: 0,
            base,
        }
    }

    /// Absolute offset of the next byte.
    #[inline]
    pub fn offset(&self) -> usize {
        self.base.saturating_add(self.pos)
    }

    /// Bytes not read yet.
    #[inline]
    pub fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    /// An error at the next byte.
    pub fn reject(&self, reason: impl Into<String>) -> Reject {
        self.reject_at(self.offset(), reason)
    }

    /// An error at absolute offset `offset`.
    pub fn reject_at(&self, offset: usize, reason: impl Into<String>) -> Reject {
        Reject {
            offset,
            reason: reason.into(),
        }
    }

    /// The next `len` bytes, consumed; `what` names them in the error.
    #[inline]
    pub fn take(&mut self, len: usize, what: &str) -> Parsed<&'a [u8]> {
        let end = self.pos.checked_add(len);
        match end.and_then(|end| self.bytes.get(self.pos..end)) {
            Some(out) => {
                self.pos += len;
                Ok(out)
            }
            None => Err(self.reject(format!(
                "{what}: needs {len} bytes, only {} left",
                self.remaining()
            ))),
        }
    }

    /// The next byte, consumed.
    #[inline]
    pub fn u8(&mut self, what: &str) -> Parsed<u8> {
        let b = self.take(1, what)?;
        Ok(b.first().copied().unwrap_or_default())
    }

    /// The next byte, not consumed.
    #[inline]
    pub fn peek(&self, what: &str) -> Parsed<u8> {
        self.bytes
            .get(self.pos)
            .copied()
            .ok_or_else(|| self.reject(format!("{what}: needs 1 byte, none left")))
    }

    /// The next 2 bytes as a little-endian u16, consumed.
    #[inline]
    pub fn u16(&mut self, what: &str) -> Parsed<u16> {
        let mut raw = [0u8; 2];
        raw.copy_from_slice(self.take(2, what)?);
        Ok(u16::from_le_bytes(raw))
    }

    /// The next 4 bytes as a little-endian u32, consumed.
    #[inline]
    pub fn u32(&mut self, what: &str) -> Parsed<u32> {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(raw))
    }

    /// The next 8 bytes as a little-endian u64, consumed.
    #[inline]
    pub fn u64(&mut self, what: &str) -> Parsed<u64> {
        let b = self.take(8, what)?;
        let mut raw = [0u8; 8];
        raw.copy_from_slice(b);
        Ok(u64::from_le_bytes(raw))
    }

    /// Fails unless every byte was read.
    #[inline]
    pub fn finish(&self, what: &str) -> Parsed<()> {
        if self.remaining() == 0 {
            Ok(())
        } else {
            Err(self.reject(format!(
                "{} unexpected bytes after the end of {what}",
                self.remaining()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_bounded_and_report_absolute_offsets() {
        let mut r = Reader::new(&[1, 2, 3], 100);
        assert_eq!(r.u8("a").unwrap(), 1);
        let err = r.u64("b").unwrap_err();
        assert_eq!(err.offset, 101);
        assert!(err.reason.contains("needs 8 bytes"), "{}", err.reason);
        assert_eq!(r.take(usize::MAX, "c").unwrap_err().offset, 101);
        assert_eq!(r.take(2, "d").unwrap(), &[2, 3]);
        assert!(r.finish("e").is_ok());
        assert!(r.peek("f").is_err());
    }
}

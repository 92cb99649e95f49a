//! Field encoding inside a frame: big-endian integers and length-prefixed byte strings, read
//! back with a bounds-checked cursor that never allocates more than the frame holds.

use crate::error::{Error, Result};

/// Appends fields to a message body.
#[derive(Debug, Default)]
pub struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    /// A body starting with the message tag.
    pub fn new(tag: u8) -> Self {
        Encoder { buf: vec![tag] }
    }

    /// Appends a `u32`.
    pub fn u32(mut self, v: u32) -> Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// Appends a `u64`.
    pub fn u64(mut self, v: u64) -> Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    /// Appends bytes, prefixed by their `u32` length.
    pub fn bytes(self, v: &[u8]) -> Self {
        let len = u32::try_from(v.len()).unwrap_or(u32::MAX);
        let mut this = self.u32(len);
        this.buf.extend_from_slice(v);
        this
    }

    /// Appends a UTF-8 string like [`bytes`](Self::bytes).
    pub fn str(self, v: &str) -> Self {
        self.bytes(v.as_bytes())
    }

    /// Appends a list of `u32`, prefixed by its `u32` length.
    pub fn u32_list(self, v: &[u32]) -> Self {
        let len = u32::try_from(v.len()).unwrap_or(u32::MAX);
        v.iter().fold(self.u32(len), |e, &x| e.u32(x))
    }

    /// Appends a list of `u64`, prefixed by its `u32` length.
    pub fn u64_list(self, v: &[u64]) -> Self {
        let len = u32::try_from(v.len()).unwrap_or(u32::MAX);
        v.iter().fold(self.u32(len), |e, &x| e.u64(x))
    }

    /// The finished body.
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads fields back out of a body, checking every length against what is left.
#[derive(Debug)]
pub struct Decoder<'a> {
    rest: &'a [u8],
}

impl<'a> Decoder<'a> {
    /// A cursor over `body`.
    pub fn new(body: &'a [u8]) -> Self {
        Decoder { rest: body }
    }

    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        if n > self.rest.len() {
            return Err(Error::Protocol(format!(
                "message cut short in field {field}: needs {n} bytes, {} left",
                self.rest.len()
            )));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    /// Reads a `u8`.
    pub fn u8(&mut self, field: &str) -> Result<u8> {
        Ok(self.take(1, field)?[0])
    }

    /// Reads a `u32`.
    pub fn u32(&mut self, field: &str) -> Result<u32> {
        let b = self.take(4, field)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Reads a `u64`.
    pub fn u64(&mut self, field: &str) -> Result<u64> {
        let b = self.take(8, field)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    /// Reads length-prefixed bytes of at most `max` bytes.
    pub fn bytes(&mut self, field: &str, max: usize) -> Result<Vec<u8>> {
        let len = self.u32(field)? as usize;
        if len > max {
            return Err(Error::Protocol(format!(
                "field {field} has {len} bytes, more than the limit of {max}"
            )));
        }
        Ok(self.take(len, field)?.to_vec())
    }

    /// Reads a length-prefixed UTF-8 string of at most `max` bytes.
    pub fn str(&mut self, field: &str, max: usize) -> Result<String> {
        String::from_utf8(self.bytes(field, max)?)
            .map_err(|_| Error::Protocol(format!("field {field} is not UTF-8")))
    }

    fn list_len(&mut self, field: &str, max: usize, item: usize) -> Result<usize> {
        let len = self.u32(field)? as usize;
        if len > max {
            return Err(Error::Protocol(format!(
                "field {field} has {len} entries, more than the limit of {max}"
            )));
        }
        if len.saturating_mul(item) > self.rest.len() {
            return Err(Error::Protocol(format!(
                "message cut short in field {field}: {len} entries announced"
            )));
        }
        Ok(len)
    }

    /// Reads a length-prefixed list of at most `max` `u32`s.
    pub fn u32_list(&mut self, field: &str, max: usize) -> Result<Vec<u32>> {
        let len = self.list_len(field, max, 4)?;
        (0..len).map(|_| self.u32(field)).collect()
    }

    /// Reads a length-prefixed list of at most `max` `u64`s.
    pub fn u64_list(&mut self, field: &str, max: usize) -> Result<Vec<u64>> {
        let len = self.list_len(field, max, 8)?;
        (0..len).map(|_| self.u64(field)).collect()
    }

    /// Checks that the whole body was consumed.
    pub fn finish(self, message: &str) -> Result<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(Error::Protocol(format!(
                "{} unexpected trailing bytes after a {message} message",
                self.rest.len()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let body = Encoder::new(7)
            .u32(1)
            .u64(2)
            .str("name")
            .u32_list(&[3, 4])
            .u64_list(&[5])
            .finish();
        let mut d = Decoder::new(&body);
        assert_eq!(d.u8("tag").unwrap(), 7);
        assert_eq!(d.u32("a").unwrap(), 1);
        assert_eq!(d.u64("b").unwrap(), 2);
        assert_eq!(d.str("c", 16).unwrap(), "name");
        assert_eq!(d.u32_list("d", 16).unwrap(), [3, 4]);
        assert_eq!(d.u64_list("e", 16).unwrap(), [5]);
        d.finish("test").unwrap();
    }

    #[test]
    fn rejects_lengths_past_the_end_or_the_limit() {
        let body = Encoder::new(0).u32(u32::MAX).finish();
        let mut d = Decoder::new(&body[1..]);
        assert!(d.bytes("x", usize::MAX).is_err());
        let mut d = Decoder::new(&body[1..]);
        assert!(d.u64_list("x", usize::MAX).is_err());
        let body = Encoder::new(0).str("toolong").finish();
        let mut d = Decoder::new(&body[1..]);
        assert!(d.str("x", 3).is_err());
        let mut d = Decoder::new(&[1, 2]);
        assert!(d.u32("x").is_err());
    }

    #[test]
    fn rejects_trailing_bytes() {
        let d = Decoder::new(&[1]);
        assert!(d.finish("test").is_err());
    }
}

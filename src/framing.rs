//! Length-prefixed frames: a 4-byte big-endian body length, then the body.
//!
//! Readers refuse a frame longer than their limit before allocating anything, and tell a
//! clean end of stream (between frames) apart from a frame cut short.

use std::io::{ErrorKind, Read, Write};

/// Largest frame the demo's side channel accepts by default (16 MiB).
pub const DEFAULT_MAX_FRAME: usize = 16 << 20;

/// Size of the length prefix.
pub const HEADER_BYTES: usize = 4;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream ended cleanly between frames.
    #[error("the peer closed the connection")]
    Closed,
    /// The stream ended inside a frame.
    #[error("truncated frame: expected {expected} bytes, got {got}")]
    Truncated {
        /// Bytes the frame (or its header) needed.
        expected: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// A frame longer than the limit.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// The announced (or attempted) length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An empty frame: every message has at least a tag byte.
    #[error("empty frame")]
    Empty,
    /// The socket failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Writes `body` as one frame.
///
/// # Errors
/// [`FrameError::TooLarge`] when `body` exceeds `max`, [`FrameError::Empty`] for an empty
/// body, [`FrameError::Io`] when writing fails.
pub fn write_frame(w: &mut impl Write, body: &[u8], max: usize) -> Result<(), FrameError> {
    if body.is_empty() {
        return Err(FrameError::Empty);
    }
    let len = u32::try_from(body.len())
        .ok()
        .filter(|_| body.len() <= max)
        .ok_or(FrameError::TooLarge {
            len: body.len(),
            max,
        })?;
    let mut frame = Vec::with_capacity(HEADER_BYTES + body.len());
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(body);
    w.write_all(&frame)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame's body.
///
/// # Errors
/// [`FrameError::Closed`] at a clean end of stream, [`FrameError::Truncated`] when the stream
/// ends inside a frame, [`FrameError::TooLarge`] / [`FrameError::Empty`] for a bad length
/// (nothing is allocated for it), [`FrameError::Io`] when reading fails.
pub fn read_frame(r: &mut impl Read, max: usize) -> Result<Vec<u8>, FrameError> {
    let mut header = [0u8; HEADER_BYTES];
    let got = read_full(r, &mut header)?;
    if got == 0 {
        return Err(FrameError::Closed);
    }
    if got < HEADER_BYTES {
        return Err(FrameError::Truncated {
            expected: HEADER_BYTES,
            got,
        });
    }
    let len = u32::from_be_bytes(header) as usize;
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len];
    let got = read_full(r, &mut body)?;
    if got < len {
        return Err(FrameError::Truncated { expected: len, got });
    }
    Ok(body)
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> Result<usize, FrameError> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(err) if err.kind() == ErrorKind::Interrupted => {}
            Err(err) => return Err(FrameError::Io(err)),
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut wire = Vec::new();
        write_frame(&mut wire, b"hello", 64).unwrap();
        write_frame(&mut wire, b"world!", 64).unwrap();
        let mut r = wire.as_slice();
        assert_eq!(read_frame(&mut r, 64).unwrap(), b"hello");
        assert_eq!(read_frame(&mut r, 64).unwrap(), b"world!");
        assert!(matches!(read_frame(&mut r, 64), Err(FrameError::Closed)));
    }

    #[test]
    fn rejects_oversized_before_allocating() {
        let wire = u32::MAX.to_be_bytes();
        let err = read_frame(&mut wire.as_slice(), 1024).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { max: 1024, .. }));
        let err = write_frame(&mut Vec::new(), &[0u8; 65], 64).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { len: 65, .. }));
    }

    #[test]
    fn reports_truncation() {
        let mut r: &[u8] = &[0, 0];
        assert!(matches!(
            read_frame(&mut r, 64),
            Err(FrameError::Truncated {
                expected: 4,
                got: 2
            })
        ));
        let mut r: &[u8] = &[0, 0, 0, 10, 1, 2, 3];
        assert!(matches!(
            read_frame(&mut r, 64),
            Err(FrameError::Truncated {
                expected: 10,
                got: 3
            })
        ));
    }

    #[test]
    fn rejects_empty_frames() {
        let mut r: &[u8] = &[0, 0, 0, 0];
        assert!(matches!(read_frame(&mut r, 64), Err(FrameError::Empty)));
        assert!(matches!(
            write_frame(&mut Vec::new(), &[], 64),
            Err(FrameError::Empty)
        ));
    }
}

//! Length-prefixed frames: a 4-byte big-endian body length, then the body.
//!
//! Readers refuse a frame longer than their limit before allocating anything, grow the body
//! only as its bytes arrive (never to the length the header declares), and tell a clean end
//! of stream (between frames) apart from a frame cut short or one that stopped arriving.

use std::io::{ErrorKind, Read, Write};

/// Largest frame the demo's side channel accepts by default (16 MiB).
pub const DEFAULT_MAX_FRAME: usize = 16 << 20;

/// Size of the length prefix.
pub const HEADER_BYTES: usize = 4;

/// Most bytes a reader asks for at once, and the first size of a frame's buffer.
pub const CHUNK_BYTES: usize = 64 << 10;

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
    /// The read timed out (its deadline passed) before the frame was complete.
    #[error("only {} of a frame arrived in time", progress(*got, *expected))]
    Stalled {
        /// Bytes of the frame, header included, that arrived.
        got: usize,
        /// The frame's whole size, header included, once the header was read.
        expected: Option<usize>,
    },
    /// The reader's [`FrameBudget`] refused more memory, and why.
    #[error("{0}")]
    OverBudget(String),
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

/// Memory a frame reader may take, charged as the body's buffer grows.
pub trait FrameBudget {
    /// Asks for `bytes` more; an error ends the read with it.
    ///
    /// # Errors
    /// [`FrameError::OverBudget`] (or any other reason) to stop the read.
    fn charge(&mut self, bytes: usize) -> Result<(), FrameError>;
}

/// No budget beyond the frame limit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unbudgeted;

impl FrameBudget for Unbudgeted {
    fn charge(&mut self, _bytes: usize) -> Result<(), FrameError> {
        Ok(())
    }
}

/// Reads one frame's body.
///
/// # Errors
/// As [`read_frame_charged`].
pub fn read_frame(r: &mut impl Read, max: usize) -> Result<Vec<u8>, FrameError> {
    read_frame_charged(r, max, &mut Unbudgeted)
}

/// Reads one frame's body, charging `budget` for its buffer as it grows.
///
/// The buffer starts at [`CHUNK_BYTES`] (or the frame's size) and doubles, each time only once
/// it is full of bytes that arrived, so a peer that declares a large frame and sends little
/// makes the reader hold little memory; reads ask for at most [`CHUNK_BYTES`].
///
/// # Errors
/// [`FrameError::Closed`] at a clean end of stream, [`FrameError::Truncated`] when the stream
/// ends inside a frame, [`FrameError::TooLarge`] / [`FrameError::Empty`] for a bad length,
/// [`FrameError::Stalled`] when a read times out, what `budget` returns when it refuses,
/// [`FrameError::Io`] when reading fails.
pub fn read_frame_charged(
    r: &mut impl Read,
    max: usize,
    budget: &mut impl FrameBudget,
) -> Result<Vec<u8>, FrameError> {
    let mut header = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match read_some(r, &mut header[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => {
                return Err(FrameError::Truncated {
                    expected: HEADER_BYTES,
                    got,
                })
            }
            Ok(n) => got += n,
            Err(err) => return Err(stalled_or_io(err, got, None)),
        }
    }
    let len = u32::from_be_bytes(header) as usize;
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let mut body = Vec::new();
    while body.len() < len {
        if body.len() == body.capacity() {
            let grow = body.capacity().max(CHUNK_BYTES).min(len - body.len());
            budget.charge(grow)?;
            body.reserve_exact(grow);
        }
        let start = body.len();
        let want = (body.capacity() - start).min(CHUNK_BYTES);
        body.resize(start + want, 0);
        let read = read_some(r, &mut body[start..]);
        body.truncate(start + *read.as_ref().unwrap_or(&0));
        match read {
            Ok(0) => {
                return Err(FrameError::Truncated {
                    expected: len,
                    got: body.len(),
                })
            }
            Ok(_) => {}
            Err(err) => {
                return Err(stalled_or_io(
                    err,
                    HEADER_BYTES + body.len(),
                    Some(HEADER_BYTES + len),
                ))
            }
        }
    }
    Ok(body)
}

/// One read, retried when interrupted.
fn read_some(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match r.read(buf) {
            Err(err) if err.kind() == ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

/// A timed-out read as [`FrameError::Stalled`], any other failure as [`FrameError::Io`].
fn stalled_or_io(err: std::io::Error, got: usize, expected: Option<usize>) -> FrameError {
    match err.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => FrameError::Stalled { got, expected },
        _ => FrameError::Io(err),
    }
}

/// How much of a frame arrived, in words: "7 of 1004 bytes", "2 of 4 header bytes".
pub fn progress(got: usize, expected: Option<usize>) -> String {
    match expected {
        Some(total) => format!("{got} of {total} bytes"),
        None => format!("{got} of {HEADER_BYTES} header bytes"),
    }
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

    /// A reader that hands out `data`, then fails as a timed-out socket does.
    struct ThenTimeout<'a>(&'a [u8]);

    impl Read for ThenTimeout<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.0.is_empty() {
                return Err(ErrorKind::WouldBlock.into());
            }
            let n = buf.len().min(self.0.len());
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    /// Records every charge.
    #[derive(Default)]
    struct Ledger(Vec<usize>);

    impl FrameBudget for Ledger {
        fn charge(&mut self, bytes: usize) -> Result<(), FrameError> {
            self.0.push(bytes);
            Ok(())
        }
    }

    #[test]
    fn reports_how_much_of_a_stalled_frame_arrived() {
        let err = read_frame(&mut ThenTimeout(&[]), 64).unwrap_err();
        assert!(matches!(
            err,
            FrameError::Stalled {
                got: 0,
                expected: None
            }
        ));
        let err = read_frame(&mut ThenTimeout(&[0, 0]), 64).unwrap_err();
        assert_eq!(
            err.to_string(),
            "only 2 of 4 header bytes of a frame arrived in time"
        );
        let err = read_frame(&mut ThenTimeout(&[0, 0, 0, 10, 1, 2, 3]), 64).unwrap_err();
        assert_eq!(
            err.to_string(),
            "only 7 of 14 bytes of a frame arrived in time"
        );
    }

    #[test]
    fn memory_follows_the_bytes_that_arrived_not_the_declared_length() {
        let max = DEFAULT_MAX_FRAME;
        let mut wire = (max as u32).to_be_bytes().to_vec();
        wire.extend(std::iter::repeat(7u8).take(100_000));
        let mut ledger = Ledger::default();
        let err = read_frame_charged(&mut ThenTimeout(&wire), max, &mut ledger).unwrap_err();
        assert!(matches!(
            err,
            FrameError::Stalled {
                got: 100_004,
                expected: Some(16_777_220)
            }
        ));
        // 64 KiB, then doubled to 128 KiB: at most twice what arrived, never 16 MiB.
        assert_eq!(ledger.0, [CHUNK_BYTES, CHUNK_BYTES]);
    }

    #[test]
    fn a_refusing_budget_ends_the_read() {
        struct Refuse;
        impl FrameBudget for Refuse {
            fn charge(&mut self, bytes: usize) -> Result<(), FrameError> {
                Err(FrameError::OverBudget(format!("no room for {bytes}")))
            }
        }
        let mut wire: &[u8] = &[0, 0, 0, 3, 1, 2, 3];
        let err = read_frame_charged(&mut wire, 64, &mut Refuse).unwrap_err();
        assert_eq!(err.to_string(), "no room for 3");
    }

    #[test]
    fn large_frames_arrive_whole() {
        let body: Vec<u8> = (0..1_000_003u32).map(|i| i as u8).collect();
        let mut wire = Vec::new();
        write_frame(&mut wire, &body, 1 << 20).unwrap();
        let mut ledger = Ledger::default();
        let got = read_frame_charged(&mut wire.as_slice(), 1 << 20, &mut ledger).unwrap();
        assert_eq!(got, body);
        assert_eq!(ledger.0.iter().sum::<usize>(), body.len());
    }
}

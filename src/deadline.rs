//! Total deadlines: one time limit for a whole exchange, however many reads or writes it
//! takes, and a TCP stream whose reads and writes end at such a deadline.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The moment by which something must be done, and the limit it was set with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    /// `None` when the limit reaches past what an [`Instant`] can hold: never passes.
    at: Option<Instant>,
    limit: Duration,
}

impl Deadline {
    /// The deadline `limit` from now.
    pub fn after(limit: Duration) -> Self {
        Deadline {
            at: Instant::now().checked_add(limit),
            limit,
        }
    }

    /// The limit the deadline was set with, for messages.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// The time left; `None` once the deadline has passed.
    pub fn remaining(&self) -> Option<Duration> {
        match self.at {
            None => Some(Duration::MAX),
            Some(at) => at
                .checked_duration_since(Instant::now())
                .filter(|left| !left.is_zero()),
        }
    }

    /// Whether the deadline has passed.
    pub fn passed(&self) -> bool {
        self.remaining().is_none()
    }
}

/// A TCP stream whose reads or writes stop at a [`Deadline`]: before each one, the socket's
/// read or write timeout becomes the time left, so a peer moving a byte at a time cannot
/// stretch it.
///
/// Use one `DeadlineStream` per direction (see [`TcpStream::try_clone`]). A read or write past
/// the deadline fails with [`ErrorKind::TimedOut`] (or the socket's
/// [`ErrorKind::WouldBlock`] when the time runs out during the call).
#[derive(Debug)]
pub struct DeadlineStream {
    stream: TcpStream,
    deadline: Option<Deadline>,
    /// Whether this stream set a timeout on the socket that is still there.
    timeout_set: bool,
}

impl DeadlineStream {
    /// Wraps `stream`, with no deadline.
    pub fn new(stream: TcpStream) -> Self {
        DeadlineStream {
            stream,
            deadline: None,
            timeout_set: false,
        }
    }

    /// Sets the deadline of the reads or writes to come (`None`: they may block forever).
    pub fn set_deadline(&mut self, deadline: Option<Deadline>) {
        self.deadline = deadline;
    }

    /// The underlying stream.
    pub fn get_ref(&self) -> &TcpStream {
        &self.stream
    }
}

/// Sets a socket's read or write timeout.
type SetTimeout = fn(&TcpStream, Option<Duration>) -> io::Result<()>;

impl DeadlineStream {
    /// Sets the timeout `set` controls to the time left, or clears it without a deadline.
    fn arm(&mut self, set: SetTimeout) -> io::Result<()> {
        match self.deadline {
            Some(deadline) => {
                let left = deadline
                    .remaining()
                    .ok_or_else(|| io::Error::from(ErrorKind::TimedOut))?;
                set(&self.stream, Some(left))?;
                self.timeout_set = true;
            }
            None if self.timeout_set => {
                set(&self.stream, None)?;
                self.timeout_set = false;
            }
            None => {}
        }
        Ok(())
    }
}

impl Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm(TcpStream::set_read_timeout)?;
        self.stream.read(buf)
    }
}

impl Write for DeadlineStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm(TcpStream::set_write_timeout)?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    #[test]
    fn remaining_shrinks_and_ends() {
        let d = Deadline::after(Duration::from_millis(50));
        assert_eq!(d.limit(), Duration::from_millis(50));
        assert!(d.remaining().is_some_and(|left| left <= d.limit()));
        std::thread::sleep(Duration::from_millis(60));
        assert!(d.passed());
        assert!(Deadline::after(Duration::ZERO).passed());
    }

    #[test]
    fn a_limit_beyond_instant_never_passes() {
        let d = Deadline::after(Duration::MAX);
        assert_eq!(d.remaining(), Some(Duration::MAX));
    }

    #[test]
    fn trickling_bytes_do_not_extend_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let writer = std::thread::spawn(move || {
            let (mut peer, _) = listener.accept().unwrap();
            for _ in 0..20 {
                if peer.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let mut stream = DeadlineStream::new(TcpStream::connect(addr).unwrap());
        stream.set_deadline(Some(Deadline::after(Duration::from_millis(300))));
        let start = Instant::now();
        let mut byte = [0u8];
        let err = loop {
            match stream.read_exact(&mut byte) {
                Ok(()) => {}
                Err(err) => break err,
            }
        };
        let took = start.elapsed();
        assert!(
            matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{err}"
        );
        assert!(took < Duration::from_millis(700), "took {took:?}");
        drop(stream);
        writer.join().unwrap();
    }
}

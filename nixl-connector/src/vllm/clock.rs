//! The clock a prefill sends with its handshake, like Python's `time.perf_counter()`: a
//! monotonic count of seconds, comparable only within this process. A decode estimates
//! its offset from the handshake's round trip ([`MetaReply::clock_offset`](super::MetaReply::clock_offset))
//! to read the prefill's `remote_blocks_expiry_time` on its own clock.

use std::sync::OnceLock;
use std::time::Instant;

/// Seconds since this process first read the clock, from a monotonic clock.
pub fn perf_counter() -> f64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    #[test]
    fn it_never_goes_back() {
        let a = super::perf_counter();
        let b = super::perf_counter();
        assert!(a >= 0.0 && b >= a);
    }
}

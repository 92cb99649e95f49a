//! Run statistics: latency percentiles, throughput, and the decode summary.

use std::fmt;
use std::time::Duration;

use crate::kv_cache::Mismatch;

/// The `p`-th percentile (0..=100) of `samples` by nearest rank; `None` when empty.
pub fn percentile(samples: &[Duration], p: f64) -> Option<Duration> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Decimal gigabytes per second.
pub fn gb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

/// Where a decode run stands; passed to the progress callback and kept in the summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Requests pulled and verified.
    pub requests_done: u64,
    /// Requests asked for.
    pub requests_total: u64,
    /// Blocks pulled (one block of one layer each).
    pub blocks: u64,
    /// Bytes pulled.
    pub bytes: u64,
    /// Time since the handshake finished.
    pub elapsed: Duration,
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "progress: {}/{} requests, {:.1} MiB, {:.2} GB/s",
            self.requests_done,
            self.requests_total,
            self.bytes as f64 / (1 << 20) as f64,
            gb_per_s(self.bytes, self.elapsed)
        )
    }
}

/// What a decode run did.
#[derive(Debug, Clone)]
pub struct DecodeSummary {
    /// The prefill agent served by.
    pub prefill_agent: String,
    /// Totals at the end of the run.
    pub progress: Progress,
    /// Per-request latency: from the announcement to the last byte landing.
    pub latencies: Vec<Duration>,
    /// The first transfer: from decode's first try to reach prefill to its handshake's end,
    /// and to its first request loaded (`None` if none was).
    pub first_load: FirstLoad,
    /// Every block that did not match the expected pattern.
    pub mismatches: Vec<Mismatch>,
    /// What the connector's request lifecycle did besides plain loads.
    pub lifecycle: Lifecycle,
}

/// How long a decode run took to connect and to load its first request, both from its first
/// try to reach prefill.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FirstLoad {
    /// To the end of the connector's handshake with prefill.
    pub handshake: Duration,
    /// To the first request loaded: the handshake, prefill's first announcement and the
    /// first load (its READs, their first connection to prefill included).
    pub loaded: Option<Duration>,
}

/// Prefix hits, aborts and recomputed blocks of a decode run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lifecycle {
    /// Request blocks the decode's own prefix cache held (not pulled; checked all the same).
    pub prefix_hit_blocks: u64,
    /// Requests aborted before their load started (prefill told, nothing read).
    pub aborted_before_load: u64,
    /// Requests aborted once their load was with the connector (blocks freed when it ended).
    pub aborted_during_load: u64,
    /// Blocks computed locally after a failed load (`kv_load_failure_policy: recompute`).
    pub recomputed_blocks: u64,
    /// With several turns per conversation, what decode answered and kept.
    pub turns: Option<Turns>,
}

/// Decode's side of conversations of several turns (`--turns`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Turns {
    /// Conversations.
    pub conversations: u64,
    /// Turns of each.
    pub turns: u32,
    /// Request blocks (tokens) loaded from prefill: each turn's new prompt blocks; decode's
    /// prefix cache held the rest of each prompt.
    pub loaded_blocks: u64,
    /// Turns decode answered and kept for prefill to read back (all but the last of each).
    pub answers_kept: u64,
    /// Blocks (tokens) of those answers, which decode wrote with a pattern of its own.
    pub answer_blocks: u64,
}

impl DecodeSummary {
    /// Whether every byte of every request was right.
    pub fn ok(&self) -> bool {
        self.mismatches.is_empty() && self.progress.requests_done == self.progress.requests_total
    }
}

/// Mismatches listed in full in the summary; the rest are counted.
const MISMATCHES_SHOWN: usize = 5;

impl fmt::Display for DecodeSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.progress;
        let ms = |d: Option<Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1e3);
        writeln!(f, "decode summary (prefill agent {})", self.prefill_agent)?;
        writeln!(f, "  requests:  {}/{}", p.requests_done, p.requests_total)?;
        writeln!(f, "  blocks:    {} (layer blocks pulled)", p.blocks)?;
        writeln!(
            f,
            "  bytes:     {} ({:.1} MiB)",
            p.bytes,
            p.bytes as f64 / (1 << 20) as f64
        )?;
        writeln!(
            f,
            "  time:      {:.3} s, {:.2} GB/s",
            p.elapsed.as_secs_f64(),
            gb_per_s(p.bytes, p.elapsed)
        )?;
        writeln!(
            f,
            "  latency:   p50 {:.2} ms, p99 {:.2} ms (announce to data landed)",
            ms(percentile(&self.latencies, 50.0)),
            ms(percentile(&self.latencies, 99.0))
        )?;
        writeln!(
            f,
            "  first:     {:.2} ms to the first request loaded, {:.2} ms of it to the handshake's end (from the first try to reach prefill)",
            ms(self.first_load.loaded),
            ms(Some(self.first_load.handshake))
        )?;
        let l = &self.lifecycle;
        if l.prefix_hit_blocks > 0 {
            writeln!(
                f,
                "  prefix:    {} request blocks from decode's own prefix cache (not pulled, verified)",
                l.prefix_hit_blocks
            )?;
        }
        if l.aborted_before_load + l.aborted_during_load > 0 {
            writeln!(
                f,
                "  aborted:   {} before their load, {} during it (prefill told; not verified)",
                l.aborted_before_load, l.aborted_during_load
            )?;
        }
        if let Some(t) = l.turns {
            writeln!(
                f,
                "  turns:     {} conversations of {} turns: {} tokens (blocks) loaded from prefill, the \
                 rest of each prompt held by decode's prefix cache\n  answers:   {} turns \
                 answered with {} tokens of decode's own, kept for prefill to read back",
                t.conversations, t.turns, t.loaded_blocks, t.answers_kept, t.answer_blocks
            )?;
        }
        if l.recomputed_blocks > 0 {
            writeln!(
                f,
                "  recomputed: {} request blocks locally after failed loads",
                l.recomputed_blocks
            )?;
        }
        if self.mismatches.is_empty() {
            write!(f, "  errors:    none, every byte verified")
        } else {
            write!(
                f,
                "  errors:    {} mismatching blocks",
                self.mismatches.len()
            )?;
            for m in self.mismatches.iter().take(MISMATCHES_SHOWN) {
                write!(f, "\n    {m}")?;
            }
            if self.mismatches.len() > MISMATCHES_SHOWN {
                write!(
                    f,
                    "\n    ... and {} more",
                    self.mismatches.len() - MISMATCHES_SHOWN
                )?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let ms = |v: u64| Duration::from_millis(v);
        let samples: Vec<_> = (1..=100).rev().map(ms).collect();
        assert_eq!(percentile(&samples, 50.0), Some(ms(50)));
        assert_eq!(percentile(&samples, 99.0), Some(ms(99)));
        assert_eq!(percentile(&samples, 100.0), Some(ms(100)));
        assert_eq!(percentile(&[ms(7)], 99.0), Some(ms(7)));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn throughput() {
        assert_eq!(gb_per_s(2_000_000_000, Duration::from_secs(2)), 1.0);
        assert_eq!(gb_per_s(5, Duration::ZERO), 0.0);
    }
}

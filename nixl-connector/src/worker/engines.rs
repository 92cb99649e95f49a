//! The remote engines a decode worker has known, over time: when each was last active,
//! which engine serves each side-channel address, and how long to back off from one whose
//! handshakes or transfers fail (vLLM's `_engine_last_active`, `_engine_by_address` and
//! `_invalid_engine_backoff`). Engines idle past the TTL, and engines whose address now
//! serves another, are evicted once no load holds them, so that prefill restarts (each a
//! new engine) leave nothing behind.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use nixl::kv_config::KvTransferConfig;

use crate::error::{Error, Result};

/// The `kv_connector_extra_config` key of the engine TTL, in seconds (vLLM's `engine_ttl`;
/// 0 or less: never evict idle engines).
pub const ENGINE_TTL_KEY: &str = "engine_ttl";

/// vLLM's default engine TTL: an hour.
pub const DEFAULT_ENGINE_TTL: Duration = Duration::from_secs(3600);

/// The `kv_connector_extra_config` key of the longest backoff from a remote engine whose
/// handshakes or transfers keep failing, in seconds (ours; 0 to 3600, default
/// [`DEFAULT_ENGINE_BACKOFF`]). It is also how long an engine must stay healthy for its next
/// failure to start again from none.
pub const ENGINE_BACKOFF_KEY: &str = "engine_backoff_max_s";

/// The longest backoff by default (vLLM's `_INVALID_PEER_MAX_BACKOFF_S`): a minute.
pub const DEFAULT_ENGINE_BACKOFF: Duration = Duration::from_secs(60);

/// The shortest backoff after a repeated failure (vLLM's `_INVALID_PEER_MIN_BACKOFF_S`), or
/// the longest if that is shorter.
const MIN_BACKOFF: Duration = Duration::from_secs(1);

/// The longest backoff of `config` (`kv_connector_extra_config.engine_backoff_max_s`,
/// default [`DEFAULT_ENGINE_BACKOFF`]).
///
/// # Errors
/// [`Error::InvalidArgument`] for a value that is not a number from 0 to 3600.
pub(crate) fn max_backoff(config: &KvTransferConfig) -> Result<Duration> {
    let Some(value) = config.kv_connector_extra_config.get(ENGINE_BACKOFF_KEY) else {
        return Ok(DEFAULT_ENGINE_BACKOFF);
    };
    value
        .as_f64()
        .filter(|s| (0.0..=3600.0).contains(s))
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| {
            Error::invalid(
                "read the engine backoff",
                format!("kv_connector_extra_config.{ENGINE_BACKOFF_KEY} is {value}; give a number of seconds from 0 to 3600, e.g. 60"),
            )
        })
}

/// The engine TTL of `config` (`kv_connector_extra_config.engine_ttl`, seconds, default
/// [`DEFAULT_ENGINE_TTL`]); `None` for 0 or less (no eviction of idle engines, as in vLLM).
///
/// # Errors
/// [`Error::InvalidArgument`] for a value that is not a number, or more than a year.
pub(crate) fn engine_ttl(config: &KvTransferConfig) -> Result<Option<Duration>> {
    const YEAR: f64 = 365.0 * 86_400.0;
    let Some(value) = config.kv_connector_extra_config.get(ENGINE_TTL_KEY) else {
        return Ok(Some(DEFAULT_ENGINE_TTL));
    };
    let seconds = value.as_f64().filter(|s| *s <= YEAR).ok_or_else(|| {
        Error::invalid(
            "read the engine TTL",
            format!("kv_connector_extra_config.{ENGINE_TTL_KEY} is {value}; give a number of seconds (at most a year; 0 or less never evicts), e.g. 3600"),
        )
    })?;
    Ok((seconds > 0.0)
        .then(|| Duration::try_from_secs_f64(seconds).ok())
        .flatten())
}

/// What a worker knows of remote engines over time.
#[derive(Debug)]
pub(crate) struct Engines {
    /// The longest backoff from a failing engine.
    max_backoff: Duration,
    /// When each engine was last used by a load or a heartbeat.
    last_active: HashMap<String, Instant>,
    /// The engine each side-channel address (host, port) serves.
    by_address: HashMap<(String, u16), String>,
    /// Engines whose address now serves another engine.
    replaced: HashSet<String>,
    /// Engines whose handshake or transfer failed: their backoff, when it ends, and why
    /// the last failure was.
    backoff: HashMap<String, (Duration, Instant, String)>,
}

impl Default for Engines {
    fn default() -> Self {
        Engines::with_max_backoff(DEFAULT_ENGINE_BACKOFF)
    }
}

impl Engines {
    /// No engine known yet; backoffs from failing engines of at most `max_backoff`.
    pub(crate) fn with_max_backoff(max_backoff: Duration) -> Self {
        Engines {
            max_backoff,
            last_active: HashMap::new(),
            by_address: HashMap::new(),
            replaced: HashSet::new(),
            backoff: HashMap::new(),
        }
    }

    /// Records that `engine` was used at `now`.
    pub(crate) fn touch(&mut self, engine: &str, now: Instant) {
        match self.last_active.get_mut(engine) {
            Some(at) => *at = now,
            None => {
                self.last_active.insert(engine.to_string(), now);
            }
        }
    }

    /// Records that `host:port` serves `engine` (vLLM's `_track_remote_engine_replacement`):
    /// the engine it served before, if another, is replaced, and evicted once no load
    /// holds it.
    pub(crate) fn serves(&mut self, host: &str, port: u16, engine: &str) {
        let key = (host.to_string(), port);
        if self.by_address.get(&key).is_some_and(|e| e == engine) {
            return;
        }
        if let Some(previous) = self.by_address.insert(key, engine.to_string()) {
            tracing::info!(%host, port, %previous, %engine, "the remote engine at this address changed; the previous one is released once no load holds it");
            self.replaced.insert(previous);
        }
        self.replaced.remove(engine);
    }

    /// How long `engine` is still backed off from at `now`, if it is, and the reason of the
    /// failure that set the backoff.
    pub(crate) fn backing_off(&self, engine: &str, now: Instant) -> Option<(Duration, &str)> {
        self.backoff
            .get(engine)
            .map(|(_, until, reason)| (until.saturating_duration_since(now), reason.as_str()))
            .filter(|(left, _)| !left.is_zero())
    }

    /// Records that a handshake with `engine` failed at `now`, or a transfer from it failed
    /// in NIXL (vLLM's `_mark_remote_engine_invalid`): the first failure backs off for
    /// nothing, each repeat before the engine stayed healthy for the longest backoff doubles
    /// the backoff, from [`MIN_BACKOFF`] up to the longest; the backoff it set. `reason`
    /// (the failure's) is what loads refused during the backoff are told.
    pub(crate) fn failed(&mut self, engine: &str, now: Instant, reason: &str) -> Duration {
        let max = self.max_backoff;
        self.backoff
            .retain(|_, (_, until, _)| now.saturating_duration_since(*until) <= max);
        let backoff = self
            .backoff
            .get(engine)
            .map_or(Duration::ZERO, |&(previous, _, _)| {
                (2 * previous).clamp(MIN_BACKOFF.min(max), max)
            });
        self.backoff.insert(
            engine.to_string(),
            (backoff, now + backoff, reason.to_string()),
        );
        backoff
    }

    /// The engines to evict at `now`: those replaced at their address, and those idle
    /// for longer than `ttl` (vLLM's `_cleanup_remote_engines` and the TTL eviction of
    /// `_cleanup_idle_remote_engines`).
    pub(crate) fn due(&self, ttl: Option<Duration>, now: Instant) -> Vec<String> {
        let idle = self
            .last_active
            .iter()
            .filter(|(_, &at)| ttl.is_some_and(|ttl| now.saturating_duration_since(at) > ttl));
        let mut due: Vec<String> = idle.map(|(engine, _)| engine.clone()).collect();
        due.extend(self.replaced.iter().cloned());
        due.sort();
        due.dedup();
        due
    }

    /// Forgets `engine` once evicted (its backoff stays, so that a failing engine cannot
    /// escape it by being evicted).
    pub(crate) fn forget(&mut self, engine: &str) {
        self.last_active.remove(engine);
        self.replaced.remove(engine);
        self.by_address.retain(|_, e| e != engine);
    }

    /// How many engines are known (used and not evicted).
    pub(crate) fn known(&self) -> usize {
        self.last_active.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_engine_backs_off_from_none_to_a_minute_and_heals() {
        let mut e = Engines::default();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(
            e.failed("p", t0, "refused"),
            Duration::ZERO,
            "the first failure"
        );
        assert_eq!(e.backing_off("p", t0), None);
        let mut at = t0;
        for want in [1, 2, 4, 8, 16, 32, 60, 60] {
            assert_eq!(e.failed("p", at, "refused"), s(want));
            assert_eq!(e.backing_off("p", at), Some((s(want), "refused")));
            at += s(want);
            assert_eq!(e.backing_off("p", at), None, "over after {want} s");
        }
        // Healthy for longer than the longest backoff: the next failure starts again.
        assert_eq!(e.failed("p", at + s(61), "refused"), Duration::ZERO);
        assert_eq!(e.backing_off("q", at), None, "others are not backed off");
        // A refused load is told the latest failure's reason.
        e.failed("p", at + s(61), "unreachable");
        e.failed("p", at + s(61), "reset");
        assert_eq!(e.backing_off("p", at + s(61)), Some((s(2), "reset")));
    }

    #[test]
    fn a_shorter_longest_backoff_caps_and_heals_sooner() {
        let ms = Duration::from_millis;
        let mut e = Engines::with_max_backoff(ms(500));
        let t0 = Instant::now();
        assert_eq!(e.failed("p", t0, "refused"), Duration::ZERO);
        assert_eq!(
            e.failed("p", t0, "refused"),
            ms(500),
            "capped below the 1 s floor"
        );
        assert_eq!(e.failed("p", t0 + ms(500), "refused"), ms(500));
        assert_eq!(e.failed("p", t0 + ms(1001), "refused"), ms(500));
        assert_eq!(
            e.failed("p", t0 + ms(2002), "refused"),
            Duration::ZERO,
            "healthy 0.5 s"
        );
        let mut never = Engines::with_max_backoff(Duration::ZERO);
        assert_eq!(never.failed("p", t0, "refused"), Duration::ZERO);
        assert_eq!(never.failed("p", t0, "refused"), Duration::ZERO);
        assert_eq!(never.backing_off("p", t0), None);
        let read = |json: &str| max_backoff(&KvTransferConfig::from_json(json).unwrap());
        assert_eq!(read("{}").unwrap(), DEFAULT_ENGINE_BACKOFF);
        let config = r#"{"kv_connector_extra_config": {"engine_backoff_max_s": 0.5}}"#;
        assert_eq!(read(config).unwrap(), ms(500));
        for bad in ["-1", "3601", "\"60\""] {
            let config =
                format!(r#"{{"kv_connector_extra_config": {{"engine_backoff_max_s": {bad}}}}}"#);
            let err = read(&config).unwrap_err().to_string();
            assert!(err.contains("engine_backoff_max_s"), "{err}");
        }
    }

    #[test]
    fn idle_and_replaced_engines_are_due() {
        let mut e = Engines::default();
        let t0 = Instant::now();
        let ttl = Some(Duration::from_secs(3600));
        e.touch("a", t0);
        e.touch("b", t0 + Duration::from_secs(100));
        e.serves("h", 1, "a");
        e.serves("h", 2, "b");
        assert!(e.due(ttl, t0 + Duration::from_secs(3600)).is_empty());
        assert_eq!(e.due(ttl, t0 + Duration::from_secs(3601)), ["a"]);
        assert!(e.due(None, t0 + Duration::from_secs(1 << 20)).is_empty());
        // Address 1 now serves c: a is replaced, whatever its age.
        e.serves("h", 1, "c");
        e.touch("c", t0);
        assert_eq!(e.due(ttl, t0), ["a"]);
        e.forget("a");
        assert!(e.due(ttl, t0).is_empty());
        assert_eq!(e.known(), 2);
        // An engine back at its old address is no longer replaced.
        e.serves("h", 2, "d");
        e.serves("h", 2, "b");
        assert!(e
            .due(ttl, t0 + Duration::from_secs(100))
            .contains(&"d".to_string()));
        assert!(!e
            .due(ttl, t0 + Duration::from_secs(100))
            .contains(&"b".to_string()));
    }

    #[test]
    fn the_ttl_comes_from_the_config() {
        let ttl = |json: &str| engine_ttl(&KvTransferConfig::from_json(json).unwrap());
        assert_eq!(ttl("{}").unwrap(), Some(DEFAULT_ENGINE_TTL));
        assert_eq!(
            ttl(r#"{"kv_connector_extra_config":{"engine_ttl":1.5}}"#).unwrap(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            ttl(r#"{"kv_connector_extra_config":{"engine_ttl":0}}"#).unwrap(),
            None
        );
        assert_eq!(
            ttl(r#"{"kv_connector_extra_config":{"engine_ttl":-1}}"#).unwrap(),
            None
        );
        let err = ttl(r#"{"kv_connector_extra_config":{"engine_ttl":"1h"}}"#).unwrap_err();
        assert!(err.to_string().contains("engine_ttl"), "{err}");
    }
}

//! Backend parameters the safe API refuses, each with its reason.
//!
//! Two UCX settings of NIXL 1.5.1 are outside the safe API. Worker threads (`num_threads`)
//! crash the process. Further workers (`num_workers` above 1) each listen on a TCP port that
//! no metadata shows, so metadata that names one of them would not be recognised as leading
//! into this process. Both stay open to `Agent::create_backend_with_unchecked`.

use std::collections::BTreeMap;

use crate::error::Error;

/// Why the safe API refuses NIXL 1.5.1's UCX worker threads, and what to do instead.
const UCX_THREADS_RACE: &str = "NIXL 1.5.1's UCX worker threads race with reposted and \
released requests and crash the process (segfault in nixlUcxDedicatedThread::run(), \
libplugin_UCX.so: 6 of 11 runs of a repost loop); leave num_threads at 0 (the default), or \
opt in for benchmarks with the unsafe Agent::create_backend_with_unchecked";

/// Why the safe API refuses more than one UCX worker per backend, and what to do instead.
const UCX_FURTHER_WORKERS: &str = "a UCX backend's further workers each listen on a TCP \
port that no metadata shows, so metadata naming one of them would not be recognised as \
leading into this process, and a peer could read and write this process's memory through \
it; leave num_workers at 1 (the default), or opt in with the unsafe \
Agent::create_backend_with_unchecked";

/// A parameter the safe API allows with some values only.
struct Rule {
    /// The plugin that reads it.
    plugin: &'static str,
    /// Its key.
    key: &'static str,
    /// The decimal values allowed.
    allowed: &'static [u64],
    /// Why other values are refused, and what to do instead.
    reason: &'static str,
}

/// Every parameter the safe API restricts.
const RULES: &[Rule] = &[
    Rule {
        plugin: "UCX",
        key: "num_threads",
        allowed: &[0],
        reason: UCX_THREADS_RACE,
    },
    // NIXL reads 0 workers as 1.
    Rule {
        plugin: "UCX",
        key: "num_workers",
        allowed: &[0, 1],
        reason: UCX_FURTHER_WORKERS,
    },
];

/// What backend creation does with parameters the safe API refuses.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RefusedParams {
    /// Refuses them ([`Error::RefusedBackendParam`]): the safe API.
    Refuse,
    /// Allows them and logs a warning: `Agent::create_backend_with_unchecked`.
    AllowWithWarning,
}

/// The refusals of the parameters in `params` that the safe API does not allow for `plugin`,
/// in the order of [`RULES`]. Anything but one of a rule's decimal values counts, as NIXL may
/// read a number from the start of a value.
pub(crate) fn refusals(plugin: &str, params: &BTreeMap<String, String>) -> Vec<Error> {
    RULES
        .iter()
        .filter(|rule| rule.plugin == plugin)
        .filter_map(|rule| {
            let value = params.get(rule.key)?;
            let allowed = value
                .trim()
                .parse::<u64>()
                .is_ok_and(|n| rule.allowed.contains(&n));
            (!allowed).then(|| Error::RefusedBackendParam {
                plugin: plugin.to_string(),
                key: rule.key.to_string(),
                value: value.clone(),
                reason: rule.reason,
            })
        })
        .collect()
}

//! Settings the crate gives a backend unless its creator set them.
//!
//! UCX's worker lock: a UCX backend's worker is shared by the threads that post and poll
//! (tokio workers, the completion driver) and by NIXL's progress thread, so UCX runs it in
//! multi-thread mode, where its lock is a spinlock by default. Under contention the waiters
//! spin: with 1000 tasks awaiting 16 KiB READs on 2 tokio workers, about half of the process's
//! CPU went to `pthread_spin_lock` (NIXL's progress thread in `ucp_worker_progress`, the
//! posting threads in `ucp_get_nbx`). A mutex lets the waiters sleep instead. The lock's kind
//! changes nothing NIXL relies on (every access stays serialised), so the crate asks UCX for
//! the mutex (`USE_MT_MUTEX=y` in the backend's `engine_config`), unless the creator's
//! `engine_config` names `USE_MT_MUTEX` or the environment sets `UCX_USE_MT_MUTEX` (NIXL lets
//! the environment win).

use std::collections::BTreeMap;

/// The UCX setting that makes the worker lock a mutex.
const UCX_MUTEX: &str = "USE_MT_MUTEX=y";

/// Adds the crate's default settings to `params`, the parameters of a backend of `plugin`.
pub(crate) fn apply(plugin: &str, params: &mut BTreeMap<String, String>) {
    if plugin != "UCX" {
        return;
    }
    let config = params.entry("engine_config".to_string()).or_default();
    let named = config
        .split(',')
        .any(|setting| setting.trim().starts_with("USE_MT_MUTEX"));
    if named {
        return;
    }
    if !config.trim().is_empty() {
        config.push(',');
    }
    config.push_str(UCX_MUTEX);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(plugin: &str, engine_config: Option<&str>) -> Option<String> {
        let mut params = BTreeMap::new();
        if let Some(config) = engine_config {
            params.insert("engine_config".to_string(), config.to_string());
        }
        apply(plugin, &mut params);
        params.get("engine_config").cloned()
    }

    #[test]
    fn ucx_gets_the_mutex_unless_its_creator_chose() {
        assert_eq!(applied("UCX", None).as_deref(), Some("USE_MT_MUTEX=y"));
        assert_eq!(applied("UCX", Some("")).as_deref(), Some("USE_MT_MUTEX=y"));
        assert_eq!(
            applied("UCX", Some("TLS=tcp")).as_deref(),
            Some("TLS=tcp,USE_MT_MUTEX=y")
        );
        assert_eq!(
            applied("UCX", Some("USE_MT_MUTEX=n,TLS=tcp")).as_deref(),
            Some("USE_MT_MUTEX=n,TLS=tcp")
        );
        assert_eq!(applied("POSIX", None), None);
    }
}

//! Endpoints of this process that a UCX transport address can name although no agent's
//! metadata shows them (a backend's further workers): the System V shared-memory segments
//! this process created, from Linux's `/proc/sysvipc/shm`.
//!
//! TCP listeners are not listed: a process holds the listening sockets its parent leaked
//! to it as much as its own (UCX's are not close-on-exec), and a connection to one reaches
//! whichever process accepts on it, so holding one says nothing about where it leads.

use std::io;

/// The ids of the System V shared-memory segments this process created.
pub(crate) fn sysv_segments() -> io::Result<Vec<u64>> {
    let text = std::fs::read_to_string("/proc/sysvipc/shm")?;
    let pid = std::process::id().to_string();
    Ok(text
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // key shmid perms size cpid ...
            (fields.get(4) == Some(&pid.as_str()))
                .then(|| fields.get(1)?.parse().ok())
                .flatten()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_segments_it_created() {
        // SAFETY: plain System V calls on a private segment of this test.
        let id = unsafe { libc::shmget(libc::IPC_PRIVATE, 4096, libc::IPC_CREAT | 0o600) };
        assert!(id >= 0, "shmget: {}", io::Error::last_os_error());
        let found = sysv_segments();
        // SAFETY: removes the segment made above.
        unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
        assert!(found.unwrap().contains(&(id as u64)));
    }
}

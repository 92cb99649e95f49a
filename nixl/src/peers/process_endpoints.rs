//! Endpoints of this process that a UCX transport address can name although no agent's
//! metadata shows them: the System V shared-memory segments this process created (a
//! backend's further workers), from Linux's `/proc/sysvipc/shm`, and the thread ids of its
//! threads, which `process_vm_readv` and `/proc/<id>/...` take as well as its pid.
//!
//! TCP listeners are not listed: a process holds the listening sockets its parent leaked
//! to it as much as its own (UCX's are not close-on-exec), and a connection to one reaches
//! whichever process accepts on it, so holding one says nothing about where it leads.

use std::io;

/// What a pid of this process's pid namespace designates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Task {
    /// A thread of this process (its main thread included).
    ThisProcess,
    /// A thread of another process, whose thread group (pid) is given.
    Other(u32),
    /// No live thread.
    None,
}

/// What `pid`, an id in this process's pid namespace, designates, by the thread group id
/// (`Tgid`) in `/proc/<pid>/status`: any thread id of a process reaches that process.
///
/// # Errors
/// When `/proc` is not this process's pid namespace's (its `self` is not this pid), so its
/// ids are not the ones to compare, or when `/proc/<pid>/status` cannot be read or has no
/// `Tgid` line.
pub(crate) fn task(pid: u32) -> io::Result<Task> {
    let own = std::process::id();
    let shown = std::fs::read_link("/proc/self")?;
    if shown.to_str() != Some(own.to_string().as_str()) {
        return Err(io::Error::other(format!(
            "/proc shows this process as {shown:?}, not as pid {own}: it belongs to another \
             pid namespace"
        )));
    }
    let status = match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(status) => status,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Task::None),
        // ESRCH: the thread ended while its status was read.
        Err(err) if err.raw_os_error() == Some(libc::ESRCH) => return Ok(Task::None),
        Err(err) => return Err(err),
    };
    let tgid = status
        .lines()
        .find_map(|line| line.strip_prefix("Tgid:"))
        .and_then(|value| value.trim().parse::<u32>().ok())
        .ok_or_else(|| io::Error::other(format!("no Tgid line in /proc/{pid}/status")))?;
    Ok(if tgid == own {
        Task::ThisProcess
    } else {
        Task::Other(tgid)
    })
}

/// The ids of the System V shared-memory segments this process created.
pub(crate) fn sysv_segments() -> io::Result<Vec<u32>> {
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

/// A thread of this process, alive until dropped, with its thread id: what a forged
/// address names to alias this process (tests only).
#[cfg(test)]
pub(crate) struct LiveThread {
    /// Its thread id (`gettid`), which is not this process's pid.
    pub(crate) tid: u32,
    /// Dropped to let the thread end.
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[cfg(test)]
impl LiveThread {
    /// Starts the thread and waits for its id.
    pub(crate) fn start() -> LiveThread {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            stopped.recv().ok();
        });
        LiveThread {
            tid: rx.recv().unwrap(),
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

#[cfg(test)]
impl Drop for LiveThread {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
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
        assert!(found.unwrap().contains(&(id as u32)));
    }

    #[test]
    fn every_thread_of_this_process_is_this_process() {
        let thread = LiveThread::start();
        assert_ne!(thread.tid, std::process::id());
        assert_eq!(task(thread.tid).unwrap(), Task::ThisProcess);
        assert_eq!(task(std::process::id()).unwrap(), Task::ThisProcess);
        drop(thread);
        let parent = std::os::unix::process::parent_id();
        assert_eq!(task(parent).unwrap(), Task::Other(parent));
        // Above the largest pid Linux hands out (2^22).
        assert_eq!(task(0x7000_0000).unwrap(), Task::None);
    }
}

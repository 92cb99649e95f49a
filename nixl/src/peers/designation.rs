//! Whether remote metadata leads into this process, and to which of its agents.
//!
//! A peer's metadata is a claim, and its UCX worker address can name a worker of this very
//! process under any agent name: loaded as an agent elsewhere, it would let NIXL read and
//! write this process's own memory at addresses the peer chooses, unchecked. Metadata leads
//! into this process when its worker's UUID is a live agent's worker's, or when any of its
//! transport addresses reaches this process, compared by what UCX would reach, not by
//! bytes:
//! - the loopback interface, shared-memory FIFO, TCP listener (or, for transports not
//!   interpreted here, the same address bytes) of a live agent's worker;
//! - a System V segment this process created (read from `/proc`), on the host of this
//!   process's workers, which covers workers that no agent's metadata shows;
//! - cross-memory attach or POSIX `/proc` access to this process's pid or to the thread id
//!   of any of its threads (the kernel takes either, and reaches the whole thread group), or
//!   XPMEM to its segment, which reach the whole process and so every worker in it.
//!
//! Pids are compared only where the address names the host and pid namespace of this
//! process's workers, and so a pid of this process's namespace (UCX uses cma and posix's
//! `/proc` path only within one pid namespace); they are read from this process's `/proc`,
//! and refused where that `/proc` is another namespace's. There, a pid that names no live
//! thread is refused too: a thread this process starts later could take it.
//!
//! Not recognised: the TCP listener of a worker that no agent's metadata shows, which this
//! process cannot tell from the listeners its parent leaked to it. Only UCX backends with
//! further workers (`num_workers` above 1, or worker threads) have such workers, and the safe
//! API refuses both (`refused_params`).
//!
//! Such metadata is an agent of this process only under that agent's exact name; it is
//! then held to that agent's live registrations. Under any other name it is refused.

use std::net::SocketAddr;

use crate::error::{Error, Result};
use crate::peers::local_peers::{self, AgentWorkers};
use crate::peers::process_endpoints::{self, Task};
use crate::peers::wire::{Destination, Host, PeerKind, PeerMetadata};

/// What one part of a worker address leads to in this process.
enum Lead {
    /// The worker of this agent.
    Agent(u64),
    /// This process, no worker in particular, with why (a clause for the error).
    Process(String),
    /// Nowhere that can be told apart from this process: refused whatever its name.
    Unclear(String),
}

/// Endpoints of this process read from `/proc`, once per classification and only if needed.
#[derive(Default)]
struct Endpoints {
    sysv: Option<Vec<u32>>,
}

impl Endpoints {
    fn sysv(&mut self) -> &[u32] {
        self.sysv.get_or_insert_with(|| {
            process_endpoints::sysv_segments().unwrap_or_else(|err| {
                tracing::warn!(%err, "cannot list this process's System V segments; metadata is checked against its agents' workers only");
                Vec::new()
            })
        })
    }
}

/// Where the agent of `peer` lives: `Some(InProcess)` with the agents of this process its
/// worker belongs to, `Some(Remote)` for another process, `None` when the metadata has no
/// UCX connection info to tell.
///
/// # Errors
/// [`Error::MetadataLeadsIntoThisProcess`] for metadata that leads into this process under
/// a name that is not the name of the agent it leads to.
pub(crate) fn classify(peer: &PeerMetadata<'_>) -> Result<Option<PeerKind>> {
    let Some(worker) = &peer.worker else {
        return Ok(None);
    };
    let agents = local_peers::live_agents();
    let mut endpoints = Endpoints::default();
    // (agent id, why) for each worker it leads to; why it leads to this process at all.
    let mut workers: Vec<(u64, String)> = Vec::new();
    let mut process: Option<String> = None;
    if let Some(uuid) = worker.uuid {
        for agent in &agents {
            if agent.workers.iter().any(|w| w.uuid == Some(uuid)) {
                workers.push((agent.id, format!("its UCX worker UUID {uuid:#018x}")));
            }
        }
    }
    for dest in &worker.destinations {
        match lead(dest, &agents, &mut endpoints) {
            Some(Lead::Agent(id)) => workers.push((id, describe(dest))),
            Some(Lead::Process(why)) => {
                process.get_or_insert(why);
            }
            Some(Lead::Unclear(why)) => {
                return Err(Error::MetadataLeadsIntoThisProcess {
                    agent: peer.name.to_string(),
                    reason: why,
                })
            }
            None => {}
        }
    }
    if workers.is_empty() && process.is_none() {
        return Ok(Some(PeerKind::Remote));
    }
    let named: Vec<u64> = agents
        .iter()
        .filter(|a| a.name == peer.name)
        .map(|a| a.id)
        .collect();
    let refuse = |reason: String| Error::MetadataLeadsIntoThisProcess {
        agent: peer.name.to_string(),
        reason,
    };
    if let Some((id, why)) = workers.iter().find(|(id, _)| !named.contains(id)) {
        let owner = agents.iter().find(|a| a.id == *id).map_or("", |a| &a.name);
        return Err(refuse(format!(
            "{why} is that of agent {owner:?} of this process"
        )));
    }
    let mut ids: Vec<u64> = workers.iter().map(|(id, _)| *id).collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() {
        if named.is_empty() {
            let why = process.unwrap_or_default();
            return Err(refuse(format!(
                "{why}, and no agent of this process has that name"
            )));
        }
        ids = named;
    }
    Ok(Some(PeerKind::InProcess(ids)))
}

/// What `dest` leads to in this process, if anything.
fn lead(dest: &Destination, agents: &[AgentWorkers], endpoints: &mut Endpoints) -> Option<Lead> {
    let ours = || {
        agents.iter().flat_map(|agent| {
            agent
                .workers
                .iter()
                .flat_map(move |w| w.destinations.iter().map(move |d| (agent.id, d)))
        })
    };
    match dest {
        // These reach the whole process, not one worker: every worker has the same.
        Destination::Cma { host, pid, pid_ns } => {
            if ours().any(|(_, d)| d == dest) {
                return Some(Lead::Process(is_this_process(dest)));
            }
            by_pid(dest, *host, *pid, *pid_ns, agents)
        }
        Destination::Xpmem { .. } => ours()
            .any(|(_, d)| d == dest)
            .then(|| Lead::Process(is_this_process(dest))),
        _ => {
            if let Some((id, _)) = ours().find(|(_, d)| *d == dest) {
                return Some(Lead::Agent(id));
            }
            match dest {
                Destination::PosixProc {
                    host, pid, pid_ns, ..
                } => {
                    let same = ours().any(|(_, d)| {
                        matches!(d, Destination::PosixProc { host: h, pid: p, pid_ns: n, .. }
                            if h == host && p == pid && n == pid_ns)
                    });
                    if same {
                        return Some(Lead::Process(is_this_process(dest)));
                    }
                    by_pid(dest, *host, *pid, *pid_ns, agents)
                }
                Destination::Sysv { host, shmid } => (ours()
                    .any(|(_, d)| matches!(d, Destination::Sysv { host: h, .. } if h == host))
                    && endpoints.sysv().contains(shmid))
                .then(|| Lead::Process(is_this_process(dest))),
                _ => None,
            }
        }
    }
}

/// What `pid` in a cma or posix address (`dest`) of `host` and pid namespace `pid_ns`
/// designates, when a worker of this process is on that host and in that namespace: this
/// process for any of its threads, nothing for another process, and an unclear target for
/// an id that names no live thread or cannot be looked up.
fn by_pid(
    dest: &Destination,
    host: Host,
    pid: u32,
    pid_ns: u32,
    agents: &[AgentWorkers],
) -> Option<Lead> {
    let here = agents
        .iter()
        .flat_map(|agent| agent.workers.iter())
        .flat_map(|worker| worker.destinations.iter())
        .any(|d| match d {
            Destination::Cma {
                host: h, pid_ns: n, ..
            }
            | Destination::PosixProc {
                host: h, pid_ns: n, ..
            } => *h == host && *n == pid_ns,
            _ => false,
        });
    if !here {
        return None;
    }
    let what = describe(dest);
    match process_endpoints::task(pid) {
        Ok(Task::ThisProcess) => Some(Lead::Process(format!(
            "{what} designates thread {pid} of this process (pid {}), which reaches all of \
             its memory",
            std::process::id()
        ))),
        Ok(Task::Other(_)) => None,
        Ok(Task::None) => Some(Lead::Unclear(format!(
            "{what} designates no live thread of this host's pid namespace, and a thread \
             this process starts later could take that id (real metadata names the live \
             process of its agent)"
        ))),
        Err(err) => Some(Lead::Unclear(format!(
            "{what} designates a pid of this process's pid namespace that cannot be told \
             apart from this process's threads ({err})"
        ))),
    }
}

/// Why `dest` is this process, as an error message says it.
fn is_this_process(dest: &Destination) -> String {
    format!("{} is this process", describe(dest))
}

/// `dest`, as an error message names it.
fn describe(dest: &Destination) -> String {
    match dest {
        Destination::Loopback(id) => format!("its UCX self interface {id:#x}"),
        Destination::Cma { pid, .. } => format!("its UCX cma address (pid {pid})"),
        Destination::PosixProc { pid, fd, .. } => {
            format!("its UCX posix FIFO (/proc/{pid}/fd/{fd})")
        }
        Destination::PosixNamed { id, .. } => format!("its UCX posix FIFO {id:#x}"),
        Destination::Sysv { shmid, .. } => format!("its UCX sysv FIFO (shmid {shmid})"),
        Destination::Xpmem { segid, .. } => format!("its UCX xpmem segment {segid:#x}"),
        Destination::Tcp { ip, port, .. } => {
            format!("its UCX tcp listener {}", SocketAddr::new(*ip, *port))
        }
        Destination::Other { checksum, .. } => {
            format!("its address on the UCX transport of name checksum {checksum:#06x}")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::peers::local_peers::FakeAgent;
    use crate::peers::process_endpoints::LiveThread;
    use crate::peers::wire::Worker;

    const HOST: Host = Host {
        id: 0x1234_5678,
        ns: None,
    };

    fn cma(pid: u32) -> Destination {
        Destination::Cma {
            host: HOST,
            pid,
            pid_ns: crate::peers::wire::ROOT_PID_NS,
        }
    }

    fn tcp(ip: [u8; 4], port: u16, loopback: bool) -> Destination {
        Destination::Tcp {
            ip: IpAddr::from(ip),
            port,
            loopback: loopback.then_some(HOST),
        }
    }

    fn classify_as(
        name: &str,
        uuid: Option<u64>,
        dest: Vec<Destination>,
    ) -> Result<Option<PeerKind>> {
        classify(&PeerMetadata {
            name,
            worker: Some(Worker {
                uuid,
                destinations: dest,
            }),
            regions: Vec::new(),
        })
    }

    fn refused(result: Result<Option<PeerKind>>, what: &str) {
        match result {
            Err(Error::MetadataLeadsIntoThisProcess { reason, .. }) => {
                assert!(reason.contains(what), "{reason}")
            }
            other => panic!("expected a refusal naming {what:?}, got {other:?}"),
        }
    }

    #[test]
    fn each_part_of_a_worker_address_leads_to_its_worker() {
        let pid = 0x7000_0001;
        let worker = Worker {
            uuid: Some(0xAB),
            destinations: vec![
                Destination::Loopback(0x51),
                tcp([192, 0, 2, 7], 4000, false),
                Destination::Sysv {
                    host: HOST,
                    shmid: 77,
                },
                cma(pid),
            ],
        };
        let victim = FakeAgent::new("designation-victim", worker.clone());
        // Its own name: an agent of this process.
        assert_eq!(
            classify_as(
                "designation-victim",
                worker.uuid,
                worker.destinations.clone()
            )
            .unwrap(),
            Some(PeerKind::InProcess(vec![victim.0]))
        );
        // Any one part, under another name, without the UUID: refused.
        refused(classify_as("other", Some(0xAB), vec![]), "UUID");
        for (dest, what) in [
            (Destination::Loopback(0x51), "self interface"),
            (tcp([192, 0, 2, 7], 4000, false), "192.0.2.7:4000"),
            (
                Destination::Sysv {
                    host: HOST,
                    shmid: 77,
                },
                "shmid 77",
            ),
            (cma(pid), "pid"),
        ] {
            refused(classify_as("other", None, vec![dest]), what);
        }
        // Elsewhere: another process, port, segment or host.
        let elsewhere = vec![
            cma(std::os::unix::process::parent_id()),
            tcp([192, 0, 2, 7], 4001, false),
            Destination::Sysv {
                host: Host { id: 9, ns: None },
                shmid: 77,
            },
        ];
        assert_eq!(
            classify_as("other", Some(0xAC), elsewhere).unwrap(),
            Some(PeerKind::Remote)
        );
        // No UCX connection info: nothing to tell.
        let bare = PeerMetadata {
            name: "other",
            ..PeerMetadata::default()
        };
        assert_eq!(classify(&bare).unwrap(), None);
    }

    #[test]
    fn a_segment_this_process_created_that_no_worker_shows_is_this_process() {
        // SAFETY: plain System V calls on a private segment of this test.
        let shmid = unsafe { libc::shmget(libc::IPC_PRIVATE, 4096, libc::IPC_CREAT | 0o600) };
        assert!(shmid >= 0, "shmget: {}", std::io::Error::last_os_error());
        let shmid = shmid as u32;
        // A worker of this process has a segment on this host...
        let ours = FakeAgent::new(
            "designation-sysv",
            Worker {
                uuid: None,
                destinations: vec![Destination::Sysv {
                    host: HOST,
                    shmid: shmid + 1,
                }],
            },
        );
        // ...so another segment this process created there is this process too.
        let theirs = vec![Destination::Sysv { host: HOST, shmid }];
        let result = classify_as("other", None, theirs.clone());
        // SAFETY: removes the segment made above.
        unsafe { libc::shmctl(shmid as libc::c_int, libc::IPC_RMID, std::ptr::null_mut()) };
        refused(result, &format!("shmid {shmid}"));
        drop(ours);
        assert_eq!(
            classify_as("other", None, theirs).unwrap(),
            Some(PeerKind::Remote)
        );
    }

    #[test]
    fn a_process_wide_address_names_the_agents_of_its_name() {
        let pid = 0x7000_0002;
        let worker = Worker {
            uuid: None,
            destinations: vec![cma(pid)],
        };
        let (a, b) = (
            FakeAgent::new("designation-twice", worker.clone()),
            FakeAgent::new("designation-twice", worker),
        );
        match classify_as("designation-twice", None, vec![cma(pid)]).unwrap() {
            Some(PeerKind::InProcess(mut ids)) => {
                ids.sort_unstable();
                assert_eq!(ids, vec![a.0, b.0]);
            }
            other => panic!("expected both agents of that name, got {other:?}"),
        }
        refused(
            classify_as("designation-nobody", None, vec![cma(pid)]),
            "no agent of this process has that name",
        );
    }

    fn posix(pid: u32) -> Destination {
        Destination::PosixProc {
            host: HOST,
            pid,
            fd: 16,
            pid_ns: crate::peers::wire::ROOT_PID_NS,
        }
    }

    #[test]
    fn a_thread_id_of_this_process_is_this_process() {
        // A worker of this process on HOST, in its pid namespace.
        let _ours = FakeAgent::new(
            "designation-threads",
            Worker {
                uuid: None,
                destinations: vec![cma(0x7000_0003), posix(0x7000_0003)],
            },
        );
        let thread = LiveThread::start();
        let tid = thread.tid;
        for dest in [cma(tid), posix(tid)] {
            refused(
                classify_as("other", None, vec![dest]),
                &format!("designates thread {tid} of this process"),
            );
        }
        drop(thread);
        // Another thread group: another process, not this one.
        let parent = std::os::unix::process::parent_id();
        for dest in [cma(parent), posix(parent)] {
            assert_eq!(
                classify_as("other", None, vec![dest]).unwrap(),
                Some(PeerKind::Remote)
            );
        }
        // An id no thread has: one this process may take later.
        refused(
            classify_as("other", None, vec![cma(0x7000_0004)]),
            "no live thread",
        );
        // On another host, or in another pid namespace, a pid is not compared.
        let other_ns = Destination::Cma {
            host: HOST,
            pid: tid,
            pid_ns: 7,
        };
        let other_host = Destination::PosixProc {
            host: Host { id: 9, ns: None },
            pid: tid,
            fd: 16,
            pid_ns: crate::peers::wire::ROOT_PID_NS,
        };
        assert_eq!(
            classify_as("other", None, vec![other_ns, other_host]).unwrap(),
            Some(PeerKind::Remote)
        );
    }
}

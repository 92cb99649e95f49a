//! Endpoints of this process that a UCX transport address can name: the TCP sockets it
//! listens on (asked of each of its descriptors, listed in Linux's `/proc/self/fd`), and the
//! System V shared-memory segments it created (from `/proc/sysvipc/shm`). These cover every
//! UCX worker of the process, including those no agent's metadata shows (a backend's
//! further workers).

use std::io;
use std::mem::{size_of, MaybeUninit};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The addresses this process's TCP sockets listen on (IPv4 addresses mapped into IPv6 as
/// the IPv4 address).
pub(crate) fn tcp_listeners() -> io::Result<Vec<SocketAddr>> {
    let mut listening = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let name = entry?.file_name();
        if let Some(addr) = name
            .to_str()
            .and_then(|n| n.parse().ok())
            .and_then(listening_on)
        {
            listening.push(addr);
        }
    }
    Ok(listening)
}

/// The address `fd` listens on, if it is a listening IP socket. The descriptor may be any
/// file, or closed (or reopened) meanwhile by another thread: it is only asked about.
fn listening_on(fd: libc::c_int) -> Option<SocketAddr> {
    let mut accepting: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a query that changes nothing (it fails for a descriptor that is not a socket
    // or not open); the out-pointers are to locals of the sizes given.
    let asked = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&mut accepting as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if asked != 0 || accepting == 0 {
        return None;
    }
    let mut storage = MaybeUninit::<libc::sockaddr_storage>::zeroed();
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: as above; the kernel writes at most `len` bytes of address into `storage`.
    let named = unsafe { libc::getsockname(fd, storage.as_mut_ptr().cast(), &mut len) };
    if named != 0 {
        return None;
    }
    // SAFETY: zeroed, then (partly) written by the kernel: every bit pattern is valid.
    let storage = unsafe { storage.assume_init() };
    match libc::c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a sockaddr_in, which the storage is large and aligned
            // enough to hold.
            let sin = unsafe {
                &*(&storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>()
            };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, a sockaddr_in6.
            let sin6 = unsafe {
                &*(&storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            let ip = IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)).to_canonical();
            Some(SocketAddr::new(ip, u16::from_be(sin6.sin6_port)))
        }
        _ => None,
    }
}

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
    fn finds_its_own_listener_and_not_others() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let found = tcp_listeners().unwrap();
        assert!(found.contains(&addr), "{addr} not in {found:?}");
        // A connected (not listening) socket is not a listener.
        let client = std::net::TcpStream::connect(addr).unwrap();
        let found = tcp_listeners().unwrap();
        assert!(!found.contains(&client.local_addr().unwrap()));
        // IPv6, where this machine has it.
        if let Ok(v6) = std::net::TcpListener::bind("[::1]:0") {
            assert!(tcp_listeners().unwrap().contains(&v6.local_addr().unwrap()));
        }
    }

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

//! What a transport address in a UCX worker address leads to, for the transports that reach
//! a worker on the same host or over TCP (facts of UCX 1.23's packing, learned from UCX's
//! sources; all integers little-endian but the TCP port):
//!
//! ```text
//! same-host device (self has none)   u64 host id; bit 63 set: a u32 namespace id follows
//! self   interface  u64 id of the worker's loopback interface
//! cma    interface  u32 pid; bit 31 set: a u32 pid-namespace id follows
//! posix  interface  u64 segment id: bit 63 the FIFO is opened as /proc/<pid>/fd/<fd>
//!                   (pid: low 30 bits, fd: the 30 above), bit 62 shm_open, bit 60 a u32
//!                   pid-namespace id follows; otherwise the low 60 bits name the segment
//! sysv   interface  u64 shared-memory id, which UCX hands to shmat() as an int: only
//!                   ids that fit one are taken (a larger one would name the segment of
//!                   its low 32 bits under other bytes)
//! xpmem  interface  u64 FIFO address, then the i64 segment of the whole process
//! tcp    device     u8 flags (bit 0 loopback), u8 address family (2 inet, 10 inet6), then
//!                   the IP (4 or 16 bytes), or for loopback a host id as above (network
//!                   namespace); interface: u16 port, big-endian
//! ```
//! A transport is named by the CRC-16 of its name; UCX uses a peer's address only over a
//! transport of the same name it has itself. Addresses of other transports (InfiniBand,
//! CUDA IPC, ...) are kept as bytes.

use std::net::IpAddr;

use super::reader::{Parsed, Reader};
use super::ucx_address::TransportAddress;

/// UCX's CRC-16 (CCITT, reflected, initial and final inversion) of a transport name.
const fn checksum(name: &str) -> u16 {
    let bytes = name.as_bytes();
    let mut crc: u16 = 0xffff;
    let mut i = 0;
    while i < bytes.len() {
        crc ^= bytes[i] as u16;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x8408
            } else {
                crc >> 1
            };
            bit += 1;
        }
        i += 1;
    }
    !crc
}

const SELF: u16 = checksum("self");
const CMA: u16 = checksum("cma");
const POSIX: u16 = checksum("posix");
const SYSV: u16 = checksum("sysv");
const XPMEM: u16 = checksum("xpmem");
const TCP: u16 = checksum("tcp");

/// Flag of a host id that a namespace id follows.
const HOST_NS: u64 = 1 << 63;
/// Flag of a CMA pid that a pid-namespace id follows.
const CMA_PID_NS: u32 = 1 << 31;
const POSIX_PROCFS: u64 = 1 << 63;
const POSIX_PID_NS: u64 = 1 << 60;
const POSIX_ID_MASK: u64 = (1 << 60) - 1;
const POSIX_PID_BITS: u32 = 30;
/// The root pid namespace's id, which UCX assumes where an address names none.
pub(crate) const ROOT_PID_NS: u32 = 0xEFFF_FFFC;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// A UCX worker as its address describes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Worker {
    /// Its UUID, where the address carries one (optional in UCX's v2 format).
    pub uuid: Option<u64>,
    /// What each of its transport addresses leads to.
    pub destinations: Vec<Destination>,
}

/// A host (and namespace) as UCX's same-host transports name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Host {
    /// The host id, without its namespace flag.
    pub id: u64,
    /// The namespace id, outside the root namespace.
    pub ns: Option<u32>,
}

/// What one transport address leads to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Destination {
    /// UCX's loopback transport to the worker whose loopback interface has this id.
    Loopback(u64),
    /// Cross-memory attach: process `pid` of `host`, any of its memory.
    Cma {
        /// The host.
        host: Host,
        /// The process.
        pid: u32,
        /// Its pid namespace ([`ROOT_PID_NS`] where the address names none).
        pid_ns: u32,
    },
    /// A worker's POSIX shared-memory FIFO, opened through `/proc/<pid>/fd/<fd>`.
    PosixProc {
        /// The host.
        host: Host,
        /// The process holding the FIFO open.
        pid: u32,
        /// Its descriptor there.
        fd: u32,
        /// The process's pid namespace.
        pid_ns: u32,
    },
    /// A worker's POSIX shared-memory FIFO, named by id.
    PosixNamed {
        /// The host.
        host: Host,
        /// The segment's id.
        id: u64,
    },
    /// A worker's System V shared-memory FIFO.
    Sysv {
        /// The host.
        host: Host,
        /// The shared-memory id (a non-negative C int, as `shmget` returns them).
        shmid: u32,
    },
    /// XPMEM: the segment of a whole process.
    Xpmem {
        /// The host.
        host: Host,
        /// The segment.
        segid: u64,
    },
    /// A worker's TCP listener.
    Tcp {
        /// Its IP (the loopback address of the family for a loopback device; an IPv4
        /// address mapped into IPv6 as the IPv4 address).
        ip: IpAddr,
        /// Its port.
        port: u16,
        /// For a loopback device, the host and network namespace it is on.
        loopback: Option<Host>,
    },
    /// A transport whose address is not interpreted: its name checksum and bytes.
    Other {
        /// CRC-16 of the transport's name.
        checksum: u16,
        /// The device address.
        device: Vec<u8>,
        /// The interface address.
        iface: Vec<u8>,
    },
}

/// What `address` leads to.
///
/// # Errors
/// A rejection, at the interface address, of an address too short for what UCX reads of
/// its transport.
pub(crate) fn destination(address: &TransportAddress<'_>) -> Parsed<Destination> {
    let mut iface = Reader::new(address.iface, address.iface_at);
    let host = || host_at(&mut Reader::new(address.device, address.device_at));
    Ok(match address.checksum {
        SELF => Destination::Loopback(iface.u64("UCX self interface address")?),
        CMA => {
            let raw = iface.u32("UCX cma interface address")?;
            let pid_ns = if raw & CMA_PID_NS != 0 {
                iface.u32("UCX cma pid namespace")?
            } else {
                ROOT_PID_NS
            };
            Destination::Cma {
                host: host()?,
                pid: raw & !CMA_PID_NS,
                pid_ns,
            }
        }
        POSIX => {
            let seg = iface.u64("UCX posix interface address")?;
            let id = seg & POSIX_ID_MASK;
            if seg & POSIX_PROCFS != 0 {
                let pid_ns = if seg & POSIX_PID_NS != 0 {
                    iface.u32("UCX posix pid namespace")?
                } else {
                    ROOT_PID_NS
                };
                // Both fit in 30 bits.
                let low = |v: u64| (v & ((1 << POSIX_PID_BITS) - 1)) as u32;
                Destination::PosixProc {
                    host: host()?,
                    pid: low(id),
                    fd: low(id >> POSIX_PID_BITS),
                    pid_ns,
                }
            } else {
                Destination::PosixNamed { host: host()?, id }
            }
        }
        SYSV => {
            let at = iface.offset();
            let raw = iface.u64("UCX sysv interface address")?;
            let shmid = u32::try_from(raw)
                .ok()
                .filter(|&id| i32::try_from(id).is_ok())
                .ok_or_else(|| {
                    iface.reject_at(
                        at,
                        format!(
                            "UCX sysv shared-memory id {raw:#x} does not fit the C int UCX \
                             passes to shmat (0 to {:#x}); UCX never packs such an id",
                            i32::MAX
                        ),
                    )
                })?;
            Destination::Sysv {
                host: host()?,
                shmid,
            }
        }
        XPMEM => {
            iface.u64("UCX xpmem FIFO address")?;
            Destination::Xpmem {
                host: host()?,
                segid: iface.u64("UCX xpmem segment")?,
            }
        }
        TCP => tcp(address, &mut iface)?,
        checksum => Destination::Other {
            checksum,
            device: address.device.to_vec(),
            iface: address.iface.to_vec(),
        },
    })
}

/// The host a same-host transport's device address names.
fn host_at(r: &mut Reader<'_>) -> Parsed<Host> {
    let raw = r.u64("UCX host id")?;
    let ns = if raw & HOST_NS != 0 {
        Some(r.u32("UCX host namespace")?)
    } else {
        None
    };
    Ok(Host {
        id: raw & !HOST_NS,
        ns,
    })
}

/// A TCP listener from its device and interface addresses.
fn tcp(address: &TransportAddress<'_>, iface: &mut Reader<'_>) -> Parsed<Destination> {
    let mut dev = Reader::new(address.device, address.device_at);
    let flags = dev.u8("UCX tcp device flags")?;
    let family = dev.u8("UCX tcp address family")?;
    let port = iface.take(2, "UCX tcp port")?;
    let port = u16::from_be_bytes([port[0], port[1]]);
    let (ip, loopback) = match (family, flags & 1 != 0) {
        (AF_INET, true) => (IpAddr::from([127, 0, 0, 1]), Some(host_at(&mut dev)?)),
        (AF_INET6, true) => (
            IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]),
            Some(host_at(&mut dev)?),
        ),
        (AF_INET, false) => {
            let ip = dev.take(4, "UCX tcp IPv4 address")?;
            (IpAddr::from([ip[0], ip[1], ip[2], ip[3]]), None)
        }
        (AF_INET6, false) => {
            let mut ip = [0u8; 16];
            ip.copy_from_slice(dev.take(16, "UCX tcp IPv6 address")?);
            (IpAddr::from(ip).to_canonical(), None)
        }
        (other, _) => return Err(dev.reject(format!("UCX tcp address family {other}"))),
    };
    Ok(Destination::Tcp { ip, port, loopback })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(checksum: u16, device: &str, iface: &str) -> Parsed<Destination> {
        let hex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        let (device, iface) = (hex(device), hex(iface));
        destination(&TransportAddress {
            checksum,
            device: &device,
            device_at: 50,
            iface: &iface,
            iface_at: 100,
        })
    }

    const HOST: Host = Host {
        id: 0x19ff_685e_9518_e461,
        ns: None,
    };

    /// Addresses taken from a live agent of NIXL 1.5.1's bundled UCX (pid 22151).
    #[test]
    fn real_addresses_decode_to_what_they_reach() {
        assert_eq!(
            [
                checksum("self"),
                checksum("tcp"),
                checksum("cma"),
                checksum("posix"),
                checksum("sysv")
            ],
            [0x7563, 0x19cf, 0x8b47, 0xd3a7, 0x538d]
        );
        let sm = "61e418955e68ff19";
        assert_eq!(
            decode(SELF, "", "9c8f450a48103c66").unwrap(),
            Destination::Loopback(0x663c_1048_0a45_8f9c)
        );
        assert_eq!(
            decode(CMA, sm, "87560000").unwrap(),
            Destination::Cma {
                host: HOST,
                pid: 22151,
                pid_ns: ROOT_PID_NS
            }
        );
        assert_eq!(
            decode(POSIX, sm, "87560000040000c0").unwrap(),
            Destination::PosixProc {
                host: HOST,
                pid: 22151,
                fd: 16,
                pid_ns: ROOT_PID_NS
            }
        );
        assert_eq!(
            decode(SYSV, sm, "0e00090000000000").unwrap(),
            Destination::Sysv {
                host: HOST,
                shmid: 0x9000e
            }
        );
        assert_eq!(
            decode(TCP, "0002c0000202", "920f").unwrap(),
            Destination::Tcp {
                ip: IpAddr::from([192, 0, 2, 2]),
                port: 0x920f,
                loopback: None
            }
        );
        assert_eq!(
            decode(TCP, "010261e418955e68ff99f9ffffef", "b06b").unwrap(),
            Destination::Tcp {
                ip: IpAddr::from([127, 0, 0, 1]),
                port: 0xb06b,
                loopback: Some(Host {
                    id: 0x19ff_685e_9518_e461,
                    ns: Some(0xefff_fff9)
                })
            }
        );
    }

    #[test]
    fn flags_that_change_the_bytes_but_not_the_target_decode_the_same() {
        // A pid-namespace flag naming the root namespace is the address without it.
        let with_ns = decode(CMA, "61e418955e68ff19", "87560080fcffffef").unwrap();
        assert_eq!(
            with_ns,
            decode(CMA, "61e418955e68ff19", "87560000").unwrap()
        );
        // Bytes after what UCX reads change nothing.
        assert_eq!(
            decode(SYSV, "61e418955e68ff19aabb", "0e00090000000000ff").unwrap(),
            decode(SYSV, "61e418955e68ff19", "0e00090000000000").unwrap()
        );
        // An IPv4 address mapped into IPv6 is that IPv4 address.
        let mapped = decode(TCP, "000a00000000000000000000ffffc0000202", "920f").unwrap();
        assert_eq!(mapped, decode(TCP, "0002c0000202", "920f").unwrap());
    }

    #[test]
    fn addresses_shorter_than_what_ucx_reads_are_refused() {
        let err = decode(CMA, "61e418955e68ff19", "8756").unwrap_err();
        assert_eq!(err.offset, 100);
        assert!(err.reason.contains("cma"), "{}", err.reason);
        assert!(decode(SYSV, "61e4", "0e00090000000000").is_err());
        // A segment id with bits above the C int that shmat takes: the same segment as
        // its low 32 bits, under other bytes.
        for iface in ["0e00090001000000", "0e00098000000000", "ffffffff00000000"] {
            let err = decode(SYSV, "61e418955e68ff19", iface).unwrap_err();
            assert_eq!(err.offset, 100);
            assert!(
                err.reason.contains("does not fit the C int"),
                "{}",
                err.reason
            );
        }
        assert!(decode(TCP, "0002c000", "920f").is_err());
        assert!(decode(TCP, "0007c0000202", "920f").is_err());
        assert_eq!(
            decode(0x1234, "ab", "cd").unwrap(),
            Destination::Other {
                checksum: 0x1234,
                device: vec![0xab],
                iface: vec![0xcd]
            }
        );
    }
}

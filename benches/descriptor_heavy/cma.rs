//! The CMA limit of a descriptor-heavy READ: `process_vm_readv` of the same runs of blocks
//! from another process holding the prefill's cache laid out as the NIXL READ's remote side,
//! into a local cache laid out as its local side, one run per call and 64 per call.
//!
//! CMA is the path UCX takes between two processes of one host, so no transfer library on
//! this machine reads these bytes faster than this probe.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use super::tables::{self, Case, BLOCK, POOL, REGIONS};
use super::Res;

/// A cache of [`REGIONS`] regions of [`POOL`] blocks, each region its own allocation,
/// zeroed lazily by the kernel (only the blocks touched take memory).
pub fn cache() -> Vec<Vec<u8>> {
    (0..REGIONS).map(|_| vec![0u8; POOL * BLOCK]).collect()
}

/// The child: the prefill's cache with the remote blocks of every case filled, its pid and
/// region addresses printed on one line, kept until stdin closes.
pub fn serve() -> Res<()> {
    let mut regions = cache();
    for case in Case::ALL {
        let (_, remote) = case.tables();
        for (r, region) in regions.iter_mut().enumerate() {
            for &b in &remote {
                tables::fill(&mut region[b * BLOCK..(b + 1) * BLOCK], r, b);
            }
        }
    }
    let addrs: Vec<String> = regions
        .iter()
        .map(|r| (r.as_ptr() as usize).to_string())
        .collect();
    let mut out = std::io::stdout();
    writeln!(out, "{} {}", std::process::id(), addrs.join(" "))?;
    out.flush()?;
    let mut rest = String::new();
    std::io::stdin().read_line(&mut rest)?;
    drop(regions);
    Ok(())
}

/// The child process and where its regions are.
pub struct Peer {
    child: Child,
    pid: libc::pid_t,
    addrs: Vec<usize>,
    /// The local cache the probe reads into.
    local: Vec<Vec<u8>>,
}

impl Peer {
    /// Starts the child (this benchmark with `cma-serve`) and waits for its addresses.
    pub fn start() -> Res<Peer> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("cma-serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().ok_or("the child's stdout")?).read_line(&mut line)?;
        let words: Vec<usize> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        let [pid, addrs @ ..] = words.as_slice() else {
            return Err(format!("the CMA child printed {line:?}").into());
        };
        if addrs.len() != REGIONS {
            return Err(format!("the CMA child printed {} regions", addrs.len()).into());
        }
        Ok(Peer {
            child,
            pid: libc::pid_t::try_from(*pid)?,
            addrs: addrs.to_vec(),
            local: cache(),
        })
    }

    /// Reads `case`'s runs (region by region) from the child, `per_call` runs per
    /// `process_vm_readv`; seconds. With `check`, the local blocks are zeroed first and every
    /// byte is checked after.
    pub fn read(&mut self, case: Case, per_call: usize, check: bool) -> Res<f64> {
        let (local, remote) = case.tables();
        if check {
            for region in &mut self.local {
                for &b in &local {
                    region[b * BLOCK..(b + 1) * BLOCK].fill(0);
                }
            }
        }
        let runs = tables::runs(&local, &remote);
        let mut local_iov = Vec::with_capacity(per_call);
        let mut remote_iov = Vec::with_capacity(per_call);
        let t0 = Instant::now();
        for r in 0..REGIONS {
            let base = self.local[r].as_mut_ptr() as usize;
            for chunk in runs.chunks(per_call) {
                local_iov.clear();
                remote_iov.clear();
                let mut bytes = 0;
                for &(l, far, n) in chunk {
                    local_iov.push(libc::iovec {
                        iov_base: (base + l * BLOCK) as *mut libc::c_void,
                        iov_len: n * BLOCK,
                    });
                    remote_iov.push(libc::iovec {
                        iov_base: (self.addrs[r] + far * BLOCK) as *mut libc::c_void,
                        iov_len: n * BLOCK,
                    });
                    bytes += n * BLOCK;
                }
                // SAFETY: the local iovecs lie inside `self.local[r]`, which lives and is not
                // otherwise borrowed during the call (`&mut self`); the remote ones name the
                // child's memory, which the kernel checks and reads, not ours.
                let got = unsafe {
                    libc::process_vm_readv(
                        self.pid,
                        local_iov.as_ptr(),
                        local_iov.len() as libc::c_ulong,
                        remote_iov.as_ptr(),
                        remote_iov.len() as libc::c_ulong,
                        0,
                    )
                };
                if got < 0 || got as usize != bytes {
                    return Err(format!(
                        "process_vm_readv: {got} of {bytes} bytes: {}",
                        std::io::Error::last_os_error()
                    )
                    .into());
                }
            }
        }
        let seconds = t0.elapsed().as_secs_f64();
        if check {
            for (r, region) in self.local.iter().enumerate() {
                for (&l, &far) in local.iter().zip(&remote) {
                    if !tables::holds(&region[l * BLOCK..(l + 1) * BLOCK], r, far) {
                        return Err(format!(
                            "CMA {}: region {r} local block {l} does not hold remote block {far}",
                            case.name()
                        )
                        .into());
                    }
                }
            }
        }
        Ok(seconds)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

//! Metadata exchange through etcd. Alone in its file (its own process) because NIXL reads
//! `NIXL_ETCD_ENDPOINTS` from the environment when an agent is created.
//!
//! Needs the `etcd` binary (Debian package etcd-server, installed by scripts/setup.sh);
//! without it the test prints why and returns.

mod common;

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{contents, free_port, pattern, transfer, unique_name, wait_metadata, Pair};
use nixl::{Agent, MetadataPeer, XferOp};

/// A private etcd server on 127.0.0.1, killed when dropped (also when a test panics).
struct Etcd {
    child: Child,
    client_url: String,
    _data: tempfile::TempDir,
}

impl Etcd {
    /// Starts etcd, or returns why it cannot.
    fn start() -> Result<Etcd, String> {
        let binary = std::env::var_os("PATH")
            .and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|dir| dir.join("etcd"))
                    .find(|p| p.is_file())
            })
            .ok_or("no etcd binary on PATH (install Debian's etcd-server)")?;
        let data = tempfile::tempdir().map_err(|e| e.to_string())?;
        let (client, peer) = (free_port(), free_port());
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new(&binary)
            .arg("--name=nixl-rs-test")
            .arg(format!("--data-dir={}", data.path().display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=nixl-rs-test={peer_url}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        let etcd = Etcd {
            child,
            client_url,
            _data: data,
        };
        etcd.wait_ready(client)?;
        Ok(etcd)
    }

    /// Waits (bounded) until the client port accepts connections and etcd reports health.
    fn wait_ready(&self, port: u16) -> Result<(), String> {
        let deadline = Instant::now() + common::WAIT;
        while Instant::now() < deadline {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() && self.healthy(port) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!("etcd never became ready on port {port}"))
    }

    fn healthy(&self, port: u16) -> bool {
        use std::io::{Read, Write};
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let request = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        let mut reply = String::new();
        stream.write_all(request.as_bytes()).is_ok()
            && stream.read_to_string(&mut reply).is_ok()
            && reply.contains("\"health\":\"true\"")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn metadata_through_etcd() {
    let etcd = match Etcd::start() {
        Ok(etcd) => etcd,
        Err(reason) => {
            eprintln!("skipping the etcd test: {reason}");
            return;
        }
    };
    // Set before any agent exists; this process has no other test that creates agents.
    std::env::set_var("NIXL_ETCD_ENDPOINTS", &etcd.client_url);
    std::env::set_var(
        "NIXL_ETCD_NAMESPACE",
        format!("/nixl-rs-test-{}", std::process::id()),
    );

    let pair = Pair::with(
        Agent::new(&unique_name("etcd-a")).unwrap(),
        Agent::new(&unique_name("etcd-b")).unwrap(),
    );
    let (src, dst) = pair.source_and_destination(pattern(4096, 81));

    // b publishes; a fetches b's metadata and WRITEs into b.
    pair.b.send_local_metadata(&MetadataPeer::Etcd).unwrap();
    pair.a
        .fetch_remote_metadata(pair.b.name(), &MetadataPeer::Etcd)
        .unwrap();
    wait_metadata(&pair.a, pair.b.name());
    transfer(&pair.a, XferOp::Write, &src, &dst, pair.b.name()).unwrap();
    assert_eq!(contents(&dst), pattern(4096, 81));

    // The other way: a publishes, b fetches and READs from a.
    pair.a.send_local_metadata(&MetadataPeer::Etcd).unwrap();
    pair.b
        .fetch_remote_metadata(pair.a.name(), &MetadataPeer::Etcd)
        .unwrap();
    wait_metadata(&pair.b, pair.a.name());
    let back = pair
        .b
        .register_memory(vec![0u8; 4096], &[&pair.ucx_b])
        .unwrap();
    transfer(&pair.b, XferOp::Read, &back, &src, pair.a.name()).unwrap();
    assert_eq!(contents(&back), pattern(4096, 81));

    pair.a
        .invalidate_local_metadata(&MetadataPeer::Etcd)
        .unwrap();
    pair.b
        .invalidate_local_metadata(&MetadataPeer::Etcd)
        .unwrap();
}

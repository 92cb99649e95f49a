//! Where a loaded agent lives, checked again once this process's UCX workers changed.
//!
//! `load_remote_metadata` decides where the metadata's worker lives against the workers
//! this process has then. A worker this process creates later (a new agent or backend) can
//! own an address the metadata names: a TCP listener on the port it names, a System V
//! segment of the id it names. So before a request reaches a loaded agent, the metadata
//! of an agent found in another process is classified again whenever the set of workers
//! changed since it was last checked; metadata that now leads into this process under a
//! name not its agent's is refused for every request, until it is invalidated. (Metadata
//! found in this process needs no second look: requests to it are held to its agents' live
//! registrations, and to none once they are gone.)

use crate::error::{Error, Result};
use crate::peers::designation;
use crate::peers::local_peers;
use crate::peers::wire::{inspect_metadata, LoadedMetadata};

/// Checks `remote_agent`'s loaded metadata again if this process's UCX workers changed
/// since it was last checked, and records what it now says.
///
/// # Errors
/// [`Error::MetadataLeadsIntoThisProcess`] when it now leads into this process under a
/// name that is not its agent's.
pub(crate) fn recheck(loaded: &LoadedMetadata, remote_agent: &str) -> Result<()> {
    let workers = local_peers::workers_generation();
    let Some(bytes) = loaded.stale(remote_agent, workers) else {
        return Ok(());
    };
    let peer = inspect_metadata(&bytes)?;
    let kind = designation::classify(&peer).map_err(|err| match err {
        Error::MetadataLeadsIntoThisProcess { agent, reason } => {
            Error::MetadataLeadsIntoThisProcess {
                agent,
                reason: format!(
                    "{reason} (found at a request: this process's UCX workers changed since \
                     the metadata was loaded; invalidate it)"
                ),
            }
        }
        other => other,
    })?;
    loaded.rechecked(remote_agent, &bytes, workers, kind);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    use super::*;
    use crate::peers::local_peers::FakeAgent;
    use crate::peers::wire::Worker;
    use crate::{Agent, LocalDescList, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};

    const PEER_ENV: &str = "NIXL_RS_TEST_RECHECK_PEER";

    /// An agent of another process, run as a child of this test binary: registers 4096
    /// bytes, prints its metadata and lives until its parent closes its stdin.
    #[test]
    #[ignore = "the peer of metadata_loaded_before_a_worker_came_is_checked_at_a_request"]
    fn recheck_peer_role() {
        let name = std::env::var(PEER_ENV).expect("run by the parent test");
        let agent = Agent::new(&name).unwrap();
        agent.create_backend("UCX").unwrap();
        let _reg = agent.register_memory(vec![0u8; 4096], &[]).unwrap();
        let md = agent.local_metadata().unwrap();
        let hex: String = md.iter().map(|b| format!("{b:02x}")).collect();
        println!("MD {hex}");
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
    }

    #[test]
    fn metadata_loaded_before_a_worker_came_is_checked_at_a_request() {
        let name = format!("recheck-peer-{}", std::process::id());
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "peers::recheck::tests::recheck_peer_role",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(PEER_ENV, &name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let md: Vec<u8> = BufReader::new(child.stdout.take().unwrap())
            .lines()
            .map_while(std::result::Result::ok)
            .find_map(|line| {
                let hex = &line[line.find("MD ")? + 3..];
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
                    .collect()
            })
            .expect("the peer prints its metadata");

        let loader = Agent::new(&format!("recheck-loader-{}", std::process::id())).unwrap();
        loader.create_backend("UCX").unwrap();
        assert_eq!(loader.load_remote_metadata(&md).unwrap(), name);
        let peer = inspect_metadata(&md).unwrap();
        let uuid = peer.worker.as_ref().unwrap().uuid;
        assert!(
            uuid.is_some(),
            "NIXL 1.5.1's UCX addresses carry the worker UUID"
        );
        let region = peer.regions[0].desc;
        let src = loader.register_memory(vec![0u8; 64], &[]).unwrap();
        let mut local = LocalDescList::new(MemType::Dram).unwrap();
        local.push(&src, 0, 0, 64).unwrap();
        let remote = RemoteDescList::from_descs(
            MemType::Dram,
            &[XferDesc::new(region.addr as usize, 64, region.dev_id)],
        )
        .unwrap();
        let request =
            || loader.create_xfer_req(XferOp::Read, &local, &remote, &name, &XferOptions::new());
        assert!(request().is_ok());
        let prepared_local = loader.prepare_local(&local, &[]).unwrap();
        let prepared_remote = loader.prepare_remote(&name, &remote, &[]).unwrap();
        let from_prepared = || {
            loader.make_xfer_req(
                XferOp::Read,
                &prepared_local,
                &[0],
                &prepared_remote,
                &[0],
                &XferOptions::new(),
            )
        };

        // A worker this process creates after the load owns what the metadata names (its
        // UUID stands in for a TCP port or segment id a new worker could take).
        let newcomer = FakeAgent::new(
            "recheck-newcomer",
            Worker {
                uuid,
                destinations: Vec::new(),
            },
        );
        for result in [request(), request(), from_prepared()] {
            match result {
                Err(Error::MetadataLeadsIntoThisProcess { agent, reason }) => {
                    assert_eq!(agent, name);
                    assert!(reason.contains("UUID"), "{reason}");
                    assert!(reason.contains("\"recheck-newcomer\""), "{reason}");
                    assert!(reason.contains("found at a request"), "{reason}");
                }
                other => panic!("expected the request refused, got {other:?}"),
            }
        }
        // Gone again: the metadata leads nowhere in this process, and requests go on.
        drop(newcomer);
        assert!(request().is_ok());
        assert!(from_prepared().is_ok());
        drop(child.stdin.take());
        child.wait().unwrap();
    }
}

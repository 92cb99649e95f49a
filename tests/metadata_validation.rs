//! Remote metadata is validated before NIXL sees it: real metadata of every kind loads,
//! and the inputs that crashed NIXL 1.5.1 / UCX (tests/data/metadata_corpus, plus the same
//! mutations of live metadata) come back as `Error::InvalidMetadata`.

mod common;

use std::path::Path;

use common::unique_name;
use nixl::{metadata_agent_name, validate_metadata, Agent, Backend, Error, Registration};

/// An agent with the given backends (by plugin name).
fn agent_with(prefix: &str, plugins: &[&str]) -> (Agent, Vec<Backend>) {
    let agent = Agent::new(&unique_name(prefix)).unwrap();
    let backends = plugins
        .iter()
        .map(|p| agent.create_backend(p).unwrap())
        .collect();
    (agent, backends)
}

/// A fresh loading agent with UCX and POSIX.
fn loader() -> (Agent, Vec<Backend>) {
    agent_with("md-loader", &["UCX", "POSIX"])
}

/// Validates `md` and loads it into a fresh agent; the loaded name must be `name`.
fn assert_loads(kind: &str, md: &[u8], name: &str) {
    validate_metadata(md).unwrap_or_else(|e| panic!("{kind}: {e}"));
    assert_eq!(metadata_agent_name(md).unwrap(), name, "{kind}");
    let (agent, _backends) = loader();
    assert_eq!(agent.load_remote_metadata(md).unwrap(), name, "{kind}");
}

/// Registers `count` DRAM buffers of 4 KiB with `backend`.
fn register(agent: &Agent, backend: &Backend, count: usize) -> Vec<Registration> {
    (0..count)
        .map(|i| {
            agent
                .register_memory(vec![i as u8; 4096], &[backend])
                .unwrap()
        })
        .collect()
}

#[test]
fn real_metadata_of_every_kind_validates_and_loads() {
    for plugins in [&["UCX"][..], &["UCX", "POSIX"]] {
        for count in [0, 1, 1000] {
            let (agent, backends) = agent_with("md-real", plugins);
            let ucx = &backends[0];
            let regs = register(&agent, ucx, count);
            let label = format!("{plugins:?} with {count} registrations");
            let full = agent.local_metadata().unwrap();
            assert_loads(&format!("full, {label}"), &full, agent.name());
            let conn = agent.local_partial_metadata(&[], &[]).unwrap();
            assert_loads(&format!("connection only, {label}"), &conn, agent.name());
            let conn_ucx = agent.local_partial_metadata(&[], &[ucx]).unwrap();
            assert_loads(
                &format!("connection only via UCX, {label}"),
                &conn_ucx,
                agent.name(),
            );
            if !regs.is_empty() {
                let all: Vec<&Registration> = regs.iter().collect();
                for (what, list) in [("one", &all[..1]), ("all", &all[..])] {
                    let partial = agent.local_partial_metadata(list, &[ucx]).unwrap();
                    let kind = format!("partial without connection info ({what}), {label}");
                    validate_metadata(&partial).unwrap_or_else(|e| panic!("{kind}: {e}"));
                    // Descriptors without connection info load after the connection info.
                    let (loader, _b) = loader();
                    loader.load_remote_metadata(&conn).unwrap();
                    assert_eq!(loader.load_remote_metadata(&partial).unwrap(), agent.name());
                }
            }
        }
    }
}

#[test]
fn posix_only_agents_have_connection_free_metadata() {
    let (agent, backends) = agent_with("md-posix", &["POSIX"]);
    // POSIX does not talk to remote agents: NIXL has no full metadata for such an agent,
    // and its connection-only metadata lists no connection info and no sections.
    assert!(matches!(agent.local_metadata(), Err(Error::Nixl { .. })));
    let md = agent.local_partial_metadata(&[], &[&backends[0]]).unwrap();
    assert_loads("POSIX connection only", &md, agent.name());
}

#[test]
fn ten_kilobyte_agent_names() {
    let name = format!("{}-{}", unique_name("md-long"), "n".repeat(10 * 1024));
    let agent = Agent::new(&name).unwrap();
    let ucx = agent.create_backend("UCX").unwrap();
    let _regs = register(&agent, &ucx, 1);
    assert_loads("10 KB name, full", &agent.local_metadata().unwrap(), &name);
    let conn = agent.local_partial_metadata(&[], &[]).unwrap();
    assert_loads("10 KB name, connection only", &conn, &name);
}

/// Every file of tests/data/metadata_corpus, by name.
fn corpus() -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/metadata_corpus");
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn the_crash_corpus_comes_back_as_errors() {
    let cases = corpus();
    assert!(cases.len() >= 20, "corpus has {} files", cases.len());
    let (agent, _backends) = loader();
    for (name, bytes) in &cases {
        assert!(
            matches!(
                metadata_agent_name(bytes),
                Err(Error::InvalidMetadata { .. })
            ),
            "{name}"
        );
        match agent.load_remote_metadata(bytes) {
            Err(Error::InvalidMetadata { offset, reason }) => {
                assert!(offset <= bytes.len(), "{name}: offset {offset}: {reason}")
            }
            other => panic!("{name}: expected InvalidMetadata, got {other:?}"),
        }
    }
    // The case: 225 bytes of partial metadata whose memory type is 8.
    let (_, md) = cases.iter().find(|(n, _)| n == "memtype-8.bin").unwrap();
    assert_eq!(md.len(), 225);
    let err = validate_metadata(md).unwrap_err().to_string();
    assert!(
        err.contains("at byte 158") && err.contains("memory type 8"),
        "{err}"
    );
    let (_, md) = cases
        .iter()
        .find(|(n, _)| n == "ucx-version-2.bin")
        .unwrap();
    let err = validate_metadata(md).unwrap_err().to_string();
    assert!(err.contains("UCX address version 2"), "{err}");
}

/// Offset of the payload of the first field tagged `tag` after `from`.
fn payload(md: &[u8], tag: &[u8], from: usize) -> usize {
    let at = md[from..]
        .windows(tag.len())
        .position(|w| w == tag)
        .unwrap()
        + from;
    at + tag.len() + 8
}

#[test]
fn mutations_of_live_metadata_come_back_as_errors() {
    let (agent, backends) = agent_with("md-live", &["UCX"]);
    let _regs = register(&agent, &backends[0], 1);
    let good = agent.local_metadata().unwrap();
    let (target, _b) = loader();
    let reject = |what: String, md: Vec<u8>| match target.load_remote_metadata(&md) {
        Err(Error::InvalidMetadata { .. }) => {}
        other => panic!("{what}: expected InvalidMetadata, got {other:?}"),
    };
    let mem_type = payload(&good, b"nixlSDList|t", 0);
    for value in (5u32..=16).chain([255, 1 << 16, u32::MAX]) {
        let mut md = good.clone();
        md[mem_type..mem_type + 4].copy_from_slice(&value.to_le_bytes());
        reject(format!("memory type {value}"), md);
    }
    let ucx = payload(&good, b"|c", 0);
    for version in 2..16u8 {
        let mut md = good.clone();
        md[ucx] = (md[ucx] & 0xf0) | version;
        reject(format!("UCX address version {version}"), md);
    }
    for cut in 1..good.len() {
        reject(format!("cut to {cut} bytes"), good[..cut].to_vec());
    }
    // After all that, the real metadata still loads.
    assert_eq!(target.load_remote_metadata(&good).unwrap(), agent.name());
}

#[test]
fn an_agent_already_loaded_gets_no_pass_for_different_bytes() {
    let (agent, backends) = agent_with("md-reload", &["UCX"]);
    let _regs = register(&agent, &backends[0], 1);
    let good = agent.local_metadata().unwrap();
    let (target, _b) = loader();
    assert_eq!(target.load_remote_metadata(&good).unwrap(), agent.name());
    // Reloading the very same bytes is NIXL's no-op path (not validated a second time).
    assert_eq!(target.load_remote_metadata(&good).unwrap(), agent.name());
    // The same agent name with one bad byte is validated, and refused, all the same.
    let mut bad = good.clone();
    let mem_type = payload(&good, b"nixlSDList|t", 0);
    bad[mem_type..mem_type + 4].copy_from_slice(&8u32.to_le_bytes());
    match target.load_remote_metadata(&bad) {
        Err(Error::InvalidMetadata { offset, .. }) => assert_eq!(offset, mem_type),
        other => panic!("expected the bad reload to be refused, got {other:?}"),
    }
    // After an invalidation the same bytes load again.
    target.invalidate_remote_metadata(agent.name()).unwrap();
    assert_eq!(target.load_remote_metadata(&good).unwrap(), agent.name());
}

//! The seed corpus: real metadata of live agents (kept alive for the whole run, so the
//! UCX addresses in the seeds point at real workers).

use nixl::{Agent, Backend, Registration};

/// Agents whose metadata seeds the run; dropping them ends those agents.
pub struct Seeds {
    /// The metadata blobs.
    pub corpus: Vec<Vec<u8>>,
    _regs: Vec<Registration>,
    _backends: Vec<Backend>,
    _agents: Vec<Agent>,
}

/// Creates agents of every kind and collects their full, partial and connection-only
/// metadata.
pub fn generate() -> nixl::Result<Seeds> {
    let pid = std::process::id();
    let mut corpus = Vec::new();
    let mut regs = Vec::new();
    let mut backends = Vec::new();
    let mut agents = Vec::new();
    for (i, registrations) in [0usize, 1, 3].into_iter().enumerate() {
        let agent = Agent::new(&format!("fuzz-seed-{pid}-{i}"))?;
        let ucx = agent.create_backend("UCX")?;
        let posix = agent.create_backend("POSIX")?;
        let mut mine = Vec::new();
        for r in 0..registrations {
            mine.push(agent.register_memory(vec![r as u8; 4096 * (r + 1)], &[&ucx])?);
        }
        corpus.push(agent.local_metadata()?);
        corpus.push(agent.local_partial_metadata(&[], &[])?);
        corpus.push(agent.local_partial_metadata(&[], &[&posix])?);
        if let Some(first) = mine.first() {
            corpus.push(agent.local_partial_metadata(&[first], &[&ucx])?);
        }
        regs.extend(mine);
        backends.extend([ucx, posix]);
        agents.push(agent);
    }
    Ok(Seeds {
        corpus,
        _regs: regs,
        _backends: backends,
        _agents: agents,
    })
}

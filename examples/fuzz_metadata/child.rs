//! The child side: loads each input of a batch file, announcing the input's index on
//! stdout before trying it, so a crash points at its input. An input that reaches NIXL
//! leaves its agent behind: the next input gets a fresh one.

use std::io::Write;

use nixl::Agent;

/// Reads a batch (inputs as u32 little-endian length + bytes) from `path`, loads each.
pub fn run(path: &str) -> std::io::Result<()> {
    let batch = std::fs::read(path)?;
    let mut stdout = std::io::stdout();
    let mut loader: Option<Loader> = None;
    for (index, input) in split(&batch).into_iter().enumerate() {
        writeln!(stdout, "{index}")?;
        stdout.flush()?;
        let agent = match loader.take() {
            Some(agent) => agent,
            None => match Loader::new(index) {
                Ok(agent) => agent,
                Err(err) => {
                    // Not the input's doing: it was not loaded yet. The parent retries it.
                    writeln!(stdout, "harness-error {err}")?;
                    return Err(err);
                }
            },
        };
        match agent.agent.load_remote_metadata(input) {
            // Refused before NIXL saw it: the agent is untouched and serves the next input.
            Err(nixl::Error::InvalidMetadata { .. } | nixl::Error::InvalidArgument { .. }) => {
                loader = Some(agent)
            }
            // NIXL parsed it (and may keep state): the next input gets a fresh agent.
            _ => writeln!(stdout, "reached-nixl")?,
        }
    }
    writeln!(stdout, "done")?;
    Ok(())
}

/// A loading agent with the UCX and POSIX backends.
struct Loader {
    agent: Agent,
    _backends: [nixl::Backend; 2],
}

impl Loader {
    fn new(index: usize) -> std::io::Result<Loader> {
        let agent = Agent::new(&format!("fuzz-loader-{}-{index}", std::process::id()))
            .map_err(std::io::Error::other)?;
        let ucx = agent.create_backend("UCX").map_err(std::io::Error::other)?;
        let posix = agent
            .create_backend("POSIX")
            .map_err(std::io::Error::other)?;
        Ok(Loader {
            agent,
            _backends: [ucx, posix],
        })
    }
}

/// Packs inputs into one batch.
pub fn join(inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for input in inputs {
        out.extend_from_slice(&(input.len() as u32).to_le_bytes());
        out.extend_from_slice(input);
    }
    out
}

/// Unpacks a batch.
pub fn split(mut batch: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while batch.len() >= 4 {
        let len = u32::from_le_bytes(batch[..4].try_into().unwrap()) as usize;
        let Some(input) = batch.get(4..4 + len) else {
            break;
        };
        out.push(input);
        batch = &batch[4 + len..];
    }
    out
}

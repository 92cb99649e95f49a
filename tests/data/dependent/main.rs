//! A program that depends on `nixl` as any crate would: no build script, no direct
//! nixl-capi-sys dependency, no LD_LIBRARY_PATH. Two agents move 1 MiB over UCX and every byte is
//! checked. tests/as_dependent.rs writes it into a fresh cargo project and runs it.

use std::process::ExitCode;
use std::time::Duration;

use nixl::{Agent, LocalDescList, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};

const LEN: usize = 1 << 20;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let a = Agent::new("dependent-a")?;
    let library = nixl::load_library()?;
    println!(
        "loaded NIXL {} from {} (via {})",
        library.version(),
        library.path().display(),
        library.found_by()
    );
    let b = Agent::new("dependent-b")?;
    let (ucx_a, ucx_b) = (a.create_backend("UCX")?, b.create_backend("UCX")?);

    let sent: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8 ^ (i >> 12) as u8).collect();
    let dst = a.register_memory(vec![0u8; LEN], &[&ucx_a])?;
    let src = b.register_memory(sent.clone(), &[&ucx_b])?;
    let remote = a.load_remote_metadata(&b.local_metadata()?)?;

    let mut local = LocalDescList::new(MemType::Dram)?;
    local.push_region(&dst, 0)?;
    let source = XferDesc::new(src.regions()[0].addr, LEN, 0);
    let remote_list = RemoteDescList::from_descs(MemType::Dram, &[source])?;
    let options = XferOptions::new();
    let mut request = a.create_xfer_req(XferOp::Read, &local, &remote_list, &remote, &options)?;
    request.post_and_wait(Duration::from_secs(30))?;

    let mut received = vec![0u8; LEN];
    dst.read(0, 0, &mut received)?;
    if let Some(at) = received.iter().zip(&sent).position(|(got, want)| got != want) {
        return Err(format!("byte {at} differs after the transfer").into());
    }
    println!("moved {LEN} bytes from b to a, every byte checked");
    Ok(())
}

//! The POSIX backend: DRAM to a real temporary file and back, within one agent (the remote
//! agent is the agent itself), with the file's contents also checked through `std::fs`.

mod common;

use std::fs::OpenOptions;

use common::{
    assert_blocks_reversed, contents, file_contents, local_whole, pattern, unique_name, WAIT,
};
use nixl::{Agent, FileRegion, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};

const LEN: usize = 64 * 1024;

#[test]
fn dram_to_file_and_back() {
    let agent = Agent::new(&unique_name("posix")).unwrap();
    let posix = agent.create_backend("POSIX").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blocks.bin");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .unwrap();
    file.set_len(LEN as u64).unwrap();

    let data = pattern(LEN, 41);
    let src = agent.register_memory(data.clone(), &[&posix]).unwrap();
    let file_reg = agent
        .register_memory(FileRegion::new(file, 0, LEN).unwrap(), &[&posix])
        .unwrap();
    assert_eq!(file_reg.mem_type(), MemType::File);
    let fd = file_reg.regions()[0].dev_id;

    // Whole buffer to offset 0 of the file.
    let whole = RemoteDescList::from_descs(MemType::File, &[XferDesc::new(0, LEN, fd)]).unwrap();
    let mut write = agent
        .create_xfer_req(
            XferOp::Write,
            &local_whole(&src),
            &whole,
            agent.name(),
            &XferOptions::new(),
        )
        .unwrap();
    assert_eq!(write.backend().unwrap(), "POSIX");
    write.post_and_wait(WAIT).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), data, "file written by NIXL");

    // Back into a second, zeroed buffer.
    let back = agent.register_memory(vec![0u8; LEN], &[&posix]).unwrap();
    let mut read = agent
        .create_xfer_req(
            XferOp::Read,
            &local_whole(&back),
            &whole,
            agent.name(),
            &XferOptions::new(),
        )
        .unwrap();
    read.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&back), data, "read back from the file");

    // The file changed behind NIXL's back is read as it is now.
    std::fs::write(&path, pattern(LEN, 42)).unwrap();
    read.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&back), pattern(LEN, 42));
}

#[test]
fn scattered_blocks_at_file_offsets() {
    const BLOCK: usize = 4096;
    const BLOCKS: usize = 8;
    let agent = Agent::new(&unique_name("posix-blocks")).unwrap();
    let posix = agent.create_backend("POSIX").unwrap();
    let file = tempfile::tempfile().unwrap();
    let reader = file.try_clone().unwrap();
    file.set_len((BLOCK * BLOCKS) as u64).unwrap();
    let data = pattern(BLOCK * BLOCKS, 43);
    let src = agent.register_memory(data.clone(), &[&posix]).unwrap();
    let file_reg = agent
        .register_memory(FileRegion::new(file, 0, BLOCK * BLOCKS).unwrap(), &[&posix])
        .unwrap();
    let fd = file_reg.regions()[0].dev_id;

    // Memory block i goes to file block BLOCKS-1-i.
    let mut local = nixl::LocalDescList::new(MemType::Dram).unwrap();
    local.push_blocks(&src, 0, BLOCK, 0..BLOCKS).unwrap();
    let descs: Vec<_> = (0..BLOCKS)
        .map(|i| XferDesc::new((BLOCKS - 1 - i) * BLOCK, BLOCK, fd))
        .collect();
    let remote = RemoteDescList::from_descs(MemType::File, &descs).unwrap();
    let mut req = agent
        .create_xfer_req(
            XferOp::Write,
            &local,
            &remote,
            agent.name(),
            &XferOptions::new().backend(&posix),
        )
        .unwrap();
    req.post_and_wait(WAIT).unwrap();

    let on_disk = file_contents(&reader);
    assert_eq!(on_disk.len(), BLOCK * BLOCKS);
    assert_blocks_reversed(&on_disk, &data, BLOCK, BLOCKS);
}

//! The bulk rates: READs, then WRITEs, of the target's whole buffer.

use std::time::Instant;

use nixl::{
    Agent, LocalDescList, MemType, Registration, RemoteDescList, XferDesc, XferOp, XferOptions,
};

use super::{fill, Args, PASS_LIMIT};

/// Moves the target's buffer at `addr` of agent `name` to and from `local` whole
/// (`--in-flight` requests at once, descriptors of `--desc-bytes` that NIXL does not merge),
/// `--passes` times per operation, and prints each operation's GB/s:
///
/// ```text
/// tcp-probe read GB/s 0.912
/// tcp-probe write GB/s 1.801
/// ```
pub fn rates(args: &Args, agent: &Agent, local: &Registration, (name, addr): (&str, usize)) {
    assert!(
        args.desc_bytes > 0
            && args.in_flight > 0
            && args.bytes % (args.desc_bytes * args.in_flight) == 0,
        "--bytes must be a multiple of --desc-bytes x --in-flight"
    );
    for op in [XferOp::Read, XferOp::Write] {
        let share = args.bytes / args.in_flight;
        let mut requests: Vec<_> = (0..args.in_flight)
            .map(|r| {
                let mut mine = LocalDescList::new(MemType::Dram).expect("list");
                let mut theirs = RemoteDescList::new(MemType::Dram).expect("list");
                for offset in (r * share..(r + 1) * share).step_by(args.desc_bytes) {
                    mine.push(local, 0, offset, args.desc_bytes).expect("local");
                    theirs
                        .push(XferDesc::new(addr + offset, args.desc_bytes, 0))
                        .expect("remote");
                }
                let options = XferOptions::new().skip_desc_merge(true);
                agent
                    .create_xfer_req(op, &mine, &theirs, name, &options)
                    .expect("request")
            })
            .collect();
        let start = Instant::now();
        for _ in 0..args.passes {
            for request in &mut requests {
                request.post().expect("post");
            }
            for request in &mut requests {
                request.wait(PASS_LIMIT).expect("transfer");
            }
        }
        let gbps = (args.passes * args.bytes) as f64 / start.elapsed().as_secs_f64() / 1e9;
        let label = if op == XferOp::Read { "read" } else { "write" };
        println!("tcp-probe {label} GB/s {gbps:.3}");
        if op == XferOp::Read {
            let mut probe = [0u8; 1];
            local
                .read(0, args.bytes - 1, &mut probe)
                .expect("read back");
            assert_eq!(probe[0], fill(args.bytes - 1), "the target's last byte");
        }
    }
}

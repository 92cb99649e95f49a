//! Prepared descriptor lists: prepare both sides once, then make requests from index slices.

mod common;

use common::{assert_blocks_reversed, contents, pattern, Pair, WAIT};
use nixl::{LocalDescList, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};

const BLOCK: usize = 256;
const BLOCKS: usize = 16;

/// `count` blocks of `BLOCK` bytes of `reg`'s region 0 as a remote list.
fn remote_blocks(reg: &nixl::Registration, count: usize) -> RemoteDescList {
    let base = reg.regions()[0].addr;
    let descs: Vec<_> = (0..count)
        .map(|i| XferDesc::new(base + i * BLOCK, BLOCK, 0))
        .collect();
    RemoteDescList::from_descs(MemType::Dram, &descs).unwrap()
}

#[test]
fn write_and_read_index_slices() {
    let pair = Pair::new("prep");
    let data = pattern(BLOCK * BLOCKS, 21);
    let (a_reg, b_reg) = pair.source_and_destination(data.clone());
    pair.exchange();

    let mut local = LocalDescList::new(MemType::Dram).unwrap();
    local.push_blocks(&a_reg, 0, BLOCK, 0..BLOCKS).unwrap();
    let prepared_local = pair.a.prepare_local(&local, &[&pair.ucx_a]).unwrap();
    // The prepared list keeps the registration; the list it came from may go.
    drop(local);
    let prepared_remote = pair
        .a
        .prepare_remote(pair.b.name(), &remote_blocks(&b_reg, BLOCKS), &[])
        .unwrap();
    assert_eq!(prepared_local.len(), BLOCKS);
    assert_eq!(prepared_remote.len(), BLOCKS);
    assert_eq!(prepared_remote.remote_agent(), pair.b.name());

    // WRITE local blocks 0, 2, 4, 15 into remote blocks 7, 1, 3, 0.
    let (l, r) = ([0, 2, 4, 15], [7, 1, 3, 0]);
    let mut req = pair
        .a
        .make_xfer_req(
            XferOp::Write,
            &prepared_local,
            &l,
            &prepared_remote,
            &r,
            &XferOptions::new(),
        )
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    let mut expected = vec![0u8; BLOCK * BLOCKS];
    for (&li, &ri) in l.iter().zip(&r) {
        expected[ri * BLOCK..(ri + 1) * BLOCK].copy_from_slice(&data[li * BLOCK..(li + 1) * BLOCK]);
    }
    assert_eq!(contents(&b_reg), expected);

    // READ remote block 7 (holding local block 0's bytes) back into local block 9, and
    // remote block 3 into local block 10, in one request.
    let mut back = pair
        .a
        .make_xfer_req(
            XferOp::Read,
            &prepared_local,
            &[9, 10],
            &prepared_remote,
            &[7, 3],
            &XferOptions::new(),
        )
        .unwrap();
    back.post_and_wait(WAIT).unwrap();
    let mut expected_a = data.clone();
    expected_a[9 * BLOCK..10 * BLOCK].copy_from_slice(&data[0..BLOCK]);
    expected_a[10 * BLOCK..11 * BLOCK].copy_from_slice(&data[4 * BLOCK..5 * BLOCK]);
    assert_eq!(contents(&a_reg), expected_a);

    // Dropping the prepared lists first is fine: the requests hold them.
    drop(prepared_local);
    drop(prepared_remote);
    a_reg.write(0, 0, &[0xee; BLOCK]).unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(&contents(&b_reg)[7 * BLOCK..8 * BLOCK], &[0xee; BLOCK][..]);
    drop(back);
    drop(req);
    assert!(a_reg.deregister().is_ok(), "the last holder is gone");
}

#[test]
fn every_block_in_many_requests_from_one_preparation() {
    let pair = Pair::new("prepmany");
    let data = pattern(BLOCK * BLOCKS, 22);
    let (a_reg, b_reg) = pair.register(vec![0u8; BLOCK * BLOCKS], data.clone());
    pair.exchange();
    let mut local = LocalDescList::new(MemType::Dram).unwrap();
    local.push_blocks(&a_reg, 0, BLOCK, 0..BLOCKS).unwrap();
    let pl = pair.a.prepare_local(&local, &[]).unwrap();
    let pr = pair
        .a
        .prepare_remote(pair.b.name(), &remote_blocks(&b_reg, BLOCKS), &[])
        .unwrap();
    // One READ request per block, each block reversed: local i <- remote BLOCKS-1-i.
    for i in 0..BLOCKS {
        let mut req = pair
            .a
            .make_xfer_req(
                XferOp::Read,
                &pl,
                &[i],
                &pr,
                &[BLOCKS - 1 - i],
                &XferOptions::new(),
            )
            .unwrap();
        req.post_and_wait(WAIT).unwrap();
    }
    let got = contents(&a_reg);
    assert_blocks_reversed(&got, &data, BLOCK, BLOCKS);
}

#[test]
fn prepared_list_with_notification_and_repeated_indices() {
    let pair = Pair::new("prepnotif");
    let data = pattern(BLOCK * 4, 23);
    let (a_reg, b_reg) = pair.source_and_destination(data.clone());
    pair.exchange();
    let mut local = LocalDescList::new(MemType::Dram).unwrap();
    local.push_blocks(&a_reg, 0, BLOCK, 0..4).unwrap();
    let pl = pair.a.prepare_local(&local, &[&pair.ucx_a]).unwrap();
    let pr = pair
        .a
        .prepare_remote(pair.b.name(), &remote_blocks(&b_reg, 4), &[&pair.ucx_a])
        .unwrap();
    // The same local block sent to every remote block.
    let message = vec![0xff, 0x00, 0xc3, 0x28];
    let mut req = pair
        .a
        .make_xfer_req(
            XferOp::Write,
            &pl,
            &[2, 2, 2, 2],
            &pr,
            &[0, 1, 2, 3],
            &XferOptions::new().notification(message.clone()),
        )
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    let block2 = &data[2 * BLOCK..3 * BLOCK];
    assert_eq!(contents(&b_reg), block2.repeat(4));
    assert_eq!(
        common::wait_notifications(&pair.b, pair.a.name(), 1),
        vec![message]
    );
}

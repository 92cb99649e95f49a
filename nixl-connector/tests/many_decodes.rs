//! Eight decodes read from one prefill at once; every byte checked, every request freed on
//! its notification.

mod common;

use std::time::Duration;

use common::{block, fill, pattern, poll_until, remote, spec, worker};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_decodes_against_one_prefill() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("pf-eight", 0, 1, &spec);
    fill(&prefill, &spec);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let decodes: Vec<_> = (0..8)
        .map(|i| worker(&format!("dc-eight-{i}"), 0, 1, &spec))
        .collect();
    for (i, decode) in decodes.iter().enumerate() {
        let request = format!("req-{i}");
        prefill.hold_for_decode(&request, deadline, Some(&common::capability()));
        let blocks = vec![2 * i, 2 * i + 1];
        decode
            .start_load(
                &request,
                &[7, 3],
                &remote(&prefill, "pf-eight", &request, blocks, 1),
            )
            .unwrap();
    }
    for (i, decode) in decodes.iter().enumerate() {
        let done = poll_until(decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
        assert_eq!(done.recving, [format!("req-{i}")]);
        assert!(decode.load_errors().is_empty());
        for layer in 0..spec.num_regions() {
            for (local, far) in [(7, 2 * i), (3, 2 * i + 1)] {
                let want: Vec<u8> = (0..spec.block_len(0))
                    .map(|o| pattern(layer, far, o))
                    .collect();
                assert_eq!(
                    block(decode, &spec, layer, local),
                    want,
                    "decode {i} layer {layer}"
                );
            }
        }
    }
    let freed = poll_until(&prefill, Duration::from_secs(10), |f| f.sending.len() == 8).await;
    assert_eq!(freed.sending.len(), 8);
    assert_eq!(prefill.send_stats().freed_on_notification, 8);
}

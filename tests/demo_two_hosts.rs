//! The prefill/decode demo across two network namespaces joined by a veth pair, over UCX's
//! TCP transport (scripts/two_hosts.sh). Needs root and a working `ip netns` (CI has both);
//! elsewhere it is skipped and listed in scripts/test.sh's summary.

mod common;
mod demo_support;

use common::netns_unavailable;
use demo_support::run_script;

#[test]
fn prefill_and_decode_in_two_namespaces_over_tcp() {
    if let Some(reason) = netns_unavailable() {
        common::skip("prefill_and_decode_in_two_namespaces_over_tcp", &reason);
        return;
    }
    let (status, text) = run_script(
        "two_hosts.sh",
        &["--", "--requests", "12", "--blocks-per-request", "4"],
    );
    assert!(status.success(), "{text}");
    assert!(text.contains("listening on 10.77.0.1:7800"), "{text}");
    assert!(
        text.contains("(10.77.0.2:"),
        "decode connects from its namespace: {text}"
    );
    assert!(text.contains("requests:  12/12"), "{text}");
    assert!(text.contains("every byte verified"), "{text}");
    assert!(text.contains("demo: PASSED"), "{text}");
}

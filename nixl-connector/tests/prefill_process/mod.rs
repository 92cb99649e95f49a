//! A prefill worker in a child process of the test binary, for tests that kill it: the child
//! runs an ignored role test of the same binary, which fills its cache, prints its
//! side-channel port and waits to be killed.

use std::process::{Child, Stdio};
use std::time::Duration;

use crate::common::{fill, printed_port, role_process, spec, worker};

/// The role: a prefill `engine` with the [`spec`]`(2)` cache filled with the pattern; prints
/// `PORT <side channel port>`, then waits (60 s at most) to be killed.
pub async fn serve(engine: &str, role_env: &str) {
    assert!(
        std::env::var_os(role_env).is_some(),
        "run by the parent test"
    );
    let spec = spec(2);
    let prefill = worker(engine, 0, 1, &spec);
    fill(&prefill, &spec);
    println!("PORT {}", prefill.side_channel_addr().unwrap().port());
    tokio::time::sleep(Duration::from_secs(60)).await;
}

/// Starts the ignored test `role_test` (which calls [`serve`]) in a child process with
/// `role_env` set; the child and its side-channel port.
pub fn start(role_test: &str, role_env: &str) -> (Child, u16) {
    let mut child = role_process(role_test, &[(role_env, "1")], Stdio::null());
    let port = printed_port(&mut child);
    (child, port)
}

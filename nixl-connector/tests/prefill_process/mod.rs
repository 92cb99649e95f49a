//! A prefill worker in a child process of the test binary, for tests that kill it: the child
//! runs an ignored role test of the same binary, which fills its cache, prints its
//! side-channel port and waits to be killed.
// Each test binary that includes this module uses part of it.
#![allow(dead_code)]

use std::process::{Child, Stdio};
use std::time::Duration;

use crate::common::{fill, printed_port, role_process, spec, stalled_worker, worker};

/// The value of the role's variable that asks for a stalled prefill ([`start_stalled`]).
const STALLED: &str = "stalled";

/// The role: a prefill `engine` with the [`spec`]`(2)` cache filled with the pattern; prints
/// `PORT <side channel port>`, then waits (60 s at most) to be killed. Started by
/// [`start_stalled`], its agent runs no progress thread and is never polled, so a READ
/// from it stays in flight.
pub async fn serve(engine: &str, role_env: &str) {
    let role = std::env::var(role_env).expect("run by the parent test");
    let spec = spec(2);
    let prefill = if role == STALLED {
        stalled_worker(engine, 0, 1, &spec)
    } else {
        worker(engine, 0, 1, &spec)
    };
    fill(&prefill, &spec);
    println!("PORT {}", prefill.side_channel_addr().unwrap().port());
    tokio::time::sleep(Duration::from_secs(60)).await;
}

/// Starts the ignored test `role_test` (which calls [`serve`]) in a child process with
/// `role_env` set; the child and its side-channel port.
pub fn start(role_test: &str, role_env: &str) -> (Child, u16) {
    start_as(role_test, role_env, "1")
}

/// [`start`], with the prefill's agent stalled (see [`serve`]).
pub fn start_stalled(role_test: &str, role_env: &str) -> (Child, u16) {
    start_as(role_test, role_env, STALLED)
}

fn start_as(role_test: &str, role_env: &str, role: &str) -> (Child, u16) {
    let mut child = role_process(role_test, &[(role_env, role)], Stdio::null());
    let port = printed_port(&mut child);
    (child, port)
}

//! Network faults between a prefill and a decode on two "hosts" (network namespaces joined
//! by a veth pair, UCX over TCP), over real NIXL (#43). Each engine runs in a child process
//! in its own namespace; the decode keeps loads in flight and prints when each starts and
//! ends, on the monotonic clock both namespaces share.
//!
//! - Partitions (link down, blackhole routes, the data path dropped by port with the side
//!   channel up) longer and shorter than the bound: no engine dies, every load ends within
//!   [`BOUND`] of its start, and loads flow again after every heal with neither engine
//!   restarted.
//! - A decode killed behind a partition: the prefill lives (#43's abort), and serves a new
//!   decode.
//! - The side channel cut, the data path kept: loads from the known prefill go on, a new
//!   decode's handshake fails in bounded time naming the address.
//! - By hand, a measurement of the time from a fault to the end of the loads it caught.
//!
//! Needs root and `ip netns` (and `nft` for the port cuts); elsewhere each test is skipped
//! and listed by scripts/test.sh (under CI it fails instead).

#[path = "../common/mod.rs"]
mod common;
mod hosts;
mod roles;
mod timeline;

use std::process::Child;
use std::time::Duration;

use hosts::{Fault, Hosts, Side};
use timeline::Timeline;

/// The prefill, run in a child process in its namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill of the tests here, which start it"]
async fn prefill_role() {
    roles::prefill().await;
}

/// The decode, run in a child process in its namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the decode of the tests here, which start it"]
async fn decode_role() {
    roles::decode().await;
}

/// An engine's child process, killed and reaped when dropped.
struct Engine {
    child: Child,
    who: &'static str,
}

impl Engine {
    /// Starts the role test `role` in `side`'s namespace with `env`.
    fn start(hosts: &Hosts, side: Side, who: &'static str, env: &[(&str, &str)]) -> Self {
        let exe = std::env::current_exe().unwrap();
        let role = match side {
            Side::Prefill => "prefill_role",
            Side::Decode => "decode_role",
        };
        let child = hosts.spawn(
            side,
            exe.to_str().unwrap(),
            &[
                "--exact",
                role,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ],
            env,
        );
        Engine { child, who }
    }

    /// A prefill in its namespace; its engine and side-channel address (`ip:port`).
    fn prefill(hosts: &Hosts) -> (Self, String) {
        let mut prefill = Self::start(
            hosts,
            Side::Prefill,
            "prefill",
            &[(roles::BIND_ADDR, &hosts.addr(Side::Prefill))],
        );
        let port = common::printed_port(&mut prefill.child);
        (prefill, format!("{}:{port}", hosts.addr(Side::Prefill)))
    }

    /// A decode in its namespace loading from the prefill at `prefill`, and its report.
    fn decode(hosts: &Hosts, prefill: &str) -> (Self, Timeline) {
        let mut decode = Self::start(
            hosts,
            Side::Decode,
            "decode",
            &[(roles::PREFILL_ADDR, prefill)],
        );
        let timeline = Timeline::read(&mut decode.child);
        (decode, timeline)
    }

    /// Panics if the process has exited.
    fn assert_alive(&mut self, when: &str) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("the {} process died {when}: {status}", self.who);
        }
    }

    /// Tells a decode to start no more loads.
    fn stop(&mut self) {
        use std::io::Write;
        if let Some(stdin) = self.child.stdin.as_mut() {
            let _ = writeln!(stdin, "STOP");
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether the test can run; if not, it is skipped (a failure under CI) with the reason.
fn hosts_available(test: &str) -> bool {
    match common::netns_unavailable() {
        Some(reason) => {
            common::skip(test, &reason);
            false
        }
        None => true,
    }
}

/// The longest a load may take, from its start to its end, whatever the network does: the
/// connector's UCX defaults drop a connection whose data stays unacknowledged for 10 s,
/// and UCX's keepalive puts data on every connection each 5 s (see the connector README's
/// "Network failures"), plus 5 s of slack for a loaded machine.
const BOUND: Duration = Duration::from_secs(20);
/// How long loads flow between faults, once they flow.
const HEALTHY: Duration = Duration::from_millis(500);
/// How long loads may take to flow again after a heal: the engine's handshake backoff
/// after repeated failures is at most 60 s.
const HEAL_LIMIT: Duration = Duration::from_secs(90);

/// Partitions longer and shorter than the bound, by link and by route, and the data path
/// cut with the side channel up: no engine dies, every load ends within [`BOUND`] of its
/// start (loaded, or failed with the reason), and loads flow again after every heal with
/// neither engine restarted.
#[test]
fn partitions_end_every_load_in_bounded_time_and_kill_no_engine() {
    if !hosts_available("partitions_end_every_load_in_bounded_time_and_kill_no_engine") {
        return;
    }
    let hosts = Hosts::new();
    let (mut prefill, at) = Engine::prefill(&hosts);
    let port: u16 = at.rsplit_once(':').unwrap().1.parse().unwrap();
    let plan = [
        (Fault::LinkDown, Duration::from_secs(16)),
        (Fault::Blackhole, Duration::from_secs(16)),
        (Fault::DataPathCut(port), Duration::from_secs(16)),
        (Fault::LinkDown, Duration::from_secs(3)),
        (Fault::Blackhole, Duration::from_secs(3)),
    ];
    let (mut decode, timeline) = Engine::decode(&hosts, &at);
    let mut faults = Vec::new();
    let mut flowing = Ok(());
    for (i, (fault, hold)) in plan.iter().enumerate() {
        flowing = timeline.wait_loaded(3, HEAL_LIMIT, &format!("loads flowing before fault {i}"));
        if flowing.is_err() {
            break;
        }
        std::thread::sleep(HEALTHY);
        let start = roles::now_ms();
        hosts.fault(*fault);
        std::thread::sleep(*hold);
        hosts.heal(*fault);
        faults.push((*fault, start, roles::now_ms()));
        let when = format!("in fault {i} ({})", fault.name());
        prefill.assert_alive(&when);
        decode.assert_alive(&when);
    }
    if flowing.is_ok() {
        flowing = timeline.wait_loaded(3, HEAL_LIMIT, "loads flowing after the last fault");
    }
    decode.stop();
    let drained = timeline.wait_drained(roles::DRAIN + Duration::from_secs(30));
    prefill.assert_alive("after the faults");
    let report = timeline.report(&faults);
    eprintln!("{report}");
    flowing.unwrap_or_else(|err| panic!("{err}\n{report}"));
    assert_eq!(drained, Some(0), "every load ended\n{report}");
    let loads = timeline.loads();
    for (request, load) in &loads {
        let (end, how) = load.end.as_ref().unwrap();
        assert!(
            end - load.start <= BOUND.as_millis() as u64,
            "{request} took {} ms ({how})\n{report}",
            end - load.start
        );
        assert_ne!(how, "mismatch", "{request} was loaded with wrong bytes");
    }
    let status = decode.child.wait().unwrap();
    assert!(
        status.success(),
        "the decode exited with {status}\n{report}"
    );
}

/// The prefill abort of #43: a decode that dies while the link is down leaves its READs'
/// requests in its kernel, which delivers them when the link is back and then resets the
/// connection; UCX's software GET over TCP (`ucp_get_req_handler`) then fails to answer
/// them and aborts the process (`ucp_request.inl:356 Fatal: unexpected error: Endpoint
/// timeout`). With the connector's defaults the prefill drops the dead connection itself
/// once its data stays unacknowledged for TCP's user timeout, so a partition longer than
/// that no longer reaches it: the prefill lives, and serves a new decode.
#[test]
fn a_decode_dying_behind_a_partition_does_not_kill_the_prefill() {
    if !hosts_available("a_decode_dying_behind_a_partition_does_not_kill_the_prefill") {
        return;
    }
    let hosts = Hosts::new();
    let (mut prefill, at) = Engine::prefill(&hosts);
    let (decode, timeline) = Engine::decode(&hosts, &at);
    timeline
        .wait_loaded(3, HEAL_LIMIT, "loads flowing")
        .unwrap();
    hosts.fault(Fault::LinkDown);
    std::thread::sleep(Duration::from_secs(12));
    drop(decode);
    std::thread::sleep(Duration::from_secs(4));
    hosts.heal(Fault::LinkDown);
    // Both kernels retransmit on their own backoff: the reset can come many seconds late.
    std::thread::sleep(Duration::from_secs(20));
    prefill.assert_alive("after its decode died behind the partition");
    let (mut decode, timeline) = Engine::decode(&hosts, &at);
    timeline
        .wait_loaded(3, HEAL_LIMIT, "a new decode's loads")
        .unwrap();
    decode.stop();
    assert_eq!(
        timeline.wait_drained(roles::DRAIN),
        Some(0),
        "{}",
        timeline.report(&[])
    );
    prefill.assert_alive("after serving a new decode");
}

/// The side channel cut while NIXL's data path stays: the decode's loads from the prefill it
/// already knows go on, and a decode new to the prefill fails its loads at the handshake,
/// naming the prefill's address, within the handshake's deadline.
#[test]
fn a_cut_side_channel_stops_only_new_handshakes() {
    if !hosts_available("a_cut_side_channel_stops_only_new_handshakes") {
        return;
    }
    let hosts = Hosts::new();
    let (mut prefill, at) = Engine::prefill(&hosts);
    let (mut known, timeline) = Engine::decode(&hosts, &at);
    timeline
        .wait_loaded(3, HEAL_LIMIT, "loads flowing")
        .unwrap();
    let port: u16 = at.rsplit_once(':').unwrap().1.parse().unwrap();
    hosts.fault(Fault::SideChannelCut(port));
    let cut = roles::now_ms();
    timeline
        .wait_loaded(
            20,
            HEAL_LIMIT,
            "loads from the known prefill while the side channel is cut",
        )
        .unwrap();
    let (mut new, fresh) = Engine::decode(&hosts, &at);
    let failed = fresh.wait_ended(1, HEAL_LIMIT).unwrap();
    hosts.heal(Fault::SideChannelCut(port));
    let (start, end, how) = failed;
    assert!(
        how.starts_with("Handshake") && how.contains(&at),
        "the new decode's load fails at the handshake, naming {at}: {how}"
    );
    assert!(
        end - start <= BOUND.as_millis() as u64,
        "{} ms: {how}",
        end - start
    );
    let during: Vec<_> = timeline
        .loads()
        .into_values()
        .filter(|l| l.start >= cut && l.end.as_ref().is_some_and(|(_, how)| how != "loaded"))
        .collect();
    assert!(
        during.is_empty(),
        "known prefill's loads failed: {during:?}"
    );
    for decode in [&mut known, &mut new] {
        decode.stop();
    }
    prefill.assert_alive("after the side channel came back");
}

/// Measures, per fault, the time from its start to the end of the last load it caught in
/// flight and failed (each fault outlasting [`BOUND`]; loads whose last bytes had passed
/// still complete), `NF43_RUNS` times (default 10) for each of a
/// link down, a blackhole route and a cut data path, and prints a table. By hand:
/// `cargo test -p nixl-connector --test network_faults -- --ignored --exact measure_fault_to_load_end --nocapture`.
#[test]
#[ignore = "a measurement, by hand (about 30 minutes at 10 runs)"]
fn measure_fault_to_load_end() {
    if !hosts_available("measure_fault_to_load_end") {
        return;
    }
    let runs: usize = std::env::var("NF43_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(10);
    let hosts = Hosts::new();
    let (mut prefill, at) = Engine::prefill(&hosts);
    let (mut decode, timeline) = Engine::decode(&hosts, &at);
    let port: u16 = at.rsplit_once(':').unwrap().1.parse().unwrap();
    let scenarios = [Fault::LinkDown, Fault::Blackhole, Fault::DataPathCut(port)];
    let mut table = String::from(
        "| fault | runs | loads caught and failed | fault to the last one's end, min / median / max (ms) |\n| --- | --- | --- | --- |\n",
    );
    for fault in scenarios {
        let mut times = Vec::new();
        let mut caught = 0;
        for run in 0..runs {
            timeline
                .wait_loaded(3, HEAL_LIMIT, &format!("loads before run {run}"))
                .unwrap();
            std::thread::sleep(HEALTHY);
            let start = roles::now_ms();
            hosts.fault(fault);
            std::thread::sleep(BOUND + Duration::from_secs(2));
            hosts.heal(fault);
            prefill.assert_alive("in the measurement");
            let (count, last) = timeline.caught(start);
            caught += count;
            times.extend(last);
        }
        times.sort_unstable();
        let pick = |q: usize| {
            times
                .get(q * (times.len().max(1) - 1) / 2)
                .copied()
                .unwrap_or(0)
        };
        table.push_str(&format!(
            "| {} | {} | {caught} | {} / {} / {} |\n",
            fault.name(),
            times.len(),
            pick(0),
            pick(1),
            pick(2)
        ));
        eprintln!("{table}");
    }
    decode.stop();
    println!("{table}");
}

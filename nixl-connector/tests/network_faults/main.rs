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
//! - A prefill host gone for good (link down, engine killed behind it): every load ends
//!   within the bound, the decode lives.
//! - The partition soak again in vLLM's protocol, shorter.
//! - A READ UCX does not end (its timeouts raised past a partition) holds its blocks until
//!   it ends after the heal; no byte lands in a block after its load ended (every test:
//!   the decode poisons what it hands back and checks it when taken again).
//! - 100 cycles of the data path dropped past a 1 s user timeout and restored, pushing:
//!   nothing the engines hold grows but UCX's half-open sockets. By hand, the same
//!   pulling (UCX's TCP transport can crash a pulled-from prefill on a failed
//!   connection), and with resets, pulling and pushing (pushing, NIXL 1.5.1 keeps reset
//!   sockets open).
//! - A partition soak: random faults (flaps, black holes, port drops, loss, a slow
//!   link; no resets) for 90 s while a decode of TP 2 loads from a prefill of TP 1; every
//!   load ends in bounded time, loaded right or failed.
//! - Two prefill hosts, one partitioned: the other's loads go on at no less than 80 % of
//!   their rate, and a handshake with an engine new to the decode completes.
//! - By hand, a measurement of the time from a fault to the end of the loads it caught.
//!
//! Needs root and `ip netns` (and `nft` for the port cuts); elsewhere each test is skipped
//! and listed by scripts/test.sh (under CI it fails instead).

#[path = "../common/mod.rs"]
mod common;
mod hosts;
#[path = "../chaos_soak/rng.rs"]
mod rng;
mod roles;
mod timeline;

use std::collections::HashSet;
use std::process::Child;
use std::time::Duration;

use hosts::{tcp_table, Fault, Hosts, Side};
use timeline::Timeline;

/// The prefill, run in a child process in its namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill of the tests here, which start it"]
async fn prefill_role() {
    roles::log_to_stderr();
    roles::prefill().await;
}

/// The decode, run in a child process in its namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the decode of the tests here, which start it"]
async fn decode_role() {
    roles::log_to_stderr();
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
            Side::Prefill | Side::SecondPrefill => "prefill_role",
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
        Self::prefill_with(hosts, &[])
    }

    /// [`prefill`](Self::prefill), with the variables `more` too.
    fn prefill_with(hosts: &Hosts, more: &[(&str, &str)]) -> (Self, String) {
        let (prefill, source) = Self::prefill_on(hosts, Side::Prefill, roles::PREFILL, more);
        let at = source.split_once('@').unwrap().1.to_string();
        (prefill, at)
    }

    /// A prefill of engine `engine` on `side`'s host, with the variables `more`; its
    /// process and where a decode finds it (`ENGINE@ip:port`).
    fn prefill_on(
        hosts: &Hosts,
        side: Side,
        engine: &str,
        more: &[(&str, &str)],
    ) -> (Self, String) {
        let addr = hosts.addr(side);
        let mut env = vec![(roles::BIND_ADDR, addr.as_str()), (roles::ENGINE, engine)];
        env.extend_from_slice(more);
        let mut prefill = Self::start(hosts, side, "prefill", &env);
        let port = common::printed_port(&mut prefill.child);
        (prefill, format!("{engine}@{addr}:{port}"))
    }

    /// A decode in its namespace loading from the prefill at `prefill` (`ip:port`), and its
    /// report.
    fn decode(hosts: &Hosts, prefill: &str) -> (Self, Timeline) {
        let source = [format!("{}@{prefill}", roles::PREFILL)];
        Self::decode_from(hosts, &source, roles::IN_FLIGHT, &[])
    }

    /// A decode in its namespace keeping `per_prefill` loads in flight from each prefill of
    /// `sources` (`ENGINE@ip:port`; the `i`-th one's requests named `p<i>r...`), with the
    /// variables `more` too, and its report.
    fn decode_from(
        hosts: &Hosts,
        sources: &[String],
        per_prefill: usize,
        more: &[(&str, &str)],
    ) -> (Self, Timeline) {
        let (sources, per_prefill) = (sources.join(","), per_prefill.to_string());
        let bind = hosts.addr(Side::Decode);
        let mut env = vec![
            (roles::PREFILL_ADDR, sources.as_str()),
            (roles::SLOTS_PER_PREFILL, per_prefill.as_str()),
            (roles::BIND_ADDR, bind.as_str()),
        ];
        env.extend_from_slice(more);
        let mut decode = Self::start(hosts, Side::Decode, "decode", &env);
        let timeline = Timeline::read(&mut decode.child);
        (decode, timeline)
    }

    /// Asks a decode to print what it holds (a `STATS` line).
    fn ask_stats(&mut self) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().expect("a decode's stdin");
        writeln!(stdin, "STATS").unwrap();
    }

    /// The process's open file descriptors and threads, from `/proc` (`ip netns exec` runs
    /// the program in its own process).
    fn fds_and_threads(&self) -> (u64, u64) {
        let pid = self.child.id();
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let threads = status
            .lines()
            .find_map(|l| l.strip_prefix("Threads:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        (fds, threads)
    }

    /// The TCP connections this process holds open in the state ESTABLISHED, as (local,
    /// remote) addresses in `/proc/net/tcp`'s notation.
    fn established(&self) -> Vec<(String, String)> {
        let pid = self.child.id();
        let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .filter_map(|target| {
                let target = target.to_string_lossy().into_owned();
                let inode = target.strip_prefix("socket:[")?.strip_suffix(']')?;
                Some(inode.to_string())
            })
            .collect();
        tcp_table(pid)
            .into_iter()
            .filter(|row| row.state == "01" && inodes.contains(&row.inode))
            .map(|row| (row.local, row.remote))
            .collect()
    }

    /// How many of this process's established connections `peer`'s namespace no longer
    /// lists in any state: half open, their other end gone without a reset reaching this
    /// one.
    fn half_open_to(&self, peer: &Engine) -> usize {
        let peers: HashSet<(String, String)> = tcp_table(peer.child.id())
            .into_iter()
            .map(|row| (row.local, row.remote))
            .collect();
        self.established()
            .into_iter()
            .filter(|(local, remote)| !peers.contains(&(remote.clone(), local.clone())))
            .count()
    }

    /// Tells a decode to load from the prefill `source` (`ENGINE@ip:port`) too.
    fn add_prefill(&mut self, source: &str) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().expect("a decode's stdin");
        writeln!(stdin, "ADD {source}").unwrap();
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

/// Starts test `test`: `None` when it cannot run (see [`hosts_available`]), else a guard
/// that holds the other tests of this binary off until dropped (each measures times and
/// rates that other tests' engines on the same two cores would skew).
fn begin(test: &str) -> Option<std::sync::MutexGuard<'static, ()>> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    hosts_available(test).then(|| ONE.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
}

/// Asserts that every load `timeline` reported ended within [`BOUND`] of its start, none
/// loaded wrong bytes, and no byte landed in a block after its load ended; `report` goes
/// with any failure.
fn assert_every_load_bounded(timeline: &Timeline, report: &str) {
    assert_eq!(
        timeline.late_blocks(),
        0,
        "blocks written after their load ended\n{report}"
    );
    for (request, load) in timeline.loads() {
        let (end, how) = load.end.as_ref().expect("every load ended");
        assert!(
            end - load.start <= BOUND.as_millis() as u64,
            "{request} took {} ms ({how})\n{report}",
            end - load.start
        );
        assert_ne!(how, "mismatch", "{request} was loaded with wrong bytes");
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
    let Some(_alone) = begin("partitions_end_every_load_in_bounded_time_and_kill_no_engine") else {
        return;
    };
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
    assert_every_load_bounded(&timeline, &report);
    let status = decode.child.wait().unwrap();
    assert!(
        status.success(),
        "the decode exited with {status}\n{report}"
    );
}

/// A prefill host gone for good: its link goes down, its engine is killed behind it, and the
/// link never comes back. Every load from it ends within [`BOUND`] of its start (the ones
/// caught failed), new ones fail at the handshake, and the decode lives and drains.
#[test]
fn a_prefill_host_gone_for_good_ends_every_load_in_bounded_time() {
    let Some(_alone) = begin("a_prefill_host_gone_for_good_ends_every_load_in_bounded_time") else {
        return;
    };
    let hosts = Hosts::new();
    let (prefill, at) = Engine::prefill(&hosts);
    let (mut decode, timeline) = Engine::decode(&hosts, &at);
    timeline
        .wait_loaded(3, HEAL_LIMIT, "loads flowing")
        .unwrap();
    std::thread::sleep(HEALTHY);
    let start = roles::now_ms();
    hosts.fault(Fault::LinkDown);
    drop(prefill);
    std::thread::sleep(BOUND + Duration::from_secs(5));
    decode.assert_alive("with its prefill's host gone");
    decode.stop();
    let drained = timeline.wait_drained(roles::DRAIN);
    let report = timeline.report(&[(Fault::LinkDown, start, roles::now_ms())]);
    eprintln!("{report}");
    assert_eq!(drained, Some(0), "every load ended\n{report}");
    assert_every_load_bounded(&timeline, &report);
    // The loads that READ from it: each failed, within the bound; none started after the
    // prefill died (a second after the fault at most) was loaded.
    let read = timeline.failed_reads(start, roles::now_ms());
    let gone = start + 1_000;
    let loaded_after = timeline.loads().into_iter().filter(|(_, load)| {
        load.start > gone && load.end.as_ref().is_some_and(|(_, how)| how == "loaded")
    });
    assert_eq!(loaded_after.count(), 0, "loaded from a host gone\n{report}");
    eprintln!("host gone: {} loads READ from it failed, the longest {:?} ms after the fault or their start", read.len(), read.iter().max());
    assert!(!read.is_empty(), "loads were caught\n{report}");
    assert!(decode.child.wait().unwrap().success(), "{report}");
}

/// #43 item 2: a READ that UCX does not end by itself holds its blocks until it does. With
/// UCX's TCP user timeout and keepalive raised past the partition (as UCX's own settings
/// leave them: TCP then retransmits for many minutes), the loads caught in a 12 s blackhole
/// pass the transfer timeout (reported overdue) and none ends while the partition lasts;
/// each ends only after the heal, once NIXL ended its READ, with the timeout's failure, and
/// no byte lands in a block after its load handed it back (poisoned when the load ended,
/// checked when taken again and at the end). NIXL 1.5.1 has nothing that ends a posted READ
/// sooner (see the connector README's "Network failures").
#[test]
fn a_read_ucx_does_not_end_holds_its_blocks_until_it_does() {
    let Some(_alone) = begin("a_read_ucx_does_not_end_holds_its_blocks_until_it_does") else {
        return;
    };
    let hosts = Hosts::new();
    let lasting = [
        ("UCX_TCP_USER_TIMEOUT", "300s"),
        ("UCX_KEEPALIVE_INTERVAL", "300s"),
    ];
    let (mut prefill, at) = Engine::prefill_with(&hosts, &lasting);
    let source = [format!("{}@{at}", roles::PREFILL)];
    let (mut decode, timeline) = Engine::decode_from(&hosts, &source, roles::IN_FLIGHT, &lasting);
    timeline
        .wait_loaded(3, HEAL_LIMIT, "loads flowing")
        .unwrap();
    std::thread::sleep(HEALTHY);
    let start = roles::now_ms();
    hosts.fault(Fault::Blackhole);
    std::thread::sleep(Duration::from_secs(12));
    let healed = roles::now_ms();
    let during = timeline.loads();
    hosts.heal(Fault::Blackhole);
    let faults = [(Fault::Blackhole, start, healed)];
    let flowing = timeline.wait_loaded(3, HEAL_LIMIT, "loads flowing after the heal");
    decode.stop();
    let drained = timeline.wait_drained(roles::DRAIN + Duration::from_secs(30));
    prefill.assert_alive("after the partition");
    let report = timeline.report(&faults);
    eprintln!("{report}");
    flowing.unwrap_or_else(|err| panic!("{err}\n{report}"));
    assert_eq!(drained, Some(0), "every load ended\n{report}");
    // Held through the partition: the loads overdue in it had not ended at the heal.
    let held: Vec<&String> = during
        .iter()
        .filter(|(_, load)| load.overdue.is_some_and(|t| t > start))
        .map(|(request, load)| {
            assert!(
                load.end.is_none(),
                "{request} ended in the partition: {load:?}\n{report}"
            );
            request
        })
        .collect();
    assert!(
        !held.is_empty(),
        "loads were caught in the partition\n{report}"
    );
    let loads = timeline.loads();
    for request in &held {
        let (end, how) = loads[*request].end.clone().expect("ended after the heal");
        assert!(end >= healed, "{request}");
        assert!(
            how.starts_with("Timeout"),
            "{request} ended {how}\n{report}"
        );
    }
    for (request, load) in &loads {
        let how = load.end.as_ref().map_or("", |(_, how)| how.as_str());
        assert_ne!(how, "mismatch", "{request} was loaded with wrong bytes");
    }
    assert_eq!(
        timeline.late_blocks(),
        0,
        "blocks written after their load ended\n{report}"
    );
    decode.child.wait().unwrap();
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
    let Some(_alone) = begin("a_decode_dying_behind_a_partition_does_not_kill_the_prefill") else {
        return;
    };
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
    let Some(_alone) = begin("a_cut_side_channel_stops_only_new_handshakes") else {
        return;
    };
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

/// How long the healthy host's rate is measured, before the partition and during it.
const RATE_WINDOW: Duration = Duration::from_secs(12);

/// One bad host does not stall the others: a decode loads from two prefill hosts at once
/// and one of them is partitioned away (its link down) for longer than the bound. Over the
/// same length of time, the healthy host's loads go on at no less than 80 % of their rate
/// before the partition; a handshake with an engine new to the decode, on the healthy host,
/// completes during the partition; and every load ends within [`BOUND`] of its start.
#[test]
fn a_partitioned_prefill_host_does_not_stall_a_healthy_one() {
    let Some(_alone) = begin("a_partitioned_prefill_host_does_not_stall_a_healthy_one") else {
        return;
    };
    let hosts = Hosts::with_second_prefill();
    let (mut cut_off, cut_off_at) = Engine::prefill_on(&hosts, Side::Prefill, "nf43-cut", &[]);
    let (mut healthy, healthy_at) = Engine::prefill_on(&hosts, Side::SecondPrefill, "nf43-ok", &[]);
    let (mut decode, timeline) = Engine::decode_from(&hosts, &[cut_off_at, healthy_at], 2, &[]);
    for (prefix, what) in [("p0r", "the first host's loads"), ("p1r", "the second's")] {
        timeline
            .wait_loaded_from(prefix, 3, HEAL_LIMIT, what)
            .unwrap();
    }
    let before = roles::now_ms();
    std::thread::sleep(RATE_WINDOW);
    let cut = roles::now_ms();
    hosts.fault(Fault::LinkDown);
    std::thread::sleep(RATE_WINDOW / 3);
    let (mut new, new_at) = Engine::prefill_on(&hosts, Side::SecondPrefill, "nf43-new", &[]);
    decode.add_prefill(&new_at);
    let met = timeline.wait_loaded_from(
        "p2r",
        1,
        BOUND,
        "a load from an engine met in the partition",
    );
    let window = RATE_WINDOW.as_millis() as u64;
    std::thread::sleep(Duration::from_millis(
        (cut + window).saturating_sub(roles::now_ms()),
    ));
    let healed = roles::now_ms();
    hosts.heal(Fault::LinkDown);
    decode.stop();
    let drained = timeline.wait_drained(roles::DRAIN + Duration::from_secs(30));
    let report = timeline.report(&[(Fault::LinkDown, cut, healed)]);
    let (rate_before, rate_during) = (
        timeline.loaded_from("p1r", before, cut),
        timeline.loaded_from("p1r", cut, cut + window),
    );
    eprintln!(
        "healthy host: {rate_before} loads in the {window} ms before the partition, {rate_during} in the {window} ms of it; the engine met in it: {} loads\n{report}",
        timeline.loaded_from("p2r", cut, healed)
    );
    met.unwrap_or_else(|err| panic!("{err}\n{report}"));
    assert!(
        rate_during * 10 >= rate_before * 8,
        "the healthy host's loads slowed to {rate_during} from {rate_before}\n{report}"
    );
    assert_eq!(drained, Some(0), "every load ended\n{report}");
    let cut_off_failed = timeline
        .loads()
        .into_iter()
        .filter(|(request, load)| {
            request.starts_with("p0r") && load.end.as_ref().is_some_and(|(_, how)| how != "loaded")
        })
        .count();
    assert!(
        cut_off_failed > 0,
        "no load from the cut host failed\n{report}"
    );
    assert_every_load_bounded(&timeline, &report);
    for (engine, when) in [
        (&mut cut_off, "after its partition"),
        (&mut healthy, "after the other's partition"),
        (&mut new, "after serving"),
    ] {
        engine.assert_alive(when);
    }
}

/// How a cycle of [`partition_and_heal_cycles`] ends NIXL's connections.
#[derive(Clone, Copy)]
enum CycleFault {
    /// The data path reset for 0.3 s: the connections fail at once.
    Reset,
    /// The data path dropped for 2.5 s, with UCX's TCP user timeout and keepalive interval
    /// at 1 s: each connection with data in flight, or a keepalive, times out silently (no
    /// reset reaches the other end), as across a partition that outlasts the user timeout.
    TimedOut,
}

/// Partition and heal cycles (`NF43_CYCLES`, default 100): the data path reset (NIXL's
/// connections fail at once, handshakes pass), then restored and loads flowing again (the
/// decode backs off from the prefill for at most 0.5 s). From the 10th cycle to the last,
/// what each engine holds stays flat: the decode's file descriptors, threads, memory,
/// remote agents and engines, and the prefill's descriptors and threads; no byte lands in
/// a block after its load ended.
///
/// By hand (`cargo test -p nixl-connector --test network_faults -- --ignored --exact
/// nothing_grows_through_partition_and_heal_cycles --nocapture`): in 5 of 10 runs the
/// prefill died, of a segmentation fault inside UCX's TCP transport where its end was
/// recorded (see the connector README's "Network failures"), so it cannot gate CI. In push
/// mode (the variants below) the prefill answers no software GET.
#[test]
#[ignore = "by hand: UCX's TCP transport can crash the prefill on a reset connection"]
fn nothing_grows_through_partition_and_heal_cycles() {
    partition_and_heal_cycles(
        "nothing_grows_through_partition_and_heal_cycles",
        CycleFault::Reset,
        &[],
    );
}

/// [`nothing_grows_through_partition_and_heal_cycles`] with partitions that end the
/// connections by timeout ([`CycleFault::TimedOut`]). By hand: the prefill died in UCX's
/// TCP transport in 2 of 2 runs (cycles 9 and 22), with the same stack as on a reset: a
/// failed connection's queued software GET replies are what crashes, however it failed.
#[test]
#[ignore = "by hand: UCX's TCP transport can crash the prefill on a failed connection"]
fn nothing_grows_through_partitions_that_time_out() {
    partition_and_heal_cycles(
        "nothing_grows_through_partitions_that_time_out",
        CycleFault::TimedOut,
        &[],
    );
}

/// The cycles in push mode (native protocol), the connections ended by timeout
/// ([`CycleFault::TimedOut`]): the prefill WRITEs into the blocks the decode registers, and
/// a registration, cancel or end lost with a connection is sent again over a new one (the
/// decode sends its cancel again until each prefill rank answers; a rank whose send failed
/// is handshaken anew). About 6 minutes.
///
/// In each of 5 runs of 100 cycles the decode's file descriptors grew by about one a cycle,
/// from some cycle on (none in 3 runs of 20 to 50 cycles): sockets UCX accepted from the prefill and keeps though they are half open (the
/// prefill's end timed out, and no reset reached the decode's; see the connector README's
/// "Network failures"). The test counts them apart, by the prefill's namespace no longer
/// listing their connection.
#[test]
fn nothing_grows_through_partitions_that_time_out_in_push_mode() {
    partition_and_heal_cycles(
        "nothing_grows_through_partitions_that_time_out_in_push_mode",
        CycleFault::TimedOut,
        &[(roles::TRANSFER_MODE, roles::PUSH)],
    );
}

/// [`nothing_grows_through_partitions_that_time_out_in_push_mode`] with resets
/// ([`CycleFault::Reset`]).
///
/// By hand (`... -- --ignored --exact
/// nothing_grows_through_partition_and_heal_cycles_in_push_mode --nocapture`): no engine
/// died in 24 runs, but the decode's file descriptors grew by up to 28 in 100 cycles
/// (sockets a reset closed, kept open by the endpoints NIXL 1.5.1 closes gracefully), and in
/// one run of those the connection between them, made anew after a reset, kept failing
/// (`NIXL_ERR_REMOTE_DISCONNECT` on every notification, both ways) past the test's 90 s, so
/// that four loads stayed held; so it cannot gate CI.
#[test]
#[ignore = "by hand: resets keep sockets open in NIXL 1.5.1 (see above)"]
fn nothing_grows_through_partition_and_heal_cycles_in_push_mode() {
    partition_and_heal_cycles(
        "nothing_grows_through_partition_and_heal_cycles_in_push_mode",
        CycleFault::Reset,
        &[(roles::TRANSFER_MODE, roles::PUSH)],
    );
}

/// The partition and heal cycles of test `test`, each cycle's connections ended by `fault`,
/// both engines run with the variables `more` too.
fn partition_and_heal_cycles(test: &str, fault: CycleFault, more: &[(&str, &str)]) {
    let Some(_alone) = begin(test) else {
        return;
    };
    let cycles: usize = std::env::var("NF43_CYCLES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100)
        .max(11);
    let hosts = Hosts::new();
    // Backed off from the prefill (and, pushing, the prefill from the decode) for at most
    // half a second after a failure (a minute by default), so that each cycle's loads flow
    // again at once.
    let mut env = vec![(roles::BACKOFF_S, "0.5")];
    if let CycleFault::TimedOut = fault {
        env.extend([
            ("UCX_TCP_USER_TIMEOUT", "1s"),
            ("UCX_KEEPALIVE_INTERVAL", "1s"),
        ]);
    }
    env.extend_from_slice(more);
    let (mut prefill, at) = Engine::prefill_with(&hosts, &env);
    let port: u16 = at.rsplit_once(':').unwrap().1.parse().unwrap();
    let (fault, held_for) = match fault {
        CycleFault::Reset => (Fault::DataPathReset(port), Duration::from_millis(300)),
        CycleFault::TimedOut => (Fault::DataPathCut(port), Duration::from_millis(2500)),
    };
    let source = [format!("{}@{at}", roles::PREFILL)];
    let (mut decode, timeline) = Engine::decode_from(&hosts, &source, roles::IN_FLIGHT, &env);
    timeline
        .wait_loaded(3, HEAL_LIMIT, "loads flowing")
        .unwrap();
    let mut held = Vec::new();
    for cycle in 1..=cycles {
        hosts.fault(fault);
        std::thread::sleep(held_for);
        hosts.heal(fault);
        prefill.assert_alive(&format!("in cycle {cycle}"));
        let flowing =
            timeline.wait_loaded(3, HEAL_LIMIT, &format!("loads flowing after cycle {cycle}"));
        if let Err(err) = flowing {
            let prefill_exit = prefill.child.try_wait();
            panic!(
                "{err} (the prefill: {prefill_exit:?})\n{}",
                timeline.report(&[])
            );
        }
        if cycle % 10 == 0 || cycle == cycles {
            decode.ask_stats();
            let decode_holds = timeline
                .wait_stats(held.len() + 1, Duration::from_secs(10))
                .expect("the decode's stats");
            held.push((
                cycle,
                decode_holds,
                prefill.fds_and_threads(),
                decode.half_open_to(&prefill),
            ));
        }
    }
    decode.stop();
    let drained = timeline.wait_drained(roles::DRAIN);
    let report = timeline.report(&[]);
    let failed = timeline
        .loads()
        .values()
        .filter(|l| l.end.as_ref().is_some_and(|(_, how)| how != "loaded"))
        .count();
    let points: Vec<String> = held
        .iter()
        .map(|(cycle, decode, (fds, threads), half_open)| {
            format!(
                "after cycle {cycle}: the decode {decode:?}, {half_open} of its sockets half \
                 open; the prefill {fds} fds, {threads} threads"
            )
        })
        .collect();
    eprintln!(
        "{cycles} cycles, {failed} loads failed\n{}\n{report}",
        points.join("\n")
    );
    assert_eq!(drained, Some(0), "every load ended\n{report}");
    assert_eq!(timeline.late_blocks(), 0, "no late byte\n{report}");
    assert!(
        failed >= cycles / 2,
        "the faults failed {failed} loads in {cycles} cycles"
    );
    let (
        Some(&(_, first, (prefill_fds, prefill_threads), half_open)),
        Some(&(_, last, (prefill_fds_after, prefill_threads_after), half_open_after)),
    ) = (held.first(), held.last())
    else {
        panic!("{held:?}")
    };
    assert!(
        last.agents <= 1 && last.engines <= 1 && last.handshakes_pending <= 1,
        "{last:?}"
    );
    assert!(
        last.threads <= first.threads + 2,
        "decode threads: {first:?} -> {last:?}"
    );
    assert!(
        prefill_threads_after <= prefill_threads + 2,
        "prefill threads {prefill_threads} -> {prefill_threads_after}"
    );
    // UCX's half-open sockets (see the connector README's "Network failures") apart.
    assert!(
        last.fds - half_open_after as u64 <= first.fds - half_open as u64 + 24,
        "decode fds: {first:?} -> {last:?}, {half_open} -> {half_open_after} half open"
    );
    assert!(
        prefill_fds_after <= prefill_fds + 24,
        "prefill fds {prefill_fds} -> {prefill_fds_after}"
    );
    assert!(
        last.rss_kib <= first.rss_kib + 32 * 1024,
        "decode memory: {first:?} -> {last:?}"
    );
    prefill.assert_alive("after the cycles");
}

/// How long the partition soak runs unless `NF43_SOAK_S` says otherwise.
const SOAK: Duration = Duration::from_secs(90);

/// A partition soak: for `NF43_SOAK_S` seconds (default 90), random faults one after
/// another with healthy gaps of 0.5 to 2 s between them (seed `NF43_SEED`, printed): the
/// link down, blackhole routes, the data path or the side channel dropped, a random loss
/// of 1 to 20 %, a slow link. Each is held 0.3 to 6 s, and one
/// partition in five 12 to 16 s (past the TCP user timeout), while the decode keeps
/// loads in flight (backing off from the prefill for at most 2 s). Every load ends within
/// [`BOUND`] of its start, loaded with the right bytes or failed; loads flow after the
/// last heal; neither engine dies; nothing is left in flight.
#[test]
fn a_partition_soak_ends_every_load_in_bounded_time() {
    partition_soak(
        "a_partition_soak_ends_every_load_in_bounded_time",
        &[(roles::DECODE_TP, "2")],
        SOAK,
        43,
    );
}

/// The partition soak with both engines speaking vLLM's protocol (its side channel, its
/// handshake, its notifications), shorter.
#[test]
fn a_partition_soak_in_vllms_protocol_ends_every_load_in_bounded_time() {
    partition_soak(
        "a_partition_soak_in_vllms_protocol_ends_every_load_in_bounded_time",
        &[(roles::PROTOCOL, roles::VLLM), (roles::DECODE_TP, "2")],
        SOAK / 2,
        44,
    );
}

/// The partition soak named `test`, both engines run with the variables `more`: random
/// faults for `NF43_SOAK_S` seconds (else `length`), drawn from `NF43_SEED` (else `seed`).
fn partition_soak(test: &str, more: &[(&str, &str)], length: Duration, seed: u64) {
    let Some(_alone) = begin(test) else {
        return;
    };
    let soak = std::env::var("NF43_SOAK_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(length, Duration::from_secs);
    let seed: u64 = std::env::var("NF43_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(seed);
    eprintln!("partition soak of {soak:?}, NF43_SEED={seed}, {more:?}");
    let mut rng = rng::Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let hosts = Hosts::new();
    let (mut prefill, at) = Engine::prefill_with(&hosts, more);
    let port: u16 = at.rsplit_once(':').unwrap().1.parse().unwrap();
    let source = [format!("{}@{at}", roles::PREFILL)];
    let mut env = vec![(roles::BACKOFF_S, "2")];
    env.extend_from_slice(more);
    let (mut decode, timeline) = Engine::decode_from(&hosts, &source, roles::IN_FLIGHT, &env);
    timeline
        .wait_loaded(3, HEAL_LIMIT, "loads flowing")
        .unwrap();
    decode.ask_stats();
    let held_before = (
        timeline.wait_stats(1, HEAL_LIMIT),
        prefill.fds_and_threads(),
    );
    let started = std::time::Instant::now();
    let mut faults = Vec::new();
    while started.elapsed() < soak {
        // No reset of the data path: UCX's TCP transport can crash the prefill on one (see
        // nothing_grows_through_partition_and_heal_cycles).
        let fault = match rng.below(6) {
            0 => Fault::LinkDown,
            1 => Fault::Blackhole,
            2 => Fault::DataPathCut(port),
            3 => Fault::SideChannelCut(port),
            4 => Fault::Loss(1 + rng.below(20) as u8),
            _ => Fault::SlowLink,
        };
        let partition = matches!(
            fault,
            Fault::LinkDown | Fault::Blackhole | Fault::DataPathCut(_)
        );
        let hold = if partition && rng.chance(20) {
            12_000 + rng.below(4_000)
        } else {
            300 + rng.below(5_700)
        };
        let at = roles::now_ms();
        hosts.fault(fault);
        std::thread::sleep(Duration::from_millis(hold as u64));
        hosts.heal(fault);
        faults.push((fault, at, roles::now_ms()));
        let when = format!("in fault {} ({})", faults.len() - 1, fault.name());
        prefill.assert_alive(&when);
        decode.assert_alive(&when);
        std::thread::sleep(Duration::from_millis(500 + rng.below(1_500) as u64));
    }
    let flowing = timeline.wait_loaded(3, HEAL_LIMIT, "loads flowing after the soak");
    decode.ask_stats();
    let held_after = (
        timeline.wait_stats(2, HEAL_LIMIT),
        prefill.fds_and_threads(),
    );
    eprintln!("decode's STATS and prefill's (fds, threads) before: {held_before:?}, after: {held_after:?}");
    decode.stop();
    let drained = timeline.wait_drained(roles::DRAIN + Duration::from_secs(30));
    prefill.assert_alive("after the soak");
    let report = timeline.report(&faults);
    eprintln!("NF43_SEED={seed}: {} faults\n{report}", faults.len());
    flowing.unwrap_or_else(|err| panic!("{err}\n{report}"));
    assert_eq!(drained, Some(0), "every load ended\n{report}");
    assert_every_load_bounded(&timeline, &report);
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
    // `NF43_SCENARIOS`: the faults' names to measure, comma-separated (all without it).
    let only = std::env::var("NF43_SCENARIOS").ok();
    let scenarios = [Fault::LinkDown, Fault::Blackhole, Fault::DataPathCut(port)]
        .into_iter()
        .filter(|f| {
            only.as_ref()
                .map_or(true, |o| o.split(',').any(|n| n == f.name()))
        });
    let mut table = String::from(
        "| fault | runs with a failed READ | loads whose READ failed | fault (or the load's start) to the last one's end, min / median / max (ms) |\n| --- | --- | --- | --- |\n",
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
            let failed = timeline.failed_reads(start, roles::now_ms());
            hosts.heal(fault);
            prefill.assert_alive("in the measurement");
            caught += failed.len();
            times.extend(failed.iter().max());
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

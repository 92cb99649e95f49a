//! Two "hosts" for the tests: network namespaces joined by a veth pair, the prefill at
//! `10.43.<n>.1` and the decode at `10.43.<n>.2`, and the faults the kernel offers between
//! them; optionally a third, a second prefill host joined to the decode's by a veth pair of
//! its own (`10.44.<n>.1` and `.2`), which the faults leave alone. Every namespace, and with
//! it every device, route and rule, is removed when the [`Hosts`] is dropped, whatever
//! happened.

use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Hosts made by this process so far: each pair gets its own names and subnet.
static MADE: AtomicUsize = AtomicUsize::new(0);

/// Runs `args`; panics with its stderr if it fails.
fn run(args: &[&str]) -> Output {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|err| panic!("run {args:?}: {err}"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    out
}

/// One of the hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The prefill's host, the one the faults reach.
    Prefill,
    /// The decode's host.
    Decode,
    /// The second prefill host, where there is one: the faults never reach it.
    SecondPrefill,
}

/// A fault between the two hosts, made by [`Hosts::fault`] and undone by [`Hosts::heal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The prefill's end of the veth pair is down: nothing passes, both ways.
    LinkDown,
    /// Each host routes the other's address into a blackhole: packets vanish silently.
    Blackhole,
    /// The prefill's host drops every TCP packet from the decode's host but those to its
    /// side channel's port (the field): handshakes pass, NIXL's data path does not.
    DataPathCut(u16),
    /// The prefill's host drops the TCP packets from the decode's host to its side channel's
    /// port (the field): NIXL's data path passes, handshakes do not.
    SideChannelCut(u16),
    /// The prefill's host answers every TCP packet from the decode's host but those to its
    /// side channel's port (the field) with a reset: NIXL's connections fail at once, and
    /// handshakes pass.
    DataPathReset(u16),
    /// The prefill's host drops the given percentage of the packets from the decode's host,
    /// at random.
    Loss(u8),
    /// The prefill's host sends to the decode's through a token bucket of 20 Mbit/s.
    SlowLink,
}

impl Fault {
    /// The fault's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Fault::LinkDown => "link down",
            Fault::Blackhole => "blackhole route",
            Fault::DataPathCut(_) => "nft drop of the data path",
            Fault::SideChannelCut(_) => "nft drop of the side channel",
            Fault::DataPathReset(_) => "nft reset of the data path",
            Fault::Loss(_) => "nft random loss",
            Fault::SlowLink => "tc tbf at 20 Mbit/s",
        }
    }
}

/// Two namespaces joined by a veth pair (and a third with a pair of its own to the decode's),
/// removed on drop.
pub struct Hosts {
    prefill_ns: String,
    decode_ns: String,
    prefill_dev: String,
    decode_dev: String,
    subnet: usize,
    second: Option<SecondHost>,
}

/// The second prefill host: its namespace, its end of its veth pair, and the decode's end.
struct SecondHost {
    ns: String,
    dev: String,
    decode_dev: String,
}

impl Hosts {
    /// Makes the namespaces `nf43p<pid>x<n>` and `nf43d<pid>x<n>` and the veth pair between
    /// them, both ends up.
    pub fn new() -> Self {
        let n = MADE.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let hosts = Hosts {
            prefill_ns: format!("nf43p{pid}x{n}"),
            decode_ns: format!("nf43d{pid}x{n}"),
            // At most 15 bytes: "nf43p" and a pid of at most 7 digits, then the counter.
            prefill_dev: format!("nf43p{pid}{n}"),
            decode_dev: format!("nf43d{pid}{n}"),
            subnet: n % 250,
            second: None,
        };
        run(&["ip", "netns", "add", &hosts.prefill_ns]);
        run(&["ip", "netns", "add", &hosts.decode_ns]);
        hosts.join(
            (
                &hosts.prefill_ns,
                &hosts.prefill_dev,
                &hosts.cidr(Side::Prefill),
            ),
            (
                &hosts.decode_ns,
                &hosts.decode_dev,
                &hosts.cidr(Side::Decode),
            ),
        );
        hosts
    }

    /// [`Hosts::new`] and a second prefill host `nf43s<pid>x<n>`, joined to the decode's by a
    /// veth pair of its own.
    pub fn with_second_prefill() -> Self {
        let mut hosts = Hosts::new();
        let n = MADE.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let second = SecondHost {
            ns: format!("nf43s{pid}x{n}"),
            dev: format!("nf43s{pid}{n}"),
            decode_dev: format!("nf43e{pid}{n}"),
        };
        run(&["ip", "netns", "add", &second.ns]);
        let decode_cidr = format!("10.44.{}.2/24", hosts.subnet);
        hosts.join(
            (
                &second.ns,
                &second.dev,
                &format!("10.44.{}.1/24", hosts.subnet),
            ),
            (&hosts.decode_ns, &second.decode_dev, &decode_cidr),
        );
        hosts.second = Some(second);
        hosts
    }

    /// A veth pair between two namespaces, each end (namespace, device, address) up.
    fn join(&self, one: (&str, &str, &str), other: (&str, &str, &str)) {
        run(&[
            "ip", "link", "add", one.1, "type", "veth", "peer", "name", other.1,
        ]);
        for (ns, dev, cidr) in [one, other] {
            run(&["ip", "link", "set", dev, "netns", ns]);
            run(&["ip", "-n", ns, "addr", "add", cidr, "dev", dev]);
            run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
            run(&["ip", "-n", ns, "link", "set", dev, "up"]);
        }
    }

    fn second(&self) -> &SecondHost {
        self.second
            .as_ref()
            .expect("made by Hosts::with_second_prefill")
    }

    fn ns(&self, side: Side) -> &str {
        match side {
            Side::Prefill => &self.prefill_ns,
            Side::Decode => &self.decode_ns,
            Side::SecondPrefill => &self.second().ns,
        }
    }

    /// The veth devices of `side`, comma-separated (the decode's host has two where there
    /// is a second prefill host).
    pub fn devs(&self, side: Side) -> String {
        match (side, &self.second) {
            (Side::Prefill, _) => self.prefill_dev.clone(),
            (Side::Decode, None) => self.decode_dev.clone(),
            (Side::Decode, Some(second)) => format!("{},{}", self.decode_dev, second.decode_dev),
            (Side::SecondPrefill, _) => self.second().dev.clone(),
        }
    }

    /// The address of `side` (the decode's on the first pair).
    pub fn addr(&self, side: Side) -> String {
        match side {
            Side::Prefill => format!("10.43.{}.1", self.subnet),
            Side::Decode => format!("10.43.{}.2", self.subnet),
            Side::SecondPrefill => format!("10.44.{}.1", self.subnet),
        }
    }

    fn cidr(&self, side: Side) -> String {
        format!("{}/24", self.addr(side))
    }

    /// Starts `program` with `args` and `env` in `side`'s namespace, UCX restricted to TCP
    /// on that side's veth device; stdin and stdout piped, stderr inherited.
    pub fn spawn(&self, side: Side, program: &str, args: &[&str], env: &[(&str, &str)]) -> Child {
        Command::new("ip")
            .args(["netns", "exec", self.ns(side), program])
            .args(args)
            .envs(env.iter().copied())
            .env("UCX_TLS", "tcp,self")
            .env("UCX_NET_DEVICES", self.devs(side))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|err| panic!("start {program} in {}: {err}", self.ns(side)))
    }

    /// Starts `fault` between the hosts.
    pub fn fault(&self, fault: Fault) {
        self.apply(fault, true);
    }

    /// Ends `fault`.
    pub fn heal(&self, fault: Fault) {
        self.apply(fault, false);
    }

    fn apply(&self, fault: Fault, on: bool) {
        match fault {
            Fault::LinkDown => {
                let state = if on { "down" } else { "up" };
                let ns = self.ns(Side::Prefill);
                run(&["ip", "-n", ns, "link", "set", &self.prefill_dev, state]);
            }
            Fault::Blackhole => {
                let verb = if on { "add" } else { "del" };
                for (side, other) in [(Side::Prefill, Side::Decode), (Side::Decode, Side::Prefill)]
                {
                    let to = format!("{}/32", self.addr(other));
                    run(&["ip", "-n", self.ns(side), "route", verb, "blackhole", &to]);
                }
            }
            Fault::DataPathCut(port) => self.nft_drop(on, &format!("tcp dport != {port} drop")),
            Fault::SideChannelCut(port) => self.nft_drop(on, &format!("tcp dport {port} drop")),
            Fault::DataPathReset(port) => {
                self.nft_drop(on, &format!("tcp dport != {port} reject with tcp reset"))
            }
            Fault::Loss(percent) => {
                self.nft_drop(on, &format!("numgen random mod 100 < {percent} drop"))
            }
            Fault::SlowLink => {
                let (ns, dev) = (self.ns(Side::Prefill), self.prefill_dev.as_str());
                let mut tc = vec!["ip", "netns", "exec", ns, "tc", "qdisc"];
                if on {
                    tc.extend(["add", "dev", dev, "root", "tbf"]);
                    tc.extend(["rate", "20mbit", "burst", "32kbit", "latency", "400ms"]);
                } else {
                    tc.extend(["del", "dev", dev, "root"]);
                }
                run(&tc);
            }
        }
    }

    /// Adds (or removes) the rule `verdict` (a match and what to do, e.g. `tcp dport 9 drop`)
    /// for packets coming into the prefill's host from its veth device, in a table of
    /// nftables of its own.
    fn nft_drop(&self, on: bool, verdict: &str) {
        let ns = self.ns(Side::Prefill);
        let nft = |rule: &str| {
            let mut args = vec!["ip", "netns", "exec", ns, "nft"];
            args.extend(rule.split(' '));
            run(&args)
        };
        if !on {
            nft("delete table inet nf43");
            return;
        }
        nft("add table inet nf43");
        nft("add chain inet nf43 input { type filter hook input priority 0 ; policy accept ; }");
        let dev = &self.prefill_dev;
        nft(&format!("add rule inet nf43 input iifname {dev} {verdict}"));
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and so the pair.
        let second = self.second.as_ref().map(|s| &s.ns);
        for ns in [&self.prefill_ns, &self.decode_ns]
            .into_iter()
            .chain(second)
        {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A row of a namespace's TCP table (`/proc/PID/net/tcp` and `tcp6`).
pub struct TcpRow {
    /// The local address, `IP:PORT` in hex.
    pub local: String,
    /// The remote address, likewise.
    pub remote: String,
    /// The state as the kernel numbers it: `01` established, `08` close wait, `0A` listen.
    pub state: String,
    /// The socket's inode.
    pub inode: String,
}

/// The TCP table of process `pid`'s network namespace.
pub fn tcp_table(pid: u32) -> Vec<TcpRow> {
    let mut rows = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if let [_, local, remote, state, _, _, _, _, _, inode, ..] = fields[..] {
                rows.push(TcpRow {
                    local: local.to_string(),
                    remote: remote.to_string(),
                    state: state.to_string(),
                    inode: inode.to_string(),
                });
            }
        }
    }
    rows
}

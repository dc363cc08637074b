//! A real-Ray cluster's place on this host: each direct-ingress cluster's replica ports
//! (a block of its own; Ray's other listeners take [`crate::ports`]' ports) and the
//! addresses of its nodes (a /24 of 198.18.0.0/15, a network namespace per worker).
//!
//! Invariant: no two clusters of one test process get the same port or /24; a subnet's
//! namespace and veth go when it is dropped.

use super::*;
use crate::ports::take_ports;

/// How many ports each direct-ingress cluster's replicas may take, per protocol.
pub(super) const REPLICA_PORTS: u16 = 24;

/// A block of [`REPLICA_PORTS`] ports of a direct-ingress cluster's own, for its replicas
/// of one protocol, inside Ray's default range for it (`min..max`, as ray-xds's default
/// `proxies.replica_ports` expects): the first no other cluster has. Not checked free
/// now: the gRPC range (40000 up) is inside the kernel's ephemeral range, where outgoing
/// connections come and go, and Ray skips (and blocks) a port it cannot bind.
pub(super) fn replica_ports(min: u16, max: u16) -> u16 {
    (min..max - REPLICA_PORTS)
        .step_by(REPLICA_PORTS.into())
        .find_map(|first| take_ports(first, REPLICA_PORTS, false))
        .unwrap_or_else(|| panic!("no {REPLICA_PORTS} free replica ports left in {min}..{max}"))
}

pub(super) fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub(super) fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Network plumbing for one cluster: a veth pair, and a namespace for its worker.
pub(super) struct Subnet {
    pub(super) n: u16,
    pub(super) namespace: String,
    pub(super) host_link: String,
}

impl Subnet {
    pub(super) fn create() -> Subnet {
        // A /24 of 198.18.0.0/15 no other test (or leftover) uses.
        let taken = run(Command::new("ip").args(["-o", "-4", "addr", "show"]));
        let start = (std::process::id() as u16).wrapping_mul(7) % 500;
        for i in 0..500u16 {
            let n = (start + i) % 500 + 1;
            let (third, second) = (n % 256, 18 + n / 256);
            let prefix = format!("198.{second}.{third}.");
            if taken.contains(&prefix) {
                continue;
            }
            let namespace = format!("rxds-{n}");
            let host_link = format!("rx{n}h");
            let ns_link = format!("rx{n}n");
            if !ip(&["netns", "add", &namespace]) {
                continue; // another process took it first
            }
            let ok = ip(&[
                "link", "add", &host_link, "type", "veth", "peer", "name", &ns_link,
            ]) && ip(&["link", "set", &ns_link, "netns", &namespace])
                && ip(&["addr", "add", &format!("{prefix}1/24"), "dev", &host_link])
                && ip(&["link", "set", &host_link, "up"])
                && ip(&[
                    "netns",
                    "exec",
                    &namespace,
                    "ip",
                    "addr",
                    "add",
                    &format!("{prefix}2/24"),
                    "dev",
                    &ns_link,
                ])
                && ip(&[
                    "netns", "exec", &namespace, "ip", "link", "set", &ns_link, "up",
                ])
                && ip(&["netns", "exec", &namespace, "ip", "link", "set", "lo", "up"]);
            let subnet = Subnet {
                n,
                namespace,
                host_link,
            };
            assert!(
                ok,
                "creating network namespace {} failed (are we root?)",
                subnet.namespace
            );
            return subnet;
        }
        panic!("no free /24 in 198.18.0.0/15");
    }

    pub(super) fn addr(&self, host: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(
            198,
            18 + (self.n / 256) as u8,
            (self.n % 256) as u8,
            host,
        ))
    }
}

impl Drop for Subnet {
    fn drop(&mut self) {
        ip(&["link", "del", &self.host_link]);
        ip(&["netns", "del", &self.namespace]);
    }
}

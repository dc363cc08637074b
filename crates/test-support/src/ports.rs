//! Ports for servers a test starts, all below the kernel's ephemeral range
//! (`ip_local_port_range`), so that no outgoing connection or port-0 listener of any
//! process on the host can take one between the moment it was found free and the bind
//! (nor while a test stops a server and starts it again on the same port, as the
//! restart tests do).
//!
//! Invariant: one process never hands out a port twice. The bands are disjoint: free
//! ports for servers (10000 up), Ray's own listeners (20000 up), and the replica port
//! blocks Ray's direct ingress expects (30000–31000, 40000–41000).

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::sync::Mutex;

/// The first port the kernel hands out for outgoing connections and port-0 binds.
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// A random port of `low..high` (`high` capped below the ephemeral range) that is free
/// now and was never handed out by this process.
fn free_in(low: u16, high: u16) -> u16 {
    let high = high.min(ephemeral_low()).max(low + 1_000);
    loop {
        let port = low + fastrand::u16(..) % (high - low);
        if let Some(port) = take_ports(port, 1, true) {
            return port;
        }
    }
}

/// A port that was free a moment ago and cannot be taken by an outgoing connection (for
/// processes that cannot bind port 0 themselves, and for servers a test restarts on the
/// same port), never one this process handed out before.
pub fn free_port() -> u16 {
    free_in(10_000, 20_000)
}

/// A port for one of Ray's own listeners: as [`free_port`], in a band of its own.
pub(crate) fn ray_port() -> u16 {
    free_in(20_000, 30_000)
}

/// Ports `first..first + n` if none was handed out before (then none will be again in
/// this process) and, when `free_now`, each is free now (on every address).
pub(crate) fn take_ports(first: u16, n: u16, free_now: bool) -> Option<u16> {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let ports = first..first.checked_add(n)?;
    let free = ports.clone().all(|port| {
        !given.contains(&port) && (!free_now || TcpListener::bind(("0.0.0.0", port)).is_ok())
    });
    free.then(|| {
        given.extend(ports);
        first
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_below_the_ephemeral_range_and_never_handed_out_twice() {
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let unique: BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(unique.len(), ports.len());
        assert!(ports
            .iter()
            .all(|&p| (10_000..20_000).contains(&p) && p < ephemeral_low()));
        let ray = ray_port();
        assert!((20_000..30_000).contains(&ray), "{ray}");
    }
}

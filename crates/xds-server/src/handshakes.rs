//! TLS handshakes on the xDS port, kept away from the work that must not wait behind them
//! (probes, pushes): a [`HandshakeRate`] lets each address begin at most `per_second`
//! handshakes a second, after a burst of as many, and the [`listener`](super::listener)
//! closes the rest before any handshake work; the handshakes let through run on
//! [`HandshakeThreads`], a runtime of their own whose threads run at a lower CPU
//! priority, so a flood of them takes only what the kernel leaves over from the rest.
//!
//! Invariants: an address is metered whole, as the connection cap counts it (an
//! IPv4-mapped IPv6 address as its IPv4 address; not by IPv6 prefix: Kubernetes gives a
//! node's pods one /64, and its Envoys must not share one budget); at most
//! [`MAX_REMEMBERED`] addresses are remembered, and past that a newcomer is let through
//! unmetered (and counted) rather than refused for what others did; an address whose
//! bucket is full again is forgotten first. A rate of 0 meters nothing.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Addresses remembered at most (about 40 bytes each).
pub const MAX_REMEMBERED: usize = 65_536;

/// How often a full table is swept of addresses whose buckets are full again.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// What [`HandshakeRate::admit`] says of a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Within its address's rate.
    Admitted,
    /// Let through unmetered: the table of addresses is full.
    Unmetered,
    /// Over its address's rate: close it before any handshake work.
    Refused,
}

/// Handshakes begun per address: a token bucket each, `per_second` tokens a second up
/// to a burst of `per_second`.
pub struct HandshakeRate {
    per_second: u32,
    table: Mutex<Table>,
}

struct Table {
    buckets: HashMap<IpAddr, Bucket>,
    last_sweep: Option<Instant>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refilled(self, now: Instant, per_second: f64) -> f64 {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        (self.tokens + elapsed * per_second).min(per_second)
    }
}

impl HandshakeRate {
    /// `per_second` handshakes begun a second per address (0: no limit).
    pub fn new(per_second: u32) -> HandshakeRate {
        HandshakeRate {
            per_second,
            table: Mutex::new(Table {
                buckets: HashMap::new(),
                last_sweep: None,
            }),
        }
    }

    /// Whether a connection from `peer` may begin its handshake at `now`.
    pub fn admit(&self, peer: IpAddr, now: Instant) -> Admission {
        if self.per_second == 0 {
            return Admission::Admitted;
        }
        let rate = f64::from(self.per_second);
        let key = metered_address(peer);
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bucket) = table.buckets.get_mut(&key) {
            let tokens = bucket.refilled(now, rate);
            return if tokens >= 1.0 {
                *bucket = Bucket {
                    tokens: tokens - 1.0,
                    at: now,
                };
                Admission::Admitted
            } else {
                *bucket = Bucket { tokens, at: now };
                Admission::Refused
            };
        }
        if table.buckets.len() >= MAX_REMEMBERED {
            table.sweep(now, rate);
            if table.buckets.len() >= MAX_REMEMBERED {
                return Admission::Unmetered;
            }
        }
        table.buckets.insert(
            key,
            Bucket {
                tokens: rate - 1.0,
                at: now,
            },
        );
        Admission::Admitted
    }

    /// Addresses remembered now.
    pub fn remembered(&self) -> usize {
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .buckets
            .len()
    }
}

impl Table {
    /// Forgets every address whose bucket is full again (it would be admitted as a
    /// newcomer is), at most once per [`SWEEP_EVERY`].
    fn sweep(&mut self, now: Instant, rate: f64) {
        if self
            .last_sweep
            .is_some_and(|at| now.saturating_duration_since(at) < SWEEP_EVERY)
        {
            return;
        }
        self.last_sweep = Some(now);
        self.buckets
            .retain(|_, bucket| bucket.refilled(now, rate) < rate);
    }
}

/// The address a connection is metered by: its own (an IPv4-mapped IPv6 address as its
/// IPv4 address).
fn metered_address(peer: IpAddr) -> IpAddr {
    peer.to_canonical()
}

/// A runtime of its own for TLS handshakes, its threads (one per core, at most 4) nicer
/// than the process by [`HANDSHAKE_NICE`]: a reconnecting fleet's handshakes use the
/// cores, a flood cannot take them from the probes. The sockets stay registered with
/// the runtime that accepted them (their readiness is still read there); only the
/// handshakes' CPU work (signatures, certificate verification) runs here. Dropping it
/// stops its threads; handshakes still running are dropped with their connections.
pub struct HandshakeThreads {
    runtime: Option<tokio::runtime::Runtime>,
}

/// How much nicer than the process the handshake threads run (higher is lower priority).
pub const HANDSHAKE_NICE: libc::c_int = 10;

impl HandshakeThreads {
    pub fn start() -> std::io::Result<HandshakeThreads> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("xds-handshakes")
            .on_thread_start(|| {
                // On Linux a thread's nice value is its own: this lowers only this
                // thread, by HANDSHAKE_NICE from where the process runs. Failing to
                // lower it leaves it at the process's priority.
                // SAFETY: getpriority and setpriority read no memory of ours.
                unsafe {
                    let current = libc::getpriority(libc::PRIO_PROCESS, 0);
                    libc::setpriority(libc::PRIO_PROCESS, 0, (current + HANDSHAKE_NICE).min(19));
                }
            })
            .enable_all()
            .build()?;
        Ok(HandshakeThreads {
            runtime: Some(runtime),
        })
    }

    /// Runs `handshake` on the threads.
    pub fn spawn<F>(&self, handshake: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        if let Some(runtime) = &self.runtime {
            runtime.spawn(handshake);
        }
    }
}

impl Drop for HandshakeThreads {
    fn drop(&mut self) {
        // Without waiting: it may be dropped on an async thread.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_burst_of_the_rate_then_the_rate() {
        let rate = HandshakeRate::new(20);
        let t0 = Instant::now();
        let admitted = (0..100)
            .filter(|_| rate.admit(ip("198.18.0.1"), t0) == Admission::Admitted)
            .count();
        assert_eq!(admitted, 20);
        // Half a second later: ten more.
        let later = t0 + Duration::from_millis(500);
        let admitted = (0..100)
            .filter(|_| rate.admit(ip("198.18.0.1"), later) == Admission::Admitted)
            .count();
        assert_eq!(admitted, 10);
        // Another address is not held back by the first.
        assert_eq!(rate.admit(ip("198.18.0.2"), later), Admission::Admitted);
    }

    #[test]
    fn an_address_is_metered_whole_and_a_mapped_ipv4_as_ipv4() {
        let rate = HandshakeRate::new(1);
        let t0 = Instant::now();
        assert_eq!(rate.admit(ip("2001:db8:0:1::1"), t0), Admission::Admitted);
        assert_eq!(rate.admit(ip("2001:db8:0:1::1"), t0), Admission::Refused);
        // Another pod of the same node (its /64): a budget of its own.
        assert_eq!(
            rate.admit(ip("2001:db8:0:1::ffff"), t0),
            Admission::Admitted
        );
        assert_eq!(rate.admit(ip("198.18.0.9"), t0), Admission::Admitted);
        assert_eq!(rate.admit(ip("::ffff:198.18.0.9"), t0), Admission::Refused);
    }

    #[test]
    fn zero_meters_nothing() {
        let rate = HandshakeRate::new(0);
        let t0 = Instant::now();
        assert!((0..1000).all(|_| rate.admit(ip("198.18.0.1"), t0) == Admission::Admitted));
        assert_eq!(rate.remembered(), 0);
    }

    #[test]
    fn a_full_table_lets_newcomers_through_unmetered_and_forgets_the_quiet_first() {
        let rate = HandshakeRate::new(2);
        let t0 = Instant::now();
        for i in 0..MAX_REMEMBERED as u32 {
            let addr = IpAddr::V4((0xC612_0000u32.wrapping_add(i)).into());
            assert_eq!(rate.admit(addr, t0), Admission::Admitted);
        }
        assert_eq!(rate.remembered(), MAX_REMEMBERED);
        // Every bucket is still short of full: a newcomer goes unmetered.
        assert_eq!(rate.admit(ip("203.0.113.1"), t0), Admission::Unmetered);
        // A second on, they are full again and forgotten: the newcomer is metered.
        let later = t0 + Duration::from_secs(1);
        assert_eq!(rate.admit(ip("203.0.113.1"), later), Admission::Admitted);
        assert_eq!(rate.remembered(), 1);
    }

    proptest! {
        /// Over any schedule of arrivals from one address, the handshakes admitted by
        /// time t never exceed the burst plus the rate times t, and an arrival after a
        /// full second of quiet is always admitted.
        #[test]
        fn admitted_never_exceed_burst_plus_rate_times_time(
            per_second in 1u32..200,
            gaps_ms in proptest::collection::vec(0u64..1500, 1..400),
        ) {
            let rate = HandshakeRate::new(per_second);
            let t0 = Instant::now();
            let mut at = t0;
            let mut admitted = 0u64;
            for gap in gaps_ms {
                at += Duration::from_millis(gap);
                let quiet = gap >= 1000;
                let said = rate.admit(ip("198.18.1.1"), at);
                prop_assert_ne!(said, Admission::Unmetered);
                if quiet {
                    prop_assert_eq!(said, Admission::Admitted);
                }
                if said == Admission::Admitted {
                    admitted += 1;
                }
                let bound = f64::from(per_second)
                    * (1.0 + (at - t0).as_secs_f64());
                prop_assert!(admitted as f64 <= bound + 1e-9, "{} admitted by {:?}, bound {}", admitted, at - t0, bound);
            }
        }
    }

    #[tokio::test]
    async fn the_threads_run_what_they_are_given_at_their_own_priority() {
        let thread = HandshakeThreads::start().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        thread.spawn(async move {
            // SAFETY: getpriority reads no memory of ours.
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            let name = std::thread::current().name().map(str::to_owned);
            let _ = tx.send((nice, name));
        });
        let (nice, name) = rx.await.unwrap();
        assert_eq!(name.as_deref(), Some("xds-handshakes"));
        // SAFETY: as above.
        let ours = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        assert_eq!(nice, (ours + HANDSHAKE_NICE).min(19));
    }
}

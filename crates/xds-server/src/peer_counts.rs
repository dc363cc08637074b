//! Open connections per peer IP address, for the listeners that bound them (the xDS
//! port and the admin port): one client cannot take every connection slot.
//!
//! Invariant: a [`PeerSlot`] gives its place back when dropped, whatever ends its
//! connection; an address with no connection left is forgotten.

use std::sync::Arc;

/// Open connections per peer address.
#[derive(Debug, Default)]
pub struct PeerCounts(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One connection's place in its peer's count, given back on drop.
pub struct PeerSlot {
    counts: Arc<PeerCounts>,
    ip: std::net::IpAddr,
}

impl PeerCounts {
    /// A place for one more connection from `ip`, if it has fewer than `max`.
    pub fn try_take(self: &Arc<Self>, ip: std::net::IpAddr, max: usize) -> Option<PeerSlot> {
        let mut counts = self.0.lock().expect("never poisoned");
        let n = counts.entry(ip).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            counts: self.clone(),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.0.lock().expect("never poisoned");
        if let Some(n) = counts.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.ip);
            }
        }
    }
}

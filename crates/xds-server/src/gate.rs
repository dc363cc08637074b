//! The one connection cap of every listener (the xDS port and the admin port): at most
//! `max_connections` open at once and `max_connections_per_peer` from one IP address (so
//! one client cannot take every slot), a connection over either closed at once, before it
//! costs a task; and an accept loop step that pauses 100 ms on an accept error (out of
//! file descriptors) instead of spinning. What a connection may then do (handshake,
//! idle and lifetime timeouts) is each listener's own.
//!
//! Invariant: an [`Admitted`] connection gives both its places back when dropped,
//! whatever ends it; an address with no connection left is forgotten.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Open connections, in all and per peer address, within their caps.
#[derive(Debug)]
pub struct ConnectionGate {
    slots: Arc<Semaphore>,
    peers: Arc<PeerCounts>,
    max_connections: usize,
    max_connections_per_peer: usize,
}

/// Why a connection was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// `max_connections` were open.
    OverLimit,
    /// `max_connections_per_peer` were open from its address.
    OverPeerLimit,
}

impl Refused {
    /// The label of metrics and logs: `over_limit`, `over_peer_limit`.
    pub fn label(self) -> &'static str {
        match self {
            Refused::OverLimit => "over_limit",
            Refused::OverPeerLimit => "over_peer_limit",
        }
    }
}

/// One connection's places (in all and in its peer's count), given back on drop.
#[derive(Debug)]
pub struct Admitted {
    _slot: OwnedSemaphorePermit,
    _peer: PeerSlot,
}

impl ConnectionGate {
    pub fn new(max_connections: usize, max_connections_per_peer: usize) -> ConnectionGate {
        ConnectionGate {
            slots: Arc::new(Semaphore::new(max_connections)),
            peers: Arc::default(),
            max_connections,
            max_connections_per_peer,
        }
    }

    /// Places for one more connection from `peer`, if both caps allow it.
    pub fn admit(&self, peer: IpAddr) -> Result<Admitted, Refused> {
        let slot = self
            .slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refused::OverLimit)?;
        let peer = self
            .peers
            .try_take(peer, self.max_connections_per_peer)
            .ok_or(Refused::OverPeerLimit)?;
        Ok(Admitted {
            _slot: slot,
            _peer: peer,
        })
    }

    /// The cap `refused` hit.
    pub fn cap(&self, refused: Refused) -> usize {
        match refused {
            Refused::OverLimit => self.max_connections,
            Refused::OverPeerLimit => self.max_connections_per_peer,
        }
    }
}

/// The next accepted connection of `listener`; an accept error is given to `on_error`
/// and followed by a 100 ms pause.
pub async fn accept(
    listener: &TcpListener,
    mut on_error: impl FnMut(&std::io::Error),
) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(err) => {
                on_error(&err);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Open connections per peer address.
#[derive(Debug, Default)]
struct PeerCounts(Mutex<HashMap<IpAddr, usize>>);

/// One connection's place in its peer's count.
#[derive(Debug)]
struct PeerSlot {
    counts: Arc<PeerCounts>,
    ip: IpAddr,
}

impl PeerCounts {
    fn try_take(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<PeerSlot> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn caps_in_all_and_per_peer_and_every_place_comes_back_on_drop() {
        let gate = ConnectionGate::new(3, 2);
        let a1 = gate.admit(ip(1)).unwrap();
        let a2 = gate.admit(ip(1)).unwrap();
        assert_eq!(gate.admit(ip(1)).unwrap_err(), Refused::OverPeerLimit);
        let b1 = gate.admit(ip(2)).unwrap();
        assert_eq!(gate.admit(ip(3)).unwrap_err(), Refused::OverLimit);
        assert_eq!(gate.cap(Refused::OverLimit), 3);
        drop(a1);
        // A refused peer's attempt took no place of its own.
        let a3 = gate.admit(ip(1)).unwrap();
        drop((a2, a3, b1));
        assert!(gate.peers.0.lock().unwrap().is_empty(), "forgotten");
        assert_eq!(gate.slots.available_permits(), 3);
    }
}

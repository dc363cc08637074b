//! The bytes of ADS responses built and not yet written out, across every stream, and
//! their bound (`memory.xds_responses`).
//!
//! A stream reserves room ([`ResponseBytes::reserve`]) before it builds responses (the
//! most one poll can send, `Snapshot::response_room`), then keeps what its framed
//! responses take ([`Room::frame`]): each framed response owns its share, given back
//! when the transport drops its last byte (written to the socket, or the stream gone).
//! A response not written within `server::WRITE_DEADLINE` of reaching the head of its
//! stream's queue closes its connection, which drops it.
//! So when every Envoy reconnects at once, responses are built only as fast as they
//! leave, and memory follows the bound, not the number of streams.
//!
//! Admission ([`Ledger`], pure) is fair between peer addresses, as the other shared
//! bounds are: a reservation is admitted while the total stays within the bound; past
//! it, a peer holding nothing, or holding less than its fair share (the bound divided
//! by the peers holding anything), is still admitted up to twice the bound. Otherwise it
//! waits, in order behind its own peer's earlier reservations. Invariants:
//!
//! - admission never takes the total past twice the bound (a reservation larger than
//!   the whole bound counts as the bound); only a response larger than its reservation
//!   (a stand-in, or a long list of names told removed) adds to it unchecked, by its
//!   excess;
//! - a client that stops reading holds at most the responses already framed for it
//!   (one per type in flight), for about the write deadline; meanwhile other peers'
//!   streams go on within the second half of the bound;
//! - room is given back exactly once, however a stream ends (a dropped waiter that was
//!   admitted gives its room back).

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::oneshot;

/// What responses built and not yet written may hold in all by default: 64 MiB, about
/// 500 responses of the largest kind at once.
pub const RESPONSE_BYTES_BOUND: usize = 64 << 20;

/// The pure admission rule and its holdings (see the module doc).
#[derive(Debug)]
pub struct Ledger {
    bound: usize,
    total: usize,
    held: HashMap<IpAddr, usize>,
}

impl Ledger {
    pub fn new(bound: usize) -> Ledger {
        Ledger {
            bound: bound.max(1),
            total: 0,
            held: HashMap::new(),
        }
    }

    /// What a request for `bytes` counts as: never more than the whole bound.
    pub fn counted(&self, bytes: usize) -> usize {
        bytes.min(self.bound)
    }

    /// Whether `peer` may take `bytes` (already [`Ledger::counted`]) now.
    pub fn admits(&self, peer: IpAddr, bytes: usize) -> bool {
        let total = self.total.saturating_add(bytes);
        if self.total == 0 || total <= self.bound {
            return true;
        }
        if total > self.bound.saturating_mul(2) {
            return false;
        }
        let held = self.held.get(&peer).copied().unwrap_or(0);
        let holders = self.held.len() + usize::from(held == 0);
        held == 0 || held.saturating_add(bytes) <= self.bound / holders.max(1)
    }

    /// Adds `bytes` to what `peer` holds (admitted or not: a stream's framed responses
    /// may come out larger than it reserved).
    pub fn take(&mut self, peer: IpAddr, bytes: usize) {
        if bytes == 0 {
            return;
        }
        self.total += bytes;
        *self.held.entry(peer).or_insert(0) += bytes;
    }

    /// Gives back `bytes` that `peer` held.
    pub fn give_back(&mut self, peer: IpAddr, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let held = self.held.get_mut(&peer).expect("given back by a holder");
        debug_assert!(*held >= bytes, "gives back more than it held");
        *held -= bytes.min(*held);
        self.total -= bytes.min(self.total);
        if *held == 0 {
            self.held.remove(&peer);
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn bound(&self) -> usize {
        self.bound
    }
}

#[derive(Debug)]
struct Shared {
    ledger: Ledger,
    /// Reservations waiting, per peer in the order they came; peers in the order they
    /// first waited.
    waiting: HashMap<IpAddr, VecDeque<Waiter>>,
    order: VecDeque<IpAddr>,
}

#[derive(Debug)]
struct Waiter {
    bytes: usize,
    admitted: oneshot::Sender<Room>,
}

/// The bound on response bytes every stream of a server shares. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ResponseBytes {
    shared: Arc<Mutex<Shared>>,
}

impl Default for ResponseBytes {
    fn default() -> Self {
        ResponseBytes::new(RESPONSE_BYTES_BOUND)
    }
}

impl ResponseBytes {
    pub fn new(bound: usize) -> ResponseBytes {
        ResponseBytes {
            shared: Arc::new(Mutex::new(Shared {
                ledger: Ledger::new(bound),
                waiting: HashMap::new(),
                order: VecDeque::new(),
            })),
        }
    }

    /// Room for `bytes` for a stream of `peer`, once admitted (see the module doc).
    /// Cancel-safe: a reservation dropped while waiting takes nothing.
    pub async fn reserve(&self, peer: IpAddr, bytes: usize) -> Room {
        let waiting = {
            let mut shared = self.lock();
            let bytes = shared.ledger.counted(bytes);
            let queued = shared.waiting.contains_key(&peer);
            if !queued && shared.ledger.admits(peer, bytes) {
                shared.ledger.take(peer, bytes);
                return self.room(peer, bytes);
            }
            let (admitted, waiting) = oneshot::channel();
            if !queued {
                shared.order.push_back(peer);
            }
            let queue = shared.waiting.entry(peer).or_default();
            queue.push_back(Waiter { bytes, admitted });
            waiting
        };
        match waiting.await {
            Ok(room) => room,
            // Only when the server is dropped with waiters, which it never is while a
            // stream runs; nothing held.
            Err(_) => self.room(peer, 0),
        }
    }

    /// Bytes held now, in all.
    pub fn total(&self) -> usize {
        self.lock().ledger.total()
    }

    /// Reservations waiting now.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.values().map(VecDeque::len).sum()
    }

    fn room(&self, peer: IpAddr, bytes: usize) -> Room {
        Room {
            bound: self.clone(),
            peer,
            bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().expect("never poisoned")
    }

    fn give_back(&self, peer: IpAddr, bytes: usize) {
        if bytes == 0 {
            return;
        }
        // Rooms whose waiter went away are dropped after the lock is released: their
        // drop gives their bytes back, which locks again.
        let mut orphans = Vec::new();
        {
            let mut shared = self.lock();
            shared.ledger.give_back(peer, bytes);
            self.admit_waiting(&mut shared, &mut orphans);
        }
        drop(orphans);
    }

    /// Admits, peer by peer in the order they first waited, each queue's head while it
    /// fits; stops at once when nothing can be admitted (the total at twice the bound).
    fn admit_waiting(&self, shared: &mut Shared, orphans: &mut Vec<Room>) {
        let mut peers = shared.order.len();
        while peers > 0 && shared.ledger.total() < shared.ledger.bound().saturating_mul(2) {
            peers -= 1;
            let Some(peer) = shared.order.pop_front() else {
                break;
            };
            let queue = shared.waiting.get_mut(&peer).expect("ordered peers wait");
            while let Some(head) = queue.front() {
                if head.admitted.is_closed() {
                    queue.pop_front(); // its stream is gone
                    continue;
                }
                if !shared.ledger.admits(peer, head.bytes) {
                    break;
                }
                let head = queue.pop_front().expect("has a head");
                shared.ledger.take(peer, head.bytes);
                if let Err(room) = head.admitted.send(self.room(peer, head.bytes)) {
                    orphans.push(room);
                }
            }
            if queue.is_empty() {
                shared.waiting.remove(&peer);
            } else {
                shared.order.push_back(peer);
            }
        }
    }
}

/// Room a stream holds in [`ResponseBytes`]; what it does not hand to framed responses
/// is given back when it is dropped.
#[derive(Debug)]
pub struct Room {
    bound: ResponseBytes,
    peer: IpAddr,
    bytes: usize,
}

impl Room {
    /// `message` framed for gRPC (compression flag 0, big-endian length, the message),
    /// holding its size of this room for as long as the returned bytes live; a message
    /// larger than the room left takes more (it is already built). When the bytes are
    /// dropped (written out, or their stream gone), `written` counts one more.
    pub fn frame<M: prost::Message>(&mut self, message: &M, written: &Written) -> Bytes {
        let share = self.split(5 + message.encoded_len());
        Bytes::from_owner(Framed {
            buf: crate::codec::frame(message),
            _room: share,
            written: written.clone(),
        })
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// A room of `bytes` taken from this one, or more when this one has less.
    fn split(&mut self, bytes: usize) -> Room {
        if bytes > self.bytes {
            let more = bytes - self.bytes;
            self.bound.lock().ledger.take(self.peer, more);
            self.bytes += more;
        }
        self.bytes -= bytes;
        Room {
            bound: self.bound.clone(),
            peer: self.peer,
            bytes,
        }
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        self.bound
            .give_back(self.peer, std::mem::take(&mut self.bytes));
    }
}

/// How many of a stream's framed responses are written out: each counts when the
/// transport drops its last byte, in the order they were sent.
pub type Written = Arc<std::sync::atomic::AtomicU64>;

/// A framed response and the room it holds.
struct Framed {
    buf: Bytes,
    _room: Room,
    written: Written,
}

impl Drop for Framed {
    fn drop(&mut self) {
        self.written
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl AsRef<[u8]> for Framed {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::Ipv4Addr;
    use std::time::Duration;

    fn peer(n: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(198, 18, 0, n))
    }

    fn message(len: usize) -> envoy_types::pb::google::protobuf::BytesValue {
        envoy_types::pb::google::protobuf::BytesValue {
            value: vec![7; len],
        }
    }

    #[tokio::test]
    async fn a_framed_response_holds_its_room_until_its_last_byte_is_dropped() {
        let bound = ResponseBytes::new(1 << 20);
        let written = Written::default();
        let mut room = bound.reserve(peer(1), 4096).await;
        assert_eq!(bound.total(), 4096);
        let framed = room.frame(&message(1000), &written);
        assert_eq!(framed[0], 0);
        assert_eq!(
            u32::from_be_bytes(framed[1..5].try_into().unwrap()) as usize,
            framed.len() - 5
        );
        drop(room);
        assert_eq!(
            bound.total(),
            framed.len(),
            "the rest of the room is given back"
        );
        let (head, tail) = (framed.slice(..10), framed.slice(10..));
        drop(framed);
        drop(head);
        assert_eq!(bound.total(), tail.len() + 10);
        assert_eq!(written.load(std::sync::atomic::Ordering::Relaxed), 0);
        drop(tail);
        assert_eq!(bound.total(), 0);
        assert_eq!(
            written.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "written once its last byte is dropped"
        );
    }

    #[tokio::test]
    async fn a_message_larger_than_its_room_takes_more() {
        let bound = ResponseBytes::new(1 << 20);
        let written = Written::default();
        let mut room = bound.reserve(peer(1), 10).await;
        let framed = room.frame(&message(5000), &written);
        drop(room);
        assert_eq!(bound.total(), framed.len());
        drop(framed);
        assert_eq!(bound.total(), 0);
    }

    #[tokio::test]
    async fn past_the_bound_a_reservation_waits_for_room_to_come_back() {
        let bound = ResponseBytes::new(1000);
        let first = bound.reserve(peer(1), 800).await;
        let waiting = tokio::spawn({
            let bound = bound.clone();
            async move { bound.reserve(peer(1), 800).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "the same peer over the bound waits");
        assert_eq!(bound.waiting(), 1);
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("admitted once room came back")
            .unwrap();
        assert_eq!(second.bytes(), 800);
        assert_eq!(bound.total(), 800);
    }

    #[tokio::test]
    async fn a_peer_holding_nothing_is_not_stopped_by_one_that_holds_the_bound() {
        let bound = ResponseBytes::new(1000);
        // A client that stopped reading holds the whole bound.
        let _stuck = bound.reserve(peer(1), 1000).await;
        let other = tokio::time::timeout(Duration::from_secs(10), bound.reserve(peer(2), 600))
            .await
            .expect("another peer goes on");
        assert_eq!(bound.total(), 1600);
        // But not past twice the bound, and not past its fair share once it holds.
        let more = bound.reserve(peer(2), 300);
        tokio::pin!(more);
        assert!(tokio::time::timeout(Duration::from_millis(50), &mut more)
            .await
            .is_err());
        drop(other);
        tokio::time::timeout(Duration::from_secs(10), more)
            .await
            .expect("admitted");
    }

    #[tokio::test]
    async fn a_waiter_dropped_takes_nothing_and_one_admitted_then_dropped_gives_back() {
        let bound = ResponseBytes::new(1000);
        let first = bound.reserve(peer(1), 1000).await;
        {
            let gone = bound.reserve(peer(1), 500);
            tokio::pin!(gone);
            assert!(tokio::time::timeout(Duration::from_millis(20), &mut gone)
                .await
                .is_err());
        }
        // Dropped while queued: left out on the next give-back.
        drop(first);
        assert_eq!(bound.total(), 0);
        assert_eq!(bound.waiting(), 0);
    }

    #[tokio::test]
    async fn a_peer_s_reservations_are_admitted_in_the_order_they_came() {
        let bound = ResponseBytes::new(1000);
        let mut first = bound.reserve(peer(1), 1000).await;
        let framed = first.frame(&message(500), &Written::default());
        drop(first);
        let big = tokio::spawn({
            let bound = bound.clone();
            async move { bound.reserve(peer(1), 900).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // A small one behind it would fit now, but waits its turn.
        let small = tokio::spawn({
            let bound = bound.clone();
            async move { bound.reserve(peer(1), 10).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!small.is_finished());
        assert_eq!(bound.waiting(), 2);
        drop(framed);
        let big = tokio::time::timeout(Duration::from_secs(10), big)
            .await
            .unwrap()
            .unwrap();
        let small = tokio::time::timeout(Duration::from_secs(10), small)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(bound.total(), big.bytes() + small.bytes());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Reserve { peer: u8, bytes: usize },
        Frame { room: usize, bytes: usize },
        DropRoom(usize),
        DropFrame(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..4, 0usize..3000).prop_map(|(peer, bytes)| Op::Reserve { peer, bytes }),
            (0usize..8, 0usize..600).prop_map(|(room, bytes)| Op::Frame { room, bytes }),
            (0usize..8).prop_map(Op::DropRoom),
            (0usize..8).prop_map(Op::DropFrame),
        ]
    }

    proptest! {
        /// Whatever streams reserve, frame and drop, in any order: the total never passes
        /// twice the bound through admission, it is what the live rooms and frames hold,
        /// and once everything is dropped nothing is held and nobody waits.
        #[test]
        fn what_is_held_is_what_lives_and_admission_stays_within_twice_the_bound(
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                let bound = ResponseBytes::new(2000);
                let mut rooms: Vec<Room> = Vec::new();
                let mut frames: Vec<Bytes> = Vec::new();
                let mut waiters = Vec::new();
                let mut framed_past_reservation = 0usize;
                for op in ops {
                    match op {
                        Op::Reserve { peer: p, bytes } => {
                            let fut = Box::pin(bound.reserve(peer(p), bytes));
                            let mut fut = fut;
                            match futures::poll!(&mut fut) {
                                std::task::Poll::Ready(room) => rooms.push(room),
                                std::task::Poll::Pending => waiters.push(fut),
                            }
                        }
                        Op::Frame { room, bytes } => {
                            if let Some(r) = rooms.get_mut(room) {
                                let size = 5 + prost::Message::encoded_len(&message(bytes));
                                framed_past_reservation += size.saturating_sub(r.bytes());
                                frames.push(r.frame(&message(bytes), &Written::default()));
                            }
                        }
                        Op::DropRoom(i) => {
                            if i < rooms.len() {
                                rooms.swap_remove(i);
                            }
                        }
                        Op::DropFrame(i) => {
                            if i < frames.len() {
                                frames.swap_remove(i);
                            }
                        }
                    }
                    // Waiters admitted since: their rooms join the live ones.
                    let mut still = Vec::new();
                    for mut fut in waiters.drain(..) {
                        match futures::poll!(&mut fut) {
                            std::task::Poll::Ready(room) => rooms.push(room),
                            std::task::Poll::Pending => still.push(fut),
                        }
                    }
                    waiters = still;
                    let live: usize = rooms.iter().map(Room::bytes).sum::<usize>()
                        + frames.iter().map(Bytes::len).sum::<usize>();
                    prop_assert_eq!(bound.total(), live);
                    prop_assert!(bound.total() <= 2 * 2000 + framed_past_reservation);
                }
                drop(waiters);
                drop(rooms);
                drop(frames);
                prop_assert_eq!(bound.total(), 0);
                prop_assert_eq!(bound.waiting(), 0);
                Ok(())
            })?;
        }
    }
}

//! The xDS listener's connections, bounded: at most `max_connections` open at once and
//! `max_connections_per_peer` from one IP address (one more is closed at once), each given `handshake_timeout` to send its first byte (an
//! HTTP/2 client sends its preface at once; a socket that stays silent is closed), and
//! accept errors (out of file descriptors) back off instead of spinning.
//!
//! Invariants: a connection's slots (total and its peer's) are freed when the
//! connection is dropped, whatever ends it; nothing here reads or writes a byte of the
//! protocol.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// How many connections the listener holds, and how long one may stay silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    /// From one IP address (Envoys sharing a node's address, or behind one NAT, share it).
    pub max_connections_per_peer: usize,
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 4096,
            max_connections_per_peer: 256,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// Open connections per peer address.
#[derive(Debug, Default)]
struct PeerCounts(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One connection's place in its peer's count, given back on drop.
struct PeerSlot {
    counts: Arc<PeerCounts>,
    ip: std::net::IpAddr,
}

impl PeerCounts {
    fn try_take(self: &Arc<Self>, ip: std::net::IpAddr, max: usize) -> Option<PeerSlot> {
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

/// What the listener turned away, for metrics and tests.
#[derive(Debug, Default)]
pub struct Refusals {
    /// Connections closed at once: `max_connections` were open.
    pub over_limit: AtomicU64,
    /// Connections closed at once: `max_connections_per_peer` were open from its address.
    pub over_peer_limit: AtomicU64,
    /// Connections closed for sending nothing within `handshake_timeout`.
    pub silent: Arc<AtomicU64>,
    /// Accept errors (each followed by a pause).
    pub accept_errors: AtomicU64,
}

/// The accepted connections of `listener`, within `limits`.
/// Each refusal is also reported to `observer` as a stream error of protocol
/// `"connection"` (reasons `over_limit`, `over_peer_limit`, `silent`, `accept_error`).
pub fn incoming(
    listener: TcpListener,
    limits: Limits,
    refusals: Arc<Refusals>,
    observer: Arc<dyn super::Observer>,
) -> impl Stream<Item = io::Result<BoundedConnection>> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let peers = Arc::new(PeerCounts::default());
    futures::stream::unfold(
        (listener, slots, refusals, observer),
        move |(listener, slots, refusals, observer)| {
            let peers = peers.clone();
            async move {
                loop {
                    let (stream, peer) = match listener.accept().await {
                        Ok(accepted) => accepted,
                        Err(err) => {
                            refusals.accept_errors.fetch_add(1, Ordering::Relaxed);
                            observer.stream_error("connection", "accept_error");
                            tracing::warn!(error = %err, "xDS listener: accept failed; pausing 100 ms");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        refusals.over_limit.fetch_add(1, Ordering::Relaxed);
                        observer.stream_error("connection", "over_limit");
                        tracing::warn!(%peer, max = limits.max_connections, "xDS listener: connection limit reached; closing the new connection");
                        drop(stream);
                        continue;
                    };
                    let Some(peer_slot) =
                        peers.try_take(peer.ip(), limits.max_connections_per_peer)
                    else {
                        refusals.over_peer_limit.fetch_add(1, Ordering::Relaxed);
                        observer.stream_error("connection", "over_peer_limit");
                        tracing::warn!(%peer, max = limits.max_connections_per_peer, "xDS listener: connection limit of this peer reached; closing the new connection");
                        drop(stream);
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let connection = BoundedConnection {
                        inner: stream,
                        _slot: slot,
                        _peer_slot: peer_slot,
                        deadline: Some(Box::pin(tokio::time::sleep(limits.handshake_timeout))),
                        silent: refusals.silent.clone(),
                        observer: observer.clone(),
                    };
                    return Some((Ok(connection), (listener, slots, refusals, observer)));
                }
            }
        },
    )
}

/// A connection holding its slot, closed if it sends nothing in time.
pub struct BoundedConnection {
    inner: TcpStream,
    _slot: OwnedSemaphorePermit,
    _peer_slot: PeerSlot,
    /// Until the first byte arrives.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    silent: Arc<AtomicU64>,
    observer: Arc<dyn super::Observer>,
}

impl AsyncRead for BoundedConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.deadline = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let expired = this
                    .deadline
                    .as_mut()
                    .is_some_and(|d| d.as_mut().poll(cx).is_ready());
                if !expired {
                    return Poll::Pending;
                }
                this.deadline = None;
                this.silent.fetch_add(1, Ordering::Relaxed);
                this.observer.stream_error("connection", "silent");
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no HTTP/2 preface in time",
                )))
            }
        }
    }
}

impl AsyncWrite for BoundedConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl Connected for BoundedConnection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn listen(
        limits: Limits,
    ) -> (
        std::net::SocketAddr,
        Arc<Refusals>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let refusals = Arc::new(Refusals::default());
        let stream = incoming(listener, limits, refusals.clone(), Arc::new(()));
        // Echo whatever each connection sends; hold it until it ends.
        let task = tokio::spawn(async move {
            tokio::pin!(stream);
            while let Some(Ok(mut conn)) = stream.next().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, refusals, task)
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_and_a_talking_one_is_not() {
        let limits = Limits {
            max_connections: 8,
            handshake_timeout: Duration::from_millis(200),
            ..Default::default()
        };
        let (addr, refusals, _task) = listen(limits).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut talking = TcpStream::connect(addr).await.unwrap();
        talking.write_all(b"PRI").await.unwrap();
        let mut buf = [0u8; 3];
        talking.read_exact(&mut buf).await.unwrap();
        // The silent one is closed (read gives EOF or a reset) within a generous bound.
        let closed = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buf)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
        assert_eq!(refusals.silent.load(Ordering::Relaxed), 1);
        // Long after the deadline, the one that spoke still works.
        talking.write_all(b"abc").await.unwrap();
        talking.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"abc");
    }

    #[tokio::test]
    async fn connections_over_the_limit_are_closed_and_slots_come_back() {
        let limits = Limits {
            max_connections: 2,
            handshake_timeout: Duration::from_secs(60),
            ..Default::default()
        };
        let (addr, refusals, _task) = listen(limits).await;
        let mut a = TcpStream::connect(addr).await.unwrap();
        let mut b = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 1];
        for c in [&mut a, &mut b] {
            c.write_all(b"x").await.unwrap();
            c.read_exact(&mut buf).await.unwrap();
        }
        let mut third = TcpStream::connect(addr).await.unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(10), third.read(&mut buf)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
        assert_eq!(refusals.over_limit.load(Ordering::Relaxed), 1);
        // One leaves: a new one gets its slot.
        drop(a);
        let mut fourth = None;
        for _ in 0..100 {
            let mut c = TcpStream::connect(addr).await.unwrap();
            let _ = c.write_all(b"y").await;
            if let Ok(Ok(1)) = tokio::time::timeout(Duration::from_secs(1), c.read(&mut buf)).await
            {
                fourth = Some(c);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(fourth.is_some(), "the freed slot was never given again");
    }

    /// One address cannot take every slot: past `max_connections_per_peer` its new
    /// connections are closed, another address's are not, and a slot comes back when
    /// a connection ends.
    #[tokio::test]
    async fn one_peer_cannot_take_every_connection() {
        let limits = Limits {
            max_connections: 16,
            max_connections_per_peer: 2,
            handshake_timeout: Duration::from_secs(60),
        };
        // Listen on every loopback address, so that 127.0.0.2 is another peer.
        let listener = TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let refusals = Arc::new(Refusals::default());
        let stream = incoming(listener, limits, refusals.clone(), Arc::new(()));
        tokio::spawn(async move {
            tokio::pin!(stream);
            while let Some(Ok(mut conn)) = stream.next().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        async fn connect_from(ip: [u8; 4], port: u16) -> Option<TcpStream> {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(std::net::SocketAddr::from((ip, 0))).unwrap();
            let mut c = socket
                .connect(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
                .await
                .unwrap();
            let mut buf = [0u8; 1];
            c.write_all(b"x").await.ok()?;
            match tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await {
                Ok(Ok(1)) => Some(c),
                _ => None,
            }
        }
        let a1 = connect_from([127, 0, 0, 1], port).await;
        let a2 = connect_from([127, 0, 0, 1], port).await;
        assert!(a1.is_some() && a2.is_some());
        assert!(connect_from([127, 0, 0, 1], port).await.is_none());
        assert_eq!(refusals.over_peer_limit.load(Ordering::Relaxed), 1);
        let b = connect_from([127, 0, 0, 2], port).await;
        assert!(b.is_some(), "another peer is not held back");
        drop(a1);
        let mut again = None;
        for _ in 0..100 {
            if let Some(c) = connect_from([127, 0, 0, 1], port).await {
                again = Some(c);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            again.is_some(),
            "the peer's freed slot was never given again"
        );
    }
}

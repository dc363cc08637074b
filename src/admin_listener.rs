//! The admin port's connections, bounded, so that `/healthz` keeps answering whatever
//! a client of the admin port does: capped by the xDS port's [`crate::gate`] (at most
//! [`AdminLimits::max_connections`] open, and [`AdminLimits::max_connections_per_peer`]
//! from one IP address, so one client cannot take every slot from kubelet's probes),
//! each closed after
//! `idle_timeout` without a byte from the client (a connection waiting for its next
//! request, or trickling one) and after `max_lifetime` in all (a client sending a byte
//! now and then, or never reading its answer).
//!
//! Invariants: a connection's slot is given back when it is dropped, whatever ends it;
//! nothing here reads or writes a byte of HTTP.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};

use crate::gate::{Admitted, ConnectionGate, Refused};

/// How many admin connections are held, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AdminLimits {
    pub max_connections: usize,
    pub max_connections_per_peer: usize,
    pub idle_timeout: Duration,
    pub max_lifetime: Duration,
}

impl Default for AdminLimits {
    /// Kubelet's probes open a connection each; Prometheus keeps one and reconnects
    /// when it is closed.
    fn default() -> Self {
        AdminLimits {
            max_connections: 256,
            max_connections_per_peer: 32,
            idle_timeout: Duration::from_secs(30),
            max_lifetime: Duration::from_secs(300),
        }
    }
}

/// The admin listener, for `axum::serve`.
pub(crate) struct BoundedAdminListener {
    listener: TcpListener,
    limits: AdminLimits,
    gate: ConnectionGate,
}

impl BoundedAdminListener {
    pub fn new(listener: TcpListener, limits: AdminLimits) -> BoundedAdminListener {
        BoundedAdminListener {
            listener,
            limits,
            gate: ConnectionGate::new(limits.max_connections, limits.max_connections_per_peer),
        }
    }
}

impl axum::serve::Listener for BoundedAdminListener {
    type Io = AdminConnection;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (AdminConnection, std::net::SocketAddr) {
        loop {
            let (stream, peer) = crate::gate::accept(&self.listener, |err| {
                tracing::warn!(error = %err, "admin listener: accept failed; pausing 100 ms");
            })
            .await;
            let admitted = match self.gate.admit(peer.ip()) {
                Ok(admitted) => admitted,
                Err(refused) => {
                    let max = self.gate.cap(refused);
                    // One peer at its cap is its own business; the whole port at its cap
                    // is the operator's.
                    if refused == Refused::OverLimit {
                        tracing::warn!(%peer, max, "admin listener: connection limit reached; closing the new connection");
                    } else {
                        tracing::debug!(%peer, max, "admin listener: connection limit of this peer reached; closing the new connection");
                    }
                    drop(stream);
                    continue;
                }
            };
            let now = Instant::now();
            return (
                AdminConnection {
                    inner: stream,
                    _admitted: admitted,
                    idle_timeout: self.limits.idle_timeout,
                    idle: Box::pin(tokio::time::sleep_until(now + self.limits.idle_timeout)),
                    end_of_life: Box::pin(tokio::time::sleep_until(now + self.limits.max_lifetime)),
                },
                peer,
            );
        }
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }
}

/// One admin connection, holding its slot, closed when idle or old.
pub(crate) struct AdminConnection {
    inner: TcpStream,
    _admitted: Admitted,
    idle_timeout: Duration,
    /// Reset by every byte read.
    idle: Pin<Box<Sleep>>,
    end_of_life: Pin<Box<Sleep>>,
}

impl AdminConnection {
    /// An error once the connection has been idle or alive too long.
    fn expired(&mut self, cx: &mut Context<'_>, waiting_to_read: bool) -> Option<io::Error> {
        if self.end_of_life.as_mut().poll(cx).is_ready() {
            return Some(io::Error::new(
                io::ErrorKind::TimedOut,
                "admin connection open too long",
            ));
        }
        if waiting_to_read && self.idle.as_mut().poll(cx).is_ready() {
            return Some(io::Error::new(
                io::ErrorKind::TimedOut,
                "admin connection idle",
            ));
        }
        None
    }
}

impl AsyncRead for AdminConnection {
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
                    let next = Instant::now() + this.idle_timeout;
                    this.idle.as_mut().reset(next);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.expired(cx, true) {
                Some(err) => Poll::Ready(Err(err)),
                None => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for AdminConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            // A client that never reads its answer holds the connection until its end.
            Poll::Pending => match this.expired(cx, false) {
                Some(err) => Poll::Ready(Err(err)),
                None => Poll::Pending,
            },
            ready => ready,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn serve(limits: AdminLimits) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        tokio::spawn(async move {
            axum::serve(BoundedAdminListener::new(listener, limits), router)
                .await
                .unwrap()
        });
        addr
    }

    async fn healthz(addr: std::net::SocketAddr) -> Option<String> {
        tokio::time::timeout(Duration::from_secs(10), async {
            let mut c = TcpStream::connect(addr).await.ok()?;
            c.write_all(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
                .await
                .ok()?;
            let mut out = String::new();
            c.read_to_string(&mut out).await.ok()?;
            Some(out)
        })
        .await
        .ok()
        .flatten()
    }

    async fn closed(c: &mut TcpStream) -> bool {
        let mut buf = [0u8; 64];
        matches!(
            tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    /// Silent connections take every slot: one more is closed at once, and once the
    /// silent ones are closed as idle, `/healthz` answers again.
    #[tokio::test]
    async fn silent_connections_are_bounded_and_closed_when_idle() {
        let addr = serve(AdminLimits {
            max_connections: 3,
            max_connections_per_peer: 3,
            idle_timeout: Duration::from_millis(500),
            max_lifetime: Duration::from_secs(60),
        })
        .await;
        assert!(healthz(addr).await.unwrap().contains("ok"));
        let mut silent = Vec::new();
        for _ in 0..3 {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        let mut over = TcpStream::connect(addr).await.unwrap();
        assert!(
            closed(&mut over).await,
            "a connection over the limit is closed"
        );
        for c in &mut silent {
            assert!(closed(c).await, "an idle connection is closed");
        }
        let mut answered = None;
        for _ in 0..50 {
            answered = healthz(addr).await;
            if answered.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(answered.unwrap().contains("ok"));
    }

    /// One address cannot take every slot: another one still gets `/healthz` answered.
    #[tokio::test]
    async fn one_peer_cannot_take_every_admin_connection() {
        let listener = TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let router = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let limits = AdminLimits {
            max_connections: 8,
            max_connections_per_peer: 4,
            idle_timeout: Duration::from_secs(60),
            max_lifetime: Duration::from_secs(60),
        };
        tokio::spawn(async move {
            axum::serve(BoundedAdminListener::new(listener, limits), router)
                .await
                .unwrap()
        });
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(TcpStream::connect(addr).await.unwrap());
        }
        let mut over = TcpStream::connect(addr).await.unwrap();
        assert!(
            closed(&mut over).await,
            "a fifth from one address is closed"
        );
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket
            .bind(std::net::SocketAddr::from(([127, 0, 0, 2], 0)))
            .unwrap();
        let mut other = socket.connect(addr).await.unwrap();
        other
            .write_all(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(10), other.read_to_string(&mut out))
            .await
            .unwrap()
            .unwrap();
        assert!(out.contains("ok"), "{out}");
    }

    /// A byte now and then resets the idle timer, but not the connection's lifetime.
    #[tokio::test]
    async fn a_trickling_connection_is_closed_at_its_end_of_life() {
        let addr = serve(AdminLimits {
            max_connections: 4,
            max_connections_per_peer: 4,
            idle_timeout: Duration::from_millis(400),
            max_lifetime: Duration::from_millis(1500),
        })
        .await;
        let mut c = TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        let ended = loop {
            if c.write_all(b"G").await.is_err() {
                break true;
            }
            let mut buf = [0u8; 64];
            match tokio::time::timeout(Duration::from_millis(100), c.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break true,
                _ => {}
            }
            if started.elapsed() > Duration::from_secs(30) {
                break false;
            }
        };
        assert!(ended, "a trickling connection lives for ever");
    }
}

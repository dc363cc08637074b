//! The xDS listener's connections, bounded: capped by the [`crate::gate`] (at most
//! `max_connections` open at once and `max_connections_per_peer` from one IP address), each given
//! `handshake_timeout` to finish its TLS handshake when the listener has TLS
//! ([`super::tls`]) and send the 24 bytes of the HTTP/2 client preface (a client sends
//! it at once; a socket silent or trickling is closed), closed after `idle_timeout`
//! without an open stream (an Envoy keeps its ADS stream open for the connection's
//! life), and accept errors (out of file descriptors) back off instead of spinning.
//! With TLS, an address over its handshake rate ([`crate::handshakes`]) is closed before
//! the gate or any handshake work, and handshakes run on threads of their own.
//!
//! Invariants: a connection's slots (total and its peer's) are freed when the
//! connection is dropped, whatever ends it (a handshake in progress holds them too);
//! nothing here reads or writes a byte of the xDS protocol, and tonic gets a TLS
//! connection only once its handshake, client certificate included, has succeeded.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::tls::ServerTls;
use crate::gate::{Admitted, ConnectionGate, Refused};
use crate::handshakes::{Admission, HandshakeRate, HandshakeThreads};

/// How many connections the listener holds, and how long one may stay silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    /// From one IP address (Envoys sharing a node's address, or behind one NAT, share it).
    pub max_connections_per_peer: usize,
    pub handshake_timeout: Duration,
    /// How long a connection may stay without a stream once its preface arrived.
    pub idle_timeout: Duration,
    /// How long a response may wait at the head of its stream's queue unwritten before
    /// its connection is closed (`server::WRITE_DEADLINE`).
    pub write_deadline: Duration,
    /// TLS handshakes one address may begin a second, after a burst of as many; the
    /// rest are closed before any handshake work (0: no limit). Plain connections cost
    /// no handshake and are not metered.
    pub handshakes_per_peer_per_second: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 4096,
            max_connections_per_peer: 256,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            write_deadline: crate::server::WRITE_DEADLINE,
            handshakes_per_peer_per_second: 20,
        }
    }
}

/// The HTTP/2 client preface's length (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE_BYTES: usize = 24;

/// The streams open on one connection, counted by the ADS service through the
/// connection's [`XdsConnectInfo`]; and a way for a stream to close the connection.
#[derive(Debug, Default)]
pub struct ConnectionStreams(AtomicUsize, Closing);

/// A request to close a connection, and the waker of its reads.
#[derive(Debug, Default)]
struct Closing {
    requested: std::sync::atomic::AtomicBool,
    reader: futures::task::AtomicWaker,
}

impl ConnectionStreams {
    /// Counts one stream open until the returned guard is dropped.
    pub(crate) fn open(self: &Arc<Self>) -> OpenStream {
        self.0.fetch_add(1, Ordering::Relaxed);
        OpenStream(self.clone())
    }

    /// Closes the connection: its next read fails, so HTTP/2 ends every stream on it
    /// and drops what it had buffered for them.
    pub(crate) fn close(&self) {
        self.1.requested.store(true, Ordering::Relaxed);
        self.1.reader.wake();
    }

    fn closing(&self) -> bool {
        self.1.requested.load(Ordering::Relaxed)
    }

    fn any(&self) -> bool {
        self.0.load(Ordering::Relaxed) > 0
    }
}

/// One stream of a connection, counted while it lives.
#[derive(Debug)]
pub(crate) struct OpenStream(Arc<ConnectionStreams>);

impl OpenStream {
    /// What closes this stream's connection.
    pub(crate) fn connection(&self) -> Arc<ConnectionStreams> {
        self.0.clone()
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a request learns of its connection (in its extensions, from tonic).
#[derive(Debug, Clone)]
pub struct XdsConnectInfo {
    pub tcp: TcpConnectInfo,
    pub streams: Arc<ConnectionStreams>,
}

impl XdsConnectInfo {
    /// For a request on this listener: its stream counted on the connection while the
    /// returned slot lives (an idle connection, one without streams, is closed), and the
    /// peer's address; neither for a request from elsewhere (a test's in-process call).
    pub(crate) fn of<B>(
        request: &http::Request<B>,
    ) -> (Option<OpenStream>, Option<std::net::IpAddr>) {
        let info = request.extensions().get::<XdsConnectInfo>();
        let open = info.map(|info| info.streams.open());
        let peer = info.and_then(|info| info.tcp.remote_addr()).map(|a| a.ip());
        (open, peer)
    }
}

/// What the listener turned away, for metrics and tests.
#[derive(Debug, Default)]
pub struct Refusals {
    /// Connections closed at once: `max_connections` were open.
    pub over_limit: AtomicU64,
    /// Connections closed at once: `max_connections_per_peer` were open from its address.
    pub over_peer_limit: AtomicU64,
    /// Connections closed for not sending the preface within `handshake_timeout`.
    pub silent: Arc<AtomicU64>,
    /// Connections closed for having no stream for `idle_timeout`.
    pub idle: Arc<AtomicU64>,
    /// Connections whose TLS handshake failed (no client certificate, an untrusted one,
    /// not TLS at all).
    pub tls_failed: AtomicU64,
    /// Accept errors (each followed by a pause).
    pub accept_errors: AtomicU64,
    /// Connections closed before their TLS handshake: their address was over
    /// `handshakes_per_peer_per_second`.
    pub handshake_rate: AtomicU64,
    /// TLS handshakes let through unmetered: the table of addresses was full.
    pub handshakes_unmetered: AtomicU64,
}

/// The accepted connections of `listener`, within `limits`, each through its TLS
/// handshake first when `tls` is set (handshakes run concurrently, so a slow one delays
/// nobody; each must finish, and the HTTP/2 preface arrive, within `handshake_timeout`).
/// Each refusal is also reported to `observer` as a stream error of protocol
/// `"connection"` (reasons `over_limit`, `over_peer_limit`, `silent`, `tls_handshake`,
/// `accept_error`).
///
/// The accept loop, which owns `listener`, ends once the stream is dropped; await the
/// returned handle after that to know the port is free again (a server restarted on the
/// same port must not race its predecessor's socket).
pub fn incoming(
    listener: TcpListener,
    limits: Limits,
    refusals: Arc<Refusals>,
    observer: Arc<dyn super::Observer>,
    tls: Option<Arc<ServerTls>>,
) -> (
    impl Stream<Item = io::Result<BoundedConnection>>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = mpsc::channel(64);
    let accepting = tokio::spawn(accept_loop(listener, limits, refusals, observer, tls, tx));
    (tokio_stream::wrappers::ReceiverStream::new(rx), accepting)
}

/// Accepts until the server stops reading its connections (`tx` closed).
async fn accept_loop(
    listener: TcpListener,
    limits: Limits,
    refusals: Arc<Refusals>,
    observer: Arc<dyn super::Observer>,
    tls: Option<Arc<ServerTls>>,
    tx: mpsc::Sender<io::Result<BoundedConnection>>,
) {
    let gate = ConnectionGate::new(limits.max_connections, limits.max_connections_per_peer);
    let handshake_log = Arc::new(RateLimitedLog::default());
    let handshakes = tls
        .is_some()
        .then(|| Handshakes::start(limits.handshakes_per_peer_per_second));
    loop {
        let on_error = |err: &io::Error| {
            refusals.accept_errors.fetch_add(1, Ordering::Relaxed);
            observer.stream_error("connection", "accept_error");
            tracing::warn!(error = %err, "xDS listener: accept failed; pausing 100 ms");
        };
        let (stream, peer) = tokio::select! {
            _ = tx.closed() => return,
            accepted = crate::gate::accept(&listener, on_error) => accepted,
        };
        if let Some(handshakes) = &handshakes {
            if !handshakes.admit(peer, &refusals, observer.as_ref()) {
                drop(stream);
                continue;
            }
        }
        let admitted = match gate.admit(peer.ip()) {
            Ok(admitted) => admitted,
            Err(refused) => {
                let count = match refused {
                    Refused::OverLimit => &refusals.over_limit,
                    Refused::OverPeerLimit => &refusals.over_peer_limit,
                };
                count.fetch_add(1, Ordering::Relaxed);
                observer.stream_error("connection", refused.label());
                tracing::warn!(%peer, max = gate.cap(refused), reason = refused.label(), "xDS listener: connection cap reached; closing the new connection");
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let deadline = tokio::time::Instant::now() + limits.handshake_timeout;
        let connection = ConnectionParts {
            tcp: stream.connect_info(),
            _admitted: admitted,
            deadline,
            idle_timeout: limits.idle_timeout,
            silent: refusals.silent.clone(),
            idle_closed: refusals.idle.clone(),
            observer: observer.clone(),
        };
        let Some(tls) = &tls else {
            if tx
                .send(Ok(connection.with(Io::Plain(stream))))
                .await
                .is_err()
            {
                return;
            }
            continue;
        };
        let (acceptor, tx, refusals) = (tls.acceptor(), tx.clone(), refusals.clone());
        let log = handshake_log.clone();
        let handshake = async move {
            match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let _ = tx.send(Ok(connection.with(Io::Tls(Box::new(tls))))).await;
                }
                Ok(Err(err)) => {
                    refusals.tls_failed.fetch_add(1, Ordering::Relaxed);
                    connection
                        .observer
                        .stream_error("connection", "tls_handshake");
                    if log.now() {
                        tracing::warn!(%peer, error = %err, "xDS listener: TLS handshake failed (no client certificate, one the client CA did not sign, or not TLS); closing the connection (logged at most every 10 s; counted in xds_stream_errors)");
                    }
                }
                Err(_) => {
                    connection.silent.fetch_add(1, Ordering::Relaxed);
                    connection.observer.stream_error("connection", "silent");
                }
            }
        };
        match handshakes.as_ref().and_then(|h| h.thread.as_ref()) {
            Some(thread) => thread.spawn(handshake),
            None => {
                tokio::spawn(handshake);
            }
        }
    }
}

/// The listener's TLS handshakes: metered per address, run on threads of their own.
struct Handshakes {
    per_second: u32,
    rate: HandshakeRate,
    /// `None` if the threads could not start: handshakes then run on the listener's
    /// runtime.
    thread: Option<HandshakeThreads>,
    log: RateLimitedLog,
}

impl Handshakes {
    fn start(per_second: u32) -> Handshakes {
        let thread = match HandshakeThreads::start() {
            Ok(thread) => Some(thread),
            Err(e) => {
                tracing::error!(error = %e, "xDS listener: could not start the TLS handshake threads; handshakes run beside the probes");
                None
            }
        };
        Handshakes {
            per_second,
            rate: HandshakeRate::new(per_second),
            thread,
            log: RateLimitedLog::default(),
        }
    }

    /// Whether a connection from `peer` may begin its handshake; a refusal is counted
    /// and logged (at most every 10 s).
    fn admit(
        &self,
        peer: std::net::SocketAddr,
        refusals: &Refusals,
        observer: &dyn super::Observer,
    ) -> bool {
        match self.rate.admit(peer.ip(), std::time::Instant::now()) {
            Admission::Admitted => true,
            Admission::Unmetered => {
                refusals
                    .handshakes_unmetered
                    .fetch_add(1, Ordering::Relaxed);
                observer.stream_error("connection", "handshake_unmetered");
                true
            }
            Admission::Refused => {
                refusals.handshake_rate.fetch_add(1, Ordering::Relaxed);
                observer.stream_error("connection", "handshake_rate");
                if self.log.now() {
                    tracing::warn!(%peer, per_second = self.per_second, "xDS listener: TLS handshakes from this address over their rate; closing new connections before their handshake (logged at most every 10 s; counted in xds_stream_errors)");
                }
                false
            }
        }
    }
}

/// Logs at most once per 10 s (a scanner's failed handshakes must not flood the log).
#[derive(Default)]
struct RateLimitedLog(std::sync::Mutex<Option<std::time::Instant>>);

impl RateLimitedLog {
    fn now(&self) -> bool {
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let due = last.is_none_or(|at| at.elapsed() >= Duration::from_secs(10));
        if due {
            *last = Some(std::time::Instant::now());
        }
        due
    }
}

/// An accepted connection's slots and limits, before its transport is ready.
struct ConnectionParts {
    tcp: TcpConnectInfo,
    _admitted: Admitted,
    /// When the handshake (TLS, then the HTTP/2 preface) must be done.
    deadline: tokio::time::Instant,
    idle_timeout: Duration,
    silent: Arc<AtomicU64>,
    idle_closed: Arc<AtomicU64>,
    observer: Arc<dyn super::Observer>,
}

impl ConnectionParts {
    fn with(self, inner: Io) -> BoundedConnection {
        BoundedConnection {
            inner,
            tcp: self.tcp,
            _admitted: self._admitted,
            preface_by: Some(self.deadline),
            deadline: None,
            preface_left: PREFACE_BYTES,
            idle_timeout: self.idle_timeout,
            idle: None,
            streams: Arc::default(),
            silent: self.silent,
            idle_closed: self.idle_closed,
            observer: self.observer,
        }
    }
}

/// A connection's transport: the socket, or TLS over it.
enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// A connection holding its slot, closed if it sends nothing in time.
pub struct BoundedConnection {
    inner: Io,
    tcp: TcpConnectInfo,
    _admitted: Admitted,
    /// When the preface must have arrived (`None` once it has).
    preface_by: Option<tokio::time::Instant>,
    /// Its timer, made at the first read that waits: on the runtime that serves the
    /// connection, not the handshake thread's that built this (which is gone when the
    /// listener stops, while the server may still drain connections).
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    preface_left: usize,
    idle_timeout: Duration,
    /// Armed while the connection has no stream.
    idle: Option<Pin<Box<tokio::time::Sleep>>>,
    streams: Arc<ConnectionStreams>,
    silent: Arc<AtomicU64>,
    idle_closed: Arc<AtomicU64>,
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
        this.streams.1.reader.register(cx.waker());
        if this.streams.closing() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "closed: a stream's client read none of a response in time",
            )));
        }
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = buf.filled().len() - before;
                this.preface_left = this.preface_left.saturating_sub(read);
                if this.preface_left == 0 {
                    this.preface_by = None;
                    this.deadline = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if let Some(by) = this.preface_by {
                    let deadline = this
                        .deadline
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(by)));
                    if deadline.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    this.preface_by = None;
                    this.deadline = None;
                    this.silent.fetch_add(1, Ordering::Relaxed);
                    this.observer.stream_error("connection", "silent");
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no HTTP/2 preface in time",
                    )));
                }
                // Preface done. HTTP/2 reads the connection for as long as it lives, so
                // a read is pending (and polled again) whenever its streams change.
                if this.streams.any() {
                    this.idle = None;
                    return Poll::Pending;
                }
                let timeout = this.idle_timeout;
                let idle = this
                    .idle
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if idle.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.idle = None;
                this.idle_closed.fetch_add(1, Ordering::Relaxed);
                this.observer.stream_error("connection", "idle");
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no stream on the connection in time",
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
    type ConnectInfo = XdsConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        XdsConnectInfo {
            tcp: self.tcp.clone(),
            streams: self.streams.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Serves `listener` within `limits`: each connection echoes what it reads, and one
    /// whose read is `open` holds a stream (as an ADS stream would) until it sends `shut`.
    fn echo_on(listener: TcpListener, limits: Limits) -> Arc<Refusals> {
        let refusals = Arc::new(Refusals::default());
        let (stream, _accepting) = incoming(listener, limits, refusals.clone(), Arc::new(()), None);
        tokio::spawn(async move {
            tokio::pin!(stream);
            while let Some(Ok(mut conn)) = stream.next().await {
                tokio::spawn(async move {
                    let streams = conn.connect_info().streams;
                    let mut open = None;
                    let mut buf = [0u8; 64];
                    while let Ok(n) = conn.read(&mut buf).await {
                        match &buf[..n] {
                            b"open" => open = Some(streams.open()),
                            b"shut" => open = None,
                            _ => {}
                        }
                        if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                    drop(open);
                });
            }
        });
        refusals
    }

    async fn listen(limits: Limits) -> (std::net::SocketAddr, Arc<Refusals>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        (addr, echo_on(listener, limits))
    }

    const PREFACE: &[u8; PREFACE_BYTES] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    #[tokio::test]
    async fn a_silent_or_trickling_connection_is_closed_and_a_talking_one_is_not() {
        let limits = Limits {
            max_connections: 8,
            handshake_timeout: Duration::from_millis(200),
            ..Default::default()
        };
        let (addr, refusals) = listen(limits).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        // One byte of the preface does not buy the connection more time.
        let mut trickling = TcpStream::connect(addr).await.unwrap();
        trickling.write_all(b"P").await.unwrap();
        let mut talking = TcpStream::connect(addr).await.unwrap();
        talking.write_all(PREFACE).await.unwrap();
        let mut buf = [0u8; PREFACE_BYTES];
        talking.read_exact(&mut buf).await.unwrap();
        // The others are closed (read gives EOF or a reset) within a generous bound.
        for c in [&mut silent, &mut trickling] {
            let closed = loop {
                match tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await {
                    Ok(Ok(n)) if n > 0 => continue, // the echo of the byte sent
                    other => break other,
                }
            };
            assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
        }
        assert_eq!(refusals.silent.load(Ordering::Relaxed), 2);
        // Long after the deadline, the one that sent its preface still works.
        talking.write_all(b"abc").await.unwrap();
        talking.read_exact(&mut buf[..3]).await.unwrap();
        assert_eq!(&buf[..3], b"abc");
    }

    /// Past its preface, a connection lives while it has a stream, and is closed after
    /// `idle_timeout` without one.
    #[tokio::test]
    async fn a_connection_without_streams_is_closed_when_idle() {
        let limits = Limits {
            idle_timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let (addr, refusals) = listen(limits).await;
        let mut buf = [0u8; PREFACE_BYTES];
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(PREFACE).await.unwrap();
        idle.read_exact(&mut buf).await.unwrap();
        let mut busy = TcpStream::connect(addr).await.unwrap();
        busy.write_all(PREFACE).await.unwrap();
        busy.read_exact(&mut buf).await.unwrap();
        busy.write_all(b"open").await.unwrap();
        busy.read_exact(&mut buf[..4]).await.unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(10), idle.read(&mut buf)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
        assert_eq!(refusals.idle.load(Ordering::Relaxed), 1);
        // Well past the idle timeout, the one with a stream still works...
        tokio::time::sleep(Duration::from_millis(600)).await;
        busy.write_all(b"shut").await.unwrap();
        busy.read_exact(&mut buf[..4]).await.unwrap();
        assert_eq!(&buf[..4], b"shut");
        // ...and once its stream ends, it is idle too.
        let closed = tokio::time::timeout(Duration::from_secs(10), busy.read(&mut buf)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
        assert_eq!(refusals.idle.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn connections_over_the_limit_are_closed_and_slots_come_back() {
        let limits = Limits {
            max_connections: 2,
            handshake_timeout: Duration::from_secs(60),
            ..Default::default()
        };
        let (addr, refusals) = listen(limits).await;
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
            ..Default::default()
        };
        // Listen on every loopback address, so that 127.0.0.2 is another peer.
        let listener = TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let refusals = echo_on(listener, limits);
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

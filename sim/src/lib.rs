//! A simulated Ray Serve: HTTP proxies that answer like Ray 2.60's, for tests and the demo.
//!
//! Each proxy serves what a real Ray Serve proxy serves (see the captures in
//! `tests/fixtures/ray-serve-2.60/`): `GET /-/healthz` → 200 `success`,
//! `GET /-/routes` → 200 JSON `{route_prefix: app}`, and application routes, which here
//! answer with which cluster, proxy and application served them. Paths that match no
//! route prefix get 404 as in Ray.
//!
//! A [`ProxyHandle`] injects faults at run time: draining (503 `This node is being
//! drained.` on `/-/healthz`, as Ray answers while a node drains), not ready (503 `Route
//! table is not populated yet.`), no replicas yet (503 `No replicas are available yet.`,
//! application requests held until the mode changes), hanging (accepts, never answers,
//! like a SIGSTOPped process), slow answers, backpressure (503, nothing ran) and a
//! connection reset after the request was read in full. Dying is cancelling the proxy's
//! shutdown token.
//!
//! Every application request that reaches a replica is recorded in the proxy's
//! [`Executions`] ledger under its `x-request-id` (Envoy sets one and keeps it across
//! retries), so a test can tell how many times a request ran. Applications also speak
//! WebSocket (an echo) and server-sent events (`?sse=<events>&every_ms=<ms>`).
//!
//! [`grpc`] is the node's gRPC proxy (Ray's port 9000): given the same [`ProxyHandle`] as
//! the node's HTTP proxy, one mode and one ledger govern both, as one Ray proxy actor
//! serves both ports.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod capacity;
pub mod cli;
pub mod dashboard;
pub mod grpc;
mod mode;

pub use mode::ProxyMode;

/// Which kind of Ray node a proxy runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeType {
    Head,
    Worker,
}

impl NodeType {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeType::Head => "head",
            NodeType::Worker => "worker",
        }
    }
}

impl std::fmt::Display for NodeType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one simulated proxy is.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub cluster: String,
    pub node_type: NodeType,
    /// Route prefix → application name, e.g. `{"/": "hello"}`.
    pub routes: BTreeMap<String, String>,
}

/// The body of an application response: who served it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Served {
    pub cluster: String,
    pub proxy: String,
    pub node_type: String,
    pub app: String,
    pub method: String,
    pub path: String,
    pub body_bytes: usize,
}

struct ProxyState {
    config: ProxyConfig,
    address: SocketAddr,
}

/// Which requests ran where: request id → the proxies that ran it, in order. Shared by
/// every proxy given the same ledger; optionally also appended to a file, line by line
/// (`<request id> <proxy>`), so that the record outlives a process that is killed.
#[derive(Clone, Debug, Default)]
pub struct Executions(
    Arc<Mutex<BTreeMap<String, Vec<SocketAddr>>>>,
    Option<Arc<Mutex<std::fs::File>>>,
);

impl Executions {
    /// A ledger that also appends each run to `path`.
    pub fn logged_to(path: &std::path::Path) -> std::io::Result<Executions> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Executions(
            Default::default(),
            Some(Arc::new(Mutex::new(file))),
        ))
    }

    pub fn record(&self, request_id: &str, proxy: SocketAddr) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(request_id.to_string())
            .or_default()
            .push(proxy);
        if let Some(file) = &self.1 {
            use std::io::Write;
            let mut f = file.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(f, "{request_id} {proxy}");
        }
    }

    /// How many times the request ran (0 if never).
    pub fn count(&self, request_id: &str) -> usize {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(request_id)
            .map_or(0, Vec::len)
    }

    /// Every request and the proxies that ran it.
    pub fn all(&self) -> BTreeMap<String, Vec<SocketAddr>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Requests that ran more than once.
    pub fn more_than_once(&self) -> BTreeMap<String, Vec<SocketAddr>> {
        let mut all = self.all();
        all.retain(|_, at| at.len() > 1);
        all
    }

    /// Forgets everything recorded so far.
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Runs on `proxy`.
    pub fn on(&self, proxy: SocketAddr) -> usize {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|at| at.iter().filter(|p| **p == proxy).count())
            .sum()
    }

    /// Runs in all.
    pub fn total(&self) -> usize {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(Vec::len)
            .sum()
    }
}

/// Changes a running proxy's behaviour, and reads what ran on it.
#[derive(Clone, Debug, Default)]
pub struct ProxyHandle {
    mode: Arc<Mutex<ProxyMode>>,
    healthz_requests: Arc<std::sync::atomic::AtomicU64>,
    /// gRPC `Healthz` calls, for [`ProxyMode::Flapping`]: a count of its own, so that an
    /// HTTP prober and a gRPC prober of the same node each see the alternation.
    grpc_healthz_requests: Arc<std::sync::atomic::AtomicU64>,
    /// Application requests that reached this proxy, run or turned away.
    received: Arc<std::sync::atomic::AtomicU64>,
    /// Application requests under [`ProxyMode::Failing`], to spread its failures.
    failing_requests: Arc<std::sync::atomic::AtomicU64>,
    executions: Executions,
    /// What the replicas behind it run at once ([`capacity`]); no bound by default.
    replicas: Arc<capacity::Replicas>,
}

impl ProxyHandle {
    /// A handle that records into `ledger` (share one across proxies to count runs of a
    /// request wherever they happen).
    pub fn with_ledger(ledger: Executions) -> ProxyHandle {
        ProxyHandle {
            executions: ledger,
            ..Default::default()
        }
    }

    pub fn executions(&self) -> &Executions {
        &self.executions
    }

    /// Application requests that reached this proxy, whether they ran or were turned
    /// away (503), over HTTP and, with a [`grpc`] proxy sharing this handle, gRPC.
    pub fn received(&self) -> u64 {
        self.received.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set(&self, mode: ProxyMode) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = mode;
    }

    pub fn get(&self) -> ProxyMode {
        self.mode.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Bounds what the replicas behind this proxy run at once (`None`: no bound).
    pub fn set_capacity(&self, capacity: Option<capacity::Capacity>) {
        self.replicas.set(capacity);
    }

    pub fn capacity(&self) -> Option<capacity::Capacity> {
        self.replicas.get()
    }

    /// Requests running on and waiting for the replicas behind this proxy now.
    pub fn load(&self) -> (u32, u32) {
        self.replicas.load()
    }

    /// A request's turn on the replicas ([`capacity::Replicas::admit`]).
    pub(crate) async fn admit(&self) -> capacity::Admission {
        self.replicas.admit().await
    }
}

/// How often a request held by [`ProxyMode::NoReplicas`] looks whether the mode changed.
const NO_REPLICAS_POLL: Duration = Duration::from_millis(10);

/// Marks a response whose connection is to be closed instead of answered.
#[derive(Clone, Copy, Debug)]
struct CloseConnection;

async fn apply_mode(
    State((handle, address)): State<(ProxyHandle, SocketAddr)>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let path = request.uri().path();
    let health_path = matches!(path, "/-/healthz" | "/-/routes");
    let healthz = path == "/-/healthz";
    let mut mode = handle.get();
    if !health_path {
        handle
            .received
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // No replica up yet: the request waits in the proxy until there is one (the mode
        // changes), then goes on under the new mode.
        while mode == ProxyMode::NoReplicas {
            tokio::time::sleep(NO_REPLICAS_POLL).await;
            mode = handle.get();
        }
    }
    // An application request runs unless the proxy turns it away first (backpressure,
    // no route table yet): then nothing ran, as in Ray. One that may run waits for its
    // turn on the replicas, or is turned away if too many wait already.
    let turned_away = matches!(mode, ProxyMode::Overloaded | ProxyMode::NotReady);
    let (mut _slot, mut call) = (None, Duration::ZERO);
    if !health_path && !turned_away {
        match handle.admit().await {
            capacity::Admission::Run(slot, takes) => (_slot, call) = (slot, takes),
            capacity::Admission::Refused(text) => return unavailable(text),
        }
    }
    if !health_path && !turned_away {
        if let Some(id) = request
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
        {
            handle.executions.record(id, address);
        }
    }
    // The replica's own time (zero unless a capacity says otherwise).
    tokio::time::sleep(call).await;
    match mode {
        ProxyMode::Serving => next.run(request).await,
        ProxyMode::Draining if health_path => unavailable("This node is being drained."),
        ProxyMode::Draining => next.run(request).await,
        ProxyMode::ReplicaDraining if health_path => unavailable("DRAINING"),
        ProxyMode::ReplicaDraining => next.run(request).await,
        ProxyMode::NotReady => unavailable("Route table is not populated yet."),
        // Only health paths get here (application requests waited above).
        ProxyMode::NoReplicas => unavailable("No replicas are available yet."),
        ProxyMode::Hang => std::future::pending().await,
        ProxyMode::Slow(delay) => {
            tokio::time::sleep(delay).await;
            next.run(request).await
        }
        ProxyMode::Flapping if healthz => {
            let n = handle
                .healthz_requests
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n % 2 == 0 {
                next.run(request).await
            } else {
                (StatusCode::INTERNAL_SERVER_ERROR, "flapping").into_response()
            }
        }
        ProxyMode::Flapping => next.run(request).await,
        ProxyMode::Failing(_) if health_path => next.run(request).await,
        ProxyMode::Failing(percent) => {
            let n = handle
                .failing_requests
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = u64::from(percent);
            if (n + 1) * p / 100 > n * p / 100 {
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Unexpected error, traceback: ray::ServeReplica:app:App.handle_request() (a bad version)",
                )
                    .into_response()
            } else {
                next.run(request).await
            }
        }
        ProxyMode::Overloaded if health_path => next.run(request).await,
        ProxyMode::Overloaded => unavailable(
            "Request dropped due to backpressure (num_queued_requests=100, max_queued_requests=100).",
        ),
        ProxyMode::ResetAfterRead if health_path => next.run(request).await,
        ProxyMode::ResetAfterRead => {
            let _ = axum::body::to_bytes(request.into_body(), 16 * 1024 * 1024).await;
            let mut response = StatusCode::INTERNAL_SERVER_ERROR.into_response();
            response.extensions_mut().insert(CloseConnection);
            response
        }
    }
}

fn unavailable(message: impl Into<String>) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        message.into(),
    )
        .into_response()
}

/// Serves one proxy on `listener` until `shutdown`.
pub async fn serve_proxy(
    listener: TcpListener,
    config: ProxyConfig,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_proxy_with(listener, config, ProxyHandle::default(), shutdown).await
}

/// Serves one proxy whose behaviour `handle` controls, until `shutdown`: then it stops
/// accepting (later connections are refused) and lets requests in flight finish.
pub async fn serve_proxy_with(
    listener: TcpListener,
    config: ProxyConfig,
    handle: ProxyHandle,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::server::conn::auto::Builder;
    use tower::ServiceExt;

    let address = listener.local_addr()?;
    let state = Arc::new(ProxyState { config, address });
    let app = Router::new()
        .route("/-/healthz", get(healthz))
        .route("/-/routes", get(routes))
        .fallback(application)
        .layer(axum::middleware::from_fn_with_state(
            (handle, address),
            apply_mode,
        ))
        .layer(axum::middleware::map_response(uvicorn_header))
        .with_state(state);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        // A response marked `CloseConnection` becomes an error, on which hyper closes the
        // connection without answering.
        let service =
            hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let app = app.clone();
                async move {
                    let response = app
                        .oneshot(request.map(axum::body::Body::new))
                        .await
                        .unwrap_or_else(|e| match e {});
                    if response.extensions().get::<CloseConnection>().is_some() {
                        Err(std::io::Error::other(
                            "closing the connection without an answer",
                        ))
                    } else {
                        Ok(response)
                    }
                }
            });
        let connection = Builder::new(TokioExecutor::new())
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
    drop(listener);
    // Requests in flight finish (a hung one does not hold shutdown forever).
    let _ = tokio::time::timeout(Duration::from_secs(30), graceful.shutdown()).await;
    Ok(())
}

async fn uvicorn_header(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::SERVER, HeaderValue::from_static("uvicorn"));
    response
}

async fn healthz() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        "success",
    )
        .into_response()
}

async fn routes(State(state): State<Arc<ProxyState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string(&state.config.routes).unwrap_or_default(),
    )
        .into_response()
}

/// The longest route prefix matching `path`, as Ray Serve's proxy picks it.
pub fn match_route<'a>(routes: &'a BTreeMap<String, String>, path: &str) -> Option<&'a str> {
    routes
        .iter()
        .filter(|(prefix, _)| {
            let p = prefix.trim_end_matches('/');
            p.is_empty() || path == p || path.starts_with(&format!("{p}/"))
        })
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(_, app)| app.as_str())
}

async fn application(State(state): State<Arc<ProxyState>>, request: Request) -> Response {
    let method = request.method().to_string();
    let path = request.uri().path().to_string();
    let Some(app) = match_route(&state.config.routes, &path).map(str::to_owned) else {
        return (
            StatusCode::NOT_FOUND,
            format!("Path '{path}' not found. Ping http://.../-/routes for available routes."),
        )
            .into_response();
    };
    if request
        .headers()
        .get(header::UPGRADE)
        .is_some_and(|u| u.as_bytes().eq_ignore_ascii_case(b"websocket"))
    {
        return websocket_echo(request).await;
    }
    if let Some((events, every)) = sse_query(request.uri().query().unwrap_or_default()) {
        return server_sent_events(events, every);
    }
    let body: Bytes = match axum::body::to_bytes(request.into_body(), 16 * 1024 * 1024).await {
        Ok(b) => b,
        Err(_) => return StatusCode::PAYLOAD_TOO_LARGE.into_response(),
    };
    let served = Served {
        cluster: state.config.cluster.clone(),
        proxy: state.address.to_string(),
        node_type: state.config.node_type.as_str().into(),
        app,
        method,
        path,
        body_bytes: body.len(),
    };
    axum::Json(served).into_response()
}

/// An application behind a WebSocket upgrade: echoes every message back.
async fn websocket_echo(request: Request) -> Response {
    use axum::extract::ws::{Message, WebSocketUpgrade};
    use axum::extract::FromRequestParts;
    let (mut parts, _) = request.into_parts();
    let upgrade = match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
        Ok(u) => u,
        Err(rejection) => return rejection.into_response(),
    };
    upgrade.on_upgrade(|mut socket| async move {
        while let Some(Ok(message)) = socket.recv().await {
            let echo = match message {
                Message::Text(t) => Message::Text(t),
                Message::Binary(b) => Message::Binary(b),
                Message::Close(_) => break,
                _ => continue,
            };
            if socket.send(echo).await.is_err() {
                break;
            }
        }
    })
}

/// `sse=<events>&every_ms=<ms>` in a query: a streamed answer of that many events.
fn sse_query(query: &str) -> Option<(u64, Duration)> {
    let mut events = None;
    let mut every = Duration::from_millis(100);
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("sse", n)) => events = n.parse().ok(),
            Some(("every_ms", ms)) => every = Duration::from_millis(ms.parse().ok()?),
            _ => {}
        }
    }
    events.map(|n| (n, every))
}

/// Server-sent events: `data: <i>` every `every`, `events` of them, then the end.
fn server_sent_events(events: u64, every: Duration) -> Response {
    let stream = futures_util::stream::unfold(0u64, move |i| async move {
        if i >= events {
            return None;
        }
        tokio::time::sleep(every).await;
        Some((
            Ok::<_, std::convert::Infallible>(format!("data: {i}\n\n")),
            i + 1,
        ))
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        axum::body::Body::from_stream(stream),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_prefix_wins() {
        let routes: BTreeMap<String, String> = [
            ("/".into(), "root".into()),
            ("/hello".into(), "hello".into()),
        ]
        .into();
        assert_eq!(match_route(&routes, "/hello"), Some("hello"));
        assert_eq!(match_route(&routes, "/hello/x"), Some("hello"));
        assert_eq!(match_route(&routes, "/helloworld"), Some("root"));
        let only: BTreeMap<String, String> = [("/hello".into(), "hello".into())].into();
        assert_eq!(match_route(&only, "/other"), None);
    }
}

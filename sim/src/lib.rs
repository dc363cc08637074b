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
//! table is not populated yet.`), hanging (accepts, never answers, like a SIGSTOPped
//! process) and slow answers. Dying is cancelling the proxy's shutdown token.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod cli;
pub mod dashboard;

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

/// How a simulated proxy behaves right now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ProxyMode {
    #[default]
    Serving,
    /// `/-/healthz` and `/-/routes` answer 503 `This node is being drained.`;
    /// application requests are still served.
    Draining,
    /// `/-/healthz` and `/-/routes` answer 503 `Route table is not populated yet.`
    NotReady,
    /// Accepts connections and never answers.
    Hang,
    /// Every answer waits this long first.
    Slow(std::time::Duration),
    /// `/-/healthz` alternates between success and a 500, request by request.
    Flapping,
    /// Healthy, but application requests get 503 (Ray's backpressure: nothing ran).
    Overloaded,
}

impl std::str::FromStr for ProxyMode {
    type Err = String;
    /// `serving`, `draining`, `not-ready`, `hang`, `flapping` or `slow:<milliseconds>`.
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "serving" => ProxyMode::Serving,
            "draining" => ProxyMode::Draining,
            "not-ready" => ProxyMode::NotReady,
            "hang" => ProxyMode::Hang,
            "flapping" => ProxyMode::Flapping,
            "overloaded" => ProxyMode::Overloaded,
            other => match other.strip_prefix("slow:").and_then(|ms| ms.parse().ok()) {
                Some(ms) => ProxyMode::Slow(std::time::Duration::from_millis(ms)),
                None => {
                    return Err(format!(
                        "unknown proxy mode {other:?}: serving, draining, not-ready, hang, flapping, overloaded or slow:<ms>"
                    ))
                }
            },
        })
    }
}

/// Changes a running proxy's behaviour.
#[derive(Clone, Debug, Default)]
pub struct ProxyHandle {
    mode: Arc<std::sync::Mutex<ProxyMode>>,
    healthz_requests: Arc<std::sync::atomic::AtomicU64>,
}

impl ProxyHandle {
    pub fn set(&self, mode: ProxyMode) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = mode;
    }

    pub fn get(&self) -> ProxyMode {
        self.mode.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

async fn apply_mode(
    State(handle): State<ProxyHandle>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let path = request.uri().path();
    let health_path = matches!(path, "/-/healthz" | "/-/routes");
    let healthz = path == "/-/healthz";
    match handle.get() {
        ProxyMode::Serving => next.run(request).await,
        ProxyMode::Draining if health_path => unavailable("This node is being drained."),
        ProxyMode::Draining => next.run(request).await,
        ProxyMode::NotReady => unavailable("Route table is not populated yet."),
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
        ProxyMode::Overloaded if health_path => next.run(request).await,
        ProxyMode::Overloaded => unavailable(
            "Request dropped due to backpressure (num_queued_requests=100, max_queued_requests=100).",
        ),
    }
}

fn unavailable(message: &'static str) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        message,
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

/// Serves one proxy whose behaviour `handle` controls, until `shutdown`.
pub async fn serve_proxy_with(
    listener: TcpListener,
    config: ProxyConfig,
    handle: ProxyHandle,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let address = listener.local_addr()?;
    let state = Arc::new(ProxyState { config, address });
    let app = Router::new()
        .route("/-/healthz", get(healthz))
        .route("/-/routes", get(routes))
        .fallback(application)
        .layer(axum::middleware::from_fn_with_state(handle, apply_mode))
        .layer(axum::middleware::map_response(uvicorn_header))
        .with_state(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
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

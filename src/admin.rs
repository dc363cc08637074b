//! The admin HTTP server: health, readiness, Prometheus metrics and debug views.
//!
//! - `/healthz`: the process is up;
//! - `/readyz`: 200 once the source has its first full state (for Kubernetes, every
//!   watch has listed) and the first snapshot is built (503 before), and while no
//!   supervised component is down (503 naming it, until its restart);
//! - `/metrics`: Prometheus text;
//! - `/debug/snapshot`: every resource of the current snapshot with its version, as proto
//!   JSON (as Envoy's `/config_dump`);
//! - `/debug/clients`: every connected Envoy in brief (node, protocol, per type the
//!   versions ACKed and NACKed and how many names it subscribes to, in sync or not),
//!   written one client at a time and cut at [`DEBUG_PAGE_MAX_BYTES`];
//!   `?stream=ID` or `?node=ID`: that Envoy whole, its subscriptions and per resource what
//!   it holds against the current snapshot (CSDS `ClientConfig`);
//! - `/debug/state`: per cluster, where its proxies come from (the source, or discovered
//!   from its dashboard), each proxy's probe state and endpoint health with the reason,
//!   and what the cluster's dashboard says (application statuses, staleness);
//!   the source's state (each Kubernetes watch, how stale, what it skipped and why);
//!   the proxies the address policy refused (`refused_proxies`, with the reason: the
//!   first 100, with `refused_proxies_total`, `refused_proxies_shown` and
//!   `refused_proxies_by_reason`, so the page stays small however many there are).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::live::dashboards::DashboardStates;
use crate::live::health::HealthMap;
use crate::live::prober::ProbeStates;
use crate::metrics::Metrics;
use crate::model::{Application, Model, Protocol, Proxy, RayCluster, RayService};
use crate::pipeline::switchover::Switchover;
use crate::source::SourceStatus;
use crate::xds::{Clients, ResourceType, Snapshot};

#[derive(Clone)]
pub(crate) struct AdminState {
    /// The supervised components, for `/readyz` and `/debug/state`.
    pub components: Arc<crate::supervisor::Components>,
    pub metrics: Arc<Metrics>,
    pub clients: Arc<Clients>,
    /// `None` until the first snapshot is built.
    pub snapshots: watch::Receiver<Option<Arc<Snapshot>>>,
    pub prestop: Prestop,
    pub live: LiveViews,
}

/// What `/prestop` needs beside the clients: the peers to ask, this replica's id (a
/// peer's call carrying it is this replica asking itself), the endpoint index, and the
/// bounds on calls waiting at once (pods' calls and peers' calls apart).
#[derive(Clone)]
pub(crate) struct Prestop {
    peers: Arc<Vec<String>>,
    replica_id: Arc<str>,
    index: Arc<crate::prestop::EndpointIndex>,
    waiting: Arc<tokio::sync::Semaphore>,
    peers_waiting: Arc<tokio::sync::Semaphore>,
}

impl Prestop {
    pub(crate) fn new(
        peers: Vec<String>,
        replica_id: String,
        index: Arc<crate::prestop::EndpointIndex>,
    ) -> Prestop {
        Prestop {
            peers: Arc::new(peers),
            replica_id: replica_id.into(),
            index,
            waiting: Arc::new(tokio::sync::Semaphore::new(crate::prestop::AT_ONCE)),
            peers_waiting: Arc::new(tokio::sync::Semaphore::new(crate::prestop::AT_ONCE)),
        }
    }
}

/// What `/debug/state` shows: the latest value of each channel, each written by its own
/// task.
#[derive(Clone)]
pub(crate) struct LiveViews {
    /// The effective model.
    pub models: watch::Receiver<Arc<Model>>,
    pub probes: watch::Receiver<Arc<ProbeStates>>,
    pub dashboards: watch::Receiver<Arc<DashboardStates>>,
    /// When each dashboard last answered (every answer, published or not).
    pub dashboards_answered: Arc<crate::live::dashboards::AnsweredAt>,
    pub health: watch::Receiver<Arc<HealthMap>>,
    pub switchover: watch::Receiver<Arc<Switchover>>,
    pub source: watch::Receiver<Arc<SourceStatus>>,
    /// Proxies the address policy left out.
    pub refused: watch::Receiver<Arc<Vec<crate::live::discovery::RefusedProxy>>>,
}

pub(crate) fn router(state: AdminState) -> Router {
    public_routes().merge(debug_routes()).with_state(state)
}

/// `/healthz`, `/readyz`, `/metrics`: what probes and Prometheus read.
fn public_routes() -> Router<AdminState> {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route(crate::live::peers::SWITCHOVER_PATH, get(replica_switchover))
        .route(crate::prestop::PATH, get(prestop))
}

#[derive(serde::Deserialize)]
struct PrestopQuery {
    address: String,
    /// How long to wait at most (`20s` by default, at most `25s`).
    grace: Option<String>,
    /// Set by a peer asking (its replica id): wait for this replica's Envoys only, and
    /// answer at once if it is this replica's own id.
    asker: Option<String>,
}

/// The pre-stop handshake (`crate::prestop`): 200 once every Envoy of this replica and
/// of its peers has moved past what listed `address`; 504 at the grace, saying who it
/// still waits for; 400 for a bad query; 503 when too many calls wait already. Only a
/// pod's calls are counted (`ray_xds_prestop_calls_total`), not its peers'.
async fn prestop(
    State(state): State<AdminState>,
    axum::extract::Query(query): axum::extract::Query<PrestopQuery>,
) -> Response {
    use crate::prestop::{Look, Target};
    let target = match Target::parse(&query.address) {
        Ok(target) => target,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    let grace = match query.grace.as_deref().map(humantime::parse_duration) {
        None => crate::prestop::DEFAULT_GRACE,
        Some(Ok(grace)) if grace <= crate::prestop::MAX_GRACE => grace,
        Some(Ok(_)) | Some(Err(_)) => {
            return (
                StatusCode::BAD_REQUEST,
                format!(
                    "grace must be a duration of at most {}\n",
                    humantime::format_duration(crate::prestop::MAX_GRACE)
                ),
            )
                .into_response()
        }
    };
    let p = &state.prestop;
    let from_peer = query.asker.is_some();
    if query.asker.as_deref() == Some(&*p.replica_id) {
        // This replica asking itself through its peers' name: its own wait covers it.
        return Json(json!({ "address": target.to_string(), "dropped": true, "self": true }))
            .into_response();
    }
    let places = if from_peer {
        &p.peers_waiting
    } else {
        &p.waiting
    };
    let Ok(_place) = places.clone().try_acquire_owned() else {
        if !from_peer {
            state
                .metrics
                .prestop_calls
                .get_or_create(&crate::metrics::ResultLabels { result: "busy" })
                .inc();
        }
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "{} pre-stop calls are waiting already\n",
                crate::prestop::AT_ONCE
            ),
        )
            .into_response();
    };
    let started = tokio::time::Instant::now();
    let deadline = started + grace;
    let local =
        || crate::prestop::wait_local(target, p.index.clone(), state.clients.clone(), deadline);
    let (mut look, peers) = if from_peer || p.peers.is_empty() {
        (local().await, Vec::new())
    } else {
        tokio::join!(
            local(),
            crate::prestop::ask_peers(&p.peers, target, &p.replica_id, deadline)
        )
    };
    let peers_dropped = peers.iter().all(|a| a.dropped);
    if look == Look::Dropped && peers_dropped && !peers.is_empty() {
        // The peers answered later than this replica's own look: look again (at once
        // when nothing changed since).
        look = local().await;
    }
    let dropped = look == Look::Dropped && peers_dropped;
    let (still_listed, waiting_for) = match look {
        Look::Dropped => (0, Vec::new()),
        Look::StillListed(n) => (n, Vec::new()),
        Look::Waiting(who) => (0, who),
    };
    let result = if dropped { "dropped" } else { "grace" };
    if !from_peer {
        state
            .metrics
            .prestop_calls
            .get_or_create(&crate::metrics::ResultLabels { result })
            .inc();
        if !dropped {
            tracing::warn!(address = %target, still_listed, waiting = waiting_for.len(), peers_waiting = peers.iter().filter(|a| !a.dropped).count(), "pre-stop: the grace passed before every Envoy dropped the address");
        }
    }
    let body = json!({
        "address": target.to_string(),
        "dropped": dropped,
        "waited_ms": started.elapsed().as_millis() as u64,
        // Endpoint resources still listing the address (the source has not said it is
        // going away), and the Envoys that still hold a version that listed it.
        "still_listed_in": still_listed,
        "waiting_for": waiting_for.iter().take(100).collect::<Vec<_>>(),
        "waiting_for_total": waiting_for.len(),
        "peers": peers,
    });
    let status = if dropped {
        StatusCode::OK
    } else {
        StatusCode::GATEWAY_TIMEOUT
    };
    (status, Json(body)).into_response()
}

/// This replica's switches, for its peers (`live::peers`).
async fn replica_switchover(State(state): State<AdminState>) -> Response {
    let mut view = state.live.switchover.borrow().replica_view();
    view.now_unix = Some(crate::live::peers::to_unix(std::time::SystemTime::now()));
    Json(view).into_response()
}

/// `/debug/*`: every resource, client and proxy; on a listener of its own when
/// `admin.debug_listen` is set.
fn debug_routes() -> Router<AdminState> {
    bounded_pages(
        Router::new()
            .route("/debug/snapshot", get(snapshot))
            .route("/debug/clients", get(clients))
            .route("/debug/state", get(live_state)),
        DEBUG_PAGES_AT_ONCE,
    )
}

/// Debug pages being answered at once: each can be megabytes (every client's
/// subscriptions), and a client that never reads its answer holds it.
pub(crate) const DEBUG_PAGES_AT_ONCE: usize = 4;

/// `pages`, at most `at_once` of them being sent at once ([`bounded_debug_page`]).
fn bounded_pages<S: Clone + Send + Sync + 'static>(pages: Router<S>, at_once: usize) -> Router<S> {
    let places = Arc::new(tokio::sync::Semaphore::new(at_once));
    pages.layer(axum::middleware::from_fn(move |request, next| {
        bounded_debug_page(places.clone(), request, next)
    }))
}

/// Answers a debug page while fewer than [`DEBUG_PAGES_AT_ONCE`] are being sent (else
/// 503), holding its place until the page's last chunk is taken by the connection: the
/// page is sent in chunks of at most 64 KiB, which HTTP/1 takes only as it writes them.
async fn bounded_debug_page(
    pages: Arc<tokio::sync::Semaphore>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Ok(place) = pages.try_acquire_owned() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{DEBUG_PAGES_AT_ONCE} debug pages are being sent; try again\n"),
        )
            .into_response();
    };
    let (parts, body) = next.run(request).await.into_parts();
    // Each frame as it comes, cut in 64 KiB slices: a page built whole (a JSON value) is
    // taken by the connection only as it writes it, like a page made as it goes.
    let slices = futures::StreamExt::flat_map(body.into_data_stream(), |frame| {
        let slices: Vec<Result<bytes::Bytes, axum::Error>> = match frame {
            Ok(bytes) => (0..bytes.len())
                .step_by(64 * 1024)
                .map(|at| Ok(bytes.slice(at..(at + 64 * 1024).min(bytes.len()))))
                .collect(),
            Err(e) => vec![Err(e)],
        };
        futures::stream::iter(slices)
    });
    let stream = futures::StreamExt::chain(
        slices,
        futures::stream::once(async move {
            drop(place);
            Ok(bytes::Bytes::new())
        }),
    );
    Response::from_parts(parts, axum::body::Body::from_stream(stream))
}

/// Serves the admin API on `listener` (HTTP/1.1 only: one request at a time per
/// connection, a header read timeout of 10 s) until `shutdown`; with `debug`, the
/// `/debug/*` pages only there (and `/healthz`, so it can be checked), not on `listener`.
pub(crate) async fn serve(
    listener: TcpListener,
    debug: Option<TcpListener>,
    state: AdminState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let Some(debug) = debug else {
        return serve_app(listener, router(state), shutdown).await;
    };
    let public = public_routes().with_state(state.clone());
    let debug_app = debug_routes()
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(state);
    tokio::try_join!(
        serve_app(listener, public, shutdown.clone()),
        serve_app(debug, debug_app, shutdown),
    )
    .map(|_| ())
}

async fn serve_app(
    listener: TcpListener,
    app: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    use axum::serve::Listener;
    let mut listener = crate::admin_listener::BoundedAdminListener::new(
        listener,
        crate::admin_listener::AdminLimits::default(),
    );
    loop {
        let (io, _peer) = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            accepted = listener.accept() => accepted,
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(hyper_util::rt::TokioIo::new(io), service)
                .await;
        });
    }
}

async fn readyz(State(state): State<AdminState>) -> Response {
    let version = state
        .snapshots
        .borrow()
        .as_ref()
        .map(|s| s.version().to_string());
    let synced = state.live.source.borrow().synced;
    readiness(&state.components.down(), synced, version.as_deref()).into_response()
}

/// `/readyz`'s answer: every component up, the source synced, a snapshot built.
fn readiness(
    down: &[(&'static str, String)],
    synced: bool,
    version: Option<&str>,
) -> (StatusCode, String) {
    if !down.is_empty() {
        let mut text =
            String::from("not ready: a component is down (restarting; see /debug/state)\n");
        for (name, why) in down {
            text.push_str(&format!("{name}: {why}\n"));
        }
        return (StatusCode::SERVICE_UNAVAILABLE, text);
    }
    match version {
        Some(v) => (StatusCode::OK, format!("ready: snapshot {v}\n")),
        None if !synced => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the source has not delivered its first full state (see /debug/state)\n"
                .into(),
        ),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: no snapshot built yet\n".into(),
        ),
    }
}

async fn metrics(State(state): State<AdminState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn snapshot(State(state): State<AdminState>) -> Response {
    let Some(snapshot) = state.snapshots.borrow().clone() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "no snapshot yet"})),
        )
            .into_response();
    };
    let mut types = serde_json::Map::new();
    for ty in ResourceType::ALL {
        let resources: Vec<_> = snapshot
            .resources(ty)
            .values()
            .map(|r| {
                json!({
                    "name": &*r.name,
                    "version": &*r.version,
                    "cluster_refs": r.cluster_refs.iter().map(|c| &**c).collect::<Vec<_>>(),
                    "resource": r.to_json(),
                })
            })
            .collect();
        types.insert(
            ty.label().into(),
            json!({"type_url": ty.type_url(), "resources": resources}),
        );
    }
    Json(json!({"version": snapshot.version(), "types": types})).into_response()
}

/// `/debug/clients`' query: one stream, or one node's streams, whole.
#[derive(Debug, Default, serde::Deserialize)]
struct ClientsQuery {
    stream: Option<u64>,
    node: Option<String>,
}

/// The most bytes a `/debug/clients` page writes: a client past it is left out and the
/// page says so (`truncated`). A summary is a few hundred bytes, so 10,000 Envoys fit.
pub(crate) const DEBUG_PAGE_MAX_BYTES: usize = 16 * 1024 * 1024;

async fn clients(
    State(state): State<AdminState>,
    axum::extract::Query(query): axum::extract::Query<ClientsQuery>,
) -> Response {
    let clients = state.clients.clone();
    match query {
        ClientsQuery {
            stream: Some(id),
            node: None,
        } => match clients.report(id, state.snapshots.borrow().clone().as_deref()) {
            Some(report) => Json(report).into_response(),
            None => (
                StatusCode::NOT_FOUND,
                Json(json!({"error": format!("no stream {id} is connected")})),
            )
                .into_response(),
        },
        ClientsQuery {
            stream: None,
            node: Some(node),
        } => {
            let ids = clients.streams_of(&node);
            let snapshots = state.snapshots.clone();
            client_page(ids, DEBUG_PAGE_MAX_BYTES, move |id| {
                let snapshot = snapshots.borrow().clone();
                clients.report(id, snapshot.as_deref()).map(|r| json!(r))
            })
        }
        ClientsQuery {
            stream: None,
            node: None,
        } => {
            // Each client against the snapshot served when it is written: a page read
            // slowly holds no old snapshot.
            let ids = clients.stream_ids();
            let snapshots = state.snapshots.clone();
            client_page(ids, DEBUG_PAGE_MAX_BYTES, move |id| {
                let snapshot = snapshots.borrow().clone();
                clients.summary(id, snapshot.as_deref()).map(|r| json!(r))
            })
        }
        _ => (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "ask for stream=ID or node=ID, not both"})),
        )
            .into_response(),
    }
}

/// `{"total": N, "clients": [...], "shown": n, "truncated": bool}`, each client's JSON
/// made only when the connection takes the page that far (in chunks of about 64 KiB), and
/// none once `max_bytes` are written. A client gone meanwhile is left out.
fn client_page(
    ids: Vec<u64>,
    max_bytes: usize,
    view: impl Fn(u64) -> Option<Value> + Send + 'static,
) -> Response {
    const CHUNK: usize = 64 * 1024;
    struct Page<F> {
        ids: std::vec::IntoIter<u64>,
        view: F,
        written: usize,
        shown: usize,
        truncated: bool,
        done: bool,
    }
    let total = ids.len();
    let page = Page {
        ids: ids.into_iter(),
        view,
        written: 0,
        shown: 0,
        truncated: false,
        done: false,
    };
    let head = bytes::Bytes::from(format!("{{\"total\":{total},\"clients\":["));
    let body = futures::stream::unfold(page, move |mut page| async move {
        if page.done {
            return None;
        }
        let mut chunk = Vec::with_capacity(CHUNK);
        while chunk.len() < CHUNK {
            let Some(id) = page.ids.next() else {
                page.done = true;
                break;
            };
            let Some(client) = (page.view)(id) else {
                continue;
            };
            let text = client.to_string();
            if page.written + chunk.len() + text.len() + 1 > max_bytes {
                page.truncated = true;
                page.done = true;
                break;
            }
            if page.shown > 0 {
                chunk.push(b',');
            }
            chunk.extend_from_slice(text.as_bytes());
            page.shown += 1;
        }
        page.written += chunk.len();
        if page.done {
            chunk.extend_from_slice(
                format!(
                    "],\"shown\":{},\"truncated\":{}}}",
                    page.shown, page.truncated
                )
                .as_bytes(),
            );
        }
        Some((
            Ok::<_, std::convert::Infallible>(bytes::Bytes::from(chunk)),
            page,
        ))
    });
    let body = futures::StreamExt::chain(
        futures::stream::once(async move { Ok::<_, std::convert::Infallible>(head) }),
        body,
    );
    (
        [(header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// The latest value of each live channel, taken once for one `/debug/state` page.
struct LiveNow<'a> {
    live: &'a LiveViews,
    probes: Arc<ProbeStates>,
    dashboards: Arc<DashboardStates>,
    health: Arc<HealthMap>,
}

impl LiveNow<'_> {
    /// An endpoint (proxy or replica) at `address` in the Envoy cluster `envoy`: its
    /// probe and its endpoint's health.
    fn endpoint(&self, envoy: &str, address: std::net::SocketAddr) -> Value {
        json!({
            "address": address.to_string(),
            "probe": self.probes.proxies.get(&address),
            "endpoint": self.health.endpoints.get(&(envoy.to_string(), address)),
        })
    }

    fn proxy(&self, service: &RayService, cluster: &RayCluster, p: &Proxy) -> Value {
        let mut proxy = self.endpoint(&service.envoy_cluster_name(&cluster.name), p.address);
        proxy["node_type"] = json!(p.node_type.as_str());
        // The same node's gRPC proxy: its own probe, its own endpoint.
        if let Some(grpc) = p.grpc {
            proxy["grpc"] = self.endpoint(&service.envoy_grpc_cluster_name(&cluster.name), grpc);
        }
        proxy
    }

    fn application(&self, service: &RayService, cluster: &RayCluster, app: &Application) -> Value {
        let replicas = |protocol: Protocol| {
            let envoy = service.envoy_app_cluster_name(&cluster.name, &app.name, protocol);
            let list: Vec<_> = app
                .replicas(protocol)
                .iter()
                .map(|r| self.endpoint(&envoy, *r))
                .collect();
            json!({"envoy_cluster": envoy, "ready": self.health.cluster(&envoy).ready, "replicas": list})
        };
        json!({
            "name": app.name,
            "route_prefix": app.route_prefix,
            "http": cluster.direct_ingress.then(|| replicas(Protocol::Http)),
            "grpc": (cluster.direct_ingress && cluster.serves_grpc()).then(|| replicas(Protocol::Grpc)),
        })
    }

    fn cluster(&self, service: &RayService, cluster: &RayCluster) -> Value {
        let name = service.envoy_cluster_name(&cluster.name);
        let grpc_name = service.envoy_grpc_cluster_name(&cluster.name);
        let health = &self.health;
        let role = if cluster.name == service.active_cluster {
            "active"
        } else if service.pending_cluster.as_deref() == Some(cluster.name.as_str()) {
            "pending"
        } else {
            "other"
        };
        json!({
            "name": cluster.name,
            "envoy_cluster": name,
            "role": role,
            "fail_open": health.cluster(&name).fail_open,
            "ready_proxies": health.cluster(&name).ready,
            "grpc": cluster.serves_grpc().then(|| json!({
                "envoy_cluster": grpc_name,
                "fail_open": health.cluster(&grpc_name).fail_open,
                "ready_proxies": health.cluster(&grpc_name).ready,
            })),
            "proxies_from": if cluster.discover { "dashboard" } else { "source" },
            "proxies": cluster.proxies.iter().map(|p| self.proxy(service, cluster, p)).collect::<Vec<_>>(),
            "direct_ingress": cluster.direct_ingress,
            "applications": cluster
                .applications
                .iter()
                .map(|app| self.application(service, cluster, app))
                .collect::<Vec<_>>(),
            "dashboard": self.dashboards.clusters.get(&name).map(|d| {
                let mut d = json!(d);
                // Polls that change nothing are not published: the time of the last
                // answer comes from the poller itself.
                if let Some(at) = self.live.dashboards_answered.get(&name) {
                    d["last_success_unix"] = json!(at);
                }
                d
            }),
        })
    }

    fn service(&self, service: &RayService, switchover: &Switchover) -> Value {
        let apps_prefix = crate::translate::app_switch_key(&service.key(), "");
        json!({
            "name": service.key(),
            "switchover": switchover.services.get(&service.key()),
            // Each application that moves on its own readiness while the RayService's
            // traffic moves.
            "application_switchovers": switchover
                .services
                .range(apps_prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&apps_prefix))
                .map(|(k, v)| (k[service.key().len() + 1..].to_string(), v))
                .collect::<std::collections::BTreeMap<_, _>>(),
            "head_proxy": format!("{:?}", service.policy.head_proxy).to_lowercase(),
            "clusters": service.clusters.iter().map(|c| self.cluster(service, c)).collect::<Vec<_>>(),
        })
    }
}

async fn live_state(State(state): State<AdminState>) -> Response {
    let live = &state.live;
    let model = live.models.borrow().clone();
    let switchover = live.switchover.borrow().clone();
    let now_views = LiveNow {
        live,
        probes: live.probes.borrow().clone(),
        dashboards: live.dashboards.borrow().clone(),
        health: live.health.borrow().clone(),
    };
    let services: Vec<Value> = model
        .services()
        .iter()
        .map(|service| now_views.service(service, &switchover))
        .collect();
    let source = live.source.borrow().clone();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let watches: Vec<_> = source
        .watches
        .iter()
        .map(|w| {
            let mut v = json!(w);
            // How old the state this watch serves may be: since it started failing.
            v["stale_seconds"] = json!(w.failing_since_unix.map(|t| (now - t).max(0.0)));
            v
        })
        .collect();
    let refused = live.refused.borrow().clone();
    let refused = crate::live::discovery::RefusedSummary::of(&refused);
    Json(json!({
        "source": {
            "source": source.source,
            "synced": source.synced,
            "watches": watches,
            "unrouted": source.unrouted,
            "problems": source.problems,
            "kuberay_application_statuses": source.kuberay_application_statuses,
        },
        "components": state.components.report(),
        "rayservices": services,
        "refused_proxies": refused.shown,
        "refused_proxies_shown": refused.shown.len(),
        "refused_proxies_total": refused.total,
        "refused_proxies_by_reason": refused.by_reason,
        "probes_complete": now_views.probes.complete,
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn send(port: u16, request: &[u8]) -> tokio::net::TcpStream {
        let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        c.write_all(request).await.unwrap();
        c
    }

    /// Clients that ask for big debug pages and never read them hold at most
    /// `at_once` pages; one more gets 503, `/healthz` answers, and a page read whole is
    /// the page. The admin port speaks HTTP/1 only: an HTTP/2 preface gets no HTTP/2.
    #[tokio::test]
    async fn big_pages_nobody_reads_are_bounded_and_the_admin_port_is_http1() {
        let page = "x".repeat(8 << 20);
        let pages = bounded_pages(
            Router::new().route("/debug/big", get(move || async move { page.clone() })),
            2,
        );
        let app = Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .merge(pages);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(serve_app(listener, app, CancellationToken::new()));
        let big = b"GET /debug/big HTTP/1.1\r\nHost: x\r\n\r\n";
        let _held = [send(port, big).await, send(port, big).await];
        let mut third = None;
        for _ in 0..100 {
            let mut c = send(port, big).await;
            let mut head = [0u8; 12];
            c.read_exact(&mut head).await.unwrap();
            if &head == b"HTTP/1.1 503" {
                third = Some(head);
                break;
            }
            // The first two had not reached the handler yet: try again.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            third.is_some(),
            "a third big page nobody reads was answered"
        );
        let mut c = send(port, b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n").await;
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        assert!(out.ends_with("ok\n"), "{out}");
        // HTTP/2 (prior knowledge) is not spoken: the answer, if any, is HTTP/1.
        let mut c = send(port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut out)).await;
        assert!(
            out.is_empty() || out.starts_with(b"HTTP/1.1 "),
            "{:?}",
            String::from_utf8_lossy(&out[..out.len().min(40)])
        );
    }

    /// A client page is made as it is read (a reader that stopped after the first chunk
    /// made about a chunk's worth of views), stays JSON when clients are gone, and stops at
    /// its byte cap saying so.
    #[tokio::test]
    async fn a_client_page_is_made_as_read_and_cut_at_its_cap() {
        use http_body_util::BodyExt;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let made = Arc::new(AtomicUsize::new(0));
        let counter = made.clone();
        let view = move |id: u64| {
            counter.fetch_add(1, Ordering::Relaxed);
            // Every third client went away meanwhile.
            (id % 3 != 1).then(|| json!({"stream_id": id, "pad": "p".repeat(1000)}))
        };
        let mut body = client_page((0..10_000).collect(), 1 << 20, view).into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(first.starts_with(b"{\"total\":10000,\"clients\":["));
        let second = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(
            made.load(Ordering::Relaxed) < 200,
            "{} views made for one chunk",
            made.load(Ordering::Relaxed)
        );
        let rest = body.collect().await.unwrap().to_bytes();
        let page = [first.to_vec(), second.to_vec(), rest.to_vec()].concat();
        assert!(page.len() <= (1 << 20) + 64 * 1024, "{}", page.len());
        let page: Value = serde_json::from_slice(&page).unwrap_or_else(|e| panic!("not JSON: {e}"));
        let shown = page["shown"].as_u64().unwrap();
        assert_eq!(page["clients"].as_array().unwrap().len() as u64, shown);
        assert!(shown > 500 && shown < 1100, "{shown}");
        assert_eq!(page["truncated"], true);
        assert!(page["clients"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["stream_id"].as_u64().unwrap() % 3 != 1));
        // Under its cap, the whole list and not truncated; none at all is JSON too.
        for (ids, shown) in [
            ((0..10).collect::<Vec<u64>>(), 7),
            (vec![], 0),
            (vec![1], 0),
        ] {
            let page = client_page(ids, 1 << 20, |id| {
                (id % 3 != 1).then(|| json!({"stream_id": id}))
            });
            let bytes = page.into_body().collect().await.unwrap().to_bytes();
            let page: Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(page["shown"], shown, "{page}");
            assert_eq!(page["truncated"], false, "{page}");
        }
    }

    #[test]
    fn a_component_that_is_down_makes_readyz_fail_and_names_it() {
        assert_eq!(readiness(&[], true, Some("v1")).0, StatusCode::OK);
        let (code, text) = readiness(&[("prober", "panicked: boom".into())], true, Some("v1"));
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(text.contains("prober: panicked: boom"), "{text}");
        assert_eq!(
            readiness(&[], false, None).0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert!(readiness(&[], true, None).1.contains("no snapshot"));
    }
}

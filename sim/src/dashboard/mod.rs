//! A simulated Ray dashboard: `GET /api/serve/applications/` as Ray 2.60 answers it, for
//! tests and the demo.
//!
//! Tests script it ([`SimDashboard::set_app`], [`SimDashboard::deploy_app`],
//! [`SimDashboard::set_proxy`], [`SimDashboard::set_mode`], ...) while it serves; every
//! request renders the current state, so a change is visible to the next request.
//!
//! Invariants:
//!
//! - The answer has the shape of the captures in `tests/fixtures/ray-serve-2.60/`: the
//!   top-level keys, and each application's and proxy's keys, are a superset of those in
//!   `02-running.json` (a test checks this). With no applications and no proxies it is
//!   exactly `01-no-serve.json`, Serve not started.
//! - Statuses are strings spelled as Ray spells them and are passed through unchecked,
//!   so tests can also serve statuses a client does not know.
//! - Generated ids (node, actor, worker) are deterministic functions of the node IP and
//!   application name, in the same formats as the captures.
//! - The proxies it lists are in `proxies` (every one, whatever its status) and, as
//!   targets of the one HTTP target group, only while HEALTHY, as Ray lists them: a
//!   STARTING proxy is not a target yet and a DRAINING one no longer is. The controller
//!   (`controller_info`) runs on the head proxy's node, else the first proxy's.
//! - Real Ray runs one proxy per node, all on `http_options.port`. Tests on one host may
//!   also place proxies at any `ip:port` ([`SimDashboard::add_proxy`]): such a proxy is
//!   its own node (node id from `ip:port`), listed as a target on its own port.
//! - gRPC is off unless [`SimDashboard::set_grpc_options`] enables it, and then the
//!   answer is what section 3 of `proto/ray-serve-grpc-research.md` derives from Ray's
//!   code (no capture with gRPC enabled exists yet): `grpc_options` carries the port and
//!   servicer functions, and a second target group, `"protocol": "gRPC"`, follows the
//!   HTTP one with the same (HEALTHY) proxies on their gRPC ports (`grpc_options.port`,
//!   or a port of their own set with [`SimDashboard::set_proxy_grpc_port`]). With gRPC
//!   off, `grpc_options` is the captures' (`port: 9000`, no servicer functions) and
//!   there is no gRPC group: Ray reports the port even when no gRPC server runs.
//! - Direct ingress is off unless [`SimDashboard::set_direct_ingress`] turns it on; then
//!   `target_groups` is Ray 2.60's with `RAY_SERVE_ENABLE_DIRECT_INGRESS=1`
//!   (`tests/fixtures/ray-serve-2.60/direct-ingress/`): per application (by name) an HTTP
//!   group of its ingress replicas ([`SimDashboard::set_app_replicas`],
//!   `SERVE_REPLICA::<app>#<Deployment>#<id>`) and, with gRPC on, a gRPC group of their
//!   gRPC ports; an application with no replica gets the proxies' groups instead (Ray's
//!   fallback); with no application, the proxies' groups as without direct ingress. The
//!   replicas themselves are simulated proxies serving that one application.
//! - Clones share one state; [`DashboardMode::Hang`] requests are released when the mode
//!   changes or when [`SimDashboard::serve`] is shut down, so shutdown never waits forever.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::NodeType;

mod render;

pub use render::node_id_for;
use render::unix_now;

/// The path the dashboard serves the Serve status on.
const APPLICATIONS_PATH: &str = "/api/serve/applications/";

/// The Serve HTTP proxies' port, as in the captures.
const HTTP_PORT: u16 = 8000;

/// The Serve gRPC proxies' port, `grpc_options.port`, as in the captures.
const GRPC_PORT: u16 = 9000;

/// How the simulated dashboard answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DashboardMode {
    /// 200 with the Serve status.
    #[default]
    Normal,
    /// 503, as when the dashboard cannot reach the Serve controller.
    Unavailable,
    /// Accepts the request and never answers (until the mode changes or shutdown).
    Hang,
    /// 200 with a body that is not JSON (an HTML page).
    Garbage,
}

/// A simulated Ray dashboard. Cheap to clone; clones share the state.
#[derive(Debug, Clone)]
pub struct SimDashboard {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<SimState>,
    /// Woken when the mode changes, to release hung requests.
    mode_changed: Notify,
    /// When the simulated controller started.
    started: SystemTime,
}

#[derive(Debug)]
struct SimState {
    apps: BTreeMap<String, SimApp>,
    /// `(node IP, port)` → proxy; no port: on `http_port`, as Ray's proxies.
    proxies: BTreeMap<(String, Option<u16>), SimProxy>,
    /// `http_options.port`.
    http_port: u16,
    /// `grpc_options.port`.
    grpc_port: u16,
    /// `grpc_options.grpc_servicer_functions`: gRPC is on when there are some and the
    /// port is not 0, as Ray decides (`is_grpc_enabled`).
    grpc_servicer_functions: Vec<String>,
    /// Ray's direct ingress (`RAY_SERVE_ENABLE_DIRECT_INGRESS=1`): a target group per
    /// application and protocol.
    direct_ingress: bool,
    /// The top-level `target_capacity` (percent), when set.
    target_capacity: Option<f64>,
    mode: DashboardMode,
    requests: u64,
}

impl Default for SimState {
    fn default() -> Self {
        SimState {
            apps: BTreeMap::new(),
            proxies: BTreeMap::new(),
            http_port: HTTP_PORT,
            grpc_port: GRPC_PORT,
            grpc_servicer_functions: Vec::new(),
            direct_ingress: false,
            target_capacity: None,
            mode: DashboardMode::default(),
            requests: 0,
        }
    }
}

#[derive(Debug)]
struct SimProxy {
    status: String,
    /// Runs on the head node: the controller's.
    head: bool,
    /// Its gRPC port, if not `grpc_options.port` (a proxy placed at its own port).
    grpc_port: Option<u16>,
}

#[derive(Debug)]
struct SimApp {
    route_prefix: String,
    status: String,
    /// `(when, status)`: the status the app reports from `when` on.
    settles: Option<(Instant, String)>,
    last_deployed_time_s: f64,
    /// Its RUNNING ingress replicas, with direct ingress: (HTTP port, gRPC port).
    replicas: Vec<(SocketAddr, Option<SocketAddr>)>,
    /// Its deployment's size, as `deployments` reports it.
    size: AppSize,
}

/// The size of an application's (one) deployment: `deployment_config.num_replicas` and
/// `max_ongoing_requests`, and how many of its replicas are RUNNING while the
/// application is (by default all of them; while it deploys they are STARTING). Serve's
/// `target_capacity` ([`SimDashboard::set_target_capacity`]) scales the replicas it runs
/// (`target_num_replicas`) as Ray does; `num_replicas` stays the full size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppSize {
    pub num_replicas: u32,
    pub running: u32,
    pub max_ongoing_requests: u32,
}

impl Default for AppSize {
    /// As in the captures: one replica, 5 requests at a time.
    fn default() -> Self {
        AppSize {
            num_replicas: 1,
            running: 1,
            max_ongoing_requests: 5,
        }
    }
}

impl SimApp {
    fn status_at(&self, now: Instant) -> &str {
        match &self.settles {
            Some((when, then)) if now >= *when => then,
            _ => &self.status,
        }
    }
}

impl Default for SimDashboard {
    fn default() -> Self {
        Self::new()
    }
}

impl SimDashboard {
    /// A dashboard with Serve not started: no applications, no proxies, mode `Normal`.
    pub fn new() -> Self {
        SimDashboard {
            shared: Arc::new(Shared {
                state: Mutex::new(SimState::default()),
                mode_changed: Notify::new(),
                started: SystemTime::now(),
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, SimState> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds or replaces application `name` with `status` (spelled as Ray does:
    /// `RUNNING`, `DEPLOY_FAILED`, ...). The message is empty except for `DEPLOY_FAILED`
    /// and `UNHEALTHY`, which get Ray's.
    pub fn set_app(&self, name: &str, route_prefix: &str, status: &str) {
        self.set_app_sized(name, route_prefix, status, AppSize::default());
    }

    /// [`SimDashboard::set_app`] with the deployment's size, in one step (no answer in
    /// between shows the default size).
    pub fn set_app_sized(&self, name: &str, route_prefix: &str, status: &str, size: AppSize) {
        self.state().apps.insert(
            name.to_string(),
            SimApp {
                route_prefix: route_prefix.to_string(),
                status: status.to_string(),
                settles: None,
                last_deployed_time_s: unix_now(),
                replicas: Vec::new(),
                size,
            },
        );
    }

    /// Deploys application `name`: it reports `DEPLOYING` until `deploying_for` has
    /// passed since this call, then `then` (`RUNNING`, `DEPLOY_FAILED` or `UNHEALTHY`).
    pub fn deploy_app(&self, name: &str, route_prefix: &str, deploying_for: Duration, then: &str) {
        self.state().apps.insert(
            name.to_string(),
            SimApp {
                route_prefix: route_prefix.to_string(),
                status: "DEPLOYING".to_string(),
                settles: Some((Instant::now() + deploying_for, then.to_string())),
                last_deployed_time_s: unix_now(),
                replicas: Vec::new(),
                size: AppSize::default(),
            },
        );
    }

    /// Turns Ray's direct ingress on or off (off by default): on, `target_groups` lists a
    /// group per application and protocol, as `02-running.json` of
    /// `tests/fixtures/ray-serve-2.60/direct-ingress/` does.
    pub fn set_direct_ingress(&self, on: bool) {
        self.state().direct_ingress = on;
    }

    /// Sets the RUNNING ingress replicas of application `name` (each an HTTP port and,
    /// with gRPC on, a gRPC port), listed in its target groups with direct ingress on;
    /// with none, the application is on the proxies' target groups (Ray's fallback).
    /// False if there is no such application.
    pub fn set_app_replicas(
        &self,
        name: &str,
        replicas: &[(SocketAddr, Option<SocketAddr>)],
    ) -> bool {
        match self.state().apps.get_mut(name) {
            Some(app) => {
                app.replicas = replicas.to_vec();
                true
            }
            None => false,
        }
    }

    /// Sets the size of application `name`'s deployment (see [`AppSize`]); false if
    /// there is no such application.
    pub fn set_app_size(&self, name: &str, size: AppSize) -> bool {
        match self.state().apps.get_mut(name) {
            Some(app) => {
                app.size = size;
                true
            }
            None => false,
        }
    }

    /// Sets Serve's `target_capacity` (percent; `None`: unset, as by default).
    pub fn set_target_capacity(&self, percent: Option<f64>) {
        self.state().target_capacity = percent;
    }

    /// Removes application `name`, if present.
    pub fn remove_app(&self, name: &str) {
        self.state().apps.remove(name);
    }

    /// Sets the status of every Serve proxy on IP `node_ip` to `status` (`STARTING`,
    /// `HEALTHY`, `UNHEALTHY` or `DRAINING`); with none there, adds one, on
    /// `http_options.port`, whose node id is [`node_id_for`]`(node_ip)`.
    pub fn set_proxy(&self, node_ip: &str, status: &str) {
        let mut state = self.state();
        let mut found = false;
        for ((ip, _), proxy) in state.proxies.iter_mut() {
            if ip == node_ip {
                proxy.status = status.to_string();
                found = true;
            }
        }
        if !found {
            state.proxies.insert(
                (node_ip.to_string(), None),
                SimProxy {
                    status: status.to_string(),
                    head: false,
                    grpc_port: None,
                },
            );
        }
    }

    /// Removes every proxy on IP `node_ip`.
    pub fn remove_proxy(&self, node_ip: &str) {
        self.state().proxies.retain(|(ip, _), _| ip != node_ip);
    }

    /// Adds or replaces the proxy listening at `address`, a node of its own (node id
    /// [`node_id_for`]`("ip:port")`), with `status`; a `Head` proxy's node runs the
    /// controller.
    pub fn add_proxy(&self, address: SocketAddr, node_type: NodeType, status: &str) {
        self.state().proxies.insert(
            (address.ip().to_string(), Some(address.port())),
            SimProxy {
                status: status.to_string(),
                head: node_type == NodeType::Head,
                grpc_port: None,
            },
        );
    }

    /// Sets the port of the gRPC proxy beside the proxy added at `address` (on the same
    /// node, so the same IP), listed while gRPC is on instead of `grpc_options.port`;
    /// false if there is no proxy at `address`.
    pub fn set_proxy_grpc_port(&self, address: SocketAddr, grpc_port: u16) -> bool {
        let key = (address.ip().to_string(), Some(address.port()));
        match self.state().proxies.get_mut(&key) {
            Some(proxy) => {
                proxy.grpc_port = Some(grpc_port);
                true
            }
            None => false,
        }
    }

    /// Sets `grpc_options`: the gRPC proxies' `port` and the `grpc_servicer_functions`
    /// (import paths, e.g. `echo_pb2_grpc.add_EchoServicer_to_server`). gRPC is on, and
    /// the gRPC target group listed, when there are servicer functions and the port is
    /// not 0 (Ray's `is_grpc_enabled`); by default it is off (`9000`, none).
    pub fn set_grpc_options(&self, port: u16, servicer_functions: &[&str]) {
        let mut state = self.state();
        state.grpc_port = port;
        state.grpc_servicer_functions = servicer_functions.iter().map(|f| f.to_string()).collect();
    }

    /// Sets the status of the proxy added at `address`; false if there is none.
    pub fn set_proxy_status(&self, address: SocketAddr, status: &str) -> bool {
        let key = (address.ip().to_string(), Some(address.port()));
        match self.state().proxies.get_mut(&key) {
            Some(proxy) => {
                proxy.status = status.to_string();
                true
            }
            None => false,
        }
    }

    /// Removes the proxy added at `address`, if present.
    pub fn remove_proxy_at(&self, address: SocketAddr) {
        self.state()
            .proxies
            .remove(&(address.ip().to_string(), Some(address.port())));
    }

    /// Sets `http_options.port`, where proxies set with [`set_proxy`](Self::set_proxy)
    /// listen (8000 by default, as in the captures).
    pub fn set_http_port(&self, port: u16) {
        self.state().http_port = port;
    }

    /// Changes how requests are answered, from the next request on; requests hung by
    /// [`DashboardMode::Hang`] are answered in the new mode.
    pub fn set_mode(&self, mode: DashboardMode) {
        self.state().mode = mode;
        self.shared.mode_changed.notify_waiters();
    }

    /// How many requests for the Serve status have arrived (whatever the mode).
    pub fn requests(&self) -> u64 {
        self.state().requests
    }

    /// The dashboard's routes: `GET /api/serve/applications/`; anything else is 404.
    pub fn router(&self) -> Router {
        self.router_with(None)
    }

    fn router_with(&self, shutdown: Option<CancellationToken>) -> Router {
        Router::new()
            .route(APPLICATIONS_PATH, get(applications))
            .with_state(Ctx {
                sim: self.clone(),
                shutdown,
            })
    }

    /// Serves [`router`](Self::router) on `listener` until `shutdown`; requests hung by
    /// [`DashboardMode::Hang`] are then answered 503 so shutdown completes.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        let router = self.router_with(Some(shutdown.clone()));
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
    }
}
#[derive(Clone)]
struct Ctx {
    sim: SimDashboard,
    shutdown: Option<CancellationToken>,
}

async fn applications(State(ctx): State<Ctx>) -> Response {
    ctx.sim.state().requests += 1;
    loop {
        // Register for the wake-up before reading the mode, so a change in between is
        // not missed.
        let changed = ctx.sim.shared.mode_changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let mode = ctx.sim.state().mode;
        return match mode {
            DashboardMode::Normal => (
                [(header::CONTENT_TYPE, "application/json; charset=utf-8")],
                ctx.sim.render().to_string(),
            )
                .into_response(),
            DashboardMode::Unavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "Failed to get a response from the Serve controller. Try again later.",
            )
                .into_response(),
            DashboardMode::Garbage => (
                [(header::CONTENT_TYPE, "text/html")],
                "<!doctype html><html lang=\"en\"><head><title>Ray Dashboard</title></head>\
                 <body><div id=\"root\"></div></body></html>",
            )
                .into_response(),
            DashboardMode::Hang => {
                tokio::select! {
                    _ = &mut changed => continue,
                    _ = shutting_down(ctx.shutdown.as_ref()) => {
                        StatusCode::SERVICE_UNAVAILABLE.into_response()
                    }
                }
            }
        };
    }
}

async fn shutting_down(token: Option<&CancellationToken>) {
    match token {
        Some(token) => token.cancelled().await,
        None => std::future::pending().await,
    }
}

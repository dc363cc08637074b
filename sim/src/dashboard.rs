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
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::NodeType;

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
        self.state().apps.insert(
            name.to_string(),
            SimApp {
                route_prefix: route_prefix.to_string(),
                status: status.to_string(),
                settles: None,
                last_deployed_time_s: unix_now(),
                replicas: Vec::new(),
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

    /// The controller's health metrics as Ray 2.60 reports them: plausible figures, only
    /// their shape matters to ray-xds.
    fn controller_health_metrics(&self, uptime_s: f64, apps: usize) -> Value {
        let stats = |mean: f64| json!({"mean": mean, "std": mean / 2.0, "min": mean / 10.0, "max": mean * 5.0});
        json!({
            "timestamp": unix_now(),
            "controller_start_time": unix_time(self.shared.started),
            "uptime_s": uptime_s,
            "last_control_loop_time": unix_now(),
            "num_control_loops": (uptime_s * 10.0) as u64,
            "loop_duration_s": stats(0.006),
            "loops_per_second": 8.9,
            "last_sleep_duration_s": 0.1,
            "expected_sleep_duration_s": 0.1,
            "event_loop_delay_s": 0.0007,
            "num_asyncio_tasks": 8 + 2 * apps,
            "handle_ingest_duration_ms": {},
            "replica_ingest_duration_ms": {},
            "metrics_decompress_duration_ms": {},
            "columnar_decode_duration_ms": {},
            "handle_reports_received": 0,
            "replica_reports_received": 0,
            "ingest_reports_received": 0,
            "ingest_cpu_fraction": 0.0,
            "deployment_state_update_duration_s": stats(0.001),
            "application_state_update_duration_s": stats(0.001),
            "proxy_state_update_duration_s": stats(0.00006),
            "node_update_duration_s": stats(0.00005),
            "handle_metrics_delay_ms": {},
            "replica_metrics_delay_ms": {},
            "process_memory_mb": 140.0,
        })
    }

    /// The Serve status as the dashboard would answer it now.
    fn render(&self) -> Value {
        let now = Instant::now();
        let state = self.state();
        if state.apps.is_empty() && state.proxies.is_empty() {
            // Serve not started (01-no-serve.json).
            return json!({
                "controller_info": {},
                "proxies": {},
                "applications": {},
                "target_capacity": null,
            });
        }

        let (head_key, head_ip) = state
            .proxies
            .iter()
            .find(|(_, p)| p.head)
            .or_else(|| state.proxies.iter().next())
            .map(|(key, _)| (node(key), key.0.clone()))
            .unwrap_or_else(|| ("127.0.0.1".to_string(), "127.0.0.1".to_string()));
        let head_id = node_id_for(&head_key);

        let grpc_enabled = state.grpc_port > 0 && !state.grpc_servicer_functions.is_empty();
        let (proxies, targets, grpc_targets) = proxy_entries(&state);

        let applications: Map<String, Value> = state
            .apps
            .iter()
            .map(|(name, app)| (name.clone(), render_app(name, app, app.status_at(now))))
            .collect();

        let uptime_s = SystemTime::now()
            .duration_since(self.shared.started)
            .unwrap_or_default()
            .as_secs_f64();
        // One group per protocol, HTTP first, as Ray's `get_target_groups`.
        let group = |targets: Vec<Value>, protocol: &str| {
            json!({
                "targets": targets,
                "route_prefix": "/",
                "protocol": protocol,
                "app_name": "",
                "ingress_request_router_targets": [],
                "ingress_deployment_name": "",
            })
        };
        let mut target_groups = vec![group(targets.clone(), "HTTP")];
        if grpc_enabled {
            target_groups.push(group(grpc_targets.clone(), "gRPC"));
        }
        if state.direct_ingress && !state.apps.is_empty() {
            target_groups = direct_ingress_groups(&state, &targets, &grpc_targets, grpc_enabled);
        }

        json!({
            "controller_info": {
                "node_id": head_id,
                "node_ip": head_ip,
                "node_instance_id": "",
                "actor_id": actor_id_for("controller", &head_key),
                "actor_name": "SERVE_CONTROLLER_ACTOR",
                "worker_id": hex_id(&format!("worker/controller/{head_key}"), 56),
                "log_file_path": "/serve/controller_11660.log",
            },
            "proxy_location": "EveryNode",
            "http_options": {
                "host": "0.0.0.0",
                "port": state.http_port,
                "root_path": "",
                "request_timeout_s": null,
                "keep_alive_timeout_s": 90,
                "ssl_keyfile": null,
                "ssl_certfile": null,
                "ssl_keyfile_password": null,
                "ssl_ca_certs": null,
            },
            "grpc_options": {
                "port": state.grpc_port,
                "grpc_servicer_functions": state.grpc_servicer_functions,
                "request_timeout_s": null,
                "enable_reflection": true,
            },
            "proxies": proxies,
            "applications": applications,
            "target_capacity": null,
            "target_groups": target_groups,
            "controller_health_metrics": self.controller_health_metrics(uptime_s, state.apps.len()),
            "restores_unset_config_options": true,
        })
    }
}

/// A proxy's node: its IP, or `ip:port` for one placed at its own port.
fn node((ip, port): &(String, Option<u16>)) -> String {
    match port {
        Some(port) => format!("{ip}:{port}"),
        None => ip.clone(),
    }
}

/// The `proxies` map, and the HTTP and gRPC targets of the proxies that are HEALTHY.
fn proxy_entries(state: &SimState) -> (Map<String, Value>, Vec<Value>, Vec<Value>) {
    let mut proxies = Map::new();
    let mut targets = Vec::new();
    let mut grpc_targets = Vec::new();
    for (key, proxy) in &state.proxies {
        let (ip, node_key) = (&key.0, node(key));
        let node_id = node_id_for(&node_key);
        let actor_name = format!("SERVE_PROXY_ACTOR-{node_id}");
        if proxy.status == "HEALTHY" {
            targets.push(json!({
                "ip": ip,
                "port": key.1.unwrap_or(state.http_port),
                "instance_id": "",
                "name": actor_name,
            }));
            grpc_targets.push(json!({
                "ip": ip,
                "port": proxy.grpc_port.unwrap_or(state.grpc_port),
                "instance_id": "",
                "name": actor_name,
            }));
        }
        proxies.insert(
            node_id.clone(),
            json!({
                "node_id": node_id,
                "node_ip": ip,
                "node_instance_id": "",
                "actor_id": actor_id_for("proxy", &node_key),
                "actor_name": actor_name,
                "worker_id": hex_id(&format!("worker/proxy/{node_key}"), 56),
                "log_file_path": format!("/serve/proxy_{ip}.log"),
                "status": proxy.status,
            }),
        );
    }
    (proxies, targets, grpc_targets)
}

/// Ray's `get_target_groups` with direct ingress: per application its replicas, or while
/// it has none the proxies' `targets` (HTTP, and `grpc_targets` when gRPC is on).
fn direct_ingress_groups(
    state: &SimState,
    targets: &[Value],
    grpc_targets: &[Value],
    grpc_enabled: bool,
) -> Vec<Value> {
    let mut target_groups = Vec::new();
    for (name, app) in &state.apps {
        let app_group = |targets: Vec<Value>, protocol: &str| {
            json!({
                "targets": targets,
                "route_prefix": app.route_prefix,
                "protocol": protocol,
                "app_name": name,
                "ingress_request_router_targets": [],
                "ingress_deployment_name": deployment_name(name),
            })
        };
        if app.replicas.is_empty() {
            if !targets.is_empty() {
                target_groups.push(app_group(targets.to_vec(), "HTTP"));
            }
            if grpc_enabled && !grpc_targets.is_empty() {
                target_groups.push(app_group(grpc_targets.to_vec(), "gRPC"));
            }
            continue;
        }
        // One id per replica (its HTTP port), the same for its gRPC target.
        let replica = |http: SocketAddr, address: SocketAddr| {
            let id = hex_id(&format!("replica/{name}/{http}"), 8);
            json!({
                "ip": address.ip().to_string(),
                "port": address.port(),
                "instance_id": "",
                "name": format!("SERVE_REPLICA::{name}#{}#{id}", deployment_name(name)),
            })
        };
        let http = app.replicas.iter().map(|r| replica(r.0, r.0)).collect();
        target_groups.push(app_group(http, "HTTP"));
        if grpc_enabled {
            let grpc: Vec<Value> = app
                .replicas
                .iter()
                .filter_map(|r| r.1.map(|g| replica(r.0, g)))
                .collect();
            target_groups.push(app_group(grpc, "gRPC"));
        }
    }
    target_groups
}

/// One application entry, with one ingress deployment named after the application
/// (`hello` → `Hello`, as in the captures).
fn render_app(name: &str, app: &SimApp, status: &str) -> Value {
    let deployment = deployment_name(name);
    let (deployment_status, trigger, deployment_message) = match status {
        "RUNNING" => ("HEALTHY", "CONFIG_UPDATE_COMPLETED", String::new()),
        "DEPLOYING" => ("UPDATING", "CONFIG_UPDATE_STARTED", String::new()),
        "DEPLOY_FAILED" => (
            "DEPLOY_FAILED",
            "REPLICA_STARTUP_FAILED",
            "The deployment failed to start 3 times in a row. This may be due to a problem \
             with its constructor or initial health check failing. See controller logs for \
             details. Error:\nRuntimeError: simulated constructor failure"
                .to_string(),
        ),
        "UNHEALTHY" => (
            "UNHEALTHY",
            "HEALTH_CHECK_FAILED",
            "A replica's health check failed. This deployment will be UNHEALTHY until the \
             replica recovers or a new deploy happens."
                .to_string(),
        ),
        "DELETING" => ("UPDATING", "DELETING", String::new()),
        _ => ("UPDATING", "CONFIG_UPDATE_STARTED", String::new()),
    };
    json!({
        "name": name,
        "route_prefix": app.route_prefix,
        "docs_path": null,
        "status": status,
        "message": app_message(status, &deployment),
        "last_deployed_time_s": app.last_deployed_time_s,
        "deployed_app_config": {
            "name": name,
            "route_prefix": app.route_prefix,
            "import_path": format!("apps:{name}"),
        },
        "source": "declarative",
        "deployments": {
            deployment.clone(): {
                "name": deployment,
                "status": deployment_status,
                "status_trigger": trigger,
                "message": deployment_message,
                "deployment_config": {
                    "name": deployment,
                    "num_replicas": 1,
                    "max_ongoing_requests": 5,
                    "max_queued_requests": -1,
                    "user_config": null,
                    "graceful_shutdown_wait_loop_s": 2.0,
                    "graceful_shutdown_timeout_s": 20.0,
                    "health_check_period_s": 10.0,
                    "health_check_timeout_s": 30.0,
                    "ray_actor_options": {"num_cpus": 0.1},
                },
                "target_num_replicas": 1,
                "required_resources": {"CPU": 0.1},
                "replicas": [],
                "recent_dead_replicas": [],
            }
        },
        "external_scaler_enabled": false,
        "deployment_topology": {
            "app_name": name,
            "nodes": {
                deployment.clone(): {
                    "name": deployment,
                    "app_name": name,
                    "outbound_deployments": [],
                    "is_ingress": true,
                }
            },
            "ingress_deployment": deployment,
        },
    })
}

/// The application message Ray gives for `status` (04-mixed-settled, 05-unhealthy).
fn app_message(status: &str, deployment: &str) -> String {
    match status {
        "DEPLOY_FAILED" => format!("Failed to update the deployments ['{deployment}']."),
        "UNHEALTHY" => format!("The deployments ['{deployment}'] are UNHEALTHY."),
        _ => String::new(),
    }
}

/// `hello` → `Hello`.
fn deployment_name(app: &str) -> String {
    let mut chars = app.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => "Ingress".to_string(),
    }
}

/// The Ray node id the simulator gives the node with IP `node_ip` (or, for a proxy
/// placed with [`SimDashboard::add_proxy`], `ip:port`): 56 hex characters, a
/// deterministic function of it.
pub fn node_id_for(node_ip: &str) -> String {
    hex_id(&format!("node/{node_ip}"), 56)
}

/// A Ray actor id: 24 hex characters of hash, then a job id `01000000` as in the captures.
fn actor_id_for(kind: &str, key: &str) -> String {
    format!("{}01000000", hex_id(&format!("actor/{kind}/{key}"), 24))
}

/// `len` hex characters derived from `seed` with FNV-1a (stable across Rust versions,
/// unlike `DefaultHasher`).
fn hex_id(seed: &str, len: usize) -> String {
    let mut out = String::with_capacity(len + 16);
    let mut block = 0u64;
    while out.len() < len {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in block.to_le_bytes().iter().chain(seed.as_bytes()) {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        out.push_str(&format!("{hash:016x}"));
        block += 1;
    }
    out.truncate(len);
    out
}

fn unix_time(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn unix_now() -> f64 {
    unix_time(SystemTime::now())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_deterministic_and_shaped_like_ray() {
        let id = node_id_for("192.0.2.2");
        assert_eq!(id.len(), 56);
        assert!(id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(id, node_id_for("192.0.2.2"));
        assert_ne!(id, node_id_for("192.0.2.3"));
        let actor = actor_id_for("proxy", "192.0.2.2");
        assert_eq!(actor.len(), 32);
        assert!(actor.ends_with("01000000"));
        assert_eq!(deployment_name("hello"), "Hello");
    }
}

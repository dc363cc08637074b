//! The `ray-serve-sim` command line (also run from a benchmark's own binary, so that each
//! simulated cluster is a process a test can SIGKILL): simulated Ray Serve proxies (and optionally a dashboard) of one
//! RayCluster, with a control endpoint to inject faults while it runs.
//!
//! ```text
//! ray-serve-sim --cluster demo-a --proxy 127.0.0.1:8000=head --proxy 127.0.0.1:8001=worker \
//!     --app /=hello --dashboard 127.0.0.1:8265 --control 127.0.0.1:8299 \
//!     --grpc 127.0.0.1:8000=127.0.0.1:9000 --grpc 127.0.0.1:8001=127.0.0.1:9001
//! curl -X PUT -d draining http://127.0.0.1:8299/proxies/8001/mode   # serving|draining|not-ready|no-replicas|hang|flapping|overloaded|reset-after-read|slow:<ms>
//! curl -X PUT -d '{"ongoing": 2, "max_queued": 2, "call_ms": 100}' http://127.0.0.1:8299/proxies/8001/capacity  # or null
//! curl http://127.0.0.1:8299/executions                             # request id -> proxies that ran it
//! curl -X POST http://127.0.0.1:8299/proxies/8001/kill              # and /start to bring it back
//! curl -X PUT 'http://127.0.0.1:8299/dashboard/apps/hello?route_prefix=/&status=DEPLOYING'
//! curl -X PUT 'http://127.0.0.1:8299/dashboard/apps/hello?route_prefix=/&deploying_for_ms=10000&then=RUNNING'
//! curl -X PUT -d unavailable http://127.0.0.1:8299/dashboard/mode   # normal|unavailable|hang|garbage
//! curl -X PUT -d DRAINING http://127.0.0.1:8299/dashboard/proxies/127.0.0.1:8001  # its status in the dashboard
//! curl -X DELETE http://127.0.0.1:8299/dashboard/proxies/127.0.0.1:8001           # gone from the dashboard
//! ```
//!
//! The dashboard lists every proxy it runs, as Ray does (`proxies`, and `target_groups`
//! while HEALTHY), the head proxy on the controller's node and `http_options.port` the
//! head's port, so ray-xds can discover them from the dashboard alone. In
//! `/dashboard/proxies/{node}`, `{node}` is `ip:port` (one proxy; a new one is a worker)
//! or an IP (every proxy on it; a new one on `http_options.port`).
//!
//! `--grpc <proxy>=<grpc address>` gives the proxy at `<proxy>` a gRPC proxy
//! ([`crate::grpc`]) on the same IP: one node, so one mode, one ledger, and `kill`/`start`
//! stop and start both; `/proxies/{port}/...` takes either port. With any `--grpc`, the
//! dashboard turns gRPC on (`grpc_options.port` the head's gRPC port, the demo's servicer
//! function, a `gRPC` target group with each proxy's gRPC port), and each proxy's line on
//! stdout is followed by its `services.yaml` entry,
//! `{ address: 127.0.0.1:8000, node_type: head, grpc: 127.0.0.1:9000 }`.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::capacity::Capacity;
use crate::dashboard::{DashboardMode, SimDashboard};
use crate::grpc::serve_grpc_proxy_with;
use crate::{serve_proxy_with, Executions, NodeType, ProxyConfig, ProxyHandle, ProxyMode};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{post, put};
use axum::Router;
use clap::Parser;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

/// Simulated Ray Serve HTTP proxies (and gRPC proxies) that answer like Ray 2.60's.
#[derive(Parser)]
#[command(name = "ray-serve-sim")]
pub struct Args {
    /// RayCluster name the proxies report in their answers.
    #[arg(long)]
    cluster: String,
    /// A proxy to run, as `ip:port=head|worker`; repeat for several.
    #[arg(long = "proxy", required = true, value_parser = parse_proxy)]
    proxies: Vec<(SocketAddr, NodeType)>,
    /// An application, as `route_prefix=name`; repeat for several [default: /=app].
    #[arg(long = "app", value_parser = parse_app)]
    apps: Vec<(String, String)>,
    /// Serve a simulated Ray dashboard (`/api/serve/applications/`) on this address.
    #[arg(long)]
    dashboard: Option<SocketAddr>,
    /// Serve the control endpoint (fault injection) on this address.
    #[arg(long)]
    control: Option<SocketAddr>,
    /// Append `<request id> <proxy>` to this file for every request that runs, so that
    /// what ran is known even after the process is killed.
    #[arg(long)]
    executions_log: Option<std::path::PathBuf>,
    /// Also run a Ray Serve gRPC proxy beside a `--proxy`, as `proxy ip:port=grpc
    /// ip:port` (the same IP: one node); repeat for several.
    #[arg(long = "grpc", value_parser = parse_grpc)]
    grpc: Vec<(SocketAddr, SocketAddr)>,
}

/// The servicer function the dashboard reports with `--grpc` (the demo application's, as
/// `grpc_servicer_functions` would name it in Ray).
pub const GRPC_SERVICER_FUNCTION: &str = "ray_xds.demo.echo_pb2_grpc.add_EchoServicer_to_server";

fn parse_grpc(s: &str) -> Result<(SocketAddr, SocketAddr), String> {
    let (proxy, grpc) = s
        .split_once('=')
        .ok_or("expected proxy ip:port=grpc ip:port")?;
    let proxy: SocketAddr = proxy.parse().map_err(|e| format!("{proxy}: {e}"))?;
    let grpc: SocketAddr = grpc.parse().map_err(|e| format!("{grpc}: {e}"))?;
    if proxy.ip() != grpc.ip() {
        return Err(format!(
            "the gRPC proxy {grpc} must be on its node's IP, {}",
            proxy.ip()
        ));
    }
    Ok((proxy, grpc))
}

/// A proxy as `services.yaml` lists it: `{ address: 127.0.0.1:8000, node_type: head }`,
/// with `, grpc: <address>` when it has a gRPC proxy.
pub fn services_yaml_entry(
    address: SocketAddr,
    node_type: NodeType,
    grpc: Option<SocketAddr>,
) -> String {
    match grpc {
        Some(grpc) => format!("{{ address: {address}, node_type: {node_type}, grpc: {grpc} }}"),
        None => format!("{{ address: {address}, node_type: {node_type} }}"),
    }
}

fn parse_proxy(s: &str) -> Result<(SocketAddr, NodeType), String> {
    let (addr, kind) = s.split_once('=').ok_or("expected ip:port=head|worker")?;
    let addr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let kind = match kind {
        "head" => NodeType::Head,
        "worker" => NodeType::Worker,
        other => return Err(format!("node type {other:?} is neither head nor worker")),
    };
    Ok((addr, kind))
}

fn parse_app(s: &str) -> Result<(String, String), String> {
    let (prefix, name) = s.split_once('=').ok_or("expected route_prefix=name")?;
    if !prefix.starts_with('/') {
        return Err(format!("route prefix {prefix:?} must start with '/'"));
    }
    Ok((prefix.into(), name.into()))
}

struct Proxy {
    address: SocketAddr,
    /// Its node's gRPC proxy, if it has one.
    grpc: Option<SocketAddr>,
    config: ProxyConfig,
    handle: ProxyHandle,
    running: Option<CancellationToken>,
}

#[derive(Clone)]
struct Control {
    proxies: Arc<Mutex<HashMap<u16, Proxy>>>,
    dashboard: SimDashboard,
    /// What ran on this process's proxies, by request id.
    executions: Executions,
}

impl Control {
    /// The key of the proxy whose HTTP or gRPC port is `port`.
    fn key(proxies: &HashMap<u16, Proxy>, port: u16) -> Option<u16> {
        if proxies.contains_key(&port) {
            return Some(port);
        }
        proxies
            .iter()
            .find(|(_, p)| p.grpc.is_some_and(|g| g.port() == port))
            .map(|(key, _)| *key)
    }

    /// Starts the node of the proxy on `port` (HTTP or gRPC): its HTTP proxy and, if it
    /// has one, its gRPC proxy, under one token.
    async fn start(&self, port: u16) -> Result<(), String> {
        let (key, address, grpc, config, handle) = {
            let proxies = self.proxies.lock().unwrap();
            let key = Self::key(&proxies, port).ok_or(format!("no proxy on port {port}"))?;
            let p = &proxies[&key];
            if p.running.is_some() {
                return Ok(());
            }
            (key, p.address, p.grpc, p.config.clone(), p.handle.clone())
        };
        let bind = |address: SocketAddr| async move {
            tokio::net::TcpListener::bind(address)
                .await
                .map_err(|e| format!("binding {address}: {e}"))
        };
        let listener = bind(address).await?;
        let grpc_listener = match grpc {
            Some(grpc) => Some(bind(grpc).await?),
            None => None,
        };
        let token = CancellationToken::new();
        if let Some(grpc_listener) = grpc_listener {
            tokio::spawn(serve_grpc_proxy_with(
                grpc_listener,
                config.clone(),
                handle.clone(),
                token.clone(),
            ));
        }
        tokio::spawn(serve_proxy_with(listener, config, handle, token.clone()));
        if let Some(p) = self.proxies.lock().unwrap().get_mut(&key) {
            p.running = Some(token);
        }
        Ok(())
    }
}

#[derive(Deserialize)]
struct AppQuery {
    route_prefix: Option<String>,
    status: Option<String>,
    deploying_for_ms: Option<u64>,
    then: Option<String>,
}

fn control_router(control: Control) -> Router {
    Router::new()
        .route(
            "/executions",
            axum::routing::get(|State(c): State<Control>| async move {
                axum::Json(c.executions.all())
            }),
        )
        .route(
            "/proxies/{port}/mode",
            put(|State(c): State<Control>, Path(port): Path<u16>, body: String| async move {
                let mode: ProxyMode = body.trim().parse().map_err(|e| (StatusCode::BAD_REQUEST, e))?;
                let proxies = c.proxies.lock().unwrap();
                let p = Control::key(&proxies, port).and_then(|key| proxies.get(&key)).ok_or((StatusCode::NOT_FOUND, format!("no proxy on port {port}")))?;
                p.handle.set(mode);
                Ok::<_, (StatusCode, String)>("ok\n")
            }),
        )
        .route(
            "/proxies/{port}/capacity",
            put(|State(c): State<Control>, Path(port): Path<u16>, body: String| async move {
                let capacity: Option<Capacity> = serde_json::from_str(&body).map_err(|e| (StatusCode::BAD_REQUEST, format!("{e}: expected {{\"ongoing\": n, \"max_queued\": n or null, \"call_ms\": n}} or null")))?;
                let proxies = c.proxies.lock().unwrap();
                let p = Control::key(&proxies, port).and_then(|key| proxies.get(&key)).ok_or((StatusCode::NOT_FOUND, format!("no proxy on port {port}")))?;
                p.handle.set_capacity(capacity);
                Ok::<_, (StatusCode, String)>("ok\n")
            }),
        )
        .route(
            "/proxies/{port}/kill",
            post(|State(c): State<Control>, Path(port): Path<u16>| async move {
                let mut proxies = c.proxies.lock().unwrap();
                let key = Control::key(&proxies, port).ok_or((StatusCode::NOT_FOUND, format!("no proxy on port {port}")))?;
                let p = proxies.get_mut(&key).ok_or((StatusCode::NOT_FOUND, format!("no proxy on port {port}")))?;
                if let Some(token) = p.running.take() {
                    token.cancel();
                }
                Ok::<_, (StatusCode, String)>("ok\n")
            }),
        )
        .route(
            "/proxies/{port}/start",
            post(|State(c): State<Control>, Path(port): Path<u16>| async move {
                c.start(port).await.map_err(|e| (StatusCode::CONFLICT, e))?;
                Ok::<_, (StatusCode, String)>("ok\n")
            }),
        )
        .route(
            "/dashboard/apps/{name}",
            put(|State(c): State<Control>, Path(name): Path<String>, Query(q): Query<AppQuery>| async move {
                let prefix = q.route_prefix.unwrap_or_else(|| "/".into());
                match (q.deploying_for_ms, q.status) {
                    (Some(ms), _) => c.dashboard.deploy_app(&name, &prefix, Duration::from_millis(ms), q.then.as_deref().unwrap_or("RUNNING")),
                    (None, Some(status)) => c.dashboard.set_app(&name, &prefix, &status),
                    (None, None) => return Err((StatusCode::BAD_REQUEST, "give status=... or deploying_for_ms=...".to_string())),
                }
                Ok("ok\n")
            })
            .delete(|State(c): State<Control>, Path(name): Path<String>| async move {
                c.dashboard.remove_app(&name);
                "ok\n"
            }),
        )
        .route(
            "/dashboard/proxies/{node}",
            put(|State(c): State<Control>, Path(node): Path<String>, body: String| async move {
                let status = body.trim();
                match node.parse::<SocketAddr>() {
                    Ok(addr) => {
                        if !c.dashboard.set_proxy_status(addr, status) {
                            c.dashboard.add_proxy(addr, NodeType::Worker, status);
                        }
                    }
                    Err(_) => c.dashboard.set_proxy(&node, status),
                }
                "ok\n"
            })
            .delete(|State(c): State<Control>, Path(node): Path<String>| async move {
                match node.parse::<SocketAddr>() {
                    Ok(addr) => c.dashboard.remove_proxy_at(addr),
                    Err(_) => c.dashboard.remove_proxy(&node),
                }
                "ok\n"
            }),
        )
        .route(
            "/dashboard/mode",
            put(|State(c): State<Control>, body: String| async move {
                let mode = match body.trim() {
                    "normal" => DashboardMode::Normal,
                    "unavailable" => DashboardMode::Unavailable,
                    "hang" => DashboardMode::Hang,
                    "garbage" => DashboardMode::Garbage,
                    other => return Err((StatusCode::BAD_REQUEST, format!("unknown mode {other:?}"))),
                };
                c.dashboard.set_mode(mode);
                Ok("ok\n")
            }),
        )
        .with_state(control)
}

/// Runs the simulator with `args` (the program name first) until SIGTERM or Ctrl-C.
pub fn main_with<I, T>(args: I) -> anyhow::Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args = Args::parse_from(args);
    tokio::runtime::Runtime::new()?.block_on(run(args))
}

/// `--grpc`: each HTTP proxy's gRPC proxy, every one naming a `--proxy`, none twice; the
/// dashboard told the port Ray's gRPC proxies share.
fn grpc_proxies(
    args: &Args,
    head: Option<&(SocketAddr, NodeType)>,
    dashboard: &SimDashboard,
) -> anyhow::Result<HashMap<SocketAddr, SocketAddr>> {
    let grpc: HashMap<SocketAddr, SocketAddr> = args.grpc.iter().copied().collect();
    for (proxy, _) in &args.grpc {
        if !args.proxies.iter().any(|(address, _)| address == proxy) {
            anyhow::bail!("--grpc {proxy}=...: there is no --proxy {proxy}");
        }
    }
    if grpc.len() != args.grpc.len() {
        anyhow::bail!("--grpc names a proxy twice");
    }
    if !grpc.is_empty() {
        // Ray's gRPC proxies all listen on `grpc_options.port`: here, the head's (or, if it
        // has none, the first one given).
        let port = head
            .and_then(|(address, _)| grpc.get(address))
            .or(args.grpc.first().map(|(_, g)| g))
            .map_or(9000, |g| g.port());
        dashboard.set_grpc_options(port, &[GRPC_SERVICER_FUNCTION]);
    }
    Ok(grpc)
}

/// Starts the proxy at `address` (with its gRPC proxy, if any) under `control`, listed on
/// the dashboard as HEALTHY, and says where it listens.
async fn start_proxy(
    control: &Control,
    args: &Args,
    routes: &BTreeMap<String, String>,
    address: SocketAddr,
    node_type: NodeType,
    grpc: Option<SocketAddr>,
) -> anyhow::Result<()> {
    control.dashboard.add_proxy(address, node_type, "HEALTHY");
    if let Some(grpc) = grpc {
        control.dashboard.set_proxy_grpc_port(address, grpc.port());
    }
    let config = ProxyConfig {
        cluster: args.cluster.clone(),
        node_type,
        routes: routes.clone(),
    };
    let proxy = Proxy {
        address,
        grpc,
        config,
        handle: ProxyHandle::with_ledger(control.executions.clone()),
        running: None,
    };
    control
        .proxies
        .lock()
        .unwrap()
        .insert(address.port(), proxy);
    control
        .start(address.port())
        .await
        .map_err(anyhow::Error::msg)?;
    match grpc {
        None => println!(
            "ray-serve-sim: cluster {} {node_type} proxy on {address}",
            args.cluster
        ),
        Some(grpc) => {
            println!(
                "ray-serve-sim: cluster {} {node_type} proxy on {address}, gRPC proxy on {grpc}",
                args.cluster
            );
            println!(
                "ray-serve-sim:   services.yaml: {}",
                services_yaml_entry(address, node_type, Some(grpc))
            );
        }
    }
    Ok(())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let routes: BTreeMap<String, String> = if args.apps.is_empty() {
        [("/".to_string(), "app".to_string())].into()
    } else {
        args.apps.iter().cloned().collect()
    };
    let dashboard = SimDashboard::new();
    for (prefix, name) in &routes {
        dashboard.set_app(name, prefix, "RUNNING");
    }
    let control = Control {
        proxies: Arc::new(Mutex::new(HashMap::new())),
        dashboard: dashboard.clone(),
        executions: match &args.executions_log {
            Some(path) => Executions::logged_to(path)?,
            None => Executions::default(),
        },
    };
    // Ray's proxies all listen on `http_options.port`: here, the head's.
    let head = args
        .proxies
        .iter()
        .find(|(_, t)| *t == NodeType::Head)
        .or(args.proxies.first());
    if let Some((address, _)) = head {
        dashboard.set_http_port(address.port());
    }
    let grpc = grpc_proxies(&args, head, &dashboard)?;
    for (address, node_type) in &args.proxies {
        let grpc = grpc.get(address).copied();
        start_proxy(&control, &args, &routes, *address, *node_type, grpc).await?;
    }
    let shutdown = CancellationToken::new();
    if let Some(addr) = args.dashboard {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        println!("ray-serve-sim: dashboard on {addr}");
        tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));
    }
    if let Some(addr) = args.control {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        println!("ray-serve-sim: control on {addr}");
        tokio::spawn(async move { axum::serve(listener, control_router(control)).await });
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    shutdown.cancel();
    Ok(())
}

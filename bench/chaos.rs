//! The chaos benchmark: steady load through a real Envoy while Ray Serve proxies crash,
//! hang and drain, clusters are upgraded or replaced, and the control plane restarts;
//! each scenario run against ray-xds and against a baseline that routes the way KubeRay
//! does today.
//!
//! `cargo bench --bench chaos -- --help`
//!
//! Every simulated proxy is its own `ray-serve-sim` process, so a crash is a real SIGKILL
//! (connections reset) and a hang a real SIGSTOP. The baseline is an xDS server fed like
//! KubeRay's Service: every 2 s a reconcile checks each proxy of the *active* cluster
//! (`GET /-/healthz`, 2 s timeout) and the endpoints follow, 1 s later (EndpointSlices,
//! kube-proxy); no retries, no outlier detection, no health in EDS, Envoy's default panic
//! threshold; the switch happens when the source says so.
//!
//! The last line of each scenario is `chaos scenario=<name> requests=<n> failed=<f>
//! baseline_failed=<b>`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::config::cluster::v3::cluster::CommonLbConfig;
use ray_serve_sim::dashboard::SimDashboard;
use ray_xds::config::GatewaySettings;
use ray_xds::metrics::Metrics;
use ray_xds::model::{Model, NodeType};
use ray_xds::xds::grpc::AdsService;
use ray_xds::xds::server::AdsServer;
use ray_xds::xds::Clients;
use ray_xds::xds::Snapshot;
use support::*;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const SCENARIOS: [&str; 7] = [
    "proxy-crash",
    "proxy-hang",
    "proxy-drain",
    "upgrade",
    "cluster-replaced",
    "control-plane-restart",
    "control-plane-down-crash",
];

#[derive(Parser, Clone)]
struct Args {
    /// Scenarios to run (all by default).
    #[arg(long = "scenario")]
    scenarios: Vec<String>,
    /// Seconds of load per scenario (proxy-drain runs 20 s longer: the drain lasts 30 s).
    #[arg(long, default_value_t = 20)]
    duration: u64,
    /// Requests per second, all connections together.
    #[arg(long, default_value_t = 200)]
    rps: u64,
    /// Keep-alive connections to Envoy.
    #[arg(long, default_value_t = 8)]
    connections: u64,
    /// Second at which the fault strikes.
    #[arg(long, default_value_t = 5)]
    fault_at: u64,
    #[arg(long, hide = true)]
    bench: bool,
}

/// One simulated proxy: its own process.
struct SimProxy {
    address: SocketAddr,
    control: u16,
    node_type: NodeType,
    process: ChildGuard,
}

impl SimProxy {
    /// Starts a proxy that logs every request it runs into `log_dir` (the log outlives a
    /// SIGKILL, so requests that ran twice are counted whatever happened).
    fn start(cluster: &str, node_type: NodeType, log_dir: &Path) -> SimProxy {
        let (port, control) = (free_port(), free_port());
        let address: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let log = log_dir.join(format!("{port}.executions"));
        let process = spawn(
            "ray-serve-sim",
            // This benchmark's own binary, run as the simulator (see `main`).
            Command::new(std::env::current_exe().expect("the benchmark's own path"))
                .arg(AS_SIM)
                .args(["--cluster", cluster, "--app", "/=hello"])
                .args(["--proxy", &format!("{address}={node_type}")])
                .args(["--control", &format!("127.0.0.1:{control}")])
                .arg("--executions-log")
                .arg(&log)
                .stdout(Stdio::null()),
        );
        SimProxy {
            address,
            control,
            node_type,
            process,
        }
    }

    async fn mode(&self, mode: &'static str) {
        let url = format!(
            "http://127.0.0.1:{}/proxies/{}/mode",
            self.control,
            self.address.port()
        );
        let _ = http("PUT", &url, mode).await;
    }

    async fn ready(&self) {
        eventually(
            "a simulated proxy starts",
            Duration::from_secs(20),
            || async {
                http_get(&format!("http://{}/-/healthz", self.address))
                    .await
                    .ok()
                    .filter(|(s, _)| *s == 200)
            },
        )
        .await;
    }
}

struct SimRayCluster {
    name: String,
    proxies: Vec<SimProxy>,
    dashboard: SimDashboard,
    url: String,
}

impl SimRayCluster {
    async fn start(
        name: &str,
        workers: usize,
        log_dir: &Path,
        shutdown: &CancellationToken,
    ) -> SimRayCluster {
        let mut proxies = vec![SimProxy::start(name, NodeType::Head, log_dir)];
        for _ in 0..workers {
            proxies.push(SimProxy::start(name, NodeType::Worker, log_dir));
        }
        for p in &proxies {
            p.ready().await;
        }
        let dashboard = SimDashboard::new();
        dashboard.set_app("hello", "/", "RUNNING");
        for p in &proxies {
            dashboard.set_proxy(&p.address.ip().to_string(), "HEALTHY");
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));
        SimRayCluster {
            name: name.into(),
            proxies,
            dashboard,
            url,
        }
    }

    /// Applications deploy for `for_` (proxies answer 503 meanwhile), then run.
    async fn deploy(&self, for_: Duration) {
        self.dashboard.deploy_app("hello", "/", for_, "RUNNING");
        for p in &self.proxies {
            p.mode("overloaded").await;
        }
        let proxies: Vec<(u16, u16)> = self
            .proxies
            .iter()
            .map(|p| (p.control, p.address.port()))
            .collect();
        tokio::spawn(async move {
            tokio::time::sleep(for_).await;
            for (control, port) in proxies {
                let _ = http(
                    "PUT",
                    &format!("http://127.0.0.1:{control}/proxies/{port}/mode"),
                    "serving",
                )
                .await;
            }
        });
    }
}

/// A cluster as the source lists it: name, proxies, dashboard URL.
type ClusterView = (String, Vec<(SocketAddr, NodeType)>, String);

/// What the source says: which clusters exist and which is active.
#[derive(Clone)]
struct SourceView {
    active: String,
    clusters: Vec<ClusterView>,
}

impl SourceView {
    fn yaml(&self) -> String {
        let mut s = format!("rayservices:\n  - name: demo\n    hosts: ['*']\n    active_cluster: {}\n    clusters:\n", self.active);
        for (name, proxies, url) in &self.clusters {
            s += &format!("      - name: {name}\n        dashboard: {url}\n        proxies:\n");
            for (addr, t) in proxies {
                s += &format!("          - {{ address: {addr}, node_type: {t} }}\n");
            }
        }
        s
    }
}

fn view(active: &str, clusters: &[&SimRayCluster]) -> SourceView {
    SourceView {
        active: active.into(),
        clusters: clusters
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    c.proxies.iter().map(|p| (p.address, p.node_type)).collect(),
                    c.url.clone(),
                )
            })
            .collect(),
    }
}

/// A control plane under test: ray-xds, or the KubeRay-like baseline.
enum ControlPlane {
    RayXds {
        services: PathBuf,
        config: Box<ray_xds::config::Config>,
        running: Option<ray_xds::runtime::Running>,
    },
    Baseline {
        xds_port: u16,
        source: Arc<Mutex<SourceView>>,
        gateway: GatewaySettings,
        stop: Option<CancellationToken>,
    },
}

impl ControlPlane {
    async fn ray_xds(dir: &Path, source: &SourceView, gateway_port: u16) -> ControlPlane {
        let services = dir.join("services.yaml");
        std::fs::write(&services, source.yaml()).unwrap();
        let mut config = test_config(&services, gateway_port);
        config.xds_listen = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut cp = ControlPlane::RayXds {
            services,
            config: Box::new(config),
            running: None,
        };
        cp.start().await;
        cp
    }

    async fn baseline(source: &SourceView, gateway_port: u16) -> ControlPlane {
        let gateway = GatewaySettings {
            listener_address: "127.0.0.1".parse().unwrap(),
            listener_port: gateway_port,
            ..Default::default()
        };
        let mut cp = ControlPlane::Baseline {
            xds_port: free_port(),
            source: Arc::new(Mutex::new(source.clone())),
            gateway,
            stop: None,
        };
        cp.start().await;
        cp
    }

    fn xds_port(&self) -> u16 {
        match self {
            ControlPlane::RayXds { config, .. } => config.xds_listen.port(),
            ControlPlane::Baseline { xds_port, .. } => *xds_port,
        }
    }

    async fn set_source(&mut self, view: &SourceView) {
        match self {
            ControlPlane::RayXds { services, .. } => write_atomic(services, &view.yaml()),
            ControlPlane::Baseline { source, .. } => *source.lock().unwrap() = view.clone(),
        }
    }

    async fn start(&mut self) {
        match self {
            ControlPlane::RayXds {
                config, running, ..
            } => {
                *running = Some(
                    ray_xds::runtime::start((**config).clone(), Default::default())
                        .await
                        .unwrap(),
                );
            }
            ControlPlane::Baseline {
                xds_port,
                source,
                gateway,
                stop,
            } => {
                let token = CancellationToken::new();
                tokio::spawn(run_baseline(
                    *xds_port,
                    source.clone(),
                    gateway.clone(),
                    token.clone(),
                ));
                *stop = Some(token);
            }
        }
    }

    async fn stop(&mut self) {
        match self {
            ControlPlane::RayXds { running, .. } => {
                if let Some(r) = running.take() {
                    r.stop().await.unwrap();
                }
            }
            ControlPlane::Baseline { stop, .. } => {
                if let Some(t) = stop.take() {
                    t.cancel();
                }
            }
        }
    }
}

/// The baseline: KubeRay's label-following Service, as xDS.
async fn run_baseline(
    port: u16,
    source: Arc<Mutex<SourceView>>,
    gateway: GatewaySettings,
    stop: CancellationToken,
) {
    let initial = baseline_snapshot(&source.lock().unwrap().clone(), &[], &gateway);
    let (tx, rx) = watch::channel(Arc::new(initial));
    let server = AdsServer::new(
        rx,
        Arc::new(Metrics::new()),
        Arc::new(Clients::default()),
        stop.clone(),
    );
    let listener = loop {
        match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
            Ok(l) => break l,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let service = AdsService::new(server, 4 << 20);
    let token = stop.clone();
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                token.cancelled_owned(),
            )
            .await;
    });
    let client = ray_xds::live::prober::probe_client(Duration::from_secs(2));
    loop {
        // KubeRay's reconcile: every 2 s, GET /-/healthz with a 2 s timeout.
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
        let view = source.lock().unwrap().clone();
        let mut failing = Vec::new();
        if let Some((_, proxies, _)) = view.clusters.iter().find(|(n, _, _)| *n == view.active) {
            for (addr, _) in proxies {
                let outcome =
                    ray_xds::live::prober::probe_healthz(&client, *addr, Duration::from_secs(2))
                        .await;
                if outcome != ray_xds::live::probe::Outcome::Healthy {
                    failing.push(*addr);
                }
            }
        }
        let snapshot = baseline_snapshot(&view, &failing, &gateway);
        let tx = tx.clone();
        // EndpointSlices, kube-proxy and the ingress follow a moment later.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            tx.send_if_modified(|s| {
                let changed = s.version() != snapshot.version();
                if changed {
                    *s = Arc::new(snapshot);
                }
                changed
            });
        });
    }
}

fn baseline_snapshot(
    view: &SourceView,
    failing: &[SocketAddr],
    gateway: &GatewaySettings,
) -> Snapshot {
    let mut yaml_view = view.clone();
    // The Service selects the active cluster's pods whose serve label is true.
    yaml_view.clusters.retain(|(n, _, _)| *n == view.active);
    for (_, proxies, _) in &mut yaml_view.clusters {
        proxies.retain(|(a, _)| !failing.contains(a));
    }
    let text = yaml_view.yaml().replace(
        "    clusters:\n",
        "    head_proxy: include\n    clusters:\n",
    );
    let model: Model = ray_xds::source::file::parse(Path::new("baseline.yaml"), &text).unwrap();
    let mut resources = ray_xds::translate::translate(
        &model,
        &Default::default(),
        &Default::default(),
        gateway,
        &Default::default(),
    );
    for c in &mut resources.clusters {
        c.outlier_detection = None;
        c.circuit_breakers = None;
        c.common_lb_config = Some(CommonLbConfig::default());
    }
    for r in &mut resources.routes {
        for vh in &mut r.virtual_hosts {
            for route in &mut vh.routes {
                if let Some(envoy_types::pb::envoy::config::route::v3::route::Action::Route(a)) =
                    &mut route.action
                {
                    a.retry_policy = None;
                }
            }
        }
    }
    Snapshot::from_resources(&resources)
}

struct LoadResult {
    requests: u64,
    failed: u64,
    latencies: Vec<Duration>,
    last_failure: Option<Duration>,
    /// Requests that ran on more than one proxy (from the proxies' execution logs).
    executed_twice: u64,
}

/// Requests the execution logs in `dir` show running more than once.
fn executed_twice(dir: &Path) -> u64 {
    let mut runs: std::collections::HashMap<String, u32> = Default::default();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.path().extension().is_some_and(|e| e == "executions") {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for line in text.lines() {
                if let Some((id, _)) = line.split_once(' ') {
                    *runs.entry(id.to_string()).or_default() += 1;
                }
            }
        }
    }
    runs.values().filter(|n| **n > 1).count() as u64
}

/// Steady keep-alive POST load through Envoy until `stop`.
async fn load(port: u16, args: &Args, started: Instant, stop: CancellationToken) -> LoadResult {
    let per_connection = Duration::from_secs_f64(args.connections as f64 / args.rps as f64);
    let mut tasks = Vec::new();
    for connection in 0..args.connections {
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = (0u64, 0u64, Vec::new(), None::<Duration>);
            let mut sender: Option<
                hyper::client::conn::http1::SendRequest<http_body_util::Full<hyper::body::Bytes>>,
            > = None;
            let mut tick = tokio::time::interval(per_connection);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !stop.is_cancelled() {
                tick.tick().await;
                let t = Instant::now();
                let id = format!("chaos-{connection}-{}", out.0);
                let ok = send(port, &mut sender, &id).await;
                out.0 += 1;
                if ok {
                    out.2.push(t.elapsed());
                } else {
                    out.1 += 1;
                    out.3 = Some(started.elapsed());
                }
            }
            out
        }));
    }
    let mut r = LoadResult {
        requests: 0,
        failed: 0,
        latencies: Vec::new(),
        last_failure: None,
        executed_twice: 0,
    };
    for t in tasks {
        let (n, f, l, last) = t.await.unwrap();
        r.requests += n;
        r.failed += f;
        r.latencies.extend(l);
        r.last_failure = r.last_failure.max(last);
    }
    r
}

/// One POST with request id `id` on a kept-alive connection (opened again when it
/// broke).
async fn send(
    port: u16,
    sender: &mut Option<
        hyper::client::conn::http1::SendRequest<http_body_util::Full<hyper::body::Bytes>>,
    >,
    id: &str,
) -> bool {
    use http_body_util::BodyExt;
    if sender.as_ref().is_none_or(|s| s.is_closed()) {
        let Ok(stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
            return false;
        };
        let Ok((s, conn)) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await
        else {
            return false;
        };
        tokio::spawn(conn);
        *sender = Some(s);
    }
    let s = sender.as_mut().unwrap();
    if s.ready().await.is_err() {
        *sender = None;
        return false;
    }
    let request = hyper::Request::post("/hello")
        .header("host", "demo")
        .header("x-request-id", id)
        .body(http_body_util::Full::new(hyper::body::Bytes::from_static(
            b"{\"prompt\":\"hi\"}",
        )))
        .unwrap();
    let result = tokio::time::timeout(Duration::from_secs(30), async {
        let response = s.send_request(request).await.ok()?;
        let ok = response.status().is_success();
        response.into_body().collect().await.ok()?;
        Some(ok)
    })
    .await;
    match result {
        Ok(Some(ok)) => ok,
        _ => {
            *sender = None;
            false
        }
    }
}

/// Runs one scenario against one control plane; returns the load's outcome.
async fn run(scenario: &str, baseline: bool, args: &Args) -> LoadResult {
    let shutdown = CancellationToken::new();
    let dir = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let a = SimRayCluster::start("a", 2, logs.path(), &shutdown).await;
    let b = SimRayCluster::start("b", 2, logs.path(), &shutdown).await;
    // Envoy binds its listener on a port of its own choosing; read it back below.
    let gateway_port = 0;
    let initial = match scenario {
        "upgrade" => view("a", &[&a, &b]),
        _ => view("a", &[&a]),
    };
    let mut cp = if baseline {
        ControlPlane::baseline(&initial, gateway_port).await
    } else {
        ControlPlane::ray_xds(dir.path(), &initial, gateway_port).await
    };
    let envoy = Envoy::start(Bootstrap::Sotw, cp.xds_port());
    let gateway_port = envoy.gateway_port().await;
    eventually("traffic flows", Duration::from_secs(30), || async {
        through_envoy(gateway_port).await
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    let duration =
        Duration::from_secs(args.duration + if scenario == "proxy-drain" { 20 } else { 0 });
    let started = Instant::now();
    let stop = CancellationToken::new();
    let load_task = {
        let (stop, args) = (stop.clone(), args.clone());
        tokio::spawn(async move { load(gateway_port, &args, started, stop).await })
    };
    tokio::time::sleep(Duration::from_secs(args.fault_at)).await;

    match scenario {
        "proxy-crash" => a.proxies[0].process.signal(libc::SIGKILL),
        "proxy-hang" => a.proxies[1].process.signal(libc::SIGSTOP),
        "proxy-drain" => {
            a.proxies[1].mode("draining").await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            a.proxies[1].process.signal(libc::SIGKILL);
        }
        "upgrade" => {
            b.deploy(Duration::from_secs(10)).await;
            // KubeRay flips early: b is active while its applications still deploy.
            cp.set_source(&view("b", &[&a, &b])).await;
        }
        "cluster-replaced" => {
            a.proxies[0].process.signal(libc::SIGKILL);
            b.deploy(Duration::from_secs(10)).await;
            cp.set_source(&view("b", &[&a, &b])).await;
        }
        "control-plane-restart" => {
            cp.stop().await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            cp.start().await;
        }
        "control-plane-down-crash" => {
            cp.stop().await;
            tokio::time::sleep(Duration::from_secs(1)).await;
            a.proxies[2].process.signal(libc::SIGKILL);
            tokio::time::sleep(Duration::from_secs(5)).await;
            cp.start().await;
        }
        other => panic!("unknown scenario {other}"),
    }
    if std::env::var_os("CHAOS_DEBUG").is_some() {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let served = through_envoy(gateway_port).await.map(|s| s.cluster);
        eprintln!(
            "debug: {} served by {served:?}",
            if baseline { "baseline" } else { "ray-xds" }
        );
        if let ControlPlane::RayXds {
            running: Some(r), ..
        } = &cp
        {
            eprintln!("{}", admin_get(r.admin_addr, "/debug/state").await);
        }
    }
    let elapsed = started.elapsed();
    if elapsed < duration {
        tokio::time::sleep(duration - elapsed).await;
    }
    stop.cancel();
    let mut result = load_task.await.unwrap();
    result.executed_twice = executed_twice(logs.path());
    if scenario == "proxy-hang" {
        a.proxies[1].process.signal(libc::SIGCONT);
    }
    cp.stop().await;
    drop(envoy);
    shutdown.cancel();
    result
}

fn describe(r: &LoadResult, fault_at: u64) -> String {
    let mut l = r.latencies.clone();
    l.sort();
    let p = |q: f64| {
        l.get(((l.len().max(1) - 1) as f64 * q) as usize)
            .copied()
            .unwrap_or_default()
    };
    let back = match r.last_failure {
        Some(t) => format!(
            "{:.1}s after the fault",
            (t.as_secs_f64() - fault_at as f64).max(0.0)
        ),
        None => "no failure".into(),
    };
    format!(
        "requests={} failed={} executed_twice={} p50={}ms p99={}ms max={}ms steady_again={}",
        r.requests,
        r.failed,
        r.executed_twice,
        p(0.5).as_millis(),
        p(0.99).as_millis(),
        l.last().copied().unwrap_or_default().as_millis(),
        back
    )
}

/// Run as `<bench> --as-ray-serve-sim <args>`, this binary is `ray-serve-sim`: every
/// simulated proxy is then a process of its own that a scenario can SIGKILL, without
/// needing the simulator's binary to be built beside this one.
const AS_SIM: &str = "--as-ray-serve-sim";

fn main() {
    let mut argv = std::env::args_os();
    let program = argv.next();
    let mut rest = argv.peekable();
    if rest.peek().is_some_and(|a| a == AS_SIM) {
        rest.next();
        if let Err(e) =
            ray_serve_sim::cli::main_with(std::iter::once("ray-serve-sim".into()).chain(rest))
        {
            eprintln!("ray-serve-sim: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    let _ = program;
    tokio::runtime::Runtime::new()
        .expect("a tokio runtime")
        .block_on(bench_main());
}

async fn bench_main() {
    let args = Args::parse();
    let scenarios: Vec<String> = if args.scenarios.is_empty() {
        SCENARIOS.iter().map(|s| s.to_string()).collect()
    } else {
        args.scenarios.clone()
    };
    for scenario in &scenarios {
        let ours = run(scenario, false, &args).await;
        println!(
            "chaos {scenario} ray-xds:  {}",
            describe(&ours, args.fault_at)
        );
        let base = run(scenario, true, &args).await;
        println!(
            "chaos {scenario} baseline: {}",
            describe(&base, args.fault_at)
        );
        println!(
            "chaos scenario={scenario} requests={} failed={} executed_twice={} baseline_failed={} baseline_executed_twice={}",
            ours.requests, ours.failed, ours.executed_twice, base.failed, base.executed_twice
        );
    }
}

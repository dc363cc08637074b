//! The chaos benchmark: open-loop load through a real Envoy while Ray Serve proxies crash,
//! hang and drain, clusters are upgraded or replaced, and the control plane stops; each
//! scenario run against ray-xds and against baselines that route the way KubeRay does,
//! every arm under the same load, the same simulated clusters and the same fault.
//!
//! `cargo bench --bench chaos -- --help`
//!
//! Every simulated proxy is its own `ray-serve-sim` process, so a crash is a real SIGKILL
//! (connections reset) and a hang a real SIGSTOP.
//!
//! Arms (`--arm` picks some):
//!
//! - `ray-xds`: ray-xds with its defaults (the head's proxy is a fallback only).
//! - `ray-xds-head-include`: the same with `head_proxy: include`, as KubeRay's Service
//!   includes the head: the arm to set beside the baselines.
//! - `baseline-kuberay`: KubeRay 1.1 and later (checked against v1.7's sources), as xDS:
//!   the `serve-svc` Service's endpoints are the active cluster's pods that are ready and
//!   labelled `ray.io/serve=true`. The head's proxy is checked by the RayService
//!   reconcile (every 2 s, `GET /-/healthz`, 2 s timeout); each worker's by its kubelet
//!   readiness probe (every 5 s, 2 s timeout, failure threshold 1, as KubeRay injects for
//!   RayService workers); endpoints follow 1 s later (EndpointSlices, the ingress). A
//!   `NewCluster` upgrade switches once the reconcile sees the pending cluster's
//!   applications RUNNING on its dashboard. No retries, no outlier detection, no health
//!   in EDS; Envoy's least request of two random choices, not ray-xds's scan of every
//!   host (every baseline arm). When "the control plane" stops, KubeRay's reconcile
//!   stops; kubelet and the endpoints go on.
//! - `baseline-kuberay-policy`: the same endpoints with ray-xds's traffic policy (retries
//!   of what certainly did not run, outlier detection, circuit breakers): what the policy
//!   buys, apart from live health and the gated switch.
//! - `baseline-kuberay-1.0` (upgrade and cluster-replaced only): KubeRay up to 1.0,
//!   which switched as soon as the new cluster's head was up (the seed report).
//!
//! ray-xds is given the harder input in the switchover scenarios: its source names the new
//! cluster active at once (as KubeRay 1.0 did), and ray-xds gates the switch itself.
//! `upgrade-partial-capacity` is `upgrade` to a cluster whose application comes up
//! RUNNING with a quarter of its replicas (the simulated proxies run what their share of
//! replicas can, queue a little, and answer Ray's 503 beyond: [`Sizes`]), under a load
//! the old cluster carries and the new one cannot alone; it grows to full size
//! `--partial-for` (20 s) later (ray-xds counts the growth after `capacity_settle`, 5 s),
//! and the load runs 9 s + `--partial-for` longer. `replicas-restart-mid-shift` is `upgrade-partial-capacity`
//! with every replica of the control plane restarted at once 1 s after the new cluster is
//! RUNNING (down 2 s), the new cluster growing 4 s + `--partial-for` after the stop; `ray-xds-no-state`
//! (this scenario only) is ray-xds without `replicas.state`: what the kept state buys.
//! `upgrade-bad-version` is `upgrade` to a cluster whose
//! application answers a fifth of its requests 500 (a bad model version: they ran, and
//! failed); as in the other switchover scenarios, ray-xds's source names it active at
//! once and keeps listing the old cluster for the run (an early flip, which ray-xds judges
//! as it judges a pending cluster; KubeRay's standard upgrade would promote it once
//! RUNNING and delete the old cluster, leaving nothing to go back to: docs/behaviour.md);
//! the baselines switch as KubeRay does. Its failures are the application's
//! (`app_failed`), not lost ones; the load runs 25 s longer (KubeRay's incremental
//! schedule reaches the whole).
//!
//! `overload` makes every proxy of the serving cluster refuse every request for 5 s (Ray's
//! backpressure: a 503, or gRPC `RESOURCE_EXHAUSTED`; nothing runs), then serve again:
//! its figure is `tries_per_request`, the tries Envoy sent to the proxies per request its
//! listener took in those 5 s (from Envoy's stats), what retries multiply an overload by.
//! Its refusals are `refused`, not lost (no proxy could run them); in every other
//! scenario a refused request is lost. `--traffic` sets the ray-xds arms' traffic policy
//! (a RayService's `traffic:`), to measure a retry budget against every scenario.
//!
//! With `--protocol grpc` the load is unary gRPC calls (`ray_xds.demo.Echo/Say`, over one
//! HTTP/2 connection to Envoy) to every node's simulated gRPC proxy, which shares its HTTP
//! proxy's process, mode and execution log; the baselines' Service then has the gRPC port
//! too (a Service's ports follow the same pod readiness), and the fault is the same. A
//! call's ending is read from its gRPC status as an HTTP request's from its answer: Envoy
//! puts the same words in `grpc-message`.
//!
//! Load is open-loop: requests start on schedule (`--rps`) whatever is in flight, at most
//! `--max-in-flight` at once (one over that is counted failed and `shed`). A failed request
//! is one that did not get a 2xx; it **may have run** when Envoy reports it reset or timed
//! out on a proxy (`upstream request timeout`, `connection termination`, `remote reset`)
//! or the client's timeout ended it while it waited on a proxy: the safety rule (a request
//! that may have run is never sent again unless its RayService is idempotent) makes those
//! the price of not replaying. Every other failure is **lost**: it never reached a proxy
//! that could have run it while a healthy one existed (every scenario keeps one), and
//! `lost_ran` counts the lost ones a proxy's execution log shows ran all the same.
//!
//! Each trial strikes its fault at `--fault-at` plus a random phase within
//! `--fault-jitter-ms`, the same for every arm of the trial; the baselines' timers (each
//! worker's kubelet probe, the reconcile) start at random points of their periods, so
//! trials meet every phase of them. With `--trials N` each trial runs every scenario, the
//! arms taking turns in an order that rotates from trial to trial (noise on the machine
//! falls on every arm alike; `--arms-together` runs them at the same time instead).
//! Latency counts from when a request was due. Every trial's line goes to stderr, prefixed
//! `trial=<i> fault_ms=<t>`. Each scenario ends (in the last trial) with one line per arm,
//! on stdout:
//! `chaos scenario=<name> arm=<arm> requests=<n> failed=<f> executed_twice=<k> p99_ms=<x>
//! p50_ms=<y> max_ms=<z> may_have_run=<m> lost=<l> refused=<f> app_failed=<e> shed=<s>
//! failed_ran=<r> lost_ran=<q> window_ms=<w>
//! served_by=<clusters> trials=<N> failed_median=<a> failed_max=<b>
//! may_have_run_median=<c> may_have_run_max=<d> tries_per_request=<t|->
//! tries_per_request_max=<t|-> protocol=<http|grpc>`: counts summed over the trials, latency
//! percentiles over every request that succeeded in any trial, the window the longest of
//! any trial. With `--assert`, the benchmark exits 1 when a trial of an arm running
//! ray-xds lost a request (or shed one, or one it lost ran), executed one twice, or broke
//! the other rules of `broken_by`.

// A benchmark run reads top to bottom (set up, measure, report): its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::config::cluster::v3::cluster::CommonLbConfig;
use ray_serve_sim::capacity::Capacity;
use ray_serve_sim::dashboard::{AppSize, SimDashboard};
use ray_xds::config::GatewaySettings;
use ray_xds::live::dashboard::DashboardClient;
use ray_xds::live::probe::Outcome;
use ray_xds::live::prober::{probe_client, probe_healthz};
use ray_xds::metrics::Metrics;
use ray_xds::model::{Model, NodeType};
use ray_xds::xds::grpc::AdsService;
use ray_xds::xds::server::AdsServer;
use ray_xds::xds::Clients;
use ray_xds::xds::Snapshot;
use support::*;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const SCENARIOS: [&str; 13] = [
    "head-crash",
    "worker-crash",
    "proxy-hang",
    "proxy-drain",
    "upgrade",
    "upgrade-partial-capacity",
    "upgrade-bad-version",
    "replicas-restart-mid-shift",
    "cluster-replaced",
    "control-plane-restart",
    "control-plane-down-crash",
    "control-plane-down-hang",
    "overload",
];

/// Every arm, in the order they run.
const ARMS: [&str; 7] = [
    "ray-xds",
    "ray-xds-head-include",
    "ray-xds-no-state",
    "baseline-kuberay",
    "baseline-kuberay-policy",
    "baseline-kuberay-incremental",
    "baseline-kuberay-1.0",
];

/// KubeRay's incremental upgrade in `baseline-kuberay-incremental`: the new cluster's
/// HTTPRoute weight grows by `stepSizePercent` (`--incremental-step`, 10 by default)
/// every `intervalSeconds`, time-compressed as the scenarios' deploys are (the sample's
/// 10% every 30 s, KubeRay's guide's 60 s, becomes 10% every 2 s, its reconcile's own
/// period).
const INCREMENTAL_INTERVAL: Duration = Duration::from_secs(2);

/// How much earlier than the interval a reconcile may find it passed (timer jitter).
const RECONCILE_SLACK: Duration = Duration::from_millis(250);

#[derive(Parser, Clone)]
struct Args {
    /// Scenarios to run (all by default).
    #[arg(long = "scenario")]
    scenarios: Vec<String>,
    /// Arms to run (all that apply to each scenario by default).
    #[arg(long = "arm")]
    arms: Vec<String>,
    /// Seconds of load per scenario (proxy-drain runs 20 s longer: the drain lasts 30 s).
    #[arg(long, default_value_t = 20)]
    duration: u64,
    /// Requests started per second (open loop).
    #[arg(long, default_value_t = 200)]
    rps: u64,
    /// Requests in flight at most; one more is counted failed (shed).
    #[arg(long, default_value_t = 512)]
    max_in_flight: usize,
    /// Seconds a request may take before the client gives up.
    #[arg(long, default_value_t = 10)]
    client_timeout: u64,
    /// Second at which the fault strikes (plus a random phase, `--fault-jitter-ms`).
    #[arg(long, default_value_t = 5)]
    fault_at: u64,
    /// The fault strikes at a random point within this many milliseconds after
    /// `--fault-at`, so that trials meet the probe and reconcile timers at every phase.
    #[arg(long, default_value_t = 1000)]
    fault_jitter_ms: u64,
    /// Runs of each scenario and arm; each trial runs every scenario, the arms taking
    /// turns, and each
    /// arm's line sums its trials (latency percentiles over all their requests) and gives
    /// the median and maximum of its per-trial failures.
    #[arg(long, default_value_t = 1)]
    trials: usize,
    /// Seconds a new cluster's applications deploy in the switchover scenarios.
    #[arg(long, default_value_t = 10)]
    deploy: u64,
    /// Exit 1 when an arm running ray-xds lost a request or executed one twice.
    #[arg(long)]
    assert: bool,
    /// `http` (POSTs) or `grpc` (unary calls to each node's gRPC proxy).
    #[arg(long, default_value = "http", value_parser = ["http", "grpc"])]
    protocol: String,
    /// Run the arms of a scenario at the same time instead of in turns (each with its
    /// own processes and ports, under the same load and fault): the machine's noise
    /// falls on every arm at once. CI's short run uses it to save time; the published
    /// tables run the arms in turns.
    #[arg(long)]
    arms_together: bool,
    /// `baseline-kuberay-incremental`'s `stepSizePercent` every 2 s.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100))]
    incremental_step: u32,
    /// Seconds the new cluster of `upgrade-partial-capacity` runs a quarter of its
    /// replicas before it grows to full size (`replicas-restart-mid-shift`: 5 s more, its
    /// restart's); the load runs as much longer. How fast capacity follows KubeRay's
    /// incremental schedule (10% every 2 s) decides whether that schedule overloads it.
    /// 20 s is about 5 minutes at the scenarios' time compression (KubeRay's 30 s interval
    /// as 2 s): a GPU node and a model to load, what an expensive model call waits for;
    /// 5 s is a warm CPU node.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=300))]
    partial_for: u64,
    /// Traffic policy overrides for the ray-xds arms, as a YAML flow map of the
    /// RayService's `traffic:` (e.g. `{ retry_budget_percent: 20 }`): what a policy
    /// change costs or buys, measured in the same scenarios.
    #[arg(long)]
    traffic: Option<String>,
    #[arg(long, hide = true)]
    bench: bool,
}

/// One simulated proxy: its own process.
struct SimProxy {
    address: SocketAddr,
    /// The same node's gRPC proxy (same process), with `--protocol grpc`.
    grpc: Option<SocketAddr>,
    control: u16,
    node_type: NodeType,
    process: ChildGuard,
}

impl SimProxy {
    /// Starts a proxy that logs every request it runs into `log_dir` (the log outlives a
    /// SIGKILL, so requests that ran twice are counted whatever happened).
    fn start(cluster: &str, node_type: NodeType, log_dir: &Path, grpc: bool) -> SimProxy {
        let (port, control) = (free_port(), free_port());
        let address: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let grpc: Option<SocketAddr> =
            grpc.then(|| format!("127.0.0.1:{}", free_port()).parse().unwrap());
        let log = log_dir.join(format!("{port}.executions"));
        let mut command = Command::new(std::env::current_exe().expect("the benchmark's own path"));
        // This benchmark's own binary, run as the simulator (see `main`).
        command
            .arg(AS_SIM)
            .args(["--cluster", cluster, "--app", "/=hello"])
            .args(["--proxy", &format!("{address}={node_type}")])
            .args(["--control", &format!("127.0.0.1:{control}")])
            .arg("--executions-log")
            .arg(&log)
            .stdout(Stdio::null());
        if let Some(grpc) = grpc {
            command.args(["--grpc", &format!("{address}={grpc}")]);
        }
        let process = spawn("ray-serve-sim", &mut command);
        SimProxy {
            address,
            grpc,
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

    /// Bounds what the replicas behind this proxy run at once.
    async fn capacity(&self, capacity: Capacity) {
        let url = format!(
            "http://127.0.0.1:{}/proxies/{}/capacity",
            self.control,
            self.address.port()
        );
        let body = serde_json::to_string(&capacity).unwrap();
        let (status, answer) = http("PUT", &url, &body).await.unwrap();
        assert_eq!(status, 200, "{url}: {answer}");
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
    /// Stops the dashboard (the head pod died).
    dashboard_stop: CancellationToken,
    url: String,
}

impl SimRayCluster {
    async fn start(
        name: &str,
        workers: usize,
        log_dir: &Path,
        grpc: bool,
        shutdown: &CancellationToken,
    ) -> SimRayCluster {
        let mut proxies = vec![SimProxy::start(name, NodeType::Head, log_dir, grpc)];
        for _ in 0..workers {
            proxies.push(SimProxy::start(name, NodeType::Worker, log_dir, grpc));
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
        let dashboard_stop = shutdown.child_token();
        tokio::spawn(dashboard.clone().serve(listener, dashboard_stop.clone()));
        SimRayCluster {
            name: name.into(),
            proxies,
            dashboard,
            dashboard_stop,
            url,
        }
    }

    /// Applications deploy for `for_` (proxies answer 503 meanwhile), then run (at
    /// `size`, when given): the proxies serve again before the dashboard says RUNNING, so
    /// that no arm that switches on RUNNING can meet a proxy still refusing.
    /// Deploys for `for_` (the proxies answer 503 meanwhile), then RUNNING at `size`, the
    /// proxies under `then` (`serving`; `failing:20` for a bad version).
    async fn deploy(
        &self,
        for_: Duration,
        size: Option<AppSize>,
        then: &'static str,
    ) -> tokio::task::JoinHandle<()> {
        self.dashboard.set_app("hello", "/", "DEPLOYING");
        for p in &self.proxies {
            p.mode("overloaded").await;
        }
        let dashboard = self.dashboard.clone();
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
                    then,
                )
                .await;
            }
            match size {
                Some(size) => dashboard.set_app_sized("hello", "/", "RUNNING", size),
                None => dashboard.set_app("hello", "/", "RUNNING"),
            }
        })
    }

    /// Its proxies at a quarter of the full size's slots, then its applications deploy
    /// for `deploy_secs` (answering 503) and come up RUNNING at a quarter of their
    /// replicas (the task ends then).
    async fn deploy_at_a_quarter(
        &self,
        sizes: &Sizes,
        deploy_secs: u64,
    ) -> tokio::task::JoinHandle<()> {
        let quarter = FULL_REPLICAS / 4;
        for p in &self.proxies {
            p.capacity(sizes.proxy(quarter)).await;
        }
        let deploy = Duration::from_secs(deploy_secs);
        self.deploy(deploy, Some(sizes.app(quarter)), "serving")
            .await
    }

    /// Requests this cluster's proxies have run so far (their execution logs).
    fn ran(&self, log_dir: &Path) -> usize {
        self.proxies
            .iter()
            .map(|p| {
                let log = log_dir.join(format!("{}.executions", p.address.port()));
                std::fs::read_to_string(log).map_or(0, |text| text.lines().count())
            })
            .sum()
    }

    /// Every proxy's share of `running` replicas (see [`Sizes`]), and the dashboard's
    /// size to match: the proxies first, so the dashboard never claims more than they run.
    async fn size(&self, sizes: &Sizes, running: u32) {
        for p in &self.proxies {
            p.capacity(sizes.proxy(running)).await;
        }
        self.dashboard.set_app_size("hello", sizes.app(running));
    }
}

/// `upgrade-partial-capacity`'s sizes. Every replica runs `2 × unit` requests at once
/// (`max_ongoing_requests`), each for [`SIZED_CALL_MS`], `unit` growing with the load (one
/// per 50 requests/s, which keep 10 requests in flight): the serving cluster runs
/// [`FULL_REPLICAS`] replicas (24 slots per unit: 16 through two of its proxies, 24
/// through three); the new one comes up RUNNING with a quarter of them (6 slots per
/// unit: 4 through two proxies, 6 through three), then grows to all. Each proxy holds a third of its cluster's slots,
/// and `2 × unit` queued (Ray's `max_queued_requests`, per proxy as in Ray): in Ray every
/// proxy reaches every replica of its cluster, here each proxy is a process of its own.
/// So ray-xds, routing to two of the three proxies (the head is a fallback), has two
/// thirds of the slots a baseline routing to all three has: the split favours the
/// baselines.
struct Sizes {
    unit: u32,
}

const SIZED_CALL_MS: u64 = 200;
const FULL_REPLICAS: u32 = 12;

impl Sizes {
    fn of(rps: u64) -> Sizes {
        Sizes {
            unit: u32::try_from(rps.div_ceil(50)).unwrap_or(u32::MAX).max(1),
        }
    }

    fn app(&self, running: u32) -> AppSize {
        AppSize {
            num_replicas: FULL_REPLICAS,
            running,
            max_ongoing_requests: 2 * self.unit,
        }
    }

    fn proxy(&self, running: u32) -> Capacity {
        Capacity {
            ongoing: (running * 2 * self.unit).div_ceil(3),
            max_queued: Some(2 * self.unit),
            call_ms: SIZED_CALL_MS,
        }
    }
}

/// A cluster as the source lists it: name, proxies (with their gRPC proxies), dashboard URL.
type ClusterView = (
    String,
    Vec<(SocketAddr, NodeType, Option<SocketAddr>)>,
    String,
);

/// What the source says: which clusters exist and which is active.
#[derive(Clone)]
struct SourceView {
    active: String,
    /// The cluster being upgraded to, as KubeRay 1.1+ reports it (ray-xds's source only).
    pending: Option<String>,
    clusters: Vec<ClusterView>,
}

impl SourceView {
    /// As services.yaml, with `extra` lines for the RayService (e.g. its head policy).
    fn yaml(&self, extra: &str) -> String {
        let mut s = format!(
            "rayservices:\n  - name: demo\n    hosts: ['*']\n    active_cluster: {}\n{extra}",
            self.active
        );
        if let Some(pending) = &self.pending {
            s += &format!("    pending_cluster: {pending}\n");
        }
        s += "    clusters:\n";
        for (name, proxies, url) in &self.clusters {
            s += &format!("      - name: {name}\n        dashboard: {url}\n        proxies:\n");
            for (addr, t, grpc) in proxies {
                let grpc = grpc.map(|g| format!(", grpc: {g}")).unwrap_or_default();
                s += &format!("          - {{ address: {addr}, node_type: {t}{grpc} }}\n");
            }
        }
        s
    }
}

fn view(active: &str, clusters: &[&SimRayCluster]) -> SourceView {
    SourceView {
        active: active.into(),
        pending: None,
        clusters: clusters
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    c.proxies
                        .iter()
                        .map(|p| (p.address, p.node_type, p.grpc))
                        .collect(),
                    c.url.clone(),
                )
            })
            .collect(),
    }
}

/// How a baseline moves traffic to a new cluster.
#[derive(Clone, Copy, PartialEq)]
enum Switch {
    /// KubeRay up to 1.0: when the source says so (the new head is up).
    AtOnce,
    /// KubeRay 1.1 and later: when the reconcile sees the new cluster's apps RUNNING.
    WhenRunning,
    /// KubeRay's `NewClusterWithIncrementalUpgrade`: from when the new cluster's apps are
    /// RUNNING, Gateway weights on its own schedule (this step every
    /// [`INCREMENTAL_INTERVAL`]), then promoted at 100; no capacity or outcome feedback.
    /// (Its `target_capacity` steps are not modelled: the new cluster's size is the
    /// scenario's, the same for every arm.)
    Incremental(u32),
}

/// A control plane under test: ray-xds, or a KubeRay-like baseline.
enum ControlPlane {
    RayXds {
        services: PathBuf,
        extra: String,
        config: Box<ray_xds::config::Config>,
        running: Option<ray_xds::runtime::Running>,
    },
    Baseline {
        /// What the RayService says (the cluster to switch to, once ready).
        source: Arc<Mutex<SourceView>>,
        /// KubeRay's reconcile runs while this is `Some`.
        reconcile: Option<CancellationToken>,
        plumbing: Arc<BaselinePlumbing>,
        /// The endpoints' side (xDS server, kubelet): up for the whole run.
        stop: CancellationToken,
    },
}

impl ControlPlane {
    /// ray-xds on a services file in `dir`, keeping its switchover view in `dir/state`
    /// (`replicas.state.dir`, as deployed) when `keep_state`.
    async fn ray_xds(
        dir: &Path,
        source: &SourceView,
        head_include: bool,
        keep_state: bool,
        gateway_port: u16,
        traffic: Option<&str>,
    ) -> ControlPlane {
        let services = dir.join("services.yaml");
        let mut extra = if head_include {
            "    head_proxy: include\n".to_string()
        } else {
            String::new()
        };
        if let Some(traffic) = traffic {
            extra += &format!("    traffic: {traffic}\n");
        }
        std::fs::write(&services, source.yaml(&extra)).unwrap();
        let mut config = test_config(&services, gateway_port);
        config.xds_listen = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        config.replica_state = keep_state.then(|| ray_xds::config::ReplicaStateConfig {
            store: ray_xds::config::ReplicaStateStore::Dir(dir.join("state")),
            ttl: Duration::from_secs(900),
        });
        let mut cp = ControlPlane::RayXds {
            services,
            extra,
            config: Box::new(config),
            running: None,
        };
        cp.start().await;
        cp
    }

    async fn baseline(
        source: &SourceView,
        switch: Switch,
        policy: bool,
        gateway_port: u16,
    ) -> ControlPlane {
        let gateway = GatewaySettings {
            listener_address: "127.0.0.1".parse().unwrap(),
            listener_port: gateway_port,
            ..Default::default()
        };
        let stop = CancellationToken::new();
        let plumbing = BaselinePlumbing::start(source, switch, policy, gateway, &stop).await;
        let mut cp = ControlPlane::Baseline {
            source: Arc::new(Mutex::new(source.clone())),
            reconcile: None,
            plumbing,
            stop,
        };
        cp.start().await;
        cp
    }

    fn xds_port(&self) -> u16 {
        match self {
            ControlPlane::RayXds { config, .. } => config.xds_listen.port(),
            ControlPlane::Baseline { plumbing, .. } => plumbing.xds_port,
        }
    }

    async fn set_source(&mut self, view: &SourceView) {
        match self {
            ControlPlane::RayXds {
                services, extra, ..
            } => write_atomic(services, &view.yaml(extra.as_str())),
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
                source,
                reconcile,
                plumbing,
                ..
            } => {
                let token = CancellationToken::new();
                tokio::spawn(kuberay_reconcile(
                    source.clone(),
                    plumbing.clone(),
                    token.clone(),
                ));
                *reconcile = Some(token);
            }
        }
    }

    /// Stops the control plane: ray-xds whole; for a baseline, KubeRay's reconcile
    /// (kubelet and the endpoints' plumbing go on, as in a cluster).
    async fn stop(&mut self) {
        match self {
            ControlPlane::RayXds { running, .. } => {
                if let Some(r) = running.take() {
                    r.stop().await.unwrap();
                }
            }
            ControlPlane::Baseline { reconcile, .. } => {
                if let Some(t) = reconcile.take() {
                    t.cancel();
                }
            }
        }
    }

    /// Ends everything the arm started.
    async fn end(mut self) {
        self.stop().await;
        if let ControlPlane::Baseline { stop, .. } = self {
            stop.cancel();
        }
    }
}

/// What the baseline's Service is made of, shared by KubeRay's reconcile and kubelet.
struct BaselinePlumbing {
    xds_port: u16,
    switch: Switch,
    policy: bool,
    gateway: GatewaySettings,
    state: Mutex<ServiceState>,
    snapshots: watch::Sender<Arc<Snapshot>>,
}

/// The `serve-svc` Service as the data plane sees it.
#[derive(Clone)]
struct ServiceState {
    /// The cluster the Service selects (KubeRay's active cluster), as KubeRay last saw it.
    active: ClusterView,
    /// An incremental upgrade's new cluster (its own Service, every pod) and its weight
    /// in the HTTPRoute, with when the weight last moved.
    pending: Option<(ClusterView, u32, Instant)>,
    /// The head's `ray.io/serve` label (set by the reconcile).
    head_serving: bool,
    /// Workers whose readiness probe failed last (kubelet).
    workers_not_ready: Vec<SocketAddr>,
}

impl BaselinePlumbing {
    async fn start(
        source: &SourceView,
        switch: Switch,
        policy: bool,
        gateway: GatewaySettings,
        stop: &CancellationToken,
    ) -> Arc<BaselinePlumbing> {
        let active = source
            .clusters
            .iter()
            .find(|(n, _, _)| *n == source.active)
            .expect("the active cluster is listed")
            .clone();
        let state = ServiceState {
            active,
            pending: None,
            head_serving: true,
            workers_not_ready: Vec::new(),
        };
        let initial = baseline_snapshot(&state, policy, &gateway);
        let (snapshots, rx) = watch::channel(Arc::new(initial));
        let server = AdsServer::new(
            rx,
            Arc::new(Metrics::new()),
            Arc::new(Clients::default()),
            stop.clone(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let xds_port = listener.local_addr().unwrap().port();
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
        let plumbing = Arc::new(BaselinePlumbing {
            xds_port,
            switch,
            policy,
            gateway,
            state: Mutex::new(state),
            snapshots,
        });
        tokio::spawn(kubelet(plumbing.clone(), stop.clone()));
        plumbing
    }

    /// Changes the Service; the data plane sees it 1 s later (EndpointSlices, the
    /// ingress).
    fn update(self: &Arc<Self>, change: impl FnOnce(&mut ServiceState)) {
        let state = {
            let mut state = self.state.lock().unwrap();
            change(&mut state);
            state.clone()
        };
        let snapshot = baseline_snapshot(&state, self.policy, &self.gateway);
        let tx = self.snapshots.clone();
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

/// kubelet's readiness probes of the active cluster's workers: one timer per worker
/// (pod), its first probe at a random point of the first 5 s period as kubelet does,
/// then every 5 s whatever the last probe took, 2 s timeout, failure threshold 1
/// (KubeRay's injection for RayService workers). Each result updates the endpoints.
async fn kubelet(plumbing: Arc<BaselinePlumbing>, stop: CancellationToken) {
    const PERIOD: Duration = Duration::from_secs(5);
    let client = probe_client(Duration::from_secs(2));
    let mut due: std::collections::HashMap<SocketAddr, Instant> = Default::default();
    let mut probes = tokio::task::JoinSet::new();
    let mut in_flight = std::collections::HashSet::new();
    let mut not_ready = std::collections::BTreeSet::new();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
            Some(done) = probes.join_next() => {
                let (worker, ready): (SocketAddr, bool) = done.expect("a probe task");
                in_flight.remove(&worker);
                let changed = if ready {
                    not_ready.remove(&worker)
                } else {
                    not_ready.insert(worker)
                };
                if changed {
                    let list: Vec<SocketAddr> = not_ready.iter().copied().collect();
                    plumbing.update(|s| s.workers_not_ready = list);
                }
            }
        }
        let workers: Vec<SocketAddr> = {
            let state = plumbing.state.lock().unwrap();
            state
                .active
                .1
                .iter()
                .filter(|(_, t, _)| *t == NodeType::Worker)
                .map(|(a, _, _)| *a)
                .collect()
        };
        let now = Instant::now();
        for w in workers {
            let next = due
                .entry(w)
                .or_insert_with(|| now + PERIOD.mul_f64(fastrand::f64()));
            if *next <= now && !in_flight.contains(&w) {
                *next += PERIOD;
                in_flight.insert(w);
                let client = client.clone();
                probes.spawn(async move {
                    let ready =
                        probe_healthz(&client, w, Duration::from_secs(2)).await == Outcome::Healthy;
                    (w, ready)
                });
            }
        }
    }
}

async fn kuberay_reconcile(
    source: Arc<Mutex<SourceView>>,
    plumbing: Arc<BaselinePlumbing>,
    stop: CancellationToken,
) {
    let client = probe_client(Duration::from_secs(2));
    let dashboards = DashboardClient::new(Duration::from_secs(2));
    // The reconcile's 2 s cycle starts at a random point, as the operator's does
    // relative to any fault.
    let mut due = tokio::time::Instant::now() + Duration::from_secs(2).mul_f64(fastrand::f64());
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(due) => {}
        }
        due += Duration::from_secs(2);
        let view = source.lock().unwrap().clone();
        let current = plumbing.state.lock().unwrap().active.0.clone();
        let mut next = None;
        if let Switch::Incremental(step) = plumbing.switch {
            next = incremental_step(&view, &plumbing, &dashboards, step).await;
        } else if view.active != current {
            let wanted = view
                .clusters
                .iter()
                .find(|(n, _, _)| *n == view.active)
                .cloned();
            if let Some(wanted) = wanted {
                let ready = match plumbing.switch {
                    Switch::AtOnce => true,
                    Switch::WhenRunning | Switch::Incremental(_) => dashboards
                        .fetch(&wanted.2)
                        .await
                        .is_ok_and(|s| s.all_running()),
                };
                if ready {
                    next = Some(wanted);
                }
            }
        }
        let active = next
            .clone()
            .unwrap_or_else(|| plumbing.state.lock().unwrap().active.clone());
        let head = active
            .1
            .iter()
            .find(|(_, t, _)| *t == NodeType::Head)
            .map(|(a, _, _)| *a);
        let head_serving = match head {
            Some(h) => probe_healthz(&client, h, Duration::from_secs(2)).await == Outcome::Healthy,
            None => false,
        };
        plumbing.update(|s| {
            if let Some(next) = next {
                s.active = next;
                s.pending = None;
                s.workers_not_ready.clear();
            }
            s.head_serving = head_serving;
        });
    }
}

/// One reconcile of KubeRay's incremental upgrade: once the new cluster's applications
/// are RUNNING it gets an HTTPRoute weight, raised by `step` once every
/// [`INCREMENTAL_INTERVAL`]; at 100 it is promoted (returned, to become the active one).
async fn incremental_step(
    view: &SourceView,
    plumbing: &Arc<BaselinePlumbing>,
    dashboards: &DashboardClient,
    step: u32,
) -> Option<ClusterView> {
    let (active, pending) = {
        let state = plumbing.state.lock().unwrap();
        (state.active.0.clone(), state.pending.clone())
    };
    if view.active == active {
        return None;
    }
    let wanted = view.clusters.iter().find(|(n, _, _)| *n == view.active)?;
    let now = Instant::now();
    match pending {
        Some((_, 100, _)) => Some(wanted.clone()),
        Some((cluster, weight, since)) => {
            // The reconcile runs every `INCREMENTAL_INTERVAL` too: with no slack, one
            // woken a little earlier than the last (timer jitter) finds the interval not
            // yet passed, and the schedule steps every other reconcile, half its pace.
            // (KubeRay's own check has the same edge, a 2 s slip in its 30 to 60 s.)
            if now.duration_since(since) + RECONCILE_SLACK >= INCREMENTAL_INTERVAL {
                let weight = (weight + step).min(100);
                plumbing.update(|s| s.pending = Some((cluster, weight, now)));
            }
            None
        }
        None => {
            let running = dashboards
                .fetch(&wanted.2)
                .await
                .is_ok_and(|s| s.all_running());
            if running {
                let first = (wanted.clone(), step.min(100), now);
                plumbing.update(|s| s.pending = Some(first));
            }
            None
        }
    }
}

/// The Service's endpoints as xDS: the active cluster's serving head and ready workers.
fn baseline_snapshot(state: &ServiceState, policy: bool, gateway: &GatewaySettings) -> Snapshot {
    let (name, proxies, url) = &state.active;
    let serving: Vec<(SocketAddr, NodeType, Option<SocketAddr>)> = proxies
        .iter()
        .filter(|(a, t, _)| match t {
            NodeType::Head => state.head_serving,
            NodeType::Worker => !state.workers_not_ready.contains(a),
        })
        .copied()
        .collect();
    let mut clusters = vec![(name.clone(), serving, url.clone())];
    let mut weights = std::collections::BTreeMap::new();
    if let Some((pending, weight, _)) = &state.pending {
        clusters.push(pending.clone());
        let split = vec![(name.clone(), 100 - weight), (pending.0.clone(), *weight)];
        weights.insert("default/demo".to_string(), split);
    }
    let yaml_view = SourceView {
        active: name.clone(),
        pending: None,
        clusters,
    };
    // A Service keeps no endpoint when none is ready; the model wants one proxy at
    // least, so an empty list is modelled by a port nothing listens on.
    let mut text = yaml_view.yaml("    head_proxy: include\n");
    if !text.contains("address:") {
        text = text.replace(
            "        proxies:\n",
            "        proxies:\n          - { address: 127.0.0.1:9, node_type: worker }\n",
        );
    }
    let model: Model = ray_xds::source::file::parse(Path::new("baseline.yaml"), &text).unwrap();
    let mut resources = ray_xds::translate::translate(
        &model,
        &Default::default(),
        &weights,
        gateway,
        &Default::default(),
    );
    for c in &mut resources.clusters {
        // Envoy's own selection (least request of two random choices, which `lb_policy`
        // keeps), as a Service behind a gateway would have.
        c.load_balancing_policy = None;
    }
    if !policy {
        for c in &mut resources.clusters {
            c.outlier_detection = None;
            c.circuit_breakers = None;
            c.common_lb_config = Some(CommonLbConfig::default());
        }
        for r in &mut resources.routes {
            for vh in &mut r.virtual_hosts {
                for route in &mut vh.routes {
                    if let Some(envoy_types::pb::envoy::config::route::v3::route::Action::Route(
                        a,
                    )) = &mut route.action
                    {
                        a.retry_policy = None;
                    }
                }
            }
        }
    }
    Snapshot::from_resources(&resources)
}

/// Requests the execution logs in `dir` show running more than once.
fn executions(dir: &Path) -> std::collections::HashMap<String, u32> {
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
    runs
}

/// How one request ended.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ending {
    Ok,
    /// Reset or timed out on a proxy: it may have run (see the module doc).
    MayHaveRun,
    /// Failed without reaching a proxy that could run it.
    Lost,
    /// Ran, and the application answered it 5xx (a bad version): the application's
    /// failure, not the routing's.
    AppFailed,
    /// Never sent: `--max-in-flight` requests were already in flight (the load
    /// generator's own bound, counted failed for every arm alike).
    Shed,
    /// Turned away by Ray's backpressure (its 503, or gRPC `RESOURCE_EXHAUSTED`), retries
    /// spent: nothing ran. Lost, unless every proxy was refusing (`overload`).
    Refused,
}

struct LoadResult {
    requests: u64,
    /// (start, how it ended, latency, request number) of every request, by start.
    outcomes: Vec<(Duration, Ending, Duration, u64)>,
    /// Requests that ran on more than one proxy (from the proxies' execution logs).
    executed_twice: u64,
    /// Failed requests that ran on a proxy all the same (from the execution logs): the
    /// truth behind Envoy's "may have run".
    failed_ran: u64,
    /// Requests counted lost (Envoy said no proxy got them) that ran on a proxy all the
    /// same: a wrong "lost" would hide a request that could be replayed.
    lost_ran: u64,
    /// The cluster serving when the load stopped.
    served_by: Option<String>,
    /// `overload`: tries Envoy sent to the proxies per request it took, while every
    /// proxy refused.
    tries_per_request: Option<f64>,
    /// Proxies (of every cluster) answering their health check once the fault had struck.
    healthy_after_fault: usize,
    /// `upgrade-partial-capacity`: requests the new cluster ran while it ran a quarter.
    ran_on_partial: Option<usize>,
}

impl LoadResult {
    fn count(&self, ending: Ending) -> u64 {
        self.outcomes
            .iter()
            .filter(|(_, e, _, _)| *e == ending)
            .count() as u64
    }

    fn failed(&self) -> u64 {
        self.requests - self.count(Ending::Ok)
    }
}

type LoadClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<hyper::body::Bytes>,
>;

/// Open-loop POST load through Envoy until `stop`: a request starts every 1/rps
/// whatever is in flight, at most `max_in_flight` at once; returns once every request
/// has ended.
async fn load(port: u16, args: &Args, started: Instant, stop: CancellationToken) -> LoadResult {
    let client: LoadClient =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build_http();
    let grpc = (args.protocol == "grpc").then(|| echo_client(port));
    let in_flight = Arc::new(tokio::sync::Semaphore::new(args.max_in_flight));
    let timeout = Duration::from_secs(args.client_timeout);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rps as f64));
    // On schedule: ticks missed while the runtime was busy are caught up at once.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    let mut outcomes = Vec::new();
    let mut requests = 0u64;
    while !stop.is_cancelled() {
        // Latency counts from when the request was due, not from when the runtime got
        // to it: a stalled sender shows in the figures.
        let due = tokio::select! {
            _ = stop.cancelled() => break,
            due = tick.tick() => due.into_std(),
        };
        let n = requests;
        let id = format!("chaos-{n}");
        requests += 1;
        let at = started.elapsed();
        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
            outcomes.push((at, Ending::Shed, Duration::ZERO, n));
            continue;
        };
        let (client, grpc) = (client.clone(), grpc.clone());
        tasks.spawn(async move {
            let ending = match grpc {
                Some(grpc) => call(grpc, &id, timeout).await,
                None => send(&client, port, &id, timeout).await,
            };
            drop(permit);
            (at, ending, due.elapsed(), n)
        });
        while let Some(done) = tasks.try_join_next() {
            outcomes.push(done.expect("a request task"));
        }
    }
    while let Some(done) = tasks.join_next().await {
        outcomes.push(done.expect("a request task"));
    }
    outcomes.sort_by_key(|(at, _, _, _)| *at);
    LoadResult {
        requests,
        outcomes,
        executed_twice: 0,
        failed_ran: 0,
        lost_ran: 0,
        served_by: None,
        tries_per_request: None,
        healthy_after_fault: 0,
        ran_on_partial: None,
    }
}

/// One POST with request id `id`; how it ended.
async fn send(client: &LoadClient, port: u16, id: &str, timeout: Duration) -> Ending {
    use http_body_util::BodyExt;
    let request = hyper::Request::post(format!("http://127.0.0.1:{port}/hello"))
        .header("host", "demo")
        .header("x-request-id", id)
        .body(http_body_util::Full::new(hyper::body::Bytes::from_static(
            b"{\"prompt\":\"hi\"}",
        )))
        .unwrap();
    // `Err(false)`: Envoy gave no answer; `Err(true)`: the answer broke off after its
    // headers (the request reached a proxy).
    let result = tokio::time::timeout(timeout, async {
        let response = client.request(request).await.map_err(|_| false)?;
        let status = response.status();
        let body = response.into_body().collect().await.map_err(|_| true)?;
        Ok::<_, bool>((status, body.to_bytes()))
    })
    .await;
    match result {
        Ok(Ok((status, _))) if status.is_success() => Ending::Ok,
        Ok(Ok((_, body))) => {
            let body = String::from_utf8_lossy(&body);
            let on_a_proxy = [
                "upstream request timeout",
                "connection termination",
                "remote reset",
            ];
            if on_a_proxy.iter().any(|m| body.contains(m)) {
                Ending::MayHaveRun
            } else if body.contains("dropped due to backpressure") {
                Ending::Refused
            } else if body.contains("traceback") {
                // (The simulator's bad version answers as Ray does for an exception.)
                Ending::AppFailed
            } else {
                Ending::Lost
            }
        }
        // The client gave up while Envoy held the request on a proxy.
        Err(_) => Ending::MayHaveRun,
        // The answer broke off mid-way: it came from a proxy.
        Ok(Err(true)) => Ending::MayHaveRun,
        // Envoy itself did not answer.
        Ok(Err(false)) => Ending::Lost,
    }
}

type EchoClient = ray_serve_sim::grpc::pb::demo::echo_client::EchoClient<tonic::transport::Channel>;

/// A gRPC client of Envoy's listener: one HTTP/2 connection, as a gRPC client keeps.
fn echo_client(port: u16) -> EchoClient {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .expect("a valid URI")
        .connect_lazy();
    EchoClient::new(channel)
}

/// One unary gRPC call with request id `id`; how it ended, read as [`send`] reads an HTTP
/// answer: Envoy's local replies to a gRPC call carry the same words in `grpc-message`.
async fn call(mut client: EchoClient, id: &str, timeout: Duration) -> Ending {
    let mut request =
        tonic::Request::new(ray_serve_sim::grpc::pb::demo::SayRequest { text: "hi".into() });
    if let Ok(id) = id.parse() {
        request.metadata_mut().insert("x-request-id", id);
    }
    match tokio::time::timeout(timeout, client.say(request)).await {
        Ok(Ok(_)) => Ending::Ok,
        // The client gave up while Envoy held the call on a proxy.
        Err(_) => Ending::MayHaveRun,
        Ok(Err(status)) => {
            let on_a_proxy = [
                "upstream request timeout",
                "connection termination",
                "remote reset",
            ];
            if on_a_proxy.iter().any(|m| status.message().contains(m)) {
                Ending::MayHaveRun
            } else if status.code() == tonic::Code::ResourceExhausted {
                Ending::Refused
            } else {
                Ending::Lost
            }
        }
    }
}

/// How long every proxy refuses in `overload`.
const OVERLOAD_FOR: Duration = Duration::from_secs(5);

/// (tries Envoy sent to the RayService's clusters, requests its listener took) so far,
/// from its stats.
async fn envoy_tries(envoy: &Envoy) -> (f64, f64) {
    let stats = envoy
        .admin("/stats?filter=(upstream_rq_total|downstream_rq_total)$")
        .await;
    let (mut tries, mut requests) = (0.0, 0.0);
    for line in stats.lines() {
        let Some((name, value)) = line.split_once(": ") else {
            continue;
        };
        let value: f64 = value.trim().parse().unwrap_or(0.0);
        // The RayService's clusters are named namespace/service/cluster[/...].
        if let Some(cluster) = name
            .strip_prefix("cluster.")
            .and_then(|n| n.strip_suffix(".upstream_rq_total"))
        {
            if cluster.contains('/') {
                tries += value;
            }
        } else if name == "http.ray_serve_http.downstream_rq_total" {
            requests += value;
        }
    }
    (tries, requests)
}

/// How many of the clusters' proxies answer `/-/healthz` with success (1 s timeout).
async fn healthy_proxies(clusters: &[&SimRayCluster]) -> usize {
    let client = probe_client(Duration::from_secs(1));
    let mut healthy = 0;
    for proxy in clusters.iter().flat_map(|c| &c.proxies) {
        if probe_healthz(&client, proxy.address, Duration::from_secs(1)).await == Outcome::Healthy {
            healthy += 1;
        }
    }
    healthy
}

/// Which arms run in `scenario` (before `--arm` filters them).
fn arms_of(scenario: &str) -> Vec<&'static str> {
    ARMS.iter()
        .copied()
        .filter(|a| match *a {
            "baseline-kuberay-1.0" | "baseline-kuberay-incremental" => matches!(
                scenario,
                "upgrade"
                    | "upgrade-partial-capacity"
                    | "upgrade-bad-version"
                    | "replicas-restart-mid-shift"
                    | "cluster-replaced"
            ),
            // What the kept state buys: ray-xds restarted with nothing kept.
            "ray-xds-no-state" => scenario == "replicas-restart-mid-shift",
            _ => true,
        })
        .collect()
}

/// Runs one scenario against one arm, the fault striking `jitter` after `--fault-at`;
/// returns the load's outcome.
async fn run(scenario: &str, arm: &str, args: &Args, jitter: Duration) -> LoadResult {
    let shutdown = CancellationToken::new();
    let dir = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let grpc = args.protocol == "grpc";
    let a = SimRayCluster::start("a", 2, logs.path(), grpc, &shutdown).await;
    let b = SimRayCluster::start("b", 2, logs.path(), grpc, &shutdown).await;
    // Envoy binds its listener on a port of its own choosing; read it back below.
    let gateway_port = 0;
    let initial = view("a", &[&a]);
    let mut cp = match arm {
        "ray-xds" => {
            let traffic = args.traffic.as_deref();
            ControlPlane::ray_xds(dir.path(), &initial, false, true, gateway_port, traffic).await
        }
        "ray-xds-head-include" => {
            let traffic = args.traffic.as_deref();
            ControlPlane::ray_xds(dir.path(), &initial, true, true, gateway_port, traffic).await
        }
        "ray-xds-no-state" => {
            let traffic = args.traffic.as_deref();
            ControlPlane::ray_xds(dir.path(), &initial, false, false, gateway_port, traffic).await
        }
        "baseline-kuberay" => {
            ControlPlane::baseline(&initial, Switch::WhenRunning, false, gateway_port).await
        }
        "baseline-kuberay-policy" => {
            ControlPlane::baseline(&initial, Switch::WhenRunning, true, gateway_port).await
        }
        "baseline-kuberay-1.0" => {
            ControlPlane::baseline(&initial, Switch::AtOnce, false, gateway_port).await
        }
        "baseline-kuberay-incremental" => {
            let step = Switch::Incremental(args.incremental_step);
            ControlPlane::baseline(&initial, step, false, gateway_port).await
        }
        other => panic!("unknown arm {other}"),
    };
    let envoy = Envoy::start(Bootstrap::Sotw, cp.xds_port());
    let gateway_port = envoy.gateway_port().await;
    eventually("traffic flows", Duration::from_secs(30), || async {
        through_envoy(gateway_port).await
    })
    .await;
    if grpc {
        let client = echo_client(gateway_port);
        eventually("gRPC calls flow", Duration::from_secs(30), || async {
            (call(client.clone(), "warm-up", Duration::from_secs(2)).await == Ending::Ok)
                .then_some(())
        })
        .await;
    }
    // Every arm starts whole: each proxy it routes to is in Envoy, healthy (ray-xds's
    // default holds the head back as a fallback, so only the workers count there).
    let serving = if arm == "ray-xds" || arm == "ray-xds-no-state" {
        &a.proxies[1..]
    } else {
        &a.proxies[..]
    };
    eventually(
        "every serving proxy healthy in Envoy",
        Duration::from_secs(30),
        || async {
            let clusters = envoy.admin("/clusters").await;
            serving
                .iter()
                .all(|p| clusters.contains(&format!("::{}::health_flags::healthy", p.address)))
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    let sizes = Sizes::of(args.rps);
    let partial = matches!(
        scenario,
        "upgrade-partial-capacity" | "replicas-restart-mid-shift"
    );
    if partial {
        a.size(&sizes, FULL_REPLICAS).await;
    }
    // The drain lasts 30 s; a partial upgrade runs partial, then grows.
    let partial_for = Duration::from_secs(args.partial_for);
    let extra = match scenario {
        "proxy-drain" => 20,
        "upgrade-partial-capacity" => 9 + args.partial_for,
        // Partial 5 s longer, the control plane down for 2 s of them.
        "replicas-restart-mid-shift" => 14 + args.partial_for,
        // Long enough after the switch for the Envoys' reports to say how it fares, and
        // for KubeRay's incremental schedule (10% every 2 s) to reach the whole.
        "upgrade-bad-version" => 25,
        _ => 0,
    };
    let duration = Duration::from_secs(args.duration + extra);
    let started = Instant::now();
    let stop = CancellationToken::new();
    let load_task = {
        let (stop, args) = (stop.clone(), args.clone());
        tokio::spawn(async move { load(gateway_port, &args, started, stop).await })
    };
    tokio::time::sleep(Duration::from_secs(args.fault_at) + jitter).await;
    let mut ran_on_partial = None;
    let mut tries_per_request = None;

    match scenario {
        "head-crash" => a.proxies[0].process.signal(libc::SIGKILL),
        "worker-crash" => a.proxies[1].process.signal(libc::SIGKILL),
        "proxy-hang" => a.proxies[1].process.signal(libc::SIGSTOP),
        "proxy-drain" => {
            a.proxies[1].mode("draining").await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            a.proxies[1].process.signal(libc::SIGKILL);
        }
        "upgrade" => {
            // The new cluster's applications deploy for 10 s (its proxies answer 503).
            b.deploy(Duration::from_secs(args.deploy), None, "serving")
                .await;
            cp.set_source(&view("b", &[&a, &b])).await;
        }
        // The new cluster's applications run with a quarter of their replicas (under a
        // load the old cluster carries and the new one cannot alone), then it grows to
        // full size: KubeRay's standard upgrade sees RUNNING at once.
        "upgrade-partial-capacity" => {
            let running = b.deploy_at_a_quarter(&sizes, args.deploy).await;
            cp.set_source(&view("b", &[&a, &b])).await;
            running.await.unwrap();
            tokio::time::sleep(partial_for).await;
            ran_on_partial = Some(b.ran(logs.path()));
            b.size(&sizes, FULL_REPLICAS).await;
        }
        // The same upgrade, and every replica of the control plane restarts at once while
        // the new cluster runs a quarter of its replicas (its share held by capacity, the
        // source naming it active): down for 2 s, then partial 2 s + `--partial-for` more
        // before it grows.
        // For a baseline, KubeRay's operator restarts (its Service stays as it was).
        "replicas-restart-mid-shift" => {
            let running = b.deploy_at_a_quarter(&sizes, args.deploy).await;
            cp.set_source(&view("b", &[&a, &b])).await;
            running.await.unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            let stopped = tokio::time::Instant::now();
            cp.stop().await;
            tokio::time::sleep_until(stopped + Duration::from_secs(2)).await;
            cp.start().await;
            tokio::time::sleep_until(stopped + Duration::from_secs(4) + partial_for).await;
            ran_on_partial = Some(b.ran(logs.path()));
            b.size(&sizes, FULL_REPLICAS).await;
        }
        "upgrade-bad-version" => {
            assert!(
                !grpc,
                "upgrade-bad-version is HTTP only (the simulator's bad version)"
            );
            b.deploy(Duration::from_secs(args.deploy), None, "failing:20")
                .await;
            cp.set_source(&view("b", &[&a, &b])).await;
        }
        "cluster-replaced" => {
            // The head pod dies: its proxy and its dashboard.
            a.proxies[0].process.signal(libc::SIGKILL);
            a.dashboard_stop.cancel();
            b.deploy(Duration::from_secs(args.deploy), None, "serving")
                .await;
            cp.set_source(&view("b", &[&a, &b])).await;
        }
        // Timed from the stop call: stopping ray-xds waits for its tasks, a baseline's
        // only cancels its reconcile, and neither may shift the fault.
        "control-plane-restart" => {
            let stopped = tokio::time::Instant::now();
            cp.stop().await;
            tokio::time::sleep_until(stopped + Duration::from_secs(2)).await;
            cp.start().await;
        }
        // Every proxy refuses every request for a while (Ray's backpressure: all of them
        // 503, nothing runs), then serves again: how many tries Envoy sends per request
        // while nothing can succeed.
        "overload" => {
            let before = envoy_tries(&envoy).await;
            for p in &a.proxies {
                p.mode("overloaded").await;
            }
            tokio::time::sleep(OVERLOAD_FOR).await;
            let after = envoy_tries(&envoy).await;
            for p in &a.proxies {
                p.mode("serving").await;
            }
            let (tries, requests) = (after.0 - before.0, after.1 - before.1);
            tries_per_request = (requests > 0.0).then(|| tries / requests);
        }
        "control-plane-down-crash" | "control-plane-down-hang" => {
            let stopped = tokio::time::Instant::now();
            cp.stop().await;
            tokio::time::sleep_until(stopped + Duration::from_secs(1)).await;
            let signal = if scenario == "control-plane-down-crash" {
                libc::SIGKILL
            } else {
                libc::SIGSTOP
            };
            a.proxies[2].process.signal(signal);
            tokio::time::sleep_until(stopped + Duration::from_secs(6)).await;
            cp.start().await;
        }
        other => panic!("unknown scenario {other}"),
    }
    // The premise of "lost": a healthy proxy existed. Every scenario faults one proxy of
    // three (or switches with the old cluster whole); checked, not assumed.
    let healthy_after_fault = healthy_proxies(&[&a, &b]).await;
    if let Some(after) = std::env::var_os("CHAOS_DEBUG") {
        // `CHAOS_DEBUG=<seconds>`: how long after the fault to look (2 by default).
        let after = after.to_str().and_then(|s| s.parse().ok()).unwrap_or(2);
        tokio::time::sleep(Duration::from_secs(after)).await;
        let served = through_envoy(gateway_port).await.map(|s| s.cluster);
        eprintln!("debug: {arm} served by {served:?}");
        if let ControlPlane::RayXds {
            running: Some(r), ..
        } = &cp
        {
            eprintln!("{}", admin_get(r.admin_addr, "/debug/state").await);
            eprintln!(
                "debug: {}",
                admin_get(r.admin_addr, "/replica/switchover").await
            );

            let metrics = admin_get(r.admin_addr, "/metrics").await;
            for line in metrics.lines().filter(|l| l.contains("load_")) {
                eprintln!("debug: {line}");
            }
        }
    }
    let elapsed = started.elapsed();
    if elapsed < duration {
        tokio::time::sleep(duration - elapsed).await;
    }
    stop.cancel();
    // Who serves now, asked outside the load (which has stopped) and a few times over: a
    // single request may meet a hung proxy and would otherwise hold the run for its timeout.
    let mut served_by = None;
    for _ in 0..3 {
        if let Ok(Some(served)) =
            tokio::time::timeout(Duration::from_secs(2), through_envoy(gateway_port)).await
        {
            served_by = Some(served.cluster);
            break;
        }
    }
    if scenario == "proxy-hang" || scenario == "control-plane-down-hang" {
        // Requests stuck on the stopped proxy end at the client's timeout.
        tokio::time::sleep(Duration::from_secs(args.client_timeout + 1)).await;
        let hung = if scenario == "proxy-hang" { 1 } else { 2 };
        a.proxies[hung].process.signal(libc::SIGCONT);
        // The resumed proxy runs what was queued on it: read the logs once they stop
        // growing.
        let mut last = usize::MAX;
        for _ in 0..20 {
            let now: usize = executions(logs.path()).values().map(|n| *n as usize).sum();
            if now == last {
                break;
            }
            last = now;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    let mut result = load_task.await.unwrap();
    result.served_by = served_by;
    result.healthy_after_fault = healthy_after_fault;
    result.ran_on_partial = ran_on_partial;
    result.tries_per_request = tries_per_request;
    if std::env::var_os("CHAOS_DEBUG").is_some() {
        // What Envoy's retries, outlier detection and connections did, per cluster.
        let stats = envoy.admin("/stats?filter=(retry|outlier|cx_connect|rq_timeout|rq_total|ejections_active|rq_pending)").await;
        eprintln!("debug: {arm} envoy stats:\n{stats}");
    }
    let runs = executions(logs.path());
    result.executed_twice = runs.values().filter(|n| **n > 1).count() as u64;
    let ran = |counted: fn(Ending) -> bool| {
        result
            .outcomes
            .iter()
            .filter(|(_, e, _, n)| counted(*e) && runs.contains_key(&format!("chaos-{n}")))
            .count() as u64
    };
    (result.failed_ran, result.lost_ran) = (ran(|e| e != Ending::Ok), ran(|e| e == Ending::Lost));
    cp.end().await;
    drop(envoy);
    shutdown.cancel();
    result
}

/// One trial's figures.
struct TrialStats {
    requests: u64,
    failed: u64,
    executed_twice: u64,
    may_have_run: u64,
    lost: u64,
    app_failed: u64,
    shed: u64,
    refused: u64,
    failed_ran: u64,
    lost_ran: u64,
    tries_per_request: Option<f64>,
    /// From the first failure's start to the last's.
    window: Duration,
    /// Latencies of the requests that succeeded.
    latencies: Vec<Duration>,
    served_by: String,
}

impl TrialStats {
    fn of(r: &LoadResult) -> TrialStats {
        let latencies = r
            .outcomes
            .iter()
            .filter(|(_, e, _, _)| *e == Ending::Ok)
            .map(|(_, _, t, _)| *t)
            .collect();
        let failures: Vec<Duration> = r
            .outcomes
            .iter()
            .filter(|(_, e, _, _)| *e != Ending::Ok)
            .map(|(at, _, _, _)| *at)
            .collect();
        let window = match (failures.first(), failures.last()) {
            (Some(first), Some(last)) => *last - *first,
            _ => Duration::ZERO,
        };
        TrialStats {
            requests: r.requests,
            failed: r.failed(),
            executed_twice: r.executed_twice,
            may_have_run: r.count(Ending::MayHaveRun),
            lost: r.count(Ending::Lost),
            app_failed: r.count(Ending::AppFailed),
            shed: r.count(Ending::Shed),
            refused: r.count(Ending::Refused),
            failed_ran: r.failed_ran,
            lost_ran: r.lost_ran,
            tries_per_request: r.tries_per_request,
            window,
            latencies,
            served_by: r.served_by.clone().unwrap_or_else(|| "none".into()),
        }
    }
}

/// The `q` quantile of sorted `values` (nearest rank), in milliseconds.
fn quantile_ms(sorted: &[Duration], q: f64) -> f64 {
    sorted
        .get(((sorted.len().max(1) - 1) as f64 * q).round() as usize)
        .copied()
        .unwrap_or_default()
        .as_secs_f64()
        * 1000.0
}

/// The median of `values` (the lower middle one for an even count).
fn median(values: &[u64]) -> u64 {
    let mut v = values.to_vec();
    v.sort_unstable();
    v.get((v.len().max(1) - 1) / 2).copied().unwrap_or(0)
}

/// The line scripts read (see the module doc): an arm's trials summed, latency
/// percentiles over every request that succeeded in any of them, and the median and
/// maximum of the per-trial failures.
fn line(scenario: &str, arm: &str, protocol: &str, trials: &[TrialStats]) -> String {
    let sum = |f: fn(&TrialStats) -> u64| trials.iter().map(f).sum::<u64>();
    let per_trial = |f: fn(&TrialStats) -> u64| trials.iter().map(f).collect::<Vec<u64>>();
    let mut latencies: Vec<Duration> = trials
        .iter()
        .flat_map(|t| t.latencies.iter().copied())
        .collect();
    latencies.sort_unstable();
    let mut served_by: Vec<&str> = trials.iter().map(|t| t.served_by.as_str()).collect();
    served_by.sort_unstable();
    served_by.dedup();
    let failed = per_trial(|t| t.failed);
    let may_have_run = per_trial(|t| t.may_have_run);
    let mut tries: Vec<f64> = trials.iter().filter_map(|t| t.tries_per_request).collect();
    tries.sort_by(f64::total_cmp);
    let tries = match (tries.get((tries.len().max(1) - 1) / 2), tries.last()) {
        (Some(median), Some(max)) => format!("{median:.2} tries_per_request_max={max:.2}"),
        _ => "- tries_per_request_max=-".to_string(),
    };
    format!(
        "chaos scenario={scenario} arm={arm} requests={} failed={} executed_twice={} p99_ms={:.1} p50_ms={:.1} max_ms={:.1} may_have_run={} lost={} refused={} app_failed={} shed={} failed_ran={} lost_ran={} window_ms={} served_by={} trials={} failed_median={} failed_max={} may_have_run_median={} may_have_run_max={} tries_per_request={tries} protocol={protocol}",
        sum(|t| t.requests),
        sum(|t| t.failed),
        sum(|t| t.executed_twice),
        quantile_ms(&latencies, 0.99),
        quantile_ms(&latencies, 0.5),
        latencies.last().copied().unwrap_or_default().as_secs_f64() * 1000.0,
        sum(|t| t.may_have_run),
        sum(|t| t.lost),
        sum(|t| t.refused),
        sum(|t| t.app_failed),
        sum(|t| t.shed),
        sum(|t| t.failed_ran),
        sum(|t| t.lost_ran),
        trials.iter().map(|t| t.window.as_millis()).max().unwrap_or(0),
        served_by.join(","),
        trials.len(),
        median(&failed),
        failed.iter().max().copied().unwrap_or(0),
        median(&may_have_run),
        may_have_run.iter().max().copied().unwrap_or(0),
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

/// The most tries per request Envoy may send while every proxy refuses (`overload`).
const OVERLOAD_TRIES_PER_REQUEST: f64 = 1.25;

/// The most requests a hang may leave "may have run" in one run of a ray-xds arm.
const HANG_MAY_HAVE_RUN: u64 = 10;

/// Why a ray-xds arm's run fails `--assert`, if it does: no healthy proxy after the fault
/// (the run cannot tell lost from unavoidable), a lost request (`lost_ran`, a lost one
/// that ran all the same, is always one of these), one run twice, or more
/// requests that may have run than the fault explains. A crash, drain or
/// switchover leaves at most those in flight on the proxy when it died (a handful at
/// these rates); a hang, those sent to the stopped proxy before least request stops
/// picking it (at most [`HANG_MAY_HAVE_RUN`]), whether ray-xds is up or down.
fn broken_by(scenario: &str, r: &LoadResult) -> Option<&'static str> {
    let may_have_run = r.count(Ending::MayHaveRun);
    if r.healthy_after_fault == 0 {
        Some("no healthy proxy after the fault: the run proves nothing")
    } else if r.count(Ending::Lost) > 0 {
        Some("lost requests")
    } else if scenario != "overload" && r.count(Ending::Refused) > 0 {
        // A proxy's backpressure while another could run it: lost.
        Some("requests refused by Ray's backpressure while a proxy could run them")
    } else if scenario == "overload"
        && r.tries_per_request
            .is_none_or(|t| t > OVERLOAD_TRIES_PER_REQUEST)
    {
        Some("more tries per request than the bound while every proxy refused")
    } else if r.executed_twice > 0 {
        Some("requests run twice")
    } else if r.ran_on_partial == Some(0) {
        Some("the new cluster ran nothing while it ran a quarter: no share by capacity shown")
    } else if r.count(Ending::Shed) > 0 {
        Some("requests piled up to the load's in-flight bound")
    } else if matches!(
        scenario,
        "upgrade" | "upgrade-partial-capacity" | "replicas-restart-mid-shift" | "cluster-replaced"
    ) && r.served_by.as_deref() != Some("b")
    {
        Some("traffic not on the new cluster when the load stopped")
    } else if scenario == "upgrade-bad-version" && r.served_by.as_deref() != Some("a") {
        Some("traffic not back on the old cluster when the load stopped")
    } else if matches!(scenario, "proxy-hang" | "control-plane-down-hang")
        && may_have_run > HANG_MAY_HAVE_RUN
    {
        // Least request over every proxy stops picking a hung one after its first
        // request or so, with or without ray-xds: at most 10 a run (docs/benchmarks.md).
        Some("more requests sent to the hung proxy than least request lets through")
    } else if !scenario.ends_with("hang") && may_have_run > 3 {
        Some("more requests failed on the faulted proxy than were in flight")
    } else {
        None
    }
}

async fn bench_main() {
    let args = Args::parse();
    // What produced these numbers: the commit, whether the tree had changes, the args.
    let commit = Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .current_dir(project_root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    println!("chaos run commit={commit} args={argv:?}");
    let scenarios: Vec<String> = if args.scenarios.is_empty() {
        SCENARIOS.iter().map(|s| s.to_string()).collect()
    } else {
        args.scenarios.clone()
    };
    for s in &scenarios {
        assert!(SCENARIOS.contains(&s.as_str()), "unknown scenario {s}");
    }
    for a in &args.arms {
        assert!(ARMS.contains(&a.as_str()), "unknown arm {a}");
    }
    let mut broken = Vec::new();
    // Each trial runs every scenario (so a run cut short still has whole trials), and
    // within a scenario the arms take turns.
    let arms: Vec<Vec<&str>> = scenarios
        .iter()
        .map(|scenario| {
            arms_of(scenario)
                .into_iter()
                .filter(|arm| args.arms.is_empty() || args.arms.iter().any(|a| a == arm))
                .collect()
        })
        .collect();
    let mut trials: Vec<Vec<Vec<TrialStats>>> = arms
        .iter()
        .map(|of| of.iter().map(|_| Vec::new()).collect())
        .collect();
    let last_trial = args.trials.max(1) - 1;
    for trial in 0..=last_trial {
        for (i, scenario) in scenarios.iter().enumerate() {
            // Every arm of a trial meets the same fault at the same point; the arms'
            // order rotates from trial to trial.
            let jitter = Duration::from_millis(fastrand::u64(0..args.fault_jitter_ms.max(1)));
            let n = arms[i].len();
            let order: Vec<usize> = (0..n).map(|k| (k + trial) % n).collect();
            let results: Vec<LoadResult> = if args.arms_together {
                futures::future::join_all(
                    order
                        .iter()
                        .map(|&j| run(scenario, arms[i][j], &args, jitter)),
                )
                .await
            } else {
                let mut results = Vec::new();
                for &j in &order {
                    results.push(run(scenario, arms[i][j], &args, jitter).await);
                }
                results
            };
            for (&j, result) in order.iter().zip(results) {
                let arm = arms[i][j];
                let one = TrialStats::of(&result);
                let trial_line = line(scenario, arm, &args.protocol, std::slice::from_ref(&one));
                eprintln!(
                    "trial={trial} fault_ms={} {trial_line}",
                    args.fault_at * 1000 + jitter.as_millis() as u64
                );
                if result.healthy_after_fault == 0 {
                    eprintln!("warning: no healthy proxy after the fault: {trial_line}");
                }
                // (`ray-xds-no-state` is a reference, as the baselines are.)
                if arm.starts_with("ray-xds") && arm != "ray-xds-no-state" {
                    if let Some(why) = broken_by(scenario, &result) {
                        broken.push(format!("{why}: trial={trial} {trial_line}"));
                    }
                }
                trials[i][j].push(one);
            }
            if trial == last_trial {
                for (arm, stats) in arms[i].iter().zip(&trials[i]) {
                    println!("{}", line(scenario, arm, &args.protocol, stats));
                }
            }
        }
    }
    if args.assert && !broken.is_empty() {
        eprintln!("ray-xds lost requests or executed them twice:");
        for line in broken {
            eprintln!("  {line}");
        }
        std::process::exit(1);
    }
}

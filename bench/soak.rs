//! The soak benchmark: a real `ray-xds` process under minutes of churn, its resources
//! sampled, and every one of them back to where it was once the churn stops.
//!
//! ```sh
//! cargo bench --bench soak                     # 600 s of churn (release)
//! cargo bench --bench soak -- --duration 60    # one minute
//! cargo test --bench soak -- --duration 20     # the CI smoke (debug build)
//! cargo bench --bench soak -- --help           # every knob
//! ```
//!
//! What it models (everything on loopback, `ray-xds` with a file source it rewrites):
//!
//! - **RayServices** (`--services`, 3), each with one serving RayCluster of a head and
//!   `--workers` worker proxies (`ray_serve_sim` proxies, served in this process) and a
//!   simulated Ray dashboard listing its application as RUNNING.
//! - **Proxies flapping** every second (`--flaps` per second, 2): a proxy of a serving
//!   cluster is killed (its port refuses connections, then it is restarted on the same
//!   port), hangs (answers only after 3 s, well past the probe timeout), drains (503
//!   `This node is being drained.`, and DRAINING on its dashboard) or flaps (its
//!   `/-/healthz` alternates between 200 and 500), for 1 to 4 s, then serves again.
//! - **Upgrades** every `--upgrade-every` seconds (4), round robin over the RayServices:
//!   a new RayCluster with a name never used before (fresh proxies and dashboard, its
//!   application DEPLOYING for 1 s) becomes the `pending_cluster`; once ray-xds has moved
//!   all of the RayService's traffic to it (`ray_xds_switchover_weight` 100), the file
//!   makes it the active cluster and drops the old one, whose proxies and dashboard are
//!   then stopped. Clusters come and go continuously; each RayService sets
//!   `switchover: { warm_timeout: 3s, drain_grace: 5s }` so that a switch does not wait
//!   10 s for the client that never ACKs, and a dropped cluster leaves 5 s later.
//! - **Envoys connecting and leaving**: `--clients` (4) ADS clients at any time, state of
//!   the world and delta in turn, each on its own connection. Each follows like Envoy
//!   (CDS and LDS by wildcard, EDS for the clusters it got, RDS for the listener's route,
//!   every response ACKed) for 2 to 8 s, then leaves: half close their request stream,
//!   half just drop the connection.
//! - **Clients that never ACK**: one SotW and one delta stream subscribe to everything at
//!   the start of the churn and never ACK anything, open until the churn stops.
//!
//! The procedure: start; a warm-up churn (`--warmup`, 20 s: every kind of event happens,
//! so one-time costs such as lazily created metric label sets, the allocator's arenas and
//! pooled connections are paid); quiesce; settle (`--settle`, 30 s); take the
//! **baseline**; churn for `--duration` seconds (600); quiesce; settle; take the **end**
//! figures. Quiesce means: every ADS client gone (the never-ACKing ones too), every
//! proxy serving again, a pending upgrade finished; so at both points ray-xds serves the
//! same number of RayServices, clusters (one each), proxies and dashboards, and has no
//! ADS stream. A figure is the smallest of three samples taken 1 s apart. The table also
//! shows a `start` sample, taken before any churn: it has fewer series (the per protocol
//! and type counters appear with the first ADS client), which is why the baseline comes
//! after a warm-up and not from the start.
//!
//! Sampled every `--sample-every` seconds (5) from outside the process: RSS (`VmRSS` of
//! `/proc/<pid>/status`), open file descriptors (entries of `/proc/<pid>/fd`), the async
//! runtime's live tasks (`ray_xds_runtime_alive_tasks` on `/metrics`) and the number of
//! `/metrics` series (lines not starting with `#`).
//!
//! **Flat** means, end against baseline:
//! - file descriptors at most `--fd-margin` (4) more;
//! - tasks at most `--task-margin` (4) more;
//! - series at most `--series-margin` (8) more (a counter's label set, such as a stream
//!   error's reason, appears the first time it happens; every such set is a fixed
//!   `&'static str`, so this is bounded), and no series names a cluster that no longer
//!   exists (`switchover_weight`), and one `snapshot_info`;
//! - RSS grown by at most the larger of `--rss-margin-mib` (4 MiB) and
//!   `--rss-margin-pct` (10%) of the baseline. After a peak the allocator keeps some
//!   freed memory, so RSS need not come all the way back (after 120 s of churn it stays
//!   ~0.8 MiB up while the heap in use is back to the baseline's); a leak grows with the
//!   churn's length. The bound is tight enough for the leak this benchmark found (the
//!   probe and dashboard clients' connection pools kept ~13 KiB for every proxy and
//!   dashboard that went away: +1.3 MiB per 120 s here, ~7 MiB over the default 600 s)
//!   and loose enough for what the allocator keeps. The release baseline is ~15 MiB, so
//!   the 4 MiB governs.
//!
//! The last line is `soak duration_s=<n> rss_kib_baseline=<a> rss_kib_end=<b>
//! fds_baseline=.. fds_end=.. tasks_baseline=.. tasks_end=.. series_baseline=..
//! series_end=.. upgrades=<n> flaps=<n> clients=<n> verdict=<flat|grew>` (the counts are
//! the measured churn's, not the warm-up's); with `grew` the line before it names what
//! grew and the benchmark exits with status 1. The samples are printed as a table first.
//!
//! The simulated proxies, dashboards and ADS clients run in this process, on one thread:
//! the two processes share the machine's cores, so the churn is slower on a small one.

// A benchmark run reads top to bottom (set up, measure, report): its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use prost::Message;
use ray_serve_sim::dashboard::SimDashboard;
use ray_serve_sim::{NodeType, ProxyConfig, ProxyHandle, ProxyMode};
use ray_xds::xds::snapshot::{
    CLUSTER_TYPE_URL, ENDPOINTS_TYPE_URL, LISTENER_TYPE_URL, ROUTE_TYPE_URL,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

#[path = "support/mod.rs"]
mod bench_support;
use bench_support::{free_port, http_get, metric_value, open_fds, rss_kib, write_atomic};

#[derive(Parser, Debug, Clone)]
#[command(about = "Soak: ray-xds under churn; RSS, fds, tasks and /metrics series flat after it")]
struct Args {
    /// Seconds of churn measured.
    #[arg(long, default_value_t = 600)]
    duration: u64,
    /// Seconds of churn before the baseline.
    #[arg(long, default_value_t = 20)]
    warmup: u64,
    /// Seconds of quiet after each churn before its figures are taken.
    #[arg(long, default_value_t = 30)]
    settle: u64,
    /// RayServices.
    #[arg(long, default_value_t = 3)]
    services: usize,
    /// Worker proxies per RayCluster (each also has a head).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Proxy faults started per second.
    #[arg(long, default_value_t = 2)]
    flaps: usize,
    /// Seconds between upgrades (round robin over the RayServices).
    #[arg(long, default_value_t = 4.0)]
    upgrade_every: f64,
    /// ADS clients following at any time (besides the two that never ACK).
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Seconds between samples.
    #[arg(long, default_value_t = 5)]
    sample_every: u64,
    /// Rows of the printed table (samples are thinned to about this many).
    #[arg(long, default_value_t = 30)]
    table_rows: usize,
    /// Flat: at most this many more file descriptors than the baseline.
    #[arg(long, default_value_t = 4)]
    fd_margin: u64,
    /// Flat: at most this many more runtime tasks than the baseline.
    #[arg(long, default_value_t = 4)]
    task_margin: u64,
    /// Flat: at most this many more /metrics series than the baseline.
    #[arg(long, default_value_t = 8)]
    series_margin: u64,
    /// Flat: RSS grown by at most the larger of this many MiB ...
    #[arg(long, default_value_t = 4)]
    rss_margin_mib: u64,
    /// ... and this percentage of the baseline.
    #[arg(long, default_value_t = 10)]
    rss_margin_pct: u64,
    /// The ray-xds binary [default: the one cargo built with this benchmark].
    #[arg(long)]
    ray_xds: Option<PathBuf>,
    /// Ignored: cargo passes it to every benchmark.
    #[arg(long, hide = true)]
    bench: bool,
}

const NAMESPACE: &str = "soak";
const ROUTE_NAME: &str = "ray-serve-http";

// ---------------------------------------------------------------------------------------
// The ray-xds process

/// The ray-xds child: SIGTERM, then SIGKILL, when dropped; SIGKILL by the kernel if this
/// process dies first (`PR_SET_PDEATHSIG`).
struct Server {
    child: Child,
    log: PathBuf,
}

impl Server {
    fn start(binary: &Path, services: &Path, xds: u16, admin: u16, log: PathBuf) -> Server {
        use std::os::unix::process::CommandExt;
        let stderr = std::fs::File::create(&log).expect("the ray-xds log file");
        let mut command = Command::new(binary);
        command
            .args(["serve", "--source-file"])
            .arg(services)
            .args(["--xds-listen", &format!("127.0.0.1:{xds}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
            .env("RAY_XDS_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        Server { child, log }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Panics with the end of its log if ray-xds has exited.
    fn check_alive(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "ray-xds exited ({status}); its log ends:\n{}",
                tail.join("\n")
            );
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn metrics(admin: u16) -> Option<String> {
    match http_get(admin, "/metrics", Duration::from_secs(5)).await {
        Some((200, body)) => Some(body),
        _ => None,
    }
}

fn series(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
}

fn weight_key(service: &str, cluster: &str) -> String {
    format!(
        "ray_xds_switchover_weight{{rayservice=\"{NAMESPACE}/{service}\",cluster=\"{cluster}\"}}"
    )
}

// ---------------------------------------------------------------------------------------
// Samples

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Figures {
    rss_kib: u64,
    fds: u64,
    tasks: u64,
    series: u64,
}

#[derive(Clone, Debug)]
struct Sample {
    at: Duration,
    phase: &'static str,
    figures: Figures,
    /// Connected ADS streams (`ray_xds_xds_streams`, both protocols).
    streams: u64,
    /// `switchover_weight` series: the clusters ray-xds weighs now.
    weights: u64,
}

/// One sample; None if /metrics did not answer.
async fn sample(pid: u32, admin: u16, started: Instant, phase: &'static str) -> Option<Sample> {
    // The process's own figures first, so the /metrics connection is not among them.
    let (rss_kib, fds) = (rss_kib(pid), open_fds(pid));
    let text = metrics(admin).await?;
    let tasks = metric_value(&text, "ray_xds_runtime_alive_tasks").unwrap_or(0.0) as u64;
    let streams = series(&text)
        .filter(|l| l.starts_with("ray_xds_xds_streams{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum::<f64>() as u64;
    let weights = series(&text)
        .filter(|l| l.starts_with("ray_xds_switchover_weight{"))
        .count() as u64;
    Some(Sample {
        at: started.elapsed(),
        phase,
        figures: Figures {
            rss_kib,
            fds,
            tasks,
            series: series(&text).count() as u64,
        },
        streams,
        weights,
    })
}

/// Samples every `every` into `samples`, labelled with the current `phase`, until `stop`.
fn spawn_sampler(
    pid: u32,
    admin: u16,
    started: Instant,
    every: Duration,
    phase: Arc<Mutex<&'static str>>,
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let p = *phase.lock().unwrap();
            if let Some(s) = sample(pid, admin, started, p).await {
                samples.lock().unwrap().push(s);
            }
        }
    })
}

// ---------------------------------------------------------------------------------------
// Simulated Ray

/// One simulated Ray Serve proxy, served in this process.
struct SimProxy {
    address: SocketAddr,
    node_type: NodeType,
    config: ProxyConfig,
    handle: ProxyHandle,
    /// Stops the running instance (a killed proxy's port refuses connections).
    stop: CancellationToken,
    /// The fault it is under, and until when.
    fault: Option<(Fault, Instant)>,
}

impl SimProxy {
    async fn start(cluster: &str, node_type: NodeType) -> SimProxy {
        let listener = bind_below_ephemeral().await;
        let mut proxy = SimProxy {
            address: listener.local_addr().unwrap(),
            node_type,
            config: ProxyConfig {
                cluster: cluster.into(),
                node_type,
                routes: [("/".to_string(), "hello".to_string())].into(),
            },
            handle: ProxyHandle::default(),
            stop: CancellationToken::new(),
            fault: None,
        };
        proxy.serve(listener);
        proxy
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        self.stop = CancellationToken::new();
        tokio::spawn(ray_serve_sim::serve_proxy_with(
            listener,
            self.config.clone(),
            self.handle.clone(),
            self.stop.clone(),
        ));
    }

    /// Serves again on the same port after a kill.
    async fn revive(&mut self) {
        for _ in 0..100 {
            if let Ok(l) = tokio::net::TcpListener::bind(self.address).await {
                self.serve(l);
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "a killed simulated proxy could not bind {} again",
            self.address
        );
    }
}

/// A listener on a port below the kernel's ephemeral range, where no outgoing
/// connection (ray-xds's probes, the ADS clients) can take it while the proxy is killed,
/// and never one this process handed out before (`free_port`): a proxy started while
/// another is killed cannot take the killed one's port, so that it can be restarted on
/// the same port. (Without that memory a proxy started meanwhile could take it.)
async fn bind_below_ephemeral() -> tokio::net::TcpListener {
    loop {
        if let Ok(l) = tokio::net::TcpListener::bind(("127.0.0.1", free_port())).await {
            return l;
        }
    }
}

impl Drop for SimProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// The port refuses connections (a SIGKILLed proxy), then it is restarted.
    Kill,
    /// Answers only after 3 s, far past the probe timeout (a hung proxy).
    Hang,
    /// Ray's draining answer, and DRAINING on the dashboard.
    Drain,
    /// `/-/healthz` alternates between 200 and 500.
    Flap,
}

const FAULTS: [Fault; 4] = [Fault::Kill, Fault::Hang, Fault::Drain, Fault::Flap];

/// One simulated RayCluster: proxies and a dashboard.
struct SimCluster {
    name: String,
    proxies: Vec<SimProxy>,
    dashboard: SimDashboard,
    dashboard_url: String,
    dashboard_stop: CancellationToken,
}

impl SimCluster {
    /// A cluster whose application deploys for `deploying` (proxies serve at once).
    async fn start(name: &str, workers: usize, deploying: Duration) -> SimCluster {
        let mut proxies = vec![SimProxy::start(name, NodeType::Head).await];
        for _ in 0..workers {
            proxies.push(SimProxy::start(name, NodeType::Worker).await);
        }
        let dashboard = SimDashboard::new();
        if deploying.is_zero() {
            dashboard.set_app("hello", "/", "RUNNING");
        } else {
            dashboard.deploy_app("hello", "/", deploying, "RUNNING");
        }
        for p in &proxies {
            dashboard.add_proxy(p.address, p.node_type, "HEALTHY");
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dashboard_url = format!("http://{}", listener.local_addr().unwrap());
        let dashboard_stop = CancellationToken::new();
        tokio::spawn(dashboard.clone().serve(listener, dashboard_stop.clone()));
        SimCluster {
            name: name.into(),
            proxies,
            dashboard,
            dashboard_url,
            dashboard_stop,
        }
    }

    fn fault(&mut self, i: usize, fault: Fault, until: Instant) {
        let p = &mut self.proxies[i];
        match fault {
            Fault::Kill => p.stop.cancel(),
            Fault::Hang => p.handle.set(ProxyMode::Slow(Duration::from_secs(3))),
            Fault::Drain => {
                p.handle.set(ProxyMode::Draining);
                self.dashboard.set_proxy_status(p.address, "DRAINING");
            }
            Fault::Flap => p.handle.set(ProxyMode::Flapping),
        }
        p.fault = Some((fault, until));
    }

    async fn heal(&mut self, i: usize) {
        let p = &mut self.proxies[i];
        match p.fault.take() {
            Some((Fault::Kill, _)) => p.revive().await,
            Some((Fault::Drain, _)) => {
                p.handle.set(ProxyMode::Serving);
                self.dashboard.set_proxy_status(p.address, "HEALTHY");
            }
            Some(_) => p.handle.set(ProxyMode::Serving),
            None => {}
        }
    }

    fn yaml(&self) -> String {
        let mut s = format!(
            "      - name: {}\n        dashboard: {}\n        proxies:\n",
            self.name, self.dashboard_url
        );
        for p in &self.proxies {
            s += &format!(
                "          - {{ address: \"{}\", node_type: {} }}\n",
                p.address, p.node_type
            );
        }
        s
    }
}

impl Drop for SimCluster {
    fn drop(&mut self) {
        self.dashboard_stop.cancel();
    }
}

struct Service {
    name: String,
    generation: usize,
    active: SimCluster,
    /// An upgrade under way: the new cluster, and since when.
    pending: Option<(SimCluster, Instant)>,
}

/// What the benchmark runs against ray-xds: its services file and the simulated Ray.
struct World {
    args: Args,
    file: PathBuf,
    admin: u16,
    services: Vec<Service>,
    /// The next RayService to upgrade.
    next_upgrade: usize,
}

impl World {
    fn yaml(&self) -> String {
        let mut s = String::from("rayservices:\n");
        for svc in &self.services {
            s += &format!(
                "  - name: {}\n    namespace: {NAMESPACE}\n    hosts: [\"{}.{NAMESPACE}\"]\n    active_cluster: {}\n",
                svc.name, svc.name, svc.active.name
            );
            if let Some((p, _)) = &svc.pending {
                s += &format!("    pending_cluster: {}\n", p.name);
            }
            s += "    switchover: { warm_timeout: 3s, drain_grace: 5s }\n    clusters:\n";
            s += &svc.active.yaml();
            if let Some((p, _)) = &svc.pending {
                s += &p.yaml();
            }
        }
        s
    }

    fn write(&self) {
        write_atomic(&self.file, &self.yaml());
    }

    fn cluster_names(&self) -> BTreeSet<String> {
        self.services
            .iter()
            .flat_map(|s| {
                std::iter::once(s.active.name.clone())
                    .chain(s.pending.as_ref().map(|(p, _)| p.name.clone()))
            })
            .collect()
    }

    /// Starts an upgrade of the next RayService that has none under way; false if every
    /// one has.
    async fn start_upgrade(&mut self) -> bool {
        let n = self.services.len();
        for k in 0..n {
            let i = (self.next_upgrade + k) % n;
            if self.services[i].pending.is_some() {
                continue;
            }
            self.next_upgrade = (i + 1) % n;
            let svc = &mut self.services[i];
            svc.generation += 1;
            let name = format!("{}-g{}", svc.name, svc.generation);
            let cluster = SimCluster::start(&name, self.args.workers, Duration::from_secs(1)).await;
            svc.pending = Some((cluster, Instant::now()));
            self.write();
            return true;
        }
        false
    }

    /// Promotes every pending cluster that ray-xds now serves at 100%: it becomes the
    /// active one and the old one leaves the file and stops. Returns how many.
    async fn promote_switched(&mut self) -> usize {
        if self.services.iter().all(|s| s.pending.is_none()) {
            return 0;
        }
        let Some(text) = metrics(self.admin).await else {
            return 0;
        };
        let mut old = Vec::new();
        for svc in &mut self.services {
            let Some((p, since)) = &svc.pending else {
                continue;
            };
            if metric_value(&text, &weight_key(&svc.name, &p.name)) == Some(100.0) {
                let (new, _) = svc.pending.take().unwrap();
                old.push(std::mem::replace(&mut svc.active, new));
            } else if since.elapsed() > Duration::from_secs(60) {
                panic!(
                    "{}: ray-xds has not switched to {} in 60 s",
                    svc.name, p.name
                );
            }
        }
        if !old.is_empty() {
            self.write();
        }
        // The old clusters' proxies and dashboards stop (when dropped) once the file no
        // longer names them, as KubeRay deletes a RayCluster after promoting the next.
        old.len()
    }
}

impl World {
    /// Faults one proxy of a serving cluster that is not under a fault already.
    fn flap(&mut self, now: Instant) -> Option<Fault> {
        let candidates: Vec<(usize, usize)> = self
            .services
            .iter()
            .enumerate()
            .flat_map(|(s, svc)| {
                svc.active
                    .proxies
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.fault.is_none())
                    .map(move |(i, _)| (s, i))
            })
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let (s, i) = candidates[fastrand::usize(..candidates.len())];
        let fault = FAULTS[fastrand::usize(..FAULTS.len())];
        let until = now + Duration::from_millis(fastrand::u64(1000..=4000));
        self.services[s].active.fault(i, fault, until);
        Some(fault)
    }

    /// Ends the faults due by `now` (every one with `None`).
    async fn heal(&mut self, now: Option<Instant>) {
        for svc in &mut self.services {
            for i in 0..svc.active.proxies.len() {
                let due = match (svc.active.proxies[i].fault, now) {
                    (Some(_), None) => true,
                    (Some((_, until)), Some(now)) => until <= now,
                    (None, _) => false,
                };
                if due {
                    svc.active.heal(i).await;
                }
            }
        }
    }

    /// The EDS names ray-xds gives the clusters in the file now.
    fn eds_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for svc in &self.services {
            for c in std::iter::once(&svc.active).chain(svc.pending.as_ref().map(|(p, _)| p)) {
                names.push(format!("{NAMESPACE}/{}/{}", svc.name, c.name));
            }
        }
        names
    }
}

// ---------------------------------------------------------------------------------------
// ADS clients

#[derive(Default)]
struct ClientCounts {
    /// Following clients whose stream opened.
    connected: AtomicUsize,
    /// ... and that got every type (CDS, EDS, LDS, RDS) before leaving.
    synced: AtomicUsize,
    /// Following clients that could not connect or whose stream ray-xds ended.
    errors: AtomicUsize,
    /// Responses the never-ACKing clients received.
    never_ack_responses: AtomicUsize,
    /// Times ray-xds ended a never-ACKing client's stream.
    never_ack_ended: AtomicUsize,
}

fn node(id: String) -> Option<Node> {
    Some(Node {
        id,
        cluster: "soak".into(),
        ..Default::default()
    })
}

async fn connect(endpoint: &str) -> Result<AggregatedDiscoveryServiceClient<Channel>, String> {
    let channel = tokio::time::timeout(
        Duration::from_secs(5),
        Channel::from_shared(endpoint.to_string())
            .unwrap()
            .connect(),
    )
    .await
    .map_err(|_| "connect timed out".to_string())?
    .map_err(|e| format!("connect: {e}"))?;
    Ok(AggregatedDiscoveryServiceClient::new(channel))
}

/// How a following client leaves: half close their request stream and wait (at most
/// 1 s) for the server to end the response stream; the others just drop everything.
async fn leave<T: Send, R>(polite: bool, tx: mpsc::Sender<T>, mut inbound: tonic::Streaming<R>) {
    if polite {
        drop(tx);
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            while let Ok(Some(_)) = inbound.message().await {}
        })
        .await;
    }
}

/// A state-of-the-world client that follows like Envoy for `lifetime`, then leaves.
async fn sotw_follower(
    endpoint: String,
    id: usize,
    lifetime: Duration,
    stop: CancellationToken,
    counts: Arc<ClientCounts>,
) -> Result<(), String> {
    let mut client = connect(&endpoint).await?;
    let (tx, rx) = mpsc::channel(16);
    let node = node(format!("soak-sotw-{id}"));
    for ty in [CLUSTER_TYPE_URL, LISTENER_TYPE_URL] {
        let _ = tx
            .send(DiscoveryRequest {
                node: node.clone(),
                type_url: ty.into(),
                ..Default::default()
            })
            .await;
    }
    let mut inbound = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .map_err(|e| format!("open: {e}"))?
        .into_inner();
    counts.connected.fetch_add(1, Ordering::Relaxed);
    let deadline = tokio::time::sleep(lifetime);
    tokio::pin!(deadline);
    let mut eds_names: Vec<String> = Vec::new();
    let (mut eds_version, mut eds_nonce) = (String::new(), String::new());
    let mut rds_requested = false;
    let mut seen = BTreeSet::new();
    loop {
        let r = tokio::select! {
            _ = stop.cancelled() => break,
            _ = &mut deadline => break,
            r = inbound.message() => r,
        };
        let r = match r {
            Ok(Some(r)) => r,
            Ok(None) => return Err("ray-xds ended the stream".into()),
            Err(status) => return Err(format!("stream: {status}")),
        };
        seen.insert(r.type_url.clone());
        let ack = |names: Vec<String>| DiscoveryRequest {
            type_url: r.type_url.clone(),
            version_info: r.version_info.clone(),
            response_nonce: r.nonce.clone(),
            resource_names: names,
            ..Default::default()
        };
        let mut out = Vec::new();
        match r.type_url.as_str() {
            CLUSTER_TYPE_URL => {
                let mut names: Vec<String> = r
                    .resources
                    .iter()
                    .filter_map(|a| Cluster::decode(&*a.value).ok())
                    .map(|c| c.name)
                    .collect();
                names.sort();
                if names != eds_names {
                    // As Envoy: the new clusters' endpoints are asked for while they warm.
                    eds_names = names;
                    out.push(DiscoveryRequest {
                        type_url: ENDPOINTS_TYPE_URL.into(),
                        resource_names: eds_names.clone(),
                        version_info: eds_version.clone(),
                        response_nonce: eds_nonce.clone(),
                        ..Default::default()
                    });
                }
                out.push(ack(Vec::new()));
            }
            ENDPOINTS_TYPE_URL => {
                eds_version = r.version_info.clone();
                eds_nonce = r.nonce.clone();
                out.push(ack(eds_names.clone()));
            }
            LISTENER_TYPE_URL => {
                out.push(ack(Vec::new()));
                if !rds_requested {
                    rds_requested = true;
                    out.push(DiscoveryRequest {
                        type_url: ROUTE_TYPE_URL.into(),
                        resource_names: vec![ROUTE_NAME.into()],
                        ..Default::default()
                    });
                }
            }
            ROUTE_TYPE_URL => out.push(ack(vec![ROUTE_NAME.into()])),
            _ => {}
        }
        for request in out {
            if tx.send(request).await.is_err() {
                return Err("request stream closed".into());
            }
        }
    }
    if seen.len() == 4 {
        counts.synced.fetch_add(1, Ordering::Relaxed);
    }
    leave(id % 4 < 2, tx, inbound).await;
    Ok(())
}

/// A delta client that follows like Envoy for `lifetime`, then leaves.
async fn delta_follower(
    endpoint: String,
    id: usize,
    lifetime: Duration,
    stop: CancellationToken,
    counts: Arc<ClientCounts>,
) -> Result<(), String> {
    let mut client = connect(&endpoint).await?;
    let (tx, rx) = mpsc::channel(16);
    let node = node(format!("soak-delta-{id}"));
    for ty in [CLUSTER_TYPE_URL, LISTENER_TYPE_URL] {
        let _ = tx
            .send(DeltaDiscoveryRequest {
                node: node.clone(),
                type_url: ty.into(),
                resource_names_subscribe: vec!["*".into()],
                ..Default::default()
            })
            .await;
    }
    let mut inbound = client
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await
        .map_err(|e| format!("open: {e}"))?
        .into_inner();
    counts.connected.fetch_add(1, Ordering::Relaxed);
    let deadline = tokio::time::sleep(lifetime);
    tokio::pin!(deadline);
    let mut clusters: BTreeSet<String> = BTreeSet::new();
    let mut eds_subscribed: BTreeSet<String> = BTreeSet::new();
    let mut rds_requested = false;
    let mut seen = BTreeSet::new();
    loop {
        let r = tokio::select! {
            _ = stop.cancelled() => break,
            _ = &mut deadline => break,
            r = inbound.message() => r,
        };
        let r = match r {
            Ok(Some(r)) => r,
            Ok(None) => return Err("ray-xds ended the stream".into()),
            Err(status) => return Err(format!("stream: {status}")),
        };
        seen.insert(r.type_url.clone());
        let ack = DeltaDiscoveryRequest {
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            ..Default::default()
        };
        let mut out = Vec::new();
        match r.type_url.as_str() {
            CLUSTER_TYPE_URL => {
                clusters.extend(r.resources.iter().map(|res| res.name.clone()));
                for gone in &r.removed_resources {
                    clusters.remove(gone);
                }
                let subscribe: Vec<String> =
                    clusters.difference(&eds_subscribed).cloned().collect();
                let unsubscribe: Vec<String> =
                    eds_subscribed.difference(&clusters).cloned().collect();
                if !subscribe.is_empty() || !unsubscribe.is_empty() {
                    eds_subscribed = clusters.clone();
                    out.push(DeltaDiscoveryRequest {
                        type_url: ENDPOINTS_TYPE_URL.into(),
                        resource_names_subscribe: subscribe,
                        resource_names_unsubscribe: unsubscribe,
                        ..Default::default()
                    });
                }
                out.push(ack);
            }
            LISTENER_TYPE_URL => {
                out.push(ack);
                if !rds_requested {
                    rds_requested = true;
                    out.push(DeltaDiscoveryRequest {
                        type_url: ROUTE_TYPE_URL.into(),
                        resource_names_subscribe: vec![ROUTE_NAME.into()],
                        ..Default::default()
                    });
                }
            }
            _ => out.push(ack),
        }
        for request in out {
            if tx.send(request).await.is_err() {
                return Err("request stream closed".into());
            }
        }
    }
    if seen.len() == 4 {
        counts.synced.fetch_add(1, Ordering::Relaxed);
    }
    leave(id % 4 < 2, tx, inbound).await;
    Ok(())
}

/// Keeps `concurrent` following clients connected, SotW and delta in turn, each for 2 to
/// 8 s, until `stop`; then waits for them to leave.
async fn client_manager(
    endpoint: String,
    concurrent: usize,
    stop: CancellationToken,
    counts: Arc<ClientCounts>,
    next_id: Arc<AtomicUsize>,
) {
    let mut set = tokio::task::JoinSet::new();
    loop {
        while set.len() < concurrent && !stop.is_cancelled() {
            let id = next_id.fetch_add(1, Ordering::Relaxed);
            let lifetime = Duration::from_millis(fastrand::u64(2000..=8000));
            let (endpoint, stop, counts) = (endpoint.clone(), stop.clone(), counts.clone());
            set.spawn(async move {
                let result = if id.is_multiple_of(2) {
                    sotw_follower(endpoint, id, lifetime, stop, counts.clone()).await
                } else {
                    delta_follower(endpoint, id, lifetime, stop, counts.clone()).await
                };
                if let Err(e) = result {
                    counts.errors.fetch_add(1, Ordering::Relaxed);
                    eprintln!("soak: ADS client {id}: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            });
        }
        if set.is_empty() {
            // No clients wanted (`--clients 0`).
            stop.cancelled().await;
            break;
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = set.join_next() => {}
        }
    }
    while set.join_next().await.is_some() {}
}

/// A client that subscribes to everything and never ACKs, until `stop` (it connects
/// again if ray-xds ends its stream, which is counted).
async fn never_ack(
    endpoint: String,
    delta: bool,
    eds_names: Vec<String>,
    stop: CancellationToken,
    counts: Arc<ClientCounts>,
) {
    while !stop.is_cancelled() {
        let Ok(mut client) = connect(&endpoint).await else {
            counts.never_ack_ended.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let types = [
            (CLUSTER_TYPE_URL, Vec::new()),
            (LISTENER_TYPE_URL, Vec::new()),
            (ENDPOINTS_TYPE_URL, eds_names.clone()),
            (ROUTE_TYPE_URL, vec![ROUTE_NAME.to_string()]),
        ];
        let id = if delta {
            "soak-never-ack-delta"
        } else {
            "soak-never-ack-sotw"
        };
        // Both streams' senders live until this connection is given up.
        let (sotw_tx, sotw_rx) = mpsc::channel::<DiscoveryRequest>(8);
        let (delta_tx, delta_rx) = mpsc::channel::<DeltaDiscoveryRequest>(8);
        let ended = if delta {
            for (ty, names) in types {
                let subscribe = if names.is_empty() {
                    vec!["*".into()]
                } else {
                    names
                };
                let _ = delta_tx
                    .send(DeltaDiscoveryRequest {
                        node: node(id.into()),
                        type_url: ty.into(),
                        resource_names_subscribe: subscribe,
                        ..Default::default()
                    })
                    .await;
            }
            match client
                .delta_aggregated_resources(ReceiverStream::new(delta_rx))
                .await
            {
                Ok(r) => drain(r.into_inner(), &stop, &counts).await,
                Err(_) => true,
            }
        } else {
            for (ty, names) in types {
                let _ = sotw_tx
                    .send(DiscoveryRequest {
                        node: node(id.into()),
                        type_url: ty.into(),
                        resource_names: names,
                        ..Default::default()
                    })
                    .await;
            }
            match client
                .stream_aggregated_resources(ReceiverStream::new(sotw_rx))
                .await
            {
                Ok(r) => drain(r.into_inner(), &stop, &counts).await,
                Err(_) => true,
            }
        };
        if ended {
            counts.never_ack_ended.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        drop((sotw_tx, delta_tx));
    }
}

/// Reads and drops responses until `stop` (false) or the stream ends (true).
async fn drain<R>(
    mut inbound: tonic::Streaming<R>,
    stop: &CancellationToken,
    counts: &ClientCounts,
) -> bool {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return false,
            r = inbound.message() => match r {
                Ok(Some(_)) => {
                    counts.never_ack_responses.fetch_add(1, Ordering::Relaxed);
                }
                _ => return true,
            },
        }
    }
}

// ---------------------------------------------------------------------------------------
// Churn

#[derive(Default, Debug, Clone, Copy)]
struct Churned {
    upgrades: usize,
    flaps: usize,
    flaps_by_kind: [usize; 4],
}

/// Churns for `duration`, then quiesces: every client gone, every proxy serving, every
/// upgrade under way finished.
async fn churn(
    world: &mut World,
    xds: u16,
    duration: Duration,
    phase: &Mutex<&'static str>,
    counts: &Arc<ClientCounts>,
    next_client: &Arc<AtomicUsize>,
) -> Churned {
    let endpoint = format!("http://127.0.0.1:{xds}");
    let stop = CancellationToken::new();
    let mut c = Churned::default();
    let never = [false, true].map(|delta| {
        tokio::spawn(never_ack(
            endpoint.clone(),
            delta,
            world.eds_names(),
            stop.clone(),
            counts.clone(),
        ))
    });
    let manager = tokio::spawn(client_manager(
        endpoint,
        world.args.clients,
        stop.clone(),
        counts.clone(),
        next_client.clone(),
    ));
    let started = Instant::now();
    let upgrade_every = Duration::from_secs_f64(world.args.upgrade_every);
    let (mut next_flap, mut next_upgrade, mut next_check) =
        (started, started + upgrade_every, started);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while started.elapsed() < duration {
        tick.tick().await;
        let now = Instant::now();
        world.heal(Some(now)).await;
        if now >= next_flap {
            next_flap += Duration::from_secs(1);
            for _ in 0..world.args.flaps {
                if let Some(fault) = world.flap(now) {
                    c.flaps += 1;
                    c.flaps_by_kind[FAULTS.iter().position(|f| *f == fault).unwrap()] += 1;
                }
            }
        }
        if now >= next_upgrade {
            next_upgrade += upgrade_every;
            world.start_upgrade().await;
        }
        if now >= next_check {
            next_check = now + Duration::from_millis(250);
            c.upgrades += world.promote_switched().await;
        }
    }
    *phase.lock().unwrap() = "quiesce";
    stop.cancel();
    let _ = manager.await;
    for n in never {
        let _ = n.await;
    }
    world.heal(None).await;
    while world.services.iter().any(|s| s.pending.is_some()) {
        c.upgrades += world.promote_switched().await;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    c
}

// ---------------------------------------------------------------------------------------
// The benchmark

/// Three samples 1 s apart; each figure the smallest of the three.
async fn measure(
    pid: u32,
    admin: u16,
    started: Instant,
    phase: &'static str,
    samples: &Mutex<Vec<Sample>>,
) -> Figures {
    let mut taken = Vec::new();
    for i in 0..3 {
        if i > 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        if let Some(s) = sample(pid, admin, started, phase).await {
            taken.push(s.figures);
            samples.lock().unwrap().push(s);
        }
    }
    assert!(!taken.is_empty(), "/metrics did not answer while measuring");
    Figures {
        rss_kib: taken.iter().map(|f| f.rss_kib).min().unwrap(),
        fds: taken.iter().map(|f| f.fds).min().unwrap(),
        tasks: taken.iter().map(|f| f.tasks).min().unwrap(),
        series: taken.iter().map(|f| f.series).min().unwrap(),
    }
}

/// Samples thinned to about `rows`, keeping the first and last of each phase.
fn print_table(samples: &[Sample], rows: usize) {
    let stride = samples.len().div_ceil(rows.max(1)).max(1);
    println!("samples (streams: connected ADS streams; weights: switchover_weight series, one per cluster weighed):");
    println!(
        "{:>7}  {:<9} {:>9} {:>5} {:>6} {:>7} {:>8} {:>8}",
        "t_s", "phase", "rss_kib", "fds", "tasks", "series", "streams", "weights"
    );
    for (i, s) in samples.iter().enumerate() {
        let boundary = i == 0
            || i + 1 == samples.len()
            || samples[i - 1].phase != s.phase
            || samples[i + 1].phase != s.phase;
        if !boundary && i % stride != 0 {
            continue;
        }
        println!(
            "{:>7.1}  {:<9} {:>9} {:>5} {:>6} {:>7} {:>8} {:>8}",
            s.at.as_secs_f64(),
            s.phase,
            s.figures.rss_kib,
            s.figures.fds,
            s.figures.tasks,
            s.figures.series,
            s.streams,
            s.weights
        );
    }
}

async fn wait_for(what: &str, deadline: Duration, mut check: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !check().await {
        assert!(
            started.elapsed() < deadline,
            "{what}: not within {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn run(args: Args) -> i32 {
    let dir = tempfile::tempdir().unwrap();
    let mut services = Vec::new();
    for i in 0..args.services {
        let name = format!("svc-{i}");
        let active = SimCluster::start(&format!("{name}-g0"), args.workers, Duration::ZERO).await;
        services.push(Service {
            name,
            generation: 0,
            active,
            pending: None,
        });
    }
    let (xds, admin) = (free_port(), free_port());
    let mut world = World {
        args: args.clone(),
        file: dir.path().join("services.yaml"),
        admin,
        services,
        next_upgrade: 0,
    };
    world.write();
    let binary = args
        .ray_xds
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ray-xds")));
    let mut server = Server::start(
        &binary,
        &world.file,
        xds,
        admin,
        dir.path().join("ray-xds.log"),
    );
    let pid = server.pid();
    wait_for("ray-xds ready", Duration::from_secs(60), async || {
        server.check_alive();
        matches!(
            http_get(admin, "/readyz", Duration::from_secs(5)).await,
            Some((200, _))
        )
    })
    .await;
    let first: Vec<String> = world
        .services
        .iter()
        .map(|s| weight_key(&s.name, &s.active.name))
        .collect();
    wait_for(
        "every RayService served",
        Duration::from_secs(30),
        async || {
            let text = metrics(admin).await.unwrap_or_default();
            first.iter().all(|k| metric_value(&text, k) == Some(100.0))
        },
    )
    .await;

    let started = Instant::now();
    let phase = Arc::new(Mutex::new("start"));
    let samples: Arc<Mutex<Vec<Sample>>> = Default::default();
    let sampler_stop = CancellationToken::new();
    let sampler = spawn_sampler(
        pid,
        admin,
        started,
        Duration::from_secs(args.sample_every.max(1)),
        phase.clone(),
        samples.clone(),
        sampler_stop.clone(),
    );
    let counts: Arc<ClientCounts> = Default::default();
    let next_client: Arc<AtomicUsize> = Default::default();
    let settle = Duration::from_secs(args.settle);

    println!(
        "soak: ray-xds pid {pid}, {} RayServices x (head + {} workers), {} faults/s, an upgrade every {} s, {} ADS clients at a time + 2 that never ACK; warm-up {} s, churn {} s, settle {} s",
        args.services, args.workers, args.flaps, args.upgrade_every, args.clients, args.warmup, args.duration, args.settle
    );
    // Before any churn, for the table: the same quiet conditions as the baseline, but
    // nothing has happened yet (no ADS client, no fault, no upgrade).
    if let Some(s) = sample(pid, admin, started, "start").await {
        samples.lock().unwrap().push(s);
    }
    *phase.lock().unwrap() = "warm-up";
    let warm = churn(
        &mut world,
        xds,
        Duration::from_secs(args.warmup),
        &phase,
        &counts,
        &next_client,
    )
    .await;
    *phase.lock().unwrap() = "settle";
    tokio::time::sleep(settle).await;
    server.check_alive();
    *phase.lock().unwrap() = "baseline";
    let baseline = measure(pid, admin, started, "baseline", &samples).await;
    let baseline_text = metrics(admin).await.unwrap_or_default();
    let warm_clients = counts.connected.load(Ordering::Relaxed);
    let warm_errors = counts.errors.load(Ordering::Relaxed);
    let warm_synced = counts.synced.load(Ordering::Relaxed);
    println!(
        "soak: warm-up done ({} upgrades, {} faults, {} clients); baseline {baseline:?}",
        warm.upgrades, warm.flaps, warm_clients
    );

    *phase.lock().unwrap() = "churn";
    let churned = churn(
        &mut world,
        xds,
        Duration::from_secs(args.duration),
        &phase,
        &counts,
        &next_client,
    )
    .await;
    *phase.lock().unwrap() = "settle";
    tokio::time::sleep(settle).await;
    server.check_alive();
    *phase.lock().unwrap() = "end";
    let end = measure(pid, admin, started, "end", &samples).await;
    let text = metrics(admin).await.expect("/metrics answers at the end");
    sampler_stop.cancel();
    let _ = sampler.await;
    server.check_alive();

    let clients = counts.connected.load(Ordering::Relaxed) - warm_clients;
    let samples = samples.lock().unwrap().clone();
    print_table(&samples, args.table_rows);
    let during: Vec<&Sample> = samples.iter().filter(|s| s.phase == "churn").collect();
    if let (Some(first), Some(last)) = (during.first(), during.last()) {
        let max = |f: fn(&Figures) -> u64| during.iter().map(|s| f(&s.figures)).max().unwrap();
        println!(
            "during the churn: rss_kib {} -> {} (max {}), fds max {}, tasks max {}, series max {}",
            first.figures.rss_kib,
            last.figures.rss_kib,
            max(|f| f.rss_kib),
            max(|f| f.fds),
            max(|f| f.tasks),
            max(|f| f.series)
        );
    }
    println!(
        "faults: {} kill, {} hang, {} drain, {} flap; ADS clients: {} connected, {} synced (all four types), {} errors; the never-ACKing clients got {} responses, their streams ended by ray-xds {} times",
        churned.flaps_by_kind[0],
        churned.flaps_by_kind[1],
        churned.flaps_by_kind[2],
        churned.flaps_by_kind[3],
        clients,
        counts.synced.load(Ordering::Relaxed) - warm_synced,
        counts.errors.load(Ordering::Relaxed) - warm_errors,
        counts.never_ack_responses.load(Ordering::Relaxed),
        counts.never_ack_ended.load(Ordering::Relaxed),
    );

    // Which series came and went (by name and labels).
    let keys = |text: &str| -> BTreeSet<String> {
        series(text)
            .filter_map(|l| Some(l.rsplit_once(' ')?.0.to_string()))
            .collect()
    };
    let (before, after) = (keys(&baseline_text), keys(&text));
    let show = |set: Vec<&String>| {
        let mut shown: Vec<&str> = set.iter().take(10).map(|s| s.as_str()).collect();
        if set.len() > 10 {
            shown.push("...");
        }
        format!("{} [{}]", set.len(), shown.join(", "))
    };
    println!(
        "series new since the baseline: {}; gone: {}",
        show(after.difference(&before).collect()),
        show(before.difference(&after).collect())
    );
    // Series that name a cluster that no longer exists, and stale snapshot versions.
    let live = world.cluster_names();
    let stale: Vec<&str> = series(&text)
        .filter(|l| {
            l.split_once("cluster=\"")
                .and_then(|(_, rest)| rest.split_once('"'))
                .is_some_and(|(cluster, _)| !live.contains(cluster))
        })
        .collect();
    let versions = series(&text)
        .filter(|l| l.starts_with("ray_xds_snapshot_info{"))
        .count();

    let mut grew = Vec::new();
    let rss_bound = (args.rss_margin_mib * 1024).max(baseline.rss_kib * args.rss_margin_pct / 100);
    if end.rss_kib > baseline.rss_kib + rss_bound {
        grew.push(format!(
            "rss (+{} KiB, bound {rss_bound} KiB)",
            end.rss_kib - baseline.rss_kib
        ));
    }
    if end.fds > baseline.fds + args.fd_margin {
        grew.push(format!(
            "fds (+{}, bound {})",
            end.fds - baseline.fds,
            args.fd_margin
        ));
    }
    if end.tasks > baseline.tasks + args.task_margin {
        grew.push(format!(
            "tasks (+{}, bound {})",
            end.tasks - baseline.tasks,
            args.task_margin
        ));
    }
    if end.series > baseline.series + args.series_margin {
        grew.push(format!(
            "series (+{}, bound {})",
            end.series - baseline.series,
            args.series_margin
        ));
    }
    if !stale.is_empty() {
        grew.push(format!(
            "series of clusters that are gone ({}: {})",
            stale.len(),
            stale.iter().take(5).copied().collect::<Vec<_>>().join(", ")
        ));
    }
    if versions != 1 {
        grew.push(format!("snapshot_info series ({versions})"));
    }
    let verdict = if grew.is_empty() { "flat" } else { "grew" };
    if !grew.is_empty() {
        println!("soak grew: {}", grew.join("; "));
    }
    println!(
        "soak duration_s={} rss_kib_baseline={} rss_kib_end={} fds_baseline={} fds_end={} tasks_baseline={} tasks_end={} series_baseline={} series_end={} upgrades={} flaps={} clients={} verdict={verdict}",
        args.duration,
        baseline.rss_kib,
        end.rss_kib,
        baseline.fds,
        end.fds,
        baseline.tasks,
        end.tasks,
        baseline.series,
        end.series,
        churned.upgrades,
        churned.flaps,
        clients,
    );
    drop(world);
    drop(server);
    i32::from(!grew.is_empty())
}

fn main() {
    let args = Args::parse();
    // One thread for the simulated Ray and the clients: ray-xds gets the other core.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let code = runtime.block_on(run(args));
    drop(runtime);
    std::process::exit(code);
}

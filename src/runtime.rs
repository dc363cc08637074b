//! Wiring: binds the listeners, starts every task with its channels, and stops them all
//! on one shutdown token. No logic of its own: each task lives with its module.
//!
//! Data flow (each channel has exactly one writer):
//! source → `watch<Model>` → `live::dashboards` → `watch<DashboardStates>`;
//! `live::discovery::run` joins the source's model and the dashboards into the effective
//! `watch<Model>` → `live::prober` → `watch<ProbeStates>`; `pipeline::task` joins the
//! effective model, probes and dashboards → `watch<Snapshot>` → one task per xDS stream.
//! Back-edges: the pipeline asks the dashboard poller for fresh answers (`mpsc`), and the
//! xDS server wakes the pipeline when an Envoy ACKs (`Clients::acked`).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminState, LiveViews};
use crate::config::{Config, SourceConfig};
use crate::live::dashboards::{DashboardPoller, DashboardStates};
use crate::live::discovery;
use crate::live::health::HealthMap;
use crate::live::prober::{ProbeStates, Prober};
use crate::metrics::Metrics;
use crate::model::Model;
use crate::pipeline::switchover::Switchover;
use crate::pipeline::task::{FirstBuild, Sinks, Sources};
use crate::pipeline::{self, Pipeline};
use crate::source::file::{self, FileSource};
use crate::source::kubernetes::{self, KubernetesSource};
use crate::source::SourceStatus;
use crate::supervisor::{supervise, Components};
use crate::xds::grpc::AdsService;
use crate::xds::server::AdsServer;
use crate::xds::{Clients, Snapshot};

/// `supervise(name, ...)` as a task of the runtime's set (it ends only at shutdown).
fn supervised<F, Fut>(
    components: &Arc<Components>,
    name: &'static str,
    shutdown: &CancellationToken,
    start: F,
) -> impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (components, shutdown) = (components.clone(), shutdown.clone());
    async move {
        supervise(name, components, shutdown, start).await;
        Ok(())
    }
}

/// A started control plane.
pub struct Running {
    pub xds_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Where `/debug/*` is served, when not on `admin_addr`.
    pub admin_debug_addr: Option<SocketAddr>,
    pub metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    tasks: JoinSet<anyhow::Result<()>>,
}

impl Running {
    /// Stops everything and waits for it.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        while let Some(result) = self.tasks.join_next().await {
            result??;
        }
        Ok(())
    }

    /// Waits until a part fails or `shutdown` fires.
    pub async fn wait(mut self) -> anyhow::Result<()> {
        tokio::select! {
            _ = self.shutdown.cancelled() => {}
            done = self.tasks.join_next() => match done {
                Some(Ok(Ok(()))) | None if !self.shutdown.is_cancelled() => {
                    self.shutdown.cancel();
                    anyhow::bail!("a component stopped unexpectedly")
                }
                Some(Ok(Err(e))) => {
                    self.shutdown.cancel();
                    return Err(e);
                }
                Some(Err(e)) => {
                    self.shutdown.cancel();
                    return Err(e.into());
                }
                _ => {}
            }
        }
        self.stop().await
    }
}

/// Open files kept for probes: each proxy probed holds a kept-alive connection, and how
/// many proxies there will be is not known at start.
pub const OPEN_FILES_PROBE_RESERVE: u64 = 1_024;

/// Open files kept for the rest: the services file and its inotify watch, the API
/// server's watches, dashboard polls, the runtime's own (epoll, eventfd), logs.
pub const OPEN_FILES_OTHER_RESERVE: u64 = 64;

/// How many files ray-xds may hold open at once with `config`'s limits: every xDS
/// connection it accepts (`xds.max_connections`), every admin connection
/// ([`AdminLimits::max_connections`](crate::admin_listener::AdminLimits)),
/// [`OPEN_FILES_PROBE_RESERVE`] for probes and [`OPEN_FILES_OTHER_RESERVE`] for the rest.
pub fn open_files_needed(config: &Config) -> u64 {
    let xds = config.xds_limits.max_connections as u64;
    let admin = crate::admin_listener::AdminLimits::default().max_connections as u64;
    xds.saturating_add(admin)
        .saturating_add(OPEN_FILES_PROBE_RESERVE)
        .saturating_add(OPEN_FILES_OTHER_RESERVE)
}

/// What to warn of at start when the open-files `limit` (already raised to the hard one)
/// is below [`open_files_needed`]: the need, or `None` when the limit is enough. Past the
/// limit, accepts fail (the listeners pause and retry) and probes fail to connect.
pub fn open_files_shortfall(limit: u64, config: &Config) -> Option<u64> {
    let needed = open_files_needed(config);
    (limit < needed).then_some(needed)
}

/// What ray-xds may need in memory at most, roughly: twice the sum of the memory budgets
/// (what they count is an estimate; real RSS runs above it, most for many small values)
/// and [`MEMORY_BASE_BYTES`] for the rest (streams, probes, snapshots of a large fleet).
pub fn memory_needed(config: &Config) -> u64 {
    let m = config.memory;
    let budgets = (m.dashboards as u64)
        .saturating_add(m.route_tables as u64)
        .saturating_add(m.partial_xds_requests as u64);
    budgets.saturating_mul(2).saturating_add(MEMORY_BASE_BYTES)
}

/// What ray-xds holds beside its budgets, roughly: 64 MiB.
pub const MEMORY_BASE_BYTES: u64 = 64 << 20;

/// What to warn of at start when the container's memory `limit` is below
/// [`memory_needed`]: the need, or `None` when the limit is enough. Past the limit the
/// kernel kills the process; lower the `memory.*` budgets or raise the limit.
pub fn memory_shortfall(limit: u64, config: &Config) -> Option<u64> {
    let needed = memory_needed(config);
    (limit < needed).then_some(needed)
}

/// The memory limit of this process's cgroup (v2 `memory.max`, else v1's), if it has one.
pub fn cgroup_memory_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    memory_limit_files(&own)
        .iter()
        .find_map(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| text.trim().parse::<u64>().ok())
        // cgroup v1 writes a huge number for "no limit" (v2 writes `max`).
        .filter(|limit| *limit < (1 << 60))
}

/// Where this process's memory limit may be read, most specific first, from its
/// `/proc/self/cgroup`: its own cgroup's file (v2 `0::<path>`, v1 `<n>:memory:<path>`),
/// then the mount roots' (a container with its own cgroup namespace sees itself there).
pub fn memory_limit_files(proc_self_cgroup: &str) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let path = path.trim_start_matches('/');
        if path.is_empty() || path.split('/').any(|part| part == "..") {
            continue; // the root (below), or not a path to follow
        }
        if controllers.is_empty() {
            files.push(format!("/sys/fs/cgroup/{path}/memory.max").into());
        } else if controllers.split(',').any(|c| c == "memory") {
            files.push(format!("/sys/fs/cgroup/memory/{path}/memory.limit_in_bytes").into());
        }
    }
    files.push("/sys/fs/cgroup/memory.max".into());
    files.push("/sys/fs/cgroup/memory/memory.limit_in_bytes".into());
    files
}

/// How long a replica peer has to answer.
const PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Starts ray-xds. A bad source file at start is an error; later bad edits are not.
pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<Running> {
    let metrics = Arc::new(Metrics::new());
    metrics.count_tasks_of(tokio::runtime::Handle::current());
    let listeners = Listeners::bind(&config).await?;
    let (xds_addr, admin_addr, admin_debug_addr) = listeners.addresses()?;
    // mTLS: unreadable or mismatched files at start are fatal (there is no last good
    // configuration yet); later changes are re-read, and a bad one is only logged.
    let xds_tls = match &config.xds_tls {
        Some(files) => Some(
            crate::xds::tls::ServerTls::load(files.clone())
                .context("xds.tls: loading the xDS listener's certificate files")?,
        ),
        None => None,
    };
    let clients = Arc::new(Clients::default());
    let mut starter = Starter {
        tasks: JoinSet::new(),
        components: Arc::new(Components::new(metrics.clone())),
        shutdown: shutdown.clone(),
        metrics: metrics.clone(),
        config: &config,
    };
    let (source, source_status) = starter.source().await?;
    let dashboards = starter.dashboards(&source);
    let (models, refused) = starter.discovery(&source, &dashboards.states);
    let (probes, heartbeat) = starter.prober(&models);
    let peers = starter.peers();
    let sources = Sources {
        source,
        models: models.clone(),
        probes: probes.clone(),
        dashboards: dashboards.states.clone(),
        prober: heartbeat,
        peers,
    };
    let outputs = starter.pipeline(sources, dashboards.refresh, &source_status, &clients);
    starter.xds_server(
        listeners.xds,
        xds_tls,
        outputs.snapshots,
        outputs.published.clone(),
        &clients,
    );
    starter.spawn({
        let token = shutdown.clone();
        async move {
            crate::memory::give_back(token).await;
            Ok(())
        }
    });
    let state = AdminState {
        components: starter.components.clone(),
        metrics: metrics.clone(),
        clients,
        snapshots: outputs.published,
        live: LiveViews {
            models,
            probes,
            dashboards: dashboards.states,
            dashboards_answered: dashboards.answered,
            health: outputs.health,
            switchover: outputs.switchover,
            source: source_status,
            refused,
        },
    };
    starter.admin(listeners.admin, listeners.debug, state)?;
    tracing::info!(%xds_addr, %admin_addr, ?admin_debug_addr, tls = config.xds_tls.is_some(), "ray-xds started");
    Ok(Running {
        xds_addr,
        admin_addr,
        admin_debug_addr,
        metrics,
        shutdown,
        tasks: starter.tasks,
    })
}

/// The ports ray-xds serves, bound before anything starts (so a test can bind port 0
/// and read the port back).
struct Listeners {
    xds: TcpListener,
    admin: TcpListener,
    debug: Option<TcpListener>,
}

impl Listeners {
    async fn bind(config: &Config) -> anyhow::Result<Listeners> {
        let xds = TcpListener::bind(config.xds_listen)
            .await
            .with_context(|| format!("binding the xDS listener on {}", config.xds_listen))?;
        let admin = TcpListener::bind(config.admin_listen)
            .await
            .with_context(|| format!("binding the admin listener on {}", config.admin_listen))?;
        let debug = match config.admin_debug_listen {
            Some(addr) => Some(TcpListener::bind(addr).await.with_context(|| {
                format!("binding the admin debug listener (admin.debug_listen) on {addr}")
            })?),
            None => None,
        };
        Ok(Listeners { xds, admin, debug })
    }

    fn addresses(&self) -> std::io::Result<(SocketAddr, SocketAddr, Option<SocketAddr>)> {
        let debug = self
            .debug
            .as_ref()
            .map(TcpListener::local_addr)
            .transpose()?;
        Ok((self.xds.local_addr()?, self.admin.local_addr()?, debug))
    }
}

/// The dashboard poller's channels: its states, the pipeline's requests for a fresh
/// answer, and when each dashboard last answered.
struct Dashboards {
    states: watch::Receiver<Arc<DashboardStates>>,
    refresh: tokio::sync::mpsc::UnboundedSender<String>,
    answered: Arc<crate::live::dashboards::AnsweredAt>,
}

/// What the pipeline publishes.
struct PipelineOutputs {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    published: watch::Receiver<Option<Arc<Snapshot>>>,
    health: watch::Receiver<Arc<HealthMap>>,
    switchover: watch::Receiver<Arc<Switchover>>,
}

/// Starts the components one by one, each under the supervisor, into one task set that
/// ends on one shutdown token. Each component is the single writer of the channels it
/// returns.
struct Starter<'a> {
    tasks: JoinSet<anyhow::Result<()>>,
    components: Arc<Components>,
    shutdown: CancellationToken,
    metrics: Arc<Metrics>,
    config: &'a Config,
}

impl Starter<'_> {
    fn supervise<F, Fut>(&mut self, name: &'static str, start: F)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let task = supervised(&self.components, name, &self.shutdown, start);
        self.tasks.spawn(task);
    }

    fn spawn(
        &mut self,
        task: impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
    ) {
        self.tasks.spawn(task);
    }

    /// The source: the single writer of the source's model and status.
    async fn source(
        &mut self,
    ) -> anyhow::Result<(
        watch::Receiver<Arc<Model>>,
        watch::Receiver<Arc<SourceStatus>>,
    )> {
        let (status_tx, status_rx) = watch::channel(Arc::new(SourceStatus::default()));
        let token = self.shutdown.clone();
        let models = match &self.config.source {
            SourceConfig::File {
                path,
                poll_interval,
            } => {
                let (model, bytes) = file::load(path)?;
                let (tx, rx) = watch::channel(Arc::new(model));
                status_tx.send_replace(Arc::new(SourceStatus::synced("file")));
                let source = FileSource {
                    path: path.clone(),
                    poll_interval: *poll_interval,
                    metrics: self.metrics.clone(),
                    status: status_tx,
                };
                self.supervise("source", move || {
                    source.clone().run(bytes.clone(), tx.clone(), token.clone())
                });
                rx
            }
            SourceConfig::Kubernetes(k) => {
                let client = kubernetes::client(k).await?;
                let (tx, rx) = watch::channel(Arc::new(Model::default()));
                let source = KubernetesSource {
                    config: k.clone(),
                    metrics: self.metrics.clone(),
                };
                self.supervise("source", move || {
                    source
                        .clone()
                        .run(client.clone(), tx.clone(), status_tx.clone(), token.clone())
                });
                rx
            }
        };
        Ok((models, status_rx))
    }

    /// Dashboards: read the source's model (only the dashboards matter to them).
    fn dashboards(&mut self, source: &watch::Receiver<Arc<Model>>) -> Dashboards {
        let (tx, states) = watch::channel(Arc::new(DashboardStates::default()));
        let (refresh, refresh_rx) = tokio::sync::mpsc::unbounded_channel();
        let answered = Arc::new(crate::live::dashboards::AnsweredAt::default());
        let policy = &self.config.policies.dashboard;
        let poller = DashboardPoller {
            answered: answered.clone(),
            interval: policy.poll_interval,
            timeout: policy.timeout,
            metrics: self.metrics.clone(),
            memory_budget: self.config.memory.dashboards,
        };
        let (models, token) = (source.clone(), self.shutdown.clone());
        // The refresh requests outlive a poller that fails: the next one takes them over.
        let refresh_rx = Arc::new(tokio::sync::Mutex::new(refresh_rx));
        self.supervise("dashboards", move || {
            let (poller, models, tx, token) =
                (poller.clone(), models.clone(), tx.clone(), token.clone());
            let refresh = refresh_rx.clone();
            async move {
                let mut refresh = refresh.lock_owned().await;
                poller.run(models, tx, &mut refresh, token).await
            }
        });
        Dashboards {
            states,
            refresh,
            answered,
        }
    }

    /// Discovery: the effective model, read by everything downstream, and the proxies
    /// and replicas the address policy refused. Until discovery's first pass, nothing
    /// downstream reads an unchecked model: the pipeline waits for the source, and the
    /// source's first model passes through here.
    fn discovery(
        &mut self,
        source: &watch::Receiver<Arc<Model>>,
        dashboards: &watch::Receiver<Arc<DashboardStates>>,
    ) -> (
        watch::Receiver<Arc<Model>>,
        watch::Receiver<Arc<Vec<crate::live::discovery::RefusedProxy>>>,
    ) {
        let addresses = &self.config.addresses;
        let first = discovery::discover(&source.borrow(), &DashboardStates::default(), addresses);
        let (effective_tx, effective_rx) = watch::channel(Arc::new(first.model));
        let (refused_tx, refused_rx) = watch::channel(Arc::new(first.refused));
        let discovery = discovery::Discovery {
            policy: addresses.clone(),
            metrics: self.metrics.clone(),
        };
        let (source, dashboards, token) =
            (source.clone(), dashboards.clone(), self.shutdown.clone());
        self.supervise("discovery", move || {
            discovery.clone().run(
                source.clone(),
                dashboards.clone(),
                effective_tx.clone(),
                refused_tx.clone(),
                token.clone(),
            )
        });
        (effective_rx, refused_rx)
    }

    /// The prober, and its heartbeat.
    fn prober(
        &mut self,
        models: &watch::Receiver<Arc<Model>>,
    ) -> (
        watch::Receiver<Arc<ProbeStates>>,
        Arc<crate::live::prober::Heartbeat>,
    ) {
        let (probes_tx, probes_rx) = watch::channel(Arc::new(ProbeStates::default()));
        let heartbeat = Arc::new(crate::live::prober::Heartbeat::default());
        let prober = Prober {
            policy: self.config.policies.probe.clone(),
            routes_budget: self.config.memory.route_tables,
            metrics: self.metrics.clone(),
            heartbeat: heartbeat.clone(),
        };
        let (models, token) = (models.clone(), self.shutdown.clone());
        self.supervise("prober", move || {
            prober
                .clone()
                .run(models.clone(), probes_tx.clone(), token.clone())
        });
        (probes_rx, heartbeat)
    }

    /// The other replicas' switchovers: one writer, the peer poller (none without peers:
    /// the channel says "polled" at once and closes).
    fn peers(&mut self) -> watch::Receiver<Arc<crate::live::peers::PeerStates>> {
        let config = self.config;
        let (peers_tx, peers_rx) = watch::channel(Arc::new(crate::live::peers::PeerStates {
            polled: config.replica_peers.is_empty(),
            ..Default::default()
        }));
        if !config.replica_peers.is_empty() {
            let poller = crate::live::peers::PeerPoller {
                peers: config.replica_peers.clone(),
                interval: config.replica_poll_interval,
                timeout: PEER_TIMEOUT,
            };
            let token = self.shutdown.clone();
            self.spawn(async move {
                poller.run(peers_tx, token).await;
                Ok(())
            });
        }
        peers_rx
    }

    /// The pipeline: once the source has its first full state (an empty model from a
    /// half-listed cluster would withdraw every route). Until its first snapshot the xDS
    /// server does not answer and /readyz says not ready.
    fn pipeline(
        &mut self,
        sources: Sources,
        refresh: tokio::sync::mpsc::UnboundedSender<String>,
        source_status: &watch::Receiver<Arc<SourceStatus>>,
        clients: &Arc<Clients>,
    ) -> PipelineOutputs {
        let (health_tx, health) = watch::channel(Arc::new(HealthMap::default()));
        let (snapshots_tx, snapshots) = watch::channel(Arc::new(Snapshot::default()));
        let (switch_tx, switchover) = watch::channel(Arc::new(Switchover::default()));
        let (published_tx, published) = watch::channel::<Option<Arc<Snapshot>>>(None);
        let sinks = Sinks {
            snapshots: snapshots_tx,
            published: published_tx,
            health: health_tx,
            switchover: switch_tx,
            refresh,
        };
        let config = self.config;
        let first = FirstBuild {
            dashboards: config.policies.dashboard.first_answer_wait(),
            probes: config.policies.probe.first_probe_wait(),
            addresses: config.addresses.clone(),
            peers: PEER_TIMEOUT + std::time::Duration::from_millis(200),
        };
        let (policies, gateway) = (config.policies.clone(), config.gateway.clone());
        let addresses = config.addresses.clone();
        let (clients, metrics, token) =
            (clients.clone(), self.metrics.clone(), self.shutdown.clone());
        let source_status = source_status.clone();
        self.supervise("pipeline", move || {
            // A restarted pipeline starts from scratch, as a restarted ray-xds does; the
            // last snapshot keeps being served until it publishes.
            let pipe =
                Pipeline::new(policies.clone(), gateway.clone()).with_addresses(addresses.clone());
            let (sources, sinks, first) = (sources.clone(), sinks.clone(), first.clone());
            let (clients, metrics, token) = (clients.clone(), metrics.clone(), token.clone());
            let mut source_status = source_status.clone();
            async move {
                tokio::select! {
                    _ = token.cancelled() => return,
                    synced = source_status.wait_for(|s| s.synced) => if synced.is_err() { return },
                }
                pipeline::task::run(pipe, sources, sinks, clients, metrics, first, token).await;
            }
        });
        PipelineOutputs {
            snapshots,
            published,
            health,
            switchover,
        }
    }

    /// The xDS server, once there is a first snapshot, and the watch on its TLS files.
    fn xds_server(
        &mut self,
        listener: TcpListener,
        tls: Option<Arc<crate::xds::tls::ServerTls>>,
        snapshots: watch::Receiver<Arc<Snapshot>>,
        mut published: watch::Receiver<Option<Arc<Snapshot>>>,
        clients: &Arc<Clients>,
    ) {
        let config = self.config;
        let ads = AdsServer::new(
            snapshots,
            self.metrics.clone(),
            clients.clone(),
            self.shutdown.clone(),
        )
        .with_max_streams(config.xds_max_streams);
        let limits = config.xds_limits;
        let service = AdsService::new(ads, config.xds_max_message_bytes).with_partial_requests(
            crate::xds::codec::PartialRequests::with_limit(config.memory.partial_xds_requests),
        );
        let observer: Arc<dyn crate::xds::Observer> = self.metrics.clone();
        if let Some(tls) = &tls {
            let watch = crate::xds::tls::watch(
                tls.clone(),
                crate::xds::tls::RELOAD_INTERVAL,
                observer.clone(),
                self.shutdown.clone(),
            );
            self.spawn(async move {
                watch.await;
                Ok(())
            });
        }
        let token = self.shutdown.clone();
        self.spawn(async move {
            tokio::select! {
                _ = token.cancelled() => return Ok(()),
                ready = published.wait_for(|s| s.is_some()) => if ready.is_err() { return Ok(()) },
            }
            tonic::transport::Server::builder()
                // A peer that stops answering pings is closed; one connection serves at
                // most this many streams (an Envoy opens one).
                .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
                .max_concurrent_streams(Some(crate::xds::server::MAX_STREAMS_PER_CONNECTION))
                .add_service(service)
                .serve_with_incoming_shutdown(
                    crate::xds::listener::incoming(
                        listener,
                        limits,
                        Default::default(),
                        observer,
                        tls,
                    ),
                    token.cancelled_owned(),
                )
                .await
                .context("xDS server")
        });
    }

    /// The admin port, on a thread and runtime of its own: with thousands of probes
    /// queued on the main runtime, `/healthz` and `/readyz` do not wait behind them (the
    /// kernel shares the cores between the threads instead).
    fn admin(
        &mut self,
        listener: TcpListener,
        debug: Option<TcpListener>,
        state: AdminState,
    ) -> anyhow::Result<()> {
        let token = self.shutdown.clone();
        let listener = listener
            .into_std()
            .context("moving the admin listener to its thread")?;
        let debug = debug
            .map(TcpListener::into_std)
            .transpose()
            .context("moving the admin debug listener to its thread")?;
        let (admin_done, admin_ended) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("ray-xds-admin".into())
            .spawn(move || {
                let served = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .and_then(|runtime| {
                        runtime.block_on(async move {
                            let listener = tokio::net::TcpListener::from_std(listener)?;
                            let debug = debug.map(tokio::net::TcpListener::from_std).transpose()?;
                            admin::serve(listener, debug, state, token).await
                        })
                    });
                let _ = admin_done.send(served);
            })
            .context("starting the admin thread")?;
        self.spawn(async move {
            admin_ended
                .await
                .unwrap_or_else(|_| Err(std::io::Error::other("the admin thread panicked")))
                .context("admin server")
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServeArgs;

    fn config(xds_max_connections: Option<usize>) -> Config {
        Config::load(&ServeArgs {
            source_kubernetes: true,
            xds_max_connections,
            ..Default::default()
        })
        .unwrap()
    }

    /// The open-files limit is checked against what the configured limits may
    /// hold at once: xDS connections, admin connections, probes, the rest.
    #[test]
    fn the_open_files_needed_follow_the_connection_limits() {
        let defaults = config(None);
        // 4,096 xDS + 256 admin + 1,024 probes + 64 others.
        assert_eq!(open_files_needed(&defaults), 4_096 + 256 + 1_024 + 64);
        assert_eq!(open_files_shortfall(1_024, &defaults), Some(5_440));
        assert_eq!(open_files_shortfall(5_439, &defaults), Some(5_440));
        assert_eq!(open_files_shortfall(5_440, &defaults), None);
        assert_eq!(open_files_shortfall(1_048_576, &defaults), None);
        assert_eq!(open_files_shortfall(u64::MAX, &defaults), None);
        // Lowering xds.max_connections lowers the need.
        let small = config(Some(100));
        assert_eq!(open_files_needed(&small), 100 + 256 + 1_024 + 64);
        assert_eq!(open_files_shortfall(1_024, &small), Some(1_444));
        assert_eq!(open_files_shortfall(4_096, &small), None);
    }

    /// The memory limit is read from this process's own cgroup first (v2 and v1), then
    /// from the mount roots.
    #[test]
    fn the_memory_limit_is_read_from_the_process_own_cgroup() {
        let files = |text: &str| -> Vec<String> {
            memory_limit_files(text)
                .into_iter()
                .map(|p| p.display().to_string())
                .collect()
        };
        let roots = [
            "/sys/fs/cgroup/memory.max".to_string(),
            "/sys/fs/cgroup/memory/memory.limit_in_bytes".to_string(),
        ];
        assert_eq!(
            files("0::/kubepods/pod1/c1\n")[..],
            [
                "/sys/fs/cgroup/kubepods/pod1/c1/memory.max".to_string(),
                roots[0].clone(),
                roots[1].clone()
            ]
        );
        assert_eq!(
            files("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n")[0],
            "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes"
        );
        assert_eq!(files("0::/\n")[..], roots[..]);
        assert_eq!(files("")[..], roots[..]);
        assert_eq!(files("garbage\n0::/../../etc\n")[..], roots[..]);
    }

    /// The container's memory limit is checked against the memory budgets:
    /// the defaults (64 + 32 + 64 MiB) fit the Deployment's 512 MiB, larger ones warn.
    #[test]
    fn the_memory_needed_follows_the_budgets() {
        let mut c = config(None);
        let mib = 1u64 << 20;
        assert_eq!(memory_needed(&c), (2 * 160 + 64) * mib);
        assert_eq!(memory_shortfall(512 * mib, &c), None);
        assert_eq!(memory_shortfall(256 * mib, &c), Some(384 * mib));
        c.memory.dashboards = 1 << 30;
        assert_eq!(memory_needed(&c), (2 * (1024 + 96) + 64) * mib);
        assert!(memory_shortfall(512 * mib, &c).is_some());
        c.memory.route_tables = usize::MAX;
        assert_eq!(memory_needed(&c), u64::MAX);
    }
}

//! The components ray-xds starts, one by one: source, dashboards, discovery, prober,
//! peer poller and pipeline.
//!
//! Each component is the single writer of the channels it returns; every task joins one
//! set and ends on one shutdown token. A supervised component that fails is started
//! again on the same channels: what reads them keeps its receiver.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

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
use crate::xds::{Clients, Snapshot};

/// How long a replica peer has to answer.
const PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// The dashboard poller's channels: its states, the pipeline's requests for a fresh
/// answer, and when each dashboard last answered.
pub(super) struct Dashboards {
    pub(super) states: watch::Receiver<Arc<DashboardStates>>,
    pub(super) refresh: tokio::sync::mpsc::UnboundedSender<String>,
    pub(super) answered: Arc<crate::live::dashboards::AnsweredAt>,
}

/// What the pipeline publishes.
pub(super) struct PipelineOutputs {
    pub(super) snapshots: watch::Receiver<Arc<Snapshot>>,
    pub(super) published: watch::Receiver<Option<Arc<Snapshot>>>,
    pub(super) health: watch::Receiver<Arc<HealthMap>>,
    pub(super) switchover: watch::Receiver<Arc<Switchover>>,
}

/// Starts the components one by one, each under the supervisor, into one task set that
/// ends on one shutdown token. Each component is the single writer of the channels it
/// returns.
pub(super) struct Starter<'a> {
    pub(super) tasks: JoinSet<anyhow::Result<()>>,
    pub(super) components: Arc<Components>,
    pub(super) shutdown: CancellationToken,
    pub(super) metrics: Arc<Metrics>,
    pub(super) config: &'a Config,
}

impl Starter<'_> {
    /// `supervisor::supervise(name, ...)` as a task of the runtime's set (it ends only at
    /// shutdown).
    fn supervise<F, Fut>(&mut self, name: &'static str, start: F)
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (components, shutdown) = (self.components.clone(), self.shutdown.clone());
        self.tasks.spawn(async move {
            supervise(name, components, shutdown, start).await;
            Ok(())
        });
    }

    pub(super) fn spawn(
        &mut self,
        task: impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
    ) {
        self.tasks.spawn(task);
    }

    /// Which published endpoint resources list which address, for the pre-stop calls:
    /// the single writer of the index, following the published snapshots.
    pub(super) fn endpoint_index(
        &mut self,
        published: &tokio::sync::watch::Receiver<Option<Arc<crate::xds::Snapshot>>>,
    ) -> Arc<crate::prestop::EndpointIndex> {
        let index = Arc::new(crate::prestop::EndpointIndex::default());
        let (follower, snapshots, token) =
            (index.clone(), published.clone(), self.shutdown.clone());
        self.spawn(async move {
            follower.follow(snapshots, token).await;
            Ok(())
        });
        index
    }

    /// The source: the single writer of the source's model and status.
    pub(super) async fn source(
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
    pub(super) fn dashboards(&mut self, source: &watch::Receiver<Arc<Model>>) -> Dashboards {
        let (tx, states) = watch::channel(Arc::new(DashboardStates::default()));
        let (refresh, refresh_rx) = tokio::sync::mpsc::unbounded_channel();
        let answered = Arc::new(crate::live::dashboards::AnsweredAt::default());
        let policy = &self.config.policies.dashboard;
        let poller = DashboardPoller {
            answered: answered.clone(),
            interval: policy.poll_interval,
            timeout: policy.timeout,
            misses_tolerated: policy.misses_tolerated,
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
    pub(super) fn discovery(
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
    pub(super) fn prober(
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

    /// The other replicas' switchovers, and the views the replicas kept (`replicas.state`,
    /// read at start): one writer, the peer poller (none without peers or kept views: the
    /// channel says "polled" at once and closes).
    pub(super) fn peers(
        &mut self,
        replica_id: &str,
        remembered: Vec<(std::time::SystemTime, crate::live::peers::ReplicaView)>,
    ) -> watch::Receiver<Arc<crate::live::peers::PeerStates>> {
        let config = self.config;
        let polled = config.replica_peers.is_empty() && remembered.is_empty();
        let (peers_tx, peers_rx) = watch::channel(Arc::new(crate::live::peers::PeerStates {
            polled,
            ..Default::default()
        }));
        if !polled {
            let poller = crate::live::peers::PeerPoller {
                peers: config.replica_peers.clone(),
                interval: config.replica_poll_interval,
                timeout: PEER_TIMEOUT,
                own_id: replica_id.to_string(),
                remembered,
            };
            let token = self.shutdown.clone();
            self.spawn(async move {
                poller.run(peers_tx, token).await;
                Ok(())
            });
        }
        peers_rx
    }

    /// The store of the replicas' kept views (`replicas.state`), if any, and what they
    /// kept, read once, before the first build (at most the store's timeout): a restart
    /// of every replica resumes from it.
    pub(super) async fn kept_state(
        &self,
    ) -> anyhow::Result<(
        Option<crate::live::state_store::StateStore>,
        crate::live::state_store::ReadAtStart,
    )> {
        use anyhow::Context;
        let Some(state) = &self.config.replica_state else {
            return Ok((None, Default::default()));
        };
        let store = crate::live::state_store::StateStore::connect(state, &self.config.source)
            .await
            .context("replicas.state: the store of the replicas' switchover views")?;
        let read = crate::live::state_store::read_at_start(&store, state.ttl, &self.metrics).await;
        Ok((Some(store), read))
    }

    /// Keeps this replica's switchover view in the store, for a restart of every replica.
    pub(super) fn state_keeper(
        &mut self,
        store: crate::live::state_store::StateStore,
        taken_in: Vec<(String, f64)>,
        replica_id: &str,
        switchover: &watch::Receiver<Arc<Switchover>>,
    ) {
        let Some(state) = &self.config.replica_state else {
            return;
        };
        let keeper = crate::live::state_store::StateKeeper {
            store,
            replica_id: replica_id.to_string(),
            ttl: state.ttl,
            metrics: self.metrics.clone(),
            taken_in,
        };
        let (switchover, token) = (switchover.clone(), self.shutdown.clone());
        self.spawn(async move {
            keeper
                .run(switchover, |s: &Arc<Switchover>| s.replica_view(), token)
                .await;
            Ok(())
        });
    }

    /// The pipeline: once the source has its first full state (an empty model from a
    /// half-listed cluster would withdraw every route). Until its first snapshot the xDS
    /// server does not answer and /readyz says not ready.
    pub(super) fn pipeline(
        &mut self,
        sources: Sources,
        refresh: tokio::sync::mpsc::UnboundedSender<String>,
        source_status: &watch::Receiver<Arc<SourceStatus>>,
        clients: &Arc<Clients>,
        replica_id: &str,
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
            dashboard_timeout: config.policies.dashboard.timeout,
            probes: config.policies.probe.first_probe_wait(),
            addresses: config.addresses.clone(),
            peers: PEER_TIMEOUT + std::time::Duration::from_millis(200),
        };
        let (policies, gateway) = (config.policies.clone(), config.gateway.clone());
        let addresses = config.addresses.clone();
        let (clients, metrics, token) =
            (clients.clone(), self.metrics.clone(), self.shutdown.clone());
        let source_status = source_status.clone();
        let replica_id = replica_id.to_string();
        self.supervise("pipeline", move || {
            // A restarted pipeline starts from scratch, as a restarted ray-xds does; the
            // last snapshot keeps being served until it publishes.
            let pipe = Pipeline::new(policies.clone(), gateway.clone())
                .with_addresses(addresses.clone())
                .with_replica_id(replica_id.clone());
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
}

//! Wiring: binds the listeners, starts the source, the pipeline, the xDS server and the
//! admin server, and stops them all on one shutdown token.
//!
//! Data flow: source → `watch<Model>` → dashboard poller → `watch<DashboardStates>`;
//! discovery joins the source's model and the dashboards into the effective
//! `watch<Model>` (a cluster known by its dashboard alone gets the proxies it lists) →
//! prober → `watch<ProbeStates>`; the pipeline joins the effective model, probes and
//! dashboards (assess health, translate, snapshot) → `watch<Snapshot>` → one task per
//! xDS stream. Each channel has exactly one writer.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminState};
use crate::config::{Config, GatewaySettings, SourceConfig};
use crate::live::dashboards::{DashboardPoller, DashboardStates};
use crate::live::discovery::discover;
use crate::live::health::{assess, HealthMap};
use crate::live::health::{EndpointHealth, Verdict};
use crate::live::probe::ProbeState;
use crate::live::prober::{ProbeStates, Prober};
use crate::metrics::Metrics;
use crate::metrics::{StateLabels, WeightLabels};
use crate::model::Model;
use crate::source::file::{self, FileSource};
use crate::source::kubernetes::{self, KubernetesSource};
use crate::source::SourceStatus;
use crate::switchover::{Departed, Switchover};
use crate::translate::translate;
use crate::xds::grpc::AdsService;
use crate::xds::server::{AdsServer, Clients};
use crate::xds::Snapshot;

/// A started control plane.
pub struct Running {
    pub xds_addr: SocketAddr,
    pub admin_addr: SocketAddr,
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

/// Starts ray-xds. A bad source file at start is an error; later bad edits are not.
pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<Running> {
    let metrics = Arc::new(Metrics::new());
    let clients = Arc::new(Clients::default());
    let xds_listener = TcpListener::bind(config.xds_listen)
        .await
        .with_context(|| format!("binding the xDS listener on {}", config.xds_listen))?;
    let admin_listener = TcpListener::bind(config.admin_listen)
        .await
        .with_context(|| format!("binding the admin listener on {}", config.admin_listen))?;
    let xds_addr = xds_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    let mut tasks = JoinSet::new();
    let (status_tx, mut source_status) = watch::channel(Arc::new(SourceStatus::default()));
    let models_rx = match &config.source {
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
                metrics: metrics.clone(),
            };
            let token = shutdown.clone();
            tasks.spawn(async move {
                source.run(bytes, tx, token).await;
                Ok(())
            });
            rx
        }
        SourceConfig::Kubernetes(k) => {
            let client = kubernetes::client(k).await?;
            let (tx, rx) = watch::channel(Arc::new(Model::default()));
            let source = KubernetesSource {
                config: k.clone(),
                metrics: metrics.clone(),
            };
            let token = shutdown.clone();
            tasks.spawn(async move {
                source.run(client, tx, status_tx, token).await;
                Ok(())
            });
            rx
        }
    };

    // The dashboard poller needs only the dashboards: it reads the source's model.
    let (dashboards_tx, dashboards_rx) = watch::channel(Arc::new(DashboardStates::default()));
    let (refresh_tx, refresh_rx) = tokio::sync::mpsc::unbounded_channel();
    {
        let poller = DashboardPoller {
            interval: config.dashboard.poll_interval,
            timeout: config.dashboard.timeout,
            metrics: metrics.clone(),
        };
        let (models, token) = (models_rx.clone(), shutdown.clone());
        tasks.spawn(async move {
            poller.run(models, dashboards_tx, refresh_rx, token).await;
            Ok(())
        });
    }
    // Everything else reads the effective model: the source's, with the proxies of the
    // clusters known by their dashboard alone.
    let (effective_tx, effective_rx) = watch::channel(models_rx.borrow().clone());
    {
        let (source, dashboards, token) =
            (models_rx.clone(), dashboards_rx.clone(), shutdown.clone());
        tasks.spawn(async move {
            effective_models(source, dashboards, effective_tx, token).await;
            Ok(())
        });
    }
    let (probes_tx, probes_rx) = watch::channel(Arc::new(ProbeStates::default()));
    {
        let prober = Prober {
            config: config.prober,
            metrics: metrics.clone(),
        };
        let (models, token) = (effective_rx.clone(), shutdown.clone());
        tasks.spawn(async move {
            prober.run(models, probes_tx, token).await;
            Ok(())
        });
    }
    let first_round = config.prober.defaults.timeout * 2 + Duration::from_millis(200);
    let first_answer = config.dashboard.timeout + Duration::from_millis(500);
    let source_models = models_rx;
    let inputs = Inputs {
        models: effective_rx,
        probes: probes_rx,
        dashboards: dashboards_rx,
    };
    let (health_tx, health_rx) = watch::channel(Arc::new(HealthMap::default()));
    let (switch_tx, switch_rx) = watch::channel(Arc::new(Switchover::default()));
    let mut pipeline = Pipeline {
        gateway: config.gateway.clone(),
        metrics: metrics.clone(),
        health: health_tx,
        fail_open: Default::default(),
        switchover: Switchover::new(config.switchover.clone()),
        departed: Departed::default(),
        clients: clients.clone(),
        published_proxies: BTreeSet::new(),
        held_until: None,
        first_probe_wait: first_round,
        last_source_model: inputs.models.borrow().clone(),
        switch_views: switch_tx,
        refresh: refresh_tx,
    };
    // Until the first snapshot, the xDS server does not answer (connections wait) and
    // /readyz says not ready.
    let (published_tx, published_rx) = watch::channel::<Option<Arc<Snapshot>>>(None);
    let (snapshots_tx, snapshots_rx) =
        watch::channel(Arc::new(Snapshot::from_resources(&Default::default())));
    let live = LiveViews {
        models: inputs.models.clone(),
        probes: inputs.probes.clone(),
        dashboards: inputs.dashboards.clone(),
        health: health_rx,
        switchover: switch_rx,
        source: source_status.clone(),
    };
    {
        let token = shutdown.clone();
        tasks.spawn(async move {
            // Nothing is published before the source has its first full state: an empty
            // model from a half-listed cluster would withdraw every route.
            tokio::select! {
                _ = token.cancelled() => return Ok(()),
                synced = source_status.wait_for(|s| s.synced) => if synced.is_err() { return Ok(()) },
            }
            // A cluster known by its dashboard alone has no proxies until the dashboard
            // answers: wait (briefly) for that, so that a restart does not publish it
            // empty.
            first_discovery(&source_models, &inputs, first_answer).await;
            // Then wait (briefly) for every proxy's first probe, so that a restarted
            // ray-xds publishes the health Envoy already has, not "unknown" for everyone.
            let wanted: Vec<SocketAddr> =
                inputs.models.borrow().proxies().map(|p| p.address).collect();
            first_probes(&mut inputs.probes.clone(), &wanted, first_round).await;
            let first = pipeline.build(&inputs, None);
            pipeline.published(&first);
            snapshots_tx.send_replace(first.clone());
            published_tx.send_replace(Some(first));
            pipeline
                .run(inputs, snapshots_tx, published_tx, token)
                .await;
            Ok(())
        });
    }

    let ads = AdsServer::new(
        snapshots_rx,
        metrics.clone(),
        clients.clone(),
        shutdown.clone(),
    );
    {
        let service = AdsService::new(ads, config.xds_max_message_bytes);
        let token = shutdown.clone();
        let mut first = published_rx.clone();
        tasks.spawn(async move {
            tokio::select! {
                _ = token.cancelled() => return Ok(()),
                ready = first.wait_for(|s| s.is_some()) => if ready.is_err() { return Ok(()) },
            }
            tonic::transport::Server::builder()
                .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(xds_listener),
                    token.cancelled_owned(),
                )
                .await
                .context("xDS server")
        });
    }
    {
        let state = AdminState {
            metrics: metrics.clone(),
            clients,
            snapshots: published_rx,
            live,
        };
        let token = shutdown.clone();
        tasks.spawn(async move {
            admin::serve(admin_listener, state, token)
                .await
                .context("admin server")
        });
    }
    tracing::info!(%xds_addr, %admin_addr, "ray-xds started");
    Ok(Running {
        xds_addr,
        admin_addr,
        metrics,
        shutdown,
        tasks,
    })
}

/// The single writer of the effective model: the source's model, with each cluster that
/// discovers its proxies given those its dashboard last listed ([`discover`]). Re-run when
/// either input changes; published only on change. When no cluster discovers, the
/// source's model is forwarded as is (the same `Arc`: no copy, no comparison, and
/// dashboard polls cost nothing here).
async fn effective_models(
    mut source: watch::Receiver<Arc<Model>>,
    mut dashboards: watch::Receiver<Arc<DashboardStates>>,
    effective: watch::Sender<Arc<Model>>,
    shutdown: CancellationToken,
) {
    loop {
        let model = source.borrow_and_update().clone();
        let discovers = model.discovers();
        if discovers {
            let states = dashboards.borrow_and_update().clone();
            let next = discover(&model, &states);
            effective.send_if_modified(|current| {
                let changed = **current != next;
                if changed {
                    *current = Arc::new(next);
                }
                changed
            });
        } else {
            effective.send_if_modified(|current| {
                let changed = !Arc::ptr_eq(current, &model);
                if changed {
                    *current = model;
                }
                changed
            });
        }
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = source.changed() => {
                    if changed.is_err() { return }
                    break;
                }
                changed = dashboards.changed() => {
                    if changed.is_err() { return }
                    if discovers { break }
                }
            }
        }
    }
}

/// Waits, at most `bound`, until each of `addresses` has had its first probe.
async fn first_probes(
    probes: &mut watch::Receiver<Arc<ProbeStates>>,
    addresses: &[SocketAddr],
    bound: Duration,
) {
    if addresses.is_empty() {
        return;
    }
    let probed = probes.wait_for(|p| {
        addresses.iter().all(|a| {
            p.proxies
                .get(a)
                .is_some_and(|s| s.state != ProbeState::Unknown)
        })
    });
    let _ = tokio::time::timeout(bound, probed).await;
}

/// Waits, at most `bound`, until the dashboard of every cluster that discovers its
/// proxies has answered (or failed) once and the effective model holds what it said.
async fn first_discovery(source: &watch::Receiver<Arc<Model>>, inputs: &Inputs, bound: Duration) {
    let model = source.borrow().clone();
    let discovering: BTreeSet<String> = model
        .services()
        .iter()
        .flat_map(|s| {
            s.clusters
                .iter()
                .filter(|c| c.discover)
                .map(|c| s.envoy_cluster_name(&c.name))
        })
        .collect();
    if discovering.is_empty() {
        return;
    }
    let (mut dashboards, mut effective) = (inputs.dashboards.clone(), inputs.models.clone());
    let answered = async {
        let polled = dashboards.wait_for(|d| {
            discovering.iter().all(|c| {
                d.clusters
                    .get(c)
                    .is_some_and(|d| d.status.is_some() || d.last_error.is_some())
            })
        });
        if polled.await.is_err() {
            return;
        }
        // Another task derives the effective model from the dashboards: wait until it
        // has caught up with them. (Each borrow is released at once: the other tasks
        // never hold one channel while writing another, so this cannot deadlock.)
        let _ = effective
            .wait_for(|m| {
                let (s, d) = (source.borrow().clone(), inputs.dashboards.borrow().clone());
                **m == discover(&s, &d)
            })
            .await;
    };
    if tokio::time::timeout(bound, answered).await.is_err() {
        tracing::warn!(clusters = ?discovering, "a dashboard to discover proxies from has not answered yet; starting without its proxies");
    }
}

/// The pipeline's inputs, each written by one task.
struct Inputs {
    /// The effective model (see [`effective_models`]).
    models: watch::Receiver<Arc<Model>>,
    probes: watch::Receiver<Arc<ProbeStates>>,
    dashboards: watch::Receiver<Arc<DashboardStates>>,
}

/// The single writer of the snapshot channel: joins the model with live health,
/// translates, and publishes when the version changes.
struct Pipeline {
    gateway: GatewaySettings,
    metrics: Arc<Metrics>,
    health: watch::Sender<Arc<HealthMap>>,
    fail_open: BTreeSet<String>,
    switchover: Switchover,
    departed: Departed,
    /// Connected Envoys: a switch waits until each has warmed its target.
    clients: Arc<Clients>,
    /// Proxies the last snapshot had.
    published_proxies: BTreeSet<SocketAddr>,
    /// When the earliest held-back new proxy is published even without a probe result.
    held_until: Option<SystemTime>,
    /// How long a new proxy is held back waiting for its first probe.
    first_probe_wait: Duration,
    last_source_model: Arc<Model>,
    switch_views: watch::Sender<Arc<Switchover>>,
    /// Asks the dashboard poller for an immediate answer from a cluster.
    refresh: tokio::sync::mpsc::UnboundedSender<String>,
}

impl Pipeline {
    /// The addresses of `model`'s proxies that the last snapshot did not have.
    fn unpublished<'a>(&'a self, model: &'a Model) -> impl Iterator<Item = SocketAddr> + 'a {
        model
            .proxies()
            .map(|p| p.address)
            .filter(|a| !self.published_proxies.contains(a))
    }

    fn build(&mut self, inputs: &Inputs, previous: Option<&Snapshot>) -> Arc<Snapshot> {
        let source_model = inputs.models.borrow().clone();
        let probes = inputs.probes.borrow().clone();
        let dashboards = inputs.dashboards.borrow().clone();
        let started = Instant::now();
        let now = SystemTime::now();
        // Clusters the source dropped stay, draining, for their grace period; the
        // switchover only ever sends traffic to clusters the source lists.
        let model = self.departed.update(
            &self.last_source_model,
            &source_model,
            &self.switchover.defaults,
            now,
        );
        self.last_source_model = source_model.clone();
        // A proxy new since the last snapshot waits (up to `first_probe_wait`) for its
        // first probe: published as "unknown", Envoy would count it healthy and send it
        // requests before anyone knows, and its health would follow in a second push.
        let mut held = BTreeSet::new();
        let mut held_until: Option<SystemTime> = None;
        for address in self.unpublished(&model) {
            let until = match probes.proxies.get(&address) {
                Some(p) if p.state != ProbeState::Unknown => continue,
                Some(p) => p.since + self.first_probe_wait,
                None => now + self.first_probe_wait,
            };
            if until > now {
                held.insert(address);
                held_until = Some(held_until.map_or(until, |u| u.min(until)));
            }
        }
        self.held_until = held_until;
        let model = if held.is_empty() {
            model
        } else {
            model.without_proxies(&held)
        };
        self.published_proxies = model.proxies().map(|p| p.address).collect();
        let mut health = assess(&model, &probes, &dashboards);
        let departed = self.departed.envoy_cluster_names();
        if !departed.is_empty() {
            for ((cluster, _), verdict) in health.endpoints.iter_mut() {
                if departed.contains(cluster) {
                    *verdict = Verdict {
                        health: EndpointHealth::Draining,
                        reason: "its cluster left the source: draining until removed".into(),
                    };
                }
            }
        }
        for e in self
            .switchover
            .advance(&source_model, &probes, &dashboards, &*self.clients, now)
        {
            tracing::info!(rayservice = e.service, phase = e.phase, weights = ?e.weights, "switchover: {}", e.reason);
            self.metrics
                .switchover_transitions
                .get_or_create(&StateLabels { state: e.phase })
                .inc();
            let clusters = model
                .services()
                .iter()
                .filter(|s| s.key() == e.service)
                .flat_map(|s| &s.clusters);
            for cluster in clusters {
                let weight = e
                    .weights
                    .iter()
                    .find(|(c, _)| *c == cluster.name)
                    .map_or(0, |(_, w)| *w);
                self.metrics
                    .switchover_weight
                    .get_or_create(&WeightLabels {
                        rayservice: e.service.clone(),
                        cluster: cluster.name.clone(),
                    })
                    .set(weight as i64);
            }
        }
        for cluster in self.switchover.take_refresh_requests() {
            let _ = self.refresh.send(cluster);
        }
        self.switch_views
            .send_replace(Arc::new(self.switchover.clone()));
        let resources = translate(&model, &health, &self.switchover, &self.gateway);
        let snapshot = Snapshot::from_resources_reusing(&resources, previous);
        self.metrics
            .translate_seconds
            .observe(started.elapsed().as_secs_f64());
        self.note_fail_open(&health);
        self.health.send_replace(Arc::new(health));
        Arc::new(snapshot)
    }

    fn published(&self, snapshot: &Snapshot) {
        self.metrics.snapshots.inc();
        self.metrics.snapshot_resources.set(snapshot.len() as i64);
        self.metrics.set_snapshot_version(snapshot.version());
        tracing::info!(
            version = snapshot.version(),
            resources = snapshot.len(),
            "snapshot published"
        );
    }

    fn note_fail_open(&mut self, health: &HealthMap) {
        for cluster in health.fail_open.difference(&self.fail_open) {
            tracing::warn!(cluster, "every proxy of the cluster fails its probe: publishing them healthy (fail-open); Envoy's outlier detection decides");
            self.metrics.fail_open_events.inc();
        }
        for cluster in self.fail_open.difference(&health.fail_open) {
            tracing::info!(cluster, "fail-open ended");
        }
        self.fail_open = health.fail_open.clone();
        self.metrics
            .fail_open_clusters
            .set(self.fail_open.len() as i64);
    }

    async fn run(
        mut self,
        mut inputs: Inputs,
        snapshots: watch::Sender<Arc<Snapshot>>,
        published: watch::Sender<Option<Arc<Snapshot>>>,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = inputs.models.changed() => {
                    if changed.is_err() { return }
                    // New proxies are held back until their first probe: wait for it
                    // (briefly) so that the change is built and pushed once, with health.
                    let new: Vec<SocketAddr> = self.unpublished(&inputs.models.borrow()).collect();
                    first_probes(&mut inputs.probes, &new, self.first_probe_wait).await;
                }
                changed = inputs.probes.changed() => if changed.is_err() { return },
                changed = inputs.dashboards.changed() => if changed.is_err() { return },
                // A progressive shift moves on with time alone.
                _ = tokio::time::sleep(Duration::from_millis(500)), if self.switchover.shifting() => {}
                // A switch waits for every Envoy to warm its target: look again on each
                // ACK, and now and then for its warm_timeout.
                _ = self.clients.acked(), if self.switchover.warming() => {}
                _ = tokio::time::sleep(Duration::from_millis(250)), if self.switchover.warming() => {}
                // A held-back new proxy is published without waiting longer for its probe.
                _ = tokio::time::sleep(self.held_until.and_then(|t| t.duration_since(SystemTime::now()).ok()).unwrap_or_default() + Duration::from_millis(10)), if self.held_until.is_some() => {}
                // A departed cluster's grace period ends.
                _ = tokio::time::sleep(self.departed.next_expiry().and_then(|t| t.duration_since(SystemTime::now()).ok()).unwrap_or_default() + Duration::from_millis(10)), if self.departed.next_expiry().is_some() => {}
            }
            inputs.models.mark_unchanged();
            inputs.probes.mark_unchanged();
            inputs.dashboards.mark_unchanged();
            let previous = snapshots.borrow().clone();
            let snapshot = self.build(&inputs, Some(&previous));
            if snapshot.version() == previous.version() {
                continue;
            }
            self.published(&snapshot);
            snapshots.send_replace(snapshot.clone());
            published.send_replace(Some(snapshot));
        }
    }
}

/// What `/debug/state` shows.
#[derive(Clone)]
pub struct LiveViews {
    pub models: watch::Receiver<Arc<Model>>,
    pub probes: watch::Receiver<Arc<ProbeStates>>,
    pub dashboards: watch::Receiver<Arc<DashboardStates>>,
    pub health: watch::Receiver<Arc<HealthMap>>,
    pub switchover: watch::Receiver<Arc<Switchover>>,
    pub source: watch::Receiver<Arc<SourceStatus>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::dashboard::{HttpProxy, ServeStatus};
    use crate::live::dashboards::ClusterDashboard;
    use crate::model::test_support::service;
    use crate::model::NodeType;

    const URL: &str = "http://127.0.0.1:8265";
    const CLUSTER: &str = "default/a/a1";

    fn discovering() -> Arc<Model> {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        a.clusters[0].dashboard = Some(URL.into());
        Arc::new(Model::new(vec![a]).unwrap())
    }

    fn answer(ports: &[u16]) -> Arc<DashboardStates> {
        let mut d = ClusterDashboard::new(URL.into());
        d.status = Some(ServeStatus {
            http_proxies: ports
                .iter()
                .map(|p| HttpProxy {
                    address: SocketAddr::from(([127, 0, 0, 1], *p)),
                    node_id: format!("n{p}"),
                    node_type: NodeType::Worker,
                    status: None,
                })
                .collect(),
            ..Default::default()
        });
        Arc::new(DashboardStates {
            clusters: [(CLUSTER.to_string(), d)].into(),
        })
    }

    async fn next(rx: &mut watch::Receiver<Arc<Model>>) -> Arc<Model> {
        tokio::time::timeout(Duration::from_secs(10), rx.changed())
            .await
            .expect("published in time")
            .unwrap();
        rx.borrow_and_update().clone()
    }

    fn ports(m: &Model) -> Vec<u16> {
        m.services()[0].clusters[0]
            .proxies
            .iter()
            .map(|p| p.address.port())
            .collect()
    }

    #[tokio::test]
    async fn without_discovery_the_source_model_is_forwarded_as_is() {
        let first = Arc::new(Model::new(vec![service("a", "a1", &[8000])]).unwrap());
        let (source_tx, source) = watch::channel(first.clone());
        let (dash_tx, dashboards) = watch::channel(Arc::new(DashboardStates::default()));
        let (tx, mut rx) = watch::channel(Arc::new(Model::default()));
        let token = CancellationToken::new();
        tokio::spawn(effective_models(source, dashboards, tx, token.clone()));
        assert!(Arc::ptr_eq(&next(&mut rx).await, &first));
        dash_tx.send_replace(answer(&[9000]));
        let second = Arc::new(Model::new(vec![service("a", "a1", &[8001])]).unwrap());
        source_tx.send_replace(second.clone());
        assert!(Arc::ptr_eq(&next(&mut rx).await, &second));
        token.cancel();
    }

    #[tokio::test]
    async fn discovered_proxies_follow_the_dashboard() {
        let (_source_tx, source) = watch::channel(discovering());
        let (dash_tx, dashboards) = watch::channel(Arc::new(DashboardStates::default()));
        let (tx, mut rx) = watch::channel(discovering());
        let token = CancellationToken::new();
        tokio::spawn(effective_models(source, dashboards, tx, token.clone()));
        dash_tx.send_replace(answer(&[8000, 8001]));
        assert_eq!(ports(&*next(&mut rx).await), [8000, 8001]);
        dash_tx.send_replace(answer(&[8000]));
        assert_eq!(ports(&*next(&mut rx).await), [8000]);
        dash_tx.send_replace(answer(&[8000, 8002]));
        assert_eq!(ports(&*next(&mut rx).await), [8000, 8002]);
        assert!(rx.borrow().services()[0].clusters[0].discover);
        token.cancel();
    }
}

//! The pipeline's task: the single writer of the snapshot channel. It waits for an input
//! to change (or for the time the last build asked to be woken at), runs
//! [`Pipeline::build`], publishes the snapshot when its version changed, logs and counts
//! what the build decided, and passes on its requests for fresh dashboard answers.
//!
//! Back-edges, both explicit here: dashboard refresh requests go back to the dashboard
//! poller (an `mpsc` channel), and ACK notifications come back from the xDS server
//! (`Clients::acked`) while a switch waits for Envoys to warm its target.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{Event, Inputs, Output, Pipeline};
use crate::live::dashboard::MAX_READS_AT_ONCE;
use crate::live::dashboards::DashboardStates;
use crate::live::discovery::discover;
use crate::live::health::HealthMap;
use crate::live::peers::PeerStates;
use crate::live::probe::ProbeState;
use crate::live::prober::ProbeStates;
use crate::metrics::{Metrics, StateLabels, WeightLabels};
use crate::model::Model;
use crate::xds::lrs::LoadReports;
use crate::xds::{Clients, Snapshot};

use super::switchover::{Phase, Switchover};

/// The channels the pipeline reads, each written by one task.
#[derive(Clone)]
pub(crate) struct Sources {
    /// The source's own model (to know which clusters discover their proxies).
    pub source: watch::Receiver<Arc<Model>>,
    /// The effective model: the source's, with discovered proxies.
    pub models: watch::Receiver<Arc<Model>>,
    pub probes: watch::Receiver<Arc<ProbeStates>>,
    pub dashboards: watch::Receiver<Arc<DashboardStates>>,
    /// The prober's liveness: while it does not beat, no probe result is fresh.
    pub prober: Arc<crate::live::prober::Heartbeat>,
    /// What the other replicas say of their switchovers (`live::peers`).
    pub peers: watch::Receiver<Arc<PeerStates>>,
    /// What this replica's Envoys report of their requests (`xds::lrs`); the pipeline
    /// says which clusters to track.
    pub loads: Arc<LoadReports>,
}

/// The channels the pipeline writes.
#[derive(Clone)]
pub(crate) struct Sinks {
    /// What the xDS streams serve.
    pub snapshots: watch::Sender<Arc<Snapshot>>,
    /// The same, `None` until the first snapshot (the xDS server and `/readyz` wait for
    /// it).
    pub published: watch::Sender<Option<Arc<Snapshot>>>,
    pub health: watch::Sender<Arc<HealthMap>>,
    pub switchover: watch::Sender<Arc<Switchover>>,
    /// Asks the dashboard poller for an immediate answer from a cluster.
    pub refresh: mpsc::UnboundedSender<String>,
}

/// How long the first snapshot waits for what it should not be built without.
#[derive(Clone, Debug)]
pub(crate) struct FirstBuild {
    /// How long one dashboard read may take once it has its turn: the wait for every
    /// cluster's dashboard to answer once follows from it ([`first_answer_wait`]).
    pub dashboard_timeout: Duration,
    /// For every proxy's first probe.
    pub probes: Duration,
    /// The address policy discovery applies (to tell when it has caught up).
    pub addresses: crate::model::AddressPolicy,
    /// For the replica peers to answer once (when there are peers), so that a restarted
    /// replica resumes a switch instead of publishing it from its start.
    pub peers: Duration,
}

/// The pipeline's loop: waits for the first inputs (`FirstBuild`), then builds, publishes
/// and waits for the next change, until `shutdown`.
pub async fn run(
    mut pipeline: Pipeline,
    mut sources: Sources,
    sinks: Sinks,
    clients: Arc<Clients>,
    metrics: Arc<Metrics>,
    first: FirstBuild,
    shutdown: CancellationToken,
) {
    tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = first_inputs(&sources, &first) => {}
    }
    let mut published = Published::default();
    let mut peers_open = true;
    loop {
        let wedged = prober_wedged(&sources);
        let started = std::time::Instant::now();
        let Some((back, out, cpu)) = build(pipeline, &mut sources, &clients, wedged).await else {
            return; // the runtime is shutting down
        };
        pipeline = back;
        let spent = started.elapsed();
        metrics.translate_seconds.observe(spent.as_secs_f64());
        published.publish(&out, &sinks, &metrics);
        let judged = out.switchover.judged_clusters();
        sources.loads.track(judged);
        let mut wake = out.wake_at.map(|t| {
            tokio::time::Instant::now()
                + t.duration_since(SystemTime::now()).unwrap_or_default()
                + Duration::from_millis(5)
        });
        // While a new cluster with traffic may be rolled back, its reports come in every
        // interval.
        if out.switchover.judging() {
            let reports = tokio::time::Instant::now() + sources.loads.interval();
            wake = Some(wake.map_or(reports, |w| w.min(reports)));
        }
        // Every build is followed by a pause of three times its length (at most 500 ms):
        // changes that come meanwhile are folded into the next build, so that a stream of
        // them (proxies flapping, the first probes of thousands) costs the pipeline at
        // most a quarter of a core. A change that comes alone is built at once.
        let pause = spent.saturating_mul(PACE_FACTOR).min(MAX_PACE);
        tracing::debug!(
            build_ms = spent.as_secs_f64() * 1e3,
            build_cpu_ms = cpu.as_secs_f64() * 1e3,
            pause_ms = pause.as_secs_f64() * 1e3,
            version = out.snapshot.version(),
            "pipeline built"
        );
        if !pause.is_zero() {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        let next = Next {
            wedged,
            wake,
            wake_on_ack: out.wake_on_ack,
            switch_in_progress: out.switchover.in_progress() || out.switchover.judging(),
        };
        if !next_change(
            &pipeline,
            &mut sources,
            &clients,
            &next,
            &mut peers_open,
            &shutdown,
        )
        .await
        {
            return;
        }
    }
}

/// What the pipeline waits for before its first build. Every dashboard to answer once
/// (briefly): a cluster known by its dashboard alone has no proxies until it answers, so
/// that a restart does not publish it empty, and a switch's capacity share needs both
/// clusters' sizes, so that a restart resumes the share instead of publishing 0 first. Then wait (briefly) for every proxy's first probe,
/// so that a restarted ray-xds publishes the health Envoy already has, not "unknown" for
/// everyone; and for the replica peers to answer once.
async fn first_inputs(sources: &Sources, first: &FirstBuild) {
    first_discovery(sources, first.dashboard_timeout, &first.addresses).await;
    let wanted: Vec<SocketAddr> = sources
        .models
        .borrow()
        .proxies()
        .map(|p| p.address)
        .collect();
    let mut probes = sources.probes.clone();
    first_probes(&mut probes, &wanted, first.probes).await;
    let mut peers = sources.peers.clone();
    let _ = tokio::time::timeout(first.peers, peers.wait_for(|p| p.polled)).await;
}

/// One build from the inputs as they are now, on a blocking thread: the build is CPU
/// work that grows with the model (20,000 proxies take tens of milliseconds), so the
/// admin port and the xDS streams keep being served meanwhile. A panic in it is the
/// pipeline's panic (the supervisor restarts the pipeline); `None` when the runtime is
/// shutting down. While the prober is `wedged`, every probe result is served as unknown.
async fn build(
    mut pipeline: Pipeline,
    sources: &mut Sources,
    clients: &Arc<Clients>,
    wedged: bool,
) -> Option<(Pipeline, Output, Duration)> {
    sources.peers.mark_unchanged();
    pipeline.set_peers(sources.peers.borrow().clone());
    pipeline.set_loads(
        sources
            .loads
            .totals(pipeline.outcome_window(), SystemTime::now()),
    );
    sources.models.mark_unchanged();
    sources.probes.mark_unchanged();
    sources.dashboards.mark_unchanged();
    let model = sources.models.borrow().clone();
    let mut probes = sources.probes.borrow().clone();
    let dashboards = sources.dashboards.borrow().clone();
    if wedged {
        tracing::error!(since = ?sources.prober.age(), "the prober has stopped: every probe result is served as unknown until it runs again");
        probes = Arc::new(probes.all_unknown(
            "the prober has stopped: no fresh probe result",
            SystemTime::now(),
        ));
    }
    let envoys = clients.clone();
    let built = tokio::task::spawn_blocking(move || {
        let cpu_before = crate::metrics::thread_cpu_time();
        let out = pipeline.build(
            &Inputs {
                model: &model,
                probes: &probes,
                dashboards: &dashboards,
                envoys: &*envoys,
            },
            SystemTime::now(),
        );
        let cpu = crate::metrics::thread_cpu_time().saturating_sub(cpu_before);
        (pipeline, out, cpu)
    })
    .await;
    match built {
        Ok(built) => Some(built),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

/// What the pipeline last published, and the weight series it set.
#[derive(Default)]
struct Published {
    snapshot: Option<Arc<Snapshot>>,
    weights: BTreeSet<WeightLabels>,
}

impl Published {
    /// Publishes one build: the snapshot first (when its version changed), then the
    /// views of it (health, switchover) and the dashboards to ask again, so that what
    /// `/debug/state` says is never ahead of what is served.
    fn publish(&mut self, out: &Output, sinks: &Sinks, metrics: &Metrics) {
        record(out, metrics, &mut self.weights);
        if self
            .snapshot
            .as_ref()
            .is_none_or(|p| p.version() != out.snapshot.version())
        {
            metrics.snapshots.inc();
            metrics.snapshot_resources.set(out.snapshot.len() as i64);
            metrics.set_snapshot_version(out.snapshot.version());
            tracing::info!(
                version = out.snapshot.version(),
                resources = out.snapshot.len(),
                "snapshot published"
            );
            self.snapshot = Some(out.snapshot.clone());
            sinks.snapshots.send_replace(out.snapshot.clone());
            sinks.published.send_replace(Some(out.snapshot.clone()));
        }
        sinks.health.send_replace(out.health.clone());
        sinks.switchover.send_replace(out.switchover.clone());
        for cluster in &out.refresh {
            let _ = sinks.refresh.send(cluster.clone());
        }
    }
}

/// What the last build says about when to build again.
struct Next {
    /// Whether the prober was wedged for that build.
    wedged: bool,
    /// When time alone changes something (`Output::wake_at`).
    wake: Option<tokio::time::Instant>,
    /// Whether an Envoy's ACK may move a switch (`Output::wake_on_ack`).
    wake_on_ack: bool,
    /// Whether a switch is under way (a peer's view matters only then, or to what drains).
    switch_in_progress: bool,
}

/// Waits for something that changes the next build: a model, probes, dashboards, a
/// peer's view that matters, an ACK a switch waits for, the build's own wake-up time, or
/// the prober stopping or starting to beat again. `false` on shutdown or a closed input.
async fn next_change(
    pipeline: &Pipeline,
    sources: &mut Sources,
    clients: &Clients,
    next: &Next,
    peers_open: &mut bool,
    shutdown: &CancellationToken,
) -> bool {
    let mut check = tokio::time::interval(Duration::from_secs(1));
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    check.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return false,
            // Rebuild when the prober stops or starts beating again, else nothing.
            _ = check.tick() => if prober_wedged(sources) == next.wedged { continue },
            changed = sources.models.changed() => {
                if changed.is_err() { return false }
                tracing::debug!(cause = "model", "pipeline wakes");
                if !first_probes_of_new_proxies(pipeline, sources, shutdown).await { return false }
            }
            changed = sources.probes.changed() => {
                if changed.is_err() { return false }
                tracing::debug!(cause = "probes", "pipeline wakes");
            }
            changed = sources.dashboards.changed() => {
                if changed.is_err() { return false }
                tracing::debug!(cause = "dashboards", "pipeline wakes");
            }
            // A peer's view changes only a switch in progress and what drains.
            changed = sources.peers.changed(), if *peers_open => {
                // No peers (their poller ended): nothing more to hear.
                if changed.is_err() { *peers_open = false; continue }
                let departed = !sources.peers.borrow().departed.is_empty();
                if !next.switch_in_progress && !departed { continue }
            }
            _ = clients.acked(), if next.wake_on_ack => tracing::debug!(cause = "ack", "pipeline wakes"),
            _ = tokio::time::sleep_until(next.wake.unwrap_or_else(tokio::time::Instant::now)), if next.wake.is_some() => {
                tracing::debug!(cause = "time", "pipeline wakes");
            }
        }
        return true;
    }
}

/// New proxies are withheld until their first probe: wait for it (briefly) so that the
/// change is built and pushed once, with health. `false` on shutdown or closed probes.
async fn first_probes_of_new_proxies(
    pipeline: &Pipeline,
    sources: &mut Sources,
    shutdown: &CancellationToken,
) -> bool {
    let model = sources.models.borrow().clone();
    loop {
        // Never hold a channel's borrow across an await.
        let probes = sources.probes.borrow().clone();
        let Some(due) = pipeline.first_probes_due(&model, &probes, SystemTime::now()) else {
            return true;
        };
        let left = due.duration_since(SystemTime::now()).unwrap_or_default();
        tokio::select! {
            _ = shutdown.cancelled() => return false,
            _ = tokio::time::sleep(left) => return true,
            changed = sources.probes.changed() => if changed.is_err() { return false },
        }
    }
}

/// A build is followed by a pause this many times its length.
const PACE_FACTOR: u32 = 3;
/// The longest pause after a build.
const MAX_PACE: Duration = Duration::from_millis(500);

fn prober_wedged(sources: &Sources) -> bool {
    sources.prober.age() > crate::live::prober::WEDGED_AFTER
}

/// Logs and counts what one build decided; keeps `ray_xds_switchover_weight` to the
/// clusters that exist (`exported` remembers which series it set).
fn record(out: &Output, metrics: &Metrics, exported: &mut BTreeSet<WeightLabels>) {
    for event in &out.events {
        match event {
            Event::Switch(e) => {
                tracing::info!(rayservice = e.service, phase = %e.phase, weights = ?e.weights, "switchover: {}", e.reason);
                metrics
                    .switchover_transitions
                    .get_or_create(&StateLabels {
                        state: e.phase.as_str(),
                    })
                    .inc();
            }
            Event::FailOpenStarted(cluster) => {
                tracing::warn!(cluster, "every proxy of the cluster fails its probe: publishing them healthy (fail-open); Envoy's outlier detection decides");
                metrics.fail_open_events.inc();
            }
            Event::FailOpenEnded(cluster) => tracing::info!(cluster, "fail-open ended"),
            Event::Inconsistent(why) => {
                tracing::error!(error = %why, "translation gave an inconsistent snapshot; keeping the previous one");
                metrics.inconsistent_snapshots.inc();
            }
        }
    }
    metrics
        .fail_open_clusters
        .set(out.health.fail_open().len() as i64);
    let mut now = BTreeSet::new();
    // RayServices only: an application's own switch is short-lived and may be one of a
    // thousand (its events are logged).
    let services = || {
        out.switchover
            .services
            .iter()
            .filter(|(k, _)| !k.contains('#'))
    };
    for phase in Phase::ALL {
        // Every phase's transitions at 0 from the first build: a series born at its
        // first event shows no increase() in Prometheus (an alert on the first rollback
        // would never fire).
        let _ = metrics.switchover_transitions.get_or_create(&StateLabels {
            state: phase.as_str(),
        });
        let count = services().filter(|(_, s)| s.phase == phase).count();
        metrics
            .switchovers
            .get_or_create(&StateLabels {
                state: phase.as_str(),
            })
            .set(count as i64);
    }
    for control in ["hold", "promote", "abort"] {
        let count = services()
            .filter(|(_, s)| s.control.as_deref() == Some(control))
            .count();
        metrics
            .switchover_controls
            .get_or_create(&StateLabels { state: control })
            .set(count as i64);
    }
    for (service, switch) in services() {
        for (cluster, weight) in &switch.weights {
            let labels = WeightLabels {
                rayservice: service.clone(),
                cluster: cluster.clone(),
            };
            metrics
                .switchover_weight
                .get_or_create(&labels)
                .set(*weight as i64);
            now.insert(labels);
        }
    }
    for gone in exported.difference(&now) {
        metrics.switchover_weight.remove(gone);
    }
    *exported = now;
}

/// Waits, at most `bound`, until each of `addresses` has had its first probe.
pub(crate) async fn first_probes(
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

/// The longest the first snapshot waits for the last of a fresh start's `dashboards`
/// to answer once: reads take turns ([`MAX_READS_AT_ONCE`] at a time, each bounded by
/// `timeout`), so the last turn may come after `dashboards / MAX_READS_AT_ONCE` rounds of
/// dashboards that hang; half a second more for the parse, and never over
/// [`MAX_FIRST_ANSWER_WAIT`].
fn first_answer_wait(timeout: Duration, dashboards: usize) -> Duration {
    let rounds = dashboards.div_ceil(MAX_READS_AT_ONCE).max(1);
    let rounds = u32::try_from(rounds).unwrap_or(u32::MAX);
    timeout
        .saturating_mul(rounds)
        .saturating_add(Duration::from_millis(500))
        .min(MAX_FIRST_ANSWER_WAIT)
}

/// The first snapshot waits no longer than this for dashboards, however many hang.
const MAX_FIRST_ANSWER_WAIT: Duration = Duration::from_secs(15);

/// Waits, at most [`first_answer_wait`], until the dashboard of every cluster that has
/// one has answered (or failed) once, and for clusters that discover their proxies, until
/// the effective model holds what it said.
async fn first_discovery(
    sources: &Sources,
    timeout: Duration,
    addresses: &crate::model::AddressPolicy,
) {
    let model = sources.source.borrow().clone();
    let with_dashboard = |discovering_only: bool| -> BTreeSet<String> {
        model
            .services()
            .iter()
            .flat_map(|s| {
                s.clusters
                    .iter()
                    .filter(|c| c.dashboard.is_some() && (c.discover || !discovering_only))
                    .map(|c| s.envoy_cluster_name(&c.name))
            })
            .collect()
    };
    let (asked, discovering) = (with_dashboard(false), with_dashboard(true));
    if asked.is_empty() {
        return;
    }
    let bound = first_answer_wait(timeout, asked.len());
    let (mut dashboards, mut effective) = (sources.dashboards.clone(), sources.models.clone());
    let answered = async {
        let polled = dashboards.wait_for(|d| {
            asked.iter().all(|c| {
                d.clusters
                    .get(c)
                    .is_some_and(|d| d.status.is_some() || d.last_error.is_some())
            })
        });
        if polled.await.is_err() || discovering.is_empty() {
            return;
        }
        // Another task derives the effective model from the dashboards: wait until it
        // has caught up with them. (Each borrow is released at once: the other tasks
        // never hold one channel while writing another, so this cannot deadlock.)
        let _ = effective
            .wait_for(|m| {
                let (s, d) = (
                    sources.source.borrow().clone(),
                    sources.dashboards.borrow().clone(),
                );
                **m == discover(&s, &d, addresses).model
            })
            .await;
    };
    if tokio::time::timeout(bound, answered).await.is_err() {
        if discovering.is_empty() {
            tracing::warn!("a dashboard has not answered yet; starting without what it says (a switch's capacity holds its share where it is)");
        } else {
            tracing::warn!(clusters = ?discovering, "a dashboard to discover proxies from has not answered yet; starting without its proxies");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GatewaySettings;
    use crate::live::probe::ProxyProbe;
    use crate::model::test_support::service;
    use crate::policy::Policies;

    #[test]
    fn the_first_answer_wait_covers_every_turn_of_dashboards_that_hang() {
        let second = Duration::from_secs(1);
        let half = Duration::from_millis(500);
        assert_eq!(first_answer_wait(second, 1), second + half);
        assert_eq!(first_answer_wait(second, MAX_READS_AT_ONCE), second + half);
        assert_eq!(
            first_answer_wait(second, MAX_READS_AT_ONCE + 1),
            2 * second + half
        );
        assert_eq!(first_answer_wait(second, 10_000), MAX_FIRST_ANSWER_WAIT);
        assert_eq!(first_answer_wait(Duration::MAX, 3), MAX_FIRST_ANSWER_WAIT);
    }

    #[test]
    fn weight_series_are_kept_only_for_clusters_that_exist() {
        let mut p = Pipeline::new(Policies::default(), GatewaySettings::default());
        let mut probes = ProbeStates::default();
        for port in [8000, 9000] {
            let mut probe = ProxyProbe::new(SystemTime::UNIX_EPOCH);
            probe.state = ProbeState::Healthy;
            probes
                .proxies
                .insert(SocketAddr::from(([127, 0, 0, 1], port)), probe);
        }
        let dashboards = DashboardStates::default();
        let metrics = Metrics::new();
        let mut exported = BTreeSet::new();
        let mut step = |model: Model, secs: u64| {
            let model = Arc::new(model);
            let out = p.build(
                &Inputs {
                    model: &model,
                    probes: &probes,
                    dashboards: &dashboards,
                    envoys: &(),
                },
                SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
            );
            record(&out, &metrics, &mut exported);
            metrics.render()
        };
        let mut s = service("s", "a1", &[8000]);
        s.clusters
            .push(service("s", "b1", &[9000]).clusters.remove(0));
        s.pending_cluster = Some("b1".into());
        let text = step(Model::new(vec![s.clone()]).unwrap(), 0);
        assert!(
            text.contains(r#"ray_xds_switchover_weight{rayservice="default/s",cluster="b1"} 100"#),
            "{text}"
        );
        assert!(
            !text.contains(r#"cluster="a1""#),
            "a1 has no traffic left: {text}"
        );
        // Every upgrade brings new cluster names; the old ones' series go with them.
        let mut c = service("s", "c1", &[9000]);
        c.clusters
            .push(service("s", "b1", &[8000]).clusters.remove(0));
        c.active_cluster = "b1".into();
        c.pending_cluster = Some("c1".into());
        let text = step(Model::new(vec![c]).unwrap(), 1);
        assert!(text.contains(r#"cluster="c1"} 100"#), "{text}");
        assert!(!text.contains(r#"cluster="b1""#), "{text}");
        let text = step(Model::default(), 2);
        assert!(!text.contains("ray_xds_switchover_weight{"), "{text}");
    }
}

#[cfg(test)]
mod freshness_tests {
    use super::*;
    use crate::config::GatewaySettings;
    use crate::live::health::EndpointHealth;
    use crate::live::probe::ProxyProbe;
    use crate::live::prober::Heartbeat;
    use crate::model::test_support::service;
    use crate::policy::Policies;

    /// A prober that stops beating (wedged) is not served as fresh health: its
    /// last results become unknown (published, so nothing healthy is removed, and no
    /// longer "healthy" on ray-xds's word), and health comes back once it beats again.
    #[tokio::test(start_paused = true)]
    async fn a_wedged_prober_leaves_every_endpoint_unknown_until_it_beats_again() {
        let model = Arc::new(Model::new(vec![service("a", "a1", &[8000])]).unwrap());
        let address = SocketAddr::from(([127, 0, 0, 1], 8000));
        let mut probes = ProbeStates::default();
        let mut probe = ProxyProbe::new(SystemTime::now());
        probe.state = ProbeState::Healthy;
        probes.proxies.insert(address, probe);
        probes.complete = true;
        let (_m, models) = watch::channel(model.clone());
        let (_p, probes_rx) = watch::channel(Arc::new(probes));
        let (_d, dashboards) = watch::channel(Arc::new(DashboardStates::default()));
        let heartbeat = Arc::new(Heartbeat::default());
        heartbeat.beat();
        let sources = Sources {
            source: models.clone(),
            models,
            probes: probes_rx,
            dashboards,
            prober: heartbeat.clone(),
            peers: watch::channel(Arc::new(PeerStates {
                polled: true,
                ..Default::default()
            }))
            .1,
            loads: LoadReports::new(Duration::from_secs(2)),
        };
        let (snapshots, _s) = watch::channel(Arc::new(Snapshot::default()));
        let (published, _pb) = watch::channel(None);
        let (health, mut health_rx) = watch::channel(Arc::new(HealthMap::default()));
        let (switchover, _sw) = watch::channel(Arc::new(Switchover::default()));
        let (refresh, _r) = mpsc::unbounded_channel();
        let sinks = Sinks {
            snapshots,
            published,
            health,
            switchover,
            refresh,
        };
        let first = FirstBuild {
            dashboard_timeout: Duration::from_secs(1),
            probes: Duration::from_secs(1),
            addresses: Default::default(),
            peers: Duration::from_secs(1),
        };
        let token = CancellationToken::new();
        tokio::spawn(run(
            Pipeline::new(Policies::default(), GatewaySettings::default()),
            sources,
            sinks,
            Arc::new(Clients::default()),
            Arc::new(Metrics::new()),
            first,
            token.clone(),
        ));
        let cluster = "default/a/a1";
        async fn health_is(
            rx: &mut watch::Receiver<Arc<HealthMap>>,
            cluster: &str,
            address: SocketAddr,
            want: EndpointHealth,
        ) {
            rx.wait_for(|h| h.health(cluster, address) == want)
                .await
                .unwrap();
        }
        health_is(&mut health_rx, cluster, address, EndpointHealth::Healthy).await;
        // Beating: still healthy well past the bound.
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            heartbeat.beat();
        }
        assert_eq!(
            health_rx.borrow().health(cluster, address),
            EndpointHealth::Healthy
        );
        // Silent: unknown after the bound.
        tokio::time::sleep(crate::live::prober::WEDGED_AFTER + Duration::from_secs(2)).await;
        assert_eq!(
            health_rx.borrow().health(cluster, address),
            EndpointHealth::Unknown
        );
        heartbeat.beat();
        health_is(&mut health_rx, cluster, address, EndpointHealth::Healthy).await;
        token.cancel();
    }
}

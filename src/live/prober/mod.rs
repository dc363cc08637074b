//! The proxy prober: probes every Ray Serve proxy the model names, directly, and
//! publishes their probe states: each HTTP proxy with `GET /-/healthz`, each gRPC proxy
//! (a proxy's second endpoint, when it serves gRPC) with Ray's
//! `ray.serve.RayServeAPIService/Healthz` over one HTTP/2 connection of its own; both
//! keyed by address, with the same hysteresis, permits and freshness. An ingress replica
//! (Ray's direct ingress) is probed the same way on its HTTP and gRPC ports, its routes
//! never read (it serves one application).
//!
//! One task per proxy sleeps its (jittered) interval, takes a permit from
//! [`ProbePermits`] (thousands of proxies share a bounded number of probes in flight;
//! first probes and the probes that confirm a failure have permits of their own), and
//! sends `GET /-/healthz` through one pooled HTTP client (connections are reused).
//!
//! Confirming a failure quickly: while the proxy is healthy as far as its task
//! knows, a probe that has not answered after [`ProbePolicy::hedge_after`] (a third of the
//! timeout) is joined by a second, hedged probe over a connection of its own (the first
//! still holds the pooled one). Hedged probes have a small pool of permits of their own
//! (a sixteenth of `max_concurrent`), taken only if one is free at once: slow proxies of
//! one RayService never take the permits of another's probes, and when the pool is used
//! up a round goes without a hedge, as below. gRPC proxies are not hedged: both calls
//! would share the proxy's one HTTP/2 connection, and a reset of it would count as two
//! failures. Each outcome is reported as soon as it is known, failures
//! in the order they come, so a hung proxy's two failures (the default
//! `unhealthy_threshold`) arrive `hedge_after + timeout` after the first probe started.
//! The first answer that is not a failure ends the round and drops the other probe: a
//! slow but live proxy is marked down only if both probes go over the timeout, and pays a
//! hedged probe (and a new connection) every round it answers later than the hedge delay.
//! No hedge is sent when one failure alone reaches the threshold. A failure that comes
//! before the hedge delay (a fast error), or with no hedge, is confirmed instead by a
//! quick re-probe, after a fifth of the interval, repeated until the threshold is reached.
//! The price: a proxy (or the path to it) that stalls for about `hedge_after + timeout`
//! (400 ms with the defaults) fails both probes of one round and is marked down.
//!
//! Each outcome goes to the manager, the single writer of the [`ProbeStates`] channel, which
//! feeds each proxy's [`ProxyProbe`] and publishes only when a state (or a proxy's route
//! list) changes. The published states are a persistent map in which a proxy's entry is
//! written only when its health or routes change (the run of like outcomes that decides
//! when is the manager's own [`Streak`]): a publication is not a copy, and two
//! publications share every entry that did not change, so a reader finds what changed
//! by a diff that skips what they share (`live::health::Assessor`). A proxy's
//! `/-/routes` is read when it answers healthy after not doing so, and every
//! `routes_interval` while healthy, at most [`ROUTE_READS_AT_ONCE`] at a time over all
//! proxies, each body at most [`MAX_ROUTES_BODY_BYTES`]. At most [`MAX_ROUTES`]
//! route prefixes of at most [`MAX_ROUTE_PREFIX_BYTES`] each are kept per proxy; an
//! answer over either is read
//! as a malformed one (routes unknown), which never touches the probe state. A read that
//! gets no whole answer in time (a busy proxy) says nothing of the routes: the last table
//! stays.
//!
//! Freshness: a proxy whose last probe result is older than [`stale_after`] (a probe task
//! that died or is starved) goes back to `unknown`, so a result nobody renews is never
//! served as today's health; a probe task that ended is started again (and counted). The
//! manager beats a [`Heartbeat`] every second; the pipeline treats every probe result as
//! unknown while it stops (a wedged prober). A restarted prober starts from what the last
//! one published, so a restart changes nothing Envoy sees.

//!
//! The parts: this module runs the probe tasks and publishes what they report; `task`
//! is one endpoint's probe loop (its permits and hedged rounds); `probes` are the probes
//! themselves (HTTP `/-/healthz`, gRPC `Healthz`, `/-/routes`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::probe::{Outcome, ProbeState, ProxyProbe, Streak};
use super::route_tables::RouteTables;
use super::route_turns::{RouteTurn, RouteTurns};
use crate::metrics::Metrics;
use crate::model::{Model, Protocol};
use crate::policy::probe::ProbePolicy;

/// The probe state of every proxy, published by the prober.
#[derive(Clone, Debug, Default)]
pub struct ProbeStates {
    /// Persistent (shared between publications): publishing one is not a copy.
    pub proxies: imbl::OrdMap<SocketAddr, ProxyProbe>,
    /// Every proxy has been probed at least once.
    pub complete: bool,
}

pub(super) type HttpClient = Client<HttpConnector, Empty<Bytes>>;

pub(super) struct Report {
    pub(super) address: SocketAddr,
    pub(super) outcome: Outcome,
    pub(super) latency: Duration,
    /// `Some` when this probe also read `/-/routes` (`Some(None)`: the read failed).
    pub(super) routes: Option<Option<BTreeSet<String>>>,
    /// The route read's turn, held with the table until the manager has kept or refused
    /// it, so that tables waiting in the report queue count against
    /// [`ROUTE_READS_AT_ONCE`] too.
    pub(super) route_read_turn: Option<RouteTurn>,
}

impl ProbeStates {
    /// These states with every proxy's probe `unknown` for `reason` (routes kept).
    pub(crate) fn all_unknown(&self, reason: &str, now: SystemTime) -> ProbeStates {
        let reason: Arc<str> = reason.into();
        let proxies = self
            .proxies
            .iter()
            .map(|(address, probe)| {
                let mut probe = probe.clone();
                if probe.state != ProbeState::Unknown {
                    probe.state = ProbeState::Unknown;
                    probe.since = now;
                }
                probe.reason = reason.clone();
                (*address, probe)
            })
            .collect();
        ProbeStates {
            complete: self.proxies.is_empty(),
            proxies,
        }
    }
}

/// How long a proxy's last probe result counts as fresh: three intervals and two
/// timeouts, plus the time `probes` probes take to get a permit each when every one of
/// them times out (`max_concurrent` at a time), at least 5 s.
pub(crate) fn stale_after(
    settings: &ProbePolicy,
    probes: usize,
    max_concurrent: usize,
) -> Duration {
    let rounds = probes.div_ceil(max_concurrent.max(1)) as u32;
    (settings.interval * 3 + settings.timeout * 2 + settings.timeout * 2 * rounds)
        .max(Duration::from_secs(5))
}

/// The most probe reports folded into one publication.
pub(super) const MAX_REPORTS_PER_PUBLICATION: usize = 4096;

/// The prober's manager beats its [`Heartbeat`] every second: this long without a beat,
/// it is wedged, and the pipeline serves no probe result as fresh.
pub(crate) const WEDGED_AFTER: Duration = Duration::from_secs(10);

/// When the prober's manager last ran (it beats every second while alive).
#[derive(Debug)]
pub struct Heartbeat {
    /// tokio's clock, so that tests can pause and advance it.
    epoch: tokio::time::Instant,
    last_ms: std::sync::atomic::AtomicU64,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat {
            epoch: tokio::time::Instant::now(),
            last_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl Heartbeat {
    pub(crate) fn beat(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// How long since the last beat (since creation before the first).
    pub(crate) fn age(&self) -> Duration {
        let last = self.last_ms.load(std::sync::atomic::Ordering::Relaxed);
        self.epoch
            .elapsed()
            .saturating_sub(Duration::from_millis(last))
    }
}

#[derive(Clone)]
pub struct Prober {
    /// The global probe policy; each RayService overrides parts of it.
    pub policy: ProbePolicy,
    /// What all route tables may hold (`route_tables::MEMORY_BUDGET_BYTES` outside
    /// tests).
    pub routes_budget: usize,
    pub metrics: Arc<Metrics>,
    /// Beaten every second by the running manager.
    pub heartbeat: Arc<Heartbeat>,
}

/// The running prober's state: a probe task per target, every proxy's state (published on
/// the states channel), when each last reported, and the route tables kept.
struct Probing {
    client: HttpClient,
    permits: ProbePermits,
    reports: mpsc::Sender<Report>,
    tasks: BTreeMap<SocketAddr, (Target, JoinHandle<()>)>,
    current: ProbeStates,
    /// Each proxy's run of like outcomes (not published: see [`Streak`]).
    streaks: BTreeMap<SocketAddr, Streak>,
    fresh: BTreeMap<SocketAddr, Instant>,
    routes: Routes,
}

impl Prober {
    /// Probes until `shutdown`, following the proxies in `models`.
    pub async fn run(
        self,
        mut models: watch::Receiver<Arc<Model>>,
        states: watch::Sender<Arc<ProbeStates>>,
        shutdown: CancellationToken,
    ) {
        let (tx, mut rx) = mpsc::channel::<Report>(1024);
        let mut p = self.resume(&states.borrow(), &models.borrow(), tx);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut models_changed = true;
        loop {
            if models_changed {
                let model = models.borrow_and_update().clone();
                if self.follow(&mut p, &model) {
                    states.send_replace(Arc::new(p.current.clone()));
                }
                models_changed = false;
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                changed = models.changed() => {
                    if changed.is_err() { break; }
                    models_changed = true;
                }
                _ = tick.tick() => {
                    self.heartbeat.beat();
                    self.restart_ended(&mut p.tasks, &p.client, &p.permits, &p.reports);
                    self.collect_replaced_routes(&mut p);
                    if self.expire(&mut p.current, &mut p.streaks, &p.tasks, &p.fresh) {
                        self.update_complete(&mut p.current);
                        states.send_replace(Arc::new(p.current.clone()));
                    }
                }
                Some(report) = rx.recv() => {
                    let started = std::time::Instant::now();
                    let cpu_before = crate::metrics::thread_cpu_time();
                    if self.apply_waiting(&mut p, report, &mut rx) {
                        states.send_replace(Arc::new(p.current.clone()));
                        let cpu = crate::metrics::thread_cpu_time().saturating_sub(cpu_before);
                        tracing::debug!(
                            took_ms = started.elapsed().as_secs_f64() * 1e3,
                            cpu_ms = cpu.as_secs_f64() * 1e3,
                            "probe states published"
                        );
                    }
                }
            }
        }
        for (_, (_, task)) in p.tasks {
            task.abort();
        }
    }

    /// Where a (re)started prober begins: from what the last one published, each result
    /// fresh from now, and the route tables its states refer to kept (and counted) again.
    /// Each proxy's run of like outcomes starts anew (it is not published): after a
    /// restart, a change of health can take up to its threshold less one more probes.
    fn resume(&self, last: &ProbeStates, model: &Model, reports: mpsc::Sender<Report>) -> Probing {
        let mut current = last.clone();
        let fresh = current
            .proxies
            .keys()
            .map(|a| (*a, Instant::now()))
            .collect();
        let mut routes = Routes {
            tables: RouteTables::new(self.routes_budget),
            owners: owners(model),
            warned: BTreeMap::new(),
            replaced: false,
        };
        current.proxies = current
            .proxies
            .iter()
            .map(|(address, probe)| {
                let mut probe = probe.clone();
                let owner = routes.owners.get(address);
                probe.routes = match (probe.routes.take(), owner) {
                    (Some(table), Some(cluster)) => routes
                        .tables
                        .intern(cluster, (*table).clone())
                        .ok()
                        .map(|(shared, _)| shared),
                    _ => None,
                };
                (*address, probe)
            })
            .collect();
        Probing {
            client: probe_client(self.policy.timeout),
            permits: ProbePermits::new(self.policy.max_concurrent),
            reports,
            tasks: BTreeMap::new(),
            current,
            streaks: BTreeMap::new(),
            fresh,
            routes,
        }
    }

    /// Probes exactly the targets `model` gives: a task for each new one, none for one
    /// that went or changed; true when the published states changed.
    fn follow(&self, p: &mut Probing, model: &Model) -> bool {
        let wanted = targets(model, &self.policy);
        p.routes.owners = owners(model);
        p.permits.route_reads.set_owners(&p.routes.owners);
        p.tasks.retain(|addr, (target, task)| {
            let keep = wanted.get(addr) == Some(target);
            if !keep {
                task.abort();
            }
            keep
        });
        for (addr, target) in &wanted {
            if !p.tasks.contains_key(addr) {
                let task = self.probe_task(*addr, target, &p.client, &p.permits, &p.reports);
                p.tasks
                    .insert(*addr, (target.clone(), tokio::spawn(task.run())));
            }
        }
        let gone: Vec<SocketAddr> = p
            .current
            .proxies
            .keys()
            .filter(|addr| !wanted.contains_key(addr))
            .copied()
            .collect();
        for addr in &gone {
            p.current.proxies.remove(addr);
        }
        p.fresh.retain(|addr, _| wanted.contains_key(addr));
        p.streaks.retain(|addr, _| wanted.contains_key(addr));
        let now = SystemTime::now();
        let mut came = false;
        for addr in wanted.keys() {
            if !p.current.proxies.contains_key(addr) {
                p.current.proxies.insert(*addr, ProxyProbe::new(now));
                came = true;
            }
            p.fresh.entry(*addr).or_insert_with(Instant::now);
        }
        p.routes.collect();
        self.metrics
            .set_held_bytes("routes", p.routes.tables.total_bytes());
        // Both, always: a proxy that came is unknown, so the states are not complete.
        let complete_changed = self.update_complete(&mut p.current);
        came || !gone.is_empty() || complete_changed
    }

    /// Applies `first` and the reports already waiting before one publication: once every
    /// proxy has a result, up to the first that changes a proxy's health (published at
    /// once: a publication shares the persistent map, it copies nothing); while first
    /// results come in, every one waiting, so that a burst (thousands of first probes) is
    /// published a few times, not once per proxy (each publication checks every proxy
    /// for completeness). A change of routes alone does not end the batch: a new
    /// application changes every proxy's table within a routes interval. True when
    /// something worth publishing changed.
    fn apply_waiting(
        &self,
        p: &mut Probing,
        first: Report,
        waiting: &mut mpsc::Receiver<Report>,
    ) -> bool {
        let mut changed = Applied::default();
        let mut next = Some(first);
        let mut taken = 0;
        while let Some(report) = next.take() {
            p.fresh.insert(report.address, Instant::now());
            let applied = self.apply(
                &mut p.current,
                &mut p.streaks,
                &p.tasks,
                &mut p.routes,
                report,
            );
            changed |= applied;
            taken += 1;
            if taken < MAX_REPORTS_PER_PUBLICATION && !(changed.health && p.current.complete) {
                next = waiting.try_recv().ok();
            }
        }
        if changed.any() {
            // A report never makes a proxy unknown: once complete, still complete (a
            // proxy that came since is `follow`'s to count).
            if !p.current.complete {
                self.update_complete(&mut p.current);
            }
        }
        changed.any()
    }

    /// Forgets the route tables no proxy holds any more, if a proxy's table was replaced
    /// since the last time (only a new table can leave an old one unused; a proxy that
    /// went is `follow`'s to collect). A walk of every proxy: at most once a second,
    /// not with every publication.
    fn collect_replaced_routes(&self, p: &mut Probing) {
        if std::mem::take(&mut p.routes.replaced) {
            p.routes.collect();
            self.metrics
                .set_held_bytes("routes", p.routes.tables.total_bytes());
        }
    }

    /// The probe task of one target.
    fn probe_task(
        &self,
        address: SocketAddr,
        target: &Target,
        client: &HttpClient,
        permits: &ProbePermits,
        reports: &mpsc::Sender<Report>,
    ) -> ProbeTask {
        ProbeTask {
            address,
            settings: target.settings.clone(),
            protocol: target.protocol,
            read_routes: target.read_routes,
            routes_interval: self.policy.routes_interval,
            client: client.clone(),
            permits: permits.clone(),
            reports: reports.clone(),
        }
    }

    /// Starts again every probe task that ended (they only end on a panic): counted as
    /// restarts of the component `probe_task`.
    fn restart_ended(
        &self,
        tasks: &mut BTreeMap<SocketAddr, (Target, JoinHandle<()>)>,
        client: &HttpClient,
        permits: &ProbePermits,
        reports: &mpsc::Sender<Report>,
    ) {
        for (addr, (target, task)) in tasks.iter_mut() {
            if task.is_finished() {
                tracing::error!(proxy = %addr, "a probe task ended; starting it again");
                self.metrics
                    .component_restarts
                    .get_or_create(&crate::metrics::ComponentLabels {
                        component: "probe_task",
                    })
                    .inc();
                *task = tokio::spawn(
                    self.probe_task(*addr, target, client, permits, reports)
                        .run(),
                );
            }
        }
    }

    /// Puts back to `unknown` every proxy whose last result is older than its
    /// [`stale_after`]; true when one changed.
    fn expire(
        &self,
        current: &mut ProbeStates,
        streaks: &mut BTreeMap<SocketAddr, Streak>,
        tasks: &BTreeMap<SocketAddr, (Target, JoinHandle<()>)>,
        fresh: &BTreeMap<SocketAddr, Instant>,
    ) -> bool {
        let mut changed = false;
        let n = tasks.len();
        let mut stale = Vec::new();
        for (addr, probe) in current.proxies.iter() {
            let (Some((Target { settings, .. }, _)), Some(at)) = (tasks.get(addr), fresh.get(addr))
            else {
                continue;
            };
            let age = at.elapsed();
            if probe.state != ProbeState::Unknown
                && age > stale_after(settings, n, self.policy.max_concurrent)
            {
                stale.push((*addr, age));
            }
        }
        for (addr, age) in stale {
            if let Some(probe) = current.proxies.get_mut(&addr) {
                tracing::warn!(proxy = %addr, age = ?age, "no probe result for too long: its health is unknown again");
                probe.state = ProbeState::Unknown;
                probe.since = SystemTime::now();
                probe.reason = format!("stale: no probe result for {}s", age.as_secs()).into();
                streaks.remove(&addr);
                changed = true;
            }
        }
        changed
    }

    fn update_complete(&self, current: &mut ProbeStates) -> bool {
        let complete = current
            .proxies
            .values()
            .all(|p| p.state != ProbeState::Unknown);
        std::mem::replace(&mut current.complete, complete) != complete
    }

    /// Applies one report: what it changed of the published states.
    fn apply(
        &self,
        current: &mut ProbeStates,
        streaks: &mut BTreeMap<SocketAddr, Streak>,
        tasks: &BTreeMap<SocketAddr, (Target, JoinHandle<()>)>,
        routes: &mut Routes,
        report: Report,
    ) -> Applied {
        let mut changed = Applied::default();
        if !current.proxies.contains_key(&report.address) || !tasks.contains_key(&report.address) {
            return changed; // a proxy removed since
        }
        let table = report
            .routes
            .map(|read| read.and_then(|t| self.keep_routes(current, routes, report.address, t)));
        // The table is kept or refused: its read turn goes back.
        drop(report.route_read_turn);
        let (Some(probe), Some((Target { settings, .. }, _))) = (
            current.proxies.get(&report.address),
            tasks.get(&report.address),
        ) else {
            return changed;
        };
        self.metrics
            .probe_seconds
            .observe(report.latency.as_secs_f64());
        // The published state is written only when it changes, so that a publication
        // shares every proxy's that did not.
        let table = table.filter(|t| probe.routes != *t);
        let next = streaks.entry(report.address).or_default().observe(
            probe.state,
            &report.outcome,
            settings,
        );
        if table.is_none() && next.is_none() {
            return changed;
        }
        let probe = current
            .proxies
            .get_mut(&report.address)
            .expect("looked up above");
        if let Some(table) = table {
            probe.routes = table;
            routes.replaced = true;
            changed.routes = true;
        }
        if let Some(t) = next.map(|next| probe.enter(next, SystemTime::now())) {
            self.metrics
                .health_transitions
                .get_or_create(&crate::metrics::StateLabels {
                    state: t.to.as_str(),
                })
                .inc();
            if t.to == ProbeState::Healthy {
                tracing::info!(proxy = %report.address, from = t.from.as_str(), reason = %t.reason, "proxy is healthy");
            } else {
                tracing::warn!(proxy = %report.address, from = t.from.as_str(), to = t.to.as_str(), reason = %t.reason, "proxy health changed");
            }
            changed.health = true;
        }
        changed
    }

    /// The shared table for `address`'s routes, if its cluster's share of the routes'
    /// budget admits it (else its routes are unknown: `None`). Clusters evicted to make
    /// room lose their proxies' tables here.
    fn keep_routes(
        &self,
        current: &mut ProbeStates,
        routes: &mut Routes,
        address: SocketAddr,
        table: BTreeSet<String>,
    ) -> Option<Arc<BTreeSet<String>>> {
        let cluster = routes.owners.get(&address)?.clone();
        match routes.tables.intern(&cluster, table) {
            Ok((shared, evicted)) => {
                for hog in evicted {
                    self.metrics.routes_refused.inc();
                    if routes.warn_now(&hog) {
                        tracing::warn!(cluster = hog, "route tables dropped: over their cluster's fair share of the memory budget; its proxies' routes are unknown (logged once a minute per cluster; ray_xds_probe_routes_refused_total counts each)");
                    }
                    let owned: Vec<SocketAddr> = current
                        .proxies
                        .keys()
                        .filter(|a| routes.owners.get(a) == Some(&hog))
                        .copied()
                        .collect();
                    for a in owned {
                        if let Some(probe) = current.proxies.get_mut(&a) {
                            probe.routes = None;
                        }
                    }
                    routes.replaced = true;
                }
                Some(shared)
            }
            Err(over) => {
                self.metrics.routes_refused.inc();
                if routes.warn_now(&cluster) {
                    tracing::warn!(cluster, proxy = %address, why = %over, "route table refused; the proxy's routes are unknown (logged once a minute per cluster; ray_xds_probe_routes_refused_total counts each)");
                }
                None
            }
        }
    }
}

/// What one report changed of the published states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Applied {
    /// The proxy's health state.
    health: bool,
    /// The proxy's route table (and, to make room for it, maybe a hog cluster's).
    routes: bool,
}

impl Applied {
    fn any(self) -> bool {
        self.health || self.routes
    }
}

impl std::ops::BitOrAssign for Applied {
    fn bitor_assign(&mut self, other: Applied) {
        self.health |= other.health;
        self.routes |= other.routes;
    }
}

/// The route tables and who owns each proxy's.
struct Routes {
    tables: RouteTables,
    /// Proxy → its Envoy cluster name (the budget's owner).
    owners: BTreeMap<SocketAddr, String>,
    /// When each cluster's refusals were last logged (at most once a minute: a hog's
    /// tables come and go with the budget, and each refusal is counted anyway).
    warned: BTreeMap<String, Instant>,
    /// A proxy's table was replaced since the last [`Routes::collect`].
    replaced: bool,
}

impl Routes {
    fn collect(&mut self) {
        self.tables
            .collect(self.owners.values().map(String::as_str));
        let owners: BTreeSet<&String> = self.owners.values().collect();
        self.warned.retain(|c, _| owners.contains(c));
    }

    /// Whether a refusal for `cluster` is logged now (not within the last minute).
    fn warn_now(&mut self, cluster: &str) -> bool {
        let due = self
            .warned
            .get(cluster)
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(60));
        if due {
            self.warned.insert(cluster.to_string(), Instant::now());
        }
        due
    }
}

/// Every proxy of the model with its Envoy cluster's name (the first, when listed twice).
fn owners(model: &Model) -> BTreeMap<SocketAddr, String> {
    let mut out = BTreeMap::new();
    for service in model.services() {
        for cluster in &service.clusters {
            let name = service.envoy_cluster_name(&cluster.name);
            for proxy in &cluster.proxies {
                out.entry(proxy.address).or_insert_with(|| name.clone());
            }
        }
    }
    out
}

/// What one probe task probes: with which settings, over which protocol.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Target {
    pub(super) settings: ProbePolicy,
    pub(super) protocol: Protocol,
    /// An HTTP proxy's `/-/routes` is read too; an ingress replica serves one application.
    pub(super) read_routes: bool,
}

/// Every endpoint of the model (each proxy's HTTP address, and its gRPC address when it
/// serves gRPC; each ingress replica's HTTP and gRPC ports) with the probe settings of its
/// RayService.
fn targets(model: &Model, defaults: &ProbePolicy) -> BTreeMap<SocketAddr, Target> {
    let mut out = BTreeMap::new();
    for service in model.services() {
        let settings = defaults.with(&service.policy.overrides.probe);
        for cluster in &service.clusters {
            for protocol in [Protocol::Http, Protocol::Grpc] {
                for (address, _) in cluster.endpoints(protocol) {
                    out.entry(address).or_insert_with(|| Target {
                        settings: settings.clone(),
                        protocol,
                        read_routes: protocol == Protocol::Http,
                    });
                }
            }
            for (address, protocol) in cluster.replica_endpoints() {
                out.entry(address).or_insert_with(|| Target {
                    settings: settings.clone(),
                    protocol,
                    read_routes: false,
                });
            }
        }
    }
    out
}

mod probes;
mod task;

pub use probes::*;
use task::{ProbePermits, ProbeTask};

#[cfg(test)]
mod tests {
    /// Routine probes leave an eighth of the permits to urgent ones (first probes and
    /// quick re-probes), which also take a routine permit when one is free.
    #[tokio::test]
    async fn urgent_probes_do_not_wait_behind_routine_ones() {
        let permits = ProbePermits::new(8);
        let mut held = Vec::new();
        for _ in 0..7 {
            held.push(permits.acquire(false).await.unwrap());
        }
        let routine = tokio::time::timeout(Duration::from_millis(50), permits.acquire(false));
        assert!(
            routine.await.is_err(),
            "routine probes are bounded at 7 of 8"
        );
        let urgent = permits.acquire(true).await.unwrap();
        let second = tokio::time::timeout(Duration::from_millis(50), permits.acquire(true));
        assert!(second.await.is_err(), "8 in flight in all");
        drop(held.pop());
        assert!(
            permits.acquire(true).await.is_some(),
            "an urgent probe takes a routine permit"
        );
        drop(urgent);
        // One permit in all: urgent and routine probes share it.
        let one = ProbePermits::new(1);
        let p = one.acquire(true).await.unwrap();
        drop(p);
        assert!(one.acquire(false).await.is_some());
    }

    use super::*;

    fn prober() -> Prober {
        Prober {
            policy: ProbePolicy::default(),
            routes_budget: crate::live::route_tables::MEMORY_BUDGET_BYTES,
            metrics: Arc::new(Metrics::new()),
            heartbeat: Default::default(),
        }
    }

    #[test]
    fn staleness_bound_grows_with_the_queue_and_never_overflows() {
        let p = ProbePolicy::default();
        assert_eq!(stale_after(&p, 10, 256), Duration::from_secs(5));
        // 20,000 proxies through 256 permits: 79 rounds of two timeouts at worst.
        assert!(stale_after(&p, 20_000, 256) > Duration::from_secs(39));
        let slow = ProbePolicy {
            interval: Duration::from_secs(3600),
            timeout: Duration::from_secs(60),
            ..Default::default()
        };
        assert!(stale_after(&slow, 100_000, 1) > Duration::from_secs(3600));
    }

    /// A proxy whose probe results stop (its task dead or starved) is not
    /// served as healthy on an old result: it goes back to unknown. A fresh one stays.
    #[tokio::test]
    async fn a_result_nobody_renews_goes_back_to_unknown() {
        let p = prober();
        let (old, new) = (local(1), local(2));
        let (mut current, tasks) = healthy_pair(&p, old, new);
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(60))
            .expect("the machine has been up a minute");
        let fresh = BTreeMap::from([(old, long_ago), (new, Instant::now())]);
        assert!(p.expire(&mut current, &mut BTreeMap::new(), &tasks, &fresh));
        assert_eq!(current.proxies[&old].state, ProbeState::Unknown);
        assert!(current.proxies[&old].reason.starts_with("stale"));
        assert_eq!(current.proxies[&new].state, ProbeState::Healthy);
        // Nothing more to expire.
        assert!(!p.expire(&mut current, &mut BTreeMap::new(), &tasks, &fresh));
    }

    /// A probe task that ended (a panic) is started again and counted.
    #[tokio::test]
    async fn an_ended_probe_task_is_started_again() {
        let p = prober();
        let (tx, _rx) = mpsc::channel(8);
        let client = probe_client(Duration::from_millis(50));
        let permits = ProbePermits::new(1);
        let addr = SocketAddr::from(([127, 0, 0, 1], 9));
        let mut tasks = BTreeMap::from([(addr, (http_target(&p.policy), tokio::spawn(async {})))]);
        tokio::task::yield_now().await;
        while !tasks[&addr].1.is_finished() {
            tokio::task::yield_now().await;
        }
        p.restart_ended(&mut tasks, &client, &permits, &tx);
        assert!(!tasks[&addr].1.is_finished());
        assert!(p
            .metrics
            .render()
            .contains("ray_xds_component_restarts_total{component=\"probe_task\"} 1"));
        tasks[&addr].1.abort();
    }

    /// A `/-/routes` object keyed by `n` distinct prefixes of `len` bytes each.
    fn routes_body(n: usize, len: usize) -> Vec<u8> {
        let routes: serde_json::Map<String, serde_json::Value> = (0..n)
            .map(|i| {
                let prefix = format!("/{i:0>width$}", width = len - 1);
                (prefix, serde_json::json!(0))
            })
            .collect();
        serde_json::Value::Object(routes).to_string().into_bytes()
    }

    /// An answer over the route caps is read as a malformed one (routes
    /// unknown), and up to them every route is kept.
    #[test]
    fn routes_over_the_caps_are_unknown_like_malformed_ones() {
        assert_eq!(parse_routes(b"not json"), None);
        let at_caps = parse_routes(&routes_body(MAX_ROUTES, MAX_ROUTE_PREFIX_BYTES));
        assert_eq!(at_caps.map(|r| r.len()), Some(MAX_ROUTES));
        assert_eq!(parse_routes(&routes_body(MAX_ROUTES + 1, 8)), None);
        assert_eq!(
            parse_routes(&routes_body(1, MAX_ROUTE_PREFIX_BYTES + 1)),
            None
        );
        // As in the report: ~87,000 short keys (over the body cap too, when read).
        let huge = routes_body(87_000, 5);
        assert_eq!(parse_routes(&huge), None);
        // A key repeated counts once, as before.
        let mut repeated = routes_body(MAX_ROUTES, 8);
        repeated.pop();
        repeated.extend_from_slice(br#","/0000000":"again"}"#);
        assert_eq!(parse_routes(&repeated).map(|r| r.len()), Some(MAX_ROUTES));
    }

    /// An over-cap routes answer from a proxy that answers healthz leaves it healthy:
    /// only its routes become unknown, as for a malformed answer.
    #[tokio::test]
    async fn over_cap_routes_leave_a_healthy_proxy_healthy() {
        let p = prober();
        let addr = SocketAddr::from(([127, 0, 0, 1], 1));
        let mut probe = ProxyProbe::new(SystemTime::now());
        probe.state = ProbeState::Healthy;
        probe.routes = Some(std::sync::Arc::new(["/".to_string()].into()));
        let mut current = ProbeStates::default();
        let mut streaks = BTreeMap::new();
        current.proxies.insert(addr, probe);
        let tasks = BTreeMap::from([(addr, (http_target(&p.policy), tokio::spawn(async {})))]);
        let report = Report {
            address: addr,
            outcome: Outcome::Healthy,
            latency: Duration::ZERO,
            routes: Some(parse_routes(&routes_body(MAX_ROUTES + 1, 8))),
            route_read_turn: None,
        };
        let mut routes = routes_of([(addr, "c")], 1 << 20);
        assert!(p
            .apply(&mut current, &mut streaks, &tasks, &mut routes, report)
            .any());
        assert_eq!(current.proxies[&addr].state, ProbeState::Healthy);
        assert_eq!(current.proxies[&addr].routes, None);
    }

    /// A result that changes neither health nor routes writes nothing that is
    /// published: the states published before stay the very map (what the pipeline's
    /// diff of two publications relies on to find what changed without a walk). The
    /// result that changes health writes that proxy alone.
    #[tokio::test]
    async fn only_a_change_of_health_or_routes_touches_the_published_states() {
        let p = prober();
        let (a, b) = (local(1), local(2));
        let (mut current, tasks) = healthy_pair(&p, a, b);
        let mut streaks = BTreeMap::new();
        let mut routes = routes_of([(a, "c"), (b, "c")], 1 << 20);
        let published = current.clone();
        let steady = [
            Outcome::Healthy,
            Outcome::Failed("timeout".into()),
            Outcome::Healthy,
        ];
        for outcome in steady {
            assert!(!p
                .apply(
                    &mut current,
                    &mut streaks,
                    &tasks,
                    &mut routes,
                    report(a, outcome)
                )
                .any());
        }
        assert!(current.proxies.ptr_eq(&published.proxies));
        assert_eq!(p.policy.unhealthy_threshold, 2);
        for _ in 0..2 {
            p.apply(
                &mut current,
                &mut streaks,
                &tasks,
                &mut routes,
                report(a, Outcome::Failed("timeout".into())),
            );
        }
        let changed: Vec<SocketAddr> = published
            .proxies
            .diff(&current.proxies)
            .map(|d| match d {
                imbl::ordmap::DiffItem::Update { new: (k, _), .. } => *k,
                other => panic!("only an update: {other:?}"),
            })
            .collect();
        assert_eq!(changed, [a]);
        assert_eq!(current.proxies[&a].state, ProbeState::Unhealthy);
    }

    /// A proxy that came since every proxy had a result makes the states incomplete
    /// again, published with the proxy (a report never recounts while complete).
    #[tokio::test]
    async fn states_are_not_complete_while_a_proxy_added_since_is_unprobed() {
        let p = prober();
        let (a, b) = (local(1), local(2));
        let one = Model::new(vec![crate::model::test_support::service("s", "c", &[1])]).unwrap();
        let two = Model::new(vec![crate::model::test_support::service("s", "c", &[1, 2])]).unwrap();
        let (tx, _reports) = mpsc::channel(64);
        let (_w, mut waiting) = mpsc::channel(1);
        let mut probing = p.resume(&ProbeStates::default(), &one, tx);
        assert!(p.follow(&mut probing, &one));
        assert!(p.apply_waiting(&mut probing, report(a, Outcome::Healthy), &mut waiting));
        assert!(probing.current.complete);
        assert!(p.follow(&mut probing, &two));
        assert!(!probing.current.complete, "b has not been probed");
        assert!(p.apply_waiting(&mut probing, report(a, Outcome::Refused), &mut waiting));
        assert!(!probing.current.complete, "b has not been probed");
        assert!(p.apply_waiting(&mut probing, report(b, Outcome::Healthy), &mut waiting));
        assert!(probing.current.complete);
        for (_, (_, t)) in std::mem::take(&mut probing.tasks) {
            t.abort();
        }
    }

    /// A proxy replaced by another in one model change is published at once, though the
    /// number of proxies and the completeness (not yet complete) are the same.
    #[tokio::test]
    async fn a_proxy_replaced_by_another_is_published() {
        let p = prober();
        let (a, b, c) = (local(1), local(2), local(3));
        let before =
            Model::new(vec![crate::model::test_support::service("s", "c", &[1, 2])]).unwrap();
        let after =
            Model::new(vec![crate::model::test_support::service("s", "c", &[1, 3])]).unwrap();
        let (tx, _reports) = mpsc::channel(64);
        let (_w, mut waiting) = mpsc::channel(1);
        let mut probing = p.resume(&ProbeStates::default(), &before, tx);
        assert!(p.follow(&mut probing, &before));
        assert!(p.apply_waiting(&mut probing, report(a, Outcome::Healthy), &mut waiting));
        assert!(!probing.current.complete, "b has not been probed");
        assert!(!p.follow(&mut probing, &before), "nothing changed");
        assert!(p.follow(&mut probing, &after), "b went and c came");
        assert!(!probing.current.proxies.contains_key(&b));
        assert!(probing.current.proxies.contains_key(&c));
        assert!(!probing.current.complete, "c has not been probed");
        for (_, (_, t)) in std::mem::take(&mut probing.tasks) {
            t.abort();
        }
    }

    /// Once complete, a batch ends at the first change of health (published at once),
    /// not at a change of routes alone (a new application changes every proxy's table).
    #[tokio::test]
    async fn a_batch_ends_at_a_change_of_health_not_of_routes_alone() {
        let p = prober();
        let (a, b) = (
            SocketAddr::from(([127, 0, 0, 1], 1)),
            SocketAddr::from(([127, 0, 0, 1], 2)),
        );
        let model =
            Model::new(vec![crate::model::test_support::service("s", "c", &[1, 2])]).unwrap();
        let report = |address, outcome, routes: Option<&str>| Report {
            address,
            outcome,
            latency: Duration::ZERO,
            routes: routes.map(|r| Some([r.to_string()].into())),
            route_read_turn: None,
        };
        let (tx, _reports) = mpsc::channel(64);
        let (more, mut waiting) = mpsc::channel(8);
        let mut probing = p.resume(&ProbeStates::default(), &model, tx);
        p.follow(&mut probing, &model);
        for address in [a, b] {
            p.apply_waiting(
                &mut probing,
                report(address, Outcome::Healthy, None),
                &mut waiting,
            );
        }
        assert!(probing.current.complete);
        // Routes alone, then health, then more health: one batch takes the first two and
        // ends at the change of health; the third waits for the next batch.
        more.try_send(report(b, Outcome::Refused, None)).unwrap();
        more.try_send(report(a, Outcome::Refused, None)).unwrap();
        let first = report(a, Outcome::Healthy, Some("/x"));
        assert!(p.apply_waiting(&mut probing, first, &mut waiting));
        let routes = probing.current.proxies[&a].routes.clone();
        assert_eq!(routes.map(|r| r.len()), Some(1));
        assert_eq!(probing.current.proxies[&b].state, ProbeState::Unhealthy);
        assert_eq!(probing.current.proxies[&a].state, ProbeState::Healthy);
        let third = waiting.try_recv().expect("left for the next batch");
        assert!(p.apply_waiting(&mut probing, third, &mut waiting));
        assert_eq!(probing.current.proxies[&a].state, ProbeState::Unhealthy);
        for (_, (_, t)) in std::mem::take(&mut probing.tasks) {
            t.abort();
        }
    }

    fn local(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// Two proxies probed healthy, each with a (finished) task.
    fn healthy_pair(
        p: &Prober,
        a: SocketAddr,
        b: SocketAddr,
    ) -> (ProbeStates, BTreeMap<SocketAddr, (Target, JoinHandle<()>)>) {
        let mut current = ProbeStates::default();
        let mut tasks = BTreeMap::new();
        for addr in [a, b] {
            let mut probe = ProxyProbe::new(SystemTime::now());
            probe.state = ProbeState::Healthy;
            current.proxies.insert(addr, probe);
            tasks.insert(addr, (http_target(&p.policy), tokio::spawn(async {})));
        }
        (current, tasks)
    }

    /// A report of `outcome` from `address`, without a route read.
    fn report(address: SocketAddr, outcome: Outcome) -> Report {
        Report {
            address,
            outcome,
            latency: Duration::ZERO,
            routes: None,
            route_read_turn: None,
        }
    }

    fn routes_of<const N: usize>(owners: [(SocketAddr, &str); N], budget: usize) -> Routes {
        Routes {
            tables: RouteTables::new(budget),
            owners: owners.map(|(a, c)| (a, c.to_string())).into(),
            warned: BTreeMap::new(),
            replaced: false,
        }
    }

    /// Proxies of one cluster listing the same routes share one table, and one
    /// cluster's many distinct tables cannot take the routes' memory from another: the
    /// hog's tables are dropped (its proxies' routes unknown) when a cluster within its
    /// share needs room, and refused after.
    #[tokio::test]
    async fn route_tables_are_shared_and_one_cluster_cannot_crowd_out_another() {
        let p = prober();
        let addr = |port| SocketAddr::from(([127, 0, 0, 1], port));
        let (hog1, hog2, mine1, mine2) = (addr(1), addr(2), addr(3), addr(4));
        let big = |salt: &str| -> BTreeSet<String> {
            (0..100).map(|i| format!("/{salt}/{i:04}")).collect()
        };
        let small: BTreeSet<String> = ["/hello".to_string()].into();
        let bytes = crate::live::route_tables::table_bytes;
        // Room for the hog's two big tables, not for those and the small one.
        let budget = 2 * bytes(&big("a")) + bytes(&small) - 1;
        let mut routes = routes_of(
            [
                (hog1, "hog"),
                (hog2, "hog"),
                (mine1, "mine"),
                (mine2, "mine"),
            ],
            budget,
        );
        let mut current = ProbeStates::default();
        let mut streaks = BTreeMap::new();
        let mut tasks = BTreeMap::new();
        for a in [hog1, hog2, mine1, mine2] {
            current
                .proxies
                .insert(a, ProxyProbe::new(SystemTime::now()));
            tasks.insert(a, (http_target(&p.policy), tokio::spawn(async {})));
        }
        let report = |address, table: BTreeSet<String>| Report {
            address,
            outcome: Outcome::Healthy,
            latency: Duration::ZERO,
            routes: Some(Some(table)),
            route_read_turn: None,
        };
        let mut apply = |current: &mut ProbeStates, routes: &mut Routes, report| {
            p.apply(current, &mut streaks, &tasks, routes, report).any()
        };
        assert!(apply(&mut current, &mut routes, report(hog1, big("a"))));
        assert!(apply(&mut current, &mut routes, report(hog2, big("b"))));
        routes.collect();
        assert_eq!(routes.tables.total_bytes(), 2 * bytes(&big("a")));
        // Mine is within its share: in, the hog's tables dropped.
        assert!(apply(
            &mut current,
            &mut routes,
            report(mine1, small.clone())
        ));
        assert!(apply(
            &mut current,
            &mut routes,
            report(mine2, small.clone())
        ));
        routes.collect();
        let table = |c: &ProbeStates, a| c.proxies[&a].routes.clone();
        assert!(Arc::ptr_eq(
            &table(&current, mine1).unwrap(),
            &table(&current, mine2).unwrap()
        ));
        assert_eq!((table(&current, hog1), table(&current, hog2)), (None, None));
        assert_eq!(routes.tables.total_bytes(), bytes(&small));
        // The hog's next big table fits the budget alone, not beside mine: it gets one
        // (the budget is not full), the second is refused.
        apply(&mut current, &mut routes, report(hog1, big("a")));
        apply(&mut current, &mut routes, report(hog2, big("b")));
        routes.collect();
        assert!(table(&current, hog1).is_some());
        assert_eq!(table(&current, hog2), None);
        assert!(table(&current, mine1).is_some());
        assert!(routes.tables.total_bytes() <= budget);
        assert!(p
            .metrics
            .render()
            .contains("ray_xds_probe_routes_refused_total 2"));
    }

    /// A fake proxy: answers `/-/healthz` with `success` and `/-/routes` with a table
    /// of its own, over kept-alive HTTP/1.1.
    async fn fake_proxy() -> SocketAddr {
        fake_proxy_with(None).await
    }

    /// A fake proxy whose `/-/routes` never answers when `stalled` is given (it is sent
    /// a message when the read arrives).
    async fn fake_proxy_with(stalled: Option<mpsc::Sender<()>>) -> SocketAddr {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let stalled = stalled.clone();
                tokio::spawn(async move {
                    let mut stream = BufReader::new(stream);
                    loop {
                        let mut line = String::new();
                        if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let mut header = String::new();
                        while stream.read_line(&mut header).await.unwrap_or(0) > 2 {
                            header.clear();
                        }
                        if let (true, Some(stalled)) = (line.contains("/-/routes"), &stalled) {
                            let _ = stalled.send(()).await;
                            std::future::pending::<()>().await;
                        }
                        let body = if line.contains("/-/routes") {
                            format!(r#"{{"/{}":"app"}}"#, address.port())
                        } else {
                            "success".to_string()
                        };
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if stream.get_mut().write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        address
    }

    fn http_target(settings: &ProbePolicy) -> Target {
        Target {
            settings: settings.clone(),
            protocol: Protocol::Http,
            read_routes: true,
        }
    }

    /// A probe task for tests that reads a proxy's routes once (the routes interval is
    /// an hour).
    fn routes_once_task(
        address: SocketAddr,
        settings: &ProbePolicy,
        client: &HttpClient,
        permits: &ProbePermits,
        reports: &mpsc::Sender<Report>,
    ) -> ProbeTask {
        ProbeTask {
            address,
            settings: settings.clone(),
            protocol: Protocol::Http,
            read_routes: true,
            routes_interval: Duration::from_secs(3600),
            client: client.clone(),
            permits: permits.clone(),
            reports: reports.clone(),
        }
    }

    /// A route read's turn is held until the manager has taken its report, so
    /// tables waiting in the report queue count against `ROUTE_READS_AT_ONCE`: with the
    /// manager stalled, more healthy proxies than turns leave at most that many tables
    /// queued (the rest report their health without a table), and taking the reports
    /// gives the turns back.
    #[tokio::test]
    async fn route_tables_waiting_for_the_manager_hold_their_read_turns() {
        let p = prober();
        let proxies = ROUTE_READS_AT_ONCE + 4;
        let (tx, mut rx) = mpsc::channel(4096);
        let client = probe_client(Duration::from_secs(2));
        let permits = ProbePermits::new(256);
        let mut settings = p.policy.clone();
        settings.timeout = Duration::from_millis(500);
        let mut handles = Vec::new();
        let mut addresses = Vec::new();
        for _ in 0..proxies {
            addresses.push(fake_proxy().await);
        }
        permits
            .route_reads
            .set_owners(&addresses.iter().map(|a| (*a, "c".to_string())).collect());
        for address in addresses {
            let task = routes_once_task(address, &settings, &client, &permits, &tx);
            handles.push(tokio::spawn(task.run()));
        }
        // Every proxy has reported at least twice: each has tried for a turn.
        let mut reports = Vec::new();
        let mut seen = BTreeMap::<SocketAddr, usize>::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while seen.len() < proxies || seen.values().any(|n| *n < 2) {
            let report = tokio::time::timeout_at(deadline.into(), rx.recv())
                .await
                .expect("every proxy reports twice within a minute")
                .unwrap();
            assert_eq!(report.outcome, Outcome::Healthy);
            *seen.entry(report.address).or_default() += 1;
            reports.push(report); // held, as by a stalled manager
        }
        let with_tables = reports.iter().filter(|r| r.routes.is_some()).count();
        assert_eq!(with_tables, ROUTE_READS_AT_ONCE, "tables queued at once");
        assert_eq!(permits.route_reads.available(), 0);
        // The manager takes them: the turns come back and the rest read their tables.
        let mut read: BTreeSet<SocketAddr> = reports
            .iter()
            .filter(|r| r.routes.is_some())
            .map(|r| r.address)
            .collect();
        reports.clear();
        while read.len() < proxies {
            let report = tokio::time::timeout_at(deadline.into(), rx.recv())
                .await
                .expect("the other proxies read their routes once turns are free")
                .unwrap();
            if let Some(table) = &report.routes {
                assert_eq!(table.as_ref().map(|t| t.len()), Some(1));
                read.insert(report.address);
            }
        }
        for h in handles {
            h.abort();
        }
    }

    /// A route read that stalls holds its turn, never the
    /// probe permit: with one probe in flight at most, another proxy is probed (and
    /// reports) while the first proxy's `/-/routes` hangs.
    #[tokio::test]
    async fn a_stalled_route_read_does_not_hold_up_other_probes() {
        let p = prober();
        let (tx, mut rx) = mpsc::channel(64);
        let client = probe_client(Duration::from_secs(30));
        let permits = ProbePermits::new(1);
        let mut settings = p.policy.clone();
        settings.timeout = Duration::from_secs(30);
        let (stalled_tx, mut stalled_rx) = mpsc::channel(1);
        let slow = fake_proxy_with(Some(stalled_tx)).await;
        let quick = fake_proxy().await;
        permits.route_reads.set_owners(&BTreeMap::from([
            (slow, "c".to_string()),
            (quick, "c".to_string()),
        ]));
        let task = |address| routes_once_task(address, &settings, &client, &permits, &tx);
        let slow_task = tokio::spawn(task(slow).run());
        tokio::time::timeout(Duration::from_secs(60), stalled_rx.recv())
            .await
            .expect("the slow proxy's routes are read");
        let quick_task = tokio::spawn(task(quick).run());
        let first = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .expect("the quick proxy reports while the slow one's read hangs")
            .unwrap();
        assert_eq!(first.address, quick);
        assert_eq!(first.outcome, Outcome::Healthy);
        slow_task.abort();
        quick_task.abort();
    }

    /// A fake proxy for the hedged probe: answers at once, or leaves requests
    /// unanswered (the next `hang_next` of them, or all while `hang_all`), counting
    /// `/-/healthz` requests and those it left unanswered.
    #[derive(Clone, Default)]
    struct Hanging {
        hang_next: Arc<std::sync::atomic::AtomicUsize>,
        hang_all: Arc<std::sync::atomic::AtomicBool>,
        /// `/-/healthz` requests left unanswered so far.
        unanswered: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Hanging {
        async fn start(&self) -> SocketAddr {
            use std::sync::atomic::Ordering::SeqCst;
            use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = listener.local_addr().unwrap();
            let me = self.clone();
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    let me = me.clone();
                    tokio::spawn(async move {
                        let mut stream = BufReader::new(stream);
                        loop {
                            let mut line = String::new();
                            if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                                return;
                            }
                            let mut header = String::new();
                            while stream.read_line(&mut header).await.unwrap_or(0) > 2 {
                                header.clear();
                            }
                            let body = if line.contains("/-/routes") {
                                r#"{"/":"app"}"#
                            } else {
                                let hang = me.hang_all.load(SeqCst)
                                    || me
                                        .hang_next
                                        .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                                        .is_ok();
                                if hang {
                                    me.unanswered.fetch_add(1, SeqCst);
                                    std::future::pending::<()>().await;
                                }
                                "success"
                            };
                            let answer = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            );
                            if stream.get_mut().write_all(answer.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            });
            address
        }

        fn unanswered(&self) -> usize {
            self.unanswered.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    /// A probe task on `address` with a long timeout (3 s, so the hedge goes at 1 s:
    /// the test's ordering never depends on how loaded the machine is) and a short
    /// interval; its reports, each fed to a [`ProxyProbe`] as the manager does.
    struct HedgeRun {
        reports: mpsc::Receiver<Report>,
        probe: ProxyProbe,
        streak: Streak,
        settings: ProbePolicy,
        task: JoinHandle<()>,
    }

    impl HedgeRun {
        /// With 16 permits in all: one for hedged probes.
        fn start(address: SocketAddr) -> HedgeRun {
            HedgeRun::start_with(address, 16)
        }

        fn start_with(address: SocketAddr, max_concurrent: usize) -> HedgeRun {
            let settings = ProbePolicy {
                interval: Duration::from_millis(50),
                timeout: Duration::from_secs(3),
                ..Default::default()
            };
            assert_eq!(settings.unhealthy_threshold, 2);
            let (tx, rx) = mpsc::channel(64);
            let permits = ProbePermits::new(max_concurrent);
            permits
                .route_reads
                .set_owners(&BTreeMap::from([(address, "c".to_string())]));
            let client = probe_client(settings.timeout);
            let task = routes_once_task(address, &settings, &client, &permits, &tx);
            HedgeRun {
                reports: rx,
                probe: ProxyProbe::new(SystemTime::now()),
                streak: Streak::default(),
                settings,
                task: tokio::spawn(task.run()),
            }
        }

        /// The next report (within a generous minute), applied to the probe state.
        async fn next(&mut self) -> Outcome {
            let report = tokio::time::timeout(Duration::from_secs(60), self.reports.recv())
                .await
                .expect("a report within a minute")
                .unwrap();
            self.probe.observe(
                &mut self.streak,
                &report.outcome,
                &self.settings,
                SystemTime::now(),
            );
            report.outcome
        }
    }

    /// A hung proxy that was healthy is confirmed by a second probe started
    /// before the first timed out (hedged), so two failures in a row, and unhealthy, come
    /// one hedge delay after the first failure instead of a re-probe and a second
    /// timeout later. The first failure is reported while the second probe is still in
    /// flight.
    #[tokio::test]
    async fn a_hung_proxy_is_confirmed_by_a_hedged_probe_started_before_the_first_timed_out() {
        let fake = Hanging::default();
        let address = fake.start().await;
        let mut run = HedgeRun::start(address);
        while run.probe.state != ProbeState::Healthy || run.streak.successes < 2 {
            assert_eq!(run.next().await, Outcome::Healthy);
        }
        fake.hang_all
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Answers already on their way may still come; then the first failure.
        let first = loop {
            match run.next().await {
                Outcome::Healthy => continue,
                other => break other,
            }
        };
        assert!(
            matches!(&first, Outcome::Failed(why) if why.contains("no answer within")),
            "{first:?}"
        );
        assert_eq!(
            fake.unanswered(),
            2,
            "when the first probe timed out, a second one was already waiting (hedged)"
        );
        assert_eq!(
            run.probe.state,
            ProbeState::Healthy,
            "one failure is not enough"
        );
        let second = run.next().await;
        assert!(matches!(second, Outcome::Failed(_)), "{second:?}");
        assert_eq!(run.probe.state, ProbeState::Unhealthy);
        assert_eq!(run.streak.failures, 2);
        run.task.abort();
    }

    /// Hedged probes have permits of their own (a sixteenth): with none (8 in all), a hung
    /// proxy's probe is not joined by a hedge taken from other probes' permits; its
    /// failure is confirmed by the quick re-probe instead, and it still goes unhealthy.
    #[tokio::test]
    async fn with_no_hedge_permit_a_failure_is_confirmed_by_a_re_probe() {
        let fake = Hanging::default();
        let address = fake.start().await;
        let mut run = HedgeRun::start_with(address, 8);
        while run.probe.state != ProbeState::Healthy || run.streak.successes < 2 {
            assert_eq!(run.next().await, Outcome::Healthy);
        }
        fake.hang_all
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let first = loop {
            match run.next().await {
                Outcome::Healthy => continue,
                other => break other,
            }
        };
        assert!(matches!(first, Outcome::Failed(_)), "{first:?}");
        assert_eq!(fake.unanswered(), 1, "no hedge: no permit of its own");
        let second = run.next().await;
        assert!(matches!(second, Outcome::Failed(_)), "{second:?}");
        assert_eq!(run.probe.state, ProbeState::Unhealthy);
        assert_eq!(
            fake.unanswered(),
            2,
            "the re-probe, after the first timed out"
        );
        run.task.abort();
    }

    /// One probe left unanswered, with the proxy answering the others at once,
    /// never flips health: the hedged probe's answer settles the round (the unanswered
    /// probe is dropped, no failure is even reported), and health stays healthy.
    #[tokio::test]
    async fn a_single_slow_answer_among_fast_ones_never_flips_health() {
        let fake = Hanging::default();
        let address = fake.start().await;
        let mut run = HedgeRun::start(address);
        while run.probe.state != ProbeState::Healthy || run.streak.successes < 2 {
            assert_eq!(run.next().await, Outcome::Healthy);
        }
        fake.hang_next.store(1, std::sync::atomic::Ordering::SeqCst);
        let mut seen = 0;
        while fake.unanswered() == 0 || seen < 10 {
            let outcome = run.next().await;
            assert_eq!(outcome, Outcome::Healthy, "the hedge answered for it");
            assert_eq!(run.probe.state, ProbeState::Healthy);
            seen += 1;
        }
        assert_eq!(fake.unanswered(), 1);
        assert_eq!(run.streak.failures, 0);
        run.task.abort();
    }

    /// With `unhealthy_threshold: 1` one failure decides alone: no hedge is sent.
    #[tokio::test]
    async fn no_hedge_when_one_failure_decides() {
        let fake = Hanging::default();
        let address = fake.start().await;
        let mut run = HedgeRun::start(address);
        run.task.abort();
        let (tx, rx) = mpsc::channel(64);
        run.reports = rx;
        run.settings.unhealthy_threshold = 1;
        run.settings.timeout = Duration::from_millis(500);
        // Long enough that no next probe starts before the failure is looked at.
        run.settings.interval = Duration::from_secs(2);
        let permits = ProbePermits::new(16);
        let client = probe_client(run.settings.timeout);
        let task = routes_once_task(address, &run.settings, &client, &permits, &tx);
        run.task = tokio::spawn(task.run());
        assert_eq!(run.next().await, Outcome::Healthy);
        fake.hang_all
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let failed = loop {
            match run.next().await {
                Outcome::Healthy => continue,
                other => break other,
            }
        };
        assert!(matches!(failed, Outcome::Failed(_)), "{failed:?}");
        assert_eq!(run.probe.state, ProbeState::Unhealthy);
        assert_eq!(fake.unanswered(), 1, "no second probe");
        run.task.abort();
    }

    #[test]
    fn all_unknown_keeps_routes_and_clears_the_verdict() {
        let mut states = ProbeStates::default();
        let mut probe = ProxyProbe::new(SystemTime::UNIX_EPOCH);
        probe.state = ProbeState::Unhealthy;
        probe.routes = Some(std::sync::Arc::new(["/".to_string()].into()));
        states
            .proxies
            .insert(SocketAddr::from(([127, 0, 0, 1], 1)), probe);
        states.complete = true;
        let out = states.all_unknown("wedged", SystemTime::now());
        let p = out.proxies.values().next().unwrap();
        assert_eq!(p.state, ProbeState::Unknown);
        assert_eq!(&*p.reason, "wedged");
        assert!(p.routes.is_some());
        assert!(!out.complete);
    }
}

//! Readiness-gated switchover: per RayService, which RayClusters get traffic, by weight.
//!
//! Traffic follows readiness, not labels. The cluster *serving* keeps its traffic until a
//! *target* (the source's pending cluster, or a new active cluster the source named early)
//! is ready: every application RUNNING on the target's own dashboard (skipped when it has
//! none configured), and at least `min_ready_proxies` of its proxies healthy and serving
//! every application's route prefix. Then traffic moves: `atomic` (0 → 100) or
//! `progressive` (the configured steps, one per interval). If the target stops being ready
//! mid-shift, traffic goes back to the serving cluster and the shift waits. At 100 the
//! target becomes the serving cluster, whatever the source's labels say, until the source
//! names another.
//!
//! Make before break, twice over: traffic starts to move only once every connected Envoy
//! that takes the target cluster has ACKed it and its endpoints ([`EnvoyWarmth`]), so all
//! Envoys switch together; an Envoy that has not warmed it within `warm_timeout` (one
//! that NACKs, or is stuck) no longer holds the others back, and is still protected by
//! its own stream: it only gets a route naming a cluster once it has warmed that cluster
//! (`xds::ordering`). No Envoy ever routes to a cold cluster.
//!
//! Pure: time is passed in.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::live::dashboard::AppStatus;
use crate::live::dashboards::DashboardStates;
use crate::live::probe::ProbeState;
use crate::live::prober::ProbeStates;
use crate::model::{Model, RayCluster, RayService};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShiftMode {
    Atomic,
    /// Target weights in percent, ending at 100, one step per interval.
    Progressive {
        steps: Vec<u32>,
        interval: Duration,
    },
}

/// How one RayService switches between RayClusters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwitchoverPolicy {
    pub mode: ShiftMode,
    /// Healthy proxies serving every route the target needs before traffic moves.
    pub min_ready_proxies: u32,
    /// How long a cluster the source dropped stays with Envoy, its endpoints DRAINING,
    /// so requests in flight on it finish before it is removed.
    pub drain_grace: Duration,
    /// How long a ready target waits for every connected Envoy to warm it before traffic
    /// moves without the laggards (each of which still switches once it has warmed it).
    pub warm_timeout: Duration,
}

impl Default for SwitchoverPolicy {
    fn default() -> Self {
        SwitchoverPolicy {
            mode: ShiftMode::Atomic,
            min_ready_proxies: 1,
            drain_grace: Duration::from_secs(30),
            warm_timeout: Duration::from_secs(10),
        }
    }
}

/// The progressive steps used when none are given: 10, 25, 50, 100 every 10 s.
pub const DEFAULT_STEPS: [u32; 4] = [10, 25, 50, 100];
pub const DEFAULT_STEP_INTERVAL: Duration = Duration::from_secs(10);

/// Whether a shift is atomic or progressive, as a RayService asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModeKind {
    Atomic,
    Progressive,
}

/// What a RayService overrides of the global switchover policy; `None` keeps the global
/// value. Steps or an interval without a mode mean `progressive`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SwitchoverOverrides {
    pub mode: Option<ModeKind>,
    pub steps: Option<Vec<u32>>,
    pub interval: Option<Duration>,
    pub min_ready_proxies: Option<u32>,
    pub drain_grace: Option<Duration>,
    pub warm_timeout: Option<Duration>,
}

impl SwitchoverOverrides {
    /// Checks what can be checked without the global policy: steps rise from above 0 to
    /// 100, and an explicit `atomic` has no steps or interval.
    pub fn validate(&self) -> Result<(), String> {
        if self.mode == Some(ModeKind::Atomic) && (self.steps.is_some() || self.interval.is_some())
        {
            return Err("switchover: steps and interval go with mode: progressive".into());
        }
        if let Some(steps) = &self.steps {
            let rising = steps.windows(2).all(|w| w[0] < w[1]);
            if steps.last() != Some(&100) || !rising || steps.first() == Some(&0) {
                return Err(format!(
                    "switchover: steps {steps:?} must rise from above 0 to 100"
                ));
            }
        }
        if self.min_ready_proxies == Some(0) {
            return Err("switchover: min_ready_proxies must be at least 1".into());
        }
        Ok(())
    }
}

impl From<SwitchoverPolicy> for SwitchoverOverrides {
    fn from(p: SwitchoverPolicy) -> Self {
        let (mode, steps, interval) = match p.mode {
            ShiftMode::Atomic => (ModeKind::Atomic, None, None),
            ShiftMode::Progressive { steps, interval } => {
                (ModeKind::Progressive, Some(steps), Some(interval))
            }
        };
        SwitchoverOverrides {
            mode: Some(mode),
            steps,
            interval,
            min_ready_proxies: Some(p.min_ready_proxies),
            drain_grace: Some(p.drain_grace),
            warm_timeout: Some(p.warm_timeout),
        }
    }
}

impl SwitchoverPolicy {
    /// This policy with a RayService's overrides applied.
    pub fn with(&self, o: &SwitchoverOverrides) -> SwitchoverPolicy {
        let (base_steps, base_interval) = match &self.mode {
            ShiftMode::Progressive { steps, interval } => (steps.clone(), *interval),
            ShiftMode::Atomic => (DEFAULT_STEPS.to_vec(), DEFAULT_STEP_INTERVAL),
        };
        let kind = o.mode.unwrap_or(
            if o.steps.is_some()
                || o.interval.is_some()
                || matches!(self.mode, ShiftMode::Progressive { .. })
            {
                ModeKind::Progressive
            } else {
                ModeKind::Atomic
            },
        );
        let mode = match kind {
            ModeKind::Atomic => ShiftMode::Atomic,
            ModeKind::Progressive => ShiftMode::Progressive {
                steps: o.steps.clone().unwrap_or(base_steps),
                interval: o.interval.unwrap_or(base_interval),
            },
        };
        SwitchoverPolicy {
            mode,
            min_ready_proxies: o.min_ready_proxies.unwrap_or(self.min_ready_proxies).max(1),
            drain_grace: o.drain_grace.unwrap_or(self.drain_grace),
            warm_timeout: o.warm_timeout.unwrap_or(self.warm_timeout),
        }
    }
}

/// Which connected Envoys have not yet warmed (ACKed) a cluster and its endpoints.
pub trait EnvoyWarmth {
    /// The node ids of connected Envoys that take `envoy_cluster` but have not ACKed it
    /// and its endpoints yet. Envoys that do not subscribe to it are not asked.
    fn cold_envoys(&self, envoy_cluster: &str) -> Vec<String>;
}

/// No Envoy connected: nothing is cold.
impl EnvoyWarmth for () {
    fn cold_envoys(&self, _: &str) -> Vec<String> {
        Vec::new()
    }
}

/// Clusters the source dropped, kept for their drain grace period.
#[derive(Clone, Debug, Default)]
pub struct Departed {
    /// (RayService key, cluster) → the cluster as last listed, and when it may go.
    clusters: BTreeMap<(String, String), (RayCluster, SystemTime)>,
}

impl Departed {
    /// Notes the clusters `previous` had and `current` lacks, forgets expired ones and any
    /// that came back, and returns `current` with the departed still draining added.
    pub fn update(
        &mut self,
        previous: &Model,
        current: &Model,
        defaults: &SwitchoverPolicy,
        now: SystemTime,
    ) -> Model {
        for old in previous.services() {
            let Some(new) = current.services().iter().find(|s| s.key() == old.key()) else {
                continue; // the whole RayService went: nothing routes to it any more
            };
            for cluster in &old.clusters {
                if new.cluster(&cluster.name).is_none() {
                    let until = now + defaults.with(&new.policy.switchover).drain_grace;
                    self.clusters
                        .entry((old.key(), cluster.name.clone()))
                        .or_insert((cluster.clone(), until));
                }
            }
        }
        self.clusters.retain(|(service, cluster), (_, until)| {
            *until > now
                && current
                    .services()
                    .iter()
                    .find(|s| s.key() == *service)
                    .is_some_and(|s| s.cluster(cluster).is_none())
        });
        if self.clusters.is_empty() {
            return current.clone();
        }
        let services = current
            .services()
            .iter()
            .map(|s| {
                let mut s = s.clone();
                for ((service, _), (cluster, _)) in &self.clusters {
                    if *service == s.key() {
                        s.clusters.push(cluster.clone());
                    }
                }
                s
            })
            .collect();
        // Valid: the names were unique in `previous`, and none is in `current`.
        Model::new(services).unwrap_or_else(|_| current.clone())
    }

    /// Whether `cluster` of `service` is draining after the source dropped it.
    pub fn contains(&self, service: &str, cluster: &str) -> bool {
        self.clusters
            .contains_key(&(service.to_string(), cluster.to_string()))
    }

    /// The Envoy cluster names of every departed cluster.
    pub fn envoy_cluster_names(&self) -> std::collections::BTreeSet<String> {
        self.clusters
            .keys()
            .map(|(service, cluster)| format!("{service}/{cluster}"))
            .collect()
    }

    /// When the next departed cluster may go.
    pub fn next_expiry(&self) -> Option<SystemTime> {
        self.clusters.values().map(|(_, until)| *until).min()
    }
}

/// One RayService's switchover state, as `/debug/state` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServiceSwitch {
    /// The cluster traffic belongs to.
    pub serving: String,
    /// The cluster traffic is moving (or waiting to move) to.
    pub target: Option<String>,
    /// `stable`, `waiting` (target not ready), `warming` (target ready, some Envoy has
    /// not ACKed it yet), `shifting`.
    pub phase: &'static str,
    pub reason: String,
    /// Percent of traffic per cluster (only clusters with some).
    pub weights: Vec<(String, u32)>,
    /// When the current target became the target: its dashboard must have answered
    /// since, so a status read before an upgrade began is never taken for readiness.
    #[serde(skip)]
    target_since: Option<SystemTime>,
    /// When the target was first found ready while some Envoy had not warmed it.
    #[serde(skip)]
    warming_since: Option<SystemTime>,
    #[serde(skip)]
    step: usize,
    #[serde(skip)]
    step_since: Option<SystemTime>,
}

/// A change worth logging once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwitchEvent {
    pub service: String,
    pub phase: &'static str,
    pub reason: String,
    pub weights: Vec<(String, u32)>,
}

/// The switchover state of every RayService.
#[derive(Clone, Debug, Default)]
pub struct Switchover {
    /// The global policy; each RayService overrides parts of it.
    pub defaults: SwitchoverPolicy,
    pub services: BTreeMap<String, ServiceSwitch>,
    /// Envoy clusters whose dashboard should be asked again now (a switch began).
    refresh: Vec<String>,
}

/// Whether `cluster` of `service` is ready for traffic, and why not.
pub fn readiness(
    service: &RayService,
    cluster: &str,
    probes: &ProbeStates,
    dashboards: &DashboardStates,
    min_ready_proxies: u32,
    answered_since: Option<SystemTime>,
) -> Result<(), String> {
    let Some(c) = service.cluster(cluster) else {
        return Err(format!("cluster {cluster} is not listed"));
    };
    let envoy_name = service.envoy_cluster_name(cluster);
    let mut prefixes = std::collections::BTreeSet::new();
    if c.dashboard.is_some() {
        let d = dashboards.clusters.get(&envoy_name);
        let Some(status) = d.and_then(|d| d.status.as_ref()) else {
            return Err("its dashboard has not answered yet".into());
        };
        if d.is_some_and(|d| d.stale) {
            return Err("its dashboard does not answer now".into());
        }
        if let Some(since) = answered_since {
            let since = since
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0);
            if d.and_then(|d| d.last_success_unix)
                .is_none_or(|t| t < since)
            {
                return Err("waiting for its dashboard to answer since the switch began".into());
            }
        }
        if !status.all_running() {
            let waiting: Vec<String> = status
                .applications
                .iter()
                .filter(|(_, a)| a.status != AppStatus::Running)
                .map(|(n, a)| format!("{n} {}", a.status.as_str()))
                .collect();
            return Err(if waiting.is_empty() {
                "no application deployed yet".into()
            } else {
                format!("applications not RUNNING: {}", waiting.join(", "))
            });
        }
        prefixes = status.route_prefixes();
    }
    let ready = c
        .proxies
        .iter()
        .filter(|p| {
            probes.proxies.get(&p.address).is_some_and(|probe| {
                probe.state == ProbeState::Healthy
                    && (prefixes.is_empty()
                        || probe.routes.as_ref().is_some_and(|r| prefixes.is_subset(r)))
            })
        })
        .count() as u32;
    if ready < min_ready_proxies.max(1) {
        return Err(format!(
            "{ready} of {} proxies healthy and serving every route (need {})",
            c.proxies.len(),
            min_ready_proxies.max(1)
        ));
    }
    Ok(())
}

fn has_healthy(service: &RayService, cluster: &str, probes: &ProbeStates) -> bool {
    service.cluster(cluster).is_some_and(|c| {
        c.proxies.iter().any(|p| {
            probes
                .proxies
                .get(&p.address)
                .is_some_and(|s| matches!(s.state, ProbeState::Healthy | ProbeState::Unknown))
        })
    })
}

impl Switchover {
    pub fn new(defaults: SwitchoverPolicy) -> Switchover {
        Switchover {
            defaults,
            ..Default::default()
        }
    }

    /// Advances every RayService's switchover to `now`; returns what changed.
    pub fn advance(
        &mut self,
        model: &Model,
        probes: &ProbeStates,
        dashboards: &DashboardStates,
        envoys: &dyn EnvoyWarmth,
        now: SystemTime,
    ) -> Vec<SwitchEvent> {
        let mut events = Vec::new();
        let mut next = BTreeMap::new();
        for service in model.services() {
            let key = service.key();
            let policy = &self.defaults.with(&service.policy.switchover);
            let mut st = self.services.remove(&key).unwrap_or_else(|| ServiceSwitch {
                serving: service.active_cluster.clone(),
                target: None,
                phase: "stable",
                reason: String::new(),
                weights: vec![],
                target_since: None,
                warming_since: None,
                step: 0,
                step_since: None,
            });
            let before = (st.phase, st.weights.clone(), st.reason.clone());
            if service.cluster(&st.serving).is_none() {
                // The source removed the cluster we served: nothing to keep serving from.
                st.serving = service.active_cluster.clone();
                st.step = 0;
            }
            let previous_target = st.target.clone();
            st.target = match &service.pending_cluster {
                // Already moved to the pending cluster: stay until the source promotes it.
                Some(p) if *p == st.serving => None,
                Some(p) => Some(p.clone()),
                // The source names an active cluster we do not serve (an early flip, or a
                // replaced cluster): a switchover like any other.
                None if service.active_cluster != st.serving => {
                    Some(service.active_cluster.clone())
                }
                None => None,
            };
            if st.target != previous_target {
                st.target_since = st.target.as_ref().map(|_| now);
                st.warming_since = None;
                if let Some(t) = &st.target {
                    if service.cluster(t).is_some_and(|c| c.dashboard.is_some()) {
                        self.refresh.push(service.envoy_cluster_name(t));
                    }
                }
            }
            match st.target.clone() {
                None => {
                    if st.phase != "stable" || st.reason.is_empty() {
                        st.reason = format!("serving {}", st.serving);
                    }
                    st.phase = "stable";
                    st.step = 0;
                    st.weights = vec![(st.serving.clone(), 100)];
                }
                Some(target) => {
                    let ready = readiness(
                        service,
                        &target,
                        probes,
                        dashboards,
                        policy.min_ready_proxies,
                        st.target_since,
                    );
                    let desperate = !has_healthy(service, &st.serving, probes)
                        && has_healthy(service, &target, probes);
                    if ready.is_err() {
                        st.warming_since = None;
                    }
                    // Before the first step, wait for every Envoy to warm the target.
                    let mut cold = Vec::new();
                    let mut warm_note = String::new();
                    if ready.is_ok() && !desperate && st.step == 0 {
                        cold = envoys.cold_envoys(&service.envoy_cluster_name(&target));
                        if cold.is_empty() {
                            st.warming_since = None;
                        } else {
                            let since = *st.warming_since.get_or_insert(now);
                            if now.duration_since(since).unwrap_or_default() >= policy.warm_timeout
                            {
                                warm_note = format!(
                                    " ({} Envoy(s) had not warmed it after {:?}: {}; each \
                                     switches once it has)",
                                    cold.len(),
                                    policy.warm_timeout,
                                    cold.join(", ")
                                );
                                cold.clear();
                            }
                        }
                    }
                    match ready {
                        Ok(()) if !cold.is_empty() => {
                            st.phase = "warming";
                            st.reason = format!(
                                "{target} is ready; waiting for {} Envoy(s) to ACK it and its \
                                 endpoints: {}",
                                cold.len(),
                                cold.join(", ")
                            );
                            st.weights = vec![(st.serving.clone(), 100)];
                        }
                        Err(why) if !desperate => {
                            st.phase = "waiting";
                            st.reason = format!("{target} is not ready: {why}");
                            st.step = 0;
                            st.weights = vec![(st.serving.clone(), 100)];
                        }
                        _ => {
                            let weight = match &policy.mode {
                                ShiftMode::Atomic => 100,
                                _ if desperate => 100,
                                ShiftMode::Progressive { steps, interval } => {
                                    let due = st.step_since.is_none_or(|t| {
                                        now.duration_since(t).unwrap_or_default() >= *interval
                                    });
                                    if st.step == 0 || (due && st.step < steps.len()) {
                                        st.step += 1;
                                        st.step_since = Some(now);
                                    }
                                    steps.get(st.step - 1).copied().unwrap_or(100).min(100)
                                }
                            };
                            if weight >= 100 {
                                st.reason = if desperate {
                                    format!(
                                        "{} has no healthy proxy left; moved to {target}",
                                        st.serving
                                    )
                                } else {
                                    format!("moved to {target}: it is ready{warm_note}")
                                };
                                st.serving = target;
                                st.target = None;
                                st.phase = "stable";
                                st.step = 0;
                                st.weights = vec![(st.serving.clone(), 100)];
                            } else {
                                st.phase = "shifting";
                                st.reason =
                                    format!("{target} is ready: {weight}% of traffic{warm_note}");
                                st.weights =
                                    vec![(st.serving.clone(), 100 - weight), (target, weight)];
                            }
                        }
                    }
                }
            }
            if (st.phase, &st.weights, &st.reason) != (before.0, &before.1, &before.2) {
                events.push(SwitchEvent {
                    service: key.clone(),
                    phase: st.phase,
                    reason: st.reason.clone(),
                    weights: st.weights.clone(),
                });
            }
            next.insert(key, st);
        }
        self.services = next;
        events
    }

    /// Percent of traffic per cluster of one RayService (the active cluster alone if unknown).
    pub fn weights<'a>(&'a self, service: &'a RayService) -> Vec<(&'a str, u32)> {
        match self.services.get(&service.key()) {
            Some(s) => s
                .weights
                .iter()
                .filter(|(_, w)| *w > 0)
                .map(|(c, w)| (c.as_str(), *w))
                .collect(),
            None => vec![(service.active_cluster.as_str(), 100)],
        }
    }

    /// Dashboards to poll now, each asked once when a switch towards its cluster began.
    pub fn take_refresh_requests(&mut self) -> Vec<String> {
        std::mem::take(&mut self.refresh)
    }

    /// Whether any RayService is mid-shift (the pipeline re-runs on a timer then).
    pub fn shifting(&self) -> bool {
        self.services.values().any(|s| s.phase == "shifting")
    }

    /// Whether any RayService waits for Envoys to warm its target (the pipeline re-runs
    /// when an Envoy ACKs, and on a timer for `warm_timeout`).
    pub fn warming(&self) -> bool {
        self.services.values().any(|s| s.phase == "warming")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::dashboard::parse;
    use crate::live::dashboards::ClusterDashboard;
    use crate::live::probe::ProxyProbe;
    use crate::model::test_support::service;
    use crate::model::{Model, RayCluster};
    use std::net::SocketAddr;

    const A: &str = "a1";
    const B: &str = "b1";

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// RayService `s` with clusters a1 (port 8000) and b1 (port 9000), both with dashboards.
    fn model(active: &str, pending: Option<&str>, policy: SwitchoverPolicy) -> Model {
        let mut s = service("s", A, &[8000]);
        let mut b = service("s", B, &[9000]).clusters.remove(0);
        b.dashboard = Some("http://b".into());
        s.clusters[0].dashboard = Some("http://a".into());
        s.clusters.push(b);
        s.active_cluster = active.into();
        s.pending_cluster = pending.map(str::to_string);
        s.policy.switchover = policy.into();
        Model::new(vec![s]).unwrap()
    }

    struct World {
        probes: ProbeStates,
        dashboards: DashboardStates,
    }

    impl World {
        fn new() -> World {
            let mut w = World {
                probes: ProbeStates::default(),
                dashboards: DashboardStates::default(),
            };
            w.proxy(8000, ProbeState::Healthy);
            w.proxy(9000, ProbeState::Healthy);
            w.apps("default/s/a1", "02-running.json");
            w.apps("default/s/b1", "02-running.json");
            w
        }

        fn proxy(&mut self, port: u16, state: ProbeState) {
            let mut p = ProxyProbe::new(SystemTime::UNIX_EPOCH);
            p.state = state;
            p.routes = Some(
                [
                    "/hello".to_string(),
                    "/slow".to_string(),
                    "/broken".to_string(),
                ]
                .into(),
            );
            self.probes.proxies.insert(addr(port), p);
        }

        fn apps(&mut self, cluster: &str, fixture: &str) {
            let path = format!(
                "{}/tests/fixtures/ray-serve-2.60/{fixture}",
                env!("CARGO_MANIFEST_DIR")
            );
            let status = parse(&std::fs::read(path).unwrap()).unwrap();
            self.dashboards.clusters.insert(
                cluster.into(),
                ClusterDashboard {
                    status: Some(status),
                    // Answered "now" for every test time below.
                    last_success_unix: Some(1e9),
                    ..ClusterDashboard::new("http://x".into())
                },
            );
        }
    }

    fn weights(s: &Switchover) -> Vec<(String, u32)> {
        s.services["default/s"].weights.clone()
    }

    fn w(pairs: &[(&str, u32)]) -> Vec<(String, u32)> {
        pairs.iter().map(|(c, w)| (c.to_string(), *w)).collect()
    }

    const T0: SystemTime = SystemTime::UNIX_EPOCH;

    #[test]
    fn an_upgrade_waits_for_readiness_then_moves_atomically() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        let mut s = Switchover::default();
        let m = model(A, Some(B), SwitchoverPolicy::default());
        s.advance(&m, &world.probes, &world.dashboards, &(), T0);
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert_eq!(s.services["default/s"].phase, "waiting");
        assert!(
            s.services["default/s"].reason.contains("DEPLOYING"),
            "{}",
            s.services["default/s"].reason
        );

        world.apps("default/s/b1", "02-running.json");
        let events = s.advance(&m, &world.probes, &world.dashboards, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert_eq!(events.len(), 1, "logged once");
        // The source still calls b1 pending: traffic stays on b1.
        assert!(s
            .advance(&m, &world.probes, &world.dashboards, &(), T0)
            .is_empty());
        assert_eq!(weights(&s), w(&[(B, 100)]));
        // The source promotes b1.
        let promoted = model(B, None, SwitchoverPolicy::default());
        s.advance(&promoted, &world.probes, &world.dashboards, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert_eq!(s.services["default/s"].phase, "stable");
    }

    #[test]
    fn a_progressive_shift_steps_with_time_and_backs_off_when_unready() {
        let world = World::new();
        let policy = SwitchoverPolicy {
            mode: ShiftMode::Progressive {
                steps: vec![10, 50, 100],
                interval: Duration::from_secs(10),
            },
            min_ready_proxies: 1,
            ..Default::default()
        };
        let m = model(A, Some(B), policy);
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        s.advance(&m, &world.probes, &world.dashboards, &(), at(0));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        s.advance(&m, &world.probes, &world.dashboards, &(), at(5));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        s.advance(&m, &world.probes, &world.dashboards, &(), at(10));
        assert_eq!(weights(&s), w(&[(A, 50), (B, 50)]));
        assert!(s.shifting());
        // b1's proxy fails: traffic goes back and the shift waits.
        let mut sick = World::new();
        sick.proxy(9000, ProbeState::Unhealthy);
        s.advance(&m, &sick.probes, &sick.dashboards, &(), at(11));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert_eq!(s.services["default/s"].phase, "waiting");
        // Ready again: the shift starts over.
        s.advance(&m, &world.probes, &world.dashboards, &(), at(12));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        s.advance(&m, &world.probes, &world.dashboards, &(), at(22));
        s.advance(&m, &world.probes, &world.dashboards, &(), at(32));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert!(!s.shifting());
    }

    #[test]
    fn an_early_flip_to_an_unready_cluster_keeps_the_old_one_serving() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        let mut s = Switchover::default();
        s.advance(
            &model(A, None, SwitchoverPolicy::default()),
            &world.probes,
            &world.dashboards,
            &(),
            T0,
        );
        // KubeRay names b1 active before its applications run (or after replacing a1).
        let flipped = model(B, None, SwitchoverPolicy::default());
        s.advance(&flipped, &world.probes, &world.dashboards, &(), T0);
        assert_eq!(
            weights(&s),
            w(&[(A, 100)]),
            "traffic follows readiness, not labels"
        );
        world.apps("default/s/b1", "02-running.json");
        s.advance(&flipped, &world.probes, &world.dashboards, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn with_nothing_left_on_the_old_cluster_traffic_moves_anyway() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        world.proxy(8000, ProbeState::Unhealthy);
        let mut s = Switchover::default();
        s.advance(
            &model(A, None, SwitchoverPolicy::default()),
            &world.probes,
            &world.dashboards,
            &(),
            T0,
        );
        s.advance(
            &model(B, None, SwitchoverPolicy::default()),
            &world.probes,
            &world.dashboards,
            &(),
            T0,
        );
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert!(s.services["default/s"].reason.contains("no healthy proxy"));
    }

    #[test]
    fn a_status_read_before_the_switch_began_is_not_readiness() {
        let mut world = World::new();
        let m = model(A, Some(B), SwitchoverPolicy::default());
        // b's dashboard last answered RUNNING at t=10; the upgrade starts at t=20.
        world
            .dashboards
            .clusters
            .get_mut("default/s/b1")
            .unwrap()
            .last_success_unix = Some(10.0);
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        s.advance(
            &model(A, None, SwitchoverPolicy::default()),
            &world.probes,
            &world.dashboards,
            &(),
            at(15),
        );
        s.advance(&m, &world.probes, &world.dashboards, &(), at(20));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert!(s.services["default/s"]
            .reason
            .contains("since the switch began"));
        world
            .dashboards
            .clusters
            .get_mut("default/s/b1")
            .unwrap()
            .last_success_unix = Some(21.0);
        s.advance(&m, &world.probes, &world.dashboards, &(), at(21));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    /// Envoys by node id, each with the clusters it has warmed.
    struct Envoys(Vec<(&'static str, Vec<&'static str>)>);

    impl EnvoyWarmth for Envoys {
        fn cold_envoys(&self, cluster: &str) -> Vec<String> {
            self.0
                .iter()
                .filter(|(_, warm)| !warm.contains(&cluster))
                .map(|(id, _)| id.to_string())
                .collect()
        }
    }

    #[test]
    fn traffic_moves_only_once_every_envoy_warmed_the_target() {
        let world = World::new();
        let m = model(A, Some(B), SwitchoverPolicy::default());
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        let one_cold = Envoys(vec![
            ("gw-1", vec!["default/s/a1", "default/s/b1"]),
            ("gw-2", vec!["default/s/a1"]),
        ]);
        s.advance(&m, &world.probes, &world.dashboards, &one_cold, at(0));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        let st = &s.services["default/s"];
        assert_eq!(st.phase, "warming");
        assert!(
            st.reason.contains("gw-2") && !st.reason.contains("gw-1"),
            "{}",
            st.reason
        );
        assert!(s.warming());
        let all_warm = Envoys(vec![
            ("gw-1", vec!["default/s/a1", "default/s/b1"]),
            ("gw-2", vec!["default/s/a1", "default/s/b1"]),
        ]);
        s.advance(&m, &world.probes, &world.dashboards, &all_warm, at(1));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert!(!s.warming());
    }

    #[test]
    fn an_envoy_that_never_warms_holds_the_switch_only_for_warm_timeout() {
        let world = World::new();
        let policy = SwitchoverPolicy {
            warm_timeout: Duration::from_secs(5),
            mode: ShiftMode::Progressive {
                steps: vec![50, 100],
                interval: Duration::from_secs(10),
            },
            ..Default::default()
        };
        let m = model(A, Some(B), policy);
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        let stuck = Envoys(vec![("nacking", vec!["default/s/a1"])]);
        s.advance(&m, &world.probes, &world.dashboards, &stuck, at(0));
        s.advance(&m, &world.probes, &world.dashboards, &stuck, at(4));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        s.advance(&m, &world.probes, &world.dashboards, &stuck, at(5));
        assert_eq!(weights(&s), w(&[(A, 50), (B, 50)]));
        assert!(s.services["default/s"].reason.contains("nacking"));
        // Mid-shift, a newly connected cold Envoy does not roll the shift back.
        s.advance(&m, &world.probes, &world.dashboards, &stuck, at(15));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn a_target_that_turns_unready_while_warming_restarts_the_wait() {
        let world = World::new();
        let mut sick = World::new();
        sick.proxy(9000, ProbeState::Unhealthy);
        let m = model(A, Some(B), SwitchoverPolicy::default());
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        let cold = Envoys(vec![("gw", vec![])]);
        s.advance(&m, &world.probes, &world.dashboards, &cold, at(0));
        s.advance(&m, &sick.probes, &sick.dashboards, &cold, at(8));
        assert_eq!(s.services["default/s"].phase, "waiting");
        // Ready again at 9 s: the 10 s wait starts over, so it still holds at 18 s.
        s.advance(&m, &world.probes, &world.dashboards, &cold, at(9));
        s.advance(&m, &world.probes, &world.dashboards, &cold, at(18));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        s.advance(&m, &world.probes, &world.dashboards, &cold, at(19));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn with_nothing_healthy_left_traffic_does_not_wait_for_warming() {
        let mut world = World::new();
        world.proxy(8000, ProbeState::Unhealthy);
        let m = model(A, Some(B), SwitchoverPolicy::default());
        let mut s = Switchover::default();
        s.advance(
            &m,
            &world.probes,
            &world.dashboards,
            &Envoys(vec![("gw", vec![])]),
            T0,
        );
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn global_defaults_apply_unless_a_rayservice_overrides_them() {
        let global = SwitchoverPolicy {
            mode: ShiftMode::Progressive {
                steps: vec![20, 100],
                interval: Duration::from_secs(3),
            },
            drain_grace: Duration::from_secs(7),
            ..Default::default()
        };
        assert_eq!(global.with(&SwitchoverOverrides::default()), global);
        let atomic = global.with(&SwitchoverOverrides {
            mode: Some(ModeKind::Atomic),
            ..Default::default()
        });
        assert_eq!(atomic.mode, ShiftMode::Atomic);
        assert_eq!(atomic.drain_grace, Duration::from_secs(7));
        let slower = global.with(&SwitchoverOverrides {
            interval: Some(Duration::from_secs(30)),
            ..Default::default()
        });
        assert_eq!(
            slower.mode,
            ShiftMode::Progressive {
                steps: vec![20, 100],
                interval: Duration::from_secs(30)
            }
        );
        // Steps alone make an atomic global policy progressive for this RayService.
        let stepped = SwitchoverPolicy::default().with(&SwitchoverOverrides {
            steps: Some(vec![50, 100]),
            ..Default::default()
        });
        assert_eq!(
            stepped.mode,
            ShiftMode::Progressive {
                steps: vec![50, 100],
                interval: DEFAULT_STEP_INTERVAL
            }
        );
        for bad in [
            SwitchoverOverrides {
                steps: Some(vec![50, 90]),
                ..Default::default()
            },
            SwitchoverOverrides {
                steps: Some(vec![0, 100]),
                ..Default::default()
            },
            SwitchoverOverrides {
                mode: Some(ModeKind::Atomic),
                interval: Some(Duration::from_secs(1)),
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        // The drain grace a RayService inherits decides how long its dropped cluster stays.
        let before = model(B, Some(A), SwitchoverPolicy::default());
        let mut plain = before.services()[0].clone();
        plain.policy.switchover = SwitchoverOverrides::default();
        let before = Model::new(vec![plain.clone()]).unwrap();
        plain.pending_cluster = None;
        plain.clusters.retain(|c| c.name == B);
        let after = Model::new(vec![plain]).unwrap();
        let mut d = Departed::default();
        d.update(&before, &after, &global, T0);
        assert_eq!(d.next_expiry(), Some(T0 + Duration::from_secs(7)));
    }

    #[test]
    fn a_dropped_cluster_drains_for_its_grace_period() {
        let before = model(B, Some(A), SwitchoverPolicy::default());
        let mut after = before.services()[0].clone();
        after.pending_cluster = None;
        after.clusters.retain(|c| c.name == B);
        let after = Model::new(vec![after]).unwrap();
        let mut d = Departed::default();
        let kept = d.update(&before, &after, &SwitchoverPolicy::default(), T0);
        assert!(kept.services()[0].cluster(A).is_some(), "a1 drains");
        assert!(d.contains("default/s", A));
        assert_eq!(d.next_expiry(), Some(T0 + Duration::from_secs(30)));
        let still = d.update(
            &after,
            &after,
            &SwitchoverPolicy::default(),
            T0 + Duration::from_secs(29),
        );
        assert!(still.services()[0].cluster(A).is_some());
        let gone = d.update(
            &after,
            &after,
            &SwitchoverPolicy::default(),
            T0 + Duration::from_secs(31),
        );
        assert!(gone.services()[0].cluster(A).is_none());
        assert_eq!(d.next_expiry(), None);
        // A cluster that comes back is the source's again.
        let mut d = Departed::default();
        d.update(&before, &after, &SwitchoverPolicy::default(), T0);
        let back = d.update(
            &after,
            &before,
            &SwitchoverPolicy::default(),
            T0 + Duration::from_secs(1),
        );
        assert!(!d.contains("default/s", A));
        assert_eq!(back, before);
    }

    #[test]
    fn readiness_needs_enough_proxies_serving_every_route() {
        let world = World::new();
        let m = model(A, Some(B), SwitchoverPolicy::default());
        let svc = &m.services()[0];
        assert!(readiness(svc, B, &world.probes, &world.dashboards, 1, None).is_ok());
        let err = readiness(svc, B, &world.probes, &world.dashboards, 2, None).unwrap_err();
        assert!(err.contains("1 of 1 proxies"), "{err}");
        let mut no_routes = World::new();
        no_routes
            .probes
            .proxies
            .get_mut(&addr(9000))
            .unwrap()
            .routes = Some(["/".to_string()].into());
        assert!(readiness(svc, B, &no_routes.probes, &no_routes.dashboards, 1, None).is_err());
        let mut stale = World::new();
        stale
            .dashboards
            .clusters
            .get_mut("default/s/b1")
            .unwrap()
            .stale = true;
        assert!(readiness(svc, B, &stale.probes, &stale.dashboards, 1, None)
            .unwrap_err()
            .contains("does not answer"));
        // No dashboard configured: the proxies alone decide.
        let mut plain = model(A, Some(B), SwitchoverPolicy::default()).services()[0].clone();
        plain
            .clusters
            .iter_mut()
            .for_each(|c: &mut RayCluster| c.dashboard = None);
        assert!(readiness(
            &plain,
            B,
            &world.probes,
            &DashboardStates::default(),
            1,
            None
        )
        .is_ok());
    }
}

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
//! names another. An Envoy only gets a route naming a cluster once it has warmed that
//! cluster and its endpoints (`xds::ordering`), so no Envoy routes to a cold cluster.
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

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwitchoverPolicy {
    pub mode: ShiftMode,
    pub min_ready_proxies: u32,
    /// How long a cluster the source dropped stays with Envoy, its endpoints DRAINING,
    /// so requests in flight on it finish before it is removed.
    pub drain_grace: Duration,
}

impl Default for SwitchoverPolicy {
    fn default() -> Self {
        SwitchoverPolicy {
            mode: ShiftMode::Atomic,
            min_ready_proxies: 1,
            drain_grace: Duration::from_secs(30),
        }
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
    pub fn update(&mut self, previous: &Model, current: &Model, now: SystemTime) -> Model {
        for old in previous.services() {
            let Some(new) = current.services().iter().find(|s| s.key() == old.key()) else {
                continue; // the whole RayService went: nothing routes to it any more
            };
            for cluster in &old.clusters {
                if new.cluster(&cluster.name).is_none() {
                    let until = now + new.policy.switchover.drain_grace;
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
    /// `stable`, `waiting` (target not ready), `shifting`.
    pub phase: &'static str,
    pub reason: String,
    /// Percent of traffic per cluster (only clusters with some).
    pub weights: Vec<(String, u32)>,
    /// When the current target became the target: its dashboard must have answered
    /// since, so a status read before an upgrade began is never taken for readiness.
    #[serde(skip)]
    target_since: Option<SystemTime>,
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
    /// Advances every RayService's switchover to `now`; returns what changed.
    pub fn advance(
        &mut self,
        model: &Model,
        probes: &ProbeStates,
        dashboards: &DashboardStates,
        now: SystemTime,
    ) -> Vec<SwitchEvent> {
        let mut events = Vec::new();
        let mut next = BTreeMap::new();
        for service in model.services() {
            let key = service.key();
            let policy = &service.policy.switchover;
            let mut st = self.services.remove(&key).unwrap_or_else(|| ServiceSwitch {
                serving: service.active_cluster.clone(),
                target: None,
                phase: "stable",
                reason: String::new(),
                weights: vec![],
                target_since: None,
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
                    match ready {
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
                                    format!("moved to {target}: it is ready")
                                };
                                st.serving = target;
                                st.target = None;
                                st.phase = "stable";
                                st.step = 0;
                                st.weights = vec![(st.serving.clone(), 100)];
                            } else {
                                st.phase = "shifting";
                                st.reason = format!("{target} is ready: {weight}% of traffic");
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
        s.policy.switchover = policy;
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
        s.advance(&m, &world.probes, &world.dashboards, T0);
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert_eq!(s.services["default/s"].phase, "waiting");
        assert!(
            s.services["default/s"].reason.contains("DEPLOYING"),
            "{}",
            s.services["default/s"].reason
        );

        world.apps("default/s/b1", "02-running.json");
        let events = s.advance(&m, &world.probes, &world.dashboards, T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert_eq!(events.len(), 1, "logged once");
        // The source still calls b1 pending: traffic stays on b1.
        assert!(s
            .advance(&m, &world.probes, &world.dashboards, T0)
            .is_empty());
        assert_eq!(weights(&s), w(&[(B, 100)]));
        // The source promotes b1.
        let promoted = model(B, None, SwitchoverPolicy::default());
        s.advance(&promoted, &world.probes, &world.dashboards, T0);
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
        s.advance(&m, &world.probes, &world.dashboards, at(0));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        s.advance(&m, &world.probes, &world.dashboards, at(5));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        s.advance(&m, &world.probes, &world.dashboards, at(10));
        assert_eq!(weights(&s), w(&[(A, 50), (B, 50)]));
        assert!(s.shifting());
        // b1's proxy fails: traffic goes back and the shift waits.
        let mut sick = World::new();
        sick.proxy(9000, ProbeState::Unhealthy);
        s.advance(&m, &sick.probes, &sick.dashboards, at(11));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert_eq!(s.services["default/s"].phase, "waiting");
        // Ready again: the shift starts over.
        s.advance(&m, &world.probes, &world.dashboards, at(12));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        s.advance(&m, &world.probes, &world.dashboards, at(22));
        s.advance(&m, &world.probes, &world.dashboards, at(32));
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
            T0,
        );
        // KubeRay names b1 active before its applications run (or after replacing a1).
        let flipped = model(B, None, SwitchoverPolicy::default());
        s.advance(&flipped, &world.probes, &world.dashboards, T0);
        assert_eq!(
            weights(&s),
            w(&[(A, 100)]),
            "traffic follows readiness, not labels"
        );
        world.apps("default/s/b1", "02-running.json");
        s.advance(&flipped, &world.probes, &world.dashboards, T0);
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
            T0,
        );
        s.advance(
            &model(B, None, SwitchoverPolicy::default()),
            &world.probes,
            &world.dashboards,
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
            at(15),
        );
        s.advance(&m, &world.probes, &world.dashboards, at(20));
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
        s.advance(&m, &world.probes, &world.dashboards, at(21));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn a_dropped_cluster_drains_for_its_grace_period() {
        let before = model(B, Some(A), SwitchoverPolicy::default());
        let mut after = before.services()[0].clone();
        after.pending_cluster = None;
        after.clusters.retain(|c| c.name == B);
        let after = Model::new(vec![after]).unwrap();
        let mut d = Departed::default();
        let kept = d.update(&before, &after, T0);
        assert!(kept.services()[0].cluster(A).is_some(), "a1 drains");
        assert!(d.contains("default/s", A));
        assert_eq!(d.next_expiry(), Some(T0 + Duration::from_secs(30)));
        let still = d.update(&after, &after, T0 + Duration::from_secs(29));
        assert!(still.services()[0].cluster(A).is_some());
        let gone = d.update(&after, &after, T0 + Duration::from_secs(31));
        assert!(gone.services()[0].cluster(A).is_none());
        assert_eq!(d.next_expiry(), None);
        // A cluster that comes back is the source's again.
        let mut d = Departed::default();
        d.update(&before, &after, T0);
        let back = d.update(&after, &before, T0 + Duration::from_secs(1));
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

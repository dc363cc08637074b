//! Readiness-gated switchover: per RayService, which RayClusters get traffic, by weight.
//!
//! Traffic follows readiness, not labels. The cluster *serving* keeps its traffic until a
//! *target* (the source's pending cluster, or a new active cluster the source named early)
//! is ready: every application RUNNING on the target's own dashboard (or DEPLOYING only to
//! start or stop replicas; skipped when it has no dashboard configured), and at least `min_ready_proxies` of its proxies ready as
//! `live::health` counts them (probe healthy, serving every application's route prefix).
//! Then traffic moves: `atomic` (0 → 100) or `progressive` (the configured steps, one per
//! interval). If the target stops being ready mid-shift, traffic goes back to the serving
//! cluster and the shift waits. At 100 the target becomes the serving cluster, whatever
//! the source's labels say, until the source names another.
//!
//! Make before break, twice over: traffic starts to move only once every connected Envoy
//! that takes the target cluster has ACKed it and its endpoints ([`EnvoyWarmth`]), so all
//! Envoys switch together; an Envoy that has not warmed it within `warm_timeout` (one
//! that NACKs, or is stuck) no longer holds the others back, and is still protected by
//! its own stream: it only gets a route naming a cluster once it has warmed that cluster
//! (`xds::ordering`). No Envoy ever routes to a cold cluster.
//!
//! Pure: time, health and the Envoys' warmth are passed in; [`Switchover::next_wake`]
//! says when time alone would change something.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use serde::Serialize;

use super::outcomes::{LoadTotals, Rollback};
use super::readiness::{has_failed_application, Unit};
use super::settle::CapacitySettle;
use crate::live::dashboards::DashboardStates;
use crate::live::health::HealthMap;
use crate::live::peers::{
    to_unix, DepartedCluster, PeerStates, PeerSwitch, ReplicaView, SharedLoad,
};
use crate::model::Model;
use crate::policy::switchover::{Control, SwitchoverPolicy};
use crate::translate::app_switch_key;

mod judge;
mod round;
mod schedule;
mod state;

pub use self::schedule::PEER_LAG;
pub use self::state::ServiceSwitch;

/// Whether `cluster` of `service` is known here not to serve: its dashboard answered
/// (fresh) with an application not RUNNING, or every proxy was probed and none is
/// routable. Not knowing (no answer yet, proxies awaiting a first probe, routes not
/// re-read) is not that.
fn known_unable(
    service: &crate::model::RayService,
    cluster: &str,
    health: &HealthMap,
    dashboards: &DashboardStates,
) -> bool {
    let name = service.envoy_cluster_name(cluster);
    let h = health.cluster(&name);
    let dead = h.awaiting_first_probe == 0 && h.routable == 0;
    let failing_apps = dashboards
        .clusters
        .get(&name)
        .filter(|d| !d.stale)
        .and_then(|d| d.status.as_deref())
        .is_some_and(|status| !status.all_serving());
    dead || failing_apps
}

fn unix_second(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Which connected Envoys have not yet warmed (ACKed) a cluster and its endpoints.
pub trait EnvoyWarmth {
    /// The node ids of connected Envoys that take `envoy_cluster` but have not ACKed it
    /// and its endpoints yet. Envoys that do not subscribe to it are not asked.
    fn cold_envoys(&self, envoy_cluster: &str) -> Vec<String>;
    /// The node ids of connected Envoys that rejected (NACKed) `envoy_cluster` or its
    /// endpoints as they are now.
    fn rejecting_envoys(&self, envoy_cluster: &str) -> Vec<String>;
}

/// No Envoy connected: nothing is cold.
impl EnvoyWarmth for () {
    fn cold_envoys(&self, _: &str) -> Vec<String> {
        Vec::new()
    }
    fn rejecting_envoys(&self, _: &str) -> Vec<String> {
        Vec::new()
    }
}

impl EnvoyWarmth for crate::xds::Clients {
    fn cold_envoys(&self, envoy_cluster: &str) -> Vec<String> {
        self.not_warmed(envoy_cluster)
    }
    fn rejecting_envoys(&self, envoy_cluster: &str) -> Vec<String> {
        self.rejecting(envoy_cluster)
    }
}

/// Where one RayService's switchover stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// All traffic on the serving cluster; no target.
    Stable,
    /// A target exists but is not ready.
    Waiting,
    /// The target is ready; some connected Envoy has not ACKed it yet.
    Warming,
    /// Traffic is moving step by step.
    Shifting,
    /// A connected Envoy rejected (NACKed) the target: no traffic moves to it, however
    /// long it waits, until its configuration changes.
    Rejected,
    /// An operator holds the switch (`switchover.control: hold`): the target keeps the
    /// share it had, gaining nothing.
    Held,
    /// An operator aborted the switch (`switchover.control: abort`): the pending cluster
    /// gets no traffic.
    Aborted,
    /// The pending cluster failed more of its requests than the active one
    /// (`pipeline::outcomes`): it gets no traffic until a new version of it, or an
    /// operator's `promote`.
    RolledBack,
}

impl Phase {
    pub(crate) const ALL: [Phase; 8] = [
        Phase::Stable,
        Phase::Waiting,
        Phase::Warming,
        Phase::Shifting,
        Phase::Rejected,
        Phase::Held,
        Phase::Aborted,
        Phase::RolledBack,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Phase::Stable => "stable",
            Phase::Waiting => "waiting",
            Phase::Warming => "warming",
            Phase::Shifting => "shifting",
            Phase::Rejected => "rejected",
            Phase::Held => "held",
            Phase::Aborted => "aborted",
            Phase::RolledBack => "rolled_back",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A change worth logging once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwitchEvent {
    pub service: String,
    pub phase: Phase,
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
    /// What the other replicas say of their switches.
    peers: Arc<PeerStates>,
    /// The clusters this replica keeps draining (for [`Switchover::replica_view`]).
    departed: Vec<DepartedCluster>,
    /// When each cluster's newly RUNNING replicas come to count toward its capacity.
    settle: CapacitySettle,
    /// Per RayService key, the decision to send nothing to its pending cluster, whose
    /// requests fail ([`outcomes`]).
    rollbacks: BTreeMap<String, Rollback>,
    /// Per RayService key, the active cluster's last reports over the window while it
    /// ended enough to compare (after the move it ends none).
    baselines: BTreeMap<String, (String, crate::xds::lrs::LoadCounts)>,
    /// Per RayService key, the pending cluster and version the operator promoted: not
    /// judged again.
    promoted: BTreeMap<String, (String, Option<String>)>,
    /// RayServices whose pending cluster's reports may decide now (no decision held, not
    /// promoted, and it has traffic): the pipeline reads reports every interval for them.
    judging: BTreeSet<String>,
    /// RayServices whose round this advance left no decision held and not promoted.
    judgeable: BTreeSet<String>,
    /// What this replica's own Envoys reported over the outcome window, and from when
    /// each cluster's reports were counted (the clusters judged the round before: the
    /// task tracks them after a build, and reads the totals before the next).
    own_loads: LoadTotals,
    loads_since: BTreeMap<String, SystemTime>,
    /// The Envoy clusters whose reports count, each from when: every RayService's active
    /// and pending clusters while it has both, the pending one from when its version
    /// was deployed.
    judged: BTreeMap<String, SystemTime>,
    /// Per pending Envoy cluster, its version and the deploy time its reports count from:
    /// the deploy time first seen with that version, so that KubeRay applying the same
    /// config again (each `target_capacity` step moves the deploy time) does not start
    /// the count over. Replicas that saw the version deployed agree on it; one started
    /// after such a step counts from the later time, and adds only the reports of peers
    /// that count from it too.
    version_since: BTreeMap<String, (Option<String>, SystemTime)>,
    /// Per judged Envoy cluster, the ready capacity it had over the outcome window, as a
    /// sliding minimum (times and levels both increasing; the first is the least).
    capacity_seen: BTreeMap<String, std::collections::VecDeque<(SystemTime, u64)>>,
    /// This replica's id, for its peers ([`ReplicaView::replica`]).
    replica_id: String,
}

impl Switchover {
    pub fn new(defaults: SwitchoverPolicy) -> Switchover {
        Switchover {
            defaults,
            ..Default::default()
        }
    }

    /// What the other replicas say, for the next [`Switchover::advance`].
    pub fn set_peers(&mut self, peers: Arc<PeerStates>) {
        self.peers = peers;
    }

    /// What this replica's own Envoys reported over the outcome window, for the next
    /// [`Switchover::advance`] (added to its peers') and for its peers.
    pub fn set_loads(&mut self, own: LoadTotals) {
        self.own_loads = own;
    }

    /// This replica's id, which its view carries to its peers.
    pub(crate) fn set_replica_id(&mut self, id: String) {
        self.replica_id = id;
    }

    /// The Envoy clusters whose load reports the outcome rule reads, each from when:
    /// each RayService's active and pending clusters, while it has both (the pending one
    /// from when its version was deployed, so a redeploy is judged on its own requests).
    pub fn judged_clusters(&self) -> &BTreeMap<String, SystemTime> {
        &self.judged
    }

    /// The clusters this replica keeps draining, for its peers.
    pub(crate) fn set_departed(&mut self, departed: Vec<DepartedCluster>) {
        self.departed = departed;
    }

    /// This replica's switches as its peers read them (`live::peers`).
    pub fn replica_view(&self) -> ReplicaView {
        ReplicaView {
            now_unix: None,
            replica: (!self.replica_id.is_empty()).then(|| self.replica_id.clone()),
            loads: self
                .own_loads
                .iter()
                .filter_map(|(cluster, counts)| {
                    let since = self.loads_since.get(cluster)?;
                    let load = SharedLoad {
                        since_unix: unix_second(*since),
                        counts: *counts,
                    };
                    Some((cluster.clone(), load))
                })
                .collect(),
            departed: self.departed.clone(),
            services: self
                .services
                .iter()
                .map(|(key, s)| {
                    let switch = PeerSwitch {
                        serving: s.serving.clone(),
                        target: s.target.clone(),
                        target_since_unix: s.target_since.map(to_unix),
                        shift_started_unix: s.shift_started.map(to_unix),
                        serving_since_unix: Some(to_unix(s.serving_since)),
                        moved: s.moved,
                        moved_from: s.moved_from.clone(),
                        rollback: self.rollbacks.get(key).cloned(),
                        held_at: s.held_at,
                    };
                    (key.clone(), switch)
                })
                .collect(),
        }
    }

    /// Advances every RayService's switchover to `now`, and, while a RayService's traffic
    /// moves, each of its target's applications' own (they move as soon as each is ready
    /// there, the rest of the traffic waiting for the whole); returns what changed.
    pub fn advance(
        &mut self,
        model: &Model,
        health: &HealthMap,
        dashboards: &DashboardStates,
        envoys: &dyn EnvoyWarmth,
        now: SystemTime,
    ) -> Vec<SwitchEvent> {
        let mut events = Vec::new();
        let mut next = BTreeMap::new();
        self.observe_capacity(model, dashboards, now);
        self.loads_since = std::mem::take(&mut self.judged);
        // (Kept for the pending clusters judged the round before: `judged` is rebuilt.)
        let loads_since = &self.loads_since;
        self.version_since
            .retain(|c, _| loads_since.contains_key(c));
        self.capacity_seen
            .retain(|c, _| loads_since.contains_key(c));
        self.judging.clear();
        self.judgeable.clear();
        let keys: BTreeSet<String> = model.services().iter().map(|s| s.key()).collect();
        self.rollbacks.retain(|key, _| keys.contains(key));
        self.baselines.retain(|key, _| keys.contains(key));
        self.promoted.retain(|key, _| keys.contains(key));
        for service in model.services() {
            let key = service.key();
            let known = self.services.contains_key(&key);
            // New here (a start, or a restart mid-switch) while the source names an active
            // cluster a peer does not serve yet (an early flip): traffic is where the peer
            // serves it, if the source still lists that cluster and does not name it as
            // where traffic goes next; the active cluster becomes a target like any other,
            // gated, not trusted. (Never the pending cluster: that would move traffic on
            // a peer's word.)
            // (Not where this replica knows it cannot serve: a peer's word, or a kept
            // one, never sends traffic to a cluster found failing here. Not knowing yet,
            // just after a start, is not failing: routes not re-read, say.)
            let serving = (!known)
                .then(|| {
                    self.peers
                        .serving(&key)
                        .into_iter()
                        .find(|c| {
                            *c != service.active_cluster
                                && service.pending_cluster.as_ref() != Some(c)
                                && service.cluster(c).is_some()
                                && !known_unable(service, c, health, dashboards)
                        })
                        .or_else(|| self.ready_instead_of_active(service, health, dashboards))
                })
                .flatten()
                .unwrap_or_else(|| service.active_cluster.clone());
            let pair = match self.services.get(&key) {
                Some(st) => judge::judged_pair(service, &st.serving, st.moved_from.as_deref()),
                None => {
                    let moved_from = self.peers.moved_from(&key, &serving);
                    judge::judged_pair(service, &serving, moved_from.as_deref())
                }
            };
            let rolled_back = self.outcome_round(service, &key, pair.as_ref(), dashboards, now);
            let st = self.advance_unit(
                &key,
                service,
                Unit::Service,
                serving,
                None,
                (known, rolled_back),
                health,
                dashboards,
                envoys,
                now,
                &mut events,
            );
            let (target, serving) = (st.target.clone(), st.serving.clone());
            let has_traffic = pair.is_some_and(|(judged, _)| st.weight_of(&judged) > 0);
            if self.judgeable.remove(&key) && has_traffic {
                self.judging.insert(key.clone());
            }
            next.insert(key.clone(), st);
            // Each application of the target moves on its own readiness, from where the
            // RayService's traffic is.
            let apps = target.as_deref().and_then(|t| service.cluster(t));
            // An application that failed on the new cluster sends those that moved there on
            // their own back to where the RayService's traffic is; so does a rollback or
            // an abort of the move (the switch of an early flip's applications has no
            // pending cluster to say where "back" is).
            let stopped = rolled_back
                || self
                    .defaults
                    .with(&service.policy.overrides.switchover)
                    .control
                    == Control::Abort;
            let back_to = target
                .as_deref()
                .filter(|t| stopped || has_failed_application(service, t, dashboards))
                .map(|_| serving.clone());
            for app in apps.into_iter().flat_map(|c| &c.applications) {
                let app_key = app_switch_key(&key, &app.name);
                let known = self.services.contains_key(&app_key);
                let st = self.advance_unit(
                    &app_key,
                    service,
                    Unit::Application(&app.name),
                    serving.clone(),
                    back_to.as_deref(),
                    (known, rolled_back),
                    health,
                    dashboards,
                    envoys,
                    now,
                    &mut events,
                );
                next.insert(app_key, st);
            }
        }
        self.services = next;
        events
    }

    /// For a RayService this replica meets with no word of where its traffic was (a
    /// start, or every replica restarted with nothing kept): when the source's active
    /// cluster is not ready and another cluster it lists (not the pending one) is, that
    /// one serves, and the active cluster becomes a target like any other. So a replica
    /// with no state never trusts an early flip to an unready cluster.
    fn ready_instead_of_active(
        &self,
        service: &crate::model::RayService,
        health: &HealthMap,
        dashboards: &DashboardStates,
    ) -> Option<String> {
        if self.ready_here(service, &service.active_cluster, health, dashboards) {
            return None;
        }
        service
            .clusters
            .iter()
            .map(|c| &c.name)
            .filter(|c| **c != service.active_cluster)
            .filter(|c| service.pending_cluster.as_ref() != Some(*c))
            .find(|c| self.ready_here(service, c, health, dashboards))
            .cloned()
    }

    /// Whether `service` is ready on `cluster` as this replica sees it (its dashboard and
    /// its probes), by the switchover's own readiness rule.
    fn ready_here(
        &self,
        service: &crate::model::RayService,
        cluster: &str,
        health: &HealthMap,
        dashboards: &DashboardStates,
    ) -> bool {
        let min = self
            .defaults
            .with(&service.policy.overrides.switchover)
            .min_ready_proxies;
        super::readiness::unit_readiness(
            service,
            cluster,
            Unit::Service,
            health,
            dashboards,
            min,
            None,
        )
        .is_ok()
    }

    /// Records every cluster's ready capacity per application, as its dashboard says
    /// now ([`CapacitySettle`]).
    fn observe_capacity(&mut self, model: &Model, dashboards: &DashboardStates, now: SystemTime) {
        let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for service in model.services() {
            let settle = self
                .defaults
                .with(&service.policy.overrides.switchover)
                .capacity_settle;
            for cluster in &service.clusters {
                let name = service.envoy_cluster_name(&cluster.name);
                let Some(status) = dashboards
                    .clusters
                    .get(&name)
                    .and_then(|d| d.status.as_deref())
                else {
                    continue;
                };
                for (app, a) in &status.applications {
                    if let Some(capacity) = a.capacity {
                        self.settle.observe(&name, app, capacity.ready, settle, now);
                        seen.entry(name.clone()).or_default().push(app.clone());
                    }
                }
            }
        }
        self.settle.forget_unseen(&seen);
    }

    /// Percent of traffic per cluster of every RayService it knows (only clusters with
    /// some); a RayService it does not know yet goes to its active cluster.
    pub fn weights(&self) -> BTreeMap<String, Vec<(String, u32)>> {
        self.services
            .iter()
            .map(|(key, s)| {
                let w = s.weights.iter().filter(|(_, w)| *w > 0).cloned().collect();
                (key.clone(), w)
            })
            .collect()
    }

    /// Dashboards to poll now, each asked once when a switch towards its cluster began.
    pub(crate) fn take_refresh_requests(&mut self) -> Vec<String> {
        std::mem::take(&mut self.refresh)
    }

    /// When time alone next changes something: a progressive step falls due, or a warm
    /// wait reaches its `warm_timeout`.
    pub(crate) fn next_wake(&self, now: SystemTime) -> Option<SystemTime> {
        let switching = self.in_progress();
        self.services
            .values()
            .filter_map(|s| match s.phase {
                Phase::Shifting => s.step_due,
                Phase::Warming => s.warming_since.map(|t| t + s.warm_timeout),
                Phase::Stable
                | Phase::Waiting
                | Phase::Rejected
                | Phase::Held
                | Phase::Aborted
                | Phase::RolledBack => None,
            })
            // A capacity level that comes to count matters only while something moves.
            .chain(switching.then(|| self.settle.next_due(now)).flatten())
            .min()
    }

    /// Whether any RayService has a switch under way (a target, ready or not).
    pub(crate) fn in_progress(&self) -> bool {
        self.services.values().any(|s| s.target.is_some())
    }

    /// Whether any RayService waits for Envoys to warm (or stop rejecting) its target:
    /// the pipeline re-runs when an Envoy ACKs or NACKs.
    pub(crate) fn warming(&self) -> bool {
        self.services
            .values()
            .any(|s| matches!(s.phase, Phase::Warming | Phase::Rejected))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::dashboard::{parse, AppStatus};
    use crate::live::dashboards::ClusterDashboard;
    use crate::live::health::{assess, Facts};
    use crate::live::probe::ProbeState;
    use crate::live::probe::ProxyProbe;
    use crate::live::prober::ProbeStates;
    use crate::model::test_support::service;
    use crate::model::RayCluster;
    use crate::pipeline::readiness::readiness;
    use crate::policy::switchover::{Control, SwitchoverOverrides};
    use crate::policy::Steps;
    use std::net::SocketAddr;
    use std::time::Duration;

    const A: &str = "a1";
    const B: &str = "b1";

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// RayService `s` with clusters a1 (port 8000) and b1 (port 9000), both with dashboards.
    fn model(active: &str, pending: Option<&str>, policy: SwitchoverOverrides) -> Model {
        let mut s = service("s", A, &[8000]);
        let mut b = service("s", B, &[9000]).clusters.remove(0);
        b.dashboard = Some("http://b".into());
        s.clusters[0].dashboard = Some("http://a".into());
        s.clusters.push(b);
        s.active_cluster = active.into();
        s.pending_cluster = pending.map(str::to_string);
        s.policy.overrides.switchover = policy;
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
            p.routes = Some(std::sync::Arc::new(
                [
                    "/hello".to_string(),
                    "/slow".to_string(),
                    "/broken".to_string(),
                ]
                .into(),
            ));
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
                    status: Some(status.into()),
                    // Answered "now" for every test time below.
                    last_success_unix: Some(1e9),
                    ..ClusterDashboard::new("http://x".into())
                },
            );
        }
    }

    impl World {
        fn health(&self, m: &Model) -> HealthMap {
            assess(m, &self.probes, &self.dashboards, Facts::default())
        }
    }

    fn advance(
        s: &mut Switchover,
        m: &Model,
        world: &World,
        envoys: &dyn EnvoyWarmth,
        now: SystemTime,
    ) -> Vec<SwitchEvent> {
        s.advance(m, &world.health(m), &world.dashboards, envoys, now)
    }

    fn weights(s: &Switchover) -> Vec<(String, u32)> {
        s.services["default/s"].weights.clone()
    }

    fn w(pairs: &[(&str, u32)]) -> Vec<(String, u32)> {
        pairs.iter().map(|(c, w)| (c.to_string(), *w)).collect()
    }

    const T0: SystemTime = SystemTime::UNIX_EPOCH;

    /// `model` with the applications of `03-deploying.json` (`hello` RUNNING, `slow` and
    /// `broken` DEPLOYING) listed on b1, as discovery gives them from its dashboard.
    fn model_with_apps(pending: Option<&str>, direct_ingress: bool) -> Model {
        let mut s = model(A, pending, SwitchoverOverrides::default()).services()[0].clone();
        let b = s.clusters.iter_mut().find(|c| c.name == B).unwrap();
        b.direct_ingress = direct_ingress;
        b.applications = ["broken", "hello", "slow"]
            .map(|name| crate::model::test_support::app(name, Some(&format!("/{name}")), &[]))
            .to_vec();
        Model::new(vec![s]).unwrap()
    }

    /// Each application moves on its own readiness: `hello`, RUNNING on b1, moves at once,
    /// while the RayService's other traffic (and `slow`, still DEPLOYING) waits for the
    /// whole cluster; once everything runs, the RayService moves and the applications'
    /// own switches end.
    #[test]
    fn an_application_ready_on_the_new_cluster_moves_without_waiting_for_the_others() {
        let m = model_with_apps(Some(B), false);
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        let mut s = Switchover::new(SwitchoverPolicy::default());
        let events = advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert_eq!(s.services["default/s"].phase, Phase::Waiting);
        let all = s.weights();
        assert_eq!(all["default/s#hello"], w(&[(B, 100)]), "{all:?}");
        assert_eq!(all["default/s#slow"], w(&[(A, 100)]));
        assert_eq!(all["default/s#broken"], w(&[(A, 100)]));
        assert!(
            s.services["default/s#slow"]
                .reason
                .contains("slow is DEPLOYING"),
            "{:?}",
            s.services["default/s#slow"]
        );
        assert!(events
            .iter()
            .any(|e| e.service == "default/s#hello" && e.reason.contains("moved to b1")));

        // A cold Envoy holds an application's move as it holds the RayService's.
        let mut s = Switchover::new(SwitchoverPolicy::default());
        let cold = ColdFor(vec!["default/s/b1"]);
        advance(&mut s, &m, &world, &cold, T0);
        assert_eq!(s.weights()["default/s#hello"], w(&[(A, 100)]));
        assert_eq!(s.services["default/s#hello"].phase, Phase::Warming);

        // Everything runs: the RayService moves, the applications' own switches end.
        let mut s = Switchover::new(SwitchoverPolicy::default());
        advance(&mut s, &m, &world, &(), T0);
        world.apps("default/s/b1", "02-running.json");
        // (02-running lists `hello` only: the others are no longer deployed there.)
        advance(&mut s, &m, &world, &(), T0 + Duration::from_secs(1));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert_eq!(s.weights().keys().collect::<Vec<_>>(), ["default/s"]);
    }

    /// A failed application on the new cluster holds every application's move: `hello` and
    /// `slow` are RUNNING there, `broken` DEPLOY_FAILED, and nothing moves; once `broken`
    /// is gone from the new cluster's answer, the running ones move; and one failing after
    /// that sends them back.
    #[test]
    fn a_failed_application_on_the_new_cluster_holds_every_application() {
        let m = model_with_apps(Some(B), false);
        let mut world = World::new();
        world.apps("default/s/b1", "04-mixed-settled.json");
        let mut s = Switchover::new(SwitchoverPolicy::default());
        advance(&mut s, &m, &world, &(), T0);
        let all = s.weights();
        for key in [
            "default/s",
            "default/s#hello",
            "default/s#slow",
            "default/s#broken",
        ] {
            assert_eq!(all[key], w(&[(A, 100)]), "{key}: {all:?}");
        }
        let hello = &s.services["default/s#hello"];
        assert_eq!(hello.phase, Phase::Waiting);
        assert!(
            hello.reason.contains("broken DEPLOY_FAILED"),
            "{:?}",
            hello.reason
        );
        world.apps("default/s/b1", "03-deploying.json");
        advance(&mut s, &m, &world, &(), T0 + Duration::from_secs(1));
        assert_eq!(s.weights()["default/s#hello"], w(&[(B, 100)]));
        // An application fails there after `hello` moved: `hello` goes back.
        world.apps("default/s/b1", "04-mixed-settled.json");
        advance(&mut s, &m, &world, &(), T0 + Duration::from_secs(2));
        assert_eq!(s.weights()["default/s#hello"], w(&[(A, 100)]));
        assert_eq!(weights(&s), w(&[(A, 100)]));
    }

    /// An early flip's applications move on their own as a pending cluster's do, and go
    /// back to where the RayService's traffic is when an application fails there, when
    /// the operator aborts, and when the new cluster is rolled back.
    #[test]
    fn an_early_flip_s_applications_go_back_when_the_move_stops() {
        let flip = |control: Control| {
            let mut s = model_with_apps(None, false).services()[0].clone();
            s.active_cluster = B.into();
            s.policy.overrides.switchover = controlled(control, Default::default());
            Model::new(vec![s]).unwrap()
        };
        let (auto, aborted) = (flip(Control::Auto), flip(Control::Abort));
        let at = |secs| T0 + Duration::from_secs(secs);
        let moved_on_its_own = |world: &World| {
            let mut s = Switchover::default();
            advance(&mut s, &model(A, None, Default::default()), world, &(), T0);
            advance(&mut s, &auto, world, &(), T0);
            assert_eq!(weights(&s), w(&[(A, 100)]));
            assert_eq!(s.weights()["default/s#hello"], w(&[(B, 100)]));
            s
        };
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        // An application fails on b1: `hello` goes back.
        let mut s = moved_on_its_own(&world);
        let mut failed = World::new();
        failed.apps("default/s/b1", "04-mixed-settled.json");
        advance(&mut s, &auto, &failed, &(), at(1));
        assert_eq!(s.weights()["default/s#hello"], w(&[(A, 100)]));
        // The operator aborts: `hello` goes back, at once.
        let mut s = moved_on_its_own(&world);
        advance(&mut s, &aborted, &world, &(), at(1));
        assert_eq!(s.weights()["default/s#hello"], w(&[(A, 100)]));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        // b1 fails a fifth of its requests: rolled back, `hello` with it.
        let mut s = moved_on_its_own(&world);
        s.set_loads(reported(&[
            ("default/s/b1", 80, 20),
            ("default/s/a1", 500, 1),
        ]));
        advance(&mut s, &auto, &world, &(), at(1));
        assert_eq!(phase(&s), Phase::RolledBack);
        assert_eq!(s.weights()["default/s#hello"], w(&[(A, 100)]));
    }

    /// An application whose replicas (direct ingress) are ready moves even with no proxy
    /// ready on the new cluster; one without replicas needs the proxies.
    #[test]
    fn an_application_with_ready_replicas_needs_no_ready_proxy() {
        let mut m = model_with_apps(Some(B), true);
        let mut svc = m.services()[0].clone();
        let b = svc.clusters.iter_mut().find(|c| c.name == B).unwrap();
        b.applications[1].http_replicas = vec![addr(30000)];
        m = Model::new(vec![svc]).unwrap();
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        world.proxy(9000, ProbeState::Unhealthy);
        world.proxy(30000, ProbeState::Healthy);
        let mut s = Switchover::new(SwitchoverPolicy::default());
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(s.weights()["default/s#hello"], w(&[(B, 100)]));
        world.proxy(30000, ProbeState::Unhealthy);
        let mut s = Switchover::new(SwitchoverPolicy::default());
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(s.weights()["default/s#hello"], w(&[(A, 100)]));
        assert!(s.services["default/s#hello"]
            .reason
            .contains("proxies healthy"));
    }

    /// Envoys that have warmed nothing of the clusters listed.
    struct ColdFor(Vec<&'static str>);

    impl EnvoyWarmth for ColdFor {
        fn cold_envoys(&self, cluster: &str) -> Vec<String> {
            if self.0.contains(&cluster) {
                vec!["envoy-1".into()]
            } else {
                Vec::new()
            }
        }
        fn rejecting_envoys(&self, _: &str) -> Vec<String> {
            Vec::new()
        }
    }

    #[test]
    fn an_upgrade_waits_for_readiness_then_moves_atomically() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        let mut s = Switchover::default();
        let m = model(A, Some(B), SwitchoverOverrides::default());
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert_eq!(s.services["default/s"].phase, Phase::Waiting);
        assert!(
            s.services["default/s"].reason.contains("DEPLOYING"),
            "{}",
            s.services["default/s"].reason
        );

        world.apps("default/s/b1", "02-running.json");
        let events = advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert_eq!(events.len(), 1, "logged once");
        // The source still calls b1 pending: traffic stays on b1.
        assert!(advance(&mut s, &m, &world, &(), T0).is_empty());
        assert_eq!(weights(&s), w(&[(B, 100)]));
        // The source promotes b1.
        let promoted = model(B, None, SwitchoverOverrides::default());
        advance(&mut s, &promoted, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert_eq!(s.services["default/s"].phase, Phase::Stable);
    }

    #[test]
    fn a_progressive_shift_steps_with_time_and_backs_off_when_unready() {
        let world = World::new();
        let policy = SwitchoverOverrides {
            steps: Some(Steps(vec![10, 50, 100])),
            interval: Some(Duration::from_secs(10)),
            ..Default::default()
        };
        let m = model(A, Some(B), policy);
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        advance(&mut s, &m, &world, &(), at(0));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        advance(&mut s, &m, &world, &(), at(5));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        advance(&mut s, &m, &world, &(), at(10));
        assert_eq!(weights(&s), w(&[(A, 50), (B, 50)]));
        assert_eq!(s.services["default/s"].phase, Phase::Shifting);
        // b1's proxy fails: traffic goes back and the shift waits.
        let mut sick = World::new();
        sick.proxy(9000, ProbeState::Unhealthy);
        advance(&mut s, &m, &sick, &(), at(11));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert_eq!(s.services["default/s"].phase, Phase::Waiting);
        // Ready again: the shift starts over.
        advance(&mut s, &m, &world, &(), at(12));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        advance(&mut s, &m, &world, &(), at(22));
        advance(&mut s, &m, &world, &(), at(32));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert_eq!(s.services["default/s"].phase, Phase::Stable);
    }

    #[test]
    fn an_early_flip_to_an_unready_cluster_keeps_the_old_one_serving() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        let mut s = Switchover::default();
        advance(
            &mut s,
            &model(A, None, SwitchoverOverrides::default()),
            &world,
            &(),
            T0,
        );
        // KubeRay names b1 active before its applications run (or after replacing a1).
        let flipped = model(B, None, SwitchoverOverrides::default());
        advance(&mut s, &flipped, &world, &(), T0);
        assert_eq!(
            weights(&s),
            w(&[(A, 100)]),
            "traffic follows readiness, not labels"
        );
        world.apps("default/s/b1", "02-running.json");
        advance(&mut s, &flipped, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn a_replica_with_no_state_serves_a_ready_listed_cluster_over_an_unready_active_one() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        // Started (or every replica restarted, nothing kept) after an early flip: the
        // source names b1 active while it deploys; a1 is listed and ready.
        let flipped = model(B, None, SwitchoverOverrides::default());
        let mut s = Switchover::default();
        advance(&mut s, &flipped, &world, &(), T0);
        assert_eq!(
            weights(&s),
            w(&[(A, 100)]),
            "no trust in an unready active cluster"
        );
        assert_eq!(s.services["default/s"].target.as_deref(), Some(B));
        world.apps("default/s/b1", "02-running.json");
        advance(&mut s, &flipped, &world, &(), T0);
        assert_eq!(
            weights(&s),
            w(&[(B, 100)]),
            "then it moves, gated as any target"
        );
        // A ready active cluster is trusted as it is, with nothing else listed or not.
        let mut fresh = Switchover::default();
        advance(&mut fresh, &flipped, &world, &(), T0);
        assert_eq!(weights(&fresh), w(&[(B, 100)]));
        // Nothing ready anywhere: the source's word stands.
        world.apps("default/s/a1", "03-deploying.json");
        world.apps("default/s/b1", "03-deploying.json");
        let mut fresh = Switchover::default();
        advance(&mut fresh, &flipped, &world, &(), T0);
        assert_eq!(weights(&fresh), w(&[(B, 100)]));
    }

    #[test]
    fn with_nothing_left_on_the_old_cluster_traffic_moves_anyway() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        world.proxy(8000, ProbeState::Unhealthy);
        let mut s = Switchover::default();
        advance(
            &mut s,
            &model(A, None, SwitchoverOverrides::default()),
            &world,
            &(),
            T0,
        );
        advance(
            &mut s,
            &model(B, None, SwitchoverOverrides::default()),
            &world,
            &(),
            T0,
        );
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert!(s.services["default/s"].reason.contains("no healthy proxy"));
    }

    /// The serving cluster's proxies awaiting their first probe (just after a restart)
    /// are not "nothing left": traffic does not move to a target that is not ready.
    #[test]
    fn proxies_awaiting_their_first_probe_are_not_nothing_left() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        world.probes.proxies.remove(&addr(8000));
        let m = model(B, None, SwitchoverOverrides::default());
        let mut s = Switchover::default();
        advance(
            &mut s,
            &model(A, None, SwitchoverOverrides::default()),
            &world,
            &(),
            T0,
        );
        let withheld: std::collections::BTreeSet<SocketAddr> = [addr(8000)].into();
        let health = assess(
            &m,
            &world.probes,
            &world.dashboards,
            Facts {
                withheld: Some(&withheld),
                ..Facts::default()
            },
        );
        s.advance(&m, &health, &world.dashboards, &(), T0);
        assert_eq!(
            weights(&s),
            w(&[(A, 100)]),
            "{}",
            s.services["default/s"].reason
        );
        // Once probed and found down, it is nothing left: traffic moves.
        world.proxy(8000, ProbeState::Unhealthy);
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn a_status_read_before_the_switch_began_is_not_readiness() {
        let mut world = World::new();
        let m = model(A, Some(B), SwitchoverOverrides::default());
        // b's dashboard last answered RUNNING at t=10; the upgrade starts at t=20.
        world
            .dashboards
            .clusters
            .get_mut("default/s/b1")
            .unwrap()
            .last_success_unix = Some(10.0);
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        advance(
            &mut s,
            &model(A, None, SwitchoverOverrides::default()),
            &world,
            &(),
            at(15),
        );
        advance(&mut s, &m, &world, &(), at(20));
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
        advance(&mut s, &m, &world, &(), at(21));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn grpc_moves_with_http_only_once_the_target_s_grpc_proxies_are_ready_and_warm() {
        let mut world = World::new();
        let mut m = model(A, Some(B), SwitchoverOverrides::default());
        m = m.with_proxies(|name, c| {
            let mut proxies = c.proxies.clone();
            if name == "default/s/b1" {
                proxies[0].grpc = Some(addr(9500));
            }
            proxies
        });
        world.proxy(9500, ProbeState::Unhealthy);
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(A, 100)]), "HTTP ready, gRPC not");
        let reason = &s.services["default/s"].reason;
        assert!(reason.contains("gRPC"), "{reason}");

        // gRPC ready, but one Envoy has not warmed the gRPC cluster yet.
        world.proxy(9500, ProbeState::Healthy);
        let envoys = Envoys(vec![
            ("e1", vec!["default/s/b1", "default/s/b1/grpc"]),
            ("e2", vec!["default/s/b1"]),
        ]);
        advance(&mut s, &m, &world, &envoys, T0);
        assert_eq!(weights(&s), w(&[(A, 100)]));
        let reason = &s.services["default/s"].reason;
        assert!(reason.contains("e2"), "{reason}");
        let warm = Envoys(vec![
            ("e1", vec!["default/s/b1", "default/s/b1/grpc"]),
            ("e2", vec!["default/s/b1", "default/s/b1/grpc"]),
        ]);
        advance(&mut s, &m, &world, &warm, T0);
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
        fn rejecting_envoys(&self, _: &str) -> Vec<String> {
            Vec::new()
        }
    }

    /// Envoys that have warmed everything but one rejected one cluster.
    struct OneRejects(&'static str, &'static str);

    impl EnvoyWarmth for OneRejects {
        fn cold_envoys(&self, _: &str) -> Vec<String> {
            Vec::new()
        }
        fn rejecting_envoys(&self, cluster: &str) -> Vec<String> {
            if cluster == self.1 {
                vec![self.0.to_string()]
            } else {
                Vec::new()
            }
        }
    }

    #[test]
    fn no_traffic_moves_to_a_target_an_envoy_rejected_however_long_it_waits() {
        let world = World::new();
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        let rejects_b = OneRejects("gw-2", "default/s/b1");
        for t in [0, 10, 60, 3600] {
            advance(&mut s, &m, &world, &rejects_b, at(t));
            assert_eq!(weights(&s), w(&[(A, 100)]), "at {t}s");
        }
        assert_eq!(s.services["default/s"].phase, Phase::Rejected);
        assert!(s.services["default/s"].reason.contains("gw-2"));
        assert!(
            s.warming(),
            "the pipeline re-runs when the Envoy answers again"
        );
        assert_eq!(s.next_wake(at(2)), None, "time alone changes nothing");
        // Once the Envoy takes it (its configuration changed), the switch goes ahead.
        advance(&mut s, &m, &world, &(), at(3601));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn traffic_moves_only_once_every_envoy_warmed_the_target() {
        let world = World::new();
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        let one_cold = Envoys(vec![
            ("gw-1", vec!["default/s/a1", "default/s/b1"]),
            ("gw-2", vec!["default/s/a1"]),
        ]);
        advance(&mut s, &m, &world, &one_cold, at(0));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        let st = &s.services["default/s"];
        assert_eq!(st.phase, Phase::Warming);
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
        advance(&mut s, &m, &world, &all_warm, at(1));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert!(!s.warming());
    }

    #[test]
    fn an_envoy_that_never_warms_holds_the_switch_only_for_warm_timeout() {
        let world = World::new();
        let policy = SwitchoverOverrides {
            warm_timeout: Some(Duration::from_secs(5)),
            steps: Some(Steps(vec![50, 100])),
            interval: Some(Duration::from_secs(10)),
            ..Default::default()
        };
        let m = model(A, Some(B), policy);
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        let stuck = Envoys(vec![("nacking", vec!["default/s/a1"])]);
        advance(&mut s, &m, &world, &stuck, at(0));
        advance(&mut s, &m, &world, &stuck, at(4));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        advance(&mut s, &m, &world, &stuck, at(5));
        assert_eq!(weights(&s), w(&[(A, 50), (B, 50)]));
        assert!(s.services["default/s"].reason.contains("nacking"));
        // Mid-shift, a newly connected cold Envoy does not roll the shift back.
        advance(&mut s, &m, &world, &stuck, at(15));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn a_target_that_turns_unready_while_warming_restarts_the_wait() {
        let world = World::new();
        let mut sick = World::new();
        sick.proxy(9000, ProbeState::Unhealthy);
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        let cold = Envoys(vec![("gw", vec![])]);
        advance(&mut s, &m, &world, &cold, at(0));
        advance(&mut s, &m, &sick, &cold, at(8));
        assert_eq!(s.services["default/s"].phase, Phase::Waiting);
        // Ready again at 9 s: the 10 s wait starts over, so it still holds at 18 s.
        advance(&mut s, &m, &world, &cold, at(9));
        advance(&mut s, &m, &world, &cold, at(18));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        advance(&mut s, &m, &world, &cold, at(19));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn with_nothing_healthy_left_traffic_does_not_wait_for_warming() {
        let mut world = World::new();
        world.proxy(8000, ProbeState::Unhealthy);
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &Envoys(vec![("gw", vec![])]), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn with_nothing_healthy_left_traffic_moves_even_to_a_target_an_envoy_rejected() {
        // Otherwise one client that NACKs the target (any ADS client can) would keep every
        // Envoy sending to a dead cluster; the rejecting Envoy keeps its own route.
        let mut world = World::new();
        world.proxy(8000, ProbeState::Unhealthy);
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &OneRejects("gw-2", "default/s/b1"), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn readiness_needs_enough_proxies_serving_every_route() {
        let world = World::new();
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let svc = &m.services()[0];
        assert!(readiness(svc, B, &world.health(&m), &world.dashboards, 1, None).is_ok());
        let err = readiness(svc, B, &world.health(&m), &world.dashboards, 2, None).unwrap_err();
        assert!(err.contains("1 of 1 proxies"), "{err}");
        let mut no_routes = World::new();
        no_routes
            .probes
            .proxies
            .get_mut(&addr(9000))
            .unwrap()
            .routes = Some(std::sync::Arc::new(["/".to_string()].into()));
        assert!(readiness(
            svc,
            B,
            &no_routes.health(&m),
            &no_routes.dashboards,
            1,
            None
        )
        .is_err());
        let mut stale = World::new();
        stale
            .dashboards
            .clusters
            .get_mut("default/s/b1")
            .unwrap()
            .stale = true;
        assert!(
            readiness(svc, B, &stale.health(&m), &stale.dashboards, 1, None)
                .unwrap_err()
                .contains("does not answer")
        );
        // No dashboard configured: the proxies alone decide.
        let mut plain = model(A, Some(B), SwitchoverOverrides::default()).services()[0].clone();
        plain
            .clusters
            .iter_mut()
            .for_each(|c: &mut RayCluster| c.dashboard = None);
        let plain_model = Model::new(vec![plain.clone()]).unwrap();
        let none = DashboardStates::default();
        let health = assess(&plain_model, &world.probes, &none, Facts::default());
        assert!(readiness(&plain, B, &health, &none, 1, None).is_ok());
    }

    /// What `from` tells its peers, as `live::peers` would deliver it to another replica.
    fn heard_from(from: &[&Switchover]) -> Arc<PeerStates> {
        let mut states = PeerStates {
            polled: true,
            ..Default::default()
        };
        for replica in from {
            // Through the wire format, as a peer reads it.
            let json = serde_json::to_vec(&replica.replica_view()).unwrap();
            let view: ReplicaView = serde_json::from_slice(&json).unwrap();
            for (key, switch) in view.services {
                states.services.entry(key).or_default().push(switch);
            }
            for (cluster, load) in &view.loads {
                states.loads.entry(cluster.clone()).or_default().push(*load);
            }
        }
        Arc::new(states)
    }

    fn steps_policy() -> SwitchoverOverrides {
        SwitchoverOverrides {
            steps: Some(Steps(vec![10, 25, 50, 100])),
            interval: Some(Duration::from_secs(10)),
            ..Default::default()
        }
    }

    /// Replicas fed the same state step together. The second replica finds the
    /// target ready 400 ms after the first (its probes ran later); alone, it would be a
    /// step behind for 400 ms after every step; hearing its peer, it takes the earlier
    /// start and agrees at every step.
    #[test]
    fn replicas_that_hear_each_other_step_together() {
        let world = World::new();
        let m = model(A, Some(B), steps_policy());
        let at = |ms: u64| T0 + Duration::from_millis(ms);
        let (mut one, mut two, mut alone) = (
            Switchover::default(),
            Switchover::default(),
            Switchover::default(),
        );
        advance(&mut one, &m, &world, &(), at(0));
        two.set_peers(heard_from(&[&one]));
        advance(&mut two, &m, &world, &(), at(400));
        advance(&mut alone, &m, &world, &(), at(400));
        let mut disagreed = 0;
        for t in (500..40_000).step_by(100) {
            one.set_peers(heard_from(&[&two]));
            two.set_peers(heard_from(&[&one]));
            advance(&mut one, &m, &world, &(), at(t));
            advance(&mut two, &m, &world, &(), at(t));
            advance(&mut alone, &m, &world, &(), at(t));
            assert_eq!(weights(&one), weights(&two), "at {t} ms");
            if weights(&alone) != weights(&one) {
                disagreed += 1;
            }
        }
        assert_eq!(weights(&two), w(&[(B, 100)]));
        // Without its peer, the late replica lags each of the 3 steps by 400 ms.
        assert_eq!(
            disagreed,
            3 * 4,
            "samples of 100 ms where the lone replica differs"
        );
    }

    #[test]
    fn a_restarted_replica_resumes_a_shift_where_its_peer_is() {
        let world = World::new();
        let m = model(A, Some(B), steps_policy());
        let at = |secs: u64| T0 + Duration::from_secs(secs);
        let mut one = Switchover::default();
        for t in [0, 10, 20, 25] {
            advance(&mut one, &m, &world, &(), at(t));
        }
        assert_eq!(weights(&one), w(&[(A, 50), (B, 50)]));
        // A new replica (or this one restarted) hears its peer before its first build.
        let mut restarted = Switchover::default();
        restarted.set_peers(heard_from(&[&one]));
        advance(&mut restarted, &m, &world, &(), at(25));
        assert_eq!(
            weights(&restarted),
            w(&[(A, 50), (B, 50)]),
            "not back to 10%"
        );
        advance(&mut restarted, &m, &world, &(), at(30));
        assert_eq!(weights(&restarted), w(&[(B, 100)]));
        // Without a peer it would start over.
        let mut lone = Switchover::default();
        advance(&mut lone, &m, &world, &(), at(25));
        assert_eq!(weights(&lone), w(&[(A, 90), (B, 10)]));
    }

    #[test]
    fn a_peer_that_moved_already_is_followed_once_this_replica_s_own_gates_pass() {
        let mut world = World::new();
        let m = model(A, Some(B), steps_policy());
        let mut done = Switchover::default();
        for t in [0, 10, 20, 30] {
            advance(&mut done, &m, &world, &(), T0 + Duration::from_secs(t));
        }
        assert_eq!(weights(&done), w(&[(B, 100)]));
        let mut restarted = Switchover::default();
        restarted.set_peers(heard_from(&[&done]));
        // Not ready here (its own probes say b1's proxy is down): the peer opens nothing.
        world.proxy(9000, ProbeState::Unhealthy);
        advance(
            &mut restarted,
            &m,
            &world,
            &(),
            T0 + Duration::from_secs(31),
        );
        assert_eq!(weights(&restarted), w(&[(A, 100)]));
        // Its own Envoy has not warmed b1: still nothing moves.
        world.proxy(9000, ProbeState::Healthy);
        let cold = Envoys(vec![("envoy-1", vec![])]);
        advance(
            &mut restarted,
            &m,
            &world,
            &cold,
            T0 + Duration::from_secs(32),
        );
        assert_eq!(restarted.services["default/s"].phase, Phase::Warming);
        assert_eq!(weights(&restarted), w(&[(A, 100)]));
        // Ready and warm: all of it at once, where the peer is.
        advance(
            &mut restarted,
            &m,
            &world,
            &(),
            T0 + Duration::from_secs(33),
        );
        assert_eq!(weights(&restarted), w(&[(B, 100)]));
    }

    #[test]
    fn a_peer_s_start_of_another_shift_or_from_the_future_changes_nothing() {
        let world = World::new();
        let m = model(A, Some(B), steps_policy());
        let peer = |serving: &str, target: &str, started: f64| {
            Arc::new(PeerStates {
                services: BTreeMap::from([(
                    "default/s".to_string(),
                    vec![PeerSwitch {
                        serving: serving.into(),
                        target: Some(target.into()),
                        target_since_unix: Some(started),
                        shift_started_unix: Some(started),
                        serving_since_unix: None,
                        moved: false,
                        moved_from: None,
                        rollback: None,
                        held_at: None,
                    }],
                )]),
                polled: true,
                ..Default::default()
            })
        };
        let at = T0 + Duration::from_secs(1000);
        for heard in [peer(B, A, 0.0), peer(A, "c1", 0.0), peer(A, B, 5000.0)] {
            let mut s = Switchover::default();
            s.set_peers(heard);
            advance(&mut s, &m, &world, &(), at);
            assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        }
    }

    /// A world where `hello` runs `a` (ready, full) requests at once on a1 and `b` on b1.
    fn sized(a: (u64, Option<u64>), b: (u64, Option<u64>)) -> World {
        let mut world = World::new();
        world.capacity("default/s/a1", a.0, a.1);
        world.capacity("default/s/b1", b.0, b.1);
        world
    }

    impl World {
        /// `hello` on `cluster` runs `ready` requests at once of `full` at full size.
        fn capacity(&mut self, cluster: &str, ready: u64, full: Option<u64>) {
            let d = self.dashboards.clusters.get_mut(cluster).unwrap();
            let mut status = (**d.status.as_ref().unwrap()).clone();
            status.applications.get_mut("hello").unwrap().capacity =
                Some(crate::live::dashboard::Capacity { ready, full });
            d.status = Some(status.into());
        }
    }

    impl World {
        /// `hello` on `cluster` reported `status`, resizing (only starting or stopping
        /// replicas) or not.
        fn hello_status(&mut self, cluster: &str, status: AppStatus, resizing: bool) {
            let d = self.dashboards.clusters.get_mut(cluster).unwrap();
            let mut s = (**d.status.as_ref().unwrap()).clone();
            let app = s.applications.get_mut("hello").unwrap();
            app.status = status;
            app.resizing = resizing;
            d.status = Some(s.into());
        }
    }

    /// KubeRay's incremental upgrade raises the new cluster's `target_capacity` after it
    /// has taken traffic (and shrinks the old one): Ray reports the application DEPLOYING
    /// while the new replicas start, and the ones RUNNING serve on. The share stays where
    /// the RUNNING replicas put it; it does not fall back onto the shrunk old cluster. A
    /// new version rolling out there (not only resizing) is not ready: traffic goes back.
    #[test]
    fn a_target_deploying_only_to_add_replicas_keeps_its_share() {
        let mut world = sized((8, Some(8)), (2, Some(8)));
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        advance(&mut s, &m, &world, &(), at(0));
        assert_eq!(weights(&s), w(&[(A, 80), (B, 20)]));
        world.capacity("default/s/a1", 6, Some(8));
        world.hello_status("default/s/b1", AppStatus::Deploying, true);
        advance(&mut s, &m, &world, &(), at(1));
        assert_eq!(
            weights(&s),
            w(&[(A, 75), (B, 25)]),
            "{}",
            s.services["default/s"].reason
        );
        // Its new replicas RUNNING, still DEPLOYING for the rest: counted once settled.
        world.capacity("default/s/b1", 4, Some(8));
        advance(&mut s, &m, &world, &(), at(7));
        assert_eq!(weights(&s), w(&[(A, 75), (B, 25)]), "not yet settled");
        advance(&mut s, &m, &world, &(), at(12));
        assert_eq!(weights(&s), w(&[(A, 60), (B, 40)]));
        // A replica of ray-xds started now agrees.
        let mut fresh = Switchover::default();
        advance(&mut fresh, &m, &world, &(), at(13));
        assert_eq!(weights(&fresh), weights(&s));
        // A new version rolling out on b1 (not only resizing): not ready, back to a1.
        world.hello_status("default/s/b1", AppStatus::Deploying, false);
        advance(&mut s, &m, &world, &(), at(14));
        assert_eq!(weights(&s), w(&[(A, 100)]));
    }

    /// The issue's case: a cluster of 4 replicas × 2 serving, the new one RUNNING with 1:
    /// it takes a fifth, more as it grows, and all once it can run what a1 can.
    #[test]
    fn traffic_moves_in_proportion_to_ready_capacity_and_completes_at_full_size() {
        let mut world = sized((8, Some(8)), (2, Some(8)));
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(A, 80), (B, 20)]));
        assert_eq!(s.services["default/s"].phase, Phase::Shifting);
        let reason = &s.services["default/s"].reason;
        assert!(
            reason.contains("ready capacity") && reason.contains("hello can run 2"),
            "{reason}"
        );
        // A replica restarted now derives the same weights from the same answers.
        let mut fresh = Switchover::default();
        advance(&mut fresh, &m, &world, &(), T0 + Duration::from_secs(60));
        assert_eq!(weights(&fresh), weights(&s));

        // b1 grows: its share follows once the rise has held for `capacity_settle` (5 s).
        let at = |secs| T0 + Duration::from_secs(secs);
        world.capacity("default/s/b1", 4, Some(8));
        advance(&mut s, &m, &world, &(), at(1));
        assert_eq!(weights(&s), w(&[(A, 80), (B, 20)]), "not yet");
        let reason = &s.services["default/s"].reason;
        assert!(reason.contains("2 more RUNNING there"), "{reason}");
        assert_eq!(s.next_wake(at(1)), Some(at(6)), "a round when it is due");
        advance(&mut s, &m, &world, &(), at(6));
        assert_eq!(weights(&s), w(&[(A, 67), (B, 33)]));
        // KubeRay shrinks a1 as b1 grows: a1's fall counts at once, b1's rise once it
        // has held; b1 still needs what a1 has at full size.
        world.capacity("default/s/a1", 4, Some(8));
        world.capacity("default/s/b1", 6, Some(8));
        advance(&mut s, &m, &world, &(), at(6));
        assert_eq!(weights(&s), w(&[(A, 50), (B, 50)]));
        advance(&mut s, &m, &world, &(), at(11));
        assert_eq!(weights(&s), w(&[(A, 40), (B, 60)]));
        world.capacity("default/s/b1", 8, Some(8));
        advance(&mut s, &m, &world, &(), at(12));
        assert_eq!(
            weights(&s),
            w(&[(A, 40), (B, 60)]),
            "the move completes settled too"
        );
        advance(&mut s, &m, &world, &(), at(17));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert_eq!(s.services["default/s"].phase, Phase::Stable);
        // A fall counts at once.
        let mut s = Switchover::default();
        let mut world = sized((8, Some(8)), (4, Some(8)));
        advance(&mut s, &m, &world, &(), at(0));
        world.capacity("default/s/b1", 2, Some(8));
        advance(&mut s, &m, &world, &(), at(0));
        assert_eq!(weights(&s), w(&[(A, 80), (B, 20)]));
        // A rise seen before the target turned unready (replicas restarting) still
        // settles when it is ready again.
        let mut deploying = sized((8, Some(8)), (8, Some(8)));
        deploying.apps("default/s/b1", "03-deploying.json");
        advance(&mut s, &m, &deploying, &(), at(1));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        let full = sized((8, Some(8)), (8, Some(8)));
        advance(&mut s, &m, &full, &(), at(2));
        assert_eq!(weights(&s), w(&[(A, 80), (B, 20)]));
        advance(&mut s, &m, &full, &(), at(7));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn the_schedule_bounds_a_capacity_weight_and_nothing_ready_moves_nothing() {
        let mut world = sized((8, Some(8)), (6, Some(8)));
        let m = model(A, Some(B), steps_policy());
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        advance(&mut s, &m, &world, &(), at(0));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]), "the first step");
        advance(&mut s, &m, &world, &(), at(20));
        assert_eq!(
            weights(&s),
            w(&[(A, 58), (B, 42)]),
            "capacity below the 50% step"
        );
        // RUNNING, no replica running: the route names a1 only.
        world.capacity("default/s/b1", 0, Some(8));
        advance(&mut s, &m, &world, &(), at(30));
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert_eq!(s.services["default/s"].phase, Phase::Shifting);
    }

    /// The progressive schedule bounds the rate of change: while capacity holds the
    /// target below the schedule's step, the schedule waits; when capacity lifts, the
    /// weight rises one step per interval from where it was held, not to where the
    /// schedule's clock would have taken it.
    #[test]
    fn a_weight_held_by_capacity_rises_a_step_per_interval_once_capacity_lifts() {
        let mut world = sized((8, Some(8)), (2, Some(8)));
        let m = model(A, Some(B), steps_policy());
        let mut s = Switchover::default();
        let at = |secs| T0 + Duration::from_secs(secs);
        for t in (0..=60).step_by(10) {
            advance(&mut s, &m, &world, &(), at(t));
            let expected = if t == 0 { 10 } else { 20 };
            assert_eq!(
                weights(&s),
                w(&[(A, 100 - expected), (B, expected)]),
                "at {t} s"
            );
        }
        // b1 runs at full size (counted 5 s later): the next step, then one per 10 s.
        world.capacity("default/s/b1", 8, Some(8));
        advance(&mut s, &m, &world, &(), at(61));
        assert_eq!(weights(&s), w(&[(A, 80), (B, 20)]));
        advance(&mut s, &m, &world, &(), at(66));
        assert_eq!(weights(&s), w(&[(A, 75), (B, 25)]), "not all at once");
        // (Held until 61 s: the 25% step counts from 51 s.)
        assert_eq!(s.next_wake(at(66)), Some(at(71)));
        advance(&mut s, &m, &world, &(), at(71));
        assert_eq!(weights(&s), w(&[(A, 50), (B, 50)]));
        advance(&mut s, &m, &world, &(), at(81));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    #[test]
    fn capacity_unknown_on_either_side_or_a_dead_serving_cluster_sets_no_limit() {
        let mut world = World::new();
        world.capacity("default/s/b1", 1, Some(8));
        let m = model(A, Some(B), SwitchoverOverrides::default());
        // a1's dashboard does not say: no limit.
        let d = world.dashboards.clusters.get_mut("default/s/a1").unwrap();
        let mut status = (**d.status.as_ref().unwrap()).clone();
        status.applications.get_mut("hello").unwrap().capacity = None;
        d.status = Some(status.into());
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));

        // a1's dashboard has not answered yet (a replica just started): nothing moves
        // until it has.
        world
            .dashboards
            .clusters
            .get_mut("default/s/a1")
            .unwrap()
            .status = None;
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(A, 100)]));
        assert!(s.services["default/s"].reason.contains("has not answered"));

        // a1 has nothing routable left: all to b1, whatever it can carry.
        let mut world = sized((8, Some(8)), (1, Some(8)));
        world.proxy(8000, ProbeState::Unhealthy);
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    /// KubeRay's incremental upgrade: the source caps the pending cluster's share; a
    /// replica restarted mid-upgrade derives the same weights.
    #[test]
    fn the_source_s_traffic_percent_caps_the_pending_cluster() {
        let world = World::new();
        let mut m = model(A, Some(B), SwitchoverOverrides::default()).services()[0].clone();
        m.pending_traffic_cap = Some(30);
        let m = Model::new(vec![m]).unwrap();
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(A, 70), (B, 30)]));
        assert!(s.services["default/s"].reason.contains("routes 30%"));
        let mut fresh = Switchover::default();
        advance(&mut fresh, &m, &world, &(), T0);
        assert_eq!(weights(&fresh), weights(&s));
        // At 0, nothing moves; at 100, the move completes.
        for (cap, want) in [(0, w(&[(A, 100)])), (100, w(&[(B, 100)]))] {
            let mut m = m.services()[0].clone();
            m.pending_traffic_cap = Some(cap);
            advance(&mut s, &Model::new(vec![m]).unwrap(), &world, &(), T0);
            assert_eq!(weights(&s), want, "{cap}");
        }
    }

    /// A replica restarted after its peer completed a move on capacity follows it, even
    /// if the target has lost a replica since (a completed move is not undone).
    #[test]
    fn a_peer_that_completed_a_move_on_capacity_is_followed() {
        let mut world = sized((8, Some(8)), (8, Some(8)));
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let mut done = Switchover::default();
        advance(&mut done, &m, &world, &(), T0);
        assert_eq!(weights(&done), w(&[(B, 100)]));
        world.capacity("default/s/b1", 6, Some(8));
        let mut restarted = Switchover::default();
        restarted.set_peers(heard_from(&[&done]));
        advance(&mut restarted, &m, &world, &(), T0 + Duration::from_secs(1));
        assert_eq!(weights(&restarted), w(&[(B, 100)]));
        // Alone, it would hold b1 at what it can carry.
        let mut alone = Switchover::default();
        advance(&mut alone, &m, &world, &(), T0 + Duration::from_secs(1));
        assert_eq!(weights(&alone), w(&[(A, 58), (B, 42)]));
    }

    /// The serving cluster's answer dropped (the dashboards' memory budget) or not yet
    /// given: the share stays where it was, never back to 0 nor up to 100.
    #[test]
    fn a_serving_answer_missing_keeps_the_share_where_it_was() {
        let mut world = sized((8, Some(8)), (4, Some(8)));
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(A, 67), (B, 33)]));
        world
            .dashboards
            .clusters
            .get_mut("default/s/a1")
            .unwrap()
            .status = None;
        advance(&mut s, &m, &world, &(), T0 + Duration::from_secs(1));
        assert_eq!(weights(&s), w(&[(A, 67), (B, 33)]));
        assert!(s.services["default/s"].reason.contains("has not answered"));
    }

    fn controlled(control: Control, base: SwitchoverOverrides) -> SwitchoverOverrides {
        SwitchoverOverrides {
            control: Some(control),
            ..base
        }
    }

    fn phase(s: &Switchover) -> Phase {
        s.services["default/s"].phase
    }

    /// A progressive switch from a1 to b1 at its second step (25%), 10 s in.
    fn at_second_step(world: &World) -> Switchover {
        let m = model(A, Some(B), steps_policy());
        let mut s = Switchover::default();
        advance(&mut s, &m, world, &(), T0);
        advance(&mut s, &m, world, &(), T0 + Duration::from_secs(10));
        assert_eq!(weights(&s), w(&[(A, 75), (B, 25)]));
        s
    }

    /// Hold: the target keeps the share it had, whatever the clock says; lifted, the
    /// schedule goes on from that step, not from where the time held would have taken it.
    #[test]
    fn an_operator_s_hold_keeps_the_target_s_share_and_lifting_it_resumes_the_schedule() {
        let world = World::new();
        let auto = model(A, Some(B), steps_policy());
        let held = model(A, Some(B), controlled(Control::Hold, steps_policy()));
        let at = |secs| T0 + Duration::from_secs(secs);
        let mut s = at_second_step(&world);
        let mut views = vec![];
        for t in [11, 30, 100] {
            advance(&mut s, &held, &world, &(), at(t));
            assert_eq!(weights(&s), w(&[(A, 75), (B, 25)]), "at {t} s");
            assert_eq!(phase(&s), Phase::Held);
            assert_eq!(s.next_wake(at(t)), None, "time changes nothing while held");
            views.push(s.replica_view());
        }
        assert!(
            views.windows(2).all(|v| v[0] == v[1]),
            "what peers read stays put while held (no rebuild loop between replicas)"
        );
        let st = &s.services["default/s"];
        assert!(st.reason.contains("held by the operator"));
        assert_eq!(st.control.as_deref(), Some("hold"));
        // Lifted long after the last round (nothing changed meanwhile): from the held
        // step, not from where the clock would be.
        advance(&mut s, &auto, &world, &(), at(1000));
        assert_eq!(weights(&s), w(&[(A, 75), (B, 25)]), "not 100% at once");
        assert_eq!(phase(&s), Phase::Shifting);
        assert_eq!(s.services["default/s"].control, None);
        advance(&mut s, &auto, &world, &(), at(1010));
        assert_eq!(weights(&s), w(&[(A, 50), (B, 50)]), "one step an interval");

        // A replica started while the hold stands (its peer's word, or what every
        // replica kept) holds the same share, not 0.
        let mut holding = at_second_step(&world);
        advance(&mut holding, &held, &world, &(), at(11));
        for peers in [heard_from(&[&holding]), kept_by(&[&holding], at(12))] {
            let mut restarted = Switchover::default();
            restarted.set_peers(peers);
            advance(&mut restarted, &held, &world, &(), at(12));
            assert_eq!(
                (weights(&restarted), phase(&restarted)),
                (w(&[(A, 75), (B, 25)]), Phase::Held)
            );
        }

        // Held before traffic moved: it stays on a1. A target that is not ready is
        // waiting, whatever the operator says.
        let mut fresh = Switchover::default();
        advance(&mut fresh, &held, &world, &(), at(0));
        assert_eq!(weights(&fresh), w(&[(A, 100)]));
        assert_eq!(phase(&fresh), Phase::Held);
        let mut deploying = World::new();
        deploying.apps("default/s/b1", "03-deploying.json");
        advance(&mut fresh, &held, &deploying, &(), at(1));
        assert_eq!(phase(&fresh), Phase::Waiting);
        // Held at 0 and lifted much later: the warmth gate first, then the first step.
        advance(&mut fresh, &held, &world, &(), at(2));
        assert_eq!(
            (weights(&fresh), phase(&fresh)),
            (w(&[(A, 100)]), Phase::Held)
        );
        let cold = ColdFor(vec!["default/s/b1"]);
        advance(&mut fresh, &auto, &world, &cold, at(600));
        assert_eq!(
            (weights(&fresh), phase(&fresh)),
            (w(&[(A, 100)]), Phase::Warming)
        );
        advance(&mut fresh, &auto, &world, &(), at(601));
        assert_eq!(weights(&fresh), w(&[(A, 90), (B, 10)]));

        // A peer that completed the move (before the hold reached it) is followed.
        let mut done = Switchover::default();
        advance(
            &mut done,
            &model(A, Some(B), Default::default()),
            &world,
            &(),
            at(0),
        );
        assert_eq!(weights(&done), w(&[(B, 100)]));
        let mut follower = Switchover::default();
        follower.set_peers(heard_from(&[&done]));
        advance(&mut follower, &held, &world, &(), at(1));
        assert_eq!(weights(&follower), w(&[(B, 100)]));

        // Held by capacity too: a share that falls stays down, and gains nothing back.
        let mut world = sized((8, Some(8)), (4, Some(8)));
        let auto = model(A, Some(B), SwitchoverOverrides::default());
        let held = model(A, Some(B), controlled(Control::Hold, Default::default()));
        let mut s = Switchover::default();
        advance(&mut s, &auto, &world, &(), at(0));
        assert_eq!(weights(&s), w(&[(A, 67), (B, 33)]));
        world.capacity("default/s/b1", 2, Some(8));
        advance(&mut s, &held, &world, &(), at(1));
        assert_eq!(weights(&s), w(&[(A, 80), (B, 20)]));
        world.capacity("default/s/b1", 8, Some(8));
        advance(&mut s, &held, &world, &(), at(2));
        assert_eq!(weights(&s), w(&[(A, 80), (B, 20)]));
        advance(&mut s, &auto, &world, &(), at(3));
        assert_eq!(
            weights(&s),
            w(&[(A, 80), (B, 20)]),
            "the rise settles first"
        );
        advance(&mut s, &auto, &world, &(), at(7));
        assert_eq!(weights(&s), w(&[(B, 100)]), "lifted: atomic moves at once");

        // Nothing routable left on a1: traffic moves whatever the operator says.
        let mut dead = World::new();
        dead.proxy(8000, ProbeState::Unhealthy);
        let mut s = Switchover::default();
        advance(&mut s, &held, &dead, &(), at(0));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    /// Promote: past the schedule and the capacity limit, never past readiness, warmth
    /// or the source's own cap.
    #[test]
    fn an_operator_s_promote_skips_schedule_and_capacity_but_no_gate_nor_the_source_cap() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        let promoted = model(A, Some(B), controlled(Control::Promote, steps_policy()));
        let mut s = Switchover::default();
        advance(&mut s, &promoted, &world, &(), T0);
        assert_eq!((weights(&s), phase(&s)), (w(&[(A, 100)]), Phase::Waiting));
        let mut world = sized((8, Some(8)), (2, Some(8)));
        let cold = ColdFor(vec!["default/s/b1"]);
        advance(&mut s, &promoted, &world, &cold, T0);
        assert_eq!((weights(&s), phase(&s)), (w(&[(A, 100)]), Phase::Warming));
        advance(&mut s, &promoted, &world, &(), T0);
        assert_eq!((weights(&s), phase(&s)), (w(&[(B, 100)]), Phase::Stable));
        assert!(
            s.services["default/s"].reason.contains("promoted"),
            "{}",
            s.services["default/s"].reason
        );

        // KubeRay's incremental upgrade routes 30%: so do we.
        world.capacity("default/s/b1", 8, Some(8));
        let mut capped = promoted.services()[0].clone();
        capped.pending_traffic_cap = Some(30);
        let capped = Model::new(vec![capped]).unwrap();
        let mut s = Switchover::default();
        advance(&mut s, &capped, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(A, 70), (B, 30)]));
    }

    /// Abort: the pending cluster gets nothing; traffic that moved there goes back to the
    /// active cluster, through the same gates; an application's own switch too.
    #[test]
    fn an_operator_s_abort_takes_traffic_off_the_pending_cluster_and_back_from_it() {
        let world = World::new();
        let auto = model(A, Some(B), steps_policy());
        let aborted = model(A, Some(B), controlled(Control::Abort, steps_policy()));
        let at = |secs| T0 + Duration::from_secs(secs);
        let mut s = at_second_step(&world);
        for t in [11, 100] {
            advance(&mut s, &aborted, &world, &(), at(t));
            assert_eq!((weights(&s), phase(&s)), (w(&[(A, 100)]), Phase::Aborted));
        }
        assert!(s.services["default/s"].reason.contains("aborted"));
        // Lifted: the shift starts over.
        advance(&mut s, &auto, &world, &(), at(101));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));

        // Moved already: back to a1 once it is ready and warm (at once, though the
        // schedule is progressive).
        let auto = model(A, Some(B), steps_policy());
        let aborted = model(A, Some(B), controlled(Control::Abort, steps_policy()));
        let mut s = Switchover::default();
        for t in [0, 10, 20, 30] {
            advance(&mut s, &auto, &world, &(), at(t));
        }
        assert_eq!(weights(&s), w(&[(B, 100)]));
        let mut a1_down = World::new();
        a1_down.proxy(8000, ProbeState::Unhealthy);
        advance(&mut s, &aborted, &a1_down, &(), at(1));
        assert_eq!((weights(&s), phase(&s)), (w(&[(B, 100)]), Phase::Waiting));
        advance(
            &mut s,
            &aborted,
            &world,
            &ColdFor(vec!["default/s/a1"]),
            at(2),
        );
        assert_eq!((weights(&s), phase(&s)), (w(&[(B, 100)]), Phase::Warming));
        advance(&mut s, &aborted, &world, &(), at(3));
        assert_eq!((weights(&s), phase(&s)), (w(&[(A, 100)]), Phase::Stable));
        advance(&mut s, &aborted, &world, &(), at(4));
        assert_eq!((weights(&s), phase(&s)), (w(&[(A, 100)]), Phase::Aborted));

        // A replica restarted while its peers wait on b1 for a1 to be ready again (a1's
        // application redeploying) does not send everything to a1 meanwhile.
        let mut a1_deploying = World::new();
        a1_deploying.apps("default/s/a1", "03-deploying.json");
        let mut survivor = Switchover::default();
        for t in [0, 10, 20, 30] {
            advance(&mut survivor, &auto, &world, &(), at(t));
        }
        advance(&mut survivor, &aborted, &a1_deploying, &(), at(31));
        assert_eq!(weights(&survivor), w(&[(B, 100)]));
        let mut restarted = Switchover::default();
        restarted.set_peers(heard_from(&[&survivor]));
        advance(&mut restarted, &aborted, &a1_deploying, &(), at(35));
        assert_eq!(weights(&restarted), w(&[(B, 100)]));
        advance(&mut restarted, &aborted, &a1_deploying, &(), at(36));
        assert_eq!(
            (weights(&restarted), phase(&restarted)),
            (w(&[(B, 100)]), Phase::Waiting)
        );
        advance(&mut restarted, &aborted, &world, &(), at(37));
        assert_eq!(weights(&restarted), w(&[(A, 100)]));

        // Each application's own switch stops too.
        let mut m = model_with_apps(Some(B), false).services()[0].clone();
        m.policy.overrides.switchover = controlled(Control::Abort, Default::default());
        let m = Model::new(vec![m]).unwrap();
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &(), at(0));
        let all = s.weights();
        assert_eq!(all["default/s#hello"], w(&[(A, 100)]), "{all:?}");
        assert_eq!(s.services["default/s#hello"].phase, Phase::Aborted);

        // Nothing routable left on a1: b1 serves, aborted or not.
        let mut s = Switchover::default();
        advance(&mut s, &aborted, &a1_down, &(), at(0));
        assert_eq!(weights(&s), w(&[(B, 100)]));
    }

    /// What Envoys reported: (cluster, succeeded, failed) over the outcome window.
    fn reported(pairs: &[(&str, u64, u64)]) -> LoadTotals {
        pairs
            .iter()
            .map(|(c, ok, failed)| {
                let counts = crate::xds::lrs::LoadCounts {
                    succeeded: *ok,
                    failed: *failed,
                    issued: ok + failed,
                    in_progress_peak: 0,
                };
                (c.to_string(), counts)
            })
            .collect()
    }

    /// What b1 ran while it deployed, with no traffic, does not count as its capacity
    /// when its failures are judged: a peak of 3 in flight is within the 5 it runs once
    /// traffic moves, so its 5xx are its own, and it is rolled back at once.
    #[test]
    fn a_capacity_seen_before_traffic_does_not_hold_a_verdict() {
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let at = |secs| T0 + Duration::from_secs(secs);
        let mut s = Switchover::default();
        for t in 0..3 {
            advance(&mut s, &m, &world, &(), at(t));
            assert_eq!(weights(&s), w(&[(A, 100)]), "b1 deploys (capacity 0)");
        }
        world.apps("default/s/b1", "02-running.json");
        advance(&mut s, &m, &world, &(), at(3));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        let mut loads = reported(&[("default/s/b1", 80, 20), ("default/s/a1", 500, 1)]);
        loads.get_mut("default/s/b1").unwrap().in_progress_peak = 3;
        s.set_loads(loads.clone());
        advance(&mut s, &m, &world, &(), at(4));
        assert_eq!(phase(&s), Phase::RolledBack);
        // Over its capacity now (6 in flight against 5): no verdict, its 5xx may be
        // Ray's backpressure.
        let mut s2 = Switchover::default();
        advance(&mut s2, &m, &world, &(), at(3));
        loads.get_mut("default/s/b1").unwrap().in_progress_peak = 6;
        s2.set_loads(loads);
        advance(&mut s2, &m, &world, &(), at(4));
        assert_eq!((weights(&s2), phase(&s2)), (w(&[(B, 100)]), Phase::Stable));
    }

    /// b1's applications redeployed with a new config (a new version of the cluster).
    fn redeploy(world: &mut World, cluster: &str) {
        let d = world.dashboards.clusters.get_mut(cluster).unwrap();
        let mut status = (**d.status.as_ref().unwrap()).clone();
        for app in status.applications.values_mut() {
            app.deployed_at = app.deployed_at.map(|t| t + 60.0);
            app.config_digest = app.config_digest.as_ref().map(|d| format!("{d}-v2"));
        }
        d.status = Some(status.into());
    }

    /// b1's applications redeployed with the same config at another `target_capacity`
    /// (KubeRay's incremental upgrade): Ray moves the deploy time only.
    fn retarget(world: &mut World, cluster: &str) {
        let d = world.dashboards.clusters.get_mut(cluster).unwrap();
        let mut status = (**d.status.as_ref().unwrap()).clone();
        for app in status.applications.values_mut() {
            app.deployed_at = app.deployed_at.map(|t| t + 30.0);
        }
        d.status = Some(status.into());
    }

    /// Outcomes: a pending cluster failing a fifth of its requests, against a fraction of
    /// a percent on the active one, goes back to no traffic, and stays there with no
    /// reports left; peers and a restarted replica take the decision; a new version of
    /// the cluster, or the operator's promote, clears it.
    #[test]
    fn a_new_cluster_whose_requests_fail_is_rolled_back_until_a_new_version_or_promote() {
        let mut world = World::new();
        let auto = model(A, Some(B), steps_policy());
        let at = |secs| T0 + Duration::from_secs(secs);
        let mut s = at_second_step(&world);
        assert_eq!(
            s.judged_clusters().keys().collect::<Vec<_>>(),
            ["default/s/a1", "default/s/b1"]
        );
        // Too few ended there yet: nothing decided.
        s.set_loads(reported(&[
            ("default/s/b1", 20, 10),
            ("default/s/a1", 500, 1),
        ]));
        advance(&mut s, &auto, &world, &(), at(11));
        assert_eq!(weights(&s), w(&[(A, 75), (B, 25)]));
        // Within the margin (5 points above a1's 0.2%): nothing decided.
        s.set_loads(reported(&[
            ("default/s/b1", 95, 5),
            ("default/s/a1", 500, 1),
        ]));
        advance(&mut s, &auto, &world, &(), at(12));
        assert_eq!(weights(&s), w(&[(A, 75), (B, 25)]));
        s.set_loads(reported(&[
            ("default/s/b1", 80, 20),
            ("default/s/a1", 500, 1),
        ]));
        let events = advance(&mut s, &auto, &world, &(), at(13));
        assert_eq!(
            (weights(&s), phase(&s)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        assert!(events.iter().any(|e| e.phase == Phase::RolledBack));
        let st = &s.services["default/s"];
        assert!(st.reason.contains("20 of 100"), "{}", st.reason);
        assert_eq!(st.rollback.as_ref().map(|r| r.cluster.as_str()), Some(B));
        // The reports age out of the window (b1 gets nothing now): still rolled back.
        s.set_loads(LoadTotals::new());
        for t in [14, 100, 1000] {
            advance(&mut s, &auto, &world, &(), at(t));
            assert_eq!(
                (weights(&s), phase(&s)),
                (w(&[(A, 100)]), Phase::RolledBack)
            );
        }
        assert_eq!(s.next_wake(at(1000)), None, "time alone changes nothing");
        // A replica restarted meanwhile takes its peer's decision.
        let mut restarted = Switchover::default();
        restarted.set_peers(heard_from(&[&s]));
        advance(&mut restarted, &auto, &world, &(), at(1001));
        assert_eq!(
            (weights(&restarted), phase(&restarted)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        // KubeRay raises b1's target_capacity (the same config redeployed): still the
        // version judged, still rolled back, its reports still counted from its deploy.
        let counted_from = s.judged_clusters()["default/s/b1"];
        retarget(&mut world, "default/s/b1");
        advance(&mut s, &auto, &world, &(), at(1001));
        assert_eq!(
            (weights(&s), phase(&s)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        assert_eq!(s.judged_clusters()["default/s/b1"], counted_from);
        // A new version of b1: the shift starts over, counted from its own deploy.
        redeploy(&mut world, "default/s/b1");
        advance(&mut s, &auto, &world, &(), at(1002));
        assert!(s.judged_clusters()["default/s/b1"] > counted_from);
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
        assert!(s.rollback("default/s").is_none());
        // A peer's decision on the old version is not taken for the new one.
        let mut fresh = Switchover::default();
        fresh.set_peers(heard_from(&[&restarted]));
        advance(&mut fresh, &auto, &world, &(), at(1003));
        assert_eq!(weights(&fresh), w(&[(A, 90), (B, 10)]));

        // The operator promotes a rolled-back cluster: it moves, and the decision goes.
        let promoted = model(A, Some(B), controlled(Control::Promote, steps_policy()));
        s.set_loads(reported(&[
            ("default/s/b1", 80, 20),
            ("default/s/a1", 500, 1),
        ]));
        advance(&mut s, &auto, &world, &(), at(1004));
        assert_eq!(phase(&s), Phase::RolledBack);
        advance(&mut s, &promoted, &world, &(), at(1005));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert!(s.rollback("default/s").is_none());
        // Back to auto: the operator's word on this version stands.
        advance(&mut s, &auto, &world, &(), at(1006));
        assert_eq!((weights(&s), phase(&s)), (w(&[(B, 100)]), Phase::Stable));
        assert!(!s.judging());
    }

    /// An early flip (the source names b1 active while traffic is still on a1, which it
    /// still lists) is judged as a pending cluster is: b1 failing a fifth of its requests
    /// goes back to no traffic and stays there while a1 is listed, a peer takes the
    /// decision, and once the source drops a1 there is nothing to go back to.
    #[test]
    fn an_early_flip_whose_requests_fail_is_rolled_back_while_the_old_cluster_is_listed() {
        let world = World::new();
        let at = |secs| T0 + Duration::from_secs(secs);
        let flipped = model(B, None, steps_policy());
        let mut s = Switchover::default();
        advance(&mut s, &model(A, None, steps_policy()), &world, &(), T0);
        advance(&mut s, &flipped, &world, &(), T0);
        advance(&mut s, &flipped, &world, &(), at(10));
        assert_eq!(weights(&s), w(&[(A, 75), (B, 25)]));
        assert_eq!(
            s.judged_clusters().keys().collect::<Vec<_>>(),
            ["default/s/a1", "default/s/b1"]
        );
        assert!(s.judging(), "b1 has traffic and may be rolled back");
        s.set_loads(reported(&[
            ("default/s/b1", 80, 20),
            ("default/s/a1", 500, 1),
        ]));
        advance(&mut s, &flipped, &world, &(), at(11));
        assert_eq!(
            (weights(&s), phase(&s)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        let st = &s.services["default/s"];
        assert!(st.reason.contains("returns to) a1"), "{}", st.reason);
        s.set_loads(LoadTotals::new());
        for t in [12, 100, 1000] {
            advance(&mut s, &flipped, &world, &(), at(t));
            assert_eq!(
                (weights(&s), phase(&s)),
                (w(&[(A, 100)]), Phase::RolledBack),
                "at {t} s"
            );
        }
        // A replica restarted meanwhile serves a1 with its peer and takes the decision.
        let mut restarted = Switchover::default();
        restarted.set_peers(heard_from(&[&s]));
        advance(&mut restarted, &flipped, &world, &(), at(1001));
        assert_eq!(
            (weights(&restarted), phase(&restarted)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        // The operator's promote clears it: the shift starts over.
        let promoted = model(B, None, controlled(Control::Promote, steps_policy()));
        let mut p = restarted.clone();
        advance(&mut p, &promoted, &world, &(), at(1002));
        assert!(p.rollback("default/s").is_none());
        assert_eq!(weights(&p), w(&[(B, 100)]));
        // The source drops a1: nothing to go back to, and nothing held.
        let only_b = {
            let mut m = service("s", B, &[9000]);
            m.clusters[0].dashboard = Some("http://b".into());
            m.policy.overrides.switchover = steps_policy();
            Model::new(vec![m]).unwrap()
        };
        advance(&mut s, &only_b, &world, &(), at(1002));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert!(s.rollback("default/s").is_none());
    }

    /// An early flip that completed at once (atomic) is judged while the source still
    /// lists the cluster the move came from, and goes back there, at once; a replica
    /// restarted after the move takes where it came from from its peer and judges alike.
    #[test]
    fn a_completed_early_flip_whose_requests_fail_goes_back_while_the_old_cluster_is_listed() {
        let world = World::new();
        let at = |secs| T0 + Duration::from_secs(secs);
        let flipped = model(B, None, SwitchoverOverrides::default());
        let mut s = Switchover::default();
        advance(&mut s, &model(A, None, Default::default()), &world, &(), T0);
        advance(&mut s, &flipped, &world, &(), T0);
        assert_eq!(weights(&s), w(&[(B, 100)]));
        assert!(
            s.judging(),
            "b1 is judged against a1, where the move came from"
        );
        let mut restarted = Switchover::default();
        restarted.set_peers(heard_from(&[&s]));
        advance(&mut restarted, &flipped, &world, &(), at(1));
        assert_eq!(weights(&restarted), w(&[(B, 100)]));
        assert!(
            restarted.judging(),
            "the peer's move says where it came from"
        );
        for r in [&mut s, &mut restarted] {
            r.set_loads(reported(&[("default/s/b1", 80, 20)]));
            advance(r, &flipped, &world, &(), at(2));
            assert_eq!((weights(r), phase(r)), (w(&[(A, 100)]), Phase::RolledBack));
            let st = &r.services["default/s"];
            assert!(st.reason.contains("returns to) a1"), "{}", st.reason);
            r.set_loads(LoadTotals::new());
            advance(r, &flipped, &world, &(), at(100));
            assert_eq!((weights(r), phase(r)), (w(&[(A, 100)]), Phase::RolledBack));
        }
        // Which cluster a move came from is what a replica saw, not what is listed.
        let mut three = flipped.services()[0].clone();
        let mut c = three.clusters[0].clone();
        c.name = "c1".into();
        c.proxies.clear();
        three.clusters.push(c);
        let pair = Some((B.to_string(), A.to_string()));
        assert_eq!(judge::judged_pair(&three, B, None), None);
        assert_eq!(judge::judged_pair(&three, B, Some(A)), pair);
        assert_eq!(judge::judged_pair(&three, A, None), pair);
        assert_eq!(judge::judged_pair(&three, B, Some("gone")), None);
    }

    /// A cluster listed beside the active one, which traffic never moved from (a standby),
    /// is no way back: the active cluster failing is not rolled back to it, and an
    /// abort with no move under way keeps traffic where it is.
    #[test]
    fn a_listed_standby_is_no_way_back() {
        let world = World::new();
        let at = |secs| T0 + Duration::from_secs(secs);
        let steady = model(A, None, SwitchoverOverrides::default());
        let mut s = Switchover::default();
        advance(&mut s, &steady, &world, &(), T0);
        assert!(!s.judging());
        s.set_loads(reported(&[("default/s/a1", 90, 10)]));
        advance(&mut s, &steady, &world, &(), at(1));
        advance(&mut s, &steady, &world, &(), at(2));
        assert_eq!(
            (weights(&s), phase(&s), s.rollback("default/s").is_none()),
            (w(&[(A, 100)]), Phase::Stable, true)
        );
        let aborted = model(A, None, controlled(Control::Abort, Default::default()));
        let mut fresh = Switchover::default();
        for t in [3, 4, 5] {
            advance(&mut s, &aborted, &world, &(), at(t));
            advance(&mut fresh, &aborted, &world, &(), at(t));
        }
        assert_eq!(
            weights(&s),
            w(&[(A, 100)]),
            "{}",
            s.services["default/s"].reason
        );
        assert_eq!(weights(&fresh), w(&[(A, 100)]));
    }

    /// The operator's abort stops an early flip's move as it stops a pending cluster's:
    /// all traffic on the cluster it is still served from, at once.
    #[test]
    fn an_operator_s_abort_stops_an_early_flip() {
        let world = World::new();
        let at = |secs| T0 + Duration::from_secs(secs);
        let mut s = Switchover::default();
        advance(&mut s, &model(A, None, steps_policy()), &world, &(), T0);
        let flipped = model(B, None, steps_policy());
        advance(&mut s, &flipped, &world, &(), T0);
        advance(&mut s, &flipped, &world, &(), at(10));
        assert_eq!(weights(&s), w(&[(A, 75), (B, 25)]));
        let aborted = model(B, None, controlled(Control::Abort, steps_policy()));
        advance(&mut s, &aborted, &world, &(), at(11));
        assert_eq!((weights(&s), phase(&s)), (w(&[(A, 100)]), Phase::Aborted));
        // Lifted: the shift starts over.
        advance(&mut s, &flipped, &world, &(), at(12));
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
    }

    /// The round that first gives the pending cluster traffic asks for its reports at
    /// once: with nothing else changing, the next build would otherwise come only with
    /// the schedule's next step (an atomic move: never).
    #[test]
    fn the_round_that_gives_the_new_cluster_traffic_asks_for_its_reports() {
        let world = World::new();
        let at = |secs| T0 + Duration::from_secs(secs);
        for policy in [steps_policy(), SwitchoverOverrides::default()] {
            let m = model(A, Some(B), policy);
            let mut s = Switchover::default();
            advance(&mut s, &m, &world, &(), at(0));
            assert!(s.weight_of_b() > 0);
            assert!(s.judging(), "{:?}", s.services["default/s"]);
        }
        // Before it has any, nothing to ask for.
        let mut waiting = World::new();
        waiting.apps("default/s/b1", "03-deploying.json");
        let mut s = Switchover::default();
        advance(
            &mut s,
            &model(A, Some(B), steps_policy()),
            &waiting,
            &(),
            at(0),
        );
        assert!(!s.judging());
    }

    impl Switchover {
        fn weight_of_b(&self) -> u32 {
            self.services["default/s"].weight_of(B)
        }
    }

    /// After a completed move the active cluster ends nothing: the new one is judged
    /// against what the active cluster had when it last ended enough, not against 0%.
    #[test]
    fn a_completed_move_is_judged_against_the_active_cluster_s_last_figures() {
        let world = World::new();
        let auto = model(A, Some(B), steps_policy());
        let at = |secs| T0 + Duration::from_secs(secs);
        let mut s = at_second_step(&world);
        assert!(s.judging(), "b1 has a share: its reports may decide");
        // a1 fails 3%, b1 7%: within the margin.
        s.set_loads(reported(&[
            ("default/s/b1", 93, 7),
            ("default/s/a1", 970, 30),
        ]));
        for t in [20, 30] {
            advance(&mut s, &auto, &world, &(), at(t));
        }
        assert_eq!(weights(&s), w(&[(B, 100)]));
        s.set_loads(reported(&[("default/s/b1", 930, 70)]));
        advance(&mut s, &auto, &world, &(), at(31));
        assert_eq!((weights(&s), phase(&s)), (w(&[(B, 100)]), Phase::Stable));
        assert!(s.judging());
        // 9% against a1's 3%: rolled back.
        s.set_loads(reported(&[("default/s/b1", 91, 9)]));
        advance(&mut s, &auto, &world, &(), at(32));
        let why = &s.rollback("default/s").unwrap().why;
        assert!(why.contains("3.0%"), "{why}");
        // Back on a1 at once, and shown rolled back from that round on.
        assert_eq!(
            (weights(&s), phase(&s)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        advance(&mut s, &auto, &world, &(), at(33));
        assert_eq!(
            (weights(&s), phase(&s)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        assert!(!s.judging(), "nothing to judge while rolled back");
    }

    /// A decision a peer took while the version was unknown takes the version once it is
    /// known, so a redeploy after that clears it.
    #[test]
    fn a_decision_on_an_unknown_version_is_cleared_by_a_later_redeploy() {
        let mut world = World::new();
        let auto = model(A, Some(B), steps_policy());
        let at = |secs| T0 + Duration::from_secs(secs);
        let mut peer = at_second_step(&world);
        peer.set_loads(reported(&[("default/s/b1", 0, 100)]));
        advance(&mut peer, &auto, &world, &(), at(11));
        let mut states = (*heard_from(&[&peer])).clone();
        for switch in states.services.values_mut().flatten() {
            if let Some(r) = &mut switch.rollback {
                r.version = None;
            }
        }
        let mut s = Switchover::default();
        s.set_peers(Arc::new(states));
        advance(&mut s, &auto, &world, &(), at(12));
        assert_eq!(phase(&s), Phase::RolledBack);
        assert!(s.rollback("default/s").unwrap().version.is_some());
        s.set_peers(Arc::default());
        redeploy(&mut world, "default/s/b1");
        advance(&mut s, &auto, &world, &(), at(13));
        assert!(s.rollback("default/s").is_none());
        assert_eq!(weights(&s), w(&[(A, 90), (B, 10)]));
    }

    /// A move that completed to a pending cluster whose requests then fail goes back to
    /// the active cluster, through its gates, at once; the applications' own switches
    /// stop too.
    #[test]
    fn a_completed_move_to_a_failing_cluster_goes_back_and_its_applications_stay() {
        let world = World::new();
        let m = model(A, Some(B), SwitchoverOverrides::default());
        let at = |secs| T0 + Duration::from_secs(secs);
        let mut s = Switchover::default();
        advance(&mut s, &m, &world, &(), at(0));
        assert_eq!(weights(&s), w(&[(B, 100)]));
        // a1 ended nothing in the window: b1 is judged against 0%.
        s.set_loads(reported(&[("default/s/b1", 90, 10)]));
        // The way back waits for a1 to be warmed: the phase says so, the reason says
        // both.
        advance(&mut s, &m, &world, &ColdFor(vec!["default/s/a1"]), at(1));
        assert_eq!((weights(&s), phase(&s)), (w(&[(B, 100)]), Phase::Warming));
        let reason = &s.services["default/s"].reason;
        assert!(
            reason.contains("too few") && reason.contains("the way back waits"),
            "{reason}"
        );
        assert!(s.services["default/s"].rollback.is_some());
        advance(&mut s, &m, &world, &(), at(2));
        assert_eq!(
            (weights(&s), phase(&s)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        advance(&mut s, &m, &world, &(), at(3));
        assert_eq!(
            (weights(&s), phase(&s)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );

        // (b1's `slow` still deploying: `hello` moves on its own.)
        let apps = model_with_apps(Some(B), false);
        let mut world = World::new();
        world.apps("default/s/b1", "03-deploying.json");
        let mut s = Switchover::default();
        advance(&mut s, &apps, &world, &(), at(0));
        assert_eq!(s.weights()["default/s#hello"], w(&[(B, 100)]));
        s.set_loads(reported(&[("default/s/b1", 0, 100)]));
        advance(&mut s, &apps, &world, &(), at(1));
        advance(&mut s, &apps, &world, &(), at(2));
        let all = s.weights();
        assert_eq!(all["default/s#hello"], w(&[(A, 100)]), "{all:?}");
        assert_eq!(s.services["default/s#hello"].phase, Phase::RolledBack);
    }

    /// A replica's entry in the store (`live::state_store`) as its keeper writes it at
    /// `written`, superseding what it read at start (`took_in`), through the wire format.
    fn entry_of(
        replica: &Switchover,
        key: &str,
        written: SystemTime,
        took_in: &[(String, f64)],
    ) -> (String, Result<crate::live::state_store::KeptView, String>) {
        use crate::live::state_store::{kept, KeptView};
        let entry = KeptView {
            written_unix: crate::live::peers::to_unix(written),
            view: kept(replica.replica_view(), written, Duration::from_secs(900)),
            supersedes: took_in.to_vec(),
        };
        let json = serde_json::to_string(&entry).unwrap();
        (key.to_string(), Ok(serde_json::from_str(&json).unwrap()))
    }

    /// What a replica started at `now` takes from the store holding `entries`: the views
    /// its peer poller adds to its peers', and what its own entry will supersede.
    fn read_back(
        entries: Vec<(String, Result<crate::live::state_store::KeptView, String>)>,
        now: SystemTime,
    ) -> (Arc<PeerStates>, Vec<(String, f64)>) {
        let ttl = Duration::from_secs(900);
        let read = crate::live::state_store::remembered(entries, now, ttl);
        let views = read.views.into_iter().map(|(_, v)| v).collect();
        (
            Arc::new(PeerStates::merge(views, "this-replica")),
            read.taken_in,
        )
    }

    /// What replicas kept, each writing at `now`, read back at `now`.
    fn kept_by(from: &[&Switchover], now: SystemTime) -> Arc<PeerStates> {
        let entries = from
            .iter()
            .enumerate()
            .map(|(i, s)| entry_of(s, &format!("replica-{i}.json"), now, &[]))
            .collect();
        read_back(entries, now).0
    }

    /// Every replica restarted at once: what no input gives again comes back from what
    /// they kept: a progressive shift's progress, a rollback decision, and traffic kept
    /// on the old cluster after the source flipped early to the new one.
    #[test]
    fn a_replica_started_after_every_replica_stopped_resumes_from_what_they_kept() {
        let world = World::new();
        let at = |secs| T0 + Duration::from_secs(secs);
        // A shift at its second step (25%).
        let pending = model(A, Some(B), steps_policy());
        let one = at_second_step(&world);
        assert_eq!(weights(&one), w(&[(A, 75), (B, 25)]));
        let mut fresh = Switchover::default();
        advance(&mut fresh, &pending, &world, &(), at(11));
        assert_eq!(
            weights(&fresh),
            w(&[(A, 90), (B, 10)]),
            "nothing kept: over"
        );
        let mut resumed = Switchover::default();
        resumed.set_peers(kept_by(&[&one], at(11)));
        advance(&mut resumed, &pending, &world, &(), at(11));
        assert_eq!(weights(&resumed), weights(&one));

        // The source flips to b1 mid-shift (KubeRay's standard upgrade promotes a
        // RUNNING cluster): the shift goes on from a1 on its schedule, and so it does on
        // a replica started with what was kept; one with nothing takes b1 whole at once.
        let flipped = model(B, None, steps_policy());
        let mut one = at_second_step(&world);
        advance(&mut one, &flipped, &world, &(), at(11));
        assert_eq!(one.services["default/s"].serving, A);
        let mut fresh = Switchover::default();
        advance(&mut fresh, &flipped, &world, &(), at(12));
        assert_eq!(weights(&fresh), w(&[(B, 100)]));
        let mut resumed = Switchover::default();
        resumed.set_peers(kept_by(&[&one], at(12)));
        advance(&mut resumed, &flipped, &world, &(), at(12));
        assert_eq!(resumed.services["default/s"].serving, A);
        assert_eq!(weights(&resumed), weights(&one));

        // A rollback decision survives, and a replica with it sends b1 nothing.
        let mut one = at_second_step(&world);
        one.set_loads(reported(&[
            ("default/s/b1", 40, 20),
            ("default/s/a1", 500, 0),
        ]));
        advance(&mut one, &pending, &world, &(), at(11));
        advance(&mut one, &pending, &world, &(), at(12));
        assert_eq!(
            (weights(&one), phase(&one)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        let mut resumed = Switchover::default();
        resumed.set_peers(kept_by(&[&one], at(13)));
        advance(&mut resumed, &pending, &world, &(), at(13));
        assert_eq!(
            (weights(&resumed), phase(&resumed)),
            (w(&[(A, 100)]), Phase::RolledBack)
        );
        // Kept longer ago than the ttl (900 s): left out.
        let entries = vec![entry_of(&one, "replica-0.json", at(13), &[])];
        assert_eq!(read_back(entries.clone(), at(13 + 899)).0.services.len(), 1);
        assert!(read_back(entries, at(13 + 900)).0.services.is_empty());
    }

    /// Incarnations: a replica's entry supersedes what it read at start, so an older
    /// incarnation's decision that a newer one took in and changed does not come back
    /// after every replica restarts: the operator's promote of a rolled-back cluster
    /// stands, and a completed move stays completed (even while an Envoy is cold for the
    /// cluster traffic moved to). A kept rollback on an unknown version is not taken, so a
    /// redeploy is not rolled back on it. And a cluster a kept view serves is taken only
    /// where it is ready here.
    #[test]
    fn a_newer_incarnation_s_entry_supersedes_what_it_took_in() {
        let world = World::new();
        let at = |secs| T0 + Duration::from_secs(secs);
        let auto = model(A, Some(B), steps_policy());
        let promote = model(A, Some(B), controlled(Control::Promote, steps_policy()));
        // Incarnation 0 rolls b1 back, writes at 11 s, and dies.
        let mut zero = at_second_step(&world);
        zero.set_loads(reported(&[
            ("default/s/b1", 0, 100),
            ("default/s/a1", 500, 0),
        ]));
        advance(&mut zero, &auto, &world, &(), at(11));
        assert_eq!(phase(&zero), Phase::RolledBack);
        let entry0 = entry_of(&zero, "replica-0.json", at(11), &[]);
        // Incarnation 1 takes it in, the operator promotes b1, then leaves it to ray-xds.
        let (peers, took_in) = read_back(vec![entry0.clone()], at(12));
        let mut one = Switchover::default();
        one.set_peers(peers);
        advance(&mut one, &auto, &world, &(), at(12));
        assert_eq!(phase(&one), Phase::RolledBack);
        advance(&mut one, &promote, &world, &(), at(20));
        advance(&mut one, &auto, &world, &(), at(30));
        assert_eq!(
            (weights(&one), phase(&one)),
            (w(&[(B, 100)]), Phase::Stable)
        );
        let entry1 = entry_of(&one, "replica-1.json", at(30), &took_in);
        // Every replica restarts: the promote stands.
        let (peers, _) = read_back(vec![entry0.clone(), entry1.clone()], at(60));
        let mut two = Switchover::default();
        two.set_peers(peers);
        advance(&mut two, &auto, &world, &(), at(60));
        assert_eq!(
            weights(&two),
            w(&[(B, 100)]),
            "the operator's promote stands"
        );
        // Without the supersession (incarnation 1 had read nothing), it would not.
        let unrelated = entry_of(&one, "replica-1.json", at(30), &[]);
        let (peers, _) = read_back(vec![entry0, unrelated], at(60));
        let mut two = Switchover::default();
        two.set_peers(peers);
        advance(&mut two, &auto, &world, &(), at(60));
        assert_eq!(weights(&two), w(&[(A, 100)]));

        // A completed move: incarnation 0 was mid-shift, incarnation 1 moved and the
        // source promoted b1 (a1 still listed). A restart with an Envoy cold for b1
        // (reconnecting) keeps b1 serving.
        let pending = model(A, Some(B), steps_policy());
        let promoted = model(B, None, steps_policy());
        let mid = at_second_step(&world);
        let entry0 = entry_of(&mid, "replica-0.json", at(10), &[]);
        let (peers, took_in) = read_back(vec![entry0.clone()], at(11));
        let mut one = Switchover::default();
        one.set_peers(peers);
        for t in [11, 20, 30, 31] {
            advance(&mut one, &pending, &world, &(), at(t));
        }
        advance(&mut one, &promoted, &world, &(), at(40));
        assert_eq!(weights(&one), w(&[(B, 100)]));
        let entry1 = entry_of(&one, "replica-1.json", at(40), &took_in);
        let (peers, _) = read_back(vec![entry0.clone(), entry1], at(60));
        let mut two = Switchover::default();
        two.set_peers(peers);
        advance(
            &mut two,
            &promoted,
            &world,
            &ColdFor(vec!["default/s/b1"]),
            at(60),
        );
        assert_eq!(two.services["default/s"].serving, B);
        assert_eq!(weights(&two), w(&[(B, 100)]));
        // A kept view serving a1 (incarnation 0's alone): taken only while a1 is ready.
        let mut a1_down = World::new();
        a1_down.proxy(8000, ProbeState::Unhealthy);
        let (peers, _) = read_back(vec![entry0], at(60));
        let mut two = Switchover::default();
        two.set_peers(peers);
        advance(&mut two, &promoted, &a1_down, &(), at(60));
        assert_eq!(two.services["default/s"].serving, B, "a1 is not ready here");

        // A rollback decided on an unknown version, kept: not taken (a redeploy would be
        // rolled back on it).
        let mut zero = at_second_step(&world);
        zero.set_loads(reported(&[("default/s/b1", 0, 100)]));
        advance(&mut zero, &auto, &world, &(), at(11));
        let mut view = zero.replica_view();
        for switch in view.services.values_mut() {
            if let Some(r) = &mut switch.rollback {
                r.version = None;
            }
        }
        let entry = crate::live::state_store::KeptView {
            written_unix: crate::live::peers::to_unix(at(11)),
            view,
            supersedes: Vec::new(),
        };
        let (peers, _) = read_back(vec![("replica-0.json".into(), Ok(entry))], at(12));
        let mut s = Switchover::default();
        s.set_peers(peers);
        advance(&mut s, &auto, &world, &(), at(12));
        assert!(s.rollback("default/s").is_none());
    }

    /// Each replica hears only its own Envoys: what they report is summed over the
    /// replicas, so two that each heard too few to judge decide alike on the whole.
    #[test]
    fn replicas_judge_what_every_envoy_reported_and_decide_alike() {
        let world = World::new();
        let auto = model(A, Some(B), steps_policy());
        let at = |secs| T0 + Duration::from_secs(secs);
        let mut one = at_second_step(&world);
        let mut two = at_second_step(&world);
        one.set_loads(reported(&[
            ("default/s/b1", 20, 10),
            ("default/s/a1", 250, 0),
        ]));
        two.set_loads(reported(&[
            ("default/s/b1", 25, 5),
            ("default/s/a1", 250, 1),
        ]));
        advance(&mut one, &auto, &world, &(), at(11));
        advance(&mut two, &auto, &world, &(), at(11));
        assert_eq!(weights(&one), w(&[(A, 75), (B, 25)]), "30 ended: too few");
        one.set_peers(heard_from(&[&two]));
        two.set_peers(heard_from(&[&one]));
        advance(&mut one, &auto, &world, &(), at(12));
        advance(&mut two, &auto, &world, &(), at(12));
        for s in [&one, &two] {
            assert_eq!((weights(s), phase(s)), (w(&[(A, 100)]), Phase::RolledBack));
            let why = &s.rollback("default/s").unwrap().why;
            assert!(why.contains("15 of 60"), "{why}");
        }
    }
}

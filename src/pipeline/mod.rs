//! The pipeline: from what ray-xds knows (the effective model, probe states, dashboards,
//! the Envoys' warmth) to the snapshot Envoy gets. Pure: [`Pipeline::build`] takes its
//! inputs and the time, and returns the snapshot, what it decided and when time alone
//! would change the answer ([`Output::wake_at`]); [`task`] is the thin loop that feeds it
//! from channels and publishes what it returns.
//!
//! One build, in order:
//! 1. clusters the source dropped stay, draining, for their grace period ([`departed`]);
//!    ingress replicas that left their application stay while its route moves
//!    ([`leaving`]);
//! 2. proxies new since the last snapshot are withheld until their first probe (at most
//!    the probe policy's first-probe wait): Envoy would count them healthy while unknown;
//! 3. `live::health` decides every endpoint's health (the one authority);
//! 4. the [`switchover`] advances each RayService's weights, reading that health;
//! 5. `translate` builds the Envoy resources, encoding again only those whose inputs
//!    changed since the last build ([`Incremental`]), and `xds` checks and versions them
//!    into a snapshot, refusing one that is inconsistent (then the previous one stays).
//!
//! Invariants: state carried between builds (switchover, departed clusters, what was
//! published) changes only here; nothing here reads a clock or does I/O.

pub(crate) mod capacity;
pub mod departed;
pub(crate) mod leaving;
pub mod outcomes;
pub(crate) mod readiness;
pub(crate) mod settle;
pub mod switchover;
pub(crate) mod task;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use crate::config::GatewaySettings;
use crate::live::dashboards::DashboardStates;
use crate::live::health::{Assessor, Facts, HealthMap};
use crate::live::probe::ProbeState;
use crate::live::prober::ProbeStates;
use crate::model::Model;
use crate::policy::Policies;
use crate::translate::Incremental;
use crate::xds::Snapshot;

use self::departed::Departed;
use self::leaving::Leaving;
use self::switchover::{EnvoyWarmth, SwitchEvent, Switchover};

/// What one build reads.
pub struct Inputs<'a> {
    /// The effective model: the source's, with discovered proxies.
    pub model: &'a Arc<Model>,
    pub probes: &'a ProbeStates,
    pub dashboards: &'a DashboardStates,
    /// Which connected Envoys have warmed which clusters.
    pub envoys: &'a dyn EnvoyWarmth,
}

/// Something a build decided that is worth a log line and a metric.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Switch(SwitchEvent),
    FailOpenStarted(String),
    FailOpenEnded(String),
    /// Translation gave resources that do not fit together (a bug): not published.
    Inconsistent(String),
}

/// What one build gives.
pub struct Output {
    /// The snapshot to serve (the previous one when this build's was refused).
    pub snapshot: Arc<Snapshot>,
    pub health: Arc<HealthMap>,
    pub switchover: Arc<Switchover>,
    pub events: Vec<Event>,
    /// Envoy clusters whose dashboard should be asked again now.
    pub refresh: Vec<String>,
    /// When time alone changes the answer: build again then, even without new input.
    pub wake_at: Option<SystemTime>,
    /// Build again when an Envoy ACKs clusters or endpoints (a switch waits for warmth).
    pub wake_on_ack: bool,
}

/// The pipeline's state between builds.
pub struct Pipeline {
    policies: Policies,
    gateway: GatewaySettings,
    switchover: Switchover,
    departed: Departed,
    leaving: Leaving,
    /// The last build's model (departed clusters included), whose replicas may leave.
    last_model: Arc<Model>,
    /// Proxies the last snapshot had.
    published: BTreeSet<SocketAddr>,
    /// The model `published` was taken from, when nothing was withheld from it.
    published_of: Option<Arc<Model>>,
    last_source: Arc<Model>,
    /// Health, judged again only where its inputs changed.
    assessor: Assessor,
    fail_open: BTreeSet<String>,
    last: Option<Arc<Snapshot>>,
    /// What the other replicas say (departed clusters they keep).
    peers: Arc<crate::live::peers::PeerStates>,
    addresses: crate::model::AddressPolicy,
    /// Translation's memo: what the last build encoded, reused where unchanged.
    translator: Incremental,
}

impl Pipeline {
    pub fn new(policies: Policies, gateway: GatewaySettings) -> Pipeline {
        Pipeline {
            switchover: Switchover::new(policies.switchover.clone()),
            policies,
            gateway,
            departed: Departed::default(),
            leaving: Leaving::default(),
            last_model: Arc::new(Model::default()),
            published: BTreeSet::new(),
            published_of: None,
            last_source: Arc::new(Model::default()),
            assessor: Assessor::default(),
            fail_open: BTreeSet::new(),
            last: None,
            peers: Arc::default(),
            addresses: Default::default(),
            translator: Incremental::default(),
        }
    }

    /// What the other replicas say of their switches, for the next builds.
    pub fn set_peers(&mut self, peers: Arc<crate::live::peers::PeerStates>) {
        self.switchover.set_peers(peers.clone());
        self.peers = peers;
    }

    /// What this replica's own Envoys reported over the outcome window, for the next
    /// builds (the switchover adds its peers').
    pub fn set_loads(&mut self, own: outcomes::LoadTotals) {
        self.switchover.set_loads(own);
    }

    /// How far back load reports count (`switchover.outcome_window`).
    pub fn outcome_window(&self) -> std::time::Duration {
        self.policies.switchover.outcome_window
    }

    /// This replica's id, which its switchover view carries to its peers.
    pub(crate) fn with_replica_id(mut self, id: String) -> Pipeline {
        self.switchover.set_replica_id(id);
        self
    }

    /// The address policy proxies taken from peers (departed clusters) must pass.
    pub(crate) fn with_addresses(mut self, addresses: crate::model::AddressPolicy) -> Pipeline {
        self.addresses = addresses;
        self
    }

    /// When the proxies of `model` that the last snapshot lacks stop waiting for their
    /// first probe; `None` when none waits. A caller that just saw the model change may
    /// wait (for probes, at most until then) so that the change goes out once, with
    /// health, instead of twice.
    pub(crate) fn first_probes_due(
        &self,
        model: &Model,
        probes: &ProbeStates,
        now: SystemTime,
    ) -> Option<SystemTime> {
        self.awaiting_first_probe(model, probes, now)
            .map(|(_, until)| until)
            .max()
    }

    /// New proxies without a first probe, each with when it stops waiting (in the future).
    fn awaiting_first_probe<'a>(
        &'a self,
        model: &'a Model,
        probes: &'a ProbeStates,
        now: SystemTime,
    ) -> impl Iterator<Item = (SocketAddr, SystemTime)> + 'a {
        let wait = self.policies.probe.first_probe_wait();
        // The model the last build published whole: every endpoint is published, none
        // new (the common build, after a probe changed: no walk of every endpoint).
        let all_published = self
            .published_of
            .as_ref()
            .is_some_and(|m| std::ptr::eq(Arc::as_ptr(m), model));
        // A departed cluster's proxies are not probed: they only drain. (Adopted ones
        // never share an address with the source: `Departed::adopt`.)
        let mut departed = if all_published {
            BTreeSet::new()
        } else {
            self.departed.addresses()
        };
        if !departed.is_empty() {
            let source: BTreeSet<SocketAddr> =
                self.last_source.endpoints().map(|(a, _)| a).collect();
            departed.retain(|a| !source.contains(a));
        }
        model
            .endpoints()
            .take(if all_published { 0 } else { usize::MAX })
            .map(|(address, _)| address)
            .filter(move |a| !self.published.contains(a) && !departed.contains(a))
            .filter_map(move |address| {
                let until = match probes.proxies.get(&address) {
                    Some(p) if p.state != ProbeState::Unknown => return None,
                    Some(p) => p.since + wait,
                    None => now + wait,
                };
                (until > now).then_some((address, until))
            })
    }

    /// Notes which proxies this build publishes: `model`'s but the `withheld`.
    fn note_published(&mut self, model: &Arc<Model>, withheld: &BTreeSet<SocketAddr>) {
        // The same model with nothing withheld, now and at the last build: the same set.
        let unchanged = withheld.is_empty()
            && self
                .published_of
                .as_ref()
                .is_some_and(|m| Arc::ptr_eq(m, model));
        if !unchanged {
            self.published = model
                .endpoints()
                .map(|(address, _)| address)
                .filter(|a| !withheld.contains(a))
                .collect();
        }
        self.published_of = withheld.is_empty().then(|| model.clone());
    }

    pub fn build(&mut self, inputs: &Inputs<'_>, now: SystemTime) -> Output {
        let source = inputs.model;
        self.departed.adopt(
            &self.peers.departed,
            source,
            &self.policies.switchover,
            &self.addresses,
            now,
        );
        let model =
            self.departed
                .update_shared(&self.last_source, source, &self.policies.switchover, now);
        self.last_source = source.clone();
        let next = self.leaving.update_shared(&self.last_model, &model, now);
        // What left is judged against what the source and dashboards list, not against
        // what is still held.
        self.last_model = model;
        let model = next;

        let awaiting: Vec<(SocketAddr, SystemTime)> = self
            .awaiting_first_probe(&model, inputs.probes, now)
            .collect();
        let withheld: BTreeSet<SocketAddr> = awaiting.iter().map(|(a, _)| *a).collect();
        let departed = self.departed.envoy_cluster_names();
        let leaving = self.leaving.held();
        let health = self.assessor.assess_shared(
            &model,
            inputs.probes,
            inputs.dashboards,
            Facts {
                withheld: Some(&withheld),
                departed: Some(&departed),
                leaving: Some(&leaving),
            },
        );
        self.note_published(&model, &withheld);

        let mut events: Vec<Event> = self
            .switchover
            .advance(source, &health, inputs.dashboards, inputs.envoys, now)
            .into_iter()
            .map(Event::Switch)
            .collect();
        let refresh = self.switchover.take_refresh_requests();

        let fail_open: BTreeSet<String> =
            health.fail_open().into_iter().map(str::to_string).collect();
        events.extend(
            fail_open
                .difference(&self.fail_open)
                .cloned()
                .map(Event::FailOpenStarted),
        );
        events.extend(
            self.fail_open
                .difference(&fail_open)
                .cloned()
                .map(Event::FailOpenEnded),
        );
        self.fail_open = fail_open;

        let encoded = self.translator.translate(
            &model,
            &health,
            &self.switchover.weights(),
            &self.gateway,
            &self.policies.traffic,
        );
        let snapshot = match Snapshot::build_encoded(&encoded, self.last.as_deref()) {
            Ok(s) => Arc::new(s),
            Err(why) => {
                events.push(Event::Inconsistent(why.to_string()));
                self.last
                    .clone()
                    .unwrap_or_else(|| Arc::new(Snapshot::default()))
            }
        };
        self.last = Some(snapshot.clone());

        self.switchover.set_departed(self.departed.view());
        let wake_at = [
            self.switchover.next_wake(now),
            awaiting.iter().map(|(_, until)| *until).min(),
            self.departed.next_expiry(),
            self.leaving.next_expiry(),
        ]
        .into_iter()
        .flatten()
        .min();
        Output {
            snapshot,
            health: Arc::new(health),
            switchover: Arc::new(self.switchover.clone()),
            events,
            refresh,
            wake_at,
            wake_on_ack: self.switchover.warming(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::dashboard::parse;
    use crate::live::dashboards::ClusterDashboard;
    use crate::live::probe::ProxyProbe;
    use crate::model::test_support::service;
    use crate::model::{Model, RayService};
    use crate::policy::switchover::SwitchoverOverrides;
    use crate::policy::Steps;
    use crate::xds::ResourceType;
    use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use envoy_types::pb::envoy::config::route::v3::{route, route_action, RouteConfiguration};
    use prost::Message;
    use std::time::Duration;

    const T0: SystemTime = SystemTime::UNIX_EPOCH;

    fn at(ms: u64) -> SystemTime {
        T0 + Duration::from_millis(ms)
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// What the world looks like to one build.
    #[derive(Default)]
    struct World {
        probes: ProbeStates,
        dashboards: DashboardStates,
    }

    impl World {
        fn probe(&mut self, port: u16, state: ProbeState, since: SystemTime) {
            let mut p = ProxyProbe::new(since);
            p.state = state;
            p.routes = Some(std::sync::Arc::new(["/hello".to_string()].into()));
            self.probes.proxies.insert(addr(port), p);
        }

        fn running(&mut self, cluster: &str) {
            let path = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/ray-serve-2.60/02-running.json"
            );
            let status = parse(&std::fs::read(path).unwrap()).unwrap();
            self.dashboards.clusters.insert(
                cluster.into(),
                ClusterDashboard {
                    status: Some(status.into()),
                    last_success_unix: Some(1e9),
                    ..ClusterDashboard::new("http://dashboard".into())
                },
            );
        }
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

    fn build(
        p: &mut Pipeline,
        m: &Arc<Model>,
        w: &World,
        envoys: &dyn EnvoyWarmth,
        now: SystemTime,
    ) -> Output {
        p.build(
            &Inputs {
                model: m,
                probes: &w.probes,
                dashboards: &w.dashboards,
                envoys,
            },
            now,
        )
    }

    fn pipeline() -> Pipeline {
        Pipeline::new(Policies::default(), GatewaySettings::default())
    }

    /// Endpoint address → health status, of one cluster in a snapshot.
    fn endpoints(out: &Output, cluster: &str) -> Option<Vec<(u16, i32)>> {
        let r = out
            .snapshot
            .resources(ResourceType::Endpoints)
            .get(cluster)?;
        let cla = ClusterLoadAssignment::decode(&*r.body.value).unwrap();
        Some(
            cla.endpoints[0]
                .lb_endpoints
                .iter()
                .map(|e| {
                    let port = e.hostname_port();
                    (port, e.health_status)
                })
                .collect(),
        )
    }

    trait HostnamePort {
        fn hostname_port(&self) -> u16;
    }

    impl HostnamePort for envoy_types::pb::envoy::config::endpoint::v3::LbEndpoint {
        fn hostname_port(&self) -> u16 {
            use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
            match &self.host_identifier {
                Some(HostIdentifier::Endpoint(e)) => {
                    e.hostname.rsplit(':').next().unwrap().parse().unwrap()
                }
                _ => panic!("an endpoint"),
            }
        }
    }

    /// Percent per cluster in the route of RayService `default/<service>`.
    fn weights(out: &Output, service: &str) -> Vec<(String, u32)> {
        let r = &out.snapshot.resources(ResourceType::Route)[crate::translate::ROUTE_CONFIG_NAME];
        let config = RouteConfiguration::decode(&*r.body.value).unwrap();
        let vh = config
            .virtual_hosts
            .iter()
            .find(|v| v.name == format!("default/{service}"))
            .unwrap();
        let http = vh.routes.iter().find(|r| r.name == "default").unwrap();
        let Some(route::Action::Route(action)) = &http.action else {
            panic!("a route action")
        };
        let Some(route_action::ClusterSpecifier::WeightedClusters(w)) = &action.cluster_specifier
        else {
            panic!("weighted clusters")
        };
        w.clusters
            .iter()
            .map(|c| {
                (
                    c.name.rsplit('/').next().unwrap().to_string(),
                    c.weight.unwrap().value,
                )
            })
            .collect()
    }

    fn healthy() -> i32 {
        envoy_types::pb::envoy::config::core::v3::HealthStatus::Healthy as i32
    }

    fn unknown() -> i32 {
        envoy_types::pb::envoy::config::core::v3::HealthStatus::Unknown as i32
    }

    fn one(s: RayService) -> Arc<Model> {
        Arc::new(Model::new(vec![s]).unwrap())
    }

    /// The first cluster of the route named `route` of RayService `default/<service>`.
    fn route_to(out: &Output, service: &str, route_name: &str) -> String {
        let r = &out.snapshot.resources(ResourceType::Route)[crate::translate::ROUTE_CONFIG_NAME];
        let config = RouteConfiguration::decode(&*r.body.value).unwrap();
        let vh = config
            .virtual_hosts
            .iter()
            .find(|v| v.name == format!("default/{service}"))
            .unwrap();
        let route = vh.routes.iter().find(|r| r.name == route_name).unwrap();
        let Some(route::Action::Route(action)) = &route.action else {
            panic!("a route action")
        };
        let Some(route_action::ClusterSpecifier::WeightedClusters(w)) = &action.cluster_specifier
        else {
            panic!("weighted clusters")
        };
        w.clusters[0].name.clone()
    }

    /// `a1` with direct ingress: `work` at `/work` with replicas on `ports`.
    fn direct(ports: &[u16]) -> Arc<Model> {
        let mut s = service("a", "a1", &[8000]);
        s.clusters[0].direct_ingress = true;
        s.clusters[0].applications = vec![crate::model::test_support::app(
            "work",
            Some("/work"),
            ports,
        )];
        one(s)
    }

    /// The last replica of an application leaves (a redeploy): its route moves to the
    /// proxies at once, and it stays published (not routable) for `leaving::HOLD`, so
    /// no Envoy routes to an empty cluster between the endpoints and the route; one that
    /// leaves while another serves goes at once.
    #[test]
    fn the_last_replica_to_leave_stays_until_its_route_has_moved() {
        const WORK: &str = "default/a/a1/app/work";
        let mut p = pipeline();
        let mut w = World::default();
        for port in [8000, 30000, 30001] {
            w.probe(port, ProbeState::Healthy, at(0));
        }
        let out = build(&mut p, &direct(&[30000, 30001]), &w, &(), at(0));
        assert_eq!(route_to(&out, "a", "app/work"), WORK);
        // One of two leaves: gone at once.
        let out = build(&mut p, &direct(&[30001]), &w, &(), at(100));
        assert_eq!(endpoints(&out, WORK).unwrap(), [(30001, healthy())]);
        assert_eq!(route_to(&out, "a", "app/work"), WORK);
        // The last leaves: the route moves, the endpoint stays a moment.
        // (Both that left within the hold, as Ray still serves on them.)
        let out = build(&mut p, &direct(&[]), &w, &(), at(200));
        assert_eq!(route_to(&out, "a", "app/work"), "default/a/a1");
        assert_eq!(
            endpoints(&out, WORK).unwrap(),
            [(30000, healthy()), (30001, healthy())]
        );
        assert_eq!(out.wake_at, Some(at(100) + leaving::HOLD));
        let out = build(&mut p, &direct(&[]), &w, &(), at(100) + leaving::HOLD);
        assert_eq!(endpoints(&out, WORK).unwrap(), [(30001, healthy())]);
        let out = build(&mut p, &direct(&[]), &w, &(), at(200) + leaving::HOLD);
        assert_eq!(endpoints(&out, WORK).unwrap(), []);
        assert_eq!(out.wake_at, None);

        // A dead one (its probe fails) is never published, held or not.
        let mut p = pipeline();
        build(&mut p, &direct(&[30000]), &w, &(), at(0));
        w.probe(30000, ProbeState::Unhealthy, at(50));
        let out = build(&mut p, &direct(&[]), &w, &(), at(100));
        assert_eq!(endpoints(&out, WORK).unwrap(), []);
        assert_eq!(route_to(&out, "a", "app/work"), "default/a/a1");
    }

    #[test]
    fn a_new_proxy_is_withheld_until_its_first_probe_or_the_wait_ends() {
        let mut p = pipeline();
        let mut w = World::default();
        let mut s = service("a", "a1", &[8000]);
        s.policy.head_proxy = crate::model::HeadProxy::Include;
        w.probe(8000, ProbeState::Healthy, T0);
        let out = build(&mut p, &one(s.clone()), &w, &(), at(0));
        assert_eq!(
            endpoints(&out, "default/a/a1").unwrap(),
            [(8000, healthy())]
        );
        assert_eq!(out.wake_at, None, "nothing waits on time");

        // A second proxy appears, not probed yet: it is left out, and the build asks to be
        // woken when its wait ends.
        let mut grown = s.clone();
        grown.clusters[0]
            .proxies
            .push(service("a", "a1", &[8001]).clusters[0].proxies[0].clone());
        let grown = one(grown);
        w.probe(8001, ProbeState::Unknown, at(1000));
        let wait = Policies::default().probe.first_probe_wait();
        assert_eq!(
            p.first_probes_due(&grown, &w.probes, at(1000)),
            Some(at(1000) + wait)
        );
        let out = build(&mut p, &grown, &w, &(), at(1000));
        assert_eq!(
            endpoints(&out, "default/a/a1").unwrap(),
            [(8000, healthy())]
        );
        assert_eq!(out.wake_at, Some(at(1000) + wait));

        // Its first probe arrives: published with its health, in one push.
        let mut probed = World::default();
        probed.probe(8000, ProbeState::Healthy, T0);
        probed.probe(8001, ProbeState::Healthy, at(1100));
        let out = build(&mut p, &grown, &probed, &(), at(1100));
        assert_eq!(
            endpoints(&out, "default/a/a1").unwrap(),
            [(8000, healthy()), (8001, healthy())]
        );
        assert_eq!(p.first_probes_due(&grown, &probed.probes, at(1100)), None);

        // Another one whose probe never comes is published unknown once its wait ends.
        let mut p = pipeline();
        build(&mut p, &one(s), &w, &(), at(0));
        let out = build(&mut p, &grown, &w, &(), at(1000) + wait);
        assert_eq!(
            endpoints(&out, "default/a/a1").unwrap(),
            [(8000, healthy()), (8001, unknown())]
        );
    }

    /// RayService `s`: clusters a1 (8000) and b1 (9000), a1 active, b1 pending.
    fn upgrade(overrides: SwitchoverOverrides) -> RayService {
        let mut s = service("s", "a1", &[8000]);
        s.clusters
            .push(service("s", "b1", &[9000]).clusters.remove(0));
        s.pending_cluster = Some("b1".into());
        s.policy.head_proxy = crate::model::HeadProxy::Include;
        s.policy.overrides.switchover = overrides;
        s
    }

    fn ready_world() -> World {
        let mut w = World::default();
        w.probe(8000, ProbeState::Healthy, T0);
        w.probe(9000, ProbeState::Healthy, T0);
        w
    }

    #[test]
    fn a_progressive_shift_wakes_for_each_step() {
        let mut p = pipeline();
        let w = ready_world();
        let m = one(upgrade(SwitchoverOverrides {
            steps: Some(Steps(vec![30, 100])),
            interval: Some(Duration::from_secs(10)),
            ..Default::default()
        }));
        let out = build(&mut p, &m, &w, &(), at(0));
        assert_eq!(weights(&out, "s"), [("a1".into(), 70), ("b1".into(), 30)]);
        assert_eq!(out.wake_at, Some(at(10_000)), "the next step is due then");
        assert!(matches!(&out.events[..], [Event::Switch(_)]));
        // Woken early (a probe changed): nothing moves.
        let out = build(&mut p, &m, &w, &(), at(5_000));
        assert_eq!(weights(&out, "s"), [("a1".into(), 70), ("b1".into(), 30)]);
        assert!(out.events.is_empty());
        let out = build(&mut p, &m, &w, &(), at(10_000));
        assert_eq!(weights(&out, "s"), [("b1".into(), 100)]);
        assert_eq!(out.wake_at, None);
    }

    #[test]
    fn a_switch_waits_for_cold_envoys_until_they_ack_or_warm_timeout() {
        let mut p = pipeline();
        let w = ready_world();
        let m = one(upgrade(SwitchoverOverrides::default()));
        let cold = Envoys(vec![("gw", vec!["default/s/a1"])]);
        let out = build(&mut p, &m, &w, &cold, at(0));
        assert_eq!(weights(&out, "s"), [("a1".into(), 100)]);
        assert!(out.wake_on_ack, "an ACK may end the wait");
        let warm_timeout = Policies::default().switchover.warm_timeout;
        assert_eq!(out.wake_at, Some(at(0) + warm_timeout));
        // The Envoy ACKs b1: traffic moves.
        let warm = Envoys(vec![("gw", vec!["default/s/a1", "default/s/b1"])]);
        let out = build(&mut p, &m, &w, &warm, at(100));
        assert_eq!(weights(&out, "s"), [("b1".into(), 100)]);
        assert!(!out.wake_on_ack);
        // An Envoy that never ACKs holds the switch only until warm_timeout.
        let mut p = pipeline();
        build(&mut p, &m, &w, &cold, at(0));
        let out = build(&mut p, &m, &w, &cold, at(0) + warm_timeout);
        assert_eq!(weights(&out, "s"), [("b1".into(), 100)]);
    }

    #[test]
    fn a_dropped_cluster_drains_for_its_grace_then_goes() {
        let mut p = pipeline();
        let mut w = ready_world();
        w.running("default/s/b1");
        let m = one(upgrade(SwitchoverOverrides {
            drain_grace: Some(Duration::from_secs(5)),
            ..Default::default()
        }));
        let out = build(&mut p, &m, &w, &(), at(0));
        assert_eq!(weights(&out, "s"), [("b1".into(), 100)]);
        // The source promotes b1 and drops a1.
        let mut promoted = upgrade(SwitchoverOverrides {
            drain_grace: Some(Duration::from_secs(5)),
            ..Default::default()
        });
        promoted.active_cluster = "b1".into();
        promoted.pending_cluster = None;
        promoted.clusters.retain(|c| c.name == "b1");
        let promoted = one(promoted);
        let out = build(&mut p, &promoted, &w, &(), at(1000));
        assert_eq!(
            endpoints(&out, "default/s/a1").unwrap(),
            [],
            "a1 drains: Envoy keeps the cluster for requests in flight, with no endpoint for new ones"
        );
        assert!(out
            .snapshot
            .resources(ResourceType::Cluster)
            .contains_key("default/s/a1"));
        assert_eq!(weights(&out, "s"), [("b1".into(), 100)]);
        assert_eq!(out.wake_at, Some(at(6000)));
        let out = build(&mut p, &promoted, &w, &(), at(6000));
        assert_eq!(endpoints(&out, "default/s/a1"), None, "a1 is gone");
        assert_eq!(out.wake_at, None);
    }

    #[test]
    fn fail_open_is_reported_once_when_it_starts_and_when_it_ends() {
        let mut p = pipeline();
        let mut w = World::default();
        let m = one(service("a", "a1", &[8000, 8001]));
        w.probe(8000, ProbeState::Unhealthy, T0);
        w.probe(8001, ProbeState::Unhealthy, T0);
        let out = build(&mut p, &m, &w, &(), at(0));
        let fail_open: Vec<&Event> = out
            .events
            .iter()
            .filter(|e| !matches!(e, Event::Switch(_)))
            .collect();
        assert_eq!(fail_open, [&Event::FailOpenStarted("default/a/a1".into())]);
        assert!(build(&mut p, &m, &w, &(), at(1)).events.is_empty());
        w.probe(8001, ProbeState::Healthy, T0);
        let out = build(&mut p, &m, &w, &(), at(2));
        assert_eq!(out.events, [Event::FailOpenEnded("default/a/a1".into())]);
    }
}

//! Endpoint health: the one place that decides, from everything ray-xds knows about a
//! proxy, the `health_status` Envoy gets for it, whether it is published at all, and
//! whether it counts as ready for a switchover. Pure.
//!
//! For each proxy, in order (a later rule overrides an earlier one):
//! 1. its probe state (unknown until first probed; Envoy treats unknown as healthy);
//! 2. withheld (not published at all) while it is new and waits for its first probe
//!    ([`Facts::withheld`]): published as unknown, Envoy would send it requests before
//!    anyone knows, and its health would need a second push;
//! 3. DRAINING when the source says it is going away (a terminating pod);
//! 4. DRAINING when its cluster's dashboard lists its proxy as DRAINING;
//! 5. DRAINING ("no new traffic") when it is healthy but does not serve every route prefix
//!    of its cluster's RUNNING applications, while another healthy proxy of the cluster
//!    does (one that just started and has not loaded its routes; if no proxy serves them
//!    all, the routes are simply not re-read yet, and nobody is held back);
//! 6. fail-open: when every proxy of a cluster that is not draining is unhealthy, ray-xds
//!    cannot tell a dead cluster from a broken path between itself and the proxies, so it
//!    publishes them healthy and lets Envoy's outlier detection decide;
//! 7. the RayService's `head_proxy` policy: `exclude` drains the head proxy, `include`
//!    leaves it alone, `fallback` drains it while any worker proxy is healthy or unknown;
//! 8. DRAINING for every proxy of a cluster the source dropped and that drains for its
//!    grace period ([`Facts::departed`]).
//!
//! Per cluster it also counts what the switchover reads: proxies *ready* (probe healthy,
//! not going away, serving every RUNNING application's route prefix; head or not; never
//! fail-open) and proxies *routable* (published healthy or unknown, not by fail-open).
//! DRAINING keeps in-flight requests and takes no new ones.
//!
//! A proxy that serves gRPC has a second endpoint, its gRPC address, in an Envoy cluster of
//! its own (`<cluster>/grpc`): the same rules on its own probe (`Healthz`), the node's
//! source and dashboard facts, no route-prefix rule (the gRPC proxy picks the application
//! from the call's `application` metadata), and counts of its own for the switchover.
//!
//! With Ray's direct ingress, each application's ingress replicas are endpoints too, per
//! protocol in an Envoy cluster of the application's
//! ([`RayService::envoy_app_cluster_name`]): their probe, withheld until the first one,
//! DRAINING on a node the source says is going away, fail-open, DRAINING in a dropped
//! cluster; counted like proxies (`ready`: probe healthy), so that `translate` sends an
//! application to its replicas only while one may take requests.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use serde::Serialize;

use super::dashboard::{ProxyStatus, ServeStatus};
use super::dashboards::DashboardStates;
use super::probe::{ProbeState, ProxyProbe};
use super::prober::ProbeStates;
use crate::model::{HeadProxy, Model, NodeType, Protocol, Proxy, RayCluster, RayService};

/// What Envoy is told about an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndpointHealth {
    /// Not published at all (see [`Reason::AwaitingFirstProbe`]).
    Withheld,
    Unknown,
    Healthy,
    Unhealthy,
    Draining,
}

/// Why an endpoint has its health.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    NotProbedYet,
    AwaitingFirstProbe,
    ProbeHealthy,
    ProbeFailed(std::sync::Arc<str>),
    ProxyDraining,
    SourceDraining,
    DashboardDraining,
    MissingRoutes(Vec<String>),
    RoutesUnknown,
    FailOpen(Box<Reason>),
    HeadExcluded,
    HeadFallback,
    ClusterDeparted,
    LeftTargetGroup,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::NotProbedYet => f.write_str("not probed yet"),
            Reason::AwaitingFirstProbe => {
                f.write_str("new: not published until its first probe (or the wait ends)")
            }
            Reason::ProbeHealthy => f.write_str("probe healthy"),
            Reason::ProbeFailed(why) => write!(f, "probe: {why}"),
            Reason::ProxyDraining => f.write_str("proxy says it is draining"),
            Reason::SourceDraining => {
                f.write_str("the source says it is going away (pod terminating)")
            }
            Reason::DashboardDraining => f.write_str("dashboard lists its proxy as DRAINING"),
            Reason::MissingRoutes(missing) => {
                write!(f, "does not serve route prefixes {missing:?} yet")
            }
            Reason::RoutesUnknown => f.write_str("its routes are not known yet"),
            Reason::FailOpen(why) => write!(
                f,
                "fail-open: every proxy of the cluster fails its probe ({why})"
            ),
            Reason::HeadExcluded => f.write_str("head_proxy: exclude"),
            Reason::HeadFallback => f.write_str("head_proxy: fallback, a worker proxy is healthy"),
            Reason::ClusterDeparted => {
                f.write_str("its cluster left the source: draining until removed")
            }
            Reason::LeftTargetGroup => f.write_str(
                "left its application's target group: published only while the route moves to the proxies",
            ),
        }
    }
}

impl Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An endpoint's health and the reason for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    pub health: EndpointHealth,
    pub reason: Reason,
}

/// What the switchover reads of one cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ClusterHealth {
    /// Proxies probe-healthy, not going away, serving every RUNNING application's route
    /// prefix (head or not; fail-open never counts).
    pub ready: u32,
    /// Proxies Envoy may send new requests to on ray-xds's own knowledge: published
    /// healthy or unknown, not by fail-open.
    pub routable: u32,
    /// Proxies withheld until their first probe (new since the last snapshot, or every
    /// proxy just after a start): not routable yet, not known to be down either.
    pub awaiting_first_probe: u32,
    /// Every proxy of the cluster failed its probe: published healthy anyway.
    pub fail_open: bool,
}

/// The health of every endpoint, keyed by Envoy cluster name and proxy address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HealthMap {
    pub endpoints: EndpointVerdicts,
    pub clusters: BTreeMap<String, ClusterHealth>,
}

impl HealthMap {
    pub fn health(&self, cluster: &str, address: SocketAddr) -> EndpointHealth {
        self.of_cluster(cluster).health(address)
    }

    /// The verdicts of one Envoy cluster's endpoints.
    pub fn of_cluster(&self, cluster: &str) -> ClusterVerdicts<'_> {
        ClusterVerdicts(self.endpoints.0.get(cluster).map(|m| &**m))
    }

    /// The shared map of one Envoy cluster's verdicts, whose pointer says "the very
    /// verdicts an earlier build published" (never changed in place while shared).
    pub(crate) fn shared_of_cluster(&self, cluster: &str) -> Option<&SharedVerdicts> {
        self.endpoints.0.get(cluster)
    }

    pub fn cluster(&self, cluster: &str) -> ClusterHealth {
        self.clusters.get(cluster).copied().unwrap_or_default()
    }

    /// Envoy clusters published fail-open.
    pub(crate) fn fail_open(&self) -> BTreeSet<&str> {
        self.clusters
            .iter()
            .filter(|(_, c)| c.fail_open)
            .map(|(n, _)| n.as_str())
            .collect()
    }
}

/// Every endpoint's verdict, by (Envoy cluster, address): a map per cluster, so that a
/// cluster's endpoints are found, and added, without a key of their own per endpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointVerdicts(BTreeMap<String, SharedVerdicts>);

/// One Envoy cluster's verdicts, shared between the builds that judged them the same.
pub(crate) type SharedVerdicts = Arc<BTreeMap<SocketAddr, Verdict>>;

impl EndpointVerdicts {
    pub fn insert(&mut self, (cluster, address): (String, SocketAddr), verdict: Verdict) {
        Arc::make_mut(self.0.entry(cluster).or_default()).insert(address, verdict);
    }

    /// As `insert`, without giving up a cluster name per endpoint.
    fn insert_in(&mut self, cluster: &str, address: SocketAddr, verdict: Verdict) {
        Arc::make_mut(self.of_cluster_mut(cluster)).insert(address, verdict);
    }

    /// One cluster's verdicts, to add to.
    fn of_cluster_mut(&mut self, cluster: &str) -> &mut Arc<BTreeMap<SocketAddr, Verdict>> {
        if !self.0.contains_key(cluster) {
            self.0.insert(cluster.to_string(), Default::default());
        }
        self.0.get_mut(cluster).expect("just inserted")
    }

    /// Each cluster's verdicts that equal `earlier`'s, replaced by `earlier`'s shared
    /// map: as [`Assessor`] hands on the verdicts of a cluster it did not judge again.
    #[cfg(test)]
    pub(crate) fn share_equal(&mut self, earlier: &EndpointVerdicts) {
        for (cluster, verdicts) in &mut self.0 {
            if let Some(e) = earlier.0.get(cluster).filter(|e| **e == *verdicts) {
                *verdicts = e.clone();
            }
        }
    }

    pub fn get(&self, (cluster, address): &(String, SocketAddr)) -> Option<&Verdict> {
        self.0.get(cluster)?.get(address)
    }

    pub fn contains_key(&self, key: &(String, SocketAddr)) -> bool {
        self.get(key).is_some()
    }

    /// Every endpoint's verdict, by cluster then address.
    pub fn iter(&self) -> impl Iterator<Item = (&str, SocketAddr, &Verdict)> {
        self.0
            .iter()
            .flat_map(|(c, m)| m.iter().map(move |(a, v)| (c.as_str(), *a, v)))
    }
}

impl std::ops::Index<&(String, SocketAddr)> for EndpointVerdicts {
    type Output = Verdict;
    fn index(&self, key: &(String, SocketAddr)) -> &Verdict {
        self.get(key).expect("an endpoint with a verdict")
    }
}

/// One Envoy cluster's endpoint health ([`HealthMap::of_cluster`]).
pub struct ClusterVerdicts<'a>(Option<&'a BTreeMap<SocketAddr, Verdict>>);

impl ClusterVerdicts<'_> {
    /// As [`HealthMap::health`]: unknown for an endpoint without a verdict.
    pub fn health(&self, address: SocketAddr) -> EndpointHealth {
        self.0
            .and_then(|m| m.get(&address))
            .map_or(EndpointHealth::Unknown, |v| v.health)
    }
}

/// What the pipeline knows beyond probes and dashboards.
#[derive(Clone, Copy, Debug, Default)]
pub struct Facts<'a> {
    /// New proxies not published until their first probe.
    pub withheld: Option<&'a BTreeSet<SocketAddr>>,
    /// Envoy clusters the source dropped, draining for their grace period.
    pub departed: Option<&'a BTreeSet<String>>,
    /// Ingress replicas that left their application's target group, by application
    /// Envoy cluster, held while its route moves (`pipeline::leaving`).
    pub leaving: Option<&'a BTreeMap<String, Vec<SocketAddr>>>,
}

/// Every endpoint's verdict and every Envoy cluster's counts: each RayCluster's proxies
/// per protocol (a gRPC endpoint is judged by the same rules as its node's HTTP one, on
/// its own probe, in an Envoy cluster of its own), then its ingress replicas.
pub fn assess(
    model: &Model,
    probes: &ProbeStates,
    dashboards: &DashboardStates,
    facts: Facts<'_>,
) -> HealthMap {
    Assessor::default().assess(model, probes, dashboards, facts)
}

/// [`assess`] across builds, in proportion to the change: an Envoy cluster of proxies is
/// judged again only when something its verdicts are made from changed (an endpoint's
/// probe, source or withheld facts, the cluster's dashboard status, head policy or
/// departure); otherwise its last verdicts and counts are kept, shared. It always gives
/// what [`assess`] gives from the same inputs (a property test holds them equal).
///
/// Given the very model of its last call ([`Assessor::assess_shared`]), it does not even
/// look at an unchanged cluster's endpoints: which proxies' probes changed comes from a
/// diff of the two probe maps, which skips the parts they share, so a health change
/// costs the clusters it touched.
#[derive(Default)]
pub struct Assessor {
    kept: BTreeMap<String, Judged>,
    /// How many assessments it made.
    round: u64,
    /// What the last [`Assessor::assess_shared`] read.
    last: Option<LastRead>,
}

/// What an assessment read that tells the next one what changed.
struct LastRead {
    /// Held, so that a pointer equal to it is this model.
    model: Arc<Model>,
    probes: imbl::OrdMap<SocketAddr, ProxyProbe>,
    withheld: BTreeSet<SocketAddr>,
    /// Each proxy endpoint of `model` with the Envoy cluster that lists it (its place in
    /// the order `assess` visits them), sorted.
    listed_in: Vec<(SocketAddr, usize)>,
}

impl LastRead {
    /// The Envoy clusters of proxies (by place) with an endpoint whose probe changed
    /// since, when nothing else an endpoint is judged on can have: the very same
    /// model and the same withheld proxies. `None`: look at every cluster.
    fn touched(
        &self,
        model: &Arc<Model>,
        probes: &ProbeStates,
        withheld: Option<&BTreeSet<SocketAddr>>,
    ) -> Option<BTreeSet<usize>> {
        if !Arc::ptr_eq(&self.model, model)
            || self.withheld != *withheld.unwrap_or(&BTreeSet::new())
        {
            return None;
        }
        let mut touched = BTreeSet::new();
        for change in self.probes.diff(&probes.proxies) {
            let address = match change {
                imbl::ordmap::DiffItem::Add(a, _) | imbl::ordmap::DiffItem::Remove(a, _) => a,
                imbl::ordmap::DiffItem::Update { new: (a, _), .. } => a,
            };
            let first = self.listed_in.partition_point(|(b, _)| b < address);
            touched.extend(
                self.listed_in[first..]
                    .iter()
                    .take_while(|(b, _)| b == address)
                    .map(|(_, place)| *place),
            );
        }
        Some(touched)
    }
}

/// One Envoy cluster of proxies as last judged.
struct Judged {
    from: JudgedFrom,
    verdicts: Arc<BTreeMap<SocketAddr, Verdict>>,
    summary: ClusterHealth,
    /// The assessment that last asked for it (to forget a cluster that went).
    round: u64,
}

/// Everything one Envoy cluster's proxy verdicts are made from, besides the rules.
struct JudgedFrom {
    head_proxy: HeadProxy,
    departed: bool,
    dashboard: Option<Arc<ServeStatus>>,
    endpoints: Vec<JudgedEndpoint>,
}

/// What one endpoint's verdict is made from: the model's proxy, withheld or not, and its
/// probe (shared parts held, so that a pointer compared is never a freed one reused).
struct JudgedEndpoint {
    address: SocketAddr,
    proxy: Proxy,
    withheld: bool,
    probe: Option<(ProbeState, Arc<str>, Option<RouteTable>)>,
}

/// A proxy's route prefixes, shared (`ProxyProbe::routes`).
type RouteTable = Arc<BTreeSet<String>>;

impl JudgedEndpoint {
    fn of(address: SocketAddr, proxy: &Proxy, withheld: bool, probe: Option<&ProxyProbe>) -> Self {
        JudgedEndpoint {
            address,
            proxy: proxy.clone(),
            withheld,
            probe: probe.map(|p| (p.state, p.reason.clone(), p.routes.clone())),
        }
    }

    fn is(
        &self,
        address: SocketAddr,
        proxy: &Proxy,
        withheld: bool,
        probe: Option<&ProxyProbe>,
    ) -> bool {
        fn same<T: ?Sized + PartialEq>(a: &Arc<T>, b: &Arc<T>) -> bool {
            Arc::ptr_eq(a, b) || a == b
        }
        self.address == address
            && self.proxy == *proxy
            && self.withheld == withheld
            && match (&self.probe, probe) {
                (None, None) => true,
                (Some((state, reason, routes)), Some(p)) => {
                    *state == p.state
                        && same(reason, &p.reason)
                        && match (routes, &p.routes) {
                            (None, None) => true,
                            (Some(a), Some(b)) => same(a, b),
                            _ => false,
                        }
                }
                _ => false,
            }
    }
}

impl Assessor {
    /// As [`assess`], judging again only the Envoy clusters whose inputs changed since
    /// the last call.
    pub fn assess(
        &mut self,
        model: &Model,
        probes: &ProbeStates,
        dashboards: &DashboardStates,
        facts: Facts<'_>,
    ) -> HealthMap {
        self.last = None;
        self.assess_touched(model, None, probes, dashboards, facts)
    }

    /// As [`Assessor::assess`], for a model shared between builds: when it is the very
    /// model of the last call and the same proxies are withheld, only the Envoy clusters
    /// with an endpoint whose probe changed since, or whose dashboard status or departure
    /// did, are looked at.
    pub fn assess_shared(
        &mut self,
        model: &Arc<Model>,
        probes: &ProbeStates,
        dashboards: &DashboardStates,
        facts: Facts<'_>,
    ) -> HealthMap {
        let last = self.last.take();
        let touched = last
            .as_ref()
            .and_then(|last| last.touched(model, probes, facts.withheld));
        let out = self.assess_touched(model, touched.as_ref(), probes, dashboards, facts);
        let listed_in = match last {
            Some(last) if Arc::ptr_eq(&last.model, model) => last.listed_in,
            _ => listed_in(model),
        };
        self.last = Some(LastRead {
            model: model.clone(),
            probes: probes.proxies.clone(),
            withheld: facts.withheld.cloned().unwrap_or_default(),
            listed_in,
        });
        out
    }

    /// One assessment; `touched`, when given, names (by place) every Envoy cluster of
    /// proxies whose endpoints may be judged differently from last time: any other
    /// cluster's endpoints are not looked at.
    fn assess_touched(
        &mut self,
        model: &Model,
        touched: Option<&BTreeSet<usize>>,
        probes: &ProbeStates,
        dashboards: &DashboardStates,
        facts: Facts<'_>,
    ) -> HealthMap {
        self.round += 1;
        let round = self.round;
        let withheld = |a: &SocketAddr| facts.withheld.is_some_and(|w| w.contains(a));
        let mut out = HealthMap::default();
        for (place, (service, cluster, protocol)) in proxy_clusters(model).enumerate() {
            let judge = ProxyJudge {
                service,
                cluster,
                protocol,
                dashboards,
                withheld: &withheld,
            };
            let name = service.envoy_cluster_name_for(&cluster.name, protocol);
            let endpoints_same = touched.is_some_and(|t| !t.contains(&place));
            let judged = self.judged(&name, &judge, endpoints_same, probes, facts, round);
            out.endpoints
                .0
                .insert(name.clone(), judged.verdicts.clone());
            out.clusters.insert(name, judged.summary);
        }
        for service in model.services() {
            for cluster in &service.clusters {
                assess_replicas(service, cluster, probes, &withheld, facts, &mut out);
            }
        }
        self.kept.retain(|_, j| j.round == round);
        out
    }

    /// Envoy cluster `name` judged by `judge`: as kept when its inputs are the same
    /// (its endpoints' without a look when `endpoints_same`).
    fn judged(
        &mut self,
        name: &str,
        judge: &ProxyJudge<'_>,
        endpoints_same: bool,
        probes: &ProbeStates,
        facts: Facts<'_>,
        round: u64,
    ) -> &Judged {
        let (service, cluster) = (judge.service, judge.cluster);
        let departed = facts
            .departed
            .is_some_and(|d| d.contains(&service.envoy_cluster_name(&cluster.name)));
        let dashboard = judge.dashboard();
        let kept = self.kept.get(name).filter(|kept| {
            kept.from.head_proxy == service.policy.head_proxy
                && kept.from.departed == departed
                && match (&kept.from.dashboard, dashboard) {
                    (None, None) => true,
                    (Some(a), Some(b)) => Arc::ptr_eq(a, b) || **a == **b,
                    _ => false,
                }
        });
        if endpoints_same && kept.is_some() {
            let kept = self.kept.get_mut(name).expect("just found");
            kept.round = round;
            return kept;
        }
        // Each endpoint's probe, looked up once.
        let endpoints: Vec<_> = cluster
            .endpoints(judge.protocol)
            .map(|(address, proxy)| (address, proxy, probes.proxies.get(&address)))
            .collect();
        let unchanged = kept.is_some_and(|kept| {
            kept.from.endpoints.len() == endpoints.len()
                && kept.from.endpoints.iter().zip(&endpoints).all(
                    |(kept, (address, proxy, probe))| {
                        kept.is(*address, proxy, (judge.withheld)(address), *probe)
                    },
                )
        });
        if !unchanged {
            let from = JudgedFrom {
                head_proxy: service.policy.head_proxy,
                departed,
                dashboard: dashboard.cloned(),
                endpoints: endpoints
                    .iter()
                    .map(|(address, proxy, probe)| {
                        JudgedEndpoint::of(*address, proxy, (judge.withheld)(address), *probe)
                    })
                    .collect(),
            };
            let (verdicts, summary) = judge.judge(dashboard.map(|d| &**d), endpoints, departed);
            self.kept.insert(
                name.to_string(),
                Judged {
                    from,
                    verdicts: Arc::new(verdicts),
                    summary,
                    round,
                },
            );
        }
        let kept = self.kept.get_mut(name).expect("kept or just judged");
        kept.round = round;
        kept
    }
}

/// Each proxy endpoint of `model` with the place of the Envoy cluster that lists it, in
/// the order [`Assessor`] visits them, sorted ([`LastRead::listed_in`]).
fn listed_in(model: &Model) -> Vec<(SocketAddr, usize)> {
    let mut out: Vec<_> = proxy_clusters(model)
        .enumerate()
        .flat_map(|(place, (_, cluster, protocol))| {
            cluster.endpoints(protocol).map(move |(a, _)| (a, place))
        })
        .collect();
    out.sort_unstable();
    out
}

/// Every Envoy cluster of proxies: each RayCluster's HTTP one, then its gRPC one when
/// it serves gRPC.
fn proxy_clusters(model: &Model) -> impl Iterator<Item = (&RayService, &RayCluster, Protocol)> {
    model.services().iter().flat_map(|service| {
        service.clusters.iter().flat_map(move |cluster| {
            [Protocol::Http, Protocol::Grpc]
                .into_iter()
                .filter(|p| *p == Protocol::Http || cluster.serves_grpc())
                .map(move |protocol| (service, cluster, protocol))
        })
    })
}

/// What judging one RayCluster's proxies for one protocol reads.
struct ProxyJudge<'a> {
    service: &'a RayService,
    cluster: &'a RayCluster,
    protocol: Protocol,
    dashboards: &'a DashboardStates,
    withheld: &'a dyn Fn(&SocketAddr) -> bool,
}

impl ProxyJudge<'_> {
    /// The RayCluster's dashboard status (whichever protocol).
    fn dashboard(&self) -> Option<&Arc<ServeStatus>> {
        self.dashboards
            .clusters
            .get(&self.service.envoy_cluster_name(&self.cluster.name))
            .and_then(|d| d.status.as_ref())
    }

    /// The verdicts of `endpoints` (each with its probe) in their Envoy cluster, and its
    /// counts: probe, withheld, draining (source or dashboard), missing routes,
    /// fail-open, the head policy, a departed cluster.
    fn judge(
        &self,
        dashboard: Option<&ServeStatus>,
        endpoints: Vec<(SocketAddr, &Proxy, Option<&ProxyProbe>)>,
        departed: bool,
    ) -> (BTreeMap<SocketAddr, Verdict>, ClusterHealth) {
        let (service, protocol) = (self.service, self.protocol);
        // Route prefixes of the applications the dashboard says serve (RUNNING, or
        // only resizing: `Application::serves`); route
        // prefixes are HTTP's only (the gRPC proxy picks the application from the call's
        // metadata).
        let required: BTreeSet<String> = dashboard
            .filter(|_| protocol == Protocol::Http)
            .map(|d| {
                d.applications
                    .values()
                    .filter(|a| a.serves())
                    .filter_map(|a| a.route_prefix.clone())
                    .collect()
            })
            .unwrap_or_default();
        let serves_all = |probe: Option<&ProxyProbe>| {
            probe.is_some_and(|probe| {
                probe.state == ProbeState::Healthy
                    && (required.is_empty()
                        || probe.routes.as_ref().is_some_and(|r| required.is_subset(r)))
            })
        };
        // Enforced only while some healthy proxy serves them all, so that a new
        // application (or routes not re-read yet) never drains the whole cluster.
        let enforce_routes =
            !required.is_empty() && endpoints.iter().any(|(_, _, probe)| serves_all(*probe));
        let mut summary = ClusterHealth::default();
        let mut verdicts: Vec<(SocketAddr, NodeType, Verdict)> =
            Vec::with_capacity(endpoints.len());
        for (address, proxy, probe) in endpoints {
            let mut v = probe_verdict(probe);
            if v.health == EndpointHealth::Unknown && (self.withheld)(&address) {
                v = verdict(EndpointHealth::Withheld, Reason::AwaitingFirstProbe);
            }
            if proxy.draining {
                v = verdict(EndpointHealth::Draining, Reason::SourceDraining);
            }
            if let Some(ProxyStatus::Draining) =
                dashboard.and_then(|d| d.proxy_status_at(proxy.address))
            {
                v = verdict(EndpointHealth::Draining, Reason::DashboardDraining);
            }
            if v.health == EndpointHealth::Healthy && enforce_routes {
                let routes = probe.and_then(|p| p.routes.as_deref());
                if let Some(missing) = missing_routes(&required, routes) {
                    v = missing;
                }
            }
            if v.health == EndpointHealth::Healthy && serves_all(probe) {
                summary.ready += 1;
            }
            verdicts.push((address, proxy.node_type, v));
        }
        // Fail-open: every proxy that could serve fails its probe.
        fail_open(verdicts.iter_mut().map(|(_, _, v)| v), &mut summary);
        apply_head_policy(service.policy.head_proxy, &mut verdicts);
        let verdicts = verdicts.into_iter().map(|(address, _, v)| (address, v));
        let mut out = BTreeMap::new();
        let summary = publish_verdicts(verdicts, departed, summary, &mut out);
        (out, summary)
    }
}

/// A healthy proxy's verdict when it does not serve every route `required` (DRAINING,
/// naming what it misses) or its routes are not known; `None` when it serves them all.
fn missing_routes(
    required: &BTreeSet<String>,
    routes: Option<&BTreeSet<String>>,
) -> Option<Verdict> {
    match routes {
        Some(routes) if required.is_subset(routes) => None,
        Some(routes) => {
            let missing = required.difference(routes).cloned().collect();
            Some(verdict(
                EndpointHealth::Draining,
                Reason::MissingRoutes(missing),
            ))
        }
        None => Some(verdict(EndpointHealth::Draining, Reason::RoutesUnknown)),
    }
}

/// The head's proxy by `head_proxy`: included; excluded; or, as a fallback, drained
/// while a worker's proxy is up (healthy or not known to be down).
fn apply_head_policy(head_proxy: HeadProxy, verdicts: &mut [(SocketAddr, NodeType, Verdict)]) {
    let worker_up = verdicts.iter().any(|(_, t, v)| {
        *t == NodeType::Worker
            && matches!(v.health, EndpointHealth::Healthy | EndpointHealth::Unknown)
    });
    for (_, node_type, v) in verdicts.iter_mut() {
        if *node_type != NodeType::Head
            || matches!(
                v.health,
                EndpointHealth::Draining | EndpointHealth::Withheld
            )
        {
            continue;
        }
        match head_proxy {
            HeadProxy::Include => {}
            HeadProxy::Exclude => *v = verdict(EndpointHealth::Draining, Reason::HeadExcluded),
            HeadProxy::Fallback if worker_up => {
                *v = verdict(EndpointHealth::Draining, Reason::HeadFallback)
            }
            HeadProxy::Fallback => {}
        }
    }
}

/// One Envoy cluster's verdicts into `of_cluster`, and its counts; in a cluster the
/// source dropped, every endpoint but a withheld one drains and none counts ready.
fn publish_verdicts(
    verdicts: impl IntoIterator<Item = (SocketAddr, Verdict)>,
    departed: bool,
    mut summary: ClusterHealth,
    of_cluster: &mut BTreeMap<SocketAddr, Verdict>,
) -> ClusterHealth {
    let verdicts = verdicts.into_iter().map(|(address, mut v)| {
        if departed && v.health != EndpointHealth::Withheld {
            v = verdict(EndpointHealth::Draining, Reason::ClusterDeparted);
        }
        count(&v, &mut summary);
        (address, v)
    });
    if of_cluster.is_empty() {
        // Built whole (sorted once), not an insert per endpoint.
        *of_cluster = verdicts.collect();
    } else {
        of_cluster.extend(verdicts);
    }
    if departed {
        summary.ready = 0;
    }
    summary
}

/// The ingress replicas of each application of `cluster` (Ray's direct ingress), each
/// protocol in its application's Envoy cluster: its probe, withheld until the first one,
/// DRAINING on a node the source says is going away, fail-open when every replica that
/// could serve fails its probe, DRAINING in a cluster the source dropped. No head or route
/// rule: a replica serves its one application wherever it runs.
fn assess_replicas(
    service: &RayService,
    cluster: &RayCluster,
    probes: &ProbeStates,
    withheld: &dyn Fn(&SocketAddr) -> bool,
    facts: Facts<'_>,
    out: &mut HealthMap,
) {
    let leaving: BTreeSet<IpAddr> = cluster
        .proxies
        .iter()
        .filter(|p| p.draining)
        .map(|p| p.address.ip())
        .collect();
    let departed = facts
        .departed
        .is_some_and(|d| d.contains(&service.envoy_cluster_name(&cluster.name)));
    for app in &cluster.applications {
        for protocol in [Protocol::Http, Protocol::Grpc] {
            let replicas = app.replicas(protocol);
            if replicas.is_empty() {
                continue;
            }
            let name = service.envoy_app_cluster_name(&cluster.name, &app.name, protocol);
            let left = facts
                .leaving
                .and_then(|l| l.get(&name))
                .map_or(&[][..], Vec::as_slice);
            let mut summary = ClusterHealth::default();
            let mut verdicts: Vec<(SocketAddr, Verdict)> = replicas
                .iter()
                .filter(|address| !left.contains(address))
                .map(|address| {
                    let v = probe_verdict(probes.proxies.get(address));
                    let v = match v.health {
                        EndpointHealth::Unknown if withheld(address) => {
                            verdict(EndpointHealth::Withheld, Reason::AwaitingFirstProbe)
                        }
                        _ if leaving.contains(&address.ip()) => {
                            verdict(EndpointHealth::Draining, Reason::SourceDraining)
                        }
                        _ => v,
                    };
                    if v.health == EndpointHealth::Healthy {
                        summary.ready += 1;
                    }
                    (*address, v)
                })
                .collect();
            fail_open(verdicts.iter_mut().map(|(_, v)| v), &mut summary);
            // Replicas that left: published (serving what Ray lets them finish) only while
            // the application has no routable replica, so its route moves to the proxies
            // before they go; never counted.
            let route_moves = !verdicts.iter().any(|(_, v)| {
                matches!(v.health, EndpointHealth::Healthy | EndpointHealth::Unknown)
            });
            for address in replicas.iter().filter(|a| left.contains(a)) {
                let v = match probe_verdict(probes.proxies.get(address)) {
                    v if v.health == EndpointHealth::Unhealthy => v,
                    _ if route_moves && !departed => {
                        verdict(EndpointHealth::Healthy, Reason::LeftTargetGroup)
                    }
                    _ => verdict(EndpointHealth::Draining, Reason::LeftTargetGroup),
                };
                out.endpoints.insert_in(&name, *address, v);
            }
            let of_cluster = Arc::make_mut(out.endpoints.of_cluster_mut(&name));
            let summary = publish_verdicts(verdicts, departed, summary, of_cluster);
            out.clusters.insert(name, summary);
        }
    }
}

/// What an endpoint's probe alone says.
fn probe_verdict(probe: Option<&ProxyProbe>) -> Verdict {
    match probe.map_or(ProbeState::Unknown, |p| p.state) {
        ProbeState::Unknown => verdict(EndpointHealth::Unknown, Reason::NotProbedYet),
        ProbeState::Healthy => verdict(EndpointHealth::Healthy, Reason::ProbeHealthy),
        ProbeState::Unhealthy => verdict(
            EndpointHealth::Unhealthy,
            Reason::ProbeFailed(probe.map_or_else(|| "".into(), |p| p.reason.clone())),
        ),
        ProbeState::Draining => verdict(EndpointHealth::Draining, Reason::ProxyDraining),
    }
}

/// Fail-open: when every endpoint that could serve (neither draining nor withheld) fails
/// its probe, all of them are published healthy, and the cluster says so.
fn fail_open<'a>(verdicts: impl Iterator<Item = &'a mut Verdict>, summary: &mut ClusterHealth) {
    let mut candidates: Vec<&mut Verdict> = verdicts
        .filter(|v| {
            !matches!(
                v.health,
                EndpointHealth::Draining | EndpointHealth::Withheld
            )
        })
        .collect();
    if candidates.is_empty()
        || candidates
            .iter()
            .any(|v| v.health != EndpointHealth::Unhealthy)
    {
        return;
    }
    for v in candidates.iter_mut() {
        let why = std::mem::replace(&mut v.reason, Reason::NotProbedYet);
        **v = verdict(EndpointHealth::Healthy, Reason::FailOpen(Box::new(why)));
    }
    summary.fail_open = true;
}

/// Counts a published verdict: routable (healthy or unknown, not by fail-open), or
/// awaiting its first probe.
fn count(v: &Verdict, summary: &mut ClusterHealth) {
    let routable = matches!(v.health, EndpointHealth::Healthy | EndpointHealth::Unknown)
        && !matches!(v.reason, Reason::FailOpen(_));
    summary.routable += routable as u32;
    summary.awaiting_first_probe += (v.health == EndpointHealth::Withheld) as u32;
}

fn verdict(health: EndpointHealth, reason: Reason) -> Verdict {
    Verdict { health, reason }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::dashboard::{parse, AppStatus, ServeStatus};
    use crate::live::dashboards::ClusterDashboard;
    use crate::live::probe::ProxyProbe;
    use crate::model::test_support::service;
    use std::time::SystemTime;

    const CLUSTER: &str = "default/a/a1";

    fn model(policy: HeadProxy) -> Model {
        let mut s = service("a", "a1", &[8000, 8001, 8002]);
        s.policy.head_proxy = policy;
        Model::new(vec![s]).unwrap()
    }

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn probes(states: &[(u16, ProbeState)]) -> ProbeStates {
        let mut out = ProbeStates::default();
        for (port, state) in states {
            let mut p = ProxyProbe::new(SystemTime::UNIX_EPOCH);
            p.state = *state;
            p.routes = Some(std::sync::Arc::new(["/".to_string()].into()));
            out.proxies.insert(addr(*port), p);
        }
        out
    }

    fn health(map: &HealthMap, port: u16) -> EndpointHealth {
        map.health(CLUSTER, addr(port))
    }

    use EndpointHealth::*;
    use ProbeState as P;

    const GRPC: &str = "default/a/a1/grpc";

    /// [`model`] with each proxy serving gRPC on its port + 1000.
    fn grpc_model(policy: HeadProxy) -> Model {
        let mut s = service("a", "a1", &[8000, 8001, 8002]);
        s.policy.head_proxy = policy;
        for p in &mut s.clusters[0].proxies {
            p.grpc = Some(addr(p.address.port() + 1000));
        }
        Model::new(vec![s]).unwrap()
    }

    #[test]
    fn a_grpc_endpoint_is_judged_on_its_own_probe_by_the_same_rules() {
        let none = DashboardStates::default();
        let mut states = probes(&[
            (8000, P::Healthy),
            (8001, P::Healthy),
            (8002, P::Healthy),
            (9000, P::Healthy),
            (9001, P::Unhealthy),
            (9002, P::Healthy),
        ]);
        // The gRPC probe reads no routes: none are required of it.
        for port in [9000, 9001, 9002] {
            states.proxies.get_mut(&addr(port)).unwrap().routes = None;
        }
        let m = assess(
            &grpc_model(HeadProxy::Fallback),
            &states,
            &none,
            Facts::default(),
        );
        assert_eq!(m.health(GRPC, addr(9001)), Unhealthy);
        assert_eq!(m.health(GRPC, addr(9002)), Healthy);
        assert_eq!(m.health(GRPC, addr(9000)), Draining, "head fallback");
        assert_eq!(health(&m, 8001), Healthy, "HTTP has its own probe");
        assert_eq!(m.cluster(GRPC).ready, 2);
        assert_eq!(m.cluster(CLUSTER).ready, 3);
        assert!(m.fail_open().is_empty());

        // Every gRPC proxy failing: that cluster fails open, not the HTTP one.
        for port in [9000, 9001, 9002] {
            states.proxies.get_mut(&addr(port)).unwrap().state = P::Unhealthy;
        }
        let m = assess(
            &grpc_model(HeadProxy::Include),
            &states,
            &none,
            Facts::default(),
        );
        assert_eq!(m.fail_open(), BTreeSet::from([GRPC]));
        assert_eq!(m.cluster(GRPC).ready, 0);

        // A node going away takes both its endpoints out; a departed cluster drains both.
        let mut model = grpc_model(HeadProxy::Include);
        model = model.with_proxies(|_, c| {
            let mut proxies = c.proxies.clone();
            proxies[2].draining = true;
            proxies
        });
        let departed = BTreeSet::from([CLUSTER.to_string()]);
        let m = assess(&model, &states, &none, Facts::default());
        assert_eq!(m.health(GRPC, addr(9002)), Draining);
        let m = assess(
            &model,
            &states,
            &none,
            Facts {
                departed: Some(&departed),
                ..Facts::default()
            },
        );
        assert_eq!(m.health(GRPC, addr(9000)), Draining);
        assert_eq!(m.cluster(GRPC).ready, 0);
    }

    #[test]
    fn head_proxy_policies() {
        let all_up = probes(&[(8000, P::Healthy), (8001, P::Healthy), (8002, P::Healthy)]);
        let none = DashboardStates::default();
        let m = assess(&model(HeadProxy::Include), &all_up, &none, Facts::default());
        assert_eq!(health(&m, 8000), Healthy);
        let m = assess(&model(HeadProxy::Exclude), &all_up, &none, Facts::default());
        assert_eq!(health(&m, 8000), Draining);
        let m = assess(
            &model(HeadProxy::Fallback),
            &all_up,
            &none,
            Facts::default(),
        );
        assert_eq!(health(&m, 8000), Draining, "a worker is healthy");
        assert_eq!(health(&m, 8001), Healthy);
        // Workers down: the head takes the traffic.
        let workers_down = probes(&[
            (8000, P::Healthy),
            (8001, P::Unhealthy),
            (8002, P::Unhealthy),
        ]);
        let m = assess(
            &model(HeadProxy::Fallback),
            &workers_down,
            &none,
            Facts::default(),
        );
        assert_eq!(health(&m, 8000), Healthy);
        assert_eq!(health(&m, 8001), Unhealthy);
        assert!(m.fail_open().is_empty());
    }

    #[test]
    fn fail_open_when_every_serving_proxy_fails() {
        let down = probes(&[
            (8000, P::Unhealthy),
            (8001, P::Unhealthy),
            (8002, P::Draining),
        ]);
        let m = assess(
            &model(HeadProxy::Include),
            &down,
            &DashboardStates::default(),
            Facts::default(),
        );
        assert_eq!(health(&m, 8000), Healthy);
        assert_eq!(health(&m, 8001), Healthy);
        assert_eq!(health(&m, 8002), Draining, "draining stays draining");
        assert!(m.cluster(CLUSTER).fail_open);
        assert!(m.endpoints[&(CLUSTER.to_string(), addr(8001))]
            .reason
            .to_string()
            .starts_with("fail-open"));
        // One proxy healthy: no fail-open.
        let one = probes(&[
            (8000, P::Unhealthy),
            (8001, P::Healthy),
            (8002, P::Unhealthy),
        ]);
        let m = assess(
            &model(HeadProxy::Include),
            &one,
            &DashboardStates::default(),
            Facts::default(),
        );
        assert_eq!(health(&m, 8000), Unhealthy);
        assert!(m.fail_open().is_empty());
    }

    fn dashboard(status: ServeStatus) -> DashboardStates {
        let mut d = DashboardStates::default();
        d.clusters.insert(
            CLUSTER.to_string(),
            ClusterDashboard {
                status: Some(status.into()),
                ..ClusterDashboard::new("http://x".into())
            },
        );
        d
    }

    #[test]
    fn dashboard_draining_and_missing_routes_take_no_new_traffic() {
        let fixture = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/ray-serve-2.60/02-running.json"
        ))
        .unwrap();
        let mut status = parse(&fixture).unwrap();
        // The capture's one proxy runs on 192.0.2.2; make it ours and draining.
        let proxy = status.proxies.values_mut().next().unwrap();
        proxy.node_ip = "127.0.0.1".into();
        proxy.status = ProxyStatus::Draining;
        let up = probes(&[(8000, P::Healthy), (8001, P::Healthy), (8002, P::Healthy)]);
        let m = assess(
            &model(HeadProxy::Include),
            &up,
            &dashboard(status.clone()),
            Facts::default(),
        );
        assert_eq!(health(&m, 8001), Draining);

        // Healthy in the dashboard, but the proxies serve "/" while the app is at "/hello".
        status.proxies.values_mut().next().unwrap().status = ProxyStatus::Healthy;
        // Nobody serves /hello: nobody is held back for it.
        let m = assess(
            &model(HeadProxy::Include),
            &up,
            &dashboard(status.clone()),
            Facts::default(),
        );
        assert_eq!(health(&m, 8001), Healthy);
        // One proxy serves it: the others, lagging behind, take no new traffic.
        let mut one = up.clone();
        one.proxies.get_mut(&addr(8002)).unwrap().routes =
            Some(std::sync::Arc::new(["/hello".to_string()].into()));
        let m = assess(
            &model(HeadProxy::Include),
            &one,
            &dashboard(status.clone()),
            Facts::default(),
        );
        assert_eq!(health(&m, 8001), Draining);
        assert_eq!(health(&m, 8002), Healthy);
        assert!(m.endpoints[&(CLUSTER.to_string(), addr(8001))]
            .reason
            .to_string()
            .contains("/hello"));
        // A DEPLOYING application's prefix is not required.
        let mut deploying = status.clone();
        deploying.applications.get_mut("hello").unwrap().status = AppStatus::Deploying;
        let m = assess(
            &model(HeadProxy::Include),
            &one,
            &dashboard(deploying),
            Facts::default(),
        );
        assert_eq!(health(&m, 8001), Healthy);
        let mut serving = up.clone();
        for port in [8000, 8001, 8002] {
            serving.proxies.get_mut(&addr(port)).unwrap().routes =
                Some(std::sync::Arc::new(["/hello".to_string()].into()));
        }
        let m = assess(
            &model(HeadProxy::Include),
            &serving,
            &dashboard(status),
            Facts::default(),
        );
        assert_eq!(health(&m, 8001), Healthy);
    }

    #[test]
    fn unprobed_proxies_are_unknown() {
        let m = assess(
            &model(HeadProxy::Include),
            &ProbeStates::default(),
            &DashboardStates::default(),
            Facts::default(),
        );
        assert_eq!(health(&m, 8001), Unknown);
        assert!(m.fail_open().is_empty());
    }

    #[test]
    fn a_new_proxy_is_withheld_until_its_first_probe_and_a_departed_cluster_drains() {
        let none = DashboardStates::default();
        let some = probes(&[(8000, P::Healthy), (8001, P::Healthy)]);
        let withheld: BTreeSet<SocketAddr> = [addr(8002)].into();
        let facts = Facts {
            withheld: Some(&withheld),
            departed: None,
            leaving: None,
        };
        let m = assess(&model(HeadProxy::Include), &some, &none, facts);
        assert_eq!(health(&m, 8002), Withheld);
        assert_eq!(m.cluster(CLUSTER).routable, 2, "withheld is not routable");
        // Once probed, withholding no longer applies.
        let all = probes(&[(8000, P::Healthy), (8001, P::Healthy), (8002, P::Unhealthy)]);
        let m = assess(&model(HeadProxy::Include), &all, &none, facts);
        assert_eq!(health(&m, 8002), Unhealthy);

        let departed: BTreeSet<String> = [CLUSTER.to_string()].into();
        let facts = Facts {
            withheld: None,
            departed: Some(&departed),
            leaving: None,
        };
        let m = assess(&model(HeadProxy::Include), &all, &none, facts);
        for port in [8000, 8001, 8002] {
            assert_eq!(health(&m, port), Draining);
        }
        assert_eq!(
            m.cluster(CLUSTER),
            ClusterHealth::default(),
            "nothing ready or routable"
        );
    }

    #[test]
    fn ready_counts_live_proxies_whatever_the_head_policy_and_never_fail_open() {
        let none = DashboardStates::default();
        let up = probes(&[(8000, P::Healthy), (8001, P::Healthy), (8002, P::Unknown)]);
        let m = assess(&model(HeadProxy::Fallback), &up, &none, Facts::default());
        assert_eq!(
            health(&m, 8000),
            Draining,
            "the head waits behind its workers"
        );
        let c = m.cluster(CLUSTER);
        assert_eq!((c.ready, c.routable), (2, 2), "{c:?}");
        let down = probes(&[
            (8000, P::Unhealthy),
            (8001, P::Unhealthy),
            (8002, P::Unhealthy),
        ]);
        let m = assess(&model(HeadProxy::Include), &down, &none, Facts::default());
        let c = m.cluster(CLUSTER);
        assert!(c.fail_open);
        assert_eq!(
            (c.ready, c.routable),
            (0, 0),
            "fail-open is not readiness: {c:?}"
        );
        // A proxy the source says is going away is never ready.
        let mut going = model(HeadProxy::Include);
        let mut s = going.services()[0].clone();
        s.clusters[0].proxies[1].draining = true;
        going = Model::new(vec![s]).unwrap();
        let all = probes(&[(8000, P::Healthy), (8001, P::Healthy), (8002, P::Healthy)]);
        let m = assess(&going, &all, &none, Facts::default());
        assert_eq!(m.cluster(CLUSTER).ready, 2);
    }

    /// Cluster `a1` with direct ingress: `work`'s replicas at 30000..=30002 (HTTP).
    fn replica_model(draining_node: bool) -> Model {
        let mut s = service("a", "a1", &[8000]);
        s.clusters[0].proxies[0].draining = draining_node;
        s.clusters[0].direct_ingress = true;
        s.clusters[0].applications = vec![crate::model::test_support::app(
            "work",
            Some("/work"),
            &[30000, 30001, 30002],
        )];
        Model::new(vec![s]).unwrap()
    }

    const WORK: &str = "default/a/a1/app/work";

    #[test]
    fn replicas_are_judged_on_their_own_probes_in_their_application_s_cluster() {
        let none = DashboardStates::default();
        let states = probes(&[
            (8000, P::Healthy),
            (30000, P::Healthy),
            (30001, P::Unhealthy),
        ]);
        let withheld = BTreeSet::from([addr(30002)]);
        let m = assess(
            &replica_model(false),
            &states,
            &none,
            Facts {
                withheld: Some(&withheld),
                departed: None,
                leaving: None,
            },
        );
        assert_eq!(m.health(WORK, addr(30000)), Healthy);
        assert_eq!(m.health(WORK, addr(30001)), Unhealthy);
        assert_eq!(m.health(WORK, addr(30002)), Withheld);
        let c = m.cluster(WORK);
        assert_eq!((c.ready, c.routable, c.awaiting_first_probe), (1, 1, 1));
        // The proxy's cluster is its own: no replica in it.
        assert_eq!(m.cluster(CLUSTER).ready, 1);
        assert!(!m
            .endpoints
            .contains_key(&(CLUSTER.to_string(), addr(30000))));

        // A replica saying it drains (`DRAINING`), or on a node going away, drains.
        let states = probes(&[
            (30000, P::Draining),
            (30001, P::Healthy),
            (30002, P::Healthy),
        ]);
        let m = assess(&replica_model(true), &states, &none, Facts::default());
        assert_eq!(m.health(WORK, addr(30000)), Draining);
        // All three run on 127.0.0.1, the draining node's address.
        assert_eq!(m.health(WORK, addr(30001)), Draining);
        assert_eq!(m.cluster(WORK).routable, 0);
    }

    #[test]
    fn replicas_fail_open_and_drain_with_a_departed_cluster() {
        let none = DashboardStates::default();
        let down = probes(&[
            (30000, P::Unhealthy),
            (30001, P::Unhealthy),
            (30002, P::Unhealthy),
        ]);
        let m = assess(&replica_model(false), &down, &none, Facts::default());
        assert_eq!(m.health(WORK, addr(30000)), Healthy);
        let c = m.cluster(WORK);
        assert!(c.fail_open);
        assert_eq!((c.ready, c.routable), (0, 0));

        let up = probes(&[
            (30000, P::Healthy),
            (30001, P::Healthy),
            (30002, P::Healthy),
        ]);
        let departed = BTreeSet::from([CLUSTER.to_string()]);
        let m = assess(
            &replica_model(false),
            &up,
            &none,
            Facts {
                withheld: None,
                departed: Some(&departed),
                leaving: None,
            },
        );
        assert_eq!(m.health(WORK, addr(30000)), Draining);
        assert_eq!(m.cluster(WORK).ready, 0);
    }

    mod incremental {
        //! The [`Assessor`] across builds gives what a fresh [`assess`] gives from the
        //! same inputs, whatever changed between them.

        use super::*;
        use proptest::prelude::*;

        /// One build's inputs, as small numbers.
        #[derive(Clone, Debug)]
        struct Step {
            head: u8,
            grpc: bool,
            /// Which of `a`'s three proxies the source says are going away (bits).
            draining: u8,
            /// `a`'s direct ingress replicas of `work` (bits), and which left (bits).
            replicas: Option<(u8, u8)>,
            /// RayService `b` is there.
            b: bool,
            /// Each endpoint's probe by index (wrapping): `None` not probed; state,
            /// reason, routes (indices into the case's shared pools).
            probes: Vec<Option<(u8, u8, u8)>>,
            /// Index into the case's dashboard statuses (0: none).
            dashboard: u8,
            /// Withheld endpoints (bits, by index).
            withheld: u16,
            departed: bool,
        }

        fn step() -> impl Strategy<Value = Step> {
            (
                (0u8..3, any::<bool>(), 0u8..8),
                proptest::option::of((0u8..8, 0u8..8)),
                any::<bool>(),
                proptest::collection::vec(
                    proptest::option::weighted(0.9, (0u8..4, 0u8..3, 0u8..4)),
                    1..12,
                ),
                0u8..5,
                proptest::bool::weighted(0.3).prop_flat_map(|w| {
                    if w {
                        (0u16..4096).boxed()
                    } else {
                        Just(0u16).boxed()
                    }
                }),
                proptest::bool::weighted(0.2),
            )
                .prop_map(
                    |(
                        (head, grpc, draining),
                        replicas,
                        b,
                        probes,
                        dashboard,
                        withheld,
                        departed,
                    )| Step {
                        head,
                        grpc,
                        draining,
                        replicas,
                        b,
                        probes,
                        dashboard,
                        withheld,
                        departed,
                    },
                )
        }

        /// One input changed between two builds (or all of them).
        #[derive(Clone, Debug)]
        enum Edit {
            Head(u8),
            Grpc(bool),
            Draining(u8),
            Replicas(Option<(u8, u8)>),
            B(bool),
            Probe(usize, Option<(u8, u8, u8)>),
            /// One endpoint's route table alone (when probed).
            Routes(usize, u8),
            /// One endpoint's probe reason alone (when probed).
            Reason(usize, u8),
            Dashboard(u8),
            Withheld(u16),
            Departed(bool),
            Whole(Step),
        }

        fn edit() -> impl Strategy<Value = Edit> {
            prop_oneof![
                1 => (0u8..3).prop_map(Edit::Head),
                1 => any::<bool>().prop_map(Edit::Grpc),
                1 => (0u8..8).prop_map(Edit::Draining),
                1 => proptest::option::of((0u8..8, 0u8..8)).prop_map(Edit::Replicas),
                1 => any::<bool>().prop_map(Edit::B),
                4 => (0usize..12, proptest::option::weighted(0.9, (0u8..4, 0u8..3, 0u8..4)))
                    .prop_map(|(i, p)| Edit::Probe(i, p)),
                2 => (0usize..12, 0u8..4).prop_map(|(i, r)| Edit::Routes(i, r)),
                1 => (0usize..12, 0u8..3).prop_map(|(i, r)| Edit::Reason(i, r)),
                2 => (0u8..5).prop_map(Edit::Dashboard),
                1 => (0u16..4096).prop_map(Edit::Withheld),
                1 => any::<bool>().prop_map(Edit::Departed),
                1 => step().prop_map(Edit::Whole),
            ]
        }

        impl Step {
            fn apply(&mut self, edit: &Edit) {
                match edit.clone() {
                    Edit::Head(h) => self.head = h,
                    Edit::Grpc(g) => self.grpc = g,
                    Edit::Draining(d) => self.draining = d,
                    Edit::Replicas(r) => self.replicas = r,
                    Edit::B(b) => self.b = b,
                    Edit::Probe(i, p) => {
                        let n = self.probes.len();
                        self.probes[i % n] = p;
                    }
                    Edit::Routes(i, r) => {
                        let n = self.probes.len();
                        if let Some(p) = &mut self.probes[i % n] {
                            p.2 = r;
                        }
                    }
                    Edit::Reason(i, r) => {
                        let n = self.probes.len();
                        if let Some(p) = &mut self.probes[i % n] {
                            p.1 = r;
                        }
                    }
                    Edit::Dashboard(d) => self.dashboard = d,
                    Edit::Withheld(w) => self.withheld = w,
                    Edit::Departed(d) => self.departed = d,
                    Edit::Whole(s) => *self = s,
                }
            }
        }

        /// What every step of a case shares, so that unchanged inputs are the same
        /// allocations (as between builds) and equal ones sometimes are not.
        struct Pools {
            reasons: Vec<Arc<str>>,
            routes: Vec<Option<Arc<BTreeSet<String>>>>,
            dashboards: Vec<Option<Arc<ServeStatus>>>,
        }

        fn pools() -> Pools {
            let fixture = std::fs::read(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/ray-serve-2.60/02-running.json"
            ))
            .unwrap();
            let running = parse(&fixture).unwrap();
            let mut ours = running.clone();
            let proxy = ours.proxies.values_mut().next().unwrap();
            proxy.node_ip = "127.0.0.1".into();
            proxy.status = ProxyStatus::Draining;
            let mut elsewhere = running.clone();
            for a in elsewhere.applications.values_mut() {
                a.route_prefix = Some("/work".into());
            }
            let root: Arc<BTreeSet<String>> = Arc::new(["/".to_string()].into());
            Pools {
                reasons: vec!["timeout".into(), "HTTP 500".into(), "timeout".into()],
                routes: vec![
                    None,
                    Some(root.clone()),
                    Some(Arc::new(["/".to_string(), "/work".to_string()].into())),
                    Some(Arc::new((*root).clone())),
                ],
                dashboards: vec![
                    None,
                    Some(Arc::new(running.clone())),
                    Some(Arc::new(ours)),
                    Some(Arc::new(elsewhere)),
                    Some(Arc::new(running)),
                ],
            }
        }

        fn model_of(s: &Step) -> Model {
            let mut a = service("a", "a1", &[8000, 8001, 8002]);
            a.policy.head_proxy =
                [HeadProxy::Exclude, HeadProxy::Include, HeadProxy::Fallback][usize::from(s.head)];
            for (i, p) in a.clusters[0].proxies.iter_mut().enumerate() {
                p.draining = s.draining & (1 << i) != 0;
                if s.grpc {
                    p.grpc = Some(addr(p.address.port() + 1000));
                }
            }
            if let Some((bits, _)) = s.replicas {
                let ports: Vec<u16> = (0..3)
                    .filter(|i| bits & (1 << i) != 0)
                    .map(|i| 30000 + i)
                    .collect();
                a.clusters[0].direct_ingress = true;
                a.clusters[0].applications = vec![crate::model::test_support::app(
                    "work",
                    Some("/work"),
                    &ports,
                )];
            }
            let mut services = vec![a];
            if s.b {
                services.push(service("b", "b1", &[8500, 8501]));
            }
            Model::new(services).unwrap()
        }

        /// Every endpoint the model has, in a fixed order (probes and withheld bits
        /// index it).
        fn endpoints(m: &Model) -> Vec<SocketAddr> {
            let mut out: Vec<SocketAddr> = m.endpoints().map(|(a, _)| a).collect();
            for svc in m.services() {
                for c in &svc.clusters {
                    out.extend(c.replica_endpoints().map(|(a, _)| a));
                }
            }
            out.sort();
            out.dedup();
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]
            #[test]
            fn an_assessment_across_builds_equals_a_fresh_one(
                first in step(),
                edits in proptest::collection::vec(edit(), 0..24),
            ) {
                let pools = pools();
                let mut assessor = Assessor::default();
                let mut s = first;
                // As the pipeline gives them: the model of the build before when equal
                // (the very `Arc`), and the probes as the prober publishes them, sharing
                // every proxy's state that did not change.
                let mut model: Option<Arc<Model>> = None;
                let mut probes = ProbeStates::default();
                for edit in std::iter::once(None).chain(edits.iter().map(Some)) {
                    if let Some(edit) = edit {
                        s.apply(edit);
                    }
                    let s = &s;
                    let next = model_of(s);
                    let model = match model.take() {
                        Some(m) if *m == next => model.insert(m).clone(),
                        _ => model.insert(Arc::new(next)).clone(),
                    };
                    let all = endpoints(&model);
                    let mut wanted = BTreeMap::new();
                    for (i, address) in all.iter().enumerate() {
                        let Some((state, reason, routes)) = s.probes[i % s.probes.len()] else { continue };
                        let mut p = ProxyProbe::new(SystemTime::UNIX_EPOCH);
                        p.state = [P::Unknown, P::Healthy, P::Unhealthy, P::Draining][usize::from(state)];
                        p.reason = pools.reasons[usize::from(reason)].clone();
                        p.routes = pools.routes[usize::from(routes)].clone();
                        wanted.insert(*address, p);
                    }
                    let gone: Vec<SocketAddr> =
                        probes.proxies.keys().filter(|a| !wanted.contains_key(a)).copied().collect();
                    for a in gone {
                        probes.proxies.remove(&a);
                    }
                    for (a, p) in wanted {
                        if probes.proxies.get(&a) != Some(&p) {
                            probes.proxies.insert(a, p);
                        }
                    }
                    let mut dashboards = DashboardStates::default();
                    if let Some(status) = &pools.dashboards[usize::from(s.dashboard)] {
                        dashboards.clusters.insert(
                            CLUSTER.to_string(),
                            ClusterDashboard {
                                status: Some(status.clone()),
                                ..ClusterDashboard::new("http://x".into())
                            },
                        );
                    }
                    let withheld: BTreeSet<SocketAddr> = all
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| s.withheld & (1 << (i % 12)) != 0)
                        .map(|(_, a)| *a)
                        .collect();
                    let departed: BTreeSet<String> =
                        s.departed.then(|| CLUSTER.to_string()).into_iter().collect();
                    let leaving: BTreeMap<String, Vec<SocketAddr>> = s
                        .replicas
                        .map(|(_, left)| {
                            let ports = (0..3).filter(|i| left & (1 << i) != 0).map(|i| addr(30000 + i));
                            (WORK.to_string(), ports.collect())
                        })
                        .into_iter()
                        .collect();
                    let facts = Facts {
                        withheld: Some(&withheld),
                        departed: Some(&departed),
                        leaving: Some(&leaving),
                    };
                    let kept = assessor.assess_shared(&model, &probes, &dashboards, facts);
                    let fresh = assess(&model, &probes, &dashboards, facts);
                    prop_assert_eq!(kept, fresh);
                }
            }
        }

        #[test]
        fn a_route_table_that_changed_alone_is_judged_again() {
            let pools = pools();
            let m = model(HeadProxy::Include);
            let mut dashboards = DashboardStates::default();
            dashboards.clusters.insert(
                CLUSTER.to_string(),
                ClusterDashboard {
                    status: pools.dashboards[3].clone(),
                    ..ClusterDashboard::new("http://x".into())
                },
            );
            let mut up = probes(&[(8000, P::Healthy), (8001, P::Healthy), (8002, P::Healthy)]);
            up.proxies.get_mut(&addr(8000)).unwrap().routes = pools.routes[2].clone();
            let mut assessor = Assessor::default();
            let before = assessor.assess(&m, &up, &dashboards, Facts::default());
            assert_eq!(health(&before, 8001), Draining, "{before:?}");
            up.proxies.get_mut(&addr(8001)).unwrap().routes = pools.routes[2].clone();
            let after = assessor.assess(&m, &up, &dashboards, Facts::default());
            assert_eq!(health(&after, 8001), Healthy);
            assert_eq!(after, assess(&m, &up, &dashboards, Facts::default()));
        }

        #[test]
        fn an_unchanged_cluster_keeps_its_verdicts_and_a_changed_one_is_judged_again() {
            let m = Model::new(vec![
                service("a", "a1", &[8000, 8001]),
                service("b", "b1", &[9000]),
            ])
            .unwrap();
            let none = DashboardStates::default();
            let mut assessor = Assessor::default();
            let up = probes(&[(8000, P::Healthy), (8001, P::Healthy), (9000, P::Healthy)]);
            let first = assessor.assess(&m, &up, &none, Facts::default());
            let mut down = up.clone();
            down.proxies.get_mut(&addr(9000)).unwrap().state = P::Unhealthy;
            down.proxies.get_mut(&addr(9000)).unwrap().reason = "HTTP 500".into();
            let second = assessor.assess(&m, &down, &none, Facts::default());
            let shared = |h: &HealthMap, c: &str| h.endpoints.0[c].clone();
            assert!(Arc::ptr_eq(
                &shared(&first, CLUSTER),
                &shared(&second, CLUSTER)
            ));
            assert!(!Arc::ptr_eq(
                &shared(&first, "default/b/b1"),
                &shared(&second, "default/b/b1")
            ));
            assert_eq!(second, assess(&m, &down, &none, Facts::default()));
        }
    }
}

//! Discovery: what a cluster's dashboard adds to the source's model.
//!
//! [`discover`] is pure: it takes the source's model and what every dashboard last said,
//! and gives the *effective* model, in which
//!
//! - each cluster that discovers its proxies
//!   ([`RayCluster::discover`](crate::model::RayCluster::discover)) has the HTTP proxies of
//!   its dashboard's last answer
//!   ([`ServeStatus::http_proxies`](super::dashboard::ServeStatus::http_proxies): targets
//!   and listed proxies, head or worker by the controller's node); clusters whose source
//!   lists their proxies keep them;
//! - every cluster with a dashboard has the applications its last answer lists
//!   ([`RayCluster::applications`](crate::model::RayCluster::applications)), and with
//!   Ray's direct ingress each application's ingress replicas
//!   ([`super::target_groups`]), each through the address policy
//!   ([`AddressPolicy::check_replica`]: Ray's replica ports, and on one of the cluster's
//!   listed nodes, or within `proxies.networks`, or, for a cluster whose proxies are
//!   discovered, in its dashboard's network).
//!
//! The runtime runs it in one task, the single writer of the effective model ([`run`]).
//!
//! Invariants:
//!
//! - A dashboard whose last poll failed (stale) keeps its last answer, so its proxies
//!   stay: a failed poll never withdraws proxies. Only an answer that no longer lists a
//!   proxy removes it, as Ray does.
//! - A dashboard that has never answered (or answered for another URL than the one the
//!   cluster now names) gives no proxies.
//! - Discovered proxies are never marked `draining` here: a DRAINING proxy stays in the
//!   model and `live::health` drains it from the same dashboard answer.
//! - The result is a valid [`Model`] (proxies sorted, each address once per cluster).
//! - Refusals stay cheap to report however many there are (80,000 once meant 80,000 WARN
//!   lines a poll and an 18 MB `/debug/state`): they are logged one line per cluster,
//!   origin and reason, with the count and a few example addresses, only when that
//!   group's addresses change; `/debug/state` lists the first [`REFUSED_SHOWN`] and counts
//!   the rest per reason ([`RefusedSummary`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::dashboard::ServeStatus;
use super::dashboards::{ClusterDashboard, DashboardStates};
use crate::metrics::Metrics;
use crate::model::{
    canonical_ip, contested_replicas, AddressPolicy, AddressRefusal, Application, Model, Protocol,
    Proxy, ProxyOrigin, RayCluster, ReplicaNodes,
};

/// A proxy left out of the effective model by the [`AddressPolicy`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct RefusedProxy {
    /// The Envoy cluster it would have served.
    pub cluster: String,
    pub address: SocketAddr,
    /// `source` or `dashboard`.
    pub from: &'static str,
    /// A fixed label for metrics.
    pub label: &'static str,
    pub reason: String,
}

/// What [`discover`] gives: the effective model and what the address policy refused.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Discovered {
    pub model: Model,
    /// Sorted.
    pub refused: Vec<RefusedProxy>,
}

/// How many refused proxies `/debug/state` lists; the rest are only counted.
pub(crate) const REFUSED_SHOWN: usize = 100;

/// How many example addresses a log line about refused proxies names.
const REFUSAL_EXAMPLES: usize = 3;

/// The refused proxies as `/debug/state` shows them: the first [`REFUSED_SHOWN`] of the
/// sorted list, how many there are in all, and how many per reason label, so that the
/// page stays small whatever a dashboard lists.
#[derive(Debug, PartialEq, Serialize)]
pub(crate) struct RefusedSummary<'a> {
    pub shown: &'a [RefusedProxy],
    pub total: usize,
    /// Reason label → how many proxies it refused.
    pub by_reason: BTreeMap<&'static str, usize>,
}

impl<'a> RefusedSummary<'a> {
    pub(crate) fn of(refused: &'a [RefusedProxy]) -> Self {
        let mut by_reason = BTreeMap::new();
        for r in refused {
            *by_reason.entry(r.label).or_insert(0) += 1;
        }
        RefusedSummary {
            shown: &refused[..refused.len().min(REFUSED_SHOWN)],
            total: refused.len(),
            by_reason,
        }
    }
}

/// The refusals one log line reports: one cluster's, from one origin, for one reason.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct RefusalGroup {
    cluster: String,
    from: &'static str,
    label: &'static str,
    reason: String,
}

/// Each group's refused addresses, sorted.
type RefusalGroups = BTreeMap<RefusalGroup, Vec<SocketAddr>>;

fn refusal_groups(refused: &[RefusedProxy]) -> RefusalGroups {
    let mut groups = RefusalGroups::new();
    for r in refused {
        let group = RefusalGroup {
            cluster: r.cluster.clone(),
            from: r.from,
            label: r.label,
            reason: r.reason.clone(),
        };
        groups.entry(group).or_default().push(r.address);
    }
    for addresses in groups.values_mut() {
        addresses.sort();
    }
    groups
}

/// The groups of `now` whose addresses differ from those of `before` (new ones included):
/// the ones to log again.
fn changed_groups<'a>(
    before: &'a RefusalGroups,
    now: &'a RefusalGroups,
) -> impl Iterator<Item = (&'a RefusalGroup, &'a [SocketAddr])> + 'a {
    now.iter()
        .filter(move |(group, addresses)| before.get(*group) != Some(*addresses))
        .map(|(group, addresses)| (group, addresses.as_slice()))
}

/// The first few `addresses`, and how many more there are: `a, b, c and 7 more`.
fn examples(addresses: &[SocketAddr]) -> String {
    let named: Vec<String> = addresses
        .iter()
        .take(REFUSAL_EXAMPLES)
        .map(SocketAddr::to_string)
        .collect();
    let mut text = named.join(", ");
    let more = addresses.len().saturating_sub(REFUSAL_EXAMPLES);
    if more > 0 {
        text.push_str(&format!(" and {more} more"));
    }
    text
}

/// The IP address a dashboard answered from, or else the one its URL names.
fn dashboard_ip(url: &str, answered_from: Option<IpAddr>) -> Option<IpAddr> {
    answered_from.or_else(|| {
        let uri: http::Uri = url.parse().ok()?;
        let host = uri.host()?;
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .ok()
    })
}

/// The effective model: `model` with every discovering cluster's proxies taken from its
/// dashboard's last known answer in `dashboards`, and every proxy the address `policy`
/// refuses left out (and listed in [`Discovered::refused`]); then each cluster's
/// applications and ingress replicas, under the same policy.
pub fn discover(model: &Model, dashboards: &DashboardStates, policy: &AddressPolicy) -> Discovered {
    let mut refused = Vec::new();
    let model = model.with_proxies(|envoy_cluster, cluster| {
        let dashboard = cluster_dashboard(dashboards, envoy_cluster, cluster);
        let (candidates, origin) = candidates(cluster, dashboard);
        checked_proxies(envoy_cluster, candidates, origin, policy, &mut refused)
    });
    let mut given: Vec<(String, Vec<Application>)> = Vec::new();
    let model = model.with_applications(|envoy_cluster, cluster| {
        // Until the dashboard answers, what the source says (Kubernetes: the Serve config).
        let Some(dashboard) =
            cluster_dashboard(dashboards, envoy_cluster, cluster).filter(|d| d.status.is_some())
        else {
            return (false, cluster.applications.clone());
        };
        let status = dashboard.status.as_ref().expect("filtered above");
        let listed: BTreeSet<IpAddr> = cluster
            .proxies
            .iter()
            .filter(|p| !p.host_network)
            .map(|p| canonical_ip(p.address.ip()))
            .collect();
        let nodes = if cluster.discover {
            ReplicaNodes::Dashboard(dashboard_ip(&dashboard.url, status.answered_from))
        } else {
            ReplicaNodes::Listed(&listed)
        };
        let applications = applications(status, |address, protocol| {
            match policy.check_replica(address, protocol, nodes) {
                Ok(()) => true,
                Err(why) => {
                    refused.push(RefusedProxy {
                        cluster: envoy_cluster.to_string(),
                        address,
                        from: "dashboard",
                        label: why.label(),
                        reason: format!("ingress replica ({}): {why}", protocol.as_str()),
                    });
                    false
                }
            }
        });
        given.push((envoy_cluster.to_string(), applications.clone()));
        (status.ingress.on, applications)
    });
    refuse_claimed_twice(&model, &given, &mut refused);
    refused.sort();
    refused.dedup();
    Discovered { model, refused }
}

/// The last answer of `cluster`'s own dashboard (one at the URL the source names).
fn cluster_dashboard<'a>(
    dashboards: &'a DashboardStates,
    envoy_cluster: &str,
    cluster: &RayCluster,
) -> Option<&'a ClusterDashboard> {
    dashboards
        .clusters
        .get(envoy_cluster)
        .filter(|d| cluster.dashboard.as_deref() == Some(d.url.as_str()))
}

/// A cluster's proxies before the address policy: those its dashboard lists (when it
/// discovers them; none before the dashboard answers) or those the source lists.
fn candidates(
    cluster: &RayCluster,
    dashboard: Option<&ClusterDashboard>,
) -> (Vec<Proxy>, ProxyOrigin) {
    if !cluster.discover {
        return (cluster.proxies.clone(), ProxyOrigin::Source);
    }
    let answer = dashboard.and_then(|d| d.status.as_ref());
    let proxies: Vec<Proxy> = answer
        .map(|status| {
            status
                .http_proxies
                .iter()
                .map(|p| Proxy {
                    address: p.address,
                    // The source's port, else the one Ray reports.
                    grpc: cluster
                        .grpc_port
                        .or(status.grpc_port)
                        .map(|port| SocketAddr::new(p.address.ip(), port)),
                    node_type: p.node_type,
                    draining: false,
                    host_network: false,
                })
                .collect()
        })
        .unwrap_or_default();
    let ip = dashboard.and_then(|d| dashboard_ip(&d.url, answer.and_then(|s| s.answered_from)));
    (proxies, ProxyOrigin::Dashboard(ip))
}

/// The `candidates` the address policy lets through; a refused gRPC endpoint is dropped
/// alone (the proxy keeps HTTP). Every refusal goes to `refused`.
fn checked_proxies(
    envoy_cluster: &str,
    candidates: Vec<Proxy>,
    origin: ProxyOrigin,
    policy: &AddressPolicy,
    refused: &mut Vec<RefusedProxy>,
) -> Vec<Proxy> {
    let http: BTreeSet<SocketAddr> = candidates.iter().map(|p| p.address).collect();
    let mut refuse = |address, origin, why: AddressRefusal, what: &str| {
        refused.push(RefusedProxy {
            cluster: envoy_cluster.to_string(),
            address,
            from: match origin {
                ProxyOrigin::Source | ProxyOrigin::HostNetwork => "source",
                ProxyOrigin::Dashboard(_) => "dashboard",
            },
            label: why.label(),
            reason: format!("{what}{why}"),
        })
    };
    candidates
        .into_iter()
        .filter_map(|mut p| {
            // A hostNetwork pod's address is its node's: not trusted as the source's.
            let origin = match origin {
                ProxyOrigin::Source if p.host_network => ProxyOrigin::HostNetwork,
                origin => origin,
            };
            if let Err(why) = policy.check(p.address, origin) {
                refuse(p.address, origin, why, "");
                return None;
            }
            // Its gRPC endpoint by the same policy: refused, the proxy keeps HTTP.
            if let Some(grpc) = p.grpc {
                let checked = if http.contains(&grpc) {
                    Err(AddressRefusal::ProtocolClash)
                } else {
                    policy.check(grpc, origin)
                };
                if let Err(why) = checked {
                    refuse(grpc, origin, why, "gRPC: ");
                    p.grpc = None;
                }
            }
            Some(p)
        })
        .collect()
}

/// Replica addresses two lists claim, or a proxy's: `with_applications` gives them to
/// nobody; each is reported where it was listed.
fn refuse_claimed_twice(
    model: &Model,
    given: &[(String, Vec<Application>)],
    refused: &mut Vec<RefusedProxy>,
) {
    let contested = contested_replicas(given.iter().flat_map(|(_, l)| l));
    let proxies = model.proxy_addresses();
    for (cluster, list) in given {
        for app in list {
            for (protocol, replicas) in [
                (Protocol::Http, &app.http_replicas),
                (Protocol::Grpc, &app.grpc_replicas),
            ] {
                for address in replicas {
                    if contested.contains(address) || proxies.contains(address) {
                        let why = AddressRefusal::ClaimedTwice;
                        refused.push(RefusedProxy {
                            cluster: cluster.clone(),
                            address: *address,
                            from: "dashboard",
                            label: why.label(),
                            reason: format!(
                                "ingress replica ({}) of {}: {why}",
                                protocol.as_str(),
                                app.name
                            ),
                        });
                    }
                }
            }
        }
    }
}

/// The applications a dashboard answer lists, each with the ingress replicas `allowed`
/// lets through (direct ingress; none without). Routing is Ray's: an application with
/// no route prefix gets no HTTP route.
fn applications(
    status: &ServeStatus,
    mut allowed: impl FnMut(SocketAddr, Protocol) -> bool,
) -> Vec<Application> {
    status
        .applications
        .iter()
        .map(|(name, app)| {
            let targets = status.ingress.apps.get(name);
            let mut replicas = |protocol| -> Vec<SocketAddr> {
                targets
                    .map(|t| t.replicas(protocol))
                    .unwrap_or_default()
                    .iter()
                    .map(|r| r.address)
                    .filter(|a| allowed(*a, protocol))
                    .collect()
            };
            Application {
                name: name.clone(),
                route_prefix: app.route_prefix.clone(),
                http_replicas: replicas(Protocol::Http),
                grpc_replicas: replicas(Protocol::Grpc),
            }
        })
        .collect()
}

/// The single writer of the effective model and of the refused proxies: the source's
/// model, with each cluster that discovers its proxies given those its dashboard last
/// listed, through the address policy ([`discover`]). Re-run when either input changes;
/// published only on change. When no cluster has a dashboard and the policy refuses nothing,
/// the source's model is forwarded as is (the same `Arc`: no copy, and dashboard polls
/// cost nothing here).
#[derive(Clone)]
pub(crate) struct Discovery {
    pub policy: AddressPolicy,
    pub metrics: Arc<Metrics>,
}

impl Discovery {
    pub async fn run(
        self,
        mut source: watch::Receiver<Arc<Model>>,
        mut dashboards: watch::Receiver<Arc<DashboardStates>>,
        effective: watch::Sender<Arc<Model>>,
        refused_tx: watch::Sender<Arc<Vec<RefusedProxy>>>,
        shutdown: CancellationToken,
    ) {
        let mut logged = RefusalGroups::new();
        loop {
            let model = source.borrow_and_update().clone();
            // Dashboards give proxies (discovering clusters) and applications (every
            // cluster with one).
            let discovers = model
                .services()
                .iter()
                .flat_map(|s| &s.clusters)
                .any(|c| c.dashboard.is_some());
            let states = dashboards.borrow_and_update().clone();
            let Discovered {
                model: next,
                refused,
            } = discover(&model, &states, &self.policy);
            if !discovers && refused.is_empty() {
                effective.send_if_modified(|current| {
                    let changed = !Arc::ptr_eq(current, &model);
                    if changed {
                        *current = model;
                    }
                    changed
                });
            } else {
                effective.send_if_modified(|current| {
                    let changed = **current != next;
                    if changed {
                        *current = Arc::new(next);
                    }
                    changed
                });
            }
            self.report(&refused, &mut logged);
            refused_tx.send_if_modified(|current| {
                let changed = **current != refused;
                if changed {
                    *current = Arc::new(refused);
                }
                changed
            });
            // Dashboards matter when a cluster has one (see `discover`).
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

    /// Logs the refusals, one line per cluster, origin and reason with the count and a few
    /// examples, when that group's addresses changed since the last report (so once while
    /// nothing changes, however many there are), and sets the gauge.
    fn report(&self, refused: &[RefusedProxy], logged: &mut RefusalGroups) {
        let now = refusal_groups(refused);
        for (group, addresses) in changed_groups(logged, &now) {
            tracing::warn!(cluster = %group.cluster, from = group.from, reason = %group.reason, count = addresses.len(), examples = %examples(addresses), "proxies refused by the address policy: not published");
        }
        *logged = now;
        self.metrics
            .set_refused_proxies(refused.iter().map(|r| r.label));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::dashboard::{parse, HttpProxy, ProxyStatus, ServeStatus};
    use crate::live::dashboards::ClusterDashboard;
    use crate::model::test_support::service;
    use crate::model::NodeType;
    use pretty_assertions::assert_eq;
    use std::net::SocketAddr;

    const URL: &str = "http://192.0.2.2:8265";

    fn effective(m: &Model, d: &DashboardStates) -> Model {
        discover(m, d, &AddressPolicy::default()).model
    }
    const CLUSTER: &str = "default/a/a1";

    /// Service `a`: cluster `a1` discovers from URL; service `b` lists one proxy.
    fn model() -> Model {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        a.clusters[0].dashboard = Some(URL.into());
        let mut b = service("b", "b1", &[9000]);
        b.clusters[0].dashboard = Some("http://192.0.2.50:8265".into());
        Model::new(vec![a, b]).unwrap()
    }

    fn proxy(address: &str, node_type: NodeType, status: &str) -> HttpProxy {
        HttpProxy {
            address: address.parse().unwrap(),
            node_id: format!("node-{address}"),
            node_type,
            status: Some(ProxyStatus::from_ray(status)),
        }
    }

    fn answered(proxies: Vec<HttpProxy>) -> ClusterDashboard {
        let mut d = ClusterDashboard::new(URL.into());
        d.status = Some(std::sync::Arc::new(ServeStatus {
            http_proxies: proxies,
            ..Default::default()
        }));
        d
    }

    fn states(entries: Vec<(&str, ClusterDashboard)>) -> DashboardStates {
        DashboardStates {
            clusters: entries
                .into_iter()
                .map(|(c, d)| (c.to_string(), d))
                .collect(),
        }
    }

    fn discovered(m: &Model) -> Vec<(SocketAddr, NodeType, bool)> {
        m.services()[0].clusters[0]
            .proxies
            .iter()
            .map(|p| (p.address, p.node_type, p.draining))
            .collect()
    }

    #[test]
    fn fills_a_discovering_cluster_from_its_dashboard() {
        let d = states(vec![(
            CLUSTER,
            answered(vec![
                proxy("192.0.2.2:8000", NodeType::Head, "HEALTHY"),
                proxy("192.0.2.3:8000", NodeType::Worker, "STARTING"),
                proxy("192.0.2.4:8000", NodeType::Worker, "DRAINING"),
            ]),
        )]);
        let m = effective(&model(), &d);
        assert_eq!(
            discovered(&m),
            [
                ("192.0.2.2:8000".parse().unwrap(), NodeType::Head, false),
                ("192.0.2.3:8000".parse().unwrap(), NodeType::Worker, false),
                ("192.0.2.4:8000".parse().unwrap(), NodeType::Worker, false),
            ]
        );
        // The listed service is untouched.
        assert_eq!(m.services()[1], model().services()[1]);
        assert!(m.services()[0].clusters[0].discover);
    }

    #[test]
    fn discovered_proxies_serve_grpc_on_the_port_ray_reports_unless_the_source_says() {
        let grpc_of = |m: &Model| -> Vec<Option<String>> {
            m.services()[0].clusters[0]
                .proxies
                .iter()
                .map(|p| p.grpc.map(|g| g.to_string()))
                .collect()
        };
        let mut d = answered(vec![
            proxy("192.0.2.2:8000", NodeType::Head, "HEALTHY"),
            proxy("192.0.2.3:8000", NodeType::Worker, "STARTING"),
        ]);
        let m = effective(&model(), &states(vec![(CLUSTER, d.clone())]));
        assert_eq!(grpc_of(&m), [None, None], "Ray reports no gRPC");
        d.status = Some(std::sync::Arc::new(ServeStatus {
            grpc_port: Some(9000),
            ..(**d.status.as_ref().unwrap()).clone()
        }));
        let m = effective(&model(), &states(vec![(CLUSTER, d.clone())]));
        assert_eq!(
            grpc_of(&m),
            [Some("192.0.2.2:9000".into()), Some("192.0.2.3:9000".into())]
        );
        // The source's grpc_port wins.
        let mut source = model();
        source = source.with_proxies(|_, c| c.proxies.clone());
        let mut services = source.services().to_vec();
        services[0].clusters[0].grpc_port = Some(9100);
        let source = Model::new(services).unwrap();
        let m = effective(&source, &states(vec![(CLUSTER, d)]));
        assert_eq!(
            grpc_of(&m),
            [Some("192.0.2.2:9100".into()), Some("192.0.2.3:9100".into())]
        );
    }

    #[test]
    fn a_dashboard_that_never_answered_gives_no_proxies() {
        let m = effective(&model(), &DashboardStates::default());
        assert_eq!(m, model());
        // Polled but failing from the start: still nothing.
        let mut d = ClusterDashboard::new(URL.into());
        d.stale = true;
        d.last_error = Some("dashboard unreachable".into());
        let m = effective(&model(), &states(vec![(CLUSTER, d)]));
        assert!(discovered(&m).is_empty());
    }

    #[test]
    fn a_stale_dashboard_keeps_its_last_proxies() {
        let mut d = answered(vec![proxy("192.0.2.2:8000", NodeType::Head, "HEALTHY")]);
        d.stale = true;
        d.last_error = Some("dashboard answered HTTP 503".into());
        let m = effective(&model(), &states(vec![(CLUSTER, d)]));
        assert_eq!(discovered(&m).len(), 1);
    }

    #[test]
    fn proxies_come_and_go_with_the_answer() {
        let two = answered(vec![
            proxy("192.0.2.2:8000", NodeType::Head, "HEALTHY"),
            proxy("192.0.2.3:8000", NodeType::Worker, "HEALTHY"),
        ]);
        let one = answered(vec![proxy("192.0.2.2:8000", NodeType::Head, "HEALTHY")]);
        assert_eq!(
            discovered(&effective(&model(), &states(vec![(CLUSTER, two)]))).len(),
            2
        );
        assert_eq!(
            discovered(&effective(&model(), &states(vec![(CLUSTER, one)]))).len(),
            1
        );
        // Serve not running any more: no proxies.
        let none = answered(vec![]);
        assert!(discovered(&effective(&model(), &states(vec![(CLUSTER, none)]))).is_empty());
    }

    #[test]
    fn an_answer_for_another_url_does_not_count() {
        let mut d = answered(vec![proxy("192.0.2.2:8000", NodeType::Head, "HEALTHY")]);
        d.url = "http://192.0.2.99:8265".into();
        let m = effective(&model(), &states(vec![(CLUSTER, d)]));
        assert!(discovered(&m).is_empty());
    }

    #[test]
    fn from_the_running_capture() {
        let body = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/ray-serve-2.60/02-running.json"
        ))
        .unwrap();
        let mut d = ClusterDashboard::new(URL.into());
        d.status = Some(parse(&body).unwrap().into());
        let m = effective(&model(), &states(vec![(CLUSTER, d)]));
        assert_eq!(
            discovered(&m),
            [("192.0.2.2:8000".parse().unwrap(), NodeType::Head, false)]
        );
    }

    /// A proxy the source lists from a hostNetwork pod (its node's address) is
    /// refused unless `proxies.networks` allows it; the pod's own addresses stay trusted.
    #[test]
    fn a_host_network_proxy_is_refused_without_networks() {
        let mut b = service("b", "b1", &[9000, 9001]);
        b.clusters[0].proxies[1].host_network = true;
        let m = Model::new(vec![b]).unwrap();
        let d = discover(&m, &DashboardStates::default(), &AddressPolicy::default());
        let ports: Vec<u16> = d.model.proxies().map(|p| p.address.port()).collect();
        assert_eq!(ports, [9000]);
        assert_eq!(
            d.refused,
            [RefusedProxy {
                cluster: "default/b/b1".into(),
                address: "127.0.0.1:9001".parse().unwrap(),
                from: "source",
                label: "host_network",
                reason: crate::model::AddressRefusal::HostNetwork.to_string(),
            }]
        );
        let allowed = AddressPolicy {
            networks: vec!["127.0.0.0/8".parse().unwrap()],
            ..Default::default()
        };
        let d = discover(&m, &DashboardStates::default(), &allowed);
        assert_eq!(d.model.proxies().count(), 2);
        assert!(d.refused.is_empty());
    }
}

#[cfg(test)]
mod application_tests {
    use super::*;
    use crate::live::dashboard::parse;
    use crate::live::dashboards::ClusterDashboard;
    use crate::model::test_support::service;
    use pretty_assertions::assert_eq;

    const URL: &str = "http://192.0.2.2:8265";

    fn capture(name: &str) -> ServeStatus {
        let path = format!(
            "{}/tests/fixtures/ray-serve-2.60/direct-ingress/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        parse(&std::fs::read(path).unwrap()).unwrap()
    }

    fn answered(url: &str, status: ServeStatus) -> ClusterDashboard {
        let mut d = ClusterDashboard::new(url.into());
        d.status = Some(std::sync::Arc::new(status));
        d
    }

    /// (application, route prefix, HTTP replica ports) of the first cluster.
    fn apps(m: &Model) -> Vec<(String, Option<String>, Vec<u16>)> {
        m.services()[0].clusters[0]
            .applications
            .iter()
            .map(|a| {
                let ports = a.http_replicas.iter().map(|r| r.port()).collect();
                (a.name.clone(), a.route_prefix.clone(), ports)
            })
            .collect()
    }

    fn app(name: &str, prefix: &str, ports: &[u16]) -> (String, Option<String>, Vec<u16>) {
        (name.into(), Some(prefix.into()), ports.to_vec())
    }

    #[test]
    fn a_discovering_cluster_gets_each_application_s_replicas_and_only_its_proxy() {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        a.clusters[0].dashboard = Some(URL.into());
        let m = Model::new(vec![a]).unwrap();
        let d = DashboardStates {
            clusters: [(
                "default/a/a1".to_string(),
                answered(URL, capture("05-two-replicas-and-failed.json")),
            )]
            .into(),
        };
        let out = discover(&m, &d, &AddressPolicy::default());
        assert_eq!(out.refused, []);
        let c = &out.model.services()[0].clusters[0];
        assert!(c.direct_ingress);
        assert_eq!(
            apps(&out.model),
            [
                app("broken", "/broken", &[]),
                app("echo", "/", &[30001]),
                app("work", "/work", &[30002, 30003]),
            ]
        );
        let proxies: Vec<u16> = c.proxies.iter().map(|p| p.address.port()).collect();
        assert_eq!(proxies, [18800]);
        // Every replica is an endpoint to probe.
        let endpoints: Vec<u16> = out.model.endpoints().map(|(a, _)| a.port()).collect();
        assert_eq!(endpoints, [18800, 30001, 30002, 30003]);
    }

    #[test]
    fn a_replica_must_be_on_a_listed_node_within_ray_s_ports() {
        // The source lists the head (192.0.2.2) only: a replica on another node is refused
        // unless proxies.networks allows it; one outside Ray's ports always.
        let mut b = service("b", "b1", &[]);
        b.clusters[0].proxies = vec![crate::model::Proxy {
            address: "192.0.2.2:18800".parse().unwrap(),
            grpc: None,
            node_type: crate::model::NodeType::Head,
            draining: false,
            host_network: false,
        }];
        b.clusters[0].dashboard = Some(URL.into());
        let m = Model::new(vec![b]).unwrap();
        let mut status = capture("05-two-replicas-and-failed.json");
        let work = status.ingress.apps.get_mut("work").unwrap();
        work.http[0].address = "192.0.2.3:30002".parse().unwrap();
        work.http[1].address = "192.0.2.2:8000".parse().unwrap();
        let d = DashboardStates {
            clusters: [("default/b/b1".to_string(), answered(URL, status))].into(),
        };
        let out = discover(&m, &d, &AddressPolicy::default());
        assert_eq!(apps(&out.model)[2], app("work", "/work", &[]));
        let refused: Vec<(String, &str)> = out
            .refused
            .iter()
            .map(|r| (r.address.to_string(), r.label))
            .collect();
        assert_eq!(
            refused,
            [
                ("192.0.2.2:8000".to_string(), "outside_replica_ports"),
                ("192.0.2.3:30002".to_string(), "not_a_cluster_node"),
            ]
        );
        let networks = AddressPolicy {
            networks: vec!["192.0.2.0/24".parse().unwrap()],
            replica_ports: crate::model::ReplicaPorts {
                http: 8000..=31000,
                grpc: 40000..=41000,
            },
        };
        let out = discover(&m, &d, &networks);
        assert_eq!(out.refused, []);
        let work: Vec<String> = out.model.services()[0].clusters[0]
            .application("work")
            .unwrap()
            .http_replicas
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(work, ["192.0.2.2:8000", "192.0.2.3:30002"]);
    }

    #[test]
    fn a_stale_dashboard_keeps_its_applications_and_none_without_an_answer() {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        a.clusters[0].dashboard = Some(URL.into());
        let m = Model::new(vec![a]).unwrap();
        let mut d = answered(URL, capture("02-running.json"));
        d.stale = true;
        let states = DashboardStates {
            clusters: [("default/a/a1".to_string(), d)].into(),
        };
        let out = discover(&m, &states, &AddressPolicy::default());
        assert_eq!(
            apps(&out.model),
            [app("echo", "/", &[30001]), app("work", "/work", &[30000])]
        );
        let none = discover(&m, &DashboardStates::default(), &AddressPolicy::default());
        assert!(none.model.services()[0].clusters[0].applications.is_empty());
        assert!(!none.model.services()[0].clusters[0].direct_ingress);
    }

    /// Two RayServices whose dashboards list the same replica addresses (a hostile or
    /// confused one): neither gets them, never the first by name, and each is refused.
    #[test]
    fn a_replica_two_rayservices_list_goes_to_neither() {
        let mut services = Vec::new();
        for name in ["aaa", "bbb"] {
            let mut s = service(name, "c1", &[]);
            s.clusters[0].discover = true;
            s.clusters[0].dashboard = Some(URL.into());
            services.push(s);
        }
        let m = Model::new(services).unwrap();
        let mut states = DashboardStates::default();
        for key in ["default/aaa/c1", "default/bbb/c1"] {
            states
                .clusters
                .insert(key.into(), answered(URL, capture("02-running.json")));
        }
        let out = discover(&m, &states, &AddressPolicy::default());
        for s in out.model.services() {
            for app in &s.clusters[0].applications {
                assert!(app.http_replicas.is_empty(), "{}: {app:?}", s.key());
            }
        }
        let claimed: BTreeSet<(&str, SocketAddr)> = out
            .refused
            .iter()
            .filter(|r| r.label == "claimed_twice")
            .map(|r| (r.cluster.as_str(), r.address))
            .collect();
        assert_eq!(claimed.len(), 4, "{:?}", out.refused);
        // Alone, each would have them.
        let alone = Model::new(vec![m.services()[0].clone()]).unwrap();
        let out = discover(&alone, &states, &AddressPolicy::default());
        assert_eq!(
            apps(&out.model),
            [app("echo", "/", &[30001]), app("work", "/work", &[30000])]
        );
    }

    /// Before its dashboard answers, a cluster keeps the applications its source gave
    /// (Kubernetes: the Serve config), with no replicas; the answer replaces them.
    #[test]
    fn the_source_applications_hold_until_the_dashboard_answers() {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        a.clusters[0].dashboard = Some(URL.into());
        a.clusters[0].applications = vec![crate::model::test_support::app(
            "from-config",
            Some("/cfg"),
            &[],
        )];
        let m = Model::new(vec![a]).unwrap();
        let before = discover(&m, &DashboardStates::default(), &AddressPolicy::default());
        assert_eq!(apps(&before.model), [app("from-config", "/cfg", &[])]);
        let states = DashboardStates {
            clusters: [(
                "default/a/a1".to_string(),
                answered(URL, capture("02-running.json")),
            )]
            .into(),
        };
        let after = discover(&m, &states, &AddressPolicy::default());
        assert_eq!(
            apps(&after.model),
            [app("echo", "/", &[30001]), app("work", "/work", &[30000])]
        );
    }
}

#[cfg(test)]
mod refusal_tests {
    use super::*;
    use std::net::Ipv4Addr;
    use std::sync::Mutex;

    /// `n` proxies of `cluster` refused as never a proxy's, from 169.254.0.0 on.
    fn refused(cluster: &str, n: u32) -> Vec<RefusedProxy> {
        (0..n)
            .map(|i| RefusedProxy {
                cluster: cluster.into(),
                address: SocketAddr::new(Ipv4Addr::from(0xa9fe_0000 + i).into(), 80),
                from: "dashboard",
                label: "never_a_proxy",
                reason: "a link-local address is never a proxy's".into(),
            })
            .collect()
    }

    /// Where a test's log lines go.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The lines `f` logs.
    fn log_lines(f: impl FnOnce()) -> Vec<String> {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_owned).collect()
    }

    /// 80,000 refusals are one line (with the count and examples), not 80,000,
    /// and nothing is logged again until that cluster's refusals change.
    #[test]
    fn refusals_are_logged_one_line_per_group_only_when_they_change() {
        let discovery = Discovery {
            policy: AddressPolicy::default(),
            metrics: Arc::new(Metrics::new()),
        };
        let mut all = refused("default/a/a1", 80_000);
        all.extend(refused("default/b/b1", 2));
        all.sort();
        let mut logged = RefusalGroups::new();
        let lines = log_lines(|| discovery.report(&all, &mut logged));
        assert_eq!(lines.len(), 2, "{lines:#?}");
        let a = lines.iter().find(|l| l.contains("default/a/a1")).unwrap();
        assert!(a.contains("WARN") && a.contains("count=80000"), "{a}");
        assert!(
            a.contains("169.254.0.0:80, 169.254.0.1:80, 169.254.0.2:80 and 79997 more"),
            "{a}"
        );
        let b = lines.iter().find(|l| l.contains("default/b/b1")).unwrap();
        assert!(b.contains("count=2") && !b.contains("more"), "{b}");

        // The same refusals again: nothing.
        assert!(log_lines(|| discovery.report(&all, &mut logged)).is_empty());
        // One of a's goes: a's line again, b's not.
        all.retain(|r| {
            r.cluster != "default/a/a1" || r.address.ip() != Ipv4Addr::new(169, 254, 0, 0)
        });
        let lines = log_lines(|| discovery.report(&all, &mut logged));
        assert_eq!(lines.len(), 1, "{lines:#?}");
        assert!(lines[0].contains("default/a/a1") && lines[0].contains("count=79999"));
    }

    /// `/debug/state` shows at most [`REFUSED_SHOWN`] refusals, and counts all
    /// of them, per reason too.
    #[test]
    fn the_refused_summary_shows_a_few_and_counts_all() {
        let mut all = refused("default/a/a1", 80_000);
        let mut outside = refused("default/b/b1", 2);
        for r in &mut outside {
            r.label = "outside_dashboard_network";
        }
        all.extend(outside);
        all.sort();
        let summary = RefusedSummary::of(&all);
        assert_eq!(summary.shown, &all[..REFUSED_SHOWN]);
        assert_eq!(summary.total, 80_002);
        assert_eq!(
            summary.by_reason,
            BTreeMap::from([("never_a_proxy", 80_000), ("outside_dashboard_network", 2)])
        );
        // The page stays small: about 20 KB, where the whole list was 18 MB.
        let json = serde_json::to_string(&summary).unwrap();
        assert!(json.len() < 64 * 1024, "{} bytes", json.len());

        let few = refused("default/a/a1", 3);
        let summary = RefusedSummary::of(&few);
        assert_eq!((summary.shown.len(), summary.total), (3, 3));
        assert!(RefusedSummary::of(&[]).by_reason.is_empty());
    }
}

#[cfg(test)]
mod task_tests {
    use super::*;
    use crate::live::dashboard::{HttpProxy, ServeStatus};
    use crate::live::dashboards::ClusterDashboard;
    use crate::model::test_support::service;
    use crate::model::NodeType;
    use std::net::SocketAddr;
    use std::time::Duration;

    const URL: &str = "http://127.0.0.1:8265";

    fn spawn_run(
        source: watch::Receiver<Arc<Model>>,
        dashboards: watch::Receiver<Arc<DashboardStates>>,
        tx: watch::Sender<Arc<Model>>,
        token: CancellationToken,
    ) {
        let (refused, _) = watch::channel(Arc::new(Vec::new()));
        let discovery = Discovery {
            policy: AddressPolicy::default(),
            metrics: Arc::new(Metrics::new()),
        };
        tokio::spawn(discovery.run(source, dashboards, tx, refused, token));
    }
    const CLUSTER: &str = "default/a/a1";

    fn discovering() -> Arc<Model> {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        a.clusters[0].dashboard = Some(URL.into());
        Arc::new(Model::new(vec![a]).unwrap())
    }

    fn answer(ports: &[u16]) -> Arc<DashboardStates> {
        let mut d = ClusterDashboard::new(URL.into());
        d.status = Some(std::sync::Arc::new(ServeStatus {
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
        }));
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
        spawn_run(source, dashboards, tx, token.clone());
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
        spawn_run(source, dashboards, tx, token.clone());
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

//! Make-before-break: what one Envoy may be sent, given what it already holds.
//!
//! Shared by the state-of-the-world and delta state machines. The rules:
//! - a virtual host is sent only once the Envoy holds (has ACKed) every cluster it names
//!   and that cluster's endpoints; until then the route configuration the Envoy gets keeps
//!   the virtual host as the Envoy has it (or leaves out one it never had), so traffic
//!   never goes to a cluster Envoy has not warmed, and one virtual host whose cluster an
//!   Envoy cannot take (it NACKs it, or never warms it) holds back no other;
//! - a cluster (and its endpoints) that left the snapshot stays with an Envoy while any
//!   route it holds or is being sent still names it, and goes once that route is replaced.
//!
//! What an Envoy holds and rejected is [`crate::holding`]'s; the subscribed names
//! [`crate::names`]'.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::holding::{Held, Holding, Rejections};
use super::snapshot::{bare_cluster, Resource, ResourceMap, ResourceType, Snapshot};

/// The route configuration `current` with each virtual host whose clusters are all
/// `warm`, and the others as `held` has them (left out where `held` has none), or `held`
/// itself when that is what it comes to. `None` when a body does not decode.
fn merge_warm_virtual_hosts(
    current: &Arc<Resource>,
    held: Option<&Arc<Resource>>,
    warm: impl Fn(&str) -> bool,
    fallback: impl Fn(&str, Option<&str>) -> Option<Arc<str>>,
) -> Option<Arc<Resource>> {
    use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
    use prost::Message;
    let decode = |r: &Resource| RouteConfiguration::decode(&*r.body.value).ok();
    let mut config = decode(current)?;
    let old = match held {
        Some(h) => Some(decode(h)?),
        None => None,
    };
    config.virtual_hosts = config
        .virtual_hosts
        .into_iter()
        .filter_map(|mut vh| {
            drop_cold_unweighted(&mut vh, &warm);
            if super::snapshot::virtual_host_clusters(&vh)
                .iter()
                .all(|c| warm(c))
            {
                return Some(vh);
            }
            if let Some(o) = &old {
                return o.virtual_hosts.iter().find(|o| o.name == vh.name).cloned();
            }
            // Nothing held to keep (a fresh Envoy, or one that reconnected): a warm
            // cluster of the same virtual host and of the same kind as each route's own
            // (a gRPC route's stand-in is a gRPC cluster), if the Envoy holds one, takes
            // that route's traffic rather than the host going unrouted; a route with none
            // is left out, and a host with no route left is.
            let vhost = vh.name.clone();
            vh.routes.retain_mut(|r| {
                let Some(own) = route_clusters(r).into_iter().next() else {
                    return true; // names no cluster (a direct response): as it is
                };
                match fallback(&vhost, Some(&own)) {
                    Some(stand_in) => {
                        route_to(r, &stand_in);
                        true
                    }
                    None => false,
                }
            });
            (!vh.routes.is_empty()).then_some(vh)
        })
        .collect();
    let merged = Resource::encode(
        &current.name,
        &config,
        super::snapshot::referenced_clusters(&config),
    );
    Some(match held {
        Some(h) if h.version == merged.version => h.clone(),
        _ => Arc::new(merged),
    })
}

/// The clusters one route names.
fn route_clusters(r: &envoy_types::pb::envoy::config::route::v3::Route) -> Vec<String> {
    use envoy_types::pb::envoy::config::route::v3::{route, route_action};
    let Some(route::Action::Route(action)) = &r.action else {
        return Vec::new();
    };
    match &action.cluster_specifier {
        Some(route_action::ClusterSpecifier::WeightedClusters(w)) => {
            w.clusters.iter().map(|c| c.name.clone()).collect()
        }
        Some(route_action::ClusterSpecifier::Cluster(c)) => vec![c.clone()],
        _ => Vec::new(),
    }
}

/// Sends route `r` to `cluster` alone.
fn route_to(r: &mut envoy_types::pb::envoy::config::route::v3::Route, cluster: &str) {
    use envoy_types::pb::envoy::config::route::v3::{
        route, route_action, weighted_cluster::ClusterWeight,
    };
    let Some(route::Action::Route(action)) = &mut r.action else {
        return;
    };
    if let Some(route_action::ClusterSpecifier::WeightedClusters(w)) = &mut action.cluster_specifier
    {
        w.clusters = vec![ClusterWeight {
            name: cluster.into(),
            weight: Some(envoy_types::pb::google::protobuf::UInt32Value { value: 100 }),
            ..Default::default()
        }];
    } else if let Some(route_action::ClusterSpecifier::Cluster(c)) = &mut action.cluster_specifier {
        *c = cluster.into();
    }
}

/// Leaves out of `vh` the weighted clusters that carry no weight and are not warm (a
/// switchover's target before any traffic moves, or one this Envoy rejected): they
/// take no request, and waiting for them would hold back the virtual host's other
/// changes for as long as they stay cold.
fn drop_cold_unweighted(
    vh: &mut envoy_types::pb::envoy::config::route::v3::VirtualHost,
    warm: &impl Fn(&str) -> bool,
) {
    use envoy_types::pb::envoy::config::route::v3::{
        route, route_action, weighted_cluster::ClusterWeight,
    };
    for r in &mut vh.routes {
        let Some(route::Action::Route(action)) = &mut r.action else {
            continue;
        };
        let Some(route_action::ClusterSpecifier::WeightedClusters(w)) =
            &mut action.cluster_specifier
        else {
            continue;
        };
        let carries =
            |c: &ClusterWeight| c.weight.as_ref().is_some_and(|w| w.value > 0) || warm(&c.name);
        if w.clusters
            .iter()
            .any(|c| c.weight.as_ref().is_some_and(|w| w.value > 0))
        {
            w.clusters.retain(carries);
        }
    }
}

/// Fills in the bodies of resources `held` knows only by version (declared on a
/// reconnect) where `wanted` has the same version: versions are content hashes, so the
/// Envoy holds exactly that body, and what it names can be known.
pub(crate) fn learn_bodies<'a>(
    held: &mut Holding,
    wanted: impl Fn(&str) -> Option<&'a Arc<Resource>>,
) {
    let Holding::Own(map) = held else { return };
    for (name, h) in map.iter_mut() {
        if h.resource.is_none() {
            if let Some(r) = wanted(name).filter(|r| r.version == h.version) {
                h.resource = Some(r.clone());
            }
        }
    }
}

/// Whether `wanted` is exactly the snapshot's whole set of `ty` (same resources).
pub(crate) fn is_whole_set(wanted: &ResourceMap, snapshot: &Snapshot, ty: ResourceType) -> bool {
    let all = snapshot.resources(ty);
    wanted.len() == all.len()
        && wanted
            .iter()
            .zip(all.iter())
            .all(|((n1, r1), (n2, r2))| n1 == n2 && Arc::ptr_eq(r1, r2))
}

/// Takes resources from `changed`, in name order, until their size in the response
/// ([`Resource::size_in_response`]) passes `budget` bytes (at least one). Each response
/// is framed in a buffer of its own and freed once written (`codec`), so the budget
/// bounds what a stream holds at once while thousands sync together; each part costs
/// the stream a round trip.
pub(crate) fn take_budget(changed: ResourceMap, budget: usize) -> (ResourceMap, bool) {
    if changed
        .values()
        .map(|r| r.size_in_response())
        .sum::<usize>()
        <= budget
    {
        return (changed, true); // (The common case: all of it, without a new map.)
    }
    let mut taken = ResourceMap::new();
    let mut size = 0;
    let total = changed.len();
    for (name, r) in changed {
        if !taken.is_empty() && size + r.size_in_response() > budget {
            break;
        }
        size += r.size_in_response();
        taken.insert(name, r);
    }
    let complete = taken.len() == total;
    (taken, complete)
}

/// Most bytes of resources carried by one response of a type that may be split. At
/// 16 KiB a 400 KB endpoint sync took 25 round trips and 1,000 streams synced in 2.4 s;
/// at 128 KiB it took 3-4 and they synced in 1.2 s; at 512 KiB it takes one, and 10,000
/// delta streams reconnecting at once are whole again in 8.0-8.4 s instead of 9.6-10.3
/// s, at a lower peak RSS (every round trip is a plan, a response and an ACK on both
/// sides). What responses hold across streams is bounded by `responses`, not by this;
/// this keeps one response of a very large set from holding all of it (Envoy 1.40
/// takes a 450 KB delta response of endpoints whole). The freed burst is given back by
/// ray-xds's `memory`.
pub(crate) const RESPONSE_BUDGET_BYTES: usize = 512 * 1024;

/// What a stream should make the Envoy hold for one type.
#[derive(Clone, Debug)]
pub(crate) enum Desired {
    /// This resource, at this version.
    Send(Arc<Resource>),
    /// Whatever the Envoy already holds under this name: keep it, but we cannot resend it.
    Keep,
}

impl Desired {
    pub(crate) fn resource(&self) -> Option<&Arc<Resource>> {
        match self {
            Desired::Send(r) => Some(r),
            Desired::Keep => None,
        }
    }
}

/// The view of one Envoy that the ordering rules need.
pub(crate) struct ClientHolds<'a> {
    /// ACKed resources per type, indexed by [`ResourceType::index`].
    pub acked: [&'a Holding; 4],
    /// Route configurations sent but not yet ACKed or NACKed.
    pub routes_in_flight: Option<&'a ResourceMap>,
    /// What the Envoy rejected, per type.
    pub rejected: [&'a Rejections; 4],
    /// The Envoy may hold routes this stream has not heard of yet (it reconnected and
    /// has not yet declared its routes): nothing it may still use can be removed.
    pub routes_unknown: bool,
    /// Clusters (or their endpoints) that a response in flight removes: no route may
    /// name them, since the Envoy will have dropped them by the time it gets the route.
    pub leaving: BTreeSet<Arc<str>>,
    /// Clusters sent and not yet ACKed, with the endpoints of the snapshot they came
    /// from: Envoy warms them, and ACKs no cluster until they are warm, so each needs its
    /// endpoints even if it has left the snapshot since.
    pub clusters_in_flight: Option<(&'a ResourceMap, &'a ResourceMap)>,
}

impl<'a> ClientHolds<'a> {
    #[cfg(test)]
    /// An Envoy that holds `acked` and has rejected nothing.
    pub fn new(acked: [&'a Holding; 4], routes_in_flight: Option<&'a ResourceMap>) -> Self {
        ClientHolds {
            acked,
            routes_in_flight,
            rejected: [&super::holding::NOTHING_REJECTED; 4],
            routes_unknown: false,
            leaving: BTreeSet::new(),
            clusters_in_flight: None,
        }
    }

    /// Clusters some route the Envoy holds or is receiving still names; `None` means
    /// "cannot tell" (a route known only by version, or routes not declared yet after a
    /// reconnect), so nothing may be removed.
    fn referenced_clusters(&self) -> Option<BTreeSet<Arc<str>>> {
        if self.routes_unknown {
            return None;
        }
        let mut names = BTreeSet::new();
        for (_, _, resource) in self.acked[ResourceType::Route.index()].iter() {
            names.extend(resource?.cluster_refs.iter().cloned());
        }
        for r in self.routes_in_flight.into_iter().flat_map(|m| m.values()) {
            names.extend(r.cluster_refs.iter().cloned());
        }
        Some(names)
    }

    fn holds(&self, ty: ResourceType, name: &str) -> bool {
        self.acked[ty.index()].contains(name)
    }

    fn warmed(&self, cluster: &str) -> bool {
        self.holds(ResourceType::Cluster, cluster)
            && self.holds(ResourceType::Endpoints, cluster)
            && !self.leaving.contains(cluster)
    }

    /// The Envoy cannot warm `cluster` as the snapshot has it: it rejected the cluster or
    /// its endpoints (and does not hold an earlier version).
    fn stuck(&self, cluster: &str) -> bool {
        !self.warmed(cluster)
            && (self.rejected[ResourceType::Cluster.index()]
                .rejected
                .contains_key(cluster)
                || self.rejected[ResourceType::Endpoints.index()]
                    .rejected
                    .contains_key(cluster))
    }

    /// Not offered now: a version the Envoy rejected, or a change held back while the
    /// Envoy's rejections are searched.
    fn is_rejected(&self, ty: ResourceType, resource: &Resource) -> bool {
        self.rejected[ty.index()].holds_back(
            &resource.name,
            &resource.version,
            self.acked[ty.index()].version_of(&resource.name),
        )
    }
}

/// Every resource of `ty` the Envoy should hold now (before subscription filtering): the
/// snapshot's, but what it rejected (it keeps what it holds), clusters and endpoints a
/// route it holds still needs, routes merged per virtual host while some of their
/// clusters are cold, and no content made for it that it rejected.
pub(crate) fn desired(
    snapshot: &Snapshot,
    ty: ResourceType,
    holds: &ClientHolds<'_>,
) -> BTreeMap<Arc<str>, Desired> {
    let current = snapshot.resources(ty);
    let mut out: BTreeMap<Arc<str>, Desired> = current
        .iter()
        .map(|(name, r)| (name.clone(), Desired::Send(r.clone())))
        .collect();
    if !holds.rejected[ty.index()].is_empty() {
        keep_what_it_rejected(&mut out, current, ty, holds);
    }
    match ty {
        ResourceType::Cluster | ResourceType::Endpoints => {
            if ty == ResourceType::Endpoints {
                endpoints_of_warming_clusters(&mut out, holds);
            }
            if holds_whole(current, ty, holds) {
                return out;
            }
            keep_what_routes_need(&mut out, current, ty, holds);
        }
        ResourceType::Listener => {}
        ResourceType::Route => {
            for (name, route) in current {
                if route.cluster_refs.iter().all(|c| holds.warmed(c)) {
                    continue;
                }
                match merged_route(snapshot, name, route, holds) {
                    Some(d) => out.insert(name.clone(), d),
                    None => out.remove(name),
                };
            }
        }
    }
    // Content made for this Envoy (a merged route, a stand-in) that it rejected is not
    // made again until the snapshot changes: it keeps what it holds.
    // (Per-name types only: a state-of-the-world cluster left out is removed.)
    let rejected = &holds.rejected[ty.index()].rejected;
    if !rejected.is_empty() && !ty.is_full_state() {
        for (name, d) in out.iter_mut() {
            let Desired::Send(r) = d else { continue };
            if rejected.get(name).is_some_and(|v| *v == r.version)
                && current.get(name).is_none_or(|c| c.version != r.version)
            {
                *d = match holds.acked[ty.index()].get(name) {
                    Some(Held {
                        resource: Some(held),
                        ..
                    }) => Desired::Send(held),
                    _ => Desired::Keep,
                };
            }
        }
    }
    out
}

/// A version the Envoy rejected is not offered again (nor a suspect held back): it keeps
/// what it holds.
fn keep_what_it_rejected(
    out: &mut BTreeMap<Arc<str>, Desired>,
    current: &ResourceMap,
    ty: ResourceType,
    holds: &ClientHolds<'_>,
) {
    for (name, r) in current {
        if !holds.is_rejected(ty, r) {
            continue;
        }
        match holds.acked[ty.index()].get(name) {
            Some(Held {
                resource: Some(held),
                ..
            }) => {
                out.insert(name.clone(), Desired::Send(held));
            }
            // A cluster a reconnected SotW Envoy holds at a version it did not say, whose
            // snapshot version it rejected or that is held back while a rejection is
            // searched: it must be in every response (a SotW response without it removes
            // it), and sending the snapshot version would fail every response or the
            // search. A bare EDS cluster of that name keeps it serving its endpoints,
            // without its own settings, until its own version is known to be good.
            Some(Held {
                resource: None,
                version,
            }) if version.is_empty() && ty == ResourceType::Cluster => {
                out.insert(name.clone(), Desired::Send(bare_cluster(name)));
            }
            // Held, but we have no body for it (declared on a reconnect). A per-name type
            // is left out: the Envoy keeps what it has. A state-of-the-world listener
            // cannot be left out (that removes it): offer the snapshot's again.
            Some(Held { resource: None, .. }) => {
                if !ty.is_full_state() {
                    out.insert(name.clone(), Desired::Keep);
                }
            }
            None => {
                out.remove(name);
            }
        }
    }
}

/// Whether the Envoy holds the snapshot's whole set of clusters (or endpoints) and has
/// rejected none: then nothing else is kept for it.
fn holds_whole(current: &ResourceMap, ty: ResourceType, holds: &ClientHolds<'_>) -> bool {
    holds.acked[ty.index()].is_whole_of(current) && holds.rejected[ty.index()].is_empty()
}

/// The endpoints of clusters sent and not yet ACKed, from the snapshot they came with:
/// Envoy warms them, and ACKs no cluster until each has its endpoints, even one that has
/// left the snapshot since.
fn endpoints_of_warming_clusters(out: &mut BTreeMap<Arc<str>, Desired>, holds: &ClientHolds<'_>) {
    if let Some((clusters, endpoints_then)) = holds.clusters_in_flight {
        for name in clusters.keys() {
            if !out.contains_key(name) {
                if let Some(r) = endpoints_then.get(name) {
                    out.insert(name.clone(), Desired::Send(r.clone()));
                }
            }
        }
    }
}

/// Clusters (or endpoints) a route the Envoy holds still names, at the version it has.
fn keep_what_routes_need(
    out: &mut BTreeMap<Arc<str>, Desired>,
    current: &ResourceMap,
    ty: ResourceType,
    holds: &ClientHolds<'_>,
) {
    let referenced = holds.referenced_clusters();
    let retain = |name: &str| referenced.as_ref().is_none_or(|r| r.contains(name));
    for (name, _, resource) in holds.acked[ty.index()].iter() {
        if !current.contains_key(name) && retain(name) {
            let keep = match resource {
                Some(r) => Desired::Send(r.clone()),
                None => Desired::Keep,
            };
            out.insert(name.clone(), keep);
        }
    }
}

/// A route some of whose clusters are cold on this Envoy, merged per virtual host: each
/// virtual host whose clusters are warm goes as it is now, each other one stays as the
/// Envoy will hold it (the route on its way, else the one it holds). `None`: leave it out.
fn merged_route(
    snapshot: &Snapshot,
    name: &Arc<str>,
    route: &Arc<Resource>,
    holds: &ClientHolds<'_>,
) -> Option<Desired> {
    let ty = ResourceType::Route;
    // Not every cluster is warm. Each virtual host whose clusters are warm
    // goes as it is now; each other one stays as the Envoy will hold it (the
    // route on its way, else the one it holds).
    let held = holds
        .routes_in_flight
        .and_then(|m| m.get(name))
        .map(Held::sent)
        .or_else(|| holds.acked[ty.index()].get(name));
    let warm = |c: &str| holds.warmed(c);
    match held {
        Some(Held {
            resource: Some(held),
            ..
        }) => Some(Desired::Send(
            merge_warm_virtual_hosts(route, Some(&held), warm, |_, _| None).unwrap_or(held),
        )),
        // With nothing (or only a version) to fall back on, a virtual host
        // still warming holds the whole route back; one whose clusters this
        // Envoy rejected is left out, so that it holds back no other.
        Some(Held { resource: None, .. }) | None => {
            let waiting = route
                .cluster_refs
                .iter()
                .any(|c| !holds.warmed(c) && !holds.stuck(c));
            match (waiting, &held) {
                (true, Some(_)) => Some(Desired::Keep),
                (true, None) => None,
                (false, _) => {
                    let fallback = |vhost: &str, own: Option<&str>| {
                        let prefix = format!("{vhost}/");
                        // Of the kind of the route's own cluster, where the
                        // snapshot's stand-in patterns say what that is.
                        let kind = own.and_then(|c| snapshot.stand_in_pattern(c));
                        holds.acked[ResourceType::Cluster.index()]
                            .iter()
                            .map(|(n, _, _)| n)
                            .find(|n| {
                                n.starts_with(&prefix)
                                    && kind.is_none_or(|k| super::snapshot::name_matches(k, n))
                                    && holds.warmed(n)
                            })
                            .cloned()
                    };
                    merge_warm_virtual_hosts(route, None, warm, fallback).map(Desired::Send)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{service, snapshot_of};

    fn hold_all(snapshot: &Snapshot, ty: ResourceType) -> Holding {
        Holding::from_resources(snapshot.resources(ty))
    }

    /// A virtual host `v` whose two routes, one per kind, both name cold clusters.
    fn two_kinds_route() -> Arc<Resource> {
        use envoy_types::pb::envoy::config::route::v3 as route;
        let to = |cluster: &str| route::Route {
            action: Some(route::route::Action::Route(route::RouteAction {
                cluster_specifier: Some(route::route_action::ClusterSpecifier::WeightedClusters(
                    route::WeightedCluster {
                        clusters: vec![route::weighted_cluster::ClusterWeight {
                            name: cluster.into(),
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                )),
                ..Default::default()
            })),
            ..Default::default()
        };
        let config = route::RouteConfiguration {
            name: "r".into(),
            virtual_hosts: vec![route::VirtualHost {
                name: "ns/v".into(),
                routes: vec![to("ns/v/new/grpc"), to("ns/v/new")],
                ..Default::default()
            }],
            ..Default::default()
        };
        Arc::new(Resource::encode("r", &config, Vec::new()))
    }

    fn routed_to(r: &Resource) -> Vec<Vec<String>> {
        use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
        use prost::Message;
        let config = RouteConfiguration::decode(&*r.body.value).unwrap();
        config
            .virtual_hosts
            .iter()
            .flat_map(|vh| vh.routes.iter().map(route_clusters))
            .collect()
    }

    #[test]
    fn each_route_of_a_cold_host_gets_a_stand_in_of_its_own_kind() {
        use crate::snapshot::name_matches;
        let patterns = ["ns/v/*", "ns/v/*/grpc"];
        let warm_held = ["ns/v/old", "ns/v/old/grpc"];
        let fallback = |vhost: &str, own: Option<&str>| {
            let kind = own.and_then(|c| {
                patterns
                    .iter()
                    .filter(|p| name_matches(p, c))
                    .max_by_key(|p| p.len())
            });
            warm_held
                .iter()
                .find(|n| {
                    n.starts_with(&format!("{vhost}/")) && kind.is_none_or(|k| name_matches(k, n))
                })
                .map(|n| Arc::from(*n))
        };
        let merged =
            merge_warm_virtual_hosts(&two_kinds_route(), None, |_| false, fallback).unwrap();
        assert_eq!(
            routed_to(&merged),
            [
                vec!["ns/v/old/grpc".to_string()],
                vec!["ns/v/old".to_string()]
            ],
            "a gRPC route never stands in on an HTTP/1 cluster, nor the reverse"
        );
        // No warm gRPC cluster held: the gRPC route is left out, HTTP still routed.
        let http_only = |vhost: &str, own: Option<&str>| {
            (!own.is_some_and(|c| c.ends_with("/grpc"))).then(|| Arc::from(format!("{vhost}/old")))
        };
        let merged =
            merge_warm_virtual_hosts(&two_kinds_route(), None, |_| false, http_only).unwrap();
        assert_eq!(routed_to(&merged), [vec!["ns/v/old".to_string()]]);
        // Nothing at all: the host is left out.
        let merged =
            merge_warm_virtual_hosts(&two_kinds_route(), None, |_| false, |_, _| None).unwrap();
        assert_eq!(routed_to(&merged), Vec::<Vec<String>>::new());
    }

    #[test]
    fn a_route_waits_for_its_cluster_to_be_warm() {
        let old = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut moved = service("a", "a2", &[8100]);
        moved
            .clusters
            .push(service("a", "a1", &[8000]).clusters.remove(0));
        let new = snapshot_of(vec![moved]);
        let acked = [
            &hold_all(&old, ResourceType::Cluster),
            &hold_all(&old, ResourceType::Endpoints),
            &hold_all(&old, ResourceType::Listener),
            &hold_all(&old, ResourceType::Route),
        ];
        let holds = ClientHolds::new(acked, None);
        let routes = desired(&new, ResourceType::Route, &holds);
        let old_route = old.resources(ResourceType::Route).values().next().unwrap();
        let sent = routes.values().next().unwrap().resource().unwrap();
        assert_eq!(sent.version, old_route.version, "still the old route");

        // Once the Envoy holds the new cluster and its endpoints, the new route goes.
        let clusters = hold_all(&new, ResourceType::Cluster);
        let endpoints = hold_all(&new, ResourceType::Endpoints);
        let holds = ClientHolds::new([&clusters, &endpoints, acked[2], acked[3]], None);
        let routes = desired(&new, ResourceType::Route, &holds);
        let new_route = new.resources(ResourceType::Route).values().next().unwrap();
        assert_eq!(
            routes.values().next().unwrap().resource().unwrap().version,
            new_route.version
        );
    }

    #[test]
    fn a_removed_cluster_stays_while_a_held_route_names_it() {
        let old = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let new = snapshot_of(vec![service("a", "a1", &[8000])]);
        let held: Vec<Holding> = ResourceType::ALL
            .iter()
            .map(|t| hold_all(&old, *t))
            .collect();
        let holds = ClientHolds::new([&held[0], &held[1], &held[2], &held[3]], None);
        let clusters = desired(&new, ResourceType::Cluster, &holds);
        assert!(
            clusters.contains_key("default/b/b1"),
            "old route still names b1"
        );
        let endpoints = desired(&new, ResourceType::Endpoints, &holds);
        assert!(endpoints.contains_key("default/b/b1"));

        // While the new route is in flight, the old one may still be in use: keep b1.
        let in_flight = new.resources(ResourceType::Route).clone();
        let holds = ClientHolds::new([&held[0], &held[1], &held[2], &held[3]], Some(&in_flight));
        assert!(desired(&new, ResourceType::Cluster, &holds).contains_key("default/b/b1"));

        // Once the Envoy holds the new route, b1 can go.
        let new_routes = hold_all(&new, ResourceType::Route);
        let holds = ClientHolds::new([&held[0], &held[1], &held[2], &new_routes], None);
        assert!(!desired(&new, ResourceType::Cluster, &holds).contains_key("default/b/b1"));
        assert!(!desired(&new, ResourceType::Endpoints, &holds).contains_key("default/b/b1"));
    }

    #[test]
    fn a_route_known_only_by_version_keeps_every_cluster() {
        let old = snapshot_of(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ]);
        let new = snapshot_of(vec![service("a", "a1", &[8000])]);
        let clusters = hold_all(&old, ResourceType::Cluster);
        let mut routes = Holding::default();
        routes.own().insert(
            "ray-serve-http".into(),
            Held {
                version: "v-from-before-restart".into(),
                resource: None,
            },
        );
        let empty = Holding::default();
        let holds = ClientHolds::new([&clusters, &empty, &empty, &routes], None);
        assert!(desired(&new, ResourceType::Cluster, &holds).contains_key("default/b/b1"));
    }

    #[test]
    fn a_cold_cluster_holds_back_only_its_own_virtual_host() {
        use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
        use prost::Message;
        // Held: a -> a1, b -> b1. Now: a -> a2 (warm), b -> b2 (cold: never ACKed).
        let mut a_old = service("a", "a1", &[8000]);
        a_old
            .clusters
            .push(service("a", "a2", &[8100]).clusters.remove(0));
        let b_old = service("b", "b1", &[9000]);
        let old = snapshot_of(vec![a_old.clone(), b_old.clone()]);
        let mut a_new = a_old.clone();
        a_new.active = "a2".into();
        let mut b_new = b_old.clone();
        b_new
            .clusters
            .push(service("b", "b2", &[9100]).clusters.remove(0));
        b_new.active = "b2".into();
        let new = snapshot_of(vec![a_new, b_new]);
        let held: Vec<Holding> = ResourceType::ALL
            .iter()
            .map(|t| hold_all(&old, *t))
            .collect();
        let holds = ClientHolds::new([&held[0], &held[1], &held[2], &held[3]], None);
        let routes = desired(&new, ResourceType::Route, &holds);
        let sent = routes.values().next().unwrap().resource().unwrap();
        let config = RouteConfiguration::decode(&*sent.body.value).unwrap();
        let target = |name: &str| {
            let vh = config
                .virtual_hosts
                .iter()
                .find(|v| v.name == name)
                .unwrap();
            crate::snapshot::virtual_host_clusters(vh)
        };
        assert_eq!(target("default/a"), ["default/a/a2"], "a moves on");
        assert_eq!(target("default/b"), ["default/b/b1"], "b waits for b2");
        assert_eq!(
            sent.cluster_refs,
            vec![Arc::from("default/a/a2"), Arc::from("default/b/b1")]
        );
        // A brand-new virtual host whose cluster is cold is left out until it is warm.
        let c_new = service("c", "c1", &[7000]);
        let with_c = snapshot_of(vec![a_old, b_old, c_new]);
        let routes = desired(&with_c, ResourceType::Route, &holds);
        let sent = routes.values().next().unwrap().resource().unwrap();
        let config = RouteConfiguration::decode(&*sent.body.value).unwrap();
        let names: Vec<&str> = config
            .virtual_hosts
            .iter()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(names, ["default/a", "default/b"]);
    }
}

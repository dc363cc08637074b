//! Routing by Ray Serve application, and straight to ingress replicas (Ray's direct
//! ingress). Pure, like the rest of `translate`.
//!
//! - **Clusters.** In a RayCluster with direct ingress on, each application gets an EDS
//!   cluster of its ingress replicas per protocol
//!   ([`RayService::envoy_app_cluster_name`]; gRPC only where the RayCluster serves gRPC),
//!   there while the application is listed, its replicas or not, so a route can move to
//!   it and back without a cluster coming and going.
//! - **Routes.** While some RayCluster taking traffic has direct ingress on, or some
//!   application moves to a new RayCluster on its own readiness (weights of its own,
//!   `pipeline::switchover`), the virtual host gets a route per application, before the
//!   catch-all route to the proxies:
//!   HTTP by route prefix, as Ray matches them (`proxy_router.py`, `match_route`: longest
//!   prefix first; a prefix ending in `/` matches what starts with it, `prefix`; any other
//!   matches itself or itself followed by `/`, `path_separated_prefix`); gRPC by the
//!   `application` metadata, as Ray's gRPC proxy routes. Each route carries its
//!   application's weights (else the RayService's), each RayCluster's share going to the
//!   replicas of the application with that prefix (gRPC: that name) there while one may
//!   take requests (routable, or fail-open: a failure of ray-xds's
//!   own probes never takes them away), else to that RayCluster's proxies (Ray's own
//!   fallback), which also take an application a RayCluster does not list (Ray answers
//!   404 there, as without ray-xds). A path with a percent escape goes to the proxies
//!   (`translate::virtual_host`): Ray matches the decoded path, Envoy the raw one.
//! - **Stand-ins.** An application's cluster an Envoy still holds after a reconnect, and
//!   that has gone since, stands in as where that application's traffic goes now.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use envoy_types::pb::envoy::config::route::v3 as route;
use envoy_types::pb::envoy::r#type::matcher::v3 as matcher;

use super::{weighted_route, ServiceWeights, TrafficPolicy};
use crate::live::health::HealthMap;
use crate::model::{encode_name_segment, Application, Protocol, RayCluster, RayService};

/// An application's Envoy clusters in `cluster`: (name, protocol, its replicas with their
/// metadata fact). None without direct ingress.
pub(super) fn clusters<'a>(
    service: &'a RayService,
    cluster: &'a RayCluster,
) -> impl Iterator<
    Item = (
        String,
        Protocol,
        impl Iterator<Item = (SocketAddr, (&'static str, &'a str))>,
    ),
> + 'a {
    let protocols: &[Protocol] = if cluster.serves_grpc() {
        &[Protocol::Http, Protocol::Grpc]
    } else {
        &[Protocol::Http]
    };
    cluster
        .applications
        .iter()
        .filter(|_| cluster.direct_ingress)
        .flat_map(move |app| {
            protocols.iter().map(move |&protocol| {
                let name = service.envoy_app_cluster_name(&cluster.name, &app.name, protocol);
                let replicas = app
                    .replicas(protocol)
                    .iter()
                    .map(move |a| (*a, ("application", app.name.as_str())));
                (name, protocol, replicas)
            })
        })
}

/// Where `app`'s `protocol` requests go in `cluster`: its replicas' Envoy cluster while
/// one may take them, else the cluster's proxies.
fn destination(
    service: &RayService,
    cluster: &RayCluster,
    app: Option<&Application>,
    protocol: Protocol,
    health: &HealthMap,
) -> String {
    if let Some(app) = app.filter(|a| cluster.direct_ingress && !a.replicas(protocol).is_empty()) {
        let name = service.envoy_app_cluster_name(&cluster.name, &app.name, protocol);
        let h = health.cluster(&name);
        if h.routable > 0 || h.fail_open {
            return name;
        }
    }
    service.envoy_cluster_name_for(&cluster.name, protocol)
}

/// The applications to route: while some RayCluster taking traffic has direct ingress on,
/// or some application moves on its own (its own weights), those of every RayCluster of
/// the RayService, the heaviest first, so that of two applications claiming one prefix
/// (or one name) in different RayClusters, the one where most traffic goes keeps it.
fn routed<'a>(service: &'a RayService, all: &ServiceWeights<'_>) -> Vec<&'a Application> {
    let weight = |name: &str| {
        all.service
            .iter()
            .find(|(c, _)| c == name)
            .map_or(0, |(_, w)| *w)
    };
    let taking = |c: &RayCluster| {
        weight(&c.name) > 0
            || all
                .apps
                .values()
                .any(|w| w.iter().any(|(n, w)| *n == c.name && *w > 0))
    };
    let direct = service
        .clusters
        .iter()
        .any(|c| c.direct_ingress && taking(c));
    if !direct && all.apps.is_empty() {
        return Vec::new();
    }
    let mut by_weight: Vec<&RayCluster> = service.clusters.iter().collect();
    by_weight.sort_by_key(|c| (std::cmp::Reverse(weight(&c.name)), c.name.as_str()));
    let (mut names, mut prefixes) = (BTreeSet::new(), BTreeSet::new());
    let mut out = Vec::new();
    for cluster in by_weight {
        for app in &cluster.applications {
            if names.contains(app.name.as_str()) {
                continue;
            }
            if app
                .route_prefix
                .as_ref()
                .is_some_and(|p| prefixes.contains(p.as_str()))
            {
                continue;
            }
            names.insert(app.name.as_str());
            if let Some(p) = &app.route_prefix {
                prefixes.insert(p.as_str());
            }
            out.push(app);
        }
    }
    out
}

/// Which application of a RayCluster a route's requests reach there: for HTTP the one
/// with the route's prefix (Ray routes by prefix, and two RayClusters may give one prefix
/// to applications of different names), for gRPC the one of the route's name.
#[derive(Clone, Copy)]
enum Owner<'a> {
    Prefix(&'a str),
    Name(&'a str),
}

/// The weighted clusters of a route: each RayCluster's share to [`destination`] of the
/// application `owner` picks there; for gRPC, only the RayClusters that serve it.
fn app_clusters(
    service: &RayService,
    weights: &[(String, u32)],
    owner: Owner<'_>,
    protocol: Protocol,
    health: &HealthMap,
) -> Vec<(String, u32)> {
    weights
        .iter()
        .filter(|(_, w)| *w > 0)
        .filter_map(|(c, w)| {
            let cluster = service.cluster(c)?;
            if protocol == Protocol::Grpc && !cluster.serves_grpc() {
                return None;
            }
            let app = match owner {
                Owner::Name(name) => cluster.application(name),
                Owner::Prefix(prefix) => cluster
                    .applications
                    .iter()
                    .find(|a| a.route_prefix.as_deref() == Some(prefix)),
            };
            let name = destination(service, cluster, app, protocol, health);
            Some((name, *w))
        })
        .collect()
}

/// Ray's prefix match: `/` and a prefix ending in `/` match every path that starts with
/// them; any other matches itself or itself followed by `/` (not `/workers` for `/work`).
pub(crate) fn prefix_match(prefix: &str) -> route::route_match::PathSpecifier {
    if prefix.ends_with('/') {
        route::route_match::PathSpecifier::Prefix(prefix.into())
    } else {
        route::route_match::PathSpecifier::PathSeparatedPrefix(prefix.into())
    }
}

/// A route per application with an HTTP route prefix, longest prefix first.
pub(super) fn http_routes(
    service: &RayService,
    all: &ServiceWeights<'_>,
    health: &HealthMap,
    policy: &TrafficPolicy,
) -> Vec<route::Route> {
    let mut apps: Vec<(&str, &str)> = routed(service, all)
        .into_iter()
        .filter_map(|a| Some((a.route_prefix.as_deref()?, a.name.as_str())))
        .collect();
    apps.sort_by_key(|(prefix, name)| (std::cmp::Reverse(prefix.len()), *prefix, *name));
    apps.into_iter()
        .map(|(prefix, name)| {
            weighted_route(
                &format!("app/{}", encode_name_segment(name)),
                route::RouteMatch {
                    path_specifier: Some(prefix_match(prefix)),
                    ..Default::default()
                },
                app_clusters(
                    service,
                    all.of(name),
                    Owner::Prefix(prefix),
                    Protocol::Http,
                    health,
                ),
                Protocol::Http,
                policy,
            )
        })
        .collect()
}

/// A gRPC route per application, by its name in the call's `application` metadata, to
/// the RayClusters that serve gRPC (an application whose weights name none gets no route:
/// its calls go as the RayService's).
pub(super) fn grpc_routes(
    service: &RayService,
    all: &ServiceWeights<'_>,
    health: &HealthMap,
    policy: &TrafficPolicy,
) -> Vec<route::Route> {
    routed(service, all)
        .into_iter()
        .filter_map(|app| {
            let clusters = app_clusters(
                service,
                all.of(&app.name),
                Owner::Name(&app.name),
                Protocol::Grpc,
                health,
            );
            (!clusters.is_empty()).then_some((app, clusters))
        })
        .map(|(app, clusters)| {
            weighted_route(
                &format!("grpc/app/{}", encode_name_segment(&app.name)),
                route::RouteMatch {
                    path_specifier: Some(route::route_match::PathSpecifier::Prefix("/".into())),
                    grpc: Some(route::route_match::GrpcRouteMatchOptions {}),
                    headers: vec![route::HeaderMatcher {
                        name: "application".into(),
                        header_match_specifier: Some(
                            route::header_matcher::HeaderMatchSpecifier::StringMatch(
                                matcher::StringMatcher {
                                    match_pattern: Some(
                                        matcher::string_matcher::MatchPattern::Exact(
                                            app.name.clone(),
                                        ),
                                    ),
                                    ..Default::default()
                                },
                            ),
                        ),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                clusters,
                Protocol::Grpc,
                policy,
            )
        })
        .collect()
}

/// Stand-ins for the application clusters of `service`: `<ns>/<name>/*/app/<app>` (and
/// `/grpc` after it) → where that application's requests go on the RayCluster taking
/// most traffic now.
pub(super) fn stand_ins(
    service: &RayService,
    weights: &[(String, u32)],
    health: &HealthMap,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Some(serving) = weights
        .iter()
        .max_by_key(|(_, w)| *w)
        .and_then(|(c, _)| service.cluster(c))
    else {
        return out;
    };
    let apps: BTreeSet<&str> = service
        .clusters
        .iter()
        .filter(|c| c.direct_ingress)
        .flat_map(|c| &c.applications)
        .map(|a| a.name.as_str())
        .collect();
    for app in apps {
        let segment = encode_name_segment(app);
        let pattern = format!("{}/{}/*/app/{segment}", service.namespace, service.name);
        let to =
            |protocol| destination(service, serving, serving.application(app), protocol, health);
        out.insert(pattern.clone(), to(Protocol::Http));
        if serving.serves_grpc() {
            out.insert(pattern + "/grpc", to(Protocol::Grpc));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GatewaySettings;
    use crate::live::health::{ClusterHealth, EndpointHealth, Reason, Verdict};
    use crate::model::test_support::{app, service};
    use crate::model::Model;
    use crate::translate::{translate, Weights};
    use crate::xds::Resources;

    /// One RayService, `a1` serving with direct ingress: `echo` at `/` (replica 30000),
    /// `work` at `/work` (30001, 30002), `api` at `/api/` (no replica: Ray's fallback),
    /// `grpc_only` with no HTTP route (30003).
    fn model() -> Model {
        let mut s = service("a", "a1", &[8000]);
        let c = &mut s.clusters[0];
        c.direct_ingress = true;
        c.applications = vec![
            app("echo", Some("/"), &[30000]),
            app("work", Some("/work"), &[30001, 30002]),
            app("api", Some("/api/"), &[]),
            app("grpc_only", None, &[30003]),
        ];
        Model::new(vec![s]).unwrap()
    }

    /// Every replica probed healthy, as `live::health` would count them.
    fn healthy(m: &Model) -> HealthMap {
        let mut h = HealthMap::default();
        for s in m.services() {
            for c in &s.clusters {
                for a in &c.applications {
                    let name = s.envoy_app_cluster_name(&c.name, &a.name, Protocol::Http);
                    for r in &a.http_replicas {
                        h.endpoints.insert(
                            (name.clone(), *r),
                            Verdict {
                                health: EndpointHealth::Healthy,
                                reason: Reason::ProbeHealthy,
                            },
                        );
                    }
                    h.clusters.insert(
                        name,
                        ClusterHealth {
                            ready: a.http_replicas.len() as u32,
                            routable: a.http_replicas.len() as u32,
                            ..Default::default()
                        },
                    );
                }
            }
        }
        h
    }

    fn run(m: &Model, h: &HealthMap, weights: &Weights) -> Resources {
        translate(
            m,
            h,
            weights,
            &GatewaySettings::default(),
            &TrafficPolicy::default(),
        )
    }

    /// A route as (name, path matcher, weighted clusters).
    type RouteSummary = (String, String, Vec<(String, u32)>);

    /// The HTTP routes but the one of percent-encoded paths (its own test).
    fn http_routes_of(r: &Resources) -> Vec<RouteSummary> {
        all_http_routes_of(r)
            .into_iter()
            .filter(|(name, _, _)| name != "percent-encoded")
            .collect()
    }

    fn all_http_routes_of(r: &Resources) -> Vec<RouteSummary> {
        r.routes[0].virtual_hosts[0]
            .routes
            .iter()
            .filter(|r| r.r#match.as_ref().unwrap().grpc.is_none())
            .map(|r| {
                let m = r.r#match.as_ref().unwrap();
                let path = match m.path_specifier.as_ref().unwrap() {
                    route::route_match::PathSpecifier::Prefix(p) => format!("prefix {p}"),
                    route::route_match::PathSpecifier::PathSeparatedPrefix(p) => {
                        format!("separated {p}")
                    }
                    route::route_match::PathSpecifier::SafeRegex(r) => {
                        format!("regex {}", r.regex)
                    }
                    other => format!("{other:?}"),
                };
                let clusters = match &r.action {
                    Some(route::route::Action::Route(a)) => match &a.cluster_specifier {
                        Some(route::route_action::ClusterSpecifier::WeightedClusters(w)) => w
                            .clusters
                            .iter()
                            .map(|c| (c.name.clone(), c.weight.unwrap().value))
                            .collect(),
                        other => panic!("{other:?}"),
                    },
                    other => panic!("{other:?}"),
                };
                (r.name.clone(), path, clusters)
            })
            .collect()
    }

    fn to(cluster: &str) -> Vec<(String, u32)> {
        vec![(cluster.to_string(), 100)]
    }

    #[test]
    fn each_application_is_routed_to_its_own_replicas_longest_prefix_first() {
        let m = model();
        let r = run(&m, &healthy(&m), &Weights::default());
        assert_eq!(
            http_routes_of(&r),
            [
                // No replica: Ray's fallback, the proxies. (As long as `/work`: either
                // order is Ray's, neither matches the other's paths.)
                ("app/api".into(), "prefix /api/".into(), to("default/a/a1")),
                (
                    "app/work".into(),
                    "separated /work".into(),
                    to("default/a/a1/app/work")
                ),
                (
                    "app/echo".into(),
                    "prefix /".into(),
                    to("default/a/a1/app/echo")
                ),
                ("default".into(), "prefix /".into(), to("default/a/a1")),
            ]
        );
        // A cluster per application, replicas or not, each with its replicas only.
        let names: Vec<&str> = r.clusters.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "default/a/a1",
                "default/a/a1/app/api",
                "default/a/a1/app/echo",
                "default/a/a1/app/grpc_only",
                "default/a/a1/app/work"
            ]
        );
        let hosts = |name: &str| -> Vec<String> {
            let e = r.endpoints.iter().find(|e| e.cluster_name == name).unwrap();
            e.endpoints[0]
                .lb_endpoints
                .iter()
                .map(|e| match &e.host_identifier {
                    Some(envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier::Endpoint(e)) => e.hostname.clone(),
                    _ => unreachable!(),
                })
                .collect()
        };
        assert_eq!(
            hosts("default/a/a1/app/work"),
            ["127.0.0.1:30001", "127.0.0.1:30002"]
        );
        assert_eq!(hosts("default/a/a1/app/echo"), ["127.0.0.1:30000"]);
        assert!(hosts("default/a/a1/app/api").is_empty());
        assert_eq!(hosts("default/a/a1"), ["127.0.0.1:8000"]);
    }

    /// Ray matches the percent-decoded path (`/wor%6B` is `work`'s), Envoy the raw one
    /// (`/`'s): a path with an escape goes to the proxies, ahead of every application's
    /// route; without application routes there is no such route.
    #[test]
    fn a_percent_encoded_path_goes_to_the_proxies_first() {
        let m = model();
        let r = run(&m, &healthy(&m), &Weights::default());
        let routes = all_http_routes_of(&r);
        assert_eq!(
            routes[0],
            (
                "percent-encoded".into(),
                "regex .*%.*".into(),
                to("default/a/a1")
            )
        );
        assert!(routes[1..].iter().all(|(n, _, _)| n != "percent-encoded"));
        let mut plain = m.services()[0].clone();
        plain.clusters[0].direct_ingress = false;
        let plain = Model::new(vec![plain]).unwrap();
        let r = run(&plain, &healthy(&plain), &Weights::default());
        assert_eq!(
            all_http_routes_of(&r),
            [("default".into(), "prefix /".into(), to("default/a/a1"))]
        );
    }

    /// Two RayClusters giving one prefix to applications of different names (an upgrade
    /// that swaps them): each RayCluster's share of a prefix goes to the application that
    /// has it there, as Ray routes there, never to the one of the same name.
    #[test]
    fn a_prefix_goes_to_whichever_application_has_it_in_each_cluster() {
        let mut s = model().services()[0].clone();
        let mut b = s.clusters[0].clone();
        b.name = "b1".into();
        for a in &mut b.applications {
            if a.name == "work" {
                a.route_prefix = Some("/api/".into());
            } else if a.name == "api" {
                a.route_prefix = Some("/work".into());
                a.http_replicas = vec![SocketAddr::from(([127, 0, 0, 1], 30009))];
            }
        }
        s.clusters.push(b);
        s.pending_cluster = Some("b1".into());
        let m = Model::new(vec![s]).unwrap();
        let mut weights = Weights::default();
        weights.insert(
            "default/a".into(),
            vec![("a1".into(), 75), ("b1".into(), 25)],
        );
        let r = run(&m, &healthy(&m), &weights);
        let work = http_routes_of(&r)
            .into_iter()
            .find(|(_, path, _)| path == "separated /work")
            .unwrap();
        assert_eq!(
            work.2,
            [
                ("default/a/a1/app/work".to_string(), 75),
                ("default/a/b1/app/api".to_string(), 25)
            ]
        );
    }

    #[test]
    fn an_application_whose_replicas_cannot_take_requests_goes_to_the_proxies() {
        let m = model();
        let mut h = healthy(&m);
        // Withheld (awaiting its first probe) or down: not routable.
        h.clusters.insert(
            "default/a/a1/app/work".into(),
            ClusterHealth {
                awaiting_first_probe: 2,
                ..Default::default()
            },
        );
        let routes = http_routes_of(&run(&m, &h, &Weights::default()));
        assert_eq!(routes[1].2, to("default/a/a1"));
        // Fail-open (every probe of ray-xds's fails): its replicas stay.
        h.clusters.insert(
            "default/a/a1/app/work".into(),
            ClusterHealth {
                fail_open: true,
                ..Default::default()
            },
        );
        let routes = http_routes_of(&run(&m, &h, &Weights::default()));
        assert_eq!(routes[1].2, to("default/a/a1/app/work"));
    }

    #[test]
    fn without_direct_ingress_nothing_changes() {
        let mut m = model();
        let mut s = m.services()[0].clone();
        s.clusters[0].direct_ingress = false;
        m = Model::new(vec![s]).unwrap();
        let r = run(&m, &healthy(&m), &Weights::default());
        assert_eq!(
            http_routes_of(&r),
            [("default".into(), "prefix /".into(), to("default/a/a1"))]
        );
        assert_eq!(r.clusters.len(), 1);
    }

    #[test]
    fn each_route_carries_the_weights_to_each_cluster_s_own_destination() {
        let mut s = model().services()[0].clone();
        // a2 (pending) runs `work` through its proxies only, and an app of its own.
        let mut a2 = service("a", "a2", &[8100]).clusters.remove(0);
        a2.applications = vec![
            app("work", Some("/work"), &[]),
            app("new", Some("/new"), &[]),
        ];
        s.clusters.push(a2);
        s.pending_cluster = Some("a2".into());
        let m = Model::new(vec![s]).unwrap();
        let weights = Weights::from([(
            "default/a".to_string(),
            vec![("a1".to_string(), 75), ("a2".to_string(), 25)],
        )]);
        let routes = http_routes_of(&run(&m, &healthy(&m), &weights));
        let by_name: BTreeMap<String, Vec<(String, u32)>> =
            routes.into_iter().map(|(n, _, c)| (n, c)).collect();
        assert_eq!(
            by_name["app/work"],
            [
                ("default/a/a1/app/work".to_string(), 75),
                ("default/a/a2".to_string(), 25)
            ]
        );
        // An application only a2 lists: a1's share to a1's proxies (Ray answers 404 there).
        assert_eq!(
            by_name["app/new"],
            [
                ("default/a/a1".to_string(), 75),
                ("default/a/a2".to_string(), 25)
            ]
        );
    }

    /// While an application moves on its own (weights of its own), every application gets
    /// its route, even without direct ingress: the moving one with its own weights, the
    /// others (and the catch-all) with the RayService's.
    #[test]
    fn an_application_moving_on_its_own_gets_its_own_weights() {
        let mut s = service("a", "a1", &[8000]);
        s.clusters[0].applications =
            vec![app("echo", Some("/"), &[]), app("work", Some("/work"), &[])];
        let mut b = service("a", "b1", &[9000]).clusters.remove(0);
        b.applications = s.clusters[0].applications.clone();
        s.clusters.push(b);
        s.pending_cluster = Some("b1".into());
        let m = Model::new(vec![s]).unwrap();
        let weights = Weights::from([
            ("default/a".to_string(), vec![("a1".to_string(), 100)]),
            ("default/a#work".to_string(), vec![("b1".to_string(), 100)]),
        ]);
        let routes = http_routes_of(&run(&m, &HealthMap::default(), &weights));
        assert_eq!(
            routes,
            [
                (
                    "app/work".into(),
                    "separated /work".into(),
                    to("default/a/b1")
                ),
                ("app/echo".into(), "prefix /".into(), to("default/a/a1")),
                ("default".into(), "prefix /".into(), to("default/a/a1")),
            ]
        );
        // Without an application of its own, none.
        let weights = Weights::from([("default/a".to_string(), vec![("a1".to_string(), 100)])]);
        let routes = http_routes_of(&run(&m, &HealthMap::default(), &weights));
        assert_eq!(routes.len(), 1);
    }

    #[test]
    fn grpc_calls_go_by_their_application_metadata() {
        let mut s = model().services()[0].clone();
        for p in &mut s.clusters[0].proxies {
            p.grpc = Some(SocketAddr::new(p.address.ip(), 9000));
        }
        for a in &mut s.clusters[0].applications {
            a.grpc_replicas = a
                .http_replicas
                .iter()
                .map(|r| SocketAddr::new(r.ip(), r.port() + 10000))
                .collect();
        }
        let m = Model::new(vec![s]).unwrap();
        let mut h = healthy(&m);
        h.clusters.insert(
            "default/a/a1/app/work/grpc".into(),
            ClusterHealth {
                routable: 2,
                ..Default::default()
            },
        );
        let r = run(&m, &h, &Weights::default());
        let vh = &r.routes[0].virtual_hosts[0];
        let grpc: Vec<(&str, Option<String>)> = vh
            .routes
            .iter()
            .filter(|r| r.r#match.as_ref().unwrap().grpc.is_some())
            .map(|r| {
                let header = r.r#match.as_ref().unwrap().headers.first().map(|h| {
                    match &h.header_match_specifier {
                        Some(route::header_matcher::HeaderMatchSpecifier::StringMatch(m)) => {
                            format!("{}={:?}", h.name, m.match_pattern)
                        }
                        other => format!("{other:?}"),
                    }
                });
                (r.name.as_str(), header)
            })
            .collect();
        assert_eq!(grpc.len(), 5, "{grpc:?}");
        assert_eq!(grpc[4], ("grpc", None));
        assert!(grpc[..4].iter().all(|(_, h)| h
            .as_deref()
            .is_some_and(|h| h.starts_with("application=Some(Exact("))));
        let work = vh
            .routes
            .iter()
            .find(|r| r.name == "grpc/app/work")
            .unwrap();
        match &work.action {
            Some(route::route::Action::Route(a)) => match &a.cluster_specifier {
                Some(route::route_action::ClusterSpecifier::WeightedClusters(w)) => {
                    assert_eq!(w.clusters[0].name, "default/a/a1/app/work/grpc")
                }
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }
        // Not probed yet (not routable): gRPC proxies.
        let echo = vh
            .routes
            .iter()
            .find(|r| r.name == "grpc/app/echo")
            .unwrap();
        let Some(route::route::Action::Route(a)) = &echo.action else {
            panic!()
        };
        let Some(route::route_action::ClusterSpecifier::WeightedClusters(w)) = &a.cluster_specifier
        else {
            panic!()
        };
        assert_eq!(w.clusters[0].name, "default/a/a1/grpc");
        assert!(r
            .clusters
            .iter()
            .any(|c| c.name == "default/a/a1/app/echo/grpc"));
    }

    #[test]
    fn ray_prefixes_map_to_envoy_matchers_with_ray_semantics() {
        use route::route_match::PathSpecifier::*;
        assert_eq!(prefix_match("/"), Prefix("/".into()));
        assert_eq!(prefix_match("/api/"), Prefix("/api/".into()));
        assert_eq!(prefix_match("/work"), PathSeparatedPrefix("/work".into()));
    }

    #[test]
    fn an_application_s_gone_cluster_stands_in_as_where_its_traffic_goes() {
        let m = model();
        let r = run(&m, &healthy(&m), &Weights::default());
        assert_eq!(
            r.stand_ins.get("default/a/*/app/work").map(String::as_str),
            Some("default/a/a1/app/work")
        );
        assert_eq!(
            r.stand_ins.get("default/a/*/app/api").map(String::as_str),
            Some("default/a/a1")
        );
        let snapshot_names =
            crate::xds::snapshot::name_matches("default/a/*/app/work", "default/a/a0/app/work");
        assert!(snapshot_names);
        assert!(!crate::xds::snapshot::name_matches(
            "default/a/*",
            "default/a/a0/app/work"
        ));
    }

    #[test]
    fn names_are_encoded_as_one_segment() {
        let mut s = service("a", "a1", &[8000]);
        s.clusters[0].direct_ingress = true;
        s.clusters[0].applications = vec![app("my app/v2", Some("/x"), &[30000])];
        let m = Model::new(vec![s]).unwrap();
        let r = run(&m, &healthy(&m), &Weights::default());
        assert!(r
            .clusters
            .iter()
            .any(|c| c.name == "default/a/a1/app/my%20app%2Fv2"));
        assert_eq!(http_routes_of(&r)[0].0, "app/my%20app%2Fv2");
    }
}

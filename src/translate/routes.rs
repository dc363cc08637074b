//! The routes: a virtual host per RayService, its routes to the RayService's clusters by
//! weight, and their retry policies.
//!
//! In each virtual host, in order: gRPC calls (per application, then to the gRPC
//! proxies; or answered `UNIMPLEMENTED` when no cluster taking traffic serves gRPC), a
//! path with a percent escape to the proxies (while there are application routes), the
//! application routes, then every other path to the HTTP proxies. Retries go to another
//! proxy and replay only what certainly did not run, unless the RayService is idempotent.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::config::route::v3 as route;
use envoy_types::pb::envoy::extensions::retry::host::previous_hosts::v3::PreviousHostsPredicate;
use envoy_types::pb::google::protobuf;
use envoy_types::util::pack_any;

use super::{applications, duration, u32_value, ServiceWeights};
use crate::live::health::HealthMap;
use crate::model::{Protocol, RayService};
use crate::policy::traffic::TrafficPolicy;

/// How many times a retry's host is picked again when the pick is a proxy it already
/// tried (Envoy's `host_selection_retry_max_attempts`).
const HOST_RE_PICKS: i64 = 30;

/// Retries that go to another proxy, of requests that certainly did not run, unless
/// the RayService is idempotent (see [`retry_on`]).
fn retry_policy(policy: &TrafficPolicy, protocol: Protocol) -> route::RetryPolicy {
    route::RetryPolicy {
        retry_on: match protocol {
            Protocol::Http => retry_on(policy),
            Protocol::Grpc => grpc_retry_on(policy),
        },
        num_retries: u32_value(policy.retries),
        // A try that times out may be running: ending it without replaying it would only
        // turn a slow answer into an error, so only idempotent requests get one.
        per_try_timeout: (policy.idempotent && !policy.per_try_timeout.is_zero())
            .then(|| duration(policy.per_try_timeout)),
        retriable_status_codes: vec![503],
        retry_host_predicate: vec![route::retry_policy::RetryHostPredicate {
            name: "envoy.retry_host_predicates.previous_hosts".into(),
            config_type: Some(
                route::retry_policy::retry_host_predicate::ConfigType::TypedConfig(pack_any(
                    PreviousHostsPredicate {},
                )),
            ),
        }],
        // Least-request breaks ties at random, so with two proxies a pick lands on the one
        // just tried about half the time: 5 re-picks sent retries back to the proxy that
        // had just failed them (CI; `envoy_safety`'s reset test, 64 retries, failed 5
        // runs in 6 with 5). 30 make it about 1 in 2^31; a re-pick is one random draw
        // and happens only when a pick is refused.
        host_selection_retry_max_attempts: HOST_RE_PICKS,
        retry_back_off: Some(route::retry_policy::RetryBackOff {
            base_interval: Some(duration(policy.retry_back_off)),
            max_interval: Some(duration(policy.retry_back_off.saturating_mul(10))),
        }),
        ..Default::default()
    }
}

/// Envoy's `retry_on` for a policy. Always: what certainly did not reach a Ray replica
/// (a refused or failed connection, a stream refused or reset before the request was
/// sent) and Ray's 503 (backpressure, or no replica: nothing ran). Only for idempotent
/// RayServices: a reset after the request was sent and 502/504 or a per-try timeout
/// (`reset`, `gateway-error`), which may follow a request that ran.
pub fn retry_on(policy: &TrafficPolicy) -> String {
    let mut on = vec![
        "connect-failure",
        "refused-stream",
        "reset-before-request",
        "retriable-status-codes",
    ];
    if policy.idempotent {
        on.extend(["reset", "gateway-error"]);
    }
    on.join(",")
}

/// Envoy's `retry_on` for gRPC calls: what [`retry_on`] retries for HTTP, and Ray's
/// gRPC backpressure (`RESOURCE_EXHAUSTED`: nothing ran); only for idempotent RayServices
/// also `UNAVAILABLE` (a draining proxy or no replica, but an application may answer it
/// too). Envoy sees a gRPC status only in a trailers-only answer (an error before any
/// message); an error after messages, in trailers, is never retried.
pub fn grpc_retry_on(policy: &TrafficPolicy) -> String {
    let mut on = retry_on(policy);
    on.push_str(",resource-exhausted");
    if policy.idempotent {
        on.push_str(",unavailable");
    }
    on
}

pub(super) fn virtual_host(
    service: &RayService,
    all: &ServiceWeights<'_>,
    health: &HealthMap,
    policy: &TrafficPolicy,
) -> route::VirtualHost {
    let weights = all.service;
    let mut routes = Vec::new();
    // gRPC calls go to the gRPC proxies of the same clusters, with the same weights; a
    // cluster that serves no gRPC takes none (while any cluster does).
    let grpc_weights: Vec<(String, u32)> = weights
        .iter()
        .filter(|(c, w)| *w > 0 && service.cluster(c).is_some_and(|c| c.serves_grpc()))
        .cloned()
        .collect();
    if !grpc_weights.is_empty() {
        routes.extend(applications::grpc_routes(service, all, health, policy));
        routes.push(weighted_route(
            "grpc",
            any_path(true),
            proxy_clusters(service, &grpc_weights, Protocol::Grpc),
            Protocol::Grpc,
            policy,
        ));
    } else {
        // No cluster to take gRPC: a gRPC call must not reach the HTTP proxy (over HTTP/1.1,
        // where the HTTP application would run it and answer garbage). Envoy answers a
        // gRPC request's local reply in gRPC: 404 becomes `UNIMPLEMENTED`, trailers-only.
        routes.push(route::Route {
            name: "grpc-unserved".into(),
            r#match: Some(route::RouteMatch {
                path_specifier: Some(route::route_match::PathSpecifier::Prefix("/".into())),
                grpc: Some(route::route_match::GrpcRouteMatchOptions {}),
                ..Default::default()
            }),
            action: Some(route::route::Action::DirectResponse(
                route::DirectResponseAction {
                    status: 404,
                    body: Some(core::DataSource {
                        specifier: Some(core::data_source::Specifier::InlineString(format!(
                            "rayservice {} serves no gRPC",
                            service.key()
                        ))),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            )),
            ..Default::default()
        });
    }
    let app_routes = applications::http_routes(service, all, health, policy);
    if !app_routes.is_empty() {
        // Ray matches route prefixes on the percent-decoded path (uvicorn decodes it),
        // Envoy on the raw one: `/wor%6B` is `work`'s for Ray, `/`'s for a prefix route.
        // A path with an escape goes to the proxies, which match as Ray does, never to
        // a replica another application's route would pick.
        routes.push(weighted_route(
            "percent-encoded",
            route::RouteMatch {
                path_specifier: Some(route::route_match::PathSpecifier::SafeRegex(
                    envoy_types::pb::envoy::r#type::matcher::v3::RegexMatcher {
                        regex: ".*%.*".into(),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            },
            proxy_clusters(service, weights, Protocol::Http),
            Protocol::Http,
            policy,
        ));
    }
    routes.extend(app_routes);
    routes.push(weighted_route(
        "default",
        any_path(false),
        proxy_clusters(service, weights, Protocol::Http),
        Protocol::Http,
        policy,
    ));
    route::VirtualHost {
        name: service.key(),
        domains: service.hosts.clone(),
        routes,
        ..Default::default()
    }
}

/// A route to `clusters` (Envoy cluster names) by weight, with the retry policy and
/// timeouts of `protocol`.
pub(super) fn weighted_route(
    name: &str,
    r#match: route::RouteMatch,
    clusters: Vec<(String, u32)>,
    protocol: Protocol,
    policy: &TrafficPolicy,
) -> route::Route {
    route::Route {
        name: name.into(),
        r#match: Some(r#match),
        action: Some(route::route::Action::Route(route::RouteAction {
            cluster_specifier: Some(route::route_action::ClusterSpecifier::WeightedClusters(
                route::WeightedCluster {
                    clusters: clusters
                        .into_iter()
                        .map(|(name, weight)| route::weighted_cluster::ClusterWeight {
                            name,
                            weight: Some(protobuf::UInt32Value { value: weight }),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                },
            )),
            // Ray Serve calls may stream for minutes: no overall deadline by default.
            timeout: Some(duration(policy.route_timeout)),
            // A gRPC client's own deadline (`grpc-timeout`) bounds its call in Envoy too.
            max_stream_duration: (protocol == Protocol::Grpc).then(|| {
                route::route_action::MaxStreamDuration {
                    grpc_timeout_header_max: Some(duration(Duration::ZERO)),
                    ..Default::default()
                }
            }),
            retry_policy: Some(retry_policy(policy, protocol)),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Every path (`/` prefix); for gRPC calls only (`content-type: application/grpc`) when
/// `grpc`.
fn any_path(grpc: bool) -> route::RouteMatch {
    route::RouteMatch {
        path_specifier: Some(route::route_match::PathSpecifier::Prefix("/".into())),
        grpc: grpc.then_some(route::route_match::GrpcRouteMatchOptions {}),
        ..Default::default()
    }
}

/// `weights` (RayCluster, percent) as the Envoy clusters of `protocol`'s proxies.
fn proxy_clusters(
    service: &RayService,
    weights: &[(String, u32)],
    protocol: Protocol,
) -> Vec<(String, u32)> {
    weights
        .iter()
        .map(|(cluster, weight)| (service.envoy_cluster_name_for(cluster, protocol), *weight))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_call_that_may_have_run_is_replayed_only_when_idempotent() {
        let p = TrafficPolicy::default();
        let on = grpc_retry_on(&p);
        let has = |on: &str, r: &str| on.split(',').any(|x| x == r);
        assert!(has(&on, "resource-exhausted"), "Ray's backpressure: {on}");
        assert!(
            has(&on, "connect-failure") && has(&on, "refused-stream"),
            "{on}"
        );
        for unsafe_ in [
            "reset",
            "unavailable",
            "cancelled",
            "deadline-exceeded",
            "internal",
            "gateway-error",
            "5xx",
        ] {
            assert!(!has(&on, unsafe_), "{unsafe_} in {on}");
        }
        let p = TrafficPolicy {
            idempotent: true,
            ..p
        };
        let on = grpc_retry_on(&p);
        assert!(has(&on, "reset") && has(&on, "unavailable"), "{on}");
    }

    #[test]
    fn what_may_have_run_is_replayed_only_when_idempotent() {
        let p = TrafficPolicy::default();
        let on = retry_on(&p);
        for unsafe_ in ["reset", "gateway-error", "5xx"] {
            assert!(!on.split(',').any(|r| r == unsafe_), "{on}");
        }
        assert!(
            retry_policy(&p, Protocol::Http).per_try_timeout.is_none(),
            "no per-try timeout"
        );
        let p = TrafficPolicy {
            idempotent: true,
            ..p
        };
        let on = retry_on(&p);
        assert!(on.split(',').any(|r| r == "reset"), "{on}");
        assert!(on.split(',').any(|r| r == "gateway-error"), "{on}");
        assert!(retry_policy(&p, Protocol::Http).per_try_timeout.is_some());
    }
}

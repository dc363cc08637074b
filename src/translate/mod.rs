//! `translate`: the pure function from a [`Model`] to the Envoy resources that serve it.
//!
//! Synchronous, no I/O, no clock: the same model and settings always give the same
//! resources, byte for byte, so resource versions (content hashes) are stable across
//! restarts and replicas. What it produces:
//!
//! - one listener, [`LISTENER_NAME`], whose HTTP connection manager takes its routes over RDS;
//! - one route configuration, [`ROUTE_CONFIG_NAME`], with a virtual host per RayService;
//! - one EDS cluster per RayCluster, named `<namespace>/<rayservice>/<raycluster>`;
//! - one ClusterLoadAssignment per cluster, with an endpoint per Ray Serve proxy that may
//!   take new requests, as [`HealthMap`] decides (`live::health`): healthy or not probed
//!   yet; an unhealthy, draining or withheld proxy is left out;
//! - for a RayCluster that serves gRPC, a second EDS cluster `<...>/<raycluster>/grpc`
//!   (HTTP/2 to each node's gRPC proxy) and its assignment, and in the virtual host a
//!   first route that takes `content-type: application/grpc` to it.
//!
//! Routes go to the active cluster through `weighted_clusters`, so that a later
//! switchover only changes weights; the gRPC route carries the same weights as HTTP.

use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3 as cluster;
use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::config::endpoint::v3 as endpoint;
use envoy_types::pb::envoy::config::listener::v3 as listener;
use envoy_types::pb::envoy::config::route::v3 as route;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use envoy_types::pb::envoy::extensions::upstreams::http::v3 as upstream_http;
use envoy_types::pb::google::protobuf;
use envoy_types::util::pack_any;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use crate::config::GatewaySettings;
use crate::live::health::{EndpointHealth, HealthMap};
use crate::model::{Model, Protocol, RayService};
use crate::policy::traffic::TrafficPolicy;
use crate::xds::Resources;
use envoy_types::pb::envoy::extensions::retry::host::previous_hosts::v3::PreviousHostsPredicate;

mod applications;

pub const LISTENER_NAME: &str = "ray-serve-http";
pub const ROUTE_CONFIG_NAME: &str = "ray-serve-http";
/// Filter-metadata namespace under which endpoints carry ray-xds facts (node type).
pub const METADATA_NAMESPACE: &str = "ray-xds";

/// Percent of traffic per RayCluster, by switch: a RayService's key (`<namespace>/<name>`),
/// or one of its applications' ([`app_switch_key`]) while that application moves on its
/// own readiness. A RayService missing here sends everything to its active cluster; an
/// application missing here goes as its RayService.
pub type Weights = BTreeMap<String, Vec<(String, u32)>>;

/// The [`Weights`] key of application `app` of the RayService keyed `service`:
/// `<namespace>/<name>#<application>` (a RayService key never holds `#`).
pub fn app_switch_key(service: &str, app: &str) -> String {
    format!("{service}#{app}")
}

/// The weights of one RayService: its own, and its applications' that move on their own.
pub(crate) struct ServiceWeights<'a> {
    pub service: &'a [(String, u32)],
    pub apps: BTreeMap<&'a str, &'a [(String, u32)]>,
}

impl ServiceWeights<'_> {
    /// `app`'s weights: its own while it moves on its own, else its RayService's.
    pub fn of(&self, app: &str) -> &[(String, u32)] {
        self.apps.get(app).copied().unwrap_or(self.service)
    }
}

pub fn translate(
    model: &Model,
    health: &HealthMap,
    all_weights: &Weights,
    gateway: &GatewaySettings,
    traffic: &TrafficPolicy,
) -> Resources {
    let mut out = Resources {
        listeners: vec![http_listener(gateway, traffic)],
        ..Default::default()
    };
    let mut virtual_hosts = Vec::new();
    for service in model.services() {
        let policy = traffic.with(&service.policy.overrides.traffic);
        for ray_cluster in &service.clusters {
            for protocol in [Protocol::Http, Protocol::Grpc] {
                if protocol == Protocol::Grpc && !ray_cluster.serves_grpc() {
                    continue;
                }
                let name = service.envoy_cluster_name_for(&ray_cluster.name, protocol);
                out.clusters
                    .push(eds_cluster(&name, gateway, &policy, protocol));
                let proxies = ray_cluster
                    .endpoints(protocol)
                    .map(|(address, proxy)| (address, ("node_type", proxy.node_type.as_str())));
                out.endpoints.push(load_assignment(&name, proxies, health));
            }
            for (name, protocol, replicas) in applications::clusters(service, ray_cluster) {
                out.clusters
                    .push(eds_cluster(&name, gateway, &policy, protocol));
                out.endpoints.push(load_assignment(&name, replicas, health));
            }
        }
        let active = [(service.active_cluster.clone(), 100)];
        let weights = all_weights
            .get(&service.key())
            .map_or(&active[..], Vec::as_slice);
        // A cluster of this RayService that an Envoy still holds after a reconnect, and
        // that has gone since, stands in as the one taking most of its traffic now; a
        // gRPC cluster for a gRPC one (`*` is one name segment, so neither pattern covers
        // the other kind).
        let by_weight = |grpc: bool| {
            weights
                .iter()
                .filter(|(c, _)| !grpc || service.cluster(c).is_some_and(|c| c.serves_grpc()))
                .max_by_key(|(_, w)| *w)
                .map(|(c, _)| c)
        };
        let service_prefix = format!("{}/{}/", service.namespace, service.name);
        if let Some(serving) = by_weight(false) {
            out.stand_ins.insert(
                format!("{service_prefix}*"),
                service.envoy_cluster_name(serving),
            );
        }
        if let Some(serving) = by_weight(true) {
            out.stand_ins.insert(
                format!("{service_prefix}*/grpc"),
                service.envoy_grpc_cluster_name(serving),
            );
        }
        out.stand_ins
            .extend(applications::stand_ins(service, weights, health));
        let prefix = app_switch_key(&service.key(), "");
        let all = ServiceWeights {
            service: weights,
            apps: all_weights
                .range(prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&prefix))
                .map(|(k, w)| (&k[prefix.len()..], w.as_slice()))
                .collect(),
        };
        virtual_hosts.push(virtual_host(service, &all, health, &policy));
    }
    out.routes.push(route::RouteConfiguration {
        name: ROUTE_CONFIG_NAME.into(),
        virtual_hosts,
        // Every cluster a route names is one we send; skip Envoy's own check so a route
        // never fails validation during the moment a cluster is still warming.
        validate_clusters: Some(protobuf::BoolValue { value: false }),
        ..Default::default()
    });
    out
}

fn duration(d: Duration) -> protobuf::Duration {
    protobuf::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

fn ads() -> core::ConfigSource {
    core::ConfigSource {
        config_source_specifier: Some(core::config_source::ConfigSourceSpecifier::Ads(
            core::AggregatedConfigSource {},
        )),
        resource_api_version: core::ApiVersion::V3 as i32,
        ..Default::default()
    }
}

fn socket_address(ip: String, port: u16) -> core::Address {
    core::Address {
        address: Some(core::address::Address::SocketAddress(core::SocketAddress {
            address: ip,
            port_specifier: Some(core::socket_address::PortSpecifier::PortValue(port as u32)),
            ..Default::default()
        })),
    }
}

/// Below this share of healthy hosts (0 of any number up to 100), a cluster routes to
/// every host it lists: better one more try on an ejected proxy than a certain 503.
pub const HEALTHY_PANIC_THRESHOLD_PERCENT: f64 = 1.0;

/// The gateway's listener. Global settings only (a listener serves every RayService):
/// WebSocket upgrades pass through to Ray Serve (FastAPI ingress deployments serve them);
/// a request or stream may be silent for `stream_idle_timeout`; the client's address
/// reaches Ray in `X-Forwarded-For`, Envoy being the edge unless `xff_num_trusted_hops`
/// says how many proxies in front of it to trust.
fn http_listener(gateway: &GatewaySettings, traffic: &TrafficPolicy) -> listener::Listener {
    let manager = hcm::HttpConnectionManager {
        stat_prefix: "ray_serve_http".into(),
        codec_type: hcm::http_connection_manager::CodecType::Auto as i32,
        upgrade_configs: vec![hcm::http_connection_manager::UpgradeConfig {
            upgrade_type: "websocket".into(),
            ..Default::default()
        }],
        stream_idle_timeout: Some(duration(traffic.stream_idle_timeout)),
        use_remote_address: Some(protobuf::BoolValue { value: true }),
        // A request id the client sets reaches Ray as it is (to correlate its logs with
        // the client's); Envoy makes one up otherwise, and keeps it across retries.
        preserve_external_request_id: true,
        xff_num_trusted_hops: traffic.xff_num_trusted_hops,
        // `Host: svc.example:10000` and `Host: svc.example.` (a fully qualified name)
        // match the virtual host of `svc.example`, never a wildcard another RayService
        // holds.
        strip_port_mode: Some(hcm::http_connection_manager::StripPortMode::StripAnyHostPort(true)),
        strip_trailing_host_dot: true,
        route_specifier: Some(hcm::http_connection_manager::RouteSpecifier::Rds(
            hcm::Rds {
                config_source: Some(ads()),
                route_config_name: ROUTE_CONFIG_NAME.into(),
            },
        )),
        http_filters: vec![hcm::HttpFilter {
            name: "envoy.filters.http.router".into(),
            config_type: Some(hcm::http_filter::ConfigType::TypedConfig(pack_any(
                Router::default(),
            ))),
            ..Default::default()
        }],
        ..Default::default()
    };
    listener::Listener {
        name: LISTENER_NAME.into(),
        address: Some(socket_address(
            gateway.listener_address.to_string(),
            gateway.listener_port,
        )),
        filter_chains: vec![listener::FilterChain {
            filters: vec![listener::Filter {
                name: "envoy.filters.network.http_connection_manager".into(),
                config_type: Some(listener::filter::ConfigType::TypedConfig(pack_any(manager))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn u32_value(value: u32) -> Option<protobuf::UInt32Value> {
    Some(protobuf::UInt32Value { value })
}

/// Passive health on top of ray-xds's probes: a proxy whose connections fail or whose
/// tries time out (per-try timeouts: idempotent RayServices only) is ejected before the
/// next probe notices (Envoy 1.40 does not count a reset after the request was sent as a
/// local-origin failure: measured, see docs/behaviour.md, Traffic policy). No HTTP answer
/// ejects: Ray's 503
/// is backpressure (the deployment behind every proxy is busy, ejecting one cannot help),
/// 500 is the application's own error, and Ray's proxy never answers 502 or 504 itself.
/// Below 100%, the last proxy of a cluster is never ejected: EDS carries only the proxies
/// that may take new requests, so the share counts only those.
fn outlier_detection(policy: &TrafficPolicy) -> cluster::OutlierDetection {
    cluster::OutlierDetection {
        enforcing_consecutive_5xx: u32_value(0),
        enforcing_consecutive_gateway_failure: u32_value(0),
        split_external_local_origin_errors: true,
        consecutive_local_origin_failure: u32_value(policy.consecutive_local_origin_failure),
        enforcing_consecutive_local_origin_failure: u32_value(100),
        enforcing_success_rate: u32_value(0),
        enforcing_local_origin_success_rate: u32_value(0),
        enforcing_failure_percentage: u32_value(0),
        enforcing_failure_percentage_local_origin: u32_value(0),
        interval: Some(duration(policy.outlier_interval)),
        base_ejection_time: Some(duration(policy.base_ejection_time)),
        max_ejection_time: Some(duration(policy.base_ejection_time.saturating_mul(10))),
        max_ejection_percent: u32_value(policy.max_ejection_percent),
        always_eject_one_host: Some(protobuf::BoolValue { value: false }),
        ..Default::default()
    }
}

/// Limits sized for streaming inference (a streamed answer holds a connection for
/// minutes), and a retry budget as the backstop against retry storms (each request's
/// retries are bounded by the route's `num_retries`): at most `retry_budget_percent` of
/// the requests in flight may be retries in flight, and at least
/// `retry_budget_min_concurrency` may, so that a burst of requests that never ran (all
/// those waiting on a proxy's connections, failed together by one connect failure) is
/// retried whole.
fn circuit_breakers(policy: &TrafficPolicy) -> cluster::CircuitBreakers {
    cluster::CircuitBreakers {
        thresholds: vec![cluster::circuit_breakers::Thresholds {
            priority: core::RoutingPriority::Default as i32,
            max_connections: u32_value(policy.max_connections),
            max_pending_requests: u32_value(policy.max_pending_requests),
            max_requests: u32_value(policy.max_requests),
            retry_budget: Some(cluster::circuit_breakers::thresholds::RetryBudget {
                budget_percent: Some(envoy_types::pb::envoy::r#type::v3::Percent {
                    value: policy.retry_budget_percent as f64,
                }),
                min_retry_concurrency: u32_value(policy.retry_budget_min_concurrency),
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn eds_cluster(
    name: &str,
    gateway: &GatewaySettings,
    policy: &TrafficPolicy,
    protocol: Protocol,
) -> cluster::Cluster {
    use upstream_http::http_protocol_options::explicit_http_config::ProtocolConfig;
    let protocol_config = match protocol {
        Protocol::Http => {
            ProtocolConfig::HttpProtocolOptions(core::Http1ProtocolOptions::default())
        }
        // Ray's gRPC proxy (grpcio) speaks HTTP/2 in clear text.
        Protocol::Grpc => {
            ProtocolConfig::Http2ProtocolOptions(core::Http2ProtocolOptions::default())
        }
    };
    let protocol = upstream_http::HttpProtocolOptions {
        common_http_protocol_options: Some(core::HttpProtocolOptions {
            // Below Ray Serve's keep-alive, so Envoy closes idle connections first and never
            // reuses one the proxy is closing.
            idle_timeout: Some(duration(gateway.upstream_idle_timeout)),
            ..Default::default()
        }),
        upstream_protocol_options: Some(
            upstream_http::http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                upstream_http::http_protocol_options::ExplicitHttpConfig {
                    protocol_config: Some(protocol_config),
                },
            ),
        ),
        ..Default::default()
    };
    cluster::Cluster {
        name: name.into(),
        cluster_discovery_type: Some(cluster::cluster::ClusterDiscoveryType::Type(
            cluster::cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::cluster::EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: String::new(),
        }),
        connect_timeout: Some(duration(gateway.connect_timeout)),
        typed_extension_protocol_options: [(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".to_string(),
            pack_any(protocol),
        )]
        .into_iter()
        .collect(),
        outlier_detection: Some(outlier_detection(policy)),
        circuit_breakers: Some(circuit_breakers(policy)),
        // Model calls are long and uneven: send each request to the less busy of two
        // proxies picked at random, not round robin.
        lb_policy: cluster::cluster::LbPolicy::LeastRequest as i32,
        common_lb_config: Some(cluster::cluster::CommonLbConfig {
            // Health changes from EDS apply at once instead of being merged for 1 s.
            update_merge_window: Some(duration(Duration::ZERO)),
            // Panic routing only when no host is left: EDS lists only proxies that may
            // take new requests (ray-xds fails open itself when a whole cluster looks
            // unhealthy, see live::health), so Envoy's default (below 50% healthy, use
            // every host) would undo outlier detection half the time, while 0 would
            // answer "no healthy upstream" once outlier detection ejects the last proxy
            // (Envoy ejects at least one host whatever `max_ejection_percent` says).
            healthy_panic_threshold: Some(envoy_types::pb::envoy::r#type::v3::Percent {
                value: HEALTHY_PANIC_THRESHOLD_PERCENT,
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The assignment of Envoy cluster `name`: each endpoint that may take new requests, as
/// `health` decides, with one fact in its metadata (a proxy's node type, a replica's
/// application).
fn load_assignment<'a>(
    name: &str,
    endpoints: impl Iterator<Item = (SocketAddr, (&'static str, &'a str))>,
    health: &HealthMap,
) -> endpoint::ClusterLoadAssignment {
    let lb_endpoints = endpoints
        .filter_map(|(address, fact)| {
            // Only what may take new requests: an endpoint that left (unhealthy,
            // draining, withheld) is not listed at all. Envoy lets requests in flight on
            // a removed host finish, and its outlier detection then counts only these
            // endpoints, so below `max_ejection_percent: 100` it never ejects the last.
            let health = match health.health(name, address) {
                EndpointHealth::Withheld | EndpointHealth::Unhealthy | EndpointHealth::Draining => {
                    return None
                }
                EndpointHealth::Unknown => core::HealthStatus::Unknown,
                EndpointHealth::Healthy => core::HealthStatus::Healthy,
            };
            Some((address, fact, health))
        })
        .map(|(address, (key, value), health)| endpoint::LbEndpoint {
            host_identifier: Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(
                endpoint::Endpoint {
                    address: Some(socket_address(address.ip().to_string(), address.port())),
                    hostname: address.to_string(),
                    ..Default::default()
                },
            )),
            health_status: health as i32,
            metadata: Some(core::Metadata {
                filter_metadata: [(
                    METADATA_NAMESPACE.to_string(),
                    protobuf::Struct {
                        fields: [(
                            key.to_string(),
                            protobuf::Value {
                                kind: Some(protobuf::value::Kind::StringValue(value.into())),
                            },
                        )]
                        .into_iter()
                        .collect(),
                    },
                )]
                .into_iter()
                .collect(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    endpoint::ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: vec![endpoint::LocalityLbEndpoints {
            lb_endpoints,
            ..Default::default()
        }],
        ..Default::default()
    }
}

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

fn virtual_host(
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
fn weighted_route(
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
    use crate::model::test_support::service;
    use crate::xds::snapshot::referenced_clusters;

    #[test]
    fn one_cluster_and_assignment_per_ray_cluster() {
        let mut a = service("a", "a1", &[8000, 8001]);
        let extra = service("a", "a2", &[8100]).clusters.remove(0);
        a.clusters.push(extra);
        a.pending_cluster = Some("a2".into());
        let model = Model::new(vec![a, service("b", "b1", &[9000])]).unwrap();
        let r = translate(
            &model,
            &HealthMap::default(),
            &Weights::default(),
            &GatewaySettings::default(),
            &TrafficPolicy::default(),
        );
        let names: Vec<_> = r.clusters.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["default/a/a1", "default/a/a2", "default/b/b1"]);
        assert_eq!(r.endpoints.len(), 3);
        assert_eq!(r.endpoints[0].endpoints[0].lb_endpoints.len(), 2);
        assert_eq!(r.listeners.len(), 1);
        assert_eq!(r.routes[0].virtual_hosts.len(), 2);
        // With no switchover known, the route goes to the active cluster only.
        assert_eq!(
            referenced_clusters(&r.routes[0]),
            ["default/a/a1", "default/b/b1"]
        );
    }

    /// A cluster whose proxies serve gRPC on `port + 1000`.
    fn with_grpc(mut s: RayService) -> RayService {
        for c in &mut s.clusters {
            for p in &mut c.proxies {
                p.grpc = Some(SocketAddr::new(p.address.ip(), p.address.port() + 1000));
            }
        }
        s
    }

    fn route_action(r: &route::Route) -> &route::RouteAction {
        match &r.action {
            Some(route::route::Action::Route(a)) => a,
            other => panic!("not a route action: {other:?}"),
        }
    }

    fn weighted(a: &route::RouteAction) -> Vec<(String, u32)> {
        match &a.cluster_specifier {
            Some(route::route_action::ClusterSpecifier::WeightedClusters(w)) => w
                .clusters
                .iter()
                .map(|c| (c.name.clone(), c.weight.unwrap().value))
                .collect(),
            other => panic!("not weighted: {other:?}"),
        }
    }

    #[test]
    fn a_cluster_serving_grpc_gets_an_http2_cluster_and_a_grpc_route_with_the_same_weights() {
        let mut a = with_grpc(service("a", "a1", &[8000, 8001]));
        // The pending cluster serves HTTP only.
        a.clusters
            .push(service("a", "a2", &[8100]).clusters.remove(0));
        a.pending_cluster = Some("a2".into());
        let model = Model::new(vec![a]).unwrap();
        let weights = Weights::from([(
            "default/a".to_string(),
            vec![("a1".to_string(), 75), ("a2".to_string(), 25)],
        )]);
        let r = translate(
            &model,
            &HealthMap::default(),
            &weights,
            &GatewaySettings::default(),
            &TrafficPolicy::default(),
        );
        let names: Vec<_> = r.clusters.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["default/a/a1", "default/a/a1/grpc", "default/a/a2"]);
        let http2 = |c: &cluster::Cluster| {
            let any = &c.typed_extension_protocol_options
                ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
            let o = <upstream_http::HttpProtocolOptions as prost::Message>::decode(&*any.value)
                .unwrap();
            matches!(
                o.upstream_protocol_options,
                Some(upstream_http::http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                    upstream_http::http_protocol_options::ExplicitHttpConfig {
                        protocol_config: Some(upstream_http::http_protocol_options::explicit_http_config::ProtocolConfig::Http2ProtocolOptions(_))
                    }
                ))
            )
        };
        assert!(http2(&r.clusters[1]), "gRPC upstreams speak HTTP/2");
        assert!(!http2(&r.clusters[0]) && !http2(&r.clusters[2]));
        // The gRPC assignment lists the gRPC addresses.
        let grpc = r
            .endpoints
            .iter()
            .find(|e| e.cluster_name == "default/a/a1/grpc")
            .unwrap();
        let ports: Vec<String> = grpc.endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| match &e.host_identifier {
                Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(e)) => e.hostname.clone(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(ports, ["127.0.0.1:9000", "127.0.0.1:9001"]);
        // First the gRPC route (content-type application/grpc), then HTTP.
        let vh = &r.routes[0].virtual_hosts[0];
        assert_eq!(vh.routes.len(), 2);
        assert!(vh.routes[0].r#match.as_ref().unwrap().grpc.is_some());
        assert!(vh.routes[1].r#match.as_ref().unwrap().grpc.is_none());
        // gRPC follows the same switch; a cluster without gRPC takes no gRPC call.
        assert_eq!(
            weighted(route_action(&vh.routes[0])),
            [("default/a/a1/grpc".to_string(), 75)]
        );
        assert_eq!(
            weighted(route_action(&vh.routes[1])),
            [
                ("default/a/a1".to_string(), 75),
                ("default/a/a2".to_string(), 25)
            ]
        );
        let grpc_action = route_action(&vh.routes[0]);
        assert_eq!(
            grpc_action
                .max_stream_duration
                .as_ref()
                .and_then(|m| m.grpc_timeout_header_max),
            Some(duration(Duration::ZERO)),
            "the client's grpc-timeout is honoured"
        );
        assert_eq!(
            grpc_action.retry_policy.as_ref().unwrap().retry_on,
            grpc_retry_on(&TrafficPolicy::default())
        );
    }

    #[test]
    fn a_gone_cluster_gets_a_stand_in_of_its_own_kind() {
        use crate::xds::{ResourceType, Snapshot};
        let model = Model::new(vec![with_grpc(service("a", "a1", &[8000]))]).unwrap();
        let r = translate(
            &model,
            &HealthMap::default(),
            &Weights::default(),
            &GatewaySettings::default(),
            &TrafficPolicy::default(),
        );
        let snapshot = Snapshot::build(&r, None).unwrap();
        let stand_in = |name: &str| {
            let r = snapshot.stand_in(ResourceType::Cluster, name).unwrap();
            <cluster::Cluster as prost::Message>::decode(&*r.body.value).unwrap()
        };
        let http = stand_in("default/a/gone");
        let grpc = stand_in("default/a/gone/grpc");
        assert_eq!(
            (http.name.as_str(), grpc.name.as_str()),
            ("default/a/gone", "default/a/gone/grpc")
        );
        let protocol = |c: &cluster::Cluster| {
            let any = &c.typed_extension_protocol_options
                ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
            format!(
                "{:?}",
                <upstream_http::HttpProtocolOptions as prost::Message>::decode(&*any.value)
                    .unwrap()
                    .upstream_protocol_options
            )
        };
        assert!(
            protocol(&grpc).contains("Http2ProtocolOptions"),
            "{}",
            protocol(&grpc)
        );
        assert!(
            protocol(&http).contains("HttpProtocolOptions(Http1"),
            "{}",
            protocol(&http)
        );
    }

    #[test]
    fn no_grpc_anywhere_means_grpc_calls_are_answered_unimplemented() {
        let model = Model::new(vec![service("a", "a1", &[8000])]).unwrap();
        let r = translate(
            &model,
            &HealthMap::default(),
            &Weights::default(),
            &GatewaySettings::default(),
            &TrafficPolicy::default(),
        );
        assert_eq!(r.clusters.len(), 1);
        // gRPC calls get `UNIMPLEMENTED` from Envoy (a 404 local reply) rather than reach
        // the HTTP proxy over HTTP/1.1.
        let routes = &r.routes[0].virtual_hosts[0].routes;
        assert_eq!(routes.len(), 2);
        assert!(routes[0].r#match.as_ref().unwrap().grpc.is_some());
        assert!(matches!(
            &routes[0].action,
            Some(route::route::Action::DirectResponse(d)) if d.status == 404
        ));
        assert!(routes[1].r#match.as_ref().unwrap().grpc.is_none());
    }

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
    fn is_deterministic() {
        let model = Model::new(vec![service("a", "a1", &[8000, 8001])]).unwrap();
        let (g, t) = (GatewaySettings::default(), TrafficPolicy::default());
        assert_eq!(
            translate(&model, &HealthMap::default(), &Weights::default(), &g, &t),
            translate(&model, &HealthMap::default(), &Weights::default(), &g, &t)
        );
    }

    #[test]
    fn an_empty_model_still_has_the_listener_and_route() {
        let r = translate(
            &Model::default(),
            &HealthMap::default(),
            &Weights::default(),
            &GatewaySettings::default(),
            &TrafficPolicy::default(),
        );
        assert_eq!(r.listeners.len(), 1);
        assert_eq!(r.routes.len(), 1);
        assert!(r.clusters.is_empty());
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

    #[test]
    fn backpressure_never_ejects_and_retries_are_budgeted() {
        let p = TrafficPolicy::default();
        let od = outlier_detection(&p);
        assert_eq!(od.enforcing_consecutive_gateway_failure, u32_value(0));
        assert_eq!(od.enforcing_consecutive_5xx, u32_value(0));
        assert_eq!(
            od.enforcing_consecutive_local_origin_failure,
            u32_value(100)
        );
        assert!(od.max_ejection_percent.unwrap().value < 100);
        // With every listed proxy ejected, route to them rather than answer 503.
        let threshold = HEALTHY_PANIC_THRESHOLD_PERCENT;
        assert!(threshold > 0.0 && threshold <= 1.0, "{threshold}");
        let cb = &circuit_breakers(&p).thresholds[0];
        assert!(cb.retry_budget.is_some());
        assert_eq!(cb.max_requests, u32_value(10_000));
    }

    #[test]
    fn only_proxies_that_may_take_new_requests_are_published() {
        use crate::live::health::{Reason, Verdict};
        let model = Model::new(vec![service("a", "a1", &[8000, 8001, 8002, 8003, 8004])]).unwrap();
        let mut health = HealthMap::default();
        for (port, h) in [
            (8001, EndpointHealth::Withheld),
            (8002, EndpointHealth::Unhealthy),
            (8003, EndpointHealth::Draining),
            (8004, EndpointHealth::Healthy),
        ] {
            health.endpoints.insert(
                (
                    "default/a/a1".into(),
                    SocketAddr::from(([127, 0, 0, 1], port)),
                ),
                Verdict {
                    health: h,
                    reason: Reason::NotProbedYet,
                },
            );
        }
        let r = translate(
            &model,
            &health,
            &Weights::default(),
            &GatewaySettings::default(),
            &TrafficPolicy::default(),
        );
        let published: Vec<(String, i32)> = r.endpoints[0].endpoints[0]
            .lb_endpoints
            .iter()
            .map(|e| match &e.host_identifier {
                Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(ep)) => {
                    (ep.hostname.clone(), e.health_status)
                }
                _ => panic!("an endpoint"),
            })
            .collect();
        assert_eq!(
            published,
            [
                (
                    "127.0.0.1:8000".to_string(),
                    core::HealthStatus::Unknown as i32
                ),
                (
                    "127.0.0.1:8004".to_string(),
                    core::HealthStatus::Healthy as i32
                ),
            ]
        );
    }
}

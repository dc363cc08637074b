//! The EDS clusters: one per RayCluster and protocol (and per application with direct
//! ingress), all alike but for the upstream protocol (HTTP/1.1, or HTTP/2 for gRPC).
//!
//! Endpoints come over ADS (EDS). Only connection failures and timeouts eject a proxy
//! (outlier detection), never an HTTP answer; least-request balancing over every listed
//! host (`FULL_SCAN`); panic routing only when no listed host is left; a retry budget
//! bounds retries in flight.

use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3 as cluster;
use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::extensions::load_balancing_policies::least_request::v3 as least_request;
use envoy_types::pb::envoy::extensions::upstreams::http::v3 as upstream_http;
use envoy_types::pb::google::protobuf;
use envoy_types::util::pack_any;

use super::{ads, duration, u32_value};
use crate::config::GatewaySettings;
use crate::model::Protocol;
use crate::policy::traffic::TrafficPolicy;

/// Below this share of healthy hosts (0 of any number up to 100), a cluster routes to
/// every host it lists: better one more try on an ejected proxy than a certain 503.
pub const HEALTHY_PANIC_THRESHOLD_PERCENT: f64 = 1.0;

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

pub(super) fn eds_cluster(
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
        // Model calls are long and uneven: each request goes to the proxy with the
        // fewest requests in flight, over every listed one (ties broken at random).
        load_balancing_policy: Some(least_request_full_scan()),
        // (Ignored beside `load_balancing_policy`; what an Envoy without the typed
        // policy would take: least request of two random choices.)
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

/// Least request over every host (`FULL_SCAN`), not the default two random choices: a
/// proxy that hangs keeps every request sent to it in flight, so a scan of every host
/// stops picking it within a few requests, with or without ray-xds (which may be down
/// when it matters); with two choices it kept a quarter of them (two proxies) until
/// something ejected it. Proxies are a handful per cluster, so the scan is cheap.
fn least_request_full_scan() -> cluster::LoadBalancingPolicy {
    let config = least_request::LeastRequest {
        selection_method: least_request::least_request::SelectionMethod::FullScan as i32,
        ..Default::default()
    };
    cluster::LoadBalancingPolicy {
        policies: vec![cluster::load_balancing_policy::Policy {
            typed_extension_config: Some(core::TypedExtensionConfig {
                name: "envoy.load_balancing_policies.least_request".into(),
                typed_config: Some(pack_any(config)),
            }),
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

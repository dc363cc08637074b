//! The gateway's one listener, [`LISTENER_NAME`]: an HTTP connection manager that
//! takes its routes over RDS ([`ROUTE_CONFIG_NAME`]).
//!
//! Global settings only: one listener serves every RayService, so nothing of a
//! RayService's own policy is in it.

use envoy_types::pb::envoy::config::listener::v3 as listener;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use envoy_types::pb::google::protobuf;
use envoy_types::util::pack_any;

use super::{ads, duration, socket_address, LISTENER_NAME, ROUTE_CONFIG_NAME};
use crate::config::GatewaySettings;
use crate::policy::traffic::TrafficPolicy;

/// The gateway's listener. Global settings only (a listener serves every RayService):
/// WebSocket upgrades pass through to Ray Serve (FastAPI ingress deployments serve them);
/// a request or stream may be silent for `stream_idle_timeout`; the client's address
/// reaches Ray in `X-Forwarded-For`, Envoy being the edge unless `xff_num_trusted_hops`
/// says how many proxies in front of it to trust.
pub(super) fn http_listener(
    gateway: &GatewaySettings,
    traffic: &TrafficPolicy,
) -> listener::Listener {
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

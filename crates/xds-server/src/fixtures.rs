//! Test fixtures: snapshots of plain Envoy resources shaped like the ones ray-xds serves
//! (an EDS cluster and its assignment per cluster, one route configuration with a virtual
//! host per service, one listener taking it over RDS), built without the domain so the
//! xDS layer's tests stand on their own.

// Test fixtures: a snapshot is built top to bottom in one function, as Envoy reads it.
#![allow(clippy::too_many_lines)]

use envoy_types::pb::envoy::config::cluster::v3 as cluster;
use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::config::endpoint::v3 as endpoint;
use envoy_types::pb::envoy::config::listener::v3 as listener;
use envoy_types::pb::envoy::config::route::v3 as route;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use envoy_types::pb::google::protobuf;
use envoy_types::util::pack_any;

use super::snapshot::{Resources, Snapshot};

pub(crate) const ROUTE_CONFIG: &str = "ray-serve-http";

/// A service: hosts routed to its active cluster.
#[derive(Clone, Debug)]
pub(crate) struct Service {
    pub name: String,
    pub hosts: Vec<String>,
    pub active: String,
    pub clusters: Vec<Cluster>,
}

#[derive(Clone, Debug)]
pub(crate) struct Cluster {
    pub name: String,
    pub ports: Vec<u16>,
    /// Set to change the cluster's body (its settings) without touching its endpoints.
    pub connect_timeout_ms: u64,
}

/// Service `name` in namespace `default`, active cluster `cluster` with a proxy on each
/// of `ports` on 127.0.0.1.
pub(crate) fn service(name: &str, cluster: &str, ports: &[u16]) -> Service {
    Service {
        name: name.into(),
        hosts: vec![format!("{name}.example")],
        active: cluster.into(),
        clusters: vec![Cluster {
            name: cluster.into(),
            ports: ports.to_vec(),
            connect_timeout_ms: 0,
        }],
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

pub(crate) fn resources_of(services: &[Service]) -> Resources {
    let mut out = Resources::default();
    let mut virtual_hosts = Vec::new();
    for s in services {
        for c in &s.clusters {
            let name = format!("default/{}/{}", s.name, c.name);
            out.clusters.push(cluster::Cluster {
                name: name.clone(),
                cluster_discovery_type: Some(cluster::cluster::ClusterDiscoveryType::Type(
                    cluster::cluster::DiscoveryType::Eds as i32,
                )),
                eds_cluster_config: Some(cluster::cluster::EdsClusterConfig {
                    eds_config: Some(ads()),
                    service_name: String::new(),
                }),
                connect_timeout: (c.connect_timeout_ms > 0).then(|| protobuf::Duration {
                    seconds: 0,
                    nanos: (c.connect_timeout_ms * 1_000_000) as i32,
                }),
                ..Default::default()
            });
            let lb_endpoints = c
                .ports
                .iter()
                .map(|port| endpoint::LbEndpoint {
                    host_identifier: Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(
                        endpoint::Endpoint {
                            address: Some(core::Address {
                                address: Some(core::address::Address::SocketAddress(
                                    core::SocketAddress {
                                        address: "127.0.0.1".into(),
                                        port_specifier: Some(
                                            core::socket_address::PortSpecifier::PortValue(
                                                *port as u32,
                                            ),
                                        ),
                                        ..Default::default()
                                    },
                                )),
                            }),
                            hostname: format!("127.0.0.1:{port}"),
                            ..Default::default()
                        },
                    )),
                    health_status: core::HealthStatus::Healthy as i32,
                    metadata: Some(core::Metadata {
                        filter_metadata: [(
                            "fixture".to_string(),
                            protobuf::Struct {
                                fields: [(
                                    "node_type".to_string(),
                                    protobuf::Value {
                                        kind: Some(protobuf::value::Kind::StringValue(
                                            "worker".into(),
                                        )),
                                    },
                                )]
                                .into(),
                            },
                        )]
                        .into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .collect();
            out.endpoints.push(endpoint::ClusterLoadAssignment {
                cluster_name: name,
                endpoints: vec![endpoint::LocalityLbEndpoints {
                    lb_endpoints,
                    ..Default::default()
                }],
                ..Default::default()
            });
        }
        virtual_hosts.push(route::VirtualHost {
            name: format!("default/{}", s.name),
            domains: s.hosts.clone(),
            routes: vec![route::Route {
                r#match: Some(route::RouteMatch {
                    path_specifier: Some(route::route_match::PathSpecifier::Prefix("/".into())),
                    ..Default::default()
                }),
                action: Some(route::route::Action::Route(route::RouteAction {
                    cluster_specifier: Some(
                        route::route_action::ClusterSpecifier::WeightedClusters(
                            route::WeightedCluster {
                                clusters: vec![route::weighted_cluster::ClusterWeight {
                                    name: format!("default/{}/{}", s.name, s.active),
                                    weight: Some(protobuf::UInt32Value { value: 100 }),
                                    ..Default::default()
                                }],
                                ..Default::default()
                            },
                        ),
                    ),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        });
    }
    out.routes.push(route::RouteConfiguration {
        name: ROUTE_CONFIG.into(),
        virtual_hosts,
        ..Default::default()
    });
    let manager = hcm::HttpConnectionManager {
        stat_prefix: "fixture".into(),
        route_specifier: Some(hcm::http_connection_manager::RouteSpecifier::Rds(
            hcm::Rds {
                config_source: Some(ads()),
                route_config_name: ROUTE_CONFIG.into(),
            },
        )),
        ..Default::default()
    };
    out.listeners.push(listener::Listener {
        name: "ray-serve-http".into(),
        filter_chains: vec![listener::FilterChain {
            filters: vec![listener::Filter {
                name: "envoy.filters.network.http_connection_manager".into(),
                config_type: Some(listener::filter::ConfigType::TypedConfig(pack_any(manager))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    });
    out
}

pub(crate) fn snapshot_of(services: Vec<Service>) -> Snapshot {
    Snapshot::build(&resources_of(&services), None).expect("fixtures are consistent")
}

/// Polls `stream` until it has nothing more to send, answering each response with
/// `answer`, and holds that no poll frames more than the room a stream reserves for it
/// (`Snapshot::response_room`). How many polls it took.
pub(crate) fn assert_every_poll_fits_the_room<P: super::AdsProtocol>(
    stream: &mut P,
    snap: &Snapshot,
    answer: impl Fn(super::snapshot::ResourceType, &P::Response) -> P::Request,
) -> usize {
    let mut polls = 0;
    loop {
        let out = stream.poll(snap);
        if out.is_empty() {
            return polls;
        }
        polls += 1;
        let framed: usize = out
            .iter()
            .map(|(_, _, r)| 5 + prost::Message::encoded_len(r))
            .sum();
        assert!(
            framed <= snap.response_room(),
            "{framed} bytes framed in one poll, room {}",
            snap.response_room()
        );
        for (ty, _, r) in &out {
            stream.on_request(answer(*ty, r)).unwrap();
        }
        assert!(polls < 100, "still answering after {polls} polls");
    }
}

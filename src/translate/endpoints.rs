//! The cluster load assignments (EDS): per Envoy cluster, each endpoint that may take
//! new requests.
//!
//! `live::health` decides: a healthy endpoint is listed healthy, one not probed yet
//! unknown; an unhealthy, draining or withheld one is not listed at all. Each endpoint
//! carries one fact under [`METADATA_NAMESPACE`] (a proxy's node type, a replica's
//! application).

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::config::endpoint::v3 as endpoint;
use envoy_types::pb::google::protobuf;

use super::{socket_address, METADATA_NAMESPACE};
use crate::live::health::{EndpointHealth, HealthMap, SharedVerdicts};

/// One endpoint as its assignment lists it: address, metadata fact, health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Listed<'a> {
    pub address: SocketAddr,
    pub fact: (&'static str, &'a str),
    pub health: core::HealthStatus,
}

/// The endpoints of Envoy cluster `name` that may take new requests, as `health`
/// decides, in the order given: what its assignment is made from, and all it is made
/// from.
pub(super) fn listed<'a>(
    name: &str,
    endpoints: impl Iterator<Item = (SocketAddr, (&'static str, &'a str))>,
    health: &HealthMap,
) -> Vec<Listed<'a>> {
    let verdicts = health.of_cluster(name);
    endpoints
        .filter_map(|(address, fact)| {
            // Only what may take new requests: an endpoint that left (unhealthy,
            // draining, withheld) is not listed at all. Envoy lets requests in flight on
            // a removed host finish, and its outlier detection then counts only these
            // endpoints, so below `max_ejection_percent: 100` it never ejects the last.
            let health = match verdicts.health(address) {
                EndpointHealth::Withheld | EndpointHealth::Unhealthy | EndpointHealth::Draining => {
                    return None
                }
                EndpointHealth::Unknown => core::HealthStatus::Unknown,
                EndpointHealth::Healthy => core::HealthStatus::Healthy,
            };
            Some(Listed {
                address,
                fact,
                health,
            })
        })
        .collect()
}

/// The assignment of Envoy cluster `name`: each of `listed`, with its one fact in its
/// metadata (a proxy's node type, a replica's application).
pub(super) fn load_assignment(
    name: &str,
    listed: &[Listed<'_>],
) -> endpoint::ClusterLoadAssignment {
    let lb_endpoints = listed
        .iter()
        .map(
            |&Listed {
                 address,
                 fact: (key, value),
                 health,
             }| endpoint::LbEndpoint {
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
            },
        )
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

/// What an assignment was made from, kept between builds: what it lists ([`Listed`],
/// owned), and the very verdicts it was last found to list (held, so that a pointer
/// equal to them is never a freed map's reused address).
#[derive(Debug)]
pub(super) struct KeptListing {
    listed: Vec<(SocketAddr, &'static str, Box<str>, core::HealthStatus)>,
    verdicts: Option<SharedVerdicts>,
}

impl KeptListing {
    pub(super) fn of(listed: &[Listed<'_>], verdicts: Option<&SharedVerdicts>) -> KeptListing {
        KeptListing {
            listed: listed
                .iter()
                .map(|l| (l.address, l.fact.0, Box::from(l.fact.1), l.health))
                .collect(),
            verdicts: verdicts.cloned(),
        }
    }

    /// True when these are the verdicts the listing was last found to list (both none,
    /// or the same shared map): with the same endpoints, the listing is the same.
    pub(super) fn made_from(&self, verdicts: Option<&SharedVerdicts>) -> bool {
        match (&self.verdicts, verdicts) {
            (None, None) => true,
            (Some(kept), Some(now)) => Arc::ptr_eq(kept, now),
            _ => false,
        }
    }

    /// Notes that the listing is also what `verdicts` list.
    pub(super) fn also_from(&mut self, verdicts: Option<&SharedVerdicts>) {
        self.verdicts = verdicts.cloned();
    }

    pub(super) fn is(&self, listed: &[Listed<'_>]) -> bool {
        self.listed.len() == listed.len()
            && self
                .listed
                .iter()
                .zip(listed)
                .all(|((address, key, value, health), l)| {
                    *address == l.address
                        && *key == l.fact.0
                        && **value == *l.fact.1
                        && *health == l.health
                })
    }
}

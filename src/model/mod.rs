//! The domain model: what ray-xds knows about RayServices, free of Kubernetes and
//! protobuf types.
//!
//! Sources (the file and Kubernetes) build a [`Model`]; the pipeline joins it with live
//! state and `translate` turns it into Envoy resources. A `Model` is always valid:
//! [`Model::new`] checks the invariants that Envoy would otherwise reject (unique
//! virtual-host domains, an active cluster that exists, IP endpoints), so a bad input is
//! refused at the source and the last good model keeps being served.
//!
//! The model's parts, each in its own file:
//! - `domain`: the types (RayService, RayCluster, Application, Proxy) and what they tell;
//! - `names`: the names a model holds, their checks, and the Envoy cluster names built
//!   from them;
//! - `validate`: [`Model::new`], which sorts its input and checks every invariant;
//! - `derived`: a valid model with its proxies or applications replaced, valid again;
//! - `hosts`: which hosts a namespace's RayServices may claim ([`HostPolicy`]);
//! - `address`: which addresses may be published as a proxy's or a replica's
//!   ([`AddressPolicy`]).

mod address;
mod derived;
mod domain;
mod hosts;
mod names;
mod validate;

pub use address::{
    canonical_ip, dashboard_network, refused_address, AddressPolicy, AddressRefusal, ProxyOrigin,
    ReplicaNodes, ReplicaPorts, METADATA_ADDRESSES,
};
pub use derived::contested_replicas;
pub use domain::{
    Application, HeadProxy, NodeType, Protocol, Proxy, RayCluster, RayService, ServicePolicy,
};
pub use hosts::{host_within, HostPolicy, MAX_HOST_PATTERNS};
pub use names::{
    check_application_name, check_host, check_route_prefix, encode_name_segment,
    MAX_APPLICATION_NAME_BYTES, MAX_ROUTE_PREFIX_BYTES,
};
pub use validate::ModelError;

use std::collections::BTreeSet;
use std::net::SocketAddr;

/// Every RayService ray-xds routes to, sorted by `(namespace, name)`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    services: Vec<RayService>,
}

impl Model {
    pub fn services(&self) -> &[RayService] {
        &self.services
    }

    /// True when some cluster discovers its proxies from its dashboard.
    #[cfg(test)]
    pub(crate) fn discovers(&self) -> bool {
        self.services
            .iter()
            .flat_map(|s| &s.clusters)
            .any(|c| c.discover)
    }

    /// Every proxy of every cluster.
    pub fn proxies(&self) -> impl Iterator<Item = &Proxy> {
        self.services
            .iter()
            .flat_map(|s| &s.clusters)
            .flat_map(|c| &c.proxies)
    }

    /// Every proxy's addresses, HTTP and gRPC: never an ingress replica's.
    pub(crate) fn proxy_addresses(&self) -> BTreeSet<SocketAddr> {
        self.proxies()
            .flat_map(|p| std::iter::once(p.address).chain(p.grpc))
            .collect()
    }

    /// Every endpoint the prober probes: each proxy's HTTP address, and its gRPC address
    /// when it has one; each ingress replica's HTTP and gRPC ports.
    pub(crate) fn endpoints(&self) -> impl Iterator<Item = (SocketAddr, Protocol)> + '_ {
        let proxies = self.proxies().flat_map(|p| {
            std::iter::once((p.address, Protocol::Http)).chain(p.grpc.map(|g| (g, Protocol::Grpc)))
        });
        proxies.chain(
            self.services
                .iter()
                .flat_map(|s| &s.clusters)
                .flat_map(RayCluster::replica_endpoints),
        )
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// An application at `prefix` with HTTP replicas on 127.0.0.1 at `ports`.
    pub fn app(name: &str, prefix: Option<&str>, ports: &[u16]) -> Application {
        Application {
            name: name.into(),
            route_prefix: prefix.map(str::to_string),
            http_replicas: ports
                .iter()
                .map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
                .collect(),
            grpc_replicas: Vec::new(),
        }
    }

    /// A RayService with one cluster of `proxies` ports on 127.0.0.1 (the first is head).
    pub fn service(name: &str, cluster: &str, ports: &[u16]) -> RayService {
        RayService {
            pending_traffic_cap: None,
            namespace: "default".into(),
            name: name.into(),
            hosts: vec![format!("{name}.example")],
            active_cluster: cluster.into(),
            pending_cluster: None,
            clusters: vec![RayCluster {
                name: cluster.into(),
                dashboard: None,
                grpc_port: None,
                discover: false,
                direct_ingress: false,
                applications: Vec::new(),
                proxies: ports
                    .iter()
                    .enumerate()
                    .map(|(i, port)| Proxy {
                        address: SocketAddr::from(([127, 0, 0, 1], *port)),
                        node_type: if i == 0 {
                            NodeType::Head
                        } else {
                            NodeType::Worker
                        },
                        grpc: None,
                        draining: false,
                        host_network: false,
                    })
                    .collect(),
            }],
            policy: ServicePolicy::default(),
        }
    }
}

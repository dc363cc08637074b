//! The domain types: a RayService, its RayClusters, their Ray Serve proxies and
//! applications, and what each tells of itself (its key, its endpoints, its replicas).
//!
//! Plain data with public fields: a value built by hand may break the model's invariants
//! until [`Model::new`](super::Model::new) checks it; inside a [`Model`](super::Model),
//! clusters, proxies, applications and replicas are sorted and unique.

use std::fmt;
use std::net::SocketAddr;

/// One RayService: a set of hosts served by its active RayCluster, with an optional
/// pending cluster that an upgrade is bringing up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RayService {
    pub namespace: String,
    pub name: String,
    /// Virtual-host domains (`*` matches any host).
    pub hosts: Vec<String>,
    pub active_cluster: String,
    pub pending_cluster: Option<String>,
    /// The most percent of the traffic the source lets the pending cluster take: KubeRay's
    /// incremental upgrade (`pendingServiceStatus.trafficRoutedPercent`), or
    /// `pending_traffic_percent` in `services.yaml`. `None`: no cap of the source's.
    pub pending_traffic_cap: Option<u32>,
    /// Sorted by name.
    pub clusters: Vec<RayCluster>,
    /// Per-RayService settings that override the global ones.
    pub policy: ServicePolicy,
}

/// Which traffic a cluster's head-node proxy gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HeadProxy {
    /// Never: the head runs the GCS and the dashboard; keep load off it.
    Exclude,
    /// Like any worker proxy.
    Include,
    /// Only while no worker proxy of its cluster is healthy.
    #[default]
    Fallback,
}

/// Per-RayService policy: which traffic its head proxy gets, and its overrides of the
/// global probe, traffic and switchover policies (checked by the source that read them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServicePolicy {
    pub head_proxy: HeadProxy,
    pub overrides: crate::policy::ServiceOverrides,
}

/// One RayCluster and the Ray Serve proxies it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RayCluster {
    pub name: String,
    /// Base URL of the Ray dashboard (`http://host:8265`), when known.
    pub dashboard: Option<String>,
    /// The port of Ray Serve's gRPC proxy on every node (`grpc_options.port`), when the
    /// cluster serves gRPC: discovered proxies get `<their IP>:<this port>` as [`Proxy::grpc`]
    /// (a source that lists proxies gives each its own).
    pub grpc_port: Option<u16>,
    /// Sorted by address.
    pub proxies: Vec<Proxy>,
    /// The proxies are discovered from the dashboard rather than listed by the source:
    /// the source gives none, and `live::discovery` fills `proxies` from the dashboard's
    /// last answer. Such a cluster always has a `dashboard`.
    pub discover: bool,
    /// Ray's direct ingress is on in this cluster (its dashboard lists a target group per
    /// application): an application with ingress replicas is routed to them, one without
    /// to the proxies. Set by `live::discovery`.
    pub direct_ingress: bool,
    /// The cluster's Ray Serve applications, when known (`live::discovery`, from its
    /// dashboard). Sorted by name; names and route prefixes unique.
    pub applications: Vec<Application>,
}

/// A Ray Serve application of a RayCluster, and how its requests reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Application {
    pub name: String,
    /// Its HTTP route prefix (`/`, `/work`, `/api/`; see
    /// [`check_route_prefix`](super::check_route_prefix)); `None`: it has no HTTP route.
    pub route_prefix: Option<String>,
    /// Its ingress replicas' HTTP ports, with direct ingress (sorted): requests for it go
    /// there while one may take them, else to the proxies.
    pub http_replicas: Vec<SocketAddr>,
    /// Its ingress replicas' gRPC ports, with direct ingress (sorted).
    pub grpc_replicas: Vec<SocketAddr>,
}

impl Application {
    pub(crate) fn replicas(&self, protocol: Protocol) -> &[SocketAddr] {
        match protocol {
            Protocol::Http => &self.http_replicas,
            Protocol::Grpc => &self.grpc_replicas,
        }
    }
}

/// A Ray Serve proxy: one per Ray node that runs one. Its HTTP endpoint is its identity;
/// the same proxy actor also serves gRPC on `grpc` when the application has gRPC servicers.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Proxy {
    /// The HTTP proxy (`ip:8000` in Ray's default).
    pub address: SocketAddr,
    /// The gRPC proxy of the same node (`ip:9000` in Ray's default), when it serves gRPC.
    pub grpc: Option<SocketAddr>,
    pub node_type: NodeType,
    /// The source says this proxy is going away (its pod is terminating): it gets no new
    /// requests, whatever its probe says. Ray's proxy does not drain on SIGTERM, so Envoy
    /// must stop using it before the pod dies.
    pub draining: bool,
    /// The source's pod runs in its node's network namespace (`spec.hostNetwork`): the
    /// address is the node's, not a pod's own, so the address policy does not trust it
    /// as it trusts other addresses the source lists
    /// ([`ProxyOrigin::HostNetwork`](super::ProxyOrigin::HostNetwork)).
    pub host_network: bool,
}

/// Which of a proxy's endpoints: each is probed, published and routed on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// `GET /-/healthz`; HTTP/1.1 upstream.
    Http,
    /// `ray.serve.RayServeAPIService/Healthz`; HTTP/2 upstream, for `application/grpc`.
    Grpc,
}

impl Protocol {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Protocol::Http => "http",
            Protocol::Grpc => "grpc",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeType {
    Head,
    Worker,
}

impl NodeType {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            NodeType::Head => "head",
            NodeType::Worker => "worker",
        }
    }
}

impl RayService {
    /// `<namespace>/<name>`: the identity used in logs, virtual-host and cluster names.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub fn cluster(&self, name: &str) -> Option<&RayCluster> {
        self.clusters.iter().find(|c| c.name == name)
    }
}

impl RayCluster {
    /// The cluster serves gRPC: it declares a gRPC port (for the proxies it discovers) or
    /// some proxy has a gRPC address.
    pub(crate) fn serves_grpc(&self) -> bool {
        self.grpc_port.is_some() || self.proxies.iter().any(|p| p.grpc.is_some())
    }

    /// The cluster's endpoints of `protocol`: (address, proxy).
    pub(crate) fn endpoints(
        &self,
        protocol: Protocol,
    ) -> impl Iterator<Item = (SocketAddr, &Proxy)> {
        self.proxies.iter().filter_map(move |p| match protocol {
            Protocol::Http => Some((p.address, p)),
            Protocol::Grpc => p.grpc.map(|g| (g, p)),
        })
    }

    pub(crate) fn application(&self, name: &str) -> Option<&Application> {
        self.applications.iter().find(|a| a.name == name)
    }

    /// Every ingress replica endpoint of the cluster: (address, protocol).
    pub(crate) fn replica_endpoints(&self) -> impl Iterator<Item = (SocketAddr, Protocol)> + '_ {
        self.applications.iter().flat_map(|a| {
            let http = a.http_replicas.iter().map(|r| (*r, Protocol::Http));
            http.chain(a.grpc_replicas.iter().map(|r| (*r, Protocol::Grpc)))
        })
    }
}

impl fmt::Display for NodeType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

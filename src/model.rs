//! The domain model: what ray-xds knows about RayServices, free of Kubernetes and
//! protobuf types.
//!
//! Sources (the file and Kubernetes) build a [`Model`]; the pipeline joins it with live
//! state and `translate` turns it into Envoy resources. A `Model` is always valid:
//! [`Model::new`] checks the invariants that Envoy would otherwise reject (unique
//! virtual-host domains, an active cluster that exists, IP endpoints), so a bad input is
//! refused at the source and the last good model keeps being served.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;

/// Every RayService ray-xds routes to, sorted by `(namespace, name)`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    services: Vec<RayService>,
}

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
    /// Its HTTP route prefix (`/`, `/work`, `/api/`; see [`check_route_prefix`]); `None`:
    /// it has no HTTP route.
    pub route_prefix: Option<String>,
    /// Its ingress replicas' HTTP ports, with direct ingress (sorted): requests for it go
    /// there while one may take them, else to the proxies.
    pub http_replicas: Vec<SocketAddr>,
    /// Its ingress replicas' gRPC ports, with direct ingress (sorted).
    pub grpc_replicas: Vec<SocketAddr>,
}

impl Application {
    pub fn replicas(&self, protocol: Protocol) -> &[SocketAddr] {
        match protocol {
            Protocol::Http => &self.http_replicas,
            Protocol::Grpc => &self.grpc_replicas,
        }
    }
}

/// The longest application name and route prefix a model holds: shorter than what a
/// dashboard answer's strings are cut to (`live::dashboard::MAX_STRING_BYTES`, 1,024 bytes,
/// at a character boundary), so a cut name or prefix is refused, never routed as another.
pub const MAX_APPLICATION_NAME_BYTES: usize = 256;
pub const MAX_ROUTE_PREFIX_BYTES: usize = 1000;

/// Whether `prefix` can be an application's HTTP route: Ray's own rule (it starts with
/// `/`), and nothing Envoy's path matchers refuse or a path never holds (`?`, `#`,
/// whitespace, control characters).
pub fn check_route_prefix(prefix: &str) -> Result<(), String> {
    if !prefix.starts_with('/') {
        return Err(format!("route prefix {prefix:?} does not start with '/'"));
    }
    if prefix.len() > MAX_ROUTE_PREFIX_BYTES {
        return Err(format!(
            "route prefix of {} bytes: at most {MAX_ROUTE_PREFIX_BYTES}",
            prefix.len()
        ));
    }
    if let Some(c) = prefix
        .chars()
        .find(|c| matches!(c, '?' | '#') || c.is_whitespace() || c.is_control())
    {
        return Err(format!("route prefix {prefix:?} holds {c:?}"));
    }
    Ok(())
}

/// Whether `name` can be an application's: not empty, at most
/// [`MAX_APPLICATION_NAME_BYTES`], no control characters (it goes into Envoy cluster
/// names, encoded by [`encode_name_segment`], and into a header match).
pub fn check_application_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("an empty application name".into());
    }
    if name.len() > MAX_APPLICATION_NAME_BYTES {
        return Err(format!(
            "application name of {} bytes: at most {MAX_APPLICATION_NAME_BYTES}",
            name.len()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(format!(
            "application name {name:?} holds a control character"
        ));
    }
    Ok(())
}

/// `name` as one segment of an Envoy cluster name: letters, digits, `-`, `_` and `.`
/// as they are, every other byte `%XX`, so no two names give the same segment and none
/// holds `/` (stand-in patterns match a segment with `*`).
pub fn encode_name_segment(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
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
    /// as it trusts other addresses the source lists ([`ProxyOrigin::HostNetwork`]).
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
    pub fn as_str(self) -> &'static str {
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
    pub fn as_str(self) -> &'static str {
        match self {
            NodeType::Head => "head",
            NodeType::Worker => "worker",
        }
    }
}

/// Why a set of RayServices cannot become a [`Model`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("rayservice {service}: {reason}")]
    InvalidService { service: String, reason: String },
    #[error("rayservice {service} and {other} both claim host {host:?}; each host must route to one RayService")]
    DuplicateHost {
        service: String,
        other: String,
        host: String,
    },
    #[error("rayservice {service} is defined twice")]
    DuplicateService { service: String },
}

impl RayService {
    /// `<namespace>/<name>`: the identity used in logs, virtual-host and cluster names.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub fn cluster(&self, name: &str) -> Option<&RayCluster> {
        self.clusters.iter().find(|c| c.name == name)
    }

    /// The Envoy cluster name of one of this service's RayClusters.
    pub fn envoy_cluster_name(&self, cluster: &str) -> String {
        format!("{}/{}/{}", self.namespace, self.name, cluster)
    }

    /// The Envoy cluster of a RayCluster's gRPC proxies: `<namespace>/<name>/<cluster>/grpc`
    /// (a cluster name is a DNS label, so this never names an HTTP cluster).
    pub fn envoy_grpc_cluster_name(&self, cluster: &str) -> String {
        format!("{}/{}/{}/grpc", self.namespace, self.name, cluster)
    }

    /// The Envoy cluster of one of a RayCluster's endpoints.
    pub fn envoy_cluster_name_for(&self, cluster: &str, protocol: Protocol) -> String {
        match protocol {
            Protocol::Http => self.envoy_cluster_name(cluster),
            Protocol::Grpc => self.envoy_grpc_cluster_name(cluster),
        }
    }

    /// The Envoy cluster of an application's ingress replicas in a RayCluster:
    /// `<namespace>/<name>/<cluster>/app/<application>` for HTTP, `.../grpc` after it for
    /// gRPC (the application's name encoded as one segment, [`encode_name_segment`]).
    pub fn envoy_app_cluster_name(&self, cluster: &str, app: &str, protocol: Protocol) -> String {
        let http = format!(
            "{}/{}/{}/app/{}",
            self.namespace,
            self.name,
            cluster,
            encode_name_segment(app)
        );
        match protocol {
            Protocol::Http => http,
            Protocol::Grpc => http + "/grpc",
        }
    }

    fn validate(&self) -> Result<(), String> {
        for (what, value) in [("namespace", &self.namespace), ("name", &self.name)] {
            if !is_dns_label(value) {
                return Err(format!(
                    "{what} {value:?} is not a DNS label (lowercase letters, digits and '-', at most 63)"
                ));
            }
        }
        if self.hosts.is_empty() {
            return Err("hosts is empty: it would be unreachable".into());
        }
        let mut seen = BTreeSet::new();
        for host in &self.hosts {
            validate_host(host)?;
            if !seen.insert(host.to_ascii_lowercase()) {
                return Err(format!("host {host:?} is listed twice"));
            }
        }
        let mut names = BTreeSet::new();
        for cluster in &self.clusters {
            if !is_dns_label(&cluster.name) {
                return Err(format!(
                    "cluster name {:?} is not a DNS label",
                    cluster.name
                ));
            }
            if !names.insert(cluster.name.as_str()) {
                return Err(format!("cluster {} is defined twice", cluster.name));
            }
            if cluster.discover && cluster.dashboard.is_none() {
                return Err(format!(
                    "cluster {} discovers its proxies from its dashboard but has no dashboard",
                    cluster.name
                ));
            }
            let mut addrs = BTreeSet::new();
            for proxy in &cluster.proxies {
                if !addrs.insert(proxy.address) {
                    return Err(format!(
                        "cluster {}: proxy {} is listed twice",
                        cluster.name, proxy.address
                    ));
                }
            }
            for grpc in cluster.proxies.iter().filter_map(|p| p.grpc) {
                if !addrs.insert(grpc) {
                    return Err(format!(
                        "cluster {}: gRPC address {grpc} is listed twice, or is also an HTTP proxy's",
                        cluster.name
                    ));
                }
            }
            let (mut apps, mut prefixes) = (BTreeSet::new(), BTreeSet::new());
            for app in &cluster.applications {
                check_application_name(&app.name)
                    .map_err(|why| format!("cluster {}: {why}", cluster.name))?;
                if !apps.insert(app.name.as_str()) {
                    return Err(format!(
                        "cluster {}: application {:?} is listed twice",
                        cluster.name, app.name
                    ));
                }
                if let Some(prefix) = &app.route_prefix {
                    check_route_prefix(prefix)
                        .map_err(|why| format!("cluster {}: {why}", cluster.name))?;
                    if !prefixes.insert(prefix.as_str()) {
                        return Err(format!(
                            "cluster {}: route prefix {prefix:?} is listed twice",
                            cluster.name
                        ));
                    }
                }
                for replica in app.http_replicas.iter().chain(&app.grpc_replicas) {
                    if !addrs.insert(*replica) {
                        return Err(format!(
                            "cluster {}: replica {replica} of {:?} is listed twice, or is also a proxy's",
                            cluster.name, app.name
                        ));
                    }
                }
            }
        }
        if self.cluster(&self.active_cluster).is_none() {
            return Err(format!(
                "active_cluster {:?} is not one of its clusters",
                self.active_cluster
            ));
        }
        if let Some(pending) = &self.pending_cluster {
            if pending == &self.active_cluster {
                return Err(format!(
                    "pending_cluster {pending:?} is also the active cluster"
                ));
            }
            if self.cluster(pending).is_none() {
                return Err(format!(
                    "pending_cluster {pending:?} is not one of its clusters"
                ));
            }
        }
        Ok(())
    }
}

impl RayCluster {
    /// The cluster serves gRPC: it declares a gRPC port (for the proxies it discovers) or
    /// some proxy has a gRPC address.
    pub fn serves_grpc(&self) -> bool {
        self.grpc_port.is_some() || self.proxies.iter().any(|p| p.grpc.is_some())
    }

    /// The cluster's endpoints of `protocol`: (address, proxy).
    pub fn endpoints(&self, protocol: Protocol) -> impl Iterator<Item = (SocketAddr, &Proxy)> {
        self.proxies.iter().filter_map(move |p| match protocol {
            Protocol::Http => Some((p.address, p)),
            Protocol::Grpc => p.grpc.map(|g| (g, p)),
        })
    }

    pub fn application(&self, name: &str) -> Option<&Application> {
        self.applications.iter().find(|a| a.name == name)
    }

    /// Every ingress replica endpoint of the cluster: (address, protocol).
    pub fn replica_endpoints(&self) -> impl Iterator<Item = (SocketAddr, Protocol)> + '_ {
        self.applications.iter().flat_map(|a| {
            let http = a.http_replicas.iter().map(|r| (*r, Protocol::Http));
            http.chain(a.grpc_replicas.iter().map(|r| (*r, Protocol::Grpc)))
        })
    }
}

impl Model {
    /// Builds a model, checking every invariant. Order of the input does not matter:
    /// the model is sorted so that equal inputs give equal models (and equal versions).
    pub fn new(mut services: Vec<RayService>) -> Result<Model, ModelError> {
        for service in &mut services {
            service.clusters.sort_by(|a, b| a.name.cmp(&b.name));
            for cluster in &mut service.clusters {
                cluster.proxies.sort();
                cluster.applications.sort_by(|a, b| a.name.cmp(&b.name));
                for app in &mut cluster.applications {
                    app.http_replicas.sort();
                    app.grpc_replicas.sort();
                }
            }
        }
        services.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let mut hosts: BTreeMap<String, String> = BTreeMap::new();
        for (i, service) in services.iter().enumerate() {
            if i > 0
                && services[i - 1].namespace == service.namespace
                && services[i - 1].name == service.name
            {
                return Err(ModelError::DuplicateService {
                    service: service.key(),
                });
            }
            service
                .validate()
                .map_err(|reason| ModelError::InvalidService {
                    service: service.key(),
                    reason,
                })?;
            for host in &service.hosts {
                if let Some(other) = hosts.insert(host.to_ascii_lowercase(), service.key()) {
                    return Err(ModelError::DuplicateHost {
                        service: service.key(),
                        other,
                        host: host.clone(),
                    });
                }
            }
        }
        // Probes are keyed by address: one address is one protocol everywhere.
        let mut protocols: BTreeMap<SocketAddr, Protocol> = BTreeMap::new();
        for service in &services {
            for cluster in &service.clusters {
                let endpoints = cluster
                    .endpoints(Protocol::Http)
                    .map(|(a, _)| (a, Protocol::Http))
                    .chain(
                        cluster
                            .endpoints(Protocol::Grpc)
                            .map(|(a, _)| (a, Protocol::Grpc)),
                    )
                    .chain(cluster.replica_endpoints());
                for (address, protocol) in endpoints {
                    if *protocols.entry(address).or_insert(protocol) != protocol {
                        return Err(ModelError::InvalidService {
                            service: service.key(),
                            reason: format!(
                                "cluster {}: {address} is both an HTTP and a gRPC endpoint",
                                cluster.name
                            ),
                        });
                    }
                }
            }
        }
        Ok(Model { services })
    }

    pub fn services(&self) -> &[RayService] {
        &self.services
    }

    /// True when some cluster discovers its proxies from its dashboard.
    pub fn discovers(&self) -> bool {
        self.services
            .iter()
            .flat_map(|s| &s.clusters)
            .any(|c| c.discover)
    }

    /// This model with the proxies of every discovering cluster replaced by
    /// `found(envoy cluster name, cluster)`, sorted and deduplicated by address (the
    /// first of equal addresses stays), so the model stays valid.
    pub fn with_discovered_proxies(
        &self,
        mut found: impl FnMut(&str, &RayCluster) -> Vec<Proxy>,
    ) -> Model {
        self.with_proxies(|name, cluster| {
            if cluster.discover {
                found(name, cluster)
            } else {
                cluster.proxies.clone()
            }
        })
    }

    /// This model with each cluster's proxies replaced by what `proxies` gives for it
    /// (its Envoy cluster name and the cluster); sorted and each address once, so the
    /// model stays valid.
    pub fn with_proxies(&self, mut proxies: impl FnMut(&str, &RayCluster) -> Vec<Proxy>) -> Model {
        let mut m = self.clone();
        for service in &mut m.services {
            for i in 0..service.clusters.len() {
                let name = service.envoy_cluster_name(&service.clusters[i].name);
                let mut list = proxies(&name, &service.clusters[i]);
                list.sort_by_key(|p| p.address);
                list.dedup_by_key(|p| p.address);
                service.clusters[i].proxies = list;
            }
        }
        // One address is one protocol everywhere, and each gRPC address one proxy's: a
        // gRPC address that breaks this is dropped (the proxy keeps serving HTTP).
        // `live::discovery` refuses such addresses first, with a reason.
        let http: BTreeSet<SocketAddr> = m.proxies().map(|p| p.address).collect();
        let mut grpc_seen = BTreeSet::new();
        for proxy in m
            .services
            .iter_mut()
            .flat_map(|s| &mut s.clusters)
            .flat_map(|c| &mut c.proxies)
        {
            if let Some(g) = proxy.grpc {
                if http.contains(&g) || !grpc_seen.insert(g) {
                    proxy.grpc = None;
                }
            }
        }
        m
    }

    /// Every proxy of every cluster.
    pub fn proxies(&self) -> impl Iterator<Item = &Proxy> {
        self.services
            .iter()
            .flat_map(|s| &s.clusters)
            .flat_map(|c| &c.proxies)
    }

    /// Every proxy's addresses, HTTP and gRPC: never an ingress replica's.
    pub fn proxy_addresses(&self) -> BTreeSet<SocketAddr> {
        self.proxies()
            .flat_map(|p| std::iter::once(p.address).chain(p.grpc))
            .collect()
    }

    /// Every endpoint the prober probes: each proxy's HTTP address, and its gRPC address
    /// when it has one; each ingress replica's HTTP and gRPC ports.
    pub fn endpoints(&self) -> impl Iterator<Item = (SocketAddr, Protocol)> + '_ {
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

    /// This model with each cluster's applications (and whether Ray's direct ingress is on
    /// there) replaced by what `applications` gives for it (its Envoy cluster name and the
    /// cluster), made valid: sorted by name, each name and route prefix once (the first
    /// stays), an invalid name or prefix dropped (the prefix alone), replicas sorted, never
    /// a proxy's address, and an address listed twice in the whole model (two applications,
    /// clusters or RayServices claim it) dropped everywhere: never first come, first
    /// served, so one RayService's dashboard cannot take another's replica
    /// (`live::discovery` refuses such addresses first, with a reason).
    pub fn with_applications(
        &self,
        mut applications: impl FnMut(&str, &RayCluster) -> (bool, Vec<Application>),
    ) -> Model {
        let mut m = self.clone();
        let proxies = m.proxy_addresses();
        let mut lists = Vec::new();
        for service in &m.services {
            for cluster in &service.clusters {
                let name = service.envoy_cluster_name(&cluster.name);
                let (direct, mut list) = applications(&name, cluster);
                list.sort_by(|a, b| a.name.cmp(&b.name));
                list.dedup_by(|a, b| a.name == b.name);
                list.retain(|a| check_application_name(&a.name).is_ok());
                for app in &mut list {
                    for replicas in [&mut app.http_replicas, &mut app.grpc_replicas] {
                        replicas.sort();
                        replicas.dedup();
                    }
                }
                lists.push((direct, list));
            }
        }
        let contested = contested_replicas(lists.iter().flat_map(|(_, l)| l));
        let mut lists = lists.into_iter();
        for service in &mut m.services {
            for cluster in &mut service.clusters {
                let (direct, mut list) = lists.next().unwrap_or_default();
                let mut prefixes = BTreeSet::new();
                for app in &mut list {
                    if let Some(p) = &app.route_prefix {
                        if check_route_prefix(p).is_err() || !prefixes.insert(p.clone()) {
                            app.route_prefix = None;
                        }
                    }
                    for replicas in [&mut app.http_replicas, &mut app.grpc_replicas] {
                        replicas.retain(|r| !proxies.contains(r) && !contested.contains(r));
                    }
                }
                cluster.direct_ingress = direct;
                cluster.applications = list;
            }
        }
        m
    }

    /// This model without the proxies at `addresses` (still valid: removing proxies
    /// breaks no invariant).
    pub fn without_proxies(&self, addresses: &BTreeSet<SocketAddr>) -> Model {
        let mut m = self.clone();
        for service in &mut m.services {
            for cluster in &mut service.clusters {
                cluster.proxies.retain(|p| !addresses.contains(&p.address));
            }
        }
        m
    }
}

/// The replica addresses listed by more than one (application, protocol) of `apps`, in
/// one cluster or across clusters and RayServices: none of them may have it.
pub fn contested_replicas<'a>(
    apps: impl IntoIterator<Item = &'a Application>,
) -> BTreeSet<SocketAddr> {
    let mut seen = BTreeSet::new();
    let mut twice = BTreeSet::new();
    for app in apps {
        for replicas in [&app.http_replicas, &app.grpc_replicas] {
            let own: BTreeSet<SocketAddr> = replicas.iter().copied().collect();
            for r in own {
                if !seen.insert(r) {
                    twice.insert(r);
                }
            }
        }
    }
    twice
}

impl fmt::Display for NodeType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Envoy accepts `*`, a prefix wildcard (`*.example.com`), a suffix wildcard
/// (`example.*`) or a plain host, optionally with a port.
/// Whether `host` is a virtual-host domain Envoy takes: a name, `*`, `*.suffix` or
/// `prefix.*` (ASCII letters, digits, `.`, `-`, `:`, `_`).
pub fn check_host(host: &str) -> Result<(), String> {
    validate_host(host)
}

fn validate_host(host: &str) -> Result<(), String> {
    if host == "*" {
        return Ok(());
    }
    let body = host
        .strip_prefix('*')
        .or_else(|| host.strip_suffix('*'))
        .unwrap_or(host);
    let ok = !body.is_empty()
        && !body.contains('*')
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "host {host:?} is not a valid virtual-host domain (a name, '*', '*.suffix' or 'prefix.*')"
        ))
    }
}

/// Which hosts each namespace's RayServices may claim, when namespaces are owners (the
/// Kubernetes source: `source.kubernetes.allowed_hosts`). A RayService may always claim
/// `<name>.<namespace>` and `<name>.<namespace>.svc`; beyond them, only hosts within a
/// pattern its namespace is given: a name, `*.suffix` (any name ending so, and wildcards
/// narrower than it), `prefix.*`, or `*` (everything). No namespace has `*` unless given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostPolicy {
    /// Namespace → host patterns, lowercase.
    pub namespaces: BTreeMap<String, Vec<String>>,
}

/// At most this many patterns in all (a policy is written by hand).
pub const MAX_HOST_PATTERNS: usize = 10_000;

impl HostPolicy {
    /// A policy from the config file's map, each pattern checked as a virtual-host domain.
    pub fn new(namespaces: BTreeMap<String, Vec<String>>) -> Result<HostPolicy, String> {
        let total: usize = namespaces.values().map(Vec::len).sum();
        if total > MAX_HOST_PATTERNS {
            return Err(format!(
                "{total} host patterns: at most {MAX_HOST_PATTERNS}"
            ));
        }
        let mut out = BTreeMap::new();
        for (namespace, patterns) in namespaces {
            if !is_dns_label(&namespace) {
                return Err(format!(
                    "namespace {namespace:?} is not a DNS label (lowercase letters, digits and '-', at most 63)"
                ));
            }
            let mut lower = Vec::with_capacity(patterns.len());
            for pattern in patterns {
                validate_host(&pattern).map_err(|e| format!("namespace {namespace}: {e}"))?;
                lower.push(pattern.to_ascii_lowercase());
            }
            out.insert(namespace, lower);
        }
        Ok(HostPolicy { namespaces: out })
    }

    /// Whether RayService `namespace/name` may claim `host`.
    pub fn allows(&self, namespace: &str, name: &str, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        let own = |ns: &str| {
            self.namespaces
                .get(ns)
                .is_some_and(|patterns| patterns.iter().any(|p| host_within(&host, p)))
        };
        if own(namespace) {
            return true;
        }
        if host == format!("{name}.{namespace}") || host == format!("{name}.{namespace}.svc") {
            // A default name is the RayService's unless the policy gives it to another
            // namespace (namespace `com`, RayService `example`: `example.com`). A `*`
            // grant is the catch-all, and gives no name away.
            return !self.namespaces.iter().any(|(ns, patterns)| {
                ns != namespace && patterns.iter().any(|p| p != "*" && host_within(&host, p))
            });
        }
        false
    }

    /// What `namespace` may claim, for messages.
    pub fn describe(&self, namespace: &str, name: &str) -> String {
        let mut allowed = vec![
            format!("{name}.{namespace}"),
            format!("{name}.{namespace}.svc"),
        ];
        allowed.extend(
            self.namespaces
                .get(namespace)
                .into_iter()
                .flatten()
                .cloned(),
        );
        allowed.join(", ")
    }
}

/// Whether every name `host` (a name or a virtual-host wildcard, lowercase) matches also
/// matches `pattern` (lowercase).
pub fn host_within(host: &str, pattern: &str) -> bool {
    if pattern == "*" || host == pattern {
        return true;
    }
    if let Some(suffix) = pattern.strip_prefix('*') {
        return host.len() > suffix.len() && host.ends_with(suffix);
    }
    if let Some(prefix) = pattern.strip_suffix('*') {
        return host.len() > prefix.len() && host.starts_with(prefix);
    }
    host == pattern
}

/// Cloud metadata services outside link-local ranges: AWS's IPv6 endpoint
/// (`fd00:ec2::254`) and Alibaba Cloud's (`100.100.100.200`).
pub const METADATA_ADDRESSES: [std::net::IpAddr; 2] = [
    std::net::IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(100, 100, 100, 200)),
];

/// Why `address` can never be a Ray Serve proxy's, if it cannot: an address that names
/// no host (unspecified, broadcast, multicast), a link-local one (the cloud metadata
/// service, 169.254.169.254, among them), a cloud metadata service elsewhere
/// ([`METADATA_ADDRESSES`]), or port 0. Such an endpoint is never published, whatever
/// source or dashboard lists it. (Loopback stays allowed: the demo and tests.)
pub fn refused_address(address: std::net::SocketAddr) -> Option<&'static str> {
    use std::net::IpAddr;
    let ip = address.ip();
    if address.port() == 0 {
        return Some("port 0");
    }
    if METADATA_ADDRESSES.contains(&ip) {
        return Some("a cloud metadata service's address");
    }
    if ip.is_unspecified() {
        return Some("an unspecified address");
    }
    if ip.is_multicast() {
        return Some("a multicast address");
    }
    match ip {
        IpAddr::V4(v4) if v4.is_broadcast() => Some("the broadcast address"),
        IpAddr::V4(v4) if v4.is_link_local() => Some("a link-local address"),
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("a link-local address"),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => refused_address(std::net::SocketAddr::new(IpAddr::V4(v4), address.port())),
            None => None,
        },
        _ => None,
    }
}

/// Which addresses ray-xds may publish as a proxy's, beyond [`refused_address`].
///
/// With `networks` set, every proxy (listed by the source or discovered) must fall in
/// one of them. Without, a proxy listed by the source is trusted (Kubernetes gives pod
/// IPs; services.yaml is the operator's own file), except a hostNetwork pod's, which is
/// refused (its address is its node's: whoever owns a RayService could publish a node's
/// address, any port on it); and a proxy *discovered* from a dashboard must be in the
/// dashboard's own network ([`dashboard_network`]): a dashboard can name any address,
/// and ray-xds would send traffic there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    pub networks: Vec<ipnet::IpNet>,
    /// The ports Ray's direct ingress gives ingress replicas ([`AddressPolicy::check_replica`]).
    pub replica_ports: ReplicaPorts,
}

/// The ports Ray's direct ingress allocates to ingress replicas, as its environment sets
/// them (`RAY_SERVE_DIRECT_INGRESS_{MIN,MAX}_{HTTP,GRPC}_PORT`): a replica a dashboard
/// lists outside them is not published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaPorts {
    pub http: std::ops::RangeInclusive<u16>,
    pub grpc: std::ops::RangeInclusive<u16>,
}

impl Default for ReplicaPorts {
    /// Ray 2.60's defaults: HTTP 30000–31000, gRPC 40000–41000, as Ray's `MIN` and `MAX`
    /// (Ray gives ports from `MIN` up to, not including, `MAX`).
    fn default() -> Self {
        ReplicaPorts {
            http: 30000..=31000,
            grpc: 40000..=41000,
        }
    }
}

impl ReplicaPorts {
    pub fn of(&self, protocol: Protocol) -> &std::ops::RangeInclusive<u16> {
        match protocol {
            Protocol::Http => &self.http,
            Protocol::Grpc => &self.grpc,
        }
    }
}

/// Where an ingress replica a dashboard lists may be.
#[derive(Debug, Clone, Copy)]
pub enum ReplicaNodes<'a> {
    /// On one of these node addresses: the source lists its cluster's nodes (Kubernetes:
    /// its pods' IPs; services.yaml: its proxies').
    Listed(&'a BTreeSet<std::net::IpAddr>),
    /// The cluster's proxies are discovered: only its dashboard speaks for it (its IP,
    /// when known).
    Dashboard(Option<std::net::IpAddr>),
}

/// Where a proxy's address came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyOrigin {
    /// The source lists it (services.yaml, or a pod's IP in Kubernetes).
    Source,
    /// The source lists it, but as a `hostNetwork` pod's IP: its node's address.
    HostNetwork,
    /// A dashboard listed it; the dashboard's IP address, when known.
    Dashboard(Option<std::net::IpAddr>),
}

/// Why a proxy's address is not published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddressRefusal {
    /// [`refused_address`]: never a proxy's.
    Never(&'static str),
    /// Outside every configured network.
    OutsideNetworks,
    /// Discovered, and outside the network of the dashboard that listed it.
    OutsideDashboardNetwork(ipnet::IpNet),
    /// Discovered from a dashboard whose address is unknown.
    DashboardAddressUnknown,
    /// A hostNetwork pod's address (its node's), with no `proxies.networks` to allow it.
    HostNetwork,
    /// A gRPC address that is an HTTP proxy's too (a dashboard reporting one port for
    /// both): an HTTP/1 proxy is never a gRPC one, and probes are keyed by address.
    ProtocolClash,
    /// An ingress replica's port outside the range Ray gives them ([`ReplicaPorts`]).
    OutsideReplicaPorts(Protocol, std::ops::RangeInclusive<u16>),
    /// An ingress replica on an address that is none of its cluster's nodes.
    NotAClusterNode,
    /// An ingress replica's address that another application, cluster or RayService
    /// lists too, or a proxy's: nobody gets it ([`Model::with_applications`]).
    ClaimedTwice,
}

impl AddressRefusal {
    /// Every [`label`](Self::label), for metrics that show each one, even at 0.
    pub const LABELS: [&'static str; 9] = [
        "never_a_proxy",
        "outside_proxy_networks",
        "outside_dashboard_network",
        "dashboard_address_unknown",
        "host_network",
        "protocol_clash",
        "outside_replica_ports",
        "not_a_cluster_node",
        "claimed_twice",
    ];

    /// A short, fixed label (for metrics).
    pub fn label(&self) -> &'static str {
        match self {
            AddressRefusal::Never(_) => "never_a_proxy",
            AddressRefusal::OutsideNetworks => "outside_proxy_networks",
            AddressRefusal::OutsideDashboardNetwork(_) => "outside_dashboard_network",
            AddressRefusal::DashboardAddressUnknown => "dashboard_address_unknown",
            AddressRefusal::HostNetwork => "host_network",
            AddressRefusal::ProtocolClash => "protocol_clash",
            AddressRefusal::OutsideReplicaPorts(..) => "outside_replica_ports",
            AddressRefusal::NotAClusterNode => "not_a_cluster_node",
            AddressRefusal::ClaimedTwice => "claimed_twice",
        }
    }
}

impl std::fmt::Display for AddressRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AddressRefusal::Never(why) => write!(f, "{why} is never a proxy's"),
            AddressRefusal::OutsideNetworks => {
                write!(f, "outside every network of proxies.networks")
            }
            AddressRefusal::OutsideDashboardNetwork(net) => write!(
                f,
                "discovered outside the network of its dashboard ({net}); set proxies.networks to allow it"
            ),
            AddressRefusal::DashboardAddressUnknown => {
                write!(f, "discovered from a dashboard whose address is unknown")
            }
            AddressRefusal::HostNetwork => write!(
                f,
                "a hostNetwork pod's address (its node's); set proxies.networks to allow it"
            ),
            AddressRefusal::ProtocolClash => {
                write!(f, "a gRPC address that is also an HTTP proxy's")
            }
            AddressRefusal::OutsideReplicaPorts(protocol, range) => write!(
                f,
                "an ingress replica's {} port outside {}-{} (Ray's direct ingress ports, from MIN up to, not including, MAX; set proxies.replica_ports to match Ray's)",
                protocol.as_str(),
                range.start(),
                range.end()
            ),
            AddressRefusal::NotAClusterNode => write!(
                f,
                "an ingress replica on none of its cluster's nodes; set proxies.networks to allow it"
            ),
            AddressRefusal::ClaimedTwice => write!(
                f,
                "an ingress replica's address that another application, cluster or RayService lists too, or a proxy's: nobody gets it"
            ),
        }
    }
}

impl AddressPolicy {
    /// Whether `address`, which came from `origin`, may be published.
    pub fn check(
        &self,
        address: std::net::SocketAddr,
        origin: ProxyOrigin,
    ) -> Result<(), AddressRefusal> {
        if let Some(why) = refused_address(address) {
            return Err(AddressRefusal::Never(why));
        }
        let ip = canonical_ip(address.ip());
        if !self.networks.is_empty() {
            return if self
                .networks
                .iter()
                .any(|n| n.contains(&ip) || n.contains(&address.ip()))
            {
                Ok(())
            } else {
                Err(AddressRefusal::OutsideNetworks)
            };
        }
        match origin {
            ProxyOrigin::Source => Ok(()),
            ProxyOrigin::HostNetwork => Err(AddressRefusal::HostNetwork),
            ProxyOrigin::Dashboard(None) => Err(AddressRefusal::DashboardAddressUnknown),
            ProxyOrigin::Dashboard(Some(dashboard)) => {
                let net = dashboard_network(dashboard);
                if net.contains(&ip) {
                    Ok(())
                } else {
                    Err(AddressRefusal::OutsideDashboardNetwork(net))
                }
            }
        }
    }

    /// Whether an ingress replica's `address` for `protocol`, which a dashboard listed,
    /// may be published: never an address [`refused_address`] refuses; its port in Ray's
    /// range for the protocol; on one of its cluster's listed nodes, or within
    /// `networks` when set, or (a cluster whose proxies are discovered, no `networks`) in
    /// its dashboard's network, as a discovered proxy.
    pub fn check_replica(
        &self,
        address: std::net::SocketAddr,
        protocol: Protocol,
        nodes: ReplicaNodes<'_>,
    ) -> Result<(), AddressRefusal> {
        if let Some(why) = refused_address(address) {
            return Err(AddressRefusal::Never(why));
        }
        let ports = self.replica_ports.of(protocol);
        // As Ray allocates them: `range(MIN, MAX)`, MAX itself never given.
        if !(*ports.start() <= address.port() && address.port() < *ports.end()) {
            return Err(AddressRefusal::OutsideReplicaPorts(protocol, ports.clone()));
        }
        let ip = canonical_ip(address.ip());
        match nodes {
            ReplicaNodes::Listed(nodes) if nodes.contains(&ip) => Ok(()),
            ReplicaNodes::Listed(_) if self.networks.is_empty() => {
                Err(AddressRefusal::NotAClusterNode)
            }
            ReplicaNodes::Listed(_) => self.check(address, ProxyOrigin::Source),
            ReplicaNodes::Dashboard(dashboard) => {
                self.check(address, ProxyOrigin::Dashboard(dashboard))
            }
        }
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it maps.
pub fn canonical_ip(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map(std::net::IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The network a dashboard's proxies are expected in when no networks are configured:
/// the /16 around its IPv4 address (a Kubernetes pod network, or a LAN of Ray nodes,
/// is rarely narrower), or the /64 around its IPv6 address.
pub fn dashboard_network(dashboard: std::net::IpAddr) -> ipnet::IpNet {
    let (ip, prefix) = match canonical_ip(dashboard) {
        ip @ std::net::IpAddr::V4(_) => (ip, 16),
        ip @ std::net::IpAddr::V6(_) => (ip, 64),
    };
    ipnet::IpNet::new(ip, prefix)
        .expect("16 and 64 are valid prefixes")
        .trunc()
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

#[cfg(test)]
mod tests {
    #[test]
    fn host_policy_defaults_to_the_rayservice_s_own_names() {
        let none = HostPolicy::default();
        assert!(none.allows("ml", "llm", "llm.ml"));
        assert!(none.allows("ml", "llm", "LLM.ml.svc"));
        for refused in [
            "llm.other",
            "other.ml",
            "*",
            "*.ml",
            "llm.ml.svc.cluster.local",
            "example.com",
        ] {
            assert!(!none.allows("ml", "llm", refused), "{refused}");
        }
    }

    #[test]
    fn host_patterns_cover_names_and_narrower_wildcards_only() {
        let p = HostPolicy::new(BTreeMap::from([
            (
                "team-a".to_string(),
                vec!["*.Team-A.example.com".to_string(), "api.example.com".into()],
            ),
            ("edge".to_string(), vec!["*".to_string()]),
            ("docs".to_string(), vec!["docs.*".to_string()]),
        ]))
        .unwrap();
        for ok in [
            "x.team-a.example.com",
            "a.b.team-a.example.com",
            "*.team-a.example.com",
            "*.x.team-a.example.com",
            "*-x.team-a.example.com",
            "API.example.com",
        ] {
            assert!(p.allows("team-a", "llm", ok), "{ok}");
        }
        for refused in [
            "team-a.example.com",
            "*.example.com",
            "*",
            "xteam-a.example.com",
            "api.example.com.evil",
            "example.com",
            "docs.example.com",
        ] {
            assert!(!p.allows("team-a", "llm", refused), "{refused}");
        }
        assert!(p.allows("edge", "gw", "*"));
        assert!(p.allows("edge", "gw", "anything.example"));
        assert!(p.allows("docs", "d", "docs.example.com"));
        assert!(p.allows("docs", "d", "docs.*"));
        assert!(!p.allows("docs", "d", "*"));
        assert!(!p.allows("docs", "d", "doc.*"));
        // Another namespace's patterns give nothing.
        assert!(!p.allows("team-b", "llm", "x.team-a.example.com"));
        assert_eq!(
            p.describe("team-a", "llm"),
            "llm.team-a, llm.team-a.svc, *.team-a.example.com, api.example.com"
        );
    }

    #[test]
    fn host_policies_are_checked() {
        let bad = |ns: &str, p: &str| {
            HostPolicy::new(BTreeMap::from([(ns.to_string(), vec![p.to_string()])])).unwrap_err()
        };
        assert!(bad("team-a", "*.*").contains("not a valid virtual-host domain"));
        assert!(bad("team-a", "a b").contains("not a valid"));
        assert!(bad("Team_A", "a.example").contains("not a DNS label"));
        let many: Vec<String> = (0..=MAX_HOST_PATTERNS)
            .map(|i| format!("h{i}.example"))
            .collect();
        assert!(HostPolicy::new(BTreeMap::from([("a".to_string(), many)]))
            .unwrap_err()
            .contains("at most"));
    }

    proptest::proptest! {
        /// A host within a pattern matches only names the pattern matches: checked on
        /// concrete names drawn from a small alphabet, so that overlaps are common.
        #[test]
        fn a_host_within_a_pattern_matches_nothing_the_pattern_does_not(
            host in "(\\*|[ab.]{1,4}\\*|\\*[ab.]{1,4}|[ab.]{1,5})",
            pattern in "(\\*|[ab.]{1,4}\\*|\\*[ab.]{1,4}|[ab.]{1,5})",
            names in proptest::collection::vec("[ab.]{1,7}", 1..40),
        ) {
            fn matches(name: &str, p: &str) -> bool {
                if p == "*" { return true; }
                if let Some(s) = p.strip_prefix('*') { return name.len() > s.len() && name.ends_with(s); }
                if let Some(s) = p.strip_suffix('*') { return name.len() > s.len() && name.starts_with(s); }
                name == p
            }
            if host_within(&host, &pattern) {
                for name in &names {
                    if matches(name, &host) {
                        proptest::prop_assert!(matches(name, &pattern), "{name} matches {host} but not {pattern}");
                    }
                }
            }
        }
    }

    use super::test_support::service;
    use super::*;

    #[test]
    fn sorts_so_equal_inputs_give_equal_models() {
        let a = service("a", "a1", &[8001, 8000]);
        let b = service("b", "b1", &[9000]);
        let m1 = Model::new(vec![a.clone(), b.clone()]).unwrap();
        let m2 = Model::new(vec![b, a]).unwrap();
        assert_eq!(m1, m2);
        assert_eq!(m1.services()[0].clusters[0].proxies[0].address.port(), 8000);
    }

    #[test]
    fn rejects_a_host_claimed_by_two_services() {
        let a = service("a", "a1", &[8000]);
        let mut b = service("b", "b1", &[9000]);
        b.hosts = vec!["A.example".into()];
        let err = Model::new(vec![a, b]).unwrap_err();
        assert!(matches!(err, ModelError::DuplicateHost { .. }), "{err}");
    }

    #[test]
    fn rejects_unknown_active_and_pending_clusters() {
        let mut a = service("a", "a1", &[8000]);
        a.active_cluster = "nope".into();
        assert!(Model::new(vec![a])
            .unwrap_err()
            .to_string()
            .contains("active_cluster"));
        let mut a = service("a", "a1", &[8000]);
        a.pending_cluster = Some("gone".into());
        assert!(Model::new(vec![a])
            .unwrap_err()
            .to_string()
            .contains("pending_cluster"));
        let mut a = service("a", "a1", &[8000]);
        a.pending_cluster = Some("a1".into());
        assert!(Model::new(vec![a])
            .unwrap_err()
            .to_string()
            .contains("also the active"));
    }

    #[test]
    fn rejects_bad_names_hosts_and_duplicates() {
        let mut a = service("a", "a1", &[8000]);
        a.name = "Bad_Name".into();
        assert!(Model::new(vec![a]).is_err());
        let mut a = service("a", "a1", &[8000]);
        a.hosts = vec!["*.*".into()];
        assert!(Model::new(vec![a]).is_err());
        let mut a = service("a", "a1", &[8000]);
        a.hosts = vec![];
        assert!(Model::new(vec![a]).is_err());
        let a = service("a", "a1", &[8000, 8000]);
        assert!(Model::new(vec![a])
            .unwrap_err()
            .to_string()
            .contains("twice"));
        let a = service("a", "a1", &[8000]);
        let err = Model::new(vec![a.clone(), a]).unwrap_err();
        assert_eq!(
            err,
            ModelError::DuplicateService {
                service: "default/a".into()
            }
        );
    }

    #[test]
    fn a_discovering_cluster_needs_a_dashboard() {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        let err = Model::new(vec![a.clone()]).unwrap_err().to_string();
        assert!(err.contains("has no dashboard"), "{err}");
        a.clusters[0].dashboard = Some("http://127.0.0.1:8265".into());
        let m = Model::new(vec![a]).unwrap();
        assert!(m.discovers());
        assert!(!Model::new(vec![service("b", "b1", &[8000])])
            .unwrap()
            .discovers());
    }

    #[test]
    fn one_address_is_one_protocol_everywhere() {
        let with_grpc = |mut s: RayService, port: u16| {
            s.clusters[0].proxies[0].grpc = Some(SocketAddr::from(([127, 0, 0, 1], port)));
            s
        };
        let m = Model::new(vec![with_grpc(service("a", "a1", &[8000, 8001]), 9000)]).unwrap();
        let endpoints: Vec<_> = m.endpoints().map(|(a, p)| (a.port(), p)).collect();
        assert_eq!(
            endpoints,
            [
                (8000, Protocol::Http),
                (9000, Protocol::Grpc),
                (8001, Protocol::Http)
            ]
        );
        // Its own cluster's HTTP address.
        let err = Model::new(vec![with_grpc(service("a", "a1", &[8000, 8001]), 8001)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("gRPC address 127.0.0.1:8001"), "{err}");
        // Another RayService's HTTP address: probes are keyed by address.
        let err = Model::new(vec![
            with_grpc(service("a", "a1", &[8000]), 9100),
            service("b", "b1", &[9100]),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("both an HTTP and a gRPC endpoint"), "{err}");
    }

    #[test]
    fn applications_are_made_valid_and_each_replica_address_is_one_endpoint() {
        use test_support::app;
        let m = Model::new(vec![
            service("a", "a1", &[8000]),
            service("b", "b1", &[9000]),
        ])
        .unwrap();
        let m = m.with_applications(|name, _| {
            if name != "default/a/a1" {
                return (true, vec![app("other", Some("/"), &[30009])]);
            }
            (
                true,
                vec![
                    app("work", Some("/work"), &[30002, 30001, 30001]),
                    app("work", Some("/dup-name"), &[]),
                    app("copy", Some("/work"), &[]),
                    app("", Some("/empty"), &[]),
                    app("bad", Some("no-slash"), &[]),
                    app("proxy", Some("/p"), &[8000, 9000]),
                    // Another RayService's replica too: neither gets it (never first
                    // come, first served).
                    app("clash", Some("/c"), &[30009]),
                ],
            )
        });
        let apps = &m.services()[0].clusters[0].applications;
        let summary: Vec<(&str, Option<&str>, Vec<u16>)> = apps
            .iter()
            .map(|a| {
                let ports = a.http_replicas.iter().map(|r| r.port()).collect();
                (a.name.as_str(), a.route_prefix.as_deref(), ports)
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("bad", None, vec![]),
                ("clash", Some("/c"), vec![]),
                ("copy", Some("/work"), vec![]),
                ("proxy", Some("/p"), vec![]),
                ("work", None, vec![30001, 30002]),
            ]
        );
        assert!(m.services()[1].clusters[0].applications[0]
            .http_replicas
            .is_empty());
        assert!(Model::new(m.services().to_vec()).is_ok());

        // Model::new refuses what with_applications would have mended.
        let mut s = service("a", "a1", &[8000]);
        s.clusters[0].applications = vec![app("x", Some("/x"), &[]), app("y", Some("/x"), &[])];
        let err = Model::new(vec![s.clone()]).unwrap_err().to_string();
        assert!(err.contains("route prefix \"/x\" is listed twice"), "{err}");
        s.clusters[0].applications = vec![app("x", Some("/x?y"), &[])];
        let err = Model::new(vec![s.clone()]).unwrap_err().to_string();
        assert!(err.contains("holds '?'"), "{err}");
        s.clusters[0].applications = vec![app("x", Some("/x"), &[8000])];
        let err = Model::new(vec![s]).unwrap_err().to_string();
        assert!(err.contains("also a proxy's"), "{err}");
    }

    #[test]
    fn application_names_are_one_cluster_name_segment_each() {
        assert_eq!(encode_name_segment("work_v2.1-a"), "work_v2.1-a");
        assert_eq!(encode_name_segment("a/b c%"), "a%2Fb%20c%25");
        assert_eq!(encode_name_segment("é"), "%C3%A9");
        assert_ne!(encode_name_segment("a%2F"), encode_name_segment("a/"));
    }

    #[test]
    fn a_replica_passes_the_address_policy_by_its_node_and_its_port() {
        let p = AddressPolicy::default();
        let nodes: BTreeSet<std::net::IpAddr> = ["10.0.0.1".parse().unwrap()].into();
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        let listed = ReplicaNodes::Listed(&nodes);
        assert_eq!(
            p.check_replica(at("10.0.0.1:30000"), Protocol::Http, listed),
            Ok(())
        );
        assert_eq!(
            p.check_replica(at("10.0.0.1:40999"), Protocol::Grpc, listed),
            Ok(())
        );
        // Ray gives ports from MIN up to, not including, MAX.
        for (address, protocol) in [
            ("10.0.0.1:41000", Protocol::Grpc),
            ("10.0.0.1:31000", Protocol::Http),
        ] {
            assert_eq!(
                p.check_replica(at(address), protocol, listed)
                    .map_err(|e| e.label()),
                Err("outside_replica_ports"),
                "{address}"
            );
        }
        assert_eq!(
            p.check_replica(at("10.0.0.1:40000"), Protocol::Http, listed)
                .map_err(|e| e.label()),
            Err("outside_replica_ports")
        );
        assert_eq!(
            p.check_replica(at("10.0.0.2:30000"), Protocol::Http, listed)
                .map_err(|e| e.label()),
            Err("not_a_cluster_node")
        );
        assert_eq!(
            p.check_replica(at("169.254.169.254:30000"), Protocol::Http, listed)
                .map_err(|e| e.label()),
            Err("never_a_proxy")
        );
        let dashboard = ReplicaNodes::Dashboard(Some("10.0.9.9".parse().unwrap()));
        assert_eq!(
            p.check_replica(at("10.0.0.2:30000"), Protocol::Http, dashboard),
            Ok(())
        );
        assert_eq!(
            p.check_replica(at("10.1.0.2:30000"), Protocol::Http, dashboard)
                .map_err(|e| e.label()),
            Err("outside_dashboard_network")
        );
        let networks = AddressPolicy {
            networks: vec!["10.0.0.0/24".parse().unwrap()],
            ..Default::default()
        };
        assert_eq!(
            networks.check_replica(at("10.0.0.2:30000"), Protocol::Http, listed),
            Ok(())
        );
        assert_eq!(
            networks
                .check_replica(at("10.0.1.2:30000"), Protocol::Http, listed)
                .map_err(|e| e.label()),
            Err("outside_proxy_networks")
        );
    }

    #[test]
    fn discovered_proxies_are_sorted_and_deduplicated() {
        let mut a = service("a", "a1", &[]);
        a.clusters[0].discover = true;
        a.clusters[0].dashboard = Some("http://127.0.0.1:8265".into());
        let listed = service("b", "b1", &[9000]);
        let m = Model::new(vec![a, listed]).unwrap();
        let proxy = |port: u16, node_type| Proxy {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            grpc: None,
            node_type,
            draining: false,
            host_network: false,
        };
        let mut asked = Vec::new();
        let found = m.with_discovered_proxies(|name, _| {
            asked.push(name.to_string());
            vec![
                proxy(8001, NodeType::Worker),
                proxy(8000, NodeType::Worker),
                proxy(8001, NodeType::Head),
            ]
        });
        assert_eq!(asked, ["default/a/a1"]);
        let ports: Vec<(u16, NodeType)> = found.services()[0].clusters[0]
            .proxies
            .iter()
            .map(|p| (p.address.port(), p.node_type))
            .collect();
        assert_eq!(ports, [(8000, NodeType::Worker), (8001, NodeType::Worker)]);
        // A listed cluster is left alone.
        assert_eq!(found.services()[1], m.services()[1]);
    }

    #[test]
    fn accepts_wildcards_envoy_accepts() {
        for host in ["*", "*.example.com", "api.*", "svc.ns:8080"] {
            let mut a = service("a", "a1", &[8000]);
            a.hosts = vec![host.into()];
            assert!(Model::new(vec![a]).is_ok(), "{host}");
        }
    }
}

#[cfg(test)]
mod address_policy_tests {
    use super::*;
    use std::net::SocketAddr;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn dashboard(ip: &str) -> ProxyOrigin {
        ProxyOrigin::Dashboard(Some(ip.parse().unwrap()))
    }

    #[test]
    fn never_a_proxy_whatever_the_origin_or_networks() {
        let open = AddressPolicy {
            networks: vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()],
            ..Default::default()
        };
        for bad in [
            "169.254.169.254:80",
            "0.0.0.0:8000",
            "255.255.255.255:8000",
            "224.0.0.1:8000",
            "[::]:8000",
            "[fe80::1]:8000",
            "[::ffff:169.254.169.254]:80",
            "[fd00:ec2::254]:80",
            "100.100.100.200:80",
            "10.0.0.1:0",
        ] {
            for policy in [&AddressPolicy::default(), &open] {
                for origin in [
                    ProxyOrigin::Source,
                    ProxyOrigin::HostNetwork,
                    dashboard("169.254.0.1"),
                ] {
                    assert!(
                        matches!(policy.check(a(bad), origin), Err(AddressRefusal::Never(_))),
                        "{bad} {origin:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn without_networks_discovered_proxies_stay_in_their_dashboards_network() {
        let p = AddressPolicy::default();
        assert_eq!(p.check(a("10.1.200.7:8000"), dashboard("10.1.0.5")), Ok(()));
        assert_eq!(
            p.check(a("10.2.0.7:8000"), dashboard("10.1.0.5")),
            Err(AddressRefusal::OutsideDashboardNetwork(
                "10.1.0.0/16".parse().unwrap()
            ))
        );
        // IPv4-mapped addresses count as the IPv4 address.
        assert_eq!(
            p.check(a("[::ffff:10.1.3.4]:8000"), dashboard("10.1.0.5")),
            Ok(())
        );
        assert_eq!(
            p.check(a("10.1.3.4:8000"), dashboard("::ffff:10.1.0.5")),
            Ok(())
        );
        // IPv6: the /64.
        assert_eq!(p.check(a("[fd00::1:2]:8000"), dashboard("fd00::9")), Ok(()));
        assert!(p
            .check(a("[fd00:0:0:1::2]:8000"), dashboard("fd00::9"))
            .is_err());
        assert_eq!(
            p.check(a("127.0.0.3:8000"), ProxyOrigin::Dashboard(None)),
            Err(AddressRefusal::DashboardAddressUnknown)
        );
        // What the source lists is trusted.
        assert_eq!(p.check(a("203.0.113.9:8000"), ProxyOrigin::Source), Ok(()));
    }

    #[test]
    fn every_refusal_label_is_listed() {
        for r in [
            AddressRefusal::Never("x"),
            AddressRefusal::OutsideNetworks,
            AddressRefusal::OutsideDashboardNetwork("10.0.0.0/16".parse().unwrap()),
            AddressRefusal::DashboardAddressUnknown,
            AddressRefusal::HostNetwork,
            AddressRefusal::ProtocolClash,
        ] {
            assert!(AddressRefusal::LABELS.contains(&r.label()), "{r:?}");
        }
    }

    /// A hostNetwork pod's podIP is its node's address; without
    /// `proxies.networks` it is refused (a RayService owner could otherwise publish a
    /// node's address, any port on it), and with them it is checked like any other.
    #[test]
    fn a_host_network_pods_address_needs_configured_networks() {
        let open = AddressPolicy::default();
        for addr in [
            "10.0.0.7:8000",
            "203.0.113.9:22",
            "127.0.0.1:8000",
            "[fd00::7]:8000",
        ] {
            assert_eq!(
                open.check(a(addr), ProxyOrigin::HostNetwork),
                Err(AddressRefusal::HostNetwork),
                "{addr}"
            );
            // The same address listed by the source as a pod's own is trusted.
            assert_eq!(open.check(a(addr), ProxyOrigin::Source), Ok(()), "{addr}");
        }
        let why = AddressRefusal::HostNetwork.to_string();
        assert!(
            why.contains("hostNetwork") && why.contains("proxies.networks"),
            "{why}"
        );
        let nodes = AddressPolicy {
            networks: vec!["10.0.0.0/24".parse().unwrap()],
            ..Default::default()
        };
        assert_eq!(
            nodes.check(a("10.0.0.7:8000"), ProxyOrigin::HostNetwork),
            Ok(())
        );
        assert_eq!(
            nodes.check(a("10.0.1.7:8000"), ProxyOrigin::HostNetwork),
            Err(AddressRefusal::OutsideNetworks)
        );
        assert_eq!(
            nodes.check(a("169.254.169.254:80"), ProxyOrigin::HostNetwork),
            Err(AddressRefusal::Never("a link-local address"))
        );
    }

    #[test]
    fn configured_networks_bind_every_proxy() {
        let p = AddressPolicy {
            networks: vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
            ..Default::default()
        };
        for origin in [
            ProxyOrigin::Source,
            ProxyOrigin::HostNetwork,
            dashboard("192.0.2.1"),
        ] {
            assert_eq!(p.check(a("10.200.0.1:8000"), origin), Ok(()));
            assert_eq!(p.check(a("[fd12::1]:8000"), origin), Ok(()));
            assert_eq!(p.check(a("[::ffff:10.0.0.1]:8000"), origin), Ok(()));
            assert_eq!(
                p.check(a("192.0.2.1:8000"), origin),
                Err(AddressRefusal::OutsideNetworks)
            );
        }
    }
}

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

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3 as core;
use envoy_types::pb::envoy::config::route::v3 as route;
use envoy_types::pb::google::protobuf;

use crate::config::GatewaySettings;
use crate::live::health::{HealthMap, SharedVerdicts};
use crate::model::{Model, Protocol};
use crate::policy::traffic::TrafficPolicy;
use crate::xds::snapshot::Resource;
use crate::xds::{Encoded, Memo, ResourceType, Resources};

mod applications;
mod clusters;
mod endpoints;
mod listener;
mod routes;

use self::clusters::eds_cluster;
pub use self::clusters::HEALTHY_PANIC_THRESHOLD_PERCENT;
use self::endpoints::{listed, load_assignment, KeptListing, Listed};
use self::listener::http_listener;
pub use self::routes::{grpc_retry_on, retry_on};
// (`weighted_route` also serves `applications`, as `super::weighted_route`.)
use self::routes::{virtual_host, weighted_route};

pub(crate) const LISTENER_NAME: &str = "ray-serve-http";
pub const ROUTE_CONFIG_NAME: &str = "ray-serve-http";
/// Filter-metadata namespace under which endpoints carry ray-xds facts (node type).
pub(crate) const METADATA_NAMESPACE: &str = "ray-xds";

/// Percent of traffic per RayCluster, by switch: a RayService's key (`<namespace>/<name>`),
/// or one of its applications' ([`app_switch_key`]) while that application moves on its
/// own readiness. A RayService missing here sends everything to its active cluster; an
/// application missing here goes as its RayService.
pub(crate) type Weights = BTreeMap<String, Vec<(String, u32)>>;

/// The [`Weights`] key of application `app` of the RayService keyed `service`:
/// `<namespace>/<name>#<application>` (a RayService key never holds `#`).
pub(crate) fn app_switch_key(service: &str, app: &str) -> String {
    format!("{service}#{app}")
}

/// The weights of one RayService: its own, and its applications' that move on their own.
pub(crate) struct ServiceWeights<'a> {
    pub service: &'a [(String, u32)],
    pub apps: BTreeMap<&'a str, &'a [(String, u32)]>,
}

impl ServiceWeights<'_> {
    /// `app`'s weights: its own while it moves on its own, else its RayService's.
    pub(crate) fn of(&self, app: &str) -> &[(String, u32)] {
        self.apps.get(app).copied().unwrap_or(self.service)
    }
}

/// The resources that serve `model`, each built whole: the reference an incremental
/// build ([`Incremental`]) must equal.
pub fn translate(
    model: &Model,
    health: &HealthMap,
    all_weights: &Weights,
    gateway: &GatewaySettings,
    traffic: &TrafficPolicy,
) -> Resources {
    let mut out = Resources::default();
    emit(model, health, all_weights, gateway, traffic, &mut out);
    out
}

/// Translation across builds, encoding only what changed: an assignment is made and
/// encoded again only when the endpoints it lists (address, fact, health) changed, and
/// every other resource only when its typed message changed. What it gives equals what
/// [`translate`] and encoding would give from the same inputs, resource for resource:
/// versions stay content hashes, and a restart (an empty memo) changes nothing.
///
/// An assignment whose Envoy cluster has the very verdicts (the same shared map) and the
/// very model (the same `Arc`) it was last made or found the same from lists the same
/// endpoints, so it is taken as kept without listing them: a health change costs the
/// clusters it touched, not a walk of every endpoint.
///
/// An Envoy cluster is made only from the model, the gateway settings and the traffic
/// policy: with the very model and equal settings and policy, each is taken as kept
/// without being made again.
#[derive(Default)]
pub struct Incremental {
    /// The model of the last build, held so that a pointer equal to it is that model.
    model: Option<Arc<Model>>,
    /// The gateway settings and traffic policy of the last build.
    settings: Option<(GatewaySettings, TrafficPolicy)>,
    clusters: Memo<envoy_types::pb::envoy::config::cluster::v3::Cluster>,
    assignments: Memo<KeptListing>,
    listeners: Memo<envoy_types::pb::envoy::config::listener::v3::Listener>,
    routes: Memo<route::RouteConfiguration>,
}

impl Incremental {
    pub fn translate(
        &mut self,
        model: &Arc<Model>,
        health: &HealthMap,
        all_weights: &Weights,
        gateway: &GatewaySettings,
        traffic: &TrafficPolicy,
    ) -> Encoded {
        let same_model = self.model.as_ref().is_some_and(|m| Arc::ptr_eq(m, model));
        self.model = Some(model.clone());
        let same_settings = self
            .settings
            .as_ref()
            .is_some_and(|(g, t)| g == gateway && t == traffic);
        if !same_settings {
            self.settings = Some((gateway.clone(), traffic.clone()));
        }
        let mut out = Kept {
            memo: self,
            same_model,
            same_cluster_inputs: same_model && same_settings,
            encoded: Encoded::default(),
        };
        emit(model, health, all_weights, gateway, traffic, &mut out);
        let encoded = out.encoded;
        self.clusters.sweep();
        self.assignments.sweep();
        self.listeners.sweep();
        self.routes.sweep();
        encoded
    }
}

/// Where translation puts what it makes: typed resources ([`translate`]), or encoded ones
/// kept across builds ([`Incremental`]).
trait Sink {
    /// Envoy cluster `name`, as `make()` makes it.
    fn cluster(
        &mut self,
        name: &str,
        make: impl FnOnce() -> envoy_types::pb::envoy::config::cluster::v3::Cluster,
    );
    /// The assignment of Envoy cluster `name`, whose endpoints are `listed()` as
    /// `verdicts` (its verdicts in the health map) judge them.
    fn assignment<'a>(
        &mut self,
        name: &str,
        verdicts: Option<&SharedVerdicts>,
        listed: impl FnOnce() -> Vec<Listed<'a>>,
    );
    fn listener(&mut self, listener: envoy_types::pb::envoy::config::listener::v3::Listener);
    fn route(&mut self, config: route::RouteConfiguration);
    fn stand_in(&mut self, pattern: String, cluster: String);
}

impl Sink for Resources {
    fn cluster(
        &mut self,
        _: &str,
        make: impl FnOnce() -> envoy_types::pb::envoy::config::cluster::v3::Cluster,
    ) {
        self.clusters.push(make());
    }
    fn assignment<'a>(
        &mut self,
        name: &str,
        _: Option<&SharedVerdicts>,
        listed: impl FnOnce() -> Vec<Listed<'a>>,
    ) {
        self.endpoints.push(load_assignment(name, &listed()));
    }
    fn listener(&mut self, listener: envoy_types::pb::envoy::config::listener::v3::Listener) {
        self.listeners.push(listener);
    }
    fn route(&mut self, config: route::RouteConfiguration) {
        self.routes.push(config);
    }
    fn stand_in(&mut self, pattern: String, cluster: String) {
        self.stand_ins.insert(pattern, cluster);
    }
}

/// The [`Sink`] of an [`Incremental`] build.
struct Kept<'m> {
    memo: &'m mut Incremental,
    /// The model is the very one of the last build.
    same_model: bool,
    /// And the gateway settings and traffic policy are equal to the last build's: every
    /// Envoy cluster is as kept.
    same_cluster_inputs: bool,
    encoded: Encoded,
}

impl Sink for Kept<'_> {
    fn cluster(
        &mut self,
        name: &str,
        make: impl FnOnce() -> envoy_types::pb::envoy::config::cluster::v3::Cluster,
    ) {
        // Made at most once, and only when an input may have changed.
        let make = Cell::new(Some(make));
        let made = RefCell::new(None);
        let same_inputs = self.same_cluster_inputs;
        let r = self.memo.clusters.get_or_make(
            name,
            |kept| {
                same_inputs || {
                    let mut made = made.borrow_mut();
                    *kept == *made.get_or_insert_with(|| make.take().expect("made once")())
                }
            },
            || {
                let cluster = made
                    .borrow_mut()
                    .take()
                    .unwrap_or_else(|| make.take().expect("made once")());
                let resource = Resource::of(&cluster);
                (cluster, resource)
            },
        );
        self.encoded.push(ResourceType::Cluster, r);
    }
    fn assignment<'a>(
        &mut self,
        name: &str,
        verdicts: Option<&SharedVerdicts>,
        listed: impl FnOnce() -> Vec<Listed<'a>>,
    ) {
        // Listed at most once, and only when the verdicts or the model are new.
        let listed = Cell::new(Some(listed));
        let listing = OnceCell::new();
        let listing = || listing.get_or_init(|| listed.take().expect("listed once")());
        let same_model = self.same_model;
        let r = self.memo.assignments.get_or_make(
            name,
            |kept| {
                if same_model && kept.made_from(verdicts) {
                    return true;
                }
                let same = kept.is(listing());
                if same {
                    kept.also_from(verdicts);
                }
                same
            },
            || {
                let assignment = load_assignment(name, listing());
                (
                    KeptListing::of(listing(), verdicts),
                    Resource::of(&assignment),
                )
            },
        );
        self.encoded.push(ResourceType::Endpoints, r);
    }
    fn listener(&mut self, listener: envoy_types::pb::envoy::config::listener::v3::Listener) {
        let r = self.memo.listeners.message(listener);
        self.encoded.push(ResourceType::Listener, r);
    }
    fn route(&mut self, config: route::RouteConfiguration) {
        let r = self.memo.routes.message(config);
        self.encoded.push(ResourceType::Route, r);
    }
    fn stand_in(&mut self, pattern: String, cluster: String) {
        self.encoded.stand_ins.insert(pattern, cluster);
    }
}

/// Translation itself, into either sink.
fn emit(
    model: &Model,
    health: &HealthMap,
    all_weights: &Weights,
    gateway: &GatewaySettings,
    traffic: &TrafficPolicy,
    out: &mut impl Sink,
) {
    out.listener(http_listener(gateway, traffic));
    let mut virtual_hosts = Vec::new();
    for service in model.services() {
        let policy = traffic.with(&service.policy.overrides.traffic);
        for ray_cluster in &service.clusters {
            for protocol in [Protocol::Http, Protocol::Grpc] {
                if protocol == Protocol::Grpc && !ray_cluster.serves_grpc() {
                    continue;
                }
                let name = service.envoy_cluster_name_for(&ray_cluster.name, protocol);
                out.cluster(&name, || eds_cluster(&name, gateway, &policy, protocol));
                let proxies = ray_cluster
                    .endpoints(protocol)
                    .map(|(address, proxy)| (address, ("node_type", proxy.node_type.as_str())));
                out.assignment(&name, health.shared_of_cluster(&name), || {
                    listed(&name, proxies, health)
                });
            }
            for (name, protocol, replicas) in applications::clusters(service, ray_cluster) {
                out.cluster(&name, || eds_cluster(&name, gateway, &policy, protocol));
                out.assignment(&name, health.shared_of_cluster(&name), || {
                    listed(&name, replicas, health)
                });
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
            out.stand_in(
                format!("{service_prefix}*"),
                service.envoy_cluster_name(serving),
            );
        }
        if let Some(serving) = by_weight(true) {
            out.stand_in(
                format!("{service_prefix}*/grpc"),
                service.envoy_grpc_cluster_name(serving),
            );
        }
        for (pattern, cluster) in applications::stand_ins(service, weights, health) {
            out.stand_in(pattern, cluster);
        }
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
    out.route(route::RouteConfiguration {
        name: ROUTE_CONFIG_NAME.into(),
        virtual_hosts,
        // Every cluster a route names is one we send; skip Envoy's own check so a route
        // never fails validation during the moment a cluster is still warming.
        validate_clusters: Some(protobuf::BoolValue { value: false }),
        ..Default::default()
    });
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

fn u32_value(value: u32) -> Option<protobuf::UInt32Value> {
    Some(protobuf::UInt32Value { value })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::health::EndpointHealth;
    use crate::model::test_support::service;
    use crate::model::RayService;
    use crate::xds::snapshot::referenced_clusters;
    use envoy_types::pb::envoy::config::cluster::v3 as cluster;
    use envoy_types::pb::envoy::config::endpoint::v3 as endpoint;
    use envoy_types::pb::envoy::extensions::upstreams::http::v3 as upstream_http;
    use std::net::SocketAddr;

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

#[cfg(test)]
mod incremental_tests {
    //! The incremental build against a whole rebuild, over random sequences of models,
    //! health and weights: every snapshot equal, resource for resource, and every
    //! refusal the same.

    use super::*;
    use crate::live::health::{EndpointHealth, Reason, Verdict};
    use crate::model::test_support::{app, service};
    use crate::model::RayService;
    use crate::xds::Snapshot;
    use proptest::prelude::*;
    use std::net::SocketAddr;
    use std::sync::Arc;

    /// One build's inputs for RayService `a` and `b`, as small numbers.
    #[derive(Clone, Debug)]
    struct Step {
        /// Per RayService: which of 6 proxies the first cluster has (bits); `None`: the
        /// RayService is absent.
        proxies: [Option<u8>; 2],
        /// Per RayService: a second cluster `c2` (pending) with these proxies (bits).
        second: [Option<u8>; 2],
        grpc: [bool; 2],
        /// Per RayService: direct ingress with these replicas of `echo` (bits).
        replicas: [Option<u8>; 2],
        /// Each endpoint's health, by its index in the build's order (wrapping).
        health: Vec<u8>,
        /// `a`'s weight for `c2` when it has one.
        weight: u8,
        /// A second traffic policy (every cluster changes).
        other_policy: bool,
        /// Other gateway settings (every cluster and the listener change).
        other_gateway: bool,
        /// Per RayService: its own `retries`.
        retries: [Option<u8>; 2],
        /// The model of the step before (the same `Arc`): only health, weights or
        /// policy change.
        same_model: bool,
        /// The health picks of the step before: a cluster whose verdicts come out the
        /// same shares the step before's map (as the `Assessor` hands it on).
        same_health: bool,
    }

    fn step() -> impl Strategy<Value = Step> {
        (
            [
                proptest::option::weighted(0.9, 1u8..64),
                proptest::option::weighted(0.9, 1u8..64),
            ],
            [proptest::option::of(1u8..64), proptest::option::of(1u8..64)],
            [any::<bool>(), any::<bool>()],
            [proptest::option::of(0u8..16), proptest::option::of(0u8..16)],
            proptest::collection::vec(0u8..6, 1..40),
            0u8..=100,
            proptest::bool::weighted(0.2),
            [
                proptest::option::weighted(0.2, 0u8..5),
                proptest::option::weighted(0.2, 0u8..5),
            ],
            (
                proptest::bool::weighted(0.4),
                proptest::bool::weighted(0.4),
                proptest::bool::weighted(0.2),
            ),
        )
            .prop_map(
                |(
                    proxies,
                    second,
                    grpc,
                    replicas,
                    health,
                    weight,
                    other_policy,
                    retries,
                    (same_model, same_health, other_gateway),
                )| Step {
                    proxies,
                    second,
                    grpc,
                    replicas,
                    health,
                    weight,
                    other_policy,
                    retries,
                    same_model,
                    same_health,
                    other_gateway,
                },
            )
    }

    fn ports(base: u16, bits: u8) -> Vec<u16> {
        (0..6)
            .filter(|i| bits & (1 << i) != 0)
            .map(|i| base + i)
            .collect()
    }

    fn service_of(s: &Step, i: usize, name: &str) -> Option<RayService> {
        let base = 8000 + 100 * i as u16;
        let mut svc = service(name, "c1", &ports(base, s.proxies[i]?));
        if let Some(bits) = s.second[i] {
            let c2 = service(name, "c2", &ports(base + 50, bits))
                .clusters
                .remove(0);
            svc.clusters.push(c2);
            svc.pending_cluster = Some("c2".into());
        }
        for c in &mut svc.clusters {
            if s.grpc[i] {
                for p in &mut c.proxies {
                    p.grpc = Some(SocketAddr::new(p.address.ip(), p.address.port() + 1000));
                }
            }
            if let Some(bits) = s.replicas[i] {
                c.direct_ingress = true;
                let mut echo = app("echo", Some("/"), &ports(base + 20_000, bits));
                if s.grpc[i] {
                    echo.grpc_replicas = ports(base + 21_000, bits)
                        .into_iter()
                        .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
                        .collect();
                }
                c.applications = vec![echo];
            }
        }
        svc.policy.overrides.traffic.retries = s.retries[i].map(u32::from);
        // A setting of the RayService's Envoy clusters too: a model change that changes
        // a cluster of the same name.
        svc.policy.overrides.traffic.max_connections = s.retries[i].map(|r| 100 + u32::from(r));
        Some(svc)
    }

    /// The step's inputs; `None` when the model is not a valid one.
    fn inputs(s: &Step) -> Option<(Model, HealthMap, Weights, TrafficPolicy)> {
        let services: Vec<RayService> = ["a", "b"]
            .iter()
            .enumerate()
            .filter_map(|(i, name)| service_of(s, i, name))
            .collect();
        let model = Model::new(services).ok()?;
        let mut health = HealthMap::default();
        let mut n = 0;
        let mut judge = |cluster: String, address: SocketAddr, health: &mut HealthMap| {
            let pick = s.health[n % s.health.len()];
            n += 1;
            let h = match pick {
                0 => return,
                1 => EndpointHealth::Healthy,
                2 => EndpointHealth::Unhealthy,
                3 => EndpointHealth::Draining,
                4 => EndpointHealth::Withheld,
                _ => EndpointHealth::Unknown,
            };
            let routable = matches!(h, EndpointHealth::Healthy | EndpointHealth::Unknown);
            let c = health.clusters.entry(cluster.clone()).or_default();
            c.routable += u32::from(routable);
            health.endpoints.insert(
                (cluster, address),
                Verdict {
                    health: h,
                    reason: Reason::NotProbedYet,
                },
            );
        };
        for svc in model.services() {
            for c in &svc.clusters {
                for protocol in [Protocol::Http, Protocol::Grpc] {
                    let name = svc.envoy_cluster_name_for(&c.name, protocol);
                    for (address, _) in c.endpoints(protocol) {
                        judge(name.clone(), address, &mut health);
                    }
                }
                for a in &c.applications {
                    for protocol in [Protocol::Http, Protocol::Grpc] {
                        let name = svc.envoy_app_cluster_name(&c.name, &a.name, protocol);
                        for r in a.replicas(protocol) {
                            judge(name.clone(), *r, &mut health);
                        }
                    }
                }
            }
        }
        let mut weights = Weights::default();
        if let Some(a) = model.services().iter().find(|s| s.name == "a") {
            if a.clusters.len() == 2 {
                let w = u32::from(s.weight);
                weights.insert(a.key(), vec![("c1".into(), 100 - w), ("c2".into(), w)]);
            }
        }
        let mut traffic = TrafficPolicy::default();
        if s.other_policy {
            traffic.retry_back_off = Duration::from_millis(100);
            traffic.consecutive_local_origin_failure = 5;
        }
        Some((model, health, weights, traffic))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn an_incremental_build_equals_a_whole_rebuild(steps in proptest::collection::vec(step(), 1..10)) {
            let other_gateway = GatewaySettings {
                connect_timeout: Duration::from_millis(250),
                ..GatewaySettings::default()
            };
            let mut incremental = Incremental::default();
            let mut previous: Option<Snapshot> = None;
            let mut before: Option<(Step, Arc<Model>, HealthMap)> = None;
            for s in &steps {
                let mut s = s.clone();
                if let Some((b, _, _)) = &before {
                    if s.same_model {
                        (s.proxies, s.second, s.grpc, s.replicas, s.retries) =
                            (b.proxies, b.second, b.grpc, b.replicas, b.retries);
                    }
                    if s.same_health {
                        s.health = b.health.clone();
                    }
                }
                let Some((model, mut health, weights, traffic)) = inputs(&s) else { continue };
                let model = match &before {
                    Some((_, m, _)) if **m == model => m.clone(),
                    _ => Arc::new(model),
                };
                if let Some((_, _, h)) = &before {
                    health.endpoints.share_equal(&h.endpoints);
                }
                before = Some((s.clone(), model.clone(), health.clone()));
                let gateway = if s.other_gateway { other_gateway.clone() } else { GatewaySettings::default() };
                let whole = Snapshot::build(&translate(&model, &health, &weights, &gateway, &traffic), None);
                let kept = Snapshot::build_encoded(
                    &incremental.translate(&model, &health, &weights, &gateway, &traffic),
                    previous.as_ref(),
                );
                prop_assert_eq!(&whole, &kept);
                if let Ok(k) = kept {
                    previous = Some(k);
                }
            }
        }
    }

    #[test]
    fn a_change_of_one_endpoint_s_health_encodes_only_its_assignment() {
        let model = Model::new(vec![
            service("a", "a1", &[8000, 8001]),
            service("b", "b1", &[9000]),
        ])
        .unwrap();
        let (g, t, w) = (
            GatewaySettings::default(),
            TrafficPolicy::default(),
            Weights::default(),
        );
        let model = Arc::new(model);
        let mut incremental = Incremental::default();
        let before = incremental.translate(&model, &HealthMap::default(), &w, &g, &t);
        let mut health = HealthMap::default();
        health.endpoints.insert(
            (
                "default/a/a1".into(),
                SocketAddr::from(([127, 0, 0, 1], 8001)),
            ),
            Verdict {
                health: EndpointHealth::Unhealthy,
                reason: Reason::NotProbedYet,
            },
        );
        let after = incremental.translate(&model, &health, &w, &g, &t);
        let mut encoded_anew = Vec::new();
        for ty in ResourceType::ALL {
            for (b, a) in before.by_type[ty.index()]
                .iter()
                .zip(&after.by_type[ty.index()])
            {
                if !Arc::ptr_eq(b, a) {
                    encoded_anew.push((ty, a.name.to_string()));
                }
            }
        }
        assert_eq!(
            encoded_anew,
            [(ResourceType::Endpoints, "default/a/a1".to_string())]
        );
    }
}

//! Versioned snapshots of Envoy resources, the unit the pipeline publishes and every
//! xDS stream reads.
//!
//! Each resource is encoded once into an `Any` and shared by `Arc` among all streams.
//! Its version is a hash of its type and encoded bytes, and the snapshot's version a
//! hash of every resource version, so equal models give equal versions on any replica
//! and after any restart.
//!
//! Invariant: a snapshot made by [`Snapshot::build`] is consistent (as go-control-plane's
//! `Snapshot.Consistent()`): every EDS cluster has its ClusterLoadAssignment and every
//! assignment its cluster, every cluster a route names exists, and every route
//! configuration a listener names over RDS exists. Envoy would otherwise warm forever or
//! route to nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use prost::{Message, Name};
use sha2::{Digest, Sha256};

use envoy_types::pb::envoy::config::cluster::v3::{self as cluster_pb, Cluster};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::{self as listener_pb, Listener};
use envoy_types::pb::envoy::config::route::v3::{self as route_pb, RouteConfiguration};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::RouteSpecifier, HttpConnectionManager,
};

/// An aggregated (ADS) config source, as every EDS cluster here uses.
fn ads_config_source() -> envoy_types::pb::envoy::config::core::v3::ConfigSource {
    use envoy_types::pb::envoy::config::core::v3 as core;
    core::ConfigSource {
        config_source_specifier: Some(core::config_source::ConfigSourceSpecifier::Ads(
            core::AggregatedConfigSource {},
        )),
        resource_api_version: core::ApiVersion::V3 as i32,
        ..Default::default()
    }
}

/// Typed Envoy resources, before encoding: what a snapshot is built from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resources {
    pub clusters: Vec<Cluster>,
    pub endpoints: Vec<ClusterLoadAssignment>,
    pub listeners: Vec<Listener>,
    pub routes: Vec<RouteConfiguration>,
    /// For clusters an Envoy may still hold that these resources no longer have (it
    /// reconnected after they went): by name pattern ([`name_matches`]: a prefix, or `*`
    /// for one `/`-free segment), the cluster that stands in for them until no route of
    /// that Envoy names them. See [`Snapshot::stand_in`].
    pub stand_ins: BTreeMap<String, String>,
}

/// Why a set of resources does not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Inconsistent {
    #[error("EDS cluster {0:?} has no ClusterLoadAssignment")]
    ClusterWithoutEndpoints(String),
    #[error("ClusterLoadAssignment {0:?} has no EDS cluster")]
    EndpointsWithoutCluster(String),
    #[error("route configuration {route:?} names cluster {cluster:?}, which does not exist")]
    MissingCluster { route: String, cluster: String },
    #[error(
        "listener {listener:?} takes route configuration {route:?} over RDS, which does not exist"
    )]
    MissingRoute { listener: String, route: String },
    #[error("two {0} resources are named {1:?}")]
    Duplicate(&'static str, String),
}

impl Resources {
    /// Each resource encoded on its own, in this order (tests and whole rebuilds).
    pub fn encode(&self) -> Encoded {
        fn each<M: EnvoyResource>(items: &[M]) -> Vec<Arc<Resource>> {
            items.iter().map(|m| Arc::new(Resource::of(m))).collect()
        }
        Encoded {
            by_type: [
                each(&self.clusters),
                each(&self.endpoints),
                each(&self.listeners),
                each(&self.routes),
            ],
            stand_ins: self.stand_ins.clone(),
        }
    }
}

/// Encoded resources of every type, before they are checked and versioned into a
/// [`Snapshot`]: what an incremental build gives (each resource either kept from an
/// earlier build, unchanged, or encoded anew; see [`Memo`]).
#[derive(Clone, Debug, Default)]
pub struct Encoded {
    /// By [`ResourceType::index`].
    pub by_type: [Vec<Arc<Resource>>; 4],
    /// As [`Resources::stand_ins`].
    pub stand_ins: BTreeMap<String, String>,
}

impl Encoded {
    pub fn push(&mut self, ty: ResourceType, resource: Arc<Resource>) {
        self.by_type[ty.index()].push(resource);
    }

    /// Checks that the resources fit together (see the module doc), from what each
    /// resource recorded of its links when it was encoded: no decoding.
    pub(crate) fn consistent(&self) -> Result<(), Inconsistent> {
        use std::collections::BTreeSet;
        fn names<'a>(
            ty: &'static str,
            items: &'a [Arc<Resource>],
        ) -> Result<BTreeSet<&'a str>, Inconsistent> {
            let mut out = BTreeSet::new();
            for r in items {
                if !out.insert(&*r.name) {
                    return Err(Inconsistent::Duplicate(ty, r.name.to_string()));
                }
            }
            Ok(out)
        }
        let [clusters, endpoints, listeners, routes] = &self.by_type;
        let cluster_names = names("cluster", clusters)?;
        let assignments = names("endpoints", endpoints)?;
        let route_names = names("route", routes)?;
        names("listener", listeners)?;
        let mut eds_names = BTreeSet::new();
        for c in clusters {
            for name in &c.needs {
                if !assignments.contains(&**name) {
                    return Err(Inconsistent::ClusterWithoutEndpoints(name.to_string()));
                }
                eds_names.insert(&**name);
            }
        }
        if let Some(orphan) = assignments.difference(&eds_names).next() {
            return Err(Inconsistent::EndpointsWithoutCluster(orphan.to_string()));
        }
        for r in routes {
            for cluster in &r.cluster_refs {
                if !cluster_names.contains(&**cluster) {
                    return Err(Inconsistent::MissingCluster {
                        route: r.name.to_string(),
                        cluster: cluster.to_string(),
                    });
                }
            }
        }
        for l in listeners {
            for route in &l.needs {
                if !route_names.contains(&**route) {
                    return Err(Inconsistent::MissingRoute {
                        listener: l.name.to_string(),
                        route: route.to_string(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// A message ray-xds serves as a resource: its type, its name, and the names of the
/// resources of other types it needs, recorded when it is encoded so that a snapshot's
/// consistency is checked without decoding anything.
pub trait EnvoyResource: Message + Name + Sized {
    const TYPE: ResourceType;
    fn resource_name(&self) -> &str;
    /// An EDS cluster: its assignment's name; a listener: the route configurations it
    /// takes over RDS.
    fn needs(&self) -> Vec<String> {
        Vec::new()
    }
    /// A route configuration: the clusters it sends traffic to.
    fn cluster_refs(&self) -> Vec<String> {
        Vec::new()
    }
}

impl EnvoyResource for Cluster {
    const TYPE: ResourceType = ResourceType::Cluster;
    fn resource_name(&self) -> &str {
        &self.name
    }
    fn needs(&self) -> Vec<String> {
        let eds = cluster_pb::cluster::ClusterDiscoveryType::Type(
            cluster_pb::cluster::DiscoveryType::Eds as i32,
        );
        if self.cluster_discovery_type.as_ref() != Some(&eds) {
            return Vec::new();
        }
        let name = self
            .eds_cluster_config
            .as_ref()
            .map(|e| e.service_name.as_str())
            .filter(|n| !n.is_empty())
            .unwrap_or(&self.name);
        vec![name.to_string()]
    }
}

impl EnvoyResource for ClusterLoadAssignment {
    const TYPE: ResourceType = ResourceType::Endpoints;
    fn resource_name(&self) -> &str {
        &self.cluster_name
    }
}

impl EnvoyResource for Listener {
    const TYPE: ResourceType = ResourceType::Listener;
    fn resource_name(&self) -> &str {
        &self.name
    }
    fn needs(&self) -> Vec<String> {
        rds_route_names(self)
    }
}

impl EnvoyResource for RouteConfiguration {
    const TYPE: ResourceType = ResourceType::Route;
    fn resource_name(&self) -> &str {
        &self.name
    }
    fn cluster_refs(&self) -> Vec<String> {
        referenced_clusters(self)
    }
}

/// One type's resources encoded across builds: a resource is encoded again only when
/// what it is made from changed. `K` is that input (the typed message itself, or
/// something smaller that decides it); a resource not asked for in a build is forgotten
/// at the next [`Memo::sweep`]. Equal inputs give the kept resource, byte for byte what
/// encoding them again would give: versions stay content hashes.
#[derive(Debug)]
pub struct Memo<K> {
    kept: std::collections::HashMap<Arc<str>, Kept<K>>,
    round: u64,
}

#[derive(Debug)]
struct Kept<K> {
    input: K,
    resource: Arc<Resource>,
    round: u64,
}

impl<K> Default for Memo<K> {
    fn default() -> Self {
        Memo {
            kept: Default::default(),
            round: 0,
        }
    }
}

impl<K> Memo<K> {
    /// Resource `name`: the kept one when `same(kept input)` holds (`same` may note in
    /// the kept input what it was found the same as), else `make()`'s input and
    /// resource, kept for the next build.
    pub fn get_or_make(
        &mut self,
        name: &str,
        same: impl FnOnce(&mut K) -> bool,
        make: impl FnOnce() -> (K, Resource),
    ) -> Arc<Resource> {
        let round = self.round;
        if let Some(kept) = self.kept.get_mut(name) {
            if same(&mut kept.input) {
                kept.round = round;
                return kept.resource.clone();
            }
        }
        let (input, resource) = make();
        let resource = Arc::new(resource);
        self.kept.insert(
            resource.name.clone(),
            Kept {
                input,
                resource: resource.clone(),
                round,
            },
        );
        resource
    }

    /// Forgets what the build since the last sweep did not ask for (and, after a burst,
    /// the room it took).
    pub fn sweep(&mut self) {
        let round = self.round;
        self.kept.retain(|_, k| k.round == round);
        if self.kept.capacity() > 4 * self.kept.len().max(16) {
            self.kept.shrink_to(2 * self.kept.len());
        }
        self.round += 1;
    }

    pub fn len(&self) -> usize {
        self.kept.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }
}

impl<M: EnvoyResource + PartialEq> Memo<M> {
    /// `message` encoded, or the kept resource when the message equals the one it was
    /// encoded from.
    pub fn message(&mut self, message: M) -> Arc<Resource> {
        let round = self.round;
        if let Some(kept) = self.kept.get_mut(message.resource_name()) {
            if kept.input == message {
                kept.round = round;
                return kept.resource.clone();
            }
        }
        let resource = Arc::new(Resource::of(&message));
        self.kept.insert(
            resource.name.clone(),
            Kept {
                input: message,
                resource: resource.clone(),
                round,
            },
        );
        resource
    }
}

/// The clusters a route configuration sends traffic to, sorted, each once.
pub fn referenced_clusters(config: &RouteConfiguration) -> Vec<String> {
    let mut names: Vec<String> = config
        .virtual_hosts
        .iter()
        .flat_map(virtual_host_clusters)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The clusters one virtual host sends traffic to.
pub(crate) fn virtual_host_clusters(vh: &route_pb::VirtualHost) -> Vec<String> {
    let mut names = Vec::new();
    for r in &vh.routes {
        if let Some(route_pb::route::Action::Route(action)) = &r.action {
            match &action.cluster_specifier {
                Some(route_pb::route_action::ClusterSpecifier::Cluster(name)) => {
                    names.push(name.clone())
                }
                Some(route_pb::route_action::ClusterSpecifier::WeightedClusters(w)) => {
                    names.extend(w.clusters.iter().map(|c| c.name.clone()))
                }
                _ => {}
            }
        }
    }
    names
}

/// The route configurations a listener's HTTP connection managers take over RDS.
fn rds_route_names(listener: &Listener) -> Vec<String> {
    let mut out = Vec::new();
    for chain in &listener.filter_chains {
        for filter in &chain.filters {
            let Some(listener_pb::filter::ConfigType::TypedConfig(any)) = &filter.config_type
            else {
                continue;
            };
            if any.type_url != <HttpConnectionManager as Name>::type_url() {
                continue;
            }
            if let Ok(hcm) = HttpConnectionManager::decode(&*any.value) {
                if let Some(RouteSpecifier::Rds(rds)) = hcm.route_specifier {
                    out.push(rds.route_config_name);
                }
            }
        }
    }
    out
}

/// The resource types ray-xds serves, in make-before-break push order: clusters before
/// their endpoints before listeners before routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ResourceType {
    Cluster = 0,
    Endpoints = 1,
    Listener = 2,
    Route = 3,
}

pub const CLUSTER_TYPE_URL: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINTS_TYPE_URL: &str =
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const LISTENER_TYPE_URL: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const ROUTE_TYPE_URL: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";

impl ResourceType {
    pub const ALL: [ResourceType; 4] = [
        ResourceType::Cluster,
        ResourceType::Endpoints,
        ResourceType::Listener,
        ResourceType::Route,
    ];

    pub fn type_url(self) -> &'static str {
        match self {
            ResourceType::Cluster => CLUSTER_TYPE_URL,
            ResourceType::Endpoints => ENDPOINTS_TYPE_URL,
            ResourceType::Listener => LISTENER_TYPE_URL,
            ResourceType::Route => ROUTE_TYPE_URL,
        }
    }

    pub fn from_type_url(url: &str) -> Option<ResourceType> {
        ResourceType::ALL.into_iter().find(|t| t.type_url() == url)
    }

    /// Short name used in metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            ResourceType::Cluster => "cds",
            ResourceType::Endpoints => "eds",
            ResourceType::Listener => "lds",
            ResourceType::Route => "rds",
        }
    }

    /// In state-of-the-world, a response of these types carries the complete set and a
    /// missing resource means "removed"; the others are named subscriptions.
    pub(crate) fn is_full_state(self) -> bool {
        matches!(self, ResourceType::Cluster | ResourceType::Listener)
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for ResourceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One encoded resource.
#[derive(Clone, PartialEq)]
pub struct Resource {
    pub name: Arc<str>,
    pub version: Arc<str>,
    pub body: Any,
    /// Clusters this resource sends traffic to (route configurations only). A route is
    /// sent to an Envoy only once that Envoy holds all of them, and a cluster is removed
    /// from an Envoy only once no route it holds names it.
    pub cluster_refs: Vec<Arc<str>>,
    /// The resources of another type this one needs ([`EnvoyResource::needs`]): what a
    /// snapshot's consistency check reads. Empty for a resource made otherwise than by
    /// [`Resource::of`] (a stand-in, a merge), which no check reads.
    pub needs: Vec<Arc<str>>,
}

impl fmt::Debug for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Resource")
            .field("name", &self.name)
            .field("version", &self.version)
            .field("cluster_refs", &self.cluster_refs)
            .finish()
    }
}

impl Resource {
    pub(crate) fn encode<M: Message + Name>(
        name: &str,
        message: &M,
        cluster_refs: Vec<String>,
    ) -> Resource {
        let value = message.encode_to_vec();
        let type_url = M::type_url();
        let mut hash = Sha256::new();
        hash.update(type_url.as_bytes());
        hash.update([0]);
        hash.update(&value);
        Resource {
            name: name.into(),
            version: short_hex(&hash.finalize()).into(),
            body: Any { type_url, value },
            cluster_refs: cluster_refs.into_iter().map(Arc::from).collect(),
            needs: Vec::new(),
        }
    }

    /// `message` encoded under its own name, with its links to other resources.
    pub fn of<M: EnvoyResource>(message: &M) -> Resource {
        let mut r = Resource::encode(message.resource_name(), message, message.cluster_refs());
        r.needs = message.needs().into_iter().map(Arc::from).collect();
        r
    }

    /// The resource as proto JSON (as Envoy's `/config_dump` prints it).
    pub fn to_json(&self) -> serde_json::Value {
        super::json::any_to_json(&self.body)
    }

    /// What the resource takes of a response, at most: its body, name and version, and
    /// their framing. The one measure of both a response's budget and the room a stream
    /// reserves for it ([`Snapshot::response_room`]).
    pub(crate) fn size_in_response(&self) -> usize {
        self.body.value.len() + self.name.len() + self.version.len() + RESOURCE_FRAMING
    }
}

pub(crate) type ResourceMap = BTreeMap<Arc<str>, Arc<Resource>>;

/// A resource's bytes in a response beside its body and its name and version: the type
/// URL, field tags and lengths (`Any`, and delta's `Resource`).
const RESOURCE_FRAMING: usize = 96;

/// A response's bytes beside its resources: versions, nonce, type URL, the control
/// plane's identity, the gRPC frame.
const RESPONSE_FRAMING: usize = 256;

/// Whether a stand-in pattern covers the cluster `name`: a pattern without `*` is a
/// prefix; one `*` stands for one non-empty segment without `/` (so `a/b/*` covers
/// `a/b/c` but not `a/b/c/d`, and `a/b/*/d` covers that one), which keeps clusters of
/// different kinds under one prefix apart.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => name.starts_with(pattern),
        Some((before, after)) => {
            name.len() > before.len() + after.len()
                && name.starts_with(before)
                && name.ends_with(after)
                && !name[before.len()..name.len() - after.len()].contains('/')
        }
    }
}

/// An immutable set of resources of every type, with a content-hash version for the
/// whole and for each type. Each type's map is shared (`Arc`) so that a stream whose
/// Envoy holds exactly this snapshot's set of a type keeps a pointer, not a copy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    version: String,
    by_type: [Arc<ResourceMap>; 4],
    type_versions: [Arc<str>; 4],
    stand_ins: Arc<BTreeMap<String, Arc<str>>>,
    /// What one stream's responses to this snapshot may come to (see
    /// [`Snapshot::response_room`]).
    response_room: usize,
}

impl Snapshot {
    /// A consistent snapshot of `resources`, sharing every unchanged resource with
    /// `previous`; an inconsistent set is refused.
    pub fn build(
        resources: &Resources,
        previous: Option<&Snapshot>,
    ) -> Result<Snapshot, Inconsistent> {
        Snapshot::build_encoded(&resources.encode(), previous)
    }

    /// A consistent snapshot of resources already encoded (an incremental build's),
    /// sharing every unchanged resource with `previous`; an inconsistent set is refused.
    pub fn build_encoded(
        encoded: &Encoded,
        previous: Option<&Snapshot>,
    ) -> Result<Snapshot, Inconsistent> {
        encoded.consistent()?;
        Ok(Snapshot::from_encoded(encoded, previous))
    }

    /// A snapshot of `resources`, unchecked (tests and benchmarks build odd ones on
    /// purpose).
    pub fn from_resources(resources: &Resources) -> Snapshot {
        Snapshot::from_encoded(&resources.encode(), None)
    }

    /// Like [`Snapshot::from_resources`], sharing every unchanged resource with
    /// `previous`: streams still holding the previous snapshot then cost nothing extra,
    /// and an unchanged resource is recognised by pointer.
    #[cfg(test)]
    pub(crate) fn from_resources_reusing(
        resources: &Resources,
        previous: Option<&Snapshot>,
    ) -> Snapshot {
        Snapshot::from_encoded(&resources.encode(), previous)
    }

    fn from_encoded(encoded: &Encoded, previous: Option<&Snapshot>) -> Snapshot {
        let mut by_type: [ResourceMap; 4] = Default::default();
        for ty in ResourceType::ALL {
            let old = previous.map(|p| p.resources(ty));
            for r in &encoded.by_type[ty.index()] {
                let reused = old
                    .and_then(|old| old.get(&r.name))
                    .filter(|old| old.version == r.version)
                    .cloned();
                let r = reused.unwrap_or_else(|| r.clone());
                by_type[ty.index()].insert(r.name.clone(), r);
            }
        }
        let mut snapshot = Snapshot::from_maps(by_type);
        snapshot.stand_ins = Arc::new(
            encoded
                .stand_ins
                .iter()
                .map(|(prefix, cluster)| (prefix.clone(), Arc::from(cluster.as_str())))
                .collect(),
        );
        snapshot
    }

    /// The longest stand-in pattern that covers the cluster `name`, if any: clusters it
    /// covers are of one kind, and one may stand in for another.
    pub(crate) fn stand_in_pattern(&self, name: &str) -> Option<&str> {
        self.stand_ins
            .keys()
            .filter(|pattern| name_matches(pattern, name))
            .max_by_key(|pattern| pattern.len())
            .map(String::as_str)
    }

    /// A body for `name` (a cluster, or its endpoints) that an Envoy holds but this
    /// snapshot lacks, and that a state-of-the-world response must still carry because
    /// a route the Envoy holds may name it (after a reconnect, when the server has no
    /// copy of what the Envoy has). It is the cluster standing in for its prefix, renamed,
    /// with that cluster's endpoints; without one, an EDS cluster with no endpoints.
    /// Either way it warms at once: Envoy holds its cluster ACKs until every cluster
    /// warms, so a stand-in that never did would stall every later cluster change.
    pub fn stand_in(&self, ty: ResourceType, name: &str) -> Option<Arc<Resource>> {
        let source = self
            .stand_ins
            .iter()
            .filter(|(pattern, _)| name_matches(pattern, name))
            .max_by_key(|(pattern, _)| pattern.len())
            .map(|(_, cluster)| cluster);
        let source = |ty: ResourceType| source.and_then(|c| self.resources(ty).get(c));
        match ty {
            ResourceType::Cluster => {
                let Some(r) = source(ty) else {
                    return Some(bare_cluster(name));
                };
                let mut cluster = Cluster::decode(&*r.body.value).ok()?;
                cluster.name = name.into();
                Some(Arc::new(Resource::encode(name, &cluster, Vec::new())))
            }
            ResourceType::Endpoints => {
                let mut assignment = match source(ty) {
                    Some(r) => ClusterLoadAssignment::decode(&*r.body.value).ok()?,
                    None => ClusterLoadAssignment::default(),
                };
                assignment.cluster_name = name.into();
                Some(Arc::new(Resource::encode(name, &assignment, Vec::new())))
            }
            ResourceType::Listener | ResourceType::Route => None,
        }
    }

    pub(crate) fn from_maps(by_type: [ResourceMap; 4]) -> Snapshot {
        let type_versions: [Arc<str>; 4] = std::array::from_fn(|i| map_version(&by_type[i]).into());
        let mut hash = Sha256::new();
        for (ty, v) in ResourceType::ALL.iter().zip(&type_versions) {
            hash.update(ty.type_url().as_bytes());
            hash.update(v.as_bytes());
        }
        let response_room = ResourceType::ALL
            .iter()
            .map(|ty| {
                let sizes = by_type[ty.index()].values().map(|r| r.size_in_response());
                let (all, largest) = sizes.fold((0usize, 0usize), |(all, largest), size| {
                    (all + size, largest.max(size))
                });
                let whole = all + RESPONSE_FRAMING;
                if ty.is_full_state() {
                    whole // state of the world sends the whole set at once
                } else {
                    // One response takes resources up to the budget, and always one.
                    whole.min(crate::ordering::RESPONSE_BUDGET_BYTES + largest + RESPONSE_FRAMING)
                }
            })
            .sum::<usize>();
        Snapshot {
            version: short_hex(&hash.finalize()),
            by_type: by_type.map(Arc::new),
            type_versions,
            stand_ins: Arc::default(),
            response_room,
        }
    }

    /// The room a stream reserves before it builds its responses to this snapshot
    /// ([`crate::responses`]): the most one poll can send, about: for each type, the
    /// whole set where state of the world sends it whole (clusters, listeners), else a
    /// response budget and the largest resource. Only a stand-in (a renamed copy, after
    /// a reconnect) or a long list of names told removed (at most the names a stream may
    /// subscribe to) can come to more; the framed bytes are what is held.
    pub fn response_room(&self) -> usize {
        self.response_room
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    pub fn resources(&self, ty: ResourceType) -> &ResourceMap {
        &self.by_type[ty.index()]
    }

    /// The shared map of one type.
    pub(crate) fn shared(&self, ty: ResourceType) -> &Arc<ResourceMap> {
        &self.by_type[ty.index()]
    }

    /// The version of one type's whole set: `set_version` of all its resources.
    pub(crate) fn type_version(&self, ty: ResourceType) -> &Arc<str> {
        &self.type_versions[ty.index()]
    }

    pub fn len(&self) -> usize {
        self.by_type.iter().map(|m| m.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `set_version` of every resource in a map.
pub(crate) fn map_version(map: &ResourceMap) -> String {
    set_version(map.iter().map(|(n, r)| (&**n, &*r.version)))
}

/// A version for a set of `(name, version)` pairs: what a state-of-the-world response
/// carries as `version_info`.
pub(crate) fn set_version<'a>(items: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut hash = Sha256::new();
    for (name, version) in items {
        hash.update(name.as_bytes());
        hash.update([0]);
        hash.update(version.as_bytes());
        hash.update([0]);
    }
    short_hex(&hash.finalize())
}

fn short_hex(bytes: &[u8]) -> String {
    bytes[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// An EDS cluster named `name` with Envoy's defaults for everything else: what stands in
/// for a cluster whose own settings are unknown or refused. Its metadata
/// (`ray-xds: {stand_in: true}`) tells it from any cluster of a snapshot.
pub(crate) fn bare_cluster(name: &str) -> Arc<Resource> {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    let marker = Struct {
        fields: [(
            "stand_in".to_string(),
            Value {
                kind: Some(Kind::BoolValue(true)),
            },
        )]
        .into(),
    };
    let cluster = Cluster {
        name: name.into(),
        metadata: Some(Metadata {
            filter_metadata: [("ray-xds".to_string(), marker)].into(),
            ..Default::default()
        }),
        cluster_discovery_type: Some(cluster_pb::cluster::ClusterDiscoveryType::Type(
            cluster_pb::cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster_pb::cluster::EdsClusterConfig {
            eds_config: Some(ads_config_source()),
            service_name: String::new(),
        }),
        ..Default::default()
    };
    Arc::new(Resource::encode(name, &cluster, Vec::new()))
}

#[cfg(test)]
mod name_pattern_tests {
    use super::name_matches;

    #[test]
    fn a_star_is_one_segment_and_a_plain_pattern_a_prefix() {
        assert!(name_matches("ns/s/*", "ns/s/a1"));
        assert!(!name_matches("ns/s/*", "ns/s/a1/grpc"), "another kind");
        assert!(!name_matches("ns/s/*", "ns/s/"), "the segment is not empty");
        assert!(name_matches("ns/s/*/grpc", "ns/s/a1/grpc"));
        assert!(!name_matches("ns/s/*/grpc", "ns/s/a1"));
        assert!(!name_matches("ns/s/*/grpc", "ns/s//grpc"));
        assert!(
            !name_matches("ns/s/*/grpc", "ns/s/grpc"),
            "shorter than the pattern"
        );
        assert!(!name_matches("ns/s/*", "ns/t/a1"));
        assert!(name_matches("ns/s/", "ns/s/a1/grpc"), "no star: a prefix");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{resources_of, service};

    #[test]
    fn versions_are_content_hashes() {
        let m1 = resources_of(&[service("a", "a1", &[8000, 8001])]);
        let s1 = Snapshot::from_resources(&m1);
        let s1_again = Snapshot::from_resources(&m1);
        assert_eq!(s1.version(), s1_again.version());
        assert_eq!(s1.version().len(), 16);

        // Changing one endpoint changes that assignment's version and nothing else.
        let m2 = resources_of(&[service("a", "a1", &[8000, 8002])]);
        let s2 = Snapshot::from_resources(&m2);
        assert_ne!(s1.version(), s2.version());
        for ty in ResourceType::ALL {
            for (name, r) in s1.resources(ty) {
                let same = s2.resources(ty)[name].version == r.version;
                assert_eq!(same, ty != ResourceType::Endpoints, "{ty} {name}");
            }
        }
    }

    #[test]
    fn unchanged_resources_are_shared_with_the_previous_snapshot() {
        let m1 = resources_of(&[service("a", "a1", &[8000]), service("b", "b1", &[9000])]);
        let m2 = resources_of(&[service("a", "a1", &[8000]), service("b", "b1", &[9001])]);
        let s1 = Snapshot::from_resources(&m1);
        let s2 = Snapshot::from_resources_reusing(&m2, Some(&s1));
        let e = ResourceType::Endpoints;
        assert!(Arc::ptr_eq(
            &s1.resources(e)["default/a/a1"],
            &s2.resources(e)["default/a/a1"]
        ));
        assert!(!Arc::ptr_eq(
            &s1.resources(e)["default/b/b1"],
            &s2.resources(e)["default/b/b1"]
        ));
        assert_eq!(s2, Snapshot::from_resources(&m2), "same content either way");
    }

    #[test]
    fn routes_know_their_clusters() {
        let m = resources_of(&[service("a", "a1", &[8000])]);
        let s = Snapshot::from_resources(&m);
        let route = s.resources(ResourceType::Route).values().next().unwrap();
        assert_eq!(route.cluster_refs, vec![Arc::from("default/a/a1")]);
    }

    #[test]
    fn type_urls_round_trip() {
        for ty in ResourceType::ALL {
            assert_eq!(ResourceType::from_type_url(ty.type_url()), Some(ty));
        }
        assert_eq!(ResourceType::from_type_url("type.googleapis.com/foo"), None);
    }

    #[test]
    fn an_inconsistent_set_is_refused() {
        let good = resources_of(&[service("a", "a1", &[8000])]);
        assert!(Snapshot::build(&good, None).is_ok());
        let mut no_endpoints = good.clone();
        no_endpoints.endpoints.clear();
        assert_eq!(
            Snapshot::build(&no_endpoints, None).unwrap_err(),
            Inconsistent::ClusterWithoutEndpoints("default/a/a1".into())
        );
        let mut orphan = good.clone();
        orphan.clusters.clear();
        assert!(matches!(
            Snapshot::build(&orphan, None).unwrap_err(),
            Inconsistent::EndpointsWithoutCluster(_)
        ));
        let mut dangling = good.clone();
        dangling.clusters.push(dangling.clusters[0].clone());
        assert!(matches!(
            Snapshot::build(&dangling, None).unwrap_err(),
            Inconsistent::Duplicate("cluster", _)
        ));
        let mut routeless = good.clone();
        routeless.routes.clear();
        assert!(matches!(
            Snapshot::build(&routeless, None).unwrap_err(),
            Inconsistent::MissingRoute { .. }
        ));
        let mut elsewhere = resources_of(&[service("a", "a1", &[8000])]);
        elsewhere.routes = resources_of(&[service("b", "b1", &[8000])]).routes;
        assert!(matches!(
            Snapshot::build(&elsewhere, None).unwrap_err(),
            Inconsistent::MissingCluster { .. }
        ));
    }
}

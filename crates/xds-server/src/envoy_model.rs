//! Test-only: a model of Envoy as an ADS client, and property tests that drive both
//! state machines with it.
//!
//! The model keeps what Envoy keeps: active clusters (in service), warming ones (a new or
//! changed cluster waits for a ClusterLoadAssignment sent after it; until then Envoy
//! serves with the version it had), endpoints, route configurations and listeners. It
//! rejects a cluster whose connect timeout is [`BAD_TIMEOUT_MS`] (as Envoy rejects an
//! invalid one), applies the rest of that response, and names each rejected cluster in
//! its NACK, as Envoy does. It subscribes to endpoints for every cluster it has, and to
//! the route configuration once it has a listener.
//!
//! The property tests publish random snapshots, deliver responses, and reconnect, in
//! random order, and check after every response that no route the model holds names a
//! cluster it does not have warm; then that it converges to the latest snapshot with a
//! bounded number of responses and nothing more after.

use std::collections::{BTreeMap, BTreeSet};

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::rpc::Status;
use prost::Message;

use super::delta::DeltaStream;
use super::fixtures::ROUTE_CONFIG;
use super::snapshot::{virtual_host_clusters, ResourceType, Snapshot};
use super::sotw::SotwStream;
use super::AdsProtocol;

/// A cluster with this connect timeout is one the model cannot add: it applies the
/// rest of the response and names this one in its NACK (as Envoy does for a cluster it
/// fails to create).
pub(crate) const BAD_TIMEOUT_MS: u64 = 13;

/// A cluster with this connect timeout is invalid: the model rejects the whole response
/// and names nothing (as Envoy does when a resource fails proto validation).
pub(crate) const INVALID_TIMEOUT_MS: u64 = 17;

fn timeout_is(c: &Cluster, ms: u64) -> bool {
    c.connect_timeout
        .as_ref()
        .is_some_and(|d| d.nanos as u64 == ms * 1_000_000)
}

fn is_bad(c: &Cluster) -> bool {
    timeout_is(c, BAD_TIMEOUT_MS) || timeout_is(c, INVALID_TIMEOUT_MS)
}

/// What one Envoy holds.
#[derive(Clone, Debug, Default)]
pub(crate) struct ModelEnvoy {
    /// Clusters in service, by name: the version.
    pub active: BTreeMap<String, String>,
    /// Clusters warming (new, or an update of an active one): the version.
    pub warming: BTreeMap<String, String>,
    pub endpoints: BTreeMap<String, String>,
    pub routes: BTreeMap<String, (String, RouteConfiguration)>,
    pub listeners: BTreeMap<String, String>,
}

impl ModelEnvoy {
    /// Whether a response carrying these clusters is refused whole.
    fn invalid(items: &[(String, String, Any)]) -> bool {
        items.iter().any(|(_, _, body)| {
            timeout_is(&Cluster::decode(&*body.value).unwrap(), INVALID_TIMEOUT_MS)
        })
    }

    /// Adds or updates clusters; returns the NACK message if any was rejected.
    fn upsert_clusters(&mut self, items: &[(String, String, Any)]) -> Vec<String> {
        let mut errors = Vec::new();
        for (name, version, body) in items {
            let cluster = Cluster::decode(&*body.value).expect("a cluster");
            assert_eq!(&cluster.name, name);
            if is_bad(&cluster) {
                errors.push(format!("{name}: Proto constraint validation failed"));
                continue;
            }
            // Envoy ignores an update identical to the warming cluster or, when none
            // warms, to the active one (envoyproxy/envoy#14598).
            let same = match self.warming.get(name) {
                Some(w) => w == version,
                None => self.active.get(name) == Some(version),
            };
            if same {
                continue;
            }
            self.warming.insert(name.clone(), version.clone());
        }
        errors
    }

    fn remove_cluster(&mut self, name: &str) {
        self.active.remove(name);
        self.warming.remove(name);
        self.endpoints.remove(name);
    }

    fn upsert_endpoints(&mut self, name: &str, version: &str) {
        self.endpoints.insert(name.into(), version.into());
        if let Some(v) = self.warming.remove(name) {
            self.active.insert(name.into(), v);
        }
    }

    fn upsert_route(&mut self, name: &str, version: &str, body: &Any) {
        let config = RouteConfiguration::decode(&*body.value).expect("a route configuration");
        self.routes.insert(name.into(), (version.into(), config));
    }

    /// Names it wants endpoints for: every cluster it has.
    fn eds_names(&self) -> Vec<String> {
        let names: BTreeSet<&String> = self.active.keys().chain(self.warming.keys()).collect();
        names.into_iter().cloned().collect()
    }

    fn rds_names(&self) -> Vec<String> {
        if self.listeners.is_empty() {
            Vec::new()
        } else {
            vec![ROUTE_CONFIG.to_string()]
        }
    }

    /// The safety invariant: every cluster a held route names is in service.
    pub(crate) fn check(&self) -> Result<(), String> {
        for (name, (_, config)) in &self.routes {
            for vh in &config.virtual_hosts {
                for c in virtual_host_clusters(vh) {
                    if !self.active.contains_key(&c) {
                        return Err(format!(
                            "route {name} virtual host {} names {c}, which is not warm \
                             (warming: {:?})",
                            vh.name,
                            self.warming.get(&c)
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether it holds `snapshot` as far as the snapshot can be held: every cluster the
    /// model accepts at its version with its endpoints, no cluster beyond those and the
    /// rejected ones' earlier versions, every virtual host whose clusters are accepted
    /// as the snapshot has it, and the listeners.
    pub(crate) fn converged_to(&self, snapshot: &Snapshot) -> Result<(), String> {
        let clusters = snapshot.resources(ResourceType::Cluster);
        let mut rejected = BTreeSet::new();
        for (name, r) in clusters {
            let c = Cluster::decode(&*r.body.value).unwrap();
            if is_bad(&c) {
                rejected.insert(name.to_string());
                continue;
            }
            if self.active.get(&**name).map(String::as_str) != Some(&*r.version) {
                return Err(format!(
                    "{name}: active {:?}, warming {:?}, want {}",
                    self.active.get(&**name),
                    self.warming.get(&**name),
                    r.version
                ));
            }
            let e = &snapshot.resources(ResourceType::Endpoints)[name];
            if self.endpoints.get(&**name).map(String::as_str) != Some(&*e.version) {
                return Err(format!("{name}: endpoints not at {}", e.version));
            }
        }
        // A cluster that left the snapshot may stay only while a held route names it
        // (a virtual host held back by a rejected cluster).
        let named: BTreeSet<String> = self
            .routes
            .values()
            .flat_map(|(_, c)| c.virtual_hosts.iter().flat_map(virtual_host_clusters))
            .collect();
        for name in self.active.keys().chain(self.warming.keys()) {
            if !clusters.contains_key(name.as_str()) && !named.contains(name) {
                return Err(format!("{name} left the snapshot but is still held"));
            }
        }
        let route = &snapshot.resources(ResourceType::Route)[ROUTE_CONFIG];
        let want = RouteConfiguration::decode(&*route.body.value).unwrap();
        let Some((version, held)) = self.routes.get(ROUTE_CONFIG) else {
            return Err("no route configuration".into());
        };
        for vh in &want.virtual_hosts {
            let cs = virtual_host_clusters(vh);
            if cs.iter().any(|c| rejected.contains(c)) {
                continue;
            }
            if !held.virtual_hosts.contains(vh) {
                return Err(format!(
                    "virtual host {} is not as the snapshot has it",
                    vh.name
                ));
            }
        }
        if rejected.is_empty() && *version != *route.version {
            return Err("route configuration not at the snapshot's version".into());
        }
        let listeners: BTreeMap<String, String> = snapshot
            .resources(ResourceType::Listener)
            .iter()
            .map(|(n, r)| (n.to_string(), r.version.to_string()))
            .collect();
        if self.listeners != listeners {
            return Err("listeners differ".into());
        }
        Ok(())
    }
}

/// What a refused whole response says: nothing that names a resource.
const INVALID_MESSAGE: &str = "Invalid duration: Expected positive duration";

fn nack_message(errors: &[String]) -> String {
    if errors.iter().any(|e| e == INVALID_MESSAGE) {
        return INVALID_MESSAGE.into();
    }
    format!("Error adding/updating cluster(s) {}", errors.join(", "))
}

/// A model Envoy on a state-of-the-world stream.
#[derive(Default)]
pub(crate) struct SotwClient {
    pub envoy: ModelEnvoy,
    pub stream: SotwStream,
    /// The version it last accepted, per type.
    accepted: [String; 4],
    nonce: [String; 4],
    /// The names it last asked for (endpoints and routes), `None` before it asked.
    asked: [Option<Vec<String>>; 4],
    /// Responses received and not yet processed.
    pending: std::collections::VecDeque<(ResourceType, DiscoveryResponse)>,
    /// Its answer to a cluster response, held while clusters warm.
    held_cds_answer: Option<DiscoveryRequest>,
}

fn request(ty: ResourceType, names: &[String], version: &str, nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: ty.type_url().into(),
        resource_names: names.to_vec(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

impl SotwClient {
    /// Opens a new stream (a reconnect when it held anything) with the requests Envoy
    /// sends at once: clusters, endpoints, listeners, routes.
    pub(crate) fn connect(&mut self) {
        self.stream = SotwStream::new();
        self.nonce = Default::default();
        self.asked = Default::default();
        self.pending.clear();
        self.held_cds_answer = None;
        for ty in ResourceType::ALL {
            let names = match ty {
                ResourceType::Endpoints => self.envoy.eds_names(),
                ResourceType::Route => self.envoy.rds_names(),
                _ => Vec::new(),
            };
            if !ty.is_full_state() && names.is_empty() {
                continue;
            }
            let req = request(ty, &names, &self.accepted[ty.index()], "");
            self.stream.on_request(req).expect("a valid request");
            if !ty.is_full_state() {
                self.asked[ty.index()] = Some(names);
            }
        }
    }

    /// Delivers whatever the server sends now and answers each response; returns how
    /// many responses there were.
    /// Takes whatever the server sends now; returns how many responses.
    pub(crate) fn receive(&mut self, snapshot: &Snapshot) -> usize {
        let out = self.stream.poll(snapshot);
        let n = out.len();
        for (ty, _, r) in out {
            self.pending.push_back((ty, r));
        }
        n
    }

    /// Processes and answers the oldest response received; false when there is none.
    pub(crate) fn answer(&mut self) -> Result<bool, String> {
        let Some((ty, r)) = self.pending.pop_front() else {
            return Ok(false);
        };
        self.apply(ty, &r)?;
        Ok(true)
    }

    fn apply(&mut self, ty: ResourceType, r: &DiscoveryResponse) -> Result<(), String> {
        let i = ty.index();
        self.nonce[i] = r.nonce.clone();
        let mut errors = Vec::new();
        match ty {
            ResourceType::Cluster => {
                let items: Vec<(String, String, Any)> = r
                    .resources
                    .iter()
                    .map(|a| {
                        let c = Cluster::decode(&*a.value).unwrap();
                        let v = super::snapshot::Resource::encode(&c.name, &c, vec![]).version;
                        (c.name, v.to_string(), a.clone())
                    })
                    .collect();
                if ModelEnvoy::invalid(&items) {
                    errors = vec![INVALID_MESSAGE.to_string()];
                } else {
                    let keep: BTreeSet<&String> = items.iter().map(|(n, _, _)| n).collect();
                    let gone: Vec<String> = self
                        .envoy
                        .eds_names()
                        .into_iter()
                        .filter(|n| !keep.contains(n))
                        .collect();
                    for name in gone {
                        self.envoy.remove_cluster(&name);
                    }
                    errors = self.envoy.upsert_clusters(&items);
                }
            }
            ResourceType::Endpoints => {
                use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
                for a in &r.resources {
                    let cla = ClusterLoadAssignment::decode(&*a.value).unwrap();
                    let v =
                        super::snapshot::Resource::encode(&cla.cluster_name, &cla, vec![]).version;
                    self.envoy.upsert_endpoints(&cla.cluster_name, &v);
                }
            }
            ResourceType::Listener => {
                use envoy_types::pb::envoy::config::listener::v3::Listener;
                self.envoy.listeners = r
                    .resources
                    .iter()
                    .map(|a| {
                        let l = Listener::decode(&*a.value).unwrap();
                        let v = super::snapshot::Resource::encode(&l.name, &l, vec![]).version;
                        (l.name, v.to_string())
                    })
                    .collect();
            }
            ResourceType::Route => {
                for a in &r.resources {
                    let rc = RouteConfiguration::decode(&*a.value).unwrap();
                    let v = super::snapshot::Resource::encode(&rc.name, &rc, vec![]).version;
                    self.envoy.upsert_route(&rc.name, &v, a);
                }
            }
        }
        self.envoy.check()?;
        let names = self.asked[i].clone().unwrap_or_default();
        let mut req = request(ty, &names, &r.version_info, &r.nonce);
        if !errors.is_empty() {
            req.version_info = self.accepted[i].clone();
            req.error_detail = Some(Status {
                code: 3,
                message: nack_message(&errors),
                details: vec![],
            });
        } else {
            self.accepted[i] = r.version_info.clone();
        }
        // Envoy holds its answer to a cluster response while any cluster warms.
        if ty == ResourceType::Cluster && !self.envoy.warming.is_empty() {
            self.held_cds_answer = Some(req);
        } else {
            self.stream.on_request(req).map_err(|e| e.to_string())?;
        }
        self.resubscribe();
        self.release_cds_answer()?;
        Ok(())
    }

    fn release_cds_answer(&mut self) -> Result<(), String> {
        if self.envoy.warming.is_empty() {
            if let Some(req) = self.held_cds_answer.take() {
                self.stream.on_request(req).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    /// Asks for endpoints and routes again when the names it needs changed.
    fn resubscribe(&mut self) {
        for ty in [ResourceType::Endpoints, ResourceType::Route] {
            let i = ty.index();
            let names = match ty {
                ResourceType::Endpoints => self.envoy.eds_names(),
                _ => self.envoy.rds_names(),
            };
            let changed = match &self.asked[i] {
                None => !names.is_empty(),
                Some(asked) => *asked != names,
            };
            if changed {
                let req = request(ty, &names, &self.accepted[i], &self.nonce[i]);
                self.stream.on_request(req).expect("a valid request");
                self.asked[i] = Some(names);
            }
        }
    }
}

/// A model Envoy on a delta stream.
#[derive(Default)]
pub(crate) struct DeltaClient {
    pub envoy: ModelEnvoy,
    pub stream: DeltaStream,
    /// What it holds per type, name to version, as it declares on reconnect.
    versions: [BTreeMap<String, String>; 4],
    /// The names it subscribed to (endpoints and routes).
    asked: [BTreeSet<String>; 4],
    /// Responses received and not yet processed.
    pending: std::collections::VecDeque<(ResourceType, DeltaDiscoveryResponse)>,
    /// Its answer to a cluster response, held while clusters warm.
    held_cds_answer: Option<DeltaDiscoveryRequest>,
}

impl DeltaClient {
    pub(crate) fn connect(&mut self) {
        self.stream = DeltaStream::new();
        self.asked = Default::default();
        self.pending.clear();
        self.held_cds_answer = None;
        for ty in ResourceType::ALL {
            let names: BTreeSet<String> = match ty {
                ResourceType::Endpoints => self.envoy.eds_names().into_iter().collect(),
                ResourceType::Route => self.envoy.rds_names().into_iter().collect(),
                _ => BTreeSet::new(),
            };
            if !ty.is_full_state() && names.is_empty() {
                continue;
            }
            let req = DeltaDiscoveryRequest {
                type_url: ty.type_url().into(),
                resource_names_subscribe: names.iter().cloned().collect(),
                initial_resource_versions: self.versions[ty.index()]
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                ..Default::default()
            };
            self.stream.on_request(req).expect("a valid request");
            self.asked[ty.index()] = names;
        }
    }

    pub(crate) fn receive(&mut self, snapshot: &Snapshot) -> usize {
        let out = self.stream.poll(snapshot);
        let n = out.len();
        for (ty, _, r) in out {
            self.pending.push_back((ty, r));
        }
        n
    }

    pub(crate) fn answer(&mut self) -> Result<bool, String> {
        let Some((ty, r)) = self.pending.pop_front() else {
            return Ok(false);
        };
        self.apply(ty, &r)?;
        Ok(true)
    }

    fn apply(&mut self, ty: ResourceType, r: &DeltaDiscoveryResponse) -> Result<(), String> {
        let i = ty.index();
        let mut errors = Vec::new();
        match ty {
            ResourceType::Cluster => {
                let items: Vec<(String, String, Any)> = r
                    .resources
                    .iter()
                    .map(|d| {
                        (
                            d.name.clone(),
                            d.version.clone(),
                            d.resource.clone().unwrap(),
                        )
                    })
                    .collect();
                if ModelEnvoy::invalid(&items) {
                    errors = vec![INVALID_MESSAGE.to_string()];
                } else {
                    for name in &r.removed_resources {
                        self.envoy.remove_cluster(name);
                    }
                    errors = self.envoy.upsert_clusters(&items);
                }
            }
            ResourceType::Endpoints => {
                // A removed assignment is an empty one: a cluster warming on it warms.
                for name in &r.removed_resources {
                    self.envoy.endpoints.remove(name);
                    if let Some(v) = self.envoy.warming.remove(name) {
                        self.envoy.active.insert(name.clone(), v);
                    }
                }
                for d in &r.resources {
                    self.envoy.upsert_endpoints(&d.name, &d.version);
                }
            }
            ResourceType::Listener => {
                for name in &r.removed_resources {
                    self.envoy.listeners.remove(name);
                }
                for d in &r.resources {
                    self.envoy
                        .listeners
                        .insert(d.name.clone(), d.version.clone());
                }
            }
            ResourceType::Route => {
                for name in &r.removed_resources {
                    self.envoy.routes.remove(name);
                }
                for d in &r.resources {
                    self.envoy
                        .upsert_route(&d.name, &d.version, d.resource.as_ref().unwrap());
                }
            }
        }
        self.envoy.check()?;
        let mut req = DeltaDiscoveryRequest {
            type_url: ty.type_url().into(),
            response_nonce: r.nonce.clone(),
            ..Default::default()
        };
        // It declares on reconnect what it applied: all of it, all but the rejected, or
        // nothing of a response refused whole.
        if !errors.iter().any(|e| e == INVALID_MESSAGE) {
            for name in &r.removed_resources {
                self.versions[i].remove(name);
            }
            for d in &r.resources {
                if !errors
                    .iter()
                    .any(|e| e.starts_with(&format!("{}:", d.name)))
                {
                    self.versions[i].insert(d.name.clone(), d.version.clone());
                }
            }
        }
        if !errors.is_empty() {
            req.error_detail = Some(Status {
                code: 3,
                message: nack_message(&errors),
                details: vec![],
            });
        }
        // Envoy holds its answer to a cluster response while any cluster warms.
        if ty == ResourceType::Cluster && !self.envoy.warming.is_empty() {
            self.held_cds_answer = Some(req);
        } else {
            self.stream.on_request(req).map_err(|e| e.to_string())?;
        }
        self.resubscribe();
        if self.envoy.warming.is_empty() {
            if let Some(req) = self.held_cds_answer.take() {
                self.stream.on_request(req).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    fn resubscribe(&mut self) {
        for ty in [ResourceType::Endpoints, ResourceType::Route] {
            let i = ty.index();
            let names: BTreeSet<String> = match ty {
                ResourceType::Endpoints => self.envoy.eds_names().into_iter().collect(),
                _ => self.envoy.rds_names().into_iter().collect(),
            };
            if names == self.asked[i] {
                continue;
            }
            let req = DeltaDiscoveryRequest {
                type_url: ty.type_url().into(),
                resource_names_subscribe: names.difference(&self.asked[i]).cloned().collect(),
                resource_names_unsubscribe: self.asked[i].difference(&names).cloned().collect(),
                ..Default::default()
            };
            for gone in self.asked[i].difference(&names) {
                self.versions[i].remove(gone);
            }
            self.stream.on_request(req).expect("a valid request");
            self.asked[i] = names;
        }
    }
}

/// One model client of either protocol.
pub(crate) trait Client {
    fn connect(&mut self);
    /// Takes what the server sends now, without answering yet.
    fn receive(&mut self, snapshot: &Snapshot) -> usize;
    /// Processes and answers the oldest response received, if any.
    fn answer(&mut self) -> Result<bool, String>;
    fn envoy(&self) -> &ModelEnvoy;
    fn settle(&mut self);

    /// Receives and answers everything; returns how many responses there were.
    fn step(&mut self, snapshot: &Snapshot) -> Result<usize, String> {
        let n = self.receive(snapshot);
        while self.answer()? {}
        Ok(n)
    }
}

macro_rules! impl_client {
    ($t:ty) => {
        impl Client for $t {
            fn connect(&mut self) {
                <$t>::connect(self)
            }
            fn receive(&mut self, snapshot: &Snapshot) -> usize {
                <$t>::receive(self, snapshot)
            }
            fn answer(&mut self) -> Result<bool, String> {
                <$t>::answer(self)
            }
            fn envoy(&self) -> &ModelEnvoy {
                &self.envoy
            }
            fn settle(&mut self) {
                self.stream.settle_reconnect()
            }
        }
    };
}

impl_client!(SotwClient);
impl_client!(DeltaClient);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{snapshot_of, Cluster as FixtureCluster, Service};
    use proptest::prelude::*;

    /// One service as the generator draws it: which of two clusters exist, which is
    /// active, and each one's endpoints and settings.
    #[derive(Clone, Debug)]
    struct ServiceDraw {
        /// Per cluster x1, x2: None (absent) or (ports variant, settings variant).
        clusters: [Option<(u8, u8)>; 2],
        active: usize,
    }

    fn service_draw() -> impl Strategy<Value = Option<ServiceDraw>> {
        let cluster = prop::option::weighted(0.7, (0u8..3, 0u8..7));
        prop::option::weighted(0.8, ([cluster.clone(), cluster], 0usize..2)).prop_map(|d| {
            d.and_then(|(clusters, active)| {
                // The active cluster must exist; fall back to the other, else none.
                let active = if clusters[active].is_some() {
                    active
                } else if clusters[1 - active].is_some() {
                    1 - active
                } else {
                    return None;
                };
                Some(ServiceDraw { clusters, active })
            })
        })
    }

    fn snapshot(draws: &[Option<ServiceDraw>]) -> Snapshot {
        let mut services = Vec::new();
        for (i, d) in draws.iter().enumerate() {
            let Some(d) = d else { continue };
            let name = ["a", "b", "c"][i];
            let mut clusters = Vec::new();
            for (k, c) in d.clusters.iter().enumerate() {
                let Some((ports, settings)) = c else { continue };
                clusters.push(FixtureCluster {
                    name: format!("x{}", k + 1),
                    ports: vec![8000 + 10 * k as u16 + *ports as u16],
                    // Two settings variants in seven are ones the model rejects: one
                    // named in the NACK, one that fails the whole response.
                    connect_timeout_ms: match settings {
                        0..=2 => 0,
                        3 | 4 => 5,
                        5 => BAD_TIMEOUT_MS,
                        _ => INVALID_TIMEOUT_MS,
                    },
                });
            }
            services.push(Service {
                name: name.into(),
                hosts: vec![format!("{name}.example")],
                active: format!("x{}", d.active + 1),
                clusters,
            });
        }
        snapshot_of(services)
    }

    #[derive(Clone, Debug)]
    enum Action {
        Publish(Vec<Option<ServiceDraw>>),
        Step,
        /// The server sends; the client has not answered yet.
        Receive,
        /// The client answers its oldest unanswered response.
        Answer,
        Reconnect,
        /// The reconnect wait ends (a timer in the stream task).
        Settle,
    }

    fn action() -> impl Strategy<Value = Action> {
        prop_oneof![
            2 => prop::collection::vec(service_draw(), 3).prop_map(Action::Publish),
            4 => Just(Action::Step),
            2 => Just(Action::Receive),
            2 => Just(Action::Answer),
            1 => Just(Action::Reconnect),
            1 => Just(Action::Settle),
        ]
    }

    fn run(client: &mut dyn Client, actions: &[Action]) -> Result<(), TestCaseError> {
        let mut current = snapshot(&[None, None, None]);
        client.connect();
        for a in actions {
            match a {
                Action::Publish(draws) => current = snapshot(draws),
                Action::Step => {
                    client.step(&current).map_err(TestCaseError::fail)?;
                }
                Action::Receive => {
                    client.receive(&current);
                }
                Action::Answer => {
                    client.answer().map_err(TestCaseError::fail)?;
                }
                Action::Reconnect => client.connect(),
                Action::Settle => client.settle(),
            }
        }
        // The reconnect wait ends in time, whatever the Envoy declared; the client
        // answers what it holds.
        client.settle();
        while client.answer().map_err(TestCaseError::fail)? {}
        let mut responses = 0;
        for _ in 0..40 {
            let n = client.step(&current).map_err(TestCaseError::fail)?;
            responses += n;
            if n == 0 {
                break;
            }
        }
        prop_assert_eq!(client.step(&current).map_err(TestCaseError::fail)?, 0);
        prop_assert!(responses <= 40, "{} responses to converge", responses);
        client
            .envoy()
            .converged_to(&current)
            .map_err(TestCaseError::fail)?;
        Ok(())
    }

    proptest! {
        // PROPTEST_CASES=20000 for a long hunt; 400 in the test suite.
        #![proptest_config(ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(400),
            ..ProptestConfig::default()
        })]

        #[test]
        fn sotw_never_routes_to_a_cold_cluster_and_converges(
            actions in prop::collection::vec(action(), 1..60)
        ) {
            run(&mut SotwClient::default(), &actions)?;
        }

        #[test]
        fn delta_never_routes_to_a_cold_cluster_and_converges(
            actions in prop::collection::vec(action(), 1..60)
        ) {
            run(&mut DeltaClient::default(), &actions)?;
        }
    }

    /// Found by the proptest: an unnamed NACK starts a search for the culprit; a new
    /// snapshot that drops an untried suspect re-split the suspects and offered again
    /// the set the Envoy had just rejected whole, which is never sent twice: the search
    /// stalled and a valid new cluster (`a/x2`) never reached the Envoy.
    #[test]
    fn delta_bisection_survives_a_snapshot_change() {
        let d = |c: [Option<(u8, u8)>; 2], active: usize| {
            Some(ServiceDraw {
                clusters: c,
                active,
            })
        };
        use Action::*;
        let actions = vec![
            Publish(vec![None, None, d([None, Some((0, 0))], 1)]),
            Step,
            Step,
            Step,
            Publish(vec![None, None, None]),
            Publish(vec![
                d([Some((0, 6)), Some((0, 0))], 0),
                d([None, Some((0, 0))], 1),
                d([Some((0, 0)), None], 0),
            ]),
            Step,
            Step,
            Publish(vec![
                d([Some((0, 6)), Some((0, 0))], 0),
                None,
                d([Some((0, 0)), None], 0),
            ]),
        ];
        run(&mut DeltaClient::default(), &actions).unwrap();
        run(&mut SotwClient::default(), &actions).unwrap();
    }

    /// Found by the proptest: an Envoy that rejected a cluster, reconnects holding
    /// another one, and is then offered only a cluster it rejects whole.
    #[test]
    fn a_reconnected_envoy_drops_a_cluster_that_left_while_the_rest_is_rejected() {
        let d = |c: [Option<(u8, u8)>; 2], active: usize| {
            Some(ServiceDraw {
                clusters: c,
                active,
            })
        };
        use Action::*;
        let actions = vec![
            Publish(vec![
                d([Some((0, 5)), None], 0),
                None,
                d([None, Some((0, 0))], 1),
            ]),
            Step,
            Reconnect,
            Publish(vec![d([Some((0, 6)), None], 0), None, None]),
        ];
        run(&mut DeltaClient::default(), &actions).unwrap();
        run(&mut SotwClient::default(), &actions).unwrap();
    }
}

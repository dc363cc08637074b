//! The body of every fuzz target: one function per parser that takes outside input, fed
//! arbitrary bytes. The cargo-fuzz targets in `fuzz/fuzz_targets/` include this file
//! (`#[path]`), and `tests/xds/fuzz_corpus.rs` replays every corpus file through the same
//! functions on the stable toolchain, so what the fuzzers found keeps being checked.
//!
//! Each body must never panic, whatever the bytes; it panics only when an invariant it
//! checks does not hold (that is the finding). What each checks:
//!
//! - [`services_yaml`]: `services.yaml` → a valid model (or an error with a message), whose
//!   overrides give in-range policies, and which the pipeline turns into a consistent
//!   snapshot;
//! - [`config_yaml`]: `ray-xds.yaml` through `Config::load` → an error with a message, or
//!   in-range policies and gateway settings that give a consistent snapshot;
//! - [`dashboard_json`]: the dashboard's `/api/serve/applications/` → proxies sorted,
//!   each address once; discovery publishes only what the address policy lets through,
//!   and it and the pipeline (switchover included) keep the model valid and the snapshot
//!   consistent;
//! - [`routes`]: the `/-/routes` body → route prefixes that health reads the documented
//!   way (a healthy proxy missing a RUNNING application's route drains);
//! - [`kubernetes_objects`]: JSON objects as the watches deliver them → decoded
//!   RayServices and pods, the pure build, the incremental index equal to it, annotations
//!   giving valid overrides; bytes that are not JSON are read as `name=value` annotation
//!   lines;
//! - [`xds_requests`]: a sequence of `DiscoveryRequest` / `DeltaDiscoveryRequest`
//!   messages (see [`XdsOp`] for the framing) fed to the sans-IO stream state machines
//!   against three snapshots: each request is answered or refused with a protocol error,
//!   at most one response per type is in flight, responses are well formed, and once the
//!   Envoy ACKs everything the stream goes quiet.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use prost::Message;
use ray_xds::config::{Config, GatewaySettings, ServeArgs};
use ray_xds::live::dashboard::{AppStatus, Application, ServeStatus};
use ray_xds::live::dashboards::{ClusterDashboard, DashboardStates};
use ray_xds::live::health::{assess, EndpointHealth, Facts};
use ray_xds::live::probe::{ProbeState, ProxyProbe};
use ray_xds::live::prober::ProbeStates;
use ray_xds::model::Model;
use ray_xds::pipeline::{Event as PipelineEvent, Inputs, Pipeline};
use ray_xds::policy::Policies;
use ray_xds::source::kubernetes::annotations;
use ray_xds::source::kubernetes::build::{build, Built};
use ray_xds::source::kubernetes::index::Index;
use ray_xds::source::kubernetes::objects::{PodObject, RayServiceObject};
use ray_xds::xds::delta::DeltaStream;
use ray_xds::xds::sotw::SotwStream;
use ray_xds::xds::{AdsProtocol, Event, ResourceType, Snapshot};

/// A fuzz target's body.
pub type Body = fn(&[u8]);

/// Every target: its name (the file in `fuzz/fuzz_targets/`, the folder in
/// `fuzz/corpus/`) and its body.
pub const TARGETS: &[(&str, Body)] = &[
    ("services_yaml", services_yaml),
    ("config_yaml", config_yaml),
    ("dashboard_json", dashboard_json),
    ("routes", routes),
    ("kubernetes_objects", kubernetes_objects),
    ("xds_requests", xds_requests),
];

/// The time every pipeline build runs at (builds are pure: the clock is an input).
fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

// ---- services.yaml ----

/// `services.yaml`, read as the file source reads it (lossy UTF-8).
pub fn services_yaml(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match ray_xds::source::file::parse(Path::new("services.yaml"), &text) {
        Ok(model) => {
            assert_valid(&model);
            for service in model.services() {
                let o = &service.policy.overrides;
                let d = Policies::default();
                let effective = Policies {
                    probe: d.probe.with(&o.probe),
                    traffic: d.traffic.with(&o.traffic),
                    switchover: d.switchover.with(&o.switchover),
                    ..d
                };
                if let Err(e) = in_range(&effective) {
                    panic!(
                        "{}: accepted overrides give a policy out of range: {e}",
                        service.key()
                    );
                }
            }
            publish(
                &model,
                Policies::default(),
                GatewaySettings::default(),
                &DashboardStates::default(),
            );
        }
        Err(e) => assert_message(&e.to_string()),
    }
}

// ---- ray-xds.yaml ----

/// `ray-xds.yaml` through `Config::load`, the real entry point (it reads the file: the
/// bytes go to a temporary file first, as they are).
pub fn config_yaml(data: &[u8]) {
    let path = std::env::temp_dir().join(format!(
        "ray-xds-fuzz-config-{}-{:?}.yaml",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&path, data).expect("writing the config file to fuzz");
    let args = ServeArgs {
        config: Some(path.clone()),
        ..Default::default()
    };
    let loaded = Config::load(&args);
    let _ = std::fs::remove_file(&path);
    match loaded {
        Ok(config) => {
            if let Err(e) = in_range(&config.policies) {
                panic!("an accepted config gives a policy out of range: {e}");
            }
            assert!(ray_xds::config::XDS_MAX_MESSAGE_BYTES_RANGE
                .contains(&config.xds_max_message_bytes));
            assert!(!config.gateway.connect_timeout.is_zero());
            let model = parsed_model(SERVICES_A);
            publish(
                &model,
                config.policies.clone(),
                config.gateway.clone(),
                &DashboardStates::default(),
            );
        }
        Err(e) => assert_message(&e.to_string()),
    }
}

// ---- the dashboard's JSON ----

/// The dashboard's address: in the network of the Ray 2.60 captures' proxies, so that
/// the address policy lets them through.
const DASHBOARD_IP: &str = "192.0.2.1";
const DASHBOARD_URL: &str = "http://192.0.2.1:8265";

/// `GET /api/serve/applications/`, then what the rest of ray-xds does with the answer.
pub fn dashboard_json(data: &[u8]) {
    let status = match ray_xds::live::dashboard::parse(data) {
        Ok(status) => status,
        Err(e) => {
            assert_eq!(e.metric_label(), "malformed", "{e}");
            assert_message(&e.to_string());
            return;
        }
    };
    for pair in status.http_proxies.windows(2) {
        assert!(
            pair[0].address < pair[1].address,
            "http_proxies not sorted, or an address twice: {} then {}",
            pair[0].address,
            pair[1].address
        );
    }
    for p in &status.http_proxies {
        if p.status.is_some() {
            assert!(status.proxy_status_at(p.address).is_some());
        }
    }
    let _ = (status.all_running(), status.route_prefixes());

    // A RayService whose two clusters discover their proxies from this dashboard (the
    // pending one's RUNNING applications let the switchover move).
    let model = parsed_model(&format!(
        "rayservices:
  - name: fuzz
    active_cluster: a
    pending_cluster: b
    clusters:
      - {{ name: a, dashboard: \"{DASHBOARD_URL}\" }}
      - {{ name: b, dashboard: \"{DASHBOARD_URL}\" }}
"
    ));
    let mut dashboards = DashboardStates::default();
    for cluster in ["a", "b"] {
        let mut d = ClusterDashboard::new(DASHBOARD_URL.into());
        d.status = Some(status.clone().into());
        dashboards
            .clusters
            .insert(format!("default/fuzz/{cluster}"), d);
    }
    let policy = ray_xds::model::AddressPolicy::default();
    let discovered = ray_xds::live::discovery::discover(&model, &dashboards, &policy);
    for refused in &discovered.refused {
        assert_message(&refused.reason);
    }
    let effective = discovered.model;
    assert_valid(&effective);
    // Only what the address policy lets through is published: never an address that is
    // no proxy's, nothing outside the dashboard's network.
    let origin = ray_xds::model::ProxyOrigin::Dashboard(Some(DASHBOARD_IP.parse().unwrap()));
    for proxy in effective.proxies() {
        if let Err(why) = policy.check(proxy.address, origin) {
            panic!("discovered proxy {} published: {why:?}", proxy.address);
        }
    }
    publish(
        &effective,
        Policies::default(),
        GatewaySettings::default(),
        &dashboards,
    );
}

// ---- /-/routes ----

/// A proxy's `GET /-/routes` body, then how health reads it: a proxy of a cluster whose
/// dashboard has `hello` RUNNING at `/hello`, next to one that serves it.
pub fn routes(data: &[u8]) {
    let parsed = ray_xds::live::prober::parse_routes(data);
    if let Some(routes) = &parsed {
        assert!(
            serde_json::from_slice::<serde_json::Value>(data)
                .ok()
                .is_some_and(|v| v.is_object()),
            "routes read from a body that is not a JSON object: {routes:?}"
        );
    }
    let model = parsed_model(
        "rayservices:
  - name: fuzz
    active_cluster: a
    head_proxy: include
    clusters:
      - name: a
        proxies:
          - { address: 10.0.0.1:8000, node_type: worker }
          - { address: 10.0.0.2:8000, node_type: worker }
",
    );
    let fuzzed: SocketAddr = "10.0.0.1:8000".parse().unwrap();
    let serving: SocketAddr = "10.0.0.2:8000".parse().unwrap();
    let mut probes = ProbeStates {
        complete: true,
        ..Default::default()
    };
    for (address, routes) in [
        (fuzzed, parsed.clone()),
        (serving, Some(BTreeSet::from(["/hello".to_string()]))),
    ] {
        let mut probe = ProxyProbe::new(now());
        probe.state = ProbeState::Healthy;
        probe.routes = routes.map(std::sync::Arc::new);
        probes.proxies.insert(address, probe);
    }
    let mut dashboard = ClusterDashboard::new("http://10.0.0.1:8265".into());
    dashboard.status = Some(std::sync::Arc::new(ServeStatus {
        applications: BTreeMap::from([(
            "hello".to_string(),
            Application {
                status: AppStatus::Running,
                route_prefix: Some("/hello".into()),
                message: String::new(),
                capacity: None,
                deployed_at: None,
                resizing: false,
                config_digest: None,
            },
        )]),
        ..Default::default()
    }));
    let dashboards = DashboardStates {
        clusters: BTreeMap::from([("default/fuzz/a".to_string(), dashboard)]),
    };
    let health = assess(&model, &probes, &dashboards, Facts::default());
    let cluster = "default/fuzz/a";
    assert_eq!(health.health(cluster, serving), EndpointHealth::Healthy);
    let serves_hello = parsed.as_ref().is_some_and(|r| r.contains("/hello"));
    let expected = if serves_hello {
        EndpointHealth::Healthy
    } else {
        EndpointHealth::Draining
    };
    assert_eq!(
        health.health(cluster, fuzzed),
        expected,
        "routes {parsed:?}"
    );
}

// ---- Kubernetes objects and annotations ----

/// JSON as the watches deliver it: one object, an array of them, or a list (`items`).
/// Each object is decoded as its `kind` says (both kinds when it has none), then built,
/// indexed and annotated. Bytes that are not JSON are annotation lines, `name=value`
/// (the `ray-xds.io/` prefix added when missing).
pub fn kubernetes_objects(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        let text = String::from_utf8_lossy(data);
        let map: BTreeMap<String, String> = text
            .lines()
            .filter_map(|line| line.split_once('='))
            .map(|(k, v)| {
                let key = if k.starts_with(annotations::PREFIX) {
                    k.to_string()
                } else {
                    format!("{}{k}", annotations::PREFIX)
                };
                (key, v.to_string())
            })
            .collect();
        check_annotations(&map);
        return;
    };
    let items = match value {
        serde_json::Value::Array(items) => items,
        serde_json::Value::Object(mut object) => match object.remove("items") {
            Some(serde_json::Value::Array(items)) => items,
            Some(other) => {
                object.insert("items".into(), other);
                vec![serde_json::Value::Object(object)]
            }
            None => vec![serde_json::Value::Object(object)],
        },
        _ => return,
    };
    let mut index = Index::default();
    let mut rayservices: BTreeMap<(String, String), RayServiceObject> = BTreeMap::new();
    let mut pods: BTreeMap<(String, String), PodObject> = BTreeMap::new();
    for item in items {
        let Ok(object) = serde_json::from_value::<kube::core::DynamicObject>(item) else {
            continue;
        };
        if let Some(map) = &object.metadata.annotations {
            check_annotations(map);
        }
        let kind = object.types.as_ref().map(|t| t.kind.as_str());
        if kind != Some("Pod") {
            match RayServiceObject::decode(&object) {
                Ok(r) => {
                    index.apply_rayservice(r.clone());
                    rayservices.insert(r.key(), r);
                }
                Err(why) => assert_message(&why),
            }
        }
        if kind.is_none() || kind == Some("Pod") {
            match PodObject::decode(&object) {
                Ok(p) => {
                    assert_ne!(p.serve_port, 0);
                    assert_ne!(p.dashboard_port, 0);
                    index.apply_pod(p.clone());
                    pods.insert(p.key(), p);
                }
                Err(why) => assert_message(&why),
            }
        }
    }
    let whole = build(rayservices.values(), pods.values(), &Default::default());
    assert_valid(&whole.model);
    for p in &whole.problems {
        assert_message(&p.message);
        assert_ne!(
            p.object, "model",
            "build assembled services that do not make a model: {}",
            p.message
        );
    }
    let incremental = index.built();
    assert_same_build(&incremental, &whole);
    publish(
        &whole.model,
        Policies::default(),
        GatewaySettings::default(),
        &DashboardStates::default(),
    );
}

fn check_annotations(map: &BTreeMap<String, String>) {
    let read = annotations::read(map);
    if let Err(e) = read.policy.overrides.validate() {
        panic!("annotations gave overrides out of range: {e} (from {map:?})");
    }
    if let Some(hosts) = &read.hosts {
        assert!(!hosts.is_empty());
        assert!(hosts.iter().all(|h| !h.is_empty() && h.trim() == h));
    }
    for (key, why) in &read.problems {
        assert!(map.contains_key(key) || key.starts_with(annotations::PREFIX));
        assert_message(why);
    }
}

fn assert_same_build(incremental: &Built, whole: &Built) {
    assert_eq!(
        incremental.model, whole.model,
        "the index's model differs from the whole build"
    );
    assert_eq!(incremental.problems, whole.problems);
    assert_eq!(incremental.unrouted, whole.unrouted);
    assert_eq!(incremental.hints, whole.hints);
}

// ---- xDS requests ----

/// One step of an [`xds_requests`] input. The input is one byte (even: state of the
/// world, odd: delta), then records of an op byte, a little-endian `u16` length and that
/// many bytes of payload (cut short at the end of the input). The op's low three bits say
/// what the record does, its high bits pick a resource type or snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdsOp {
    /// 0: the payload decoded as the protocol's request, sent as it is.
    Request = 0,
    /// 1: the same, with the type URL of the type the high bits pick.
    Typed = 1,
    /// 2: the payload, typed, answering the last response of that type: its nonce (and,
    /// in state of the world, its version): an ACK, or a NACK if it has `error_detail`.
    Answer = 2,
    /// 3: the snapshot the high bits pick becomes the current one.
    Snapshot = 3,
    /// 4: the wait for a reconnected Envoy's declarations ends.
    Settle = 4,
    /// 5: the stream is only polled.
    Poll = 5,
    /// 6: everything `/debug/clients` and the switchover read of the stream.
    Inspect = 6,
    /// 7: as 0.
    Request2 = 7,
}

/// An [`xds_requests`] input: `delta` or not, then each `(op, type or snapshot, payload)`.
pub fn xds_input(delta: bool, records: &[(XdsOp, u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = vec![u8::from(delta)];
    for (op, high, payload) in records {
        out.push(*op as u8 | (high << 3));
        let len = u16::try_from(payload.len()).expect("a payload fits in u16");
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(payload);
    }
    out
}

/// The snapshots an [`xds_requests`] stream is served: two RayServices (one with a
/// pending cluster), then an upgrade that dropped a cluster and changed another's
/// settings, then nothing.
pub fn xds_snapshots() -> &'static [Snapshot; 3] {
    static SNAPSHOTS: OnceLock<[Snapshot; 3]> = OnceLock::new();
    SNAPSHOTS.get_or_init(|| {
        let of = |text: &str| {
            let mut p = Pipeline::new(Policies::default(), GatewaySettings::default());
            let model = Arc::new(parsed_model(text));
            let out = p.build(
                &Inputs {
                    model: &model,
                    probes: &healthy(&model),
                    dashboards: &DashboardStates::default(),
                    envoys: &(),
                },
                now(),
            );
            Arc::unwrap_or_clone(out.snapshot)
        };
        [of(SERVICES_A), of(SERVICES_B), of("rayservices: []\n")]
    })
}

pub fn xds_requests(data: &[u8]) {
    let Some((&first, records)) = data.split_first() else {
        return;
    };
    if first % 2 == 0 {
        drive::<SotwStream>(SotwStream::new(), records);
    } else {
        drive::<DeltaStream>(DeltaStream::new(), records);
    }
}

/// What the driver needs of a protocol's messages.
trait Wire: AdsProtocol {
    fn decode(bytes: &[u8]) -> Option<Self::Request>;
    fn type_url(request: &Self::Request) -> &str;
    fn nonce(request: &Self::Request) -> &str;
    fn set_type(request: &mut Self::Request, ty: ResourceType);
    /// Makes `request` answer `response`.
    fn answer(request: &mut Self::Request, response: &Self::Response);
    /// The ACK of `response` by an Envoy that subscribes to `names` of `ty` (`None`: a
    /// wildcard).
    fn ack(
        ty: ResourceType,
        response: &Self::Response,
        names: Option<Vec<Arc<str>>>,
    ) -> Self::Request;
    /// Checks a response of `ty`; returns its nonce.
    fn check(ty: ResourceType, count: usize, response: &Self::Response) -> String;
}

impl Wire for SotwStream {
    fn decode(bytes: &[u8]) -> Option<DiscoveryRequest> {
        DiscoveryRequest::decode(bytes).ok()
    }
    fn type_url(r: &DiscoveryRequest) -> &str {
        &r.type_url
    }
    fn nonce(r: &DiscoveryRequest) -> &str {
        &r.response_nonce
    }
    fn set_type(r: &mut DiscoveryRequest, ty: ResourceType) {
        r.type_url = ty.type_url().into();
    }
    fn answer(r: &mut DiscoveryRequest, response: &DiscoveryResponse) {
        r.response_nonce = response.nonce.clone();
        if r.error_detail.is_none() {
            r.version_info = response.version_info.clone();
        }
    }
    fn ack(
        ty: ResourceType,
        r: &DiscoveryResponse,
        names: Option<Vec<Arc<str>>>,
    ) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: ty.type_url().into(),
            version_info: r.version_info.clone(),
            response_nonce: r.nonce.clone(),
            resource_names: match names {
                None => vec!["*".into()],
                Some(names) => names.iter().map(|n| n.to_string()).collect(),
            },
            ..Default::default()
        }
    }
    fn check(ty: ResourceType, count: usize, r: &DiscoveryResponse) -> String {
        assert_eq!(r.type_url, ty.type_url());
        assert_eq!(count, r.resources.len());
        for any in &r.resources {
            assert_eq!(any.type_url, ty.type_url(), "a resource of another type");
        }
        r.nonce.clone()
    }
}

impl Wire for DeltaStream {
    fn decode(bytes: &[u8]) -> Option<DeltaDiscoveryRequest> {
        DeltaDiscoveryRequest::decode(bytes).ok()
    }
    fn type_url(r: &DeltaDiscoveryRequest) -> &str {
        &r.type_url
    }
    fn nonce(r: &DeltaDiscoveryRequest) -> &str {
        &r.response_nonce
    }
    fn set_type(r: &mut DeltaDiscoveryRequest, ty: ResourceType) {
        r.type_url = ty.type_url().into();
    }
    fn answer(r: &mut DeltaDiscoveryRequest, response: &DeltaDiscoveryResponse) {
        r.response_nonce = response.nonce.clone();
    }
    fn ack(
        ty: ResourceType,
        r: &DeltaDiscoveryResponse,
        _: Option<Vec<Arc<str>>>,
    ) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: ty.type_url().into(),
            response_nonce: r.nonce.clone(),
            ..Default::default()
        }
    }
    fn check(ty: ResourceType, count: usize, r: &DeltaDiscoveryResponse) -> String {
        assert_eq!(r.type_url, ty.type_url());
        assert_eq!(count, r.resources.len() + r.removed_resources.len());
        let mut names = HashSet::new();
        for resource in &r.resources {
            assert!(
                names.insert(resource.name.as_str()),
                "{} sent twice in one response",
                resource.name
            );
            let any = resource.resource.as_ref().expect("a resource has a body");
            assert_eq!(any.type_url, ty.type_url(), "a resource of another type");
        }
        for removed in &r.removed_resources {
            assert!(
                !names.contains(removed.as_str()),
                "{removed} both sent and removed"
            );
        }
        r.nonce.clone()
    }
}

/// What the driver knows of a stream: the last response of each type, the nonce of the
/// one still unanswered, every nonce sent.
struct Sent<P: Wire> {
    last: [Option<P::Response>; 4],
    in_flight: [Option<String>; 4],
    nonces: HashSet<String>,
}

impl<P: Wire> Sent<P> {
    fn new() -> Self {
        Sent {
            last: Default::default(),
            in_flight: Default::default(),
            nonces: HashSet::new(),
        }
    }

    /// Polls the stream and checks what it sends; returns how many responses went.
    fn poll(&mut self, stream: &mut P, snapshot: &Snapshot) -> usize {
        let out = stream.poll(snapshot);
        let sent = out.len();
        for (ty, count, response) in out {
            let nonce = P::check(ty, count, &response);
            assert!(!nonce.is_empty(), "a response without a nonce");
            assert!(
                self.nonces.insert(nonce.clone()),
                "nonce {nonce} used twice"
            );
            if let Some(previous) = &self.in_flight[ty.index()] {
                panic!("a second {ty:?} response while {previous} is unanswered");
            }
            self.in_flight[ty.index()] = Some(nonce);
            self.last[ty.index()] = Some(response);
        }
        sent
    }

    /// Sends `request`; `false` when the stream refused it (and so ended).
    fn send(&mut self, stream: &mut P, request: P::Request) -> bool {
        let ty = ResourceType::from_type_url(P::type_url(&request));
        let nonce = P::nonce(&request).to_string();
        match stream.on_request(request) {
            Ok(event) => {
                let ty = ty.expect("a request of an unknown type was taken");
                let event_ty = match &event {
                    Event::Subscribed(t) | Event::Stale(t) => *t,
                    Event::Ack { ty, .. } | Event::Nack { ty, .. } => *ty,
                };
                assert_eq!(event_ty, ty, "{event:?} for a request of {ty:?}");
                if let Event::Nack { message, .. } = &event {
                    let _ = ray_xds::xds::clip(message, 1024);
                }
                if self.in_flight[ty.index()].as_deref() == Some(nonce.as_str()) {
                    self.in_flight[ty.index()] = None;
                }
                true
            }
            // A request the server refuses ends the stream, with this error.
            Err(e) => {
                assert_message(&e.to_string());
                let _ = e.metric_label();
                false
            }
        }
    }

    /// From here on the Envoy ACKs everything: the stream must go quiet within a few
    /// rounds, whatever came before (a stream that keeps sending loops at the Envoy's pace).
    fn settle(&mut self, stream: &mut P, snapshot: &Snapshot) {
        stream.settle_reconnect();
        for _ in 0..16 {
            let mut acked = false;
            for ty in ResourceType::ALL {
                if self.in_flight[ty.index()].is_none() {
                    continue;
                }
                let response = self.last[ty.index()].as_ref().expect("sent");
                let names = stream.subscription(ty).flatten();
                let ack = P::ack(ty, response, names);
                assert!(self.send(stream, ack), "an ACK was refused");
                assert!(
                    self.in_flight[ty.index()].is_none(),
                    "an ACK left its {ty:?} response unanswered"
                );
                acked = true;
            }
            if self.poll(stream, snapshot) == 0 && !acked {
                return;
            }
        }
        panic!("an Envoy that ACKs everything is still being sent responses after 16 rounds");
    }
}

fn drive<P: Wire>(mut stream: P, mut records: &[u8]) {
    let snapshots = xds_snapshots();
    let mut current = &snapshots[0];
    let mut sent = Sent::<P>::new();
    while let Some((&op, rest)) = records.split_first() {
        let len = match rest {
            [lo, hi, ..] => usize::from(u16::from_le_bytes([*lo, *hi])),
            _ => 0,
        };
        let rest = rest.get(2..).unwrap_or_default();
        let (payload, next) = rest.split_at(len.min(rest.len()));
        records = next;
        let high = usize::from(op >> 3);
        let ty = ResourceType::ALL[high % 4];
        let request = match op & 7 {
            0 | 7 => Some(P::decode(payload)),
            1 => Some(P::decode(payload).map(|mut r| {
                P::set_type(&mut r, ty);
                r
            })),
            2 => Some(P::decode(payload).map(|mut r| {
                P::set_type(&mut r, ty);
                if let Some(response) = &sent.last[ty.index()] {
                    P::answer(&mut r, response);
                }
                r
            })),
            3 => {
                current = &snapshots[high % snapshots.len()];
                None
            }
            4 => {
                stream.settle_reconnect();
                None
            }
            6 => {
                inspect(&stream, current);
                None
            }
            _ => None,
        };
        if let Some(request) = request {
            // A message that does not decode ends the stream (the server's codec).
            let Some(request) = request else { return };
            if !sent.send(&mut stream, request) {
                return;
            }
        }
        sent.poll(&mut stream, current);
    }
    inspect(&stream, current);
    sent.settle(&mut stream, current);
    inspect(&stream, current);
}

/// Reads everything the server's views and the switchover read of a stream.
fn inspect<P: AdsProtocol>(stream: &P, snapshot: &Snapshot) {
    let _ = (stream.node(), stream.status(), stream.awaiting_reconnect());
    for ty in ResourceType::ALL {
        let _ = (stream.held(ty), stream.subscription(ty));
    }
    for name in snapshot.resources(ResourceType::Cluster).keys() {
        let _ = (stream.warmed(name), stream.rejected(name));
    }
}

/// A DiscoveryRequest as Envoy sends it, encoded (for seeds).
pub fn sotw_request(ty: ResourceType, names: &[&str], node: bool, error: Option<&str>) -> Vec<u8> {
    DiscoveryRequest {
        type_url: ty.type_url().into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        node: node.then(envoy_node),
        error_detail: error.map(|m| envoy_types::pb::google::rpc::Status {
            code: 3,
            message: m.into(),
            details: vec![],
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// A DeltaDiscoveryRequest as Envoy sends it, encoded (for seeds).
pub fn delta_request(
    ty: ResourceType,
    subscribe: &[&str],
    unsubscribe: &[&str],
    initial: &[(&str, &str)],
    node: bool,
    error: Option<&str>,
) -> Vec<u8> {
    DeltaDiscoveryRequest {
        type_url: ty.type_url().into(),
        resource_names_subscribe: subscribe.iter().map(|n| n.to_string()).collect(),
        resource_names_unsubscribe: unsubscribe.iter().map(|n| n.to_string()).collect(),
        initial_resource_versions: initial
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
        node: node.then(envoy_node),
        error_detail: error.map(|m| envoy_types::pb::google::rpc::Status {
            code: 3,
            message: m.into(),
            details: vec![],
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

fn envoy_node() -> Node {
    use envoy_types::pb::envoy::config::core::v3::node::UserAgentVersionType;
    Node {
        id: "gateway-0".into(),
        cluster: "ray-gateway".into(),
        user_agent_name: "envoy".into(),
        user_agent_version_type: Some(UserAgentVersionType::UserAgentVersion("1.40.0".into())),
        ..Default::default()
    }
}

// ---- shared ----

/// Two RayServices, one upgrading (the first xDS snapshot; the model `ray-xds.yaml` is
/// checked with).
pub const SERVICES_A: &str = "rayservices:
  - name: text-ml
    namespace: ml
    active_cluster: text-ml-a
    pending_cluster: text-ml-b
    clusters:
      - name: text-ml-a
        dashboard: http://10.0.0.5:8265
        proxies:
          - { address: 10.0.0.5:8000, node_type: head }
          - { address: 10.0.0.6:8000, node_type: worker }
      - name: text-ml-b
        proxies: [ { address: 10.0.1.5:8000, node_type: head } ]
  - name: demo
    hosts: [demo.example.com]
    active_cluster: demo-a
    clusters:
      - name: demo-a
        proxies: [ { address: \"[::1]:8000\", node_type: worker } ]
";

/// After the upgrade: the old cluster gone, the demo's settings and proxies changed.
pub const SERVICES_B: &str = "rayservices:
  - name: text-ml
    namespace: ml
    active_cluster: text-ml-b
    clusters:
      - name: text-ml-b
        proxies: [ { address: 10.0.1.5:8000, node_type: head } ]
  - name: demo
    hosts: [demo.example.com]
    active_cluster: demo-a
    traffic: { retries: 1, idempotent: true }
    clusters:
      - name: demo-a
        proxies:
          - { address: \"[::1]:8000\", node_type: worker }
          - { address: \"[::1]:8001\", node_type: worker }
";

fn parsed_model(text: &str) -> Model {
    ray_xds::source::file::parse(Path::new("fuzz.yaml"), text).expect("a fixed model parses")
}

/// Every proxy of `model` probed healthy, serving `/`.
fn healthy(model: &Model) -> ProbeStates {
    let mut probes = ProbeStates {
        complete: true,
        ..Default::default()
    };
    for proxy in model.proxies() {
        let mut probe = ProxyProbe::new(now());
        probe.state = ProbeState::Healthy;
        probe.routes = Some(std::sync::Arc::new(BTreeSet::from(["/".to_string()])));
        probes.proxies.insert(proxy.address, probe);
    }
    probes
}

/// A model is valid: building it again from its services gives it back.
fn assert_valid(model: &Model) {
    match Model::new(model.services().to_vec()) {
        Ok(again) => assert_eq!(&again, model, "a model is not in its canonical order"),
        Err(e) => panic!("an invalid model was produced: {e}"),
    }
}

/// Every setting of `policies` is in its range (each checked by its own rule; the mode
/// is left out of the switchover's, so that an atomic policy's unused steps and interval
/// are ranged too instead of refused).
fn in_range(policies: &Policies) -> Result<(), String> {
    let mut switchover = policies.switchover.as_global();
    switchover.mode = None;
    policies.probe.as_global().validate()?;
    policies.dashboard.as_global().validate()?;
    policies.traffic.as_global().validate()?;
    switchover.validate()
}

fn assert_message(message: &str) {
    assert!(!message.trim().is_empty(), "an error without a message");
}

/// The pipeline turns `model` into a snapshot: first with no proxy probed yet, then with
/// every proxy healthy, then an hour later; the snapshot is consistent every time.
fn publish(
    model: &Model,
    policies: Policies,
    gateway: GatewaySettings,
    dashboards: &DashboardStates,
) {
    let mut pipeline = Pipeline::new(policies, gateway);
    let model = Arc::new(model.clone());
    let healthy = healthy(&model);
    for (probes, at) in [
        (&ProbeStates::default(), now()),
        (&healthy, now() + Duration::from_secs(1)),
        (&healthy, now() + Duration::from_secs(3600)),
    ] {
        let out = pipeline.build(
            &Inputs {
                model: &model,
                probes,
                dashboards,
                envoys: &(),
            },
            at,
        );
        for event in &out.events {
            if let PipelineEvent::Inconsistent(why) = event {
                panic!("the pipeline built an inconsistent snapshot: {why}");
            }
        }
    }
}

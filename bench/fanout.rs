//! xDS fan-out benchmark: N simulated ADS clients on a model of S RayServices × C clusters
//! × P proxies, served by a real `ray-xds` process and, side by side under the same
//! clients, by a peer: rust-control-plane 0.1.2 (`bench/peer/`, a Rust port of
//! go-control-plane's snapshot cache and server; state of the world only) serving the
//! very resources ray-xds served. One endpoint changes, and we measure how long until
//! every client has it, each server's CPU per push and its memory per connected stream.
//!
//! `cargo bench --bench fanout -- --streams 1000` runs both servers and both protocols
//! at that scale (`--streams` may be repeated); `-- --help` lists the rest.
//!
//! The arms differ only in the server. ray-xds reads the services file (inotify, parse,
//! probe the new proxy, translate); the peer reads a file of the resources ray-xds served
//! for the same change (inotify, decode, `set_snapshot` for every node), so the peer does
//! less work per change than ray-xds. Both are timed from their file's write.
//!
//! Everything runs on loopback. The clients run in this process, so on a 2-core machine
//! they compete with the server for CPU: the figures are an upper bound. The model's
//! proxies do not exist, so ray-xds probes them once and then (by default) not for an
//! hour: this measures xDS, not probing (see the detection benchmark for that).

// A benchmark run reads top to bottom (set up, measure, report): its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, Resource,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use ray_xds::xds::snapshot::{
    CLUSTER_TYPE_URL, ENDPOINTS_TYPE_URL, LISTENER_TYPE_URL, ROUTE_TYPE_URL,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

#[path = "support/mod.rs"]
mod bench_support;
#[path = "floor.rs"]
mod floor;
use bench_support::{cpu_seconds, free_port, ms, percentile, rss_kib};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// ADS streams per run (each server and protocol gets a run of its own); repeat the
    /// flag for several scales.
    #[arg(long, default_values_t = [1000])]
    streams: Vec<usize>,
    /// Servers to run [default: both].
    #[arg(long, value_enum)]
    server: Vec<ServerKind>,
    /// Protocols to run [default: both]. The peer has no delta: its line says so.
    #[arg(long, value_enum)]
    protocol: Vec<Protocol>,
    #[arg(long, default_value_t = 100)]
    services: usize,
    #[arg(long, default_value_t = 2)]
    clusters: usize,
    #[arg(long, default_value_t = 20)]
    proxies: usize,
    /// Endpoint changes to time per run.
    #[arg(long, default_value_t = 20)]
    changes: usize,
    /// ADS streams multiplexed on one HTTP/2 connection.
    #[arg(long, default_value_t = 50)]
    streams_per_connection: usize,
    /// The ray-xds binary [default: the one cargo built with this benchmark].
    #[arg(long)]
    ray_xds: Option<PathBuf>,
    /// The peer's binary [default: built from bench/peer/ with cargo].
    #[arg(long)]
    peer: Option<PathBuf>,
    /// Only build the peer (bench/peer/), print its path and exit: what a build-only run
    /// of scripts/test.sh does.
    #[arg(long)]
    build_peer_only: bool,
    /// ray-xds's probe interval (the proxies of this model do not exist).
    #[arg(long, default_value = "1h")]
    probe_interval: String,
    /// Every client sends a node id of its own (as Envoys usually do) instead of one id
    /// shared by all (as a fleet of Envoys configured alike may, and the default here).
    /// rust-control-plane keys its cache by node id, with no way to group ids
    /// (go-control-plane's `NodeHash`), and keeps a deep copy of the snapshot per id
    /// (about 7 MB for this model): with an id per stream the peer cannot hold 5,000
    /// streams in 24 GiB. With one id shared it loses changes: a stream cancels its
    /// watch by a slab index kept after the watch fired, and the slot may hold another
    /// stream's watch by then (`Cache::cancel_watch`). ray-xds serves by subscription,
    /// not by node id.
    #[arg(long)]
    node_id_per_stream: bool,
    /// After the changes, read ray-xds's `/debug/clients` this many seconds in a loop,
    /// 4 readers at once (as many pages as it sends at once), sampling its RSS: the
    /// page's cost while every stream is connected.
    #[arg(long, default_value_t = 0)]
    debug_pages: u64,
    /// At most this many streams opening at once (from their open until their first
    /// answer of every type); 0 opens them all at once. Lets a machine whose clients
    /// share its cores with the server open more streams than it can sync within the
    /// server's first-request deadline (10 s) all at once. The sync time then includes
    /// the wait for a place: it is not the time of a herd.
    #[arg(long, default_value_t = 0)]
    opening: usize,
    /// Instead of timing changes: open this many streams of each protocol, restart
    /// ray-xds (SIGTERM, then a new process on the same port) and time until every
    /// stream, reconnecting at once, holds every type again; the new process's RSS is
    /// sampled every 20 ms meanwhile (its peak, during the storm).
    #[arg(long)]
    storm: Option<usize>,
    /// Serve as the transport's floor (`bench/floor.rs`) on this address, from the
    /// resources file `--floor-resources` (how the benchmark starts the floor arm).
    #[arg(long, hide = true)]
    as_floor: Option<std::net::SocketAddr>,
    #[arg(long, hide = true)]
    floor_resources: Option<PathBuf>,
    /// How long every stream may take to sync, and every client to get one change.
    #[arg(long, default_value_t = 300)]
    deadline_secs: u64,
    /// Ignored: cargo passes it to every benchmark.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum ServerKind {
    RayXds,
    /// The transport's floor (`bench/floor.rs`): the same bytes, no xDS logic.
    Floor,
    Peer,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Sotw,
    Delta,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Sotw => "sotw",
            Protocol::Delta => "delta",
        }
    }
}

/// Cluster 0 of service 0: the one whose endpoint changes.
const TARGET: &str = "bench/svc-0/svc-0-c0";

fn services_yaml(args: &Args, change: usize) -> String {
    let mut s = String::from("rayservices:\n");
    for svc in 0..args.services {
        s += &format!("  - name: svc-{svc}\n    namespace: bench\n    hosts: [\"svc-{svc}.bench\"]\n    active_cluster: svc-{svc}-c0\n    clusters:\n");
        for c in 0..args.clusters {
            s += &format!("      - name: svc-{svc}-c{c}\n        proxies:\n");
            for p in 0..args.proxies {
                // 127.<svc>.<cluster>.<proxy>: loopback addresses where nothing listens;
                // ray-xds probes every proxy, and probes must never leave this machine.
                // The changing proxy is a worker: with the default `head_proxy: fallback`
                // a head beside workers carries no traffic and is not in EDS.
                let port = if svc == 0 && c == 0 && p + 1 == args.proxies {
                    20000 + change
                } else {
                    8000
                };
                s += &format!(
                    "          - {{ address: \"127.{}.{}.{}:{port}\", node_type: {} }}\n",
                    svc % 250,
                    c,
                    p + 1,
                    if p == 0 { "head" } else { "worker" }
                );
            }
        }
    }
    s
}

struct Server(Child);
impl Drop for Server {
    /// SIGTERM first, so a profiler wrapping the server can write its report.
    fn drop(&mut self) {
        unsafe {
            libc::kill(self.0.id() as i32, libc::SIGTERM);
        }
        for _ in 0..200 {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a client reports: (change number, resources in that EDS response) when it sees a change.
/// What a client reports when it sees a change: (client, change number, resources in
/// that EDS response, when).
type Report = (usize, usize, usize, Instant);

fn target_port(resources: impl Iterator<Item = (String, Vec<u8>)>) -> Option<u32> {
    use envoy_types::pb::envoy::config::core::v3::{address, socket_address};
    use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
    for (name, bytes) in resources {
        if name != TARGET {
            continue;
        }
        // The changing proxy is the only one on a port from 20000 up; it may sit in any
        // locality or priority (the head is a fallback priority by default).
        let cla = ClusterLoadAssignment::decode(&*bytes).ok()?;
        return cla
            .endpoints
            .iter()
            .flat_map(|l| &l.lb_endpoints)
            .find_map(|e| match &e.host_identifier {
                Some(HostIdentifier::Endpoint(e)) => match e.address.as_ref()?.address.as_ref()? {
                    address::Address::SocketAddress(sa) => match sa.port_specifier {
                        Some(socket_address::PortSpecifier::PortValue(p)) if p >= 20000 => Some(p),
                        _ => None,
                    },
                    _ => None,
                },
                _ => None,
            });
    }
    None
}

/// A cluster load assignment's name, read alone (prost skips every other field by its
/// length): a client looks for one assignment among hundreds, and decoding each whole
/// would make the clients' work, not the server's, what the benchmark measures.
fn cla_name(bytes: &[u8]) -> String {
    #[derive(Clone, PartialEq, prost::Message)]
    struct NameOnly {
        #[prost(string, tag = "1")]
        cluster_name: String,
    }
    NameOnly::decode(bytes)
        .map(|c| c.cluster_name)
        .unwrap_or_default()
}

/// What a SotW client holds of each type: (version, resources by name). Listeners and
/// clusters are replaced by each response (full state); a response of endpoints or
/// routes may carry only the resources that changed, so those are merged by name.
type Recording = Arc<Mutex<HashMap<String, (String, BTreeMap<String, Any>)>>>;

fn record(recording: &Recording, type_url: &str, version: &str, resources: &[Any]) {
    let mut held = recording.lock().unwrap();
    let entry = held.entry(type_url.to_string()).or_default();
    entry.0 = version.to_string();
    if matches!(type_url, CLUSTER_TYPE_URL | LISTENER_TYPE_URL) {
        entry.1.clear();
    }
    for any in resources {
        entry
            .1
            .insert(resource_name(type_url, &any.value), any.clone());
    }
}

/// The name a resource of `type_url` carries inside its bytes.
fn resource_name(type_url: &str, bytes: &[u8]) -> String {
    match type_url {
        CLUSTER_TYPE_URL => Cluster::decode(bytes).map(|c| c.name),
        ENDPOINTS_TYPE_URL => ClusterLoadAssignment::decode(bytes).map(|c| c.cluster_name),
        LISTENER_TYPE_URL => Listener::decode(bytes).map(|l| l.name),
        ROUTE_TYPE_URL => RouteConfiguration::decode(bytes).map(|r| r.name),
        _ => Ok(String::new()),
    }
    .unwrap_or_default()
}

/// What the recording client holds, as the peer's resources file: one length-delimited
/// `DeltaDiscoveryResponse` per type, with the type's version and every named resource.
fn peer_file(recording: &Recording) -> Vec<u8> {
    let held = recording.lock().unwrap();
    let mut out = Vec::new();
    for ty in [
        CLUSTER_TYPE_URL,
        ENDPOINTS_TYPE_URL,
        LISTENER_TYPE_URL,
        ROUTE_TYPE_URL,
    ] {
        let Some((version, resources)) = held.get(ty) else {
            continue;
        };
        DeltaDiscoveryResponse {
            type_url: ty.into(),
            system_version_info: version.clone(),
            resources: resources
                .iter()
                .map(|(name, any)| Resource {
                    name: name.clone(),
                    version: version.clone(),
                    resource: Some(any.clone()),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
        .encode_length_delimited(&mut out)
        .unwrap();
    }
    out
}

/// The port of the changing proxy in what `recording` holds.
fn recorded_port(recording: &Recording) -> Option<u32> {
    let held = recording.lock().unwrap();
    let (_, resources) = held.get(ENDPOINTS_TYPE_URL)?;
    target_port(resources.iter().map(|(n, a)| (n.clone(), a.value.clone())))
}

/// The order a client subscribes in, as Envoy does: clusters, their endpoints, listeners,
/// their routes; each type once the previous one has its first answer. (rust-control-plane
/// 0.1.2 loses a type's watch when another type's response is sent before that type is
/// ACKed: it checks an ACK against the stream's last nonce, not the type's.)
const TYPES: [&str; 4] = [
    CLUSTER_TYPE_URL,
    ENDPOINTS_TYPE_URL,
    LISTENER_TYPE_URL,
    ROUTE_TYPE_URL,
];

/// Set once by `main`: not `--node-id-per-stream`.
static SHARED_NODE_ID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Responses every client has received, and their bytes (encoded), since the last reset.
static RECEIVED: [std::sync::atomic::AtomicU64; 2] = [
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
];

fn count_received<M: prost::Message>(response: &M) {
    RECEIVED[0].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    RECEIVED[1].fetch_add(
        response.encoded_len() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// What [`RECEIVED`] counts, reset to zero.
fn take_received() -> (u64, u64) {
    (
        RECEIVED[0].swap(0, std::sync::atomic::Ordering::Relaxed),
        RECEIVED[1].swap(0, std::sync::atomic::Ordering::Relaxed),
    )
}

fn node_id(protocol: &str, id: usize) -> String {
    if SHARED_NODE_ID.load(std::sync::atomic::Ordering::Relaxed) {
        "fanout".into()
    } else {
        format!("{protocol}-{id}")
    }
}

/// A client's "synced" signal, holding its place among the streams opening at once
/// (`--opening`) until it fires or the client ends.
struct Synced {
    tx: mpsc::UnboundedSender<()>,
    _opening: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Synced {
    fn fire(self) {
        let _ = self.tx.send(());
    }
}

async fn sotw_client(
    channel: Channel,
    id: usize,
    eds_names: Arc<Vec<String>>,
    reports: mpsc::UnboundedSender<Report>,
    synced: Synced,
    recording: Option<Recording>,
) {
    let mut client =
        AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(64 << 20);
    let (tx, rx) = mpsc::channel(8);
    let Ok(inbound) = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
    else {
        return;
    };
    let mut inbound = inbound.into_inner();
    let node = Some(Node {
        id: node_id("sotw", id),
        ..Default::default()
    });
    let names_of = |ty: &str| match ty {
        ENDPOINTS_TYPE_URL => eds_names.to_vec(),
        ROUTE_TYPE_URL => vec!["ray-serve-http".into()],
        _ => vec![],
    };
    let subscribe = |ty: &str| DiscoveryRequest {
        node: node.clone(),
        type_url: ty.into(),
        resource_names: names_of(ty),
        ..Default::default()
    };
    if tx.send(subscribe(TYPES[0])).await.is_err() {
        return;
    }
    let mut seen = [false; 4];
    let mut synced = Some(synced);
    while let Ok(Some(r)) = inbound.message().await {
        count_received(&r);
        let Some(idx) = TYPES.iter().position(|t| *t == r.type_url) else {
            return;
        };
        seen[idx] = true;
        if let Some(rec) = &recording {
            record(rec, &r.type_url, &r.version_info, &r.resources);
        }
        if r.type_url == ENDPOINTS_TYPE_URL {
            let n = r.resources.len();
            if let Some(port) = target_port(
                r.resources
                    .into_iter()
                    .map(|a| (cla_name(&a.value), a.value)),
            ) {
                let _ = reports.send((id, (port - 20000) as usize, n, Instant::now()));
            }
        }
        let ack = DiscoveryRequest {
            resource_names: names_of(&r.type_url),
            type_url: r.type_url,
            version_info: r.version_info,
            response_nonce: r.nonce,
            ..Default::default()
        };
        if tx.send(ack).await.is_err() {
            return;
        }
        // The next type once the previous one has its first answer.
        if let Some(next) = TYPES.get(idx + 1).filter(|_| !seen[idx + 1]) {
            if tx.send(subscribe(next)).await.is_err() {
                return;
            }
        }
        if seen.iter().all(|s| *s) {
            if let Some(s) = synced.take() {
                s.fire();
            }
        }
    }
}

async fn delta_client(
    channel: Channel,
    id: usize,
    eds_names: Arc<Vec<String>>,
    reports: mpsc::UnboundedSender<Report>,
    synced: Synced,
) {
    let mut client =
        AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(64 << 20);
    let (tx, rx) = mpsc::channel(8);
    let Ok(inbound) = client
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await
    else {
        return;
    };
    let mut inbound = inbound.into_inner();
    let node = Some(Node {
        id: node_id("delta", id),
        ..Default::default()
    });
    let subscribe = |ty: &str| DeltaDiscoveryRequest {
        node: node.clone(),
        type_url: ty.into(),
        resource_names_subscribe: match ty {
            ENDPOINTS_TYPE_URL => eds_names.to_vec(),
            ROUTE_TYPE_URL => vec!["ray-serve-http".into()],
            _ => vec!["*".into()],
        },
        ..Default::default()
    };
    if tx.send(subscribe(TYPES[0])).await.is_err() {
        return;
    }
    let mut seen = [false; 4];
    let mut synced = Some(synced);
    while let Ok(Some(r)) = inbound.message().await {
        count_received(&r);
        let Some(idx) = TYPES.iter().position(|t| *t == r.type_url) else {
            return;
        };
        seen[idx] = true;
        if r.type_url == ENDPOINTS_TYPE_URL {
            let n = r.resources.len();
            let resources = r
                .resources
                .into_iter()
                .filter_map(|res| Some((res.name, res.resource?.value)));
            if let Some(port) = target_port(resources) {
                let _ = reports.send((id, (port - 20000) as usize, n, Instant::now()));
            }
        }
        let ack = DeltaDiscoveryRequest {
            type_url: r.type_url,
            response_nonce: r.nonce,
            ..Default::default()
        };
        if tx.send(ack).await.is_err() {
            return;
        }
        // The next type once the previous one has its first answer.
        if let Some(next) = TYPES.get(idx + 1).filter(|_| !seen[idx + 1]) {
            if tx.send(subscribe(next)).await.is_err() {
                return;
            }
        }
        if seen.iter().all(|s| *s) {
            if let Some(s) = synced.take() {
                s.fire();
            }
        }
    }
}

/// One server and protocol at one scale.
struct RunResult {
    streams: usize,
    sync: Duration,
    latencies: Vec<Duration>,
    cpu_per_change: f64,
    rss_idle: u64,
    rss_connected: u64,
    resources_per_push: BTreeMap<usize, usize>,
    /// `--debug-pages`: what reading `/debug/clients` in a loop cost.
    debug_pages: Option<DebugPages>,
}

/// `/debug/clients` read in a loop while every stream is connected.
#[derive(Debug)]
struct DebugPages {
    pages: usize,
    /// The last page's size, and how many of the clients it showed.
    page_bytes: usize,
    shown: u64,
    /// The highest RSS sampled (every 20 ms) above the RSS before the reading began.
    rss_peak_above_kib: u64,
    /// The slowest page, read whole.
    slowest: Duration,
}

impl RunResult {
    fn rss_per_stream(&self) -> f64 {
        self.rss_connected.saturating_sub(self.rss_idle) as f64 / self.streams as f64
    }
    fn cpu_us_per_push(&self) -> f64 {
        self.cpu_per_change * 1e6 / self.streams as f64
    }
}

/// A server under test: how to start it and how to make change `k`.
enum Arm<'a> {
    RayXds {
        binary: PathBuf,
    },
    /// The peer, and what ray-xds served for each change (index = change).
    Peer {
        binary: PathBuf,
        files: &'a [Vec<u8>],
    },
    /// The floor (this benchmark's own binary), pushing what ray-xds served.
    Floor {
        files: &'a [Vec<u8>],
    },
}

impl Arm<'_> {
    fn name(&self) -> &'static str {
        match self {
            Arm::RayXds { .. } => "ray-xds",
            Arm::Peer { .. } => "peer",
            Arm::Floor { .. } => "floor",
        }
    }

    /// What the server's file holds for change `k`.
    fn content(&self, args: &Args, k: usize) -> Vec<u8> {
        match self {
            Arm::RayXds { .. } => services_yaml(args, k).into_bytes(),
            Arm::Peer { files, .. } | Arm::Floor { files } => files[k].clone(),
        }
    }

    /// Replaces the server's file by a rename, as both servers' watches expect.
    fn write(path: &Path, content: &[u8]) {
        let tmp = path.with_extension("tmp~");
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    fn start(&self, args: &Args, path: &Path, port: u16, admin: u16, streams: usize) -> Server {
        let mut command = match self {
            Arm::RayXds { binary } => {
                let mut c = Command::new(binary);
                c.args(["serve", "--source-file"])
                    .arg(path)
                    .args([
                        "--xds-listen",
                        &format!("127.0.0.1:{port}"),
                        "--admin-listen",
                        &format!("127.0.0.1:{admin}"),
                        // This benchmark measures xDS fan-out: probe each (absent) proxy
                        // once, then leave them be (the detection bench measures probing).
                        "--probe-interval",
                        &args.probe_interval,
                    ])
                    .env("RAY_XDS_LOG", "warn");
                c
            }
            Arm::Peer { binary, .. } => {
                let mut c = Command::new(binary);
                c.args(["--listen", &format!("127.0.0.1:{port}"), "--resources"])
                    .arg(path)
                    .args([
                        "--expect-nodes",
                        &if args.node_id_per_stream { streams } else { 1 }.to_string(),
                    ]);
                c
            }
            Arm::Floor { .. } => {
                let mut c = Command::new(std::env::current_exe().expect("this benchmark's path"));
                c.args([
                    "--as-floor",
                    &format!("127.0.0.1:{port}"),
                    "--floor-resources",
                ])
                .arg(path);
                c
            }
        };
        // The peer's streams panic when a client goes away (rust-control-plane 0.1.2
        // unwraps the end of a stream): its stderr is not ours to show. Its stdout is one
        // line: the bytes its protos dropped from what ray-xds served.
        let (stdout, stderr) = if matches!(self, Arm::Peer { .. }) {
            (Stdio::inherit(), Stdio::null())
        } else {
            (Stdio::null(), Stdio::inherit())
        };
        Server(
            command
                .stdout(stdout)
                .stderr(stderr)
                .spawn()
                .unwrap_or_else(|e| panic!("starting {}: {e}", self.name())),
        )
    }
}

/// Runs `streams` clients of `protocol` against `arm` through every change; with
/// `record`, client 0 (SotW) also keeps what it was served, and the peer's resources file
/// for each change is returned.
async fn run(
    args: &Args,
    arm: &Arm<'_>,
    protocol: Protocol,
    streams: usize,
    record: bool,
) -> Result<(RunResult, Vec<Vec<u8>>), String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(match arm {
        Arm::RayXds { .. } => "services.yaml",
        Arm::Peer { .. } | Arm::Floor { .. } => "resources.pb",
    });
    Arm::write(&path, &arm.content(args, 0));
    let port = free_port();
    let admin = free_port();
    let mut server = arm.start(args, &path, port, admin, streams);
    let pid = server.0.id();
    let endpoint = format!("http://127.0.0.1:{port}");
    let deadline = Duration::from_secs(args.deadline_secs);
    let started = Instant::now();
    // Ready once a stream gets its first answer (ray-xds listens before its first build):
    // idle memory and the sync clock start from a server that serves.
    loop {
        if let Some(status) = server.0.try_wait().unwrap() {
            panic!("{} exited before serving: {status}", arm.name());
        }
        if first_answer(&endpoint).await {
            break;
        }
        assert!(started.elapsed() < deadline, "{} never served", arm.name());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // As after the sync below: time to tidy up, so both readings are of a settled heap.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let rss_idle = rss_kib(pid);

    let eds_names: Arc<Vec<String>> = Arc::new(
        (0..args.services)
            .flat_map(|s| (0..args.clusters).map(move |c| format!("bench/svc-{s}/svc-{s}-c{c}")))
            .collect(),
    );
    let recording: Option<Recording> = record.then(Recording::default);
    let (report_tx, mut report_rx) = mpsc::unbounded_channel::<Report>();
    let (synced_tx, mut synced_rx) = mpsc::unbounded_channel::<()>();
    let connect_started = Instant::now();
    let mut channel = None;
    let mut tasks = Aborting(Vec::new());
    let opening = (args.opening > 0).then(|| Arc::new(tokio::sync::Semaphore::new(args.opening)));
    let opening_deadline = tokio::time::Instant::now() + deadline;
    for i in 0..streams {
        let ch = channel_for(i, args.streams_per_connection, &endpoint, &mut channel)
            .await
            .unwrap();
        let place = match &opening {
            Some(o) => {
                let acquire = o.clone().acquire_owned();
                match tokio::time::timeout_at(opening_deadline, acquire).await {
                    Ok(permit) => Some(permit.expect("never closed")),
                    Err(_) => {
                        return Err(format!(
                            "{i} of {streams} streams opened within {deadline:?}: those opening \
                             never synced"
                        ))
                    }
                }
            }
            None => None,
        };
        let s = Synced {
            tx: synced_tx.clone(),
            _opening: place,
        };
        let (r, names) = (report_tx.clone(), eds_names.clone());
        tasks.0.push(match protocol {
            Protocol::Sotw => {
                let rec = if i == 0 { recording.clone() } else { None };
                tokio::spawn(sotw_client(ch, i, names, r, s, rec))
            }
            Protocol::Delta => tokio::spawn(delta_client(ch, i, names, r, s)),
        });
    }
    drop(channel);
    drop(synced_tx);
    let sync_deadline = tokio::time::Instant::now() + deadline;
    for synced in 0..streams {
        match tokio::time::timeout_at(sync_deadline, synced_rx.recv()).await {
            Ok(Some(())) => {}
            Ok(None) => return Err("a client's stream ended before it synced".into()),
            Err(_) => {
                return Err(format!(
                    "{synced} of {streams} streams synced within {deadline:?}"
                ))
            }
        }
    }
    let sync = connect_started.elapsed();
    // Idle: drain the initial sync's reports (change 0) and give a server that tidies up
    // after a burst (ray-xds gives freed heap back every second) the time to.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    while report_rx.try_recv().is_ok() {}
    let rss_connected = rss_kib(pid);
    let mut files = Vec::new();
    if let Some(rec) = &recording {
        files.push(peer_file(rec));
    }

    let mut latencies: Vec<Duration> = Vec::new();
    let mut resources_per_push: BTreeMap<usize, usize> = BTreeMap::new();
    let mut cpu_per_change = Vec::new();
    for change in 1..=args.changes {
        let content = arm.content(args, change);
        let cpu_before = cpu_seconds(pid);
        let t0 = Instant::now();
        Arm::write(&path, &content);
        let change_deadline = tokio::time::Instant::now() + deadline;
        // Each client counts once, at its first push carrying the change.
        let mut got = vec![false; streams];
        let mut left = streams;
        while left > 0 {
            let report = tokio::time::timeout_at(change_deadline, report_rx.recv()).await;
            let Ok(Some((client, c, n, at))) = report else {
                latencies.sort();
                return Err(format!(
                    "{} of {streams} clients got change {change} within {deadline:?}; the {} changes before reached every client: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
                    streams - left,
                    change - 1,
                    ms(percentile(&latencies, 0.5)),
                    ms(percentile(&latencies, 0.99)),
                    ms(latencies.last().copied().unwrap_or_default()),
                ));
            };
            if c != change || std::mem::replace(&mut got[client], true) {
                continue;
            }
            latencies.push(at - t0);
            *resources_per_push.entry(n).or_default() += 1;
            left -= 1;
        }
        // Let the ACKs land before measuring CPU.
        tokio::time::sleep(Duration::from_millis(200)).await;
        cpu_per_change.push(cpu_seconds(pid) - cpu_before);
        if let Some(rec) = &recording {
            // Client 0 has change `change` (all clients do): record it for the peer.
            assert_eq!(recorded_port(rec), Some(20000 + change as u32));
            files.push(peer_file(rec));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    latencies.sort();
    let debug_pages = match arm {
        Arm::RayXds { .. } if args.debug_pages > 0 => {
            Some(read_debug_pages(pid, admin, Duration::from_secs(args.debug_pages)).await?)
        }
        _ => None,
    };
    drop(server);
    drop(tasks);
    let result = RunResult {
        streams,
        sync,
        latencies,
        cpu_per_change: cpu_per_change.iter().sum::<f64>() / cpu_per_change.len().max(1) as f64,
        rss_idle,
        rss_connected,
        resources_per_push,
        debug_pages,
    };
    Ok((result, files))
}

/// Reads `/debug/clients` of the server `pid` on `admin` for `how_long`, 4 readers at
/// once, sampling its RSS every 20 ms.
async fn read_debug_pages(pid: u32, admin: u16, how_long: Duration) -> Result<DebugPages, String> {
    let before = rss_kib(pid);
    let until = Instant::now() + how_long;
    let readers: Vec<_> = (0..4)
        .map(|_| {
            tokio::spawn(async move {
                let (mut pages, mut last, mut slowest) = (0, String::new(), Duration::ZERO);
                while Instant::now() < until {
                    let t0 = Instant::now();
                    match bench_support::http_get(admin, "/debug/clients", Duration::from_secs(60))
                        .await
                    {
                        Some((200, body)) => {
                            slowest = slowest.max(t0.elapsed());
                            pages += 1;
                            last = body;
                        }
                        // Over the pages sent at once: try again.
                        Some((503, _)) => tokio::time::sleep(Duration::from_millis(5)).await,
                        other => return Err(format!("/debug/clients: {other:?}")),
                    }
                }
                Ok((pages, last, slowest))
            })
        })
        .collect();
    let mut peak = before;
    while Instant::now() < until {
        peak = peak.max(rss_kib(pid));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut pages, mut last, mut slowest) = (0, String::new(), Duration::ZERO);
    for r in readers {
        peak = peak.max(rss_kib(pid));
        let (p, l, s) = r.await.map_err(|e| e.to_string())??;
        pages += p;
        slowest = slowest.max(s);
        if !l.is_empty() {
            last = l;
        }
    }
    let page: serde_json::Value =
        serde_json::from_str(&last).map_err(|e| format!("/debug/clients is not JSON: {e}"))?;
    Ok(DebugPages {
        pages,
        page_bytes: last.len(),
        shown: page["shown"].as_u64().unwrap_or(0),
        rss_peak_above_kib: peak.saturating_sub(before),
        slowest,
    })
}

/// Client tasks, stopped when dropped (a run that fails ends its clients too).
struct Aborting(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Aborting {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Waits until `streams` clients said they are whole at `generation` or later.
async fn wait_whole(
    rx: &mut mpsc::UnboundedReceiver<(usize, usize)>,
    streams: usize,
    generation: usize,
    deadline: Duration,
) -> Result<Vec<Instant>, String> {
    let until = tokio::time::Instant::now() + deadline;
    let mut whole = vec![false; streams];
    let mut when = Vec::with_capacity(streams);
    let mut n = 0;
    while n < streams {
        match tokio::time::timeout_at(until, rx.recv()).await {
            Ok(Some((client, g))) if g >= generation => {
                if !std::mem::replace(&mut whole[client], true) {
                    n += 1;
                    when.push(Instant::now());
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => return Err("the clients ended".to_string()),
            Err(_) => {
                return Err(format!(
                    "{n} of {streams} streams whole (generation {generation}) within {deadline:?}"
                ))
            }
        }
    }
    Ok(when)
}

/// The channel stream `i` rides: a new connection every `per_connection` streams.
async fn channel_for(
    i: usize,
    per_connection: usize,
    endpoint: &str,
    current: &mut Option<Channel>,
) -> Result<Channel, String> {
    if i.is_multiple_of(per_connection) || current.is_none() {
        let channel = Channel::from_shared(endpoint.to_string())
            .map_err(|e| e.to_string())?
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        *current = Some(channel);
    }
    Ok(current.clone().expect("made above"))
}

/// What a reconnect storm took.
struct StormResult {
    /// From the new process's start until every stream held every type again.
    whole: Duration,
    /// ... until the first one did, and half of them.
    first: Duration,
    half: Duration,
    /// What the clients received meanwhile: responses, and their bytes.
    responses: u64,
    received_bytes: u64,
    /// The new process's highest RSS sampled during the storm.
    peak_rss_kib: u64,
    /// The old process's RSS with every stream connected, before the restart.
    before_rss_kib: u64,
}

/// `streams` clients of `protocol` on ray-xds, each reconnecting at once (every 50 ms
/// while it cannot) whenever its stream ends; ray-xds restarted once all are synced.
async fn storm(
    args: &Args,
    arm: &Arm<'_>,
    protocol: Protocol,
    streams: usize,
) -> Result<StormResult, String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("services.yaml");
    Arm::write(&path, &arm.content(args, 0));
    let (port, admin) = (free_port(), free_port());
    let server = arm.start(args, &path, port, admin, streams);
    let endpoint = format!("http://127.0.0.1:{port}");
    let deadline = Duration::from_secs(args.deadline_secs);
    let started = Instant::now();
    while !first_answer(&endpoint).await {
        if started.elapsed() > deadline {
            return Err(format!("{} never served", arm.name()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let eds_names: Arc<Vec<String>> = Arc::new(
        (0..args.services)
            .flat_map(|s| (0..args.clusters).map(move |c| format!("bench/svc-{s}/svc-{s}-c{c}")))
            .collect(),
    );
    // Every time a client holds every type, it says so with its generation (how many
    // times its stream ended before).
    let (whole_tx, mut whole_rx) = mpsc::unbounded_channel::<(usize, usize)>();
    let mut tasks = Aborting(Vec::new());
    let mut channel = None;
    for i in 0..streams {
        let ch = channel_for(i, args.streams_per_connection, &endpoint, &mut channel).await?;
        let (names, whole) = (eds_names.clone(), whole_tx.clone());
        tasks.0.push(tokio::spawn(async move {
            for generation in 0.. {
                let (tx, mut rx) = mpsc::unbounded_channel();
                let synced = Synced { tx, _opening: None };
                let (reports, _) = mpsc::unbounded_channel();
                let whole = whole.clone();
                let forward = tokio::spawn(async move {
                    if rx.recv().await.is_some() {
                        let _ = whole.send((i, generation));
                    }
                });
                match protocol {
                    Protocol::Sotw => {
                        sotw_client(ch.clone(), i, names.clone(), reports, synced, None).await
                    }
                    Protocol::Delta => {
                        delta_client(ch.clone(), i, names.clone(), reports, synced).await
                    }
                }
                let _ = forward.await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
    }
    drop(channel);
    wait_whole(&mut whole_rx, streams, 0, deadline).await?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let before_rss_kib = rss_kib(server.0.id());
    drop(server);
    while whole_rx.try_recv().is_ok() {}
    let t0 = Instant::now();
    take_received();
    let server = arm.start(args, &path, port, admin, streams);
    let pid = server.0.id();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_kib(pid), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let whole = wait_whole(&mut whole_rx, streams, 1, deadline).await;
    let whole_time = t0.elapsed();
    let (responses, received_bytes) = take_received();
    let since = |i: usize| match &whole {
        Ok(when) => when
            .get(i)
            .map(|t| t.duration_since(t0))
            .unwrap_or_default(),
        Err(_) => Duration::ZERO,
    };
    let (first, half) = (since(0), since(streams / 2));
    peak.fetch_max(rss_kib(pid), std::sync::atomic::Ordering::Relaxed);
    sampler.abort();
    drop(tasks);
    drop(server);
    whole?;
    Ok(StormResult {
        responses,
        received_bytes,
        whole: whole_time,
        first,
        half,
        peak_rss_kib: peak.load(std::sync::atomic::Ordering::Relaxed),
        before_rss_kib,
    })
}

fn describe(server: &str, protocol: Protocol, r: &RunResult) {
    let l = &r.latencies;
    println!(
        "{server} {}: {} streams synced in {:.2?}; change -> every client: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; CPU {:.1} ms per change ({:.1} us per push); RSS {} KiB idle, {} KiB connected ({:.1} KiB per stream); resources per EDS push carrying the change (count: pushes): {:?}",
        protocol.name(),
        r.streams,
        r.sync,
        ms(percentile(l, 0.5)),
        ms(percentile(l, 0.99)),
        ms(l.last().copied().unwrap_or_default()),
        r.cpu_per_change * 1000.0,
        r.cpu_us_per_push(),
        r.rss_idle,
        r.rss_connected,
        r.rss_per_stream(),
        r.resources_per_push,
    );
    if let Some(d) = &r.debug_pages {
        println!(
            "{server} {}: /debug/clients read {} times by 4 readers: {} KiB a page showing {} clients, slowest {:.0?}; RSS peak {:.1} MiB above connected",
            protocol.name(),
            d.pages,
            d.page_bytes / 1024,
            d.shown,
            d.slowest,
            d.rss_peak_above_kib as f64 / 1024.0,
        );
    }
}

/// Whether a SotW stream to `endpoint` gets an answer to a request for clusters.
async fn first_answer(endpoint: &str) -> bool {
    use tokio_stream::StreamExt;
    let attempt = async {
        let channel = Channel::from_shared(endpoint.to_string())
            .ok()?
            .connect()
            .await
            .ok()?;
        let mut client = AggregatedDiscoveryServiceClient::new(channel);
        let request = DiscoveryRequest {
            node: Some(Node {
                id: node_id("sotw", 0),
                ..Default::default()
            }),
            type_url: CLUSTER_TYPE_URL.into(),
            ..Default::default()
        };
        let requests = tokio_stream::iter([request]).chain(tokio_stream::pending());
        let mut inbound = client
            .stream_aggregated_resources(requests)
            .await
            .ok()?
            .into_inner();
        inbound.message().await.ok()?
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), attempt).await,
        Ok(Some(_))
    )
}

/// Builds the peer from bench/peer/ (scripts/build-peer.sh, which says how) and returns
/// the path of its binary.
fn build_peer() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-peer.sh");
    let output = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .expect("running scripts/build-peer.sh");
    assert!(
        output.status.success(),
        "building the peer (bench/peer/) failed"
    );
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Some(listen) = args.as_floor {
        let path = args.floor_resources.clone().expect("--floor-resources");
        floor::serve(listen, path).await;
        return;
    }
    if args.build_peer_only {
        println!("{}", build_peer().display());
        return;
    }
    assert!(args.changes > 0, "--changes must be at least 1");
    SHARED_NODE_ID.store(
        !args.node_id_per_stream,
        std::sync::atomic::Ordering::Relaxed,
    );
    let servers = if args.server.is_empty() {
        vec![ServerKind::RayXds, ServerKind::Floor, ServerKind::Peer]
    } else {
        args.server.clone()
    };
    let protocols = if args.protocol.is_empty() {
        vec![Protocol::Sotw, Protocol::Delta]
    } else {
        args.protocol.clone()
    };
    let ray_xds = Arm::RayXds {
        binary: args
            .ray_xds
            .clone()
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ray-xds"))),
    };
    let peer_binary = servers
        .contains(&ServerKind::Peer)
        .then(|| args.peer.clone().unwrap_or_else(build_peer));
    println!(
        "xds fan-out: model {} services x {} clusters x {} proxies ({} clusters, {} endpoints), {} changes per run, {} streams per connection, {}; clients and server share this machine's {} cores",
        args.services,
        args.clusters,
        args.proxies,
        args.services * args.clusters,
        args.services * args.clusters * args.proxies,
        args.changes,
        args.streams_per_connection,
        if args.node_id_per_stream {
            "a node id per stream"
        } else {
            "one node id for all streams"
        },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    if let Some(streams) = args.storm {
        // The floor's storm first (what ray-xds served, recorded by one stream), so that
        // ray-xds's line can carry it.
        let files = if servers.contains(&ServerKind::Floor) {
            run(&args, &ray_xds, Protocol::Sotw, 1, true)
                .await
                .unwrap_or_else(|e| panic!("recording what ray-xds serves: {e}"))
                .1
        } else {
            Vec::new()
        };
        for &protocol in &protocols {
            let floor = if servers.contains(&ServerKind::Floor) {
                let r = storm(&args, &Arm::Floor { files: &files }, protocol, streams)
                    .await
                    .unwrap_or_else(|e| {
                        panic!("floor storm, {} {streams} streams: {e}", protocol.name())
                    });
                println!(
                    "storm-floor protocol={} streams={streams} whole_s={:.2} peak_rss_mib={:.0} first_whole_s={:.2} half_whole_s={:.2} responses={} received_mib={:.0}",
                    protocol.name(),
                    r.whole.as_secs_f64(),
                    r.peak_rss_kib as f64 / 1024.0,
                    r.first.as_secs_f64(),
                    r.half.as_secs_f64(),
                    r.responses,
                    r.received_bytes as f64 / 1048576.0,
                );
                Some(r.whole)
            } else {
                None
            };
            if !servers.contains(&ServerKind::RayXds) {
                continue;
            }
            let r = storm(&args, &ray_xds, protocol, streams)
                .await
                .unwrap_or_else(|e| panic!("storm, {} {streams} streams: {e}", protocol.name()));
            let beside_floor = floor
                .map(|f| {
                    format!(
                        " floor_whole_s={:.2} floor_ratio={:.2}",
                        f.as_secs_f64(),
                        r.whole.as_secs_f64() / f.as_secs_f64().max(1e-9)
                    )
                })
                .unwrap_or_default();
            println!(
                "storm protocol={} streams={streams} whole_s={:.2} peak_rss_mib={:.0} before_rss_mib={:.0} first_whole_s={:.2} half_whole_s={:.2} responses={} received_mib={:.0}{beside_floor}",
                protocol.name(),
                r.whole.as_secs_f64(),
                r.peak_rss_kib as f64 / 1024.0,
                r.before_rss_kib as f64 / 1024.0,
                r.first.as_secs_f64(),
                r.half.as_secs_f64(),
                r.responses,
                r.received_bytes as f64 / 1048576.0,
            );
        }
        return;
    }
    let mut lines = Vec::new();
    for &streams in &args.streams {
        let mut results: BTreeMap<(&str, &str), RunResult> = BTreeMap::new();
        let mut failed: BTreeMap<&str, String> = BTreeMap::new();
        // ray-xds's SotW run records what it served, for the peer.
        let mut files = Vec::new();
        let floor_wanted = servers.contains(&ServerKind::Floor);
        let record = peer_binary.is_some() || floor_wanted;
        if servers.contains(&ServerKind::RayXds) || record {
            let wanted =
                servers.contains(&ServerKind::RayXds) && protocols.contains(&Protocol::Sotw);
            let n = if wanted { streams } else { 1 };
            let (r, f) = run(&args, &ray_xds, Protocol::Sotw, n, record)
                .await
                .unwrap_or_else(|e| panic!("ray-xds sotw, {n} streams: {e}"));
            files = f;
            if wanted {
                describe("ray-xds", Protocol::Sotw, &r);
                results.insert(("ray-xds", "sotw"), r);
            }
        }
        if servers.contains(&ServerKind::RayXds) && protocols.contains(&Protocol::Delta) {
            let (r, _) = run(&args, &ray_xds, Protocol::Delta, streams, false)
                .await
                .unwrap_or_else(|e| panic!("ray-xds delta, {streams} streams: {e}"));
            describe("ray-xds", Protocol::Delta, &r);
            results.insert(("ray-xds", "delta"), r);
        }
        if floor_wanted {
            let floor = Arm::Floor { files: &files };
            for &protocol in &protocols {
                let (r, _) = run(&args, &floor, protocol, streams, false)
                    .await
                    .unwrap_or_else(|e| {
                        panic!("floor {}, {streams} streams: {e}", protocol.name())
                    });
                describe("floor", protocol, &r);
                results.insert(("floor", protocol.name()), r);
            }
        }
        if let Some(binary) = &peer_binary {
            if protocols.contains(&Protocol::Sotw) {
                let peer = Arm::Peer {
                    binary: binary.clone(),
                    files: &files,
                };
                // The peer failing is a result, not the benchmark's failure.
                match run(&args, &peer, Protocol::Sotw, streams, false).await {
                    Ok((r, _)) => {
                        describe("peer", Protocol::Sotw, &r);
                        results.insert(("peer", "sotw"), r);
                    }
                    Err(e) => {
                        println!("peer sotw: {streams} streams: failed: {e}");
                        failed.insert("sotw", e);
                    }
                }
            }
        }
        if let (Some(ours), Some(theirs)) = (
            results.get(&("ray-xds", "sotw")),
            results.get(&("peer", "sotw")),
        ) {
            let ratio = |a: f64, b: f64| if a > 0.0 { b / a } else { f64::NAN };
            let (lo, lt) = (&ours.latencies, &theirs.latencies);
            println!(
                "peer / ray-xds (sotw, {streams} streams; above 1 means ray-xds is ahead): sync {:.2}, p50 {:.2}, p99 {:.2}, max {:.2}, CPU per push {:.2}, RSS per stream {:.2}",
                ratio(ours.sync.as_secs_f64(), theirs.sync.as_secs_f64()),
                ratio(ms(percentile(lo, 0.5)), ms(percentile(lt, 0.5))),
                ratio(ms(percentile(lo, 0.99)), ms(percentile(lt, 0.99))),
                ratio(ms(*lo.last().unwrap()), ms(*lt.last().unwrap())),
                ratio(ours.cpu_us_per_push(), theirs.cpu_us_per_push()),
                ratio(ours.rss_per_stream(), theirs.rss_per_stream()),
            );
        }
        for server in ["ray-xds", "floor", "peer"] {
            for protocol in ["sotw", "delta"] {
                if let Some(d) = results
                    .get(&(server, protocol))
                    .and_then(|r| r.debug_pages.as_ref())
                {
                    lines.push(format!(
                        "fanout_debug_clients server={server} protocol={protocol} streams={streams} pages={} page_kib={} shown={} rss_peak_above_mib={:.1}",
                        d.pages,
                        d.page_bytes / 1024,
                        d.shown,
                        d.rss_peak_above_kib as f64 / 1024.0
                    ));
                }
                if let Some(r) = results.get(&(server, protocol)) {
                    // Beside ray-xds's figures, the floor's of the same run, and the ratio.
                    let floor = results
                        .get(&("floor", protocol))
                        .filter(|_| server == "ray-xds")
                        .map(|f| {
                            let (ours, theirs) = (
                                ms(percentile(&r.latencies, 0.99)),
                                ms(percentile(&f.latencies, 0.99)),
                            );
                            format!(
                                " floor_p99_ms={theirs:.1} floor_ratio={:.2}",
                                if theirs > 0.0 {
                                    ours / theirs
                                } else {
                                    f64::NAN
                                }
                            )
                        })
                        .unwrap_or_default();
                    lines.push(format!(
                        "fanout server={server} protocol={protocol} streams={streams} p50_ms={:.1} p99_ms={:.1} rss_kib_per_stream={:.1} sync_s={:.2} cpu_us_per_push={:.1}{floor}",
                        ms(percentile(&r.latencies, 0.5)),
                        ms(percentile(&r.latencies, 0.99)),
                        r.rss_per_stream(),
                        r.sync.as_secs_f64(),
                        r.cpu_us_per_push(),
                    ));
                } else if let Some(why) = failed.get(protocol).filter(|_| server == "peer") {
                    lines.push(format!(
                        "fanout server=peer protocol={protocol} streams={streams} p50_ms=- p99_ms=- rss_kib_per_stream=- (failed: {why})"
                    ));
                } else if server == "peer"
                    && protocol == "delta"
                    && peer_binary.is_some()
                    && protocols.contains(&Protocol::Delta)
                {
                    lines.push(format!(
                        "fanout server=peer protocol=delta streams={streams} p50_ms=- p99_ms=- rss_kib_per_stream=- (rust-control-plane 0.1.2 has no delta xDS)"
                    ));
                }
            }
        }
    }
    for l in lines {
        println!("{l}");
    }
}

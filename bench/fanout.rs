//! xDS fan-out benchmark: N simulated ADS clients (state of the world and delta) on a
//! model of S RayServices × C clusters × P proxies served by a real `ray-xds` process;
//! one endpoint changes, and we measure how long until every client has it, the
//! server's CPU per push, and its memory per connected stream.
//!
//! `cargo bench --bench fanout -- --help`
//!
//! Everything runs on loopback. The clients run in this process, so on a 2-core machine
//! they compete with the server for CPU: the figures are an upper bound. The model's
//! proxies do not exist, so ray-xds probes them once and then (by default) not for an
//! hour: this measures xDS, not probing (see the detection benchmark for that).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use prost::Message;
use ray_xds::xds::snapshot::{
    CLUSTER_TYPE_URL, ENDPOINTS_TYPE_URL, LISTENER_TYPE_URL, ROUTE_TYPE_URL,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

#[path = "support/mod.rs"]
mod support;
use support::{cpu_seconds, free_port, http_get, percentile, rss_kib, write_atomic};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// State-of-the-world streams.
    #[arg(long, default_value_t = 1000)]
    sotw: usize,
    /// Delta streams.
    #[arg(long, default_value_t = 1000)]
    delta: usize,
    #[arg(long, default_value_t = 100)]
    services: usize,
    #[arg(long, default_value_t = 2)]
    clusters: usize,
    #[arg(long, default_value_t = 20)]
    proxies: usize,
    /// Endpoint changes to time.
    #[arg(long, default_value_t = 20)]
    changes: usize,
    /// ADS streams multiplexed on one HTTP/2 connection.
    #[arg(long, default_value_t = 50)]
    streams_per_connection: usize,
    /// The ray-xds binary [default: the one cargo built with this benchmark].
    #[arg(long)]
    ray_xds: Option<PathBuf>,
    /// ray-xds's probe interval (the proxies of this model do not exist).
    #[arg(long, default_value = "1h")]
    probe_interval: String,
    /// Ignored: cargo passes it to every benchmark.
    #[arg(long, hide = true)]
    bench: bool,
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
type Report = (usize, usize, Instant);

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

fn cla_name(bytes: &[u8]) -> String {
    ClusterLoadAssignment::decode(bytes)
        .map(|c| c.cluster_name)
        .unwrap_or_default()
}

async fn sotw_client(
    channel: Channel,
    id: usize,
    eds_names: Arc<Vec<String>>,
    reports: mpsc::UnboundedSender<Report>,
    synced: mpsc::UnboundedSender<()>,
) {
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    let (tx, rx) = mpsc::channel(8);
    let mut inbound = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let node = Some(Node {
        id: format!("sotw-{id}"),
        ..Default::default()
    });
    for ty in [CLUSTER_TYPE_URL, LISTENER_TYPE_URL] {
        tx.send(DiscoveryRequest {
            node: node.clone(),
            type_url: ty.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    tx.send(DiscoveryRequest {
        type_url: ENDPOINTS_TYPE_URL.into(),
        resource_names: eds_names.to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.send(DiscoveryRequest {
        type_url: ROUTE_TYPE_URL.into(),
        resource_names: vec!["ray-serve-http".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut seen = [false; 4];
    let mut synced = Some(synced);
    while let Ok(Some(r)) = inbound.message().await {
        let names = match r.type_url.as_str() {
            ENDPOINTS_TYPE_URL => eds_names.to_vec(),
            ROUTE_TYPE_URL => vec!["ray-serve-http".into()],
            _ => vec![],
        };
        let idx = [
            CLUSTER_TYPE_URL,
            ENDPOINTS_TYPE_URL,
            LISTENER_TYPE_URL,
            ROUTE_TYPE_URL,
        ]
        .iter()
        .position(|t| *t == r.type_url)
        .unwrap();
        seen[idx] = true;
        if r.type_url == ENDPOINTS_TYPE_URL {
            let n = r.resources.len();
            if let Some(port) = target_port(
                r.resources
                    .into_iter()
                    .map(|a| (cla_name(&a.value), a.value)),
            ) {
                let _ = reports.send(((port - 20000) as usize, n, Instant::now()));
            }
        }
        tx.send(DiscoveryRequest {
            type_url: r.type_url,
            resource_names: names,
            version_info: r.version_info,
            response_nonce: r.nonce,
            ..Default::default()
        })
        .await
        .unwrap();
        if seen.iter().all(|s| *s) {
            if let Some(s) = synced.take() {
                let _ = s.send(());
            }
        }
    }
}

async fn delta_client(
    channel: Channel,
    id: usize,
    eds_names: Arc<Vec<String>>,
    reports: mpsc::UnboundedSender<Report>,
    synced: mpsc::UnboundedSender<()>,
) {
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    let (tx, rx) = mpsc::channel(8);
    let mut inbound = client
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let node = Some(Node {
        id: format!("delta-{id}"),
        ..Default::default()
    });
    for ty in [CLUSTER_TYPE_URL, LISTENER_TYPE_URL] {
        tx.send(DeltaDiscoveryRequest {
            node: node.clone(),
            type_url: ty.into(),
            resource_names_subscribe: vec!["*".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    }
    tx.send(DeltaDiscoveryRequest {
        type_url: ENDPOINTS_TYPE_URL.into(),
        resource_names_subscribe: eds_names.to_vec(),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.send(DeltaDiscoveryRequest {
        type_url: ROUTE_TYPE_URL.into(),
        resource_names_subscribe: vec!["ray-serve-http".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut seen = [false; 4];
    let mut synced = Some(synced);
    while let Ok(Some(r)) = inbound.message().await {
        let idx = [
            CLUSTER_TYPE_URL,
            ENDPOINTS_TYPE_URL,
            LISTENER_TYPE_URL,
            ROUTE_TYPE_URL,
        ]
        .iter()
        .position(|t| *t == r.type_url)
        .unwrap();
        seen[idx] = true;
        if r.type_url == ENDPOINTS_TYPE_URL {
            let n = r.resources.len();
            let resources = r
                .resources
                .into_iter()
                .filter_map(|res| Some((res.name, res.resource?.value)));
            if let Some(port) = target_port(resources) {
                let _ = reports.send(((port - 20000) as usize, n, Instant::now()));
            }
        }
        tx.send(DeltaDiscoveryRequest {
            type_url: r.type_url,
            response_nonce: r.nonce,
            ..Default::default()
        })
        .await
        .unwrap();
        if seen.iter().all(|s| *s) {
            if let Some(s) = synced.take() {
                let _ = s.send(());
            }
        }
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    write_atomic(&services, &services_yaml(&args, 0));
    let (xds_port, admin_port) = (free_port(), free_port());
    let binary = args
        .ray_xds
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ray-xds")));
    let server = Server(
        Command::new(&binary)
            .args(["serve", "--source-file"])
            .arg(&services)
            .args([
                "--xds-listen",
                &format!("127.0.0.1:{xds_port}"),
                "--admin-listen",
                &format!("127.0.0.1:{admin_port}"),
                // This benchmark measures xDS fan-out: probe each (absent) proxy once,
                // then leave them be. Probing costs are measured by the detection bench.
                "--probe-interval",
                &args.probe_interval,
            ])
            .env("RAY_XDS_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display())),
    );
    let pid = server.0.id();
    let endpoint = format!("http://127.0.0.1:{xds_port}");
    let channel = loop {
        if let Ok(c) = Channel::from_shared(endpoint.clone())
            .unwrap()
            .connect()
            .await
        {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    drop(channel);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_idle = rss_kib(pid);

    let eds_names: Arc<Vec<String>> = Arc::new(
        (0..args.services)
            .flat_map(|s| (0..args.clusters).map(move |c| format!("bench/svc-{s}/svc-{s}-c{c}")))
            .collect(),
    );
    let (report_tx, mut report_rx) = mpsc::unbounded_channel::<Report>();
    let (synced_tx, mut synced_rx) = mpsc::unbounded_channel::<()>();
    let total = args.sotw + args.delta;
    let connect_started = Instant::now();
    let mut channel = None;
    for i in 0..total {
        if i % args.streams_per_connection == 0 {
            channel = Some(
                Channel::from_shared(endpoint.clone())
                    .unwrap()
                    .connect()
                    .await
                    .unwrap(),
            );
        }
        let ch = channel.clone().unwrap();
        let (r, s, names) = (report_tx.clone(), synced_tx.clone(), eds_names.clone());
        if i < args.sotw {
            tokio::spawn(sotw_client(ch, i, names, r, s));
        } else {
            tokio::spawn(delta_client(ch, i, names, r, s));
        }
    }
    drop(channel);
    drop(synced_tx);
    for _ in 0..total {
        tokio::time::timeout(Duration::from_secs(120), synced_rx.recv())
            .await
            .expect("every stream syncs within 120 s")
            .expect("a client task ended before it synced");
    }
    let sync_time = connect_started.elapsed();
    // Drain the initial sync's reports (change 0).
    tokio::time::sleep(Duration::from_millis(500)).await;
    while report_rx.try_recv().is_ok() {}
    let rss_connected = rss_kib(pid);
    let clients = http_get(admin_port, "/debug/clients", Duration::from_secs(30))
        .await
        .map(|(_, body)| body)
        .expect("/debug/clients");
    let own = clients.matches("\"holds_snapshot_set\":false").count();
    println!("types held resource by resource (not as a shared snapshot set) after sync: {own}");

    let mut latencies: Vec<Duration> = Vec::new();
    let mut resources_per_delta_push: BTreeMap<usize, usize> = BTreeMap::new();
    let mut cpu_per_change = Vec::new();
    for change in 1..=args.changes {
        let cpu_before = cpu_seconds(pid);
        let text = services_yaml(&args, change);
        let t0 = Instant::now();
        write_atomic(&services, &text);
        let mut got = 0;
        while got < total {
            let (c, n, at) = tokio::time::timeout(Duration::from_secs(30), report_rx.recv())
                .await
                .expect("every client gets the change within 30 s")
                .unwrap();
            if c != change {
                continue;
            }
            latencies.push(at - t0);
            *resources_per_delta_push.entry(n).or_default() += 1;
            got += 1;
        }
        // Let the ACKs land before measuring CPU.
        tokio::time::sleep(Duration::from_millis(200)).await;
        cpu_per_change.push(cpu_seconds(pid) - cpu_before);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    latencies.sort();
    let cpu_avg = cpu_per_change.iter().sum::<f64>() / cpu_per_change.len() as f64;
    println!("xds fan-out: {} sotw + {} delta streams, model {} services x {} clusters x {} proxies ({} clusters, {} endpoints)",
        args.sotw, args.delta, args.services, args.clusters, args.proxies, args.services * args.clusters, args.services * args.clusters * args.proxies);
    println!("initial sync of all streams: {:.2?}", sync_time);
    println!("change one endpoint -> every client has it ({} changes x {} clients): p50 {:.1?}  p99 {:.1?}  max {:.1?}",
        args.changes, total, percentile(&latencies, 0.5), percentile(&latencies, 0.99), latencies.last().copied().unwrap_or_default());
    println!(
        "server CPU per change: {:.1} ms ({:.1} us per push)",
        cpu_avg * 1000.0,
        cpu_avg * 1e6 / total as f64
    );
    println!(
        "server RSS: {} KiB idle, {} KiB with {} streams -> {:.1} KiB per stream",
        rss_idle,
        rss_connected,
        total,
        (rss_connected.saturating_sub(rss_idle)) as f64 / total as f64
    );
    println!(
        "resources per EDS push carrying the change (count: pushes): {resources_per_delta_push:?}"
    );
    drop(server);
}

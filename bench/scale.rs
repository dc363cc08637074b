//! Scale benchmark (issue 13): a real `ray-xds` process with 20,000 proxies, all
//! probed with the default settings, while `/healthz` is timed every 50 ms and the
//! source is edited: does the admin port keep answering (goal: within 100 ms), and how
//! long until an edit reaches an ADS client (goal: within 2 s)?
//!
//! `cargo bench --bench scale` (20,000 proxies), `cargo bench --bench scale -- --help`.
//!
//! What it models: RayServices of 100 proxies each (`--per-service`), every proxy at its
//! own loopback address `127.<a>.<b>.<c>` on one port, all answered by one responder in
//! this process that says `success` to `/-/healthz` (and lists `/` on `/-/routes`), so
//! every proxy is live and healthy. Probes reuse their connection as they would with
//! real proxies (the benchmark raises the open-files limit it and ray-xds inherit, to
//! hold 20,000 connections on each side); `--close` makes the responder close each one
//! after its answer, so that every probe opens a connection (a heavier load than a real
//! deployment). Probing uses ray-xds's defaults
//! (every 500 ms, 256 in flight). Phases: `start` from the process start until the
//! snapshot has every proxy healthy (every first probe, the burst), then `steady` for
//! `--steady` seconds, during which `--edits` edits add a RayService each; an edit's
//! time is from the file's rename to a state-of-the-world ADS client holding the new
//! cluster. Everything shares the machine's 2 cores with the responder and the client:
//! the figures are an upper bound.
//!
//! Then two more phases:
//!
//! - `change` (`--changes`): one worker proxy at a time fails its probes (HTTP 500) until
//!   a state-of-the-world client subscribed to every cluster's endpoints has ACKed an
//!   assignment without it, then answers again until the client has ACKed one with it.
//!   Each change is timed from the responder's answer that completed ray-xds's threshold
//!   (the `unhealthy_threshold`-th failing answer in a row, or the `healthy_threshold`-th
//!   success) to the client's ACK: the probe result that changed the proxy's health, to
//!   the Envoy's ACK of the endpoints that follow from it.
//! - `flap` (`--flap`, `--flap-seconds`): ray-xds's CPU over a window of steady probing,
//!   then over a window as long in which that many proxies each fail for 2.5 s and answer
//!   for 2.5 s (phases spread evenly over the 5 s); the difference is what flapping costs.
//!
//! Ends with one line: `scale proxies=<n> start_s=<s> healthz_p50_ms=.. healthz_p99_ms=..
//! healthz_max_ms=.. edit_p50_ms=.. edit_max_ms=.. cpu_pct=.. rss_mib=..
//! change_to_envoy_ms=.. change_to_envoy_max_ms=.. flap_cores=..` (healthz over the start
//! and steady phases; `cpu_pct` over the steady phase; `change_to_envoy_ms` the median).

// A benchmark run reads top to bottom (set up, measure, report): its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;
use ray_xds::xds::snapshot::CLUSTER_TYPE_URL;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

#[path = "support/mod.rs"]
mod bench_support;
use bench_support::{
    cpu_seconds, free_port, http_get, metric_value, ms, percentile, rss_kib, write_atomic,
};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Proxies in all.
    #[arg(long, default_value_t = 20_000)]
    proxies: usize,
    /// Proxies per RayService (one cluster each).
    #[arg(long, default_value_t = 100)]
    per_service: usize,
    /// Source edits timed in the steady phase.
    #[arg(long, default_value_t = 5)]
    edits: usize,
    /// Seconds of the steady phase.
    #[arg(long, default_value_t = 20)]
    steady: u64,
    /// The responder closes each connection after its answer (every probe then opens
    /// one: a heavier load than kept-alive probes).
    #[arg(long)]
    close: bool,
    /// Health changes timed after the steady phase: a proxy fails its probes until an
    /// Envoy-like client has ACKed endpoints without it, then answers again until the
    /// client has ACKed endpoints with it (two changes each).
    #[arg(long, default_value_t = 10)]
    changes: usize,
    /// Proxies that flap (each unhealthy and healthy again every 5 s) in the flap phase.
    #[arg(long, default_value_t = 1000)]
    flap: usize,
    /// Seconds of the flap phase, and of the steady window measured before it.
    #[arg(long, default_value_t = 20)]
    flap_seconds: u64,
    /// ray-xds's log filter (`RAY_XDS_LOG`); its log goes to this benchmark's stderr.
    #[arg(long, default_value = "error")]
    log: String,
    /// The ray-xds binary [default: the one cargo built with this benchmark].
    #[arg(long)]
    ray_xds: Option<PathBuf>,
    /// Ignored: cargo passes it to every benchmark.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The `i`-th proxy's address on loopback (never 127.0.0.1, where the admin port is).
fn proxy_ip(i: usize) -> String {
    let n = i + 1;
    format!("127.{}.{}.{}", 1 + n / 62_500, (n / 250) % 250, 1 + n % 250)
}

fn services_yaml(args: &Args, port: u16, edits: usize) -> String {
    let mut s = String::from("rayservices:\n");
    let services = args.proxies.div_ceil(args.per_service);
    for svc in 0..services {
        s += &format!("  - name: svc-{svc}\n    namespace: scale\n    hosts: [\"svc-{svc}.scale\"]\n    active_cluster: c\n    clusters:\n      - name: c\n        proxies:\n");
        let first = svc * args.per_service;
        for i in first..(first + args.per_service).min(args.proxies) {
            s += &format!(
                "          - {{ address: \"{}:{port}\", node_type: {} }}\n",
                proxy_ip(i),
                if i == first { "head" } else { "worker" }
            );
        }
    }
    for e in 0..edits {
        s += &format!("  - name: edit-{e}\n    namespace: scale\n    hosts: [\"edit-{e}.scale\"]\n    active_cluster: c\n    clusters:\n      - name: c\n        proxies:\n          - {{ address: \"127.250.250.{}:{port}\", node_type: worker }}\n", e + 1);
    }
    s
}

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Answers one proxy gave: (when, succeeded).
type Answers = Vec<(Instant, bool)>;

/// Which proxies fail their probes, and the answers one watched proxy got.
#[derive(Default)]
struct Faults {
    failing: std::sync::RwLock<std::collections::HashSet<std::net::IpAddr>>,
    /// The proxies whose `/-/routes` ray-xds has read at least once.
    routes_read: Mutex<std::collections::HashSet<std::net::IpAddr>>,
    /// The watched proxy and its answers since it was watched: (when, succeeded).
    watched: Mutex<Option<(std::net::IpAddr, Answers)>>,
}

impl Faults {
    /// Whether `ip` fails its probe now; noted when `ip` is watched.
    fn answer(&self, ip: std::net::IpAddr) -> bool {
        let failing = self.failing.read().unwrap().contains(&ip);
        if let Some((watched, answers)) = &mut *self.watched.lock().unwrap() {
            if *watched == ip {
                answers.push((Instant::now(), !failing));
            }
        }
        failing
    }
}

/// Answers `/-/healthz` with `success` (or, for a proxy `faults` says fails, HTTP 500)
/// and `/-/routes` with `{"/": "app"}`; keeps each connection for the next request unless
/// `close`. Each proxy is told apart by the local address its connection reached.
async fn responder(listener: tokio::net::TcpListener, close: bool, faults: Arc<Faults>) {
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let faults = faults.clone();
        tokio::spawn(async move {
            let Ok(proxy) = conn.local_addr().map(|a| a.ip()) else {
                return;
            };
            let mut buf = vec![0u8; 4096];
            let mut have = 0;
            loop {
                let end = loop {
                    if let Some(i) = buf[..have].windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                    if have == buf.len() {
                        return;
                    }
                    match conn.read(&mut buf[have..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => have += n,
                    }
                };
                let (status, body): (&str, &[u8]) = if buf[..have].starts_with(b"GET /-/routes") {
                    faults.routes_read.lock().unwrap().insert(proxy);
                    ("200 OK", b"{\"/\": \"app\"}")
                } else if faults.answer(proxy) {
                    ("500 Internal Server Error", b"failing")
                } else {
                    ("200 OK", b"success")
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: {}\r\n\r\n",
                    body.len(),
                    if close { "close" } else { "keep-alive" }
                );
                let mut answer = head.into_bytes();
                answer.extend_from_slice(body);
                if conn.write_all(&answer).await.is_err() {
                    return;
                }
                if close {
                    let _ = conn.shutdown().await;
                    return;
                }
                buf.copy_within(end..have, 0);
                have -= end;
            }
        });
    }
}

/// What the endpoints client saw: (when its ACK was sent, cluster, addresses listed).
type Acked = (Instant, String, std::collections::HashSet<String>);

/// A state-of-the-world ADS stream to ray-xds on `xds_port` (connecting until it
/// listens): requests go in through the sender.
async fn ads_stream(
    xds_port: u16,
) -> (
    mpsc::Sender<DiscoveryRequest>,
    tonic::Streaming<envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse>,
) {
    let mut client = loop {
        match AggregatedDiscoveryServiceClient::connect(format!("http://127.0.0.1:{xds_port}"))
            .await
        {
            Ok(c) => break c.max_decoding_message_size(256 << 20),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let (tx, rx) = mpsc::channel(16);
    let responses = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, responses)
}

/// A state-of-the-world client of `clusters`' endpoints that ACKs each response and
/// reports, per assignment, the addresses it lists, timed at its ACK.
async fn endpoints_client(xds_port: u16, clusters: Vec<String>) -> mpsc::UnboundedReceiver<Acked> {
    use envoy_types::pb::envoy::config::core::v3::address::Address;
    use envoy_types::pb::envoy::config::endpoint::v3::{
        lb_endpoint::HostIdentifier, ClusterLoadAssignment,
    };
    use ray_xds::xds::snapshot::ENDPOINTS_TYPE_URL;
    let (tx, mut responses) = ads_stream(xds_port).await;
    tx.send(DiscoveryRequest {
        node: Some(Node {
            id: "scale-endpoints".into(),
            cluster: "scale".into(),
            ..Default::default()
        }),
        type_url: ENDPOINTS_TYPE_URL.into(),
        resource_names: clusters.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let (acked_tx, acked_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(r)) = responses.message().await {
            let assignments: Vec<ClusterLoadAssignment> = r
                .resources
                .iter()
                .filter_map(|a| ClusterLoadAssignment::decode(&*a.value).ok())
                .collect();
            let ack = DiscoveryRequest {
                type_url: r.type_url,
                version_info: r.version_info,
                response_nonce: r.nonce,
                resource_names: clusters.clone(),
                ..Default::default()
            };
            if tx.send(ack).await.is_err() {
                return;
            }
            let at = Instant::now();
            for cla in assignments {
                let listed = cla
                    .endpoints
                    .iter()
                    .flat_map(|l| &l.lb_endpoints)
                    .filter_map(|e| match &e.host_identifier {
                        Some(HostIdentifier::Endpoint(e)) => {
                            match e.address.as_ref()?.address.as_ref()? {
                                Address::SocketAddress(sa) => Some(sa.address.clone()),
                                _ => None,
                            }
                        }
                        _ => None,
                    })
                    .collect();
                let _ = acked_tx.send((at, cla.cluster_name, listed));
            }
        }
    });
    acked_rx
}

/// Raises this process's open-files limit (and so ray-xds's, which inherits it) to
/// `want`: kept-alive probes hold a descriptor per proxy on both sides. Raising the
/// hard limit needs root; otherwise the soft limit goes as high as the hard one.
fn raise_open_files(want: u64) {
    let (_, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE).unwrap_or((0, 0));
    if rlimit::setrlimit(rlimit::Resource::NOFILE, want, want.max(hard)).is_err() {
        let _ = rlimit::increase_nofile_limit(want);
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    raise_open_files(3 * args.proxies as u64 + 4096);
    let responder_listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let port = responder_listener.local_addr().unwrap().port();
    let faults = Arc::new(Faults::default());
    tokio::spawn(responder(responder_listener, args.close, faults.clone()));

    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    write_atomic(&services, &services_yaml(&args, port, 0));
    let (xds_port, admin_port) = (free_port(), free_port());
    let binary = args
        .ray_xds
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ray-xds")));
    let started = Instant::now();
    let server = Server(
        Command::new(&binary)
            .args(["serve", "--source-file"])
            .arg(&services)
            .args([
                "--xds-listen",
                &format!("127.0.0.1:{xds_port}"),
                "--admin-listen",
                &format!("127.0.0.1:{admin_port}"),
            ])
            .env("RAY_XDS_LOG", &args.log)
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display())),
    );
    let pid = server.0.id();

    // /healthz every 50 ms, from the start to the end.
    let samples: Arc<Mutex<Vec<(Instant, Duration)>>> = Arc::default();
    let failures = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (s, f) = (samples.clone(), failures.clone());
    let sampler = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let t = Instant::now();
            match http_get(admin_port, "/healthz", Duration::from_secs(10)).await {
                Some((200, _)) => {
                    s.lock().unwrap().push((t, t.elapsed()));
                }
                // Before the admin port is bound, a refused connection is not a sample.
                _ if s.lock().unwrap().is_empty() => {}
                _ => {
                    f.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    s.lock().unwrap().push((t, t.elapsed()));
                }
            }
        }
    });

    // Start-up: until every proxy is healthy in the metrics' eyes (probes complete and
    // no fail-open), read from /debug/state's probes_complete and /readyz.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        assert!(Instant::now() < deadline, "ray-xds did not start in 600 s");
        if let Some((200, _)) = http_get(admin_port, "/readyz", Duration::from_secs(10)).await {
            {
                let metrics = http_get(admin_port, "/metrics", Duration::from_secs(30))
                    .await
                    .map(|(_, body)| body)
                    .unwrap_or_default();
                let healthy = metric_value(
                    &metrics,
                    "ray_xds_proxy_health_transitions_total{state=\"healthy\"}",
                )
                .unwrap_or(0.0);
                if healthy as usize >= args.proxies {
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let start_s = started.elapsed().as_secs_f64();
    println!("start: every proxy healthy after {start_s:.1} s");
    // Then every proxy's first route table (read 16 at a time, each a publication of the
    // prober and a build): until then ray-xds is still starting, and what follows is
    // measured in the steady state.
    let until = Instant::now() + Duration::from_secs(600);
    while faults.routes_read.lock().unwrap().len() < args.proxies {
        assert!(
            Instant::now() < until,
            "route tables read: {} of {}",
            faults.routes_read.lock().unwrap().len(),
            args.proxies
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let routes_s = started.elapsed().as_secs_f64();
    println!("start: every proxy's route table read after {routes_s:.1} s");

    // Steady: an ADS client follows the clusters; edits add a RayService each.
    let (tx, mut responses) = ads_stream(xds_port).await;
    let node = Some(Node {
        id: "scale".into(),
        cluster: "scale".into(),
        ..Default::default()
    });
    tx.send(DiscoveryRequest {
        node: node.clone(),
        type_url: CLUSTER_TYPE_URL.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let (names_tx, mut names_rx) = mpsc::unbounded_channel::<Vec<String>>();
    tokio::spawn(async move {
        while let Ok(Some(r)) = responses.message().await {
            let names = r
                .resources
                .iter()
                .filter_map(|a| Cluster::decode(&*a.value).ok())
                .map(|c| c.name)
                .collect();
            let _ = names_tx.send(names);
            let ack = DiscoveryRequest {
                node: None,
                type_url: r.type_url,
                version_info: r.version_info,
                response_nonce: r.nonce,
                ..Default::default()
            };
            if tx.send(ack).await.is_err() {
                return;
            }
        }
    });
    let steady_from = Instant::now();
    let cpu_from = cpu_seconds(pid);
    let mut edit_times = Vec::new();
    let pause = Duration::from_secs(args.steady) / (args.edits as u32 + 1);
    for e in 0..args.edits {
        tokio::time::sleep(pause).await;
        while names_rx.try_recv().is_ok() {}
        let want = format!("scale/edit-{e}/c");
        let t = Instant::now();
        write_atomic(&services, &services_yaml(&args, port, e + 1));
        let seen = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(names) = names_rx.recv().await {
                if names.contains(&want) {
                    return;
                }
            }
        })
        .await;
        assert!(seen.is_ok(), "edit {e} did not reach the client in 60 s");
        let took = t.elapsed();
        let written = std::time::SystemTime::now() - took;
        let unix = written
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        println!(
            "edit {e}: {:.0} ms (written at unix {:.3})",
            ms(took),
            unix.as_secs_f64()
        );
        edit_times.push(took);
    }
    let left = Duration::from_secs(args.steady).saturating_sub(steady_from.elapsed());
    tokio::time::sleep(left).await;
    let cpu_pct = (cpu_seconds(pid) - cpu_from) / steady_from.elapsed().as_secs_f64() * 100.0;
    let rss_mib = rss_kib(pid) as f64 / 1024.0;
    let healthz_until = Instant::now();

    // Change: one worker proxy's health at a time, to the endpoints client's ACK.
    let probe = ray_xds::policy::probe::ProbePolicy::default();
    let services_n = args.proxies.div_ceil(args.per_service);
    let changing: Vec<(String, std::net::IpAddr)> = (0..args.changes)
        .map(|k| {
            let svc = (k * 37) % services_n;
            let first = svc * args.per_service;
            let in_service = (first + args.per_service).min(args.proxies) - first;
            // A worker: with the default `head_proxy: fallback` the head is not listed.
            let i = first + 1 + k % in_service.saturating_sub(1).max(1);
            (format!("scale/svc-{svc}/c"), proxy_ip(i).parse().unwrap())
        })
        .collect();
    let mut clusters: Vec<String> = changing.iter().map(|(c, _)| c.clone()).collect();
    clusters.sort();
    clusters.dedup();
    let mut acked = endpoints_client(xds_port, clusters).await;
    let mut change_times = Vec::new();
    for (cluster, ip) in &changing {
        for fail in [true, false] {
            tokio::time::sleep(Duration::from_millis(500)).await;
            while acked.try_recv().is_ok() {}
            *faults.watched.lock().unwrap() = Some((*ip, Vec::new()));
            {
                let mut failing = faults.failing.write().unwrap();
                if fail {
                    failing.insert(*ip);
                } else {
                    failing.remove(ip);
                }
            }
            let address = ip.to_string();
            let seen = tokio::time::timeout(Duration::from_secs(60), async {
                while let Some((at, name, listed)) = acked.recv().await {
                    if name == *cluster && listed.contains(&address) != fail {
                        return at;
                    }
                }
                panic!("the endpoints client ended");
            })
            .await;
            let at = seen.unwrap_or_else(|_| {
                panic!(
                    "{address} turning {} did not reach the client in 60 s",
                    if fail { "unhealthy" } else { "healthy" }
                )
            });
            let answers = faults.watched.lock().unwrap().take().unwrap().1;
            let threshold = if fail {
                probe.unhealthy_threshold
            } else {
                probe.healthy_threshold
            };
            // The answer that completed the threshold: the `threshold`-th of the new kind
            // in a row, before the ACK.
            let mut run = 0;
            let decisive = answers
                .iter()
                .filter(|(t, _)| *t <= at)
                .find_map(|(t, ok)| {
                    run = if *ok != fail { run + 1 } else { 0 };
                    (run == threshold).then_some(*t)
                });
            let Some(decisive) = decisive else {
                panic!("{address}: the client ACKed the change before the responder gave {threshold} answers of it: {answers:?}");
            };
            let took = at - decisive;
            // The deciding answer's wall-clock time, to read beside ray-xds's log.
            let decided_at = std::time::SystemTime::now() - decisive.elapsed();
            println!(
                "change {address} {}: {:.1} ms from the deciding answer (at {:.6} s since the epoch) to the ACK",
                if fail { "unhealthy" } else { "healthy" },
                ms(took),
                decided_at
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs_f64(),
            );
            change_times.push(took);
        }
    }
    change_times.sort();

    // Flap: CPU over a steady window, then over one as long with `--flap` proxies flapping.
    let window = Duration::from_secs(args.flap_seconds);
    let cpu_from = cpu_seconds(pid);
    tokio::time::sleep(window).await;
    let steady_cores = (cpu_seconds(pid) - cpu_from) / window.as_secs_f64();
    let workers: Vec<usize> = (0..args.proxies)
        .filter(|i| i % args.per_service != 0)
        .collect();
    let flapping: Vec<std::net::IpAddr> = (0..args.flap.min(workers.len()))
        .map(|j| {
            proxy_ip(workers[j * workers.len() / args.flap.min(workers.len()).max(1)])
                .parse()
                .unwrap()
        })
        .collect();
    let period = Duration::from_secs(5);
    let flap_from = Instant::now();
    let cpu_from = cpu_seconds(pid);
    while flap_from.elapsed() < window {
        let now = flap_from.elapsed();
        let failing: std::collections::HashSet<std::net::IpAddr> = flapping
            .iter()
            .enumerate()
            .filter(|(j, _)| {
                let offset = period * *j as u32 / flapping.len() as u32;
                ((now + offset).as_millis() % period.as_millis()) < period.as_millis() / 2
            })
            .map(|(_, ip)| *ip)
            .collect();
        *faults.failing.write().unwrap() = failing;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let flap_cores = (cpu_seconds(pid) - cpu_from) / flap_from.elapsed().as_secs_f64();
    faults.failing.write().unwrap().clear();
    println!(
        "flap: {} proxies flapping: {flap_cores:.2} cores against {steady_cores:.2} steady",
        flapping.len()
    );
    sampler.abort();

    let all: Vec<(Instant, Duration)> = samples
        .lock()
        .unwrap()
        .iter()
        .filter(|(t, _)| *t < healthz_until)
        .copied()
        .collect();
    let mut start_phase: Vec<Duration> = all
        .iter()
        .filter(|(t, _)| *t < steady_from)
        .map(|(_, d)| *d)
        .collect();
    let mut steady_phase: Vec<Duration> = all
        .iter()
        .filter(|(t, _)| *t >= steady_from)
        .map(|(_, d)| *d)
        .collect();
    let mut both: Vec<Duration> = all.iter().map(|(_, d)| *d).collect();
    for v in [&mut start_phase, &mut steady_phase, &mut both] {
        v.sort();
    }
    edit_times.sort();
    println!();
    println!("| phase  | /healthz samples | p50 ms | p99 ms | max ms |");
    println!("|--------|-----------------:|-------:|-------:|-------:|");
    for (name, v) in [("start", &start_phase), ("steady", &steady_phase)] {
        println!(
            "| {name:<6} | {:>16} | {:>6.1} | {:>6.1} | {:>6.1} |",
            v.len(),
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.99)),
            ms(percentile(v, 1.0))
        );
    }
    println!(
        "/healthz failures: {}",
        failures.load(std::sync::atomic::Ordering::Relaxed)
    );
    println!(
        "scale proxies={} start_s={start_s:.1} routes_s={routes_s:.1} healthz_p50_ms={:.1} healthz_p99_ms={:.1} healthz_max_ms={:.1} edit_p50_ms={:.0} edit_max_ms={:.0} cpu_pct={cpu_pct:.0} rss_mib={rss_mib:.0} change_to_envoy_ms={:.1} change_to_envoy_max_ms={:.1} flap_cores={:.2}",
        args.proxies,
        ms(percentile(&both, 0.5)),
        ms(percentile(&both, 0.99)),
        ms(percentile(&both, 1.0)),
        ms(percentile(&edit_times, 0.5)),
        ms(percentile(&edit_times, 1.0)),
        ms(percentile(&change_times, 0.5)),
        ms(percentile(&change_times, 1.0)),
        flap_cores - steady_cores,
    );
    drop(server);
    // The admin port must answer throughout (every edit reaching the client is asserted
    // above); how fast is a figure, not a verdict.
    let failed = failures.load(std::sync::atomic::Ordering::Relaxed);
    if failed > 0 {
        eprintln!("scale: /healthz failed {failed} times");
        std::process::exit(1);
    }
}

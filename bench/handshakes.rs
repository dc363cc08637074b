//! Handshake benchmark: a flood of TLS handshakes from one address against ray-xds's mTLS
//! xDS port, while ray-xds probes a fleet of proxies and a good client from another
//! address connects once a second. Whether a flood can starve the probes (a proxy
//! falsely marked down) or lock out a good client, with and without the per-address
//! handshake rate (`xds.handshakes_per_peer_per_second`).
//!
//! `cargo bench --bench handshakes -- --help`
//!
//! ray-xds is this build's binary (release under `cargo bench`), a process of its own (its CPU is read
//! from `/proc`), with its default probe settings and a server key of `--key` (RSA-4096
//! by default: the costliest signature a deployment is likely to hold). The proxies
//! (`--proxies`, simulated, healthy throughout) run on a thread of their own in this
//! process, so the flood's client work cannot slow their answers. The flood is
//! open-loop: `--rate` connections a second from 127.0.0.1, each a full TLS handshake
//! without a client certificate (the server signs, then refuses it), each given 5 s. The
//! good client connects from 127.0.0.2 once a second with a valid certificate, and
//! succeeds when it reads the server's HTTP/2 SETTINGS within 5 s.
//!
//! Arms (`--arm`): `limited` (the default rate of 20 a second, or `--limit`) and
//! `unlimited` (0: no rate). One line per arm:
//! `handshakes arm=<arm> per_second=<limit> attempted=<n> handshakes_done=<n>
//! closed_before=<n> closed_by_peer_cap=<n> falsely_down=<n> good=<ok>/<n>
//! slowest_good_ms=<x> cpu_cores=<y>`.
//! `closed_before` is ray-xds's count of connections closed by the rate before any
//! handshake work, `closed_by_peer_cap` by the cap on connections from one address
//! (`xds.max_connections_per_peer`, 256), `handshakes_done` its count of handshakes that ran and failed (each
//! flood connection lacks a certificate), `falsely_down` its transitions of a proxy to
//! unhealthy (every proxy is healthy all along). With `--assert` the benchmark exits 1
//! when a `limited` arm marks a proxy down or a good client fails.

// A benchmark run reads top to bottom (set up, measure, report): its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use ray_serve_sim::NodeType;
use ray_serve_sim::{serve_proxy_with, ProxyConfig, ProxyHandle};
use rustls::pki_types::ServerName;
use support::*;
use tokio_util::sync::CancellationToken;

#[path = "support/mod.rs"]
mod bench_support;

#[derive(Parser)]
struct Args {
    /// Arms to run: `limited`, `unlimited` (both by default).
    #[arg(long = "arm")]
    arms: Vec<String>,
    /// Flood connections a second from one address.
    #[arg(long, default_value_t = 500)]
    rate: u64,
    /// Seconds of flood.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// Proxies ray-xds probes meanwhile.
    #[arg(long, default_value_t = 200)]
    proxies: usize,
    /// The `limited` arm's handshakes a second per address (ray-xds's default: 20).
    #[arg(long, default_value_t = 20)]
    limit: u32,
    /// The server key: `rsa4096`, `rsa2048` or `p256`.
    #[arg(long, default_value = "rsa4096", value_parser = ["rsa4096", "rsa2048", "p256"])]
    key: String,
    /// The ray-xds binary (default: this build's).
    #[arg(long)]
    binary: Option<std::path::PathBuf>,
    /// Exit 1 when a `limited` arm marks a proxy down or a good client fails.
    #[arg(long)]
    assert: bool,
    #[arg(long, hide = true)]
    bench: bool,
}

/// The HTTP/2 client preface and an empty SETTINGS frame.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// The simulated proxies, on a thread and runtime of their own.
fn start_proxies(n: usize, stop: CancellationToken) -> Vec<SocketAddr> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("proxies".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let mut addresses = Vec::new();
                for i in 0..n {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                    addresses.push(listener.local_addr().unwrap());
                    let config = ProxyConfig {
                        cluster: "bench".into(),
                        node_type: if i % 100 == 0 {
                            NodeType::Head
                        } else {
                            NodeType::Worker
                        },
                        routes: [("/".to_string(), "app".to_string())].into(),
                    };
                    tokio::spawn(serve_proxy_with(
                        listener,
                        config,
                        ProxyHandle::default(),
                        stop.clone(),
                    ));
                }
                tx.send(addresses).unwrap();
                stop.cancelled().await;
            });
        })
        .unwrap();
    rx.recv().unwrap()
}

fn openssl_key(bits: Option<u32>) -> String {
    let mut cmd = Command::new("openssl");
    cmd.arg("genpkey");
    match bits {
        Some(bits) => cmd.args([
            "-algorithm",
            "RSA",
            "-pkeyopt",
            &format!("rsa_keygen_bits:{bits}"),
        ]),
        None => cmd.args(["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"]),
    };
    let out = cmd.output().expect("openssl");
    assert!(out.status.success(), "openssl genpkey failed");
    String::from_utf8(out.stdout).unwrap()
}

fn client_config(ca_pem: &str, identity: Option<(&str, &str)>) -> Arc<rustls::ClientConfig> {
    let mut config = support::tls::client_config(ca_pem, identity, &[b"h2"]);
    // Every connection a full handshake: no resumption.
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

/// A TLS connection from `source` to `port` that reads the server's first HTTP/2
/// frame (SETTINGS), within 5 s.
async fn connect(
    source: IpAddr,
    port: u16,
    config: Arc<rustls::ClientConfig>,
) -> Result<(), String> {
    let attempt = async {
        let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
        socket
            .bind((source, 0).into())
            .map_err(|e| format!("bind: {e}"))?;
        let tcp = socket
            .connect(([127, 0, 0, 1], port).into())
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut tls = tokio_rustls::TlsConnector::from(config)
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        support::tls::first_frame_is_settings(&mut tls, PREFACE).await
    };
    tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .map_err(|_| "no SETTINGS within 5 s".to_string())?
}

struct ArmResult {
    arm: String,
    per_second: u32,
    attempted: u64,
    handshakes_done: f64,
    closed_before: f64,
    closed_by_peer_cap: f64,
    falsely_down: f64,
    good_ok: usize,
    good_tried: usize,
    slowest_good: Duration,
    cpu_cores: f64,
}

async fn run_arm(args: &Args, arm: &str, proxies: &[SocketAddr]) -> ArmResult {
    let per_second = match arm {
        "limited" => args.limit,
        "unlimited" => 0,
        other => panic!("unknown arm {other}"),
    };
    let dir = tempfile::tempdir().unwrap();
    let pki = support::tls::TestPki::new(&dir.path().join("pki"));
    let key = match args.key.as_str() {
        "rsa4096" => openssl_key(Some(4096)),
        "rsa2048" => openssl_key(Some(2048)),
        _ => openssl_key(None),
    };
    pki.issue_server_for_key(&pki.server_cert_path, &pki.server_key_path, &key);
    let ca_pem = std::fs::read_to_string(&pki.ca_pem_path).unwrap();
    let (client_cert, client_key) = pki.client_pem("good-envoy");
    let good = client_config(&ca_pem, Some((&client_cert, &client_key)));
    let anonymous = client_config(&ca_pem, None);

    let services = dir.path().join("services.yaml");
    let text = bench_support::services_of(proxies);
    std::fs::write(&services, text).unwrap();
    let (xds, admin) = (free_port(), free_port());
    let mut server = spawn(
        "ray-xds",
        Command::new(
            args.binary
                .clone()
                .unwrap_or_else(|| env!("CARGO_BIN_EXE_ray-xds").into()),
        )
        .args(["serve", "--xds-listen", &format!("127.0.0.1:{xds}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .arg("--source-file")
        .arg(&services)
        .arg("--xds-tls-cert")
        .arg(&pki.server_cert_path)
        .arg("--xds-tls-key")
        .arg(&pki.server_key_path)
        .arg("--xds-tls-client-ca")
        .arg(&pki.ca_pem_path)
        .args([
            "--xds-handshakes-per-peer-per-second",
            &per_second.to_string(),
        ])
        .env("RAY_XDS_LOG", "error")
        .stdout(Stdio::null()),
    );
    let pid = server.child.id();
    let metrics = || async {
        http_get(&format!("http://127.0.0.1:{admin}/metrics"))
            .await
            .map(|(_, b)| b)
            .unwrap_or_default()
    };
    bench_support::wait_ready(admin).await;
    eventually("every proxy healthy", Duration::from_secs(60), || async {
        let m = metrics().await;
        let healthy = metric(
            &m,
            "ray_xds_proxy_health_transitions_total{state=\"healthy\"}",
        );
        (healthy >= proxies.len() as f64).then_some(())
    })
    .await;
    let good_first = connect("127.0.0.2".parse().unwrap(), xds, good.clone()).await;
    assert!(
        good_first.is_ok(),
        "a good client before the flood: {good_first:?}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;

    let unhealthy = "ray_xds_proxy_health_transitions_total{state=\"unhealthy\"}";
    let rated =
        "ray_xds_xds_stream_errors_total{protocol=\"connection\",reason=\"handshake_rate\"}";
    let failed =
        "ray_xds_xds_stream_errors_total{protocol=\"connection\",reason=\"tls_handshake\"}";
    let capped =
        "ray_xds_xds_stream_errors_total{protocol=\"connection\",reason=\"over_peer_limit\"}";
    let before = metrics().await;
    let cpu0 = (bench_support::cpu_seconds(pid), Instant::now());

    let stop = CancellationToken::new();
    let attempted = Arc::new(AtomicU64::new(0));
    let flood = tokio::spawn({
        let (stop, attempted, anonymous) = (stop.clone(), attempted.clone(), anonymous.clone());
        let every = Duration::from_secs_f64(1.0 / args.rate as f64);
        async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut tries = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                attempted.fetch_add(1, Ordering::Relaxed);
                let config = anonymous.clone();
                tries.spawn(async move {
                    let _ = connect("127.0.0.1".parse().unwrap(), xds, config).await;
                });
                while tries.try_join_next().is_some() {}
            }
            while tries.join_next().await.is_some() {}
        }
    });
    let mut good_results = Vec::new();
    let flood_started = Instant::now();
    while flood_started.elapsed() < Duration::from_secs(args.seconds) {
        let started = Instant::now();
        let ok = connect("127.0.0.2".parse().unwrap(), xds, good.clone())
            .await
            .is_ok();
        good_results.push((ok, started.elapsed()));
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(started.elapsed())).await;
    }
    stop.cancel();
    let cpu1 = (bench_support::cpu_seconds(pid), Instant::now());
    flood.await.unwrap();
    // Let the last handshakes end and the counts settle.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let after = metrics().await;
    let delta = |series: &str| metric(&after, series) - metric(&before, series);
    let _ = server.child.kill();
    ArmResult {
        arm: arm.to_string(),
        per_second,
        attempted: attempted.load(Ordering::Relaxed),
        handshakes_done: delta(failed),
        closed_before: delta(rated),
        closed_by_peer_cap: delta(capped),
        falsely_down: delta(unhealthy),
        good_ok: good_results.iter().filter(|(ok, _)| *ok).count(),
        good_tried: good_results.len(),
        slowest_good: good_results
            .iter()
            .map(|(_, t)| *t)
            .max()
            .unwrap_or_default(),
        cpu_cores: (cpu1.0 - cpu0.0) / (cpu1.1 - cpu0.1).as_secs_f64(),
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let arms = if args.arms.is_empty() {
        vec!["limited".to_string(), "unlimited".to_string()]
    } else {
        args.arms.clone()
    };
    let stop = CancellationToken::new();
    let proxies = start_proxies(args.proxies, stop.clone());
    let mut broken = Vec::new();
    for arm in &arms {
        let r = run_arm(&args, arm, &proxies).await;
        println!(
            "handshakes arm={} per_second={} attempted={} handshakes_done={} closed_before={} closed_by_peer_cap={} falsely_down={} good={}/{} slowest_good_ms={} cpu_cores={:.2} key={} proxies={}",
            r.arm,
            r.per_second,
            r.attempted,
            r.handshakes_done,
            r.closed_before,
            r.closed_by_peer_cap,
            r.falsely_down,
            r.good_ok,
            r.good_tried,
            r.slowest_good.as_millis(),
            r.cpu_cores,
            args.key,
            args.proxies,
        );
        if r.arm == "limited" && (r.falsely_down > 0.0 || r.good_ok < r.good_tried) {
            broken.push(format!(
                "{}: {} proxies falsely down, {} of {} good clients failed",
                r.arm,
                r.falsely_down,
                r.good_tried - r.good_ok,
                r.good_tried
            ));
        }
    }
    stop.cancel();
    if args.assert && !broken.is_empty() {
        eprintln!("handshakes: broken: {}", broken.join("; "));
        std::process::exit(1);
    }
}

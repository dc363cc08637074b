//! Detection benchmark: from a Ray Serve proxy's death to every connected Envoy holding
//! its new health, with default probe settings; and what probing 2,000 proxies costs.
//!
//! `cargo bench --bench detection -- --help`
//!
//! Real Envoy 1.40 processes (from `scripts/install-envoy.sh`), ray-xds and simulated
//! proxies, all on loopback. A proxy dies in one of two ways: killed (its port refuses
//! connections, like a SIGKILLed Ray proxy) or hung (accepts and never answers, like a
//! SIGSTOPped one). Each Envoy's admin `/clusters` is polled every 5 ms.

#[path = "../tests/support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use ray_serve_sim::NodeType;
use ray_serve_sim::{serve_proxy_with, ProxyConfig, ProxyHandle, ProxyMode};
use support::*;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Args {
    /// Trials per fault kind.
    #[arg(long, default_value_t = 20)]
    trials: usize,
    /// Envoys connected to ray-xds (alternating state-of-the-world and delta).
    #[arg(long, default_value_t = 2)]
    envoys: usize,
    /// Proxies for the probe-cost run (0 skips it).
    #[arg(long, default_value_t = 2000)]
    cost_proxies: usize,
    /// Seconds over which probe cost is measured.
    #[arg(long, default_value_t = 10)]
    cost_seconds: u64,
    #[arg(long, hide = true)]
    bench: bool,
}

struct Proxy {
    address: SocketAddr,
    handle: ProxyHandle,
    token: CancellationToken,
}

impl Proxy {
    async fn start(address: SocketAddr, node_type: NodeType) -> Proxy {
        let listener = tokio::net::TcpListener::bind(address).await.unwrap();
        let address = listener.local_addr().unwrap();
        let handle = ProxyHandle::default();
        let token = CancellationToken::new();
        let config = ProxyConfig {
            cluster: "bench".into(),
            node_type,
            routes: [("/".to_string(), "app".to_string())].into(),
        };
        tokio::spawn(serve_proxy_with(
            listener,
            config,
            handle.clone(),
            token.clone(),
        ));
        Proxy {
            address,
            handle,
            token,
        }
    }
}

async fn host_flags(envoy: &Envoy, cluster: &str, addr: SocketAddr) -> Option<String> {
    let text = envoy.admin("/clusters").await;
    let prefix = format!("{cluster}::{addr}::health_flags::");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
}

async fn all_envoys(
    envoys: &[Envoy],
    cluster: &str,
    addr: SocketAddr,
    check: impl Fn(Option<&str>) -> bool,
) {
    loop {
        let mut ok = true;
        for e in envoys {
            if !check(host_flags(e, cluster, addr).await.as_deref()) {
                ok = false;
                break;
            }
        }
        if ok {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn summary(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    let ms = |d: Duration| d.as_millis();
    println!(
        "detection {name}: n={} p50 {} ms, p99 {} ms, max {} ms",
        v.len(),
        ms(p(0.5)),
        ms(p(0.99)),
        ms(v[v.len() - 1])
    );
}

async fn detection(args: &Args) {
    let mut proxies = Vec::new();
    for i in 0..4 {
        let node_type = if i == 0 {
            NodeType::Head
        } else {
            NodeType::Worker
        };
        proxies.push(Proxy::start("127.0.0.1:0".parse().unwrap(), node_type).await);
    }
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    let mut text = "rayservices:\n  - name: demo\n    hosts: ['*']\n    active_cluster: c\n    head_proxy: include\n    clusters:\n      - name: c\n        proxies:\n".to_string();
    for (i, p) in proxies.iter().enumerate() {
        text += &format!(
            "          - {{ address: {}, node_type: {} }}\n",
            p.address,
            if i == 0 { "head" } else { "worker" }
        );
    }
    std::fs::write(&services, text).unwrap();
    let xds = ray_xds::runtime::start(test_config(&services, 0), Default::default())
        .await
        .unwrap();
    let envoys: Vec<Envoy> = (0..args.envoys)
        .map(|i| {
            Envoy::start(
                if i % 2 == 0 {
                    Bootstrap::Sotw
                } else {
                    Bootstrap::Delta
                },
                xds.xds_addr.port(),
            )
        })
        .collect();
    let cluster = "default/demo/c";
    for p in &proxies {
        all_envoys(&envoys, cluster, p.address, |f| f == Some("healthy")).await;
    }
    let (mut refused, mut hung) = (Vec::new(), Vec::new());
    for trial in 0..args.trials {
        let i = 1 + trial % 3;
        // Killed: the port refuses connections.
        let addr = proxies[i].address;
        // Faults strike at a random point of the probe cycle, not right after a probe.
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..700))).await;
        let started = Instant::now();
        proxies[i].token.cancel();
        all_envoys(&envoys, cluster, addr, |f| f.is_none()).await;
        refused.push(started.elapsed());
        proxies[i] = Proxy::start(addr, NodeType::Worker).await;
        all_envoys(&envoys, cluster, addr, |f| f == Some("healthy")).await;
        // Hung: accepts, never answers.
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..700))).await;
        let started = Instant::now();
        proxies[i].handle.set(ProxyMode::Hang);
        all_envoys(&envoys, cluster, addr, |f| f.is_none()).await;
        hung.push(started.elapsed());
        proxies[i].handle.set(ProxyMode::Serving);
        all_envoys(&envoys, cluster, addr, |f| f == Some("healthy")).await;
    }
    println!("detection: {} Envoys ({}), default probe settings (500 ms interval ±20%, 250 ms timeout, 2 failures)", args.envoys, if args.envoys > 1 { "SotW and delta" } else { "SotW" });
    summary("killed (connection refused)", refused);
    summary("hung (no answer)", hung);
    xds.stop().await.unwrap();
}

async fn probe_cost(args: &Args) {
    let mut proxies = Vec::new();
    for i in 0..args.cost_proxies {
        proxies.push(
            Proxy::start(
                "127.0.0.1:0".parse().unwrap(),
                if i % 100 == 0 {
                    NodeType::Head
                } else {
                    NodeType::Worker
                },
            )
            .await,
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    let mut text = String::from("rayservices:\n");
    for (s, chunk) in proxies.chunks(100).enumerate() {
        text += &format!("  - name: s{s}\n    hosts: ['s{s}']\n    active_cluster: c\n    clusters:\n      - name: c\n        proxies:\n");
        for (i, p) in chunk.iter().enumerate() {
            text += &format!(
                "          - {{ address: {}, node_type: {} }}\n",
                p.address,
                if i == 0 { "head" } else { "worker" }
            );
        }
    }
    std::fs::write(&services, text).unwrap();
    let admin = free_port();
    let mut server = spawn(
        "ray-xds",
        Command::new(env!("CARGO_BIN_EXE_ray-xds"))
            .args([
                "serve",
                "--xds-listen",
                "127.0.0.1:0",
                "--admin-listen",
                &format!("127.0.0.1:{admin}"),
                "--source-file",
            ])
            .arg(&services)
            .env("RAY_XDS_LOG", "warn")
            .stdout(Stdio::null()),
    );
    let pid = server.child.id();
    eventually("ray-xds is ready", Duration::from_secs(60), || async {
        http_get(&format!("http://127.0.0.1:{admin}/readyz"))
            .await
            .ok()
            .filter(|(s, _)| *s == 200)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu = |pid: u32| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let f: Vec<f64> = stat
            .rsplit_once(')')
            .map(|(_, r)| r)
            .unwrap_or("")
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0
    };
    let probes_done = || async {
        let m = http_get(&format!("http://127.0.0.1:{admin}/metrics"))
            .await
            .map(|(_, b)| b)
            .unwrap_or_default();
        metric(&m, "ray_xds_probe_duration_seconds_count")
    };
    let p0 = probes_done().await;
    let (c0, t0) = (cpu(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(args.cost_seconds)).await;
    let (c1, t1) = (cpu(pid), Instant::now());
    let sockets = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter(|l| l.to_string_lossy().starts_with("socket:"))
                .count()
        })
        .unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let p1 = probes_done().await;
    let metrics = http_get(&format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .map(|(_, b)| b)
        .unwrap_or_default();
    let healthy_transitions = metric(
        &metrics,
        "ray_xds_proxy_health_transitions_total{state=\"healthy\"}",
    );
    println!(
        "probe cost: {} proxies, default settings: ray-xds CPU {:.1}% of one core, {} sockets, {} threads, RSS {}, {:.0} probes/s, {} proxies healthy",
        args.cost_proxies,
        (c1 - c0) / (t1 - t0).as_secs_f64() * 100.0,
        sockets,
        field("Threads:"),
        field("VmRSS:"),
        (p1 - p0) / (t1 - t0).as_secs_f64(),
        healthy_transitions
    );
    let _ = server.child.kill();
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    detection(&args).await;
    if args.cost_proxies > 0 {
        probe_cost(&args).await;
    }
}

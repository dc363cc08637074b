//! Real-Ray kill benchmark: how long after a real Ray Serve proxy is SIGKILLed Envoy stops
//! sending it requests, and how many requests fail meanwhile.
//!
//! `cargo bench --bench real_ray_kill -- --help`
//!
//! A real Ray 2.60 cluster (head + one worker node in a network namespace, see
//! `crates/test-support/src/real_ray/`), ray-xds probing both proxies and reading the dashboard,
//! a real Envoy with steady requests. Each trial kills the worker node's proxy process and
//! polls Envoy's admin `/clusters` every 5 ms until that endpoint is no longer healthy,
//! then waits for Ray to restart the proxy (about 25 s) before the next trial.

// A benchmark run reads top to bottom (set up, measure, report): its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use support::real_ray::{App, RealRayCluster};
use support::*;

#[derive(Parser)]
struct Args {
    /// Kills to time.
    #[arg(long, default_value_t = 5)]
    trials: usize,
    /// Requests per second through Envoy during the trials.
    #[arg(long, default_value_t = 100)]
    rps: u64,
    /// Replay requests reset mid-way (the application is idempotent).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    idempotent: bool,
    #[arg(long, hide = true)]
    bench: bool,
}

async fn flags(envoy: &Envoy, addr: SocketAddr) -> Option<String> {
    let needle = format!("::{addr}::health_flags::");
    envoy
        .admin("/clusters")
        .await
        .lines()
        .find_map(|l| l.split_once(&needle).map(|(_, f)| f.to_string()))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let cluster = RealRayCluster::start("a", 1).await;
    cluster.deploy(&[App {
        extra: "deployments: [ { name: Hello, num_replicas: 2 } ]",
        ..App::hello("/")
    }]);
    cluster.wait_for_app("hello", "RUNNING").await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(
        &services,
        format!(
            "rayservices:\n  - name: demo\n    hosts: ['*']\n    head_proxy: include\n    active_cluster: a\n    traffic: {{ idempotent: {} }}\n    clusters:\n      - name: a\n        dashboard: {}\n        proxies:\n          - {{ address: {}, node_type: head }}\n          - {{ address: {}, node_type: worker }}\n",
            args.idempotent,
            cluster.dashboard_url(),
            cluster.head_proxy(),
            cluster.worker_proxy()
        ),
    )
    .unwrap();
    let xds = ray_xds::runtime::start(test_config(&services, 0), Default::default())
        .await
        .unwrap();
    let envoy = Envoy::start(Bootstrap::Sotw, xds.xds_addr.port());
    let port = envoy.gateway_port().await;
    let worker = cluster.worker_proxy();

    let stop = Arc::new(AtomicBool::new(false));
    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let reasons: Arc<std::sync::Mutex<std::collections::BTreeMap<String, usize>>> =
        Default::default();
    let load = tokio::spawn({
        let (stop, sent, failed, reasons) =
            (stop.clone(), sent.clone(), failed.clone(), reasons.clone());
        let gap = Duration::from_micros(1_000_000 / args.rps.max(1));
        async move {
            let mut tick = tokio::time::interval(gap);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let (sent, failed) = (sent.clone(), failed.clone());
                let reasons = reasons.clone();
                tokio::spawn(async move {
                    let outcome = http("POST", &format!("http://127.0.0.1:{port}/"), "{}").await;
                    sent.fetch_add(1, Ordering::Relaxed);
                    let why = match outcome {
                        Ok((200, _)) => return,
                        Ok((status, body)) => {
                            format!("{status} {}", body.chars().take(60).collect::<String>())
                        }
                        Err(e) => e.chars().take(60).collect(),
                    };
                    failed.fetch_add(1, Ordering::Relaxed);
                    *reasons.lock().unwrap().entry(why).or_insert(0usize) += 1;
                });
            }
        }
    });

    let mut times = Vec::new();
    for trial in 1..=args.trials {
        // Both proxies serving, in Envoy too.
        let pid = eventually(
            "the worker's proxy runs and is healthy in Envoy",
            Duration::from_secs(120),
            || async {
                let pid = cluster.worker_proxy_pid()?;
                (flags(&envoy, worker).await? == "healthy").then_some(pid)
            },
        )
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let failed_before = failed.load(Ordering::Relaxed);
        let killed = Instant::now();
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
        let out = loop {
            if flags(&envoy, worker).await.is_some_and(|f| f != "healthy") {
                break killed.elapsed();
            }
            assert!(killed.elapsed() < Duration::from_secs(30), "never detected");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let lost = failed.load(Ordering::Relaxed) - failed_before;
        let why = std::mem::take(&mut *reasons.lock().unwrap());
        println!(
            "trial {trial}: out of Envoy's rotation after {out:?}, {lost} requests failed {why:?}"
        );
        times.push(out);
        // Ray restarts the proxy (a new process) before the next trial.
        eventually(
            "Ray restarts the proxy",
            Duration::from_secs(120),
            || async { cluster.worker_proxy_pid().filter(|p| *p != pid) },
        )
        .await;
    }
    stop.store(true, Ordering::Relaxed);
    let _ = load.await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "real-ray kill: {} trials, median {:.0} ms, min {:.0} ms, max {:.0} ms; requests {} failed {}",
        times.len(),
        ms(times[times.len() / 2]),
        ms(times[0]),
        ms(times[times.len() - 1]),
        sent.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
}

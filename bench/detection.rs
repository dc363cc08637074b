//! Detection benchmark: from a Ray Serve proxy's death to every connected Envoy holding
//! its new health, with default probe settings; that a slow but live proxy is never
//! marked down; and what probing 2,000 proxies costs.
//!
//! `cargo bench --bench detection -- --help`
//!
//! Real Envoy 1.40 processes (from `scripts/install-envoy.sh`), ray-xds (in the benchmark
//! process, default probe settings) and simulated proxies, all on loopback. Faults:
//! - `killed`: the proxy's port refuses connections, like a SIGKILLed Ray proxy;
//! - `hung`: it accepts and never answers, like a SIGSTOPped one;
//! - `slow-live`: it answers every request after `--slow-ms` (200 ms) for
//!   `--slow-window` seconds. It must stay healthy: a false alarm is a trial in which any
//!   Envoy ever showed it as anything but healthy; ray-xds's own transitions to
//!   unhealthy during the slow-live trials are counted too (all lanes run slow-live at
//!   the same time and no other fault then, so the count is theirs), and the reported
//!   `false_alarms` is the larger of the two. Nothing is detected, so its `p50_ms` and
//!   `p99_ms` are `-`.
//!
//! Trials run in `--lanes` parallel lanes. Each lane is a RayService of its own, with one
//! cluster of two proxies: the one faulted, and a control proxy that never is (so a lane's
//! cluster never fails open, and a fault never touches another lane's endpoints). For
//! `killed` and `hung`, `false_alarms` counts the times a control proxy was seen not
//! healthy by an Envoy during that fault's trials. One poller reads every Envoy's admin
//! `/clusters` in turn, every 5 ms, and each lane watches its endpoints in what it read;
//! a detection time is from the fault to the first read in which every Envoy has the
//! endpoint out of its cluster. Each fault strikes after a random wait of up to 1 s (more
//! than two probe intervals), so at a random point of the probe cycle.
//!
//! The output ends with one line per fault:
//! `detection fault=<killed|hung|slow-live> trials=<n> p50_ms=<x> p99_ms=<y> false_alarms=<k>`
//! (p99 is the nearest rank: with 100 trials, the 99th smallest).

// A benchmark run reads top to bottom (set up, measure, report): its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use ray_serve_sim::NodeType;
use ray_serve_sim::{serve_proxy_with, ProxyConfig, ProxyHandle, ProxyMode};
use support::*;

#[path = "support/mod.rs"]
mod bench_support;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
struct Args {
    /// Trials per fault kind (0 skips the detection runs).
    #[arg(long, default_value_t = 100)]
    trials: usize,
    /// Lanes run in parallel (each a RayService with a faulted and a control proxy).
    #[arg(long, default_value_t = 8)]
    lanes: usize,
    /// Envoys connected to ray-xds (alternating state-of-the-world and delta).
    #[arg(long, default_value_t = 2)]
    envoys: usize,
    /// How long a `slow-live` proxy takes to answer each request, in milliseconds.
    #[arg(long, default_value_t = 200)]
    slow_ms: u64,
    /// How long each `slow-live` trial lasts, in seconds.
    #[arg(long, default_value_t = 5.0)]
    slow_window: f64,
    /// Proxies for the probe-cost run (0 skips it).
    #[arg(long, default_value_t = 2000)]
    cost_proxies: usize,
    /// Seconds over which probe cost is measured.
    #[arg(long, default_value_t = 10)]
    cost_seconds: u64,
    /// Every probe-cost proxy answers after this many milliseconds (0: at once); with
    /// 200, every probe of the default settings is hedged.
    #[arg(long, default_value_t = 0)]
    cost_slow_ms: u64,
    /// The `ray-xds` binary the probe-cost run starts (default: this build's), to
    /// compare with another build's.
    #[arg(long)]
    cost_binary: Option<std::path::PathBuf>,
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

/// What every Envoy's `/clusters` said in one round of reads: per Envoy,
/// `cluster::address` → health flags.
type Seen = Arc<Vec<HashMap<String, String>>>;

/// Reads every Envoy's `/clusters` in turn every 5 ms, and publishes each round.
async fn poll_envoys(envoys: Arc<Vec<Envoy>>, tx: watch::Sender<Seen>, stop: CancellationToken) {
    while !stop.is_cancelled() {
        let mut round = Vec::with_capacity(envoys.len());
        for e in envoys.iter() {
            let text = e.admin("/clusters").await;
            let flags: HashMap<String, String> = text
                .lines()
                .filter_map(|l| {
                    let (host, flags) = l.split_once("::health_flags::")?;
                    Some((host.to_string(), flags.to_string()))
                })
                .collect();
            round.push(flags);
        }
        tx.send_replace(Arc::new(round));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One lane: its cluster, its faulted proxy and its control proxy.
struct Lane {
    cluster: String,
    target: Proxy,
    control: SocketAddr,
}

fn key(cluster: &str, addr: SocketAddr) -> String {
    format!("{cluster}::{addr}")
}

fn flags<'a>(seen: &'a Seen, envoy: usize, cluster: &str, addr: SocketAddr) -> Option<&'a str> {
    seen[envoy].get(&key(cluster, addr)).map(String::as_str)
}

fn all_healthy(seen: &Seen, cluster: &str, addr: SocketAddr) -> bool {
    (0..seen.len()).all(|e| flags(seen, e, cluster, addr) == Some("healthy"))
}

fn all_gone(seen: &Seen, cluster: &str, addr: SocketAddr) -> bool {
    (0..seen.len()).all(|e| flags(seen, e, cluster, addr).is_none())
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    Killed,
    Hung,
    SlowLive,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Killed => "killed",
            Fault::Hung => "hung",
            Fault::SlowLive => "slow-live",
        }
    }
}

/// What one fault's trials gave.
#[derive(Default)]
struct Results {
    detections: Vec<Duration>,
    /// Trials (slow-live) or control proxies (killed, hung) seen not healthy.
    false_alarms: usize,
    trials: usize,
}

/// Waits for a round of reads where `check` holds, counting a control proxy seen not
/// healthy (once per dip) in `alarms`; the time the round was seen.
async fn wait_until(
    rx: &mut watch::Receiver<Seen>,
    lane: &Lane,
    alarms: &AtomicUsize,
    control_ok: &mut bool,
    what: &str,
    check: impl Fn(&Seen) -> bool,
) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen = rx.borrow_and_update().clone();
        let ok = all_healthy(&seen, &lane.cluster, lane.control);
        if *control_ok && !ok {
            alarms.fetch_add(1, Ordering::Relaxed);
            eprintln!("false alarm: control proxy {} not healthy", lane.control);
        }
        *control_ok = ok;
        if check(&seen) {
            return Instant::now();
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, rx.changed()).await.is_err() {
            panic!("{}: {what} not seen within 60 s", lane.cluster);
        }
    }
}

async fn run_lane(
    mut lane: Lane,
    fault: Fault,
    mut rx: watch::Receiver<Seen>,
    left: Arc<AtomicUsize>,
    args: Arc<Args>,
    alarms: Arc<AtomicUsize>,
) -> (Lane, Vec<Duration>, usize) {
    let mut times = Vec::new();
    let mut trials = 0;
    // Counted only once seen healthy (not while Envoy is still receiving it).
    let mut control_ok = false;
    let alarms = &*alarms;
    let cluster = lane.cluster.clone();
    let addr = lane.target.address;
    let control = lane.control;
    wait_until(&mut rx, &lane, alarms, &mut control_ok, "healthy", |s| {
        all_healthy(s, &cluster, addr) && all_healthy(s, &cluster, control)
    })
    .await;
    loop {
        if left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_err()
        {
            break;
        }
        trials += 1;
        // The fault strikes at a random point of the probe cycle.
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..1000))).await;
        match fault {
            Fault::Killed | Fault::Hung => {
                let started = Instant::now();
                if fault == Fault::Killed {
                    lane.target.token.cancel();
                } else {
                    lane.target.handle.set(ProxyMode::Hang);
                }
                let at = wait_until(&mut rx, &lane, alarms, &mut control_ok, "gone", |s| {
                    all_gone(s, &cluster, addr)
                })
                .await;
                times.push(at - started);
                if fault == Fault::Killed {
                    lane.target = Proxy::start(addr, NodeType::Worker).await;
                } else {
                    lane.target.handle.set(ProxyMode::Serving);
                }
            }
            Fault::SlowLive => {
                lane.target
                    .handle
                    .set(ProxyMode::Slow(Duration::from_millis(args.slow_ms)));
                let end = Instant::now() + Duration::from_secs_f64(args.slow_window);
                let mut alarmed = false;
                while Instant::now() < end {
                    let seen = rx.borrow_and_update().clone();
                    if !alarmed && !all_healthy(&seen, &cluster, addr) {
                        alarmed = true;
                        alarms.fetch_add(1, Ordering::Relaxed);
                        eprintln!("false alarm: slow-live proxy {addr} not healthy");
                    }
                    let _ = tokio::time::timeout_at(end.into(), rx.changed()).await;
                }
                lane.target.handle.set(ProxyMode::Serving);
            }
        }
        wait_until(&mut rx, &lane, alarms, &mut control_ok, "healthy", |s| {
            all_healthy(s, &cluster, addr)
        })
        .await;
    }
    (lane, times, trials)
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    // Nearest rank.
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

async fn detection(args: Arc<Args>) -> Vec<(Fault, Results)> {
    let mut lanes = Vec::new();
    for i in 0..args.lanes {
        let target = Proxy::start("127.0.0.1:0".parse().unwrap(), NodeType::Worker).await;
        let control = Proxy::start("127.0.0.1:0".parse().unwrap(), NodeType::Head).await;
        lanes.push((i, target, control));
    }
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    let mut text = "rayservices:\n".to_string();
    for (i, target, control) in &lanes {
        text += &format!(
            "  - name: lane{i}\n    hosts: ['lane{i}.test']\n    active_cluster: c\n    head_proxy: include\n    clusters:\n      - name: c\n        proxies:\n          - {{ address: {}, node_type: head }}\n          - {{ address: {}, node_type: worker }}\n",
            control.address, target.address
        );
    }
    std::fs::write(&services, text).unwrap();
    let xds = ray_xds::runtime::start(test_config(&services, 0), Default::default())
        .await
        .unwrap();
    let envoys: Arc<Vec<Envoy>> = Arc::new(
        (0..args.envoys)
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
            .collect(),
    );
    let (tx, rx) = watch::channel::<Seen>(Arc::new(vec![HashMap::new(); args.envoys]));
    let stop = CancellationToken::new();
    let poller = tokio::spawn(poll_envoys(envoys.clone(), tx, stop.clone()));
    let mut lanes: Vec<Lane> = lanes
        .into_iter()
        .map(|(i, target, control)| {
            // The control proxy serves until the process ends (its token is never
            // cancelled).
            Lane {
                cluster: format!("default/lane{i}/c"),
                target,
                control: control.address,
            }
        })
        .collect();
    let policy = ray_xds::policy::probe::ProbePolicy::default();
    println!(
        "detection: {} Envoys ({}), {} lanes, default probe settings ({} ms interval ±20%, {} ms timeout, hedged after {} ms, {} failures)",
        args.envoys,
        if args.envoys > 1 { "SotW and delta" } else { "SotW" },
        args.lanes,
        policy.interval.as_millis(),
        policy.timeout.as_millis(),
        policy.hedge_after().as_millis(),
        policy.unhealthy_threshold
    );
    let metrics_url = format!("http://{}/metrics", xds.admin_addr);
    let unhealthy_transitions = || async {
        let text = http_get(&metrics_url)
            .await
            .map(|(_, b)| b)
            .unwrap_or_default();
        metric(
            &text,
            "ray_xds_proxy_health_transitions_total{state=\"unhealthy\"}",
        )
    };
    let mut out = Vec::new();
    for fault in [Fault::Killed, Fault::Hung, Fault::SlowLive] {
        let left = Arc::new(AtomicUsize::new(args.trials));
        let alarms = Arc::new(AtomicUsize::new(0));
        let transitions_before = unhealthy_transitions().await;
        let started = Instant::now();
        let running: Vec<_> = lanes
            .drain(..)
            .map(|lane| {
                tokio::spawn(run_lane(
                    lane,
                    fault,
                    rx.clone(),
                    left.clone(),
                    args.clone(),
                    alarms.clone(),
                ))
            })
            .collect();
        let mut results = Results::default();
        for r in running {
            let (lane, times, trials) = r.await.unwrap();
            lanes.push(lane);
            results.detections.extend(times);
            results.trials += trials;
        }
        let transitions = (unhealthy_transitions().await - transitions_before) as usize;
        results.false_alarms = alarms.load(Ordering::Relaxed);
        let took = started.elapsed().as_secs();
        if fault == Fault::SlowLive {
            println!(
                "detection {}: {} trials of {} s at {} ms a request in {took} s: {} seen not healthy by an Envoy, {} ray-xds transitions to unhealthy",
                fault.name(),
                results.trials,
                args.slow_window,
                args.slow_ms,
                results.false_alarms,
                transitions
            );
            results.false_alarms = results.false_alarms.max(transitions);
        } else {
            let mut v = results.detections.clone();
            v.sort();
            let ms = |d: Duration| d.as_millis();
            println!(
                "detection {}: n={} in {took} s: min {} ms, p50 {} ms, p90 {} ms, p99 {} ms, max {} ms; control proxies seen not healthy: {}",
                fault.name(),
                v.len(),
                ms(v[0]),
                ms(percentile(&v, 0.5)),
                ms(percentile(&v, 0.9)),
                ms(percentile(&v, 0.99)),
                ms(v[v.len() - 1]),
                results.false_alarms
            );
        }
        out.push((fault, results));
    }
    stop.cancel();
    let _ = poller.await;
    xds.stop().await.unwrap();
    out
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
    if args.cost_slow_ms > 0 {
        for p in &proxies {
            p.handle
                .set(ProxyMode::Slow(Duration::from_millis(args.cost_slow_ms)));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    let addresses: Vec<std::net::SocketAddr> = proxies.iter().map(|p| p.address).collect();
    let text = bench_support::services_of(&addresses);
    std::fs::write(&services, text).unwrap();
    let admin = free_port();
    let mut server = spawn(
        "ray-xds",
        Command::new(
            args.cost_binary
                .clone()
                .unwrap_or_else(|| env!("CARGO_BIN_EXE_ray-xds").into()),
        )
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
    bench_support::wait_ready(admin).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu = bench_support::cpu_seconds;
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
        "probe cost ({}): {} proxies answering in {} ms, default settings: ray-xds CPU {:.1}% of one core, {} sockets, {} threads, RSS {}, {:.0} probes/s, {} proxies healthy",
        args.cost_binary
            .as_ref()
            .map_or("this build".to_string(), |p| p.display().to_string()),
        args.cost_proxies,
        args.cost_slow_ms,
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
    let args = Arc::new(Args::parse());
    assert!(args.lanes > 0 && args.envoys > 0);
    let results = if args.trials > 0 {
        detection(args.clone()).await
    } else {
        Vec::new()
    };
    if args.cost_proxies > 0 {
        probe_cost(&args).await;
    }
    for (fault, r) in results {
        let (p50, p99) = if r.detections.is_empty() {
            ("-".to_string(), "-".to_string())
        } else {
            let mut v = r.detections;
            v.sort();
            (
                percentile(&v, 0.5).as_millis().to_string(),
                percentile(&v, 0.99).as_millis().to_string(),
            )
        };
        println!(
            "detection fault={} trials={} p50_ms={p50} p99_ms={p99} false_alarms={}",
            fault.name(),
            r.trials,
            r.false_alarms
        );
    }
}

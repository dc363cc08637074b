//! Pipeline benchmark: what one health change costs the pipeline at 20,000 proxies, in
//! this process, with nothing else on the machine's cores.
//!
//! `cargo bench --bench pipeline` (20,000 proxies), `-- --help` for the options.
//!
//! What it models: the file source's model of `--proxies` proxies, a RayService per
//! `--per-service` of them (one cluster each, its first proxy the head), every proxy
//! probed healthy; no dashboard, no Envoy warming anything. One whole build first, then
//! `--changes` builds each after one proxy's probe turned unhealthy or healthy again (a
//! different proxy each time), timed apart:
//!
//! - `publish`: the prober's side, a new `ProbeStates` with the one change (what the
//!   prober's publication costs);
//! - `build`: `Pipeline::build` from those states to the snapshot (health, switchover,
//!   translate, encoding).
//!
//! Every change must change exactly one endpoint assignment and nothing else: the
//! benchmark checks it, so a build that skipped the change cannot look fast.
//!
//! Ends with one line: `pipeline proxies=<n> whole_build_ms=<x> change_build_ms_p50=<y>
//! change_build_ms_max=<z> publish_ms_p50=<p>`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use clap::Parser;
use ray_xds::config::GatewaySettings;
use ray_xds::live::dashboards::DashboardStates;
use ray_xds::live::probe::{ProbeState, ProxyProbe};
use ray_xds::live::prober::ProbeStates;
use ray_xds::model::Model;
use ray_xds::pipeline::switchover::EnvoyWarmth;
use ray_xds::pipeline::{Inputs, Pipeline};
use ray_xds::policy::Policies;
use ray_xds::xds::ResourceType;

#[path = "support/mod.rs"]
mod bench_support;
use bench_support::{ms, percentile};

#[derive(Parser, Debug)]
struct Args {
    /// Proxies in all.
    #[arg(long, default_value_t = 20_000)]
    proxies: usize,
    /// Proxies per RayService (one cluster each).
    #[arg(long, default_value_t = 100)]
    per_service: usize,
    /// Health changes timed.
    #[arg(long, default_value_t = 200)]
    changes: usize,
    /// Ignored: cargo passes it to every benchmark.
    #[arg(long, hide = true)]
    bench: bool,
}

/// No Envoy connected: nothing is cold, nothing rejected.
struct NoEnvoys;

impl EnvoyWarmth for NoEnvoys {
    fn cold_envoys(&self, _: &str) -> Vec<String> {
        Vec::new()
    }
    fn rejecting_envoys(&self, _: &str) -> Vec<String> {
        Vec::new()
    }
}

fn proxy_address(i: usize) -> SocketAddr {
    SocketAddr::from(([127, 1 + (i >> 16) as u8, (i >> 8) as u8, i as u8], 8000))
}

fn model_of(args: &Args) -> Model {
    let mut text = String::from("rayservices:\n");
    let services = args.proxies.div_ceil(args.per_service);
    for s in 0..services {
        text += &format!("  - name: s{s}\n    namespace: bench\n    hosts: ['s{s}.bench']\n    active_cluster: c\n    clusters:\n      - name: c\n        proxies:\n");
        let first = s * args.per_service;
        for i in first..(first + args.per_service).min(args.proxies) {
            text += &format!(
                "          - {{ address: \"{}\", node_type: {} }}\n",
                proxy_address(i),
                if i == first { "head" } else { "worker" }
            );
        }
    }
    ray_xds::source::file::parse(Path::new("bench.yaml"), &text).expect("a valid model")
}

fn main() {
    let args = Args::parse();
    let model = Arc::new(model_of(&args));
    let t0 = SystemTime::now();
    let mut probes = ProbeStates {
        complete: true,
        ..Default::default()
    };
    let routes = Arc::new(["/".to_string()].into_iter().collect());
    for i in 0..args.proxies {
        let mut p = ProxyProbe::new(t0);
        p.state = ProbeState::Healthy;
        p.routes = Some(Arc::clone(&routes));
        probes.proxies.insert(proxy_address(i), p);
    }
    let dashboards = DashboardStates::default();
    let mut pipeline = Pipeline::new(Policies::default(), GatewaySettings::default());
    let build = |pipeline: &mut Pipeline, probes: &ProbeStates, now: SystemTime| {
        pipeline.build(
            &Inputs {
                model: &model,
                probes,
                dashboards: &dashboards,
                envoys: &NoEnvoys,
            },
            now,
        )
    };

    let started = Instant::now();
    let mut last = build(&mut pipeline, &probes, t0).snapshot;
    let whole = started.elapsed();
    let assignments = last.resources(ResourceType::Endpoints).len();

    let mut builds = Vec::with_capacity(args.changes);
    let mut publishes = Vec::with_capacity(args.changes);
    for c in 0..args.changes {
        // A different worker each time, spread over the RayServices (with the default
        // `head_proxy: fallback` a head is not listed); every second change heals the
        // proxy the change before took out.
        let i = ((c / 2) * 7919) % args.proxies;
        let i = if i % args.per_service == 0 { i + 1 } else { i };
        let now = t0 + Duration::from_secs(1 + c as u64);
        let started = Instant::now();
        let mut next = probes.clone();
        let probe = next.proxies.get_mut(&proxy_address(i)).unwrap();
        probe.state = if c % 2 == 0 {
            ProbeState::Unhealthy
        } else {
            ProbeState::Healthy
        };
        probe.since = now;
        probes = next;
        publishes.push(started.elapsed());

        let started = Instant::now();
        let snapshot = build(&mut pipeline, &probes, now).snapshot;
        builds.push(started.elapsed());

        let changed: Vec<(ResourceType, &str)> = ResourceType::ALL
            .into_iter()
            .flat_map(|ty| {
                let before = last.resources(ty);
                snapshot
                    .resources(ty)
                    .iter()
                    .filter(move |(name, r)| {
                        before.get(*name).is_none_or(|b| b.version != r.version)
                    })
                    .map(move |(name, _)| (ty, &**name))
            })
            .collect();
        assert_eq!(
            changed.len(),
            1,
            "change {c}: one assignment changes, not {changed:?}"
        );
        assert_eq!(changed[0].0, ResourceType::Endpoints, "change {c}");
        drop(changed);
        last = snapshot;
    }
    builds.sort();
    publishes.sort();
    eprintln!(
        "{} proxies in {} assignments; whole build {:.1} ms; {} changes",
        args.proxies,
        assignments,
        ms(whole),
        args.changes
    );
    println!(
        "pipeline proxies={} whole_build_ms={:.1} change_build_ms_p50={:.2} change_build_ms_max={:.2} publish_ms_p50={:.2}",
        args.proxies,
        ms(whole),
        ms(percentile(&builds, 0.5)),
        ms(*builds.last().unwrap()),
        ms(percentile(&publishes, 0.5)),
    );
}

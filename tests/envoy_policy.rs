//! Traffic policy in a real Envoy, with ray-xds's own probes slowed to once a minute so
//! that only Envoy's retries and outlier detection act: requests survive a proxy that
//! answers 503 (Ray's backpressure), one that is gone, and (idempotent ones) one that
//! hangs.

mod support;

use std::time::Duration;

use ray_serve_sim::NodeType;
use ray_serve_sim::ProxyMode;
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

/// A stack over three simulated workers, probed only once a minute, with `traffic` as the
/// RayService's traffic policy and Envoy carrying traffic.
struct Setup {
    stack: Stack,
    sim: SimCluster,
}

impl std::ops::Deref for Setup {
    type Target = Stack;
    fn deref(&self) -> &Stack {
        &self.stack
    }
}

async fn start(traffic: &str) -> Setup {
    let sim = SimCluster::start(
        "demo-a",
        &[NodeType::Worker, NodeType::Worker, NodeType::Worker],
    )
    .await;
    let extra = format!("    probe: {{ interval: 60s }}\n    traffic: {traffic}\n");
    let stack = Stack::with(services_yaml_with("demo-a", &[&sim], &extra))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    Setup { stack, sim }
}

/// Sends `n` requests; returns how many failed and who served the rest.
async fn load(port: u16, n: usize) -> (usize, std::collections::BTreeMap<String, usize>) {
    let mut failed = 0;
    let mut by = std::collections::BTreeMap::new();
    for _ in 0..n {
        match through_envoy(port).await {
            Some(s) => *by.entry(s.proxy).or_default() += 1,
            None => failed += 1,
        }
    }
    (failed, by)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backpressured_proxy_is_retried_elsewhere() {
    let s = start("{ retries: 3 }").await;
    s.sim.set_mode(0, ProxyMode::Overloaded);
    let (failed, by) = load(s.gateway_port, 60).await;
    assert_eq!(failed, 0, "{by:?}");
    assert!(!by.contains_key(&s.sim.proxies[0].0.to_string()), "{by:?}");
    let stats = s.envoy().admin("/stats?filter=upstream_rq_retry$").await;
    let retries: u64 = stats
        .lines()
        .filter(|l| l.contains("demo-a"))
        .filter_map(|l| l.rsplit_once(": ")?.1.trim().parse::<u64>().ok())
        .sum();
    assert!(retries > 0, "Envoy retried: {stats}");
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_request_to_a_hung_proxy_costs_one_per_try_timeout() {
    // Only for idempotent RayServices: the others get no per-try timeout (a try that
    // times out may be running; tests/envoy_safety.rs shows it is not replayed).
    let s = start("{ per_try_timeout: 300ms, idempotent: true }").await;
    s.sim.set_mode(1, ProxyMode::Hang);
    let started = std::time::Instant::now();
    let (failed, by) = load(s.gateway_port, 30).await;
    assert_eq!(failed, 0, "{by:?}");
    assert!(!by.contains_key(&s.sim.proxies[1].0.to_string()), "{by:?}");
    // Requests that met the hung proxy waited one per-try timeout, not the whole deadline.
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_proxy_is_retried_elsewhere_and_ejected() {
    let s = start("{ retries: 3 }").await;
    let dead = s.sim.proxies[2].0;
    s.sim.kill(2);
    // The sim's proxy closes its idle keep-alive connections as it dies; a request Envoy
    // writes on one at that very moment may have run and is not replayed (the safety
    // rule; tests/envoy_safety.rs). This test is about requests sent after the death:
    // they start once Envoy holds no connection to the dead proxy.
    eventually(
        "Envoy drops its connections to the dead proxy",
        DEADLINE,
        || async {
            let text = s.envoy().admin("/clusters").await;
            let line = format!("default/demo/demo-a::{dead}::cx_active::0");
            text.lines().any(|l| l == line).then_some(())
        },
    )
    .await;
    let (failed, by) = load(s.gateway_port, 60).await;
    assert_eq!(failed, 0, "{by:?}");
    assert!(!by.contains_key(&dead.to_string()), "{by:?}");
    eventually("Envoy ejects the dead proxy", DEADLINE, || async {
        let text = s.envoy().admin("/clusters").await;
        let line = format!("default/demo/demo-a::{dead}::health_flags::");
        text.lines()
            .find(|l| l.starts_with(&line) && l.contains("failed_outlier_check"))
            .map(|_| ())
    })
    .await;
}

//! Live health reaches a real Envoy: a killed proxy leaves Envoy's cluster, a draining
//! one takes no new requests, `head_proxy` routes as documented, and a cluster whose
//! every probe fails is published fail-open.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ray_serve_sim::NodeType;
use ray_serve_sim::ProxyMode;
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);
const CLUSTER: &str = "default/demo/demo-a";

/// A stack over one simulated cluster (a head and two workers), with Envoy carrying
/// traffic.
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

async fn start(bootstrap: Bootstrap, head_proxy: &str) -> Setup {
    let sim = SimCluster::start(
        "demo-a",
        &[NodeType::Head, NodeType::Worker, NodeType::Worker],
    )
    .await;
    let extra = format!("    head_proxy: {head_proxy}\n");
    let stack = Stack::with(services_yaml_with("demo-a", &[&sim], &extra))
        .envoy(bootstrap)
        .start()
        .await;
    Setup { stack, sim }
}

/// Envoy's health flags for one host of the cluster, from its admin `/clusters`.
async fn flags(envoy: &Envoy, addr: SocketAddr) -> Option<String> {
    let text = envoy.admin("/clusters").await;
    let prefix = format!("{CLUSTER}::{addr}::health_flags::");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
}

async fn wait_flags(
    envoy: &Envoy,
    addr: SocketAddr,
    what: &str,
    check: impl Fn(&str) -> bool,
) -> Duration {
    let started = Instant::now();
    eventually(what, DEADLINE, || async {
        flags(envoy, addr).await.filter(|f| check(f))
    })
    .await;
    started.elapsed()
}

/// Waits until Envoy no longer lists the host: ray-xds publishes only proxies that may
/// take new requests, so an unhealthy or draining proxy leaves Envoy's cluster.
async fn wait_gone(envoy: &Envoy, addr: SocketAddr, what: &str) -> Duration {
    let started = Instant::now();
    eventually(what, DEADLINE, || async {
        let text = envoy.admin("/clusters").await;
        let listed = format!("{CLUSTER}::{addr}::");
        (text.contains(&format!("{CLUSTER}::")) && !text.contains(&listed)).then_some(())
    })
    .await;
    started.elapsed()
}

/// Which proxies serve `n` requests through Envoy.
async fn served_by(port: u16, n: usize) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for _ in 0..n {
        let who = through_envoy(port)
            .await
            .map(|s| s.proxy)
            .unwrap_or_else(|| "FAILED".into());
        *out.entry(who).or_default() += 1;
    }
    out
}

async fn a_killed_proxy_turns_unhealthy(bootstrap: Bootstrap) {
    let s = start(bootstrap, "include").await;
    let worker = s.sim.proxies[1].0;
    wait_flags(s.envoy(), worker, "the worker is healthy", |f| {
        f == "healthy"
    })
    .await;
    s.sim.kill(1);
    let took = wait_gone(s.envoy(), worker, "Envoy drops the killed proxy").await;
    eprintln!("{bootstrap:?}: killed proxy out of Envoy after {took:?}");
    let by = served_by(s.gateway_port, 20).await;
    assert!(!by.contains_key(&worker.to_string()), "{by:?}");
    let state: serde_json::Value =
        serde_json::from_str(&admin_get(s.xds.admin_addr, "/debug/state").await).unwrap();
    let proxy = state["rayservices"][0]["clusters"][0]["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["address"] == worker.to_string())
        .unwrap();
    assert_eq!(proxy["probe"]["state"], "unhealthy", "{proxy}");
    assert_eq!(proxy["endpoint"]["health"], "unhealthy", "{proxy}");
    assert!(
        proxy["probe"]["reason"]
            .as_str()
            .unwrap()
            .contains("refused"),
        "{proxy}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_a_killed_proxy_turns_unhealthy() {
    a_killed_proxy_turns_unhealthy(Bootstrap::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_a_killed_proxy_turns_unhealthy() {
    a_killed_proxy_turns_unhealthy(Bootstrap::Delta).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_proxy_drains() {
    let s = start(Bootstrap::Sotw, "include").await;
    let worker = s.sim.proxies[2].0;
    s.sim.set_mode(2, ProxyMode::Draining);
    wait_gone(
        s.envoy(),
        worker,
        "Envoy stops sending the draining proxy requests",
    )
    .await;
    let by = served_by(s.gateway_port, 20).await;
    assert!(
        !by.contains_key(&worker.to_string()) && !by.contains_key("FAILED"),
        "{by:?}"
    );
    s.sim.set_mode(2, ProxyMode::Serving);
    wait_flags(s.envoy(), worker, "it comes back", |f| f == "healthy").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_proxy_fallback_routes_to_the_head_only_without_workers() {
    let s = start(Bootstrap::Sotw, "fallback").await;
    let head = s.sim.proxies[0].0.to_string();
    wait_gone(
        s.envoy(),
        s.sim.proxies[0].0,
        "the head is left out while workers serve",
    )
    .await;
    let by = served_by(s.gateway_port, 20).await;
    assert!(
        !by.contains_key(&head) && !by.contains_key("FAILED"),
        "{by:?}"
    );
    s.sim.kill(1);
    s.sim.kill(2);
    wait_flags(s.envoy(), s.sim.proxies[0].0, "the head takes over", |f| {
        f == "healthy"
    })
    .await;
    let by = served_by(s.gateway_port, 20).await;
    assert_eq!(by.get(&head), Some(&20), "{by:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_proxy_include_and_exclude() {
    let s = start(Bootstrap::Sotw, "include").await;
    let head = s.sim.proxies[0].0;
    wait_flags(s.envoy(), head, "head included", |f| f == "healthy").await;
    let by = served_by(s.gateway_port, 30).await;
    assert!(
        by.contains_key(&head.to_string()) && by.len() == 3,
        "every proxy serves: {by:?}"
    );
    drop(s);

    let s = start(Bootstrap::Sotw, "exclude").await;
    let head = s.sim.proxies[0].0;
    wait_gone(s.envoy(), head, "head excluded").await;
    let by = served_by(s.gateway_port, 30).await;
    assert!(
        !by.contains_key(&head.to_string()) && !by.contains_key("FAILED"),
        "{by:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_when_every_probe_fails() {
    let s = start(Bootstrap::Sotw, "include").await;
    // Every proxy answers probes too slowly (over the 250 ms probe timeout), yet serves.
    for i in 0..3 {
        s.sim
            .set_mode(i, ProxyMode::Slow(Duration::from_millis(600)));
    }
    let m = eventually("fail-open is raised", DEADLINE, || async {
        let m = admin_get(s.xds.admin_addr, "/metrics").await;
        (metric(&m, "ray_xds_fail_open_clusters") == 1.0).then_some(m)
    })
    .await;
    assert!(metric(&m, "ray_xds_fail_open_events_total") >= 1.0, "{m}");
    for (addr, _, _) in &s.sim.proxies {
        assert_eq!(
            flags(s.envoy(), *addr).await.as_deref(),
            Some("healthy"),
            "{addr} published healthy"
        );
    }
    let served = through_envoy(s.gateway_port).await;
    assert!(served.is_some(), "requests still served");
    let state: serde_json::Value =
        serde_json::from_str(&admin_get(s.xds.admin_addr, "/debug/state").await).unwrap();
    assert_eq!(state["rayservices"][0]["clusters"][0]["fail_open"], true);
    for i in 0..3 {
        s.sim.set_mode(i, ProxyMode::Serving);
    }
    eventually("fail-open ends", DEADLINE, || async {
        let m = admin_get(s.xds.admin_addr, "/metrics").await;
        (metric(&m, "ray_xds_fail_open_clusters") == 0.0).then_some(())
    })
    .await;
}

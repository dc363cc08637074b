//! Discovery from the dashboard, end to end: a cluster that `services.yaml` gives by its
//! dashboard alone gets the proxies that (simulated) dashboard lists, in a real Envoy;
//! proxies added to the list appear, removed ones disappear, a DRAINING one drains, and
//! a dashboard that stops answering keeps its endpoints. Also: `ray-serve-sim` lists the
//! proxies it runs so that ray-xds can discover them.

// A test is a scenario read top to bottom: its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use std::time::Duration;

use ray_serve_sim::dashboard::{DashboardMode, SimDashboard};
use ray_serve_sim::NodeType;
use ray_serve_sim::{serve_proxy, ProxyConfig};
use support::*;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(30);
const CLUSTER: &str = "default/demo/demo-a";

/// Listeners on `127.0.0.<2..>`, all on one port, as Ray's proxies (one per node, each
/// on `http_options.port`).
async fn same_port_listeners(n: u8) -> (u16, Vec<TcpListener>) {
    for _ in 0..50 {
        let first = TcpListener::bind("127.0.0.2:0").await.unwrap();
        let port = first.local_addr().unwrap().port();
        let mut listeners = vec![first];
        for i in 1..n {
            match TcpListener::bind(SocketAddr::from(([127, 0, 0, 2 + i], port))).await {
                Ok(l) => listeners.push(l),
                Err(_) => break,
            }
        }
        if listeners.len() == n as usize {
            return (port, listeners);
        }
    }
    panic!("no port free on every loopback address");
}

/// A simulated RayCluster of three nodes, `127.0.0.2` (head), `.3` and `.4` (workers),
/// every proxy serving; its dashboard lists the head and `.3` only.
struct Cluster {
    port: u16,
    dashboard: SimDashboard,
    dashboard_url: String,
    shutdown: CancellationToken,
}

impl Cluster {
    async fn start() -> Cluster {
        let shutdown = CancellationToken::new();
        let (port, listeners) = same_port_listeners(3).await;
        for (i, listener) in listeners.into_iter().enumerate() {
            let config = ProxyConfig {
                cluster: "demo-a".into(),
                node_type: if i == 0 {
                    NodeType::Head
                } else {
                    NodeType::Worker
                },
                routes: BTreeMap::from([("/".to_string(), "hello".to_string())]),
            };
            tokio::spawn(serve_proxy(listener, config, shutdown.clone()));
        }
        let dashboard = SimDashboard::new();
        dashboard.set_app("hello", "/", "RUNNING");
        dashboard.set_http_port(port);
        let node = |host: u8| SocketAddr::from(([127, 0, 0, host], port));
        dashboard.add_proxy(node(2), NodeType::Head, "HEALTHY");
        dashboard.add_proxy(node(3), NodeType::Worker, "HEALTHY");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dashboard_url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));
        Cluster {
            port,
            dashboard,
            dashboard_url,
            shutdown,
        }
    }

    /// The proxy of node `127.0.0.<host>`.
    fn node(&self, host: u8) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, host], self.port))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Envoy's hosts of the cluster and their health flags, from its admin `/clusters`.
async fn envoy_hosts(envoy: &Envoy) -> BTreeMap<String, String> {
    let text = envoy.admin("/clusters").await;
    let prefix = format!("{CLUSTER}::");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|l| l.split_once("::health_flags::"))
        .map(|(host, flags)| (host.to_string(), flags.to_string()))
        .collect()
}

/// Waits until Envoy's hosts satisfy `check`.
async fn wait_hosts(
    envoy: &Envoy,
    what: &str,
    check: impl Fn(&BTreeMap<String, String>) -> bool,
) -> BTreeMap<String, String> {
    eventually(what, DEADLINE, || async {
        Some(envoy_hosts(envoy).await).filter(|h| check(h))
    })
    .await
}

/// Which proxies served `n` requests through Envoy (`FAILED` for failures).
async fn served_by(gateway_port: u16, n: usize) -> BTreeMap<String, usize> {
    let mut by = BTreeMap::new();
    for _ in 0..n {
        let who = through_envoy(gateway_port)
            .await
            .map_or("FAILED".to_string(), |s| s.proxy);
        *by.entry(who).or_default() += 1;
    }
    by
}

async fn debug_cluster(admin: SocketAddr) -> serde_json::Value {
    let state: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/state").await).unwrap_or_default();
    state["rayservices"][0]["clusters"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_given_by_its_dashboard_alone() {
    let cluster = Cluster::start().await;
    let (head, w3, w4) = (cluster.node(2), cluster.node(3), cluster.node(4));
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(
        &services,
        format!(
            "rayservices:\n  - name: demo\n    hosts: [\"*\"]\n    active_cluster: demo-a\n    clusters:\n      - name: demo-a\n        dashboard: {}\n",
            cluster.dashboard_url
        ),
    )
    .unwrap();
    let mut config = test_config(&services, 0);
    config.policies.dashboard.poll_interval = Duration::from_millis(200);
    // Generous timeouts, so that the start-up waits (for the dashboard's first answer,
    // then for the first probes) cannot run out on a busy machine.
    config.policies.dashboard.timeout = Duration::from_secs(10);
    config.policies.probe.timeout = Duration::from_secs(2);
    let xds = ray_xds::runtime::start(config, Default::default())
        .await
        .unwrap();
    let admin = xds.admin_addr;

    // The first snapshot already has the dashboard's proxies.
    eventually("ray-xds is ready", DEADLINE, || async {
        let (status, _) = http_get(&format!("http://{admin}/readyz")).await.ok()?;
        (status == 200).then_some(())
    })
    .await;
    // The first snapshot already has the worker the dashboard lists (the head, kept for
    // when no worker is healthy, is not published: see below).
    let snapshot = admin_get(admin, "/debug/snapshot").await;
    assert!(
        snapshot.contains(&w3.to_string()),
        "{w3} in the first snapshot: {snapshot}"
    );
    let state = debug_cluster(admin).await;
    assert_eq!(state["proxies_from"], "dashboard", "{state}");
    let types: BTreeMap<String, String> = state["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["address"].as_str().unwrap().to_string(),
                p["node_type"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        types,
        BTreeMap::from([
            (head.to_string(), "head".to_string()),
            (w3.to_string(), "worker".to_string())
        ])
    );

    let envoy = Envoy::start(Bootstrap::Sotw, xds.xds_addr.port());
    let gateway = envoy.gateway_port().await;

    // Traffic flows, to the worker: the controller's node is the head, and head_proxy's
    // default (fallback) keeps it for when no worker is healthy.
    wait_hosts(&envoy, "Envoy has the worker; the head is kept back", |h| {
        h.len() == 1 && h.get(&w3.to_string()).is_some_and(|f| f == "healthy")
    })
    .await;
    let by = served_by(gateway, 20).await;
    assert_eq!(by, BTreeMap::from([(w3.to_string(), 20)]));

    // A proxy Ray starts (STARTING: not a target yet) appears, then serves once HEALTHY.
    cluster
        .dashboard
        .add_proxy(w4, NodeType::Worker, "STARTING");
    wait_hosts(&envoy, "the new proxy appears in Envoy", |h| {
        h.contains_key(&w4.to_string())
    })
    .await;
    cluster.dashboard.set_proxy_status(w4, "HEALTHY");
    eventually("the new proxy serves", DEADLINE, || async {
        through_envoy(gateway)
            .await
            .filter(|s| s.proxy == w4.to_string())
    })
    .await;

    // A proxy Ray removes disappears.
    cluster.dashboard.remove_proxy_at(w3);
    wait_hosts(&envoy, "the removed proxy leaves Envoy", |h| {
        !h.contains_key(&w3.to_string()) && h.len() == 1
    })
    .await;
    let by = served_by(gateway, 20).await;
    assert_eq!(by, BTreeMap::from([(w4.to_string(), 20)]));

    // A dashboard that stops answering keeps its endpoints: several polls fail, nothing
    // is withdrawn.
    cluster.dashboard.set_mode(DashboardMode::Unavailable);
    let failures = |m: &str| metric(m, "ray_xds_dashboard_poll_errors_total{reason=\"status\"}");
    eventually("several dashboard polls fail", DEADLINE, || async {
        let m = admin_get(admin, "/metrics").await;
        (failures(&m) >= 5.0).then_some(())
    })
    .await;
    let state = debug_cluster(admin).await;
    assert_eq!(state["dashboard"]["stale"], true, "{state}");
    assert_eq!(state["proxies"].as_array().unwrap().len(), 2, "{state}");
    let hosts = envoy_hosts(&envoy).await;
    assert_eq!(
        hosts.keys().cloned().collect::<BTreeSet<_>>(),
        BTreeSet::from([w4.to_string()]),
        "{hosts:?}"
    );
    let by = served_by(gateway, 20).await;
    assert_eq!(by, BTreeMap::from([(w4.to_string(), 20)]));

    // A DRAINING proxy leaves Ray's targets but stays listed by Ray: ray-xds takes it out
    // of Envoy's rotation (requests in flight finish), and the head takes over (the only
    // proxy not draining).
    cluster.dashboard.set_mode(DashboardMode::Normal);
    cluster.dashboard.set_proxy_status(w4, "DRAINING");
    wait_hosts(
        &envoy,
        "the draining proxy leaves Envoy, the head serves",
        |h| {
            !h.contains_key(&w4.to_string())
                && h.get(&head.to_string()).is_some_and(|f| f == "healthy")
        },
    )
    .await;
    let by = served_by(gateway, 20).await;
    assert_eq!(by, BTreeMap::from([(head.to_string(), 20)]));

    drop(envoy);
    xds.stop().await.unwrap();
}

/// The refused proxies `/debug/state` shows, as `(address, reason label)`.
async fn refused(admin: SocketAddr) -> BTreeSet<(String, String)> {
    let state: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/state").await).unwrap_or_default();
    state["refused_proxies"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|r| {
                    (
                        r["address"].as_str().unwrap_or_default().to_string(),
                        r["label"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Issue 13: a dashboard is outside input. One that lists the cloud metadata service,
/// or any address outside its own network, never gets it published, not even by
/// fail-open (a cluster whose every listed proxy is refused has no endpoint at all); the
/// refusals are shown in `/debug/state` and counted. With `proxies.networks` set, only
/// proxies inside them are published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dashboard_cannot_publish_addresses_outside_its_network() {
    let cluster = Cluster::start().await;
    let (head, w3) = (cluster.node(2), cluster.node(3));
    let metadata: SocketAddr = "169.254.169.254:80".parse().unwrap();
    let elsewhere: SocketAddr = "198.51.100.7:8000".parse().unwrap();
    // Only refused addresses: the head and w3 leave the list for now.
    cluster.dashboard.remove_proxy_at(head);
    cluster.dashboard.remove_proxy_at(w3);
    cluster
        .dashboard
        .add_proxy(metadata, NodeType::Worker, "HEALTHY");
    cluster
        .dashboard
        .add_proxy(elsewhere, NodeType::Worker, "HEALTHY");
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(
        &services,
        format!(
            "rayservices:\n  - name: demo\n    hosts: [\"*\"]\n    active_cluster: demo-a\n    clusters:\n      - name: demo-a\n        dashboard: {}\n",
            cluster.dashboard_url
        ),
    )
    .unwrap();
    let start = |networks: Vec<ipnet::IpNet>| {
        let mut config = test_config(&services, 0);
        config.policies.dashboard.poll_interval = Duration::from_millis(200);
        config.policies.dashboard.timeout = Duration::from_secs(10);
        config.policies.probe.timeout = Duration::from_secs(2);
        config.addresses.networks = networks;
        ray_xds::runtime::start(config, Default::default())
    };
    let xds = start(vec![]).await.unwrap();
    let admin = xds.admin_addr;
    let want = BTreeSet::from([
        (metadata.to_string(), "never_a_proxy".to_string()),
        (
            elsewhere.to_string(),
            "outside_dashboard_network".to_string(),
        ),
    ]);
    eventually("both addresses are refused", DEADLINE, || async {
        (refused(admin).await == want).then_some(())
    })
    .await;
    eventually("ray-xds is ready", DEADLINE, || async {
        let (status, _) = http_get(&format!("http://{admin}/readyz")).await.ok()?;
        (status == 200).then_some(())
    })
    .await;
    let snapshot = admin_get(admin, "/debug/snapshot").await;
    for bad in ["169.254.169.254", "198.51.100.7"] {
        assert!(!snapshot.contains(bad), "{bad} published: {snapshot}");
    }
    let state = debug_cluster(admin).await;
    assert_eq!(state["proxies"].as_array().unwrap().len(), 0, "{state}");
    let m = admin_get(admin, "/metrics").await;
    assert_eq!(
        metric(&m, "ray_xds_proxies_refused{reason=\"never_a_proxy\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "ray_xds_proxies_refused{reason=\"outside_dashboard_network\"}"
        ),
        1.0
    );

    // The dashboard lists its own nodes again: they are published, the others stay out.
    cluster.dashboard.add_proxy(head, NodeType::Head, "HEALTHY");
    cluster.dashboard.add_proxy(w3, NodeType::Worker, "HEALTHY");
    eventually(
        "the dashboard's own worker is published",
        DEADLINE,
        || async {
            let snapshot = admin_get(admin, "/debug/snapshot").await;
            snapshot.contains(&w3.to_string()).then_some(())
        },
    )
    .await;
    assert_eq!(refused(admin).await, want);
    xds.stop().await.unwrap();

    // With proxies.networks set to w3 alone, the head is refused too, and nothing the
    // dashboard's network would have allowed gets past the configured list.
    let xds = start(vec![format!("{}/32", w3.ip()).parse().unwrap()])
        .await
        .unwrap();
    let admin = xds.admin_addr;
    let want = BTreeSet::from([
        (metadata.to_string(), "never_a_proxy".to_string()),
        (elsewhere.to_string(), "outside_proxy_networks".to_string()),
        (head.to_string(), "outside_proxy_networks".to_string()),
    ]);
    eventually(
        "the head is refused by proxies.networks",
        DEADLINE,
        || async { (refused(admin).await == want).then_some(()) },
    )
    .await;
    let state = debug_cluster(admin).await;
    let published: Vec<_> = state["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["address"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(published, [w3.to_string()], "{state}");
    xds.stop().await.unwrap();
}

/// A cluster given by its dashboard alone, serving gRPC: Ray's dashboard reports
/// `grpc_options` (port and servicer functions), and every discovered proxy's gRPC proxy
/// at its IP and that port is probed and routed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_given_by_its_dashboard_alone_serves_grpc_too() {
    use ray_serve_sim::grpc::pb::demo::{echo_client::EchoClient, SayRequest};
    use ray_serve_sim::{serve_proxy_with, ProxyHandle};
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let (port, http) = same_port_listeners(2).await;
    let (grpc_port, grpc) = same_port_listeners(2).await;
    for (i, (http, grpc)) in http.into_iter().zip(grpc).enumerate() {
        let config = ProxyConfig {
            cluster: "demo-a".into(),
            node_type: if i == 0 {
                NodeType::Head
            } else {
                NodeType::Worker
            },
            routes: BTreeMap::from([("/".to_string(), "hello".to_string())]),
        };
        let handle = ProxyHandle::default();
        tokio::spawn(ray_serve_sim::grpc::serve_grpc_proxy_with(
            grpc,
            config.clone(),
            handle.clone(),
            shutdown.clone(),
        ));
        tokio::spawn(serve_proxy_with(http, config, handle, shutdown.clone()));
    }
    let dashboard = SimDashboard::new();
    dashboard.set_app("hello", "/", "RUNNING");
    dashboard.set_http_port(port);
    let node = |host: u8, port: u16| SocketAddr::from(([127, 0, 0, host], port));
    dashboard.add_proxy(node(2, port), NodeType::Head, "HEALTHY");
    dashboard.add_proxy(node(3, port), NodeType::Worker, "HEALTHY");
    dashboard.set_grpc_options(
        grpc_port,
        &["ray_xds.demo.echo_pb2_grpc.add_EchoServicer_to_server"],
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));

    let yaml = format!(
        "rayservices:\n  - name: demo\n    hosts: [\"*\"]\n    active_cluster: demo-a\n    clusters:\n      - name: demo-a\n        dashboard: {url}\n"
    );
    let s = Stack::with(yaml)
        .config(|c| {
            c.policies.dashboard.poll_interval = Duration::from_millis(200);
            c.policies.dashboard.timeout = Duration::from_secs(10);
            c.policies.probe.timeout = Duration::from_secs(2);
        })
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", s.gateway_port))
            .unwrap()
            .connect_lazy();
    let client = EchoClient::new(channel);
    let worker_grpc = node(3, grpc_port).to_string();
    let served = eventually("gRPC calls reach the worker's gRPC proxy", DEADLINE, || {
        let mut client = client.clone();
        let worker_grpc = worker_grpc.clone();
        async move {
            let answer = client.say(SayRequest { text: "hi".into() }).await.ok()?;
            Some(answer.into_inner()).filter(|m| m.proxy == worker_grpc)
        }
    })
    .await;
    assert_eq!(served.node_type, "worker");
    let state = debug_cluster(s.admin_addr()).await;
    let grpc: BTreeMap<String, String> = state["proxies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["grpc"]["address"].as_str().unwrap_or("none").to_string(),
                p["grpc"]["probe"]["state"]
                    .as_str()
                    .unwrap_or("none")
                    .to_string(),
            )
        })
        .collect();
    assert_eq!(
        grpc,
        BTreeMap::from([
            (node(2, grpc_port).to_string(), "healthy".to_string()),
            (worker_grpc, "healthy".to_string()),
        ]),
        "{state}"
    );
}

//! Ray's direct ingress, end to end with a real Envoy and the simulator: each application
//! answered only by its own ingress replicas, routed as Ray matches prefixes; an
//! application with no replica on the proxies (Ray's fallback) and back; a killed replica
//! and a draining one cost no request and run none twice; gRPC calls by their
//! `application` metadata.

// A test is a scenario read top to bottom: its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use ray_serve_sim::dashboard::SimDashboard;
use ray_serve_sim::{serve_proxy_with, Executions, NodeType, ProxyConfig, ProxyHandle, ProxyMode};
use support::*;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(30);

/// A simulated endpoint: a proxy (every application) or an ingress replica (one).
struct Endpoint {
    address: SocketAddr,
    handle: ProxyHandle,
    shutdown: CancellationToken,
}

impl Endpoint {
    async fn start(routes: &[(&str, &str)], node_type: NodeType, ledger: &Executions) -> Endpoint {
        let listener = TcpListener::bind("127.0.0.2:0").await.unwrap();
        Endpoint::serve(listener, routes, node_type, ledger)
    }

    /// An endpoint serving `routes` on `listener`.
    fn serve(
        listener: TcpListener,
        routes: &[(&str, &str)],
        node_type: NodeType,
        ledger: &Executions,
    ) -> Endpoint {
        let address = listener.local_addr().unwrap();
        let handle = ProxyHandle::with_ledger(ledger.clone());
        let shutdown = CancellationToken::new();
        let config = ProxyConfig {
            cluster: "demo-a".into(),
            node_type,
            routes: routes
                .iter()
                .map(|(p, a)| (p.to_string(), a.to_string()))
                .collect(),
        };
        tokio::spawn(serve_proxy_with(
            listener,
            config,
            handle.clone(),
            shutdown.clone(),
        ));
        Endpoint {
            address,
            handle,
            shutdown,
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A RayCluster with direct ingress: the head's proxy (every application), `echo` at `/`
/// with one replica, `work` at `/work` with two; its dashboard lists them as Ray does.
struct Cluster {
    proxy: Endpoint,
    echo: Endpoint,
    work: Vec<Endpoint>,
    dashboard: SimDashboard,
    dashboard_url: String,
    ledger: Executions,
    shutdown: CancellationToken,
}

impl Cluster {
    async fn start() -> Cluster {
        let ledger = Executions::default();
        let apps = [("/", "echo"), ("/work", "work")];
        let proxy = Endpoint::start(&apps, NodeType::Head, &ledger).await;
        let echo = Endpoint::start(&[("/", "echo")], NodeType::Head, &ledger).await;
        let mut work = Vec::new();
        for _ in 0..2 {
            work.push(Endpoint::start(&[("/work", "work")], NodeType::Head, &ledger).await);
        }
        let dashboard = SimDashboard::new();
        dashboard.set_direct_ingress(true);
        dashboard.add_proxy(proxy.address, NodeType::Head, "HEALTHY");
        dashboard.set_http_port(proxy.address.port());
        dashboard.set_app("echo", "/", "RUNNING");
        dashboard.set_app("work", "/work", "RUNNING");
        let shutdown = CancellationToken::new();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dashboard_url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));
        let cluster = Cluster {
            proxy,
            echo,
            work,
            dashboard,
            dashboard_url,
            ledger,
            shutdown,
        };
        cluster.list_replicas();
        cluster
    }

    /// Tells the dashboard the replicas that run now.
    fn list_replicas(&self) {
        let replicas = |e: &[&Endpoint]| -> Vec<(SocketAddr, Option<SocketAddr>)> {
            e.iter().map(|e| (e.address, None)).collect()
        };
        self.dashboard
            .set_app_replicas("echo", &replicas(&[&self.echo]));
        let work: Vec<&Endpoint> = self.work.iter().collect();
        self.dashboard.set_app_replicas("work", &replicas(&work));
    }

    fn services_yaml(&self) -> String {
        format!(
            "rayservices:\n  - name: demo\n    hosts: [\"*\"]\n    active_cluster: demo-a\n    clusters:\n      - name: demo-a\n        dashboard: {}\n",
            self.dashboard_url
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A ray-xds over `cluster` with a real Envoy in front; replica ports may be any (the
/// simulator's come from the kernel).
async fn stack(cluster: &Cluster, bootstrap: Bootstrap) -> Stack {
    Stack::with(cluster.services_yaml())
        .config(|c| {
            c.policies.dashboard.poll_interval = Duration::from_millis(200);
            c.policies.dashboard.timeout = Duration::from_secs(10);
            c.policies.probe.timeout = Duration::from_secs(2);
            c.addresses.replica_ports.http = 1..=65535;
            c.addresses.replica_ports.grpc = 1..=65535;
        })
        .envoy(bootstrap)
        .start()
        .await
}

/// Who answered `n` POSTs to `path` (the endpoint's address and application), or
/// `FAILED <status>`.
async fn answered_by(gateway: u16, path: &str, n: usize) -> BTreeMap<String, usize> {
    let mut by = BTreeMap::new();
    for _ in 0..n {
        let who = match post_through_envoy(gateway, path, Duration::from_secs(10)).await {
            Ok((200, body)) => {
                let s: ray_serve_sim::Served = serde_json::from_str(&body).unwrap();
                format!("{} {}", s.proxy, s.app)
            }
            Ok((status, body)) => format!("FAILED {status} {body}"),
            Err(e) => format!("FAILED {e}"),
        };
        *by.entry(who).or_default() += 1;
    }
    by
}

/// Waits until `n` POSTs to `path` are all answered by `app` at one of `at`.
async fn wait_served(gateway: u16, path: &str, app: &str, at: &[SocketAddr]) {
    let want: Vec<String> = at.iter().map(|a| format!("{a} {app}")).collect();
    eventually(
        &format!("{path} answered by {want:?} only"),
        DEADLINE,
        || async {
            let by = answered_by(gateway, path, 8).await;
            by.keys().all(|k| want.contains(k)).then_some(by)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_application_is_answered_by_its_own_replicas_only() {
    let cluster = Cluster::start().await;
    for bootstrap in [Bootstrap::Sotw, Bootstrap::Delta] {
        let s = stack(&cluster, bootstrap).await;
        let gateway = s.gateway_port;
        let work: Vec<SocketAddr> = cluster.work.iter().map(|e| e.address).collect();
        wait_served(gateway, "/work", "work", &work).await;
        let through_proxy = cluster.proxy.handle.received();
        // Every request for `work` reaches a replica of `work`, both of them in turn;
        // every other path an `echo` replica, as Ray matches prefixes (`/workers` is
        // not under `/work`; `/work/x` is).
        let by = answered_by(gateway, "/work", 40).await;
        assert_eq!(by.len(), 2, "both replicas of work, nothing else: {by:?}");
        assert!(by.keys().all(|k| k.ends_with(" work")), "{by:?}");
        let by = answered_by(gateway, "/work/a/b", 10).await;
        assert!(by.keys().all(|k| k.ends_with(" work")), "{by:?}");
        let echo = format!("{} echo", cluster.echo.address);
        for path in ["/", "/workers", "/hello", "/Work"] {
            let by = answered_by(gateway, path, 10).await;
            assert_eq!(by, BTreeMap::from([(echo.clone(), 10)]), "{path}");
        }
        // Nothing went through the proxy.
        assert_eq!(cluster.proxy.handle.received(), through_proxy);
        // Ray matches the decoded path (`/wor%6B` is `work`'s), Envoy the raw one: a path
        // with an escape goes to the proxy, never to `echo`'s replica.
        for path in ["/wor%6B", "/work%2Fx", "/%77ork"] {
            let by = answered_by(gateway, path, 4).await;
            let proxy = cluster.proxy.address.to_string();
            assert!(
                by.keys().all(|k| k.starts_with(&proxy)),
                "{path}: {by:?} {}",
                s.envoy.as_ref().unwrap().admin("/clusters").await
            );
        }
        let state = s.state().await;
        let apps = &state["rayservices"][0]["clusters"][0]["applications"];
        assert_eq!(apps.as_array().map(Vec::len), Some(2), "{state}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_without_replicas_goes_through_the_proxies_and_back() {
    let cluster = Cluster::start().await;
    let s = stack(&cluster, Bootstrap::Sotw).await;
    let gateway = s.gateway_port;
    let work: Vec<SocketAddr> = cluster.work.iter().map(|e| e.address).collect();
    wait_served(gateway, "/work", "work", &work).await;

    // A redeploy: no RUNNING replica, Ray's fallback lists the proxy.
    cluster.dashboard.set_app_replicas("work", &[]);
    wait_served(gateway, "/work", "work", &[cluster.proxy.address]).await;
    let by = answered_by(gateway, "/", 10).await;
    assert_eq!(
        by,
        BTreeMap::from([(format!("{} echo", cluster.echo.address), 10)]),
        "echo keeps its replica"
    );

    // Back on replicas.
    cluster.list_replicas();
    wait_served(gateway, "/work", "work", &work).await;
}

/// Requests to `/work` through Envoy, four at a time, for `secs`: how many were sent and
/// the failures.
fn load(gateway: u16, secs: u64) -> tokio::task::JoinHandle<(usize, Vec<String>)> {
    tokio::spawn(async move {
        let mut failed = Vec::new();
        let mut sent = 0;
        let until = tokio::time::Instant::now() + Duration::from_secs(secs);
        while tokio::time::Instant::now() < until {
            let batch: Vec<_> = (0..LOAD_CONCURRENCY)
                .map(|_| post_through_envoy(gateway, "/work", Duration::from_secs(10)))
                .collect();
            for r in futures::future::join_all(batch).await {
                sent += 1;
                match r {
                    Ok((200, _)) => {}
                    other => failed.push(format!("{other:?}")),
                }
            }
        }
        (sent, failed)
    })
}

const LOAD_CONCURRENCY: usize = 4;

/// A replica killed under load: at most the requests in flight on it fail (they may have
/// run: a reset after the request was sent is never retried), and none runs twice. Then
/// one draining (Ray stopping it: `DRAINING` on `/-/healthz`, still serving): nothing
/// fails, and it gets no new request once Envoy has dropped it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_costs_at_most_its_requests_in_flight_and_a_draining_one_none() {
    let mut cluster = Cluster::start().await;
    // A third replica of work, so one can drain after another died.
    let third = Endpoint::start(&[("/work", "work")], NodeType::Head, &cluster.ledger).await;
    cluster.work.push(third);
    cluster.list_replicas();
    let s = stack(&cluster, Bootstrap::Sotw).await;
    let gateway = s.gateway_port;
    let work: Vec<SocketAddr> = cluster.work.iter().map(|e| e.address).collect();
    wait_served(gateway, "/work", "work", &work).await;
    cluster.ledger.clear();

    let killing = load(gateway, 4);
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Killed: its port refuses connections; the dashboard still lists it for a while.
    let killed = cluster.work.remove(0);
    killed.shutdown.cancel();
    let (sent, failed) = killing.await.unwrap();
    assert!(sent > 40, "the load ran: {sent}");
    assert!(
        failed.len() <= LOAD_CONCURRENCY
            && failed
                .iter()
                .all(|f| f.contains("reset") || f.contains("termination")),
        "at most what was in flight on the killed replica, reset: {failed:?} of {sent}"
    );
    assert_eq!(
        cluster.ledger.more_than_once(),
        BTreeMap::new(),
        "no request ran twice"
    );

    let draining = cluster.work[0].address;
    let left = cluster.work[1].address;
    let drain = load(gateway, 3);
    cluster.work[0].handle.set(ProxyMode::ReplicaDraining);
    let (sent, failed) = drain.await.unwrap();
    assert_eq!(failed, Vec::<String>::new(), "of {sent}");
    assert_eq!(cluster.ledger.more_than_once(), BTreeMap::new());
    wait_served(gateway, "/work", "work", &[left]).await;
    let before = cluster.ledger.on(draining);
    let by = answered_by(gateway, "/work", 20).await;
    assert_eq!(by, BTreeMap::from([(format!("{left} work"), 20)]));
    assert_eq!(cluster.ledger.on(draining), before);
    drop(killed);
}

/// Direct ingress on the Kubernetes source, the real kube-rs client against the fake API
/// server: the pods of a RayCluster are its nodes, the head pod's `dashboard` port lists
/// the applications and their replicas, and a replica is routed only when it is on one of
/// its cluster's pods. `echo` has a replica on the head pod, `work` two on the worker pod
/// and one the dashboard lists on an address no pod has (refused `not_a_cluster_node`:
/// it would answer, and must never be sent a request). Under direct ingress only the
/// head runs a Serve proxy; the worker pod's `serve` port refuses connections.
mod kubernetes {
    use super::*;
    use ray_xds::config::{KubernetesSourceConfig, SourceConfig};
    use serde_json::{json, Value};
    use support::fake_apiserver::FakeApiServer;
    use support::kuberay::{self, ray_pod};

    const RAY_CLUSTER: &str = "rs-a";

    /// The KubeRay sample RayService serving `echo` at `/` and `work` at `/work`, routed on
    /// every host, active on `rs-a`.
    fn rayservice() -> Value {
        let mut v = kuberay::rayservice(Some(RAY_CLUSTER), None);
        v["spec"]["serveConfigV2"] = json!(
            "applications:\n  - name: echo\n    import_path: apps:echo\n    route_prefix: /\n  - name: work\n    import_path: apps:work\n    route_prefix: /work\n"
        );
        v
    }

    async fn start_on(ip: &str, routes: &[(&str, &str)], ledger: &Executions) -> Endpoint {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        Endpoint::serve(listener, routes, NodeType::Head, ledger)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_application_is_answered_by_its_own_replicas_on_its_clusters_pods_only() {
        let (head_ip, worker_ip, no_pod_ip) = ("127.0.0.2", "127.0.0.3", "127.0.0.4");
        let ledger = Executions::default();
        let proxy = start_on(head_ip, &[("/", "echo"), ("/work", "work")], &ledger).await;
        let echo = start_on(head_ip, &[("/", "echo")], &ledger).await;
        let mut work = Vec::new();
        for _ in 0..2 {
            work.push(start_on(worker_ip, &[("/work", "work")], &ledger).await);
        }
        let rogue = start_on(no_pod_ip, &[("/work", "work")], &ledger).await;
        // The worker's `serve` port: nothing listens there.
        let closed = TcpListener::bind((worker_ip, 0)).await.unwrap();
        let closed_port = closed.local_addr().unwrap().port();
        drop(closed);

        let shutdown = CancellationToken::new();
        let dashboard = SimDashboard::new();
        dashboard.set_direct_ingress(true);
        dashboard.add_proxy(proxy.address, NodeType::Head, "HEALTHY");
        dashboard.set_http_port(proxy.address.port());
        dashboard.set_app("echo", "/", "RUNNING");
        dashboard.set_app("work", "/work", "RUNNING");
        dashboard.set_app_replicas("echo", &[(echo.address, None)]);
        let mut listed: Vec<(SocketAddr, Option<SocketAddr>)> =
            work.iter().map(|e| (e.address, None)).collect();
        listed.push((rogue.address, None));
        dashboard.set_app_replicas("work", &listed);
        let listener = TcpListener::bind((head_ip, 0)).await.unwrap();
        let dashboard_port = listener.local_addr().unwrap().port();
        tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));

        let api = FakeApiServer::start().await;
        api.apply(rayservice());
        api.apply(ray_pod(
            "rs-a-head",
            RAY_CLUSTER,
            NodeType::Head,
            proxy.address,
            dashboard_port,
        ));
        let worker_serve = SocketAddr::new(worker_ip.parse().unwrap(), closed_port);
        api.apply(ray_pod(
            "rs-a-worker",
            RAY_CLUSTER,
            NodeType::Worker,
            worker_serve,
            dashboard_port,
        ));

        let mut config = test_config(std::path::Path::new("unused"), 0);
        config.source = SourceConfig::Kubernetes(KubernetesSourceConfig {
            api_server: Some(api.url()),
            allowed_hosts: [(kuberay::NAMESPACE.to_string(), vec!["*".to_string()])].into(),
            ..Default::default()
        });
        config.policies.dashboard.poll_interval = Duration::from_millis(200);
        config.policies.dashboard.timeout = Duration::from_secs(10);
        config.policies.probe.timeout = Duration::from_secs(2);
        config.addresses.replica_ports.http = 1..=65535;
        config.addresses.replica_ports.grpc = 1..=65535;
        let xds = ray_xds::runtime::start(config, shutdown.clone())
            .await
            .unwrap();
        let envoy = Envoy::start(Bootstrap::Delta, xds.xds_addr.port());
        let gateway = envoy.gateway_port().await;

        let work_addresses: Vec<SocketAddr> = work.iter().map(|e| e.address).collect();
        wait_served(gateway, "/work", "work", &work_addresses).await;
        let through_proxy = proxy.handle.received();
        let by = answered_by(gateway, "/work", 40).await;
        assert_eq!(
            by.len(),
            2,
            "both pod replicas of work, nothing else: {by:?}"
        );
        assert!(by.keys().all(|k| k.ends_with(" work")), "{by:?}");
        let echo_only = BTreeMap::from([(format!("{} echo", echo.address), 10)]);
        for path in ["/", "/workers"] {
            assert_eq!(answered_by(gateway, path, 10).await, echo_only, "{path}");
        }
        assert_eq!(
            rogue.handle.received(),
            0,
            "a replica on no pod of rs-a got requests"
        );
        assert_eq!(
            proxy.handle.received(),
            through_proxy,
            "every application has replicas"
        );

        let refused = refused_proxies(xds.admin_addr).await;
        assert!(
            refused.contains(&(rogue.address.to_string(), "not_a_cluster_node".to_string())),
            "{refused:?}"
        );
        let state: Value =
            serde_json::from_str(&admin_get(xds.admin_addr, "/debug/state").await).unwrap();
        let apps = &state["rayservices"][0]["clusters"][0]["applications"];
        assert_eq!(apps.as_array().map(Vec::len), Some(2), "{state}");

        // The dashboard stops listing work's replicas (a redeploy): work goes through the
        // head's proxy, Ray's fallback; echo keeps its replica.
        dashboard.set_app_replicas("work", &[]);
        wait_served(gateway, "/work", "work", &[proxy.address]).await;
        assert_eq!(answered_by(gateway, "/", 10).await, echo_only);
        shutdown.cancel();
    }
}

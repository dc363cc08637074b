//! The Kubernetes source end to end: the real kube-rs client in ray-xds against a fake API
//! server speaking the real list/watch protocol, simulated Ray Serve proxies and
//! dashboards, and a real Envoy carrying requests.

// A test is a scenario read top to bottom: its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ray_serve_sim::dashboard::SimDashboard;
use ray_serve_sim::NodeType;
use ray_xds::config::{Config, KubernetesSourceConfig, SourceConfig};
use serde_json::{json, Value};
use support::fake_apiserver::FakeApiServer;
use support::kuberay::{self, ray_pod, rayservice};
use support::*;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(30);
const NS: &str = kuberay::NAMESPACE;
const NAME: &str = kuberay::NAME;

/// A simulated RayCluster: its proxies, and a dashboard saying `status` for app `hello`.
struct Cluster {
    sim: SimCluster,
    dashboard: SimDashboard,
    dashboard_port: u16,
}

impl Cluster {
    async fn start(
        name: &str,
        nodes: &[NodeType],
        status: &str,
        shutdown: &CancellationToken,
    ) -> Cluster {
        let sim = SimCluster::start(name, nodes).await;
        let dashboard = SimDashboard::new();
        dashboard.set_app("hello", "/", status);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dashboard_port = listener.local_addr().unwrap().port();
        tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));
        Cluster {
            sim,
            dashboard,
            dashboard_port,
        }
    }

    fn pod_name(&self, i: usize) -> String {
        format!("{}-{}-{i}", self.sim.name, self.sim.proxies[i].1.as_str())
    }

    fn pod(&self, i: usize) -> Value {
        let (addr, node_type, _) = &self.sim.proxies[i];
        ray_pod(
            &self.pod_name(i),
            &self.sim.name,
            *node_type,
            *addr,
            self.dashboard_port,
        )
    }

    fn apply_pods(&self, api: &FakeApiServer) {
        for i in 0..self.sim.proxies.len() {
            api.apply(self.pod(i));
        }
    }
}

fn k8s_config(api: &FakeApiServer) -> Config {
    let mut c = test_config(std::path::Path::new("unused"), 0);
    c.source = SourceConfig::Kubernetes(KubernetesSourceConfig {
        api_server: Some(api.url()),
        // The sample RayService claims every host ("*"), as a gateway admin's may.
        allowed_hosts: [(NS.to_string(), vec!["*".to_string()])].into(),
        ..Default::default()
    });
    c
}

async fn debug_state(admin: SocketAddr) -> Value {
    serde_json::from_str(&admin_get(admin, "/debug/state").await).unwrap_or(Value::Null)
}

async fn snapshot_version(admin: SocketAddr) -> String {
    let text = admin_get(admin, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix("ray_xds_snapshot_info{version=\""))
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_default()
        .to_string()
}

/// The health flags Envoy shows for one endpoint, once it has it.
async fn envoy_flags(envoy: &Envoy, cluster: &str, addr: SocketAddr) -> Option<String> {
    let prefix = format!("{NS}/{NAME}/{cluster}::{addr}::health_flags::");
    envoy
        .admin("/clusters")
        .await
        .lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
}

/// Steady requests through Envoy in the background, counting failures and who served.
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    last_cluster: Arc<std::sync::Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl Load {
    fn start(port: u16) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicUsize::new(0));
        let last_cluster = Arc::new(std::sync::Mutex::new(String::new()));
        let task = tokio::spawn({
            let (stop, sent, failed, last) = (
                stop.clone(),
                sent.clone(),
                failed.clone(),
                last_cluster.clone(),
            );
            async move {
                while !stop.load(Ordering::Relaxed) {
                    match through_envoy(port).await {
                        Some(s) => *last.lock().unwrap() = s.cluster,
                        None => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        });
        Load {
            stop,
            sent,
            failed,
            last_cluster,
            task,
        }
    }

    fn serving(&self) -> String {
        self.last_cluster.lock().unwrap().clone()
    }

    async fn stop(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        (
            self.sent.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

/// RayService `rs-a` on a cluster of a head and two workers, the first `pods` of its
/// pods applied, ray-xds on the fake API server, and an Envoy carrying traffic.
async fn three_nodes(
    pods: usize,
    shutdown: &CancellationToken,
) -> (
    FakeApiServer,
    Cluster,
    ray_xds::runtime::Running,
    Envoy,
    u16,
) {
    let api = FakeApiServer::start().await;
    let a = Cluster::start(
        "rs-a",
        &[NodeType::Head, NodeType::Worker, NodeType::Worker],
        "RUNNING",
        shutdown,
    )
    .await;
    api.apply(rayservice(Some("rs-a"), None));
    for i in 0..pods {
        api.apply(a.pod(i));
    }
    let xds = ray_xds::runtime::start(k8s_config(&api), shutdown.clone())
        .await
        .unwrap();
    let (envoy, port) = envoy_carrying_traffic(xds.xds_addr.port(), Bootstrap::Delta).await;
    (api, a, xds, envoy, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_come_drain_and_go_and_traffic_follows() {
    let shutdown = CancellationToken::new();
    let (api, a, xds, envoy, port) = three_nodes(2, &shutdown).await;
    let ready = admin_get(xds.admin_addr, "/readyz").await;
    assert!(ready.starts_with("ready"), "{ready}");

    // A pod is added: Envoy gets its endpoint.
    api.apply(a.pod(2));
    let added = a.sim.proxies[2].0;
    eventually("the new pod's endpoint reaches Envoy", DEADLINE, || async {
        envoy_flags(&envoy, "rs-a", added)
            .await
            .filter(|f| f == "healthy")
    })
    .await;

    // It starts terminating: out of Envoy's rotation at once, while the pod still exists.
    let load = Load::start(port);
    api.begin_delete("v1", "Pod", NS, &a.pod_name(2));
    eventually("the terminating pod leaves Envoy", DEADLINE, || async {
        envoy_flags(&envoy, "rs-a", added)
            .await
            .is_none()
            .then_some(())
    })
    .await;
    let state = debug_state(xds.admin_addr).await;
    let proxies = &state["rayservices"][0]["clusters"][0]["proxies"];
    let endpoint = proxies
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["address"] == added.to_string())
        .unwrap();
    assert!(
        endpoint["endpoint"]["reason"]
            .as_str()
            .unwrap()
            .contains("terminating"),
        "{endpoint}"
    );

    // The pod goes: so does its endpoint.
    api.delete("v1", "Pod", NS, &a.pod_name(2));
    eventually("the deleted pod leaves Envoy", DEADLINE, || async {
        envoy_flags(&envoy, "rs-a", added)
            .await
            .is_none()
            .then_some(())
    })
    .await;
    let (sent, failed) = load.stop().await;
    assert!(sent > 0);
    assert_eq!(failed, 0, "{failed} of {sent} requests failed");
    shutdown.cancel();
}

/// A Ray pod deleted under load, its preStop hook calling `GET /prestop?address=...` as
/// kubelet runs it: the call answers once Envoy sends the pod nothing more (Envoy no
/// longer lists it at the answer, and no request reaches it after), and only then is
/// its proxy stopped, as kubelet sends SIGTERM after the hook: no request fails. The call
/// alone takes nothing out: before the pod is deleted it waits out its grace and answers
/// 504, naming where the pod is still listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pod_s_prestop_call_returns_once_envoy_sends_it_nothing() {
    let shutdown = CancellationToken::new();
    let (api, a, xds, envoy, port) = three_nodes(3, &shutdown).await;
    let leaving = a.sim.proxies[2].0;
    eventually("the pod's endpoint is in Envoy", DEADLINE, || async {
        envoy_flags(&envoy, "rs-a", leaving)
            .await
            .filter(|f| f == "healthy")
    })
    .await;
    let admin = xds.admin_addr;
    let prestop = |query: String| async move {
        http_get(&format!("http://{admin}/prestop?{query}"))
            .await
            .unwrap()
    };

    // A bad call is refused at once.
    for bad in [
        "address=ray-worker-2".to_string(),
        "grace=1s".to_string(),
        format!("address={leaving}&grace=26s"),
        format!("address={leaving}&grace=soon"),
    ] {
        let (status, body) = prestop(bad.clone()).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }

    // Before the pod is deleted nothing says it is going away: the call waits out its
    // grace, and Envoy keeps the pod.
    let (status, body) = prestop(format!("address={leaving}&grace=1s")).await;
    assert_eq!(status, 504, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["dropped"], false, "{answer}");
    assert!(answer["still_listed_in"].as_u64().unwrap() >= 1, "{answer}");
    assert_eq!(
        envoy_flags(&envoy, "rs-a", leaving).await.as_deref(),
        Some("healthy"),
        "the call alone took the pod out"
    );

    let load = Load::start(port);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(a.sim.handles[2].received() > 0, "the pod served before");
    // The pod is deleted; its preStop hook runs.
    api.begin_delete("v1", "Pod", NS, &a.pod_name(2));
    // (Every simulated proxy here is on 127.0.0.1: the call names the pod's proxy by its
    // address and port, as `address=IP:PORT` allows.)
    let (status, body) = prestop(format!("address={leaving}&grace=20s")).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["dropped"], true, "{answer}");
    // At the answer, not eventually: Envoy lists the pod no more, and sends it nothing.
    assert_eq!(
        envoy_flags(&envoy, "rs-a", leaving).await,
        None,
        "answered while Envoy still lists the pod: {answer}"
    );
    let received = a.sim.handles[2].received();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        a.sim.handles[2].received(),
        received,
        "requests reached the pod after its pre-stop answer"
    );
    // The hook returned: kubelet's SIGTERM, and Ray's proxy stops.
    a.sim.kill(2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (sent, failed) = load.stop().await;
    assert!(sent > 0);
    assert_eq!(failed, 0, "{failed} of {sent} requests failed");
    let metrics = admin_get(admin, "/metrics").await;
    assert_eq!(
        metric(&metrics, "ray_xds_prestop_calls_total{result=\"dropped\"}"),
        1.0
    );
    assert_eq!(
        metric(&metrics, "ray_xds_prestop_calls_total{result=\"grace\"}"),
        1.0
    );
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_through_kuberay_status_loses_no_request() {
    let shutdown = CancellationToken::new();
    let api = FakeApiServer::start().await;
    let a = Cluster::start(
        "rs-a",
        &[NodeType::Head, NodeType::Worker],
        "RUNNING",
        &shutdown,
    )
    .await;
    let b = Cluster::start(
        "rs-b",
        &[NodeType::Head, NodeType::Worker],
        "DEPLOYING",
        &shutdown,
    )
    .await;
    api.apply(rayservice(Some("rs-a"), None));
    a.apply_pods(&api);
    let xds = ray_xds::runtime::start(k8s_config(&api), shutdown.clone())
        .await
        .unwrap();
    let (_envoy, port) = envoy_carrying_traffic(xds.xds_addr.port(), Bootstrap::Sotw).await;
    let load = Load::start(port);

    // KubeRay brings up the pending cluster; its application is still deploying.
    api.apply(rayservice(Some("rs-a"), Some("rs-b")));
    b.apply_pods(&api);
    eventually("the switchover waits for rs-b", DEADLINE, || async {
        let s = debug_state(xds.admin_addr).await;
        let sw = &s["rayservices"][0]["switchover"];
        (sw["phase"] == "waiting" && sw["reason"].as_str()?.contains("DEPLOYING")).then_some(())
    })
    .await;
    assert_eq!(load.serving(), "rs-a");

    // Its application runs: traffic moves to rs-b.
    b.dashboard.set_app("hello", "/", "RUNNING");
    eventually("traffic moves to rs-b", DEADLINE, || async {
        (load.serving() == "rs-b").then_some(())
    })
    .await;

    // KubeRay promotes rs-b, then deletes rs-a's pods (terminating first).
    api.apply(rayservice(Some("rs-b"), None));
    for i in 0..a.sim.proxies.len() {
        api.begin_delete("v1", "Pod", NS, &a.pod_name(i));
    }
    for i in 0..a.sim.proxies.len() {
        api.delete("v1", "Pod", NS, &a.pod_name(i));
    }
    drop(a);
    for _ in 0..20 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("rs-b")
        );
    }
    let (sent, failed) = load.stop().await;
    assert!(sent > 20, "{sent}");
    assert_eq!(failed, 0, "{failed} of {sent} requests failed");
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_objects_dropped_watches_410_and_an_absent_api_server_keep_the_served_state() {
    let shutdown = CancellationToken::new();
    let api = FakeApiServer::start().await;
    let a = Cluster::start(
        "rs-a",
        &[NodeType::Head, NodeType::Worker],
        "RUNNING",
        &shutdown,
    )
    .await;
    api.apply(rayservice(Some("rs-a"), None));
    a.apply_pods(&api);
    // A RayService whose status is garbage, in another namespace.
    api.apply_raw(
        "ray.io/v1",
        "RayService",
        "other",
        "broken",
        json!({"apiVersion": "ray.io/v1", "kind": "RayService",
               "metadata": {"name": "broken", "namespace": "other"},
               "spec": {"excludeHeadPodFromServeSvc": "maybe"},
               "status": {"activeServiceStatus": ["not", "an", "object"]}}),
    );
    let xds = ray_xds::runtime::start(k8s_config(&api), shutdown.clone())
        .await
        .unwrap();
    let (_envoy, port) = envoy_carrying_traffic(xds.xds_addr.port(), Bootstrap::Delta).await;
    let state = debug_state(xds.admin_addr).await;
    let problems = state["source"]["problems"].to_string();
    assert!(
        problems.contains("rayservice other/broken: malformed"),
        "{problems}"
    );
    assert_eq!(
        state["rayservices"].as_array().unwrap().len(),
        1,
        "the good one is served"
    );
    let m = admin_get(xds.admin_addr, "/metrics").await;
    assert_eq!(
        metric(&m, "ray_xds_source_objects_skipped_total{source=\"kubernetes\",reason=\"malformed_object\"}"),
        1.0,
        "{m}"
    );
    let served = snapshot_version(xds.admin_addr).await;
    assert!(!served.is_empty());

    // Dropped watch connections, then a watch that must re-list after 410 Gone.
    let (lists, watches) = (api.lists("pods"), api.watches("pods"));
    api.drop_watches();
    eventually("the pod watch comes back", DEADLINE, || async {
        (api.watches("pods") > watches).then_some(())
    })
    .await;
    // While the watches are cut, pods come and go and the history is compacted: the
    // watches' resource versions are now too old (410 Gone) and they must list again.
    api.set_unavailable(true);
    let passing = ray_pod(
        "passing",
        "unrelated",
        NodeType::Worker,
        "127.0.0.1:1".parse().unwrap(),
        8265,
    );
    api.apply(passing);
    api.delete("v1", "Pod", NS, "passing");
    api.expire_history();
    api.set_unavailable(false);
    eventually("the pod watch re-lists after 410", DEADLINE, || async {
        (api.lists("pods") > lists).then_some(())
    })
    .await;
    assert_eq!(
        snapshot_version(xds.admin_addr).await,
        served,
        "nothing changed"
    );
    assert!(through_envoy(port).await.is_some());

    // The API server goes away: the last state keeps being served, and it says so.
    api.set_unavailable(true);
    let watches = eventually("the watches report failing", DEADLINE, || async {
        let s = debug_state(xds.admin_addr).await;
        let w = s["source"]["watches"].as_array()?.clone();
        w.iter()
            .any(|w| w["state"] == "retrying" && w["stale_seconds"].is_number())
            .then_some(w)
    })
    .await;
    assert!(watches.iter().all(|w| w["synced"] == true), "{watches:?}");
    for _ in 0..10 {
        assert!(through_envoy(port).await.is_some());
    }
    assert_eq!(snapshot_version(xds.admin_addr).await, served);
    let ready = admin_get(xds.admin_addr, "/readyz").await;
    assert!(
        ready.starts_with("ready"),
        "still serving the last state: {ready}"
    );

    // It comes back, and a change made meanwhile is seen.
    api.set_unavailable(false);
    let b = Cluster::start("rs-b", &[NodeType::Head], "RUNNING", &shutdown).await;
    api.apply(rayservice(Some("rs-a"), Some("rs-b")));
    b.apply_pods(&api);
    eventually(
        "the change after recovery reaches Envoy",
        DEADLINE,
        || async { (through_envoy(port).await?.cluster == "rs-b").then_some(()) },
    )
    .await;
    shutdown.cancel();
}

/// Every endpoint address (`ip:port`) of the current snapshot's EDS resources.
async fn eds_addresses(admin: SocketAddr) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if let Some(a) = m.get("socket_address") {
                    out.push(format!(
                        "{}:{}",
                        a["address"].as_str().unwrap_or(""),
                        a["port_value"]
                    ));
                }
                m.values().for_each(|v| walk(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let snapshot: Value =
        serde_json::from_str(&admin_get(admin, "/debug/snapshot").await).unwrap_or(Value::Null);
    let mut out = Vec::new();
    walk(&snapshot["types"]["eds"], &mut out);
    out.sort();
    out
}

/// Issue 13: a `hostNetwork` pod's podIP is its node's address, so whoever owns a
/// RayService could have a node's address (any port on it) published. Without
/// `proxies.networks` such a pod's proxy is refused: not in EDS, shown in `/debug/state`
/// and counted; the cluster's other pods are served. With networks that hold it, it is
/// published like any pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_network_pods_proxy_is_refused_unless_networks_allow_it() {
    let shutdown = CancellationToken::new();
    let api = FakeApiServer::start().await;
    let a = Cluster::start(
        "rs-a",
        &[NodeType::Head, NodeType::Worker],
        "RUNNING",
        &shutdown,
    )
    .await;
    api.apply(rayservice(Some("rs-a"), None));
    api.apply(a.pod(0));
    let mut node_pod = a.pod(1);
    node_pod["spec"]["hostNetwork"] = json!(true);
    api.apply(node_pod);
    let (pod_addr, node_addr) = (a.sim.proxies[0].0, a.sim.proxies[1].0);
    let start = |networks: Vec<ipnet::IpNet>| {
        let mut config = k8s_config(&api);
        config.addresses.networks = networks;
        ray_xds::runtime::start(config, shutdown.child_token())
    };

    let xds = start(vec![]).await.unwrap();
    let admin = xds.admin_addr;
    let want = vec![(node_addr.to_string(), "host_network".to_string())];
    eventually(
        "the hostNetwork pod's proxy is refused",
        DEADLINE,
        || async { (refused_proxies(admin).await == want).then_some(()) },
    )
    .await;
    eventually("the other pod's proxy is in EDS", DEADLINE, || async {
        (eds_addresses(admin).await == [pod_addr.to_string()]).then_some(())
    })
    .await;
    let state = debug_state(admin).await;
    let reason = state["refused_proxies"][0]["reason"].to_string();
    assert!(
        reason.contains("hostNetwork") && reason.contains("proxies.networks"),
        "{reason}"
    );
    assert_eq!(
        state["refused_proxies_by_reason"]["host_network"], 1,
        "{state}"
    );
    let m = admin_get(admin, "/metrics").await;
    assert_eq!(
        metric(&m, "ray_xds_proxies_refused{reason=\"host_network\"}"),
        1.0,
        "{m}"
    );
    xds.stop().await.unwrap();

    // proxies.networks holds the node: the policy checks it like any address, and passes it.
    let xds = start(vec!["127.0.0.0/8".parse().unwrap()]).await.unwrap();
    let admin = xds.admin_addr;
    eventually(
        "the hostNetwork pod's proxy is in EDS",
        DEADLINE,
        || async {
            eds_addresses(admin)
                .await
                .contains(&node_addr.to_string())
                .then_some(())
        },
    )
    .await;
    assert_eq!(refused_proxies(admin).await, vec![]);
    xds.stop().await.unwrap();
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_and_nothing_served_until_every_watch_has_listed() {
    let shutdown = CancellationToken::new();
    let api = FakeApiServer::start().await;
    let a = Cluster::start("rs-a", &[NodeType::Head], "RUNNING", &shutdown).await;
    api.apply(rayservice(Some("rs-a"), None));
    a.apply_pods(&api);
    api.set_unavailable(true);
    let xds = ray_xds::runtime::start(k8s_config(&api), shutdown.clone())
        .await
        .unwrap();
    eventually("a watch has failed", DEADLINE, || async {
        let s = debug_state(xds.admin_addr).await;
        s["source"]["watches"]
            .as_array()?
            .iter()
            .any(|w| w["errors"].as_u64() > Some(0))
            .then_some(())
    })
    .await;
    let (code, body) = http_get(&format!("http://{}/readyz", xds.admin_addr))
        .await
        .unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("first full state"), "{body}");
    api.set_unavailable(false);
    eventually("ready once listed", DEADLINE, || async {
        let (code, _) = http_get(&format!("http://{}/readyz", xds.admin_addr))
            .await
            .ok()?;
        (code == 200).then_some(())
    })
    .await;
    let (_envoy, _port) = envoy_carrying_traffic(xds.xds_addr.port(), Bootstrap::Sotw).await;
    shutdown.cancel();
}

mod two_replicas {
    use super::*;
    use envoy_types::pb::envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse,
    };
    use ray_xds::xds::snapshot::{CLUSTER_TYPE_URL, ENDPOINTS_TYPE_URL};
    use std::collections::{BTreeMap, HashMap};

    struct DeltaClient {
        requests: tokio::sync::mpsc::Sender<DeltaDiscoveryRequest>,
        responses: tonic::Streaming<DeltaDiscoveryResponse>,
    }

    impl DeltaClient {
        async fn connect(xds: SocketAddr) -> DeltaClient {
            let (requests, responses) = support::ads::delta_stream(xds).await;
            DeltaClient {
                requests,
                responses,
            }
        }

        async fn subscribe(
            &self,
            type_url: &str,
            names: Vec<String>,
            known: HashMap<String, String>,
        ) {
            self.requests
                .send(DeltaDiscoveryRequest {
                    node: support::ads::node("moving-envoy"),
                    type_url: type_url.into(),
                    resource_names_subscribe: names,
                    initial_resource_versions: known,
                    ..Default::default()
                })
                .await
                .unwrap();
        }

        async fn next(&mut self) -> DeltaDiscoveryResponse {
            support::ads::next(&mut self.responses).await
        }

        async fn ack(&self, r: &DeltaDiscoveryResponse) {
            self.requests
                .send(DeltaDiscoveryRequest {
                    type_url: r.type_url.clone(),
                    response_nonce: r.nonce.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
    }

    fn versions(r: &DeltaDiscoveryResponse) -> BTreeMap<String, String> {
        r.resources
            .iter()
            .map(|x| (x.name.clone(), x.version.clone()))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_replicas_agree_and_an_envoy_moving_between_them_gets_no_cluster_again() {
        let shutdown = CancellationToken::new();
        let api = FakeApiServer::start().await;
        let a = Cluster::start("rs-a", &[NodeType::Head], "RUNNING", &shutdown).await;
        let b = Cluster::start(
            "rs-b",
            &[NodeType::Head, NodeType::Worker],
            "DEPLOYING",
            &shutdown,
        )
        .await;
        api.apply(rayservice(Some("rs-a"), Some("rs-b")));
        a.apply_pods(&api);
        api.apply(b.pod(0));
        let one = ray_xds::runtime::start(k8s_config(&api), shutdown.clone())
            .await
            .unwrap();
        let two = ray_xds::runtime::start(k8s_config(&api), shutdown.clone())
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let agreed = loop {
            let (v1, v2) = (
                snapshot_version(one.admin_addr).await,
                snapshot_version(two.admin_addr).await,
            );
            if !v1.is_empty() && v1 == v2 {
                break v1;
            }
            if started.elapsed() > DEADLINE {
                // Say why, for whoever reads a failure: what each replica serves and knows.
                for (n, a) in [(1, one.admin_addr), (2, two.admin_addr)] {
                    eprintln!(
                        "--- replica {n}: /debug/state ---\n{}",
                        admin_get(a, "/debug/state").await
                    );
                    eprintln!(
                        "--- replica {n}: /debug/snapshot ---\n{}",
                        admin_get(a, "/debug/snapshot").await
                    );
                }
                panic!("the replicas did not agree within {DEADLINE:?}: {v1:?} vs {v2:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(!agreed.is_empty());

        // An Envoy takes everything from replica one.
        let mut first = DeltaClient::connect(one.xds_addr).await;
        first
            .subscribe(CLUSTER_TYPE_URL, vec![], HashMap::new())
            .await;
        let clusters = first.next().await;
        first.ack(&clusters).await;
        let cluster_versions = versions(&clusters);
        let names: Vec<String> = cluster_versions.keys().cloned().collect();
        assert_eq!(
            names,
            [
                "default/rayservice-sample/rs-a",
                "default/rayservice-sample/rs-b"
            ]
        );
        first
            .subscribe(ENDPOINTS_TYPE_URL, names.clone(), HashMap::new())
            .await;
        let endpoints = first.next().await;
        first.ack(&endpoints).await;
        let endpoint_versions = versions(&endpoints);
        assert_eq!(endpoint_versions.len(), 2);
        drop(first);

        // It reconnects to replica two, saying what it holds.
        let mut moved = DeltaClient::connect(two.xds_addr).await;
        moved
            .subscribe(
                CLUSTER_TYPE_URL,
                vec![],
                cluster_versions.clone().into_iter().collect(),
            )
            .await;
        moved
            .subscribe(
                ENDPOINTS_TYPE_URL,
                names,
                endpoint_versions.clone().into_iter().collect(),
            )
            .await;
        // Replica two sends no cluster again. It sends the endpoints once more whatever
        // versions the Envoy declared (a cluster the Envoy was warming when its stream
        // broke waits for an assignment sent after it), unchanged ones included.
        let r = moved.next().await;
        assert_eq!(r.type_url, ENDPOINTS_TYPE_URL, "clusters were re-sent");
        assert_eq!(versions(&r), endpoint_versions, "the same endpoints, once");
        moved.ack(&r).await;
        // Then rs-b gains a pod: what comes next is that change alone.
        api.apply(b.pod(1));
        let r = moved.next().await;
        assert_eq!(r.type_url, ENDPOINTS_TYPE_URL, "clusters were re-sent");
        let changed: Vec<&str> = r.resources.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(
            changed,
            ["default/rayservice-sample/rs-b"],
            "only what changed"
        );
        assert_ne!(
            r.resources[0].version,
            endpoint_versions["default/rayservice-sample/rs-b"]
        );
        shutdown.cancel();
    }
}

/// A RayService in `namespace`, created at `created` (RFC 3339), claiming `hosts`, routed
/// to `cluster`; with its cluster's pods moved into the namespace.
fn claimant(namespace: &str, created: &str, hosts: &str, cluster: &Cluster) -> Vec<Value> {
    let mut r = rayservice(Some(&cluster.sim.name), None);
    r["metadata"]["namespace"] = json!(namespace);
    r["metadata"]["creationTimestamp"] = json!(created);
    r["metadata"]["annotations"] = json!({ "ray-xds.io/hosts": hosts });
    let mut objects = vec![r];
    for i in 0..cluster.sim.proxies.len() {
        let mut pod = cluster.pod(i);
        pod["metadata"]["namespace"] = json!(namespace);
        objects.push(pod);
    }
    objects
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_namespaces_contending_for_a_host_the_older_keeps_it_and_none_takes_what_the_policy_refuses(
) {
    let shutdown = CancellationToken::new();
    let api = FakeApiServer::start().await;
    let z = Cluster::start("z-1", &[NodeType::Head], "RUNNING", &shutdown).await;
    let a = Cluster::start("a-1", &[NodeType::Head], "RUNNING", &shutdown).await;
    // zeta's RayService is older; alpha's sorts first by name, and also claims "*".
    for o in claimant("zeta", "2026-01-01T00:00:00Z", "shared.example.com", &z) {
        api.apply(o);
    }
    for o in claimant(
        "alpha",
        "2026-06-01T00:00:00Z",
        "shared.example.com, *, rayservice-sample.alpha",
        &a,
    ) {
        api.apply(o);
    }
    let mut config = k8s_config(&api);
    let SourceConfig::Kubernetes(k) = &mut config.source else {
        unreachable!()
    };
    k.allowed_hosts = [
        ("zeta".to_string(), vec!["*.example.com".to_string()]),
        ("alpha".to_string(), vec!["*.example.com".to_string()]),
    ]
    .into();
    let xds = ray_xds::runtime::start(config, shutdown.clone())
        .await
        .unwrap();
    let envoy = Envoy::start(Bootstrap::Delta, xds.xds_addr.port());
    let port = envoy.gateway_port().await;
    let served_by =
        |host: &'static str| async move { through_envoy_to(port, host).await.map(|s| s.cluster) };
    eventually(
        "the shared host routes to the older RayService",
        DEADLINE,
        || async { served_by("shared.example.com").await.filter(|c| c == "z-1") },
    )
    .await;
    eventually("the younger keeps its own name", DEADLINE, || async {
        served_by("rayservice-sample.alpha")
            .await
            .filter(|c| c == "a-1")
    })
    .await;
    for _ in 0..20 {
        assert_eq!(
            served_by("shared.example.com").await.as_deref(),
            Some("z-1")
        );
    }
    // "*" was refused: nothing routes a host nobody may claim.
    assert_eq!(served_by("anything.else").await, None);
    let (status, _) = http_to_host(
        "POST",
        &format!("http://127.0.0.1:{port}/hello"),
        "anything.else",
        "{}",
    )
    .await
    .unwrap();
    assert_eq!(status, 404);

    // Refused and conflicting claims are shown and counted.
    let state = debug_state(xds.admin_addr).await;
    let problems: Vec<String> =
        serde_json::from_value(state["source"]["problems"].clone()).unwrap();
    assert!(
        problems.iter().any(|p| p
            .starts_with("rayservice alpha/rayservice-sample: 1 host(s) refused")
            && p.ends_with("\"*\"")),
        "{problems:#?}"
    );
    assert!(
        problems.iter().any(|p| p
            .starts_with("rayservice alpha/rayservice-sample: 1 host(s) held by older")
            && p.contains("\"shared.example.com\" left to zeta/rayservice-sample")),
        "{problems:#?}"
    );
    let metrics = admin_get(xds.admin_addr, "/metrics").await;
    for reason in ["host_refused", "host_conflict"] {
        let series = format!(
            "ray_xds_source_objects_skipped_total{{source=\"kubernetes\",reason=\"{reason}\"}}"
        );
        assert!(metric(&metrics, &series) >= 1.0, "{series}\n{metrics}");
    }

    // The older RayService goes: the host passes to the one claimant left.
    api.delete("ray.io/v1", "RayService", "zeta", NAME);
    eventually(
        "the shared host moves to the remaining claimant",
        DEADLINE,
        || async { served_by("shared.example.com").await.filter(|c| c == "a-1") },
    )
    .await;
    shutdown.cancel();
}

/// A fake API server and two single-node clusters, `rs-a` and `rs-b`, RUNNING, their
/// pods listed.
async fn upgrade_pair(shutdown: &CancellationToken) -> (FakeApiServer, Cluster, Cluster) {
    let api = FakeApiServer::start().await;
    let a = Cluster::start("rs-a", &[NodeType::Head], "RUNNING", shutdown).await;
    let b = Cluster::start("rs-b", &[NodeType::Head], "RUNNING", shutdown).await;
    a.apply_pods(&api);
    b.apply_pods(&api);
    (api, a, b)
}

/// `hello` at 4 replicas of 2 requests at once, `running` of them RUNNING.
fn sized(running: u32) -> ray_serve_sim::dashboard::AppSize {
    ray_serve_sim::dashboard::AppSize {
        num_replicas: 4,
        running,
        max_ongoing_requests: 2,
    }
}

/// KubeRay's incremental upgrade (`NewClusterWithIncrementalUpgrade`): it grows the new
/// cluster through Serve's `target_capacity` and reports the traffic its Gateway sends it
/// (`pendingServiceStatus.trafficRoutedPercent`). The new cluster never gets more than
/// that, nor more than its ready capacity allows; the move completes once KubeRay routes
/// it everything and it can run what the old cluster could, while KubeRay scales the old
/// one down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incremental_upgrade_follows_kuberays_traffic_percent_and_the_new_clusters_capacity() {
    let shutdown = CancellationToken::new();
    let (api, a, b) = upgrade_pair(&shutdown).await;
    let full = sized(4);
    a.dashboard.set_app_size("hello", full);
    b.dashboard.set_app_size("hello", full);
    // KubeRay starts the new cluster at a quarter of its size.
    b.dashboard.set_target_capacity(Some(25.0));
    let upgrade = |percent: u32| {
        let mut r = rayservice(Some("rs-a"), Some("rs-b"));
        r["status"]["pendingServiceStatus"]["trafficRoutedPercent"] = json!(percent);
        r["status"]["pendingServiceStatus"]["targetCapacity"] = json!(25);
        r
    };
    api.apply(upgrade(10));
    let xds = ray_xds::runtime::start(k8s_config(&api), shutdown.clone())
        .await
        .unwrap();
    let admin = xds.admin_addr;
    let weights_are = |want: Vec<(&'static str, u64)>| async move {
        let want: Vec<(String, u64)> = want.into_iter().map(|(c, w)| (c.into(), w)).collect();
        eventually(&format!("weights {want:?}"), DEADLINE, || async {
            (published_weights(admin).await == want).then_some(())
        })
        .await;
    };
    // KubeRay routes 10%: so does ray-xds (capacity would allow 20%).
    weights_are(vec![("rs-a", 90), ("rs-b", 10)]).await;
    let s = debug_state(admin).await;
    let reason = s["rayservices"][0]["switchover"]["reason"]
        .as_str()
        .unwrap();
    assert!(reason.contains("it routes 10%"), "{reason}");
    // KubeRay routes 50%: b runs 1 of 4 replicas, so it takes 2 / (2 + 8) = 20%.
    api.apply(upgrade(50));
    weights_are(vec![("rs-a", 80), ("rs-b", 20)]).await;
    // KubeRay grows b to full size and shrinks a: b could carry everything, and takes
    // the 50% KubeRay routes it (ray-xds does not undo the scale-down of a).
    b.dashboard.set_target_capacity(Some(100.0));
    a.dashboard.set_target_capacity(Some(50.0));
    weights_are(vec![("rs-a", 50), ("rs-b", 50)]).await;
    // KubeRay routes it everything: the move completes.
    api.apply(upgrade(100));
    weights_are(vec![("rs-b", 100)]).await;
    let s = debug_state(admin).await;
    assert_eq!(s["rayservices"][0]["switchover"]["phase"], "stable", "{s}");
    shutdown.cancel();
}

/// An operator's word on a switch, through the `ray-xds.io/switchover-control`
/// annotation: abort keeps the traffic off a ready pending cluster, hold keeps its share
/// where it is, promote moves it all at once past a progressive schedule and the capacity
/// limit; each phase shown in `/debug/state` and counted in `/metrics`. A value that is
/// not one of them is reported and holds the switch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_aborts_holds_and_promotes_a_switch_through_an_annotation() {
    let shutdown = CancellationToken::new();
    let (api, a, b) = upgrade_pair(&shutdown).await;
    a.dashboard.set_app_size("hello", sized(4));
    // b runs 1 replica of 4: capacity alone would give it 2 / (2 + 8) = 20%.
    b.dashboard.set_app_size("hello", sized(1));
    let with_control = |control: Option<&str>| {
        let mut r = rayservice(Some("rs-a"), Some("rs-b"));
        let annotations = &mut r["metadata"]["annotations"];
        // A first step of 10%, and the next an hour later.
        annotations["ray-xds.io/switchover-steps"] = json!("10,100");
        annotations["ray-xds.io/switchover-interval"] = json!("1h");
        if let Some(c) = control {
            annotations["ray-xds.io/switchover-control"] = json!(c);
        }
        r
    };
    api.apply(with_control(Some("abort")));
    let xds = ray_xds::runtime::start(k8s_config(&api), shutdown.clone())
        .await
        .unwrap();
    let admin = xds.admin_addr;
    let state_is = |want: Vec<(&'static str, u64)>, phase: &'static str| async move {
        let want: Vec<(String, u64)> = want.into_iter().map(|(c, w)| (c.into(), w)).collect();
        eventually(&format!("weights {want:?}, {phase}"), DEADLINE, || async {
            let s = debug_state(admin).await;
            let now = s["rayservices"][0]["switchover"]["phase"].as_str() == Some(phase);
            (now && published_weights(admin).await == want).then_some(())
        })
        .await;
    };
    let gauge = |family: &str, state: &str| {
        let series = format!("ray_xds_{family}{{state=\"{state}\"}} ");
        async move {
            let text = admin_get(admin, "/metrics").await;
            text.lines()
                .find_map(|l| l.strip_prefix(&series).map(str::to_string))
                .unwrap_or_default()
        }
    };
    let phase_count = |phase: &str| gauge("switchovers", phase);
    let control_count = |control: &str| gauge("switchover_controls", control);
    state_is(vec![("rs-a", 100)], "aborted").await;
    let reason = debug_state(admin).await["rayservices"][0]["switchover"]["reason"].clone();
    assert!(
        reason.to_string().contains("aborted by the operator"),
        "{reason}"
    );
    assert_eq!(phase_count("aborted").await, "1");
    assert_eq!(phase_count("shifting").await, "0");
    assert_eq!(control_count("abort").await, "1");
    assert_eq!(control_count("hold").await, "0");

    // Held before anything moved: nothing moves.
    api.apply(with_control(Some("hold")));
    state_is(vec![("rs-a", 100)], "held").await;
    assert_eq!(phase_count("held").await, "1");
    // Left to ray-xds: the schedule's first step (below what capacity allows).
    api.apply(with_control(None));
    state_is(vec![("rs-a", 90), ("rs-b", 10)], "shifting").await;
    // A typo is reported, and holds the switch where it is (a typo in `hold` or
    // `abort` must not set it going).
    api.apply(with_control(Some("abrot")));
    eventually("the bad value reported", DEADLINE, || async {
        let s = debug_state(admin).await.to_string();
        s.contains("abrot").then_some(())
    })
    .await;
    state_is(vec![("rs-a", 90), ("rs-b", 10)], "held").await;
    assert_eq!(control_count("hold").await, "1");
    // Held where it is.
    api.apply(with_control(Some("hold")));
    state_is(vec![("rs-a", 90), ("rs-b", 10)], "held").await;
    // Promoted: all of it now, not 10% for an hour, nor the 20% b's capacity gives.
    api.apply(with_control(Some("promote")));
    state_is(vec![("rs-b", 100)], "stable").await;
    let reason = debug_state(admin).await["rayservices"][0]["switchover"]["reason"].clone();
    assert!(
        reason.to_string().contains("promoted by the operator"),
        "{reason}"
    );
    shutdown.cancel();
}

//! The replicas' kept switchover views in a ConfigMap (`replicas.state.configmap`): the
//! store against the fake API server (merge patches of one key per replica), and ray-xds
//! with the Kubernetes source restarted mid-shift, resuming from what it kept, having
//! written nothing but that ConfigMap.

use std::time::{Duration, SystemTime};

use ray_serve_sim::dashboard::SimDashboard;
use ray_serve_sim::NodeType;
use ray_xds::config::{
    Config, KubernetesSourceConfig, ReplicaStateConfig, ReplicaStateStore, SourceConfig,
};
use ray_xds::live::peers::{to_unix, ReplicaView};
use ray_xds::live::state_store::{entry_key, KeptView, StateStore};
use serde_json::json;
use support::fake_apiserver::FakeApiServer;
use support::kuberay::{self, ray_pod, rayservice};
use support::*;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(30);
const STATE_NS: &str = "ray-xds";
const STATE_NAME: &str = "ray-xds-state";

fn state_configmap() -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": STATE_NAME, "namespace": STATE_NS},
        "data": {"unrelated": "kept as it is"},
    })
}

fn store(api: &FakeApiServer) -> StateStore {
    StateStore::ConfigMap {
        api: kube::Api::namespaced(api.client(), STATE_NS),
        name: STATE_NAME.into(),
    }
}

fn entry(replica: &str, written: SystemTime) -> KeptView {
    KeptView {
        written_unix: to_unix(written),
        view: ReplicaView {
            replica: Some(replica.into()),
            ..Default::default()
        },
        supersedes: Vec::new(),
    }
}

#[tokio::test]
async fn a_configmap_keeps_a_key_per_replica_and_writes_touch_only_their_keys() {
    let api = FakeApiServer::start().await;
    let store = store(&api);
    // No ConfigMap (deploy/ creates it; ray-xds may not): an error that says so.
    let missing = store.read().await.unwrap_err();
    assert!(missing.contains("does not exist"), "{missing}");
    let refused = store
        .write(&entry_key("r1"), Some(&entry("r1", SystemTime::now())), &[])
        .await
        .unwrap_err();
    assert!(refused.contains("ray-xds-state"), "{refused}");

    api.apply(state_configmap());
    let now = SystemTime::now();
    // Two replicas write at once: neither loses the other's key.
    let (key_1, key_2) = (entry_key("r1"), entry_key("r2"));
    let (entry_1, entry_2) = (entry("r1", now), entry("r2", now));
    let (one, two) = tokio::join!(
        store.write(&key_1, Some(&entry_1), &[]),
        store.write(&key_2, Some(&entry_2), &[]),
    );
    one.unwrap();
    two.unwrap();
    let read = store.read().await.unwrap();
    let keys: Vec<&str> = read.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        ["replica-r1.json", "replica-r2.json"],
        "only replicas' keys are read"
    );
    assert_eq!(read[0].1.as_ref().unwrap(), &entry("r1", now));
    // A write that removes another replica's (expired) entry removes only that key.
    store
        .write(
            &entry_key("r2"),
            Some(&entry("r2", now)),
            &[entry_key("r1")],
        )
        .await
        .unwrap();
    let map: k8s_openapi::api::core::v1::ConfigMap = kube::Api::namespaced(api.client(), STATE_NS)
        .get(STATE_NAME)
        .await
        .unwrap();
    let data = map.data.unwrap();
    let keys: Vec<&str> = data.keys().map(String::as_str).collect();
    assert_eq!(keys, ["replica-r2.json", "unrelated"]);
    // Garbage under a replica's key is read as an error of that entry alone.
    let mut garbage = state_configmap();
    garbage["data"]["replica-bad.json"] = json!("{\"written_unix\": \"yesterday\"}");
    garbage["data"]["replica-r2.json"] = json!(data["replica-r2.json"]);
    api.apply(garbage);
    let read = store.read().await.unwrap();
    assert_eq!(read.len(), 2);
    assert!(read[0].1.is_err() && read[1].1.is_ok(), "{read:?}");
}

fn k8s_config(api: &FakeApiServer) -> Config {
    let mut c = test_config(std::path::Path::new("unused"), 0);
    c.source = SourceConfig::Kubernetes(KubernetesSourceConfig {
        api_server: Some(api.url()),
        allowed_hosts: [(kuberay::NAMESPACE.to_string(), vec!["*".to_string()])].into(),
        ..Default::default()
    });
    c.replica_state = Some(ReplicaStateConfig {
        store: ReplicaStateStore::ConfigMap {
            namespace: STATE_NS.into(),
            name: STATE_NAME.into(),
        },
        ttl: Duration::from_secs(600),
    });
    c
}

/// A single-node cluster, RUNNING, its pod listed.
async fn cluster(
    api: &FakeApiServer,
    name: &str,
    shutdown: &CancellationToken,
) -> (SimCluster, SimDashboard) {
    let sim = SimCluster::start(name, &[NodeType::Head]).await;
    let dashboard = SimDashboard::new();
    dashboard.set_app("hello", "/", "RUNNING");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));
    let (addr, node_type, _) = &sim.proxies[0];
    let pod = format!("{name}-{}-0", node_type.as_str());
    api.apply(ray_pod(&pod, name, *node_type, *addr, port));
    (sim, dashboard)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ray_xds_restarted_mid_shift_resumes_from_its_configmap_and_writes_nothing_else() {
    let shutdown = CancellationToken::new();
    let api = FakeApiServer::start().await;
    let _a = cluster(&api, "rs-a", &shutdown).await;
    let _b = cluster(&api, "rs-b", &shutdown).await;
    api.apply(state_configmap());
    let mut upgrade = rayservice(Some("rs-a"), Some("rs-b"));
    // A first step of 10%, then 50% 8 s later: a shift started over shows.
    upgrade["metadata"]["annotations"]["ray-xds.io/switchover-steps"] = json!("10,50,100");
    upgrade["metadata"]["annotations"]["ray-xds.io/switchover-interval"] = json!("8s");
    api.apply(upgrade);
    let config = k8s_config(&api);
    let xds = ray_xds::runtime::start(config.clone(), shutdown.child_token())
        .await
        .unwrap();
    let admin = xds.admin_addr;
    eventually("the second step", DEADLINE, || async {
        (published_weights(admin).await == [("rs-a".into(), 50), ("rs-b".into(), 50)]).then_some(())
    })
    .await;
    xds.stop().await.unwrap();
    let xds = ray_xds::runtime::start(config, shutdown.child_token())
        .await
        .unwrap();
    let admin = xds.admin_addr;
    let first = eventually("the restarted replica publishes", DEADLINE, || async {
        let w = published_weights(admin).await;
        (!w.is_empty()).then_some(w)
    })
    .await;
    let on_b = first
        .iter()
        .find(|(c, _)| c == "rs-b")
        .map_or(0, |(_, w)| *w);
    assert!(on_b >= 50, "the shift started over: {first:?}");
    // Its writes: merge patches of its own ConfigMap, nothing else.
    let writes: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| !r.starts_with("GET "))
        .collect();
    assert!(!writes.is_empty());
    let own = format!("PATCH /api/v1/namespaces/{STATE_NS}/configmaps/{STATE_NAME}");
    assert!(writes.iter().all(|w| w.starts_with(&own)), "{writes:?}");
    assert_eq!(api.patches("rayservices"), 0);
    xds.stop().await.unwrap();
    shutdown.cancel();
}

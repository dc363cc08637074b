//! The pre-stop handshake across replicas: a pod's call to one replica is answered only
//! once the Envoys of every replica hold endpoints without it. Two replicas, a real Envoy
//! on each; the second Envoy is frozen (SIGSTOP) so it cannot ACK.

use std::net::SocketAddr;
use std::time::Duration;

use ray_serve_sim::NodeType;
use ray_xds::config::Config;
use serde_json::Value;
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

/// A replica whose peers are itself and the other, as a headless Service's name resolves
/// to every replica.
fn replica_config(services: &std::path::Path, admin: u16, peer_admin: u16) -> Config {
    let mut c = test_config(services, 0);
    c.admin_listen = SocketAddr::from(([127, 0, 0, 1], admin));
    c.replica_peers = vec![
        format!("127.0.0.1:{admin}"),
        format!("127.0.0.1:{peer_admin}"),
    ];
    c.replica_poll_interval = Duration::from_millis(200);
    c
}

/// `services_yaml` with the proxy at `leaving` marked going away (as a terminating pod).
fn services(a: &SimCluster, leaving: Option<SocketAddr>) -> String {
    let text = services_yaml("a", &[a]);
    match leaving {
        None => text,
        Some(addr) => {
            let listed = format!("address: {addr}, node_type: worker }}");
            assert!(text.contains(&listed), "{text}");
            text.replace(
                &listed,
                &format!("address: {addr}, node_type: worker, draining: true }}"),
            )
        }
    }
}

async fn listed_by(envoy: &Envoy, addr: SocketAddr) -> bool {
    envoy
        .admin("/clusters")
        .await
        .contains(&format!("::{addr}::health_flags::"))
}

async fn prestop(admin: SocketAddr, query: &str) -> (u16, Value) {
    let (status, body) = http_get(&format!("http://{admin}/prestop?{query}"))
        .await
        .unwrap();
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// While the second replica's Envoy cannot ACK, a call to the first answers 504 at its
/// grace, naming the peer that still waits and its Envoy; once that Envoy runs again, the
/// same call answers 200, and neither Envoy lists the pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prestop_call_waits_for_every_replica_s_envoys() {
    let a = SimCluster::start("a", &[NodeType::Head, NodeType::Worker, NodeType::Worker]).await;
    let leaving = a.proxies[2].0;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("services.yaml");
    write_atomic(&file, &services(&a, None));
    let (admin_1, admin_2) = (free_port(), free_port());
    let one = ray_xds::runtime::start(replica_config(&file, admin_1, admin_2), Default::default())
        .await
        .unwrap();
    let two = ray_xds::runtime::start(replica_config(&file, admin_2, admin_1), Default::default())
        .await
        .unwrap();
    let (envoy_1, _) = envoy_carrying_traffic(one.xds_addr.port(), Bootstrap::Sotw).await;
    let (envoy_2, _) = envoy_carrying_traffic(two.xds_addr.port(), Bootstrap::Delta).await;
    for envoy in [&envoy_1, &envoy_2] {
        eventually("the pod is in both Envoys", DEADLINE, || async {
            listed_by(envoy, leaving).await.then_some(())
        })
        .await;
    }

    // The second Envoy stops (it cannot ACK); the pod is marked going away.
    envoy_2.process.signal(libc::SIGSTOP);
    write_atomic(&file, &services(&a, Some(leaving)));
    eventually("the first Envoy drops the pod", DEADLINE, || async {
        (!listed_by(&envoy_1, leaving).await).then_some(())
    })
    .await;
    let query = format!("address={leaving}&grace=3s");
    let (status, answer) = prestop(one.admin_addr, &query).await;
    envoy_2.process.signal(libc::SIGCONT);
    assert_eq!(status, 504, "{answer}");
    assert_eq!(answer["dropped"], false, "{answer}");
    // Replica one's own Envoy dropped it: what is missing is the peer's.
    assert_eq!(answer["waiting_for_total"], 0, "{answer}");
    let peers = answer["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 2, "{answer}");
    // Asked through its peers' names, replica one answered itself at once.
    let own = format!("127.0.0.1:{admin_1}");
    let (itself, other): (Vec<&Value>, Vec<&Value>) = peers
        .iter()
        .partition(|p| p["peer"].as_str().unwrap().starts_with(&own));
    assert_eq!(itself.len(), 1, "{answer}");
    assert_eq!(itself[0]["dropped"], true, "{answer}");
    assert!(
        itself[0]["detail"]
            .as_str()
            .unwrap()
            .contains("\"self\":true"),
        "{answer}"
    );
    assert_eq!(other[0]["dropped"], false, "{answer}");
    // The peer had dropped the pod from what it publishes, and waited for its Envoy.
    let detail: Value = serde_json::from_str(other[0]["detail"].as_str().unwrap()).unwrap();
    assert_eq!(detail["still_listed_in"], 0, "{detail}");
    assert_eq!(detail["waiting_for_total"], 1, "{detail}");

    // Running again, it ACKs: the call answers 200 and neither Envoy lists the pod.
    let (status, answer) = prestop(one.admin_addr, &format!("address={leaving}&grace=20s")).await;
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["peers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["dropped"] == true),
        "{answer}"
    );
    assert!(!listed_by(&envoy_1, leaving).await);
    assert!(!listed_by(&envoy_2, leaving).await);
    one.stop().await.unwrap();
    two.stop().await.unwrap();
}

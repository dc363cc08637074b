//! Two ray-xds replicas fed the same services file, each asking the other for its
//! switchovers (`replicas.peers`), a real Envoy on each, through a progressive shift: the
//! weights each publishes are sampled side by side, and one replica restarted mid-shift
//! resumes where the other is instead of starting the shift over.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ray_serve_sim::NodeType;
use ray_xds::config::Config;
use ray_xds::runtime::Running;
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);
const WEIGHT_B: &str = "ray_xds_switchover_weight{rayservice=\"default/demo\",cluster=\"b\"}";

fn services(a: &SimCluster, b: &SimCluster, pending: bool) -> String {
    let mut extra = String::from(
        "    switchover: { mode: progressive, steps: [10, 25, 50, 100], interval: 3s }\n",
    );
    if pending {
        extra += "    pending_cluster: b\n";
    }
    services_yaml_with("a", &[a, b], &extra)
}

fn replica_config(services: &std::path::Path, admin: u16, xds: u16, peer_admin: u16) -> Config {
    let mut c = test_config(services, 0);
    c.admin_listen = SocketAddr::from(([127, 0, 0, 1], admin));
    c.xds_listen = SocketAddr::from(([127, 0, 0, 1], xds));
    c.replica_peers = vec![format!("127.0.0.1:{peer_admin}")];
    c.replica_poll_interval = Duration::from_millis(200);
    c
}

/// The weight of cluster b a replica publishes now (0 when it names only a); `None`
/// before its first snapshot.
pub(crate) async fn weight_b(admin: SocketAddr) -> Option<u32> {
    let (ready, _) = http_get(&format!("http://{admin}/readyz")).await.ok()?;
    let (status, text) = http_get(&format!("http://{admin}/metrics")).await.ok()?;
    let named = text.contains("ray_xds_switchover_weight{");
    (ready == 200 && status == 200 && named).then(|| metric(&text, WEIGHT_B) as u32)
}

async fn start(config: Config) -> Running {
    ray_xds::runtime::start(config, Default::default())
        .await
        .expect("ray-xds starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_publish_the_same_weights_and_a_restarted_one_resumes_the_shift() {
    let a = SimCluster::start("a", &[NodeType::Head]).await;
    let b = SimCluster::start("b", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("services.yaml");
    write_atomic(&file, &services(&a, &b, false));
    let (admin_1, admin_2) = (free_port(), free_port());
    let (xds_1, xds_2) = (free_port(), free_port());
    let one = start(replica_config(&file, admin_1, xds_1, admin_2)).await;
    let two_config = replica_config(&file, admin_2, xds_2, admin_1);
    let two = start(two_config.clone()).await;
    let (envoy_1, port_1) = envoy_carrying_traffic(xds_1, Bootstrap::Sotw).await;
    let (envoy_2, port_2) = envoy_carrying_traffic(xds_2, Bootstrap::Delta).await;

    // Before the upgrade both send nothing to b: the first sample of each, so that a step
    // one replica takes before the other is sampled still shows in both (under load, one
    // can be at 10% by the first sample after the file changes while the other is at 0).
    let before = (
        weight_b(one.admin_addr).await,
        weight_b(two.admin_addr).await,
    );
    assert_eq!(before, (Some(0), Some(0)));
    let mut samples: Vec<(u32, u32)> = vec![(0, 0)];

    // The upgrade begins: b becomes pending on both (one file).
    write_atomic(&file, &services(&a, &b, true));
    let started = Instant::now();
    let two_admin = two.admin_addr;
    // Until the second step (25%), side by side.
    loop {
        let (w1, w2) = (weight_b(one.admin_addr).await, weight_b(two_admin).await);
        if let (Some(w1), Some(w2)) = (w1, w2) {
            samples.push((w1, w2));
            if w1 >= 25 && w2 >= 25 {
                break;
            }
        }
        assert!(started.elapsed() < DEADLINE, "no second step: {samples:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Replica two restarts mid-shift (same ports: its Envoy reconnects to it).
    let before_restart = weight_b(one.admin_addr).await.unwrap();
    two.stop().await.unwrap();
    let two = start(two_config).await;
    let resumed = eventually("the restarted replica publishes", DEADLINE, || async {
        weight_b(two.admin_addr).await
    })
    .await;
    assert!(
        resumed >= before_restart,
        "the restarted replica started the shift over: {resumed}% of traffic on b, its peer \
         was at {before_restart}%"
    );

    // To the end, side by side, and through each Envoy.
    loop {
        let (w1, w2) = (
            weight_b(one.admin_addr).await,
            weight_b(two.admin_addr).await,
        );
        if let (Some(w1), Some(w2)) = (w1, w2) {
            samples.push((w1, w2));
            if w1 == 100 && w2 == 100 {
                break;
            }
        }
        assert!(started.elapsed() < 2 * DEADLINE, "no end: {samples:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Each replica's weights only rise, through the same steps.
    let steps = |pick: fn(&(u32, u32)) -> u32| {
        let mut seen: Vec<u32> = samples.iter().map(pick).collect();
        assert!(
            seen.windows(2).all(|w| w[0] <= w[1]),
            "went back: {samples:?}"
        );
        seen.dedup();
        seen
    };
    let (steps_1, steps_2) = (steps(|s| s.0), steps(|s| s.1));
    assert_eq!(steps_1.last(), Some(&100));
    assert!(
        steps_1.iter().all(|w| [0, 10, 25, 50, 100].contains(w)),
        "{steps_1:?}"
    );
    assert!(
        steps_2.iter().all(|w| steps_1.contains(w)),
        "{steps_1:?} {steps_2:?}"
    );
    let apart = samples.iter().filter(|(w1, w2)| w1 != w2).count();
    println!(
        "{} samples 50 ms apart, {apart} with different weights; steps {steps_1:?} and {steps_2:?}",
        samples.len()
    );
    for port in [port_1, port_2] {
        eventually("each Envoy routes to b", DEADLINE, || async {
            through_envoy(port).await.filter(|s| s.cluster == "b")
        })
        .await;
    }
    drop((envoy_1, envoy_2));
    one.stop().await.unwrap();
    two.stop().await.unwrap();
}

/// The Envoy clusters in a replica's current snapshot.
pub(crate) async fn snapshot_clusters(admin: SocketAddr) -> Vec<String> {
    let Ok((200, text)) = http_get(&format!("http://{admin}/debug/snapshot")).await else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    v["types"]["cds"]["resources"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["name"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_restarted_while_a_dropped_cluster_drains_keeps_it_draining() {
    let a = SimCluster::start("a", &[NodeType::Head]).await;
    let b = SimCluster::start("b", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("services.yaml");
    let grace = "    switchover: { drain_grace: 60s }\n";
    write_atomic(
        &file,
        &services_yaml_with("a", &[&a, &b], &format!("{grace}    pending_cluster: b\n")),
    );
    let (admin_1, admin_2) = (free_port(), free_port());
    let one = start(replica_config(&file, admin_1, free_port(), admin_2)).await;
    let two_config = replica_config(&file, admin_2, free_port(), admin_1);
    let two = start(two_config.clone()).await;
    for admin in [one.admin_addr, two.admin_addr] {
        eventually("b serves", DEADLINE, || async {
            (weight_b(admin).await == Some(100)).then_some(())
        })
        .await;
    }
    // The source promotes b and drops a: both replicas keep a, draining.
    write_atomic(&file, &services_yaml_with("b", &[&b], grace));
    for admin in [one.admin_addr, two.admin_addr] {
        eventually(
            "a is dropped by the source but drains",
            DEADLINE,
            || async {
                let state: serde_json::Value = serde_json::from_str(
                    &http_get(&format!("http://{admin}/debug/state"))
                        .await
                        .ok()?
                        .1,
                )
                .ok()?;
                let clusters = state["rayservices"][0]["clusters"].as_array()?.len();
                (clusters == 1
                    && snapshot_clusters(admin)
                        .await
                        .contains(&"default/demo/a".to_string()))
                .then_some(())
            },
        )
        .await;
    }
    // Replica two restarts: it never saw a in its source, and keeps it all the same.
    two.stop().await.unwrap();
    let two = start(two_config).await;
    eventually("the restarted replica is ready", DEADLINE, || async {
        weight_b(two.admin_addr).await
    })
    .await;
    let clusters = snapshot_clusters(two.admin_addr).await;
    assert!(
        clusters.contains(&"default/demo/a".to_string()),
        "its first snapshot keeps the draining cluster: {clusters:?}"
    );
    let view: serde_json::Value = serde_json::from_str(
        &http_get(&format!("http://{}/replica/switchover", two.admin_addr))
            .await
            .unwrap()
            .1,
    )
    .unwrap();
    assert_eq!(view["departed"][0]["cluster"], "a", "{view}");
    one.stop().await.unwrap();
    two.stop().await.unwrap();
}

//! Every replica restarted at once (`replicas.state.dir`): two ray-xds replicas, each
//! keeping its switchover view in one directory, both stopped mid-shift and started again:
//! each resumes the shift where it was (not from its first step), and a cluster the source
//! dropped keeps draining.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ray_serve_sim::NodeType;
use ray_xds::config::{Config, ReplicaStateConfig, ReplicaStateStore};
use ray_xds::runtime::Running;
use support::*;

use crate::agree::{snapshot_clusters, weight_b};

const DEADLINE: Duration = Duration::from_secs(30);

fn replica_config(services: &Path, state: &Path, admin: u16, peer_admin: u16) -> Config {
    let mut c = test_config(services, 0);
    c.admin_listen = SocketAddr::from(([127, 0, 0, 1], admin));
    c.replica_peers = vec![format!("127.0.0.1:{peer_admin}")];
    c.replica_poll_interval = Duration::from_millis(200);
    c.replica_state = Some(ReplicaStateConfig {
        store: ReplicaStateStore::Dir(state.to_path_buf()),
        ttl: Duration::from_secs(600),
    });
    c
}

async fn start(config: &Config) -> Running {
    ray_xds::runtime::start(config.clone(), Default::default())
        .await
        .expect("ray-xds starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_replicas_restarted_at_once_resume_the_shift_and_keep_draining() {
    let a = SimCluster::start("a", &[NodeType::Head]).await;
    let b = SimCluster::start("b", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let (file, state) = (dir.path().join("services.yaml"), dir.path().join("state"));
    // Steps far enough apart that a shift started over shows: its first step is 10%.
    let policy = "    switchover: { mode: progressive, steps: [10, 50, 100], interval: 8s, drain_grace: 60s }\n";
    write_atomic(
        &file,
        &services_yaml_with("a", &[&a, &b], &format!("{policy}    pending_cluster: b\n")),
    );
    let (admin_1, admin_2) = (free_port(), free_port());
    let configs = [
        replica_config(&file, &state, admin_1, admin_2),
        replica_config(&file, &state, admin_2, admin_1),
    ];
    let mut replicas = vec![start(&configs[0]).await, start(&configs[1]).await];
    for r in &replicas {
        let admin = r.admin_addr;
        eventually("the second step (50%)", DEADLINE, || async {
            (weight_b(admin).await == Some(50)).then_some(())
        })
        .await;
    }
    // Both stop at once (their nodes lost together), and start again.
    for r in replicas.drain(..) {
        r.stop().await.unwrap();
    }
    let kept: Vec<String> = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(kept.len(), 2, "an entry per replica: {kept:?}");
    for config in &configs {
        replicas.push(start(config).await);
    }
    for r in &replicas {
        let admin = r.admin_addr;
        let first = eventually("the restarted replica publishes", DEADLINE, || async {
            weight_b(admin).await
        })
        .await;
        assert!(
            first >= 50,
            "a restarted replica started the shift over: {first}% on b"
        );
    }
    for r in &replicas {
        let admin = r.admin_addr;
        eventually("the move completes", DEADLINE, || async {
            (weight_b(admin).await == Some(100)).then_some(())
        })
        .await;
    }

    // The source promotes b and drops a: a drains for 60 s, through another restart of both.
    write_atomic(&file, &services_yaml_with("b", &[&b], policy));
    for r in &replicas {
        let admin = r.admin_addr;
        eventually("a dropped by the source, draining", DEADLINE, || async {
            let (_, text) = http_get(&format!("http://{admin}/replica/switchover"))
                .await
                .ok()?;
            text.contains("\"departed\":[{").then_some(())
        })
        .await;
    }
    // A second for the keepers to write what changed.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for r in replicas.drain(..) {
        r.stop().await.unwrap();
    }
    for config in &configs {
        replicas.push(start(config).await);
    }
    for r in &replicas {
        let admin = r.admin_addr;
        eventually("the restarted replica is ready", DEADLINE, || async {
            weight_b(admin).await
        })
        .await;
        let clusters = snapshot_clusters(admin).await;
        assert!(
            clusters.contains(&"default/demo/a".to_string()),
            "its first snapshot keeps the draining cluster: {clusters:?}"
        );
    }
    for r in replicas {
        r.stop().await.unwrap();
    }
}

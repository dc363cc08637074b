//! Real Envoy (1.40, from `scripts/install-envoy.sh`) fed by ray-xds, carrying real
//! requests to simulated Ray Serve proxies; both bootstraps in `envoy/`.

// A test is a scenario read top to bottom: its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::time::{Duration, Instant};

use ray_serve_sim::NodeType;
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

async fn start_stack(bootstrap: Bootstrap, services_text: &str) -> Stack {
    Stack::with(services_text)
        .envoy_without_waiting(bootstrap)
        .start()
        .await
}

async fn carries_traffic_and_follows_edits(bootstrap: Bootstrap) {
    let a = SimCluster::start("demo-a", &[NodeType::Head, NodeType::Worker]).await;
    let b = SimCluster::start("demo-b", &[NodeType::Head]).await;
    let stack = start_stack(bootstrap, &services_yaml("demo-a", &[&a, &b])).await;
    let port = stack.gateway_port;

    let served = eventually(
        "a request through Envoy reaches demo-a",
        DEADLINE,
        || async { through_envoy(port).await.filter(|s| s.cluster == "demo-a") },
    )
    .await;
    assert_eq!(served.app, "hello");
    assert_eq!(served.method, "POST");
    assert_eq!(served.body_bytes, 7);

    // Every request reaches demo-a's worker proxy: by default (head_proxy: fallback) the
    // head proxy gets traffic only while no worker proxy is healthy.
    let worker = a.proxies[1].0.to_string();
    eventually(
        "the head proxy is drained in favour of the worker",
        DEADLINE,
        || async { through_envoy(port).await.filter(|s| s.proxy == worker) },
    )
    .await;
    for _ in 0..20 {
        let s = through_envoy(port).await.expect("served");
        assert_eq!(
            (s.cluster.as_str(), s.proxy.as_str(), s.node_type.as_str()),
            ("demo-a", worker.as_str(), "worker")
        );
    }

    // Envoy connected over the expected protocol and ACKed every type.
    let admin = stack.xds.admin_addr;
    let clients: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/clients").await).unwrap();
    let client = &clients["clients"][0];
    assert_eq!(client["protocol"], bootstrap.protocol());
    assert_eq!(client["node"]["id"], "ray-xds-gateway");
    for ty in ["cds", "eds", "lds", "rds"] {
        assert!(
            client["types"][ty]["acks"].as_u64().unwrap() >= 1,
            "{ty}: {client}"
        );
        assert_eq!(client["types"][ty]["nacks"], 0, "{ty}: {client}");
    }
    // ...and holds the whole snapshot, resource by resource (CSDS in proto JSON, in the
    // stream's whole view).
    assert_eq!(client["in_sync"], true, "{client}");
    let client: serde_json::Value = serde_json::from_str(
        &admin_get(
            admin,
            &format!("/debug/clients?stream={}", client["stream_id"]),
        )
        .await,
    )
    .unwrap();
    let held = client["client_config"]["generic_xds_configs"]
        .as_array()
        .unwrap();
    assert!(held.len() >= 4, "{client}");
    for r in held {
        assert_eq!(r["client_status"], "ACKED", "{r}");
        assert_eq!(r["config_status"], "SYNCED", "{r}");
    }
    let snapshot: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/snapshot").await).unwrap();
    let cluster = &snapshot["types"]["cds"]["resources"][0]["resource"];
    assert_eq!(
        cluster["type"], "EDS",
        "proto JSON, as Envoy's config_dump: {cluster}"
    );

    // An edit of services.yaml moves traffic.
    let edited = Instant::now();
    write_atomic(&stack.services, &services_yaml("demo-b", &[&a, &b]));
    eventually("traffic moves to demo-b", DEADLINE, || async {
        through_envoy(port).await.filter(|s| s.cluster == "demo-b")
    })
    .await;
    eprintln!(
        "{bootstrap:?}: edit to traffic on demo-b took {:?}",
        edited.elapsed()
    );
    // And stays there: every request now goes to demo-b.
    for _ in 0..20 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("demo-b")
        );
    }

    // A bad edit is refused and the last good state keeps serving.
    write_atomic(&stack.services, "rayservices: [ {name: broken");
    let metrics = eventually("the bad edit is counted", DEADLINE, || async {
        let m = admin_get(admin, "/metrics").await;
        (metric(&m, "ray_xds_source_rejected_total{source=\"file\"}") >= 1.0).then_some(m)
    })
    .await;
    assert!(
        metrics.contains("ray_xds_xds_streams{protocol="),
        "{metrics}"
    );
    for _ in 0..10 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("demo-b")
        );
    }
    // Envoy still holds demo-a's cluster? No: once the route moved, demo-a is unused but
    // still in the model (listed in services.yaml), so Envoy keeps it warm.
    let clusters = stack.envoy().admin("/clusters").await;
    assert!(clusters.contains("default/demo/demo-a::"), "{clusters}");
    stack.xds.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_envoy_carries_traffic_and_follows_edits() {
    carries_traffic_and_follows_edits(Bootstrap::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_envoy_carries_traffic_and_follows_edits() {
    carries_traffic_and_follows_edits(Bootstrap::Delta).await;
}

/// A listener Envoy cannot bind (its port is taken) is NACKed once and not resent.
async fn rejected_listener_is_nacked_once(bootstrap: Bootstrap) {
    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&a])).unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let xds = ray_xds::runtime::start(test_config(&services, taken_port), Default::default())
        .await
        .unwrap();
    let envoy = Envoy::start(bootstrap, xds.xds_addr.port());
    let lds = format!("{{protocol=\"{}\",type=\"lds\"}}", bootstrap.protocol());
    let nacks = format!("ray_xds_xds_nacks_total{lds}");
    let pushes = format!("ray_xds_xds_pushes_total{lds}");
    eventually("Envoy NACKs the listener", DEADLINE, || async {
        let m = admin_get(xds.admin_addr, "/metrics").await;
        (metric(&m, &nacks) >= 1.0).then_some(())
    })
    .await;
    // Other types were accepted.
    let m = admin_get(xds.admin_addr, "/metrics").await;
    let cds_acks = format!(
        "ray_xds_xds_acks_total{{protocol=\"{}\",type=\"cds\"}}",
        bootstrap.protocol()
    );
    assert!(metric(&m, &cds_acks) >= 1.0, "{m}");
    // Give a resend loop every chance to show itself, then check there was none.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let m = admin_get(xds.admin_addr, "/metrics").await;
    assert_eq!(metric(&m, &nacks), 1.0, "{m}");
    assert_eq!(metric(&m, &pushes), 1.0, "{m}");
    let clients = admin_get(xds.admin_addr, "/debug/clients").await;
    assert!(clients.contains("last_nack_message"), "{clients}");
    assert!(
        envoy.log_text().contains("cannot bind") || clients.contains("bind"),
        "{clients}"
    );
    drop(taken);
    xds.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_rejected_listener_is_nacked_once() {
    rejected_listener_is_nacked_once(Bootstrap::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_rejected_listener_is_nacked_once() {
    rejected_listener_is_nacked_once(Bootstrap::Delta).await;
}

/// ray-xds (the real binary) dies and comes back while Envoy carries traffic: no request
/// fails, and the new process sends nothing the Envoy already holds but its endpoints.
async fn restart_keeps_traffic_and_resends_only_endpoints(bootstrap: Bootstrap) {
    let a = SimCluster::start("demo-a", &[NodeType::Head, NodeType::Worker]).await;
    let b = SimCluster::start("demo-b", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&a, &b])).unwrap();
    let (xds_port, admin_port) = (free_port(), free_port());
    let config = dir.path().join("ray-xds.yaml");
    std::fs::write(
        &config,
        format!(
            "xds: {{ listen: 127.0.0.1:{xds_port} }}\nadmin: {{ listen: 127.0.0.1:{admin_port} }}\ngateway:\n  http_listener: {{ address: 127.0.0.1, port: 0 }}\nsource:\n  file: {{ path: services.yaml }}\n"
        ),
    )
    .unwrap();
    let admin: std::net::SocketAddr = format!("127.0.0.1:{admin_port}").parse().unwrap();
    let start_server = || {
        spawn(
            "ray-xds",
            std::process::Command::new(env!("CARGO_BIN_EXE_ray-xds"))
                .args(["serve", "--config"])
                .arg(&config)
                .env("RAY_XDS_LOG", "warn")
                .stdout(std::process::Stdio::null()),
        )
    };
    let mut server = start_server();
    let envoy = Envoy::start(bootstrap, xds_port);
    let gateway_port = envoy.gateway_port().await;
    eventually("traffic flows", DEADLINE, || async {
        through_envoy(gateway_port).await
    })
    .await;

    // Steady load while the control plane goes away and comes back.
    let stop = tokio_util::sync::CancellationToken::new();
    let load = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, 0u32);
            while !stop.is_cancelled() {
                match through_envoy(gateway_port).await {
                    Some(s) if s.cluster == "demo-a" => ok += 1,
                    _ => failed += 1,
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (ok, failed)
        })
    };
    server.signal(libc::SIGKILL);
    let _ = server.child.wait();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _server = start_server();
    let clients = eventually(
        "Envoy reconnects and resubscribes to every type",
        DEADLINE,
        || async {
            let text = admin_get(admin, "/debug/clients").await;
            let v: serde_json::Value = serde_json::from_str(&text).ok()?;
            let types = v["clients"][0]["types"].as_object()?;
            (types.len() == 4).then_some(v)
        },
    )
    .await;
    assert_eq!(clients["clients"][0]["protocol"], bootstrap.protocol());
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    let (ok, failed) = load.await.unwrap();
    assert!(ok > 10, "the load ran: {ok}");
    assert_eq!(
        failed, 0,
        "requests failed while ray-xds restarted ({ok} succeeded)"
    );
    // Only the endpoints go again, once (and for state of the world the clusters): a
    // cluster the Envoy was warming when the stream broke waits for a
    // ClusterLoadAssignment sent after it.
    let metrics = admin_get(admin, "/metrics").await;
    // (Series come out in no set order.)
    let mut pushes: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("ray_xds_xds_pushes_total{") && !l.ends_with(" 0"))
        .collect();
    pushes.sort();
    let pushed = |ty: &str| {
        format!(
            "ray_xds_xds_pushes_total{{protocol=\"{}\",type=\"{ty}\"}} 1",
            bootstrap.protocol()
        )
    };
    let expected = match bootstrap {
        // State of the world re-sends the clusters too: after a NACK, Envoy reports its
        // last accepted version though it applied what it could of the rejected one.
        Bootstrap::Sotw | Bootstrap::SotwTls => vec![pushed("cds"), pushed("eds")],
        Bootstrap::Delta => vec![pushed("eds")],
    };
    assert_eq!(
        pushes, expected,
        "the restarted server re-sent more than it must\n{clients}"
    );

    // The restarted server still follows changes.
    write_atomic(&services, &services_yaml("demo-b", &[&a, &b]));
    eventually(
        "traffic moves to demo-b after the restart",
        DEADLINE,
        || async {
            through_envoy(gateway_port)
                .await
                .filter(|s| s.cluster == "demo-b")
        },
    )
    .await;
    drop(envoy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_restart_keeps_traffic_and_resends_only_endpoints() {
    restart_keeps_traffic_and_resends_only_endpoints(Bootstrap::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_restart_keeps_traffic_and_resends_only_endpoints() {
    restart_keeps_traffic_and_resends_only_endpoints(Bootstrap::Delta).await;
}

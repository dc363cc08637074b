//! The xDS protocol against a real Envoy 1.40, in both protocols: the sequences that once
//! left Envoy with no endpoints, a frozen route or a removed cluster while ray-xds said
//! all was well (issue 12), each a row of the conformance table in `tests/README.md`.
//!
//! Where the old failure was a wait for Envoy's 15 s initial fetch timeout, a test checks
//! Envoy's own `init_fetch_timeout` counters (they stay 0 when nothing waited for it)
//! rather than a duration.

use std::time::Duration;

use ray_serve_sim::NodeType;
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

/// One RayService in `services.yaml`: its name (host `<name>.example`), active cluster,
/// clusters, and extra lines.
#[derive(Clone)]
struct Svc<'a> {
    name: &'a str,
    active: &'a str,
    pending: Option<&'a str>,
    clusters: Vec<&'a SimCluster>,
    extra: &'a str,
}

fn services(list: &[Svc<'_>]) -> String {
    let mut s = "rayservices:\n".to_string();
    for svc in list {
        s += &format!(
            "  - name: {}\n    namespace: default\n    hosts: [\"{}.example\"]\n    active_cluster: {}\n",
            svc.name, svc.name, svc.active
        );
        if let Some(p) = svc.pending {
            s += &format!("    pending_cluster: {p}\n");
        }
        s += svc.extra;
        s += "    clusters:\n";
        for c in &svc.clusters {
            s += &c.yaml();
        }
    }
    s
}

fn svc<'a>(name: &'a str, active: &'a str, clusters: &[&'a SimCluster]) -> Svc<'a> {
    Svc {
        name,
        active,
        pending: None,
        clusters: clusters.to_vec(),
        extra: "    switchover: { drain_grace: 0s }\n",
    }
}

/// The cluster (of the simulator) that served a request for `host`.
async fn served_by(port: u16, host: &str) -> Option<String> {
    through_envoy_to(port, &format!("{host}.example"))
        .await
        .map(|s| s.cluster)
}

async fn eventually_served_by(port: u16, host: &str, cluster: &str) {
    eventually(
        &format!("{host}.example is served by {cluster}"),
        DEADLINE,
        || async { (served_by(port, host).await.as_deref() == Some(cluster)).then_some(()) },
    )
    .await;
}

/// The names of the dynamic clusters Envoy has in service, and of those warming.
async fn envoy_clusters(envoy: &Envoy) -> (Vec<String>, Vec<String>) {
    let dump = envoy.config_dump().await;
    let names = |key: &str| -> Vec<String> {
        dump["configs"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|c| c[key].as_array().cloned().unwrap_or_default())
            .filter_map(|c| c["cluster"]["name"].as_str().map(String::from))
            .collect()
    };
    (
        names("dynamic_active_clusters"),
        names("dynamic_warming_clusters"),
    )
}

/// Envoy's non-zero `init_fetch_timeout` counters: each time it gave up waiting for a
/// resource it subscribed to.
async fn init_fetch_timeouts(envoy: &Envoy) -> Vec<String> {
    envoy
        .admin("/stats")
        .await
        .lines()
        .filter(|l| l.contains("init_fetch_timeout: ") && !l.ends_with(": 0"))
        .map(String::from)
        .collect()
}

// 1. A bad edit of the services file withdraws nothing.

async fn a_bad_edit_withdraws_nothing(bootstrap: Bootstrap) {
    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let good = services(&[svc("demo", "demo-a", &[&a])]);
    let s = Stack::with(good.clone()).envoy(bootstrap).start().await;
    let port = s.gateway_port;
    for (what, text) in [
        ("an empty file (`: > services.yaml`)", ""),
        ("a file without rayservices:", "# nothing here yet\n"),
        (
            "half a file (a write caught mid-way)",
            &good[..good.len() / 2],
        ),
    ] {
        // Not atomic: the way a shell redirection writes.
        std::fs::write(&s.services, text).unwrap();
        let state = eventually(&format!("ray-xds refuses {what}"), DEADLINE, || async {
            let st = s.state().await;
            let problems = st["source"]["problems"].as_array()?.clone();
            (!problems.is_empty()).then_some(st)
        })
        .await;
        assert!(
            state["source"]["problems"][0]
                .as_str()
                .unwrap()
                .contains("previous state is served"),
            "{state}"
        );
        assert_eq!(
            served_by(port, "demo").await.as_deref(),
            Some("demo-a"),
            "{what} withdrew the RayService"
        );
        let (active, _) = envoy_clusters(s.envoy()).await;
        assert!(
            active.contains(&"default/demo/demo-a".to_string()),
            "{active:?}"
        );
        std::fs::write(&s.services, &good).unwrap();
        eventually("the good file is taken again", DEADLINE, || async {
            let st = s.state().await;
            st["source"]["problems"]
                .as_array()?
                .is_empty()
                .then_some(())
        })
        .await;
    }
    // `rayservices: []` is the way to say "none": the RayService goes.
    s.edit("rayservices: []\n");
    eventually("the RayService is withdrawn", DEADLINE, || async {
        let (active, _) = envoy_clusters(s.envoy()).await;
        active.is_empty().then_some(())
    })
    .await;
    assert_eq!(served_by(port, "demo").await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_a_bad_edit_of_the_services_file_withdraws_nothing() {
    a_bad_edit_withdraws_nothing(Bootstrap::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_a_bad_edit_of_the_services_file_withdraws_nothing() {
    a_bad_edit_withdraws_nothing(Bootstrap::Delta).await;
}

// 2. Endpoints come back after Envoy unsubscribed from all of them.

async fn endpoints_come_back_after_unsubscribing_from_all(bootstrap: Bootstrap) {
    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let b = SimCluster::start("demo-b", &[NodeType::Head]).await;
    let only_a = services(&[svc("demo", "demo-a", &[&a])]);
    let s = Stack::with(only_a.clone()).envoy(bootstrap).start().await;
    let port = s.gateway_port;
    // Every cluster goes: Envoy's last EDS cluster leaves, so it unsubscribes from all.
    s.edit("rayservices: []\n");
    eventually("Envoy drops every cluster", DEADLINE, || async {
        envoy_clusters(s.envoy()).await.0.is_empty().then_some(())
    })
    .await;
    // A second RayService comes, then the first one again, alone.
    s.edit(&services(&[
        svc("demo", "demo-a", &[&a]),
        svc("other", "demo-b", &[&b]),
    ]));
    eventually_served_by(port, "other", "demo-b").await;
    s.edit(&only_a);
    eventually_served_by(port, "demo", "demo-a").await;
    assert_eq!(
        init_fetch_timeouts(s.envoy()).await,
        Vec::<String>::new(),
        "Envoy waited for a resource it subscribed to"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_endpoints_come_back_after_envoy_unsubscribed_from_all() {
    endpoints_come_back_after_unsubscribing_from_all(Bootstrap::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_endpoints_come_back_after_envoy_unsubscribed_from_all() {
    endpoints_come_back_after_unsubscribing_from_all(Bootstrap::Delta).await;
}

// 3. A cluster whose settings change warms at once.

async fn a_changed_cluster_warms_at_once(bootstrap: Bootstrap) {
    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let s = Stack::with(services(&[svc("demo", "demo-a", &[&a])]))
        .envoy(bootstrap)
        .start()
        .await;
    let mut changed = svc("demo", "demo-a", &[&a]);
    changed.extra = "    switchover: { drain_grace: 0s }\n    traffic: { max_requests: 7 }\n";
    s.edit(&services(&[changed]));
    eventually(
        "Envoy serves with the changed cluster, none warming",
        DEADLINE,
        || async {
            let dump = s.envoy().config_dump().await.to_string();
            let (_, warming) = envoy_clusters(s.envoy()).await;
            (dump.contains("\"max_requests\":7") && warming.is_empty()).then_some(())
        },
    )
    .await;
    assert_eq!(
        served_by(s.gateway_port, "demo").await.as_deref(),
        Some("demo-a")
    );
    if std::env::var("TEST_ENVOY_LOG_LEVEL").is_ok() {
        std::fs::copy(&s.envoy().log, "/tmp/envoy-debug.log").unwrap();
    }
    assert_eq!(init_fetch_timeouts(s.envoy()).await, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_a_cluster_whose_settings_change_warms_at_once() {
    a_changed_cluster_warms_at_once(Bootstrap::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_a_cluster_whose_settings_change_warms_at_once() {
    a_changed_cluster_warms_at_once(Bootstrap::Delta).await;
}

// 4. A restart with a changed source keeps make-before-break.

async fn a_restart_never_removes_a_cluster_a_route_names(bootstrap: Bootstrap) {
    let a = SimCluster::start("demo-a", &[NodeType::Head, NodeType::Worker]).await;
    let b = SimCluster::start("demo-b", &[NodeType::Head, NodeType::Worker]).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("services.yaml");
    std::fs::write(&path, services(&[svc("demo", "demo-a", &[&a])])).unwrap();
    let (xds_port, admin_port) = (free_port(), free_port());
    let config = dir.path().join("ray-xds.yaml");
    std::fs::write(
        &config,
        format!(
            "xds: {{ listen: 127.0.0.1:{xds_port} }}\nadmin: {{ listen: 127.0.0.1:{admin_port} }}\ngateway:\n  http_listener: {{ address: 127.0.0.1, port: 0 }}\nsource:\n  file: {{ path: services.yaml }}\n"
        ),
    )
    .unwrap();
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
    let port = envoy.gateway_port().await;
    eventually_served_by(port, "demo", "demo-a").await;

    // While ray-xds is down, the RayService moves to demo-b and demo-a leaves the source.
    server.signal(libc::SIGKILL);
    let _ = server.child.wait();
    write_atomic(&path, &services(&[svc("demo", "demo-b", &[&b])]));

    // Requests back to back, from several connections, across the restart.
    let stop = tokio_util::sync::CancellationToken::new();
    let served = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut load = Vec::new();
    for _ in 0..4 {
        let (stop, served) = (stop.clone(), served.clone());
        load.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.is_cancelled() {
                let url = format!("http://127.0.0.1:{port}/hello");
                match http_to_host("POST", &url, "demo.example", "{}").await {
                    Ok((200, _)) => {
                        ok += 1;
                        served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    other => failed.push(format!("{other:?}")),
                }
            }
            (ok, failed)
        }));
    }
    let _server = start_server();
    eventually_served_by(port, "demo", "demo-b").await;
    eventually("demo-a leaves Envoy", DEADLINE, || async {
        let (active, _) = envoy_clusters(&envoy).await;
        (!active.contains(&"default/demo/demo-a".to_string())).then_some(())
    })
    .await;
    // However fast the restart went on this machine, the load goes on past it until it
    // has sent a fair number of requests (a count, not a timing).
    eventually("the load has run", DEADLINE, || async {
        (served.load(std::sync::atomic::Ordering::Relaxed) > 100).then_some(())
    })
    .await;
    stop.cancel();
    let (mut ok, mut failed) = (0, Vec::new());
    for l in load {
        let (o, f) = l.await.unwrap();
        ok += o;
        failed.extend(f);
    }
    assert!(ok > 100, "the load ran: {ok}");
    assert!(
        failed.is_empty(),
        "{} of {} requests failed across the restart: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert_eq!(
        envoy.stat("http.ray_serve_http.no_cluster").await,
        0,
        "a route named a cluster Envoy did not have"
    );
    assert_eq!(init_fetch_timeouts(&envoy).await, Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_a_restart_with_a_changed_source_never_removes_a_cluster_a_route_names() {
    a_restart_never_removes_a_cluster_a_route_names(Bootstrap::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_a_restart_with_a_changed_source_never_removes_a_cluster_a_route_names() {
    a_restart_never_removes_a_cluster_a_route_names(Bootstrap::Delta).await;
}

// 5. One RayService's cluster that Envoy rejects holds back only that RayService.

async fn a_rejected_cluster_holds_back_only_its_own_rayservice(bootstrap: Bootstrap) {
    let a1 = SimCluster::start("a1", &[NodeType::Head]).await;
    let a2 = SimCluster::start("a2", &[NodeType::Head]).await;
    let b1 = SimCluster::start("b1", &[NodeType::Head]).await;
    let b2 = SimCluster::start("b2", &[NodeType::Head]).await;
    let quick = "    switchover: { drain_grace: 0s, warm_timeout: 1s }\n";
    let mut svc_b = svc("svc-b", "b1", &[&b1, &b2]);
    svc_b.extra = quick;
    let mut svc_a = svc("svc-a", "a1", &[&a1, &a2]);
    svc_a.extra = quick;
    let s = Stack::with(services(&[svc_a.clone(), svc_b.clone()]))
        .start()
        .await;
    // Envoy reaches ray-xds through a proxy that breaks cluster b2, so Envoy NACKs it.
    let tamper = tamper::start(s.xds.xds_addr, |name| name.ends_with("/b2")).await;
    let envoy = Envoy::start(bootstrap, tamper.addr.port());
    let port = envoy.gateway_port().await;
    eventually_served_by(port, "svc-a", "a1").await;
    eventually_served_by(port, "svc-b", "b1").await;
    // (A Host with the gateway's port matches too: `strip_any_host_port`.)
    let with_port = through_envoy_to(port, &format!("svc-a.example:{port}")).await;
    assert_eq!(with_port.map(|s| s.cluster).as_deref(), Some("a1"));
    // An upgrade of svc-b to b2 begins, with that Envoy connected.
    svc_b.pending = Some("b2");
    s.edit(&services(&[svc_a, svc_b]));
    // b2 is ready, but an Envoy rejected it: no traffic moves, however long it waits.
    let sw = eventually("the switch to b2 is held as rejected", DEADLINE, || async {
        let st = s.state().await;
        let sw = st["rayservices"]
            .as_array()?
            .iter()
            .find(|r| r["name"] == "default/svc-b")?["switchover"]
            .clone();
        (sw["phase"] == "rejected").then_some(sw)
    })
    .await;
    assert!(sw["reason"].as_str().unwrap().contains("rejected"), "{sw}");
    tokio::time::sleep(Duration::from_secs(2)).await; // past warm_timeout
    assert_eq!(served_by(port, "svc-b").await.as_deref(), Some("b1"));
    // The other RayService still changes.
    let mut svc_a = svc("svc-a", "a2", &[&a1, &a2]);
    svc_a.extra = quick;
    let mut svc_b = svc("svc-b", "b1", &[&b1, &b2]);
    svc_b.pending = Some("b2");
    svc_b.extra = quick;
    s.edit(&services(&[svc_a, svc_b]));
    eventually_served_by(port, "svc-a", "a2").await;
    assert_eq!(served_by(port, "svc-b").await.as_deref(), Some("b1"));
    // And /debug/clients does not call that Envoy in sync.
    let clients: serde_json::Value =
        serde_json::from_str(&s.admin("/debug/clients").await).unwrap();
    let c = &clients["clients"][0];
    assert_eq!(c["in_sync"], false, "{c}");
    assert_eq!(c["types"]["cds"]["rejected"], 1, "{c}");
    // The stream whole names what it rejected.
    let c: serde_json::Value = serde_json::from_str(
        &s.admin(&format!("/debug/clients?stream={}", c["stream_id"]))
            .await,
    )
    .unwrap();
    assert!(
        c["types"]["cds"]["rejected"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n == "default/svc-b/b2"),
        "{c}"
    );
    assert!(c["client_config"].to_string().contains("NACKED"), "{c}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sotw_a_cluster_envoy_rejects_holds_back_only_its_own_rayservice() {
    a_rejected_cluster_holds_back_only_its_own_rayservice(Bootstrap::Sotw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_a_cluster_envoy_rejects_holds_back_only_its_own_rayservice() {
    a_rejected_cluster_holds_back_only_its_own_rayservice(Bootstrap::Delta).await;
}

// 6. Delta: a subscribed name that does not exist is answered at once.

/// A static cluster whose endpoints come over ADS under a name ray-xds does not have.
const CLUSTER_WITH_MISSING_ENDPOINTS: &str = r#"    - name: missing-endpoints
      type: EDS
      connect_timeout: 1s
      eds_cluster_config:
        service_name: no-such-endpoints
        eds_config: { ads: {}, resource_api_version: V3 }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_a_subscribed_name_that_does_not_exist_is_answered_at_once() {
    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let s = Stack::with(services(&[svc("demo", "demo-a", &[&a])]))
        .start()
        .await;
    // Envoy waits for every static cluster to initialize before it serves at all.
    let envoy = Envoy::start_with(Bootstrap::Delta, s.xds.xds_addr.port(), |b| {
        b.replace(
            "static_resources:\n  clusters:\n",
            &format!("static_resources:\n  clusters:\n{CLUSTER_WITH_MISSING_ENDPOINTS}"),
        )
    });
    let port = envoy.gateway_port().await;
    eventually_served_by(port, "demo", "demo-a").await;
    assert!(
        envoy.stat("cluster.missing-endpoints.update_empty").await >= 1,
        "Envoy was told the name does not exist"
    );
    assert_eq!(
        init_fetch_timeouts(&envoy).await,
        Vec::<String>::new(),
        "Envoy waited for its initial fetch timeout instead of being told the name is absent"
    );
    let clients: serde_json::Value =
        serde_json::from_str(&s.admin("/debug/clients").await).unwrap();
    let stream = &clients["clients"][0]["stream_id"];
    let client = s.admin(&format!("/debug/clients?stream={stream}")).await;
    assert!(client.contains("no-such-endpoints"), "{client}");
}

//! Readiness-gated switchover with a real Envoy: traffic moves to a new RayCluster only
//! once its own dashboard says every application is RUNNING, and not because the source
//! named it active early.

use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use prost::Message;
use ray_serve_sim::dashboard::SimDashboard;
use ray_serve_sim::NodeType;
use ray_xds::xds::snapshot::{CLUSTER_TYPE_URL, ENDPOINTS_TYPE_URL};
use support::ads;
use support::*;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(30);

async fn dashboard(app_status: &str, shutdown: &CancellationToken) -> (SimDashboard, String) {
    let d = SimDashboard::new();
    d.set_app("hello", "/", app_status);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(d.clone().serve(listener, shutdown.clone()));
    (d, url)
}

fn yaml(
    active: &str,
    pending: Option<&str>,
    clusters: &[(&SimCluster, &str)],
    extra: &str,
) -> String {
    let mut s = format!("rayservices:\n  - name: demo\n    hosts: ['*']\n    active_cluster: {active}\n    head_proxy: include\n{extra}");
    if let Some(p) = pending {
        s += &format!("    pending_cluster: {p}\n");
    }
    s += "    clusters:\n";
    for (c, url) in clusters {
        s += &c.yaml().replacen(
            "\n        proxies:",
            &format!("\n        dashboard: {url}\n        proxies:"),
            1,
        );
    }
    s
}

/// Sends requests until `until` holds for a served response; counts failures on the way.
async fn drive(port: u16, until: impl Fn(&str) -> bool) -> usize {
    let started = std::time::Instant::now();
    let mut failed = 0;
    loop {
        match through_envoy(port).await {
            Some(s) if until(&s.cluster) => return failed,
            Some(_) => {}
            None => failed += 1,
        }
        assert!(started.elapsed() < DEADLINE, "timed out; {failed} failed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until 20 requests in a row through Envoy are all served by `cluster`.
async fn all_traffic_on(port: u16, cluster: &str) {
    eventually(&format!("all traffic on {cluster}"), DEADLINE, || async {
        let mut all = true;
        for _ in 0..20 {
            all &= through_envoy(port).await.map(|s| s.cluster).as_deref() == Some(cluster);
        }
        all.then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_moves_only_once_the_new_cluster_runs() {
    let shutdown = CancellationToken::new();
    let a = SimCluster::start("a", &[NodeType::Head, NodeType::Worker]).await;
    let b = SimCluster::start("b", &[NodeType::Head, NodeType::Worker]).await;
    let (_da, url_a) = dashboard("RUNNING", &shutdown).await;
    let (db, url_b) = dashboard("DEPLOYING", &shutdown).await;
    let s = Stack::with(yaml("a", Some("b"), &[(&a, &url_a), (&b, &url_b)], ""))
        .envoy(Bootstrap::Delta)
        .start()
        .await;
    let (xds, port) = (&s.xds, s.gateway_port);
    for _ in 0..30 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("a"),
            "b is still DEPLOYING"
        );
    }
    // Waiting: first for b's dashboard to answer since the switch began, then for its
    // application to run.
    let sw = eventually(
        "the switchover waits for b's DEPLOYING application",
        DEADLINE,
        || async {
            let state: serde_json::Value =
                serde_json::from_str(&admin_get(xds.admin_addr, "/debug/state").await).ok()?;
            let sw = state["rayservices"][0]["switchover"].clone();
            sw["reason"].as_str()?.contains("DEPLOYING").then_some(sw)
        },
    )
    .await;
    assert_eq!(sw["phase"], "waiting", "{sw}");
    for _ in 0..10 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("a")
        );
    }

    db.set_app("hello", "/", "RUNNING");
    let failed = drive(port, |c| c == "b").await;
    assert_eq!(failed, 0);
    for _ in 0..20 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("b")
        );
    }
    let m = admin_get(xds.admin_addr, "/metrics").await;
    assert_eq!(
        metric(
            &m,
            "ray_xds_switchover_weight{rayservice=\"default/demo\",cluster=\"b\"}"
        ),
        100.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "ray_xds_switchover_weight{rayservice=\"default/demo\",cluster=\"a\"}"
        ),
        0.0,
        "{m}"
    );
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_flip_keeps_serving_from_the_ready_cluster() {
    let shutdown = CancellationToken::new();
    let a = SimCluster::start("a", &[NodeType::Head]).await;
    let b = SimCluster::start("b", &[NodeType::Head]).await;
    let (_da, url_a) = dashboard("RUNNING", &shutdown).await;
    let (db, url_b) = dashboard("DEPLOYING", &shutdown).await;
    let progressive = "    switchover: { mode: progressive, steps: [50, 100], interval: 1s }\n";
    let s = Stack::with(yaml("a", None, &[(&a, &url_a), (&b, &url_b)], progressive))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    let (xds, port) = (&s.xds, s.gateway_port);
    // The source names b active while its applications still deploy.
    s.edit(&yaml("b", None, &[(&a, &url_a), (&b, &url_b)], progressive));
    eventually("ray-xds sees the flip", DEADLINE, || async {
        let state: serde_json::Value =
            serde_json::from_str(&admin_get(xds.admin_addr, "/debug/state").await).ok()?;
        (state["rayservices"][0]["switchover"]["target"] == "b").then_some(())
    })
    .await;
    for _ in 0..30 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("a"),
            "traffic follows readiness"
        );
    }
    db.set_app("hello", "/", "RUNNING");
    // Progressive: first half and half, then all on b.
    let failed = drive(port, |c| c == "b").await;
    assert_eq!(failed, 0);
    all_traffic_on(port, "b").await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_the_source_drops_drains_then_goes() {
    let shutdown = CancellationToken::new();
    let a = SimCluster::start("a", &[NodeType::Head]).await;
    let b = SimCluster::start("b", &[NodeType::Head]).await;
    let (_da, url_a) = dashboard("RUNNING", &shutdown).await;
    let (_db, url_b) = dashboard("RUNNING", &shutdown).await;
    let grace = "    switchover: { drain_grace: 3s }\n";
    let s = Stack::with(yaml("a", Some("b"), &[(&a, &url_a), (&b, &url_b)], grace))
        .envoy_without_waiting(Bootstrap::Sotw)
        .start()
        .await;
    let port = s.gateway_port;
    drive(port, |c| c == "b").await;
    // The source promotes b and drops a.
    s.edit(&yaml("b", None, &[(&b, &url_b)], grace));
    // It drains: Envoy keeps cluster a (for requests in flight) with no endpoint for new
    // ones, until the grace period ends.
    let a_proxy = format!("default/demo/a::{}::", a.proxies[0].0);
    eventually(
        "a's endpoint leaves Envoy, its cluster stays",
        DEADLINE,
        || async {
            let text = s.envoy().admin("/clusters").await;
            (text.contains("default/demo/a::") && !text.contains(&a_proxy)).then_some(())
        },
    )
    .await;
    for _ in 0..10 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("b")
        );
    }
    eventually(
        "a leaves Envoy after its grace period",
        DEADLINE,
        || async {
            let text = s.envoy().admin("/clusters").await;
            (!text.contains("default/demo/a::")).then_some(())
        },
    )
    .await;
    shutdown.cancel();
}

/// The ACK of SotW response `r`, subscribing to `names`.
fn ack(r: &DiscoveryResponse, names: Vec<String>) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: r.version_info.clone(),
        response_nonce: r.nonce.clone(),
        type_url: r.type_url.clone(),
        resource_names: names,
        ..Default::default()
    }
}

async fn switch_state(admin: std::net::SocketAddr) -> Option<serde_json::Value> {
    let state: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/state").await).ok()?;
    Some(state["rayservices"][0]["switchover"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_waits_until_every_connected_envoy_warmed_the_new_cluster() {
    let shutdown = CancellationToken::new();
    let a = SimCluster::start("a", &[NodeType::Head]).await;
    let b = SimCluster::start("b", &[NodeType::Head]).await;
    let (_da, url_a) = dashboard("RUNNING", &shutdown).await;
    let (db, url_b) = dashboard("DEPLOYING", &shutdown).await;
    // Long enough that only the laggard's ACK can release the switch in this test.
    let slow = "    switchover: { warm_timeout: 5m }\n";
    let s = Stack::with(yaml("a", Some("b"), &[(&a, &url_a), (&b, &url_b)], slow))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    let (xds, port) = (&s.xds, s.gateway_port);
    // A second Envoy takes the clusters and has not ACKed them yet.
    let (laggard, mut responses) = ads::sotw_stream(xds.xds_addr).await;
    laggard
        .send(DiscoveryRequest {
            node: ads::node("laggard"),
            type_url: CLUSTER_TYPE_URL.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let clusters = ads::next(&mut responses).await;
    let names: Vec<String> = clusters
        .resources
        .iter()
        .map(|any| Cluster::decode(any.value.as_slice()).unwrap().name)
        .collect();
    assert!(names.contains(&"default/demo/b".to_string()), "{names:?}");

    db.set_app("hello", "/", "RUNNING");
    let sw = eventually("the switch waits for the laggard", DEADLINE, || async {
        let sw = switch_state(xds.admin_addr).await?;
        (sw["phase"] == "warming").then_some(sw)
    })
    .await;
    let reason = sw["reason"].as_str().unwrap();
    assert!(reason.contains("laggard"), "{reason}");
    assert!(
        !reason.contains("ray-xds-gateway"),
        "the real Envoy is warm: {reason}"
    );
    for _ in 0..20 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("a"),
            "no traffic moves while an Envoy is cold"
        );
    }

    // The laggard ACKs the clusters, then asks for and ACKs their endpoints.
    laggard.send(ack(&clusters, vec![])).await.unwrap();
    laggard
        .send(DiscoveryRequest {
            type_url: ENDPOINTS_TYPE_URL.into(),
            resource_names: names.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let endpoints = loop {
        let r = ads::next(&mut responses).await;
        if r.type_url == ENDPOINTS_TYPE_URL {
            break r;
        }
    };
    assert_eq!(
        switch_state(xds.admin_addr).await.unwrap()["phase"],
        "warming",
        "clusters alone are not warm"
    );
    laggard.send(ack(&endpoints, names)).await.unwrap();
    let failed = drive(port, |c| c == "b").await;
    assert_eq!(failed, 0);
    let sw = switch_state(xds.admin_addr).await.unwrap();
    assert_eq!(sw["phase"], "stable", "{sw}");
    shutdown.cancel();
}

/// A new cluster RUNNING at a quarter of the serving cluster's replicas takes a share of
/// the traffic in proportion to what it can run at once (4 × 2 against 1 × 2: a fifth),
/// not all of it, and all of it once it is scaled to full size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_to_a_smaller_cluster_moves_traffic_in_proportion_to_ready_capacity() {
    use ray_serve_sim::dashboard::AppSize;
    let shutdown = CancellationToken::new();
    let a = SimCluster::start("a", &[NodeType::Head]).await;
    let b = SimCluster::start("b", &[NodeType::Head]).await;
    let (da, url_a) = dashboard("RUNNING", &shutdown).await;
    let (db, url_b) = dashboard("RUNNING", &shutdown).await;
    let full = AppSize {
        num_replicas: 4,
        running: 4,
        max_ongoing_requests: 2,
    };
    da.set_app_size("hello", full);
    db.set_app_size("hello", AppSize { running: 1, ..full });
    let s = Stack::with(yaml("a", Some("b"), &[(&a, &url_a), (&b, &url_b)], ""))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    let (xds, port) = (&s.xds, s.gateway_port);
    let sw = eventually("b takes a fifth", DEADLINE, || async {
        let sw = switch_state(xds.admin_addr).await?;
        let b_weight = sw["weights"].as_array()?.iter().find(|w| w[0] == "b")?[1].as_u64();
        (b_weight == Some(20)).then_some(sw)
    })
    .await;
    assert_eq!(sw["phase"], "shifting", "{sw}");
    assert!(
        sw["reason"].as_str().unwrap().contains("ready capacity"),
        "{sw}"
    );
    // Envoy splits the requests (a route's update may still be on its way: wait for b).
    drive(port, |c| c == "b").await;
    let mut on = std::collections::BTreeMap::<String, u32>::new();
    for _ in 0..200 {
        let served = through_envoy(port)
            .await
            .expect("every request is answered");
        *on.entry(served.cluster).or_default() += 1;
    }
    let (on_a, on_b) = (
        on.get("a").copied().unwrap_or(0),
        on.get("b").copied().unwrap_or(0),
    );
    // 20% of 200 is 40; 10 and 80 are over 4 standard deviations away.
    assert!((10..=80).contains(&on_b) && on_a + on_b == 200, "{on:?}");

    // b is scaled to full size: it takes everything, and the switch ends.
    db.set_app_size("hello", full);
    all_traffic_on(port, "b").await;
    let sw = switch_state(xds.admin_addr).await.unwrap();
    assert_eq!(sw["phase"], "stable", "{sw}");
    shutdown.cancel();
}

/// Outcomes from the Envoys: a new cluster that answers a fifth of its requests 500 (a
/// bad version) takes its first step's share, Envoy's load reports show it failing, and
/// it goes back to no traffic while the old cluster keeps serving; a new version of it
/// (a redeploy that answers well) clears the decision and the shift starts over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_cluster_whose_requests_fail_is_rolled_back_from_envoy_s_load_reports() {
    rolled_back_from_load_reports(Upgrade::Pending).await;
}

/// The same when the source names the new cluster active at once (an early flip, as
/// KubeRay up to 1.0 did, or an operator's edit) while it still lists the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_flip_whose_requests_fail_is_rolled_back_from_envoy_s_load_reports() {
    rolled_back_from_load_reports(Upgrade::EarlyFlip).await;
}

/// How the source names the new cluster `b`.
enum Upgrade {
    Pending,
    EarlyFlip,
}

async fn rolled_back_from_load_reports(upgrade: Upgrade) {
    use ray_serve_sim::ProxyMode;
    let shutdown = CancellationToken::new();
    let a = SimCluster::start("a", &[NodeType::Head]).await;
    let b = SimCluster::start("b", &[NodeType::Head]).await;
    b.set_mode(0, ProxyMode::Failing(20));
    let (_da, url_a) = dashboard("RUNNING", &shutdown).await;
    let (db, url_b) = dashboard("RUNNING", &shutdown).await;
    let policy =
        "    switchover: { steps: [25, 50, 100], interval: 60s, outcome_min_requests: 20 }\n";
    let s = Stack::with(yaml("a", None, &[(&a, &url_a)], policy))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    let (xds, port) = (&s.xds, s.gateway_port);
    // b is named pending once the Envoy runs (its load reports began without it).
    for _ in 0..50 {
        through_envoy(port).await;
    }
    let both = [(&a, url_a.as_str()), (&b, url_b.as_str())];
    s.edit(&match upgrade {
        Upgrade::Pending => yaml("a", Some("b"), &both, policy),
        Upgrade::EarlyFlip => yaml("b", None, &both, policy),
    });
    let failed = std::sync::atomic::AtomicUsize::new(0);
    let sw = eventually("b is rolled back", Duration::from_secs(60), || async {
        for _ in 0..20 {
            if through_envoy(port).await.is_none() {
                failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let sw = switch_state(xds.admin_addr).await?;
        (sw["phase"] == "rolled_back").then_some(sw)
    })
    .await;
    let failed = failed.into_inner();
    assert!(failed > 0, "b answered some requests 500 before: {sw}");
    assert_eq!(sw["weights"], serde_json::json!([["a", 100]]), "{sw}");
    assert_eq!(sw["rollback"]["cluster"], "b", "{sw}");
    let why = sw["rollback"]["why"].as_str().unwrap();
    assert!(why.contains("requests failed"), "{why}");
    // Every request is answered by a now (a route update may still be on its way).
    all_traffic_on(port, "a").await;
    for _ in 0..50 {
        assert_eq!(
            through_envoy(port).await.map(|s| s.cluster).as_deref(),
            Some("a")
        );
    }
    let m = admin_get(xds.admin_addr, "/metrics").await;
    assert!(
        metric(&m, "ray_xds_load_report_clusters_total{result=\"tracked\"}") > 0.0,
        "{m}"
    );
    assert_eq!(metric(&m, "ray_xds_load_streams"), 1.0, "{m}");
    assert!(
        metric(
            &m,
            "ray_xds_switchover_transitions_total{state=\"rolled_back\"}"
        ) >= 1.0,
        "{m}"
    );

    // A new version of b that answers well: the shift starts over.
    b.set_mode(0, ProxyMode::Serving);
    db.set_app("hello", "/", "RUNNING");
    drive(port, |c| c == "b").await;
    let sw = switch_state(xds.admin_addr).await.unwrap();
    assert_eq!(sw["phase"], "shifting", "{sw}");
    assert!(sw.get("rollback").is_none(), "{sw}");
    shutdown.cancel();
}

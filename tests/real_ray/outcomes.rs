//! Outcomes on real Ray 2.60: a new version whose application fails a fifth of its
//! requests (`apps:flaky`, Ray answering 500) takes its first step's share, the Envoys'
//! load reports show it failing, and it goes back to no traffic while the old cluster
//! keeps serving.

use std::time::Duration;

use support::real_ray::{App, RealRayCluster};
use support::*;

use crate::serve::{cluster_yaml, gateway, services_yaml};

const DEADLINE: Duration = Duration::from_secs(90);

const fn app(import_path: &'static str) -> App {
    App {
        name: "hello",
        route_prefix: "/",
        import_path,
        extra: "",
    }
}

/// One POST through Envoy: its status, and the cluster that answered a 200.
async fn ask(port: u16) -> (u16, Option<String>) {
    match http("POST", &format!("http://127.0.0.1:{port}/"), "{}").await {
        Ok((200, body)) => {
            let cluster = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["cluster"].as_str().map(str::to_string));
            (200, cluster)
        }
        Ok((status, _)) => (status, None),
        Err(_) => (0, None),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ray_outcomes_a_new_version_failing_a_fifth_of_its_requests_is_rolled_back() {
    let (a, b) = tokio::join!(RealRayCluster::start("a", 0), RealRayCluster::start("b", 0));
    a.deploy(&[app("apps:hello")]);
    b.deploy(&[app("apps:flaky")]);
    a.wait_for_app("hello", "RUNNING").await;
    b.wait_for_app("hello", "RUNNING").await;
    let clusters = [
        cluster_yaml(&a, &[(a.head_proxy(), "head")]),
        cluster_yaml(&b, &[(b.head_proxy(), "head")]),
    ];
    // A first step of a quarter that lasts: the reports decide, not the schedule.
    let policy =
        "    switchover: { steps: [25, 50, 100], interval: 300s, outcome_min_requests: 20 }\n";
    let gw = gateway(&services_yaml("a", Some("b"), policy, &clusters)).await;
    let admin = gw.xds.admin_addr;
    let mut sent = 0;
    let mut failed = Vec::new();
    let started = std::time::Instant::now();
    let state = loop {
        for _ in 0..10 {
            let (status, _) = ask(gw.port).await;
            sent += 1;
            if status != 200 {
                failed.push(status);
            }
        }
        let state: serde_json::Value =
            serde_json::from_str(&admin_get(admin, "/debug/state").await).unwrap_or_default();
        let sw = state["rayservices"][0]["switchover"].clone();
        if sw["phase"] == "rolled_back" {
            break sw;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "b was not rolled back: {sw}; {} of {sent} failed",
            failed.len()
        );
    };
    eprintln!(
        "outcome figures: rolled back after {} ms, {sent} requests sent, {} failed ({:?}): {}",
        started.elapsed().as_millis(),
        failed.len(),
        failed,
        state["rollback"]["why"]
    );
    // The premise: b's application failed requests, and Ray answered them 500.
    assert!(failed.contains(&500), "{failed:?}");
    assert_eq!(state["weights"], serde_json::json!([["a", 100]]), "{state}");
    // From here on a serves everything (an Envoy may take a moment to get the route).
    eventually("every request on a", DEADLINE, || async {
        for _ in 0..20 {
            if ask(gw.port).await != (200, Some("a".to_string())) {
                return None;
            }
        }
        Some(())
    })
    .await;
    for _ in 0..50 {
        assert_eq!(ask(gw.port).await, (200, Some("a".to_string())));
    }
}

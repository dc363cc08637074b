//! `ray-serve-sim` as demos and benchmarks use it: proxies, dashboard and the control
//! endpoint that injects faults at run time; what it lists is what ray-xds discovers.

// A test is a scenario read top to bottom: its steps stay in one function.
#![allow(clippy::too_many_lines)]

mod common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use ray_xds::live::dashboard::DashboardClient;
use ray_xds::model::NodeType;

#[tokio::test]
async fn the_control_endpoint_injects_faults() {
    let (p1, p2, dash, ctl) = (free_port(), free_port(), free_port(), free_port());
    let _sim = spawn(
        Command::new(env!("CARGO_BIN_EXE_ray-serve-sim"))
            .args(["--cluster", "c1", "--app", "/hello=hello"])
            .args([
                "--proxy",
                &format!("127.0.0.1:{p1}=head"),
                "--proxy",
                &format!("127.0.0.1:{p2}=worker"),
            ])
            .args([
                "--dashboard",
                &format!("127.0.0.1:{dash}"),
                "--control",
                &format!("127.0.0.1:{ctl}"),
            ])
            .stdout(Stdio::null()),
    );
    let healthz =
        |port: u16| async move { http_get(&format!("http://127.0.0.1:{port}/-/healthz")).await };
    let control = |method: &'static str, path: String, body: &'static str| async move {
        http(method, &format!("http://127.0.0.1:{ctl}{path}"), body)
            .await
            .unwrap()
    };
    eventually("the sim is up", Duration::from_secs(20), || async {
        healthz(p2).await.ok().filter(|(s, _)| *s == 200)
    })
    .await;
    eventually("control is up", Duration::from_secs(20), || async {
        http_get(&format!("http://127.0.0.1:{ctl}/nope")).await.ok()
    })
    .await;

    assert_eq!(
        control("PUT", format!("/proxies/{p2}/mode"), "draining")
            .await
            .0,
        200
    );
    assert_eq!(
        healthz(p2).await.unwrap(),
        (503, "This node is being drained.".to_string())
    );
    assert_eq!(
        control("PUT", format!("/proxies/{p2}/mode"), "bogus")
            .await
            .0,
        400
    );
    assert_eq!(
        control("PUT", format!("/proxies/{p2}/mode"), "serving")
            .await
            .0,
        200
    );
    assert_eq!(healthz(p2).await.unwrap().0, 200);

    assert_eq!(
        control("POST", format!("/proxies/{p1}/kill"), "").await.0,
        200
    );
    eventually(
        "the killed proxy refuses",
        Duration::from_secs(10),
        || async { healthz(p1).await.err() },
    )
    .await;
    assert_eq!(
        control("POST", format!("/proxies/{p1}/start"), "").await.0,
        200
    );
    assert_eq!(healthz(p1).await.unwrap().0, 200);

    let dashboard = |()| async move {
        let (_, body) = http_get(&format!("http://127.0.0.1:{dash}/api/serve/applications/"))
            .await
            .unwrap();
        ray_xds::live::dashboard::parse(body.as_bytes()).unwrap()
    };
    let status = dashboard(()).await;
    assert!(status.all_running());
    assert_eq!(status.route_prefixes(), ["/hello".to_string()].into());
    assert_eq!(
        control(
            "PUT",
            "/dashboard/apps/hello?route_prefix=/hello&status=DEPLOYING".into(),
            ""
        )
        .await
        .0,
        200
    );
    assert!(!dashboard(()).await.all_running());
    assert_eq!(
        control("PUT", "/dashboard/mode".into(), "unavailable")
            .await
            .0,
        200
    );
    let (status, _) = http_get(&format!("http://127.0.0.1:{dash}/api/serve/applications/"))
        .await
        .unwrap();
    assert_eq!(status, 503);
}

/// `ray-serve-sim` lists the proxies it runs, as Ray does, with the head on the
/// controller's node.
#[tokio::test]
async fn the_simulator_binary_lists_its_proxies() {
    let (p1, p2, dash) = (free_port(), free_port(), free_port());
    let _sim = spawn(
        Command::new(env!("CARGO_BIN_EXE_ray-serve-sim"))
            .args(["--cluster", "c1", "--app", "/hello=hello"])
            .args([
                "--proxy",
                &format!("127.0.0.1:{p2}=worker"),
                "--proxy",
                &format!("127.0.0.1:{p1}=head"),
            ])
            .args(["--dashboard", &format!("127.0.0.1:{dash}")])
            .stdout(Stdio::null()),
    );
    let client = DashboardClient::new(Duration::from_secs(5));
    let url = format!("http://127.0.0.1:{dash}");
    let status = eventually(
        "the dashboard lists both proxies",
        Duration::from_secs(30),
        || async {
            client
                .fetch(&url)
                .await
                .ok()
                .filter(|s| s.http_proxies.len() == 2)
        },
    )
    .await;
    let listed: BTreeMap<u16, NodeType> = status
        .http_proxies
        .iter()
        .map(|p| (p.address.port(), p.node_type))
        .collect();
    assert_eq!(
        listed,
        BTreeMap::from([(p1, NodeType::Head), (p2, NodeType::Worker)])
    );
}

/// What ran is recorded under the request's `x-request-id`, in memory (`/executions` on
/// the control endpoint) and in the log file, which outlives a killed process; a
/// backpressured request did not run.
#[tokio::test]
async fn executions_are_recorded_by_request_id_and_logged() {
    let (p1, ctl) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("runs.log");
    let _sim = spawn(
        Command::new(env!("CARGO_BIN_EXE_ray-serve-sim"))
            .args(["--cluster", "c1", "--app", "/=hello"])
            .args(["--proxy", &format!("127.0.0.1:{p1}=worker")])
            .args(["--control", &format!("127.0.0.1:{ctl}")])
            .arg("--executions-log")
            .arg(&log)
            .stdout(Stdio::null()),
    );
    eventually("the sim is up", Duration::from_secs(20), || async {
        http_get(&format!("http://127.0.0.1:{ctl}/executions"))
            .await
            .ok()
            .filter(|(s, _)| *s == 200)
    })
    .await;
    let post = |id: &'static str| async move {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>();
        let request = hyper::Request::post(format!("http://127.0.0.1:{p1}/infer"))
            .header("x-request-id", id)
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        client.request(request).await.unwrap().status().as_u16()
    };
    assert_eq!(post("one").await, 200);
    assert_eq!(post("two").await, 200);
    assert_eq!(post("two").await, 200);
    http(
        "PUT",
        &format!("http://127.0.0.1:{ctl}/proxies/{p1}/mode"),
        "overloaded",
    )
    .await
    .unwrap();
    assert_eq!(post("three").await, 503, "backpressure: nothing ran");
    let (_, body) = http_get(&format!("http://127.0.0.1:{ctl}/executions"))
        .await
        .unwrap();
    let runs: BTreeMap<String, Vec<String>> = serde_json::from_str(&body).unwrap();
    assert_eq!(runs.keys().collect::<Vec<_>>(), ["one", "two"]);
    assert_eq!(runs["two"].len(), 2);
    let logged = std::fs::read_to_string(&log).unwrap();
    assert_eq!(logged.lines().count(), 3, "{logged}");
    assert!(
        logged
            .lines()
            .all(|l| l.ends_with(&format!("127.0.0.1:{p1}"))),
        "{logged}"
    );
}

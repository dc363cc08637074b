//! The simulated Ray Serve proxy answers like the real one: checked against the captures
//! of a real Ray 2.60 proxy in `tests/fixtures/ray-serve-2.60/`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ray_serve_sim::NodeType;
use ray_serve_sim::{serve_proxy, ProxyConfig};

struct Capture {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

fn capture(name: &str) -> Capture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/ray-serve-2.60")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    let (head, body) = text
        .split_once("\n\n")
        .or_else(|| text.split_once("\r\n\r\n"))
        .unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Capture {
        status,
        headers,
        body: body.trim_end_matches('\n').to_string(),
    }
}

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, BTreeMap<String, String>, String) {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header("host", "x")
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap().to_string()))
        .collect();
    let body = String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    (status, headers, body)
}

async fn sim_with_hello() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ProxyConfig {
        cluster: "c".into(),
        node_type: NodeType::Head,
        // The captured proxy served one application, `hello`, at `/hello`.
        routes: BTreeMap::from([("/hello".to_string(), "hello".to_string())]),
    };
    tokio::spawn(serve_proxy(listener, config, Default::default()));
    addr
}

#[tokio::test]
async fn healthz_matches_the_capture() {
    let want = capture("02-healthz.txt");
    let (status, headers, body) = get(sim_with_hello().await, "/-/healthz").await;
    assert_eq!(status, want.status);
    assert_eq!(body, want.body);
    for h in ["content-type", "server"] {
        assert_eq!(headers.get(h), want.headers.get(h), "{h}");
    }
}

#[tokio::test]
async fn routes_matches_the_capture() {
    let want = capture("02-routes.txt");
    let (status, headers, body) = get(sim_with_hello().await, "/-/routes").await;
    assert_eq!(status, want.status);
    let got: serde_json::Value = serde_json::from_str(&body).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&want.body).unwrap();
    assert_eq!(got, expected);
    for h in ["content-type", "server"] {
        assert_eq!(headers.get(h), want.headers.get(h), "{h}");
    }
}

#[tokio::test]
async fn unknown_paths_are_404_and_apps_say_who_served() {
    let addr = sim_with_hello().await;
    let (status, _, _) = get(addr, "/nope").await;
    assert_eq!(status, 404);
    let (status, _, body) = get(addr, "/hello/world").await;
    assert_eq!(status, 200);
    let served: ray_serve_sim::Served = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (
            served.app.as_str(),
            served.cluster.as_str(),
            served.node_type.as_str()
        ),
        ("hello", "c", "head")
    );
    assert_eq!(served.proxy, addr.to_string());
}

// The simulated dashboard's proxies, target groups and controller, against 02-running.json.

fn running_capture() -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/ray-serve-2.60/02-running.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// `sim` has every key `real` has, recursively, with values of the same JSON type (a
/// non-empty list in `real` needs a non-empty list whose first item covers `real`'s).
fn assert_covers(what: &str, sim: &serde_json::Value, real: &serde_json::Value) {
    use serde_json::Value;
    match (sim, real) {
        (Value::Object(s), Value::Object(r)) => {
            for (key, value) in r {
                let Some(theirs) = s.get(key) else {
                    panic!("{what}: the sim lacks `{key}`: {sim}");
                };
                assert_covers(&format!("{what}.{key}"), theirs, value);
            }
        }
        (Value::Array(s), Value::Array(r)) => {
            if let Some(first) = r.first() {
                let theirs = s
                    .first()
                    .unwrap_or_else(|| panic!("{what}: empty in the sim"));
                assert_covers(&format!("{what}[0]"), theirs, first);
            }
        }
        (Value::Number(_), Value::Number(_))
        | (Value::String(_), Value::String(_))
        | (Value::Bool(_), Value::Bool(_))
        | (Value::Null, Value::Null) => {}
        _ => panic!("{what}: the sim has {sim}, Ray has {real}"),
    }
}

/// The fields discovery reads have the capture's shape (`proxies` is keyed by node id:
/// each entry is compared with the captured one).
fn assert_shaped_like(served: &serde_json::Value, real: &serde_json::Value) {
    for key in ["controller_info", "http_options", "target_groups"] {
        assert_covers(key, &served[key], &real[key]);
    }
    let real_proxy = real["proxies"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap();
    let proxies = served["proxies"].as_object().expect("proxies is an object");
    assert!(!proxies.is_empty());
    for (node_id, proxy) in proxies {
        assert_covers(&format!("proxies.{node_id}"), proxy, real_proxy);
    }
}

async fn sim_dashboard_body(sim: &ray_serve_sim::dashboard::SimDashboard) -> serde_json::Value {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/api/serve/applications/",
        listener.local_addr().unwrap()
    );
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(sim.clone().serve(listener, shutdown));
    let (status, body) = support::http_get(&url).await.unwrap();
    assert_eq!(status, 200);
    serde_json::from_str(&body).unwrap()
}

#[tokio::test]
async fn dashboard_proxies_and_target_groups_are_shaped_like_the_capture() {
    use ray_serve_sim::dashboard::SimDashboard;
    let real = running_capture();

    // As captured: one node, one proxy, on 8000.
    let sim = SimDashboard::new();
    sim.set_app("hello", "/hello", "RUNNING");
    sim.set_proxy("192.0.2.2", "HEALTHY");
    let served = sim_dashboard_body(&sim).await;
    assert_shaped_like(&served, &real);
    // What ray-xds reads from them is the same, node ids aside.
    let parse = |v: &serde_json::Value| {
        ray_xds::live::dashboard::parse(v.to_string().as_bytes())
            .unwrap()
            .http_proxies
            .into_iter()
            .map(|p| (p.address, p.node_type, p.status))
            .collect::<Vec<_>>()
    };
    assert_eq!(parse(&served), parse(&real));
    assert_eq!(parse(&real).len(), 1);

    // A cluster of three nodes on their own IPs, as ray-xds's tests discover them: every
    // proxy keyed by its node id, each HEALTHY one a target whose name is its actor
    // name, on http_options.port; the controller on the head's node.
    let sim = SimDashboard::new();
    sim.set_app("hello", "/hello", "RUNNING");
    sim.set_http_port(8123);
    for (ip, node_type, status) in [
        ("127.0.0.2", NodeType::Head, "HEALTHY"),
        ("127.0.0.3", NodeType::Worker, "HEALTHY"),
        ("127.0.0.4", NodeType::Worker, "STARTING"),
    ] {
        sim.add_proxy(format!("{ip}:8123").parse().unwrap(), node_type, status);
    }
    let served = sim_dashboard_body(&sim).await;
    assert_shaped_like(&served, &real);
    let proxies = served["proxies"].as_object().unwrap();
    assert_eq!(proxies.len(), 3);
    for (node_id, proxy) in proxies {
        assert_eq!(proxy["node_id"], node_id.as_str());
        assert_eq!(proxy["actor_name"], format!("SERVE_PROXY_ACTOR-{node_id}"));
    }
    let groups = served["target_groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0]["protocol"], real["target_groups"][0]["protocol"]);
    assert_eq!(
        groups[0]["route_prefix"],
        real["target_groups"][0]["route_prefix"]
    );
    let targets = groups[0]["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 2, "only HEALTHY proxies are targets");
    for target in targets {
        assert_eq!(target["port"], served["http_options"]["port"]);
        assert!(
            proxies
                .values()
                .any(|p| p["actor_name"] == target["name"] && p["node_ip"] == target["ip"]),
            "{target}"
        );
    }
    // As in the capture, the controller's node runs a proxy.
    let controller = &served["controller_info"];
    let on_controller = &proxies[controller["node_id"].as_str().unwrap()];
    assert_eq!(on_controller["node_ip"], "127.0.0.2");
    assert_eq!(
        real["proxies"][real["controller_info"]["node_id"].as_str().unwrap()]["node_ip"],
        real["controller_info"]["node_ip"]
    );
}

/// The assertions `tests/real_ray/serve.rs` makes against real Ray 2.60, made against the
/// simulator: the two cannot drift apart unnoticed.
#[tokio::test]
async fn the_shared_conformance_assertions_hold_for_the_simulator() {
    let proxy = sim_with_hello().await;
    support::conformance::healthz_is_healthy(proxy).await;
    support::conformance::routes_are(proxy, &[("/hello", "hello")]).await;

    let dashboard = ray_serve_sim::dashboard::SimDashboard::new();
    dashboard.add_proxy(proxy, NodeType::Head, "HEALTHY");
    dashboard.set_app("hello", "/hello", "RUNNING");
    dashboard.set_app("slow", "/slow", "DEPLOYING");
    dashboard.set_app("broken", "/broken", "DEPLOY_FAILED");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));
    support::conformance::applications_are(
        &url,
        &[
            ("hello", "RUNNING", "/hello"),
            ("slow", "DEPLOYING", "/slow"),
            ("broken", "DEPLOY_FAILED", "/broken"),
        ],
    )
    .await;
    dashboard.set_app("slow", "/slow", "RUNNING");
    support::conformance::applications_are(
        &url,
        &[
            ("hello", "RUNNING", "/hello"),
            ("slow", "RUNNING", "/slow"),
            ("broken", "DEPLOY_FAILED", "/broken"),
        ],
    )
    .await;

    // Sizes: 2 replicas × 3 requests, then scaled to half by `target_capacity` (Ray
    // runs ceil(2 × 50%) = 1; `num_replicas` stays the full size).
    use ray_serve_sim::dashboard::AppSize;
    use ray_xds::live::dashboard::Capacity;
    let size = AppSize {
        num_replicas: 2,
        running: 2,
        max_ongoing_requests: 3,
    };
    dashboard.set_app_size("hello", size);
    let full = Capacity {
        ready: 6,
        full: Some(6),
    };
    support::conformance::capacity_is(&url, "hello", full, None).await;
    dashboard.set_target_capacity(Some(50.0));
    let half = Capacity { ready: 3, ..full };
    support::conformance::capacity_is(&url, "hello", half, Some(50.0)).await;
    shutdown.cancel();
}

/// Backpressure as `real_ray_backpressure_ejects_nothing` checks it on real Ray
/// (`apps:busy`: one replica running one request at a time, one queued, 0.3 s each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulator_pushes_back_as_ray_does() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ProxyConfig {
        cluster: "c".into(),
        node_type: NodeType::Head,
        routes: BTreeMap::from([("/busy".to_string(), "busy".to_string())]),
    };
    let handle = ray_serve_sim::ProxyHandle::default();
    handle.set_capacity(Some(ray_serve_sim::capacity::Capacity {
        ongoing: 1,
        max_queued: Some(1),
        call_ms: 300,
    }));
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(ray_serve_sim::serve_proxy_with(
        listener,
        config,
        handle.clone(),
        shutdown.clone(),
    ));
    let url = format!("http://{addr}/busy");
    support::conformance::backpressure_is(&url, 12, std::time::Duration::from_secs(2)).await;
    assert_eq!(handle.load(), (0, 0), "every slot and place given back");
    shutdown.cancel();
}

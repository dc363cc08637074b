//! The simulated dashboard answers as Ray 2.60's, as ray-xds reads it: applications and
//! their statuses, proxies and where they listen, faults (unavailable, hanging, garbage).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use pretty_assertions::assert_eq;
use ray_serve_sim::dashboard::*;
use ray_serve_sim::NodeType;
use ray_xds::live::dashboard::APPLICATIONS_PATH;
use ray_xds::live::dashboard::{
    parse, AppStatus, Application, Capacity, DashboardClient, DashboardError, ProxyStatus,
    ServeProxy,
};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

struct Running {
    base: String,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(sim: &SimDashboard) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(sim.clone().serve(listener, shutdown.clone()));
    Running {
        base,
        shutdown,
        task,
    }
}

impl Running {
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("serve returns after shutdown")
            .unwrap()
            .unwrap();
    }
}

/// `GET /api/serve/applications/`: status and raw body.
async fn get_raw(base: &str) -> (u16, Bytes) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    let uri: hyper::Uri = format!("{base}{APPLICATIONS_PATH}").parse().unwrap();
    let response = client.get(uri).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, body)
}

fn capture(name: &str) -> Value {
    let path = format!(
        "{}/../tests/fixtures/ray-serve-2.60/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .cloned()
        .collect()
}

fn first(v: &Value) -> &Value {
    v.as_object().unwrap().values().next().unwrap()
}

fn assert_superset(what: &str, sim: &Value, real: &Value) {
    let missing: Vec<_> = keys(real).difference(&keys(sim)).cloned().collect();
    assert!(missing.is_empty(), "{what}: the sim lacks {missing:?}");
}

#[tokio::test]
async fn serves_what_was_set_for_every_status() {
    let sim = SimDashboard::new();
    let running = start(&sim).await;
    let app_statuses = [
        "NOT_STARTED",
        "DEPLOYING",
        "DEPLOY_FAILED",
        "RUNNING",
        "UNHEALTHY",
        "DELETING",
    ];
    let proxy_statuses = ["STARTING", "HEALTHY", "UNHEALTHY", "DRAINING"];
    for (i, status) in app_statuses.iter().enumerate() {
        sim.set_app("app", "/app", status);
        let ip = format!("192.0.2.{}", 10 + i % proxy_statuses.len());
        let proxy_status = proxy_statuses[i % proxy_statuses.len()];
        sim.set_proxy(&ip, proxy_status);

        let (code, body) = get_raw(&running.base).await;
        assert_eq!(code, 200);
        let parsed = parse(&body).unwrap();
        let app = &parsed.applications["app"];
        assert_eq!(app.status, AppStatus::from_ray(status));
        assert!(!matches!(app.status, AppStatus::Other(_)), "{status}");
        assert_eq!(app.route_prefix.as_deref(), Some("/app"));
        let expected_message = match *status {
            "DEPLOY_FAILED" => "Failed to update the deployments ['App'].",
            "UNHEALTHY" => "The deployments ['App'] are UNHEALTHY.",
            _ => "",
        };
        assert_eq!(app.message, expected_message, "{status}");
        assert_eq!(
            parsed.proxy_status_by_ip(&ip),
            Some(&ProxyStatus::from_ray(proxy_status))
        );
        assert_eq!(
            parsed.proxies[&node_id_for(&ip)],
            ServeProxy {
                node_id: node_id_for(&ip),
                node_ip: ip.clone(),
                status: ProxyStatus::from_ray(proxy_status),
            }
        );
        assert_eq!(parsed.keep_alive_timeout_s, Some(90.0));
        assert_eq!(parsed.target_capacity, None);
        assert_eq!(parsed.all_running(), *status == "RUNNING");
    }
    // An unknown status passes through.
    sim.set_app("future", "/future", "HIBERNATING");
    let status = DashboardClient::new(Duration::from_secs(2))
        .fetch(&running.base)
        .await
        .unwrap();
    assert_eq!(
        status.applications["future"].status,
        AppStatus::Other("HIBERNATING".into())
    );
    running.stop().await;
}

#[tokio::test]
async fn keys_are_a_superset_of_the_capture() {
    let sim = SimDashboard::new();
    sim.set_app("hello", "/hello", "RUNNING");
    sim.set_proxy("192.0.2.2", "HEALTHY");
    let running = start(&sim).await;
    let (code, body) = get_raw(&running.base).await;
    assert_eq!(code, 200);
    let served: Value = serde_json::from_slice(&body).unwrap();
    let real = capture("02-running.json");

    assert_superset("top level", &served, &real);
    for key in [
        "controller_info",
        "http_options",
        "grpc_options",
        "controller_health_metrics",
    ] {
        assert_superset(key, &served[key], &real[key]);
    }
    assert_superset("proxy", first(&served["proxies"]), first(&real["proxies"]));
    let (sim_app, real_app) = (
        &served["applications"]["hello"],
        &real["applications"]["hello"],
    );
    assert_superset("application", sim_app, real_app);
    assert_superset(
        "deployed_app_config",
        &sim_app["deployed_app_config"],
        &real_app["deployed_app_config"],
    );
    assert_superset(
        "deployment_topology",
        &sim_app["deployment_topology"],
        &real_app["deployment_topology"],
    );
    let mut real_deployment = real_app["deployments"]["Hello"].clone();
    let sim_deployment = &sim_app["deployments"]["Hello"];
    assert_superset("deployment", sim_deployment, &real_deployment);
    real_deployment["deployment_config"]
        .as_object_mut()
        .unwrap()
        .retain(|k, _| {
            !k.contains("router")
                && !k.contains("backpressure")
                && !k.contains("rolling")
                && !k.contains("surge")
        });
    assert_superset(
        "deployment_config",
        &sim_deployment["deployment_config"],
        &real_deployment["deployment_config"],
    );
    let (sim_group, real_group) = (&served["target_groups"][0], &real["target_groups"][0]);
    assert_superset("target group", sim_group, real_group);
    assert_superset(
        "target",
        &sim_group["targets"][0],
        &real_group["targets"][0],
    );

    // Same values where the capture's are not run-specific.
    for key in [
        "proxy_location",
        "http_options",
        "grpc_options",
        "target_capacity",
    ] {
        assert_eq!(served[key], real[key], "{key}");
    }
    // The simulator's config carries `args` of its own (a deploy's time: every deploy
    // here is a new config, as a new version is in Ray); the rest is the capture's.
    let mut sim_config = sim_app["deployed_app_config"].clone();
    assert!(sim_config["args"]["deployed"].is_f64(), "{sim_config}");
    sim_config.as_object_mut().unwrap().remove("args");
    assert_eq!(sim_config, real_app["deployed_app_config"]);
    assert_eq!(
        sim_app["deployment_topology"],
        real_app["deployment_topology"]
    );
    let proxy = first(&served["proxies"]);
    assert_eq!(proxy["node_ip"], "192.0.2.2");
    assert_eq!(
        proxy["actor_name"],
        format!("SERVE_PROXY_ACTOR-{}", node_id_for("192.0.2.2"))
    );
    assert_eq!(sim_group["targets"][0]["name"], proxy["actor_name"]);
    running.stop().await;
}

#[tokio::test]
async fn no_serve_looks_like_the_capture() {
    let sim = SimDashboard::new();
    let running = start(&sim).await;
    let (code, body) = get_raw(&running.base).await;
    assert_eq!(code, 200);
    let served: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(served, capture("01-no-serve.json"));

    // Removing everything goes back to it.
    sim.set_app("a", "/a", "RUNNING");
    sim.set_proxy("192.0.2.9", "HEALTHY");
    sim.remove_app("a");
    let after_app: Value = serde_json::from_slice(&get_raw(&running.base).await.1).unwrap();
    assert_eq!(after_app["applications"], json!({}));
    assert_eq!(keys(&after_app["proxies"]).len(), 1);
    sim.remove_proxy("192.0.2.9");
    let after_all: Value = serde_json::from_slice(&get_raw(&running.base).await.1).unwrap();
    assert_eq!(after_all, capture("01-no-serve.json"));
    running.stop().await;
}

#[tokio::test]
async fn deploy_app_settles_after_the_duration() {
    let sim = SimDashboard::new();
    sim.set_proxy("192.0.2.2", "HEALTHY");
    let running = start(&sim).await;
    let client = DashboardClient::new(Duration::from_secs(2));

    sim.deploy_app("slow", "/slow", Duration::from_millis(100), "RUNNING");
    sim.deploy_app(
        "broken",
        "/broken",
        Duration::from_millis(100),
        "DEPLOY_FAILED",
    );
    let first = client.fetch(&running.base).await.unwrap();
    assert_eq!(first.applications["slow"].status, AppStatus::Deploying);
    assert_eq!(first.applications["broken"].status, AppStatus::Deploying);
    assert_eq!(first.applications["broken"].message, "");

    let deadline = Instant::now() + Duration::from_secs(5);
    let settled = loop {
        let status = client.fetch(&running.base).await.unwrap();
        if status.applications["slow"].status != AppStatus::Deploying {
            break status;
        }
        assert!(Instant::now() < deadline, "still DEPLOYING: {status:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        settled.applications["slow"],
        Application {
            status: AppStatus::Running,
            route_prefix: Some("/slow".into()),
            message: String::new(),
            capacity: Some(Capacity {
                ready: 5,
                full: Some(5)
            }),
            // When the simulator deployed it, as Ray gives it.
            deployed_at: settled.applications["slow"]
                .deployed_at
                .filter(|t| *t > 1e9),
            resizing: false,
            config_digest: settled.applications["slow"].config_digest.clone(),
        }
    );
    assert!(settled.applications["slow"].deployed_at.is_some());
    assert_eq!(
        settled.applications["broken"].status,
        AppStatus::DeployFailed
    );
    assert_eq!(
        settled.applications["broken"].message,
        "Failed to update the deployments ['Broken']."
    );
    running.stop().await;
}

#[tokio::test]
async fn unavailable_answers_503() {
    let sim = SimDashboard::new();
    sim.set_app("hello", "/hello", "RUNNING");
    let running = start(&sim).await;
    sim.set_mode(DashboardMode::Unavailable);
    assert_eq!(get_raw(&running.base).await.0, 503);
    let err = DashboardClient::new(Duration::from_secs(2))
        .fetch(&running.base)
        .await
        .unwrap_err();
    assert!(matches!(err, DashboardError::Status(503)), "{err:?}");
    sim.set_mode(DashboardMode::Normal);
    assert_eq!(get_raw(&running.base).await.0, 200);
    running.stop().await;
}

#[tokio::test]
async fn garbage_is_malformed() {
    let sim = SimDashboard::new();
    let running = start(&sim).await;
    sim.set_mode(DashboardMode::Garbage);
    let (code, body) = get_raw(&running.base).await;
    assert_eq!(code, 200);
    assert!(matches!(parse(&body), Err(DashboardError::Malformed(_))));
    let err = DashboardClient::new(Duration::from_secs(2))
        .fetch(&running.base)
        .await
        .unwrap_err();
    assert!(matches!(err, DashboardError::Malformed(_)), "{err:?}");
    running.stop().await;
}

#[tokio::test]
async fn hang_times_out_and_is_released() {
    let sim = SimDashboard::new();
    sim.set_app("hello", "/hello", "RUNNING");
    let running = start(&sim).await;
    sim.set_mode(DashboardMode::Hang);
    let err = DashboardClient::new(Duration::from_millis(200))
        .fetch(&running.base)
        .await
        .unwrap_err();
    assert!(matches!(err, DashboardError::Timeout), "{err:?}");

    // A hung request is answered once the mode changes.
    let base = running.base.clone();
    let pending = tokio::spawn(async move { get_raw(&base).await.0 });
    let deadline = Instant::now() + Duration::from_secs(5);
    while sim.requests() < 2 {
        assert!(Instant::now() < deadline, "request never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sim.set_mode(DashboardMode::Normal);
    assert_eq!(pending.await.unwrap(), 200);

    // And shutdown does not wait for requests hung forever.
    sim.set_mode(DashboardMode::Hang);
    let base = running.base.clone();
    let hung = tokio::spawn(async move { get_raw(&base).await.0 });
    while sim.requests() < 3 {
        assert!(Instant::now() < deadline, "request never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.stop().await;
    assert_eq!(hung.await.unwrap(), 503);
}

#[tokio::test]
async fn lists_its_proxies_as_ray_does() {
    let sim = SimDashboard::new();
    sim.set_app("hello", "/hello", "RUNNING");
    sim.set_http_port(8100);
    let addr = |s: &str| -> SocketAddr { s.parse().unwrap() };
    sim.add_proxy(addr("127.0.0.3:8100"), NodeType::Worker, "HEALTHY");
    sim.add_proxy(addr("127.0.0.2:8100"), NodeType::Head, "HEALTHY");
    sim.add_proxy(addr("127.0.0.4:8100"), NodeType::Worker, "STARTING");
    let running = start(&sim).await;
    let client = DashboardClient::new(Duration::from_secs(2));
    let listed = |s: &ray_xds::live::dashboard::ServeStatus| -> Vec<(String, NodeType, String)> {
        s.http_proxies
            .iter()
            .map(|p| {
                let status = p.status.as_ref().map(|s| s.to_string()).unwrap_or_default();
                let node_type = match p.node_type {
                    ray_xds::model::NodeType::Head => NodeType::Head,
                    ray_xds::model::NodeType::Worker => NodeType::Worker,
                };
                (p.address.to_string(), node_type, status)
            })
            .collect()
    };
    let status = client.fetch(&running.base).await.unwrap();
    let entry = |a: &str, t, s: &str| (a.to_string(), t, s.to_string());
    assert_eq!(
        listed(&status),
        [
            entry("127.0.0.2:8100", NodeType::Head, "HEALTHY"),
            entry("127.0.0.3:8100", NodeType::Worker, "HEALTHY"),
            entry("127.0.0.4:8100", NodeType::Worker, "STARTING"),
        ]
    );
    // Only HEALTHY proxies are targets; every proxy is in `proxies`.
    let (_, body) = get_raw(&running.base).await;
    let served: Value = serde_json::from_slice(&body).unwrap();
    let targets: Vec<&str> = served["target_groups"][0]["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["ip"].as_str().unwrap())
        .collect();
    assert_eq!(targets, ["127.0.0.2", "127.0.0.3"]);
    assert_eq!(served["proxies"].as_object().unwrap().len(), 3);
    assert_eq!(served["http_options"]["port"], 8100);
    assert_eq!(
        served["controller_info"]["node_id"],
        node_id_for("127.0.0.2:8100")
    );

    // Proxies come, change and go.
    assert!(sim.set_proxy_status(addr("127.0.0.3:8100"), "DRAINING"));
    assert!(!sim.set_proxy_status(addr("127.0.0.9:8100"), "DRAINING"));
    sim.remove_proxy_at(addr("127.0.0.4:8100"));
    let status = client.fetch(&running.base).await.unwrap();
    assert_eq!(
        listed(&status),
        [
            entry("127.0.0.2:8100", NodeType::Head, "HEALTHY"),
            entry("127.0.0.3:8100", NodeType::Worker, "DRAINING"),
        ]
    );

    // Several proxies on one IP (the simulator on one host), each on its own port.
    sim.remove_proxy("127.0.0.3");
    sim.add_proxy(addr("127.0.0.2:8101"), NodeType::Worker, "HEALTHY");
    let status = client.fetch(&running.base).await.unwrap();
    assert_eq!(
        listed(&status),
        [
            entry("127.0.0.2:8100", NodeType::Head, "HEALTHY"),
            entry("127.0.0.2:8101", NodeType::Worker, "HEALTHY"),
        ]
    );
    // set_proxy by IP sets every proxy on it.
    sim.set_proxy("127.0.0.2", "UNHEALTHY");
    let status = client.fetch(&running.base).await.unwrap();
    assert!(status
        .proxies
        .values()
        .all(|p| p.status == ProxyStatus::Unhealthy));
    running.stop().await;
}

/// With direct ingress on, the simulated answer has the shape of a real direct-ingress
/// cluster's (`direct-ingress/08-grpc-running.json`, `07-grpc-deploying-fallback.json`),
/// and ray-xds reads the same things from both: each application's replicas per protocol,
/// the proxies as targets only on the fallback.
#[tokio::test]
async fn direct_ingress_looks_like_the_captures_and_reads_the_same() {
    let sim = SimDashboard::new();
    sim.set_direct_ingress(true);
    sim.set_grpc_options(
        19900,
        &["ray_xds.demo.echo_pb2_grpc.add_EchoServicer_to_server"],
    );
    sim.set_http_port(18800);
    sim.set_proxy("192.0.2.2", "HEALTHY");
    sim.set_app("echo", "/", "DEPLOYING");
    sim.set_app("work", "/work", "DEPLOYING");
    let running = start(&sim).await;

    // Deploying: both on the proxies' groups, as Ray's fallback.
    let (_, body) = get_raw(&running.base).await;
    let served: Value = serde_json::from_slice(&body).unwrap();
    let real = capture("direct-ingress/07-grpc-deploying-fallback.json");
    let groups = |v: &Value| -> Vec<(String, String, Vec<u64>)> {
        v["target_groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                let ports = g["targets"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t["port"].as_u64().unwrap())
                    .collect();
                (
                    g["app_name"].as_str().unwrap().to_string(),
                    g["protocol"].as_str().unwrap().to_string(),
                    ports,
                )
            })
            .collect()
    };
    assert_eq!(groups(&served), groups(&real));
    for (sim_group, real_group) in served["target_groups"]
        .as_array()
        .unwrap()
        .iter()
        .zip(real["target_groups"].as_array().unwrap())
    {
        assert_superset("target group", sim_group, real_group);
        assert_eq!(sim_group["route_prefix"], real_group["route_prefix"]);
    }

    // Running: each application's own replicas (the capture's ports).
    let ip = |port: u16| SocketAddr::from(([192, 0, 2, 2], port));
    sim.set_app("echo", "/", "RUNNING");
    sim.set_app("work", "/work", "RUNNING");
    assert!(sim.set_app_replicas("echo", &[(ip(30000), Some(ip(40000)))]));
    assert!(sim.set_app_replicas("work", &[(ip(30001), Some(ip(40001)))]));
    assert!(!sim.set_app_replicas("nope", &[]));
    let (_, body) = get_raw(&running.base).await;
    let served: Value = serde_json::from_slice(&body).unwrap();
    let real = capture("direct-ingress/08-grpc-running.json");
    assert_eq!(groups(&served), groups(&real));
    let (sim_target, real_target) = (
        &served["target_groups"][0]["targets"][0],
        &real["target_groups"][0]["targets"][0],
    );
    assert_superset("replica target", sim_target, real_target);
    let name = sim_target["name"].as_str().unwrap();
    assert!(name.starts_with("SERVE_REPLICA::echo#Echo#"), "{name}");
    // The HTTP and gRPC targets of one replica carry its one name, as in Ray.
    assert_eq!(served["target_groups"][1]["targets"][0]["name"], name);

    // What ray-xds reads is the same from both.
    let (sim_status, real_status) = (parse(&body).unwrap(), {
        let bytes = serde_json::to_vec(&real).unwrap();
        parse(&bytes).unwrap()
    });
    let replicas =
        |s: &ray_xds::live::dashboard::ServeStatus| -> Vec<(String, Vec<u16>, Vec<u16>)> {
            s.ingress
                .apps
                .iter()
                .map(|(n, a)| {
                    let ports = |r: &[ray_xds::live::target_groups::ReplicaTarget]| {
                        r.iter().map(|r| r.address.port()).collect()
                    };
                    (n.clone(), ports(&a.http), ports(&a.grpc))
                })
                .collect()
        };
    assert_eq!(replicas(&sim_status), replicas(&real_status));
    assert!(sim_status.ingress.on && real_status.ingress.on);
    let proxies = |s: &ray_xds::live::dashboard::ServeStatus| -> Vec<SocketAddr> {
        s.http_proxies.iter().map(|p| p.address).collect()
    };
    assert_eq!(proxies(&sim_status), proxies(&real_status));

    // Off again: one group per protocol, the proxies.
    sim.set_direct_ingress(false);
    let (_, body) = get_raw(&running.base).await;
    let served: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        groups(&served),
        [
            ("".to_string(), "HTTP".to_string(), vec![18800]),
            ("".to_string(), "gRPC".to_string(), vec![19900]),
        ]
    );
    running.stop().await;
}

//! One set of assertions about the Ray Serve endpoints ray-xds reads, run against both the
//! simulator (`tests/live/sim_conformance.rs`) and real Ray 2.60 (`tests/real_ray/serve.rs`), so the
//! simulator cannot drift from the real thing unnoticed.
//!
//! Each function checks what ray-xds depends on (status codes, bodies, content types, the
//! fields of `/api/serve/applications/` and their types), and that ray-xds's own parser
//! reads the answer the same way.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde_json::Value;

use super::http_get;

async fn get_with_headers(url: &str) -> (u16, String, String) {
    use http_body_util::BodyExt;
    let uri: hyper::Uri = url.parse().unwrap();
    let authority = uri.authority().unwrap().clone();
    let stream = tokio::net::TcpStream::connect(authority.as_str())
        .await
        .unwrap_or_else(|e| panic!("connecting to {url}: {e}"));
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(uri.path())
        .header("host", authority.as_str())
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        content_type,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// A healthy proxy: `GET /-/healthz` is 200 `success`, as plain text.
pub async fn healthz_is_healthy(proxy: SocketAddr) {
    let (status, content_type, body) = get_with_headers(&format!("http://{proxy}/-/healthz")).await;
    assert_eq!((status, body.as_str()), (200, "success"), "{proxy}");
    assert_eq!(content_type, "text/plain; charset=utf-8", "{proxy}");
}

/// `GET /-/routes` is a JSON object, route prefix → application, exactly `expected`.
pub async fn routes_are(proxy: SocketAddr, expected: &[(&str, &str)]) {
    let (status, content_type, body) = get_with_headers(&format!("http://{proxy}/-/routes")).await;
    assert_eq!(status, 200, "{proxy}: {body}");
    assert_eq!(content_type, "application/json", "{proxy}");
    let got: BTreeMap<String, String> =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{proxy}: {e}: {body}"));
    let want: BTreeMap<String, String> = expected
        .iter()
        .map(|(p, a)| (p.to_string(), a.to_string()))
        .collect();
    assert_eq!(got, want, "{proxy}");
}

/// `GET /api/serve/applications/` has the shape ray-xds reads, lists the applications
/// with the given statuses and route prefixes, and ray-xds's parser agrees. Returns the
/// document.
pub async fn applications_are(dashboard: &str, expected: &[(&str, &str, &str)]) -> Value {
    let url = format!("{dashboard}/api/serve/applications/");
    let (status, body) = http_get(&url).await.unwrap();
    assert_eq!(status, 200, "{url}: {body}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    let apps = doc["applications"]
        .as_object()
        .expect("applications is an object");
    let mut got: Vec<(String, String, String)> = apps
        .iter()
        .map(|(name, a)| {
            assert_eq!(a["name"].as_str(), Some(name.as_str()), "{name}");
            assert!(a["message"].is_string(), "{name}: message is a string");
            assert!(a["deployments"].is_object(), "{name}: deployments");
            (
                name.clone(),
                a["status"]
                    .as_str()
                    .expect("status is a string")
                    .to_string(),
                a["route_prefix"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    got.sort();
    let mut want: Vec<(String, String, String)> = expected
        .iter()
        .map(|(n, s, r)| (n.to_string(), s.to_string(), r.to_string()))
        .collect();
    want.sort();
    assert_eq!(got, want, "{url}");

    // Proxies: node id → {node_id, node_ip, status}.
    let proxies = doc["proxies"].as_object().expect("proxies is an object");
    assert!(
        !proxies.is_empty(),
        "{url}: Serve runs, so proxies are listed"
    );
    for (node_id, p) in proxies {
        assert_eq!(p["node_id"].as_str(), Some(node_id.as_str()));
        let ip = p["node_ip"].as_str().expect("node_ip");
        assert!(ip.parse::<std::net::IpAddr>().is_ok(), "node_ip {ip}");
        let s = p["status"].as_str().expect("proxy status");
        assert!(
            ["STARTING", "HEALTHY", "UNHEALTHY", "DRAINING", "DRAINED"].contains(&s),
            "proxy status {s}"
        );
    }
    // Target groups: the HTTP proxies' addresses.
    let groups = doc["target_groups"]
        .as_array()
        .expect("target_groups is a list");
    for g in groups {
        assert!(
            ["HTTP", "gRPC"].contains(&g["protocol"].as_str().unwrap_or_default()),
            "{g}"
        );
        assert!(g["route_prefix"].is_string(), "{g}");
        for t in g["targets"].as_array().expect("targets is a list") {
            assert!(
                t["ip"]
                    .as_str()
                    .unwrap()
                    .parse::<std::net::IpAddr>()
                    .is_ok(),
                "{t}"
            );
            assert!(
                t["port"].as_u64().is_some_and(|p| p > 0 && p < 65536),
                "{t}"
            );
        }
    }
    assert_eq!(
        doc["http_options"]["keep_alive_timeout_s"].as_f64(),
        Some(90.0),
        "Ray 2.60's keep-alive, below which Envoy's idle timeout is set"
    );
    assert!(doc["controller_info"]["node_id"].is_string());

    // ray-xds reads it the same way.
    let parsed = ray_xds::live::dashboard::parse(body.as_bytes()).expect("ray-xds parses it");
    for (name, status, prefix) in expected {
        let app = &parsed.applications[*name];
        assert_eq!(app.status.as_str(), *status, "{name}");
        assert_eq!(
            app.route_prefix.as_deref().unwrap_or_default(),
            *prefix,
            "{name}"
        );
    }
    assert_eq!(parsed.proxies.len(), proxies.len());
    doc
}

/// What a gRPC proxy's `ray.serve.RayServeAPIService` answers, as ray-xds and a client
/// see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcApi {
    /// The prober's reading of `Healthz` (`ray_xds::live::prober::probe_grpc_healthz`).
    pub probe: ray_xds::live::probe::Outcome,
    /// `Healthz`: the status code, its message (`grpc-message`; Ray sets `success` on OK
    /// too) and `HealthzResponse.message` ("" when not OK).
    pub healthz: (tonic::Code, String, String),
    /// `ListApplications`: the status code, its message, and the application names,
    /// sorted (Ray lists them in deploy order, the simulator sorted).
    pub list_applications: (tonic::Code, String, Vec<String>),
}

/// The `grpc-message` of an OK answer (tonic keeps a unary call's trailers in its
/// metadata).
fn ok_message<T>(answer: &tonic::Response<T>) -> String {
    answer
        .metadata()
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// Calls `Healthz` (as ray-xds's prober does, and with a plain client) and
/// `ListApplications` on the gRPC proxy at `proxy`.
pub async fn grpc_api(proxy: SocketAddr) -> GrpcApi {
    use ray_serve_sim::grpc::pb::ray_serve::ray_serve_api_service_client::RayServeApiServiceClient;
    use ray_serve_sim::grpc::pb::ray_serve::{HealthzRequest, ListApplicationsRequest};
    use ray_xds::live::prober::{grpc_channel, probe_grpc_healthz};
    let timeout = std::time::Duration::from_secs(5);
    let probe = probe_grpc_healthz(grpc_channel(proxy), timeout).await;
    let mut client = RayServeApiServiceClient::new(grpc_channel(proxy));
    let mut request = tonic::Request::new(HealthzRequest {});
    request.set_timeout(timeout);
    let healthz = match client.healthz(request).await {
        Ok(answer) => (
            tonic::Code::Ok,
            ok_message(&answer),
            answer.into_inner().message,
        ),
        Err(status) => (status.code(), status.message().to_string(), String::new()),
    };
    let mut request = tonic::Request::new(ListApplicationsRequest {});
    request.set_timeout(timeout);
    let list_applications = match client.list_applications(request).await {
        Ok(answer) => {
            let message = ok_message(&answer);
            let mut names = answer.into_inner().application_names;
            names.sort();
            (tonic::Code::Ok, message, names)
        }
        Err(status) => (status.code(), status.message().to_string(), Vec::new()),
    };
    GrpcApi {
        probe,
        healthz,
        list_applications,
    }
}

/// A healthy gRPC proxy serving `applications`: ray-xds's prober finds it healthy,
/// `Healthz` is OK `success`, `ListApplications` OK with exactly those names (in any
/// order). Returns what it answered, for comparing the simulator with real Ray.
pub async fn grpc_api_is_healthy(proxy: SocketAddr, applications: &[&str]) -> GrpcApi {
    let api = grpc_api(proxy).await;
    let mut names: Vec<String> = applications.iter().map(|a| a.to_string()).collect();
    names.sort();
    let want = GrpcApi {
        probe: ray_xds::live::probe::Outcome::Healthy,
        healthz: (tonic::Code::Ok, "success".into(), "success".into()),
        list_applications: (tonic::Code::Ok, "success".into(), names),
    };
    assert_eq!(api, want, "{proxy}");
    api
}

/// What ray-xds reads of an application's size (`live::dashboard::capacity`) comes to
/// `expected`, and the answer's `target_capacity` is `target_capacity`, within a minute
/// (replicas start and stop after the application's status changes): each deployment
/// lists its replicas with a `state` and its `deployment_config` with `num_replicas` and
/// `max_ongoing_requests`.
pub async fn capacity_is(
    dashboard: &str,
    app: &str,
    expected: ray_xds::live::dashboard::Capacity,
    target_capacity: Option<f64>,
) {
    let url = format!("{dashboard}/api/serve/applications/");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (status, body) = http_get(&url).await.unwrap();
        assert_eq!(status, 200, "{url}: {body}");
        let doc: Value = serde_json::from_str(&body).unwrap();
        for (name, d) in doc["applications"][app]["deployments"]
            .as_object()
            .expect("deployments is an object")
        {
            let config = &d["deployment_config"];
            let autoscaling = !config["autoscaling_config"].is_null();
            assert!(
                config["num_replicas"].is_u64() || autoscaling,
                "{name}: {config}"
            );
            assert!(config["max_ongoing_requests"].is_u64(), "{name}: {config}");
            for r in d["replicas"].as_array().expect("replicas is a list") {
                assert!(r["state"].is_string(), "{name}: {r}");
            }
        }
        let parsed = ray_xds::live::dashboard::parse(body.as_bytes()).unwrap();
        let got = (parsed.applications[app].capacity, parsed.target_capacity);
        if got == (Some(expected), target_capacity) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{url}: {app}'s capacity and target_capacity are {got:?}, not {:?}",
            (Some(expected), target_capacity)
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Ray's backpressure at `url`, an application of one replica that runs one request at a
/// time (`max_ongoing_requests: 1`) with one more queued (`max_queued_requests: 1`):
/// under `clients` clients at once for `duration`, requests are answered 200 or 503, the
/// 503s with Ray's `BackPressureError` text, as plain text, and nothing else. (Ray checks
/// the queue before it counts a request in, across awaits, so the count it reports can
/// pass the bound: `num_queued_requests=2, max_queued_requests=1` on Ray 2.60.)
/// Returns (answered 200, answered 503).
pub async fn backpressure_is(
    url: &str,
    clients: usize,
    duration: std::time::Duration,
) -> (usize, usize) {
    let stop = std::time::Instant::now() + duration;
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let url = url.to_string();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while std::time::Instant::now() < stop {
                    seen.push(get_with_headers(&url).await);
                }
                seen
            })
        })
        .collect();
    let (mut ok, mut refused) = (0, 0);
    let (prefix, suffix) = (
        "Request dropped due to backpressure (num_queued_requests=",
        ", max_queued_requests=1).",
    );
    for task in tasks {
        for (status, content_type, body) in task.await.unwrap() {
            match status {
                200 => ok += 1,
                503 => {
                    let queued = body
                        .strip_prefix(prefix)
                        .and_then(|rest| rest.strip_suffix(suffix))
                        .and_then(|n| n.parse::<u32>().ok());
                    assert!(queued.is_some_and(|n| n >= 1), "{url}: {body:?}");
                    assert_eq!(
                        body,
                        ray_serve_sim::capacity::backpressure_message(queued.unwrap(), 1)
                    );
                    assert!(
                        content_type.starts_with("text/plain"),
                        "{url}: {content_type}"
                    );
                    refused += 1;
                }
                other => panic!("{url}: {other} {body}"),
            }
        }
    }
    assert!(
        ok > 0 && refused > 0,
        "{url}: {ok} answered, {refused} refused"
    );
    (ok, refused)
}

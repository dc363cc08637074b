//! The Ray dashboard client: what Ray Serve itself says about its applications and proxies.
//!
//! Ray's dashboard (port 8265 on the head node) answers `GET /api/serve/applications/`
//! with a JSON `ServeInstanceDetails` (captures from Ray 2.60 are in
//! `tests/fixtures/ray-serve-2.60/`). This module turns that answer into a small domain
//! type, [`ServeStatus`], and fetches it over HTTP with [`DashboardClient`].
//!
//! Invariants:
//!
//! - No `serde_json::Value` leaks out: the public API is [`ServeStatus`] and friends.
//! - [`parse`] is tolerant the way a reader of someone else's evolving API must be:
//!   unknown fields are ignored, nulls and missing fields become `None`, empty strings or
//!   empty maps, and status strings this version does not know become `Other(..)` instead
//!   of failing. Only a body that is not a JSON object, or whose `applications` or
//!   `proxies` are present but not objects, is [`DashboardError::Malformed`].
//! - [`DashboardClient::fetch`] never takes longer than its timeout (connect, request and
//!   the whole body are under one deadline), never buffers more than [`MAX_BODY_BYTES`],
//!   and reports every failure as one [`DashboardError`] whose
//!   [`metric_label`](DashboardError::metric_label) is a fixed, low-cardinality string.
//! - The client reuses connections (one pooled hyper client per [`DashboardClient`];
//!   clones share the pool).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Map, Value};

/// The path of the Serve status endpoint on the dashboard.
pub const APPLICATIONS_PATH: &str = "/api/serve/applications/";

/// The largest body [`DashboardClient::fetch`] accepts (8 MiB); a bigger one is
/// [`DashboardError::Malformed`].
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// How long an idle pooled connection to a dashboard is kept. Below aiohttp's default
/// keep-alive (75 s), so the client does not race the dashboard closing it.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// What the dashboard says about one Ray Serve instance.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ServeStatus {
    /// Application name → application.
    pub applications: BTreeMap<String, Application>,
    /// Ray node id → the Serve proxy on that node.
    pub proxies: BTreeMap<String, ServeProxy>,
    /// `target_capacity` in percent, when set.
    pub target_capacity: Option<f64>,
    /// `http_options.keep_alive_timeout_s` of the Serve proxies, when known.
    pub keep_alive_timeout_s: Option<f64>,
}

/// One Serve application.
#[derive(Debug, Clone, PartialEq)]
pub struct Application {
    pub status: AppStatus,
    /// `None` when the application has no HTTP route (`route_prefix: null`).
    pub route_prefix: Option<String>,
    /// Ray's explanation of the status; empty when there is none.
    pub message: String,
}

/// An application's status, as Ray Serve's `ApplicationStatus`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum AppStatus {
    NotStarted,
    Deploying,
    DeployFailed,
    Running,
    Unhealthy,
    Deleting,
    /// A status this version does not know, spelled as Ray sent it.
    Other(String),
}

impl AppStatus {
    /// The status for Ray's spelling (`RUNNING`, ...); unknown spellings become `Other`.
    pub fn from_ray(s: &str) -> Self {
        match s {
            "NOT_STARTED" => AppStatus::NotStarted,
            "DEPLOYING" => AppStatus::Deploying,
            "DEPLOY_FAILED" => AppStatus::DeployFailed,
            "RUNNING" => AppStatus::Running,
            "UNHEALTHY" => AppStatus::Unhealthy,
            "DELETING" => AppStatus::Deleting,
            other => AppStatus::Other(other.to_string()),
        }
    }

    /// Ray's spelling of the status.
    pub fn as_str(&self) -> &str {
        match self {
            AppStatus::NotStarted => "NOT_STARTED",
            AppStatus::Deploying => "DEPLOYING",
            AppStatus::DeployFailed => "DEPLOY_FAILED",
            AppStatus::Running => "RUNNING",
            AppStatus::Unhealthy => "UNHEALTHY",
            AppStatus::Deleting => "DELETING",
            AppStatus::Other(s) => s,
        }
    }
}

impl std::fmt::Display for AppStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One Serve HTTP proxy (one per node with `proxy_location: EveryNode`).
#[derive(Debug, Clone, PartialEq)]
pub struct ServeProxy {
    pub node_id: String,
    pub node_ip: String,
    pub status: ProxyStatus,
}

/// A proxy's status, as Ray Serve's `ProxyStatus`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ProxyStatus {
    Starting,
    Healthy,
    Unhealthy,
    Draining,
    /// A status this version does not know, spelled as Ray sent it.
    Other(String),
}

impl ProxyStatus {
    /// The status for Ray's spelling (`HEALTHY`, ...); unknown spellings become `Other`.
    pub fn from_ray(s: &str) -> Self {
        match s {
            "STARTING" => ProxyStatus::Starting,
            "HEALTHY" => ProxyStatus::Healthy,
            "UNHEALTHY" => ProxyStatus::Unhealthy,
            "DRAINING" => ProxyStatus::Draining,
            other => ProxyStatus::Other(other.to_string()),
        }
    }

    /// Ray's spelling of the status.
    pub fn as_str(&self) -> &str {
        match self {
            ProxyStatus::Starting => "STARTING",
            ProxyStatus::Healthy => "HEALTHY",
            ProxyStatus::Unhealthy => "UNHEALTHY",
            ProxyStatus::Draining => "DRAINING",
            ProxyStatus::Other(s) => s,
        }
    }
}

impl std::fmt::Display for ProxyStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ServeStatus {
    /// True when there is at least one application and every one is `RUNNING`.
    pub fn all_running(&self) -> bool {
        !self.applications.is_empty()
            && self
                .applications
                .values()
                .all(|a| a.status == AppStatus::Running)
    }

    /// The route prefixes of all applications that have one.
    pub fn route_prefixes(&self) -> BTreeSet<String> {
        self.applications
            .values()
            .filter_map(|a| a.route_prefix.clone())
            .collect()
    }

    /// The status of the proxy on the node with IP `ip`, if Serve has one there.
    pub fn proxy_status_by_ip(&self, ip: &str) -> Option<&ProxyStatus> {
        self.proxies
            .values()
            .find(|p| p.node_ip == ip)
            .map(|p| &p.status)
    }
}

/// Why the dashboard could not tell us the Serve status.
#[derive(Debug, thiserror::Error)]
pub enum DashboardError {
    /// No connection, or the connection broke before the answer was complete.
    #[error("dashboard unreachable: {0}")]
    Unreachable(String),
    /// No complete answer within the timeout.
    #[error("dashboard did not answer in time")]
    Timeout,
    /// An answer other than 200 (503 while the Serve controller is unreachable).
    #[error("dashboard answered HTTP {0}")]
    Status(u16),
    /// A 200 whose body is not a Serve status.
    #[error("dashboard answer is malformed: {0}")]
    Malformed(String),
}

impl DashboardError {
    /// A fixed label for metrics: `unreachable`, `timeout`, `status` or `malformed`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            DashboardError::Unreachable(_) => "unreachable",
            DashboardError::Timeout => "timeout",
            DashboardError::Status(_) => "status",
            DashboardError::Malformed(_) => "malformed",
        }
    }
}

/// Parses the body of `GET /api/serve/applications/`.
pub fn parse(body: &[u8]) -> Result<ServeStatus, DashboardError> {
    let root: Value = serde_json::from_slice(body)
        .map_err(|e| DashboardError::Malformed(format!("not JSON: {e}")))?;
    let Value::Object(root) = root else {
        return Err(malformed("top level is not an object"));
    };

    let mut status = ServeStatus::default();

    for (name, app) in object_field(&root, "applications")? {
        let Value::Object(app) = app else {
            return Err(DashboardError::Malformed(format!(
                "application `{name}` is not an object"
            )));
        };
        status.applications.insert(
            name.clone(),
            Application {
                status: AppStatus::from_ray(&string_field(app, "status")),
                route_prefix: app
                    .get("route_prefix")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                message: string_field(app, "message"),
            },
        );
    }

    for (node_id, proxy) in object_field(&root, "proxies")? {
        let Value::Object(proxy) = proxy else {
            return Err(DashboardError::Malformed(format!(
                "proxy `{node_id}` is not an object"
            )));
        };
        let id = string_field(proxy, "node_id");
        status.proxies.insert(
            node_id.clone(),
            ServeProxy {
                node_id: if id.is_empty() { node_id.clone() } else { id },
                node_ip: string_field(proxy, "node_ip"),
                status: ProxyStatus::from_ray(&string_field(proxy, "status")),
            },
        );
    }

    status.target_capacity = root.get("target_capacity").and_then(Value::as_f64);
    status.keep_alive_timeout_s = root
        .get("http_options")
        .and_then(|o| o.get("keep_alive_timeout_s"))
        .and_then(Value::as_f64);
    Ok(status)
}

fn malformed(reason: &str) -> DashboardError {
    DashboardError::Malformed(reason.to_string())
}

/// `root[key]` as an object; missing or null is empty, anything else is malformed.
fn object_field<'a>(
    root: &'a Map<String, Value>,
    key: &str,
) -> Result<Box<dyn Iterator<Item = (&'a String, &'a Value)> + 'a>, DashboardError> {
    match root.get(key) {
        None | Some(Value::Null) => Ok(Box::new(std::iter::empty())),
        Some(Value::Object(map)) => Ok(Box::new(map.iter())),
        Some(_) => Err(DashboardError::Malformed(format!(
            "`{key}` is not an object"
        ))),
    }
}

/// `object[key]` as a string; missing, null or not a string is empty.
fn string_field(object: &Map<String, Value>, key: &str) -> String {
    object
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// Fetches the Serve status from Ray dashboards, reusing connections.
#[derive(Debug, Clone)]
pub struct DashboardClient {
    client: Client<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
}

impl DashboardClient {
    /// A client whose every [`fetch`](Self::fetch) completes or fails within `timeout`.
    pub fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(2)
            .build(connector);
        DashboardClient { client, timeout }
    }

    /// `GET {base_url}/api/serve/applications/` and parse the answer.
    ///
    /// `base_url` is the dashboard's address, e.g. `http://10.0.0.1:8265`; a trailing
    /// slash is ignored.
    pub async fn fetch(&self, base_url: &str) -> Result<ServeStatus, DashboardError> {
        let url = format!("{}{APPLICATIONS_PATH}", base_url.trim_end_matches('/'));
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e| DashboardError::Unreachable(format!("bad dashboard URL {url:?}: {e}")))?;
        let request = hyper::Request::get(uri)
            .header(hyper::header::ACCEPT, "application/json")
            .body(Empty::<Bytes>::new())
            .map_err(|e| DashboardError::Unreachable(format!("bad request for {url:?}: {e}")))?;

        let body = tokio::time::timeout(self.timeout, async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| DashboardError::Unreachable(error_chain(&e)))?;
            let status = response.status();
            if status != hyper::StatusCode::OK {
                return Err(DashboardError::Status(status.as_u16()));
            }
            let too_long = response
                .headers()
                .get(hyper::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|n| n > MAX_BODY_BYTES as u64);
            if too_long {
                return Err(body_too_large());
            }
            Limited::new(response.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
                .map(|collected| collected.to_bytes())
                .map_err(|e| {
                    if e.downcast_ref::<LengthLimitError>().is_some() {
                        body_too_large()
                    } else {
                        DashboardError::Unreachable(format!(
                            "reading the body: {}",
                            error_chain(&*e)
                        ))
                    }
                })
        })
        .await
        .map_err(|_| DashboardError::Timeout)??;

        parse(&body)
    }
}

fn body_too_large() -> DashboardError {
    DashboardError::Malformed(format!("body over {} MiB", MAX_BODY_BYTES >> 20))
}

/// An error and its sources, `outer: inner: ...` (hyper's own messages are terse).
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    macro_rules! fixture {
        ($name:literal) => {
            std::fs::read(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/ray-serve-2.60/",
                $name
            ))
            .unwrap()
        };
    }

    const NODE_ID: &str = "b0c512094558f87b989c465668d92115b6a84e4d051e0cc1d6cb319e";

    fn statuses(s: &ServeStatus) -> Vec<(&str, &str)> {
        s.applications
            .iter()
            .map(|(name, app)| (name.as_str(), app.status.as_str()))
            .collect()
    }

    fn the_one_healthy_proxy(s: &ServeStatus) {
        assert_eq!(s.proxies.len(), 1);
        assert_eq!(
            s.proxies[NODE_ID],
            ServeProxy {
                node_id: NODE_ID.into(),
                node_ip: "192.0.2.2".into(),
                status: ProxyStatus::Healthy,
            }
        );
        assert_eq!(
            s.proxy_status_by_ip("192.0.2.2"),
            Some(&ProxyStatus::Healthy)
        );
        assert_eq!(s.proxy_status_by_ip("192.0.2.3"), None);
        assert_eq!(s.keep_alive_timeout_s, Some(90.0));
        assert_eq!(s.target_capacity, None);
    }

    #[test]
    fn parses_no_serve_capture() {
        let s = parse(&fixture!("01-no-serve.json")).unwrap();
        assert_eq!(s, ServeStatus::default());
        assert!(!s.all_running());
        assert!(s.route_prefixes().is_empty());
        assert_eq!(s.proxy_status_by_ip("192.0.2.2"), None);
    }

    #[test]
    fn parses_running_capture() {
        let s = parse(&fixture!("02-running.json")).unwrap();
        assert_eq!(
            s.applications["hello"],
            Application {
                status: AppStatus::Running,
                route_prefix: Some("/hello".into()),
                message: String::new(),
            }
        );
        assert_eq!(s.applications.len(), 1);
        assert!(s.all_running());
        assert_eq!(s.route_prefixes(), BTreeSet::from(["/hello".to_string()]));
        the_one_healthy_proxy(&s);
    }

    #[test]
    fn parses_deploying_capture() {
        let s = parse(&fixture!("03-deploying.json")).unwrap();
        assert_eq!(
            statuses(&s),
            [
                ("broken", "DEPLOYING"),
                ("hello", "RUNNING"),
                ("slow", "DEPLOYING")
            ]
        );
        assert_eq!(s.applications["slow"].status, AppStatus::Deploying);
        assert_eq!(s.applications["broken"].status, AppStatus::Deploying);
        assert!(!s.all_running());
        assert_eq!(
            s.route_prefixes(),
            BTreeSet::from(["/broken".into(), "/hello".into(), "/slow".into()])
        );
        the_one_healthy_proxy(&s);
    }

    #[test]
    fn parses_mixed_settled_capture() {
        let s = parse(&fixture!("04-mixed-settled.json")).unwrap();
        assert_eq!(
            statuses(&s),
            [
                ("broken", "DEPLOY_FAILED"),
                ("hello", "RUNNING"),
                ("slow", "RUNNING")
            ]
        );
        let broken = &s.applications["broken"];
        assert_eq!(broken.status, AppStatus::DeployFailed);
        assert_eq!(broken.route_prefix.as_deref(), Some("/broken"));
        assert_eq!(
            broken.message,
            "Failed to update the deployments ['Broken']."
        );
        assert!(s.applications["slow"].message.is_empty());
        assert!(!s.all_running());
        the_one_healthy_proxy(&s);
    }

    #[test]
    fn parses_unhealthy_capture() {
        let s = parse(&fixture!("05-unhealthy.json")).unwrap();
        assert_eq!(statuses(&s), [("hello", "RUNNING"), ("sick", "UNHEALTHY")]);
        let sick = &s.applications["sick"];
        assert_eq!(sick.status, AppStatus::Unhealthy);
        assert_eq!(sick.route_prefix.as_deref(), Some("/sick"));
        assert_eq!(sick.message, "The deployments ['Sick'] are UNHEALTHY.");
        assert!(!s.all_running());
        the_one_healthy_proxy(&s);
    }

    fn assert_malformed(body: &[u8]) -> String {
        match parse(body) {
            Err(e @ DashboardError::Malformed(_)) => {
                assert_eq!(e.metric_label(), "malformed");
                e.to_string()
            }
            other => panic!(
                "{:?}: expected Malformed, got {other:?}",
                String::from_utf8_lossy(body)
            ),
        }
    }

    #[test]
    fn malformed_inputs() {
        assert!(assert_malformed(b"<html>Bad Gateway</html>").contains("not JSON"));
        assert!(assert_malformed(b"").contains("not JSON"));
        assert!(assert_malformed(br#"{"applications": []}"#).contains("`applications`"));
        assert!(assert_malformed(br#"{"proxies": "none"}"#).contains("`proxies`"));
        assert!(assert_malformed(br#"[1, 2]"#).contains("top level"));
        assert!(assert_malformed(br#"{"applications": {"a": 1}}"#).contains("`a`"));
        let capture = fixture!("02-running.json");
        assert!(assert_malformed(&capture[..capture.len() / 2]).contains("not JSON"));
    }

    #[test]
    fn unknown_statuses_nulls_and_fields_are_tolerated() {
        let s = parse(
            br#"{
                "applications": {
                    "future": {"status": "HIBERNATING", "route_prefix": null,
                               "message": null, "new_field": [1]},
                    "bare": {}
                },
                "proxies": {
                    "n1": {"node_ip": "10.0.0.1", "status": "WARMING_UP"}
                },
                "target_capacity": 50,
                "http_options": {"keep_alive_timeout_s": null},
                "something_new": {"x": 1}
            }"#,
        )
        .unwrap();
        assert_eq!(
            s.applications["future"],
            Application {
                status: AppStatus::Other("HIBERNATING".into()),
                route_prefix: None,
                message: String::new(),
            }
        );
        assert_eq!(s.applications["future"].status.as_str(), "HIBERNATING");
        assert_eq!(
            s.applications["bare"].status,
            AppStatus::Other(String::new())
        );
        assert_eq!(
            s.proxies["n1"],
            ServeProxy {
                node_id: "n1".into(),
                node_ip: "10.0.0.1".into(),
                status: ProxyStatus::Other("WARMING_UP".into()),
            }
        );
        assert_eq!(s.target_capacity, Some(50.0));
        assert_eq!(s.keep_alive_timeout_s, None);
        assert!(s.route_prefixes().is_empty());

        let nulls = parse(br#"{"applications": null, "proxies": null}"#).unwrap();
        assert_eq!(nulls, ServeStatus::default());
    }

    #[test]
    fn statuses_round_trip_ray_spelling() {
        for s in [
            "NOT_STARTED",
            "DEPLOYING",
            "DEPLOY_FAILED",
            "RUNNING",
            "UNHEALTHY",
            "DELETING",
        ] {
            let status = AppStatus::from_ray(s);
            assert!(!matches!(status, AppStatus::Other(_)), "{s}");
            assert_eq!(status.as_str(), s);
        }
        for s in ["STARTING", "HEALTHY", "UNHEALTHY", "DRAINING"] {
            let status = ProxyStatus::from_ray(s);
            assert!(!matches!(status, ProxyStatus::Other(_)), "{s}");
            assert_eq!(status.to_string(), s);
        }
    }

    #[test]
    fn all_running_needs_an_application() {
        let mut s = ServeStatus::default();
        assert!(!s.all_running());
        let app = |status| Application {
            status,
            route_prefix: None,
            message: String::new(),
        };
        s.applications.insert("a".into(), app(AppStatus::Running));
        assert!(s.all_running());
        s.applications.insert("b".into(), app(AppStatus::Deleting));
        assert!(!s.all_running());
    }

    // fetch against tiny servers.

    use axum::http::StatusCode;
    use axum::routing::get;
    use axum::Router;

    const TIMEOUT: Duration = Duration::from_millis(200);

    /// Serves `router` on 127.0.0.1; the base URL, with a trailing slash.
    async fn serve(router: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        format!("http://{addr}/")
    }

    fn answering(status: StatusCode, body: Vec<u8>) -> Router {
        Router::new().route(
            APPLICATIONS_PATH,
            get(move || {
                let body = body.clone();
                async move { (status, body) }
            }),
        )
    }

    #[tokio::test]
    async fn fetch_ok() {
        let base = serve(answering(StatusCode::OK, fixture!("02-running.json"))).await;
        let client = DashboardClient::new(TIMEOUT);
        let expected = parse(&fixture!("02-running.json")).unwrap();
        assert_eq!(client.fetch(&base).await.unwrap(), expected);
        // Without the trailing slash, and again on the pooled connection.
        assert_eq!(
            client.fetch(base.trim_end_matches('/')).await.unwrap(),
            expected
        );
    }

    #[tokio::test]
    async fn fetch_503_is_status() {
        let base = serve(answering(
            StatusCode::SERVICE_UNAVAILABLE,
            b"controller unavailable".to_vec(),
        ))
        .await;
        let err = DashboardClient::new(TIMEOUT)
            .fetch(&base)
            .await
            .unwrap_err();
        assert!(matches!(err, DashboardError::Status(503)), "{err:?}");
        assert_eq!(err.metric_label(), "status");
    }

    #[tokio::test]
    async fn fetch_wrong_path_is_status_404() {
        let base = serve(Router::new()).await;
        let err = DashboardClient::new(TIMEOUT)
            .fetch(&base)
            .await
            .unwrap_err();
        assert!(matches!(err, DashboardError::Status(404)), "{err:?}");
    }

    #[tokio::test]
    async fn fetch_slow_is_timeout() {
        let router = Router::new().route(
            APPLICATIONS_PATH,
            get(|| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                "{}"
            }),
        );
        let base = serve(router).await;
        let started = std::time::Instant::now();
        let err = DashboardClient::new(TIMEOUT)
            .fetch(&base)
            .await
            .unwrap_err();
        assert!(matches!(err, DashboardError::Timeout), "{err:?}");
        assert_eq!(err.metric_label(), "timeout");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn fetch_garbage_is_malformed() {
        let base = serve(answering(StatusCode::OK, b"<html>oops</html>".to_vec())).await;
        let err = DashboardClient::new(TIMEOUT)
            .fetch(&base)
            .await
            .unwrap_err();
        assert!(matches!(err, DashboardError::Malformed(_)), "{err:?}");
    }

    #[tokio::test]
    async fn fetch_oversized_body_is_malformed() {
        let mut body = b"{\"pad\": \"".to_vec();
        body.resize(MAX_BODY_BYTES + 10, b'x');
        body.extend_from_slice(b"\"}");
        let base = serve(answering(StatusCode::OK, body)).await;
        let err = DashboardClient::new(Duration::from_secs(5))
            .fetch(&base)
            .await
            .unwrap_err();
        match err {
            DashboardError::Malformed(reason) => assert!(reason.contains("8 MiB"), "{reason}"),
            other => panic!("expected Malformed, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn fetch_refused_is_unreachable() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let err = DashboardClient::new(TIMEOUT)
            .fetch(&format!("http://127.0.0.1:{port}"))
            .await
            .unwrap_err();
        assert!(matches!(err, DashboardError::Unreachable(_)), "{err:?}");
        assert_eq!(err.metric_label(), "unreachable");
    }

    #[tokio::test]
    async fn fetch_bad_url_is_unreachable() {
        let err = DashboardClient::new(TIMEOUT)
            .fetch("not a url")
            .await
            .unwrap_err();
        assert!(matches!(err, DashboardError::Unreachable(_)), "{err:?}");
    }
}

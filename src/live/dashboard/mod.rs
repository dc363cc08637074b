//! The Ray dashboard client: what Ray Serve itself says about its applications and proxies.
//!
//! Ray's dashboard (port 8265 on the head node) answers `GET /api/serve/applications/`
//! with a JSON `ServeInstanceDetails` (captures from Ray 2.60 are in
//! `tests/fixtures/ray-serve-2.60/`). This module turns that answer into a small domain
//! type, [`ServeStatus`], and fetches it over HTTP with [`DashboardClient`].
//!
//! It also reads where Ray's HTTP proxies listen ([`ServeStatus::http_proxies`]), so that a
//! cluster can be given by its dashboard alone (`live::discovery`):
//!
//! - every target of a `target_groups` entry whose `protocol` is `HTTP` (gRPC groups are
//!   skipped), deduplicated by `ip:port`;
//! - and every proxy in `proxies` that owns no such target, at its `node_ip` and
//!   `http_options.port` (8000, Ray's default, when absent): Ray lists a proxy while it is
//!   STARTING, before it is a target, and a DRAINING proxy leaves `target_groups` but must
//!   stay listed so that it drains instead of vanishing. A target belongs to the proxy
//!   whose `actor_name` is the target's `name`, else to the only proxy on its IP.
//! - The gRPC proxies' port ([`ServeStatus::grpc_port`]): `grpc_options.port` when
//!   `grpc_options.grpc_servicer_functions` lists any. Ray 2.60 reports the port even
//!   without servicers, when no gRPC server runs (`tests/fixtures/ray-serve-2.60/grpc/`),
//!   and its `gRPC` target group lists only HEALTHY proxies, so every discovered proxy
//!   gets that port at its IP instead.
//! - Node type, a heuristic: Ray Serve runs its controller on the head node (and always
//!   keeps a proxy there), so a proxy is `head` when its node is `controller_info`'s
//!   (same `node_id` when both are known, else same `node_ip`), `worker` otherwise. With no
//!   `controller_info` every proxy is a worker.
//! - An entry with garbage (an `ip` or `node_ip` that is not an IP address, a port that
//!   is not a number in 1..=65535, a target that is not an object) is left out alone; a
//!   `target_groups` that is not a list counts as none. It never fails the parse.
//! - Matching a target to its proxy goes through maps built once (by actor name, by
//!   node IP), so a parse is O(n log n): matching each target against every proxy froze
//!   the async runtime for minutes on answers with 40,000 of each.
//!
//! Invariants:
//!
//! - No `serde_json::Value` leaks out: the public API is [`ServeStatus`] and friends.
//! - [`parse`] is tolerant the way a reader of someone else's evolving API must be:
//!   unknown fields are ignored, nulls and missing fields become `None`, empty strings or
//!   empty maps, and status strings this version does not know become `Other(..)` instead
//!   of failing. Only a body that is not a JSON object, whose `applications` or
//!   `proxies` are present but not objects, or that lists more than [`MAX_PROXIES`]
//!   proxies or [`MAX_TARGETS`] targets or over [`MAX_JSON_VALUES`] values in all, is
//!   [`DashboardError::Malformed`] (and, as
//!   for every failed poll, the last good answer stays).
//! - [`DashboardClient::fetch`] parses on a blocking thread: a big answer costs a
//!   blocking-pool thread for a while, never a runtime worker (admin, xDS and probes go on).
//!   At most [`MAX_READS_AT_ONCE`] answers are read and one is parsed at a time, over all
//!   clusters, so what answers cost in flight does not grow with the number of clusters.
//! - [`DashboardClient::fetch`] never takes longer than its timeout (connect, request and
//!   the whole body are under one deadline), never buffers more than [`MAX_BODY_BYTES`],
//!   and reports every failure as one [`DashboardError`] whose
//!   [`metric_label`](DashboardError::metric_label) is a fixed, low-cardinality string.
//! - The client reuses connections (one pooled hyper client per [`DashboardClient`];
//!   clones share the pool).

//!
//! The parts: `parse` (the answer's JSON, bounded, into [`ServeStatus`]) and `client`
//! (the HTTP fetch, bounded in bytes, time and reads at once).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use crate::model::NodeType;

mod capacity;
mod client;
mod parse;

pub use capacity::{application_capacity, Capacity, DeploymentSize};

pub use client::DashboardClient;
pub use parse::{parse, MAX_APPLICATIONS, MAX_JSON_VALUES, MAX_STRING_BYTES};

/// The path of the Serve status endpoint on the dashboard.
pub const APPLICATIONS_PATH: &str = "/api/serve/applications/";

/// The Serve HTTP proxies' port when `http_options.port` is absent (Ray's default).
pub(crate) const DEFAULT_HTTP_PORT: u16 = 8000;

/// The largest body [`DashboardClient::fetch`] accepts (8 MiB); a bigger one is
/// [`DashboardError::Malformed`].
pub(crate) const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// The most proxies one answer may list (`proxies`), and the most targets its HTTP
/// `target_groups` may list ([`MAX_TARGETS`]). Ray runs one proxy per node and Ray's
/// tested scale is 2,000 nodes per cluster, so an answer over either is not a real
/// cluster's (a broken or hostile dashboard) and is [`DashboardError::Malformed`]:
/// refused whole, rather than published in part or parsed at any cost. (20,000 kept up to
/// 130 MB per cluster alive; what answers hold in all is bounded by
/// `live::dashboards::MEMORY_BUDGET_BYTES` too.)
pub(crate) const MAX_PROXIES: usize = 5_000;

/// The most targets the `target_groups` of one answer may list, all groups and protocols
/// together: a proxy per node, and with direct ingress an HTTP and a gRPC target per
/// ingress replica (see [`MAX_PROXIES`]).
pub(crate) const MAX_TARGETS: usize = 20_000;

/// The most dashboard answers read (and waiting to be parsed) at once, over all
/// clusters: each buffers up to [`MAX_BODY_BYTES`], so bodies in memory stay under
/// 8 × 8 MiB however many clusters there are. Waiting is first come, first served
/// (tokio's semaphore is fair); a read holds its turn for at most the dashboard timeout
/// and then one parse, which builds only the fields read (see `Shape`) and so costs
/// about a scan of the body.
pub(crate) const MAX_READS_AT_ONCE: usize = 8;

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
    /// Where the Serve HTTP proxies listen (see the module doc), sorted by address, each
    /// address once.
    pub http_proxies: Vec<HttpProxy>,
    /// The port of every node's Serve gRPC proxy: `grpc_options.port`, when
    /// `grpc_options.grpc_servicer_functions` lists any (Ray runs no gRPC server without
    /// one, though it still reports the port).
    pub grpc_port: Option<u16>,
    /// The IP address the answer came from (the dashboard's, as connected to): the
    /// network its discovered proxies are expected in. `None` from [`parse`] alone.
    pub answered_from: Option<std::net::IpAddr>,
    /// Ray's direct ingress: each application's ingress replicas
    /// (`live::target_groups`).
    pub ingress: super::target_groups::DirectIngress,
}

/// A Serve HTTP proxy to send requests to, read from `target_groups` and `proxies`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpProxy {
    pub address: SocketAddr,
    /// The Ray node it runs on; empty for a target that no entry of `proxies` owns.
    pub node_id: String,
    /// `Head` when it runs on the controller's node (a heuristic, see the module doc).
    pub node_type: NodeType,
    /// Its status in `proxies`; `None` for a target that no entry of `proxies` owns.
    pub status: Option<ProxyStatus>,
}

/// One Serve application.
#[derive(Debug, Clone, PartialEq)]
pub struct Application {
    pub status: AppStatus,
    /// `None` when the application has no HTTP route (`route_prefix: null`).
    pub route_prefix: Option<String>,
    /// Ray's explanation of the status; empty when there is none.
    pub message: String,
    /// What it can carry here (see `capacity`); `None` when the answer does not say.
    pub capacity: Option<Capacity>,
    /// When it was last deployed (`last_deployed_time_s`, unix seconds): a redeploy is a
    /// new version. `None` when the answer does not say (or says garbage).
    pub deployed_at: Option<f64>,
    /// `DEPLOYING` only to change how many replicas run (see [`Application::serves`]).
    pub resizing: bool,
    /// A digest of the application's config as deployed (`deployed_app_config`): a new
    /// version changes it; a `target_capacity` change (KubeRay's incremental upgrade
    /// redeploys the same config with it, which moves `last_deployed_time_s`) does not.
    /// `None` when the answer does not give it.
    pub config_digest: Option<String>,
}

impl Application {
    /// Whether it serves its requests here: `RUNNING`, or `DEPLOYING` only to change how
    /// many replicas run. Ray Serve 2.60 reports an application `DEPLOYING` while a
    /// raised `target_capacity` (KubeRay's incremental upgrade) or `num_replicas` starts
    /// more replicas (its deployments `UPSCALING`), for as long as they take to be placed
    /// and start, while the replicas already RUNNING serve on; a new version rolling out
    /// (a deployment `UPDATING`), a failure, or a deployment with no replica RUNNING is
    /// not that.
    pub fn serves(&self) -> bool {
        self.status == AppStatus::Running || (self.status == AppStatus::Deploying && self.resizing)
    }
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
    pub(crate) fn as_str(&self) -> &str {
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
    /// About what this status costs in memory (strings and a per-entry overhead), for
    /// the dashboards' memory budget.
    pub fn estimated_bytes(&self) -> usize {
        // String headers (24 bytes each), enum tags and the map's nodes.
        const ENTRY: usize = 128;
        // Each application's name and status are kept twice: here, and in the poller's
        // per-cluster view of statuses and since when.
        let apps: usize = self
            .applications
            .iter()
            .map(|(name, a)| {
                2 * (ENTRY + name.len() + a.status.as_str().len())
                    + a.message.len()
                    + a.route_prefix.as_ref().map_or(0, String::len)
            })
            .sum();
        let proxies: usize = self
            .proxies
            .iter()
            .map(|(key, p)| {
                ENTRY + key.len() + p.node_id.len() + p.node_ip.len() + p.status.as_str().len()
            })
            .sum();
        let http: usize = self
            .http_proxies
            .iter()
            .map(|p| ENTRY + p.node_id.len())
            .sum();
        std::mem::size_of::<Self>() + apps + proxies + http + self.ingress.estimated_bytes()
    }

    /// True when there is at least one application and every one serves
    /// ([`Application::serves`]: `RUNNING`, or only resizing).
    pub fn all_serving(&self) -> bool {
        !self.applications.is_empty() && self.applications.values().all(Application::serves)
    }

    /// True when there is at least one application and every one is `RUNNING` (what
    /// KubeRay checks).
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

    /// The status of the proxy listening at `address`, else of the proxy on its IP (when
    /// several proxies share an IP, as in tests on one host, the address tells them
    /// apart).
    pub fn proxy_status_at(&self, address: SocketAddr) -> Option<&ProxyStatus> {
        self.http_proxies
            .binary_search_by_key(&address, |p| p.address)
            .ok()
            .and_then(|i| self.http_proxies[i].status.as_ref())
            .or_else(|| self.proxy_status_by_ip(&address.ip().to_string()))
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
    /// A good answer that would take more than this cluster's share of the memory
    /// answers may hold (`live::dashboards`).
    #[error("dashboard answer refused: {0}")]
    OverBudget(String),
}

impl DashboardError {
    /// A fixed label for metrics: `unreachable`, `timeout`, `status`, `malformed` or
    /// `over_budget`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            DashboardError::Unreachable(_) => "unreachable",
            DashboardError::Timeout => "timeout",
            DashboardError::Status(_) => "status",
            DashboardError::Malformed(_) => "malformed",
            DashboardError::OverBudget(_) => "over_budget",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse::*;
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::{json, Map, Value};
    use std::net::IpAddr;
    use std::time::Duration;

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
        // The one target, on the controller's node: the head.
        assert_eq!(
            s.http_proxies,
            [HttpProxy {
                address: "192.0.2.2:8000".parse().unwrap(),
                node_id: NODE_ID.into(),
                node_type: NodeType::Head,
                status: Some(ProxyStatus::Healthy),
            }]
        );
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
                // One RUNNING replica of one, 5 requests at a time.
                capacity: Some(Capacity {
                    ready: 5,
                    full: Some(5)
                }),
                deployed_at: Some(1795966897.9371948),
                resizing: false,
                // SHA-256 of the fixture's `deployed_app_config` bytes as written, as
                // Python's hashlib gives it: the same on every replica and version.
                config_digest: Some("08ae6767030c0aa0".into()),
            }
        );
        assert_eq!(s.applications.len(), 1);
        assert!(s.all_running());
        assert_eq!(s.route_prefixes(), BTreeSet::from(["/hello".to_string()]));
        the_one_healthy_proxy(&s);
    }

    /// A redeploy of the same config with another `target_capacity` (KubeRay's
    /// incremental upgrade) moves the deploy time, not the config's digest; a changed
    /// config changes it.
    #[test]
    fn the_config_digest_follows_the_config_not_the_deploy_time_or_target_capacity() {
        let mut doc: serde_json::Value =
            serde_json::from_slice(&fixture!("02-running.json")).unwrap();
        let digest = |doc: &serde_json::Value| {
            parse(&serde_json::to_vec(doc).unwrap())
                .unwrap()
                .applications["hello"]
                .config_digest
                .clone()
                .unwrap()
        };
        let first = digest(&doc);
        doc["target_capacity"] = json!(50);
        doc["applications"]["hello"]["last_deployed_time_s"] = json!(1.9e9);
        assert_eq!(digest(&doc), first);
        doc["applications"]["hello"]["deployed_app_config"]["args"] = json!({"model": "v2"});
        assert_ne!(digest(&doc), first);
        // Not an object: no digest (and so no version to compare).
        for garbage in [json!("{garbage"), json!(null), json!([1])] {
            doc["applications"]["hello"]["deployed_app_config"] = garbage;
            let s = parse(&serde_json::to_vec(&doc).unwrap()).unwrap();
            assert_eq!(s.applications["hello"].config_digest, None);
        }
        // A config nested past serde_json's recursion limit (128) is digested all the
        // same: it never refuses the answer.
        let deep = format!("{}1{}", "[".repeat(5_000), "]".repeat(5_000));
        let body = String::from_utf8(fixture!("02-running.json"))
            .unwrap()
            .replacen(
                r#""import_path": "apps:hello""#,
                &format!(r#""import_path": "apps:hello", "args": {deep}"#),
                1,
            );
        let s = parse(body.as_bytes()).expect("a deep config is read");
        assert!(s.applications["hello"].config_digest.is_some());
    }

    /// Ray 2.60 with gRPC servicers: every proxy's gRPC port; with none, no gRPC (Ray
    /// still reports the port, and runs no server on it).
    #[test]
    fn reads_the_grpc_port_only_when_servicers_are_set() {
        let s = parse(&fixture!("grpc/06-two-nodes-running.json")).unwrap();
        assert_eq!(s.grpc_port, Some(55447));
        assert_eq!(s.http_proxies.len(), 2, "gRPC targets are not HTTP proxies");
        assert!(s.http_proxies.iter().all(|p| p.address.port() == 38701));
        let s = parse(&fixture!("grpc/00-grpc-no-servicers.json")).unwrap();
        assert_eq!(s.grpc_port, None);
        assert_eq!(parse(&fixture!("02-running.json")).unwrap().grpc_port, None);
        // Garbage: a port out of range or not a number, servicers not a list.
        let mut v: serde_json::Value =
            serde_json::from_slice(&fixture!("grpc/01-running.json")).unwrap();
        for port in [
            serde_json::json!(0),
            serde_json::json!(70000),
            serde_json::json!("x"),
        ] {
            v["grpc_options"]["port"] = port;
            assert_eq!(parse(v.to_string().as_bytes()).unwrap().grpc_port, None);
        }
        v["grpc_options"]["port"] = 9000.into();
        v["grpc_options"]["grpc_servicer_functions"] = "a.b.c".into();
        assert_eq!(parse(v.to_string().as_bytes()).unwrap().grpc_port, None);
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
                capacity: None,
                deployed_at: None,
                resizing: false,
                config_digest: None,
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

    // HTTP proxies from `target_groups` and `proxies`, on variants of 02-running.json.

    const WORKER_ID: &str = "f00dfeed";

    fn running() -> Value {
        serde_json::from_slice(&fixture!("02-running.json")).unwrap()
    }

    /// Adds a worker node's proxy with `status` on `ip` to `proxies` (not to targets).
    fn add_worker(v: &mut Value, node_id: &str, ip: &str, status: &str) {
        v["proxies"][node_id] = serde_json::json!({
            "node_id": node_id,
            "node_ip": ip,
            "node_instance_id": "",
            "actor_id": "0123",
            "actor_name": format!("SERVE_PROXY_ACTOR-{node_id}"),
            "worker_id": "4567",
            "log_file_path": format!("/serve/proxy_{ip}.log"),
            "status": status,
        });
    }

    /// Adds a target to the first (HTTP) target group.
    fn add_target(v: &mut Value, target: Value) {
        v["target_groups"][0]["targets"]
            .as_array_mut()
            .unwrap()
            .push(target);
    }

    fn http(v: &Value) -> Vec<(String, NodeType, Option<String>)> {
        parse(v.to_string().as_bytes())
            .unwrap()
            .http_proxies
            .into_iter()
            .map(|p| {
                (
                    p.address.to_string(),
                    p.node_type,
                    p.status.map(|s| s.to_string()),
                )
            })
            .collect()
    }

    fn healthy(address: &str, node_type: NodeType) -> (String, NodeType, Option<String>) {
        (address.into(), node_type, Some("HEALTHY".into()))
    }

    /// Parsing keeps every listed address: discovery refuses them (see
    /// `live::discovery`), where the refusal is counted and shown.
    #[test]
    fn addresses_that_are_never_a_proxy_are_kept_for_discovery_to_refuse() {
        let mut v = running();
        let before = http(&v);
        for ip in [
            "169.254.169.254",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "fe80::1",
        ] {
            add_target(
                &mut v,
                serde_json::json!({"ip": ip, "port": 80, "instance_id": "", "name": ""}),
            );
        }
        assert_eq!(http(&v).len(), before.len() + 5);
    }

    #[test]
    fn no_serve_has_no_http_proxies() {
        let s = parse(&fixture!("01-no-serve.json")).unwrap();
        assert!(s.http_proxies.is_empty());
    }

    #[test]
    fn two_proxies_head_and_worker() {
        let mut v = running();
        add_worker(&mut v, WORKER_ID, "192.0.2.3", "HEALTHY");
        add_target(
            &mut v,
            serde_json::json!({"ip": "192.0.2.3", "port": 8000, "instance_id": "",
                               "name": format!("SERVE_PROXY_ACTOR-{WORKER_ID}")}),
        );
        assert_eq!(
            http(&v),
            [
                healthy("192.0.2.2:8000", NodeType::Head),
                healthy("192.0.2.3:8000", NodeType::Worker)
            ]
        );
        let s = parse(v.to_string().as_bytes()).unwrap();
        assert_eq!(s.http_proxies[1].node_id, WORKER_ID);
    }

    #[test]
    fn a_starting_or_draining_proxy_outside_the_targets_is_listed_at_the_http_port() {
        let mut v = running();
        add_worker(&mut v, "starting-node", "192.0.2.3", "STARTING");
        add_worker(&mut v, "draining-node", "192.0.2.4", "DRAINING");
        v["http_options"]["port"] = 8123.into();
        // The targets keep the port Ray listed them with.
        assert_eq!(
            http(&v),
            [
                healthy("192.0.2.2:8000", NodeType::Head),
                (
                    "192.0.2.3:8123".into(),
                    NodeType::Worker,
                    Some("STARTING".into())
                ),
                (
                    "192.0.2.4:8123".into(),
                    NodeType::Worker,
                    Some("DRAINING".into())
                ),
            ]
        );
        let s = parse(v.to_string().as_bytes()).unwrap();
        assert_eq!(
            s.proxy_status_at("192.0.2.4:8123".parse().unwrap()),
            Some(&ProxyStatus::Draining)
        );
        // Without http_options, Ray's default port.
        v.as_object_mut().unwrap().remove("http_options");
        assert_eq!(http(&v)[1].0, "192.0.2.3:8000");
        // The head left the targets too (draining): still listed, still the head.
        v["target_groups"][0]["targets"] = serde_json::json!([]);
        assert_eq!(http(&v)[0], healthy("192.0.2.2:8000", NodeType::Head));
    }

    #[test]
    fn grpc_groups_are_skipped_and_targets_deduplicated() {
        let mut v = running();
        let mut grpc = v["target_groups"][0].clone();
        grpc["protocol"] = "gRPC".into();
        grpc["targets"][0]["port"] = 9000.into();
        grpc["targets"][0]["ip"] = "192.0.2.9".into();
        let per_app = v["target_groups"][0].clone();
        v["target_groups"].as_array_mut().unwrap().push(grpc);
        v["target_groups"].as_array_mut().unwrap().push(per_app);
        assert_eq!(http(&v), [healthy("192.0.2.2:8000", NodeType::Head)]);
    }

    #[test]
    fn several_proxies_on_one_ip_are_told_apart_by_name() {
        // As in tests on one host (Ray's TEST_WORKER_NODE_HTTP_PORT, or the simulator).
        let mut v = running();
        add_worker(&mut v, WORKER_ID, "192.0.2.2", "HEALTHY");
        add_target(
            &mut v,
            serde_json::json!({"ip": "192.0.2.2", "port": 8001,
                               "name": format!("SERVE_PROXY_ACTOR-{WORKER_ID}")}),
        );
        assert_eq!(
            http(&v),
            [
                healthy("192.0.2.2:8000", NodeType::Head),
                healthy("192.0.2.2:8001", NodeType::Worker)
            ]
        );
        let s = parse(v.to_string().as_bytes()).unwrap();
        assert_eq!(
            s.proxy_status_at("192.0.2.2:8001".parse().unwrap()),
            Some(&ProxyStatus::Healthy)
        );
    }

    #[test]
    fn a_target_no_proxy_owns_is_kept() {
        let mut v = running();
        add_target(&mut v, serde_json::json!({"ip": "192.0.2.7", "port": 8000}));
        add_target(&mut v, serde_json::json!({"ip": "192.0.2.2", "port": 8002}));
        let s = parse(v.to_string().as_bytes()).unwrap();
        let unowned = &s.http_proxies[2];
        assert_eq!(
            (unowned.address.to_string(), unowned.node_type),
            ("192.0.2.7:8000".into(), NodeType::Worker)
        );
        assert_eq!((unowned.node_id.as_str(), &unowned.status), ("", &None));
        // On the controller's IP, no name: the one proxy there owns it.
        assert_eq!(s.http_proxies[1].address.to_string(), "192.0.2.2:8002");
        assert_eq!(s.http_proxies[1].node_type, NodeType::Head);
    }

    #[test]
    fn without_controller_info_every_proxy_is_a_worker() {
        let mut v = running();
        v.as_object_mut().unwrap().remove("controller_info");
        assert_eq!(http(&v), [healthy("192.0.2.2:8000", NodeType::Worker)]);
        // With only the controller's IP, the IP decides.
        v["controller_info"] = serde_json::json!({"node_ip": "192.0.2.2"});
        assert_eq!(http(&v), [healthy("192.0.2.2:8000", NodeType::Head)]);
    }

    #[test]
    fn garbage_entries_are_skipped_alone() {
        let mut v = running();
        for bad in [
            serde_json::json!({"ip": "not-an-ip", "port": 8000}),
            serde_json::json!({"ip": "example.com", "port": 8000}),
            serde_json::json!({"ip": "192.0.2.5", "port": 70000}),
            serde_json::json!({"ip": "192.0.2.5", "port": 0}),
            serde_json::json!({"ip": "192.0.2.5", "port": -1}),
            serde_json::json!({"ip": "192.0.2.5", "port": "8000"}),
            serde_json::json!({"ip": "192.0.2.5", "port": 8000.5}),
            serde_json::json!({"ip": "192.0.2.5"}),
            serde_json::json!({"port": 8000}),
            serde_json::json!("192.0.2.5:8000"),
            Value::Null,
        ] {
            add_target(&mut v, bad);
        }
        add_target(
            &mut v,
            serde_json::json!({"ip": "2001:db8::1", "port": 8000}),
        );
        add_worker(&mut v, "bad-ip", "nowhere", "STARTING");
        v["target_groups"].as_array_mut().unwrap().extend([
            serde_json::json!(7),
            serde_json::json!({"protocol": "HTTP", "targets": "x"}),
        ]);
        let want = [
            healthy("192.0.2.2:8000", NodeType::Head),
            ("[2001:db8::1]:8000".into(), NodeType::Worker, None),
        ];
        assert_eq!(http(&v), want);
        // The proxy with a bad IP is still in `proxies` (its status is known).
        let s = parse(v.to_string().as_bytes()).unwrap();
        assert_eq!(s.proxies["bad-ip"].status, ProxyStatus::Starting);

        // A bad http_options.port: proxies outside the targets have no address.
        let mut v = running();
        add_worker(&mut v, WORKER_ID, "192.0.2.3", "STARTING");
        v["http_options"]["port"] = "eighty".into();
        assert_eq!(http(&v), [healthy("192.0.2.2:8000", NodeType::Head)]);

        // target_groups that is not a list: no targets, the proxies still count.
        let mut v = running();
        v["target_groups"] = serde_json::json!({"targets": []});
        assert_eq!(http(&v), [healthy("192.0.2.2:8000", NodeType::Head)]);
        v["target_groups"] = Value::Null;
        assert_eq!(http(&v), [healthy("192.0.2.2:8000", NodeType::Head)]);
    }

    /// The owner of a target as `parse` found it before [`Owners`]: a scan of every
    /// proxy per target (quadratic, kept here as the reference).
    fn owner_by_scan<'a>(
        proxies: &'a BTreeMap<String, ServeProxy>,
        actor_names: &BTreeMap<String, String>,
        name: &str,
        ip: IpAddr,
    ) -> Option<&'a ServeProxy> {
        let by_name = proxies.values().find(|p| {
            !name.is_empty() && actor_names.get(&p.node_id).map(String::as_str) == Some(name)
        });
        by_name.or_else(|| {
            let mut on_ip = proxies.values().filter(|p| ip_addr(&p.node_ip) == Some(ip));
            on_ip.next().filter(|_| on_ip.next().is_none())
        })
    }

    /// The maps give every target of every capture, and of a variant with shared IPs,
    /// shared actor names and unknown names, the owner the scan of every proxy gave.
    #[test]
    fn owners_match_a_scan_of_every_proxy() {
        let mut tricky = running();
        add_worker(&mut tricky, "w1", "192.0.2.3", "HEALTHY");
        add_worker(&mut tricky, "w2", "192.0.2.3", "STARTING");
        add_worker(&mut tricky, "w3", "192.0.2.4", "HEALTHY");
        add_worker(&mut tricky, "w4", "not-an-ip", "HEALTHY");
        add_worker(&mut tricky, "w5", "192.0.2.5", "HEALTHY");
        // w5 takes w3's actor name: the first in `proxies` order wins, as before.
        tricky["proxies"]["w5"]["actor_name"] = "SERVE_PROXY_ACTOR-w3".into();
        // A proxy keyed apart from its node id.
        add_worker(&mut tricky, "w6", "192.0.2.6", "HEALTHY");
        tricky["proxies"]["w6"]["node_id"] = "w6-real".into();
        for (ip, name) in [
            ("192.0.2.3", "SERVE_PROXY_ACTOR-w2"),
            ("192.0.2.3", ""),
            ("192.0.2.3", "SERVE_PROXY_ACTOR-nobody"),
            ("192.0.2.4", ""),
            ("192.0.2.5", "SERVE_PROXY_ACTOR-w3"),
            ("192.0.2.6", "SERVE_PROXY_ACTOR-w6"),
            ("192.0.2.9", ""),
            ("192.0.2.2", "SERVE_PROXY_ACTOR-w1"),
        ] {
            add_target(
                &mut tricky,
                serde_json::json!({"ip": ip, "port": 8000, "name": name}),
            );
        }
        let mut bodies: Vec<Vec<u8>> = vec![
            fixture!("01-no-serve.json"),
            fixture!("02-running.json"),
            fixture!("03-deploying.json"),
            fixture!("04-mixed-settled.json"),
            fixture!("05-unhealthy.json"),
        ];
        bodies.push(tricky.to_string().into_bytes());
        let mut compared = 0;
        for body in &bodies {
            let Value::Object(root) = serde_json::from_slice::<Value>(body).unwrap() else {
                panic!("a capture is an object")
            };
            let proxies = parse(body).unwrap().proxies;
            let actor_names: BTreeMap<String, String> = proxies
                .iter()
                .map(|(key, p)| {
                    let name = root["proxies"][key]["actor_name"].as_str().unwrap_or("");
                    (p.node_id.clone(), name.to_string())
                })
                .collect();
            let owners = Owners::new(&proxies, &actor_names);
            for target in http_targets(&root).filter_map(Value::as_object) {
                let Some(ip) = target.get("ip").and_then(Value::as_str).and_then(ip_addr) else {
                    continue;
                };
                let name = target.get("name").and_then(Value::as_str).unwrap_or("");
                assert_eq!(
                    owners.of(name, ip),
                    owner_by_scan(&proxies, &actor_names, name, ip),
                    "target {name:?} on {ip}"
                );
                compared += 1;
            }
        }
        assert!(compared >= 12, "only {compared} targets compared");
        // And the answer as a whole: w2 by name on the shared IP, the unnamed target
        // there unowned, w3 by name though w5 shares it, w4 by IP, w6 by its node id.
        let s = parse(tricky.to_string().as_bytes()).unwrap();
        let owner = |address: &str| {
            let address: SocketAddr = address.parse().unwrap();
            let p = s
                .http_proxies
                .iter()
                .find(|p| p.address == address)
                .unwrap();
            p.node_id.clone()
        };
        assert_eq!(owner("192.0.2.3:8000"), "w2");
        assert_eq!(owner("192.0.2.4:8000"), "w3");
        assert_eq!(owner("192.0.2.5:8000"), "w3");
        assert_eq!(owner("192.0.2.6:8000"), "w6-real");
        assert_eq!(owner("192.0.2.9:8000"), "");
    }

    /// The IP of proxy `i` of [`big_answer`]: distinct for each `i` under 2^24.
    fn big_answer_ip(i: usize) -> String {
        format!("10.{}.{}.{}", i >> 16, (i >> 8) & 0xff, i & 0xff)
    }

    /// An answer with `proxies` proxies on distinct IPs and `targets` targets, target `i`
    /// on proxy `i`'s IP: every other one named by its actor (so matched by name), the
    /// rest unnamed (so matched by IP).
    fn big_answer(proxies: usize, targets: usize) -> Vec<u8> {
        let ip = big_answer_ip;
        let proxy_entries: Map<String, Value> = (0..proxies)
            .map(|i| {
                let entry = serde_json::json!({
                    "node_id": format!("n{i}"),
                    "node_ip": ip(i),
                    "actor_name": format!("SERVE_PROXY_ACTOR-n{i}"),
                    "status": "HEALTHY",
                });
                (format!("n{i}"), entry)
            })
            .collect();
        let target_entries: Vec<Value> = (0..targets)
            .map(|i| {
                let name = if i % 2 == 0 {
                    format!("SERVE_PROXY_ACTOR-n{i}")
                } else {
                    String::new()
                };
                serde_json::json!({"ip": ip(i), "port": 8000, "name": name})
            })
            .collect();
        serde_json::json!({
            "controller_info": {"node_id": "n0", "node_ip": ip(0)},
            "proxies": Value::Object(proxy_entries),
            "target_groups": [{"protocol": "HTTP", "targets": target_entries}],
        })
        .to_string()
        .into_bytes()
    }

    /// An answer at both caps: every target matched to its proxy. Matching was
    /// quadratic (20,000 × 20,000 scans, minutes in a debug build); with the maps this
    /// finishes like any other test.
    #[test]
    fn an_answer_at_the_caps_matches_every_target_to_its_proxy() {
        // Targets past the proxies (direct ingress lists replicas too) are still read.
        let s = parse(&big_answer(MAX_PROXIES, MAX_TARGETS)).unwrap();
        assert_eq!(s.http_proxies.len(), MAX_TARGETS);
        let s = parse(&big_answer(MAX_PROXIES, MAX_PROXIES)).unwrap();
        assert_eq!(s.http_proxies.len(), MAX_PROXIES);
        let ip = big_answer_ip;
        let by_address: BTreeMap<SocketAddr, &HttpProxy> =
            s.http_proxies.iter().map(|p| (p.address, p)).collect();
        for i in 0..MAX_PROXIES {
            let address: SocketAddr = format!("{}:8000", ip(i)).parse().unwrap();
            let p = by_address[&address];
            assert_eq!(p.node_id, format!("n{i}"));
            assert_eq!(p.status, Some(ProxyStatus::Healthy));
            let want = if i == 0 {
                NodeType::Head
            } else {
                NodeType::Worker
            };
            assert_eq!(p.node_type, want);
        }
    }

    /// One proxy or one target over its cap and the whole answer is refused, naming the
    /// cap (the poller then keeps the last good answer, as for any malformed one). gRPC
    /// targets count too: with direct ingress they are replicas.
    #[test]
    fn an_answer_over_a_cap_is_malformed_naming_it() {
        // Refused as soon as the entry over the cap is read, not after the whole tree.
        let why = assert_malformed(&big_answer(MAX_PROXIES + 1, 1));
        assert!(
            why.contains(&format!("more than {MAX_PROXIES} proxies"))
                && why.contains(&format!("cap of {MAX_PROXIES}")),
            "{why}"
        );
        let why = assert_malformed(&big_answer(1, MAX_TARGETS + 1));
        assert!(
            why.contains(&format!("more than {MAX_TARGETS} targets"))
                && why.contains(&format!("cap of {MAX_TARGETS}")),
            "{why}"
        );
        // Over the cap in all, across groups.
        let mut v: Value = serde_json::from_slice(&big_answer(1, MAX_TARGETS)).unwrap();
        let group = v["target_groups"][0].clone();
        v["target_groups"].as_array_mut().unwrap().push(group);
        let why = assert_malformed(v.to_string().as_bytes());
        assert!(
            why.contains(&format!("{} targets listed", 2 * MAX_TARGETS)),
            "{why}"
        );
        let mut v: Value = serde_json::from_slice(&big_answer(1, MAX_TARGETS / 2)).unwrap();
        let mut grpc = v["target_groups"][0].clone();
        grpc["protocol"] = "gRPC".into();
        v["target_groups"]
            .as_array_mut()
            .unwrap()
            .push(grpc.clone());
        assert_eq!(parse(v.to_string().as_bytes()).unwrap().proxies.len(), 1);
        v["target_groups"].as_array_mut().unwrap().push(grpc);
        let why = assert_malformed(v.to_string().as_bytes());
        assert!(why.contains("targets listed"), "{why}");

        // Many tiny values (the tree, not the body, is what costs): refused before the
        // tree is built; commas inside strings are not values.
        let zeros = vec!["0"; MAX_JSON_VALUES].join(",");
        let why = assert_malformed(format!(r#"{{"applications":{{}},"x":[{zeros}]}}"#).as_bytes());
        assert!(why.contains("JSON values"), "{why}");
        let commas = ",".repeat(2 * MAX_JSON_VALUES);
        let ok = format!(r#"{{"applications":{{}},"x":"{commas}\\\",[{{"}}"#);
        assert!(parse(ok.as_bytes()).is_ok());
        assert_eq!(json_values_at_most(br#"[1,{"a":[2,"x,y"]}]"#, 100), 6);
    }

    /// Bulk in fields ray-xds never reads is skipped unbuilt (an
    /// answer of 390,000 ignored keys parsed for seconds and queued every other
    /// cluster's); strings are cut, overlong keys and too many applications refused.
    #[test]
    fn only_the_fields_read_are_built_and_strings_are_bounded() {
        let running = fixture!("02-running.json").to_vec();
        let mut v: Value = serde_json::from_slice(&running).unwrap();
        let junk: Map<String, Value> = (0..60_000)
            .map(|i| (format!("k{i}"), Value::from(i)))
            .collect();
        v["x"] = Value::Object(junk.clone());
        for app in v["applications"].as_object_mut().unwrap().values_mut() {
            app["x"] = Value::Object(junk.clone());
            for deployment in app["deployments"].as_object_mut().unwrap().values_mut() {
                deployment["x"] = Value::Object(junk.clone());
                deployment["replicas"][0]["x"] = Value::Object(junk.clone());
            }
        }
        // (The same serializer for both: a config's digest is of its bytes as sent.)
        let plain: Value = serde_json::from_slice(&running).unwrap();
        assert_eq!(
            parse(v.to_string().as_bytes()).unwrap(),
            parse(plain.to_string().as_bytes()).unwrap()
        );
        // Deployments are read (for capacity): more of one application than any has are
        // refused as they are read.
        let mut v: Value = serde_json::from_slice(&running).unwrap();
        for app in v["applications"].as_object_mut().unwrap().values_mut() {
            app["deployments"] = Value::Object(junk.clone());
        }
        let why = assert_malformed(v.to_string().as_bytes());
        assert!(why.contains("deployments of one application"), "{why}");

        let mut v: Value = serde_json::from_slice(&running).unwrap();
        let app = v["applications"]
            .as_object_mut()
            .unwrap()
            .values_mut()
            .next()
            .unwrap();
        app["message"] = Value::from("é".repeat(MAX_STRING_BYTES));
        v["applications"]["x".repeat(MAX_STRING_BYTES + 1)] = v["applications"]
            .as_object()
            .unwrap()
            .values()
            .next()
            .unwrap()
            .clone();
        // Bulk in a field read as a scalar is skipped unbuilt, read as null.
        let (name, _) = v["applications"]
            .as_object()
            .unwrap()
            .iter()
            .next()
            .unwrap();
        let name = name.clone();
        v["applications"][&name]["route_prefix"] = Value::Object(junk.clone());
        let s = parse(v.to_string().as_bytes()).unwrap();
        assert_eq!(s.applications[&name].route_prefix, None);
        assert_eq!(s.applications.len(), 1, "the overlong name is left out");
        let message = &s.applications.values().next().unwrap().message;
        assert_eq!(
            message.len(),
            MAX_STRING_BYTES,
            "cut at a character boundary"
        );

        let apps: Map<String, Value> = (0..=MAX_APPLICATIONS)
            .map(|i| (format!("app{i}"), serde_json::json!({"status": "RUNNING"})))
            .collect();
        let why = assert_malformed(
            serde_json::json!({ "applications": apps })
                .to_string()
                .as_bytes(),
        );
        assert!(why.contains("applications listed"), "{why}");
        // Containers of the wrong type are judged as before.
        assert_malformed(br#"{"applications": [1, 2]}"#);
        assert!(parse(br#"{"applications": {}, "target_groups": {"a": 1}}"#).is_ok());
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
            capacity: None,
            deployed_at: None,
            resizing: false,
            config_digest: None,
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
        let mut expected = parse(&fixture!("02-running.json")).unwrap();
        // The answer says where it came from (discovery's network check).
        expected.answered_from = Some(std::net::IpAddr::from([127, 0, 0, 1]));
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

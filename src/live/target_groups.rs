//! Ray Serve's direct ingress, as a dashboard answer's `target_groups` lists it.
//!
//! With `RAY_SERVE_ENABLE_DIRECT_INGRESS=1` Ray lists one target group per application and
//! protocol (`app_name`, `route_prefix`, `protocol` `HTTP` or `gRPC`,
//! `ingress_deployment_name`, `targets`): the application's RUNNING ingress replicas, each
//! on a port of its own (`SERVE_REPLICA::<app>#<deployment>#<id>`), or, while it has none,
//! the Serve proxies (Ray's fallback). Without direct ingress there is one group per
//! protocol, `app_name` empty, listing the proxies. Captures: `tests/fixtures/ray-serve-2.60/
//! direct-ingress/`.
//!
//! [`parse`] reads the groups of an answer already pruned to the fields it uses
//! (`dashboard::parse`) into [`DirectIngress`]:
//!
//! - direct ingress is on when some group names an application;
//! - a target is a replica when its `name` starts with [`REPLICA_PREFIX`] (Ray's actor name
//!   of a replica); any other target of a group is a proxy, left to `dashboard`'s proxy
//!   reading, so an application on the fallback has no replica here;
//! - replicas are kept per application and protocol, each address once, sorted; a target
//!   with garbage (an `ip` that is not an IP address, a port out of 1..=65535, a target that
//!   is not an object) is left out alone, as is a group of another protocol;
//! - an application name or route prefix is cut to `MAX_STRING_BYTES` by the pruning parse,
//!   like every string of an answer; what may be routed is `model`'s and `discovery`'s call
//!   (the model refuses names and prefixes long enough to have been cut).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use serde_json::{Map, Value};

use crate::model::Protocol;

// A string the pruning parse cut (to at least MAX_STRING_BYTES - 3 bytes, at a character
// boundary) is too long for the model: never routed as a shorter prefix.
const _: () = assert!(
    crate::model::MAX_ROUTE_PREFIX_BYTES + 4 <= crate::live::dashboard::MAX_STRING_BYTES
        && crate::model::MAX_APPLICATION_NAME_BYTES + 4 <= crate::live::dashboard::MAX_STRING_BYTES
);

/// How Ray names a replica's actor, and so its targets: `SERVE_REPLICA::<app>#...`.
pub(crate) const REPLICA_PREFIX: &str = "SERVE_REPLICA::";

/// Ray's direct ingress in one answer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DirectIngress {
    /// Ray lists target groups per application: direct ingress is on.
    pub on: bool,
    /// Application name → its ingress replicas, for every application a group names.
    pub apps: BTreeMap<String, AppTargets>,
}

/// One application's ingress replicas, per protocol; empty while the application is on
/// the proxies' target group (no RUNNING replica, or its ports not allocated yet).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AppTargets {
    /// The group's `route_prefix`.
    pub route_prefix: String,
    /// The group's `ingress_deployment_name`.
    pub ingress_deployment: String,
    /// HTTP ingress replicas (ports 30000+ by default), sorted by address.
    pub http: Vec<ReplicaTarget>,
    /// gRPC ingress replicas (ports 40000+ by default), sorted by address.
    pub grpc: Vec<ReplicaTarget>,
}

/// An ingress replica's port for one protocol.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReplicaTarget {
    pub address: SocketAddr,
    /// Ray's name for it: `SERVE_REPLICA::<app>#<deployment>#<id>`.
    pub name: String,
}

impl AppTargets {
    pub(crate) fn replicas(&self, protocol: Protocol) -> &[ReplicaTarget] {
        match protocol {
            Protocol::Http => &self.http,
            Protocol::Grpc => &self.grpc,
        }
    }

    fn replicas_mut(&mut self, protocol: Protocol) -> &mut Vec<ReplicaTarget> {
        match protocol {
            Protocol::Http => &mut self.http,
            Protocol::Grpc => &mut self.grpc,
        }
    }
}

impl DirectIngress {
    /// About what this costs in memory, for the dashboards' memory budget.
    pub fn estimated_bytes(&self) -> usize {
        const ENTRY: usize = 96;
        self.apps
            .iter()
            .map(|(name, app)| {
                ENTRY
                    + name.len()
                    + app.route_prefix.len()
                    + app.ingress_deployment.len()
                    + app
                        .http
                        .iter()
                        .chain(&app.grpc)
                        .map(|r| ENTRY + r.name.len())
                        .sum::<usize>()
            })
            .sum()
    }
}

/// The protocol a group's `protocol` names (`HTTP`, `gRPC`, any case), if it is one.
pub(crate) fn group_protocol(group: &Value) -> Option<Protocol> {
    let p = group.get("protocol").and_then(Value::as_str)?;
    if p.eq_ignore_ascii_case("http") {
        Some(Protocol::Http)
    } else if p.eq_ignore_ascii_case("grpc") {
        Some(Protocol::Grpc)
    } else {
        None
    }
}

/// Every target of every group, with its group's protocol (a group of no known protocol
/// gives none).
pub(crate) fn targets(root: &Map<String, Value>) -> impl Iterator<Item = (Protocol, &Value)> {
    root.get("target_groups")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|g| {
            let protocol = group_protocol(g)?;
            let targets = g.get("targets").and_then(Value::as_array)?;
            Some(targets.iter().map(move |t| (protocol, t)))
        })
        .flatten()
}

/// A target's address and name, if its address is one.
pub(crate) fn target_address(target: &Value) -> Option<(SocketAddr, &str)> {
    let target = target.as_object()?;
    let ip: IpAddr = target.get("ip")?.as_str()?.parse().ok()?;
    let port = target
        .get("port")?
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)?;
    let name = target.get("name").and_then(Value::as_str).unwrap_or("");
    Some((SocketAddr::new(ip, port), name))
}

/// Whether a target is an ingress replica (else it is a proxy).
pub(crate) fn is_replica(name: &str) -> bool {
    name.starts_with(REPLICA_PREFIX)
}

/// Direct ingress as `root`'s `target_groups` list it (see the module doc).
pub fn parse(root: &Map<String, Value>) -> DirectIngress {
    let mut out = DirectIngress::default();
    let groups = root.get("target_groups").and_then(Value::as_array);
    for group in groups.into_iter().flatten() {
        let Some(protocol) = group_protocol(group) else {
            continue;
        };
        let app_name = group.get("app_name").and_then(Value::as_str).unwrap_or("");
        if app_name.is_empty() {
            continue;
        }
        out.on = true;
        let app = out.apps.entry(app_name.to_string()).or_default();
        let text = |key| {
            group
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        if app.route_prefix.is_empty() {
            app.route_prefix = text("route_prefix");
        }
        if app.ingress_deployment.is_empty() {
            app.ingress_deployment = text("ingress_deployment_name");
        }
        let targets = group.get("targets").and_then(Value::as_array);
        let replicas = app.replicas_mut(protocol);
        for (address, name) in targets.into_iter().flatten().filter_map(target_address) {
            if is_replica(name) {
                replicas.push(ReplicaTarget {
                    address,
                    name: name.to_string(),
                });
            }
        }
    }
    for app in out.apps.values_mut() {
        for protocol in [Protocol::Http, Protocol::Grpc] {
            let replicas = app.replicas_mut(protocol);
            replicas.sort();
            replicas.dedup_by_key(|r| r.address);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::dashboard::{parse as parse_answer, ServeStatus};

    fn capture(name: &str) -> ServeStatus {
        let path = format!(
            "{}/tests/fixtures/ray-serve-2.60/direct-ingress/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        parse_answer(&std::fs::read(path).unwrap()).unwrap()
    }

    fn ports(replicas: &[ReplicaTarget]) -> Vec<u16> {
        replicas.iter().map(|r| r.address.port()).collect()
    }

    fn proxy_ports(s: &ServeStatus) -> Vec<u16> {
        s.http_proxies.iter().map(|p| p.address.port()).collect()
    }

    #[test]
    fn without_application_groups_direct_ingress_is_off_and_targets_are_proxies() {
        let s = capture("00-proxy-only.json");
        assert!(!s.ingress.on);
        assert!(s.ingress.apps.is_empty());
        assert_eq!(proxy_ports(&s), [18800]);
        let s = capture("06-grpc-proxy-only.json");
        assert!(!s.ingress.on);
        assert_eq!(proxy_ports(&s), [18800]);
    }

    #[test]
    fn an_application_on_the_fallback_has_no_replica_and_its_targets_stay_proxies() {
        let s = capture("01-deploying-fallback.json");
        assert!(s.ingress.on);
        assert_eq!(s.ingress.apps.keys().collect::<Vec<_>>(), ["echo", "work"]);
        for app in s.ingress.apps.values() {
            assert!(app.http.is_empty() && app.grpc.is_empty(), "{app:?}");
        }
        assert_eq!(s.ingress.apps["work"].route_prefix, "/work");
        assert_eq!(proxy_ports(&s), [18800]);
    }

    /// The merge this module exists to prevent: every application's replicas taken for
    /// proxies of the whole cluster (8 POSTs to `/work`, 6 answered by `echo`).
    #[test]
    fn each_application_gets_its_own_replicas_and_no_replica_is_a_proxy() {
        let s = capture("02-running.json");
        assert!(s.ingress.on);
        let (echo, work) = (&s.ingress.apps["echo"], &s.ingress.apps["work"]);
        assert_eq!(
            (ports(&echo.http), ports(&work.http)),
            (vec![30001], vec![30000])
        );
        assert_eq!(
            (echo.route_prefix.as_str(), work.route_prefix.as_str()),
            ("/", "/work")
        );
        assert_eq!(work.ingress_deployment, "Hello");
        assert!(work.http[0].name.starts_with("SERVE_REPLICA::work#Hello#"));
        // The proxy stays (from `proxies`), and only it.
        assert_eq!(proxy_ports(&s), [18800]);
    }

    #[test]
    fn a_redeploy_and_a_scale_up_change_the_replicas_ports() {
        let s = capture("04-redeploy-new-port.json");
        assert_eq!(ports(&s.ingress.apps["work"].http), [30002]);
        assert!(s.ingress.apps["broken"].http.is_empty());
        let s = capture("05-two-replicas-and-failed.json");
        assert_eq!(ports(&s.ingress.apps["work"].http), [30002, 30003]);
        assert_eq!(ports(&s.ingress.apps["echo"].http), [30001]);
        assert!(s.ingress.apps["broken"].http.is_empty());
        let s = capture("09-redeploy-draining-fallback.json");
        assert!(s.ingress.apps["work"].http.is_empty());
        assert_eq!(ports(&s.ingress.apps["echo"].http), [30000]);
        assert_eq!(proxy_ports(&s), [18800]);
    }

    #[test]
    fn grpc_replicas_are_kept_apart_from_http_ones() {
        let s = capture("08-grpc-running.json");
        let (echo, work) = (&s.ingress.apps["echo"], &s.ingress.apps["work"]);
        assert_eq!(
            (ports(&echo.http), ports(&echo.grpc)),
            (vec![30000], vec![40000])
        );
        assert_eq!(
            (ports(&work.http), ports(&work.grpc)),
            (vec![30001], vec![40001])
        );
        assert_eq!(proxy_ports(&s), [18800]);
        assert_eq!(s.grpc_port, Some(19900));
        let s = capture("07-grpc-deploying-fallback.json");
        assert!(s.ingress.apps.values().all(|a| a.grpc.is_empty()));
    }

    #[test]
    fn garbage_targets_are_left_out_alone_and_duplicates_counted_once() {
        let answer = serde_json::json!({
            "target_groups": [
                {"protocol": "HTTP", "app_name": "a", "route_prefix": "/a", "targets": [
                    {"ip": "10.0.0.1", "port": 30000, "name": "SERVE_REPLICA::a#A#1"},
                    {"ip": "10.0.0.1", "port": 30000, "name": "SERVE_REPLICA::a#A#1"},
                    {"ip": "not an ip", "port": 30001, "name": "SERVE_REPLICA::a#A#2"},
                    {"ip": "10.0.0.2", "port": 0, "name": "SERVE_REPLICA::a#A#3"},
                    {"ip": "10.0.0.2", "port": 70000, "name": "SERVE_REPLICA::a#A#4"},
                    {"ip": "10.0.0.2", "port": "30002", "name": "SERVE_REPLICA::a#A#5"},
                    "a string",
                    {"ip": "10.0.0.3", "port": 30003},
                    {"ip": "10.0.0.4", "port": 30004, "name": "SERVE_REPLICA::a#A#6"},
                ]},
                {"protocol": "UDP", "app_name": "b", "targets": [
                    {"ip": "10.0.0.5", "port": 30005, "name": "SERVE_REPLICA::b#B#1"}]},
                {"protocol": "gRPC", "app_name": "a", "targets": "not a list"},
                "not a group",
            ],
        });
        let s = parse_answer(answer.to_string().as_bytes()).unwrap();
        assert_eq!(s.ingress.apps.keys().collect::<Vec<_>>(), ["a"]);
        assert_eq!(ports(&s.ingress.apps["a"].http), [30000, 30004]);
        assert!(s.ingress.apps["a"].grpc.is_empty());
        // The unnamed target is a proxy's, as before direct ingress.
        assert_eq!(proxy_ports(&s), [30003]);
    }
}

//! The parts of Kubernetes objects ray-xds reads, decoded one object at a time.
//!
//! The watches deliver `DynamicObject`s, which decode whatever the API server sends; each
//! is then decoded here into the few fields we use. Unknown fields are ignored, so newer
//! KubeRay versions decode too, and one malformed object is an `Err` for that object only,
//! never for the whole list (a typed watch would fail the list and stall).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
use kube::api::DynamicObject;
use serde::Deserialize;

use crate::model::{check_application_name, check_route_prefix, Application};

/// `ray.io/v1` RayService, as far as ray-xds reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RayServiceObject {
    pub namespace: String,
    pub name: String,
    pub annotations: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub exclude_head_pod: bool,
    /// `metadata.creationTimestamp`, unix seconds: the older claim of a host wins.
    pub created: Option<i64>,
    pub active: Option<ClusterStatus>,
    pub pending: Option<ClusterStatus>,
    /// The applications `spec.serveConfigV2` deploys (name, route prefix), known before
    /// the cluster's dashboard answers; empty when the config names none or cannot be
    /// read ([`serve_config_applications`]).
    pub applications: Vec<Application>,
}

/// `status.activeServiceStatus` or `status.pendingServiceStatus`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    #[serde(default)]
    pub ray_cluster_name: Option<String>,
    /// Application statuses as KubeRay last saw them: a hint only. KubeRay blanks them
    /// during upgrades and while a head is down; absent means unknown.
    #[serde(default)]
    pub application_statuses: Option<BTreeMap<String, AppStatusHint>>,
    /// KubeRay's incremental upgrade: the percent of traffic its Gateway sends this
    /// cluster (set on the pending cluster's status).
    #[serde(default)]
    pub traffic_routed_percent: Option<i64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct AppStatusHint {
    #[serde(default)]
    pub status: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RayServiceData {
    #[serde(default)]
    spec: Option<RayServiceSpec>,
    #[serde(default)]
    status: Option<RayServiceStatus>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RayServiceSpec {
    #[serde(default)]
    exclude_head_pod_from_serve_svc: Option<bool>,
    /// The Serve config (YAML in a string) KubeRay deploys to the RayService's clusters.
    #[serde(default, rename = "serveConfigV2")]
    serve_config_v2: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RayServiceStatus {
    #[serde(default)]
    active_service_status: Option<ClusterStatus>,
    #[serde(default)]
    pending_service_status: Option<ClusterStatus>,
}

fn identity(obj: &DynamicObject) -> Result<(String, String), String> {
    let name = obj
        .metadata
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or("metadata.name is missing")?;
    let namespace = obj
        .metadata
        .namespace
        .clone()
        .filter(|n| !n.is_empty())
        .ok_or("metadata.namespace is missing")?;
    Ok((namespace, name))
}

impl RayServiceObject {
    pub fn decode(obj: &DynamicObject) -> Result<RayServiceObject, String> {
        let (namespace, name) = identity(obj)?;
        let data: RayServiceData =
            serde_json::from_value(obj.data.clone()).map_err(|e| e.to_string())?;
        let status = data.status.unwrap_or_default();
        let spec = data.spec.unwrap_or_default();
        Ok(RayServiceObject {
            namespace,
            name,
            annotations: obj.metadata.annotations.clone().unwrap_or_default(),
            labels: obj.metadata.labels.clone().unwrap_or_default(),
            exclude_head_pod: spec.exclude_head_pod_from_serve_svc.unwrap_or(false),
            applications: spec
                .serve_config_v2
                .as_deref()
                .map(serve_config_applications)
                .unwrap_or_default(),
            created: obj
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.timestamp()),
            active: status.active_service_status,
            pending: status.pending_service_status,
        })
    }

    pub fn key(&self) -> (String, String) {
        (self.namespace.clone(), self.name.clone())
    }
}

/// The longest `serveConfigV2` read for its applications (Kubernetes caps a whole object
/// at about 1.5 MiB).
pub(crate) const MAX_SERVE_CONFIG_BYTES: usize = 1 << 20;

/// The deepest nesting a Serve config may have: flow collections (`[`, `{`) open at once,
/// or compact block sequences (`- - -`) opened on one line. A YAML parser's time grows
/// with the square of the nesting (a 1 MiB `[[[[...` takes minutes), and one tenant's
/// RayService must not stall the source for all; a real config nests a few levels.
pub(crate) const MAX_SERVE_CONFIG_NESTING: usize = 64;

/// Whether `yaml` nests deeper than [`MAX_SERVE_CONFIG_NESTING`], counted over the text
/// without parsing it: brackets outside quotes and comments, and `- ` indicators at the
/// start of a line. It may over-count (brackets in a block scalar), which only costs the
/// hint.
fn too_deep(yaml: &str) -> bool {
    let mut depth = 0usize;
    for line in yaml.lines() {
        let compact = line
            .trim_start()
            .split_inclusive(' ')
            .take_while(|t| *t == "- " || t.trim().is_empty())
            .filter(|t| *t == "- ")
            .count();
        if compact > MAX_SERVE_CONFIG_NESTING {
            return true;
        }
        let mut quote: Option<char> = None;
        let mut previous = ' ';
        for c in line.chars() {
            match (quote, c) {
                (Some('"'), '\\') if previous != '\\' => {}
                (Some(q), c) if c == q && !(q == '"' && previous == '\\') => quote = None,
                (Some(_), _) => {}
                (None, '"' | '\'') if previous.is_whitespace() || "[{,:".contains(previous) => {
                    quote = Some(c)
                }
                (None, '#') if previous.is_whitespace() => break,
                (None, '[' | '{') => {
                    depth += 1;
                    if depth > MAX_SERVE_CONFIG_NESTING {
                        return true;
                    }
                }
                (None, ']' | '}') => depth = depth.saturating_sub(1),
                _ => {}
            }
            previous = if previous == '\\' && c == '\\' {
                ' '
            } else {
                c
            };
        }
    }
    false
}

/// The applications a Serve config (`serveConfigV2`, Ray's `ServeDeploySchema` as YAML)
/// deploys: each entry of `applications`, its `name` (Ray's default `default`) and
/// `route_prefix` (Ray's default `/`; `null` for none), as Ray would read them. Read
/// leniently, as a hint until the cluster's dashboard answers: a config that is not YAML
/// (serde_yaml's reading: a repeated key or a merge key makes it none), or over
/// [`MAX_SERVE_CONFIG_BYTES`], gives none; an integer name is its decimal string, as Ray
/// coerces it; an entry with another invalid name is left out, an invalid or repeated
/// route prefix dropped; at most 1,000 applications.
pub(crate) fn serve_config_applications(yaml: &str) -> Vec<Application> {
    if yaml.len() > MAX_SERVE_CONFIG_BYTES || too_deep(yaml) {
        return Vec::new();
    }
    let Ok(config) = serde_yaml::from_str::<serde_yaml::Value>(yaml) else {
        return Vec::new();
    };
    let entries = config
        .get("applications")
        .and_then(serde_yaml::Value::as_sequence)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let (mut names, mut prefixes) = (BTreeSet::new(), BTreeSet::new());
    let mut out = Vec::new();
    for entry in entries
        .iter()
        .take(crate::live::dashboard::MAX_APPLICATIONS)
    {
        if !entry.is_mapping() {
            continue;
        }
        // An integer name reaches Ray as a JSON number (KubeRay converts the YAML), which
        // Ray's schema coerces to its decimal string; any other non-string is left out.
        let name = match entry.get("name") {
            None => "default".to_string(),
            Some(serde_yaml::Value::String(n)) => n.clone(),
            Some(serde_yaml::Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
            Some(_) => continue,
        };
        if check_application_name(&name).is_err() || !names.insert(name.clone()) {
            continue;
        }
        let prefix = match entry.get("route_prefix") {
            None => Some("/"),
            Some(p) => p.as_str(),
        }
        .filter(|p| check_route_prefix(p).is_ok() && prefixes.insert(p.to_string()));
        out.push(Application {
            name,
            route_prefix: prefix.map(str::to_string),
            http_replicas: Vec::new(),
            grpc_replicas: Vec::new(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// A Ray pod, as far as ray-xds reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodObject {
    pub namespace: String,
    pub name: String,
    /// `ray.io/cluster`.
    pub cluster: String,
    /// `ray.io/node-type` is `head`.
    pub head: bool,
    /// `status.podIP`, when assigned.
    pub ip: Option<std::net::IpAddr>,
    /// `status.phase` is `Running`.
    pub running: bool,
    /// `metadata.deletionTimestamp` is set: the pod is terminating.
    pub terminating: bool,
    /// `spec.hostNetwork`: the pod shares its node's network namespace, so its IP is
    /// the node's (and any port on the node is reachable at it).
    pub host_network: bool,
    /// The container port named `serve` (8000 if none).
    pub serve_port: u16,
    /// The container port named `dashboard` (8265 if none).
    pub dashboard_port: u16,
    /// The container port named `serve-grpc` (KubeRay's convention for Ray Serve's gRPC
    /// proxy; KubeRay itself declares no gRPC port), or `grpc`; none: no gRPC.
    pub grpc_port: Option<u16>,
}

pub(crate) const CLUSTER_LABEL: &str = "ray.io/cluster";
pub(crate) const NODE_TYPE_LABEL: &str = "ray.io/node-type";
const DEFAULT_SERVE_PORT: u16 = 8000;
const DEFAULT_DASHBOARD_PORT: u16 = 8265;

#[derive(Debug, Default, Deserialize)]
struct PodData {
    #[serde(default)]
    spec: Option<PodSpec>,
    #[serde(default)]
    status: Option<PodStatus>,
}

impl PodObject {
    pub fn decode(obj: &DynamicObject) -> Result<PodObject, String> {
        let (namespace, name) = identity(obj)?;
        let labels = obj.metadata.labels.clone().unwrap_or_default();
        let cluster = labels
            .get(CLUSTER_LABEL)
            .cloned()
            .ok_or("label ray.io/cluster is missing")?;
        let data: PodData = serde_json::from_value(obj.data.clone()).map_err(|e| e.to_string())?;
        let status = data.status.unwrap_or_default();
        let named_port = |wanted: &str| {
            data.spec
                .iter()
                .flat_map(|s| &s.containers)
                .flat_map(|c| c.ports.iter().flatten())
                .find(|p| p.name.as_deref() == Some(wanted))
                .map(|p| u16::try_from(p.container_port))
        };
        let serve_port = match named_port("serve") {
            Some(Ok(p)) if p > 0 => p,
            Some(_) => return Err("container port `serve` is out of range".into()),
            None => DEFAULT_SERVE_PORT,
        };
        let dashboard_port = match named_port("dashboard") {
            Some(Ok(p)) if p > 0 => p,
            Some(_) => return Err("container port `dashboard` is out of range".into()),
            None => DEFAULT_DASHBOARD_PORT,
        };
        let grpc_port = match named_port("serve-grpc").or_else(|| named_port("grpc")) {
            Some(Ok(p)) if p > 0 => Some(p),
            Some(_) => return Err("container port `serve-grpc` is out of range".into()),
            None => None,
        };
        let ip = match status.pod_ip.as_deref().filter(|s| !s.is_empty()) {
            Some(text) => Some(
                text.parse()
                    .map_err(|_| format!("status.podIP {text:?} is not an IP address"))?,
            ),
            None => None,
        };
        Ok(PodObject {
            namespace,
            name,
            cluster,
            head: labels.get(NODE_TYPE_LABEL).map(String::as_str) == Some("head"),
            ip,
            running: status.phase.as_deref() == Some("Running"),
            terminating: obj.metadata.deletion_timestamp.is_some(),
            host_network: data
                .spec
                .as_ref()
                .and_then(|s| s.host_network)
                .unwrap_or(false),
            serve_port,
            dashboard_port,
            grpc_port,
        })
    }

    pub fn key(&self) -> (String, String) {
        (self.namespace.clone(), self.name.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn dynamic(value: serde_json::Value) -> DynamicObject {
        serde_json::from_value(value).unwrap()
    }

    fn sample_rayservice() -> serde_json::Value {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/kuberay-1.7/ray-service.sample.yaml"
        ))
        .unwrap();
        let mut v: serde_json::Value = serde_yaml::from_str(&text).unwrap();
        v["metadata"]["namespace"] = json!("ml");
        v
    }

    #[test]
    fn the_serve_config_names_the_applications_as_ray_reads_it() {
        let r = RayServiceObject::decode(&dynamic(sample_rayservice())).unwrap();
        let apps: Vec<(&str, Option<&str>)> = r
            .applications
            .iter()
            .map(|a| (a.name.as_str(), a.route_prefix.as_deref()))
            .collect();
        assert_eq!(
            apps,
            [("fruit_app", Some("/fruit")), ("math_app", Some("/calc"))]
        );
        let read = |yaml: &str| -> Vec<(String, Option<String>)> {
            serve_config_applications(yaml)
                .into_iter()
                .map(|a| (a.name, a.route_prefix))
                .collect()
        };
        // Ray's defaults: name `default`, route prefix `/`; `null` is no route.
        assert_eq!(
            read("applications: [ { import_path: a:b } ]"),
            [("default".to_string(), Some("/".to_string()))]
        );
        assert_eq!(
            read("applications: [ { name: x, route_prefix: null } ]"),
            [("x".to_string(), None)]
        );
        // Bad input: nothing, or the bad entry alone.
        for bad in ["", "[", "applications: 3", "applications: [ 1, 2 ]", "{{{"] {
            assert!(read(bad).is_empty(), "{bad}");
        }
        assert_eq!(
            read("applications: [ { name: a, route_prefix: no-slash }, { name: [x] }, { name: b, route_prefix: /a }, { name: c, route_prefix: /a }, { name: b } ]"),
            [
                ("a".to_string(), None),
                ("b".to_string(), Some("/a".to_string())),
                ("c".to_string(), None)
            ]
        );
        // An integer name is Ray's decimal string of it; a float or a boolean is left out.
        assert_eq!(
            read("applications: [ { name: 7, route_prefix: /seven }, { name: 1.5 }, { name: true } ]"),
            [("7".to_string(), Some("/seven".to_string()))]
        );
        // What serde_yaml refuses (a repeated key) gives none: the dashboard will say.
        assert!(read("applications: [ { name: a, name: b } ]").is_empty());
        assert!(read(&"x".repeat(MAX_SERVE_CONFIG_BYTES + 1)).is_empty());
        // A billion laughs is refused, not expanded.
        let laughs =
            "a: &a [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n\
                      b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n\
                      d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n\
                      f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n\
                      h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\ni: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]\n\
                      applications: [ { name: x } ]\n";
        assert!(read(laughs).is_empty());
    }

    proptest::proptest! {
        /// Whatever text a RayService's serve config holds, reading it never panics, and
        /// what it gives passes the model's own checks.
        #[test]
        fn any_serve_config_reads_without_panicking(
            yaml in "(applications:|name:|route_prefix:|- |  |\\n|\\[|\\]|\\{|\\}|&a|\\*a|\"|'|#|/|x|1|null|,|: )*"
        ) {
            for app in serve_config_applications(&yaml) {
                proptest::prop_assert!(crate::model::check_application_name(&app.name).is_ok());
                if let Some(p) = &app.route_prefix {
                    proptest::prop_assert!(crate::model::check_route_prefix(p).is_ok());
                }
            }
        }
    }

    /// Nesting deeper than a real config's is refused before a parser sees it (its time
    /// grows with the square of the depth); brackets in quotes and comments do not count.
    #[test]
    fn a_serve_config_nested_too_deep_is_refused_unparsed() {
        let read = |yaml: &str| -> Vec<String> {
            serve_config_applications(yaml)
                .into_iter()
                .map(|a| a.name)
                .collect()
        };
        let app = "applications:\n  - name: a\n    route_prefix: /a\n";
        let deep = |n: usize| format!("{app}x: {}{}\n", "[".repeat(n), "]".repeat(n));
        assert_eq!(read(&deep(MAX_SERVE_CONFIG_NESTING)), ["a"]);
        assert!(read(&deep(MAX_SERVE_CONFIG_NESTING + 1)).is_empty());
        // 1 MiB of it, refused without parsing.
        assert!(read(&deep(MAX_SERVE_CONFIG_BYTES / 2 - 64)).is_empty());
        let compact = |n: usize| format!("{app}x:\n  {}1\n", "- ".repeat(n));
        assert_eq!(read(&compact(MAX_SERVE_CONFIG_NESTING)), ["a"]);
        assert!(read(&compact(MAX_SERVE_CONFIG_NESTING + 1)).is_empty());
        let (square, curly) = ("[".repeat(200), "{".repeat(200));
        let quoted = format!("{app}  - name: \"{square}\"\n  - name: '{curly}'\n# {square}\n");
        let mut names = read(&quoted);
        names.sort();
        assert_eq!(names, ["[".repeat(200), "a".into(), "{".repeat(200)]);
    }

    #[test]
    fn decodes_the_kuberay_sample_with_an_upgrade_status() {
        let mut v = sample_rayservice();
        v["spec"]["excludeHeadPodFromServeSvc"] = json!(true);
        v["status"] = json!({
            "activeServiceStatus": {
                "rayClusterName": "rayservice-sample-raycluster-abcde",
                "applicationStatuses": {"fruit_app": {"status": "RUNNING", "healthLastUpdateTime": "2026-01-01T00:00:00Z"}},
                "targetCapacity": 100,
            },
            "pendingServiceStatus": {"rayClusterName": "rayservice-sample-raycluster-fghij"},
            "conditions": [{"type": "UpgradeInProgress", "status": "True"}],
            "observedGeneration": 2,
        });
        let r = RayServiceObject::decode(&dynamic(v)).unwrap();
        assert_eq!(r.key(), ("ml".into(), "rayservice-sample".into()));
        assert!(r.exclude_head_pod);
        let active = r.active.unwrap();
        assert_eq!(
            active.ray_cluster_name.as_deref(),
            Some("rayservice-sample-raycluster-abcde")
        );
        assert_eq!(
            active.application_statuses.unwrap()["fruit_app"]
                .status
                .as_deref(),
            Some("RUNNING")
        );
        let pending = r.pending.unwrap();
        assert!(pending.application_statuses.is_none(), "absent is unknown");
    }

    #[test]
    fn a_malformed_rayservice_is_an_error_for_that_object() {
        let mut v = sample_rayservice();
        v["status"] = json!({"activeServiceStatus": "not an object"});
        let err = RayServiceObject::decode(&dynamic(v)).unwrap_err();
        assert!(err.contains("invalid type"), "{err}");
        let mut v = sample_rayservice();
        v["spec"]["excludeHeadPodFromServeSvc"] = json!("yes please");
        assert!(RayServiceObject::decode(&dynamic(v)).is_err());
    }

    fn pod() -> serde_json::Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "rs-head-x", "namespace": "ml",
                "labels": {"ray.io/cluster": "rs-raycluster-abcde", "ray.io/node-type": "head", "ray.io/is-ray-node": "yes"}},
            "spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray:2.60.0",
                "ports": [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                          {"containerPort": 8000, "name": "serve"}]}]},
            "status": {"phase": "Running", "podIP": "10.1.2.3"}
        })
    }

    #[test]
    fn decodes_a_kuberay_pod() {
        let p = PodObject::decode(&dynamic(pod())).unwrap();
        assert_eq!(p.cluster, "rs-raycluster-abcde");
        assert!(p.head && p.running && !p.terminating && !p.host_network);
        assert_eq!(p.ip, Some("10.1.2.3".parse().unwrap()));
        assert_eq!((p.serve_port, p.dashboard_port), (8000, 8265));
        assert_eq!(p.grpc_port, None, "no gRPC port named: no gRPC");

        let mut v = pod();
        v["spec"]["containers"][0]["ports"] = json!([
            {"containerPort": 8123, "name": "serve"},
            {"containerPort": 9123, "name": "serve-grpc"}
        ]);
        v["metadata"]["deletionTimestamp"] = json!("2026-11-29T10:00:00Z");
        v["metadata"]["labels"]["ray.io/node-type"] = json!("worker");
        v["status"] = json!({"phase": "Pending"});
        let p = PodObject::decode(&dynamic(v)).unwrap();
        assert_eq!(p.serve_port, 8123);
        assert_eq!(p.grpc_port, Some(9123));
        assert!(!p.head && !p.running && p.terminating && p.ip.is_none());
    }

    /// A hostNetwork pod's podIP is its node's address; the flag travels with
    /// the pod so that the address policy can refuse it.
    #[test]
    fn decodes_host_network() {
        for (value, want) in [
            (json!(true), true),
            (json!(false), false),
            (serde_json::Value::Null, false),
        ] {
            let mut v = pod();
            v["spec"]["hostNetwork"] = value.clone();
            let p = PodObject::decode(&dynamic(v)).unwrap();
            assert_eq!(p.host_network, want, "{value}");
        }
        let mut v = pod();
        v["spec"]["hostNetwork"] = json!("yes");
        assert!(PodObject::decode(&dynamic(v)).is_err(), "a malformed flag");
    }

    #[test]
    fn a_malformed_pod_is_an_error_for_that_pod() {
        for bad in [
            json!({"spec": "garbage"}),
            json!({"status": {"podIP": "not-an-ip", "phase": "Running"}}),
            json!({"spec": {"containers": [{"name": "c", "ports": [{"containerPort": 70000, "name": "serve"}]}]}}),
        ] {
            let mut v = pod();
            for (k, val) in bad.as_object().unwrap() {
                v[k] = val.clone();
            }
            assert!(PodObject::decode(&dynamic(v.clone())).is_err(), "{v}");
        }
        let mut v = pod();
        v["metadata"]["labels"] = json!({});
        assert!(PodObject::decode(&dynamic(v))
            .unwrap_err()
            .contains("ray.io/cluster"));
    }
}

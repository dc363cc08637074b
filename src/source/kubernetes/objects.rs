//! The parts of Kubernetes objects ray-xds reads, decoded one object at a time.
//!
//! The watches deliver `DynamicObject`s, which decode whatever the API server sends; each
//! is then decoded here into the few fields we use. Unknown fields are ignored, so newer
//! KubeRay versions decode too, and one malformed object is an `Err` for that object only,
//! never for the whole list (a typed watch would fail the list and stall).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PodSpec, PodStatus};
use kube::api::DynamicObject;
use serde::Deserialize;

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
        Ok(RayServiceObject {
            namespace,
            name,
            annotations: obj.metadata.annotations.clone().unwrap_or_default(),
            labels: obj.metadata.labels.clone().unwrap_or_default(),
            exclude_head_pod: data
                .spec
                .and_then(|s| s.exclude_head_pod_from_serve_svc)
                .unwrap_or(false),
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

pub const CLUSTER_LABEL: &str = "ray.io/cluster";
pub const NODE_TYPE_LABEL: &str = "ray.io/node-type";
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

    /// Issue 13: a hostNetwork pod's podIP is its node's address; the flag travels with
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

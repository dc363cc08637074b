//! KubeRay's objects as the fake API server serves them: the sample RayService (from
//! `tests/fixtures/kuberay-1.7/`) and Ray pods labelled as KubeRay labels them.

use std::net::SocketAddr;

use ray_serve_sim::NodeType;
use serde_json::{json, Value};

use super::project_root;

/// The sample RayService's namespace, as the tests apply it.
pub const NAMESPACE: &str = "default";
/// The sample RayService's name (`metadata.name` in the fixture).
pub const NAME: &str = "rayservice-sample";

/// The KubeRay sample RayService, routed on every host, with the given status.
pub fn rayservice(active: Option<&str>, pending: Option<&str>) -> Value {
    let text = std::fs::read_to_string(
        project_root().join("tests/fixtures/kuberay-1.7/ray-service.sample.yaml"),
    )
    .unwrap();
    let mut v: Value = serde_yaml::from_str(&text).unwrap();
    v["metadata"]["namespace"] = json!(NAMESPACE);
    v["metadata"]["annotations"] = json!({"ray-xds.io/hosts": "*"});
    let status = |c: Option<&str>| c.map(|c| json!({"rayClusterName": c}));
    v["status"] = json!({
        "activeServiceStatus": status(active),
        "pendingServiceStatus": status(pending),
    });
    v
}

/// A Ray pod as KubeRay makes it: labels, named container ports, Running with an IP.
pub fn ray_pod(
    name: &str,
    cluster: &str,
    node_type: NodeType,
    serve: SocketAddr,
    dashboard_port: u16,
) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {
                "ray.io/cluster": cluster,
                "ray.io/node-type": node_type.as_str(),
                "ray.io/is-ray-node": "yes",
                "ray.io/group": if node_type == NodeType::Head { "headgroup" } else { "small-group" },
                "ray.io/originated-from-crd": "RayService",
                "ray.io/originated-from-cr-name": NAME,
            },
        },
        "spec": {"containers": [{
            "name": if node_type == NodeType::Head { "ray-head" } else { "ray-worker" },
            "image": "rayproject/ray:2.60.0",
            "ports": [
                {"containerPort": 6379, "name": "gcs-server", "protocol": "TCP"},
                {"containerPort": dashboard_port, "name": "dashboard", "protocol": "TCP"},
                {"containerPort": 10001, "name": "client", "protocol": "TCP"},
                {"containerPort": serve.port(), "name": "serve", "protocol": "TCP"},
            ],
        }]},
        "status": {"phase": "Running", "podIP": serve.ip().to_string(), "podIPs": [{"ip": serve.ip().to_string()}]},
    })
}

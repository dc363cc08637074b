//! The Kubernetes manifests in `deploy/` (`kubectl apply -k deploy/`) and the Envoy
//! bootstraps they carry.
//!
//! - every document parses into its k8s-openapi type, and nothing in it is dropped on the
//!   way (k8s-openapi ignores unknown fields, so a typo such as `readinessProb` would
//!   otherwise pass): the typed object, serialized back, must hold every field path of the
//!   original;
//! - `kustomization.yaml` lists exactly the manifests there are;
//! - RBAC is read-only on RayServices and pods; the Deployments are hardened and wired to
//!   their ConfigMaps, ports and probes; the Services select them;
//! - ray-xds's config file in its ConfigMap loads with ray-xds's own loader;
//! - both Envoy bootstraps (the gateway's and `deploy/sidecar/`'s) pass the real Envoy
//!   1.40's `--mode validate`, and, rendered for loopback, carry requests through an
//!   in-process ray-xds to simulated Ray Serve proxies.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PodSpec, Probe, Service, ServiceAccount,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use ray_serve_sim::NodeType;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use support::*;

const NAMESPACE: &str = "ray-xds";
/// Not a Kubernetes object: an Envoy bootstrap, checked by Envoy itself.
const SIDECAR_BOOTSTRAP: &str = "sidecar/envoy-sidecar-bootstrap.yaml";
const KUSTOMIZATION: &str = "kustomization.yaml";
/// Where Envoys find ray-xds: its Service in its namespace.
const XDS_HOST: &str = "ray-xds.ray-xds.svc.cluster.local";
const DEADLINE: Duration = Duration::from_secs(30);

fn deploy_dir() -> PathBuf {
    project_root().join("deploy")
}

// ---- reading the manifests ----

/// Every YAML file under `deploy/`, relative to it, sorted.
fn yaml_files() -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            ) {
                let relative = path.strip_prefix(root).unwrap();
                out.push(relative.to_str().unwrap().replace('\\', "/"));
            }
        }
    }
    let mut files = Vec::new();
    walk(&deploy_dir(), &deploy_dir(), &mut files);
    files.sort();
    files
}

/// The Kubernetes manifests: every YAML file but the kustomization and the sidecar bootstrap.
fn manifest_files() -> Vec<String> {
    yaml_files()
        .into_iter()
        .filter(|f| f != KUSTOMIZATION && f != SIDECAR_BOOTSTRAP)
        .collect()
}

/// The documents of a YAML stream, as JSON (empty documents skipped).
fn documents(text: &str) -> Result<Vec<Value>, String> {
    let mut docs = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let yaml = serde_yaml::Value::deserialize(doc).map_err(|e| format!("document {i}: {e}"))?;
        if yaml.is_null() {
            continue;
        }
        docs.push(serde_json::to_value(&yaml).map_err(|e| format!("document {i}: {e}"))?);
    }
    Ok(docs)
}

/// One Kubernetes object (boxed: the types differ a lot in size).
#[derive(Debug)]
enum Object {
    Namespace(Box<Namespace>),
    ServiceAccount(Box<ServiceAccount>),
    ClusterRole(Box<ClusterRole>),
    ClusterRoleBinding(Box<ClusterRoleBinding>),
    ConfigMap(Box<ConfigMap>),
    Deployment(Box<Deployment>),
    Service(Box<Service>),
    PodDisruptionBudget(Box<PodDisruptionBudget>),
}

impl Object {
    /// Parses one document into the k8s-openapi type its `kind` names.
    fn parse(doc: &Value) -> Result<Object, String> {
        let kind = doc["kind"].as_str().ok_or("no `kind`")?;
        Ok(match kind {
            "Namespace" => Object::Namespace(typed(doc)?),
            "ServiceAccount" => Object::ServiceAccount(typed(doc)?),
            "ClusterRole" => Object::ClusterRole(typed(doc)?),
            "ClusterRoleBinding" => Object::ClusterRoleBinding(typed(doc)?),
            "ConfigMap" => Object::ConfigMap(typed(doc)?),
            "Deployment" => Object::Deployment(typed(doc)?),
            "Service" => Object::Service(typed(doc)?),
            "PodDisruptionBudget" => Object::PodDisruptionBudget(typed(doc)?),
            other => return Err(format!("unknown kind {other:?}")),
        })
    }

    fn kind(&self) -> &'static str {
        match self {
            Object::Namespace(_) => "Namespace",
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::ConfigMap(_) => "ConfigMap",
            Object::Deployment(_) => "Deployment",
            Object::Service(_) => "Service",
            Object::PodDisruptionBudget(_) => "PodDisruptionBudget",
        }
    }

    fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            Object::Namespace(o) => &o.metadata,
            Object::ServiceAccount(o) => &o.metadata,
            Object::ClusterRole(o) => &o.metadata,
            Object::ClusterRoleBinding(o) => &o.metadata,
            Object::ConfigMap(o) => &o.metadata,
            Object::Deployment(o) => &o.metadata,
            Object::Service(o) => &o.metadata,
            Object::PodDisruptionBudget(o) => &o.metadata,
        }
    }

    fn name(&self) -> &str {
        self.metadata().name.as_deref().unwrap_or("")
    }

    fn cluster_scoped(&self) -> bool {
        matches!(
            self,
            Object::Namespace(_) | Object::ClusterRole(_) | Object::ClusterRoleBinding(_)
        )
    }
}

/// Parses `doc` as `T` and checks that nothing was dropped: `T`, serialized back, must
/// hold every field path of `doc` with the same value.
fn typed<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<T, String> {
    let parsed: T = serde_path_to_error::deserialize(doc).map_err(|e| {
        format!(
            "field `{}`: {}",
            e.path(),
            e.inner().to_string().replace('\n', " ")
        )
    })?;
    let back = serde_json::to_value(&parsed).map_err(|e| e.to_string())?;
    match first_difference(doc, &back, "") {
        Some(problem) => Err(problem),
        None => Ok(parsed),
    }
}

/// The first field path of `original` that `round_trip` lacks or holds differently.
fn first_difference(original: &Value, round_trip: &Value, path: &str) -> Option<String> {
    match (original, round_trip) {
        (Value::Object(o), Value::Object(r)) => o.iter().find_map(|(key, value)| {
            let path = field_path(path, key);
            match r.get(key) {
                None => Some(format!(
                    "`{path}` was dropped: not a field of this type (a typo?)"
                )),
                Some(back) => first_difference(value, back, &path),
            }
        }),
        (Value::Array(o), Value::Array(r)) if o.len() == r.len() => o
            .iter()
            .zip(r)
            .enumerate()
            .find_map(|(i, (o, r))| first_difference(o, r, &format!("{path}[{i}]"))),
        (o, r) if same_scalar(o, r) => None,
        (o, r) => Some(format!("`{path}` is {o} but reads back as {r}")),
    }
}

/// Equal, or the same text: a number read into a string type (a `Quantity` such as
/// `cpu: 1`) reads back as a string.
fn same_scalar(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(n), Value::String(s)) | (Value::String(s), Value::Number(n)) => {
            n.to_string() == *s
        }
        _ => a == b,
    }
}

fn field_path(parent: &str, key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match (parent.is_empty(), plain) {
        (true, true) => key.to_string(),
        (false, true) => format!("{parent}.{key}"),
        (_, false) => format!("{parent}[{key:?}]"),
    }
}

struct Manifest {
    /// `file#document`, for messages.
    origin: String,
    doc: Value,
    object: Object,
}

/// Every document of every manifest, parsed and checked; panics naming the first bad one.
fn manifests() -> Vec<Manifest> {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for file in manifest_files() {
        let text = std::fs::read_to_string(deploy_dir().join(&file)).unwrap();
        let docs = match documents(&text) {
            Ok(d) => d,
            Err(e) => {
                errors.push(format!("deploy/{file}: {e}"));
                continue;
            }
        };
        for (i, doc) in docs.into_iter().enumerate() {
            let origin = format!("deploy/{file}#{i}");
            match Object::parse(&doc) {
                Ok(object) => out.push(Manifest {
                    origin,
                    doc,
                    object,
                }),
                Err(e) => errors.push(format!("{origin}: {e}")),
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    out
}

fn find<'a>(all: &'a [Manifest], kind: &str, name: &str) -> &'a Object {
    &all.iter()
        .find(|m| m.object.kind() == kind && m.object.name() == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/"))
        .object
}

fn deployment<'a>(all: &'a [Manifest], name: &str) -> &'a Deployment {
    match find(all, "Deployment", name) {
        Object::Deployment(d) => d,
        _ => unreachable!(),
    }
}

fn config_map<'a>(all: &'a [Manifest], name: &str) -> &'a ConfigMap {
    match find(all, "ConfigMap", name) {
        Object::ConfigMap(c) => c,
        _ => unreachable!(),
    }
}

fn service<'a>(all: &'a [Manifest], name: &str) -> &'a Service {
    match find(all, "Service", name) {
        Object::Service(s) => s,
        _ => unreachable!(),
    }
}

fn pod_spec(d: &Deployment) -> &PodSpec {
    d.spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .expect("a pod spec")
}

fn pod_labels(d: &Deployment) -> &BTreeMap<String, String> {
    d.spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.as_ref())
        .expect("pod template labels")
}

fn only_container(d: &Deployment) -> &Container {
    let containers = &pod_spec(d).containers;
    assert_eq!(containers.len(), 1, "{:?}", d.metadata.name);
    &containers[0]
}

fn container_port(c: &Container, name: &str) -> i32 {
    c.ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("container {} has no port named {name}", c.name))
        .container_port
}

fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    assert!(
        selector.match_expressions.is_none(),
        "only matchLabels here"
    );
    selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v))
}

/// The file a ConfigMap key is mounted as, if `path` is one: `(configmap name, key)`.
fn mounted_config_map(pod: &PodSpec, c: &Container, path: &str) -> Option<(String, String)> {
    let path = Path::new(path);
    let (dir, file) = (path.parent()?, path.file_name()?.to_str()?);
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == dir && m.sub_path.is_none())?;
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)?;
    let source = volume.config_map.as_ref()?;
    // With `items` the file is the item's path; without, the key itself.
    let key = match &source.items {
        Some(items) => items.iter().find(|i| i.path == file)?.key.clone(),
        None => file.to_string(),
    };
    Some((source.name.clone(), key))
}

fn http_probe(probe: &Option<Probe>) -> (&str, &IntOrString) {
    let get = probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("an httpGet probe");
    (get.path.as_deref().unwrap_or(""), &get.port)
}

fn is_port(port: &IntOrString, c: &Container, name: &str) -> bool {
    match port {
        IntOrString::String(s) => s == name,
        IntOrString::Int(n) => *n == container_port(c, name),
    }
}

/// The hardening every container here has, at pod or container level.
fn assert_hardened(d: &Deployment, uid: i64) {
    let name = d.metadata.name.as_deref().unwrap();
    let pod = pod_spec(d).security_context.clone().unwrap_or_default();
    let c = only_container(d);
    let sc = c.security_context.clone().unwrap_or_default();
    assert_eq!(
        sc.run_as_non_root.or(pod.run_as_non_root),
        Some(true),
        "{name}: runAsNonRoot"
    );
    assert_eq!(
        sc.run_as_user.or(pod.run_as_user),
        Some(uid),
        "{name}: runAsUser"
    );
    assert_eq!(
        sc.read_only_root_filesystem,
        Some(true),
        "{name}: readOnlyRootFilesystem"
    );
    assert_eq!(
        sc.allow_privilege_escalation,
        Some(false),
        "{name}: allowPrivilegeEscalation"
    );
    assert_eq!(
        sc.capabilities.and_then(|c| c.drop),
        Some(vec!["ALL".to_string()]),
        "{name}: capabilities"
    );
    let seccomp = sc.seccomp_profile.or(pod.seccomp_profile).expect("seccomp");
    assert_eq!(seccomp.type_, "RuntimeDefault", "{name}: seccompProfile");
    let resources = c.resources.as_ref().expect("resources");
    for (what, set) in [
        ("requests", &resources.requests),
        ("limits", &resources.limits),
    ] {
        let set = set.as_ref().unwrap_or_else(|| panic!("{name}: no {what}"));
        for r in ["cpu", "memory"] {
            assert!(set.contains_key(r), "{name}: {what} without {r}");
        }
    }
}

/// Preferred anti-affinity on the node, against the Deployment's own pods.
fn assert_spread(d: &Deployment) {
    let name = d.metadata.name.as_deref().unwrap();
    let anti = pod_spec(d)
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .unwrap_or_else(|| panic!("{name}: no podAntiAffinity"));
    let terms = anti
        .preferred_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap_or_else(|| panic!("{name}: no preferred anti-affinity"));
    assert!(
        terms.iter().any(|t| {
            t.pod_affinity_term.topology_key == "kubernetes.io/hostname"
                && t.pod_affinity_term
                    .label_selector
                    .as_ref()
                    .is_some_and(|s| selects(s, pod_labels(d)))
        }),
        "{name}: no anti-affinity on kubernetes.io/hostname against its own pods"
    );
}

fn kustomization() -> serde_yaml::Mapping {
    let text = std::fs::read_to_string(deploy_dir().join(KUSTOMIZATION)).unwrap();
    serde_yaml::from_str(&text).unwrap()
}

fn ray_xds_config_text(all: &[Manifest]) -> String {
    config_map(all, "ray-xds-config")
        .data
        .as_ref()
        .and_then(|d| d.get("ray-xds.yaml"))
        .expect("ray-xds-config has ray-xds.yaml")
        .clone()
}

fn gateway_bootstrap_text(all: &[Manifest]) -> String {
    config_map(all, "envoy-gateway-bootstrap")
        .data
        .as_ref()
        .and_then(|d| d.get("bootstrap.yaml"))
        .expect("envoy-gateway-bootstrap has bootstrap.yaml")
        .clone()
}

fn sidecar_bootstrap_text() -> String {
    std::fs::read_to_string(deploy_dir().join(SIDECAR_BOOTSTRAP)).unwrap()
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

// ---- the manifests ----

#[test]
fn every_manifest_parses_as_its_kubernetes_type_with_nothing_dropped() {
    let all = manifests();
    let mut seen = BTreeSet::new();
    for m in &all {
        let (kind, name) = (m.object.kind(), m.object.name());
        assert!(!name.is_empty(), "{}: no metadata.name", m.origin);
        assert!(
            seen.insert((kind, name.to_string())),
            "{}: a second {kind} {name}",
            m.origin
        );
        let namespace = m.object.metadata().namespace.as_deref();
        if m.object.cluster_scoped() {
            assert_eq!(namespace, None, "{}: cluster-scoped", m.origin);
        } else {
            // Set in the file too, so `kubectl apply -f deploy/` works without kustomize.
            assert_eq!(namespace, Some(NAMESPACE), "{}", m.origin);
        }
    }
    let expected: BTreeSet<(&str, String)> = [
        ("Namespace", "ray-xds"),
        ("ServiceAccount", "ray-xds"),
        ("ClusterRole", "ray-xds"),
        ("ClusterRoleBinding", "ray-xds"),
        ("ConfigMap", "ray-xds-config"),
        ("Deployment", "ray-xds"),
        ("PodDisruptionBudget", "ray-xds"),
        ("Service", "ray-xds"),
        ("Service", "ray-xds-metrics"),
        ("ConfigMap", "envoy-gateway-bootstrap"),
        ("Deployment", "envoy-gateway"),
        ("PodDisruptionBudget", "envoy-gateway"),
        ("Service", "envoy-gateway"),
    ]
    .into_iter()
    .map(|(k, n)| (k, n.to_string()))
    .collect();
    assert_eq!(seen, expected);
}

#[test]
fn the_round_trip_check_catches_typos() {
    let all = manifests();
    let original = all
        .iter()
        .find(|m| m.object.kind() == "Deployment" && m.object.name() == "ray-xds")
        .unwrap()
        .doc
        .clone();
    // The untouched document passes.
    typed::<Deployment>(&original).unwrap();

    let mut doc = original.clone();
    let container = &mut doc["spec"]["template"]["spec"]["containers"][0];
    container["readinessProb"] = container["readinessProbe"].take();
    let err = typed::<Deployment>(&doc).unwrap_err();
    assert!(
        err.contains("`spec.template.spec.containers[0].readinessProb` was dropped"),
        "{err}"
    );

    let mut doc = original.clone();
    doc["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonroot"] =
        Value::Bool(true);
    let err = typed::<Deployment>(&doc).unwrap_err();
    assert!(
        err.contains("`spec.template.spec.containers[0].securityContext.runAsNonroot`"),
        "{err}"
    );

    // A key that is not an identifier is quoted; a wrong type names its field.
    let mut doc = original.clone();
    doc["spec"]["template"]["metadata"]["annotations"] = serde_json::json!({"a.b/c": 1});
    let err = typed::<Deployment>(&doc).unwrap_err();
    assert!(err.contains("spec.template.metadata.annotations"), "{err}");
    let mut doc = original;
    doc["spec"]["replicas"] = Value::String("two".into());
    let err = typed::<Deployment>(&doc).unwrap_err();
    assert!(err.contains("field `spec.replicas`"), "{err}");

    // Ports as numbers or names (IntOrString) and quantities as numbers compare equal.
    let svc = serde_json::json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
        "spec": {"ports": [{"port": 80, "targetPort": 8080}, {"port": 81, "targetPort": "http"}]}
    });
    typed::<Service>(&svc).unwrap();
    let quantities =
        serde_json::json!({"limits": {"cpu": 1, "memory": "1Gi"}, "requests": {"cpu": 2}});
    typed::<k8s_openapi::api::core::v1::ResourceRequirements>(&quantities).unwrap();
    assert!(field_path("metadata.annotations", "prometheus.io/port")
        .ends_with("[\"prometheus.io/port\"]"));

    // A wrong apiVersion and an unknown kind fail.
    let mut svc_v2 = svc.clone();
    svc_v2["apiVersion"] = "v2".into();
    assert!(Object::parse(&svc_v2).is_err());
    let mut ingress = svc;
    ingress["kind"] = "Ingres".into();
    assert_eq!(
        Object::parse(&ingress).unwrap_err(),
        "unknown kind \"Ingres\""
    );
}

#[test]
fn kustomization_lists_exactly_the_manifests() {
    let k = kustomization();
    let keys: BTreeSet<&str> = k.keys().filter_map(|k| k.as_str()).collect();
    assert_eq!(
        keys,
        BTreeSet::from(["apiVersion", "kind", "namespace", "resources"]),
        "unexpected (misspelt?) fields in kustomization.yaml"
    );
    assert_eq!(k["apiVersion"], "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k["kind"], "Kustomization");
    assert_eq!(k["namespace"], NAMESPACE);
    let listed: Vec<String> = k["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let unique: BTreeSet<&String> = listed.iter().collect();
    assert_eq!(unique.len(), listed.len(), "listed twice: {listed:?}");
    let files = manifest_files();
    let present: BTreeSet<&String> = files.iter().collect();
    let missing: Vec<_> = present.difference(&unique).collect();
    let extra: Vec<_> = unique.difference(&present).collect();
    assert!(missing.is_empty(), "not in kustomization.yaml: {missing:?}");
    assert!(extra.is_empty(), "listed but absent: {extra:?}");
}

/// `kubectl kustomize deploy/` (when kubectl is installed) renders exactly the objects of
/// the files, every namespaced one in `ray-xds`.
#[test]
fn kustomize_renders_every_object() {
    let out = match Command::new("kubectl")
        .arg("kustomize")
        .arg(deploy_dir())
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("kubectl not available ({e}): skipping the kustomize render");
            return;
        }
    };
    assert!(
        out.status.success(),
        "kubectl kustomize: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = documents(&String::from_utf8(out.stdout).unwrap()).unwrap();
    let mut objects = BTreeSet::new();
    for doc in &rendered {
        let object = Object::parse(doc).unwrap_or_else(|e| panic!("rendered {doc}: {e}"));
        if !object.cluster_scoped() {
            assert_eq!(object.metadata().namespace.as_deref(), Some(NAMESPACE));
        }
        objects.insert((object.kind(), object.name().to_string()));
    }
    let files: BTreeSet<_> = manifests()
        .iter()
        .map(|m| (m.object.kind(), m.object.name().to_string()))
        .collect();
    assert_eq!(objects, files);
}

#[test]
fn cluster_role_reads_rayservices_and_pods_and_nothing_else() {
    let all = manifests();
    let Object::ClusterRole(role) = find(&all, "ClusterRole", "ray-xds") else {
        unreachable!()
    };
    assert!(role.aggregation_rule.is_none());
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(rule.resource_names.is_none(), "{rule:?}");
        assert!(rule.non_resource_urls.is_none(), "{rule:?}");
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    granted.insert((group.as_str(), resource.as_str(), verb.as_str()));
                }
            }
        }
    }
    let mut expected = BTreeSet::new();
    for (group, resource) in [("ray.io", "rayservices"), ("", "pods")] {
        for verb in ["get", "list", "watch"] {
            expected.insert((group, resource, verb));
        }
    }
    assert_eq!(granted, expected);

    let Object::ClusterRoleBinding(binding) = find(&all, "ClusterRoleBinding", "ray-xds") else {
        unreachable!()
    };
    assert_eq!(binding.role_ref.api_group, "rbac.authorization.k8s.io");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(binding.role_ref.name, "ray-xds");
    let subjects = binding.subjects.as_ref().unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(subjects[0].name, "ray-xds");
    assert_eq!(subjects[0].namespace.as_deref(), Some(NAMESPACE));
    find(&all, "ServiceAccount", "ray-xds");
    assert_eq!(
        pod_spec(deployment(&all, "ray-xds"))
            .service_account_name
            .as_deref(),
        Some("ray-xds")
    );
}

#[test]
fn ray_xds_deployment_is_hardened_probed_spread_and_configured() {
    let all = manifests();
    let d = deployment(&all, "ray-xds");
    let spec = d.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2));
    assert!(selects(&spec.selector, pod_labels(d)));
    assert_hardened(d, 65532);
    assert_spread(d);
    let pod = pod_spec(d);
    // It lists and watches the API: it needs its token.
    assert_eq!(pod.automount_service_account_token, Some(true));

    let c = only_container(d);
    assert_eq!(c.image.as_deref(), Some("ghcr.io/ray-xds/ray-xds:0.1.0"));
    assert_eq!(container_port(c, "xds"), 18000);
    assert_eq!(container_port(c, "admin"), 19000);
    let (path, port) = http_probe(&c.liveness_probe);
    assert_eq!(path, "/healthz");
    assert!(is_port(port, c, "admin"), "{port:?}");
    let (path, port) = http_probe(&c.readiness_probe);
    assert_eq!(path, "/readyz");
    assert!(is_port(port, c, "admin"), "{port:?}");
    let env: BTreeMap<_, _> = c
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e.value.as_deref()))
        .collect();
    assert_eq!(env.get("RAY_XDS_LOG"), Some(&Some("info")));

    // The config file the args name is the ConfigMap's key, mounted there.
    let args = c.args.as_ref().unwrap();
    assert_eq!(args[..2], ["serve", "--config"]);
    assert_eq!(args.len(), 3);
    let (name, key) = mounted_config_map(pod, c, &args[2])
        .unwrap_or_else(|| panic!("{} is not a mounted ConfigMap key", args[2]));
    assert_eq!(
        (name.as_str(), key.as_str()),
        ("ray-xds-config", "ray-xds.yaml")
    );

    // The config's listen ports are the container's.
    let config: serde_yaml::Value = serde_yaml::from_str(&ray_xds_config_text(&all)).unwrap();
    let xds = config["xds"]["listen"].as_str().unwrap();
    let admin = config["admin"]["listen"].as_str().unwrap();
    assert!(xds.starts_with("0.0.0.0:") && admin.starts_with("0.0.0.0:"));
    assert_eq!(i32::from(port_of(xds)), container_port(c, "xds"));
    assert_eq!(i32::from(port_of(admin)), container_port(c, "admin"));
}

/// ray-xds's own loader (strict: an unknown field fails) takes the file in the ConfigMap.
#[test]
fn ray_xds_config_in_the_config_map_loads() {
    let all = manifests();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ray-xds.yaml");
    std::fs::write(&path, ray_xds_config_text(&all)).unwrap();
    let config = ray_xds::config::Config::load(&ray_xds::config::ServeArgs {
        config: Some(path),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("deploy/ray-xds-config.yaml: {e}"));
    assert_eq!(config.xds_listen, "0.0.0.0:18000".parse().unwrap());
    assert_eq!(config.admin_listen, "0.0.0.0:19000".parse().unwrap());
    assert_eq!(config.gateway.listener_port, 10000);
    match &config.source {
        ray_xds::config::SourceConfig::Kubernetes(k) => {
            assert!(k.namespaces.is_empty(), "all namespaces: {k:?}")
        }
        other => panic!("not the Kubernetes source: {other:?}"),
    }
}

#[test]
fn services_and_budgets_select_the_deployments_and_their_ports() {
    let all = manifests();
    let deployments: Vec<&Deployment> = all
        .iter()
        .filter_map(|m| match &m.object {
            Object::Deployment(d) => Some(&**d),
            _ => None,
        })
        .collect();
    let selected = |labels: &BTreeMap<String, String>, what: &str| -> &Deployment {
        let matching: Vec<_> = deployments
            .iter()
            .filter(|d| labels.iter().all(|(k, v)| pod_labels(d).get(k) == Some(v)))
            .collect();
        assert_eq!(
            matching.len(),
            1,
            "{what} selects {} Deployments",
            matching.len()
        );
        matching[0]
    };
    for m in &all {
        match &m.object {
            Object::Service(s) => {
                let spec = s.spec.as_ref().unwrap();
                let d = selected(spec.selector.as_ref().unwrap(), &m.origin);
                let c = only_container(d);
                for p in spec.ports.iter().flatten() {
                    match p.target_port.as_ref().expect("targetPort") {
                        IntOrString::String(name) => {
                            container_port(c, name);
                        }
                        IntOrString::Int(n) => assert!(
                            c.ports.iter().flatten().any(|cp| cp.container_port == *n),
                            "{}: no container port {n}",
                            m.origin
                        ),
                    }
                }
            }
            Object::PodDisruptionBudget(b) => {
                let spec = b.spec.as_ref().unwrap();
                let labels = spec
                    .selector
                    .as_ref()
                    .and_then(|s| s.match_labels.clone())
                    .unwrap();
                let d = selected(&labels, &m.origin);
                let replicas = d.spec.as_ref().unwrap().replicas.unwrap();
                // A budget that allows no eviction would block node drains.
                assert_eq!(spec.min_available, Some(IntOrString::Int(replicas - 1)));
            }
            _ => {}
        }
    }

    let port = |s: &Service, name: &str| {
        s.spec
            .as_ref()
            .unwrap()
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("{:?} has no port {name}", s.metadata.name))
            .clone()
    };
    let xds = service(&all, "ray-xds");
    assert_eq!(
        xds.spec.as_ref().unwrap().type_.as_deref(),
        Some("ClusterIP")
    );
    let grpc = port(xds, "grpc-xds");
    assert_eq!(grpc.port, 18000);
    assert_eq!(grpc.app_protocol.as_deref(), Some("grpc"));
    assert_eq!(grpc.target_port, Some(IntOrString::String("xds".into())));

    let metrics = service(&all, "ray-xds-metrics");
    let admin = port(metrics, "admin");
    assert_eq!(admin.port, 19000);
    assert_eq!(admin.target_port, Some(IntOrString::String("admin".into())));
    let annotations = metrics.metadata.annotations.as_ref().unwrap();
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], "19000");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");

    let gateway = service(&all, "envoy-gateway");
    let http = port(gateway, "http");
    assert_eq!(http.port, 80);
    assert_eq!(http.target_port, Some(IntOrString::String("http".into())));
}

#[test]
fn envoy_gateway_deployment_is_hardened_and_wired_to_its_bootstrap() {
    let all = manifests();
    let d = deployment(&all, "envoy-gateway");
    let spec = d.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(2));
    assert!(selects(&spec.selector, pod_labels(d)));
    assert_hardened(d, 101);
    assert_spread(d);
    let pod = pod_spec(d);
    assert_eq!(pod.automount_service_account_token, Some(false));
    let c = only_container(d);
    assert_eq!(c.image.as_deref(), Some("envoyproxy/envoy:v1.40.0"));

    // The bootstrap file the args name is the ConfigMap's.
    let args = c.args.as_ref().unwrap();
    let flag = |name: &str| {
        let i = args
            .iter()
            .position(|a| a == name)
            .unwrap_or_else(|| panic!("no {name} in {args:?}"));
        args[i + 1].as_str()
    };
    let (name, key) = mounted_config_map(pod, c, flag("-c")).expect("-c names a mounted file");
    assert_eq!(
        (name.as_str(), key.as_str()),
        ("envoy-gateway-bootstrap", "bootstrap.yaml")
    );
    // The node id is the pod's name, from the downward API.
    assert_eq!(flag("--service-node"), "$(POD_NAME)");
    assert_eq!(flag("--service-cluster"), "ray-xds-gateway");
    let pod_name = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "POD_NAME")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .expect("POD_NAME from a fieldRef");
    assert_eq!(pod_name.field_path, "metadata.name");

    let bootstrap: Value = serde_yaml::from_str(&gateway_bootstrap_text(&all)).unwrap();
    assert!(
        bootstrap.get("node").is_none(),
        "the node comes from the flags"
    );
    // Everything but two static pieces comes from ray-xds, over ADS.
    let dynamic = &bootstrap["dynamic_resources"];
    assert_eq!(dynamic["ads_config"]["api_type"], "GRPC");
    for ty in ["cds_config", "lds_config"] {
        assert!(dynamic[ty]["ads"].is_object(), "{ty}");
        assert_eq!(dynamic[ty]["initial_fetch_timeout"], "0s", "{ty}");
    }
    assert_xds_cluster(&bootstrap, &all);
    assert_eq!(
        bootstrap["admin"]["address"]["socket_address"]["address"],
        "127.0.0.1"
    );

    // The listener ray-xds sends is the container's `http` port and the Service's target.
    let config: serde_yaml::Value = serde_yaml::from_str(&ray_xds_config_text(&all)).unwrap();
    let gateway_port = config["gateway"]["http_listener"]["port"].as_i64().unwrap();
    assert_eq!(i64::from(container_port(c, "http")), gateway_port);

    // Readiness is Envoy's /ready, through the static health listener.
    let (path, port) = http_probe(&c.readiness_probe);
    assert_eq!(path, "/ready");
    assert!(is_port(port, c, "health"), "{port:?}");
    let health = static_listener(&bootstrap, "envoy-health");
    assert_eq!(
        health["address"]["socket_address"]["port_value"].as_i64(),
        Some(i64::from(container_port(c, "health")))
    );
    let annotations = d
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
        .unwrap();
    assert_eq!(
        annotations["prometheus.io/port"],
        container_port(c, "health").to_string()
    );
    // preStop sleeps for less than the grace period.
    let sleep = c
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|p| p.sleep.as_ref())
        .expect("a preStop sleep")
        .seconds;
    assert!(sleep < pod.termination_grace_period_seconds.unwrap());
}

fn static_listener<'a>(bootstrap: &'a Value, name: &str) -> &'a Value {
    bootstrap["static_resources"]["listeners"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("no static listener {name}"))
}

/// The bootstrap's `ray-xds` cluster: the ray-xds Service, HTTP/2 with keepalive.
fn assert_xds_cluster(bootstrap: &Value, all: &[Manifest]) {
    let dynamic = &bootstrap["dynamic_resources"];
    assert_eq!(dynamic["ads_config"]["transport_api_version"], "V3");
    let grpc = &dynamic["ads_config"]["grpc_services"][0]["envoy_grpc"];
    assert_eq!(grpc["cluster_name"], "ray-xds");
    let cluster = bootstrap["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "ray-xds")
        .expect("a ray-xds cluster");
    assert_eq!(cluster["type"], "STRICT_DNS");
    let address = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ["address"]["socket_address"];
    assert_eq!(address["address"], XDS_HOST);
    let svc = service(all, "ray-xds");
    assert_eq!(
        XDS_HOST,
        format!(
            "{}.{}.svc.cluster.local",
            svc.metadata.name.as_deref().unwrap(),
            svc.metadata.namespace.as_deref().unwrap()
        )
    );
    let svc_port = svc.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port;
    assert_eq!(address["port_value"].as_i64(), Some(i64::from(svc_port)));
    let http2 = &cluster["typed_extension_protocol_options"]
        ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
        ["http2_protocol_options"];
    assert!(
        http2["connection_keepalive"]["interval"].is_string(),
        "{cluster}"
    );
}

#[test]
fn sidecar_bootstrap_takes_clusters_and_routes_but_not_listeners() {
    let all = manifests();
    let bootstrap: Value = serde_yaml::from_str(&sidecar_bootstrap_text()).unwrap();
    let dynamic = &bootstrap["dynamic_resources"];
    assert!(dynamic["cds_config"]["ads"].is_object());
    assert!(
        dynamic.get("lds_config").is_none(),
        "no listeners from ray-xds"
    );
    assert_xds_cluster(&bootstrap, &all);
    let listener = static_listener(&bootstrap, "ray-serve-local");
    assert_eq!(
        listener["address"]["socket_address"],
        serde_json::json!({"address": "127.0.0.1", "port_value": 15080})
    );
    let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(
        hcm["rds"]["route_config_name"],
        ray_xds::translate::ROUTE_CONFIG_NAME
    );
    assert!(hcm["rds"]["config_source"]["ads"].is_object());
    assert_eq!(hcm["rds"]["config_source"]["resource_api_version"], "V3");
}

// ---- the real Envoy ----

/// A `--base-id` no other Envoy of this or another test process uses.
fn base_id() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    // pid * 64 + n, the scheme of support::Envoy (which this binary does not use).
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 64;
    std::process::id() * 64 + n
}

/// The gateway's Envoy command line from its Deployment, with the bootstrap at `config`,
/// `$(POD_NAME)` as `pod_name`, and without `--log-level` (the caller sets its own).
fn gateway_args(all: &[Manifest], config: &Path, pod_name: &str) -> Vec<String> {
    let args = only_container(deployment(all, "envoy-gateway"))
        .args
        .clone()
        .unwrap();
    let mut out = Vec::new();
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-c" => {
                it.next();
                out.push("-c".into());
                out.push(config.to_str().unwrap().into());
            }
            "--log-level" => {
                it.next();
            }
            _ => out.push(arg.replace("$(POD_NAME)", pod_name)),
        }
    }
    out
}

fn envoy_validate(args: &[String]) {
    let out = Command::new(envoy_binary())
        .args(args)
        .args(["--mode", "validate", "--log-level", "error"])
        .args(["--base-id", &base_id().to_string()])
        .stdin(Stdio::null())
        .output()
        .expect("running envoy");
    assert!(
        out.status.success(),
        "envoy --mode validate {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn gateway_bootstrap_passes_envoy_validation() {
    let all = manifests();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bootstrap.yaml");
    std::fs::write(&file, gateway_bootstrap_text(&all)).unwrap();
    // Exactly the Deployment's flags: node id and cluster come from them. (Validation
    // does not resolve the STRICT_DNS name, so cluster.local is fine here.)
    envoy_validate(&gateway_args(&all, &file, "envoy-gateway-7d9f-abcde"));
}

#[test]
fn sidecar_bootstrap_passes_envoy_validation() {
    let file = deploy_dir().join(SIDECAR_BOOTSTRAP);
    envoy_validate(&["-c".into(), file.to_str().unwrap().into()]);
}

/// A bootstrap from `deploy/` for loopback: ray-xds at 127.0.0.1:`xds_port`, and each
/// `port_value: from` as `to`.
fn render(text: &str, xds_port: u16, ports: &[(u16, u16)]) -> String {
    assert!(text.contains(XDS_HOST) && text.contains("port_value: 18000"));
    let mut out = text
        .replace(XDS_HOST, "127.0.0.1")
        .replace("port_value: 18000", &format!("port_value: {xds_port}"));
    for (from, to) in ports {
        let from = format!("port_value: {from}");
        assert!(out.contains(&from), "{from}");
        out = out.replace(&from, &format!("port_value: {to}"));
    }
    out
}

/// A real Envoy from a rendered bootstrap; its admin on `admin_port`.
struct RunningEnvoy {
    _process: ChildGuard,
    admin: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl RunningEnvoy {
    fn start(bootstrap: &str, admin_port: u16, args: impl Fn(&Path) -> Vec<String>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("bootstrap.yaml");
        std::fs::write(&config, bootstrap).unwrap();
        let log = dir.path().join("envoy.log");
        let process = spawn(
            "envoy",
            Command::new(envoy_binary())
                .args(args(&config))
                .args(["--base-id", &base_id().to_string()])
                .args(["--log-level", "info", "--log-path"])
                .arg(&log)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        RunningEnvoy {
            _process: process,
            admin: format!("http://127.0.0.1:{admin_port}"),
            log,
            _dir: dir,
        }
    }

    /// The port the named listener bound.
    async fn listener_port(&self, name: &str) -> u16 {
        let url = format!("{}/listeners?format=json", self.admin);
        eventually(&format!("Envoy binds {name}"), DEADLINE, || async {
            let (_, text) = http_get(&url).await.ok()?;
            let v: Value = serde_json::from_str(&text).ok()?;
            v["listener_statuses"]
                .as_array()?
                .iter()
                .find(|l| l["name"] == name)?["local_address"]["socket_address"]["port_value"]
                .as_u64()
                .map(|p| p as u16)
                .filter(|p| *p != 0)
        })
        .await
    }
}

impl Drop for RunningEnvoy {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("--- last lines of Envoy's log ---");
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// The Envoy ray-xds knows by `node_id`, from its /debug/clients.
async fn xds_client(admin: std::net::SocketAddr, node_id: &str) -> Value {
    eventually(
        &format!("{node_id} connected to ray-xds"),
        DEADLINE,
        || async {
            let v: Value = serde_json::from_str(&admin_get(admin, "/debug/clients").await).ok()?;
            v["clients"]
                .as_array()?
                .iter()
                .find(|c| c["node"]["id"] == node_id)
                .cloned()
        },
    )
    .await
}

/// The sidecar bootstrap, as is but for addresses, carries requests to a Ray Serve proxy
/// through routes and clusters from ray-xds, and never subscribes to listeners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_bootstrap_routes_through_ray_xds() {
    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&a])).unwrap();
    let xds = ray_xds::runtime::start(test_config(&services, 0), Default::default())
        .await
        .unwrap();

    let admin_port = free_port();
    let bootstrap = render(
        &sidecar_bootstrap_text(),
        xds.xds_addr.port(),
        &[(9901, admin_port), (15080, 0)],
    );
    let envoy = RunningEnvoy::start(&bootstrap, admin_port, |config| {
        vec!["-c".into(), config.to_str().unwrap().into()]
    });
    let port = envoy.listener_port("ray-serve-local").await;
    let served = eventually("a request through the sidecar", DEADLINE, || async {
        through_envoy(port).await
    })
    .await;
    assert_eq!(served.cluster, "demo-a");

    let client = xds_client(xds.admin_addr, "my-app-sidecar").await;
    let types = client["types"].as_object().unwrap();
    assert!(
        !types.contains_key("lds"),
        "subscribed to listeners: {client}"
    );
    assert_eq!(
        types["rds"]["subscribed"],
        serde_json::json!([ray_xds::translate::ROUTE_CONFIG_NAME])
    );
    for ty in ["cds", "eds", "rds"] {
        assert!(types[ty]["acks"].as_u64().unwrap() >= 1, "{ty}: {client}");
        assert_eq!(types[ty]["nacks"], 0, "{ty}: {client}");
    }
    // The gateway listener ray-xds builds never reached it.
    let (_, listeners) = http_get(&format!("{}/listeners", envoy.admin))
        .await
        .unwrap();
    assert!(!listeners.contains("ray-serve-http"), "{listeners}");
    xds.stop().await.unwrap();
}

/// The gateway bootstrap with the Deployment's own flags: /ready (through the health
/// listener, the kubelet's probe) is not 200 while ray-xds is away, past Envoy's default
/// 15 s initial fetch timeout, and turns 200 once ray-xds answers; then requests flow.
/// Only GET /ready and /stats/prometheus reach the admin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_bootstrap_is_ready_only_with_ray_xds_config() {
    let all = manifests();
    let xds_port = free_port();
    let admin_port = free_port();
    let bootstrap = render(
        &gateway_bootstrap_text(&all),
        xds_port,
        &[(9901, admin_port), (9902, 0)],
    );
    let started = Instant::now();
    let envoy = RunningEnvoy::start(&bootstrap, admin_port, |config| {
        gateway_args(&all, config, "envoy-gateway-test-0")
    });
    let health = envoy.listener_port("envoy-health").await;
    let ready = format!("http://127.0.0.1:{health}/ready");

    // No ray-xds yet: not ready (Envoy starts its workers, which accept on the health
    // listener, only once initialized; the kubelet counts a refused connection as not
    // ready, like a 503), and still not past the default 15 s initial fetch timeout.
    while started.elapsed() < Duration::from_secs(17) {
        if let Ok((status, body)) = http_get(&ready).await {
            assert_eq!(status, 503, "ready without ray-xds: {body}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&a])).unwrap();
    let mut config = test_config(&services, 0);
    config.xds_listen = format!("127.0.0.1:{xds_port}").parse().unwrap();
    let xds = ray_xds::runtime::start(config, Default::default())
        .await
        .unwrap();
    // Envoy reconnects within its 5 s maximum back-off.
    eventually("the gateway turns ready", DEADLINE, || async {
        (http_get(&ready).await.ok()?.0 == 200).then_some(())
    })
    .await;
    let (status, metrics) = http_get(&format!("http://127.0.0.1:{health}/stats/prometheus"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(metrics.contains("envoy_server_live"), "{metrics}");
    for (method, path) in [("GET", "/quitquitquit"), ("POST", "/ready"), ("GET", "/")] {
        let (status, _) = http(method, &format!("http://127.0.0.1:{health}{path}"), "")
            .await
            .unwrap();
        assert_eq!(status, 404, "{method} {path}");
    }
    let port = envoy.listener_port("ray-serve-http").await;
    let served = eventually("a request through the gateway", DEADLINE, || async {
        through_envoy(port).await
    })
    .await;
    assert_eq!(served.cluster, "demo-a");
    let client = xds_client(xds.admin_addr, "envoy-gateway-test-0").await;
    assert_eq!(client["node"]["cluster"], "ray-xds-gateway");
    xds.stop().await.unwrap();
}

//! The Kubernetes manifests in `deploy/` (`kubectl apply -k deploy/`) and the Envoy
//! bootstraps they carry.
//!
//! - every document parses into its k8s-openapi type, and nothing in it is dropped on the
//!   way (k8s-openapi ignores unknown fields, so a typo such as `readinessProb` would
//!   otherwise pass): the typed object, serialized back, must hold every field path of the
//!   original;
//! - `kustomization.yaml` (and `cert-manager/kustomization.yaml`) lists exactly the
//!   manifests there are;
//! - RBAC is read-only on RayServices and pods; the Deployments are hardened and wired to
//!   their ConfigMaps, Secrets, ports and probes; the Services select them;
//! - the NetworkPolicy, evaluated for pods of every kind that matters, lets only the
//!   gateway and labelled sidecars reach the xDS port, only `monitoring` the admin port,
//!   and ray-xds out only to DNS, the API server's ports and the Ray pods' ports;
//! - ray-xds's config file in its ConfigMap loads with ray-xds's own loader, and the TLS
//!   files it names are the Secret's keys where the Deployment projects them; the
//!   Envoys' SDS files name theirs, and watch the folder the kubelet swaps;
//! - the cert-manager objects (not Kubernetes types: checked as YAML for the fields
//!   cert-manager v1 requires) chain up to one CA and write the Secrets that are mounted,
//!   with the names the Envoys check;
//! - both Envoy bootstraps (the gateway's and `deploy/sidecar/`'s) pass the real Envoy
//!   1.40's `--mode validate`, and, rendered for loopback with their files laid out as the
//!   kubelet does, carry requests over mTLS through an in-process ray-xds (its TLS files
//!   where the Deployment puts them) to simulated Ray Serve proxies; a certificate renewed
//!   under a running Envoy (the kubelet's `..data` swap) is picked up without a restart.

// A test is a scenario read top to bottom: its steps stay in one function.
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, KeyToPath, Namespace, PodSpec, Probe, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use ray_serve_sim::NodeType;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use support::tls::TestPki;
use support::*;

const NAMESPACE: &str = "ray-xds";
/// Not Kubernetes objects: Envoy's files, checked by Envoy itself.
const SIDECAR_BOOTSTRAP: &str = "sidecar/envoy-sidecar-bootstrap.yaml";
const SIDECAR_SDS_FILES: [&str; 2] = [
    "sidecar/xds-tls-certificate.yaml",
    "sidecar/xds-tls-validation.yaml",
];
const KUSTOMIZATION: &str = "kustomization.yaml";
/// cert-manager's objects (CRDs, not in k8s-openapi): checked as YAML.
const CERT_MANAGER_DIR: &str = "cert-manager/";
const CERT_MANAGER_KUSTOMIZATION: &str = "cert-manager/kustomization.yaml";
const SIDECAR_CERTIFICATE: &str = "sidecar/xds-client-certificate.yaml";
/// Examples for the Ray side (RayServices): not applied with ray-xds.
const RAY_EXAMPLES_DIR: &str = "ray/";
const RAY_PRESTOP_EXAMPLE: &str = "ray/rayservice-prestop.yaml";
/// Prometheus's rule files (tests/xds/monitoring.rs checks them).
const MONITORING_DIR: &str = "monitoring/";
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

/// The Kubernetes manifests: every YAML file but the kustomizations, Envoy's files and
/// cert-manager's objects.
fn manifest_files() -> Vec<String> {
    yaml_files()
        .into_iter()
        .filter(|f| {
            f != KUSTOMIZATION
                && f != SIDECAR_BOOTSTRAP
                && !SIDECAR_SDS_FILES.contains(&f.as_str())
                && !cert_manager_files().contains(f)
                && f != CERT_MANAGER_KUSTOMIZATION
                && !f.starts_with(RAY_EXAMPLES_DIR)
                && !f.starts_with(MONITORING_DIR)
        })
        .collect()
}

/// The Ray-side examples (`ray/`).
fn ray_example_files() -> Vec<String> {
    yaml_files()
        .into_iter()
        .filter(|f| f.starts_with(RAY_EXAMPLES_DIR))
        .collect()
}

/// The files of cert-manager objects: `cert-manager/` (but its kustomization) and the
/// sidecar's example Certificate.
fn cert_manager_files() -> Vec<String> {
    yaml_files()
        .into_iter()
        .filter(|f| {
            (f.starts_with(CERT_MANAGER_DIR) && f != CERT_MANAGER_KUSTOMIZATION)
                || f == SIDECAR_CERTIFICATE
        })
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
    Role(Box<Role>),
    RoleBinding(Box<RoleBinding>),
    ConfigMap(Box<ConfigMap>),
    Deployment(Box<Deployment>),
    Service(Box<Service>),
    PodDisruptionBudget(Box<PodDisruptionBudget>),
    NetworkPolicy(Box<NetworkPolicy>),
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
            "Role" => Object::Role(typed(doc)?),
            "RoleBinding" => Object::RoleBinding(typed(doc)?),
            "ConfigMap" => Object::ConfigMap(typed(doc)?),
            "Deployment" => Object::Deployment(typed(doc)?),
            "Service" => Object::Service(typed(doc)?),
            "PodDisruptionBudget" => Object::PodDisruptionBudget(typed(doc)?),
            "NetworkPolicy" => Object::NetworkPolicy(typed(doc)?),
            other => return Err(format!("unknown kind {other:?}")),
        })
    }

    fn kind(&self) -> &'static str {
        match self {
            Object::Namespace(_) => "Namespace",
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::Role(_) => "Role",
            Object::RoleBinding(_) => "RoleBinding",
            Object::ConfigMap(_) => "ConfigMap",
            Object::Deployment(_) => "Deployment",
            Object::Service(_) => "Service",
            Object::PodDisruptionBudget(_) => "PodDisruptionBudget",
            Object::NetworkPolicy(_) => "NetworkPolicy",
        }
    }

    fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            Object::Namespace(o) => &o.metadata,
            Object::ServiceAccount(o) => &o.metadata,
            Object::ClusterRole(o) => &o.metadata,
            Object::ClusterRoleBinding(o) => &o.metadata,
            Object::Role(o) => &o.metadata,
            Object::RoleBinding(o) => &o.metadata,
            Object::ConfigMap(o) => &o.metadata,
            Object::Deployment(o) => &o.metadata,
            Object::Service(o) => &o.metadata,
            Object::PodDisruptionBudget(o) => &o.metadata,
            Object::NetworkPolicy(o) => &o.metadata,
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

/// Where a file a container sees comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum FileSource {
    ConfigMap { name: String, key: String },
    Secret { name: String, key: String },
}

/// A file in a container: its source, and its mode (the volume's or the item's).
#[derive(Debug)]
struct MountedFile {
    source: FileSource,
    mode: i32,
    /// Where the volume is mounted.
    mount_path: String,
}

/// The ConfigMap or Secret key mounted at `path` in `c`, through a `configMap`, `secret` or
/// `projected` volume (the innermost mount holding `path`). A ConfigMap projected without
/// `items` provides its keys (checked against its manifest); a Secret without `items`, any
/// file name (there is no Secret manifest to check against).
fn mounted_file(all: &[Manifest], pod: &PodSpec, c: &Container, path: &str) -> Option<MountedFile> {
    let path = Path::new(path);
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| m.sub_path.is_none() && path.starts_with(&m.mount_path))
        .max_by_key(|m| m.mount_path.len())?;
    let relative = path.strip_prefix(&mount.mount_path).ok()?.to_str()?;
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)?;
    // (kind is a Secret, name, items, default mode)
    let mut sources: Vec<(bool, String, Option<Vec<KeyToPath>>, i32)> = Vec::new();
    if let Some(cm) = &volume.config_map {
        let mode = cm.default_mode.unwrap_or(0o644);
        sources.push((false, cm.name.clone(), cm.items.clone(), mode));
    }
    if let Some(secret) = &volume.secret {
        let mode = secret.default_mode.unwrap_or(0o644);
        let name = secret.secret_name.clone()?;
        sources.push((true, name, secret.items.clone(), mode));
    }
    if let Some(projected) = &volume.projected {
        let mode = projected.default_mode.unwrap_or(0o644);
        for p in projected.sources.iter().flatten() {
            if let Some(cm) = &p.config_map {
                sources.push((false, cm.name.clone(), cm.items.clone(), mode));
            }
            if let Some(secret) = &p.secret {
                sources.push((true, secret.name.clone(), secret.items.clone(), mode));
            }
        }
    }
    sources
        .into_iter()
        .find_map(|(is_secret, name, items, mode)| {
            let (key, mode) = match items {
                Some(items) => {
                    let item = items.iter().find(|i| i.path == relative)?;
                    (item.key.clone(), item.mode.unwrap_or(mode))
                }
                None if relative.contains('/') => return None,
                None if !is_secret => {
                    let data = config_map(all, &name).data.as_ref()?;
                    data.contains_key(relative).then_some(())?;
                    (relative.to_string(), mode)
                }
                None => (relative.to_string(), mode),
            };
            let source = if is_secret {
                FileSource::Secret { name, key }
            } else {
                FileSource::ConfigMap { name, key }
            };
            Some(MountedFile {
                source,
                mode,
                mount_path: mount.mount_path.clone(),
            })
        })
}

/// The ConfigMap key mounted at `path`, if it is one: `(configmap name, key)`.
fn mounted_config_map(
    all: &[Manifest],
    pod: &PodSpec,
    c: &Container,
    path: &str,
) -> Option<(String, String)> {
    match mounted_file(all, pod, c, path)?.source {
        FileSource::ConfigMap { name, key } => Some((name, key)),
        FileSource::Secret { .. } => None,
    }
}

/// The Secret key mounted at `path` (panics naming it when it is not one), and its mode.
fn mounted_secret(
    all: &[Manifest],
    pod: &PodSpec,
    c: &Container,
    path: &str,
) -> (String, String, i32) {
    let file = mounted_file(all, pod, c, path)
        .unwrap_or_else(|| panic!("{path} is no file mounted in container {}", c.name));
    match file.source {
        FileSource::Secret { name, key } => (name, key, file.mode),
        other => panic!("{path} is {other:?}, not a Secret's"),
    }
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
        ("ConfigMap", "ray-xds-state"),
        ("Role", "ray-xds-state"),
        ("RoleBinding", "ray-xds-state"),
        ("Deployment", "ray-xds"),
        ("PodDisruptionBudget", "ray-xds"),
        ("Service", "ray-xds"),
        ("Service", "ray-xds-metrics"),
        ("Service", "ray-xds-peers"),
        ("ConfigMap", "envoy-gateway-bootstrap"),
        ("Deployment", "envoy-gateway"),
        ("PodDisruptionBudget", "envoy-gateway"),
        ("Service", "envoy-gateway"),
        ("NetworkPolicy", "ray-xds"),
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

/// The `resources` of a kustomization, checked: its fields are `expected_keys`, nothing is
/// listed twice, and it lists exactly `files` (relative to its folder).
fn assert_kustomization_lists(file: &str, expected_keys: &[&str], files: &[String]) {
    let text = std::fs::read_to_string(deploy_dir().join(file)).unwrap();
    let k: serde_yaml::Mapping = serde_yaml::from_str(&text).unwrap();
    let keys: BTreeSet<&str> = k.keys().filter_map(|k| k.as_str()).collect();
    assert_eq!(
        keys,
        expected_keys.iter().copied().collect(),
        "unexpected (misspelt?) fields in deploy/{file}"
    );
    assert_eq!(k["apiVersion"], "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k["kind"], "Kustomization");
    let listed: Vec<String> = k["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let unique: BTreeSet<&String> = listed.iter().collect();
    assert_eq!(unique.len(), listed.len(), "listed twice: {listed:?}");
    let present: BTreeSet<&String> = files.iter().collect();
    let missing: Vec<_> = present.difference(&unique).collect();
    let extra: Vec<_> = unique.difference(&present).collect();
    assert!(missing.is_empty(), "not in deploy/{file}: {missing:?}");
    assert!(
        extra.is_empty(),
        "listed in deploy/{file} but absent: {extra:?}"
    );
}

#[test]
fn kustomization_lists_exactly_the_manifests() {
    assert_eq!(kustomization()["namespace"], NAMESPACE);
    assert_kustomization_lists(
        KUSTOMIZATION,
        &["apiVersion", "kind", "namespace", "resources"],
        &manifest_files(),
    );
    // cert-manager's own, apart (its CRDs may not be installed): every file of its folder,
    // and no `namespace:` (the CA lives in cert-manager's namespace).
    let cert_manager: Vec<String> = cert_manager_files()
        .into_iter()
        .filter_map(|f| f.strip_prefix(CERT_MANAGER_DIR).map(str::to_string))
        .collect();
    assert_kustomization_lists(
        CERT_MANAGER_KUSTOMIZATION,
        &["apiVersion", "kind", "resources"],
        &cert_manager,
    );
    // Every YAML file is in exactly one of the lists this test reads.
    let mut classified: Vec<String> = manifest_files();
    classified.extend(cert_manager_files());
    classified
        .extend([KUSTOMIZATION, CERT_MANAGER_KUSTOMIZATION, SIDECAR_BOOTSTRAP].map(String::from));
    classified.extend(SIDECAR_SDS_FILES.map(String::from));
    classified.extend(ray_example_files());
    classified.extend(
        yaml_files()
            .into_iter()
            .filter(|f| f.starts_with(MONITORING_DIR)),
    );
    classified.sort();
    assert_eq!(classified, yaml_files());
}

/// The pre-stop example (deploy/ray/): every Ray container of the RayService runs the
/// same hook, with its pod's IP, and a grace period covering the call and the drain; the
/// hook's script, run as the container would (python, its environment), against a real
/// ray-xds at the admin port the Service names, by the pod's IP alone and with an Envoy
/// connected, gets the handshake's answer: 504 while the pod is listed, then 200 once it
/// is marked going away, when the Envoy no longer lists it. Its sleep is the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prestop_example_hook_asks_ray_xds_and_waits_for_its_answer() {
    let docs = documents(&std::fs::read_to_string(deploy_dir().join(RAY_PRESTOP_EXAMPLE)).unwrap())
        .unwrap();
    assert_eq!(docs.len(), 1);
    let rs = &docs[0];
    assert_eq!(rs["kind"], "RayService");
    let cluster = &rs["spec"]["rayClusterConfig"];
    let mut templates = vec![&cluster["headGroupSpec"]["template"]];
    templates.extend(
        cluster["workerGroupSpecs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| &g["template"]),
    );
    assert_eq!(templates.len(), 2);
    let mut scripts = BTreeSet::new();
    for t in &templates {
        let spec = &t["spec"];
        let c = &spec["containers"][0];
        let command = c["lifecycle"]["preStop"]["exec"]["command"]
            .as_array()
            .unwrap();
        assert_eq!(command[0], "python");
        assert_eq!(command[1], "-c");
        let script = command[2].as_str().unwrap();
        scripts.insert(script.to_string());
        let pod_ip = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "POD_IP")
            .unwrap();
        assert_eq!(pod_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
        // The call's grace (20 s), the drain (20 s by default) and Ray's own shutdown.
        let grace = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            grace >= 20 + 20 + 10,
            "terminationGracePeriodSeconds {grace}"
        );
    }
    assert_eq!(scripts.len(), 1, "every container runs the same hook");
    let script = scripts.into_iter().next().unwrap();
    // It calls the admin port through the Service that serves it.
    let all = manifests();
    let metrics = service(&all, "ray-xds-metrics");
    assert_eq!(
        metrics.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
        19000
    );
    let url = "http://ray-xds-metrics.ray-xds.svc.cluster.local:19000";
    assert!(script.contains(url), "{script}");
    assert!(script.contains("/prestop?address="), "{script}");
    assert!(
        script.contains("deadline = time.monotonic() + 20"),
        "{script}"
    );

    // Run it against a real ray-xds: a cluster of a head (127.0.0.1) and a worker on an
    // address of its own (127.0.0.2), as a pod has.
    let stop = tokio_util::sync::CancellationToken::new();
    let mut proxies = Vec::new();
    for (ip, node) in [
        ("127.0.0.1", NodeType::Head),
        ("127.0.0.2", NodeType::Worker),
    ] {
        let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
        proxies.push(listener.local_addr().unwrap());
        let config = ray_serve_sim::ProxyConfig {
            cluster: "c".into(),
            node_type: node,
            routes: [("/".to_string(), "app".to_string())].into(),
        };
        tokio::spawn(ray_serve_sim::serve_proxy_with(
            listener,
            config,
            ray_serve_sim::ProxyHandle::default(),
            stop.clone(),
        ));
    }
    let services = |draining: bool| {
        format!(
            "rayservices:\n  - name: llm\n    hosts: ['*']\n    active_cluster: c\n    clusters:\n      - name: c\n        proxies:\n          - {{ address: {}, node_type: head }}\n          - {{ address: {}, node_type: worker, draining: {draining} }}\n",
            proxies[0], proxies[1]
        )
    };
    // An Envoy connected, as in a cluster: the call waits for it.
    let stack = Stack::with(services(false))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    let admin = stack.xds.admin_addr;
    let worker = proxies[1];
    let listed_in_envoy = move |text: &str| text.contains(&format!("::{worker}::health_flags::"));
    eventually("Envoy lists the worker", DEADLINE, || async {
        listed_in_envoy(&stack.envoy().admin("/clusters").await).then_some(())
    })
    .await;
    let run_hook = move |seconds: u64| {
        let script = script.replace(url, &format!("http://{admin}")).replace(
            "deadline = time.monotonic() + 20",
            &format!("deadline = time.monotonic() + {seconds}"),
        );
        let out = Command::new("python3")
            .args(["-c", &script])
            .env("POD_IP", "127.0.0.2")
            .env("RAY_XDS_DRAIN_SECONDS", "0")
            .output()
            .expect("python3");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let listed = tokio::task::spawn_blocking({
        let run_hook = run_hook.clone();
        move || run_hook(1)
    })
    .await
    .unwrap();
    assert!(
        listed.contains("504") && listed.contains("\"dropped\":false"),
        "{listed}"
    );
    stack.edit(&services(true));
    let dropped = tokio::task::spawn_blocking(move || run_hook(20))
        .await
        .unwrap();
    assert!(
        dropped.contains("ray-xds pre-stop: 200") && dropped.contains("\"dropped\":true"),
        "{dropped}"
    );
    // At the answer, its Envoy no longer lists the pod.
    assert!(
        !listed_in_envoy(&stack.envoy().admin("/clusters").await),
        "answered while Envoy still lists the pod: {dropped}"
    );
    stop.cancel();
}

/// `kubectl kustomize` of a folder of deploy/, or `None` without kubectl.
fn kustomize(dir: &str) -> Option<Vec<Value>> {
    let out = match Command::new("kubectl")
        .arg("kustomize")
        .arg(deploy_dir().join(dir))
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("kubectl not available ({e}): skipping the kustomize render");
            return None;
        }
    };
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/{dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(documents(&String::from_utf8(out.stdout).unwrap()).unwrap())
}

/// `kubectl kustomize deploy/` (when kubectl is installed) renders exactly the objects of
/// the files, every namespaced one in `ray-xds`; `deploy/cert-manager/` renders exactly
/// its objects, each in its own namespace.
#[test]
fn kustomize_renders_every_object() {
    let Some(rendered) = kustomize(".") else {
        return;
    };
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

    let rendered: BTreeSet<String> = kustomize(CERT_MANAGER_DIR)
        .unwrap()
        .iter()
        .map(object_id)
        .collect();
    let files: BTreeSet<String> = cert_manager_objects()
        .iter()
        .filter(|(file, _)| file.starts_with(CERT_MANAGER_DIR))
        .map(|(_, doc)| object_id(doc))
        .collect();
    assert_eq!(rendered, files);
}

/// `kind namespace/name` of a YAML object.
fn object_id(doc: &Value) -> String {
    format!(
        "{} {}/{}",
        doc["kind"].as_str().unwrap_or(""),
        doc["metadata"]["namespace"].as_str().unwrap_or(""),
        doc["metadata"]["name"].as_str().unwrap_or("")
    )
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

/// The one write ray-xds may make: get and patch its own state ConfigMap, by name, in
/// its own namespace (what `replicas.state.configmap` names), created here.
#[test]
fn the_state_role_reads_and_patches_its_own_configmap_and_nothing_else() {
    let all = manifests();
    let Object::Role(role) = find(&all, "Role", "ray-xds-state") else {
        unreachable!()
    };
    let rules = role.rules.as_ref().unwrap();
    assert_eq!(rules.len(), 1, "{rules:?}");
    let rule = &rules[0];
    assert_eq!(rule.api_groups.as_deref(), Some(&[String::new()][..]));
    assert_eq!(
        rule.resources.as_deref(),
        Some(&["configmaps".to_string()][..])
    );
    assert_eq!(
        rule.resource_names.as_deref(),
        Some(&["ray-xds-state".to_string()][..])
    );
    assert_eq!(rule.verbs, ["get", "patch"]);
    let Object::RoleBinding(binding) = find(&all, "RoleBinding", "ray-xds-state") else {
        unreachable!()
    };
    assert_eq!(binding.role_ref.kind, "Role");
    assert_eq!(binding.role_ref.name, "ray-xds-state");
    let subjects = binding.subjects.as_ref().unwrap();
    assert_eq!(subjects.len(), 1);
    assert_eq!(
        (subjects[0].kind.as_str(), subjects[0].name.as_str()),
        ("ServiceAccount", "ray-xds")
    );
    assert_eq!(subjects[0].namespace.as_deref(), Some(NAMESPACE));
    find(&all, "ConfigMap", "ray-xds-state");
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
    let (name, key) = mounted_config_map(&all, pod, c, &args[2])
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
    // The Deployment's memory limit holds what this configuration may need.
    let limit = only_container(deployment(&all, "ray-xds"))
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
        .expect("a memory limit");
    let limit: u64 = match limit.0.split_at(limit.0.len() - 2) {
        (mib, "Mi") => mib.parse::<u64>().unwrap() << 20,
        (gib, "Gi") => gib.parse::<u64>().unwrap() << 30,
        _ => panic!("a memory limit in Mi or Gi: {}", limit.0),
    };
    let needed = ray_xds::runtime::memory_needed(&config);
    assert!(
        ray_xds::runtime::memory_shortfall(limit, &config).is_none(),
        "the Deployment's memory limit {limit} is below what its configuration may need, {needed}"
    );
    // /debug/* only on loopback, in the pod (kubectl port-forward), on no port of the pod's.
    let debug = config.admin_debug_listen.expect("admin.debug_listen");
    assert!(debug.ip().is_loopback(), "{debug}");
    let c = only_container(deployment(&all, "ray-xds"));
    assert!(
        !c.ports
            .iter()
            .flatten()
            .any(|p| p.container_port == i32::from(debug.port())),
        "the debug port is declared a container port"
    );
    // mTLS on: all three files, absolute (the config's folder is a mounted volume).
    let tls = config.xds_tls.as_ref().expect("xds.tls");
    for path in [&tls.cert, &tls.key, &tls.client_ca] {
        assert!(path.is_absolute(), "{path:?}");
    }
    // Replicas ask each other through the headless Service, on the admin port.
    assert_eq!(
        config.replica_peers,
        ["ray-xds-peers.ray-xds.svc.cluster.local:19000"]
    );
    // Both restarted at once resume from the state ConfigMap the Role lets them patch.
    assert_eq!(
        config.replica_state.as_ref().map(|s| &s.store),
        Some(&ray_xds::config::ReplicaStateStore::ConfigMap {
            namespace: NAMESPACE.into(),
            name: "ray-xds-state".into(),
        })
    );
    let peers = service(&all, "ray-xds-peers");
    let spec = peers.spec.as_ref().unwrap();
    assert_eq!(
        spec.cluster_ip.as_deref(),
        Some("None"),
        "headless: every replica's IP"
    );
    assert_eq!(spec.publish_not_ready_addresses, Some(true));
    assert!(label_selector_matches(
        &LabelSelector {
            match_labels: spec.selector.clone(),
            ..Default::default()
        },
        pod_labels(deployment(&all, "ray-xds"))
    ));
    assert_eq!(spec.ports.as_ref().unwrap()[0].port, 19000);
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
    // The xDS port carries TLS the clients originate (ray-xds-config.yaml has `xds.tls`):
    // a mesh must pass it through, not parse it as cleartext gRPC.
    let config: serde_yaml::Value = serde_yaml::from_str(&ray_xds_config_text(&all)).unwrap();
    assert!(config["xds"]["tls"].is_mapping());
    let xds_port = port(xds, "tls-xds");
    assert_eq!(xds_port.port, 18000);
    assert_eq!(xds_port.app_protocol.as_deref(), Some("tls"));
    assert_eq!(
        xds_port.target_port,
        Some(IntOrString::String("xds".into()))
    );

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

// ---- cert-manager ----

/// Every cert-manager object, with its file (plain YAML: cert-manager's CRDs are not in
/// k8s-openapi).
fn cert_manager_objects() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for file in cert_manager_files() {
        let text = std::fs::read_to_string(deploy_dir().join(&file)).unwrap();
        for doc in documents(&text).unwrap_or_else(|e| panic!("deploy/{file}: {e}")) {
            out.push((file.clone(), doc));
        }
    }
    out
}

/// Fails when `value` has a field not in `allowed` (a misspelt field is dropped by
/// cert-manager's API server, as by any CRD with a structural schema, without a word).
fn only_fields(value: &Value, allowed: &[&str], what: &str) {
    let fields = value
        .as_object()
        .unwrap_or_else(|| panic!("{what}: not a mapping"));
    for key in fields.keys() {
        assert!(
            allowed.contains(&key.as_str()),
            "{what}.{key}: not a field of cert-manager v1"
        );
    }
}

/// A Go duration as cert-manager takes them ("2160h", "1h30m", "90s").
fn go_duration(text: &str) -> Duration {
    let mut total = 0u64;
    let mut number = String::new();
    for ch in text.chars() {
        match ch {
            '0'..='9' => number.push(ch),
            'h' | 'm' | 's' => {
                let n: u64 = number
                    .parse()
                    .unwrap_or_else(|_| panic!("duration {text:?}"));
                total += n * match ch {
                    'h' => 3600,
                    'm' => 60,
                    _ => 1,
                };
                number.clear();
            }
            _ => panic!("duration {text:?}"),
        }
    }
    assert!(number.is_empty() && total > 0, "duration {text:?}");
    Duration::from_secs(total)
}

/// The fields cert-manager v1 requires, and no others than it knows, on the objects used.
fn check_cert_manager_object(origin: &str, doc: &Value) {
    only_fields(doc, &["apiVersion", "kind", "metadata", "spec"], origin);
    assert_eq!(doc["apiVersion"], "cert-manager.io/v1", "{origin}");
    let metadata = &doc["metadata"];
    only_fields(
        metadata,
        &["name", "namespace", "labels", "annotations"],
        origin,
    );
    assert!(
        metadata["name"].as_str().is_some_and(|n| !n.is_empty()),
        "{origin}"
    );
    let spec = &doc["spec"];
    match doc["kind"].as_str().unwrap_or("") {
        "Certificate" => {
            assert!(metadata["namespace"].is_string(), "{origin}: namespaced");
            only_fields(
                spec,
                &[
                    "subject",
                    "literalSubject",
                    "commonName",
                    "duration",
                    "renewBefore",
                    "renewBeforePercentage",
                    "dnsNames",
                    "ipAddresses",
                    "uris",
                    "otherNames",
                    "emailAddresses",
                    "secretName",
                    "secretTemplate",
                    "keystores",
                    "issuerRef",
                    "isCA",
                    "usages",
                    "privateKey",
                    "signatureAlgorithm",
                    "encodeUsagesInRequest",
                    "revisionHistoryLimit",
                    "additionalOutputFormats",
                    "nameConstraints",
                ],
                &format!("{origin}: spec"),
            );
            assert!(
                spec["secretName"].is_string(),
                "{origin}: secretName is required"
            );
            let issuer = &spec["issuerRef"];
            only_fields(
                issuer,
                &["name", "kind", "group"],
                &format!("{origin}: issuerRef"),
            );
            assert!(
                issuer["name"].is_string(),
                "{origin}: issuerRef.name is required"
            );
            assert!(
                [
                    "commonName",
                    "dnsNames",
                    "uris",
                    "emailAddresses",
                    "ipAddresses",
                    "otherNames",
                    "literalSubject"
                ]
                .iter()
                .any(|f| spec.get(*f).is_some()),
                "{origin}: a certificate needs at least one name"
            );
            const USAGES: [&str; 19] = [
                "signing",
                "digital signature",
                "content commitment",
                "key encipherment",
                "key agreement",
                "data encipherment",
                "cert sign",
                "crl sign",
                "encipher only",
                "decipher only",
                "any",
                "server auth",
                "client auth",
                "code signing",
                "email protection",
                "s/mime",
                "ipsec end system",
                "ipsec tunnel",
                "timestamping",
            ];
            for usage in spec["usages"].as_array().into_iter().flatten() {
                assert!(
                    USAGES.contains(&usage.as_str().unwrap_or("")),
                    "{origin}: usage {usage}"
                );
            }
            let key = &spec["privateKey"];
            if !key.is_null() {
                only_fields(
                    key,
                    &["rotationPolicy", "encoding", "algorithm", "size"],
                    &format!("{origin}: privateKey"),
                );
                for (field, allowed) in [
                    ("algorithm", &["RSA", "ECDSA", "Ed25519"][..]),
                    ("encoding", &["PKCS1", "PKCS8"][..]),
                    ("rotationPolicy", &["Never", "Always"][..]),
                ] {
                    if let Some(v) = key.get(field) {
                        assert!(
                            allowed.contains(&v.as_str().unwrap_or("")),
                            "{origin}: {field}"
                        );
                    }
                }
                if key["algorithm"] == "ECDSA" {
                    assert!([256, 384, 521].contains(&key["size"].as_i64().unwrap_or(0)));
                }
            }
            let duration = spec["duration"].as_str().map(go_duration);
            if let Some(d) = duration {
                assert!(
                    d >= Duration::from_secs(3600),
                    "{origin}: cert-manager's minimum"
                );
            }
            if let Some(renew) = spec["renewBefore"].as_str().map(go_duration) {
                let d = duration.unwrap_or(Duration::from_secs(90 * 24 * 3600));
                assert!(
                    renew < d,
                    "{origin}: renewBefore must be below the duration"
                );
            }
        }
        kind @ ("Issuer" | "ClusterIssuer") => {
            assert_eq!(
                metadata["namespace"].is_string(),
                kind == "Issuer",
                "{origin}: an Issuer is namespaced, a ClusterIssuer not"
            );
            only_fields(
                spec,
                &["acme", "ca", "vault", "selfSigned", "venafi"],
                &format!("{origin}: spec"),
            );
            assert_eq!(
                spec.as_object().unwrap().len(),
                1,
                "{origin}: exactly one issuer type"
            );
            if let Some(ca) = spec.get("ca") {
                only_fields(
                    ca,
                    &[
                        "secretName",
                        "crlDistributionPoints",
                        "ocspServers",
                        "issuingCertificateURLs",
                    ],
                    &format!("{origin}: ca"),
                );
                assert!(
                    ca["secretName"].is_string(),
                    "{origin}: ca.secretName is required"
                );
            }
            if let Some(ss) = spec.get("selfSigned") {
                only_fields(
                    ss,
                    &["crlDistributionPoints"],
                    &format!("{origin}: selfSigned"),
                );
            }
        }
        other => panic!("{origin}: kind {other:?}"),
    }
}

/// The namespace a ClusterIssuer of kind `ca` reads its Secret from: cert-manager's
/// --cluster-resource-namespace, by default.
const CERT_MANAGER_NAMESPACE: &str = "cert-manager";

#[test]
fn cert_manager_objects_have_the_fields_cert_manager_requires() {
    let objects = cert_manager_objects();
    assert!(objects.len() >= 5, "{objects:?}");
    for (file, doc) in &objects {
        check_cert_manager_object(&format!("deploy/{file}"), doc);
    }
    // The checks catch what they should.
    let good = objects
        .iter()
        .find(|(_, d)| d["kind"] == "Certificate")
        .unwrap()
        .1
        .clone();
    for (mutate, message) in [
        (
            Box::new(|d: &mut Value| d["spec"]["dnsName"] = serde_json::json!(["x"]))
                as Box<dyn Fn(&mut Value)>,
            "spec.dnsName: not a field",
        ),
        (
            Box::new(|d: &mut Value| {
                d["spec"].as_object_mut().unwrap().remove("secretName");
            }),
            "secretName is required",
        ),
        (
            Box::new(|d: &mut Value| d["spec"]["usages"] = serde_json::json!(["serverauth"])),
            "usage",
        ),
        (
            Box::new(|d: &mut Value| d["spec"]["renewBefore"] = serde_json::json!("100000h")),
            "renewBefore",
        ),
    ] {
        let mut doc = good.clone();
        mutate(&mut doc);
        let err =
            std::panic::catch_unwind(|| check_cert_manager_object("t", &doc)).expect_err(message);
        let text = err
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        assert!(text.contains(message), "{text}");
    }
}

/// Finds the issuer an `issuerRef` in `namespace` names.
fn issuer<'a>(objects: &'a [(String, Value)], issuer_ref: &Value, namespace: &str) -> &'a Value {
    assert_eq!(issuer_ref["group"], "cert-manager.io");
    let kind = issuer_ref["kind"].as_str().unwrap_or("Issuer");
    &objects
        .iter()
        .find(|(_, d)| {
            d["kind"] == kind
                && d["metadata"]["name"] == issuer_ref["name"]
                && (kind == "ClusterIssuer" || d["metadata"]["namespace"] == namespace)
        })
        .unwrap_or_else(|| panic!("no {kind} {} for {namespace}", issuer_ref["name"]))
        .1
}

/// The Certificate writing `secret` in `namespace`.
fn certificate<'a>(objects: &'a [(String, Value)], namespace: &str, secret: &str) -> &'a Value {
    &objects
        .iter()
        .find(|(_, d)| {
            d["kind"] == "Certificate"
                && d["metadata"]["namespace"] == namespace
                && d["spec"]["secretName"] == secret
        })
        .unwrap_or_else(|| panic!("no Certificate writes {namespace}/{secret}"))
        .1
}

/// The CA Certificate behind a leaf: its issuer is a `ca` issuer whose Secret a
/// self-signed Certificate with isCA writes.
fn ca_of<'a>(objects: &'a [(String, Value)], leaf: &Value) -> &'a Value {
    let namespace = leaf["metadata"]["namespace"].as_str().unwrap();
    let issuer_ref = &leaf["spec"]["issuerRef"];
    let ca_issuer = issuer(objects, issuer_ref, namespace);
    let secret = ca_issuer["spec"]["ca"]["secretName"]
        .as_str()
        .expect("a `ca` issuer");
    let ca_namespace = if issuer_ref["kind"] == "ClusterIssuer" {
        CERT_MANAGER_NAMESPACE
    } else {
        namespace
    };
    let ca = certificate(objects, ca_namespace, secret);
    assert_eq!(ca["spec"]["isCA"], true);
    let root = issuer(objects, &ca["spec"]["issuerRef"], ca_namespace);
    assert!(root["spec"]["selfSigned"].is_object(), "{root}");
    ca
}

/// ray-xds's certificate is for the names the Envoys check and is written to the Secret
/// ray-xds mounts; the gateway's and the sidecar's are client certificates from the same CA
/// (the one whose ca.crt ray-xds trusts), written where they are mounted.
#[test]
fn cert_manager_certificates_chain_to_one_ca_and_write_the_mounted_secrets() {
    let all = manifests();
    let objects = cert_manager_objects();
    let usages = |c: &Value| -> BTreeSet<String> {
        c["spec"]["usages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u.as_str().unwrap().to_string())
            .collect()
    };

    // The Secret names come from the Deployments' volumes, not from here.
    let d = deployment(&all, "ray-xds");
    let (server_secret, _, _) = mounted_secret(
        &all,
        pod_spec(d),
        only_container(d),
        "/etc/ray-xds/tls/tls.crt",
    );
    let server = certificate(&objects, NAMESPACE, &server_secret);
    let names: BTreeSet<&str> = server["spec"]["dnsNames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    let svc = service(&all, "ray-xds");
    let short = format!(
        "{}.{}.svc",
        svc.metadata.name.as_deref().unwrap(),
        svc.metadata.namespace.as_deref().unwrap()
    );
    assert_eq!(names, BTreeSet::from([short.as_str(), XDS_HOST]));
    // The bootstraps send and check exactly that name (xds_tls_files asserts it).
    assert!(usages(server).contains("server auth"));
    assert!(!usages(server).contains("client auth"));
    let ca = ca_of(&objects, server);

    let d = deployment(&all, "envoy-gateway");
    let (gateway_secret, _, _) = mounted_secret(
        &all,
        pod_spec(d),
        only_container(d),
        "/etc/envoy/xds-tls/tls.crt",
    );
    let sidecar = &objects
        .iter()
        .find(|(f, _)| f == SIDECAR_CERTIFICATE)
        .unwrap()
        .1;
    let sidecar_namespace = sidecar["metadata"]["namespace"].as_str().unwrap();
    assert_ne!(
        sidecar_namespace, NAMESPACE,
        "an example in the application's namespace"
    );
    for client in [certificate(&objects, NAMESPACE, &gateway_secret), sidecar] {
        assert!(usages(client).contains("client auth"), "{client}");
        assert!(!usages(client).contains("server auth"), "{client}");
        assert_eq!(ca_of(&objects, client), ca, "{client}");
    }
    // A sidecar in another namespace can only use a ClusterIssuer.
    assert_eq!(sidecar["spec"]["issuerRef"]["kind"], "ClusterIssuer");
}

// ---- the NetworkPolicy ----

/// Whether `selector` selects `labels` (matchLabels and matchExpressions, as Kubernetes).
fn label_selector_matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let by_expressions = selector.match_expressions.iter().flatten().all(|e| {
        let values = e.values.clone().unwrap_or_default();
        match e.operator.as_str() {
            "In" => labels.get(&e.key).is_some_and(|v| values.contains(v)),
            "NotIn" => labels.get(&e.key).is_none_or(|v| !values.contains(v)),
            "Exists" => labels.contains_key(&e.key),
            "DoesNotExist" => !labels.contains_key(&e.key),
            other => panic!("operator {other}"),
        }
    });
    by_labels && by_expressions
}

/// A pod somewhere, or an address that is no pod's (the API server, outside).
#[derive(Debug, Clone)]
enum Peer {
    Pod {
        namespace: &'static str,
        labels: BTreeMap<String, String>,
    },
    Outside,
}

fn pod(namespace: &'static str, labels: &[(&str, &str)]) -> Peer {
    Peer::Pod {
        namespace,
        labels: labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// Whether a NetworkPolicy peer (in a policy of `policy_namespace`) is `peer`. Namespaces
/// carry the label Kubernetes gives every one, kubernetes.io/metadata.name.
fn peer_matches(p: &NetworkPolicyPeer, policy_namespace: &str, peer: &Peer) -> bool {
    let Peer::Pod { namespace, labels } = peer else {
        // No ipBlock here (asserted apart): selectors match pods only.
        return false;
    };
    let namespace_labels = BTreeMap::from([(
        "kubernetes.io/metadata.name".to_string(),
        namespace.to_string(),
    )]);
    let in_namespace = match &p.namespace_selector {
        Some(s) => label_selector_matches(s, &namespace_labels),
        None => *namespace == policy_namespace,
    };
    in_namespace
        && p.pod_selector
            .as_ref()
            .is_none_or(|s| label_selector_matches(s, labels))
}

/// Whether `ports` (absent: every port) lets in `port`/`protocol`.
fn port_matches(ports: &Option<Vec<NetworkPolicyPort>>, port: i32, protocol: &str) -> bool {
    let Some(ports) = ports.as_ref().filter(|p| !p.is_empty()) else {
        return true;
    };
    ports.iter().any(|p| {
        let number = match &p.port {
            Some(IntOrString::Int(n)) => *n,
            other => panic!("numeric ports only here: {other:?}"),
        };
        p.protocol.as_deref().unwrap_or("TCP") == protocol
            && (number..=p.end_port.unwrap_or(number)).contains(&port)
    })
}

/// Whether `policy` lets `from` reach a pod it selects on `port`.
fn ingress_allowed(policy: &NetworkPolicy, from: &Peer, port: i32, protocol: &str) -> bool {
    let namespace = policy.metadata.namespace.as_deref().unwrap();
    policy
        .spec
        .as_ref()
        .unwrap()
        .ingress
        .iter()
        .flatten()
        .any(|rule| {
            port_matches(&rule.ports, port, protocol)
                && match rule.from.as_ref().filter(|f| !f.is_empty()) {
                    None => true,
                    Some(peers) => peers.iter().any(|p| peer_matches(p, namespace, from)),
                }
        })
}

/// Whether `policy` lets a pod it selects reach `to` on `port`.
fn egress_allowed(policy: &NetworkPolicy, to: &Peer, port: i32, protocol: &str) -> bool {
    let namespace = policy.metadata.namespace.as_deref().unwrap();
    policy
        .spec
        .as_ref()
        .unwrap()
        .egress
        .iter()
        .flatten()
        .any(|rule| {
            port_matches(&rule.ports, port, protocol)
                && match rule.to.as_ref().filter(|t| !t.is_empty()) {
                    None => true,
                    Some(peers) => peers.iter().any(|p| peer_matches(p, namespace, to)),
                }
        })
}

fn network_policy<'a>(all: &'a [Manifest], name: &str) -> &'a NetworkPolicy {
    match find(all, "NetworkPolicy", name) {
        Object::NetworkPolicy(p) => p,
        _ => unreachable!(),
    }
}

/// The policy, evaluated as Kubernetes does for the pods that matter: the xDS port from the
/// gateway (this namespace) and labelled sidecars (any namespace) only; the admin port from
/// `monitoring`, the other replicas and the Ray pods (their preStop hook) only; out, DNS,
/// the API server's ports and the Ray pods' ports only.
#[test]
fn network_policy_lets_in_the_gateway_sidecars_and_monitoring_only() {
    let all = manifests();
    let policy = network_policy(&all, "ray-xds");
    let spec = policy.spec.as_ref().unwrap();
    let ray_xds = deployment(&all, "ray-xds");
    let gateway = deployment(&all, "envoy-gateway");
    let selector = spec.pod_selector.as_ref().unwrap();
    assert!(label_selector_matches(selector, pod_labels(ray_xds)));
    assert!(!label_selector_matches(selector, pod_labels(gateway)));
    assert_eq!(
        spec.policy_types,
        Some(vec!["Ingress".to_string(), "Egress".to_string()])
    );
    // No address ranges, and every rule names its ports (a rule without is every port).
    for rule in spec.ingress.iter().flatten() {
        assert!(rule.ports.as_ref().is_some_and(|p| !p.is_empty()));
        assert!(rule.from.iter().flatten().all(|p| p.ip_block.is_none()));
    }
    for rule in spec.egress.iter().flatten() {
        assert!(rule.ports.as_ref().is_some_and(|p| !p.is_empty()));
        assert!(rule.to.iter().flatten().all(|p| p.ip_block.is_none()));
    }

    let c = only_container(ray_xds);
    let (xds, admin) = (container_port(c, "xds"), container_port(c, "admin"));
    let gateway_pod = Peer::Pod {
        namespace: NAMESPACE,
        labels: pod_labels(gateway).clone(),
    };
    let own_pod = Peer::Pod {
        namespace: NAMESPACE,
        labels: pod_labels(ray_xds).clone(),
    };
    let sidecar = pod(
        "my-app",
        &[("app", "my-app"), ("ray-xds.io/xds-client", "true")],
    );
    let sidecar_here = pod(NAMESPACE, &[("ray-xds.io/xds-client", "true")]);
    let sidecar_label_false = pod("my-app", &[("ray-xds.io/xds-client", "false")]);
    // The gateway's labels in another namespace are anyone's to copy.
    let fake_gateway = pod("my-app", &[("app.kubernetes.io/name", "envoy-gateway")]);
    let unlabelled = pod("my-app", &[("app", "my-app")]);
    let prometheus = pod("monitoring", &[("app", "prometheus")]);
    let ray_pod = pod(
        "ml",
        &[("ray.io/cluster", "demo-a"), ("ray.io/node-type", "worker")],
    );
    let cases: [(&str, &Peer, bool, bool); 10] = [
        // (who, from, may reach xds, may reach admin)
        ("the gateway", &gateway_pod, true, false),
        (
            "another ray-xds replica (replicas.peers)",
            &own_pod,
            false,
            true,
        ),
        ("a labelled sidecar", &sidecar, true, false),
        ("a labelled pod in ray-xds", &sidecar_here, true, false),
        (
            "a sidecar labelled false",
            &sidecar_label_false,
            false,
            false,
        ),
        (
            "the gateway's labels elsewhere",
            &fake_gateway,
            false,
            false,
        ),
        ("an unlabelled pod", &unlabelled, false, false),
        ("prometheus", &prometheus, false, true),
        // Its preStop hook's GET /prestop (deploy/ray/).
        ("a Ray pod", &ray_pod, false, true),
        ("outside", &Peer::Outside, false, false),
    ];
    for (who, from, to_xds, to_admin) in cases {
        assert_eq!(
            ingress_allowed(policy, from, xds, "TCP"),
            to_xds,
            "{who} -> xds"
        );
        assert_eq!(
            ingress_allowed(policy, from, admin, "TCP"),
            to_admin,
            "{who} -> admin"
        );
        assert!(
            !ingress_allowed(policy, from, xds, "UDP"),
            "{who} -> xds/UDP"
        );
        assert!(!ingress_allowed(policy, from, 22, "TCP"), "{who} -> 22");
    }

    // Out. The Ray ports are the ones ray-xds probes by default: serve 8000, Ray Serve's
    // gRPC proxy 9000, the dashboard 8265 (README, "What ray-xds reads"), and with direct
    // ingress the replicas' ports.
    let dns = pod("kube-system", &[("k8s-app", "kube-dns")]);
    let fake_dns = pod("my-app", &[("k8s-app", "kube-dns")]);
    let cases: [(&str, &Peer, i32, &str, bool); 19] = [
        ("a Ray pod's serve port", &ray_pod, 8000, "TCP", true),
        ("a Ray pod's gRPC port", &ray_pod, 9000, "TCP", true),
        ("a Ray head's dashboard", &ray_pod, 8265, "TCP", true),
        // Direct ingress: ingress replicas' HTTP and gRPC ports (Ray's default ranges).
        ("a replica's first HTTP port", &ray_pod, 30000, "TCP", true),
        ("a replica's last gRPC port", &ray_pod, 41000, "TCP", true),
        ("past the HTTP range", &ray_pod, 31001, "TCP", false),
        (
            "a replica port of a pod that is no Ray pod",
            &unlabelled,
            30000,
            "TCP",
            false,
        ),
        (
            "a replica port outside",
            &Peer::Outside,
            40000,
            "TCP",
            false,
        ),
        ("a Ray pod's ssh", &ray_pod, 22, "TCP", false),
        (
            "a pod that is no Ray pod, on 8000",
            &unlabelled,
            8000,
            "TCP",
            false,
        ),
        ("kube-dns", &dns, 53, "UDP", true),
        ("kube-dns over TCP", &dns, 53, "TCP", true),
        ("a pod calling itself kube-dns", &fake_dns, 53, "UDP", false),
        ("the API server (443)", &Peer::Outside, 443, "TCP", true),
        ("the API server (6443)", &Peer::Outside, 6443, "TCP", true),
        ("outside, on 80", &Peer::Outside, 80, "TCP", false),
        ("outside, on 8000", &Peer::Outside, 8000, "TCP", false),
        ("another replica's admin", &own_pod, 19000, "TCP", true),
        ("another replica's xDS", &own_pod, 18000, "TCP", false),
    ];
    for (what, to, port, protocol, allowed) in cases {
        assert_eq!(
            egress_allowed(policy, to, port, protocol),
            allowed,
            "to {what}"
        );
    }
}

/// The evaluator above is Kubernetes' semantics, not just what this policy happens to need.
#[test]
fn network_policy_evaluation_follows_kubernetes() {
    let policy: NetworkPolicy = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "p", "namespace": "a"},
        "spec": {
            "podSelector": {},
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"x": "1"}}}], "ports": [{"port": 80}]},
                {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "b"}}}],
                 "ports": [{"port": 1000, "endPort": 1010, "protocol": "UDP"}]},
                {"ports": [{"port": 7}]}
            ],
            "egress": [{"to": [{"namespaceSelector": {}, "podSelector": {"matchExpressions": [{"key": "y", "operator": "In", "values": ["2", "3"]}]}}]}]
        }
    }))
    .unwrap();
    // A podSelector alone: this namespace only.
    assert!(ingress_allowed(
        &policy,
        &pod("a", &[("x", "1")]),
        80,
        "TCP"
    ));
    assert!(!ingress_allowed(
        &policy,
        &pod("b", &[("x", "1")]),
        80,
        "TCP"
    ));
    // A namespaceSelector alone: any pod there; a port range and a protocol.
    assert!(ingress_allowed(&policy, &pod("b", &[]), 1005, "UDP"));
    assert!(!ingress_allowed(&policy, &pod("b", &[]), 1005, "TCP"));
    assert!(!ingress_allowed(&policy, &pod("b", &[]), 1011, "UDP"));
    // No `from`: anyone, outside included, on that port.
    assert!(ingress_allowed(&policy, &Peer::Outside, 7, "TCP"));
    assert!(!ingress_allowed(&policy, &Peer::Outside, 8, "TCP"));
    // No `ports`: every port; both selectors: both must match.
    assert!(egress_allowed(
        &policy,
        &pod("c", &[("y", "3")]),
        12345,
        "TCP"
    ));
    assert!(!egress_allowed(
        &policy,
        &pod("c", &[("y", "4")]),
        12345,
        "TCP"
    ));
    assert!(!egress_allowed(&policy, &Peer::Outside, 12345, "TCP"));
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
    let (name, key) =
        mounted_config_map(&all, pod, c, flag("-c")).expect("-c names a mounted file");
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

/// The files an Envoy's `ray-xds` cluster reads for mTLS, through file-based SDS.
#[derive(Debug)]
struct XdsTlsFiles {
    /// The two SDS files (certificate, validation).
    sds: [String; 2],
    cert: String,
    key: String,
    ca: String,
    /// Every `watched_directory` (of the SDS configs and of the secrets in them).
    watched: BTreeSet<String>,
}

/// The `ray-xds` cluster's TLS, checked: UpstreamTlsContext with the Service's name as SNI,
/// HTTP/2 by ALPN, the server certificate's DNS name matched exactly, the client
/// certificate and the trusted CA from SDS files (never inline: Envoy would read those once,
/// at start); `sds_file` reads an SDS file by its path in the pod.
fn xds_tls_files(bootstrap: &Value, sds_file: impl Fn(&str) -> String) -> XdsTlsFiles {
    let cluster = bootstrap["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "ray-xds")
        .expect("a ray-xds cluster");
    let socket = &cluster["transport_socket"];
    assert_eq!(socket["name"], "envoy.transport_sockets.tls", "{cluster}");
    let tls = &socket["typed_config"];
    assert_eq!(
        tls["@type"],
        "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
    );
    assert_eq!(tls["sni"], XDS_HOST);
    let common = &tls["common_tls_context"];
    assert_eq!(common["alpn_protocols"], serde_json::json!(["h2"]));
    for inline in ["tls_certificates", "validation_context"] {
        assert!(
            common.get(inline).is_none(),
            "{inline}: read once, at start"
        );
    }
    let combined = &common["combined_validation_context"];
    assert_eq!(
        combined["default_validation_context"]["match_typed_subject_alt_names"],
        serde_json::json!([{"san_type": "DNS", "matcher": {"exact": XDS_HOST}}])
    );
    let mut watched = BTreeSet::new();
    // One SDS config: its secret's name and file, and that file's one Secret.
    let mut sds = |config: &Value| -> (String, Value) {
        let source = &config["sds_config"];
        assert_eq!(source["resource_api_version"], "V3");
        let path = source["path_config_source"]["path"]
            .as_str()
            .unwrap()
            .to_string();
        let dir = &source["path_config_source"]["watched_directory"]["path"];
        watched.insert(dir.as_str().expect("a watched_directory").to_string());
        let file: Value = serde_yaml::from_str(&sds_file(&path)).unwrap();
        let resources = file["resources"].as_array().expect("resources");
        assert_eq!(resources.len(), 1, "{path}: one Secret per file");
        let secret = resources[0].clone();
        assert_eq!(
            secret["@type"],
            "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
        );
        assert_eq!(secret["name"], config["name"], "{path}");
        (path, secret)
    };
    let certificates = common["tls_certificate_sds_secret_configs"]
        .as_array()
        .unwrap();
    assert_eq!(certificates.len(), 1);
    let (cert_sds, secret) = sds(&certificates[0]);
    let certificate = &secret["tls_certificate"];
    let (ca_sds, secret) = sds(&combined["validation_context_sds_secret_config"]);
    let validation = &secret["validation_context"];
    for dir in [
        &certificate["watched_directory"]["path"],
        &validation["watched_directory"]["path"],
    ] {
        watched.insert(dir.as_str().expect("a watched_directory").to_string());
    }
    let file = |v: &Value| v["filename"].as_str().unwrap().to_string();
    XdsTlsFiles {
        sds: [cert_sds, ca_sds],
        cert: file(&certificate["certificate_chain"]),
        key: file(&certificate["private_key"]),
        ca: file(&validation["trusted_ca"]),
        watched,
    }
}

/// A private key's mode: none for others, read for the group, which is the pod's fsGroup and
/// the container's group (the files of a projected volume belong to root and the fsGroup).
fn assert_key_mode(d: &Deployment, mode: i32) {
    let pod = pod_spec(d).security_context.clone().unwrap_or_default();
    let c = only_container(d)
        .security_context
        .clone()
        .unwrap_or_default();
    assert_eq!(mode & 0o007, 0, "the key is readable by others: {mode:o}");
    assert_eq!(
        mode & 0o040,
        0o040,
        "the key is not readable by its group: {mode:o}"
    );
    let group = c.run_as_group.or(pod.run_as_group);
    assert_eq!(pod.fs_group, group, "fsGroup is not the container's group");
}

/// ray-xds's `xds.tls` files are the keys of the Secret ray-xds-xds-tls, where the
/// Deployment projects it; readable by ray-xds and by no other user.
#[test]
fn ray_xds_tls_files_are_the_secrets_keys_where_the_config_says() {
    let all = manifests();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ray-xds.yaml");
    std::fs::write(&path, ray_xds_config_text(&all)).unwrap();
    let config = ray_xds::config::Config::load(&ray_xds::config::ServeArgs {
        config: Some(path),
        ..Default::default()
    })
    .unwrap();
    let tls = config.xds_tls.expect("xds.tls");
    let d = deployment(&all, "ray-xds");
    let (pod, c) = (pod_spec(d), only_container(d));
    for (path, key) in [
        (&tls.cert, "tls.crt"),
        (&tls.key, "tls.key"),
        (&tls.client_ca, "ca.crt"),
    ] {
        let (secret, found, mode) = mounted_secret(&all, pod, c, path.to_str().unwrap());
        assert_eq!(
            (secret.as_str(), found.as_str()),
            (XDS_SECRET, key),
            "{path:?}"
        );
        if key == "tls.key" {
            assert_key_mode(d, mode);
        }
    }
    // The config file and the Secret share one volume (no mount inside a read-only one).
    let mounts: Vec<_> = c.volume_mounts.iter().flatten().collect();
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert!(mounts[0].read_only == Some(true));
}

/// The Secret ray-xds serves xDS with (cert-manager/ray-xds-certificate.yaml).
const XDS_SECRET: &str = "ray-xds-xds-tls";
/// The gateway's client certificate (cert-manager/gateway-certificate.yaml).
const GATEWAY_SECRET: &str = "envoy-gateway-xds-tls";

/// The gateway's TLS files are its ConfigMap's SDS files and its Secret's keys, in the one
/// projected folder Envoy watches.
#[test]
fn gateway_tls_files_are_its_secrets_keys_in_the_folder_envoy_watches() {
    let all = manifests();
    let d = deployment(&all, "envoy-gateway");
    let (pod, c) = (pod_spec(d), only_container(d));
    let bootstrap: Value = serde_yaml::from_str(&gateway_bootstrap_text(&all)).unwrap();
    let files = xds_tls_files(&bootstrap, |path| {
        let (name, key) = mounted_config_map(&all, pod, c, path)
            .unwrap_or_else(|| panic!("{path}: not a mounted ConfigMap key"));
        config_map(&all, &name).data.as_ref().unwrap()[&key].clone()
    });
    for path in &files.sds {
        let (name, _) = mounted_config_map(&all, pod, c, path).unwrap();
        assert_eq!(name, "envoy-gateway-bootstrap");
    }
    for (path, key) in [
        (&files.cert, "tls.crt"),
        (&files.key, "tls.key"),
        (&files.ca, "ca.crt"),
    ] {
        let (secret, found, mode) = mounted_secret(&all, pod, c, path);
        assert_eq!(
            (secret.as_str(), found.as_str()),
            (GATEWAY_SECRET, key),
            "{path}"
        );
        if key == "tls.key" {
            assert_key_mode(d, mode);
        }
    }
    // Envoy watches the folder where the kubelet swaps `..data`: the volume's mount path.
    // (Watching xds-tls/, which links into ..data, would never see a renewal.)
    let mount = mounted_file(&all, pod, c, &files.cert).unwrap().mount_path;
    assert_eq!(files.watched, BTreeSet::from([mount]));
}

/// The sidecar's SDS files are the gateway's (one wiring to review), at /etc/envoy as the
/// README's pod lays them out.
#[test]
fn sidecar_tls_files_are_the_gateways() {
    let all = manifests();
    let gateway: Value = serde_yaml::from_str(&gateway_bootstrap_text(&all)).unwrap();
    let gateway = xds_tls_files(&gateway, |path| {
        let key = path.strip_prefix("/etc/envoy/").unwrap();
        config_map(&all, "envoy-gateway-bootstrap")
            .data
            .as_ref()
            .unwrap()[key]
            .clone()
    });
    let sidecar: Value = serde_yaml::from_str(&sidecar_bootstrap_text()).unwrap();
    let sidecar = xds_tls_files(&sidecar, |path| {
        let name = path.strip_prefix("/etc/envoy/").unwrap();
        let file = format!("sidecar/{name}");
        assert!(SIDECAR_SDS_FILES.contains(&file.as_str()), "{path}");
        std::fs::read_to_string(deploy_dir().join(file)).unwrap()
    });
    assert_eq!(format!("{sidecar:?}"), format!("{gateway:?}"));
    for (file, key) in SIDECAR_SDS_FILES
        .iter()
        .zip(["xds-tls-certificate.yaml", "xds-tls-validation.yaml"])
    {
        let ours: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(deploy_dir().join(file)).unwrap())
                .unwrap();
        let theirs: serde_yaml::Value = serde_yaml::from_str(
            &config_map(&all, "envoy-gateway-bootstrap")
                .data
                .as_ref()
                .unwrap()[key],
        )
        .unwrap();
        assert_eq!(ours, theirs, "{file}");
    }
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

/// A `--base-id` no other Envoy of this or another test process uses: support's, whose
/// counter every Envoy of this process shares.
fn base_id() -> u32 {
    support::base_id()
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

/// A folder as the kubelet writes a ConfigMap, Secret or projected volume: the files in a
/// folder of their own (`..<n>`), `..data` linking to it, and each top-level entry linking
/// through `..data`. An update writes a new folder and renames a new link over `..data`,
/// one atomic swap in the volume's root: what a renewed certificate looks like in a pod.
struct KubeletVolume {
    root: PathBuf,
    generation: u32,
}

impl KubeletVolume {
    fn create(root: &Path, files: &[(String, Vec<u8>)]) -> KubeletVolume {
        std::fs::create_dir_all(root).unwrap();
        let mut volume = KubeletVolume {
            root: root.to_path_buf(),
            generation: 0,
        };
        volume.update(files);
        volume
    }

    fn update(&mut self, files: &[(String, Vec<u8>)]) {
        self.generation += 1;
        let name = format!("..{}", self.generation);
        for (path, data) in files {
            let file = self.root.join(&name).join(path);
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(&file, data).unwrap();
        }
        for (path, _) in files {
            let top = path.split('/').next().unwrap();
            let link = self.root.join(top);
            if link.symlink_metadata().is_err() {
                std::os::unix::fs::symlink(format!("..data/{top}"), &link).unwrap();
            }
        }
        let tmp = self.root.join("..data_tmp");
        std::os::unix::fs::symlink(&name, &tmp).unwrap();
        std::fs::rename(&tmp, self.root.join("..data")).unwrap();
    }
}

/// Secret name -> key -> content.
type Secrets = BTreeMap<String, BTreeMap<String, Vec<u8>>>;

/// A kubernetes.io/tls Secret's keys from certificate files.
fn tls_secret(cert: &Path, key: &Path, ca: &Path) -> BTreeMap<String, Vec<u8>> {
    [("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)]
        .into_iter()
        .map(|(k, p)| (k.to_string(), std::fs::read(p).unwrap()))
        .collect()
}

/// The files of the one volume `d`'s container mounts, as the kubelet writes them: its
/// ConfigMaps' keys from their manifests, each text passed through `edit`, its Secrets'
/// keys from `secrets`. Returns the mount path too.
fn volume_files(
    all: &[Manifest],
    d: &Deployment,
    secrets: &Secrets,
    edit: impl Fn(&str) -> String,
) -> (String, Vec<(String, Vec<u8>)>) {
    let c = only_container(d);
    let mounts: Vec<_> = c.volume_mounts.iter().flatten().collect();
    assert_eq!(mounts.len(), 1);
    let volume = pod_spec(d)
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mounts[0].name)
        .unwrap();
    let projected = volume.projected.as_ref().expect("a projected volume");
    let pick = |items: &Option<Vec<KeyToPath>>, data: BTreeMap<String, Vec<u8>>| match items {
        None => data.into_iter().collect::<Vec<_>>(),
        Some(items) => items
            .iter()
            .map(|i| {
                let content = data
                    .get(&i.key)
                    .unwrap_or_else(|| panic!("no key {}", i.key));
                (i.path.clone(), content.clone())
            })
            .collect(),
    };
    let mut files = Vec::new();
    for source in projected.sources.iter().flatten() {
        if let Some(cm) = &source.config_map {
            let data = config_map(all, &cm.name).data.clone().unwrap_or_default();
            let data = data
                .into_iter()
                .map(|(k, v)| (k, edit(&v).into_bytes()))
                .collect();
            files.extend(pick(&cm.items, data));
        }
        if let Some(secret) = &source.secret {
            let data = secrets
                .get(&secret.name)
                .unwrap_or_else(|| panic!("no Secret {} in this test", secret.name));
            files.extend(pick(&secret.items, data.clone()));
        }
    }
    (mounts[0].mount_path.clone(), files)
}

/// The gateway's /etc/envoy, from its Deployment's volume, at `root`: every path in it and
/// the bootstrap rendered by `edit` after /etc/envoy becomes `root`.
fn gateway_volume(
    all: &[Manifest],
    root: &Path,
    secret: BTreeMap<String, Vec<u8>>,
    edit: impl Fn(&str) -> String,
) -> (KubeletVolume, Vec<(String, Vec<u8>)>) {
    let secrets = Secrets::from([(GATEWAY_SECRET.to_string(), secret)]);
    let d = deployment(all, "envoy-gateway");
    let (mount, files) = volume_files(all, d, &secrets, |text| {
        edit(&text.replace(&mount_path(d), root.to_str().unwrap()))
    });
    assert_eq!(mount, "/etc/envoy");
    (KubeletVolume::create(root, &files), files)
}

fn mount_path(d: &Deployment) -> String {
    only_container(d).volume_mounts.as_ref().unwrap()[0]
        .mount_path
        .clone()
}

/// The sidecar's /etc/envoy as its README lays it out (bootstrap.yaml, the two SDS files,
/// xds-tls/ from the Secret) at `root`, its paths and ports rendered by `edit`.
fn sidecar_files(
    root: &Path,
    secret: &BTreeMap<String, Vec<u8>>,
    edit: impl Fn(&str) -> String,
) -> Vec<(String, Vec<u8>)> {
    let path_edit = |text: &str| edit(&text.replace("/etc/envoy", root.to_str().unwrap()));
    let mut files = vec![(
        "bootstrap.yaml".to_string(),
        path_edit(&sidecar_bootstrap_text()).into_bytes(),
    )];
    for file in SIDECAR_SDS_FILES {
        let text = std::fs::read_to_string(deploy_dir().join(file)).unwrap();
        let name = file.strip_prefix("sidecar/").unwrap().to_string();
        files.push((name, path_edit(&text).into_bytes()));
    }
    for (key, data) in secret {
        files.push((format!("xds-tls/{key}"), data.clone()));
    }
    files
}

/// Certificates for a test: `pki`, ray-xds's CA, and `other`, a CA nobody here trusts.
struct Pkis {
    pki: TestPki,
    other: TestPki,
    _dir: tempfile::TempDir,
}

impl Pkis {
    fn new() -> Pkis {
        let dir = tempfile::tempdir().unwrap();
        Pkis {
            pki: TestPki::new(&dir.path().join("pki")),
            other: TestPki::new(&dir.path().join("other")),
            _dir: dir,
        }
    }

    /// An Envoy's Secret: its client certificate and the CA it trusts ray-xds with.
    fn client_secret(pki: &TestPki) -> BTreeMap<String, Vec<u8>> {
        tls_secret(
            &pki.client_cert_path,
            &pki.client_key_path,
            &pki.ca_pem_path,
        )
    }

    /// ray-xds's Secret: its server certificate and the CA of the clients it lets in.
    fn server_secret(&self) -> BTreeMap<String, Vec<u8>> {
        tls_secret(
            &self.pki.server_cert_path,
            &self.pki.server_key_path,
            &self.pki.ca_pem_path,
        )
    }
}

#[test]
fn gateway_bootstrap_passes_envoy_validation() {
    let all = manifests();
    let pkis = Pkis::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("etc-envoy");
    let (_volume, _) = gateway_volume(&all, &root, Pkis::client_secret(&pkis.pki), |t| {
        t.to_string()
    });
    // Exactly the Deployment's flags: node id and cluster come from them. (Validation
    // does not resolve the STRICT_DNS name, so cluster.local is fine here; it needs the
    // SDS files in place, but does not read the certificates: the runs below do.)
    envoy_validate(&gateway_args(
        &all,
        &root.join("bootstrap.yaml"),
        "envoy-gateway-7d9f-abcde",
    ));
}

#[test]
fn sidecar_bootstrap_passes_envoy_validation() {
    let pkis = Pkis::new();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("etc-envoy");
    let files = sidecar_files(&root, &Pkis::client_secret(&pkis.pki), |t| t.to_string());
    let _volume = KubeletVolume::create(&root, &files);
    let config = root.join("bootstrap.yaml");
    envoy_validate(&["-c".into(), config.to_str().unwrap().into()]);
    // As it is in the repository, the SDS files it names are missing: Envoy says so (the
    // validation above is no formality).
    let out = Command::new(envoy_binary())
        .args(["--mode", "validate", "--log-level", "error", "-c"])
        .arg(deploy_dir().join(SIDECAR_BOOTSTRAP))
        .args(["--base-id", &base_id().to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/etc/envoy/xds-tls-certificate.yaml"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A bootstrap from `deploy/` for loopback: ray-xds at 127.0.0.1:`xds_port` (the SNI and
/// the name checked in ray-xds's certificate stay the Service's), and each
/// `port_value: from` as `to`.
fn render(text: &str, xds_port: u16, ports: &[(u16, u16)]) -> String {
    let socket = format!("{{ address: {XDS_HOST}, port_value: 18000 }}");
    if !text.contains("static_resources") {
        return text.to_string(); // an SDS file
    }
    assert!(text.contains(&socket), "{socket}");
    let mut out = text.replace(
        &socket,
        &format!("{{ address: 127.0.0.1, port_value: {xds_port} }}"),
    );
    for (from, to) in ports {
        let from = format!("port_value: {from}");
        assert!(out.contains(&from), "{from}");
        out = out.replace(&from, &format!("port_value: {to}"));
    }
    out
}

/// ray-xds with deploy/'s own `xds.tls`: its config file and `secret` laid out as the
/// Deployment's volume holds them, the config loaded by ray-xds's loader (so the paths
/// it names must be where the volume puts the Secret), then run on loopback ports
/// (`xds_port`, or any) with the file source on `services`.
async fn start_ray_xds_with_deploy_tls(
    all: &[Manifest],
    root: &Path,
    secret: BTreeMap<String, Vec<u8>>,
    services: &Path,
    xds_port: u16,
) -> (ray_xds::runtime::Running, KubeletVolume) {
    let d = deployment(all, "ray-xds");
    let secrets = Secrets::from([(XDS_SECRET.to_string(), secret)]);
    let (mount, files) = volume_files(all, d, &secrets, |text| {
        text.replace(&mount_path(d), root.to_str().unwrap())
    });
    assert_eq!(mount, "/etc/ray-xds");
    let volume = KubeletVolume::create(root, &files);
    let deployed = ray_xds::config::Config::load(&ray_xds::config::ServeArgs {
        config: Some(root.join("ray-xds.yaml")),
        ..Default::default()
    })
    .unwrap();
    let tls = deployed.xds_tls.expect("xds.tls");
    for path in [&tls.cert, &tls.key, &tls.client_ca] {
        assert!(path.starts_with(root) && path.exists(), "{path:?}");
    }
    let mut config = test_config(services, 0);
    config.xds_tls = Some(tls);
    config.xds_listen = format!("127.0.0.1:{xds_port}").parse().unwrap();
    let xds = ray_xds::runtime::start(config, Default::default())
        .await
        .unwrap();
    (xds, volume)
}

/// A real Envoy on a rendered bootstrap (in a volume laid out as the kubelet does); its
/// admin on `admin_port`.
struct RunningEnvoy {
    _process: ChildGuard,
    admin: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl RunningEnvoy {
    fn start(config: &Path, admin_port: u16, args: impl Fn(&Path) -> Vec<String>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("envoy.log");
        let process = spawn(
            "envoy",
            Command::new(envoy_binary())
                .args(args(config))
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

    /// One of Envoy's counters (0 when it has none yet).
    async fn stat(&self, name: &str) -> u64 {
        let url = format!("{}/stats?filter=^{}$", self.admin, name.replace('.', "\\."));
        let (_, text) = http_get(&url).await.unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
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

/// The Envoy ray-xds knows by `node_id`, whole (its subscriptions), from its
/// /debug/clients.
async fn xds_client(admin: std::net::SocketAddr, node_id: &str) -> Value {
    eventually(
        &format!("{node_id} connected to ray-xds"),
        DEADLINE,
        || async {
            let page = admin_get(admin, &format!("/debug/clients?node={node_id}")).await;
            let v: Value = serde_json::from_str(&page).ok()?;
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
/// through routes and clusters from ray-xds, over mTLS with deploy/'s own TLS settings on
/// both sides, and never subscribes to listeners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_bootstrap_routes_through_ray_xds() {
    let all = manifests();
    let pkis = Pkis::new();
    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&a])).unwrap();
    let (xds, _xds_volume) = start_ray_xds_with_deploy_tls(
        &all,
        &dir.path().join("etc-ray-xds"),
        pkis.server_secret(),
        &services,
        0,
    )
    .await;

    let admin_port = free_port();
    let root = dir.path().join("etc-envoy");
    let files = sidecar_files(&root, &Pkis::client_secret(&pkis.pki), |text| {
        render(text, xds.xds_addr.port(), &[(9901, admin_port), (15080, 0)])
    });
    let _volume = KubeletVolume::create(&root, &files);
    let envoy = RunningEnvoy::start(&root.join("bootstrap.yaml"), admin_port, |config| {
        vec!["-c".into(), config.to_str().unwrap().into()]
    });
    let port = envoy.listener_port("ray-serve-local").await;
    let served = eventually("a request through the sidecar", DEADLINE, || async {
        through_envoy(port).await
    })
    .await;
    assert_eq!(served.cluster, "demo-a");
    // Over TLS: Envoy counts its handshakes with ray-xds.
    assert!(envoy.stat("cluster.ray-xds.ssl.handshake").await >= 1);

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

/// A sidecar whose certificates are from a CA ray-xds does not trust (and that trusts
/// another CA) gets nothing; once its Secret is renewed in place (the kubelet's `..data`
/// swap: new files, no restart), the same Envoy re-reads them through its SDS files,
/// connects and routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_reaches_a_running_envoy() {
    let all = manifests();
    let pkis = Pkis::new();
    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&a])).unwrap();
    let (xds, _xds_volume) = start_ray_xds_with_deploy_tls(
        &all,
        &dir.path().join("etc-ray-xds"),
        pkis.server_secret(),
        &services,
        0,
    )
    .await;

    let admin_port = free_port();
    let root = dir.path().join("etc-envoy");
    let edit = |text: &str| render(text, xds.xds_addr.port(), &[(9901, admin_port), (15080, 0)]);
    let wrong = sidecar_files(&root, &Pkis::client_secret(&pkis.other), edit);
    let mut volume = KubeletVolume::create(&root, &wrong);
    let envoy = RunningEnvoy::start(&root.join("bootstrap.yaml"), admin_port, |config| {
        vec!["-c".into(), config.to_str().unwrap().into()]
    });
    // Envoy refuses ray-xds's certificate (not from the CA it trusts), over and over.
    eventually("Envoy refuses ray-xds's certificate", DEADLINE, || async {
        (envoy.stat("cluster.ray-xds.ssl.fail_verify_error").await >= 2).then_some(())
    })
    .await;
    let clients = admin_get(xds.admin_addr, "/debug/clients").await;
    assert!(!clients.contains("my-app-sidecar"), "{clients}");

    volume.update(&sidecar_files(&root, &Pkis::client_secret(&pkis.pki), edit));
    let port = envoy.listener_port("ray-serve-local").await;
    let served = eventually(
        "a request through the renewed sidecar",
        DEADLINE,
        || async { through_envoy(port).await },
    )
    .await;
    assert_eq!(served.cluster, "demo-a");
    xds_client(xds.admin_addr, "my-app-sidecar").await;
    xds.stop().await.unwrap();
}

/// The gateway bootstrap with the Deployment's own flags: /ready (through the health
/// listener, the kubelet's probe) is not 200 while ray-xds is away, past Envoy's default
/// 15 s initial fetch timeout, and turns 200 once ray-xds answers; then requests flow.
/// Only GET /ready and /stats/prometheus reach the admin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_bootstrap_is_ready_only_with_ray_xds_config() {
    let all = manifests();
    let pkis = Pkis::new();
    let dir = tempfile::tempdir().unwrap();
    let xds_port = free_port();
    let admin_port = free_port();
    let root = dir.path().join("etc-envoy");
    let (_volume, _) = gateway_volume(&all, &root, Pkis::client_secret(&pkis.pki), |text| {
        render(text, xds_port, &[(9901, admin_port), (9902, 0)])
    });
    let started = Instant::now();
    let envoy = RunningEnvoy::start(&root.join("bootstrap.yaml"), admin_port, |config| {
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
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&a])).unwrap();
    let (xds, _xds_volume) = start_ray_xds_with_deploy_tls(
        &all,
        &dir.path().join("etc-ray-xds"),
        pkis.server_secret(),
        &services,
        xds_port,
    )
    .await;
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

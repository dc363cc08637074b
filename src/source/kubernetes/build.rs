//! From the RayServices and Ray pods the watches hold to a [`Model`]. Pure.
//!
//! - A RayService's clusters are the ones its status names: `activeServiceStatus` and
//!   `pendingServiceStatus.rayClusterName`. With only a pending cluster (a first deploy),
//!   that one is the active cluster; with neither, the RayService is not routed yet.
//! - A cluster's proxies are its pods (label `ray.io/cluster`, same namespace) that are
//!   Running and have an IP, at the container port named `serve` (8000 if none). A pod
//!   with a deletion timestamp is a draining proxy. A `hostNetwork` pod's proxy is marked
//!   so ([`Proxy::host_network`]): its IP is its node's, and the address policy refuses it
//!   unless `proxies.networks` allows it. Its dashboard is at the head pod's IP and the
//!   port named `dashboard` (8265 if none).
//! - `spec.excludeHeadPodFromServeSvc` forces `head_proxy: exclude`; `ray-xds.io/*`
//!   annotations set hosts and policy overrides.
//! - KubeRay's application statuses are hints only and do not reach the model: each
//!   cluster's own dashboard is the authority. The applications `spec.serveConfigV2`
//!   deploys (names, route prefixes) go to the newest cluster (the pending one, else the
//!   active one) until its dashboard answers.
//!
//! Hosts: a RayService claims `ray-xds.io/hosts`, or by default `<name>.<namespace>` and
//! `<name>.<namespace>.svc`. A host outside what its namespace may claim
//! ([`HostPolicy`], `source.kubernetes.allowed_hosts`) is refused; a host an older
//! RayService (by creation time, then `namespace/name`, as Gateway API orders routes)
//! already claims is left to it. Each is reported, and the RayService keeps its other
//! hosts; one with no host left is left out. A RayService that would make the model
//! invalid (a name Envoy would reject) is left out and reported; the others are still
//! served.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use super::annotations;
use super::objects::{PodObject, RayServiceObject};
use crate::model::{
    host_within, HeadProxy, HostPolicy, Model, NodeType, Proxy, RayCluster, RayService,
};

/// Something in the objects that ray-xds ignored, reported once by the caller.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    /// `rayservice <ns>/<name>` or `pod <ns>/<name>`.
    pub object: String,
    /// A short label for metrics: `bad_annotation`, `invalid_rayservice`, ...
    pub reason: &'static str,
    pub message: String,
}

/// The model, and what was left out of it.
#[derive(Debug, Default)]
pub struct Built {
    pub model: Model,
    pub problems: Vec<Problem>,
    /// RayServices whose status names no RayCluster yet.
    pub unrouted: Vec<String>,
    /// What KubeRay's status says of each cluster's applications (RayService → cluster →
    /// application → status), shown in `/debug/state` as a hint; never used for routing.
    pub hints: Hints,
}

pub(crate) type Hints = BTreeMap<String, BTreeMap<String, BTreeMap<String, String>>>;

/// One RayService, built alone: what [`assemble`] puts together. The index keeps one per
/// RayService and rebuilds it only when its object or its clusters' pods change.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct ServiceBuild {
    /// `<namespace>/<name>`.
    pub key: String,
    /// `None` when it is not routed yet or is invalid on its own.
    pub service: Option<RayService>,
    pub problems: Vec<Problem>,
    /// Its status names no RayCluster yet.
    pub unrouted: bool,
    /// KubeRay's application statuses per cluster.
    pub hints: BTreeMap<String, BTreeMap<String, String>>,
    /// When the RayService was created (unix seconds): the older claim of a host wins.
    pub created: Option<i64>,
    /// The hosts it claims and may (held even while it is not routed yet).
    pub claims: Vec<String>,
}

/// The clusters a RayService's status names: active (or a lone pending) and pending.
pub(crate) fn cluster_names(r: &RayServiceObject) -> (Option<String>, Option<String>) {
    let name_of = |s: &Option<super::objects::ClusterStatus>| {
        s.as_ref()
            .and_then(|s| s.ray_cluster_name.clone())
            .filter(|n| !n.is_empty())
    };
    match (name_of(&r.active), name_of(&r.pending)) {
        (Some(a), Some(p)) if a == p => (Some(a), None),
        (Some(a), p) => (Some(a), p),
        (None, Some(p)) => (Some(p), None),
        (None, None) => (None, None),
    }
}

/// Builds one RayService from its object and the pods of its clusters (`pods_of(cluster)`
/// gives those of the RayService's namespace).
pub(crate) fn service<'a>(
    r: &RayServiceObject,
    pods_of: impl Fn(&str) -> Vec<&'a PodObject>,
    hosts: &HostPolicy,
) -> ServiceBuild {
    let object = format!("rayservice {}/{}", r.namespace, r.name);
    let mut built = ServiceBuild {
        key: format!("{}/{}", r.namespace, r.name),
        created: r.created,
        ..Default::default()
    };
    let annotated = annotations::read(&r.annotations);
    for (key, message) in &annotated.problems {
        built.problems.push(Problem {
            object: object.clone(),
            reason: "bad_annotation",
            message: format!("annotation {key} ignored: {message}"),
        });
    }
    let allowed = claimed_hosts(
        r,
        annotated.hosts.as_deref(),
        hosts,
        &object,
        &mut built.problems,
    );
    // A RayService not routed yet holds its claims all the same (the older keeps a host).
    built.claims = allowed.clone();
    let (Some(active), pending) = cluster_names(r) else {
        built.unrouted = true;
        return built;
    };
    for status in r.active.iter().chain(&r.pending) {
        if let (Some(cluster), Some(apps)) =
            (&status.ray_cluster_name, &status.application_statuses)
        {
            built.hints.insert(
                cluster.clone(),
                apps.iter()
                    .map(|(app, s)| (app.clone(), s.status.clone().unwrap_or_default()))
                    .collect(),
            );
        }
    }
    let mut policy = annotated.policy;
    if r.exclude_head_pod {
        policy.head_proxy = HeadProxy::Exclude;
    }
    // The Serve config names the applications the newest cluster runs (or will): a hint
    // until its dashboard answers (`live::discovery`).
    let runs_config = pending.as_ref().unwrap_or(&active);
    let clusters = std::iter::once(&active)
        .chain(pending.as_ref())
        .map(|name| {
            let mut c = cluster(name, &pods_of(name), &object, &mut built.problems);
            if name == runs_config {
                c.applications = r.applications.clone();
            }
            c
        })
        .collect();
    if allowed.is_empty() {
        built.problems.push(Problem {
            object,
            reason: "host_refused",
            message: "left out: every host it claims is refused".into(),
        });
        return built;
    }
    let service = RayService {
        namespace: r.namespace.clone(),
        name: r.name.clone(),
        hosts: allowed,
        active_cluster: active,
        pending_traffic_cap: pending
            .as_ref()
            .and_then(|_| r.pending.as_ref()?.traffic_routed_percent)
            .map(|percent| percent.clamp(0, 100) as u32),
        pending_cluster: pending,
        clusters,
        policy,
    };
    // Valid on its own (hosts claimed by others are checked in `assemble`).
    match Model::new(vec![service.clone()]) {
        Ok(_) => built.service = Some(service),
        Err(e) => {
            built.claims.clear();
            built.problems.push(Problem {
                object,
                reason: "invalid_rayservice",
                message: format!("left out: {e}"),
            })
        }
    }
    built
}

/// The most hosts one RayService may claim (`ray-xds.io/hosts`); more, and the annotation
/// is ignored (its default hosts apply).
pub(crate) const MAX_HOSTS: usize = 256;

/// Hosts named in one problem; the rest are counted.
const HOSTS_NAMED: usize = 5;

/// `"a", "b", "c" (and 7 more)`.
fn some_hosts(hosts: &[String]) -> String {
    let named: Vec<String> = hosts
        .iter()
        .take(HOSTS_NAMED)
        .map(|h| format!("{h:?}"))
        .collect();
    let more = hosts.len().saturating_sub(HOSTS_NAMED);
    if more > 0 {
        format!("{} (and {more} more)", named.join(", "))
    } else {
        named.join(", ")
    }
}

/// The hosts RayService `r` claims and may: its annotation's (at most [`MAX_HOSTS`]) or
/// its default ones, each a valid virtual-host domain, once (in any case), within what
/// its namespace may claim. What is dropped is reported in one problem per reason,
/// naming a few hosts (so a huge annotation costs little).
fn claimed_hosts(
    r: &RayServiceObject,
    annotated: Option<&[String]>,
    policy: &HostPolicy,
    object: &str,
    problems: &mut Vec<Problem>,
) -> Vec<String> {
    let defaults = || {
        vec![
            format!("{}.{}", r.name, r.namespace),
            format!("{}.{}.svc", r.name, r.namespace),
        ]
    };
    let claimed = match annotated {
        Some(hosts) if hosts.len() > MAX_HOSTS => {
            problems.push(Problem {
                object: object.to_string(),
                reason: "bad_annotation",
                message: format!(
                    "annotation ray-xds.io/hosts ignored: {} hosts, at most {MAX_HOSTS}; the default hosts apply",
                    hosts.len()
                ),
            });
            defaults()
        }
        Some(hosts) => hosts.to_vec(),
        None => defaults(),
    };
    let mut seen = BTreeSet::new();
    let (mut valid, mut invalid) = (Vec::new(), Vec::new());
    for host in claimed {
        if crate::model::check_host(&host).is_err() {
            invalid.push(host);
        } else if seen.insert(host.to_ascii_lowercase()) {
            valid.push(host);
        }
    }
    if !invalid.is_empty() {
        problems.push(Problem {
            object: object.to_string(),
            reason: "bad_annotation",
            message: format!(
                "{} host(s) of ray-xds.io/hosts ignored, not virtual-host domains (a name, '*', '*.suffix' or 'prefix.*'): {}",
                invalid.len(),
                some_hosts(&invalid)
            ),
        });
    }
    let (allowed, refused): (Vec<String>, Vec<String>) = valid
        .into_iter()
        .partition(|h| policy.allows(&r.namespace, &r.name, h));
    if !refused.is_empty() {
        problems.push(Problem {
            object: object.to_string(),
            reason: "host_refused",
            message: format!(
                "{} host(s) refused, outside what RayServices of namespace {} may claim ({}; source.kubernetes.allowed_hosts): {}",
                refused.len(),
                r.namespace,
                policy.describe(&r.namespace, &r.name),
                some_hosts(&refused)
            ),
        });
    }
    allowed
}

/// Puts built RayServices into one model. Hosts go to the oldest claimant (creation time,
/// then `namespace/name`; one without a creation time counts as the newest), routed or
/// not yet: a younger RayService loses each host an older one holds, and each name inside
/// a wildcard an older RayService of another namespace holds (Envoy would send that name
/// to the younger, more specific claim), is reported, and keeps its others (left out when
/// none is left). A RayService whose proxies clash with an older one's (an address that
/// is HTTP there and gRPC here) is left out alone.
pub(crate) fn assemble<'a>(built: impl IntoIterator<Item = &'a ServiceBuild>) -> Built {
    let mut out = Built::default();
    let mut services = Vec::new();
    // Host (lowercase) → the RayService holding it; wildcards also with its namespace.
    let mut claimed: BTreeMap<String, String> = BTreeMap::new();
    let mut wildcards: Vec<(String, String, String)> = Vec::new();
    let mut built: Vec<&ServiceBuild> = built.into_iter().collect();
    built.sort_by(|a, b| {
        let age = |b: &ServiceBuild| (b.created.is_none(), b.created);
        age(a).cmp(&age(b)).then_with(|| a.key.cmp(&b.key))
    });
    for b in built {
        out.problems.extend(b.problems.iter().cloned());
        if b.unrouted {
            out.unrouted.push(b.key.clone());
        }
        if let Some(service) = &b.service {
            if !b.hints.is_empty() {
                out.hints.insert(service.key(), b.hints.clone());
            }
        }
        let namespace = b.key.split('/').next().unwrap_or_default();
        let object = format!("rayservice {}", b.key);
        let mut lost: Vec<String> = Vec::new();
        let mut kept: Vec<String> = Vec::new();
        for host in &b.claims {
            let lower = host.to_ascii_lowercase();
            let holder = claimed.get(&lower).cloned().or_else(|| {
                wildcards
                    .iter()
                    .find(|(w, _, ns)| ns != namespace && host_within(&lower, w))
                    .map(|(w, owner, _)| format!("{owner} (its {w:?})"))
            });
            match holder {
                Some(holder) if holder != b.key => lost.push(format!("{host:?} left to {holder}")),
                _ => kept.push(host.clone()),
            }
        }
        for host in &kept {
            let lower = host.to_ascii_lowercase();
            if lower != "*" && (lower.starts_with('*') || lower.ends_with('*')) {
                wildcards.push((lower.clone(), b.key.clone(), namespace.to_string()));
            }
            claimed.insert(lower, b.key.clone());
        }
        if !lost.is_empty() {
            let named: Vec<&str> = lost.iter().take(HOSTS_NAMED).map(String::as_str).collect();
            let more = lost.len().saturating_sub(HOSTS_NAMED);
            out.problems.push(Problem {
                object: object.clone(),
                reason: "host_conflict",
                message: format!(
                    "{} host(s) held by older RayServices, which claimed them first: {}{}",
                    lost.len(),
                    named.join(", "),
                    if more > 0 {
                        format!(" (and {more} more)")
                    } else {
                        String::new()
                    }
                ),
            });
        }
        let Some(service) = &b.service else {
            continue;
        };
        if kept.is_empty() {
            out.problems.push(Problem {
                object,
                reason: "host_conflict",
                message: "left out: every host it claims is held by an older RayService".into(),
            });
            continue;
        }
        let mut service = service.clone();
        service.hosts = kept;
        services.push(service);
    }
    out.model = match Model::new(services.clone()) {
        Ok(model) => model,
        // Each RayService is valid alone; together they are not (two namespaces' pods on
        // one address, one as HTTP and one as gRPC): keep the older, leave the one that
        // clashes out, alone.
        Err(_) => {
            let mut kept: Vec<RayService> = Vec::new();
            for service in services {
                let mut candidate = kept.clone();
                candidate.push(service.clone());
                match Model::new(candidate) {
                    Ok(_) => kept.push(service),
                    Err(e) => out.problems.push(Problem {
                        object: format!("rayservice {}", service.key()),
                        reason: "invalid_rayservice",
                        message: format!("left out, clashing with an older RayService: {e}"),
                    }),
                }
            }
            Model::new(kept).unwrap_or_default()
        }
    };
    out.unrouted.sort();
    out.problems.sort();
    out.problems.dedup();
    out
}

/// The model of a whole set of objects at once (the index builds the same incrementally).
pub fn build<'a>(
    rayservices: impl IntoIterator<Item = &'a RayServiceObject>,
    pods: impl IntoIterator<Item = &'a PodObject>,
    hosts: &HostPolicy,
) -> Built {
    let mut by_cluster: BTreeMap<(&str, &str), Vec<&PodObject>> = BTreeMap::new();
    for pod in pods {
        by_cluster
            .entry((pod.namespace.as_str(), pod.cluster.as_str()))
            .or_default()
            .push(pod);
    }
    let mut rayservices: Vec<&RayServiceObject> = rayservices.into_iter().collect();
    rayservices.sort_by_key(|r| r.key());
    let built: Vec<ServiceBuild> = rayservices
        .iter()
        .map(|r| {
            service(
                r,
                |cluster| {
                    by_cluster
                        .get(&(r.namespace.as_str(), cluster))
                        .cloned()
                        .unwrap_or_default()
                },
                hosts,
            )
        })
        .collect();
    assemble(&built)
}

fn cluster(
    name: &str,
    pods: &[&PodObject],
    object: &str,
    problems: &mut Vec<Problem>,
) -> RayCluster {
    let mut proxies: Vec<Proxy> = Vec::new();
    let mut seen = BTreeSet::new();
    let mut pods: Vec<&&PodObject> = pods.iter().collect();
    pods.sort_by_key(|p| (&p.namespace, &p.name));
    for pod in &pods {
        let (true, Some(ip)) = (pod.running, pod.ip) else {
            continue;
        };
        let address = SocketAddr::new(ip, pod.serve_port);
        if !seen.insert(address) {
            problems.push(Problem {
                object: format!("pod {}/{}", pod.namespace, pod.name),
                reason: "duplicate_address",
                message: format!(
                    "{object}: another pod of cluster {name} already serves at {address}"
                ),
            });
            continue;
        }
        proxies.push(Proxy {
            address,
            grpc: pod.grpc_port.map(|port| SocketAddr::new(ip, port)),
            node_type: if pod.head {
                NodeType::Head
            } else {
                NodeType::Worker
            },
            draining: pod.terminating,
            host_network: pod.host_network,
        });
    }
    // The head that is not going away, else any running head.
    let head = pods
        .iter()
        .filter(|p| p.head && p.running && p.ip.is_some())
        .min_by_key(|p| p.terminating);
    let dashboard = head.and_then(|p| {
        p.ip.map(|ip| format!("http://{}", SocketAddr::new(ip, p.dashboard_port)))
    });
    RayCluster {
        name: name.to_string(),
        dashboard,
        proxies,
        // Each pod says its own (listed proxies carry their gRPC address).
        grpc_port: None,
        // The pods are the proxies: Kubernetes knows them before Ray does.
        discover: false,
        direct_ingress: false,
        applications: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::objects::ClusterStatus;
    use super::*;

    fn rs(name: &str, active: Option<&str>, pending: Option<&str>) -> RayServiceObject {
        let status = |c: Option<&str>| {
            c.map(|c| ClusterStatus {
                ray_cluster_name: Some(c.into()),
                ..Default::default()
            })
        };
        RayServiceObject {
            namespace: "ml".into(),
            name: name.into(),
            annotations: Default::default(),
            labels: Default::default(),
            exclude_head_pod: false,
            created: None,
            active: status(active),
            pending: status(pending),
            applications: Vec::new(),
        }
    }

    /// Namespace `ml` may claim any host.
    fn open() -> HostPolicy {
        HostPolicy::new(BTreeMap::from([("ml".to_string(), vec!["*".to_string()])])).unwrap()
    }

    fn pod(name: &str, cluster: &str, ip: &str, head: bool) -> PodObject {
        PodObject {
            namespace: "ml".into(),
            name: name.into(),
            cluster: cluster.into(),
            head,
            ip: Some(ip.parse().unwrap()),
            running: true,
            terminating: false,
            host_network: false,
            serve_port: 8000,
            dashboard_port: 8265,
            grpc_port: None,
        }
    }

    #[test]
    fn active_and_pending_clusters_with_their_pods() {
        let services = [rs("llm", Some("llm-a"), Some("llm-b"))];
        let mut terminating = pod("a-worker-2", "llm-a", "10.0.0.3", false);
        terminating.terminating = true;
        let mut pending_pod = pod("a-worker-3", "llm-a", "10.0.0.4", false);
        pending_pod.running = false;
        let mut host_network = pod("a-worker-1", "llm-a", "10.0.0.2", false);
        host_network.host_network = true;
        let pods = [
            pod("a-head", "llm-a", "10.0.0.1", true),
            host_network,
            terminating,
            pending_pod,
            pod("b-head", "llm-b", "10.0.1.1", true),
            pod("other", "unrelated", "10.0.9.9", true),
        ];
        let built = build(&services, &pods, &open());
        assert_eq!(built.problems, vec![]);
        let s = &built.model.services()[0];
        assert_eq!(s.key(), "ml/llm");
        assert_eq!(s.hosts, ["llm.ml", "llm.ml.svc"]);
        assert_eq!(s.active_cluster, "llm-a");
        assert_eq!(s.pending_cluster.as_deref(), Some("llm-b"));
        let a = s.cluster("llm-a").unwrap();
        assert_eq!(a.dashboard.as_deref(), Some("http://10.0.0.1:8265"));
        let proxies: Vec<(String, NodeType, bool, bool)> = a
            .proxies
            .iter()
            .map(|p| {
                let address = p.address.to_string();
                (address, p.node_type, p.draining, p.host_network)
            })
            .collect();
        assert_eq!(
            proxies,
            [
                ("10.0.0.1:8000".to_string(), NodeType::Head, false, false),
                ("10.0.0.2:8000".to_string(), NodeType::Worker, false, true),
                ("10.0.0.3:8000".to_string(), NodeType::Worker, true, false),
            ],
            "the not-Running pod has no endpoint; the terminating one drains; the \
             hostNetwork one is marked for the address policy"
        );
        assert_eq!(s.cluster("llm-b").unwrap().proxies.len(), 1);
    }

    /// The Serve config's applications go to the cluster that runs it: the pending one
    /// during an upgrade (the active one still runs the old config), else the active one.
    #[test]
    fn the_serve_config_applications_go_to_the_newest_cluster() {
        let apps = vec![crate::model::test_support::app("work", Some("/work"), &[])];
        let mut upgrading = rs("llm", Some("llm-a"), Some("llm-b"));
        upgrading.applications = apps.clone();
        let mut steady = rs("tts", Some("tts-a"), None);
        steady.applications = apps.clone();
        let pods = [
            pod("a-head", "llm-a", "10.0.0.1", true),
            pod("b-head", "llm-b", "10.0.1.1", true),
            pod("t-head", "tts-a", "10.0.2.1", true),
        ];
        let built = build(&[upgrading, steady], &pods, &open());
        assert_eq!(built.problems, vec![]);
        let service = |key: &str| {
            built
                .model
                .services()
                .iter()
                .find(|s| s.key() == key)
                .unwrap()
        };
        let llm = service("ml/llm");
        assert!(llm.cluster("llm-a").unwrap().applications.is_empty());
        assert_eq!(llm.cluster("llm-b").unwrap().applications, apps);
        let tts = service("ml/tts");
        assert_eq!(tts.cluster("tts-a").unwrap().applications, apps);
    }

    #[test]
    fn a_pod_with_a_grpc_port_serves_grpc_at_its_ip() {
        let services = [rs("llm", Some("llm-a"), None)];
        let mut head = pod("a-head", "llm-a", "10.0.0.1", true);
        head.grpc_port = Some(9000);
        let pods = [head, pod("a-worker", "llm-a", "10.0.0.2", false)];
        let built = build(&services, &pods, &open());
        let a = built.model.services()[0].cluster("llm-a").unwrap().clone();
        let grpc: Vec<Option<String>> = a
            .proxies
            .iter()
            .map(|p| p.grpc.map(|g| g.to_string()))
            .collect();
        assert_eq!(grpc, [Some("10.0.0.1:9000".to_string()), None]);
        assert!(a.serves_grpc());
    }

    #[test]
    fn kuberay_application_statuses_are_kept_as_hints_only() {
        let mut r = rs("llm", Some("llm-a"), Some("llm-b"));
        r.active.as_mut().unwrap().application_statuses = Some(
            [(
                "app".to_string(),
                super::super::objects::AppStatusHint {
                    status: Some("RUNNING".into()),
                },
            )]
            .into(),
        );
        let built = build(&[r], &[], &open());
        assert_eq!(built.hints["ml/llm"]["llm-a"]["app"], "RUNNING");
        assert!(
            !built.hints["ml/llm"].contains_key("llm-b"),
            "absent is unknown, not an empty list"
        );
    }

    #[test]
    fn a_first_deploy_routes_to_its_pending_cluster_and_no_status_is_not_routed() {
        let services = [rs("new", None, Some("new-a")), rs("blank", None, None)];
        let built = build(&services, &[], &open());
        let s = &built.model.services()[0];
        assert_eq!(
            (s.active_cluster.as_str(), s.pending_cluster.as_ref()),
            ("new-a", None)
        );
        assert!(s.cluster("new-a").unwrap().proxies.is_empty());
        assert_eq!(built.unrouted, ["ml/blank"]);
    }

    #[test]
    fn exclude_head_pod_and_annotations_apply() {
        let mut r = rs("llm", Some("llm-a"), None);
        r.exclude_head_pod = true;
        r.annotations
            .insert("ray-xds.io/head-proxy".into(), "include".into());
        r.annotations
            .insert("ray-xds.io/hosts".into(), "llm.example.com".into());
        r.annotations
            .insert("ray-xds.io/retries".into(), "lots".into());
        let built = build(&[r], &[], &open());
        let s = &built.model.services()[0];
        assert_eq!(s.policy.head_proxy, HeadProxy::Exclude, "the spec wins");
        assert_eq!(s.hosts, ["llm.example.com"]);
        assert_eq!(built.problems.len(), 1);
        assert_eq!(built.problems[0].reason, "bad_annotation");
    }

    #[test]
    fn a_conflicting_or_invalid_rayservice_is_left_out_alone() {
        let mut first = rs("a", Some("a-1"), None);
        first
            .annotations
            .insert("ray-xds.io/hosts".into(), "shared.example".into());
        let mut second = rs("b", Some("b-1"), None);
        second
            .annotations
            .insert("ray-xds.io/hosts".into(), "shared.example".into());
        let invalid = rs("c", Some("Not_A_DNS_Label"), None);
        let fine = rs("d", Some("d-1"), None);
        let built = build(&[second, first, invalid, fine], &[], &open());
        let keys: Vec<String> = built.model.services().iter().map(|s| s.key()).collect();
        assert_eq!(keys, ["ml/a", "ml/d"]);
        let reasons: Vec<(&str, &str)> = built
            .problems
            .iter()
            .map(|p| (p.object.as_str(), p.reason))
            .collect();
        assert_eq!(
            reasons,
            [
                ("rayservice ml/b", "host_conflict"),
                ("rayservice ml/b", "host_conflict"),
                ("rayservice ml/c", "invalid_rayservice")
            ]
        );
    }

    #[test]
    fn the_same_objects_in_any_order_build_the_same_model() {
        let services = [
            rs("x", Some("x-1"), None),
            rs("y", Some("y-1"), Some("y-2")),
        ];
        let pods = [
            pod("x1", "x-1", "10.0.0.1", true),
            pod("x2", "x-1", "10.0.0.2", false),
            pod("y1", "y-2", "10.0.0.3", true),
        ];
        let forward = build(&services, &pods, &open()).model;
        let mut rs_rev = services.to_vec();
        rs_rev.reverse();
        let mut pods_rev = pods.to_vec();
        pods_rev.reverse();
        assert_eq!(forward, build(&rs_rev, &pods_rev, &open()).model);
    }

    fn claiming(namespace: &str, name: &str, hosts: &str, created: i64) -> RayServiceObject {
        let mut r = rs(name, Some(&format!("{name}-1")), None);
        r.namespace = namespace.into();
        r.created = Some(created);
        r.annotations
            .insert("ray-xds.io/hosts".into(), hosts.into());
        r
    }

    fn hosts_of(built: &Built) -> Vec<(String, Vec<String>)> {
        built
            .model
            .services()
            .iter()
            .map(|s| (s.key(), s.hosts.clone()))
            .collect()
    }

    #[test]
    fn a_namespace_claims_only_its_own_names_unless_the_policy_gives_it_more() {
        let policy = HostPolicy::new(BTreeMap::from([(
            "team-a".to_string(),
            vec!["*.team-a.example.com".to_string()],
        )]))
        .unwrap();
        let services = [
            claiming(
                "team-a",
                "llm",
                "chat.team-a.example.com, llm.team-a, evil.example.com",
                1,
            ),
            claiming("team-b", "llm", "chat.team-a.example.com, *", 2),
            claiming("team-b", "own", "own.team-b.svc", 3),
        ];
        let built = build(&services, &[], &policy);
        assert_eq!(
            hosts_of(&built),
            [
                (
                    "team-a/llm".to_string(),
                    vec!["chat.team-a.example.com".to_string(), "llm.team-a".into()]
                ),
                ("team-b/own".to_string(), vec!["own.team-b.svc".to_string()]),
            ]
        );
        let problems: Vec<(&str, &str, &str)> = built
            .problems
            .iter()
            .map(|p| (p.object.as_str(), p.reason, p.message.as_str()))
            .collect();
        // One problem per RayService and reason, naming the hosts.
        assert_eq!(problems.len(), 3, "{problems:#?}");
        assert!(problems
            .iter()
            .any(|(o, r, m)| *o == "rayservice team-a/llm"
                && *r == "host_refused"
                && m.contains("\"evil.example.com\"")
                && m.contains("llm.team-a, llm.team-a.svc, *.team-a.example.com")));
        assert!(problems
            .iter()
            .any(|(o, r, m)| *o == "rayservice team-b/llm"
                && *r == "host_refused"
                && m.contains("\"*\"")));
        assert!(problems
            .iter()
            .any(|(o, r, m)| *o == "rayservice team-b/llm"
                && *r == "host_refused"
                && m.contains("chat.team-a.example.com")));
        assert!(problems
            .iter()
            .any(|(o, r, m)| *o == "rayservice team-b/llm"
                && *r == "host_refused"
                && m.contains("every host")));
    }

    #[test]
    fn the_older_rayservice_keeps_a_contended_host_whatever_the_names() {
        let policy = HostPolicy::new(BTreeMap::from([
            ("alpha".to_string(), vec!["*.example.com".to_string()]),
            ("zulu".to_string(), vec!["*.example.com".to_string()]),
        ]))
        .unwrap();
        // zulu/z is older: it keeps shared.example.com though alpha/a sorts first.
        let older = claiming("zulu", "z", "shared.example.com, z.example.com", 100);
        let younger = claiming("alpha", "a", "shared.example.com, a.example.com", 200);
        for order in [
            [older.clone(), younger.clone()],
            [younger.clone(), older.clone()],
        ] {
            let built = build(&order, &[], &policy);
            assert_eq!(
                hosts_of(&built),
                [
                    ("alpha/a".to_string(), vec!["a.example.com".to_string()]),
                    (
                        "zulu/z".to_string(),
                        vec!["shared.example.com".to_string(), "z.example.com".into()]
                    ),
                ]
            );
            assert_eq!(built.problems.len(), 1);
            assert_eq!(built.problems[0].object, "rayservice alpha/a");
            assert_eq!(built.problems[0].reason, "host_conflict");
            assert!(built.problems[0]
                .message
                .contains("\"shared.example.com\" left to zulu/z"));
        }
        // Created in the same second: namespace/name decides. No timestamp: the newest.
        let mut tie = younger.clone();
        tie.created = Some(100);
        assert_eq!(
            hosts_of(&build(&[older.clone(), tie], &[], &policy))[0].1,
            ["shared.example.com", "a.example.com"]
        );
        let mut unknown = older.clone();
        unknown.created = None;
        assert_eq!(
            hosts_of(&build(&[unknown, younger.clone()], &[], &policy))[0].1,
            ["shared.example.com", "a.example.com"]
        );
        // Every host taken: left out, reported.
        let copycat = claiming("alpha", "c", "shared.example.com", 300);
        let built = build(&[older, copycat], &[], &policy);
        assert_eq!(built.model.services().len(), 1);
        assert!(built
            .problems
            .iter()
            .any(|p| p.object == "rayservice alpha/c" && p.message.starts_with("left out")));
    }
}

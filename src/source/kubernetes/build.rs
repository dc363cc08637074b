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
//!   cluster's own dashboard is the authority.
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
use crate::model::{HeadProxy, HostPolicy, Model, NodeType, Proxy, RayCluster, RayService};

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

pub type Hints = BTreeMap<String, BTreeMap<String, BTreeMap<String, String>>>;

/// One RayService, built alone: what [`assemble`] puts together. The index keeps one per
/// RayService and rebuilds it only when its object or its clusters' pods change.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServiceBuild {
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
}

/// The clusters a RayService's status names: active (or a lone pending) and pending.
pub fn cluster_names(r: &RayServiceObject) -> (Option<String>, Option<String>) {
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
pub fn service<'a>(
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
    let annotated = annotations::read(&r.annotations);
    for (key, message) in annotated.problems {
        built.problems.push(Problem {
            object: object.clone(),
            reason: "bad_annotation",
            message: format!("annotation {key} ignored: {message}"),
        });
    }
    let mut policy = annotated.policy;
    if r.exclude_head_pod {
        policy.head_proxy = HeadProxy::Exclude;
    }
    let clusters = std::iter::once(&active)
        .chain(pending.as_ref())
        .map(|name| cluster(name, &pods_of(name), &object, &mut built.problems))
        .collect();
    let claimed = annotated.hosts.unwrap_or_else(|| {
        vec![
            format!("{}.{}", r.name, r.namespace),
            format!("{}.{}.svc", r.name, r.namespace),
        ]
    });
    let (allowed, refused): (Vec<String>, Vec<String>) = claimed
        .into_iter()
        .partition(|h| hosts.allows(&r.namespace, &r.name, h));
    for host in &refused {
        built.problems.push(Problem {
            object: object.clone(),
            reason: "host_refused",
            message: format!(
                "host {host:?} refused: RayServices of namespace {} may claim {} (source.kubernetes.allowed_hosts)",
                r.namespace,
                hosts.describe(&r.namespace, &r.name)
            ),
        });
    }
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
        pending_cluster: pending,
        clusters,
        policy,
    };
    // Valid on its own (hosts claimed by others are checked in `assemble`).
    match Model::new(vec![service.clone()]) {
        Ok(_) => built.service = Some(service),
        Err(e) => built.problems.push(Problem {
            object,
            reason: "invalid_rayservice",
            message: format!("left out: {e}"),
        }),
    }
    built
}

/// Puts built RayServices into one model. Hosts go to the oldest claimant (creation time,
/// then `namespace/name`; one without a creation time counts as the newest): a younger
/// RayService loses each host an older one holds, is reported, and keeps its others (left
/// out when none is left).
pub fn assemble<'a>(built: impl IntoIterator<Item = &'a ServiceBuild>) -> Built {
    let mut out = Built::default();
    let mut services = Vec::new();
    let mut claimed: BTreeMap<String, String> = BTreeMap::new();
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
        let Some(service) = &b.service else {
            continue;
        };
        if !b.hints.is_empty() {
            out.hints.insert(service.key(), b.hints.clone());
        }
        let object = format!("rayservice {}", service.key());
        let mut service = service.clone();
        service.hosts.retain(|h| match claimed.get(&h.to_ascii_lowercase()) {
            None => true,
            Some(older) => {
                out.problems.push(Problem {
                    object: object.clone(),
                    reason: "host_conflict",
                    message: format!(
                        "host {h:?} left to {older}, which claimed it first (the older RayService keeps a host)"
                    ),
                });
                false
            }
        });
        if service.hosts.is_empty() {
            out.problems.push(Problem {
                object,
                reason: "host_conflict",
                message: "left out: every host it claims is held by an older RayService".into(),
            });
            continue;
        }
        for h in &service.hosts {
            claimed.insert(h.to_ascii_lowercase(), service.key());
        }
        services.push(service);
    }
    match Model::new(services) {
        Ok(model) => out.model = model,
        // Every service was checked above; this would be a bug, not bad input.
        Err(e) => out.problems.push(Problem {
            object: "model".into(),
            reason: "invalid_rayservice",
            message: format!("no RayService routed: {e}"),
        }),
    }
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
                application_statuses: None,
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
        assert_eq!(problems.len(), 4, "{problems:#?}");
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
            assert!(built.problems[0].message.contains("left to zulu/z"));
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

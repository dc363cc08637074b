//! The Kubernetes source's index: RayServices and Ray pods as the watches last delivered
//! them, and each RayService's part of the model, rebuilt only when its own object or a
//! pod of one of its clusters changes. Pure: the watch task applies events, tests write
//! to it directly.
//!
//! Invariants: [`Index::built`] equals `build::build` of the objects applied (the
//! incremental path never diverges from the whole rebuild; a test checks it on random
//! sequences); deleting an object the index does not hold, or applying one unchanged,
//! rebuilds nothing.

use std::collections::{BTreeMap, BTreeSet};

use super::build::{self, Built, ServiceBuild};
use super::objects::{PodObject, RayServiceObject};
use crate::model::HostPolicy;

type Key = (String, String);

/// A pod's cluster, within its namespace.
type ClusterKey = (String, String);

#[derive(Debug, Default)]
pub struct Index {
    rayservices: BTreeMap<Key, RayServiceObject>,
    /// Pods by (namespace, cluster), then by name.
    pods: BTreeMap<ClusterKey, BTreeMap<String, PodObject>>,
    /// Which cluster each pod is in (to find it again when it is deleted).
    pod_cluster: BTreeMap<Key, ClusterKey>,
    /// The RayServices that route to each cluster.
    routed_by: BTreeMap<ClusterKey, BTreeSet<Key>>,
    built: BTreeMap<Key, ServiceBuild>,
    /// RayServices whose build is out of date.
    dirty: BTreeSet<Key>,
    /// What each namespace may claim.
    hosts: HostPolicy,
}

impl Index {
    /// An empty index whose RayServices claim hosts within `hosts`.
    pub fn new(hosts: HostPolicy) -> Index {
        Index {
            hosts,
            ..Default::default()
        }
    }

    pub fn apply_rayservice(&mut self, r: RayServiceObject) {
        let key = r.key();
        if self.rayservices.get(&key) == Some(&r) {
            return;
        }
        self.unroute(&key);
        for cluster in clusters(&r) {
            self.routed_by
                .entry((r.namespace.clone(), cluster))
                .or_default()
                .insert(key.clone());
        }
        self.rayservices.insert(key.clone(), r);
        self.dirty.insert(key);
    }

    pub fn delete_rayservice(&mut self, key: &Key) {
        self.unroute(key);
        if self.rayservices.remove(key).is_some() {
            self.built.remove(key);
            self.dirty.remove(key);
        }
    }

    pub fn apply_pod(&mut self, pod: PodObject) {
        let key = pod.key();
        let cluster = (pod.namespace.clone(), pod.cluster.clone());
        if let Some(old) = self.pod_cluster.get(&key).cloned() {
            if old != cluster {
                self.delete_pod(&key);
            } else if self.pods.get(&cluster).and_then(|p| p.get(&pod.name)) == Some(&pod) {
                return;
            }
        }
        self.pod_cluster.insert(key, cluster.clone());
        self.pods
            .entry(cluster.clone())
            .or_default()
            .insert(pod.name.clone(), pod);
        self.touch(&cluster);
    }

    pub(crate) fn delete_pod(&mut self, key: &Key) {
        let Some(cluster) = self.pod_cluster.remove(key) else {
            return;
        };
        if let Some(pods) = self.pods.get_mut(&cluster) {
            pods.remove(&key.1);
            if pods.is_empty() {
                self.pods.remove(&cluster);
            }
        }
        self.touch(&cluster);
    }

    #[cfg(test)]
    /// Replaces every pod with `objects` (a full list).
    pub(crate) fn reset_pods(&mut self, objects: impl IntoIterator<Item = PodObject>) {
        let objects: BTreeMap<Key, PodObject> = objects.into_iter().map(|p| (p.key(), p)).collect();
        let gone: Vec<Key> = self
            .pod_cluster
            .keys()
            .filter(|k| !objects.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            self.delete_pod(&key);
        }
        for (_, p) in objects {
            self.apply_pod(p);
        }
    }

    /// The model of everything applied, rebuilding only the RayServices that changed.
    pub fn built(&mut self) -> Built {
        for key in std::mem::take(&mut self.dirty) {
            let Some(r) = self.rayservices.get(&key) else {
                continue;
            };
            let pods = &self.pods;
            let b = build::service(
                r,
                |cluster| {
                    pods.get(&(r.namespace.clone(), cluster.to_string()))
                        .map(|p| p.values().collect())
                        .unwrap_or_default()
                },
                &self.hosts,
            );
            self.built.insert(key, b);
        }
        build::assemble(self.built.values())
    }

    #[cfg(test)]
    /// How many RayServices the next [`Index::built`] rebuilds.
    pub(crate) fn pending_rebuilds(&self) -> usize {
        self.dirty.len()
    }

    fn touch(&mut self, cluster: &ClusterKey) {
        if let Some(services) = self.routed_by.get(cluster) {
            self.dirty.extend(services.iter().cloned());
        }
    }

    fn unroute(&mut self, key: &Key) {
        let Some(old) = self.rayservices.get(key) else {
            return;
        };
        for cluster in clusters(old) {
            let ck = (old.namespace.clone(), cluster);
            if let Some(set) = self.routed_by.get_mut(&ck) {
                set.remove(key);
                if set.is_empty() {
                    self.routed_by.remove(&ck);
                }
            }
        }
    }
}

fn clusters(r: &RayServiceObject) -> Vec<String> {
    let (active, pending) = build::cluster_names(r);
    active.into_iter().chain(pending).collect()
}

#[cfg(test)]
mod tests {
    use super::super::objects::ClusterStatus;
    use super::*;
    use proptest::prelude::*;

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

    fn pod(name: &str, cluster: &str, last_octet: u8, head: bool) -> PodObject {
        PodObject {
            namespace: "ml".into(),
            name: name.into(),
            cluster: cluster.into(),
            head,
            ip: Some(std::net::IpAddr::from([10, 0, 0, last_octet])),
            running: true,
            terminating: false,
            host_network: false,
            serve_port: 8000,
            dashboard_port: 8265,
            grpc_port: None,
        }
    }

    #[test]
    fn a_pod_change_rebuilds_only_the_rayservices_of_its_cluster() {
        let mut index = Index::default();
        index.apply_rayservice(rs("a", Some("a1"), None));
        index.apply_rayservice(rs("b", Some("b1"), Some("b2")));
        index.apply_pod(pod("a1-head", "a1", 1, true));
        index.apply_pod(pod("b2-head", "b2", 2, true));
        let built = index.built();
        assert_eq!(built.model.services().len(), 2);
        assert_eq!(index.pending_rebuilds(), 0);

        index.apply_pod(pod("b2-worker", "b2", 3, false));
        assert_eq!(index.pending_rebuilds(), 1, "only b routes to b2");
        let built = index.built();
        assert_eq!(
            built.model.services()[1]
                .cluster("b2")
                .unwrap()
                .proxies
                .len(),
            2
        );

        // An unchanged object, a pod of no RayService's cluster, an unknown delete: nothing.
        index.apply_pod(pod("b2-worker", "b2", 3, false));
        index.apply_pod(pod("stray", "z9", 9, true));
        index.delete_pod(&("ml".into(), "nope".into()));
        assert_eq!(index.pending_rebuilds(), 0);

        // A pod that moves to another cluster (relabelled) leaves the old one.
        index.apply_pod(pod("b2-worker", "a1", 3, false));
        assert_eq!(index.pending_rebuilds(), 2);
        let built = index.built();
        assert_eq!(
            built.model.services()[0]
                .cluster("a1")
                .unwrap()
                .proxies
                .len(),
            2
        );
        assert_eq!(
            built.model.services()[1]
                .cluster("b2")
                .unwrap()
                .proxies
                .len(),
            1
        );

        // The RayService promotes b2 and drops b1: it is rebuilt, and follows b2's pods.
        index.apply_rayservice(rs("b", Some("b2"), None));
        let built = index.built();
        assert_eq!(built.model.services()[1].active_cluster, "b2");
        index.delete_rayservice(&("ml".into(), "a".into()));
        let built = index.built();
        assert_eq!(built.model.services().len(), 1);
        index.apply_pod(pod("a1-head", "a1", 5, true));
        assert_eq!(
            index.pending_rebuilds(),
            0,
            "a is gone; nobody routes to a1"
        );
    }

    #[derive(Clone, Debug)]
    enum Op {
        ApplyService(u8, Option<u8>, Option<u8>),
        DeleteService(u8),
        ApplyPod(u8, u8, bool, bool),
        DeletePod(u8),
        ResetPods(Vec<(u8, u8)>),
    }

    fn op() -> impl Strategy<Value = Op> {
        let cluster = 0u8..4;
        prop_oneof![
            (
                0u8..3,
                proptest::option::of(cluster.clone()),
                proptest::option::of(cluster.clone())
            )
                .prop_map(|(s, a, p)| Op::ApplyService(s, a, p)),
            (0u8..3).prop_map(Op::DeleteService),
            (0u8..6, cluster.clone(), any::<bool>(), any::<bool>())
                .prop_map(|(p, c, h, t)| Op::ApplyPod(p, c, h, t)),
            (0u8..6).prop_map(Op::DeletePod),
            proptest::collection::vec((0u8..6, cluster), 0..4).prop_map(Op::ResetPods),
        ]
    }

    proptest! {
        /// Whatever the sequence of events, the index's model is the whole rebuild's.
        #[test]
        fn the_incremental_model_equals_a_whole_rebuild(ops in proptest::collection::vec(op(), 1..40)) {
            let mut index = Index::default();
            let mut services: BTreeMap<u8, RayServiceObject> = BTreeMap::new();
            let mut pods: BTreeMap<u8, PodObject> = BTreeMap::new();
            let name = |c: u8| format!("c{c}");
            for op in ops {
                match op {
                    Op::ApplyService(s, a, p) => {
                        let r = rs(&format!("s{s}"), a.map(name).as_deref(), p.map(name).as_deref());
                        services.insert(s, r.clone());
                        index.apply_rayservice(r);
                    }
                    Op::DeleteService(s) => {
                        services.remove(&s);
                        index.delete_rayservice(&("ml".into(), format!("s{s}")));
                    }
                    Op::ApplyPod(p, c, head, terminating) => {
                        let mut o = pod(&format!("p{p}"), &name(c), p + 1, head);
                        o.terminating = terminating;
                        pods.insert(p, o.clone());
                        index.apply_pod(o);
                    }
                    Op::DeletePod(p) => {
                        pods.remove(&p);
                        index.delete_pod(&("ml".into(), format!("p{p}")));
                    }
                    Op::ResetPods(list) => {
                        pods = list
                            .into_iter()
                            .map(|(p, c)| (p, pod(&format!("p{p}"), &name(c), p + 1, false)))
                            .collect();
                        index.reset_pods(pods.values().cloned());
                    }
                }
                // The reverse map holds exactly who routes where.
                let mut routed: BTreeMap<ClusterKey, BTreeSet<Key>> = BTreeMap::new();
                for r in services.values() {
                    for c in clusters(r) {
                        routed.entry((r.namespace.clone(), c)).or_default().insert(r.key());
                    }
                }
                prop_assert_eq!(&index.routed_by, &routed);
                let whole = build::build(services.values(), pods.values(), &Default::default());
                let incremental = index.built();
                prop_assert_eq!(&incremental.model, &whole.model);
                prop_assert_eq!(&incremental.problems, &whole.problems);
                prop_assert_eq!(&incremental.unrouted, &whole.unrouted);
            }
        }
    }
}

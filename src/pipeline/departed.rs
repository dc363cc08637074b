//! Clusters the source dropped, kept (their endpoints draining) for their grace period so
//! that requests in flight on them finish before Envoy loses them; a whole RayService the
//! source dropped likewise (its virtual host stays, with no proxy to take new requests,
//! until its clusters go). Pure: time is passed in.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::SystemTime;

use crate::live::peers::{from_unix, to_unix, DepartedCluster, DepartedProxy};
use crate::model::{AddressPolicy, Model, NodeType, Proxy, ProxyOrigin, RayCluster, RayService};
use crate::policy::switchover::SwitchoverPolicy;

/// The most proxies a cluster taken from a peer may have.
pub(crate) const MAX_ADOPTED_PROXIES: usize = 10_000;
/// The most departed clusters kept for one RayService, and in all, when taking them from
/// peers (a RayService leaves one or two behind per upgrade).
pub(crate) const MAX_ADOPTED_PER_SERVICE: usize = 4;
pub(crate) const MAX_ADOPTED: usize = 64;

/// Clusters the source dropped, kept for their drain grace period.
#[derive(Clone, Debug, Default)]
pub struct Departed {
    /// (RayService key, cluster) → the cluster as last listed, and when it may go.
    clusters: BTreeMap<(String, String), (RayCluster, SystemTime)>,
    /// RayService key → the RayService as last listed, and when it may go.
    services: BTreeMap<String, (RayService, SystemTime)>,
}

impl Departed {
    /// Notes the clusters `previous` had and `current` lacks, forgets expired ones and any
    /// that came back, and returns `current` with the departed still draining added.
    pub fn update(
        &mut self,
        previous: &Model,
        current: &Model,
        defaults: &SwitchoverPolicy,
        now: SystemTime,
    ) -> Model {
        if self.advance(Some(previous), current, defaults, now) {
            self.with_departed(current)
        } else {
            current.clone()
        }
    }

    /// As [`Departed::update`], sharing `current` when nothing drains, and not comparing
    /// the models when `current` is the very model of the last build (nothing can have
    /// left): a build that only health changed costs nothing here.
    pub(crate) fn update_shared(
        &mut self,
        previous: &Arc<Model>,
        current: &Arc<Model>,
        defaults: &SwitchoverPolicy,
        now: SystemTime,
    ) -> Arc<Model> {
        let previous = (!Arc::ptr_eq(previous, current)).then_some(&**previous);
        if self.advance(previous, current, defaults, now) {
            Arc::new(self.with_departed(current))
        } else {
            current.clone()
        }
    }

    /// Notes what left since `previous` (none when it is `current` itself) and forgets
    /// what is gone for good; true while something drains.
    fn advance(
        &mut self,
        previous: Option<&Model>,
        current: &Model,
        defaults: &SwitchoverPolicy,
        now: SystemTime,
    ) -> bool {
        if let Some(previous) = previous {
            self.note_departures(previous, current, defaults, now);
        }
        self.forget_gone(current, now);
        !(self.clusters.is_empty() && self.services.is_empty())
    }

    /// Notes the clusters and RayServices `previous` had and `current` lacks.
    fn note_departures(
        &mut self,
        previous: &Model,
        current: &Model,
        defaults: &SwitchoverPolicy,
        now: SystemTime,
    ) {
        let by_key: BTreeMap<String, &RayService> =
            current.services().iter().map(|s| (s.key(), s)).collect();
        for old in previous.services() {
            let Some(new) = by_key.get(&old.key()) else {
                // The whole RayService went: all its clusters drain.
                let until = now + defaults.with(&old.policy.overrides.switchover).drain_grace;
                self.services
                    .entry(old.key())
                    .or_insert((old.clone(), until));
                continue;
            };
            for cluster in &old.clusters {
                if new.cluster(&cluster.name).is_none() {
                    let until = now + defaults.with(&new.policy.overrides.switchover).drain_grace;
                    self.clusters
                        .entry((old.key(), cluster.name.clone()))
                        .or_insert((cluster.clone(), until));
                }
            }
        }
    }

    /// Forgets what expired, and what `current` lists again.
    fn forget_gone(&mut self, current: &Model, now: SystemTime) {
        self.clusters.retain(|(service, cluster), (_, until)| {
            *until > now
                && current
                    .services()
                    .iter()
                    .find(|s| s.key() == *service)
                    .is_some_and(|s| s.cluster(cluster).is_none())
        });
        self.services.retain(|key, (_, until)| {
            *until > now && !current.services().iter().any(|s| s.key() == *key)
        });
    }

    /// `current` with the departed clusters and RayServices added back.
    fn with_departed(&self, current: &Model) -> Model {
        let services: Vec<RayService> = current
            .services()
            .iter()
            .map(|s| {
                let mut s = s.clone();
                for ((service, _), (cluster, _)) in &self.clusters {
                    if *service == s.key() {
                        s.clusters.push(cluster.clone());
                    }
                }
                s
            })
            .collect();
        // Valid: the names were unique in `previous`, and none is in `current`.
        let with_clusters = Model::new(services.clone()).unwrap_or_else(|_| current.clone());
        if self.services.is_empty() {
            return with_clusters;
        }
        // A departed RayService whose hosts another one now claims goes at once.
        let mut all = with_clusters.services().to_vec();
        for (service, _) in self.services.values() {
            let mut candidate = all.clone();
            candidate.push(service.clone());
            if Model::new(candidate.clone()).is_ok() {
                all = candidate;
            }
        }
        Model::new(all).unwrap_or(with_clusters)
    }

    /// Takes the clusters peers keep draining that this replica does not know (it
    /// restarted since the source dropped them): a cluster of a RayService `current` has,
    /// that `current` lacks, until no later than its drain grace from `now` allows, with
    /// only the proxies `addresses` lets the source publish. Its endpoints only drain.
    pub fn adopt(
        &mut self,
        peers: &[DepartedCluster],
        current: &Model,
        defaults: &SwitchoverPolicy,
        addresses: &AddressPolicy,
        now: SystemTime,
    ) {
        if peers.is_empty() {
            return;
        }
        // No address the source lists anywhere: a live proxy stays the source's (probed,
        // withheld until its first probe), whatever a peer says.
        let live: BTreeSet<std::net::SocketAddr> = current.endpoints().map(|(a, _)| a).collect();
        for peer in peers {
            let key = (peer.service.clone(), peer.cluster.clone());
            if self.clusters.contains_key(&key) || peer.proxies.len() > MAX_ADOPTED_PROXIES {
                continue;
            }
            let of_service = self
                .clusters
                .keys()
                .filter(|(s, _)| *s == peer.service)
                .count();
            if self.clusters.len() >= MAX_ADOPTED || of_service >= MAX_ADOPTED_PER_SERVICE {
                continue;
            }
            let Some(service) = current.services().iter().find(|s| s.key() == peer.service) else {
                continue;
            };
            let grace = defaults
                .with(&service.policy.overrides.switchover)
                .drain_grace;
            let Some(until) = from_unix(peer.until_unix) else {
                continue;
            };
            if service.cluster(&peer.cluster).is_some() || until <= now || until > now + grace {
                continue;
            }
            let source = |a| addresses.check(a, ProxyOrigin::Source).is_ok() && !live.contains(&a);
            let mut proxies: Vec<Proxy> = peer
                .proxies
                .iter()
                .filter(|p| source(p.address))
                .map(|p| Proxy {
                    address: p.address,
                    grpc: p.grpc.filter(|g| source(*g) && *g != p.address),
                    node_type: if p.head {
                        NodeType::Head
                    } else {
                        NodeType::Worker
                    },
                    draining: true,
                    host_network: false,
                })
                .collect();
            proxies.sort();
            proxies.dedup_by_key(|p| p.address);
            let cluster = RayCluster {
                name: peer.cluster.clone(),
                dashboard: None,
                grpc_port: None,
                proxies,
                discover: false,
                direct_ingress: false,
                applications: Vec::new(),
            };
            // Only what keeps the model valid (a name Envoy takes, one protocol per address).
            let mut candidate = service.clone();
            candidate.clusters.push(cluster.clone());
            if Model::new(vec![candidate]).is_ok() {
                self.clusters.insert(key, (cluster, until));
            }
        }
    }

    /// What this replica keeps draining, for its peers.
    pub fn view(&self) -> Vec<DepartedCluster> {
        self.clusters
            .iter()
            .map(|((service, name), (cluster, until))| DepartedCluster {
                service: service.clone(),
                cluster: name.clone(),
                until_unix: to_unix(*until),
                proxies: cluster
                    .proxies
                    .iter()
                    .map(|p| DepartedProxy {
                        address: p.address,
                        grpc: p.grpc,
                        head: p.node_type == NodeType::Head,
                    })
                    .collect(),
            })
            .collect()
    }

    /// The proxies of departed clusters: never awaiting a first probe (the prober does
    /// not probe them; they only drain).
    pub fn addresses(&self) -> BTreeSet<std::net::SocketAddr> {
        self.clusters
            .values()
            .flat_map(|(c, _)| c.proxies.iter().map(|p| p.address))
            .collect()
    }

    /// Whether `cluster` of `service` is draining after the source dropped it.
    pub fn contains(&self, service: &str, cluster: &str) -> bool {
        self.clusters
            .contains_key(&(service.to_string(), cluster.to_string()))
    }

    /// The Envoy cluster names of every departed cluster (those of departed RayServices
    /// included).
    pub(crate) fn envoy_cluster_names(&self) -> BTreeSet<String> {
        self.clusters
            .keys()
            .map(|(service, cluster)| format!("{service}/{cluster}"))
            .chain(
                self.services
                    .values()
                    .flat_map(|(s, _)| s.clusters.iter().map(|c| s.envoy_cluster_name(&c.name))),
            )
            .collect()
    }

    /// When the next departed cluster or RayService may go.
    pub fn next_expiry(&self) -> Option<SystemTime> {
        self.clusters
            .values()
            .map(|(_, until)| *until)
            .chain(self.services.values().map(|(_, until)| *until))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_support::service;
    use crate::policy::switchover::GlobalSwitchover;
    use std::time::Duration;

    const A: &str = "a1";
    const B: &str = "b1";
    const T0: SystemTime = SystemTime::UNIX_EPOCH;

    /// RayService `s` served by b1, with a1 pending.
    fn two_clusters() -> Model {
        let mut s = service("s", B, &[9000]);
        s.clusters.push(service("s", A, &[8000]).clusters.remove(0));
        s.pending_cluster = Some(A.into());
        Model::new(vec![s]).unwrap()
    }

    #[test]
    fn a_dropped_cluster_drains_for_its_grace_period() {
        let before = two_clusters();
        let mut after = before.services()[0].clone();
        after.pending_cluster = None;
        after.clusters.retain(|c| c.name == B);
        let after = Model::new(vec![after]).unwrap();
        let mut d = Departed::default();
        let kept = d.update(&before, &after, &SwitchoverPolicy::default(), T0);
        assert!(kept.services()[0].cluster(A).is_some(), "a1 drains");
        assert!(d.contains("default/s", A));
        assert_eq!(d.next_expiry(), Some(T0 + Duration::from_secs(30)));
        let still = d.update(
            &after,
            &after,
            &SwitchoverPolicy::default(),
            T0 + Duration::from_secs(29),
        );
        assert!(still.services()[0].cluster(A).is_some());
        let gone = d.update(
            &after,
            &after,
            &SwitchoverPolicy::default(),
            T0 + Duration::from_secs(31),
        );
        assert!(gone.services()[0].cluster(A).is_none());
        assert_eq!(d.next_expiry(), None);
        // A cluster that comes back is the source's again.
        let mut d = Departed::default();
        d.update(&before, &after, &SwitchoverPolicy::default(), T0);
        let back = d.update(
            &after,
            &before,
            &SwitchoverPolicy::default(),
            T0 + Duration::from_secs(1),
        );
        assert!(!d.contains("default/s", A));
        assert_eq!(back, before);
    }

    #[test]
    fn the_drain_grace_a_rayservice_inherits_decides_how_long_its_dropped_cluster_stays() {
        let global = SwitchoverPolicy::default().with_global(&GlobalSwitchover {
            drain_grace: Some(Duration::from_secs(7)),
            ..Default::default()
        });
        let before = two_clusters();
        let mut plain = before.services()[0].clone();
        plain.pending_cluster = None;
        plain.clusters.retain(|c| c.name == B);
        let after = Model::new(vec![plain.clone()]).unwrap();
        let mut d = Departed::default();
        d.update(&before, &after, &global, T0);
        assert_eq!(d.next_expiry(), Some(T0 + Duration::from_secs(7)));
        // One RayService's own drain_grace wins.
        let mut own = before.services()[0].clone();
        own.policy.overrides.switchover.drain_grace = Some(Duration::from_secs(2));
        let before = Model::new(vec![own.clone()]).unwrap();
        own.pending_cluster = None;
        own.clusters.retain(|c| c.name == B);
        let after = Model::new(vec![own]).unwrap();
        let mut d = Departed::default();
        d.update(&before, &after, &global, T0);
        assert_eq!(d.next_expiry(), Some(T0 + Duration::from_secs(2)));
    }

    #[test]
    fn a_dropped_rayservice_drains_all_its_clusters_then_goes() {
        let before = two_clusters();
        let after = Model::default();
        let mut d = Departed::default();
        let kept = d.update(&before, &after, &SwitchoverPolicy::default(), T0);
        assert_eq!(kept, before, "still there, draining");
        assert_eq!(
            d.envoy_cluster_names(),
            ["default/s/a1".to_string(), "default/s/b1".to_string()].into()
        );
        assert_eq!(d.next_expiry(), Some(T0 + Duration::from_secs(30)));
        let gone = d.update(
            &after,
            &after,
            &SwitchoverPolicy::default(),
            T0 + Duration::from_secs(30),
        );
        assert_eq!(gone, after);
        assert_eq!(d.next_expiry(), None);
        // One that comes back is the source's again at once.
        let mut d = Departed::default();
        d.update(&before, &after, &SwitchoverPolicy::default(), T0);
        let back = d.update(
            &after,
            &before,
            &SwitchoverPolicy::default(),
            T0 + Duration::from_secs(1),
        );
        assert_eq!(back, before);
        assert!(d.envoy_cluster_names().is_empty());
    }

    /// A replica restarted while a dropped cluster drains takes it from a peer,
    /// with what a peer cannot make it take left out.
    #[test]
    fn a_restarted_replica_keeps_draining_what_its_peer_drains() {
        let before = two_clusters();
        let mut after = before.services()[0].clone();
        after.pending_cluster = None;
        after.clusters.retain(|c| c.name == B);
        let after = Model::new(vec![after]).unwrap();
        let mut peer = Departed::default();
        peer.update(&before, &after, &SwitchoverPolicy::default(), T0);
        let view = peer.view();
        assert_eq!(view.len(), 1);

        let at = T0 + Duration::from_secs(10);
        let policy = SwitchoverPolicy::default();
        let mut restarted = Departed::default();
        restarted.adopt(&view, &after, &policy, &AddressPolicy::default(), at);
        let kept = restarted.update(&after, &after, &policy, at);
        let a1 = kept.services()[0].cluster(A).expect("a1 drains here too");
        assert!(a1.proxies.iter().all(|p| p.draining));
        assert_eq!(
            a1.proxies,
            before.services()[0]
                .cluster(A)
                .unwrap()
                .proxies
                .iter()
                .cloned()
                .map(|mut p| {
                    p.draining = true;
                    p
                })
                .collect::<Vec<_>>()
        );
        assert_eq!(
            restarted.next_expiry(),
            Some(T0 + Duration::from_secs(30)),
            "the peer's end, not a new grace"
        );
        assert_eq!(restarted.addresses().len(), 1);

        let adopt = |view: &[DepartedCluster], model: &Model, addresses: &AddressPolicy| {
            let mut d = Departed::default();
            d.adopt(view, model, &policy, addresses, at);
            d.contains("default/s", A)
        };
        // Not while the source still lists the cluster, nor for a RayService it lacks.
        assert!(!adopt(&view, &before, &AddressPolicy::default()));
        assert!(!adopt(&view, &Model::default(), &AddressPolicy::default()));
        // Not past the grace this replica would give, nor already over, nor garbage times.
        for until in [at + Duration::from_secs(31), at, T0] {
            let mut v = view.clone();
            v[0].until_unix = to_unix(until);
            assert!(!adopt(&v, &after, &AddressPolicy::default()), "{until:?}");
        }
        let mut v = view.clone();
        v[0].until_unix = f64::NAN;
        assert!(!adopt(&v, &after, &AddressPolicy::default()));
        // Proxies the address policy refuses are left out (a metadata address always).
        let mut v = view.clone();
        v[0].proxies.push(DepartedProxy {
            address: "169.254.169.254:80".parse().unwrap(),
            grpc: None,
            head: false,
        });
        let mut d = Departed::default();
        d.adopt(&v, &after, &policy, &AddressPolicy::default(), at);
        assert_eq!(d.addresses().len(), 1);
        let elsewhere = AddressPolicy {
            networks: vec!["198.18.0.0/15".parse().unwrap()],
            ..Default::default()
        };
        let mut d = Departed::default();
        d.adopt(&view, &after, &policy, &elsewhere, at);
        assert_eq!(d.addresses().len(), 0, "outside proxies.networks");
        // A name that would make the model invalid: left out.
        let mut v = view.clone();
        v[0].cluster = "Not_A_Label".into();
        let mut d = Departed::default();
        d.adopt(&v, &after, &policy, &AddressPolicy::default(), at);
        assert!(d.addresses().is_empty());
    }
}

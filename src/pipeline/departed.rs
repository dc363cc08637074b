//! Clusters the source dropped, kept (their endpoints draining) for their grace period so
//! that requests in flight on them finish before Envoy loses them; a whole RayService the
//! source dropped likewise (its virtual host stays, with no proxy to take new requests,
//! until its clusters go). Pure: time is passed in.

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use crate::model::{Model, RayCluster, RayService};
use crate::policy::switchover::SwitchoverPolicy;

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
        for old in previous.services() {
            let Some(new) = current.services().iter().find(|s| s.key() == old.key()) else {
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
        if self.clusters.is_empty() && self.services.is_empty() {
            return current.clone();
        }
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

    /// Whether `cluster` of `service` is draining after the source dropped it.
    pub fn contains(&self, service: &str, cluster: &str) -> bool {
        self.clusters
            .contains_key(&(service.to_string(), cluster.to_string()))
    }

    /// The Envoy cluster names of every departed cluster (those of departed RayServices
    /// included).
    pub fn envoy_cluster_names(&self) -> BTreeSet<String> {
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
}

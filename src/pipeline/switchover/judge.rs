//! The outcome rule's round for one RayService (`pipeline::outcomes`): what the Envoys
//! reported of its pending and active clusters, the rollback decision it leads to, and
//! what clears one.
//!
//! A decision on a cluster no longer pending, or on an older version of it, is cleared;
//! a peer's on the same version is taken; the operator's `promote` clears it and keeps
//! that cluster and version from being judged again; otherwise the reports are judged,
//! against the active cluster's own over the window, or, when it ended too few there
//! (after a completed move it ends none), against what it had when it last ended enough.

use std::time::SystemTime;

use super::{unix_second, Switchover};
use crate::live::dashboards::DashboardStates;
use crate::model::RayService;
use crate::pipeline::outcomes::{self, LoadTotals, OutcomeRule, Rollback, Verdict};
use crate::policy::switchover::Control;

impl Switchover {
    /// Whether `service`'s pending cluster is rolled back now (never while the operator
    /// promotes it).
    pub(super) fn outcome_round(
        &mut self,
        service: &RayService,
        key: &str,
        dashboards: &DashboardStates,
        now: SystemTime,
    ) -> bool {
        let policy = self.defaults.with(&service.policy.overrides.switchover);
        let active = &service.active_cluster;
        let Some(pending) = service
            .pending_cluster
            .clone()
            .filter(|p| p != active && service.cluster(p).is_some())
            .filter(|_| service.cluster(active).is_some())
        else {
            self.forget_outcomes(key, service);
            return false;
        };
        let (new, old) = (
            service.envoy_cluster_name(&pending),
            service.envoy_cluster_name(active),
        );
        let version = outcomes::version(service, &pending, dashboards);
        let deployed_now =
            outcomes::deployed_at(service, &pending, dashboards).unwrap_or(SystemTime::UNIX_EPOCH);
        let deployed = match self.version_since.get(&new) {
            Some((seen, since))
                if version.is_some() && *seen == version && *since <= deployed_now =>
            {
                *since
            }
            _ => deployed_now,
        };
        self.version_since
            .insert(new.clone(), (version.clone(), deployed));
        self.judged.insert(new.clone(), deployed);
        self.judged.insert(old.clone(), SystemTime::UNIX_EPOCH);
        self.clear_stale(key, &pending, version.as_deref());
        if self.baselines.get(key).is_some_and(|(c, _)| *c != pending) {
            self.baselines.remove(key);
        }
        let promoted = (pending.clone(), version.clone());
        if policy.control == Control::Promote {
            if let Some(r) = self.rollbacks.remove(key) {
                tracing::info!(rayservice = key, cluster = r.cluster, "switchover: the rollback decision is cleared: the operator promotes the cluster");
            }
            self.promoted.insert(key.to_string(), promoted);
            return false;
        }
        if self.promoted.get(key) == Some(&promoted) {
            return false;
        }
        if !self.rollbacks.contains_key(key) {
            let from_peer = self
                .peers
                .rollback(key, &pending)
                .filter(|r| outcomes::same_version(r.version.as_deref(), version.as_deref()))
                .cloned();
            if let Some(mut r) = from_peer {
                r.version = r.version.or_else(|| version.clone());
                self.rollbacks.insert(key.to_string(), r);
            }
        }
        if self.rollbacks.contains_key(key) {
            return true;
        }
        let loads = self.reported(&[(&new, deployed), (&old, SystemTime::UNIX_EPOCH)]);
        let rule = OutcomeRule {
            margin: policy.outcome_margin,
            min_requests: policy.outcome_min_requests,
        };
        let now_old = loads
            .get(&old)
            .filter(|o| o.ended() >= u64::from(rule.min_requests));
        if let Some(o) = now_old {
            self.baselines
                .insert(key.to_string(), (pending.clone(), *o));
        }
        let baseline = now_old.or(self.baselines.get(key).map(|(_, o)| o));
        let capacity = outcomes::ready_capacity(service, &pending, dashboards);
        if let Verdict::Failing(why) = outcomes::judge(loads.get(&new), baseline, capacity, rule) {
            self.rollbacks.insert(
                key.to_string(),
                Rollback {
                    cluster: pending,
                    version,
                    why,
                    at_unix: unix_second(now),
                },
            );
            return true;
        }
        self.judgeable.insert(key.to_string());
        false
    }

    /// A decision on another cluster than `pending`, or on a version of it seen to
    /// differ, is cleared; one taken while the version was unknown takes the version
    /// now known (a later redeploy then clears it).
    fn clear_stale(&mut self, key: &str, pending: &str, version: Option<&str>) {
        let Some(r) = self.rollbacks.get_mut(key) else {
            return;
        };
        if r.cluster == pending && outcomes::same_version(r.version.as_deref(), version) {
            if r.version.is_none() {
                r.version = version.map(str::to_string);
            }
            return;
        }
        tracing::info!(
            rayservice = key,
            cluster = r.cluster,
            "switchover: the rollback decision is cleared: a new version of the cluster"
        );
        self.rollbacks.remove(key);
        if self.promoted.get(key).is_some_and(|(c, _)| c != pending) {
            self.promoted.remove(key);
        }
    }

    /// `service` has no pending cluster any more: what was decided of it goes, and a
    /// decision the source moved past (it promoted the rolled-back cluster, or made
    /// another one pending) is logged as such.
    fn forget_outcomes(&mut self, key: &str, service: &RayService) {
        if let Some(r) = self.rollbacks.remove(key) {
            if service.active_cluster == r.cluster {
                tracing::warn!(rayservice = key, cluster = r.cluster, why = r.why, "switchover: the source made a rolled-back cluster active; ray-xds keeps traffic where it is ready, but no longer holds this cluster back");
            }
        }
        self.baselines.remove(key);
        self.promoted.remove(key);
    }

    /// What every Envoy reported of each of `clusters`, counted from its time: this
    /// replica's own reports and each peer's, each only if counted from the same time
    /// (a report of an older version, which a ledger not yet told counts, is left out).
    fn reported(&self, clusters: &[(&String, SystemTime)]) -> LoadTotals {
        let mut sum = LoadTotals::new();
        for (cluster, since) in clusters {
            let since_unix = unix_second(*since);
            let own = self.own_loads.get(*cluster).filter(|_| {
                self.loads_since.get(*cluster).map(|t| unix_second(*t)) == Some(since_unix)
            });
            let peers = self.peers.loads.get(*cluster).into_iter().flatten();
            let peers = peers
                .filter(|l| l.since_unix == since_unix)
                .map(|l| &l.counts);
            for counts in own.into_iter().chain(peers) {
                sum.entry((*cluster).clone()).or_default().add(counts);
            }
        }
        sum
    }

    /// The rollback decision on `key`'s pending cluster, if any.
    pub(crate) fn rollback(&self, key: &str) -> Option<&Rollback> {
        self.rollbacks.get(key)
    }

    /// Whether some RayService's pending cluster has traffic and may be rolled back by
    /// the next reports: the pipeline reads them every report interval then.
    pub fn judging(&self) -> bool {
        !self.judging.is_empty()
    }
}

//! The outcome rule's round for one RayService (`pipeline::outcomes`): what the Envoys
//! reported of the cluster a switch moves to and of the one it moves from
//! ([`judged_pair`]), the rollback decision it leads to, and what clears one.
//!
//! The pair is the source's pending cluster and its active one; or, with none pending,
//! the active cluster the source named early (an early flip) and the cluster traffic is
//! moving from, for as long as the source lists it: the one traffic is still on, or,
//! once the move completed, the one it came from (a move this replica or a peer made: a
//! cluster merely listed beside the active one is no way back). Without such a pair
//! nothing is judged.
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

/// The cluster `service`'s switch moves to, whose outcomes are judged, and the one it
/// moves from, whose outcomes are the baseline, while traffic is on `serving`: the
/// pending cluster and the active one; with none pending (an early flip), the active
/// cluster and `serving` while that is another one the source lists, or, once traffic
/// moved to the active cluster, `moved_from`, where that move came from. Both listed, or
/// none.
pub(crate) fn judged_pair(
    service: &RayService,
    serving: &str,
    moved_from: Option<&str>,
) -> Option<(String, String)> {
    let active = &service.active_cluster;
    let listed = |c: &str| service.cluster(c).is_some();
    if !listed(active) {
        return None;
    }
    if let Some(p) = service.pending_cluster.as_ref().filter(|p| *p != active) {
        return listed(p).then(|| (p.clone(), active.clone()));
    }
    if serving != active {
        return listed(serving).then(|| (active.clone(), serving.into()));
    }
    moved_from
        .filter(|old| *old != active && listed(old))
        .map(|old| (active.clone(), old.to_string()))
}

impl Switchover {
    /// Whether `service`'s switch to the first of `pair` ([`judged_pair`]) is rolled back
    /// now (never while the operator promotes it).
    pub(super) fn outcome_round(
        &mut self,
        service: &RayService,
        key: &str,
        pair: Option<&(String, String)>,
        dashboards: &DashboardStates,
        now: SystemTime,
    ) -> bool {
        let policy = self.defaults.with(&service.policy.overrides.switchover);
        let Some((candidate, from)) = pair.cloned() else {
            self.forget_outcomes(key, service);
            return false;
        };
        let (new, old) = (
            service.envoy_cluster_name(&candidate),
            service.envoy_cluster_name(&from),
        );
        let version = outcomes::version(service, &candidate, dashboards);
        let deployed_now = outcomes::deployed_at(service, &candidate, dashboards)
            .unwrap_or(SystemTime::UNIX_EPOCH);
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
        self.clear_stale(key, &candidate, version.as_deref());
        if self
            .baselines
            .get(key)
            .is_some_and(|(c, _)| *c != candidate)
        {
            self.baselines.remove(key);
        }
        let promoted = (candidate.clone(), version.clone());
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
                .rollback(key, &candidate)
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
                .insert(key.to_string(), (candidate.clone(), *o));
        }
        // (Only while it has traffic: what it ran while deploying, with nothing sent to
        // it, turned nothing away.)
        let has_traffic = self
            .services
            .get(key)
            .is_some_and(|st| st.weight_of(&candidate) > 0);
        let capacity = self.least_capacity(
            &new,
            outcomes::ready_capacity(service, &candidate, dashboards),
            has_traffic,
            policy.outcome_window,
            now,
        );
        let baseline = now_old.or(self.baselines.get(key).map(|(_, o)| o));
        if let Verdict::Failing(why) = outcomes::judge(loads.get(&new), baseline, capacity, rule) {
            self.rollbacks.insert(
                key.to_string(),
                Rollback {
                    cluster: candidate,
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

    /// The least ready capacity `cluster` had over the last `window` while it had
    /// traffic (`with_traffic`: it has now; a level seen now counts): the failures
    /// counted over the window happened at the capacity of their time, and a cluster
    /// that grew since may have turned requests away (Ray's backpressure) at its smaller
    /// size. With no level seen under traffic in the window, the level now; `None` while
    /// none is known.
    fn least_capacity(
        &mut self,
        cluster: &str,
        now_capacity: Option<u64>,
        with_traffic: bool,
        window: std::time::Duration,
        now: SystemTime,
    ) -> Option<u64> {
        let seen = self.capacity_seen.entry(cluster.to_string()).or_default();
        if let Some(level) = now_capacity.filter(|_| with_traffic) {
            // A newer level no higher than an older one is the least for as long as
            // the older one would have been: the older one can go.
            while seen.back().is_some_and(|(_, l)| *l >= level) {
                seen.pop_back();
            }
            seen.push_back((now, level));
        }
        let since = now.checked_sub(window).unwrap_or(SystemTime::UNIX_EPOCH);
        while seen.front().is_some_and(|(t, _)| *t < since) {
            seen.pop_front();
        }
        seen.front().map(|(_, l)| *l).or(now_capacity)
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The sliding minimum equals the least level seen under traffic over the window
        /// (the level now without one), however the levels, the traffic and the gaps
        /// between rounds (unknown levels included) come.
        #[test]
        fn the_least_capacity_is_the_least_level_seen_over_the_window(
            rounds in proptest::collection::vec(
                (0u64..20_000, proptest::option::of(0u64..50), any::<bool>()),
                1..200,
            ),
        ) {
            let window = Duration::from_secs(30);
            let mut s = Switchover::default();
            let mut now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
            let mut all: Vec<(SystemTime, u64)> = vec![];
            for (gap_ms, level, traffic) in rounds {
                now += Duration::from_millis(gap_ms);
                if let Some(l) = level.filter(|_| traffic) {
                    all.push((now, l));
                }
                let got = s.least_capacity("c", level, traffic, window, now);
                let want = all
                    .iter()
                    .filter(|(t, _)| *t >= now - window)
                    .map(|(_, l)| *l)
                    .min()
                    .or(level);
                prop_assert_eq!(got, want);
                prop_assert!(s.capacity_seen["c"].len() <= 50, "bounded by distinct levels");
            }
        }
    }
}

//! When a cluster's newly RUNNING replicas count toward its ready capacity: once they
//! have been seen RUNNING for `capacity_settle`. On Ray 2.60 the dashboard lists a replica
//! RUNNING a moment before the proxies route to it, and a share raised at once was
//! answered 503 (backpressure) for a second or two. Pure.
//!
//! Per cluster and application, the levels of ready capacity seen, each with when it was
//! first seen: the level counted is the highest one seen at least `settle` ago. So each
//! replica counts `settle` after it turned RUNNING, however close together they come; a
//! fall counts at once (and a later rise settles again); what a replica sees first counts
//! at once (a replica that starts mid-move takes the share its peers have, not 0), and so
//! does a rise from nothing ready (a cluster that deployed: the switch's readiness and
//! warmth gates hold its first traffic).
//!
//! Invariants: the counted level never exceeds the level seen now; levels are strictly
//! increasing; a cluster or application no longer seen is forgotten.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

/// Ready capacity levels of one application of one cluster, each with when it comes to
/// count (`settle` after it was first seen; `UNIX_EPOCH`: at once).
type Levels = Vec<(u64, SystemTime)>;

#[derive(Clone, Debug, Default)]
pub(crate) struct CapacitySettle {
    /// Envoy cluster name → application → levels.
    clusters: BTreeMap<String, BTreeMap<String, Levels>>,
}

impl CapacitySettle {
    /// Records what `cluster`'s dashboard says `app` runs now, for one round; call
    /// [`CapacitySettle::forget_unseen`] with every (cluster, app) seen, after.
    pub(crate) fn observe(
        &mut self,
        cluster: &str,
        app: &str,
        ready: u64,
        settle: Duration,
        now: SystemTime,
    ) {
        let levels = self
            .clusters
            .entry(cluster.to_string())
            .or_default()
            .entry(app.to_string())
            .or_default();
        match levels.last() {
            None => levels.push((ready, SystemTime::UNIX_EPOCH)),
            // From nothing ready (a cluster deploying): at once; the readiness and
            // warmth gates hold its first traffic.
            Some((0, _)) if ready > 0 => *levels = vec![(ready, SystemTime::UNIX_EPOCH)],
            Some((top, _)) if ready > *top => levels.push((ready, now + settle)),
            Some((top, _)) if ready < *top => {
                levels.retain(|(level, _)| *level < ready);
                levels.push((ready, SystemTime::UNIX_EPOCH));
            }
            Some(_) => {}
        }
    }

    /// Drops what was not seen this round.
    pub(crate) fn forget_unseen(&mut self, seen: &BTreeMap<String, Vec<String>>) {
        self.clusters.retain(|cluster, apps| {
            let Some(now) = seen.get(cluster) else {
                return false;
            };
            apps.retain(|app, _| now.contains(app));
            !apps.is_empty()
        });
    }

    /// What `app` of `cluster` counts as ready now: the highest level seen at least
    /// `settle` ago; `ready` (as seen now) when nothing was recorded.
    pub(crate) fn counted(&self, cluster: &str, app: &str, ready: u64, now: SystemTime) -> u64 {
        let Some(levels) = self.levels(cluster, app) else {
            return ready;
        };
        levels
            .iter()
            .rev()
            .find(|(_, due)| *due <= now)
            .map_or(0, |(level, _)| *level)
            .min(ready)
    }

    /// When the next level seen comes to count.
    pub(crate) fn next_due(&self, now: SystemTime) -> Option<SystemTime> {
        self.clusters
            .values()
            .flat_map(|apps| apps.values().flatten())
            .map(|(_, due)| *due)
            .filter(|due| *due > now)
            .min()
    }

    fn levels(&self, cluster: &str, app: &str) -> Option<&Levels> {
        self.clusters.get(cluster)?.get(app)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTLE: Duration = Duration::from_secs(5);

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000 + secs)
    }

    #[test]
    fn each_rise_counts_once_it_has_held_and_a_fall_at_once() {
        let mut s = CapacitySettle::default();
        s.observe("b", "hello", 2, SETTLE, at(0));
        assert_eq!(s.counted("b", "hello", 2, at(0)), 2, "first seen: at once");
        // Replicas turn RUNNING 3 s apart: each counts 5 s after it did.
        s.observe("b", "hello", 4, SETTLE, at(1));
        s.observe("b", "hello", 6, SETTLE, at(4));
        assert_eq!(s.counted("b", "hello", 6, at(5)), 2);
        assert_eq!(s.next_due(at(5)), Some(at(6)));
        assert_eq!(s.counted("b", "hello", 6, at(6)), 4);
        assert_eq!(s.counted("b", "hello", 6, at(9)), 6);
        assert_eq!(s.next_due(at(9)), None);
        // A fall counts at once; the rise after it settles again.
        s.observe("b", "hello", 1, SETTLE, at(10));
        assert_eq!(s.counted("b", "hello", 1, at(10)), 1);
        s.observe("b", "hello", 8, SETTLE, at(11));
        assert_eq!(s.counted("b", "hello", 8, at(15)), 1);
        assert_eq!(s.counted("b", "hello", 8, at(16)), 8);
        // From nothing ready, at once.
        s.observe("b", "hello", 0, SETTLE, at(17));
        s.observe("b", "hello", 6, SETTLE, at(18));
        assert_eq!(s.counted("b", "hello", 6, at(18)), 6);
        // Never more than is seen now; forgotten when unseen.
        assert_eq!(s.counted("b", "hello", 3, at(16)), 3);
        s.forget_unseen(&BTreeMap::new());
        assert_eq!(s.counted("b", "hello", 8, at(16)), 8, "unknown: as seen");
    }
}

//! How much of a switch's traffic its target may take, by the ready capacity of the
//! target and of the serving cluster (`live::dashboard::Capacity`: per application, its
//! weakest deployment's RUNNING replicas × `max_ongoing_requests`). Pure.
//!
//! While both clusters serve an application, each takes traffic in proportion to its
//! ready capacity; the target takes all of it once its ready capacity reaches what the
//! serving cluster has at full target capacity (or has running now, when it autoscales,
//! or runs more than its full size). A smaller new version never reaches that: its move
//! completes when the source drops the old cluster (KubeRay deletes it after promoting
//! the new one), or when an operator promotes it. A RayService's switch is
//! limited by its most limited application. The limit is derived from the dashboards,
//! the target's newly RUNNING replicas counted once they have settled
//! (`pipeline::settle`), so replicas fed the same answers agree, and a restarted one
//! takes the share at once.
//!
//! Invariants: an application whose capacity either dashboard does not give (no
//! dashboard, garbage sizes), that the serving cluster does not run, or that neither
//! cluster can run anything of now, sets no limit, as before capacity was known; one that
//! autoscales on the target takes its share by what it runs, never less than
//! [`AUTOSCALING_FLOOR`] (its autoscaler grows it from the load it is given). A serving cluster with a dashboard but no answer at hand holds
//! the share where it is (0 on a replica that just started): its capacity is unknown,
//! not nothing. Below its reference the target never gets 100, so only capacity (or the
//! source) ends a move.

use std::time::{Duration, SystemTime};

use crate::live::dashboard::{Capacity, ServeStatus};
use crate::live::dashboards::DashboardStates;
use crate::model::RayService;
use crate::pipeline::readiness::Unit;
use crate::pipeline::settle::CapacitySettle;

/// The most percent of a switch's traffic the target may take now, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CapacityLimit {
    pub(crate) weight: u32,
    pub(crate) why: String,
}

/// How the target's newly RUNNING replicas come to count (`pipeline::settle`).
pub(crate) struct TargetSettle<'a> {
    pub(crate) settle: &'a CapacitySettle,
    pub(crate) duration: Duration,
    pub(crate) now: SystemTime,
}

/// The capacity limit of a switch of `unit` of `service` from `serving` to `target`,
/// whose target has `previous` percent now; `None` when capacity sets none (every
/// application may move all its traffic). The target's ready capacity is what
/// `settle` counts of it; the serving cluster's counts as its dashboard says.
#[allow(clippy::too_many_arguments)]
pub(crate) fn capacity_limit(
    service: &RayService,
    unit: Unit<'_>,
    serving: &str,
    target: &str,
    previous: u32,
    dashboards: &DashboardStates,
    settle: &TargetSettle<'_>,
) -> Option<CapacityLimit> {
    let status = |cluster: &str| {
        dashboards
            .clusters
            .get(&service.envoy_cluster_name(cluster))
            .and_then(|d| d.status.as_deref())
    };
    let to = status(target)?;
    let has_dashboard = service
        .cluster(serving)
        .is_some_and(|c| c.dashboard.is_some());
    let Some(from) = status(serving) else {
        // No answer of the serving cluster's at hand (not yet, since this replica
        // started, or dropped by the memory budget): what it carries is unknown, not
        // nothing. The share stays where it is (0 on a replica that just started).
        return has_dashboard.then(|| CapacityLimit {
            weight: previous,
            why: format!("ready capacity: {serving}'s dashboard has not answered"),
        });
    };
    let apps: Vec<&str> = match unit {
        Unit::Service => to.applications.keys().map(String::as_str).collect(),
        Unit::Application(app) => vec![app],
    };
    apps.into_iter()
        .filter_map(|app| {
            let (seen, s) = (capacity(to, app)?, capacity(from, app)?);
            let target_cluster = service.envoy_cluster_name(target);
            let t = Capacity {
                ready: settle
                    .settle
                    .counted(&target_cluster, app, seen.ready, settle.now),
                ..seen
            };
            let weight = share(t, s)?;
            let settling = if t.ready < seen.ready {
                format!(
                    "; {} more RUNNING there, counted {:?} after each turned RUNNING",
                    seen.ready - t.ready,
                    settle.duration
                )
            } else {
                String::new()
            };
            let why = format!(
                "ready capacity: {app} can run {} request(s) at once on {target} (of {} at \
                 full size) and {} on {serving} (of {}){settling}",
                t.ready,
                t.full.map_or_else(|| "?".to_string(), |f| f.to_string()),
                s.ready,
                reference(s),
            );
            Some(CapacityLimit { weight, why })
        })
        .min_by_key(|limit| limit.weight)
}

fn capacity(status: &ServeStatus, app: &str) -> Option<Capacity> {
    status.applications.get(app)?.capacity
}

/// What the serving cluster can run: at full size, or what it runs now when that is more
/// (or it autoscales).
fn reference(serving: Capacity) -> u64 {
    serving.ready.max(serving.full.unwrap_or(0))
}

/// The target's percent of the traffic: 100 once it can run what the serving cluster
/// can; else in proportion to the ready capacities, below 100 (a serving cluster running
/// nothing for a moment does not end the move, nor does a target at its own full size
/// that is smaller: the load the serving cluster carries would overflow it). A target
/// that autoscales (no full size: Ray reports it RUNNING at `min_replicas`) takes its
/// share the same way, and at least [`AUTOSCALING_FLOOR`] percent: its autoscaler grows
/// it as the load it is given asks (from zero replicas too), and the share follows what
/// it runs. `None` (no limit) when neither runs anything now.
fn share(target: Capacity, serving: Capacity) -> Option<u32> {
    if target.ready >= reference(serving) {
        return Some(100);
    }
    let floor = if target.full.is_none() {
        AUTOSCALING_FLOOR
    } else {
        0
    };
    let both = target.ready.checked_add(serving.ready)?;
    if both == 0 {
        return None;
    }
    // In u128: no product overflows.
    let share = (u128::from(target.ready) * 100 / u128::from(both)) as u32;
    Some(share.max(floor).min(99))
}

/// The least share of an autoscaling target: enough load for its autoscaler to see.
pub(crate) const AUTOSCALING_FLOOR: u32 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(ready: u64, full: Option<u64>) -> Capacity {
        Capacity { ready, full }
    }

    #[test]
    fn traffic_follows_ready_capacity_until_the_target_can_run_what_the_serving_cluster_can() {
        // 4 replicas × 2 serving, 1 × 2 ready on the target: a fifth.
        assert_eq!(share(cap(2, Some(8)), cap(8, Some(8))), Some(20));
        assert_eq!(share(cap(4, Some(8)), cap(8, Some(8))), Some(33));
        assert_eq!(share(cap(8, Some(8)), cap(8, Some(8))), Some(100));
        // The serving cluster shrinks (KubeRay scales it down): the target still needs
        // what the serving cluster has at full size.
        assert_eq!(share(cap(4, Some(8)), cap(2, Some(8))), Some(66));
        // A smaller new version at its full size: in proportion, until the old cluster
        // goes (or an operator promotes it).
        assert_eq!(share(cap(4, Some(4)), cap(8, Some(8))), Some(33));
        // The serving cluster autoscales: what it runs now.
        assert_eq!(share(cap(4, Some(8)), cap(2, None)), Some(100));
        assert_eq!(share(cap(0, Some(8)), cap(8, Some(8))), Some(0));
        // The serving cluster runs nothing for a moment: most, never all, to the target.
        assert_eq!(share(cap(2, Some(8)), cap(0, Some(8))), Some(99));
        // Neither runs anything: no opinion.
        assert_eq!(share(cap(0, Some(8)), cap(0, Some(8))), None);
        // An autoscaling target (RUNNING at min_replicas): in proportion to what it
        // runs, at least 1% (from zero replicas too), all of it once it runs what the
        // serving cluster does.
        assert_eq!(share(cap(2, None), cap(8, Some(8))), Some(20));
        assert_eq!(share(cap(0, None), cap(8, Some(8))), Some(1));
        assert_eq!(share(cap(8, None), cap(8, Some(8))), Some(100));
        assert_eq!(share(cap(4, None), cap(6, None)), Some(40));
        assert_eq!(
            share(cap(u64::MAX - 1, Some(u64::MAX)), cap(u64::MAX, None)),
            None,
            "an overflow is no opinion"
        );
    }

    proptest::proptest! {
        #[test]
        fn a_share_is_a_percent_grows_with_the_target_and_is_whole_only_when_it_can_carry_it(
            t in 0u64..1_000, s in 0u64..1_000, full in proptest::option::of(0u64..1_000),
            t_full in 1u64..2_000, more in 1u64..1000,
        ) {
            let serving = cap(s, full);
            if let Some(w) = share(cap(t, Some(t_full)), serving) {
                proptest::prop_assert!(w <= 100);
                let bigger = share(cap(t + more, Some(t_full)), serving).unwrap();
                proptest::prop_assert!(bigger >= w);
                proptest::prop_assert_eq!(w == 100, t >= reference(serving));
            }
        }
    }
}

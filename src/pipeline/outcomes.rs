//! Outcomes: whether a RayService's pending cluster fails more of its requests than its
//! active cluster, by what the Envoys report (`xds::lrs`, summed over this replica's
//! Envoys and its peers'), and the rollback decision that follows.
//!
//! The rule, over the last `outcome_window`: the pending cluster fails when it has
//! ended at least `outcome_min_requests` requests and its failure ratio (failed / ended)
//! is more than `outcome_margin` percentage points above the active cluster's (above 0
//! when the active cluster ended fewer than that: no sign it fails as much). No verdict
//! while the pending cluster may have been answering Ray's backpressure: Envoy counts
//! every 5xx alike, and Ray turns a request away (503) only once its replicas run all
//! they may and its queue is full, so a window in which the pending cluster never had
//! more in flight than its applications' ready capacity (RUNNING replicas ×
//! `max_ongoing_requests`, the least of its applications) holds no backpressure, and one
//! that had may.
//!
//! A decision holds for that cluster at that version (its applications' deploy times on
//! its dashboard): a new pending cluster, or a redeploy on it, clears it; the operator's
//! `promote` skips it. A peer's decision on the same cluster and version is taken as
//! this replica's own (it only ever takes traffic away from the new cluster).

use crate::live::dashboards::DashboardStates;
use crate::model::RayService;
use crate::xds::lrs::LoadCounts;

pub use crate::live::peers::{LoadTotals, Rollback};

/// What the reports say of a pending cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Not enough to say, and why.
    Unknown(String),
    Fine,
    /// It fails more than the margin allows: the figures.
    Failing(String),
}

/// The thresholds of [`judge`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutcomeRule {
    /// Percentage points above the active cluster's failure ratio allowed.
    pub margin: u32,
    pub min_requests: u32,
}

/// The pending cluster's reports (`new`) against the active cluster's (`old`), with the
/// pending cluster's ready capacity (requests at once; `None` when unknown).
pub(crate) fn judge(
    new: Option<&LoadCounts>,
    old: Option<&LoadCounts>,
    ready_capacity: Option<u64>,
    rule: OutcomeRule,
) -> Verdict {
    if rule.margin >= 100 {
        return Verdict::Unknown("outcome_margin is 100: not judged".into());
    }
    let new = new.copied().unwrap_or_default();
    let min = u64::from(rule.min_requests);
    if new.ended() < min {
        return Verdict::Unknown(format!(
            "{} of {min} requests ended there so far",
            new.ended()
        ));
    }
    if let Some(capacity) = ready_capacity.filter(|c| new.in_progress_peak > *c) {
        if new.failed > 0 {
            return Verdict::Unknown(format!(
                "{} in flight at once there, over its ready capacity of {capacity}: its \
                 5xx may be Ray's backpressure",
                new.in_progress_peak
            ));
        }
    }
    let ratio = |c: &LoadCounts| c.failed as f64 * 100.0 / c.ended().max(1) as f64;
    let (baseline, against) = match old.filter(|o| o.ended() >= min) {
        Some(o) => (
            ratio(o),
            format!("the active cluster's {:.1}% of {}", ratio(o), o.ended()),
        ),
        None => (
            0.0,
            "0% (the active cluster ended too few to compare)".into(),
        ),
    };
    let failing = ratio(&new) > baseline + f64::from(rule.margin);
    let figures = format!(
        "{} of {} requests failed ({:.1}%) against {against}, margin {} points",
        new.failed,
        new.ended(),
        ratio(&new),
        rule.margin
    );
    if failing {
        Verdict::Failing(figures)
    } else {
        Verdict::Fine
    }
}

/// The version of `cluster`'s applications: each one's config as deployed (its digest),
/// as its dashboard says now, or its deploy time when it has no config; `None` when it
/// has no dashboard answer or an application with neither. Not the deploy time alone:
/// KubeRay's incremental upgrade redeploys the same config with each `target_capacity`
/// step, which moves the deploy time (Ray 2.60,
/// `real_ray_conformance_of_the_endpoints_ray_xds_reads`) and would clear a rollback.
pub(crate) fn version(
    service: &RayService,
    cluster: &str,
    dashboards: &DashboardStates,
) -> Option<String> {
    let status = dashboards
        .clusters
        .get(&service.envoy_cluster_name(cluster))?
        .status
        .clone()?;
    let mut parts = Vec::new();
    for (name, app) in &status.applications {
        // An application not deployed from a config (`serve.run`) has no digest: its
        // deploy time, then.
        let version = match &app.config_digest {
            Some(digest) => digest.clone(),
            None => format!("t{}", app.deployed_at?),
        };
        parts.push(format!("{name}@{version}"));
    }
    (!parts.is_empty()).then(|| parts.join(","))
}

/// When `cluster`'s current version was deployed: its applications' latest deploy time,
/// as its dashboard says now.
pub(crate) fn deployed_at(
    service: &RayService,
    cluster: &str,
    dashboards: &DashboardStates,
) -> Option<std::time::SystemTime> {
    let status = dashboards
        .clusters
        .get(&service.envoy_cluster_name(cluster))?
        .status
        .clone()?;
    let latest = status
        .applications
        .values()
        .filter_map(|a| a.deployed_at)
        .reduce(f64::max)?;
    crate::live::peers::from_unix(latest)
}

/// The least ready capacity of `cluster`'s applications, as its dashboard says now.
pub(crate) fn ready_capacity(
    service: &RayService,
    cluster: &str,
    dashboards: &DashboardStates,
) -> Option<u64> {
    let name = service.envoy_cluster_name(cluster);
    let status = dashboards.clusters.get(&name)?.status.clone()?;
    status
        .applications
        .values()
        .map(|a| a.capacity.map(|c| c.ready))
        .collect::<Option<Vec<u64>>>()?
        .into_iter()
        .min()
}

/// Whether a decision taken at `decided` still holds at version `now` (unknown on either
/// side holds: only a version seen to differ clears it).
pub(crate) fn same_version(decided: Option<&str>, now: Option<&str>) -> bool {
    match (decided, now) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(succeeded: u64, failed: u64) -> LoadCounts {
        LoadCounts {
            succeeded,
            failed,
            issued: succeeded + failed,
            in_progress_peak: 1,
        }
    }

    const RULE: OutcomeRule = OutcomeRule {
        margin: 5,
        min_requests: 50,
    };

    #[test]
    fn a_new_cluster_failing_more_than_the_margin_above_the_old_one_fails() {
        let old = counts(990, 10);
        assert!(matches!(
            judge(Some(&counts(80, 20)), Some(&old), Some(100), RULE),
            Verdict::Failing(f) if f.contains("20 of 100") && f.contains("1.0%")
        ));
        // 5.5% against 1%: within the margin.
        assert_eq!(
            judge(Some(&counts(945, 55)), Some(&old), Some(100), RULE),
            Verdict::Fine
        );
        // Both fail alike (the application, or the load, not the version).
        assert_eq!(
            judge(Some(&counts(80, 20)), Some(&counts(800, 200)), None, RULE),
            Verdict::Fine
        );
    }

    #[test]
    fn too_few_requests_or_a_cluster_past_its_capacity_gives_no_verdict() {
        assert!(matches!(
            judge(Some(&counts(10, 39)), None, None, RULE),
            Verdict::Unknown(w) if w.contains("49 of 50")
        ));
        assert!(matches!(judge(None, None, None, RULE), Verdict::Unknown(_)));
        let mut crowded = counts(50, 50);
        crowded.in_progress_peak = 9;
        assert!(matches!(
            judge(Some(&crowded), None, Some(8), RULE),
            Verdict::Unknown(w) if w.contains("backpressure")
        ));
        // At its capacity and not over: nothing queued, so no backpressure.
        crowded.in_progress_peak = 8;
        assert!(matches!(
            judge(Some(&crowded), None, Some(8), RULE),
            Verdict::Failing(_)
        ));
        // The active cluster ended too few to compare: against 0%.
        assert!(matches!(
            judge(Some(&counts(90, 10)), Some(&counts(5, 5)), None, RULE),
            Verdict::Failing(f) if f.contains("too few")
        ));
        let off = OutcomeRule {
            margin: 100,
            ..RULE
        };
        assert!(matches!(
            judge(Some(&counts(0, 100)), None, None, off),
            Verdict::Unknown(_)
        ));
    }

    #[test]
    fn only_a_version_seen_to_differ_clears_a_decision() {
        assert!(same_version(Some("a@1"), Some("a@1")));
        assert!(!same_version(Some("a@1"), Some("a@2")));
        assert!(same_version(None, Some("a@2")));
        assert!(same_version(Some("a@1"), None));
    }
}

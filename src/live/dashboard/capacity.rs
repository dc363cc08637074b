//! How much an application can carry on one cluster, from what its dashboard says of
//! each deployment: replicas RUNNING, replicas at full target capacity, and
//! `max_ongoing_requests`.
//!
//! The rule: a deployment's ready capacity is its RUNNING replicas times
//! `max_ongoing_requests` (the requests Ray lets it run at once; what it queues beyond
//! that waits, and past `max_queued_requests` is answered 503). An application is as
//! strong as its weakest deployment: a request runs its ingress deployment and, through
//! it, the deployments it calls, so the smallest of their capacities bounds what the
//! application can run at once (a deployment called several times per request is
//! counted once: an approximation, the same on both clusters of a switch).
//!
//! Invariants: a deployment whose size cannot be read (garbage, or an answer without
//! `deployment_config`) makes the application's capacity unknown, never 0; counts are
//! capped at [`MAX_REPLICAS`], so no product overflows.

use serde_json::{Map, Value};

/// The most replicas one deployment may list (as many as targets: see
/// `super::MAX_TARGETS`).
pub const MAX_REPLICAS: usize = super::MAX_TARGETS;

/// The most deployments one application may list (Ray Serve applications have a few).
pub const MAX_DEPLOYMENTS: usize = 256;

/// Ray's `max_ongoing_requests` when a deployment does not say (Ray 2.60's default).
const DEFAULT_MAX_ONGOING_REQUESTS: u64 = 5;

/// The largest `max_ongoing_requests` taken as it is; a bigger one is garbage.
const MAX_ONGOING_LIMIT: u64 = 1_000_000;

/// One deployment's size, as the dashboard reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeploymentSize {
    /// Replicas in state `RUNNING`.
    pub running: u64,
    /// Replicas at full target capacity: `deployment_config.num_replicas`. `None` for an
    /// autoscaling deployment (its size follows its load) or when not reported.
    pub full: Option<u64>,
    /// `deployment_config.max_ongoing_requests`; `None` when it is not a number Ray
    /// would take.
    pub max_ongoing_requests: Option<u64>,
}

/// What an application can carry on one cluster, in requests running at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// With the replicas RUNNING now.
    pub ready: u64,
    /// At full target capacity; `None` when a deployment autoscales (or does not say).
    pub full: Option<u64>,
}

/// The capacity of an application of these deployments; `None` when it lists none or
/// one's size is unknown.
pub fn application_capacity(deployments: &[DeploymentSize]) -> Option<Capacity> {
    if deployments.is_empty() {
        return None;
    }
    let mut ready = u64::MAX;
    let mut full = Some(u64::MAX);
    for d in deployments {
        let per_replica = d.max_ongoing_requests?;
        ready = ready.min(d.running * per_replica);
        full = full
            .zip(d.full)
            .map(|(least, replicas)| least.min(replicas * per_replica));
    }
    Some(Capacity { ready, full })
}

/// One deployment of a dashboard answer's application (`deployments.<name>`).
pub(super) fn deployment_size(deployment: &Map<String, Value>) -> Option<DeploymentSize> {
    let config = deployment.get("deployment_config")?.as_object()?;
    let running = deployment
        .get("replicas")
        .and_then(Value::as_array)
        .map_or(0, |replicas| {
            replicas
                .iter()
                .filter(|r| r.get("state").and_then(Value::as_str) == Some("RUNNING"))
                .count()
                .min(MAX_REPLICAS)
        }) as u64;
    let autoscaling = config
        .get("autoscaling_config")
        .is_some_and(|a| !a.is_null());
    let full = config
        .get("num_replicas")
        .and_then(Value::as_u64)
        .filter(|_| !autoscaling)
        .map(|n| n.min(MAX_REPLICAS as u64));
    let max_ongoing_requests = match config.get("max_ongoing_requests") {
        None | Some(Value::Null) => Some(DEFAULT_MAX_ONGOING_REQUESTS),
        Some(v) => v.as_u64().filter(|n| (1..=MAX_ONGOING_LIMIT).contains(n)),
    };
    Some(DeploymentSize {
        running,
        full,
        max_ongoing_requests,
    })
}

/// The sizes of an application's deployments (`deployments`), or `None` when any is not
/// an object Ray would send.
/// Whether an application is `DEPLOYING` only to change how many replicas run: a
/// deployment `UPSCALING` or `DOWNSCALING`, every other `HEALTHY` (none `UPDATING` to a
/// new version, none failed), and each with a replica `RUNNING` (`Application::serves`).
/// All `HEALTHY` while `DEPLOYING` is not resizing: that is a new config being built
/// (imported) before its deployments start to update.
pub(super) fn only_resizing(app: &Map<String, Value>) -> bool {
    let status =
        |v: &Map<String, Value>| v.get("status").and_then(Value::as_str).map(str::to_owned);
    if status(app).as_deref() != Some("DEPLOYING") {
        return false;
    }
    let Some(deployments) = app.get("deployments").and_then(Value::as_object) else {
        return false;
    };
    let resizing = |d: &Value| {
        d.get("status")
            .and_then(Value::as_str)
            .is_some_and(|s| matches!(s, "UPSCALING" | "DOWNSCALING"))
    };
    deployments.values().any(resizing)
        && deployments.values().all(|d| {
            let Some(d) = d.as_object() else {
                return false;
            };
            matches!(
                status(d).as_deref(),
                Some("HEALTHY" | "UPSCALING" | "DOWNSCALING")
            ) && deployment_size(d).is_some_and(|size| size.running > 0)
        })
}

pub(super) fn deployment_sizes(app: &Map<String, Value>) -> Option<Vec<DeploymentSize>> {
    app.get("deployments")?
        .as_object()?
        .values()
        .map(|d| deployment_size(d.as_object()?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn size(running: u64, full: Option<u64>, per: u64) -> DeploymentSize {
        DeploymentSize {
            running,
            full,
            max_ongoing_requests: Some(per),
        }
    }

    #[test]
    fn an_application_is_as_strong_as_its_weakest_deployment() {
        // An ingress of 4 replicas × 2 in front of a model of 1 replica × 5.
        let c = application_capacity(&[size(4, Some(4), 2), size(1, Some(3), 5)]).unwrap();
        assert_eq!(
            c,
            Capacity {
                ready: 5,
                full: Some(8)
            }
        );
    }

    #[test]
    fn an_autoscaling_deployment_has_no_full_size_and_garbage_makes_capacity_unknown() {
        let c = application_capacity(&[size(2, Some(2), 2), size(1, None, 5)]).unwrap();
        assert_eq!(
            c,
            Capacity {
                ready: 4,
                full: None
            }
        );
        let garbage = DeploymentSize {
            max_ongoing_requests: None,
            ..size(1, Some(1), 1)
        };
        assert_eq!(application_capacity(&[size(1, Some(1), 1), garbage]), None);
        assert_eq!(application_capacity(&[]), None);
    }

    #[test]
    fn a_deployment_is_read_as_ray_reports_it() {
        let d = json!({
            "replicas": [{"state": "RUNNING"}, {"state": "STARTING"}, {"state": "RUNNING"}, 7],
            "deployment_config": {"num_replicas": 4, "max_ongoing_requests": 2,
                                  "autoscaling_config": null},
        });
        assert_eq!(
            deployment_size(d.as_object().unwrap()),
            Some(size(2, Some(4), 2))
        );
        let autoscaling = json!({
            "replicas": [],
            "deployment_config": {"num_replicas": 1,
                                  "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}},
        });
        assert_eq!(
            deployment_size(autoscaling.as_object().unwrap()),
            Some(size(0, None, DEFAULT_MAX_ONGOING_REQUESTS))
        );
        for garbage in [json!(-1), json!(0), json!("5"), json!(2_000_000)] {
            let d =
                json!({"deployment_config": {"num_replicas": 1, "max_ongoing_requests": garbage}});
            assert_eq!(
                deployment_size(d.as_object().unwrap())
                    .unwrap()
                    .max_ongoing_requests,
                None,
                "{garbage}"
            );
        }
        assert_eq!(
            deployment_size(json!({"replicas": []}).as_object().unwrap()),
            None
        );
    }

    #[test]
    fn deploying_only_to_start_or_stop_replicas_is_resizing_and_nothing_else_is() {
        // As Ray Serve 2.60 answers while a raised target_capacity starts replicas it
        // cannot place yet (checked on real Ray: `real_ray_capacity_*`).
        let app = |app_status: &str, deployments: serde_json::Value| json!({"status": app_status, "deployments": deployments});
        let deployment = |status: &str, states: &[&str]| {
            let replicas: Vec<_> = states.iter().map(|s| json!({"state": s})).collect();
            json!({"status": status, "replicas": replicas,
                   "deployment_config": {"num_replicas": 8, "max_ongoing_requests": 2}})
        };
        let resizing = |a: serde_json::Value| only_resizing(a.as_object().unwrap());
        let growing = deployment("UPSCALING", &["RUNNING", "RUNNING", "STARTING"]);
        assert!(resizing(app("DEPLOYING", json!({"Big": growing.clone()}))));
        assert!(resizing(app(
            "DEPLOYING",
            json!({"Ingress": deployment("HEALTHY", &["RUNNING"]), "Big": growing.clone()})
        )));
        let shrinking = deployment("DOWNSCALING", &["RUNNING", "STOPPING"]);
        assert!(resizing(app("DEPLOYING", json!({"Big": shrinking}))));
        // Every deployment HEALTHY while DEPLOYING: a new config being built (imported)
        // before its deployments update, not a resize.
        let healthy = deployment("HEALTHY", &["RUNNING"]);
        assert!(!resizing(app("DEPLOYING", json!({"Big": healthy}))));
        // Not resizing: a new version rolling out, a failure, nothing RUNNING yet (a
        // first deploy, or from zero), no deployments, a status other than DEPLOYING,
        // garbage.
        let updating = deployment("UPDATING", &["RUNNING", "STARTING"]);
        assert!(!resizing(app(
            "DEPLOYING",
            json!({"Big": growing.clone(), "New": updating})
        )));
        let failed = deployment("DEPLOY_FAILED", &["RUNNING"]);
        assert!(!resizing(app("DEPLOYING", json!({"Big": failed}))));
        let from_zero = deployment("UPSCALING", &["STARTING"]);
        assert!(!resizing(app("DEPLOYING", json!({"Big": from_zero}))));
        assert!(!resizing(app("DEPLOYING", json!({}))));
        assert!(!resizing(app("RUNNING", json!({"Big": growing.clone()}))));
        assert!(!resizing(app("DEPLOY_FAILED", json!({"Big": growing}))));
        assert!(!resizing(app("DEPLOYING", json!({"Big": 7}))));
        assert!(!resizing(app("DEPLOYING", json!([1, 2]))));
    }

    #[test]
    fn counts_are_capped_so_no_product_overflows() {
        let c = application_capacity(&[size(
            MAX_REPLICAS as u64,
            Some(MAX_REPLICAS as u64),
            MAX_ONGOING_LIMIT,
        )])
        .unwrap();
        assert_eq!(c.ready, MAX_REPLICAS as u64 * MAX_ONGOING_LIMIT);
    }
}

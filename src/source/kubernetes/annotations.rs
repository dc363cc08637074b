//! `ray-xds.io/*` annotations on a RayService: its hosts and its overrides of the global
//! probe, traffic and switchover policy.
//!
//! Every annotation is optional. A value that does not parse is reported and ignored (the
//! global value applies); the RayService itself is still served. Annotations with the
//! `ray-xds.io/` prefix that ray-xds does not know are reported too, so a typo is seen.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::model::{HeadProxy, ServicePolicy};
use crate::switchover::{ModeKind, SwitchoverOverrides};

pub const PREFIX: &str = "ray-xds.io/";

/// Every annotation ray-xds reads, with what it means (the README's table is this list).
pub const ANNOTATIONS: &[(&str, &str)] = &[
    ("hosts", "comma-separated virtual-host domains (default: <name>.<namespace>, <name>.<namespace>.svc)"),
    ("head-proxy", "exclude | include | fallback"),
    ("probe-interval", "duration"),
    ("probe-timeout", "duration"),
    ("probe-unhealthy-threshold", "count"),
    ("probe-healthy-threshold", "count"),
    ("retries", "count"),
    ("per-try-timeout", "duration (0s disables)"),
    ("route-timeout", "duration (0s is none)"),
    ("idempotent", "true | false"),
    ("retry-back-off", "duration"),
    ("consecutive-gateway-failure", "count"),
    ("consecutive-local-origin-failure", "count"),
    ("outlier-interval", "duration"),
    ("base-ejection-time", "duration"),
    ("max-ejection-percent", "0-100"),
    ("max-retries", "count"),
    ("switchover-mode", "atomic | progressive"),
    ("switchover-steps", "comma-separated percents rising to 100, e.g. 10,25,50,100"),
    ("switchover-interval", "duration"),
    ("min-ready-proxies", "count, at least 1"),
    ("drain-grace", "duration"),
    ("warm-timeout", "duration"),
];

/// What a RayService's annotations say.
#[derive(Debug, Default, PartialEq)]
pub struct Annotated {
    pub hosts: Option<Vec<String>>,
    pub policy: ServicePolicy,
    /// `(annotation, why it was ignored)`.
    pub problems: Vec<(String, String)>,
}

pub fn read(annotations: &BTreeMap<String, String>) -> Annotated {
    let mut out = Annotated::default();
    let p = &mut out.policy;
    let mut switchover = SwitchoverOverrides::default();
    for (key, value) in annotations {
        let Some(name) = key.strip_prefix(PREFIX) else {
            continue;
        };
        let value = value.trim();
        let result: Result<(), String> = (|| {
            match name {
                "hosts" => {
                    let hosts: Vec<String> = value
                        .split(',')
                        .map(str::trim)
                        .filter(|h| !h.is_empty())
                        .map(str::to_string)
                        .collect();
                    if hosts.is_empty() {
                        return Err("no host listed".into());
                    }
                    out.hosts = Some(hosts);
                }
                "head-proxy" => {
                    p.head_proxy = match value {
                        "exclude" => HeadProxy::Exclude,
                        "include" => HeadProxy::Include,
                        "fallback" => HeadProxy::Fallback,
                        _ => return Err("expected exclude, include or fallback".into()),
                    }
                }
                "probe-interval" => p.probe.interval = Some(positive(value)?),
                "probe-timeout" => p.probe.timeout = Some(positive(value)?),
                "probe-unhealthy-threshold" => {
                    p.probe.unhealthy_threshold = Some(count_at_least(value, 1)?)
                }
                "probe-healthy-threshold" => {
                    p.probe.healthy_threshold = Some(count_at_least(value, 1)?)
                }
                "retries" => p.traffic.retries = Some(count_at_least(value, 0)?),
                "per-try-timeout" => p.traffic.per_try_timeout = Some(duration(value)?),
                "route-timeout" => p.traffic.route_timeout = Some(duration(value)?),
                "idempotent" => p.traffic.idempotent = Some(boolean(value)?),
                "retry-back-off" => p.traffic.retry_back_off = Some(positive(value)?),
                "consecutive-gateway-failure" => {
                    p.traffic.consecutive_gateway_failure = Some(count_at_least(value, 1)?)
                }
                "consecutive-local-origin-failure" => {
                    p.traffic.consecutive_local_origin_failure = Some(count_at_least(value, 1)?)
                }
                "outlier-interval" => p.traffic.outlier_interval = Some(positive(value)?),
                "base-ejection-time" => p.traffic.base_ejection_time = Some(positive(value)?),
                "max-ejection-percent" => {
                    let v = count_at_least(value, 0)?;
                    if v > 100 {
                        return Err("at most 100".into());
                    }
                    p.traffic.max_ejection_percent = Some(v)
                }
                "max-retries" => p.traffic.max_retries = Some(count_at_least(value, 1)?),
                "switchover-mode" => {
                    switchover.mode = Some(match value {
                        "atomic" => ModeKind::Atomic,
                        "progressive" => ModeKind::Progressive,
                        _ => return Err("expected atomic or progressive".into()),
                    })
                }
                "switchover-steps" => {
                    let steps = value
                        .split(',')
                        .map(|s| s.trim().parse::<u32>())
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| format!("not a list of percents: {e}"))?;
                    let check = SwitchoverOverrides {
                        steps: Some(steps.clone()),
                        ..Default::default()
                    };
                    check.validate()?;
                    switchover.steps = Some(steps);
                }
                "switchover-interval" => switchover.interval = Some(positive(value)?),
                "min-ready-proxies" => {
                    switchover.min_ready_proxies = Some(count_at_least(value, 1)?)
                }
                "drain-grace" => switchover.drain_grace = Some(duration(value)?),
                "warm-timeout" => switchover.warm_timeout = Some(duration(value)?),
                _ => return Err("unknown ray-xds annotation".into()),
            }
            Ok(())
        })();
        if let Err(why) = result {
            out.problems
                .push((key.clone(), format!("{value:?}: {why}")));
        }
    }
    // An explicit `atomic` with steps or an interval: keep the mode, drop the rest.
    if let Err(why) = switchover.validate() {
        out.problems
            .push((format!("{PREFIX}switchover-mode"), why.to_string()));
        switchover.steps = None;
        switchover.interval = None;
    }
    out.policy.switchover = switchover;
    out
}

fn duration(v: &str) -> Result<Duration, String> {
    humantime::parse_duration(v).map_err(|e| format!("not a duration: {e}"))
}

fn positive(v: &str) -> Result<Duration, String> {
    let d = duration(v)?;
    if d.is_zero() {
        return Err("must be above 0".into());
    }
    Ok(d)
}

fn count_at_least(v: &str, min: u32) -> Result<u32, String> {
    let n: u32 = v.parse().map_err(|_| "not a whole number".to_string())?;
    if n < min {
        return Err(format!("must be at least {min}"));
    }
    Ok(n)
}

fn boolean(v: &str) -> Result<bool, String> {
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err("expected true or false".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (format!("{PREFIX}{k}"), v.to_string()))
            .collect()
    }

    #[test]
    fn every_documented_annotation_is_read() {
        let values = [
            ("hosts", "a.example, b.example"),
            ("head-proxy", "exclude"),
            ("probe-interval", "1s"),
            ("probe-timeout", "300ms"),
            ("probe-unhealthy-threshold", "3"),
            ("probe-healthy-threshold", "1"),
            ("retries", "5"),
            ("per-try-timeout", "30s"),
            ("route-timeout", "0s"),
            ("idempotent", "true"),
            ("retry-back-off", "50ms"),
            ("consecutive-gateway-failure", "4"),
            ("consecutive-local-origin-failure", "3"),
            ("outlier-interval", "2s"),
            ("base-ejection-time", "10s"),
            ("max-ejection-percent", "30"),
            ("max-retries", "64"),
            ("switchover-mode", "progressive"),
            ("switchover-steps", "20, 60, 100"),
            ("switchover-interval", "5s"),
            ("min-ready-proxies", "2"),
            ("drain-grace", "45s"),
            ("warm-timeout", "3s"),
        ];
        assert_eq!(values.len(), ANNOTATIONS.len());
        for ((name, _), (doc, _)) in values.iter().zip(ANNOTATIONS) {
            assert_eq!(name, doc, "the documented list and this test agree");
        }
        let a = read(&annotations(&values));
        assert_eq!(a.problems, vec![]);
        assert_eq!(
            a.hosts,
            Some(vec!["a.example".to_string(), "b.example".to_string()])
        );
        let p = &a.policy;
        assert_eq!(p.head_proxy, HeadProxy::Exclude);
        assert_eq!(p.probe.timeout, Some(Duration::from_millis(300)));
        assert_eq!(p.probe.healthy_threshold, Some(1));
        assert_eq!(p.traffic.retries, Some(5));
        assert_eq!(p.traffic.route_timeout, Some(Duration::ZERO));
        assert_eq!(p.traffic.idempotent, Some(true));
        assert_eq!(p.traffic.max_ejection_percent, Some(30));
        assert_eq!(p.switchover.mode, Some(ModeKind::Progressive));
        assert_eq!(p.switchover.steps, Some(vec![20, 60, 100]));
        assert_eq!(p.switchover.min_ready_proxies, Some(2));
        assert_eq!(p.switchover.warm_timeout, Some(Duration::from_secs(3)));
    }

    #[test]
    fn a_bad_value_is_reported_and_ignored_and_the_rest_applies() {
        let a = read(&annotations(&[
            ("retries", "many"),
            ("probe-interval", "0s"),
            ("switchover-steps", "50,90"),
            ("max-ejection-percent", "150"),
            ("head-proxy", "sometimes"),
            ("hosts", " , "),
            ("retires", "3"),
            ("idempotent", "true"),
        ]));
        let bad: Vec<&str> = a.problems.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            bad,
            [
                "ray-xds.io/head-proxy",
                "ray-xds.io/hosts",
                "ray-xds.io/max-ejection-percent",
                "ray-xds.io/probe-interval",
                "ray-xds.io/retires",
                "ray-xds.io/retries",
                "ray-xds.io/switchover-steps",
            ]
        );
        assert!(a.problems[4].1.contains("unknown"), "{:?}", a.problems[4]);
        assert_eq!(a.policy.traffic.idempotent, Some(true));
        assert_eq!(a.policy.traffic.retries, None);
        assert_eq!(a.hosts, None);
        // Other prefixes are none of our business.
        let mut other = BTreeMap::new();
        other.insert("example.com/retries".to_string(), "x".to_string());
        assert_eq!(read(&other), Annotated::default());
    }

    #[test]
    fn atomic_with_steps_keeps_atomic() {
        let a = read(&annotations(&[
            ("switchover-mode", "atomic"),
            ("switchover-interval", "5s"),
        ]));
        assert_eq!(a.policy.switchover.mode, Some(ModeKind::Atomic));
        assert_eq!(a.policy.switchover.interval, None);
        assert_eq!(a.problems.len(), 1);
    }
}

//! `ray-xds.io/*` annotations on a RayService: its hosts and its overrides of the global
//! probe, traffic and switchover policy.
//!
//! Every annotation is optional. A value that does not parse is reported and ignored (the
//! global value applies), except `switchover-control`, whose bad value holds the switch
//! (a typo in `hold` or `abort` must not set it going); the RayService itself is still
//! served. Annotations with the
//! `ray-xds.io/` prefix that ray-xds does not know are reported too, so a typo is seen.

use std::collections::BTreeMap;

use crate::model::{HeadProxy, ServicePolicy};
use crate::policy::switchover::Control;
use crate::policy::Scope;

pub const PREFIX: &str = "ray-xds.io/";

/// The annotations that are not policy overrides: `(name, value, what it sets)`.
pub const OWN: &[(&str, &str, &str)] = &[
    ("hosts", "comma-separated domains", "the default hosts"),
    (
        "head-proxy",
        "`exclude`, `include`, `fallback`",
        "`head_proxy` (`excludeHeadPodFromServeSvc: true` wins)",
    ),
];

/// Every annotation ray-xds reads: its own, then one per policy setting a RayService may
/// override (named after the setting's flag), as docs/kubernetes.md's table lists them.
pub fn documented() -> Vec<String> {
    OWN.iter()
        .map(|(name, _, _)| name.to_string())
        .chain(
            crate::policy::all_fields()
                .filter(|f| f.scope == Scope::Service)
                .filter_map(|f| f.annotation.map(str::to_string)),
        )
        .collect()
}

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
    for (key, value) in annotations {
        let Some(name) = key.strip_prefix(PREFIX) else {
            continue;
        };
        let value = value.trim();
        let result: Result<(), String> = match name {
            "hosts" => {
                let hosts: Vec<String> = value
                    .split(',')
                    .map(str::trim)
                    .filter(|h| !h.is_empty())
                    .map(str::to_string)
                    .collect();
                if hosts.is_empty() {
                    Err("no host listed".into())
                } else {
                    out.hosts = Some(hosts);
                    Ok(())
                }
            }
            "head-proxy" => {
                let head = match value {
                    "exclude" => Some(HeadProxy::Exclude),
                    "include" => Some(HeadProxy::Include),
                    "fallback" => Some(HeadProxy::Fallback),
                    _ => None,
                };
                match head {
                    Some(h) => {
                        out.policy.head_proxy = h;
                        Ok(())
                    }
                    None => Err("expected exclude, include or fallback".into()),
                }
            }
            // An operator's word that does not parse holds the switch: a typo in `hold`
            // or `abort` must not set the switch going again.
            "switchover-control" => match out.policy.overrides.set_annotation(name, value) {
                Ok(_) => Ok(()),
                Err(why) => {
                    out.policy.overrides.switchover.control = Some(Control::Hold);
                    Err(format!("{why}; the switch is held until it is fixed"))
                }
            },
            // Each value is checked alone, by the same rule as everywhere else: a bad one
            // changes nothing.
            _ => match out.policy.overrides.set_annotation(name, value) {
                Ok(true) => Ok(()),
                Ok(false) => Err("unknown ray-xds annotation".into()),
                Err(why) => Err(why),
            },
        };
        if let Err(why) = result {
            out.problems
                .push((key.clone(), format!("{value:?}: {why}")));
        }
    }
    // An explicit `atomic` with steps or an interval: keep the mode, drop the rest.
    let switchover = &mut out.policy.overrides.switchover;
    if let Err(why) = crate::policy::CheckOverrides::check(&*switchover) {
        out.problems
            .push((format!("{PREFIX}switchover-mode"), why.to_string()));
        switchover.steps = None;
        switchover.interval = None;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::switchover::ModeKind;
    use std::time::Duration;

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
            ("idempotent", "true"),
            ("per-try-timeout", "30s"),
            ("route-timeout", "0s"),
            ("retry-back-off", "50ms"),
            ("retry-budget-percent", "10"),
            ("retry-budget-min-concurrency", "5"),
            ("consecutive-local-origin-failure", "3"),
            ("outlier-interval", "2s"),
            ("base-ejection-time", "10s"),
            ("max-ejection-percent", "30"),
            ("max-connections", "5000"),
            ("max-pending-requests", "100"),
            ("max-requests", "5000"),
            ("switchover-mode", "progressive"),
            ("switchover-steps", "20, 60, 100"),
            ("switchover-interval", "5s"),
            ("min-ready-proxies", "2"),
            ("drain-grace", "45s"),
            ("warm-timeout", "3s"),
            ("capacity-settle", "2s"),
            ("switchover-control", "hold"),
            ("outcome-margin", "10"),
            ("outcome-min-requests", "200"),
        ];
        let documented = documented();
        assert_eq!(values.len(), documented.len());
        for ((name, _), doc) in values.iter().zip(&documented) {
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
        assert_eq!(p.overrides.probe.timeout, Some(Duration::from_millis(300)));
        assert_eq!(p.overrides.probe.healthy_threshold, Some(1));
        assert_eq!(p.overrides.traffic.retries, Some(5));
        assert_eq!(p.overrides.traffic.route_timeout, Some(Duration::ZERO));
        assert_eq!(p.overrides.traffic.idempotent, Some(true));
        assert_eq!(p.overrides.traffic.max_ejection_percent, Some(30));
        assert_eq!(p.overrides.switchover.mode, Some(ModeKind::Progressive));
        assert_eq!(
            p.overrides.switchover.steps,
            Some(crate::policy::Steps(vec![20, 60, 100]))
        );
        assert_eq!(p.overrides.switchover.min_ready_proxies, Some(2));
        assert_eq!(
            p.overrides.switchover.control,
            Some(crate::policy::switchover::Control::Hold)
        );
        assert_eq!(
            p.overrides.switchover.warm_timeout,
            Some(Duration::from_secs(3))
        );
        assert_eq!(p.overrides.switchover.outcome_margin, Some(10));
        assert_eq!(p.overrides.switchover.outcome_min_requests, Some(200));
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
        assert_eq!(a.policy.overrides.traffic.idempotent, Some(true));
        assert_eq!(a.policy.overrides.traffic.retries, None);
        assert_eq!(a.hosts, None);
        // Other prefixes are none of our business.
        let mut other = BTreeMap::new();
        other.insert("example.com/retries".to_string(), "x".to_string());
        assert_eq!(read(&other), Annotated::default());
    }

    #[test]
    fn an_operator_s_word_that_does_not_parse_holds_the_switch() {
        for typo in ["abrot", "Hold", "", "promote now"] {
            let a = read(&annotations(&[("switchover-control", typo)]));
            assert_eq!(
                a.policy.overrides.switchover.control,
                Some(Control::Hold),
                "{typo:?}"
            );
            assert_eq!(a.problems.len(), 1);
            assert!(
                a.problems[0].1.contains("held until it is fixed"),
                "{:?}",
                a.problems
            );
        }
        let a = read(&annotations(&[("switchover-control", " abort ")]));
        assert_eq!(a.policy.overrides.switchover.control, Some(Control::Abort));
        assert_eq!(a.problems, vec![]);
    }

    #[test]
    fn atomic_with_steps_keeps_atomic() {
        let a = read(&annotations(&[
            ("switchover-mode", "atomic"),
            ("switchover-interval", "5s"),
        ]));
        assert_eq!(a.policy.overrides.switchover.mode, Some(ModeKind::Atomic));
        assert_eq!(a.policy.overrides.switchover.interval, None);
        assert_eq!(a.problems.len(), 1);
    }
}

//! How Envoy treats Ray Serve proxies (outlier detection, circuit breakers) and requests
//! (retries, timeouts), with defaults chosen for Ray Serve. `translate` turns it into
//! Envoy's fields; the reasons for each default are here.

use std::time::Duration;

use super::{AfterOverride, CheckOverrides};

const DAY: Duration = Duration::from_secs(24 * 3600);
const HOUR: Duration = Duration::from_secs(3600);

crate::declare_policy! {
    section "traffic";
    /// The traffic policy of one RayService.
    pub struct TrafficPolicy, service TrafficOverrides, global GlobalTraffic {
        service {
            /// Retries of a failed request, each on another proxy.
            retries: u32 = 3, range(0, 10), flag "retries";
            /// How long one try may wait for its response to start; 0s disables it. A hung
            /// proxy costs one of these, then the request goes to another proxy. Generous,
            /// because a model may take seconds before its first byte.
            per_try_timeout: Duration = Duration::from_secs(10),
                range(Duration::ZERO, DAY), flag "per-try-timeout";
            /// The deadline of a whole request, retries included; 0s is none. None by
            /// default: Ray Serve responses may stream for minutes.
            route_timeout: Duration = Duration::ZERO, range(Duration::ZERO, DAY), flag "route-timeout";
            /// Whether a request may be replayed after the proxy reset it mid-way (it may have run).
            idempotent: bool = false, flag "idempotent";
            /// The first retry back-off interval (the longest is ten times it).
            retry_back_off: Duration = Duration::from_millis(25),
                range(Duration::from_millis(1), Duration::from_secs(60)), flag "retry-back-off";
            /// Gateway failures (502, 503, 504) in a row before a proxy is ejected.
            consecutive_gateway_failure: u32 = 3, range(1, 1000), flag "consecutive-gateway-failure";
            /// Connect failures, resets and timeouts in a row before a proxy is ejected, counted apart from HTTP answers.
            consecutive_local_origin_failure: u32 = 2, range(1, 1000), flag "consecutive-local-origin-failure";
            /// How often Envoy's outlier detection sweeps.
            outlier_interval: Duration = Duration::from_secs(1),
                range(Duration::from_millis(10), HOUR), flag "outlier-interval";
            /// How long a first ejection lasts (repeats grow it, up to ten times).
            base_ejection_time: Duration = Duration::from_secs(5),
                range(Duration::from_millis(1), HOUR), flag "base-ejection-time";
            /// The largest share of a cluster's proxies ejected at once, in percent.
            max_ejection_percent: u32 = 50, range(0, 100), flag "max-ejection-percent";
            /// Concurrent retries allowed per cluster (a circuit breaker). Envoy's default of
            /// 3 is far too low for the burst of retries right after a proxy dies under load.
            max_retries: u32 = 1024, range(1, 1_000_000), flag "max-retries";
        }
        global {}
    }
}

impl CheckOverrides for TrafficOverrides {}
impl AfterOverride<TrafficOverrides> for TrafficPolicy {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_apply_over_the_global_policy() {
        let o = TrafficOverrides {
            idempotent: Some(true),
            retries: Some(5),
            ..Default::default()
        };
        o.validate().unwrap();
        let p = TrafficPolicy::default().with(&o);
        assert!(p.idempotent);
        assert_eq!(p.retries, 5);
        assert_eq!(p.per_try_timeout, Duration::from_secs(10));
    }

    #[test]
    fn the_same_rules_apply_to_every_field_wherever_it_comes_from() {
        let cases: [(&str, &str); 5] = [
            ("base-ejection-time", "0s"),
            ("retry-back-off", "0s"),
            ("max-ejection-percent", "150"),
            ("retry-back-off", "18446744073709551615s"),
            ("retries", "many"),
        ];
        for (annotation, text) in cases {
            let mut o = TrafficOverrides::default();
            let set = o.set_annotation(annotation, text);
            let refused = set.is_err() || o.validate().is_err();
            assert!(refused, "{annotation}={text} must be refused");
            let mut g = GlobalTraffic::default();
            let set = g.set_flag(annotation, text);
            assert!(
                set.is_err() || g.validate().is_err(),
                "--{annotation} {text}"
            );
        }
    }
}

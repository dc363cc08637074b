//! How Envoy treats Ray Serve proxies (outlier detection, circuit breakers, the retry
//! budget) and requests (retries, timeouts, streams), with defaults chosen for Ray Serve:
//! a request that may have run is never sent again unless the RayService says it is
//! idempotent, and backpressure (Ray's 503) is never taken for a proxy fault.
//! `translate` turns it into Envoy's fields; the reasons for each default are here.

use std::time::Duration;

use super::{AfterOverride, CheckOverrides};

const DAY: Duration = Duration::from_secs(24 * 3600);
const HOUR: Duration = Duration::from_secs(3600);

crate::declare_policy! {
    section "traffic";
    /// The traffic policy of one RayService.
    pub(crate) struct TrafficPolicy, service TrafficOverrides, global GlobalTraffic {
        service {
            /// Retries of a failed request, each on another proxy where there is one (only of requests that certainly did not run, unless idempotent).
            retries: u32 = 3, range(0, 10), flag "retries";
            /// Whether a request that may have run may be sent again: after a reset mid-way, a 502 or 504, or a per-try timeout. Off by default: a model call is expensive and may not be idempotent.
            idempotent: bool = false, flag "idempotent";
            /// How long one try of an idempotent request may wait for its response to start before it is tried on another proxy; 0s disables it. Not applied to non-idempotent requests.
            per_try_timeout: Duration = Duration::from_secs(10),
                range(Duration::ZERO, DAY), flag "per-try-timeout";
            /// The deadline of a whole request, retries included; 0s is none. None by
            /// default: Ray Serve responses may stream for minutes.
            route_timeout: Duration = Duration::ZERO, range(Duration::ZERO, DAY), flag "route-timeout";
            /// The first retry back-off interval (the longest is ten times it).
            retry_back_off: Duration = Duration::from_millis(25),
                range(Duration::from_millis(1), Duration::from_secs(60)), flag "retry-back-off";
            /// Retries in flight at once (a retry counts until its try ends), in percent of the requests in flight to the cluster (Envoy's retry budget): a backstop against retry storms, as `retries` bounds each request. 100 by default, not Envoy's 20: one connect failure fails every request waiting for a connection to that proxy at once (Envoy purges the queue), and each of them, which never ran, must get its retry.
            retry_budget_percent: u32 = 100, range(1, 100), flag "retry-budget-percent";
            /// Retries allowed in flight whatever the percent (Envoy's default is 3): enough for the requests waiting on one proxy's connections to fail together and all be retried while few others are in flight.
            retry_budget_min_concurrency: u32 = 1_000, range(1, 10_000), flag "retry-budget-min-concurrency";
            /// Connect failures and per-try timeouts in a row before a proxy is ejected. HTTP answers never eject: Ray's 503 is backpressure, not a proxy fault.
            consecutive_local_origin_failure: u32 = 2, range(1, 1000), flag "consecutive-local-origin-failure";
            /// How often Envoy's outlier detection sweeps.
            outlier_interval: Duration = Duration::from_secs(1),
                range(Duration::from_millis(10), HOUR), flag "outlier-interval";
            /// How long a first ejection lasts (repeats grow it, up to ten times).
            base_ejection_time: Duration = Duration::from_secs(5),
                range(Duration::from_millis(1), HOUR), flag "base-ejection-time";
            /// The largest share of a cluster's published proxies ejected at once, in percent. Below 100, the last one is never ejected.
            max_ejection_percent: u32 = 50, range(0, 99), flag "max-ejection-percent";
            /// Connections to a cluster at once, per Envoy (HTTP/1: one per request in flight, and a streamed answer holds its own for minutes).
            max_connections: u32 = 10_000, range(1, 1_000_000), flag "max-connections";
            /// Requests waiting for a connection to a cluster at once, per Envoy.
            max_pending_requests: u32 = 10_000, range(1, 1_000_000), flag "max-pending-requests";
            /// Requests in flight to a cluster at once, per Envoy.
            max_requests: u32 = 10_000, range(1, 1_000_000), flag "max-requests";
        }
        global {
            /// How long a request or stream (WebSocket, server-sent events) may pass no data before Envoy ends it; 0s disables it.
            stream_idle_timeout: Duration = Duration::from_secs(300),
                range(Duration::ZERO, DAY), flag "stream-idle-timeout";
            /// Proxies in front of Envoy whose X-Forwarded-For entries are trusted (0: Envoy is the edge, the client is the peer it sees).
            xff_num_trusted_hops: u32 = 0, range(0, 10), flag "xff-num-trusted-hops";
        }
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
        let cases: [(&str, &str); 6] = [
            ("base-ejection-time", "0s"),
            ("retry-back-off", "0s"),
            ("max-ejection-percent", "150"),
            ("retry-back-off", "18446744073709551615s"),
            ("retries", "many"),
            ("max-ejection-percent", "100"),
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

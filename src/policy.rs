//! Traffic policy: how Envoy treats Ray Serve proxies (outlier detection, circuit
//! breakers) and requests (retries, timeouts), with defaults chosen for Ray Serve.
//!
//! Global values come from the config file (`traffic:`); a RayService overrides any of
//! them (`traffic:` in services.yaml). Every default is explained where it is set.

use std::time::Duration;

/// The traffic policy of one RayService.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrafficPolicy {
    /// Retries of a request that failed on one proxy, each on another proxy.
    pub retries: u32,
    /// How long one try may wait for the response to start. A hung proxy costs one of
    /// these, then the request goes to another proxy. Generous, because a model may take
    /// seconds before its first byte, and a try that times out is tried again elsewhere
    /// (it may have run); 0 disables it.
    pub per_try_timeout: Duration,
    /// The whole request's deadline, retries included; 0 (the default) is none: Ray Serve
    /// responses may stream for minutes.
    pub route_timeout: Duration,
    /// Whether a request may be replayed after the proxy reset it mid-way (`reset`).
    /// Safe only for idempotent work, so off by default: without it, retries happen only
    /// when nothing ran (connect failure, reset before the request was sent, Ray's 503).
    pub idempotent: bool,
    /// Retry back-off: first interval (the maximum is ten times it).
    pub retry_back_off: Duration,
    /// Ray's 503 and Envoy's 502/504 in a row before a proxy is ejected.
    pub consecutive_gateway_failure: u32,
    /// Connect failures, resets and timeouts in a row before a proxy is ejected, counted
    /// apart from HTTP responses (`split_external_local_origin_errors`).
    pub consecutive_local_origin_failure: u32,
    /// How often Envoy's outlier detector sweeps.
    pub outlier_interval: Duration,
    /// How long a first ejection lasts (it grows with repeated ejections, up to ten times).
    pub base_ejection_time: Duration,
    /// At most this share of a cluster's proxies ejected at once: a moment when every
    /// proxy is slow must not eject them all (ray-xds's own health decides what is out).
    pub max_ejection_percent: u32,
    /// Concurrent retries allowed per cluster: Envoy's default of 3 is far too low for the
    /// burst of retries right after a proxy dies under load.
    pub max_retries: u32,
}

impl Default for TrafficPolicy {
    fn default() -> Self {
        TrafficPolicy {
            retries: 3,
            per_try_timeout: Duration::from_secs(10),
            route_timeout: Duration::ZERO,
            idempotent: false,
            retry_back_off: Duration::from_millis(25),
            consecutive_gateway_failure: 3,
            consecutive_local_origin_failure: 2,
            outlier_interval: Duration::from_secs(1),
            base_ejection_time: Duration::from_secs(5),
            max_ejection_percent: 50,
            max_retries: 1024,
        }
    }
}

/// What a RayService overrides; `None` keeps the global value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficOverrides {
    pub retries: Option<u32>,
    pub per_try_timeout: Option<Duration>,
    pub route_timeout: Option<Duration>,
    pub idempotent: Option<bool>,
    pub consecutive_gateway_failure: Option<u32>,
    pub consecutive_local_origin_failure: Option<u32>,
    pub base_ejection_time: Option<Duration>,
    pub max_ejection_percent: Option<u32>,
    pub retry_back_off: Option<Duration>,
    pub outlier_interval: Option<Duration>,
    pub max_retries: Option<u32>,
}

impl TrafficPolicy {
    pub fn with(self, o: &TrafficOverrides) -> TrafficPolicy {
        TrafficPolicy {
            retries: o.retries.unwrap_or(self.retries),
            per_try_timeout: o.per_try_timeout.unwrap_or(self.per_try_timeout),
            route_timeout: o.route_timeout.unwrap_or(self.route_timeout),
            idempotent: o.idempotent.unwrap_or(self.idempotent),
            consecutive_gateway_failure: o
                .consecutive_gateway_failure
                .unwrap_or(self.consecutive_gateway_failure),
            consecutive_local_origin_failure: o
                .consecutive_local_origin_failure
                .unwrap_or(self.consecutive_local_origin_failure),
            base_ejection_time: o.base_ejection_time.unwrap_or(self.base_ejection_time),
            max_ejection_percent: o
                .max_ejection_percent
                .unwrap_or(self.max_ejection_percent)
                .min(100),
            retry_back_off: o
                .retry_back_off
                .filter(|d| !d.is_zero())
                .unwrap_or(self.retry_back_off),
            outlier_interval: o
                .outlier_interval
                .filter(|d| !d.is_zero())
                .unwrap_or(self.outlier_interval),
            max_retries: o.max_retries.unwrap_or(self.max_retries),
        }
    }

    /// Envoy's `retry_on` for this policy.
    pub fn retry_on(&self) -> String {
        // gateway-error: 502/503/504 and per-try timeouts (Ray's own proxy never answers
        // 502 or 504; Envoy does, for connection trouble), so a hung proxy costs one
        // per-try timeout. Anything slower than `per_try_timeout` to start answering is
        // tried again elsewhere: keep it above the slowest time to first byte.
        let mut on = vec![
            "connect-failure",
            "refused-stream",
            "reset-before-request",
            "gateway-error",
            "retriable-status-codes",
        ];
        if self.idempotent {
            on.push("reset");
        }
        on.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_after_reset_only_when_idempotent() {
        let p = TrafficPolicy::default();
        assert!(!p.retry_on().split(',').any(|r| r == "reset"));
        let p = p.with(&TrafficOverrides {
            idempotent: Some(true),
            retries: Some(5),
            ..Default::default()
        });
        assert!(p.retry_on().split(',').any(|r| r == "reset"));
        assert_eq!(p.retries, 5);
        assert_eq!(p.per_try_timeout, Duration::from_secs(10));
        let p = p.with(&TrafficOverrides {
            max_retries: Some(64),
            outlier_interval: Some(Duration::from_millis(500)),
            retry_back_off: Some(Duration::ZERO),
            ..Default::default()
        });
        assert_eq!(
            (p.max_retries, p.outlier_interval),
            (64, Duration::from_millis(500))
        );
        assert_eq!(
            p.retry_back_off,
            Duration::from_millis(25),
            "a zero back-off is ignored"
        );
    }
}

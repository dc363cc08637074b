//! How ray-xds probes every Ray Serve proxy (`GET /-/healthz`, `GET /-/routes`).

use std::time::Duration;

use super::{AfterOverride, CheckOverrides};

crate::declare_policy! {
    section "probe";
    /// How every Ray Serve proxy is probed.
    pub(crate) struct ProbePolicy, service ProbeOverrides, global GlobalProbe {
        service {
            /// How often each proxy is probed, with ±20% jitter. A healthy proxy whose
            /// probe has not answered within a third of the timeout is probed a second
            /// time at once, alongside the first ([`ProbePolicy::hedge_after`]); one that
            /// fails without that (a fast error) is probed again after a fifth of the
            /// interval, until it reaches the unhealthy threshold.
            interval: Duration = Duration::from_millis(400),
                range(Duration::from_millis(50), Duration::from_secs(3600)), flag "probe-interval";
            /// How long one probe may take. A proxy is marked unhealthy only when
            /// `unhealthy_threshold` probes in a row failed, so a live proxy answering
            /// slower than this in one probe, but not in the next, stays healthy.
            timeout: Duration = Duration::from_millis(300),
                range(Duration::from_millis(10), Duration::from_secs(60)), flag "probe-timeout";
            /// Consecutive failed probes that make a proxy unhealthy (a refused connection counts at once).
            unhealthy_threshold: u32 = 2, range(1, 100), flag "probe-unhealthy-threshold";
            /// Consecutive good probes that make a proxy healthy again.
            healthy_threshold: u32 = 2, range(1, 100), flag "probe-healthy-threshold";
        }
        global {
            /// Probes in flight at once, across all proxies; an eighth is kept for a proxy's first probe and the quick re-probe that confirms a healthy proxy's failure, so neither waits behind a round of routine probes; a sixteenth is for hedged probes only (taken when free, never waited for).
            max_concurrent: usize = 256, range(1, 65_536), flag "probe-max-concurrent";
            /// How often a healthy proxy's `/-/routes` is read again.
            routes_interval: Duration = Duration::from_secs(10),
                range(Duration::from_secs(1), Duration::from_secs(3600)), flag "probe-routes-interval";
        }
    }
}

impl CheckOverrides for ProbeOverrides {}
impl AfterOverride<ProbeOverrides> for ProbePolicy {}

impl ProbePolicy {
    /// How long a new proxy may wait for its first probe before it is published anyway:
    /// two timeouts (a connect and a request) and a little slack.
    pub(crate) fn first_probe_wait(&self) -> Duration {
        self.timeout * 2 + Duration::from_millis(200)
    }

    /// How long a healthy proxy's probe may go unanswered before a second probe is sent
    /// alongside it (a third of the timeout: 100 ms by default). The two run together
    /// and each outcome is reported as soon as known; two failures in a row (the
    /// default `unhealthy_threshold`) make the proxy unhealthy. So a hung proxy is found
    /// `hedge_after + timeout` after its probe starts (400 ms by default, instead of two
    /// timeouts and a wait between them), and a slow one is marked down only if both
    /// probes go over the timeout: a proxy answering in 200 ms is healthy, and pays a
    /// second probe every round (HTTP/1.1: on a connection of its own, dropped when the
    /// first answers). The hedge is sent only when one failure alone would not reach
    /// `unhealthy_threshold` (with 1 there is nothing to confirm).
    pub fn hedge_after(&self) -> Duration {
        self.timeout / 3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_apply_and_are_checked() {
        let o = ProbeOverrides {
            interval: Some(Duration::from_secs(2)),
            ..Default::default()
        };
        o.validate().unwrap();
        let p = ProbePolicy::default().with(&o);
        assert_eq!(p.interval, Duration::from_secs(2));
        assert_eq!(p.timeout, Duration::from_millis(300));
        for bad in [
            ProbeOverrides {
                interval: Some(Duration::ZERO),
                ..Default::default()
            },
            ProbeOverrides {
                unhealthy_threshold: Some(0),
                ..Default::default()
            },
            ProbeOverrides {
                timeout: Some(Duration::MAX),
                ..Default::default()
            },
        ] {
            let err = bad.validate().unwrap_err();
            assert!(err.starts_with("probe."), "{err}");
            assert!(err.contains("out of range"), "{err}");
        }
    }
}

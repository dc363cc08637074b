//! How traffic moves between a RayService's RayClusters (see `pipeline::switchover` for
//! when it may move).

use std::time::Duration;

use super::{AfterOverride, CheckOverrides, Steps};

/// Whether a shift is atomic or progressive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModeKind {
    Atomic,
    Progressive,
}
crate::lowercase_enum_value!(ModeKind { Atomic = "atomic", Progressive = "progressive" });

/// An operator's word on a RayService's switch to its pending cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Control {
    /// The gates, limits and schedule decide.
    #[default]
    Auto,
    /// The pending cluster gains no more traffic than it has; readiness may still take
    /// it back to 0.
    Hold,
    /// Past the schedule and the capacity limit: all the traffic once the pending cluster
    /// is ready and warmed everywhere, within the source's own cap.
    Promote,
    /// The pending cluster gets none, and traffic that moved there goes back to the
    /// active cluster (through the same readiness and warmth gates).
    Abort,
}
crate::lowercase_enum_value!(Control {
    Auto = "auto",
    Hold = "hold",
    Promote = "promote",
    Abort = "abort"
});

/// The progressive steps used when none are given.
pub(crate) const DEFAULT_STEPS: [u32; 4] = [10, 25, 50, 100];

crate::declare_policy! {
    section "switchover";
    /// How one RayService switches between RayClusters.
    pub(crate) struct SwitchoverPolicy, service SwitchoverOverrides, global GlobalSwitchover {
        service {
            /// Atomic (0 to 100 at once) or progressive (the steps, one per interval); steps or an interval alone imply progressive.
            mode: ModeKind = ModeKind::Atomic, flag "switchover-mode";
            /// Percent of traffic on the new cluster at each progressive step, rising to 100.
            steps: Steps = Steps(DEFAULT_STEPS.to_vec()), flag "switchover-steps";
            /// How long each progressive step lasts.
            interval: Duration = Duration::from_secs(10),
                range(Duration::from_millis(100), Duration::from_secs(24 * 3600)), flag "switchover-interval";
            /// Healthy proxies serving every route the new cluster needs before traffic moves.
            min_ready_proxies: u32 = 1, range(1, 10_000), flag "min-ready-proxies";
            /// How long a cluster the source dropped stays, its endpoints draining, before it goes.
            drain_grace: Duration = Duration::from_secs(30),
                range(Duration::ZERO, Duration::from_secs(24 * 3600)), flag "drain-grace";
            /// The longest wait for every connected Envoy to warm the new cluster before traffic moves without the laggards.
            warm_timeout: Duration = Duration::from_secs(10),
                range(Duration::ZERO, Duration::from_secs(3600)), flag "warm-timeout";
            /// How long a rise of the new cluster's ready capacity must hold before its share grows (Ray's proxies route to replicas that just turned RUNNING a moment after its dashboard lists them).
            capacity_settle: Duration = Duration::from_secs(5),
                range(Duration::ZERO, Duration::from_secs(3600)), flag "capacity-settle";
            /// An operator's word on a switch to the pending cluster: auto, hold (gain no more traffic), promote (past the schedule and capacity limit, never the readiness and warmth gates) or abort (none, and back to the active cluster).
            control: Control = Control::Auto, flag "switchover-control";
            /// Percentage points by which the new cluster's failure ratio (5xx or no answer, from the Envoys' load reports) may exceed the active cluster's before it is rolled back to no traffic; 100 never rolls back.
            outcome_margin: u32 = 5, range(0, 100), flag "outcome-margin";
            /// Requests that must have ended on the new cluster within the outcome window before its failure ratio is judged.
            outcome_min_requests: u32 = 50, range(1, 10_000_000), flag "outcome-min-requests";
        }
        global {
            /// How far back the Envoys' load reports count when a new cluster's failure ratio is judged.
            outcome_window: Duration = Duration::from_secs(30),
                range(Duration::from_secs(5), Duration::from_secs(120)), flag "outcome-window";
            /// How often each Envoy is asked to report its requests per cluster (Load Reporting Service).
            load_report_interval: Duration = Duration::from_secs(2),
                range(Duration::from_secs(1), Duration::from_secs(60)), flag "load-report-interval";
        }
    }
}

impl CheckOverrides for SwitchoverOverrides {
    fn check(&self) -> Result<(), String> {
        if self.mode == Some(ModeKind::Atomic) && (self.steps.is_some() || self.interval.is_some())
        {
            return Err("switchover: steps and interval go with mode: progressive".into());
        }
        Ok(())
    }
}

impl AfterOverride<SwitchoverOverrides> for SwitchoverPolicy {
    /// Steps or an interval without a mode mean `progressive`.
    fn after_override(&mut self, o: &SwitchoverOverrides) {
        if o.mode.is_none() && (o.steps.is_some() || o.interval.is_some()) {
            self.mode = ModeKind::Progressive;
        }
    }
}

/// How a shift moves, as the switchover state machine uses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ShiftMode {
    Atomic,
    /// Target weights in percent, ending at 100, one step per interval.
    Progressive {
        steps: Vec<u32>,
        interval: Duration,
    },
}

impl SwitchoverPolicy {
    pub(crate) fn shift(&self) -> ShiftMode {
        match self.mode {
            ModeKind::Atomic => ShiftMode::Atomic,
            ModeKind::Progressive => ShiftMode::Progressive {
                steps: self.steps.0.clone(),
                interval: self.interval,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn global_defaults_apply_unless_a_rayservice_overrides_them() {
        let global = SwitchoverPolicy::default().with_global(&GlobalSwitchover {
            steps: Some(Steps(vec![20, 100])),
            interval: Some(Duration::from_secs(3)),
            drain_grace: Some(Duration::from_secs(7)),
            ..Default::default()
        });
        assert_eq!(
            global.shift(),
            ShiftMode::Progressive {
                steps: vec![20, 100],
                interval: Duration::from_secs(3)
            },
            "steps imply progressive in ray-xds.yaml too"
        );
        assert_eq!(global.with(&SwitchoverOverrides::default()), global);
        let atomic = global.with(&SwitchoverOverrides {
            mode: Some(ModeKind::Atomic),
            ..Default::default()
        });
        assert_eq!(atomic.shift(), ShiftMode::Atomic);
        assert_eq!(atomic.drain_grace, Duration::from_secs(7));
        let slower = global.with(&SwitchoverOverrides {
            interval: Some(Duration::from_secs(30)),
            ..Default::default()
        });
        assert_eq!(
            slower.shift(),
            ShiftMode::Progressive {
                steps: vec![20, 100],
                interval: Duration::from_secs(30)
            }
        );
        let stepped = SwitchoverPolicy::default().with(&SwitchoverOverrides {
            steps: Some(Steps(vec![50, 100])),
            ..Default::default()
        });
        assert_eq!(
            stepped.shift(),
            ShiftMode::Progressive {
                steps: vec![50, 100],
                interval: Duration::from_secs(10)
            }
        );
        for bad in [
            SwitchoverOverrides {
                steps: Some(Steps(vec![50, 90])),
                ..Default::default()
            },
            SwitchoverOverrides {
                steps: Some(Steps(vec![0, 100])),
                ..Default::default()
            },
            SwitchoverOverrides {
                min_ready_proxies: Some(0),
                ..Default::default()
            },
            SwitchoverOverrides {
                mode: Some(ModeKind::Atomic),
                interval: Some(Duration::from_secs(1)),
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}

//! How ray-xds polls each RayCluster's Ray dashboard (`GET /api/serve/applications/`).

use std::time::Duration;

use super::{AfterOverride, CheckOverrides};

crate::declare_policy! {
    section "dashboard";
    /// How each cluster's Ray dashboard is polled.
    pub(crate) struct DashboardPolicy, service DashboardOverrides, global GlobalDashboard {
        service {}
        global {
            /// How often each cluster's Ray dashboard is polled.
            poll_interval: Duration = Duration::from_secs(2),
                range(Duration::from_millis(50), Duration::from_secs(3600)), flag "dashboard-poll-interval";
            /// How long one dashboard poll may take.
            timeout: Duration = Duration::from_secs(1),
                range(Duration::from_millis(10), Duration::from_secs(60)), flag "dashboard-timeout";
            /// How many polls of a dashboard in a row may fail while its last answer still counts as current (for readiness and a switch's gates); the next failure marks it stale.
            misses_tolerated: u32 = 1, range(0, 10), flag "dashboard-misses-tolerated";
        }
    }
}

impl CheckOverrides for DashboardOverrides {}
impl AfterOverride<DashboardOverrides> for DashboardPolicy {}

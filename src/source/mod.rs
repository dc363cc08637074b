//! Sources: where ray-xds learns which RayServices exist and where their proxies are.
//!
//! Each source is the single writer of its own `watch` channel of [`Model`]s; the
//! pipeline reads it. A source publishes only valid models: bad input is logged,
//! counted in `ray_xds_source_rejected_total` and skipped, and the last good model stays.

pub mod file;
pub mod kubernetes;

use serde::Serialize;

pub use crate::model::Model;

/// How a source is doing, for `/readyz` and `/debug/state`. Written by the source alone.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct SourceStatus {
    /// `file` or `kubernetes`.
    pub source: &'static str,
    /// The source has delivered its first full state (at once for the file source; once
    /// every watch has listed, for Kubernetes). Nothing is published before.
    pub synced: bool,
    pub watches: Vec<WatchStatus>,
    /// RayServices whose status names no RayCluster yet.
    pub unrouted: Vec<String>,
    /// What the source currently ignores, and why.
    pub problems: Vec<String>,
    /// Kubernetes: what KubeRay's status says of each cluster's applications (RayService →
    /// cluster → application → status). A hint only: KubeRay blanks it during upgrades and
    /// head loss; each cluster's own dashboard decides.
    pub kuberay_application_statuses: kubernetes::build::Hints,
}

/// Where one Kubernetes watch stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum WatchState {
    /// A (re-)list is under way.
    Listing,
    Watching,
    /// After an error, with back-off; the last state is served meanwhile.
    Retrying,
}

/// One Kubernetes watch.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct WatchStatus {
    /// e.g. `pods in all namespaces`, `rayservices in ml`.
    pub watch: String,
    pub state: WatchState,
    /// Has delivered a full list at least once.
    pub synced: bool,
    pub objects: usize,
    pub last_event_unix: Option<f64>,
    /// Since when this watch has been failing (cleared by its next event): the state it
    /// serves may be this old.
    pub failing_since_unix: Option<f64>,
    pub last_error: Option<String>,
    pub errors: u64,
    /// Full lists after the first (after a 410 Gone, or a reconnect that needed one).
    pub relists: u64,
}

impl SourceStatus {
    /// A source that is synced from the start (the file source).
    pub(crate) fn synced(source: &'static str) -> SourceStatus {
        SourceStatus {
            source,
            synced: true,
            ..Default::default()
        }
    }
}

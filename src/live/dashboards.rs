//! Polls the Ray dashboard of every cluster that has one, and publishes what each says.
//!
//! One task per cluster polls `GET /api/serve/applications/` every interval; the manager
//! is the single writer of [`DashboardStates`]. A failed poll (unreachable, 503, timeout,
//! malformed JSON) is counted and logged and crashes nothing; the last known status is
//! kept. It still counts as current through `misses_tolerated` failed polls in a row (one
//! slow answer on a busy head does not flap a switch's weights), and is marked stale from
//! the next. Publishing happens only on change.
//!
//! Memory: a status is shared (`Arc`), never copied per publication, and what all
//! statuses hold is bounded by [`MEMORY_BUDGET_BYTES`], shared fairly between clusters
//! (`budget::FairBudget`): an answer over its cluster's fair share, when the budget is
//! full, is refused like a failed poll (`over_budget`; the last good status stays), and a
//! cluster within its share always gets in, dropping the statuses of clusters over
//! theirs (they become unknown and stale, as if their dashboards were down).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::dashboard::{DashboardClient, DashboardError, ServeStatus};
use crate::budget::FairBudget;
use crate::metrics::{ErrorLabels, Metrics};
use crate::model::Model;

/// What the statuses of all clusters may hold in all (estimated by
/// [`ServeStatus::estimated_bytes`]): 64 MiB, over 20 answers at the proxy caps.
pub const MEMORY_BUDGET_BYTES: usize = crate::config::DASHBOARDS_BUDGET_BYTES;

/// What every cluster's dashboard said, by Envoy cluster name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DashboardStates {
    pub clusters: BTreeMap<String, ClusterDashboard>,
}

/// What one cluster's dashboard said last.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterDashboard {
    pub url: String,
    /// The last status it answered with; `None` until it first answers.
    #[serde(skip)]
    pub status: Option<Arc<ServeStatus>>,
    /// Each application's status and since when (unix seconds) it has had it. Shown in
    /// `/debug/state` up to [`APPLICATIONS_SHOWN`] (by name), with how many there are.
    #[serde(serialize_with = "some_applications")]
    pub applications: BTreeMap<String, (String, f64)>,
    pub last_success_unix: Option<f64>,
    pub last_error: Option<String>,
    /// Polls failed in a row since the last answer.
    pub misses: u32,
    /// More polls failed in a row than are tolerated: `status` is what it said before,
    /// not what it says now.
    pub stale: bool,
}

/// When each cluster's dashboard last answered well, by Envoy cluster name.
#[derive(Debug, Default)]
pub struct AnsweredAt(std::sync::Mutex<BTreeMap<String, f64>>);

impl AnsweredAt {
    pub fn get(&self, cluster: &str) -> Option<f64> {
        self.0.lock().expect("never poisoned").get(cluster).copied()
    }

    fn set(&self, cluster: &str, at: f64) {
        self.0
            .lock()
            .expect("never poisoned")
            .insert(cluster.to_string(), at);
    }

    fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.0
            .lock()
            .expect("never poisoned")
            .retain(|c, _| keep(c));
    }
}

/// The most applications `/debug/state` shows per cluster.
pub(crate) const APPLICATIONS_SHOWN: usize = 50;

fn some_applications<S: serde::Serializer>(
    applications: &BTreeMap<String, (String, f64)>,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let more = applications.len().saturating_sub(APPLICATIONS_SHOWN);
    let mut map = s.serialize_map(None)?;
    for (name, status) in applications.iter().take(APPLICATIONS_SHOWN) {
        map.serialize_entry(name, status)?;
    }
    if more > 0 {
        map.serialize_entry("...", &format!("and {more} more"))?;
    }
    map.end()
}

impl ClusterDashboard {
    pub fn new(url: String) -> ClusterDashboard {
        ClusterDashboard {
            url,
            status: None,
            applications: BTreeMap::new(),
            last_success_unix: None,
            last_error: None,
            misses: 0,
            stale: false,
        }
    }

    /// One poll's result; after more than `misses_tolerated` failures in a row the last
    /// status is stale.
    fn apply(
        &mut self,
        result: Result<ServeStatus, DashboardError>,
        now: SystemTime,
        misses_tolerated: u32,
    ) {
        let now_unix = unix(now);
        match result {
            Ok(status) => {
                let mut applications = BTreeMap::new();
                for (name, app) in &status.applications {
                    let s = app.status.as_str().to_string();
                    let since = match self.applications.get(name) {
                        Some((old, since)) if *old == s => *since,
                        _ => now_unix,
                    };
                    applications.insert(name.clone(), (s, since));
                }
                self.applications = applications;
                self.status = Some(Arc::new(status));
                self.last_success_unix = Some(now_unix);
                self.last_error = None;
                self.misses = 0;
                self.stale = false;
            }
            Err(e) => {
                self.last_error = Some(e.to_string());
                self.misses = self.misses.saturating_add(1);
                self.stale = self.stale || self.misses > misses_tolerated;
            }
        }
    }
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[derive(Clone)]
pub struct DashboardPoller {
    /// When each cluster's dashboard last answered (unix seconds), every answer: the
    /// published states change only when what they say changes.
    pub answered: Arc<AnsweredAt>,
    pub interval: Duration,
    pub timeout: Duration,
    /// Failed polls in a row after which a dashboard's last answer is stale.
    pub misses_tolerated: u32,
    pub metrics: Arc<Metrics>,
    /// What all statuses may hold ([`MEMORY_BUDGET_BYTES`] outside tests).
    pub memory_budget: usize,
}

impl DashboardPoller {
    /// Polls until `shutdown`. A cluster name received on `refresh` is polled at once and
    /// its answer published even if unchanged: the switchover asks for that when it needs
    /// an answer given after a switch began.
    pub async fn run(
        self,
        mut models: watch::Receiver<Arc<Model>>,
        states: watch::Sender<Arc<DashboardStates>>,
        refresh: &mut mpsc::UnboundedReceiver<String>,
        shutdown: CancellationToken,
    ) {
        let (tx, mut rx) = mpsc::channel::<Answer>(64);
        let mut polls = Polls {
            client: Arc::new(DashboardClient::new(self.timeout)),
            tx,
            tasks: BTreeMap::new(),
            current: DashboardStates::default(),
            budget: FairBudget::new(self.memory_budget),
            wanted_fresh: BTreeSet::new(),
            poller: &self,
            states: &states,
        };
        let mut models_changed = true;
        loop {
            if models_changed {
                models_changed = false;
                let wanted = dashboards(&models.borrow_and_update());
                polls.follow(&wanted);
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                changed = models.changed() => {
                    if changed.is_err() { break; }
                    models_changed = true;
                }
                Some(cluster) = refresh.recv() => polls.refresh(cluster),
                Some(answer) = rx.recv() => polls.answer(answer),
            }
        }
        for (_, (_, task)) in polls.tasks {
            task.abort();
        }
    }
}

/// One dashboard's answer: the cluster, the URL asked, what it said, and whether it was
/// asked for out of turn (`refresh`).
type Answer = (String, String, Result<ServeStatus, DashboardError>, bool);

/// The poller's state: a polling task per dashboard, what each last said (published on
/// `states`), and what the statuses hold of the memory budget.
struct Polls<'a> {
    client: Arc<DashboardClient>,
    tx: mpsc::Sender<Answer>,
    tasks: BTreeMap<String, (String, JoinHandle<()>)>,
    current: DashboardStates,
    budget: FairBudget<String>,
    /// Clusters whose next answer is published even if unchanged.
    wanted_fresh: BTreeSet<String>,
    poller: &'a DashboardPoller,
    states: &'a watch::Sender<Arc<DashboardStates>>,
}

impl Polls<'_> {
    /// Polls exactly the dashboards `wanted` names (Envoy cluster → URL): a task for each
    /// new one, none for one that went or moved; what a gone one said is forgotten.
    fn follow(&mut self, wanted: &BTreeMap<String, String>) {
        self.tasks.retain(|cluster, (url, task)| {
            let keep = wanted.get(cluster) == Some(url);
            if !keep {
                task.abort();
            }
            keep
        });
        for (cluster, url) in wanted {
            self.tasks.entry(cluster.clone()).or_insert_with(|| {
                let (client, tx) = (self.client.clone(), self.tx.clone());
                let interval = self.poller.interval;
                let (c, u) = (cluster.clone(), url.clone());
                let task = tokio::spawn(async move {
                    loop {
                        let result = client.fetch(&u).await;
                        if tx
                            .send((c.clone(), u.clone(), result, false))
                            .await
                            .is_err()
                        {
                            return;
                        }
                        tokio::time::sleep(interval).await;
                    }
                });
                (url.clone(), task)
            });
        }
        let before = self.current.clone();
        self.current
            .clusters
            .retain(|c, d| wanted.get(c) == Some(&d.url));
        let current = &self.current;
        self.budget.retain(|c| current.clusters.contains_key(c));
        self.poller
            .answered
            .retain(|c| current.clusters.contains_key(c));
        self.poller
            .metrics
            .set_held_bytes("dashboards", self.budget.total());
        for (cluster, url) in wanted {
            self.current
                .clusters
                .entry(cluster.clone())
                .or_insert_with(|| ClusterDashboard::new(url.clone()));
        }
        if self.current != before {
            self.states.send_replace(Arc::new(self.current.clone()));
        }
    }

    /// Asks `cluster`'s dashboard now. Whichever answer comes next (this one, or the
    /// regular poll's if the cluster is not known yet) is published even if unchanged.
    fn refresh(&mut self, cluster: String) {
        self.wanted_fresh.insert(cluster.clone());
        if let Some(d) = self.current.clusters.get(&cluster) {
            let (client, tx, url) = (self.client.clone(), self.tx.clone(), d.url.clone());
            tokio::spawn(async move {
                let result = client.fetch(&url).await;
                let _ = tx.send((cluster, url, result, true)).await;
            });
        }
    }

    /// One answer: within the memory budget (evicting clusters over their share) or
    /// refused as over it, applied to its cluster's state, published when what readers
    /// see changed (or a fresh answer was asked for).
    fn answer(&mut self, (cluster, url, result, forced): Answer) {
        let forced = self.wanted_fresh.remove(&cluster) || forced;
        if self
            .current
            .clusters
            .get(&cluster)
            .is_none_or(|d| d.url != url)
        {
            return;
        }
        let metrics = &self.poller.metrics;
        if result.is_ok() {
            self.poller.answered.set(&cluster, unix(SystemTime::now()));
        }
        let result = match result {
            Ok(status) => match self.budget.admit(&cluster, status.estimated_bytes()) {
                Ok(evicted) => {
                    for hog in evicted {
                        drop_over_budget(&mut self.current, &hog, metrics);
                    }
                    Ok(status)
                }
                Err(over) => Err(DashboardError::OverBudget(over.to_string())),
            },
            Err(e) => Err(e),
        };
        metrics.set_held_bytes("dashboards", self.budget.total());
        let Some(entry) = self.current.clusters.get_mut(&cluster) else {
            return;
        };
        if let Err(e) = &result {
            metrics
                .dashboard_errors
                .get_or_create(&ErrorLabels {
                    reason: e.metric_label(),
                })
                .inc();
            if entry.misses == 0 {
                tracing::warn!(cluster, url, error = %e, "Ray dashboard did not answer; keeping its last known state");
            }
        } else if entry.misses > 0 {
            tracing::info!(
                cluster,
                url,
                misses = entry.misses,
                "Ray dashboard answers again"
            );
        }
        let before = entry.clone();
        entry.apply(result, SystemTime::now(), self.poller.misses_tolerated);
        if entry.stale && !before.stale {
            tracing::warn!(
                cluster,
                url,
                misses = entry.misses,
                "Ray dashboard's last answer is stale"
            );
        }
        // Only the status, staleness and errors matter to readers; a poll that changes
        // nothing but the success time is not worth a new snapshot.
        // (A miss counts as a change only up to the one that makes the status stale: a
        // dashboard that stays down is published once, not at every poll.)
        let tolerated = self.poller.misses_tolerated;
        let changed = before.status != entry.status
            || before.stale != entry.stale
            || (before.misses != entry.misses && entry.misses <= tolerated.saturating_add(1))
            || before.last_error != entry.last_error;
        if changed || forced {
            self.states.send_replace(Arc::new(self.current.clone()));
        }
    }
}

/// Drops what `cluster`'s dashboard said, evicted from the memory budget by a cluster
/// within its fair share: it is unknown and stale until an answer fits again.
fn drop_over_budget(current: &mut DashboardStates, cluster: &str, metrics: &Metrics) {
    let Some(entry) = current.clusters.get_mut(cluster) else {
        return;
    };
    let error = DashboardError::OverBudget(
        "dropped to make room for a cluster within its fair share of the memory budget".into(),
    );
    metrics
        .dashboard_errors
        .get_or_create(&ErrorLabels {
            reason: error.metric_label(),
        })
        .inc();
    tracing::warn!(cluster, error = %error, "Ray dashboard's status dropped");
    entry.status = None;
    entry.applications.clear();
    entry.last_error = Some(error.to_string());
    entry.stale = true;
}

/// Envoy cluster name → dashboard URL, for every cluster that has a dashboard.
fn dashboards(model: &Model) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for service in model.services() {
        for cluster in &service.clusters {
            if let Some(url) = &cluster.dashboard {
                out.insert(service.envoy_cluster_name(&cluster.name), url.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running() -> ServeStatus {
        crate::live::dashboard::parse(include_bytes!(
            "../../tests/fixtures/ray-serve-2.60/02-running.json"
        ))
        .unwrap()
    }

    /// A dashboard that stays down is published as it goes stale, not at every poll
    /// after (each publication rebuilds every snapshot).
    #[tokio::test]
    async fn a_dashboard_that_stays_down_is_published_once_stale() {
        let mut s = crate::model::test_support::service("s", "c", &[8000]);
        // Port 1 on loopback: refused at once.
        s.clusters[0].dashboard = Some("http://127.0.0.1:1".into());
        let (_models, models_rx) = watch::channel(Arc::new(Model::new(vec![s]).unwrap()));
        let (tx, mut rx) = watch::channel(Arc::new(DashboardStates::default()));
        let metrics = Arc::new(Metrics::new());
        let poller = DashboardPoller {
            answered: Default::default(),
            interval: Duration::from_millis(20),
            timeout: Duration::from_secs(5),
            misses_tolerated: 1,
            metrics: metrics.clone(),
            memory_budget: MEMORY_BUDGET_BYTES,
        };
        let shutdown = CancellationToken::new();
        let (_refresh, mut refresh_rx) = mpsc::unbounded_channel();
        let token = shutdown.clone();
        tokio::spawn(async move { poller.run(models_rx, tx, &mut refresh_rx, token).await });
        let stale = |d: &Arc<DashboardStates>| d.clusters.values().any(|c| c.stale);
        tokio::time::timeout(Duration::from_secs(20), rx.wait_for(stale))
            .await
            .expect("stale in time")
            .unwrap();
        rx.mark_unchanged();
        let misses = || rx.borrow().clusters.values().map(|c| c.misses).max();
        assert_eq!(misses(), Some(2), "stale at the second miss");
        let errors = metrics.dashboard_errors.get_or_create(&ErrorLabels {
            reason: "unreachable",
        });
        let at_stale = errors.get();
        tokio::time::timeout(Duration::from_secs(20), async {
            while errors.get() < at_stale + 10 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("10 more polls in time");
        assert!(
            !rx.has_changed().unwrap(),
            "published again at {:?} misses",
            misses()
        );
        shutdown.cancel();
    }

    #[test]
    fn a_dashboard_is_stale_only_after_more_misses_in_a_row_than_tolerated() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        for tolerated in [0, 1, 3] {
            let mut d = ClusterDashboard::new("http://192.0.2.1:8265".into());
            d.apply(Ok(running()), t, tolerated);
            for round in 0..2 {
                for miss in 1..=tolerated + 2 {
                    d.apply(Err(DashboardError::Timeout), t, tolerated);
                    assert_eq!(d.misses, miss);
                    assert_eq!(
                        d.stale,
                        miss > tolerated,
                        "{tolerated} tolerated, miss {miss}"
                    );
                    assert!(d.status.is_some(), "the last status is kept");
                    assert_eq!(d.last_success_unix, Some(1_000.0 + round as f64));
                }
                d.apply(Ok(running()), t + Duration::from_secs(round + 1), tolerated);
                assert_eq!(d.last_success_unix, Some(1_001.0 + round as f64));
                assert_eq!(
                    (d.misses, d.stale, d.last_error.as_deref()),
                    (0, false, None)
                );
            }
        }
    }

    /// `/debug/state` shows a bounded part of a cluster's
    /// applications (45 clusters of big statuses made 360 MB pages).
    #[test]
    fn the_debug_view_shows_a_bounded_number_of_applications() {
        let mut d = ClusterDashboard::new("http://192.0.2.1:8265".into());
        for i in 0..APPLICATIONS_SHOWN + 10 {
            d.applications
                .insert(format!("app{i:03}"), ("RUNNING".into(), 1.0));
        }
        let shown = serde_json::to_value(&d).unwrap();
        let apps = shown["applications"].as_object().unwrap();
        assert_eq!(apps.len(), APPLICATIONS_SHOWN + 1);
        assert_eq!(apps["..."], "and 10 more");
        assert!(apps.contains_key("app000") && !apps.contains_key("app059"));
    }
}

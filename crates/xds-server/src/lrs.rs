//! Envoy's Load Reporting Service (`envoy.service.load_stats.v3.LoadReportingService`):
//! what the requests each Envoy sent to each cluster came to.
//!
//! An Envoy whose bootstrap names this server in `cluster_manager.load_stats_config`
//! opens one stream and says who it is; the server answers once, asking for every
//! cluster (`send_all_clusters`) every `interval`; from then on each message is one
//! report: per cluster and locality, the requests that succeeded, failed (a 5xx, or no
//! answer), were issued, and are in progress now, since the report before.
//!
//! [`LoadLedger`] (sans-IO) sums the reports of every stream per *tracked* cluster, in
//! one-second buckets over the last [`MAX_WINDOW`]; a cluster is tracked when its name,
//! or a name it is below (`tracked/...`), was given to [`LoadLedger::track`], and its
//! reports count under that name. [`LoadReports`] shares a ledger between the streams
//! and whoever reads totals over a window; [`LrsService`] is the tower service.
//!
//! Invariants: memory grows only with the tracked names (at most [`MAX_TRACKED`]) and
//! the window, never with what a client sends (an untracked cluster is counted and
//! skipped); a stream's in-progress counts go when the stream ends; a report's numbers
//! are added saturating, so garbage cannot wrap a total; a stream that names no node in
//! its first message is refused; an entry counts only for a cluster that an ADS stream of
//! the reporting node takes (so a client reports only on what it was given); one address
//! holds at most [`MAX_STREAMS_PER_PEER`] streams, and a stream silent for five report
//! intervals is closed.

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterStats;
use envoy_types::pb::envoy::service::load_stats::v3::{LoadStatsRequest, LoadStatsResponse};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::server::NamedService;
use tonic::Status;

use super::clients::{takes, Clients, SharedStream};
use super::codec::{frame, PartialRequests, RequestStream};
use super::Observer;

const STREAM_PATH: &str = "/envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats";

/// The longest window totals are kept for.
pub const MAX_WINDOW: Duration = Duration::from_secs(120);

/// The most names tracked at once: a name beyond is not tracked.
pub const MAX_TRACKED: usize = 4096;

/// The most LRS streams served at once (an Envoy opens one).
pub const MAX_STREAMS: usize = 20_000;

/// The most LRS streams one client address holds at once (an Envoy opens one; a node
/// with a few Envoys, a few).
pub const MAX_STREAMS_PER_PEER: usize = 64;

/// How many report intervals a stream may stay silent before it is closed (Envoy reports
/// every interval; a stream that says nothing holds a place).
const SILENT_INTERVALS: u32 = 5;

/// How often a stream whose node has no ADS stream yet looks for one again.
const NODE_LOOKUP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// What the requests to one cluster came to, over some time, as Envoy counts them: a
/// request that got a 5xx, or no answer at all, failed; one in progress has not ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadCounts {
    pub succeeded: u64,
    pub failed: u64,
    pub issued: u64,
    /// The most in progress at once that any report saw (over every stream's latest).
    #[serde(default)]
    pub in_progress_peak: u64,
}

impl LoadCounts {
    /// Both summed (peaks too: two sets of Envoys' peaks may coincide).
    pub fn add(&mut self, other: &LoadCounts) {
        self.succeeded = self.succeeded.saturating_add(other.succeeded);
        self.failed = self.failed.saturating_add(other.failed);
        self.issued = self.issued.saturating_add(other.issued);
        self.in_progress_peak = self.in_progress_peak.saturating_add(other.in_progress_peak);
    }

    /// Requests that ended, well or not.
    pub fn ended(&self) -> u64 {
        self.succeeded.saturating_add(self.failed)
    }
}

/// One report's effect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Cluster entries counted under a tracked name.
    pub tracked: usize,
    /// Cluster entries skipped: no tracked name covers them.
    pub untracked: usize,
    /// Cluster entries refused: no ADS stream of the reporting node takes that cluster
    /// (an Envoy reports only on clusters it was given).
    pub not_held: usize,
}

/// One tracked name's reports.
#[derive(Debug, Default)]
struct Tracked {
    /// Reports received before this unix second do not count (a new version began).
    since: u64,
    /// Per whole unix second (ascending), what reports received then added.
    buckets: VecDeque<(u64, LoadCounts)>,
    /// Each stream's latest in-progress count, and their sum.
    in_progress: BTreeMap<u64, u64>,
    in_progress_sum: u64,
}

impl Tracked {
    /// Stream `stream` has `n` in progress now (`None`: it ended).
    fn set_in_progress(&mut self, stream: u64, n: Option<u64>) {
        let before = match n {
            Some(n) => self.in_progress.insert(stream, n),
            None => self.in_progress.remove(&stream),
        };
        self.in_progress_sum = self
            .in_progress_sum
            .saturating_sub(before.unwrap_or(0))
            .saturating_add(n.unwrap_or(0));
    }
}

/// Every stream's reports, per tracked name (sans-IO: time is passed in).
#[derive(Debug, Default)]
pub struct LoadLedger {
    tracked: BTreeMap<String, Tracked>,
}

impl LoadLedger {
    /// Tracks exactly `names` (at most [`MAX_TRACKED`], the first in order), each
    /// counting reports from its time on: what a name no longer given had is forgotten,
    /// a new one starts empty, and one whose time moved forgets what came before.
    pub fn track(&mut self, names: &BTreeMap<String, SystemTime>) {
        self.tracked.retain(|name, _| names.contains_key(name));
        for (name, since) in names {
            if !self.tracked.contains_key(name) && self.tracked.len() >= MAX_TRACKED {
                continue;
            }
            let t = self.tracked.entry(name.clone()).or_default();
            t.since = unix_second(*since);
            let since = t.since;
            t.buckets.retain(|(s, _)| *s >= since);
        }
    }

    /// The tracked name `cluster` counts under: itself, or the longest tracked name it is
    /// below (`name/...`).
    fn owner<'a>(&self, cluster: &'a str) -> Option<&'a str> {
        let mut at = cluster;
        loop {
            if self.tracked.contains_key(at) {
                return Some(at);
            }
            at = &at[..at.rfind('/')?];
        }
    }

    /// Adds one report of stream `stream`, received at `now`.
    pub fn record(&mut self, stream: u64, stats: &[ClusterStats], now: SystemTime) -> Recorded {
        let second = unix_second(now);
        let mut recorded = Recorded::default();
        let mut in_progress: BTreeMap<String, u64> = BTreeMap::new();
        let mut added: BTreeMap<String, LoadCounts> = BTreeMap::new();
        for cluster in stats {
            let Some(owner) = self.owner(&cluster.cluster_name) else {
                recorded.untracked += 1;
                continue;
            };
            recorded.tracked += 1;
            let counts = added.entry(owner.to_string()).or_default();
            let running = in_progress.entry(owner.to_string()).or_default();
            for locality in &cluster.upstream_locality_stats {
                counts.succeeded = counts
                    .succeeded
                    .saturating_add(locality.total_successful_requests);
                counts.failed = counts.failed.saturating_add(locality.total_error_requests);
                counts.issued = counts.issued.saturating_add(locality.total_issued_requests);
                *running = running.saturating_add(locality.total_requests_in_progress);
            }
        }
        for (owner, counts) in added {
            let Some(t) = self.tracked.get_mut(&owner) else {
                continue;
            };
            t.set_in_progress(stream, Some(in_progress[&owner]));
            let mut counts = counts;
            counts.in_progress_peak = t.in_progress_sum;
            match t.buckets.back_mut() {
                // (A clock that went back adds to the newest bucket.)
                Some((s, bucket)) if *s >= second => {
                    let peak = bucket.in_progress_peak.max(counts.in_progress_peak);
                    counts.in_progress_peak = 0;
                    bucket.add(&counts);
                    bucket.in_progress_peak = peak;
                }
                _ => t.buckets.push_back((second, counts)),
            }
            let oldest = second.saturating_sub(MAX_WINDOW.as_secs());
            while t.buckets.front().is_some_and(|(s, _)| *s < oldest) {
                t.buckets.pop_front();
            }
        }
        recorded
    }

    /// Stream `stream` ended: its requests in progress no longer count.
    pub fn end_stream(&mut self, stream: u64) {
        for t in self.tracked.values_mut() {
            t.set_in_progress(stream, None);
        }
    }

    /// Each tracked name's totals over the `window` (at most [`MAX_WINDOW`]) up to `now`;
    /// names with no report in it are left out.
    pub fn totals(&self, window: Duration, now: SystemTime) -> BTreeMap<String, LoadCounts> {
        let from = unix_second(now).saturating_sub(window.min(MAX_WINDOW).as_secs());
        self.tracked
            .iter()
            .filter_map(|(name, t)| {
                let mut total = LoadCounts::default();
                let mut any = false;
                let since = from.max(t.since);
                for (_, bucket) in t.buckets.iter().filter(|(s, _)| *s >= since) {
                    any = true;
                    let peak = total.in_progress_peak.max(bucket.in_progress_peak);
                    total.add(bucket);
                    total.in_progress_peak = peak;
                }
                any.then(|| (name.clone(), total))
            })
            .collect()
    }
}

fn unix_second(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// A ledger shared by every LRS stream and its readers, and the interval Envoys are told
/// to report at.
pub struct LoadReports {
    ledger: Mutex<LoadLedger>,
    interval: Duration,
    next_stream: AtomicU64,
}

impl LoadReports {
    pub fn new(interval: Duration) -> Arc<LoadReports> {
        Arc::new(LoadReports {
            ledger: Mutex::new(LoadLedger::default()),
            interval,
            next_stream: AtomicU64::new(1),
        })
    }

    /// How often Envoys are asked to report.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Tracks exactly `names`, each from its time on ([`LoadLedger::track`]).
    pub fn track(&self, names: &BTreeMap<String, SystemTime>) {
        self.lock().track(names);
    }

    /// Each tracked name's totals over `window` up to `now` ([`LoadLedger::totals`]).
    pub fn totals(&self, window: Duration, now: SystemTime) -> BTreeMap<String, LoadCounts> {
        self.lock().totals(window, now)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LoadLedger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The tower service of the LRS (`tonic::transport::Server::add_service`).
#[derive(Clone)]
pub struct LrsService {
    reports: Arc<LoadReports>,
    clients: Arc<Clients>,
    observer: Arc<dyn Observer>,
    shutdown: CancellationToken,
    max_message_bytes: usize,
    partial: PartialRequests,
    streams: Arc<tokio::sync::Semaphore>,
    per_peer: Arc<Mutex<BTreeMap<Option<std::net::IpAddr>, usize>>>,
}

impl LrsService {
    /// The service recording into `reports`, taking from each node only what its ADS
    /// streams in `clients` take.
    pub fn new(
        reports: Arc<LoadReports>,
        clients: Arc<Clients>,
        observer: Arc<dyn Observer>,
        max_message_bytes: usize,
        shutdown: CancellationToken,
    ) -> LrsService {
        LrsService {
            reports,
            clients,
            observer,
            shutdown,
            max_message_bytes,
            partial: PartialRequests::new(max_message_bytes),
            streams: Arc::new(tokio::sync::Semaphore::new(MAX_STREAMS)),
            per_peer: Arc::default(),
        }
    }

    /// A place for one more stream of `peer`, or `None` when it holds its most.
    fn take_peer_place(&self, peer: Option<std::net::IpAddr>) -> Option<PeerPlace> {
        let mut places = self.per_peer.lock().unwrap_or_else(|e| e.into_inner());
        let held = places.entry(peer).or_default();
        if *held >= MAX_STREAMS_PER_PEER {
            return None;
        }
        *held += 1;
        Some(PeerPlace {
            places: self.per_peer.clone(),
            peer,
        })
    }

    /// Requests still arriving share `partial` with the ADS streams (see `codec`).
    pub fn with_partial_requests(mut self, partial: PartialRequests) -> LrsService {
        self.partial = partial;
        self
    }

    async fn run_stream(
        self,
        mut inbound: RequestStream<LoadStatsRequest>,
        tx: mpsc::Sender<Result<Bytes, Status>>,
    ) {
        let id = self.reports.next_stream.fetch_add(1, Ordering::Relaxed);
        let _guard = StreamEnd {
            reports: self.reports.clone(),
            observer: self.observer.clone(),
            id,
        };
        self.observer.load_stream(true);
        let mut node = None;
        let mut held = NodeStreams::default();
        let silent = self.reports.interval * SILENT_INTERVALS;
        loop {
            let message = tokio::select! {
                _ = self.shutdown.cancelled() => return,
                message = tokio::time::timeout(silent, inbound.message()) => match message {
                    Ok(message) => message,
                    Err(_) => {
                        self.observer.load_report_refused("silent");
                        let _ = tx.send(Err(Status::deadline_exceeded(
                            "no load report within five report intervals",
                        ))).await;
                        return;
                    }
                },
            };
            let request = match message {
                Ok(Some(request)) => request,
                Ok(None) => return,
                Err(status) => {
                    if !matches!(
                        status.code(),
                        tonic::Code::Cancelled | tonic::Code::Unavailable | tonic::Code::Unknown
                    ) {
                        tracing::warn!(stream = id, code = ?status.code(), message = status.message(), "bad load report; closing the stream");
                        self.observer.load_report_refused("bad_message");
                        let _ = tx.send(Err(status)).await;
                    }
                    return;
                }
            };
            if node.is_none() {
                let Some(id_of_node) = request
                    .node
                    .as_ref()
                    .map(|n| n.id.clone())
                    .filter(|id| !id.is_empty())
                else {
                    self.observer.load_report_refused("no_node");
                    let _ = tx
                        .send(Err(Status::invalid_argument(
                            "the first load report must name its node (node.id)",
                        )))
                        .await;
                    return;
                };
                tracing::debug!(stream = id, node = %id_of_node, "load reporting stream opened");
                node = Some(id_of_node);
                let response = LoadStatsResponse {
                    clusters: Vec::new(),
                    send_all_clusters: true,
                    load_reporting_interval: Some(envoy_types::pb::google::protobuf::Duration {
                        seconds: self.reports.interval.as_secs() as i64,
                        nanos: self.reports.interval.subsec_nanos() as i32,
                    }),
                    report_endpoint_granularity: false,
                };
                if tx.send(Ok(frame(&response))).await.is_err() {
                    return;
                }
            }
            if request.cluster_stats.is_empty() {
                continue;
            }
            let node_id = node.as_deref().unwrap_or_default();
            let (taken, not_held) = held.split(&self.clients, node_id, request.cluster_stats);
            let mut recorded = self.reports.lock().record(id, &taken, SystemTime::now());
            recorded.not_held = not_held;
            self.observer.load_report(&recorded);
        }
    }
}

/// The ADS streams of one LRS stream's node, looked up again at most every
/// [`NODE_LOOKUP_EVERY`] while it has none or one ended (an Envoy may open LRS before
/// ADS, and reconnect either).
#[derive(Default)]
struct NodeStreams {
    streams: Vec<SharedStream>,
    looked: Option<std::time::Instant>,
}

impl NodeStreams {
    /// `stats` split into the entries some ADS stream of `node` takes, and how many no
    /// stream of it does.
    fn split(
        &mut self,
        clients: &Clients,
        node: &str,
        stats: Vec<ClusterStats>,
    ) -> (Vec<ClusterStats>, usize) {
        // Looked up again only while it has none, or one ended (the registry and the
        // stream's task let theirs go): a steady Envoy costs no lookup.
        let ended = self.streams.iter().any(|s| Arc::strong_count(s) == 1);
        let due = self
            .looked
            .is_none_or(|at| at.elapsed() >= NODE_LOOKUP_EVERY);
        if (self.streams.is_empty() || ended) && due {
            self.streams = clients.streams_of_node(node);
            self.looked = Some(std::time::Instant::now());
        }
        let total = stats.len();
        let taken: Vec<ClusterStats> = stats
            .into_iter()
            .filter(|c| self.streams.iter().any(|s| takes(s, &c.cluster_name)))
            .collect();
        let not_held = total - taken.len();
        (taken, not_held)
    }
}

/// One stream's place among its peer address's ([`MAX_STREAMS_PER_PEER`]), given back
/// when dropped.
struct PeerPlace {
    places: Arc<Mutex<BTreeMap<Option<std::net::IpAddr>, usize>>>,
    peer: Option<std::net::IpAddr>,
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut places = self.places.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = places.get_mut(&self.peer) {
            *held -= 1;
            if *held == 0 {
                places.remove(&self.peer);
            }
        }
    }
}

/// Forgets a stream's in-progress counts however its task ends.
struct StreamEnd {
    reports: Arc<LoadReports>,
    observer: Arc<dyn Observer>,
    id: u64,
}

impl Drop for StreamEnd {
    fn drop(&mut self) {
        self.reports.lock().end_stream(self.id);
        self.observer.load_stream(false);
    }
}

impl NamedService for LrsService {
    const NAME: &'static str = "envoy.service.load_stats.v3.LoadReportingService";
}

impl tower::Service<http::Request<tonic::body::Body>> for LrsService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let (tx, rx) = mpsc::channel(2);
        // The connection counts the stream while its response lives.
        let (open, peer) = super::listener::XdsConnectInfo::of(&request);
        if request.uri().path() != STREAM_PATH {
            let _ = tx.try_send(Err(Status::unimplemented(format!(
                "no method {}",
                request.uri().path()
            ))));
        } else if let (Ok(permit), Some(place)) = (
            self.streams.clone().try_acquire_owned(),
            self.take_peer_place(peer),
        ) {
            let inbound = RequestStream::new(
                request.into_body(),
                self.max_message_bytes,
                self.partial.share(peer),
            );
            let this = self.clone();
            tokio::spawn(async move {
                this.run_stream(inbound, tx).await;
                drop((permit, place));
            });
        } else {
            self.observer.load_report_refused("over_stream_limit");
            let _ = tx.try_send(Err(Status::resource_exhausted(
                "no more load reporting streams at once from here; retry later",
            )));
        }
        std::future::ready(Ok(super::grpc::grpc_response(rx, open)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::endpoint::v3::UpstreamLocalityStats;

    fn stats(cluster: &str, ok: u64, failed: u64, in_progress: u64) -> ClusterStats {
        ClusterStats {
            cluster_name: cluster.into(),
            upstream_locality_stats: vec![
                UpstreamLocalityStats {
                    total_successful_requests: ok,
                    total_error_requests: failed,
                    total_issued_requests: ok.saturating_add(failed),
                    total_requests_in_progress: in_progress,
                    ..Default::default()
                },
                UpstreamLocalityStats::default(),
            ],
            ..Default::default()
        }
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + secs)
    }

    fn names(n: &[&str]) -> BTreeMap<String, SystemTime> {
        n.iter()
            .map(|s| (s.to_string(), SystemTime::UNIX_EPOCH))
            .collect()
    }

    #[test]
    fn reports_of_every_stream_sum_under_the_tracked_name_they_are_below() {
        let mut ledger = LoadLedger::default();
        ledger.track(&names(&["ns/s/b", "ns/s/a"]));
        let r = ledger.record(
            1,
            &[
                stats("ns/s/b", 8, 2, 3),
                stats("ns/s/b/grpc", 1, 0, 1),
                stats("ns/s/b/app/x", 0, 1, 0),
                stats("ns/s/bb", 100, 100, 0),
                stats("other", 5, 5, 0),
            ],
            at(0),
        );
        assert_eq!(
            r,
            Recorded {
                tracked: 3,
                untracked: 2,
                not_held: 0
            }
        );
        ledger.record(2, &[stats("ns/s/b", 10, 0, 2)], at(1));
        let totals = ledger.totals(Duration::from_secs(30), at(1));
        assert_eq!(
            totals["ns/s/b"],
            LoadCounts {
                succeeded: 19,
                failed: 3,
                issued: 22,
                // Stream 1 had 4 in progress, then stream 2 reported 2 beside them.
                in_progress_peak: 6,
            }
        );
        assert!(
            !totals.contains_key("ns/s/a"),
            "no report, no entry: {totals:?}"
        );
        // Stream 1 ends: its requests in progress no longer count.
        ledger.end_stream(1);
        ledger.record(2, &[stats("ns/s/b", 0, 0, 2)], at(50));
        assert_eq!(
            ledger.totals(Duration::from_secs(5), at(50))["ns/s/b"].in_progress_peak,
            2
        );
    }

    #[test]
    fn totals_cover_the_window_and_nothing_older_is_kept() {
        let mut ledger = LoadLedger::default();
        ledger.track(&names(&["c"]));
        for s in 0..200 {
            ledger.record(1, &[stats("c", 1, 0, 0)], at(s));
        }
        let t = |w| ledger.totals(Duration::from_secs(w), at(199))["c"].succeeded;
        assert_eq!(t(9), 10);
        assert_eq!(t(30), 31);
        assert_eq!(
            t(10_000),
            MAX_WINDOW.as_secs() + 1,
            "at most the longest window"
        );
        assert!(ledger.tracked["c"].buckets.len() as u64 <= MAX_WINDOW.as_secs() + 1);
        // Nothing in the window: no entry.
        assert!(ledger.totals(Duration::from_secs(5), at(400)).is_empty());
    }

    #[test]
    fn untracking_forgets_and_the_number_of_names_is_capped() {
        let mut ledger = LoadLedger::default();
        ledger.track(&names(&["a", "b"]));
        ledger.record(1, &[stats("a", 1, 0, 0), stats("b", 1, 0, 0)], at(0));
        ledger.track(&names(&["b"]));
        let totals = ledger.totals(Duration::from_secs(10), at(0));
        assert_eq!(totals.keys().collect::<Vec<_>>(), ["b"]);
        let many: Vec<String> = (0..MAX_TRACKED + 10).map(|i| format!("n{i:05}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        ledger.track(&names(&many));
        assert_eq!(ledger.tracked.len(), MAX_TRACKED);
    }

    #[test]
    fn a_name_tracked_from_a_later_time_forgets_what_came_before() {
        let mut ledger = LoadLedger::default();
        ledger.track(&names(&["c"]));
        ledger.record(1, &[stats("c", 0, 10, 0)], at(10));
        ledger.record(1, &[stats("c", 5, 0, 0)], at(20));
        // A new version deployed at 15: only the report of 20 counts, now and after.
        ledger.track(&BTreeMap::from([("c".to_string(), at(15))]));
        let t = ledger.totals(Duration::from_secs(30), at(20))["c"];
        assert_eq!((t.succeeded, t.failed), (5, 0));
        ledger.record(1, &[stats("c", 1, 0, 0)], at(14));
        let t = ledger.totals(Duration::from_secs(30), at(20))["c"];
        assert_eq!(
            (t.succeeded, t.failed),
            (6, 0),
            "a late clock adds to the newest"
        );
    }

    #[test]
    fn garbage_numbers_saturate_and_a_clock_that_went_back_adds_to_the_newest_second() {
        let mut ledger = LoadLedger::default();
        ledger.track(&names(&["c"]));
        ledger.record(1, &[stats("c", u64::MAX, 0, u64::MAX)], at(10));
        ledger.record(2, &[stats("c", u64::MAX, 1, u64::MAX)], at(5));
        let t = ledger.totals(Duration::from_secs(30), at(10))["c"];
        assert_eq!(t.succeeded, u64::MAX);
        assert_eq!(t.failed, 1);
        assert_eq!(t.in_progress_peak, u64::MAX);
        assert_eq!(ledger.tracked["c"].buckets.len(), 1);
    }
}

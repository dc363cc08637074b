//! What the other ray-xds replicas say of their switchovers, read from their admin ports
//! (`GET /replica/switchover`), so that replicas fed the same state give the same weights
//! and a restarted replica resumes a shift where the others are.
//!
//! Each replica decides on its own, from its own probes, dashboards and Envoys; what it
//! takes from a peer are facts about a switch both see: when the shift from one cluster
//! to another started (a progressive schedule runs from the earliest start any replica
//! saw), that a peer has completed a move (its serving cluster is our target), the share
//! an operator's hold keeps, a rollback decision, and the clusters it drains.
//! Neither opens a gate: a target this replica does not find ready, or its own Envoys have
//! not warmed, gets no traffic, whatever a peer says. So a peer that lies can at most
//! hurry a shift that this replica already finds safe.
//!
//! The poller is the single writer of [`PeerStates`]; an unreachable peer, a slow one or
//! garbage from one is logged (once per change) and left out, never fatal. Replicas'
//! clocks are compared (unix times): the deployment's nodes run NTP.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The admin path a replica answers its switchover view on.
pub(crate) const SWITCHOVER_PATH: &str = "/replica/switchover";

/// The largest answer read from a peer (one entry per RayService, and a few departed
/// clusters).
pub(crate) const MAX_ANSWER_BYTES: usize = 1024 * 1024;

/// The most addresses asked for one peer name (a headless Service gives one per replica).
pub(crate) const MAX_ADDRESSES_PER_PEER: usize = 16;

/// One RayService's switch as a replica sees it: the wire format of
/// [`SWITCHOVER_PATH`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerSwitch {
    /// The cluster traffic belongs to.
    pub serving: String,
    /// The cluster traffic is moving (or waiting to move) to.
    #[serde(default)]
    pub target: Option<String>,
    /// When that replica first saw `target` named (unix seconds).
    #[serde(default)]
    pub target_since_unix: Option<f64>,
    /// When traffic started to move from `serving` to `target` (unix seconds).
    #[serde(default)]
    pub shift_started_unix: Option<f64>,
    /// When `serving` became the cluster traffic belongs to (unix seconds).
    #[serde(default)]
    pub serving_since_unix: Option<f64>,
    /// Traffic moved to `serving` at that replica (a switch it made, not where it
    /// started): only such a `serving` is a move done.
    #[serde(default)]
    pub moved: bool,
    /// Where that move came from: the cluster a completed early flip may go back to
    /// while the source lists it (`pipeline::switchover`'s judged pair).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_from: Option<String>,
    /// That replica's decision to send nothing to the pending cluster, whose requests
    /// fail (`pipeline::outcomes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback: Option<Rollback>,
    /// The share an operator's hold keeps on `target` there (percent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_at: Option<u32>,
}

impl PeerSwitch {
    /// The same, its times moved by `offset` seconds (from the peer's clock to ours).
    fn shifted(mut self, offset: f64) -> PeerSwitch {
        for t in [
            &mut self.target_since_unix,
            &mut self.shift_started_unix,
            &mut self.serving_since_unix,
        ] {
            *t = t.map(|t| t + offset);
        }
        self
    }
}

/// A decision to send no traffic to a pending cluster whose requests fail.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollback {
    /// The pending cluster.
    pub cluster: String,
    /// Its version when decided: each application's last deploy time, as its dashboard
    /// said (`None`: unknown, and then any version it turns out to have is the same).
    #[serde(default)]
    pub version: Option<String>,
    /// The figures that decided.
    pub why: String,
    /// When (unix seconds).
    pub at_unix: u64,
}

/// Load reports by a RayCluster's Envoy cluster name (its gRPC and application clusters
/// counted in it): what a replica's own Envoys reported over the outcome window.
pub type LoadTotals = BTreeMap<String, crate::xds::lrs::LoadCounts>;

/// What one replica's Envoys reported of one cluster, and from when it counted them (unix
/// seconds: a new version of the cluster counts from its deploy time), so that a reader
/// sums only reports counted from the same time as its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedLoad {
    pub since_unix: u64,
    pub counts: crate::xds::lrs::LoadCounts,
}

/// A replica's answer: RayService key → its switch, and the clusters it keeps draining.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReplicaView {
    pub services: BTreeMap<String, PeerSwitch>,
    #[serde(default)]
    pub departed: Vec<DepartedCluster>,
    /// The replica's clock when it answered (unix seconds): the reader moves the view's
    /// times to its own clock.
    #[serde(default)]
    pub now_unix: Option<f64>,
    /// Which replica answered (random per start): a reader finds itself among the
    /// addresses of its peers' name, and one peer under several addresses.
    #[serde(default)]
    pub replica: Option<String>,
    /// What that replica's own Envoys reported over the outcome window, per RayCluster
    /// under a switch: summed over the replicas, it is what every Envoy reported.
    #[serde(default)]
    pub loads: BTreeMap<String, SharedLoad>,
}

impl ReplicaView {
    /// The view with its times on the reader's clock, given when it was read there.
    pub(crate) fn on_our_clock(mut self, read_at: SystemTime) -> ReplicaView {
        let Some(theirs) = self.now_unix.filter(|t| t.is_finite()) else {
            return self;
        };
        let offset = to_unix(read_at) - theirs;
        // Within the read's own time (1 s at most), clocks agree: move nothing.
        if offset.abs() <= 1.0 {
            return self;
        }
        self.services = self
            .services
            .into_iter()
            .map(|(k, v)| (k, v.shifted(offset)))
            .collect();
        for d in &mut self.departed {
            d.until_unix += offset;
        }
        self.now_unix = Some(theirs + offset);
        self
    }
}

/// A cluster the source dropped that a replica keeps, draining, until `until_unix`: a
/// replica restarted meanwhile keeps it too, so its Envoys keep the cluster for the
/// requests in flight on it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DepartedCluster {
    /// The RayService key (`namespace/name`).
    pub service: String,
    pub cluster: String,
    pub until_unix: f64,
    pub proxies: Vec<DepartedProxy>,
}

/// One proxy of a departed cluster: its endpoints (only drained, never sent new work).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DepartedProxy {
    pub address: std::net::SocketAddr,
    #[serde(default)]
    pub grpc: Option<std::net::SocketAddr>,
    #[serde(default)]
    pub head: bool,
}

/// What every peer said last, by RayService.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerStates {
    /// RayService key → each answering peer's view of it.
    pub services: BTreeMap<String, Vec<PeerSwitch>>,
    /// Clusters peers keep draining.
    pub departed: Vec<DepartedCluster>,
    /// A first round of asking every peer has ended (answered or not).
    pub polled: bool,
    /// What the other replicas' Envoys reported, per cluster (each replica once, this
    /// one never).
    pub loads: BTreeMap<String, Vec<SharedLoad>>,
}

impl PeerStates {
    /// The earliest time a peer started shifting `service` from `serving` to `target`.
    pub(crate) fn shift_started(
        &self,
        service: &str,
        serving: &str,
        target: &str,
    ) -> Option<SystemTime> {
        self.of(service)
            .filter(|p| p.serving == serving && p.target.as_deref() == Some(target))
            .filter_map(|p| p.shift_started_unix)
            .reduce(f64::min)
            .and_then(from_unix)
    }

    /// Whether a peer has moved `service` to `target` already (a move it made, nothing
    /// after).
    pub(crate) fn completed(&self, service: &str, target: &str) -> bool {
        self.of(service)
            .any(|p| p.moved && p.serving == target && p.target.is_none())
    }

    /// Where a peer's move of `service` to `serving` came from (a move it made).
    pub(crate) fn moved_from(&self, service: &str, serving: &str) -> Option<String> {
        self.of(service)
            .filter(|p| p.moved && p.serving == serving)
            .find_map(|p| p.moved_from.clone())
    }

    /// The clusters peers serve `service` from.
    pub(crate) fn serving(&self, service: &str) -> Vec<String> {
        let mut clusters: Vec<String> = self.of(service).map(|p| p.serving.clone()).collect();
        clusters.sort();
        clusters.dedup();
        clusters
    }

    /// The earliest time a peer saw the switch to `target` begin: when it named it its
    /// target, or, once it moved, when it did (after it had found it ready itself).
    pub(crate) fn target_since(&self, service: &str, target: &str) -> Option<SystemTime> {
        self.of(service)
            .filter_map(|p| {
                if p.target.as_deref() == Some(target) {
                    p.target_since_unix
                } else if p.moved && p.serving == target && p.target.is_none() {
                    p.serving_since_unix
                } else {
                    None
                }
            })
            .reduce(f64::min)
            .and_then(from_unix)
    }

    /// A peer's decision to send nothing to `cluster`, the pending cluster of `service`.
    /// The largest share a peer's operator hold keeps on `target` while `serving`
    /// serves (at most 100).
    pub(crate) fn held_at(&self, service: &str, serving: &str, target: &str) -> Option<u32> {
        self.of(service)
            .filter(|p| p.serving == serving && p.target.as_deref() == Some(target))
            .filter_map(|p| p.held_at)
            .max()
            .map(|h| h.min(100))
    }

    pub(crate) fn rollback(&self, service: &str, cluster: &str) -> Option<&Rollback> {
        self.of(service)
            .filter_map(|p| p.rollback.as_ref())
            .find(|r| r.cluster == cluster)
    }

    fn of(&self, service: &str) -> impl Iterator<Item = &PeerSwitch> {
        self.services.get(service).into_iter().flatten()
    }
}

pub fn to_unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// A unix time as `SystemTime`; `None` for what no clock says (negative, not finite,
/// past the year 2^34).
pub(crate) fn from_unix(t: f64) -> Option<SystemTime> {
    (t.is_finite() && (0.0..17_179_869_184.0).contains(&t))
        .then(|| SystemTime::UNIX_EPOCH + Duration::from_secs_f64(t))
}

/// Asks every peer every `interval` (each answer within `timeout`).
#[derive(Clone)]
pub(crate) struct PeerPoller {
    /// `host:port` of the peers' admin ports; a name is resolved at each round and every
    /// address it has is asked (a headless Service's name gives every replica).
    pub peers: Vec<String>,
    pub interval: Duration,
    pub timeout: Duration,
    /// This replica's id ([`ReplicaView::replica`]): its own answer adds no loads.
    pub own_id: String,
    /// What the replicas kept (`live::state_store`), read at start: each view taken as
    /// one more peer's until it stops counting.
    pub remembered: Vec<(SystemTime, ReplicaView)>,
}

impl PeerStates {
    /// What the views `answered` (each a peer's) say together; a replica's loads are
    /// counted once, and never this replica's (`own_id`).
    pub(crate) fn merge(answered: Vec<ReplicaView>, own_id: &str) -> PeerStates {
        let mut next = PeerStates {
            polled: true,
            ..Default::default()
        };
        let mut counted = std::collections::BTreeSet::new();
        for view in answered {
            let new_replica = match &view.replica {
                Some(id) => *id != own_id && counted.insert(id.clone()),
                None => true,
            };
            if new_replica {
                for (cluster, load) in &view.loads {
                    next.loads.entry(cluster.clone()).or_default().push(*load);
                }
            }
            for (service, switch) in view.services {
                next.services.entry(service).or_default().push(switch);
            }
            next.departed.extend(view.departed);
        }
        next
    }
}

impl PeerPoller {
    pub async fn run(self, states: watch::Sender<Arc<PeerStates>>, shutdown: CancellationToken) {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(self.timeout));
        let client: Client<HttpConnector, Empty<Bytes>> =
            Client::builder(TokioExecutor::new()).build(connector);
        let mut failing: BTreeMap<String, String> = BTreeMap::new();
        let mut remembered = self.remembered.clone();
        loop {
            let round = self.round(&client, &mut failing);
            let mut answered = tokio::select! {
                _ = shutdown.cancelled() => return,
                answered = round => answered,
            };
            // A kept view counts until its ttl passes, or until its replica answers
            // itself (from then on its own answers, and the entries it writes, are
            // fresher than what was read at start).
            let now = SystemTime::now();
            let live: Vec<Option<String>> = answered.iter().map(|v| v.replica.clone()).collect();
            remembered.retain(|(until, v)| {
                *until > now && (v.replica.is_none() || !live.contains(&v.replica))
            });
            answered.extend(remembered.iter().map(|(_, v)| v.clone()));
            let next = PeerStates::merge(answered, &self.own_id);
            states.send_if_modified(|current| {
                if **current == next {
                    return false;
                }
                *current = Arc::new(next);
                true
            });
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }

    /// One round: every address of every peer, at once; the views that came back.
    async fn round(
        &self,
        client: &Client<HttpConnector, Empty<Bytes>>,
        failing: &mut BTreeMap<String, String>,
    ) -> Vec<ReplicaView> {
        let mut asks = Vec::new();
        for peer in &self.peers {
            let addresses =
                match tokio::time::timeout(self.timeout, tokio::net::lookup_host(peer)).await {
                    Ok(Ok(addresses)) => addresses.take(MAX_ADDRESSES_PER_PEER).collect::<Vec<_>>(),
                    Ok(Err(e)) => {
                        note(failing, peer, format!("resolving it: {e}"));
                        continue;
                    }
                    Err(_) => {
                        note(failing, peer, "resolving it timed out".into());
                        continue;
                    }
                };
            for address in addresses {
                let (client, timeout, peer) = (client.clone(), self.timeout, peer.clone());
                asks.push(async move {
                    let answer = tokio::time::timeout(timeout, ask(&client, address)).await;
                    let answer = answer.unwrap_or_else(|_| Err("no answer in time".into()));
                    (format!("{peer} ({address})"), answer)
                });
            }
        }
        let mut views = Vec::new();
        for (who, answer) in futures::future::join_all(asks).await {
            match answer {
                Ok(view) => {
                    if failing.remove(&who).is_some() {
                        tracing::info!(peer = who, "replica peer answers again");
                    }
                    views.push(view);
                }
                Err(e) => note(failing, &who, e),
            }
        }
        views
    }
}

/// Logs a peer's failure once while it lasts.
fn note(failing: &mut BTreeMap<String, String>, peer: &str, error: String) {
    if failing.get(peer) != Some(&error) {
        tracing::warn!(peer, %error, "replica peer did not answer; its view is left out until it does");
        failing.insert(peer.to_string(), error);
    }
}

async fn ask(
    client: &Client<HttpConnector, Empty<Bytes>>,
    address: std::net::SocketAddr,
) -> Result<ReplicaView, String> {
    let uri: hyper::Uri = format!("http://{address}{SWITCHOVER_PATH}")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let response = client.get(uri).await.map_err(|e| format!("asking: {e}"))?;
    if response.status() != hyper::StatusCode::OK {
        return Err(format!("answered HTTP {}", response.status().as_u16()));
    }
    let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading the answer (at most {MAX_ANSWER_BYTES} bytes): {e}"))?
        .to_bytes();
    let view: ReplicaView =
        serde_json::from_slice(&body).map_err(|e| format!("not a replica's answer: {e}"))?;
    Ok(view.on_our_clock(SystemTime::now()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn switch(serving: &str, target: Option<&str>, started: Option<f64>) -> PeerSwitch {
        PeerSwitch {
            serving: serving.into(),
            target: target.map(str::to_string),
            target_since_unix: started.map(|s| s - 5.0),
            shift_started_unix: started,
            serving_since_unix: Some(1.0),
            moved: target.is_none(),
            moved_from: None,
            rollback: None,
            held_at: None,
        }
    }

    #[test]
    fn the_earliest_start_of_the_same_shift_counts_and_nothing_else() {
        let states = PeerStates {
            services: BTreeMap::from([(
                "ns/s".to_string(),
                vec![
                    switch("a", Some("b"), Some(200.0)),
                    switch("a", Some("b"), Some(100.0)),
                    // Another shift of the same RayService, and garbage times: ignored.
                    switch("b", Some("a"), Some(50.0)),
                    switch("a", Some("c"), Some(10.0)),
                    switch("a", Some("b"), Some(f64::NAN)),
                ],
            )]),
            polled: true,
            ..Default::default()
        };
        assert_eq!(
            states.shift_started("ns/s", "a", "b").map(to_unix),
            Some(100.0)
        );
        assert_eq!(states.shift_started("ns/other", "a", "b"), None);
        assert_eq!(states.target_since("ns/s", "b").map(to_unix), Some(95.0));
        assert!(!states.completed("ns/s", "b"));
        let done = PeerStates {
            services: BTreeMap::from([("ns/s".to_string(), vec![switch("b", None, None)])]),
            polled: true,
            ..Default::default()
        };
        assert!(done.completed("ns/s", "b"));
        assert_eq!(done.target_since("ns/s", "b").map(to_unix), Some(1.0));
        assert!(!done.completed("ns/s", "a"));
    }

    #[test]
    fn unix_times_that_no_clock_gives_are_none() {
        for t in [f64::NAN, f64::INFINITY, -1.0, 1e300] {
            assert_eq!(from_unix(t), None, "{t}");
        }
        assert_eq!(from_unix(1.5).map(to_unix), Some(1.5));
    }

    #[test]
    fn a_view_is_moved_to_the_reader_s_clock() {
        let view = ReplicaView {
            services: BTreeMap::from([("ns/s".to_string(), switch("a", Some("b"), Some(100.0)))]),
            departed: vec![],
            now_unix: Some(1000.0),
            ..Default::default()
        };
        // Read at 1000 + 3 h: the peer's clock is 3 h behind.
        let read_at = from_unix(1000.0 + 10_800.0).unwrap();
        let ours = view.clone().on_our_clock(read_at);
        assert_eq!(
            ours.services["ns/s"].shift_started_unix,
            Some(100.0 + 10_800.0)
        );
        assert_eq!(
            ours.services["ns/s"].target_since_unix,
            Some(95.0 + 10_800.0)
        );
        // Within a second: as it is.
        assert_eq!(view.clone().on_our_clock(from_unix(1000.5).unwrap()), view);
    }
}

//! Every connected ADS stream, for `/debug/clients` and for whoever must know which
//! Envoys have warmed a cluster (ray-xds's switchover waits for all of them).
//!
//! Invariant: a stream is registered for exactly as long as its task runs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use envoy_types::pb::envoy::admin::v3::{ClientResourceStatus, UpdateFailureState};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::status::v3::client_config::GenericXdsConfig;
use envoy_types::pb::envoy::service::status::v3::{ClientConfig, ConfigStatus};
use serde::Serialize;

use super::{AdsProtocol, NodeInfo, ResourceType, Snapshot, TypeStatus};

pub(super) type SharedStream = Arc<Mutex<dyn ClientDescribe>>;

pub(super) trait ClientDescribe: Send {
    fn describe(&self) -> (Option<NodeInfo>, Vec<(ResourceType, TypeStatus)>);
    fn client_config(&self, snapshot: Option<&Snapshot>) -> (ClientConfig, bool);
    /// [`ClientReport::in_sync`], without building the report.
    fn in_sync(&self, snapshot: Option<&Snapshot>) -> bool;
    /// Per type it asked for, how many names it subscribes to (`None`: a wildcard).
    fn subscribed_counts(&self) -> BTreeMap<ResourceType, Option<usize>>;
    fn warmed(&self, cluster: &str) -> Option<bool>;
    fn rejected(&self, cluster: &str) -> bool;
    fn node_id(&self) -> Option<String>;
    /// Whether it holds a resource of `ty` named in `clean` at a version not given there
    /// (one it must move past).
    fn holds_other_than(
        &self,
        ty: ResourceType,
        clean: &BTreeMap<Arc<str>, BTreeSet<Arc<str>>>,
    ) -> bool;
}

impl<P: AdsProtocol> ClientDescribe for P {
    fn describe(&self) -> (Option<NodeInfo>, Vec<(ResourceType, TypeStatus)>) {
        (self.node().cloned(), self.status())
    }
    fn client_config(&self, snapshot: Option<&Snapshot>) -> (ClientConfig, bool) {
        client_config(self, snapshot, true)
    }
    fn in_sync(&self, snapshot: Option<&Snapshot>) -> bool {
        client_config(self, snapshot, false).1
    }
    fn subscribed_counts(&self) -> BTreeMap<ResourceType, Option<usize>> {
        ResourceType::ALL
            .into_iter()
            .filter_map(|ty| Some((ty, self.subscription(ty)?.map(|names| names.len()))))
            .collect()
    }
    fn warmed(&self, cluster: &str) -> Option<bool> {
        AdsProtocol::warmed(self, cluster)
    }
    fn rejected(&self, cluster: &str) -> bool {
        AdsProtocol::rejected(self, cluster)
    }
    fn node_id(&self) -> Option<String> {
        self.node().map(|n| n.id.clone())
    }
    fn holds_other_than(
        &self,
        ty: ResourceType,
        clean: &BTreeMap<Arc<str>, BTreeSet<Arc<str>>>,
    ) -> bool {
        clean.iter().any(|(name, clean)| {
            AdsProtocol::holds(self, ty, name).is_some_and(|held| !clean.contains(&held))
        })
    }
}

/// Every connected stream: for `/debug/clients`, and for the switchover, which waits
/// until every Envoy has warmed a cluster before sending it traffic.
#[derive(Default)]
pub struct Clients {
    next_id: AtomicU64,
    streams: Mutex<BTreeMap<u64, (&'static str, u64, SharedStream)>>,
    /// Signalled when any stream ACKs clusters or endpoints.
    warmed: tokio::sync::Notify,
}

impl Clients {
    /// The connected Envoys (node id and stream) that subscribe to `cluster` but have not
    /// ACKed it and its endpoints yet.
    pub fn not_warmed(&self, cluster: &str) -> Vec<String> {
        self.streams_where(|s| s.warmed(cluster) == Some(false))
    }

    /// The connected Envoys (node id and stream) that hold a resource of `ty` named in
    /// `clean` at a version not listed there (name → the versions that are fine to hold).
    pub fn holding_other_than(
        &self,
        ty: ResourceType,
        clean: &BTreeMap<Arc<str>, BTreeSet<Arc<str>>>,
    ) -> Vec<String> {
        self.streams_where(|s| s.holds_other_than(ty, clean))
    }

    /// The connected Envoys (node id and stream) that rejected `cluster` or its
    /// endpoints as the current snapshot has them.
    pub fn rejecting(&self, cluster: &str) -> Vec<String> {
        self.streams_where(|s| s.rejected(cluster))
    }

    /// The ADS streams of the connected Envoys whose node id is `node`.
    pub(crate) fn streams_of_node(&self, node: &str) -> Vec<SharedStream> {
        let streams: Vec<SharedStream> = lock(&self.streams)
            .values()
            .map(|(_, _, s)| s.clone())
            .collect();
        streams
            .into_iter()
            .filter(|s| lock(s).node_id().as_deref() == Some(node))
            .collect()
    }

    fn streams_where(&self, pick: impl Fn(&dyn ClientDescribe) -> bool) -> Vec<String> {
        let streams: Vec<_> = lock(&self.streams)
            .iter()
            .map(|(id, (_, _, s))| (*id, s.clone()))
            .collect();
        streams
            .into_iter()
            .filter_map(|(id, s)| {
                let s = lock(&s);
                pick(&*s).then(|| match s.node_id() {
                    Some(node) if !node.is_empty() => format!("{node} (stream {id})"),
                    _ => format!("stream {id}"),
                })
            })
            .collect()
    }
}

/// One connected Envoy in brief, as `/debug/clients` lists it: a few hundred bytes
/// whatever it subscribed to.
#[derive(Debug, Serialize)]
pub struct ClientSummary {
    pub stream_id: u64,
    pub protocol: &'static str,
    pub connected_at_unix: u64,
    pub node: Option<NodeInfo>,
    pub types: BTreeMap<&'static str, TypeSummary>,
    /// The Envoy holds every resource it subscribes to at the current snapshot's version.
    pub in_sync: bool,
}

/// [`TypeStatus`] with counts for its lists.
#[derive(Debug, Serialize)]
pub struct TypeSummary {
    /// Names subscribed to (`None`: a wildcard subscription).
    pub subscribed: Option<usize>,
    pub last_acked_version: Option<String>,
    pub last_nacked_version: Option<String>,
    /// The NACK's message, cut at [`NACK_MESSAGE_SHOWN`] bytes.
    pub last_nack_message: Option<String>,
    pub pushes: u64,
    pub acks: u64,
    pub nacks: u64,
    pub resources_held: usize,
    pub rejected: usize,
}

/// The most bytes of a NACK's message a summary shows (Envoy's can list every
/// resource it refused).
pub const NACK_MESSAGE_SHOWN: usize = 500;

impl TypeSummary {
    fn of(s: TypeStatus, subscribed: Option<usize>) -> TypeSummary {
        TypeSummary {
            subscribed,
            last_acked_version: s.last_acked_version,
            last_nacked_version: s.last_nacked_version,
            last_nack_message: s
                .last_nack_message
                .map(|m| crate::clip(&m, NACK_MESSAGE_SHOWN)),
            pushes: s.pushes,
            acks: s.acks,
            nacks: s.nacks,
            resources_held: s.resources_held,
            rejected: s.rejected.len(),
        }
    }
}

/// One connected Envoy whole, as `/debug/clients?stream=ID` shows it.
#[derive(Debug, Serialize)]
pub struct ClientReport {
    pub stream_id: u64,
    pub protocol: &'static str,
    pub connected_at_unix: u64,
    pub node: Option<NodeInfo>,
    pub types: BTreeMap<&'static str, TypeStatus>,
    /// The Envoy holds every resource it subscribes to at the current snapshot's version.
    pub in_sync: bool,
    /// Per resource, what the Envoy holds against what is current, as Envoy's Client
    /// Status Discovery Service (`envoy.service.status.v3.ClientConfig`) reports it, in
    /// proto JSON.
    pub client_config: serde_json::Value,
}

/// What one Envoy holds, resource by resource, against `snapshot` (the one being served),
/// and whether it is in sync; with `list` false, only whether it is in sync.
fn client_config<P: AdsProtocol + ?Sized>(
    p: &P,
    snapshot: Option<&Snapshot>,
    list: bool,
) -> (ClientConfig, bool) {
    let status: BTreeMap<ResourceType, TypeStatus> = p.status().into_iter().collect();
    let mut configs = Vec::new();
    let mut in_sync = true;
    for ty in ResourceType::ALL {
        let Some(subscription) = p.subscription(ty) else {
            continue;
        };
        let held: BTreeMap<Arc<str>, Arc<str>> = p.held(ty).into_iter().collect();
        let current = snapshot.map(|s| s.resources(ty));
        let nacked = status
            .get(&ty)
            .and_then(|s| {
                s.last_nacked_version
                    .as_ref()
                    .map(|_| s.last_nack_message.clone())
            })
            .flatten();
        let rejected: BTreeSet<&str> = status
            .get(&ty)
            .map(|s| s.rejected.iter().map(String::as_str).collect())
            .unwrap_or_default();
        let mut names: BTreeSet<Arc<str>> = held.keys().cloned().collect();
        match subscription {
            None => names.extend(current.into_iter().flat_map(|c| c.keys().cloned())),
            Some(list) => names.extend(list),
        }
        // (Every name counts for `in_sync`; at most `NAMES_SHOWN` per type are listed, so
        // that a client subscribed to thousands of names cannot make the view huge.)
        for (listed, name) in names.into_iter().enumerate() {
            let have = held.get(&name);
            let want = current.and_then(|c| c.get(&name)).map(|r| &r.version);
            let (client, config) = match (have, want) {
                (Some(h), Some(w)) if h == w => (ClientResourceStatus::Acked, ConfigStatus::Synced),
                (_, Some(_)) if rejected.contains(&*name) => {
                    (ClientResourceStatus::Nacked, ConfigStatus::Error)
                }
                // An older version: an update on its way, or held back until its clusters
                // are warm, or one the server keeps while a route still names it.
                (Some(_), _) => (ClientResourceStatus::Acked, ConfigStatus::Stale),
                (None, Some(_)) => (ClientResourceStatus::Requested, ConfigStatus::NotSent),
                (None, None) => (ClientResourceStatus::DoesNotExist, ConfigStatus::Synced),
            };
            // In sync: it holds every subscribed resource that exists, as it is now
            // (holding more, a cluster on its way out, is not holding less).
            in_sync &= want.is_none() || config == ConfigStatus::Synced;
            if !list || listed >= super::NAMES_SHOWN {
                continue;
            }
            configs.push(GenericXdsConfig {
                type_url: ty.type_url().into(),
                name: name.to_string(),
                version_info: have.map(|v| v.to_string()).unwrap_or_default(),
                config_status: config as i32,
                client_status: client as i32,
                error_state: (client == ClientResourceStatus::Nacked).then(|| UpdateFailureState {
                    details: nacked.clone().unwrap_or_default(),
                    version_info: want.map(|v| v.to_string()).unwrap_or_default(),
                    ..Default::default()
                }),
                ..Default::default()
            });
        }
    }
    let node = p.node().map(|n| Node {
        id: n.id.clone(),
        cluster: n.cluster.clone(),
        user_agent_name: n.user_agent.clone(),
        ..Default::default()
    });
    let config = ClientConfig {
        node,
        generic_xds_configs: configs,
        ..Default::default()
    };
    (config, in_sync)
}

impl Clients {
    /// Waits until some Envoy ACKs (or NACKs) clusters or endpoints, or a stream ends (or
    /// returns at once if one did since the last wait).
    pub async fn acked(&self) {
        self.warmed.notified().await
    }

    pub(super) fn notify_acked(&self) {
        self.warmed.notify_one();
    }

    /// The ids of the connected streams, oldest first: a page walks them one at a time, so
    /// it never holds every client's view at once.
    pub fn stream_ids(&self) -> Vec<u64> {
        lock(&self.streams).keys().copied().collect()
    }

    /// One stream in brief ([`ClientSummary`]), if it is still connected.
    pub fn summary(&self, stream_id: u64, snapshot: Option<&Snapshot>) -> Option<ClientSummary> {
        let (protocol, connected_at_unix, stream) = self.stream(stream_id)?;
        let s = lock(&stream);
        let (node, status) = s.describe();
        let in_sync = s.in_sync(snapshot);
        let counts = s.subscribed_counts();
        Some(ClientSummary {
            stream_id,
            protocol,
            connected_at_unix,
            node,
            types: status
                .into_iter()
                .map(|(t, s)| {
                    let subscribed = counts.get(&t).copied().flatten();
                    (t.label(), TypeSummary::of(s, subscribed))
                })
                .collect(),
            in_sync,
        })
    }

    /// One stream whole ([`ClientReport`]): what it subscribed to and, per resource, what
    /// it holds against `snapshot` (the one served now), if it is still connected.
    pub fn report(&self, stream_id: u64, snapshot: Option<&Snapshot>) -> Option<ClientReport> {
        let (protocol, connected_at_unix, stream) = self.stream(stream_id)?;
        let s = lock(&stream);
        let (node, status) = s.describe();
        let (config, in_sync) = s.client_config(snapshot);
        Some(ClientReport {
            stream_id,
            protocol,
            connected_at_unix,
            node,
            types: status.into_iter().map(|(t, s)| (t.label(), s)).collect(),
            in_sync,
            client_config: super::json::message_to_json(&config),
        })
    }

    /// The node id stream `stream_id` gave, if it is connected and gave one.
    pub fn node_id_of(&self, stream_id: u64) -> Option<String> {
        let (_, _, stream) = self.stream(stream_id)?;
        let id = lock(&stream).node_id();
        id
    }

    /// What stream `stream_id` holds as Envoy's Client Status Discovery Service reports
    /// it, if it is still connected.
    pub fn client_config_of(
        &self,
        stream_id: u64,
        snapshot: Option<&Snapshot>,
    ) -> Option<ClientConfig> {
        let (_, _, stream) = self.stream(stream_id)?;
        let config = lock(&stream).client_config(snapshot).0;
        Some(config)
    }

    /// The ids of the streams whose node id is `node`.
    pub fn streams_of(&self, node: &str) -> Vec<u64> {
        let streams: Vec<(u64, SharedStream)> = lock(&self.streams)
            .iter()
            .map(|(id, (_, _, s))| (*id, s.clone()))
            .collect();
        streams
            .into_iter()
            .filter(|(_, s)| lock(s).node_id().as_deref() == Some(node))
            .map(|(id, _)| id)
            .collect()
    }

    fn stream(&self, stream_id: u64) -> Option<(&'static str, u64, SharedStream)> {
        lock(&self.streams)
            .get(&stream_id)
            .map(|(p, t, s)| (*p, *t, s.clone()))
    }

    pub(super) fn register(&self, protocol: &'static str, stream: SharedStream) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, (protocol, now, stream));
        id
    }

    /// A stream ended: what it held back (a cold or rejected target) no longer does, so
    /// a waiting switchover looks again.
    pub(super) fn remove(&self, id: u64) {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        self.notify_acked();
    }
}

/// Whether `stream` holds `cluster`: it takes it and ACKed it and its endpoints (an
/// Envoy sends requests only to a cluster it holds).
pub(crate) fn takes(stream: &SharedStream, cluster: &str) -> bool {
    lock(stream).warmed(cluster) == Some(true)
}

pub(super) fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    /// What a client sends of itself is kept to a bound (at a character boundary), so a
    /// summary stays small whatever it sent.
    #[test]
    fn a_node_s_fields_are_kept_to_a_bound() {
        let long = "é".repeat(2000);
        let node = Node {
            id: long.clone(),
            cluster: format!("x{long}"),
            user_agent_name: long,
            ..Default::default()
        };
        let info = NodeInfo::from_node(&node);
        for field in [&info.id, &info.cluster, &info.user_agent] {
            // The kept part, and how long it was.
            assert!(
                field.len() <= crate::MAX_NODE_FIELD_BYTES + 48,
                "{}",
                field.len()
            );
            assert!(field.ends_with("bytes in all)"), "{field}");
        }
        assert_eq!(
            NodeInfo::from_node(&Node {
                id: "gw-1".into(),
                ..Default::default()
            })
            .id,
            "gw-1"
        );
    }

    use super::*;
    use crate::fixtures::{service, snapshot_of};
    use crate::sotw::SotwStream;
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;

    fn request(ty: ResourceType, names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: ty.type_url().into(),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            version_info: version.into(),
            response_nonce: nonce.into(),
            ..Default::default()
        }
    }

    fn statuses(config: &ClientConfig) -> Vec<(String, i32, i32)> {
        config
            .generic_xds_configs
            .iter()
            .map(|c| (c.name.clone(), c.client_status, c.config_status))
            .collect()
    }

    #[test]
    fn an_envoy_is_in_sync_only_once_it_holds_everything_it_subscribed_to() {
        let snap = snapshot_of(vec![service("a", "a1", &[8000])]);
        let mut s = SotwStream::new();
        s.on_request(request(ResourceType::Cluster, &[], "", ""))
            .unwrap();
        // The clusters go out; the Envoy asks for their endpoints (and one more name)
        // before it answers. (Asked before any cluster was sent, the names would say it
        // reconnected holding them.)
        let clusters = s.poll(&snap);
        assert_eq!(clusters.len(), 1);
        s.on_request(request(
            ResourceType::Endpoints,
            &["default/a/a1", "default/gone/x"],
            "",
            "",
        ))
        .unwrap();
        let (config, in_sync) = client_config(&s, Some(&snap), true);
        assert!(!in_sync, "nothing ACKed yet");
        // Whether it is in sync, without the list (the summary's way), agrees each time.
        assert_eq!(
            client_config(&s, Some(&snap), false),
            (Default::default(), false)
        );
        assert!(statuses(&config).contains(&(
            "default/a/a1".into(),
            ClientResourceStatus::Requested as i32,
            ConfigStatus::NotSent as i32
        )));
        assert!(
            statuses(&config).contains(&(
                "default/gone/x".into(),
                ClientResourceStatus::DoesNotExist as i32,
                ConfigStatus::Synced as i32
            )),
            "a name that does not exist is not a lag"
        );
        // Send and ACK both types.
        for (ty, _, r) in clusters.into_iter().chain(s.poll(&snap)) {
            let names: &[&str] = match ty {
                ResourceType::Endpoints => &["default/a/a1", "default/gone/x"],
                _ => &[],
            };
            s.on_request(request(ty, names, &r.version_info, &r.nonce))
                .unwrap();
        }
        let (config, in_sync) = client_config(&s, Some(&snap), true);
        assert!(in_sync, "{:?}", statuses(&config));
        assert!(client_config(&s, Some(&snap), false).1);
        // A new snapshot: what the Envoy holds is now stale.
        let next = snapshot_of(vec![service("a", "a1", &[8001])]);
        let (config, in_sync) = client_config(&s, Some(&next), true);
        assert!(!in_sync);
        assert!(!client_config(&s, Some(&next), false).1);
        assert!(statuses(&config).contains(&(
            "default/a/a1".into(),
            ClientResourceStatus::Acked as i32,
            ConfigStatus::Stale as i32
        )));
        let json = crate::json::message_to_json(&config);
        assert_eq!(json["generic_xds_configs"][0]["client_status"], "ACKED");
    }
}

//! Every connected ADS stream, for `/debug/clients` and for whoever must know which
//! Envoys have warmed a cluster (ray-xds's switchover waits for all of them).
//!
//! Invariant: a stream is registered for exactly as long as its task runs.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde::Serialize;

use super::{AdsProtocol, NodeInfo, ResourceType, TypeStatus};

pub(super) type SharedStream = Arc<Mutex<dyn ClientDescribe>>;

pub(super) trait ClientDescribe: Send {
    fn describe(&self) -> (Option<NodeInfo>, Vec<(ResourceType, TypeStatus)>);
    fn warmed(&self, cluster: &str) -> Option<bool>;
    fn node_id(&self) -> Option<String>;
}

impl<P: AdsProtocol> ClientDescribe for P {
    fn describe(&self) -> (Option<NodeInfo>, Vec<(ResourceType, TypeStatus)>) {
        (self.node().cloned(), self.status())
    }
    fn warmed(&self, cluster: &str) -> Option<bool> {
        AdsProtocol::warmed(self, cluster)
    }
    fn node_id(&self) -> Option<String> {
        self.node().map(|n| n.id.clone())
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
        let streams: Vec<_> = lock(&self.streams)
            .iter()
            .map(|(id, (_, _, s))| (*id, s.clone()))
            .collect();
        streams
            .into_iter()
            .filter_map(|(id, s)| {
                let s = lock(&s);
                (s.warmed(cluster) == Some(false)).then(|| match s.node_id() {
                    Some(node) if !node.is_empty() => format!("{node} (stream {id})"),
                    _ => format!("stream {id}"),
                })
            })
            .collect()
    }
}

/// One connected Envoy as `/debug/clients` shows it.
#[derive(Debug, Serialize)]
pub struct ClientReport {
    pub stream_id: u64,
    pub protocol: &'static str,
    pub connected_at_unix: u64,
    pub node: Option<NodeInfo>,
    pub types: BTreeMap<&'static str, TypeStatus>,
}

impl Clients {
    /// Waits until some Envoy ACKs clusters or endpoints (or returns at once if one did
    /// since the last wait).
    pub async fn acked(&self) {
        self.warmed.notified().await
    }

    pub(super) fn notify_acked(&self) {
        self.warmed.notify_one();
    }

    pub fn report(&self) -> Vec<ClientReport> {
        let streams: Vec<_> = {
            let guard = self.streams.lock().unwrap_or_else(|e| e.into_inner());
            guard
                .iter()
                .map(|(id, (p, t, s))| (*id, *p, *t, s.clone()))
                .collect()
        };
        streams
            .into_iter()
            .map(|(stream_id, protocol, connected_at_unix, s)| {
                let (node, status) = s.lock().unwrap_or_else(|e| e.into_inner()).describe();
                ClientReport {
                    stream_id,
                    protocol,
                    connected_at_unix,
                    node,
                    types: status.into_iter().map(|(t, s)| (t.label(), s)).collect(),
                }
            })
            .collect()
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

    pub(super) fn remove(&self, id: u64) {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }
}

pub(super) fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

//! The gRPC layer: moves bytes between tonic and the per-stream state machines.
//!
//! One task per stream. It waits for a request, a new snapshot or shutdown, feeds the
//! state machine and sends what it returns. Snapshots come from a `watch` channel, so a
//! stream that falls behind skips straight to the latest; a client that stops reading
//! blocks only its own task, and holds at most one response per type. A client error
//! (undecodable or oversized message, unknown type) ends that stream only.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::grpc::{frame, RequestStream};
use super::{AdsProtocol, Event, NodeInfo, ResourceType, Snapshot, TypeStatus};
use crate::metrics::{Metrics, ProtocolLabels};

/// Responses buffered per stream: enough for one of each type (the state machines keep
/// at most one in flight per type).
pub const STREAM_BUFFER: usize = 8;

type SharedStream = Arc<Mutex<dyn ClientDescribe>>;

trait ClientDescribe: Send {
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

impl crate::switchover::EnvoyWarmth for Clients {
    fn cold_envoys(&self, envoy_cluster: &str) -> Vec<String> {
        let streams: Vec<_> = lock(&self.streams)
            .iter()
            .map(|(id, (_, _, s))| (*id, s.clone()))
            .collect();
        streams
            .into_iter()
            .filter_map(|(id, s)| {
                let s = lock(&s);
                (s.warmed(envoy_cluster) == Some(false)).then(|| match s.node_id() {
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

    fn register(&self, protocol: &'static str, stream: SharedStream) -> u64 {
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

    fn remove(&self, id: u64) {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }
}

/// The ADS service. Cheap to clone: everything inside is shared.
#[derive(Clone)]
pub struct AdsServer {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    metrics: Arc<Metrics>,
    clients: Arc<Clients>,
    shutdown: CancellationToken,
}

impl AdsServer {
    pub fn new(
        snapshots: watch::Receiver<Arc<Snapshot>>,
        metrics: Arc<Metrics>,
        clients: Arc<Clients>,
        shutdown: CancellationToken,
    ) -> AdsServer {
        AdsServer {
            snapshots,
            metrics,
            clients,
            shutdown,
        }
    }

    /// Starts the task that serves one stream: requests from `inbound`, framed
    /// responses (then at most one error) into `tx`.
    pub fn spawn_stream<P>(
        &self,
        machine: P,
        inbound: RequestStream<P::Request>,
        tx: mpsc::Sender<Result<Bytes, Status>>,
    ) where
        P: AdsProtocol,
    {
        let this = self.clone();
        tokio::spawn(async move { this.run_stream(machine, inbound, tx).await });
    }

    async fn run_stream<P>(
        self,
        machine: P,
        mut inbound: RequestStream<P::Request>,
        tx: mpsc::Sender<Result<Bytes, Status>>,
    ) where
        P: AdsProtocol,
    {
        let protocol = P::NAME;
        let machine = Arc::new(Mutex::new(machine));
        let id = self.clients.register(protocol, machine.clone());
        let streams = self
            .metrics
            .streams
            .get_or_create(&ProtocolLabels { protocol })
            .clone();
        streams.inc();
        let _guard = StreamGuard {
            clients: self.clients.clone(),
            id,
            streams,
        };
        let mut subscribed = SubscriptionGauges::new(self.metrics.clone(), protocol);
        let mut snapshots = self.snapshots.clone();
        loop {
            let snapshot = snapshots.borrow_and_update().clone();
            let responses = lock(&machine).poll(&snapshot);
            for (ty, count, response) in responses {
                let labels = Metrics::type_labels(protocol, ty.label());
                self.metrics.pushes.get_or_create(&labels).inc();
                self.metrics
                    .pushed_resources
                    .get_or_create(&labels)
                    .inc_by(count as u64);
                tokio::select! {
                    sent = tx.send(Ok(frame(&response))) => if sent.is_err() { return },
                    _ = self.shutdown.cancelled() => return,
                }
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                changed = snapshots.changed() => if changed.is_err() { return },
                message = inbound.message() => match message {
                    Ok(Some(request)) => {
                        let result = lock(&machine).on_request(request);
                        match result {
                            Ok(event) => self.record(id, protocol, &event, &mut subscribed),
                            Err(err) => {
                                tracing::warn!(stream = id, protocol, error = %err, "refusing xDS request; closing the stream");
                                self.count_error(protocol, err.metric_label());
                                let _ = tx.send(Err(Status::invalid_argument(err.to_string()))).await;
                                return;
                            }
                        }
                    }
                    Ok(None) => return,
                    Err(status) => {
                        // Undecodable, oversized, or the connection went away.
                        let reason = match status.code() {
                            tonic::Code::Cancelled | tonic::Code::Unavailable | tonic::Code::Unknown => "disconnected",
                            tonic::Code::ResourceExhausted | tonic::Code::OutOfRange => "too_large",
                            _ => "bad_message",
                        };
                        if reason != "disconnected" {
                            tracing::warn!(stream = id, protocol, code = ?status.code(), message = status.message(), "bad xDS message; closing the stream");
                            self.count_error(protocol, reason);
                            let _ = tx.send(Err(status)).await;
                        }
                        return;
                    }
                },
            }
        }
    }

    fn count_error(&self, protocol: &'static str, reason: &'static str) {
        self.metrics
            .stream_errors
            .get_or_create(&crate::metrics::ReasonLabels { protocol, reason })
            .inc();
    }

    fn record(
        &self,
        id: u64,
        protocol: &'static str,
        event: &Event,
        subscribed: &mut SubscriptionGauges,
    ) {
        match event {
            Event::Subscribed(ty) => subscribed.add(*ty),
            Event::Ack { ty, .. } => {
                if matches!(ty, ResourceType::Cluster | ResourceType::Endpoints) {
                    self.clients.warmed.notify_one();
                }
                self.metrics
                    .acks
                    .get_or_create(&Metrics::type_labels(protocol, ty.label()))
                    .inc();
            }
            Event::Nack {
                ty,
                version,
                message,
            } => {
                tracing::warn!(
                    stream = id,
                    protocol,
                    r#type = ty.label(),
                    version,
                    error_detail = message.as_str(),
                    "Envoy rejected a response; it will not be resent until its content changes"
                );
                self.metrics
                    .nacks
                    .get_or_create(&Metrics::type_labels(protocol, ty.label()))
                    .inc();
            }
            Event::Stale(_) => {}
        }
    }
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct StreamGuard {
    clients: Arc<Clients>,
    id: u64,
    streams: prometheus_client::metrics::gauge::Gauge,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.clients.remove(self.id);
        self.streams.dec();
    }
}

/// Counts each stream once per type it subscribed to, and uncounts it when it ends.
struct SubscriptionGauges {
    metrics: Arc<Metrics>,
    protocol: &'static str,
    seen: [bool; 4],
}

impl SubscriptionGauges {
    fn new(metrics: Arc<Metrics>, protocol: &'static str) -> Self {
        SubscriptionGauges {
            metrics,
            protocol,
            seen: [false; 4],
        }
    }

    fn add(&mut self, ty: ResourceType) {
        if !std::mem::replace(&mut self.seen[ty.index()], true) {
            self.metrics
                .subscriptions
                .get_or_create(&Metrics::type_labels(self.protocol, ty.label()))
                .inc();
        }
    }
}

impl Drop for SubscriptionGauges {
    fn drop(&mut self) {
        for ty in ResourceType::ALL {
            if self.seen[ty.index()] {
                self.metrics
                    .subscriptions
                    .get_or_create(&Metrics::type_labels(self.protocol, ty.label()))
                    .dec();
            }
        }
    }
}

//! The gRPC layer: moves bytes between tonic and the per-stream state machines.
//!
//! One task per stream. It waits for a request, a new snapshot or shutdown, feeds the
//! state machine and sends what it returns; it registers the stream with [`Clients`] and
//! reports what happens to an [`Observer`] (metrics, in ray-xds). Snapshots come from a `watch` channel, so a
//! stream that falls behind skips straight to the latest; a client that stops reading
//! blocks only its own task, and holds at most one response per type; a response not
//! written within [`WRITE_DEADLINE`] of reaching the head of its stream's queue closes
//! the connection (and every stream on it). Responses built and not yet
//! written share one bound across streams ([`super::responses`]), reserved before a
//! stream builds them. A client error
//! (undecodable or oversized message, unknown type) ends that stream only.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::clients::{lock, Clients};
use super::codec::RequestStream;
use super::listener::ConnectionStreams;
use super::responses::{ResponseBytes, Written};
use super::{AdsProtocol, Event, Observer, ResourceType, Snapshot};

/// Responses buffered per stream: enough for one of each type (the state machines keep
/// at most one in flight per type).
pub(crate) const STREAM_BUFFER: usize = 8;

/// How long a reconnected Envoy has to declare what it holds (it sends every request at
/// once, so on any network this is far more than it needs) before removals go ahead.
pub(crate) const RECONNECT_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// The most ADS streams one HTTP/2 connection carries at once (HTTP/2's
/// SETTINGS_MAX_CONCURRENT_STREAMS).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 100;

/// How many ADS streams are served at once by default, over every connection.
pub const DEFAULT_MAX_STREAMS: usize = 20_000;

/// How long a response may wait at the head of its stream's queue without being written
/// out (its client making no progress) before the stream's connection is closed: what
/// it holds of the shared response bound comes back, and a client that stops reading
/// holds it about this long at most.
pub const WRITE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// The ADS service. Cheap to clone: everything inside is shared.
#[derive(Clone)]
pub struct AdsServer {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    observer: Arc<dyn Observer>,
    clients: Arc<Clients>,
    shutdown: CancellationToken,
    /// One permit per stream served; a stream over the limit is refused with
    /// RESOURCE_EXHAUSTED before it costs anything.
    streams: Arc<tokio::sync::Semaphore>,
    /// What responses built and not yet written hold, across every stream.
    responses: ResponseBytes,
    write_deadline: std::time::Duration,
}

impl AdsServer {
    pub fn new(
        snapshots: watch::Receiver<Arc<Snapshot>>,
        observer: Arc<dyn Observer>,
        clients: Arc<Clients>,
        shutdown: CancellationToken,
    ) -> AdsServer {
        AdsServer {
            snapshots,
            observer,
            clients,
            shutdown,
            streams: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_STREAMS)),
            responses: ResponseBytes::default(),
            write_deadline: WRITE_DEADLINE,
        }
    }

    /// A response unwritten for `deadline` closes its connection (instead of
    /// [`WRITE_DEADLINE`]).
    pub fn with_write_deadline(mut self, deadline: std::time::Duration) -> AdsServer {
        self.write_deadline = deadline;
        self
    }

    /// Response bytes built and not yet written bounded by `bound` (instead of
    /// [`RESPONSE_BYTES_BOUND`](super::responses::RESPONSE_BYTES_BOUND)).
    pub fn with_response_bytes(mut self, bound: usize) -> AdsServer {
        self.responses = ResponseBytes::new(bound);
        self
    }

    /// The bound on response bytes every stream shares.
    pub fn response_bytes(&self) -> &ResponseBytes {
        &self.responses
    }

    /// At most `max` streams at once (instead of [`DEFAULT_MAX_STREAMS`]).
    pub fn with_max_streams(mut self, max: usize) -> AdsServer {
        self.streams = Arc::new(tokio::sync::Semaphore::new(
            max.clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
        ));
        self
    }

    /// Starts the task that serves one stream of a client at `peer` on `connection`:
    /// requests from `inbound`, framed responses (then at most one error) into `tx`.
    pub(crate) fn spawn_stream<P>(
        &self,
        machine: P,
        inbound: RequestStream<P::Wire>,
        tx: mpsc::Sender<Result<Bytes, Status>>,
        peer: Option<IpAddr>,
        connection: Option<Arc<ConnectionStreams>>,
    ) where
        P: AdsProtocol,
    {
        let Ok(permit) = self.streams.clone().try_acquire_owned() else {
            self.observer.stream_error(P::NAME, "over_stream_limit");
            tracing::warn!(
                protocol = P::NAME,
                "ADS stream limit reached; refusing a new stream"
            );
            let _ = tx.try_send(Err(Status::resource_exhausted(
                "ray-xds serves no more ADS streams at once; retry later",
            )));
            return;
        };
        let this = self.clone();
        // On the heap before the task starts: a future keeps room for what it was given
        // for as long as it lives, and the state machine is the largest part of a stream.
        let machine = Arc::new(Mutex::new(machine));
        let inbound = Box::new(inbound);
        tokio::spawn(async move {
            let peer = peer.unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
            this.run_stream(machine, inbound, tx, peer, connection)
                .await;
            drop(permit);
        });
    }

    async fn run_stream<P>(
        self,
        machine: Arc<Mutex<P>>,
        mut inbound: Box<RequestStream<P::Wire>>,
        tx: mpsc::Sender<Result<Bytes, Status>>,
        peer: IpAddr,
        connection: Option<Arc<ConnectionStreams>>,
    ) where
        P: AdsProtocol,
    {
        let protocol = P::NAME;
        let id = self.clients.register(protocol, machine.clone());
        self.observer.stream_opened(protocol);
        let mut guard = StreamGuard {
            clients: self.clients.clone(),
            observer: self.observer.clone(),
            protocol,
            id,
            subscribed: [false; 4],
        };
        let mut snapshots = self.snapshots.clone();
        // Made only while a reconnected Envoy is awaited, and on the heap: an idle stream
        // does not keep a timer's room in its task.
        let reconnect_deadline = tokio::time::Instant::now() + RECONNECT_WAIT;
        let mut reconnect: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        let mut watch = WriteWatch::new(self.write_deadline);
        // Whether something may have changed what the stream sends (anything but the
        // write deadline's check).
        let mut poll_needed = true;
        loop {
            let awaiting_reconnect = lock(&machine).awaiting_reconnect();
            if !awaiting_reconnect {
                reconnect = None;
            } else if reconnect.is_none() {
                reconnect = Some(Box::pin(tokio::time::sleep_until(reconnect_deadline)));
            }
            if std::mem::replace(&mut poll_needed, true) {
                let snapshot = snapshots.borrow_and_update().clone();
                // Room before the responses are built: when every Envoy reconnects at
                // once, they are built only as fast as earlier ones leave.
                let room = self.room_for(
                    &snapshot,
                    &mut watch,
                    (id, protocol, peer),
                    connection.as_deref(),
                );
                let Some(mut room) = room.await else { return };
                let responses = lock(&machine).poll(&snapshot);
                for (ty, count, response) in responses {
                    self.observer.pushed(protocol, ty, count);
                    let framed = room.frame(&response, &watch.written);
                    drop(response);
                    tokio::select! {
                        sent = tx.send(Ok(framed)) => if sent.is_err() { return },
                        _ = self.shutdown.cancelled() => return,
                    }
                    watch.sent();
                }
            }
            watch.refresh();
            let write_by = watch.write_by();
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(write_by.unwrap_or_else(tokio::time::Instant::now)), if write_by.is_some() => {
                    if watch.stalled() {
                        self.close_stalled(id, protocol, peer, connection.as_deref());
                        return;
                    }
                    poll_needed = false; // written meanwhile: nothing else changed
                }
                _ = futures::future::OptionFuture::from(reconnect.as_mut()), if awaiting_reconnect => {
                    tracing::debug!(stream = id, protocol, "reconnected Envoy did not declare all it holds in time; going ahead");
                    lock(&machine).settle_reconnect();
                }
                changed = snapshots.changed() => if changed.is_err() { return },
                message = inbound.message() => match message {
                    Ok(Some(request)) => {
                        let result = lock(&machine).on_wire(request);
                        match result {
                            Ok(event) => self.record(id, protocol, &event, &mut guard),
                            Err(err) => {
                                tracing::warn!(stream = id, protocol, error = %err, "refusing xDS request; closing the stream");
                                self.observer.stream_error(protocol, err.metric_label());
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
                            tonic::Code::OutOfRange => "too_large",
                            tonic::Code::ResourceExhausted => "partial_requests_over_budget",
                            tonic::Code::DeadlineExceeded => "request_too_slow",
                            _ => "bad_message",
                        };
                        if reason != "disconnected" {
                            tracing::warn!(stream = id, protocol, code = ?status.code(), message = status.message(), "bad xDS message; closing the stream");
                            self.observer.stream_error(protocol, reason);
                            let _ = tx.send(Err(status)).await;
                        }
                        return;
                    }
                },
            }
        }
    }

    /// Room in the response bound for what a round on `snapshot` may send; `None` when
    /// the server stops or the stream stalls meanwhile. The write deadline is watched
    /// while it waits: a stream whose own unwritten responses keep the bound full must
    /// not wait for ever.
    async fn room_for(
        &self,
        snapshot: &Snapshot,
        watch: &mut WriteWatch,
        (id, protocol, peer): (u64, &'static str, IpAddr),
        connection: Option<&ConnectionStreams>,
    ) -> Option<super::responses::Room> {
        let reserve = self.responses.reserve(peer, snapshot.response_room());
        tokio::pin!(reserve);
        loop {
            let write_by = watch.write_by();
            tokio::select! {
                room = &mut reserve => return Some(room),
                _ = self.shutdown.cancelled() => return None,
                _ = tokio::time::sleep_until(write_by.unwrap_or_else(tokio::time::Instant::now)), if write_by.is_some() => {
                    if watch.stalled() {
                        self.close_stalled(id, protocol, peer, connection);
                        return None;
                    }
                }
            }
        }
    }

    /// Closes the connection of a stream whose client reads none of a response in time
    /// (every stream on it ends; what they held of the response bound comes back).
    fn close_stalled(
        &self,
        id: u64,
        protocol: &'static str,
        peer: IpAddr,
        connection: Option<&ConnectionStreams>,
    ) {
        tracing::warn!(stream = id, protocol, peer = %peer, deadline = ?self.write_deadline, "the client read none of a response in time; closing its connection");
        self.observer.stream_error(protocol, "not_reading");
        if let Some(connection) = connection {
            connection.close();
        }
    }

    fn record(&self, id: u64, protocol: &'static str, event: &Event, stream: &mut StreamGuard) {
        match event {
            Event::Subscribed(ty) => {
                if !std::mem::replace(&mut stream.subscribed[ty.index()], true) {
                    self.observer.subscribed(protocol, *ty);
                }
            }
            Event::Ack { ty, .. } => {
                if matches!(ty, ResourceType::Cluster | ResourceType::Endpoints) {
                    self.clients.notify_acked();
                }
                self.observer.acked(protocol, *ty);
            }
            Event::Nack {
                ty,
                version,
                message,
            } => {
                if matches!(ty, ResourceType::Cluster | ResourceType::Endpoints) {
                    self.clients.notify_acked();
                }
                tracing::warn!(
                    stream = id,
                    protocol,
                    r#type = ty.label(),
                    version,
                    error_detail = super::clip(message, 1024).as_str(),
                    "Envoy rejected a response; it will not be resent until its content changes"
                );
                self.observer.nacked(protocol, *ty);
            }
            Event::Stale(_) => {}
        }
    }
}

/// Whether a stream's client reads its responses: they are written in the order they
/// were sent, and each counts in `written` when its last byte is dropped. A response's
/// clock starts when it is sent or when the one before it is seen written, whichever is
/// later, so a slow client that makes progress is never cut off; one whose oldest
/// response waits out the deadline is stalled.
struct WriteWatch {
    written: Written,
    /// When each response not known written became the oldest (or was sent).
    unwritten: std::collections::VecDeque<tokio::time::Instant>,
    /// How many of `written`'s counts have been taken off `unwritten`.
    counted: u64,
    deadline: std::time::Duration,
}

impl WriteWatch {
    fn new(deadline: std::time::Duration) -> WriteWatch {
        WriteWatch {
            written: Written::default(),
            unwritten: Default::default(),
            counted: 0,
            deadline,
        }
    }

    fn sent(&mut self) {
        self.unwritten.push_back(tokio::time::Instant::now());
    }

    /// Takes what was written off the front; the new front's clock starts now if it
    /// started before.
    fn refresh(&mut self) {
        let done = self.written.load(std::sync::atomic::Ordering::Relaxed);
        let mut progressed = false;
        while self.counted < done && self.unwritten.pop_front().is_some() {
            self.counted += 1;
            progressed = true;
        }
        if progressed {
            if let Some(front) = self.unwritten.front_mut() {
                *front = (*front).max(tokio::time::Instant::now());
            }
        }
    }

    /// When the oldest unwritten response must be written by.
    fn write_by(&self) -> Option<tokio::time::Instant> {
        self.unwritten.front().map(|since| *since + self.deadline)
    }

    /// Whether the oldest response has waited out the deadline (after a refresh).
    fn stalled(&mut self) -> bool {
        self.refresh();
        self.write_by()
            .is_some_and(|by| by <= tokio::time::Instant::now())
    }
}

/// Unregisters a stream and reports it closed (with the types it subscribed to) however
/// its task ends.
struct StreamGuard {
    clients: Arc<Clients>,
    observer: Arc<dyn Observer>,
    protocol: &'static str,
    id: u64,
    subscribed: [bool; 4],
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.clients.remove(self.id);
        for ty in ResourceType::ALL {
            if self.subscribed[ty.index()] {
                self.observer.unsubscribed(self.protocol, ty);
            }
        }
        self.observer.stream_closed(self.protocol);
    }
}

#[cfg(test)]
mod tests {
    use super::WriteWatch;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    /// A client that reads none of its oldest response for the deadline is stalled; one
    /// that finishes a response gives the next one a deadline of its own, counted from
    /// then.
    #[tokio::test(start_paused = true)]
    async fn a_stream_is_stalled_only_when_its_oldest_response_waits_out_the_deadline() {
        let mut watch = WriteWatch::new(Duration::from_secs(30));
        assert!(!watch.stalled(), "nothing sent");
        watch.sent();
        watch.sent();
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(!watch.stalled());
        // The first is written at 20 s, and seen: the second's clock starts there.
        watch.written.fetch_add(1, Ordering::Relaxed);
        watch.refresh();
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(
            !watch.stalled(),
            "40 s after it was sent, 20 s after it became the oldest"
        );
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(watch.stalled(), "30 s at the head without being written");
        // Written after all: nothing left to wait for.
        watch.written.fetch_add(1, Ordering::Relaxed);
        assert!(!watch.stalled());
        assert_eq!(watch.write_by(), None);
    }
}

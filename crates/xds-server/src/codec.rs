//! gRPC framing for the ADS streams, without tonic's codec: each response is framed into
//! its own buffer (5-byte header and the message) and freed once written, and requests
//! are read from the body by [`RequestStream`], whose buffer is released between
//! messages.
//!
//! Why: tonic's codec keeps, per stream, an encode buffer at the capacity of the largest
//! response it ever sent and a decode buffer at the largest request chunk, for the life
//! of the stream; with thousands of idle Envoys that was most of the server's memory.
//!
//! Invariants: a request over the size limit is refused from its header, before it is
//! buffered; compressed requests are refused; the bytes of requests not yet whole are
//! bounded across every stream ([`PartialRequests`]), and a request not whole within
//! [`PARTIAL_REQUEST_TIMEOUT`] of its first byte ends its stream: a client that
//! declares large messages and trickles them cannot hold the server's memory.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::budget::FairBudget;

/// One gRPC message, framed: compression flag 0, big-endian length, the message.
pub(crate) fn frame<M: prost::Message>(message: &M) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    // Cannot fail: the buffer has room for `encoded_len` bytes.
    let _ = message.encode(&mut buf);
    buf.freeze()
}

/// How long a request may take to arrive whole, from its first byte (or from the
/// previous request's end, when its first bytes came with it).
pub(crate) const PARTIAL_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// What requests still arriving may hold in all by default (`memory.partial_xds_requests`).
pub const PARTIAL_REQUESTS_BUDGET_BYTES: usize = 64 << 20;

/// How long a stream may go without its first request: an Envoy sends it at once, and a
/// stream that sends none would hold a slot of the listener for ever.
pub(crate) const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The bytes held in requests not yet whole, across every stream of the server, and
/// their bound: the larger of 64 MiB and two of the largest requests accepted.
///
/// The bound is shared fairly between peer addresses (`budget::FairBudget`): a peer's
/// streams may hold more than its fair share (the bound divided by the peers holding
/// anything) only while the bound is not reached; a peer within its share always gets
/// its bytes, and the streams of peers over their share are ended to make room
/// (`RESOURCE_EXHAUSTED`). So a client that holds the whole bound in trickled requests
/// cannot make an Envoy's request (spread over a few HTTP/2 frames) fail: its own
/// streams are the ones that end.
#[derive(Clone, Debug)]
pub struct PartialRequests {
    shared: Arc<Mutex<Holdings>>,
    limit: usize,
}

#[derive(Debug)]
struct Holdings {
    budget: FairBudget<IpAddr>,
    /// Stream id → its peer, what it holds, and how to end it when evicted.
    streams: HashMap<u64, (IpAddr, usize, CancellationToken)>,
    next_id: u64,
}

/// One stream's part of [`PartialRequests`].
#[derive(Debug)]
pub(crate) struct PartialShare {
    requests: PartialRequests,
    peer: IpAddr,
    id: u64,
    evicted: CancellationToken,
}

impl PartialRequests {
    /// The default bound: [`PARTIAL_REQUESTS_BUDGET_BYTES`], or room for two of the
    /// largest messages if that is more.
    pub fn new(max_message_bytes: usize) -> PartialRequests {
        PartialRequests::with_limit(
            PARTIAL_REQUESTS_BUDGET_BYTES.max(max_message_bytes.saturating_mul(2)),
        )
    }

    pub fn with_limit(limit: usize) -> PartialRequests {
        PartialRequests {
            shared: Arc::new(Mutex::new(Holdings {
                budget: FairBudget::new(limit),
                streams: HashMap::new(),
                next_id: 0,
            })),
            limit,
        }
    }

    /// A new stream's share, for a client at `peer` (unknown peers share one address).
    pub(crate) fn share(&self, peer: Option<IpAddr>) -> PartialShare {
        let mut shared = self.shared.lock().expect("never poisoned");
        shared.next_id += 1;
        PartialShare {
            requests: self.clone(),
            peer: peer.unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)),
            id: shared.next_id,
            evicted: CancellationToken::new(),
        }
    }

    #[cfg(test)]
    /// Bytes held now.
    pub(crate) fn held(&self) -> usize {
        self.shared.lock().expect("never poisoned").budget.total()
    }
}

impl PartialShare {
    /// Sets what this stream holds; `Err` (nothing changed) when the peer is over its
    /// fair share of a full bound. Ends the streams of peers evicted to make room.
    fn hold(&self, bytes: usize) -> Result<(), ()> {
        let mut shared = self.requests.shared.lock().expect("never poisoned");
        let Holdings {
            budget, streams, ..
        } = &mut *shared;
        let old = streams.get(&self.id).map_or(0, |(_, held, _)| *held);
        let peer_total = budget.held_by(&self.peer) - old + bytes;
        let evicted = budget.admit(&self.peer, peer_total).map_err(|_| ())?;
        for peer in evicted {
            streams.retain(|_, (p, _, evict)| {
                let hit = *p == peer;
                if hit {
                    evict.cancel();
                }
                !hit
            });
        }
        if bytes == 0 {
            streams.remove(&self.id);
        } else {
            streams.insert(self.id, (self.peer, bytes, self.evicted.clone()));
        }
        Ok(())
    }
}

impl Drop for PartialShare {
    fn drop(&mut self) {
        // Giving back is always admitted (an evicted stream holds nothing any more).
        if !self.evicted.is_cancelled() {
            let _ = self.hold(0);
        }
    }
}

/// The status of a stream ended to make room for a client within its share.
fn evicted_status() -> Status {
    Status::resource_exhausted(
        "this client's requests not yet whole were over its share of a full bound; ended to make room for another client's",
    )
}

/// The messages of a gRPC request body.
pub(crate) struct RequestStream<T> {
    body: tonic::body::Body,
    buf: BytesMut,
    max_message_bytes: usize,
    partial: PartialShare,
    /// Bytes of `buf` counted in `partial`.
    counted: usize,
    /// When the bytes now buffered began to arrive.
    partial_since: Option<tokio::time::Instant>,
    /// Until the first request is whole.
    first_until: Option<tokio::time::Instant>,
    _message: std::marker::PhantomData<fn() -> T>,
}

impl<T: prost::Message + Default> RequestStream<T> {
    pub fn new(
        body: tonic::body::Body,
        max_message_bytes: usize,
        partial: PartialShare,
    ) -> RequestStream<T> {
        RequestStream {
            body,
            buf: BytesMut::new(),
            max_message_bytes,
            partial,
            counted: 0,
            partial_since: None,
            first_until: Some(tokio::time::Instant::now() + FIRST_REQUEST_TIMEOUT),
            _message: std::marker::PhantomData,
        }
    }

    /// Counts what `buf` holds now in the server's partial requests.
    fn count_buffered(&mut self) -> Result<(), Status> {
        let now = self.buf.len();
        if self.partial.evicted.is_cancelled() {
            return Err(evicted_status());
        }
        if now != self.counted && self.partial.hold(now).is_err() {
            return Err(Status::resource_exhausted(format!(
                "requests not yet whole hold over {} MiB across all streams, and this client is over its share",
                self.partial.requests.limit >> 20
            )));
        }
        self.counted = now;
        if now == 0 {
            self.partial_since = None;
        } else if self.partial_since.is_none() {
            self.partial_since = Some(tokio::time::Instant::now());
        }
        Ok(())
    }

    /// The next message; `Ok(None)` when the client ended the stream.
    pub(crate) async fn message(&mut self) -> Result<Option<T>, Status> {
        loop {
            let decoded = self.decode_buffered();
            if matches!(decoded, Ok(Some(_))) {
                // The next request's time starts now, even if some of it came along.
                self.partial_since = None;
                self.first_until = None;
            }
            self.count_buffered()?;
            if let Some(message) = decoded? {
                return Ok(Some(message));
            }
            let partial_until = self.partial_since.map(|t| t + PARTIAL_REQUEST_TIMEOUT);
            let until = match (partial_until, self.first_until) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let evicted = self.partial.evicted.clone();
            let frame = async {
                tokio::select! {
                    next = self.body.frame() => Ok(next),
                    _ = evicted.cancelled() => Err(evicted_status()),
                }
            };
            let next = match until {
                None => frame.await?,
                Some(until) => match tokio::time::timeout_at(until, frame).await {
                    Ok(next) => next?,
                    Err(_) if self.first_until.is_some_and(|t| t <= until) => {
                        return Err(Status::deadline_exceeded(format!(
                            "no whole request {}s after the stream opened",
                            FIRST_REQUEST_TIMEOUT.as_secs()
                        )))
                    }
                    Err(_) => {
                        return Err(Status::deadline_exceeded(format!(
                            "a request was not whole {}s after its first byte",
                            PARTIAL_REQUEST_TIMEOUT.as_secs()
                        )))
                    }
                },
            };
            match next {
                None if self.buf.is_empty() => return Ok(None),
                None => return Err(Status::internal("the stream ended inside a message")),
                Some(Err(status)) => return Err(status),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    fn decode_buffered(&mut self) -> Result<Option<T>, Status> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        if self.buf[0] != 0 {
            return Err(Status::unimplemented(
                "compressed xDS requests are not supported",
            ));
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max_message_bytes {
            return Err(Status::out_of_range(format!(
                "a request of {len} bytes is over the limit of {} bytes",
                self.max_message_bytes
            )));
        }
        if self.buf.len() < 5 + len {
            // Not reserved from the header: the buffer grows only with bytes received.
            return Ok(None);
        }
        let message = T::decode(&self.buf[5..5 + len]);
        bytes::Buf::advance(&mut self.buf, 5 + len);
        if self.buf.is_empty() {
            // Released between requests, whatever its capacity says: what is left of a
            // buffer after a request is taken from its front still holds the request's
            // whole allocation, which an idle stream then kept.
            self.buf = BytesMut::new();
        }
        message
            .map(Some)
            .map_err(|e| Status::internal(format!("undecodable request: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use http_body::Frame;

    fn stream(chunks: Vec<Vec<u8>>, max: usize) -> RequestStream<DiscoveryRequest> {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, Status>(Frame::data(Bytes::from(c))));
        let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
        RequestStream::new(
            tonic::body::Body::new(body),
            max,
            PartialRequests::new(max).share(None),
        )
    }

    fn request(type_url: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            type_url: type_url.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn reads_messages_across_and_within_chunks() {
        let mut bytes = frame(&request("a")).to_vec();
        bytes.extend_from_slice(&frame(&request("b")));
        bytes.extend_from_slice(&frame(&request("c")));
        let (first, rest) = bytes.split_at(3);
        let (second, third) = rest.split_at(20);
        let mut s = stream(vec![first.to_vec(), second.to_vec(), third.to_vec()], 1024);
        for want in ["a", "b", "c"] {
            assert_eq!(s.message().await.unwrap().unwrap().type_url, want);
        }
        assert!(s.message().await.unwrap().is_none());

        // A large request does not leave a large buffer behind.
        let big = frame(&DiscoveryRequest {
            resource_names: (0..200)
                .map(|i| format!("default/service-{i}/cluster"))
                .collect(),
            ..Default::default()
        });
        let mut s = stream(vec![big[..4000].to_vec(), big[4000..].to_vec()], 1 << 20);
        assert_eq!(
            s.message().await.unwrap().unwrap().resource_names.len(),
            200
        );
        assert_eq!(s.buf.capacity(), 0, "nothing kept between requests");
    }

    #[tokio::test]
    async fn refuses_oversized_compressed_truncated_and_garbage() {
        let big = frame(&DiscoveryRequest {
            resource_names: vec!["x".repeat(100)],
            ..Default::default()
        });
        // Refused from the header alone: only the first 5 bytes are sent.
        let err = stream(vec![big[..5].to_vec()], 50)
            .message()
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::OutOfRange);

        let mut compressed = frame(&request("a")).to_vec();
        compressed[0] = 1;
        let err = stream(vec![compressed], 1024).message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unimplemented);

        let whole = frame(&request("abc"));
        let err = stream(vec![whole[..whole.len() - 1].to_vec()], 1024)
            .message()
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Internal);

        // Field 2 (node, a message) with a fixed64 wire type.
        let garbage = vec![0, 0, 0, 0, 9, 0x11, 1, 2, 3, 4, 5, 6, 7, 8];
        let err = stream(vec![garbage], 1024).message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Internal);
    }

    /// A body that sends `chunks` and then nothing, without ending.
    fn stalled(chunks: Vec<Vec<u8>>, partial: PartialRequests) -> RequestStream<DiscoveryRequest> {
        stalled_from(chunks, partial, [192, 0, 2, 1])
    }

    /// [`stalled`], for a client at `peer`.
    fn stalled_from(
        chunks: Vec<Vec<u8>>,
        partial: PartialRequests,
        peer: [u8; 4],
    ) -> RequestStream<DiscoveryRequest> {
        use futures::StreamExt;
        let frames = futures::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, Status>(Frame::data(Bytes::from(c)))),
        )
        .chain(futures::stream::pending());
        let body = http_body_util::StreamBody::new(frames);
        RequestStream::new(
            tonic::body::Body::new(body),
            1 << 20,
            partial.share(Some(IpAddr::from(peer))),
        )
    }

    /// A stream that never sends its first request ends; a request whose first bytes came
    /// with the previous one has its own 30 s, not what is left of the previous one's.
    #[tokio::test(start_paused = true)]
    async fn a_first_request_is_awaited_10s_and_each_request_gets_its_own_30s() {
        let mut silent = stalled(vec![], PartialRequests::new(1 << 20));
        let err = silent.message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
        assert!(err.message().contains("opened"), "{err}");

        // Requests a, b, c, each whole 20 s after the previous, each chunk straddling two.
        let mut bytes = frame(&request("a")).to_vec();
        let b = frame(&request("b"));
        let c = frame(&request("c"));
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(4);
        let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut s = RequestStream::<DiscoveryRequest>::new(
            tonic::body::Body::new(body),
            1 << 20,
            PartialRequests::new(1 << 20).share(None),
        );
        bytes.extend_from_slice(&b[..3]);
        tx.send(Ok(Frame::data(Bytes::from(bytes)))).await.unwrap();
        assert_eq!(s.message().await.unwrap().unwrap().type_url, "a");
        let feeder = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(20)).await;
            let mut rest = b[3..].to_vec();
            rest.extend_from_slice(&c[..3]);
            tx.send(Ok(Frame::data(Bytes::from(rest)))).await.unwrap();
            tokio::time::sleep(Duration::from_secs(20)).await;
            tx.send(Ok(Frame::data(c.slice(3..)))).await.unwrap();
            tx
        });
        assert_eq!(s.message().await.unwrap().unwrap().type_url, "b");
        assert_eq!(s.message().await.unwrap().unwrap().type_url, "c");
        drop(feeder.await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn partial_requests_are_bounded_across_streams_and_in_time() {
        let partial = PartialRequests::with_limit(10_000);
        let big = frame(&DiscoveryRequest {
            resource_names: (0..400).map(|i| format!("resource-name-{i}")).collect(),
            ..Default::default()
        });
        assert!(big.len() > 6_000, "{}", big.len());
        // A header declaring the whole message, and 6,000 of its bytes: held.
        let mut first = stalled(vec![big[..6_000].to_vec()], partial.clone());
        let held = tokio::time::timeout(Duration::from_secs(1), first.message()).await;
        assert!(held.is_err(), "a partial message is waited for");
        assert_eq!(partial.held(), 6_000);
        // A second stream doing the same goes over the bound: refused, and counts nothing.
        let mut second = stalled(vec![big[..6_000].to_vec()], partial.clone());
        let err = second.message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        drop(second);
        assert_eq!(partial.held(), 6_000);
        // The first one's request never completes: its stream ends at the deadline.
        let err = first.message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err}");
        drop(first);
        assert_eq!(
            partial.held(),
            0,
            "a stream gives its bytes back when it ends"
        );

        // A header declaring 1 MiB reserves nothing: only what arrived is held.
        let mut header = vec![0u8];
        header.extend_from_slice(&(1u32 << 20).to_be_bytes());
        let mut s = stalled(vec![header], partial.clone());
        assert!(tokio::time::timeout(Duration::from_secs(1), s.message())
            .await
            .is_err());
        assert_eq!(partial.held(), 5);
        assert!(s.buf.capacity() < 4096, "{}", s.buf.capacity());
    }

    /// One client holding the whole bound in trickled requests cannot make an
    /// Envoy's request fail: the Envoy is within its share, so the hog's streams end to
    /// make room, and the hog cannot take it back while the Envoy holds its part.
    #[tokio::test(start_paused = true)]
    async fn a_client_within_its_share_gets_in_and_the_hog_is_ended() {
        let partial = PartialRequests::with_limit(10_000);
        let big = frame(&DiscoveryRequest {
            resource_names: (0..400).map(|i| format!("resource-name-{i}")).collect(),
            ..Default::default()
        });
        let hog = [198, 18, 0, 66];
        let mut hogs: Vec<_> = (0..2)
            .map(|_| stalled_from(vec![big[..4_900].to_vec()], partial.clone(), hog))
            .collect();
        for h in &mut hogs {
            assert!(tokio::time::timeout(Duration::from_secs(1), h.message())
                .await
                .is_err());
        }
        assert_eq!(partial.held(), 9_800);

        // An Envoy's request in two frames: its first 3,000 bytes are within its share
        // (5,000 of 10,000 with two peers holding), so the hog's streams are ended.
        let envoy = frame(&DiscoveryRequest {
            resource_names: (0..200).map(|i| format!("envoy-resource-{i}")).collect(),
            ..Default::default()
        });
        assert!(
            envoy.len() > 3_000 && envoy.len() < 5_000,
            "{}",
            envoy.len()
        );
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Status>>(4);
        let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut s = RequestStream::<DiscoveryRequest>::new(
            tonic::body::Body::new(body),
            1 << 20,
            partial.share(Some(IpAddr::from([198, 18, 0, 1]))),
        );
        tx.send(Ok(Frame::data(envoy.slice(..3_000))))
            .await
            .unwrap();
        assert!(tokio::time::timeout(Duration::from_secs(1), s.message())
            .await
            .is_err());
        assert_eq!(partial.held(), 3_000);
        for h in &mut hogs {
            let err = h.message().await.unwrap_err();
            assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        }
        drop(hogs);
        assert_eq!(partial.held(), 3_000);
        // The hog comes back: within the bound it may hold (7,000 are free)...
        let mut again = stalled_from(vec![big[..4_000].to_vec()], partial.clone(), hog);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), again.message())
                .await
                .is_err()
        );
        // ...but not past it, over its share: refused, the Envoy untouched.
        let mut more = stalled_from(vec![big[..4_000].to_vec()], partial.clone(), hog);
        let err = more.message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        drop(more);
        assert_eq!(partial.held(), 7_000);
        tx.send(Ok(Frame::data(envoy.slice(3_000..))))
            .await
            .unwrap();
        assert_eq!(
            s.message().await.unwrap().unwrap().resource_names.len(),
            200
        );
        drop((again, s));
        assert_eq!(partial.held(), 0);
    }
}

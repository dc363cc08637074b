//! The ADS gRPC service, wired by hand around tonic's transport and request decoding.
//!
//! Why not the generated server: tonic encodes a stream's responses into one buffer that
//! keeps the capacity of the largest message it ever carried (a full cluster list, or
//! the initial sync), for the life of the stream; with thousands of idle Envoys that was
//! most of our memory. Here each response is framed into its own `Bytes` (5-byte gRPC
//! header + the encoded message) and freed once written. Requests are still decoded by
//! tonic's `Streaming`, which enforces the message-size limit.
//!
//! Invariant: a stream's task sends only framed messages, then at most one error; the
//! body ends with `grpc-status` trailers.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use http_body::Frame;
use tokio::sync::mpsc;
use tonic::codec::{BufferSettings, Streaming};
use tonic::server::NamedService;
use tonic::Status;

use super::delta::DeltaStream;
use super::server::AdsServer;
use super::sotw::SotwStream;

const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// Requests are small (a type, a nonce, some names): start the decode buffer small.
const DECODE_BUFFER_BYTES: usize = 4 * 1024;

/// One gRPC message, framed: compression flag 0, big-endian length, the message.
pub fn frame<M: prost::Message>(message: &M) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    // Cannot fail: the buffer has room for `encoded_len` bytes.
    let _ = message.encode(&mut buf);
    buf.freeze()
}

/// The tower service `tonic::transport::Server::add_service` takes.
#[derive(Clone)]
pub struct AdsService {
    server: AdsServer,
    max_message_bytes: usize,
}

impl AdsService {
    pub fn new(server: AdsServer, max_message_bytes: usize) -> AdsService {
        AdsService {
            server,
            max_message_bytes,
        }
    }

    fn decode<T: prost::Message + Default + Send + 'static>(
        &self,
        body: tonic::body::Body,
    ) -> Streaming<T> {
        let decoder = tonic_prost::ProstCodec::<(), T>::raw_decoder(BufferSettings::new(
            DECODE_BUFFER_BYTES,
            DECODE_BUFFER_BYTES,
        ));
        Streaming::new_request(decoder, body, None, Some(self.max_message_bytes))
    }
}

impl NamedService for AdsService {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

impl tower::Service<http::Request<tonic::body::Body>> for AdsService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let (tx, rx) = mpsc::channel(super::server::STREAM_BUFFER);
        let path = request.uri().path().to_owned();
        let body = request.into_body();
        match path.as_str() {
            SOTW_PATH => {
                let inbound = self.decode::<DiscoveryRequest>(body);
                self.server
                    .spawn_stream::<SotwStream>(SotwStream::new(), inbound, tx);
            }
            DELTA_PATH => {
                let inbound = self.decode::<DeltaDiscoveryRequest>(body);
                self.server
                    .spawn_stream::<DeltaStream>(DeltaStream::new(), inbound, tx);
            }
            _ => {
                let _ = tx.try_send(Err(Status::unimplemented(format!("no method {path}"))));
            }
        }
        std::future::ready(Ok(grpc_response(rx)))
    }
}

fn grpc_response(rx: mpsc::Receiver<Result<Bytes, Status>>) -> http::Response<tonic::body::Body> {
    let mut response = http::Response::new(tonic::body::Body::new(FramedBody { rx, ended: false }));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

/// A response body of framed messages from a stream task, ending in trailers.
struct FramedBody {
    rx: mpsc::Receiver<Result<Bytes, Status>>,
    ended: bool,
}

impl http_body::Body for FramedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let status = match self.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Ok(bytes))) => return Poll::Ready(Some(Ok(Frame::data(bytes)))),
            Poll::Ready(Some(Err(status))) => status,
            Poll::Ready(None) => Status::ok(""),
        };
        self.ended = true;
        let mut trailers = http::HeaderMap::new();
        if let Err(e) = status.add_header(&mut trailers) {
            return Poll::Ready(Some(Err(e)));
        }
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

//! The ADS gRPC service, wired by hand around tonic's transport: routes each call to a
//! stream task of [`super::server`] with the protocol's state machine, and turns what the
//! task sends into a response body ([`super::codec`] frames the messages; see there why
//! not tonic's codec).
//!
//! Invariants: a stream's task sends only framed messages, then at most one error; the
//! body ends with `grpc-status` trailers.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use http_body::Frame;
use tokio::sync::mpsc;
use tonic::server::NamedService;
use tonic::Status;

use super::codec::{PartialRequests, RequestStream};
use super::delta::DeltaStream;
use super::server::AdsServer;
use super::sotw::SotwStream;

const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// The tower service `tonic::transport::Server::add_service` takes.
#[derive(Clone)]
pub struct AdsService {
    server: AdsServer,
    max_message_bytes: usize,
    partial: PartialRequests,
}

impl AdsService {
    pub fn new(server: AdsServer, max_message_bytes: usize) -> AdsService {
        AdsService {
            server,
            max_message_bytes,
            partial: PartialRequests::new(max_message_bytes),
        }
    }

    /// Requests still arriving share `partial` (see `xds::codec`).
    pub fn with_partial_requests(mut self, partial: PartialRequests) -> AdsService {
        self.partial = partial;
        self
    }

    fn decode<T: prost::Message + Default>(
        &self,
        body: tonic::body::Body,
        peer: Option<std::net::IpAddr>,
    ) -> RequestStream<T> {
        RequestStream::new(body, self.max_message_bytes, self.partial.share(peer))
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
        // The connection counts the stream while its response lives.
        let (open, peer) = super::listener::XdsConnectInfo::of(&request);
        let connection = open.as_ref().map(|o| o.connection());
        let body = request.into_body();
        match path.as_str() {
            SOTW_PATH => {
                let inbound = self.decode::<super::sotw::WireRequest>(body, peer);
                self.server.spawn_stream::<SotwStream>(
                    SotwStream::new(),
                    inbound,
                    tx,
                    peer,
                    connection,
                );
            }
            DELTA_PATH => {
                let inbound = self.decode::<DeltaDiscoveryRequest>(body, peer);
                self.server.spawn_stream::<DeltaStream>(
                    DeltaStream::new(),
                    inbound,
                    tx,
                    peer,
                    connection,
                );
            }
            _ => {
                let _ = tx.try_send(Err(Status::unimplemented(format!("no method {path}"))));
            }
        }
        std::future::ready(Ok(grpc_response(rx, open)))
    }
}

pub(crate) fn grpc_response(
    rx: mpsc::Receiver<Result<Bytes, Status>>,
    open: Option<super::listener::OpenStream>,
) -> http::Response<tonic::body::Body> {
    let mut response = http::Response::new(tonic::body::Body::new(FramedBody {
        rx,
        ended: false,
        _open: open,
    }));
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
    _open: Option<super::listener::OpenStream>,
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

//! The transport's floor for the fan-out benchmark: a gRPC server with no xDS logic at
//! all, on the stack ray-xds serves with (tonic's transport over h2, the same HTTP/2
//! settings, a response body of framed messages fed by a channel per stream), that
//! pushes bytes encoded once per change to every stream.
//!
//! It reads the fan-out benchmark's resources file (what ray-xds served, one
//! length-delimited `DeltaDiscoveryResponse` per type) whenever the file is replaced, and
//! prepares, once per type and protocol, the framed response a stream gets when it first
//! asks for the type (everything) and the one every stream gets for the change (state of
//! the world: every cluster or listener when one changed, only the endpoint assignments
//! and route configurations that changed; delta: what changed and what went). A stream's
//! only work is to send those bytes: it reads of its requests only the type and the
//! nonce (to see which types it asked for), and ignores ACKs and NACKs. Whatever ray-xds
//! spends above it is xDS.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryResponse, DiscoveryResponse};
use http_body_util::BodyExt;
use prost::Message;
use ray_xds::xds::snapshot::{
    CLUSTER_TYPE_URL, ENDPOINTS_TYPE_URL, LISTENER_TYPE_URL, ROUTE_TYPE_URL,
};
use tokio::sync::{mpsc, watch};

const TYPES: [&str; 4] = [
    CLUSTER_TYPE_URL,
    ENDPOINTS_TYPE_URL,
    LISTENER_TYPE_URL,
    ROUTE_TYPE_URL,
];

const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// One type's resources in a file: name → (version, bytes of the `Any`).
type Held = BTreeMap<String, (String, envoy_types::pb::google::protobuf::Any)>;

/// What every stream sends, framed once.
#[derive(Default)]
struct Prepared {
    /// Per protocol (0 state of the world, 1 delta) and type: the answer to a first
    /// request.
    first: [[Bytes; 4]; 2],
    /// Per protocol and type: the push of the last change, if the type changed.
    push: [[Option<Bytes>; 4]; 2],
}

/// One gRPC message, framed: uncompressed, its length, the message.
fn frame<M: Message>(m: &M) -> Bytes {
    let mut buf = BytesMut::with_capacity(5 + m.encoded_len());
    buf.put_u8(0);
    buf.put_u32(m.encoded_len() as u32);
    m.encode(&mut buf).expect("room for the message");
    buf.freeze()
}

/// The file's resources, per type.
fn read(path: &Path) -> Option<[Held; 4]> {
    let bytes = std::fs::read(path).ok()?;
    let mut buf = &bytes[..];
    let mut out: [Held; 4] = Default::default();
    while buf.has_remaining() {
        let r = DeltaDiscoveryResponse::decode_length_delimited(&mut buf).ok()?;
        let i = TYPES.iter().position(|t| *t == r.type_url)?;
        for res in r.resources {
            out[i].insert(res.name, (res.version, res.resource?));
        }
    }
    Some(out)
}

fn prepare(now: &[Held; 4], before: Option<&[Held; 4]>, change: u64) -> Prepared {
    use envoy_types::pb::envoy::service::discovery::v3::Resource;
    let mut p = Prepared::default();
    for (i, ty) in TYPES.iter().enumerate() {
        let version = format!("floor-{change}");
        let nonce = format!("{change}-{i}");
        let sotw = |resources: Vec<_>| DiscoveryResponse {
            version_info: version.clone(),
            resources,
            type_url: ty.to_string(),
            nonce: nonce.clone(),
            ..Default::default()
        };
        let delta = |resources: Vec<Resource>, removed: Vec<String>| DeltaDiscoveryResponse {
            system_version_info: version.clone(),
            resources,
            type_url: ty.to_string(),
            nonce: nonce.clone(),
            removed_resources: removed,
            ..Default::default()
        };
        let as_delta = |(name, (v, any)): (&String, &(String, _))| Resource {
            name: name.clone(),
            version: v.clone(),
            resource: Some(Clone::clone(any)),
            ..Default::default()
        };
        p.first[0][i] = frame(&sotw(now[i].values().map(|(_, a)| a.clone()).collect()));
        p.first[1][i] = frame(&delta(now[i].iter().map(as_delta).collect(), Vec::new()));
        let Some(before) = before else { continue };
        let changed: Vec<(&String, &(String, _))> = now[i]
            .iter()
            .filter(|(name, (_, any))| before[i].get(*name).is_none_or(|(_, b)| b != any))
            .collect();
        let removed: Vec<String> = before[i]
            .keys()
            .filter(|name| !now[i].contains_key(*name))
            .cloned()
            .collect();
        if changed.is_empty() && removed.is_empty() {
            continue;
        }
        let whole_set = *ty == CLUSTER_TYPE_URL || *ty == LISTENER_TYPE_URL;
        let sotw_resources = if whole_set {
            now[i].values().map(|(_, a)| a.clone()).collect()
        } else {
            changed.iter().map(|(_, (_, a))| a.clone()).collect()
        };
        p.push[0][i] = Some(frame(&sotw(sotw_resources)));
        p.push[1][i] = Some(frame(&delta(
            changed.into_iter().map(as_delta).collect(),
            removed,
        )));
    }
    p
}

/// Serves the floor on `listen`, from the resources file `path`, until the process ends.
pub async fn serve(listen: SocketAddr, path: PathBuf) {
    let first = read(&path).expect("the floor's resources file");
    let (tx, rx) = watch::channel(Arc::new(prepare(&first, None, 0)));
    // Replaced by a rename: watch the directory, read the file when an event other than
    // an access names it, as ray-xds's file source does. (Reading on any event read it
    // forever: each read's own open and close are events. The floor spent about a core
    // on that throughout every run, beside the clients.)
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let file = path.clone();
    let mut watcher = notify::recommended_watcher(move |e: notify::Result<notify::Event>| {
        let changed = e.map_or(true, |e| {
            !matches!(e.kind, notify::EventKind::Access(_)) && e.paths.contains(&file)
        });
        if changed {
            let _ = events_tx.send(());
        }
    })
    .expect("a file watcher");
    use notify::Watcher;
    watcher
        .watch(path.parent().unwrap(), notify::RecursiveMode::NonRecursive)
        .expect("watching the resources file");
    tokio::spawn(async move {
        let _watcher = watcher;
        let (mut held, mut change) = (first, 0);
        while events.recv().await.is_some() {
            let Some(now) = read(&path) else { continue };
            if now == held {
                continue;
            }
            change += 1;
            tx.send_replace(Arc::new(prepare(&now, Some(&held), change)));
            held = now;
        }
    });
    let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
    tonic::transport::Server::builder()
        // As ray-xds's xDS listener.
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        .max_concurrent_streams(Some(ray_xds::xds::server::MAX_STREAMS_PER_CONNECTION))
        .add_service(Floor(rx))
        .serve_with_incoming(
            // As ray-xds's listener: no Nagle delay on what is pushed.
            tokio_stream::StreamExt::map(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                |conn| {
                    if let Ok(c) = &conn {
                        let _ = c.set_nodelay(true);
                    }
                    conn
                },
            ),
        )
        .await
        .unwrap();
}

#[derive(Clone)]
struct Floor(watch::Receiver<Arc<Prepared>>);

impl tonic::server::NamedService for Floor {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

impl tower::Service<http::Request<tonic::body::Body>> for Floor {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let (tx, rx) = mpsc::channel(16);
        let protocol = match request.uri().path() {
            SOTW_PATH => Some(0),
            DELTA_PATH => Some(1),
            _ => None,
        };
        if let Some(protocol) = protocol {
            tokio::spawn(stream(protocol, request.into_body(), tx, self.0.clone()));
        }
        let mut response = http::Response::new(tonic::body::Body::new(Framed { rx, ended: false }));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        std::future::ready(Ok(response))
    }
}

/// Of a `DiscoveryRequest`, only what the floor reads (the rest, resource names
/// included, is skipped unread).
#[derive(Clone, PartialEq, prost::Message)]
struct SotwAsked {
    #[prost(string, tag = "4")]
    type_url: String,
    #[prost(string, tag = "5")]
    response_nonce: String,
}

/// Of a `DeltaDiscoveryRequest`, only what the floor reads.
#[derive(Clone, PartialEq, prost::Message)]
struct DeltaAsked {
    #[prost(string, tag = "2")]
    type_url: String,
    #[prost(string, tag = "6")]
    response_nonce: String,
}

/// The type each request of a stream asks for, and whether it is a first request
/// (no nonce: not an ACK or NACK).
fn asked(protocol: usize, message: &[u8]) -> Option<(usize, bool)> {
    let (type_url, nonce) = if protocol == 0 {
        let r = SotwAsked::decode(message).ok()?;
        (r.type_url, r.response_nonce)
    } else {
        let r = DeltaAsked::decode(message).ok()?;
        (r.type_url, r.response_nonce)
    };
    Some((TYPES.iter().position(|t| *t == type_url)?, nonce.is_empty()))
}

async fn stream(
    protocol: usize,
    mut body: tonic::body::Body,
    tx: mpsc::Sender<Bytes>,
    mut prepared: watch::Receiver<Arc<Prepared>>,
) {
    let mut subscribed = [false; 4];
    let mut buf = BytesMut::new();
    prepared.mark_unchanged();
    loop {
        tokio::select! {
            frame = body.frame() => {
                let Some(Ok(frame)) = frame else { return };
                let Ok(data) = frame.into_data() else { continue };
                buf.extend_from_slice(&data);
                while buf.len() >= 5 {
                    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                    if buf.len() < 5 + len {
                        break;
                    }
                    let message = buf.split_to(5 + len);
                    let Some((ty, first)) = asked(protocol, &message[5..]) else { return };
                    if first && !std::mem::replace(&mut subscribed[ty], true) {
                        let answer = prepared.borrow().first[protocol][ty].clone();
                        if tx.send(answer).await.is_err() {
                            return;
                        }
                    }
                }
            }
            changed = prepared.changed() => {
                if changed.is_err() {
                    return;
                }
                let p = prepared.borrow_and_update().clone();
                for (ty, push) in p.push[protocol].iter().enumerate() {
                    if let (true, Some(push)) = (subscribed[ty], push) {
                        if tx.send(push.clone()).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// A response body of framed messages from a stream's channel (it never ends on its own).
struct Framed {
    rx: mpsc::Receiver<Bytes>,
    ended: bool,
}

impl http_body::Body for Framed {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(bytes)) => Poll::Ready(Some(Ok(http_body::Frame::data(bytes)))),
            Poll::Ready(None) => {
                self.ended = true;
                let mut trailers = http::HeaderMap::new();
                let _ = tonic::Status::ok("").add_header(&mut trailers);
                Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

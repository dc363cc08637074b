//! Envoy's Client Status Discovery Service (`envoy.service.status.v3`) on the xDS port:
//! what each connected Envoy holds, resource by resource, against the snapshot served now,
//! for tools that speak CSDS (as `/debug/clients?stream=ID` shows it in JSON).
//!
//! Invariants:
//! - a request's node matchers (OR) select clients by node id (exact, prefix, suffix,
//!   contains; `ignore_case` folds ASCII, as Envoy does); a matcher this server cannot
//!   evaluate (a regex, node metadata, an empty or missing pattern) is refused whole
//!   (`INVALID_ARGUMENT`), never read as "match all"; at most [`MAX_MATCHERS`] of at most
//!   [`MAX_PATTERN_BYTES`] each;
//! - requests are read as ADS's are (bounded in size, sharing the port's budget for
//!   requests not yet whole, a first request due within the codec's timeout), and a call
//!   counts as a stream of its connection, so the connection is not idle meanwhile;
//! - an answer is built one client at a time on a blocking thread and holds at most
//!   [`MAX_RESPONSE_BYTES`]: a client too big to fit is left out and the next tried; the
//!   response metadata of `FetchClientStatus` says how many matched
//!   (`ray-xds-clients-matched`) and how many it holds (`ray-xds-clients-shown`);
//! - at most [`AT_ONCE`] answers exist at once, from the start of their building until the
//!   connection has taken their last byte, or [`TAKEN_WITHIN`] passed (then the rest of
//!   the answer is dropped and the call ends in `DEADLINE_EXCEEDED`): more calls are
//!   refused (`RESOURCE_EXHAUSTED`); a stream is answered at most once per
//!   [`STREAM_INTERVAL`].

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
use envoy_types::pb::envoy::r#type::matcher::v3::{NodeMatcher, StringMatcher};
use envoy_types::pb::envoy::service::status::v3::{ClientStatusRequest, ClientStatusResponse};
use prost::Message;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tonic::server::NamedService;
use tonic::Status;

use super::codec::{frame, PartialRequests, RequestStream};
use crate::{Clients, Snapshot};

const FETCH_PATH: &str = "/envoy.service.status.v3.ClientStatusDiscoveryService/FetchClientStatus";
const STREAM_PATH: &str =
    "/envoy.service.status.v3.ClientStatusDiscoveryService/StreamClientStatus";

/// The most bytes one answer holds: gRPC clients take 4 MiB by default.
pub const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024 - 64 * 1024;

/// Answers that exist at once (being built or being sent).
pub const AT_ONCE: usize = 2;

/// How long the connection has to take an answer whole.
pub const TAKEN_WITHIN: Duration = Duration::from_secs(30);

/// The least time between two answers on one stream.
pub const STREAM_INTERVAL: Duration = Duration::from_secs(1);

/// Node matchers in one request, and bytes in one pattern.
pub const MAX_MATCHERS: usize = 64;
pub const MAX_PATTERN_BYTES: usize = 1024;

/// The largest request read: matchers only.
const MAX_REQUEST_BYTES: usize = 128 * 1024;

/// An answer leaves the task in slices of this size, so what the connection has not
/// taken stays with the task (and goes when the task gives up).
const SLICE: usize = 64 * 1024;

/// The CSDS service of `clients` against the snapshots served (the tower service
/// `tonic::transport::Server::add_service` takes).
#[derive(Clone)]
pub struct Csds {
    clients: Arc<Clients>,
    snapshots: watch::Receiver<Option<Arc<Snapshot>>>,
    at_once: Arc<Semaphore>,
    partial: PartialRequests,
}

impl Csds {
    pub fn new(clients: Arc<Clients>, snapshots: watch::Receiver<Option<Arc<Snapshot>>>) -> Csds {
        Csds {
            clients,
            snapshots,
            at_once: Arc::new(Semaphore::new(AT_ONCE)),
            partial: PartialRequests::new(MAX_REQUEST_BYTES),
        }
    }

    /// Reads requests within the budget the port's other services share.
    pub fn with_partial_requests(mut self, partial: PartialRequests) -> Csds {
        self.partial = partial;
        self
    }

    /// A place for one answer, or why not.
    fn place(&self) -> Result<OwnedSemaphorePermit, Status> {
        self.at_once.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "{AT_ONCE} client status answers are being built or sent; retry later"
            ))
        })
    }

    /// The answer to `request` and how many clients matched, built on a blocking thread.
    async fn answer(
        &self,
        request: ClientStatusRequest,
    ) -> Result<(ClientStatusResponse, usize), Status> {
        let matchers = Matchers::of(&request)?;
        let (clients, snapshot) = (self.clients.clone(), self.snapshots.borrow().clone());
        tokio::task::spawn_blocking(move || build(&clients, snapshot.as_deref(), &matchers))
            .await
            .map_err(|e| Status::internal(format!("building the answer: {e}")))
    }

    /// Answers one `FetchClientStatus` call; `counts` gets how many clients matched and
    /// how many the answer holds, before the answer is sent.
    async fn fetch(
        self,
        mut inbound: RequestStream<ClientStatusRequest>,
        tx: mpsc::Sender<Result<Bytes, Status>>,
        counts: tokio::sync::oneshot::Sender<(usize, usize)>,
    ) {
        let result = async {
            let request = inbound
                .message()
                .await?
                .ok_or_else(|| Status::invalid_argument("no request"))?;
            let place = self.place()?;
            let (response, matched) = self.answer(request).await?;
            Ok((response, matched, place))
        }
        .await;
        match result {
            Ok((response, matched, place)) => {
                let _ = counts.send((matched, response.config.len()));
                send(&tx, &response, place).await;
            }
            Err(status) => {
                let _ = tx.send(Err(status)).await;
            }
        }
    }

    /// Answers each request of one `StreamClientStatus` call, at most one per
    /// [`STREAM_INTERVAL`].
    async fn stream(
        self,
        mut inbound: RequestStream<ClientStatusRequest>,
        tx: mpsc::Sender<Result<Bytes, Status>>,
    ) {
        loop {
            let next = tokio::time::Instant::now() + STREAM_INTERVAL;
            let answered = async {
                let Some(request) = inbound.message().await? else {
                    return Ok(false);
                };
                let place = self.place()?;
                let (response, _) = self.answer(request).await?;
                Ok::<_, Status>(send(&tx, &response, place).await)
            }
            .await;
            match answered {
                Ok(true) => tokio::time::sleep_until(next).await,
                Ok(false) => return,
                Err(status) => {
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            }
        }
    }
}

/// Sends `response` in slices while holding `place`; false when the connection did not
/// take it whole within [`TAKEN_WITHIN`] (the call then ends) or went away.
async fn send(
    tx: &mpsc::Sender<Result<Bytes, Status>>,
    response: &ClientStatusResponse,
    place: OwnedSemaphorePermit,
) -> bool {
    let framed = frame(response);
    let sent = tokio::time::timeout(TAKEN_WITHIN, async {
        for at in (0..framed.len()).step_by(SLICE) {
            let slice = framed.slice(at..(at + SLICE).min(framed.len()));
            if tx.send(Ok(slice)).await.is_err() {
                return false;
            }
        }
        // Taken whole: the body holds at most the last slice; its place goes with the
        // next request, or the call's end.
        true
    })
    .await;
    drop(place);
    match sent {
        Ok(taken) => taken,
        Err(_) => {
            let _ = tx.try_send(Err(Status::deadline_exceeded(format!(
                "the answer was not taken whole within {TAKEN_WITHIN:?}"
            ))));
            false
        }
    }
}

/// The answer for `matchers`: one client at a time, at most [`MAX_RESPONSE_BYTES`].
fn build(
    clients: &Clients,
    snapshot: Option<&Snapshot>,
    matchers: &Matchers,
) -> (ClientStatusResponse, usize) {
    let mut response = ClientStatusResponse::default();
    let (mut matched, mut bytes) = (0, 0);
    for id in clients.stream_ids() {
        let Some(node) = clients.node_id_of(id) else {
            continue;
        };
        if !matchers.matches(&node) {
            continue;
        }
        matched += 1;
        let Some(config) = clients.client_config_of(id, snapshot) else {
            continue;
        };
        // The config, its tag and its length.
        let len = config.encoded_len() + 1 + 5;
        if bytes + len > MAX_RESPONSE_BYTES {
            continue;
        }
        bytes += len;
        response.config.push(config);
    }
    (response, matched)
}

/// A request's node matchers, checked and folded once.
#[derive(Debug)]
struct Matchers(Vec<NodeIdMatcher>);

#[derive(Debug)]
struct NodeIdMatcher {
    kind: Kind,
    pattern: String,
    ignore_case: bool,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Any,
    Exact,
    Prefix,
    Suffix,
    Contains,
}

impl Matchers {
    fn of(request: &ClientStatusRequest) -> Result<Matchers, Status> {
        if request.node_matchers.len() > MAX_MATCHERS {
            return Err(Status::invalid_argument(format!(
                "{} node matchers: at most {MAX_MATCHERS}",
                request.node_matchers.len()
            )));
        }
        request
            .node_matchers
            .iter()
            .map(NodeIdMatcher::of)
            .collect::<Result<_, _>>()
            .map(Matchers)
    }

    /// No matcher matches every node (CSDS: "all clients").
    fn matches(&self, node: &str) -> bool {
        self.0.is_empty() || self.0.iter().any(|m| m.matches(node))
    }
}

impl NodeIdMatcher {
    fn of(m: &NodeMatcher) -> Result<NodeIdMatcher, Status> {
        if !m.node_metadatas.is_empty() {
            return Err(Status::invalid_argument(
                "node_metadatas: ray-xds keeps no node metadata; match on node_id",
            ));
        }
        let Some(StringMatcher {
            ignore_case,
            match_pattern,
        }) = &m.node_id
        else {
            return Ok(NodeIdMatcher {
                kind: Kind::Any,
                pattern: String::new(),
                ignore_case: false,
            });
        };
        let (kind, pattern) = match match_pattern {
            Some(MatchPattern::Exact(p)) => (Kind::Exact, p),
            Some(MatchPattern::Prefix(p)) => (Kind::Prefix, p),
            Some(MatchPattern::Suffix(p)) => (Kind::Suffix, p),
            Some(MatchPattern::Contains(p)) => (Kind::Contains, p),
            None => {
                return Err(Status::invalid_argument(
                    "node_id: a matcher needs a pattern",
                ))
            }
            Some(_) => {
                return Err(Status::invalid_argument(
                    "node_id: only exact, prefix, suffix and contains matchers are supported",
                ))
            }
        };
        if pattern.is_empty() && !matches!(kind, Kind::Exact) {
            return Err(Status::invalid_argument(
                "node_id: an empty prefix, suffix or contains pattern is not allowed",
            ));
        }
        if pattern.len() > MAX_PATTERN_BYTES {
            return Err(Status::invalid_argument(format!(
                "node_id: a pattern of {} bytes; at most {MAX_PATTERN_BYTES}",
                pattern.len()
            )));
        }
        let pattern = if *ignore_case {
            pattern.to_ascii_lowercase()
        } else {
            pattern.clone()
        };
        Ok(NodeIdMatcher {
            kind,
            pattern,
            ignore_case: *ignore_case,
        })
    }

    fn matches(&self, node: &str) -> bool {
        let folded;
        let node = if self.ignore_case && node.bytes().any(|b| b.is_ascii_uppercase()) {
            folded = node.to_ascii_lowercase();
            folded.as_str()
        } else {
            node
        };
        let p = self.pattern.as_str();
        match self.kind {
            Kind::Any => true,
            Kind::Exact => node == p,
            Kind::Prefix => node.starts_with(p),
            Kind::Suffix => node.ends_with(p),
            Kind::Contains => node.contains(p),
        }
    }
}

impl NamedService for Csds {
    const NAME: &'static str = "envoy.service.status.v3.ClientStatusDiscoveryService";
}

impl tower::Service<http::Request<tonic::body::Body>> for Csds {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>,
    >;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let (tx, rx) = mpsc::channel(1);
        // The connection counts the call as a stream while its response lives.
        let (open, peer) = super::listener::XdsConnectInfo::of(&request);
        let path = request.uri().path().to_string();
        let inbound = RequestStream::new(
            request.into_body(),
            MAX_REQUEST_BYTES,
            self.partial.share(peer),
        );
        let this = self.clone();
        match path.as_str() {
            FETCH_PATH => {
                // The response's headers wait for the answer: they carry its counts.
                let (counts_tx, counts_rx) = tokio::sync::oneshot::channel();
                tokio::spawn(this.fetch(inbound, tx, counts_tx));
                return Box::pin(async move {
                    let counts = counts_rx.await.ok();
                    let mut response = super::grpc::grpc_response(rx, open);
                    if let Some((matched, shown)) = counts {
                        let headers = response.headers_mut();
                        headers.insert("ray-xds-clients-matched", matched.into());
                        headers.insert("ray-xds-clients-shown", shown.into());
                    }
                    Ok(response)
                });
            }
            STREAM_PATH => {
                tokio::spawn(this.stream(inbound, tx));
            }
            _ => {
                let _ = tx.try_send(Err(Status::unimplemented(format!("no method {path}"))));
            }
        }
        Box::pin(std::future::ready(Ok(super::grpc::grpc_response(rx, open))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_matcher(m: &NodeMatcher) -> Result<NodeIdMatcher, Status> {
        NodeIdMatcher::of(m)
    }

    fn node_matches(m: &NodeMatcher, node: &str) -> bool {
        NodeIdMatcher::of(m).unwrap().matches(node)
    }

    fn matcher(pattern: MatchPattern, ignore_case: bool) -> NodeMatcher {
        NodeMatcher {
            node_id: Some(StringMatcher {
                ignore_case,
                match_pattern: Some(pattern),
            }),
            node_metadatas: vec![],
        }
    }

    #[test]
    fn node_ids_match_as_envoy_s_string_matcher_says() {
        let id = "Gateway-7.ns";
        for (m, want) in [
            (
                matcher(MatchPattern::Exact("Gateway-7.ns".into()), false),
                true,
            ),
            (
                matcher(MatchPattern::Exact("gateway-7.ns".into()), false),
                false,
            ),
            (
                matcher(MatchPattern::Exact("gateway-7.ns".into()), true),
                true,
            ),
            (
                matcher(MatchPattern::Prefix("Gateway-".into()), false),
                true,
            ),
            (matcher(MatchPattern::Prefix("gw".into()), true), false),
            (matcher(MatchPattern::Suffix(".NS".into()), true), true),
            (matcher(MatchPattern::Suffix(".NS".into()), false), false),
            (matcher(MatchPattern::Contains("way-7".into()), false), true),
            (matcher(MatchPattern::Contains("WAY-7".into()), true), true),
            (matcher(MatchPattern::Exact(String::new()), false), false),
            (NodeMatcher::default(), true),
        ] {
            check_matcher(&m).unwrap();
            assert_eq!(node_matches(&m, id), want, "{m:?}");
        }
    }

    #[test]
    fn matchers_it_cannot_evaluate_are_refused_not_taken_for_all() {
        let regex = matcher(MatchPattern::SafeRegex(Default::default()), false);
        assert_eq!(
            check_matcher(&regex).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        for refused in [
            matcher(MatchPattern::Prefix(String::new()), false),
            matcher(MatchPattern::Suffix(String::new()), true),
            matcher(MatchPattern::Contains(String::new()), false),
            matcher(
                MatchPattern::Exact("x".repeat(MAX_PATTERN_BYTES + 1)),
                false,
            ),
            NodeMatcher {
                node_id: Some(StringMatcher::default()),
                ..Default::default()
            },
        ] {
            assert_eq!(
                check_matcher(&refused).unwrap_err().code(),
                tonic::Code::InvalidArgument,
                "{refused:?}"
            );
        }
        let too_many = ClientStatusRequest {
            node_matchers: vec![NodeMatcher::default(); MAX_MATCHERS + 1],
            ..Default::default()
        };
        assert_eq!(
            Matchers::of(&too_many).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        // ASCII folding only, as Envoy's: the Kelvin sign is not a K.
        assert!(!node_matches(
            &matcher(MatchPattern::Exact("k".into()), true),
            "\u{212A}"
        ));
        let metadata = NodeMatcher {
            node_metadatas: vec![Default::default()],
            ..Default::default()
        };
        assert_eq!(
            check_matcher(&metadata).unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }
}

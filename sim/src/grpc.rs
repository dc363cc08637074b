//! A simulated Ray Serve gRPC proxy, as Ray 2.60 runs one beside the HTTP proxy on every
//! node (port 9000 by default, when `grpc_options.grpc_servicer_functions` is set), for
//! tests, benchmarks and the demo.
//!
//! [`serve_grpc_proxy_with`] serves, over h2c (HTTP/2 with prior knowledge, no TLS), Ray's
//! own `ray.serve.RayServeAPIService` (`Healthz`, `ListApplications`) and one application
//! service, the demo's `ray_xds.demo.Echo` (`Say`, `SayMany`, `Chat`), whose answers say
//! which cluster, proxy, node type and application served them. [`pb`] holds the
//! generated messages, servers and clients (`build.rs` compiles `proto/`).
//!
//! Invariants:
//!
//! - Given the node's HTTP proxy's [`ProxyHandle`], one [`ProxyHandle::set`] changes both
//!   proxies and one [`Executions`](crate::Executions) ledger records what ran on either
//!   (a gRPC call under the gRPC listener's address). `Flapping` alternates gRPC `Healthz`
//!   on a count of its own (HTTP `/-/healthz` keeps its own).
//! - An application call is recorded under its `x-request-id` metadata exactly when it
//!   ran, before its first answer: not when it was turned away (`NotReady`, `Overloaded`,
//!   an unknown application), recorded when `ResetAfterRead` reset it. Every application
//!   call that reaches the gRPC layer counts in [`ProxyHandle::received`].
//! - Errors the proxy itself returns are trailers-only responses (HTTP 200, `grpc-status`
//!   in the only header block), as tonic sends every error returned before an answer.
//! - After `shutdown` nothing is accepted (the listener is closed, so connects are
//!   refused), calls in flight finish (at most 30 s), and connections held by `Hang` are
//!   closed.
//!
//! What each [`ProxyMode`] does, and where it comes from. "Ray" marks facts from Ray's
//! code and unit tests (`proto/ray-serve-grpc-research.md`, sections 1 and 2; nothing here
//! was captured from a running Ray with gRPC enabled), "inferred" what the simulator
//! chose:
//!
//! | mode | `Healthz` / `ListApplications` | application calls |
//! |---|---|---|
//! | `Serving` | `OK`, `message: "success"` / the application names (Ray; Ray also sets the details `success` on the `OK`, the simulator sets none) | served, recorded |
//! | `Draining` | `UNAVAILABLE` `This node is being drained.` (Ray) | served, recorded (Ray: draining does not turn calls away) |
//! | `NotReady` | `UNAVAILABLE` `Route table is not populated yet.` (Ray) | `UNAVAILABLE`, same text, not recorded (inferred, as the HTTP simulator's 503; from Ray's code, a real proxy with an empty route table finds no application and answers `NOT_FOUND` `Application ... not found`) |
//! | `Hang` | no answer | no answer (inferred: a SIGSTOPped process) |
//! | `Slow(d)` | answered after `d` | answered after `d`, recorded at once |
//! | `Flapping` | `Healthz` alternates `OK` / `INTERNAL` `flapping`; `ListApplications` `OK` (inferred) | served, recorded |
//! | `Overloaded` | `OK` | `RESOURCE_EXHAUSTED` with the text of Ray's `BackPressureError`, not recorded (Ray: backpressure maps to `RESOURCE_EXHAUSTED` since ray#54537; nothing ran) |
//! | `ResetAfterRead` | `OK` | the request is read to its end and recorded, then the stream is reset (`RST_STREAM` `INTERNAL_ERROR`) with no answer (inferred: a proxy dying mid-call) |
//!
//! - Application selection is Ray's (`ProxyRouter.get_handle_for_endpoint`): the
//!   `application` metadata names the application; with one application, every call goes
//!   to it whatever the metadata says; with several, a missing or unknown name gets
//!   `NOT_FOUND` `Application metadata not set. Ping
//!   /ray.serve.RayServeAPIService/ListApplications for available applications.` or
//!   `Application '<name>' not found. Ping ...` (Ray's texts). The service name plays no
//!   part (Ray): a method the application lacks is an application call that ran and got
//!   `UNIMPLEMENTED` (inferred: Ray's replica fails it).
//! - The applications are the distinct names in [`ProxyConfig::routes`], sorted;
//!   `ListApplications` lists them all, whatever their status (Ray lists the route table).
//! - Wire format of errors: **unverified for Ray.** The memo infers from Ray's code that
//!   Ray's proxy sets the code on the servicer context and returns, so its errors likely
//!   arrive as HTTP 200 with `grpc-status` in *trailers* after (empty) response headers;
//!   the simulator sends them trailers-only, as tonic does. Envoy retries and passive
//!   outlier detection see only a `grpc-status` in response headers, so the simulator is
//!   more visible to Envoy than Ray may be.
//! - `Hang`: a connection accepted while hung is held at the TCP level (the kernel's
//!   handshake done, no HTTP/2 preface or SETTINGS from the server), and a call arriving
//!   on an open connection is held before the gRPC layer sees it: nothing is counted,
//!   recorded or answered (unlike the HTTP simulator, which reads and records a request
//!   before hanging). When the mode changes, held connections and calls go on under the
//!   new mode, as a SIGCONT resumes a stopped process. A client's own deadline ends its
//!   call; the server does not act on `grpc-timeout` (tonic's transport server would
//!   answer `CANCELLED` on it, which a stopped process cannot).
//! - `Slow(d)` delays the whole call once, before its first answer (a stream's later
//!   answers keep their own pace).
//! - Ray answers streaming calls (unary-stream since 2.7; client and bidirectional
//!   streaming were added in 2026 and are not verified in the 2.60 wheel); the simulator
//!   serves all three of `Echo`'s kinds. Ray returns the request id as `request_id` trailing metadata;
//!   the simulator does not.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{Request, Response};
use futures_util::{Stream, StreamExt};
use hyper::body::Incoming;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};

use crate::{ProxyConfig, ProxyHandle, ProxyMode};

/// Code generated from `proto/` by `build.rs`: messages, servers and clients.
pub mod pb {
    /// Ray Serve's own API, `ray.serve.RayServeAPIService` (`Healthz`,
    /// `ListApplications`), wire-compatible with Ray 2.60.
    #[allow(clippy::all, missing_docs)]
    pub mod ray_serve {
        tonic::include_proto!("ray.serve");
    }
    /// The demo application, `ray_xds.demo.Echo` (`Say`, `SayMany`, `Chat`).
    #[allow(clippy::all, missing_docs)]
    pub mod demo {
        tonic::include_proto!("ray_xds.demo");
    }
}

use pb::demo::echo_server::{Echo, EchoServer};
use pb::demo::{SayManyRequest, SayRequest, Served};
use pb::ray_serve::ray_serve_api_service_server::{RayServeApiService, RayServeApiServiceServer};
use pb::ray_serve::{
    HealthzRequest, HealthzResponse, ListApplicationsRequest, ListApplicationsResponse,
};

/// The gRPC path of `Healthz`, as Ray's proxy recognises it.
pub const HEALTHZ_PATH: &str = "/ray.serve.RayServeAPIService/Healthz";
/// The gRPC path of `ListApplications`.
pub const LIST_APPLICATIONS_PATH: &str = "/ray.serve.RayServeAPIService/ListApplications";
/// The metadata key that names the application a call is for (Ray's).
pub const APPLICATION_METADATA: &str = "application";
/// The metadata key a call is recorded under in the ledger (Envoy's request id, kept
/// across retries; Ray's own key is `request_id`).
pub const REQUEST_ID_METADATA: &str = "x-request-id";

/// `Healthz`'s message, and its details, on a healthy proxy (Ray's `HEALTHY_MESSAGE`).
pub const HEALTHY_MESSAGE: &str = "success";
/// The details of `UNAVAILABLE` while the node drains (Ray's `DRAINING_MESSAGE`).
pub const DRAINING_MESSAGE: &str = "This node is being drained.";
/// The details of `UNAVAILABLE` before the route table is populated (Ray's
/// `NO_ROUTES_MESSAGE`).
pub const NO_ROUTES_MESSAGE: &str = "Route table is not populated yet.";
/// The details of `RESOURCE_EXHAUSTED` under backpressure (the text of Ray's
/// `BackPressureError`, as the HTTP simulator's 503).
pub const BACKPRESSURE_MESSAGE: &str =
    "Request dropped due to backpressure (num_queued_requests=100, max_queued_requests=100).";

/// How often a hung connection or call looks whether the mode changed.
const HANG_POLL: Duration = Duration::from_millis(10);
/// The longest shutdown waits for calls in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// The applications a proxy serves: the distinct names in `config.routes`, sorted.
pub fn applications(config: &ProxyConfig) -> Vec<String> {
    let names: BTreeSet<&String> = config.routes.values().collect();
    names.into_iter().cloned().collect()
}

/// The application a call goes to, as Ray's proxy picks it from the `application`
/// metadata (`requested`): with one application, that one whatever was asked; with
/// several, the one named exactly, else `NOT_FOUND` with Ray's text.
pub fn select_application<'a>(
    applications: &'a [String],
    requested: Option<&str>,
) -> Result<&'a str, Status> {
    if let [only] = applications {
        return Ok(only);
    }
    let requested = requested.filter(|name| !name.is_empty());
    if let Some(app) = requested.and_then(|name| applications.iter().find(|a| *a == name)) {
        return Ok(app);
    }
    let what = match requested {
        None => "Application metadata not set.".to_string(),
        Some(name) => format!("Application '{name}' not found."),
    };
    Err(Status::not_found(format!(
        "{what} Ping /ray.serve.RayServeAPIService/ListApplications for available applications."
    )))
}

/// What a node's gRPC proxy knows about itself.
struct Node {
    config: ProxyConfig,
    address: SocketAddr,
    applications: Vec<String>,
    handle: ProxyHandle,
}

/// Which application a call was routed to; set before the application's handler runs.
#[derive(Clone, Debug)]
struct SelectedApp(String);

/// Serves the gRPC proxy of the node whose behaviour `handle` controls on `listener`, over
/// h2c, until `shutdown`: then it stops accepting (later connects are refused) and lets
/// calls in flight finish, for at most 30 s. Give it the node's HTTP proxy's handle
/// ([`serve_proxy_with`](crate::serve_proxy_with)) so that both follow one mode and
/// record into one ledger.
pub async fn serve_grpc_proxy_with(
    listener: TcpListener,
    config: ProxyConfig,
    handle: ProxyHandle,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let address = listener.local_addr()?;
    let node = Arc::new(Node {
        applications: applications(&config),
        config,
        address,
        handle,
    });
    let routes = tonic::service::Routes::new(RayServeApiServiceServer::new(RayServeApi {
        node: node.clone(),
    }))
    .add_service(EchoServer::new(EchoApp { node: node.clone() }))
    .prepare();
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(
            stream,
            node.clone(),
            routes.clone(),
            graceful.watcher(),
            shutdown.clone(),
        ));
    }
    drop(listener);
    // Calls in flight finish (a hung one does not hold shutdown forever).
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await;
    Ok(())
}

/// One accepted connection: held while the proxy hangs, then served over HTTP/2.
async fn serve_connection(
    stream: TcpStream,
    node: Arc<Node>,
    routes: tonic::service::Routes,
    watcher: hyper_util::server::graceful::Watcher,
    shutdown: CancellationToken,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

    // A stopped process: the kernel accepted the connection, nothing reads it.
    while node.handle.get() == ProxyMode::Hang {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(HANG_POLL) => {}
        }
    }
    if shutdown.is_cancelled() {
        return;
    }
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let (node, routes) = (node.clone(), routes.clone());
        async move { call(&node, routes, request).await }
    });
    let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .serve_connection(TokioIo::new(stream), service);
    let _ = watcher.watch(connection).await;
}

/// Why a call's stream was reset instead of answered.
#[derive(Debug)]
struct ResetStream;

impl std::fmt::Display for ResetStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("resetting the stream without an answer")
    }
}

impl std::error::Error for ResetStream {}

/// One call: the proxy's own part (mode, application selection, ledger), then the
/// service. An error resets the stream (hyper sends `RST_STREAM` `INTERNAL_ERROR`).
async fn call(
    node: &Node,
    routes: tonic::service::Routes,
    request: Request<Incoming>,
) -> Result<Response<tonic::body::Body>, ResetStream> {
    use tower::ServiceExt;

    // A stopped process: the call is held before the gRPC layer sees it.
    while node.handle.get() == ProxyMode::Hang {
        tokio::time::sleep(HANG_POLL).await;
    }
    let mode = node.handle.get();
    let admission = admit(node, &mode, request).await;
    if let ProxyMode::Slow(delay) = mode {
        tokio::time::sleep(delay).await;
    }
    match admission {
        Admission::Answer(response) => Ok(response),
        Admission::Reset => Err(ResetStream),
        Admission::Serve(request) => {
            Ok(routes.oneshot(request).await.unwrap_or_else(|e| match e {}))
        }
    }
}

/// What the proxy does with a call before the service sees it.
enum Admission {
    /// The proxy answers it itself (an error).
    Answer(Response<tonic::body::Body>),
    /// The call ran; its stream is reset without an answer.
    Reset,
    /// The service answers it.
    Serve(Request<Incoming>),
}

/// The proxy's own part of a call in `mode`: counts and records an application call,
/// routes it to its application ([`SelectedApp`]) or turns it away.
async fn admit(node: &Node, mode: &ProxyMode, mut request: Request<Incoming>) -> Admission {
    let path = request.uri().path();
    let handle = &node.handle;
    if matches!(path, HEALTHZ_PATH | LIST_APPLICATIONS_PATH) {
        return match mode {
            ProxyMode::Draining => Admission::Answer(status(Code::Unavailable, DRAINING_MESSAGE)),
            ProxyMode::NotReady => Admission::Answer(status(Code::Unavailable, NO_ROUTES_MESSAGE)),
            ProxyMode::Flapping if path == HEALTHZ_PATH => {
                let n = handle.grpc_healthz_requests.fetch_add(1, Ordering::Relaxed);
                if n.is_multiple_of(2) {
                    Admission::Serve(request)
                } else {
                    Admission::Answer(status(Code::Internal, "flapping"))
                }
            }
            _ => Admission::Serve(request),
        };
    }
    handle.received.fetch_add(1, Ordering::Relaxed);
    if *mode == ProxyMode::NotReady {
        return Admission::Answer(status(Code::Unavailable, NO_ROUTES_MESSAGE));
    }
    let requested = request
        .headers()
        .get(APPLICATION_METADATA)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let app = match select_application(&node.applications, requested.as_deref()) {
        Ok(app) => app.to_string(),
        Err(not_found) => return Admission::Answer(not_found.into_http()),
    };
    if *mode == ProxyMode::Overloaded {
        return Admission::Answer(status(Code::ResourceExhausted, BACKPRESSURE_MESSAGE));
    }
    let request_id = request
        .headers()
        .get(REQUEST_ID_METADATA)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if *mode == ProxyMode::ResetAfterRead {
        use http_body_util::BodyExt;
        // The whole request (every message, to the client's end of stream) is read: the
        // call ran.
        let _ = request.into_body().collect().await;
        if let Some(id) = &request_id {
            handle.executions.record(id, node.address);
        }
        return Admission::Reset;
    }
    if let Some(id) = &request_id {
        handle.executions.record(id, node.address);
    }
    request.extensions_mut().insert(SelectedApp(app));
    Admission::Serve(request)
}

/// A trailers-only error response, as tonic sends errors.
fn status(code: Code, message: &str) -> Response<tonic::body::Body> {
    Status::new(code, message).into_http()
}

/// `ray.serve.RayServeAPIService` on a proxy that takes traffic (the modes that say
/// otherwise answered before the call got here).
struct RayServeApi {
    node: Arc<Node>,
}

#[tonic::async_trait]
impl RayServeApiService for RayServeApi {
    async fn list_applications(
        &self,
        _: tonic::Request<ListApplicationsRequest>,
    ) -> Result<tonic::Response<ListApplicationsResponse>, Status> {
        Ok(tonic::Response::new(ListApplicationsResponse {
            application_names: self.node.applications.clone(),
        }))
    }

    async fn healthz(
        &self,
        _: tonic::Request<HealthzRequest>,
    ) -> Result<tonic::Response<HealthzResponse>, Status> {
        Ok(tonic::Response::new(HealthzResponse {
            message: HEALTHY_MESSAGE.into(),
        }))
    }
}

/// The demo application, `ray_xds.demo.Echo`: every answer says who served it.
struct EchoApp {
    node: Arc<Node>,
}

type Answers = Pin<Box<dyn Stream<Item = Result<Served, Status>> + Send + 'static>>;

impl EchoApp {
    /// The application [`call`] routed the call to.
    fn app<T>(request: &tonic::Request<T>) -> Result<String, Status> {
        request
            .extensions()
            .get::<SelectedApp>()
            .map(|a| a.0.clone())
            .ok_or_else(|| Status::internal("no application was selected for this call"))
    }

    /// Makes the answers of a call to `app`.
    fn server(&self, app: String) -> impl Fn(String, u32) -> Served + Send + Sync + 'static {
        let node = self.node.clone();
        move |text, index| Served {
            cluster: node.config.cluster.clone(),
            proxy: node.address.to_string(),
            node_type: node.config.node_type.as_str().into(),
            app: app.clone(),
            text,
            index,
        }
    }
}

#[tonic::async_trait]
impl Echo for EchoApp {
    async fn say(
        &self,
        request: tonic::Request<SayRequest>,
    ) -> Result<tonic::Response<Served>, Status> {
        let served = self.server(Self::app(&request)?);
        Ok(tonic::Response::new(served(request.into_inner().text, 0)))
    }

    type SayManyStream = Answers;

    async fn say_many(
        &self,
        request: tonic::Request<SayManyRequest>,
    ) -> Result<tonic::Response<Answers>, Status> {
        let served = self.server(Self::app(&request)?);
        let SayManyRequest {
            text,
            count,
            every_ms,
        } = request.into_inner();
        let every = Duration::from_millis(every_ms.into());
        let answers = futures_util::stream::unfold(0u32, move |index| {
            let answer = (index < count).then(|| served(text.clone(), index));
            async move {
                let answer = answer?;
                if index > 0 {
                    tokio::time::sleep(every).await;
                }
                Some((Ok(answer), index + 1))
            }
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }

    type ChatStream = Answers;

    async fn chat(
        &self,
        request: tonic::Request<tonic::Streaming<SayRequest>>,
    ) -> Result<tonic::Response<Answers>, Status> {
        let served = self.server(Self::app(&request)?);
        let answers = request.into_inner().enumerate().map(move |(index, said)| {
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            said.map(|said| served(said.text, index))
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn one_application_takes_every_call() {
        let one = names(&["hello"]);
        assert_eq!(select_application(&one, None).unwrap(), "hello");
        assert_eq!(select_application(&one, Some("other")).unwrap(), "hello");
        assert_eq!(select_application(&one, Some("hello")).unwrap(), "hello");
    }

    #[test]
    fn several_applications_need_an_exact_name() {
        let two = names(&["a", "b"]);
        assert_eq!(select_application(&two, Some("b")).unwrap(), "b");
        let missing = select_application(&two, None).unwrap_err();
        assert_eq!(missing.code(), Code::NotFound);
        assert_eq!(
            missing.message(),
            "Application metadata not set. Ping /ray.serve.RayServeAPIService/ListApplications for available applications."
        );
        let unknown = select_application(&two, Some("c")).unwrap_err();
        assert_eq!(unknown.code(), Code::NotFound);
        assert_eq!(
            unknown.message(),
            "Application 'c' not found. Ping /ray.serve.RayServeAPIService/ListApplications for available applications."
        );
        assert!(select_application(&[], Some("a")).is_err());
    }

    #[test]
    fn applications_are_the_distinct_route_targets() {
        let config = ProxyConfig {
            cluster: "c".into(),
            node_type: crate::NodeType::Head,
            routes: BTreeMap::from([
                ("/b".to_string(), "b".to_string()),
                ("/a".to_string(), "b".to_string()),
                ("/".to_string(), "a".to_string()),
            ]),
        };
        assert_eq!(applications(&config), ["a", "b"]);
    }
}

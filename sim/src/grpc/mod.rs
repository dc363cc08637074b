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
//!   an unknown application), recorded when `ResetAfterRead` reset it. Every call to an
//!   application method that reaches the proxy counts in [`ProxyHandle::received`].
//! - Answers are framed as Ray 2.60 frames them (below, "Wire format"): a unary method's,
//!   errors included, is never trailers-only.
//! - After `shutdown` nothing is accepted (the listener is closed, so connects are
//!   refused), calls in flight finish (at most 30 s), and connections held by `Hang` are
//!   closed.
//!
//! What each [`ProxyMode`] does, and where it comes from. "captured N" marks what a real
//! Ray 2.60 was seen doing (`tests/fixtures/ray-serve-2.60/grpc/`, file N;
//! `proto/ray-serve-grpc-research.md`, section 7), "Ray" what Ray's code says (the memo,
//! sections 1 and 2), "inferred" what the simulator chose:
//!
//! | mode | `Healthz` / `ListApplications` | application calls |
//! |---|---|---|
//! | `Serving` | `OK`, `message: "success"` / the application names, both with `grpc-message: success` (captured 10, 11) | served, recorded |
//! | `Draining` | `UNAVAILABLE` `This node is being drained.` (captured 34) | served, recorded (captured 35, 36: draining turns no call away) |
//! | `NotReady` | `UNAVAILABLE` `Route table is not populated yet.` (captured, timeline-first-deploy.txt) | `NOT_FOUND` `Application '<name>' not found. Ping ...` (captured 28), or `Application metadata not set. Ping ...` without `application` metadata (Ray): the empty route table has no application, not even one that takes every call; not recorded |
//! | `NoReplicas` | `UNAVAILABLE` `No replicas are available yet.` (captured 32: a worker node's proxy before its node's replica is up) | held, unanswered, until the mode changes, then handled in the new mode; counted at once, recorded when it runs (inferred from captured 30, where a call to an application with no replica up waited for one) |
//! | `Hang` | no answer | no answer (inferred: a SIGSTOPped process) |
//! | `Slow(d)` | answered after `d` | answered after `d`, recorded at once |
//! | `Flapping` | `Healthz` alternates `OK` / `INTERNAL` `flapping`; `ListApplications` `OK` (inferred) | served, recorded |
//! | `Overloaded` | `OK` | `RESOURCE_EXHAUSTED` with the text of Ray's `BackPressureError`, not recorded (captured 23, 24; Ray's text gives the deployment's own queue limits, the simulator says 100) |
//! | `ResetAfterRead` | `OK` | the request is read to its end and recorded, then the stream is reset (`RST_STREAM` `INTERNAL_ERROR`) with no answer (inferred: a proxy dying mid-call; captured 38 shows a killed proxy's connection ending with a FIN, no reset) |
//!
//! - Application selection is Ray's (`ProxyRouter.get_handle_for_endpoint`; captured 13,
//!   21): the `application` metadata names the application; with one application, every
//!   call goes to it whatever the metadata says; with several, a missing or unknown name
//!   gets `NOT_FOUND` `Application metadata not set. Ping
//!   /ray.serve.RayServeAPIService/ListApplications for available applications.` or
//!   `Application '<name>' not found. Ping ...` (Ray's texts). The service name plays no
//!   part beyond naming a method the server has.
//! - A method no servicer registered (an unknown method or service, `grpc.health.v1`) gets
//!   grpc core's `UNIMPLEMENTED` `Method not found!` before Ray's proxy sees the call
//!   (captured 19, 26): not counted, not recorded.
//! - The applications are the distinct names in [`ProxyConfig::routes`], sorted;
//!   `ListApplications` lists them all, whatever their status (Ray lists the route table,
//!   DEPLOY_FAILED applications too, in deploy order: captured 20).
//! - Wire format (captured 10-34; the memo, section 7, §2.3). Every answer to a **unary**
//!   method (`Healthz`, `ListApplications`, `Say`), `OK` or error, is response headers
//!   (`:status 200`, `content-type: application/grpc`, `grpc-accept-encoding: identity,
//!   deflate, gzip`), one DATA frame with a message (on an error the empty message, the 5
//!   bytes `00 00 00 00 00`), then trailers with `grpc-status`, `grpc-message` and
//!   END_STREAM: never trailers-only, so Envoy's gRPC retry policy and passive outlier
//!   detection, which read a `grpc-status` in response headers, see none of Ray's unary
//!   errors. A **streaming** method (`SayMany`, `Chat`) that fails before its first message
//!   is answered trailers-only (HTTP 200, `content-type`, `grpc-status` and `grpc-message`
//!   in the only header block, END_STREAM), which Envoy does see; after messages its status
//!   is in trailers. `grpc-message` is always sent: `success` on an `OK` of `Healthz` and
//!   `ListApplications`, empty on an application's `OK`. Errors of grpc core itself are
//!   trailers-only for both kinds: `UNIMPLEMENTED` `Method not found!` (above) and
//!   `DEADLINE_EXCEEDED` `Deadline Exceeded` when a client's `grpc-timeout` runs out before
//!   the call is answered (captured 25). `grpc-message` is percent-encoded as grpc core
//!   does it, spaces and punctuation as they are (captured 18, 21). The simulator gets
//!   this by reframing tonic's answers, which are trailers-only for every error returned
//!   before an answer. Not
//!   reproduced: the `RST_STREAM(NO_ERROR)` grpc core sends after its `DEADLINE_EXCEEDED`;
//!   a stream still sending when its `grpc-timeout` runs out goes on (what Ray does then
//!   was not captured); the `request_id` trailer (below); grpc core's `0xfe03` setting and
//!   BDP pings. The connection's other SETTINGS are Ray's (4 MiB windows and frames, 16 KiB
//!   header lists), and the answers have no `date` header, as Ray's.
//! - `Hang`: a connection accepted while hung is held at the TCP level (the kernel's
//!   handshake done, no HTTP/2 preface or SETTINGS from the server), and a call arriving
//!   on an open connection is held before the gRPC layer sees it: nothing is counted,
//!   recorded or answered (unlike the HTTP simulator, which reads and records a request
//!   before hanging). When the mode changes, held connections and calls go on under the
//!   new mode, as a SIGCONT resumes a stopped process. A client's own deadline ends its
//!   call; the server does not act on `grpc-timeout` while hung (a stopped process
//!   cannot), and a held call's `grpc-timeout` counts from its arrival.
//! - `Slow(d)` delays the whole call once, before its first answer (a stream's later
//!   answers keep their own pace).
//! - Ray answers streaming calls: server streaming, and bidirectional in 2.60 (captured
//!   15, 16); the simulator serves all three of `Echo`'s kinds. Ray returns the request id
//!   as `request_id` trailing metadata on `OK` and on user-set statuses, the client's
//!   `request_id` metadata or a UUID of its own (captured 12, 14); the simulator does not,
//!   and records calls under `x-request-id`, which Ray ignores.

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

mod apps;
mod wire;

use apps::{EchoApp, RayServeApi};
use wire::{frame_like_ray, grpc_timeout, status, MethodKind};

/// Code generated from `proto/` by `build.rs`: messages, servers and clients.
pub mod pb {
    /// Ray Serve's own API, `ray.serve.RayServeAPIService` (`Healthz`,
    /// `ListApplications`), wire-compatible with Ray 2.60.
    #[allow(clippy::all, clippy::too_many_lines, missing_docs)]
    pub mod ray_serve {
        tonic::include_proto!("ray.serve");
    }
    /// The demo application, `ray_xds.demo.Echo` (`Say`, `SayMany`, `Chat`).
    #[allow(clippy::all, clippy::too_many_lines, missing_docs)]
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
/// The gRPC path of the demo's unary `Say`.
pub const SAY_PATH: &str = "/ray_xds.demo.Echo/Say";
/// The gRPC path of the demo's server-streaming `SayMany`.
pub const SAY_MANY_PATH: &str = "/ray_xds.demo.Echo/SayMany";
/// The gRPC path of the demo's bidirectional `Chat`.
pub const CHAT_PATH: &str = "/ray_xds.demo.Echo/Chat";
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
/// The details of `UNAVAILABLE` from a worker node's proxy before any replica is up (Ray's
/// `NO_REPLICAS_MESSAGE`).
pub const NO_REPLICAS_MESSAGE: &str = "No replicas are available yet.";
/// The details of grpc core's `UNIMPLEMENTED` for a method the server does not have.
pub const METHOD_NOT_FOUND_MESSAGE: &str = "Method not found!";
/// The details of grpc core's `DEADLINE_EXCEEDED` when a client's `grpc-timeout` ran out.
pub const DEADLINE_EXCEEDED_MESSAGE: &str = "Deadline Exceeded";
/// The `grpc-accept-encoding` of Ray's response headers (grpcio's).
pub const GRPC_ACCEPT_ENCODING: &str = "identity, deflate, gzip";
/// The details of `RESOURCE_EXHAUSTED` under backpressure (the text of Ray's
/// `BackPressureError`, as the HTTP simulator's 503).
pub const BACKPRESSURE_MESSAGE: &str =
    "Request dropped due to backpressure (num_queued_requests=100, max_queued_requests=100).";

/// The stream and connection windows and the largest frame Ray's gRPC server announces.
const RAY_WINDOW: u32 = 4 * 1024 * 1024;
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
    // Ray's (grpcio's) SETTINGS: 4 MiB windows and frames, 16 KiB of headers, no stream
    // limit; and no `date` header, which Ray's answers lack.
    let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .initial_stream_window_size(RAY_WINDOW)
        .initial_connection_window_size(RAY_WINDOW)
        .max_frame_size(RAY_WINDOW)
        .max_header_list_size(16 * 1024)
        .max_concurrent_streams(None)
        .auto_date_header(false)
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

/// One call: grpc core's part (a method the server lacks, the client's `grpc-timeout`),
/// the proxy's own (mode, application selection, ledger), then the service; the answer
/// framed as Ray frames it ([`frame_like_ray`]). An error resets the stream (hyper sends
/// `RST_STREAM` `INTERNAL_ERROR`).
async fn call(
    node: &Node,
    routes: tonic::service::Routes,
    request: Request<Incoming>,
) -> Result<Response<tonic::body::Body>, ResetStream> {
    use tower::ServiceExt;

    let arrived = tokio::time::Instant::now();
    // A stopped process: the call is held before the gRPC layer sees it.
    while node.handle.get() == ProxyMode::Hang {
        tokio::time::sleep(HANG_POLL).await;
    }
    let path = request.uri().path().to_owned();
    // grpc core answers a method no servicer registered; Ray's proxy never sees the call.
    let Some(kind) = MethodKind::of(&path) else {
        return Ok(status(Code::Unimplemented, METHOD_NOT_FOUND_MESSAGE));
    };
    let deadline = grpc_timeout(request.headers()).and_then(|t| arrived.checked_add(t));
    let answer = async {
        let (admission, mode) = admit(node, &path, request).await;
        if let ProxyMode::Slow(delay) = mode {
            tokio::time::sleep(delay).await;
        }
        match admission {
            Admission::Answer(response) => Ok(response),
            Admission::Reset => Err(ResetStream),
            Admission::Serve {
                request,
                slot,
                call,
            } => {
                tokio::time::sleep(call).await;
                let response = routes.oneshot(request).await.unwrap_or_else(|e| match e {});
                drop(slot);
                Ok(response)
            }
        }
    };
    let response = match deadline {
        None => answer.await?,
        Some(deadline) => match tokio::time::timeout_at(deadline, answer).await {
            Ok(answered) => answered?,
            // grpc core's, trailers-only whatever the method.
            Err(_) => return Ok(status(Code::DeadlineExceeded, DEADLINE_EXCEEDED_MESSAGE)),
        },
    };
    Ok(frame_like_ray(kind, &path, response))
}

/// What the proxy does with a call before the service sees it.
enum Admission {
    /// The proxy answers it itself (an error).
    Answer(Response<tonic::body::Body>),
    /// The call ran; its stream is reset without an answer.
    Reset,
    /// The service answers it, once the call has run for `call` on the replica's `slot`.
    Serve {
        request: Request<Incoming>,
        slot: Option<crate::capacity::Slot>,
        call: Duration,
    },
}

impl Admission {
    /// The service answers it, with no replica's time of its own (health and listing).
    fn serve(request: Request<Incoming>) -> Admission {
        Admission::Serve {
            request,
            slot: None,
            call: Duration::ZERO,
        }
    }
}

/// The proxy's own part of a call to `path`: counts and records an application call,
/// routes it to its application ([`SelectedApp`]) or turns it away. Also returns the mode
/// it was decided in (a call held by `NoReplicas` goes on in the next one).
async fn admit(node: &Node, path: &str, mut request: Request<Incoming>) -> (Admission, ProxyMode) {
    let handle = &node.handle;
    let mut mode = handle.get();
    if matches!(path, HEALTHZ_PATH | LIST_APPLICATIONS_PATH) {
        let admission = match mode {
            ProxyMode::Draining => Admission::Answer(status(Code::Unavailable, DRAINING_MESSAGE)),
            ProxyMode::ReplicaDraining => Admission::Answer(status(Code::Unavailable, "DRAINING")),
            ProxyMode::NotReady => Admission::Answer(status(Code::Unavailable, NO_ROUTES_MESSAGE)),
            ProxyMode::NoReplicas => {
                Admission::Answer(status(Code::Unavailable, NO_REPLICAS_MESSAGE))
            }
            ProxyMode::Flapping if path == HEALTHZ_PATH => {
                let n = handle.grpc_healthz_requests.fetch_add(1, Ordering::Relaxed);
                if n.is_multiple_of(2) {
                    Admission::serve(request)
                } else {
                    Admission::Answer(status(Code::Internal, "flapping"))
                }
            }
            _ => Admission::serve(request),
        };
        return (admission, mode);
    }
    handle.received.fetch_add(1, Ordering::Relaxed);
    // No replica up yet: the call waits in the proxy for one (the mode to change).
    while matches!(mode, ProxyMode::NoReplicas | ProxyMode::Hang) {
        tokio::time::sleep(HANG_POLL).await;
        mode = handle.get();
    }
    let requested = request
        .headers()
        .get(APPLICATION_METADATA)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    // An empty route table has no application, not even the one that takes every call.
    let applications: &[String] = if mode == ProxyMode::NotReady {
        &[]
    } else {
        &node.applications
    };
    let app = match select_application(applications, requested.as_deref()) {
        Ok(app) => app.to_string(),
        Err(not_found) => return (Admission::Answer(not_found.into_http()), mode),
    };
    if mode == ProxyMode::Overloaded {
        return (
            Admission::Answer(status(Code::ResourceExhausted, BACKPRESSURE_MESSAGE)),
            mode,
        );
    }
    // Its turn on the replicas, or Ray's backpressure when too many wait already.
    let (slot, call) = match handle.admit().await {
        crate::capacity::Admission::Run(slot, call) => (slot, call),
        crate::capacity::Admission::Refused(text) => {
            return (
                Admission::Answer(status(Code::ResourceExhausted, &text)),
                mode,
            )
        }
    };
    let request_id = request
        .headers()
        .get(REQUEST_ID_METADATA)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if mode == ProxyMode::ResetAfterRead {
        use http_body_util::BodyExt;
        // The whole request (every message, to the client's end of stream) is read: the
        // call ran.
        let _ = request.into_body().collect().await;
        if let Some(id) = &request_id {
            handle.executions.record(id, node.address);
        }
        return (Admission::Reset, mode);
    }
    if let Some(id) = &request_id {
        handle.executions.record(id, node.address);
    }
    request.extensions_mut().insert(SelectedApp(app));
    (
        Admission::Serve {
            request,
            slot,
            call,
        },
        mode,
    )
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

//! The probes: HTTP `GET /-/healthz` and `/-/routes` (bounded bodies), gRPC `Healthz`,
//! and how each failure is classified.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::*;

pub(super) async fn get(
    client: &HttpClient,
    address: SocketAddr,
    path: &str,
    timeout: Duration,
    max_body: usize,
) -> Result<(u16, Bytes), Outcome> {
    get_answer(client, address, path, timeout, max_body)
        .await
        .map_err(|failure| match failure {
            GetFailure::NoAnswer(outcome) | GetFailure::BodyOverCap(outcome) => outcome,
        })
}

/// Why a `GET` gave no status and body.
enum GetFailure {
    /// No whole answer: refused, reset, or not within the timeout.
    NoAnswer(Outcome),
    /// An answer whose body is over the cap.
    BodyOverCap(Outcome),
}

async fn get_answer(
    client: &HttpClient,
    address: SocketAddr,
    path: &str,
    timeout: Duration,
    max_body: usize,
) -> Result<(u16, Bytes), GetFailure> {
    let uri: hyper::Uri = match format!("http://{address}{path}").parse() {
        Ok(u) => u,
        Err(e) => {
            return Err(GetFailure::NoAnswer(Outcome::Failed(format!(
                "bad address: {e}"
            ))))
        }
    };
    let request = async {
        let response = client
            .get(uri)
            .await
            .map_err(|e| GetFailure::NoAnswer(classify(e)))?;
        let status = response.status().as_u16();
        // A proxy that answers an endless or huge body is not healthy, and must not
        // take ray-xds's memory with it.
        let body = Limited::new(response.into_body(), max_body)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    GetFailure::BodyOverCap(Outcome::Failed(format!(
                        "answered a body over {} KiB",
                        max_body >> 10
                    )))
                } else {
                    GetFailure::NoAnswer(Outcome::Failed(format!("reading the body: {e}")))
                }
            })?
            .to_bytes();
        Ok((status, body))
    };
    match tokio::time::timeout(timeout, request).await {
        Ok(result) => result,
        Err(_) => Err(GetFailure::NoAnswer(Outcome::Failed(format!(
            "no answer within {timeout:?}"
        )))),
    }
}

pub(super) fn classify(error: hyper_util::client::legacy::Error) -> Outcome {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return Outcome::Refused;
            }
        }
        source = e.source();
    }
    Outcome::Failed(format!(
        "{error}: {}",
        std::error::Error::source(&error)
            .map(|s| s.to_string())
            .unwrap_or_default()
    ))
}

/// The largest `/-/healthz` body a probe reads (64 KiB; Ray answers "success" or a
/// sentence): up to 256 probes read at once, so this bounds what they hold in flight.
pub(crate) const MAX_PROBE_BODY_BYTES: usize = 64 * 1024;

/// The largest `/-/routes` body read (256 KiB: hundreds of routes); a bigger one is read
/// as a malformed one (routes unknown).
pub const MAX_ROUTES_BODY_BYTES: usize = 256 * 1024;

/// The most `/-/routes` reads at once, over all proxies: each turn is held through the
/// read, the parse and the report queue until the manager has kept or refused the table,
/// so what reads cost in flight stays under 16 × (256 KiB and its table) however many
/// proxies answer big tables and however far the manager lags. Each cluster holds at most
/// its share of the turns (`live::route_turns`), so one cluster's slow reads never starve
/// another's. A read that does not get its turn within the probe timeout (or whose
/// cluster holds its share) is tried at the next probe.
pub(crate) const ROUTE_READS_AT_ONCE: usize = 16;

/// Whether a 503 (HTTP) or `UNAVAILABLE` (gRPC) health answer says the endpoint drains:
/// a proxy's `This node is being drained.`, an ingress replica's `DRAINING` (a replica
/// that stopped being a target and finishes what it holds).
pub(super) fn says_draining(message: &str) -> bool {
    message.contains("being drained") || message.trim() == "DRAINING"
}

/// One `GET /-/healthz`, classified.
pub async fn probe_healthz(client: &HttpClient, address: SocketAddr, timeout: Duration) -> Outcome {
    match get(client, address, "/-/healthz", timeout, MAX_PROBE_BODY_BYTES).await {
        Ok((200, body)) if &body[..] == b"success" => Outcome::Healthy,
        Ok((503, body)) if says_draining(&String::from_utf8_lossy(&body)) => Outcome::Draining,
        Ok((status, body)) => {
            let text = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
            Outcome::Failed(format!("healthz answered {status}: {text:?}"))
        }
        Err(outcome) => outcome,
    }
}

/// A lazily connecting gRPC channel to a Ray Serve gRPC proxy (plain HTTP/2).
pub fn grpc_channel(address: SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .expect("a socket address is a valid URI authority")
        .tcp_nodelay(true)
        .connect_lazy()
}

/// One `ray.serve.RayServeAPIService/Healthz`, classified like `GET /-/healthz`: OK with
/// `success` is healthy, `UNAVAILABLE` "This node is being drained." (or a replica's
/// `DRAINING`) is draining, a
/// refused connection is refused; anything else (another status or message, no answer
/// within `timeout`) is a failure.
pub async fn probe_grpc_healthz(channel: tonic::transport::Channel, timeout: Duration) -> Outcome {
    use crate::ray_serve_api::ray_serve_api_service_client::RayServeApiServiceClient;
    let mut client =
        RayServeApiServiceClient::new(channel).max_decoding_message_size(MAX_PROBE_BODY_BYTES);
    let call = client.healthz(crate::ray_serve_api::HealthzRequest {});
    match tokio::time::timeout(timeout, call).await {
        Err(_) => Outcome::Failed(format!("no answer within {timeout:?}")),
        Ok(Ok(answer)) if answer.get_ref().message == "success" => Outcome::Healthy,
        Ok(Ok(answer)) => {
            let message: String = answer.get_ref().message.chars().take(120).collect();
            Outcome::Failed(format!("Healthz answered OK with {message:?}"))
        }
        Ok(Err(status)) => {
            if refused(&status) {
                return Outcome::Refused;
            }
            if status.code() == tonic::Code::Unavailable && says_draining(status.message()) {
                return Outcome::Draining;
            }
            let message: String = status.message().chars().take(120).collect();
            Outcome::Failed(format!("Healthz answered {:?}: {message:?}", status.code()))
        }
    }
}

/// The call failed because nothing listens at the address.
pub(super) fn refused(status: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(status);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        source = e.source();
    }
    false
}

/// `GET /-/routes`: `Ok(Some(prefixes))`, the route prefixes the proxy serves;
/// `Ok(None)` when it answered something else (another status, not a table, over a cap:
/// its routes are unknown); `Err(NoRoutesAnswer)` when it did not answer whole in time (a
/// busy proxy): that says nothing of its routes, so whoever holds its last table keeps it.
pub async fn read_routes(
    client: &HttpClient,
    address: SocketAddr,
    timeout: Duration,
) -> Result<Option<BTreeSet<String>>, NoRoutesAnswer> {
    let (status, body) =
        match get_answer(client, address, "/-/routes", timeout, MAX_ROUTES_BODY_BYTES).await {
            Ok(answer) => answer,
            Err(GetFailure::BodyOverCap(_)) => return Ok(None),
            Err(GetFailure::NoAnswer(_)) => return Err(NoRoutesAnswer),
        };
    if status != 200 {
        return Ok(None);
    }
    Ok(parse_routes(&body))
}

/// A `/-/routes` read that got no whole answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRoutesAnswer;

/// The most route prefixes kept from one proxy's `/-/routes` (Ray lists one per
/// application with a route; real clusters have tens). A 1 MiB body listed ~87,000
/// keys, ~12 MB held per proxy, so 40 such proxies ran the process out of memory (the
/// body is now capped at [`MAX_ROUTES_BODY_BYTES`] too). An answer over the cap is malformed, as one that is
/// not JSON: the proxy's routes are unknown (`live::health` then drains it where routes
/// are enforced, as for any unreadable answer); its probe state is untouched.
pub(crate) const MAX_ROUTES: usize = 1_000;

/// The longest route prefix kept, in bytes (256; Serve's are short paths). A longer
/// one makes the whole answer malformed, as for [`MAX_ROUTES`].
pub const MAX_ROUTE_PREFIX_BYTES: usize = 256;

/// The route prefixes of a `/-/routes` body (a JSON object keyed by route prefix); `None`
/// when it is not one, or is over [`MAX_ROUTES`] or [`MAX_ROUTE_PREFIX_BYTES`].
pub fn parse_routes(body: &[u8]) -> Option<BTreeSet<String>> {
    serde_json::from_slice::<RouteKeys>(body)
        .ok()
        .map(|keys| keys.0)
}

/// The keys of a `/-/routes` object, within the caps. Values are skipped unbuilt and the
/// read stops at the first key over a cap, so an oversized answer never costs more than
/// the caps allow.
struct RouteKeys(BTreeSet<String>);

impl<'de> serde::Deserialize<'de> for RouteKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Keys;
        impl<'de> serde::de::Visitor<'de> for Keys {
            type Value = RouteKeys;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object keyed by route prefix")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RouteKeys, A::Error> {
                use serde::de::Error;
                let mut routes = BTreeSet::new();
                while let Some(prefix) = map.next_key::<String>()? {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    if prefix.len() > MAX_ROUTE_PREFIX_BYTES {
                        return Err(A::Error::custom(format!(
                            "a route prefix over {MAX_ROUTE_PREFIX_BYTES} bytes"
                        )));
                    }
                    routes.insert(prefix);
                    if routes.len() > MAX_ROUTES {
                        return Err(A::Error::custom(format!("more than {MAX_ROUTES} routes")));
                    }
                }
                Ok(RouteKeys(routes))
            }
        }
        deserializer.deserialize_map(Keys)
    }
}

/// The prober's HTTP client: one kept-alive connection per proxy, connects bounded by
/// the probe timeout. Tests and benchmarks use the same one.
///
/// The pool needs a timer to evict idle connections: without one, hyper-util checks an
/// idle connection only when the same address is asked for again, so every proxy that
/// went away (a new address with each upgrade or restarted pod) kept its closed
/// connection's channels in the pool for good, ~13 KiB each (found by the soak benchmark).
pub fn probe_client(timeout: Duration) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(timeout));
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1)
        // A kept-alive connection keeps its read buffer, which grows with the bodies read
        // (to ~400 KiB by default): 300 proxies answering big `/-/routes` held 0.6 MB
        // each. Bodies are read in chunks of at most this.
        .http1_max_buf_size(PROBE_READ_BUFFER_BYTES)
        .build(connector)
}

/// The most a probe connection buffers at once (bodies stream through it in chunks).
pub const PROBE_READ_BUFFER_BYTES: usize = 16 * 1024;

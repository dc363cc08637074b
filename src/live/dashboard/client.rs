//! Fetches dashboard answers over HTTP: pooled connections, a deadline per fetch, bodies
//! bounded in bytes, and a bound on the answers read and parsed at once over all clusters.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::*;

static READS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_READS_AT_ONCE);

/// One answer is parsed at a time: a parse near the body cap builds a JSON tree many
/// times the body's size, and only one such tree is alive at once.
static PARSES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// How long an idle pooled connection to a dashboard is kept. Below aiohttp's default
/// keep-alive (75 s), so the client does not race the dashboard closing it.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Fetches the Serve status from Ray dashboards, reusing connections.
#[derive(Debug, Clone)]
pub struct DashboardClient {
    client: Client<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
}

impl DashboardClient {
    /// A client whose every [`fetch`](Self::fetch) completes or fails within `timeout`.
    pub fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        // The timer evicts idle connections to dashboards that went away (see
        // `prober::probe_client`); without it they stayed in the pool for good.
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(2)
            // A pooled connection keeps its read buffer (up to ~400 KiB by default, grown
            // by big answers): bodies stream through 64 KiB at most.
            .http1_max_buf_size(64 * 1024)
            .build(connector);
        DashboardClient { client, timeout }
    }

    /// `GET {base_url}/api/serve/applications/` and parse the answer.
    ///
    /// `base_url` is the dashboard's address, e.g. `http://10.0.0.1:8265`; a trailing
    /// slash is ignored.
    pub async fn fetch(&self, base_url: &str) -> Result<ServeStatus, DashboardError> {
        let url = format!("{}{APPLICATIONS_PATH}", base_url.trim_end_matches('/'));
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e| DashboardError::Unreachable(format!("bad dashboard URL {url:?}: {e}")))?;
        let request = hyper::Request::get(uri)
            .header(hyper::header::ACCEPT, "application/json")
            .body(Empty::<Bytes>::new())
            .map_err(|e| DashboardError::Unreachable(format!("bad request for {url:?}: {e}")))?;

        // The wait for a turn is not part of the timeout: a read that got one has it all.
        let reading = READS.acquire().await.expect("never closed");
        let body = tokio::time::timeout(self.timeout, async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| DashboardError::Unreachable(error_chain(&e)))?;
            let peer = response
                .extensions()
                .get::<hyper_util::client::legacy::connect::HttpInfo>()
                .map(|info| info.remote_addr().ip());
            let status = response.status();
            if status != hyper::StatusCode::OK {
                return Err(DashboardError::Status(status.as_u16()));
            }
            let too_long = response
                .headers()
                .get(hyper::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|n| n > MAX_BODY_BYTES as u64);
            if too_long {
                return Err(body_too_large());
            }
            Limited::new(response.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
                .map(|collected| (collected.to_bytes(), peer))
                .map_err(|e| {
                    if e.downcast_ref::<LengthLimitError>().is_some() {
                        body_too_large()
                    } else {
                        DashboardError::Unreachable(format!(
                            "reading the body: {}",
                            error_chain(&*e)
                        ))
                    }
                })
        })
        .await
        .map_err(|_| DashboardError::Timeout)??;

        let (body, peer) = body;
        // Off the runtime's workers: parsing an answer near the body cap takes a while.
        // The read's turn is held until the body is parsed and freed: bodies waiting for
        // the parse count among the reads at once, so they stay bounded too.
        let parsing = PARSES.acquire().await.expect("never closed");
        let parsed = tokio::task::spawn_blocking(move || parse(&body)).await;
        drop((parsing, reading));
        let mut status = match parsed {
            Ok(parsed) => parsed?,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => return Err(DashboardError::Unreachable(format!("parse cancelled: {e}"))),
        };
        status.answered_from = peer;
        Ok(status)
    }
}

fn body_too_large() -> DashboardError {
    DashboardError::Malformed(format!("body over {} MiB", MAX_BODY_BYTES >> 20))
}

/// An error and its sources, `outer: inner: ...` (hyper's own messages are terse).
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

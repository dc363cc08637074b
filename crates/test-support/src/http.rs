//! HTTP from tests: requests through an Envoy's listener or to an admin port, ray-xds's
//! debug views read, metrics parsed, and `eventually`, the one way a test waits.
//!
//! Invariant: every wait has a deadline and says what it waited for when it fails.

use super::*;

fn client() -> &'static Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    static CLIENT: OnceLock<
        Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    > = OnceLock::new();
    CLIENT.get_or_init(|| Client::builder(TokioExecutor::new()).build_http())
}

/// One HTTP request; `Err` for a connection-level failure.
pub async fn http(method: &str, url: &str, body: &str) -> Result<(u16, String), String> {
    http_to_host(method, url, "demo.example", body).await
}

/// A request through Envoy's listener for `host`; `Some(served)` when a simulated proxy
/// answered.
pub async fn through_envoy_to(gateway_port: u16, host: &str) -> Option<Served> {
    let url = format!("http://127.0.0.1:{gateway_port}/hello");
    match http_to_host("POST", &url, host, "{\"x\":1}").await {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// One HTTP request with the given Host; `Err` for a connection-level failure.
pub async fn http_to_host(
    method: &str,
    url: &str,
    host: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let request = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("host", host)
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let response = tokio::time::timeout(Duration::from_secs(10), client().request(request))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}

/// A POST through Envoy's listener to `path`, given up after `timeout`.
pub async fn post_through_envoy(
    gateway_port: u16,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String), String> {
    let request = hyper::Request::builder()
        .method("POST")
        .uri(format!("http://127.0.0.1:{gateway_port}{path}"))
        .header("host", "demo.example")
        .body(Full::new(Bytes::from_static(b"{\"prompt\": \"hello\"}")))
        .map_err(|e| e.to_string())?;
    let response = tokio::time::timeout(timeout, async {
        let response = client().request(request).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, String::from_utf8_lossy(&bytes).into_owned()))
    })
    .await
    .map_err(|_| "timed out".to_string())??;
    Ok(response)
}

pub async fn http_get(url: &str) -> Result<(u16, String), String> {
    http("GET", url, "").await
}

/// A request through Envoy's listener; `Some(served)` when a simulated proxy answered.
pub async fn through_envoy(gateway_port: u16) -> Option<Served> {
    match http(
        "POST",
        &format!("http://127.0.0.1:{gateway_port}/hello"),
        "{\"x\":1}",
    )
    .await
    {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// Starts Envoy against ray-xds's xDS port and waits until a request through it reaches
/// a proxy; returns Envoy and its listener port.
pub async fn envoy_carrying_traffic(xds_port: u16, bootstrap: Bootstrap) -> (Envoy, u16) {
    let envoy = Envoy::start(bootstrap, xds_port);
    let port = envoy.gateway_port().await;
    eventually(
        "traffic flows through Envoy",
        Duration::from_secs(30),
        || async { through_envoy(port).await },
    )
    .await;
    (envoy, port)
}

/// Polls `check` until it returns `Some`, or panics with `what` after `deadline`.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of one Prometheus sample, e.g. `ray_xds_xds_nacks_total{protocol="sotw",type="lds"}`.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

pub async fn admin_get(admin: SocketAddr, path: &str) -> String {
    http_get(&format!("http://{admin}{path}"))
        .await
        .map(|(_, b)| b)
        .unwrap_or_default()
}

/// The weights the ray-xds whose admin is `admin` publishes for its first RayService
/// (`/debug/state`), `(cluster, percent)`; none while it does not answer.
pub async fn published_weights(admin: SocketAddr) -> Vec<(String, u64)> {
    let state: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/state").await).unwrap_or_default();
    state["rayservices"][0]["switchover"]["weights"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| Some((w[0].as_str()?.to_string(), w[1].as_u64()?)))
        .collect()
}

/// Whether every Envoy connected to the ray-xds whose admin is `admin` holds what it
/// serves now (`/debug/clients`, `in_sync`): what ray-xds's state says has reached them.
pub async fn every_envoy_in_sync(admin: SocketAddr) -> bool {
    let clients: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/clients").await).unwrap_or_default();
    clients["clients"]
        .as_array()
        .is_some_and(|c| !c.is_empty() && c.iter().all(|c| c["in_sync"] == true))
}

/// The refused proxies and replicas `/debug/state` shows, as `(address, reason label)`,
/// sorted.
pub async fn refused_proxies(admin: SocketAddr) -> Vec<(String, String)> {
    let state: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/state").await).unwrap_or_default();
    let mut out: Vec<(String, String)> = state["refused_proxies"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let field = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (field("address"), field("label"))
        })
        .collect();
    out.sort();
    out
}

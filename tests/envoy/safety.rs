//! Safe by default, with a real Envoy: a request that may have run is never sent again
//! unless the RayService says it is idempotent; Ray's backpressure (503) ejects no proxy
//! and its retries stay within a budget; a removed proxy finishes what it is running;
//! WebSockets and long server-sent event streams pass through.
//!
//! The simulated proxies record every request that reaches a replica under Envoy's
//! `x-request-id` (kept across retries), so "ran twice" is counted, not guessed. ray-xds's
//! own probes are slowed to a minute where a test wants Envoy alone to act.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ray_serve_sim::{NodeType, ProxyMode};
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

/// Two workers behind a real Envoy, with `extra` lines for the RayService.
async fn two_workers(extra: &str) -> (Stack, SimCluster) {
    let sim = SimCluster::start("a", &[NodeType::Worker, NodeType::Worker]).await;
    let stack = Stack::with(services_yaml_with("a", &[&sim], extra))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    sim.ledger.clear();
    (stack, sim)
}

/// Sends `n` POSTs one after another; how many got each status ("timeout", "error: ..."
/// for the rest).
async fn post_many(port: u16, n: usize, timeout: Duration) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let outcome = match post_through_envoy(port, "/infer", timeout).await {
            Ok((status, _)) => status.to_string(),
            Err(e) if e == "timed out" => "timeout".into(),
            Err(e) => format!("error: {e}"),
        };
        *out.entry(outcome).or_default() += 1;
    }
    out
}

const QUIET_PROBES: &str = "    probe: { interval: 60s }\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_reset_after_it_was_read_runs_once_unless_idempotent() {
    let (s, sim) = two_workers(QUIET_PROBES).await;
    sim.set_mode(0, ProxyMode::ResetAfterRead);
    let outcomes = post_many(s.gateway_port, 16, Duration::from_secs(10)).await;
    let on_resetting = sim.ledger.on(sim.proxies[0].0);
    assert!(
        on_resetting >= 1,
        "some requests reached the resetting proxy: {outcomes:?}"
    );
    assert_eq!(
        sim.ledger.more_than_once(),
        BTreeMap::new(),
        "nothing ran twice"
    );
    let failed: usize = outcomes
        .iter()
        .filter(|(k, _)| *k != "200")
        .map(|(_, n)| n)
        .sum();
    assert_eq!(
        failed, on_resetting,
        "each request the proxy reset after reading it ends in an error, not a replay: {outcomes:?}"
    );

    // Idempotent: the same reset is replayed on the other proxy, and every request succeeds.
    // Enough requests (about 64 retries) that a retry sent back to the proxy that just
    // reset it would show: with Envoy re-picking a host only 5 times, 5 runs in 6 failed.
    let extra = format!("{QUIET_PROBES}    traffic: {{ idempotent: true }}\n");
    let (s, sim) = two_workers(&extra).await;
    sim.set_mode(0, ProxyMode::ResetAfterRead);
    let outcomes = post_many(s.gateway_port, 128, Duration::from_secs(10)).await;
    assert_eq!(outcomes, BTreeMap::from([("200".to_string(), 128)]));
    let twice = sim.ledger.more_than_once();
    assert!(!twice.is_empty(), "replayed after the reset");
    for at in twice.values() {
        assert_eq!(
            at[0], sim.proxies[0].0,
            "first on the resetting proxy, then elsewhere"
        );
        assert!(at[1..].iter().all(|p| *p == sim.proxies[1].0), "{at:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_slower_than_the_per_try_timeout_runs_once_unless_idempotent() {
    let extra = format!("{QUIET_PROBES}    traffic: {{ per_try_timeout: 300ms }}\n");
    let (s, sim) = two_workers(&extra).await;
    sim.set_mode(0, ProxyMode::Slow(Duration::from_millis(1200)));
    let outcomes = post_many(s.gateway_port, 10, Duration::from_secs(10)).await;
    assert_eq!(
        outcomes,
        BTreeMap::from([("200".to_string(), 10)]),
        "a slow answer is an answer, not a timeout"
    );
    assert!(sim.ledger.on(sim.proxies[0].0) >= 1);
    assert_eq!(sim.ledger.more_than_once(), BTreeMap::new());

    let extra =
        format!("{QUIET_PROBES}    traffic: {{ per_try_timeout: 300ms, idempotent: true }}\n");
    let (s, sim) = two_workers(&extra).await;
    sim.set_mode(0, ProxyMode::Slow(Duration::from_millis(1200)));
    let outcomes = post_many(s.gateway_port, 10, Duration::from_secs(10)).await;
    assert_eq!(outcomes, BTreeMap::from([("200".to_string(), 10)]));
    // (Envoy's counts, not the execution ledger: the slow proxy records a request only
    // once its delay ends, and may never get there after Envoy resets the try.)
    let timed_out = envoy_stat(s.envoy(), "default/demo/a", "upstream_rq_per_try_timeout").await;
    let retried = envoy_stat(s.envoy(), "default/demo/a", "upstream_rq_retry").await;
    assert!(
        timed_out >= 1 && retried >= timed_out,
        "idempotent: a try that times out is tried again elsewhere ({timed_out} timed out, \
         {retried} retried; ledger {:?})",
        sim.ledger.more_than_once()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_on_a_hung_proxy_runs_once() {
    let (s, sim) = two_workers("").await;
    sim.set_mode(0, ProxyMode::Hang);
    // Enough requests that some land on the hung proxy before ray-xds takes it out.
    let mut requests = Vec::new();
    for _ in 0..8 {
        let port = s.gateway_port;
        requests.push(tokio::spawn(async move {
            // Longer than a per-try timeout would be (10 s): nothing replays it meanwhile.
            post_through_envoy(port, "/infer", Duration::from_secs(12)).await
        }));
    }
    let mut hung = 0;
    for r in requests {
        if r.await.unwrap().is_err() {
            hung += 1;
        }
    }
    let on_hung = sim.ledger.on(sim.proxies[0].0);
    assert_eq!(
        sim.ledger.more_than_once(),
        BTreeMap::new(),
        "nothing ran twice"
    );
    assert_eq!(
        hung, on_hung,
        "what hung ran once, on the hung proxy, and was not replayed"
    );
    // New requests go around it.
    eventually("the hung proxy leaves the rotation", DEADLINE, || async {
        let out = post_many(s.gateway_port, 5, Duration::from_secs(2)).await;
        (out.get("200") == Some(&5)).then_some(())
    })
    .await;
}

/// Envoy's counter `cluster.<cluster>.<stat>`, summed over its lines.
async fn envoy_stat(envoy: &Envoy, cluster: &str, stat: &str) -> u64 {
    let text = envoy.admin(&format!("/stats?filter={stat}$")).await;
    text.lines()
        .filter(|l| l.contains(cluster))
        .filter_map(|l| l.rsplit_once(": ")?.1.trim().parse::<u64>().ok())
        .sum()
}

/// Every proxy answers Ray's backpressure 503 while 16 clients send back to back for two
/// seconds, under `traffic` (the RayService's traffic policy, a flow map): checks that only
/// Ray's answers come back (never "no healthy upstream"), that no proxy is ejected and that
/// traffic is back at once when the 503s stop. Returns (requests sent, requests the
/// proxies saw, Envoy's retry overflows).
async fn overloaded_cluster(traffic: &str) -> (usize, u64, u64) {
    let sim = SimCluster::start("a", &[NodeType::Worker, NodeType::Worker, NodeType::Worker]).await;
    let extra = format!("{QUIET_PROBES}    traffic: {traffic}\n");
    let s = Stack::with(services_yaml_with("a", &[&sim], &extra))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    let received_before: u64 = sim.handles.iter().map(|h| h.received()).sum();
    for i in 0..3 {
        sim.set_mode(i, ProxyMode::Overloaded);
    }
    let stop = Instant::now() + Duration::from_secs(2);
    let mut clients = Vec::new();
    for _ in 0..16 {
        let port = s.gateway_port;
        clients.push(tokio::spawn(async move {
            let mut seen: BTreeMap<String, usize> = BTreeMap::new();
            while Instant::now() < stop {
                let key = match post_through_envoy(port, "/infer", Duration::from_secs(5)).await {
                    Ok((503, body)) if body.contains("backpressure") => "ray 503".to_string(),
                    Ok((status, body)) => format!("{status} {body}"),
                    Err(e) => e,
                };
                *seen.entry(key).or_default() += 1;
            }
            seen
        }));
    }
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for c in clients {
        for (k, n) in c.await.unwrap() {
            *seen.entry(k).or_default() += n;
        }
    }
    let sent: usize = seen.values().sum();
    assert_eq!(
        seen.keys().collect::<Vec<_>>(),
        ["ray 503"],
        "only Ray's own answers, never 'no healthy upstream': {seen:?}"
    );
    let received: u64 = sim.handles.iter().map(|h| h.received()).sum::<u64>() - received_before;
    eprintln!("backpressure under {traffic}: {sent} requests, the proxies saw {received}");
    let overflow = envoy_stat(s.envoy(), "default/demo/a", "upstream_rq_retry_overflow").await;
    let clusters = s.envoy().admin("/clusters").await;
    assert!(
        !clusters.contains("failed_outlier_check"),
        "no proxy ejected: {clusters}"
    );
    assert_eq!(
        envoy_stat(
            s.envoy(),
            "default/demo/a",
            "outlier_detection.ejections_enforced_total"
        )
        .await,
        0
    );
    // The 503s stop: traffic is back at once.
    for i in 0..3 {
        sim.set_mode(i, ProxyMode::Serving);
    }
    let out = post_many(s.gateway_port, 20, Duration::from_secs(5)).await;
    assert_eq!(out, BTreeMap::from([("200".to_string(), 20)]));
    (sent, received, overflow)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backpressure_ejects_no_proxy_and_each_request_is_tried_at_most_retries_plus_one_times() {
    // The default budget (100%, at least 1,000) does not bind here: it is sized so that a
    // burst of requests that never ran is always retried (tests/envoy/policy.rs), and the
    // price is that an overloaded deployment sees each request up to 1 + `retries` times.
    let (sent, received, overflow) = overloaded_cluster("{ retries: 3 }").await;
    assert!(
        received as usize <= sent * 4,
        "at most 1 + 3 tries a request: {received} seen for {sent} sent"
    );
    assert!(
        received as usize > sent * 2,
        "the retries ran: {received} seen for {sent} sent"
    );
    assert_eq!(overflow, 0, "the default budget turned no retry away");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tight_retry_budget_bounds_what_an_overloaded_deployment_sees() {
    // Envoy's own defaults (20%, at least 3), for a RayService that prefers bounding
    // overload to retrying every burst.
    let (sent, received, overflow) = overloaded_cluster(
        "{ retries: 3, retry_budget_percent: 20, retry_budget_min_concurrency: 3 }",
    )
    .await;
    assert!(
        (received as usize) < sent * 2,
        "retries bounded by the budget: {received} seen for {sent} sent"
    );
    assert!(overflow > 0, "the retry budget turned retries away");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_proxy_down_and_the_other_busy_never_leaves_no_healthy_upstream() {
    let (s, sim) = two_workers("").await;
    sim.kill(0);
    eventually("ray-xds takes the dead proxy out", DEADLINE, || async {
        let clusters = s.envoy().admin("/clusters").await;
        (!clusters.contains(&sim.proxies[0].0.to_string())).then_some(())
    })
    .await;
    sim.set_mode(1, ProxyMode::Overloaded);
    let busy = post_many(s.gateway_port, 10, Duration::from_secs(5)).await;
    sim.set_mode(1, ProxyMode::Serving);
    let after = post_many(s.gateway_port, 20, Duration::from_secs(5)).await;
    assert_eq!(
        busy,
        BTreeMap::from([("503".to_string(), 10)]),
        "Ray's own 503s"
    );
    assert_eq!(
        after,
        BTreeMap::from([("200".to_string(), 20)]),
        "and nothing after"
    );
    let clusters = s.envoy().admin("/clusters").await;
    assert!(!clusters.contains("failed_outlier_check"), "{clusters}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_removed_from_the_source_finishes_what_it_is_running() {
    let sim = SimCluster::start("a", &[NodeType::Worker, NodeType::Worker]).await;
    let yaml = services_yaml_with("a", &[&sim], "    head_proxy: include\n");
    let s = Stack::with(yaml.clone())
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    sim.set_mode(0, ProxyMode::Slow(Duration::from_millis(2000)));
    let mut requests = Vec::new();
    for _ in 0..6 {
        let port = s.gateway_port;
        requests.push(tokio::spawn(async move {
            post_through_envoy(port, "/infer", Duration::from_secs(10)).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The source drops the slow proxy while requests run on it.
    let gone = format!(
        "          - {{ address: {}, node_type: worker }}\n",
        sim.proxies[0].0
    );
    assert!(yaml.contains(&gone));
    s.edit(&yaml.replace(&gone, ""));
    eventually("Envoy drops the proxy", DEADLINE, || async {
        let clusters = s.envoy().admin("/clusters").await;
        (!clusters.contains(&sim.proxies[0].0.to_string())).then_some(())
    })
    .await;
    let mut statuses = Vec::new();
    for r in requests {
        statuses.push(r.await.unwrap().map(|(s, _)| s));
    }
    assert!(
        sim.ledger.on(sim.proxies[0].0) >= 1,
        "some ran on the removed proxy"
    );
    assert!(statuses.iter().all(|s| *s == Ok(200)), "{statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_passes_through_envoy() {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let (s, _sim) = two_workers("").await;
    let mut request = format!("ws://127.0.0.1:{}/chat", s.gateway_port)
        .into_client_request()
        .unwrap();
    request
        .headers_mut()
        .insert("host", "demo.example".parse().unwrap());
    let (mut socket, response) = tokio_tungstenite::connect_async(request)
        .await
        .expect("the upgrade passes through Envoy");
    assert_eq!(response.status(), 101);
    for i in 0..5 {
        socket
            .send(Message::Text(format!("hello {i}").into()))
            .await
            .unwrap();
        let echo = tokio::time::timeout(Duration::from_secs(5), socket.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(echo, Message::Text(format!("hello {i}").into()));
    }
}

/// A stream of server-sent events as long as a long generation passes through every
/// timeout on its way: Envoy's own 15 s route default (ray-xds sets no total deadline by
/// default), the stream idle timeout and the upstream connection's idle timeout. The idle
/// timeouts are set to 2 s here, a tenth of the 20 s stream, so the stream outlives each
/// of them many times over as a five-minute generation outlives the defaults (300 s and
/// 60 s) without a five-minute test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_outlives_every_timeout_through_envoy() {
    use http_body_util::BodyExt;
    assert_eq!(
        ray_xds::policy::traffic::TrafficPolicy::default().route_timeout,
        Duration::ZERO,
        "a long generation has no total deadline by default"
    );
    let sim = SimCluster::start("a", &[NodeType::Worker, NodeType::Worker]).await;
    let s = Stack::with(services_yaml_with("a", &[&sim], ""))
        .config(|c| {
            c.policies.traffic.stream_idle_timeout = Duration::from_secs(2);
            c.gateway.upstream_idle_timeout = Duration::from_secs(2);
        })
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    let request = hyper::Request::builder()
        .uri(format!(
            "http://127.0.0.1:{}/generate?sse=40&every_ms=500",
            s.gateway_port
        ))
        .header("host", "demo.example")
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http();
    let started = Instant::now();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let (mut text, mut events) = (String::new(), 0);
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("the stream is not cut");
        if let Some(data) = frame.data_ref() {
            text.push_str(&String::from_utf8_lossy(data));
            events = text.matches("data: ").count();
        }
    }
    assert_eq!(events, 40, "every event arrived");
    assert!(text.ends_with("data: 39\n\n"), "in order, to the end");
    assert!(started.elapsed() >= Duration::from_secs(19));
}

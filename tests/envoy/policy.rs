//! Traffic policy in a real Envoy, with ray-xds's own probes slowed to once a minute so
//! that only Envoy's retries, outlier detection and load balancing act: requests survive
//! a proxy that answers 503 (Ray's backpressure), one that is gone, and (idempotent ones)
//! one that hangs; a hung proxy stops being picked after its first request.

use std::time::Duration;

use ray_serve_sim::NodeType;
use ray_serve_sim::ProxyMode;
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

/// A stack over three simulated workers, probed only once a minute, with `traffic` as the
/// RayService's traffic policy and Envoy carrying traffic.
struct Setup {
    stack: Stack,
    sim: SimCluster,
}

impl std::ops::Deref for Setup {
    type Target = Stack;
    fn deref(&self) -> &Stack {
        &self.stack
    }
}

async fn start(traffic: &str) -> Setup {
    let sim = SimCluster::start(
        "demo-a",
        &[NodeType::Worker, NodeType::Worker, NodeType::Worker],
    )
    .await;
    let extra = format!("    probe: {{ interval: 60s }}\n    traffic: {traffic}\n");
    let stack = Stack::with(services_yaml_with("demo-a", &[&sim], &extra))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    Setup { stack, sim }
}

/// Waits until Envoy holds no connection to `proxy` of cluster `demo-a`.
async fn envoy_drops_its_connections_to(s: &Stack, proxy: std::net::SocketAddr) {
    eventually(
        "Envoy drops its connections to the proxy",
        DEADLINE,
        || async {
            let text = s.envoy().admin("/clusters").await;
            let line = format!("default/demo/demo-a::{proxy}::cx_active::0");
            text.lines().any(|l| l == line).then_some(())
        },
    )
    .await;
}

/// Sends `n` requests; returns how many failed and who served the rest.
async fn load(port: u16, n: usize) -> (usize, std::collections::BTreeMap<String, usize>) {
    let mut failed = 0;
    let mut by = std::collections::BTreeMap::new();
    for _ in 0..n {
        match through_envoy(port).await {
            Some(s) => *by.entry(s.proxy).or_default() += 1,
            None => failed += 1,
        }
    }
    (failed, by)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backpressured_proxy_is_retried_elsewhere() {
    let s = start("{ retries: 3 }").await;
    s.sim.set_mode(0, ProxyMode::Overloaded);
    let (failed, by) = load(s.gateway_port, 60).await;
    assert_eq!(failed, 0, "{by:?}");
    assert!(!by.contains_key(&s.sim.proxies[0].0.to_string()), "{by:?}");
    let stats = s.envoy().admin("/stats?filter=upstream_rq_retry$").await;
    let retries: u64 = stats
        .lines()
        .filter(|l| l.contains("demo-a"))
        .filter_map(|l| l.rsplit_once(": ")?.1.trim().parse::<u64>().ok())
        .sum();
    assert!(retries > 0, "Envoy retried: {stats}");
    drop(s);
}

/// Least request over every listed proxy (`FULL_SCAN`): a hung proxy keeps what it was
/// sent in flight, so once it holds one request it is never the least busy again, with
/// no probe and no ejection (ray-xds's probes here are once a minute; the same holds
/// while ray-xds is down). Requests go one at a time (a request still unanswered after
/// 500 ms is left in flight and the next one sent): Envoy's default, the less busy of two
/// picked at random (with replacement), would send the hung proxy about one in nine of
/// 80 (three proxies); the scan sends it at most the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_proxy_gets_no_more_than_its_first_request() {
    let s = start("{ retries: 3 }").await;
    let hung = s.sim.proxies[1].0;
    s.sim.set_mode(1, ProxyMode::Hang);
    let mut in_flight = vec![];
    for _ in 0..80 {
        let mut request = tokio::spawn(through_envoy(s.gateway_port));
        if tokio::time::timeout(Duration::from_millis(500), &mut request)
            .await
            .is_err()
        {
            in_flight.push(request);
        }
    }
    let clusters = s.envoy().admin("/clusters").await;
    let sent_to_hung: u64 = clusters
        .lines()
        .find_map(|l| l.strip_prefix(&format!("default/demo/demo-a::{hung}::rq_total::")))
        .and_then(|n| n.trim().parse().ok())
        .expect("the hung proxy's request count");
    assert!(
        sent_to_hung <= 2,
        "{sent_to_hung} of 80 went to the hung proxy ({} left unanswered)",
        in_flight.len()
    );
    for request in in_flight {
        request.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_request_to_a_hung_proxy_costs_one_per_try_timeout() {
    // Only for idempotent RayServices: the others get no per-try timeout (a try that
    // times out may be running; tests/envoy/safety.rs shows it is not replayed).
    let s = start("{ per_try_timeout: 300ms, idempotent: true }").await;
    s.sim.set_mode(1, ProxyMode::Hang);
    let started = std::time::Instant::now();
    let (failed, by) = load(s.gateway_port, 30).await;
    assert_eq!(failed, 0, "{by:?}");
    assert!(!by.contains_key(&s.sim.proxies[1].0.to_string()), "{by:?}");
    // Requests that met the hung proxy waited one per-try timeout, not the whole deadline.
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_proxy_is_retried_elsewhere_and_ejected() {
    let s = start("{ retries: 3 }").await;
    let dead = s.sim.proxies[2].0;
    s.sim.kill(2);
    // The sim's proxy closes its idle keep-alive connections as it dies; a request Envoy
    // writes on one at that very moment may have run and is not replayed (the safety
    // rule; tests/envoy/safety.rs). This test is about requests sent after the death:
    // they start once Envoy holds no connection to the dead proxy.
    envoy_drops_its_connections_to(&s, dead).await;
    let (failed, by) = load(s.gateway_port, 60).await;
    assert_eq!(failed, 0, "{by:?}");
    assert!(!by.contains_key(&dead.to_string()), "{by:?}");
    eventually("Envoy ejects the dead proxy", DEADLINE, || async {
        let text = s.envoy().admin("/clusters").await;
        let line = format!("default/demo/demo-a::{dead}::health_flags::");
        text.lines()
            .find(|l| l.starts_with(&line) && l.contains("failed_outlier_check"))
            .map(|_| ())
    })
    .await;
}

/// Stands in front of `target`, forwarding connections to it, until `stop` is cancelled;
/// then closes what it forwarded and, like a SIGSTOPped Ray proxy whose accept queue is
/// full, accepts nothing more (its listen backlog is 0: one connection fills the queue,
/// later connects time out). Returns its address.
async fn stoppable_in_front_of(
    target: std::net::SocketAddr,
    stop: tokio_util::sync::CancellationToken,
) -> std::net::SocketAddr {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut forwarded = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                accepted = listener.accept() => {
                    let Ok((mut inbound, _)) = accepted else { continue };
                    forwarded.spawn(async move {
                        let mut outbound = tokio::net::TcpStream::connect(target).await?;
                        tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await
                    });
                }
            }
        }
        forwarded.abort_all();
        // Held, never accepting again, for as long as the test runs.
        std::future::pending::<()>().await;
        drop(listener);
    });
    address
}

/// What a burst does under the traffic policy `traffic`: a hung proxy found by nobody
/// (ray-xds probes once a minute here, as when it is down) takes its share of 120
/// requests sent at once; they wait for connections that never complete, then fail
/// together at the connect timeout, with nothing else in flight. None of them ran, so
/// each should be retried on another proxy. Returns the requests that failed and the
/// cluster's retry stats.
async fn burst_on_a_stopped_proxy(traffic: &str) -> (usize, BurstStats) {
    let sim = SimCluster::start(
        "demo-a",
        &[NodeType::Worker, NodeType::Worker, NodeType::Worker],
    )
    .await;
    let stop = tokio_util::sync::CancellationToken::new();
    let behind = sim.proxies[1].0;
    let stoppable = stoppable_in_front_of(behind, stop.clone()).await;
    let yaml = services_yaml_with(
        "demo-a",
        &[&sim],
        &format!("    probe: {{ interval: 60s }}\n    traffic: {traffic}\n"),
    )
    .replace(
        &format!("address: {behind},"),
        &format!("address: {stoppable},"),
    );
    assert!(yaml.contains(&stoppable.to_string()), "{yaml}");
    let s = Stack::with(yaml).envoy(Bootstrap::Sotw).start().await;
    eventually("every proxy healthy in Envoy", DEADLINE, || async {
        let text = s.envoy().admin("/clusters").await;
        [sim.proxies[0].0, stoppable, sim.proxies[2].0]
            .iter()
            .all(|p| text.contains(&format!("::{p}::health_flags::healthy")))
            .then_some(())
    })
    .await;
    stop.cancel();
    envoy_drops_its_connections_to(&s, stoppable).await;
    // Fill its accept queue: from here on, a connect to it never completes.
    let mut fillers = Vec::new();
    for _ in 0..3 {
        if let Ok(Ok(c)) = tokio::time::timeout(
            Duration::from_millis(300),
            tokio::net::TcpStream::connect(stoppable),
        )
        .await
        {
            fillers.push(c);
        }
    }
    assert!(!fillers.is_empty(), "the queue took a connection");
    assert!(
        fillers.len() < 3,
        "a connect beyond the queue does not complete"
    );

    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..120 {
        let port = s.gateway_port;
        requests.spawn(async move { through_envoy(port).await });
    }
    let mut failed = 0;
    while let Some(served) = requests.join_next().await {
        if served.unwrap().is_none() {
            failed += 1;
        }
    }
    let stats = s
        .envoy()
        .admin("/stats?filter=demo-a.*(cx_connect_timeout|rq_retry$|rq_retry_overflow)")
        .await;
    let stat = |name: &str| -> u64 {
        stats
            .lines()
            .find(|l| l.ends_with(&format!("{name}: ")) || l.contains(&format!(".{name}: ")))
            .and_then(|l| l.rsplit_once(": ")?.1.trim().parse().ok())
            .unwrap_or(0)
    };
    let counts = BurstStats {
        connect_timeouts: stat("upstream_cx_connect_timeout"),
        retries: stat("upstream_rq_retry"),
        retries_refused: stat("upstream_rq_retry_overflow"),
        text: stats,
    };
    drop(fillers);
    (failed, counts)
}

#[derive(Debug)]
#[allow(dead_code)] // `text` is read through Debug, in failure messages.
struct BurstStats {
    connect_timeouts: u64,
    retries: u64,
    retries_refused: u64,
    text: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_on_a_proxy_that_stopped_accepting_are_all_retried() {
    // The default budget lets the whole burst through at once.
    let (failed, stats) = burst_on_a_stopped_proxy("{}").await;
    assert_eq!(failed, 0, "{stats:?}");
    // The burst happened: connects to the stopped proxy timed out and were retried.
    assert!(stats.connect_timeouts > 0, "{stats:?}");
    assert!(stats.retries > 0, "{stats:?}");
    assert_eq!(stats.retries_refused, 0, "{stats:?}");
}

/// The price of the bounded retry profile (docs/benchmarks.md, "Overload"), kept in
/// sight: retries in flight may only match the requests in flight or waiting (at least
/// one), a number that falls as a burst's own requests fail, so a burst that fails
/// together with nothing else in flight has retries refused (about half, measured).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bounded_retry_profile_refuses_retries_of_a_burst_when_little_else_is_in_flight() {
    let (failed, stats) = burst_on_a_stopped_proxy(
        "{ retry_budget_percent: 100, retry_budget_min_concurrency: 1, consecutive_local_origin_failure: 1, retry_back_off: 100ms }",
    )
    .await;
    eprintln!("bounded profile: {failed} of 120 failed; {stats:?}");
    assert!(stats.connect_timeouts > 0, "{stats:?}");
    assert!(stats.retries_refused > 0, "{stats:?}");
    assert!(failed > 0, "{stats:?}");
}

//! The prober against real sockets: refused, hanging, draining, not ready, wrong body,
//! slow and flapping proxies; and the dashboard poller against the simulated dashboard.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ray_serve_sim::dashboard::{DashboardMode, SimDashboard};
use ray_serve_sim::NodeType;
use ray_serve_sim::ProxyMode;
use ray_xds::live::dashboards::{DashboardPoller, DashboardStates};
use ray_xds::live::probe::{Outcome, ProbeState};
use ray_xds::live::prober::{probe_client, probe_healthz, read_routes, ProbeStates, Prober};
use ray_xds::metrics::Metrics;
use ray_xds::model::Model;
use ray_xds::policy::probe::ProbePolicy;
use support::*;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const TIMEOUT: Duration = Duration::from_millis(250);

/// Ray's gRPC `Healthz`, as the prober reads it, on a simulated gRPC proxy in every mode.
#[tokio::test]
async fn grpc_probe_outcomes_on_real_sockets() {
    use ray_xds::live::prober::{grpc_channel, probe_grpc_healthz};
    let c = SimCluster::start_grpc("c", &[NodeType::Worker]).await;
    let addr = c.grpc[0];
    let channel = grpc_channel(addr);
    let probe = || probe_grpc_healthz(channel.clone(), TIMEOUT);
    assert_eq!(probe().await, Outcome::Healthy);

    c.set_mode(0, ProxyMode::Draining);
    assert_eq!(probe().await, Outcome::Draining);

    c.set_mode(0, ProxyMode::NotReady);
    let Outcome::Failed(why) = probe().await else {
        panic!()
    };
    assert!(
        why.contains("Unavailable") && why.contains("Route table"),
        "{why}"
    );

    c.set_mode(0, ProxyMode::Flapping);
    let (a, b) = (probe().await, probe().await);
    assert!(
        matches!(
            (&a, &b),
            (Outcome::Healthy, Outcome::Failed(_)) | (Outcome::Failed(_), Outcome::Healthy)
        ),
        "{a:?} then {b:?}"
    );

    c.set_mode(0, ProxyMode::Slow(Duration::from_millis(600)));
    let started = Instant::now();
    let Outcome::Failed(why) = probe().await else {
        panic!()
    };
    assert!(why.contains("no answer within"), "{why}");
    assert!(started.elapsed() < Duration::from_secs(5));

    c.set_mode(0, ProxyMode::Hang);
    let Outcome::Failed(why) = probe().await else {
        panic!()
    };
    assert!(why.contains("no answer within"), "{why}");

    // Back to serving, on the same channel (the prober keeps one per proxy).
    c.set_mode(0, ProxyMode::Serving);
    eventually(
        "the same channel sees it healthy again",
        Duration::from_secs(10),
        || async { (probe().await == Outcome::Healthy).then_some(()) },
    )
    .await;

    c.kill(0);
    eventually(
        "the killed gRPC proxy refuses connections",
        Duration::from_secs(10),
        || async { (probe().await == Outcome::Refused).then_some(()) },
    )
    .await;
    // Nothing ever listened there: refused from the first probe.
    let never = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    assert_eq!(
        probe_grpc_healthz(grpc_channel(never), TIMEOUT).await,
        Outcome::Refused
    );
}

#[tokio::test]
async fn probe_outcomes_on_real_sockets() {
    let c = SimCluster::start("c", &[NodeType::Worker]).await;
    let addr = c.proxies[0].0;
    let client = probe_client(TIMEOUT);
    assert_eq!(
        probe_healthz(&client, addr, TIMEOUT).await,
        Outcome::Healthy
    );
    assert_eq!(
        read_routes(&client, addr, TIMEOUT).await,
        Ok(Some(["/".to_string()].into()))
    );

    c.set_mode(0, ProxyMode::Draining);
    assert_eq!(
        probe_healthz(&client, addr, TIMEOUT).await,
        Outcome::Draining
    );

    c.set_mode(0, ProxyMode::NotReady);
    let Outcome::Failed(why) = probe_healthz(&client, addr, TIMEOUT).await else {
        panic!()
    };
    assert!(why.contains("503") && why.contains("Route table"), "{why}");

    c.set_mode(0, ProxyMode::Slow(Duration::from_millis(20)));
    assert_eq!(
        probe_healthz(&client, addr, TIMEOUT).await,
        Outcome::Healthy,
        "slow but in time"
    );
    c.set_mode(0, ProxyMode::Slow(Duration::from_millis(600)));
    let started = Instant::now();
    let Outcome::Failed(why) = probe_healthz(&client, addr, TIMEOUT).await else {
        panic!()
    };
    assert!(why.contains("no answer within"), "{why}");
    assert!(started.elapsed() < Duration::from_secs(5));

    c.set_mode(0, ProxyMode::Hang);
    let Outcome::Failed(why) = probe_healthz(&client, addr, TIMEOUT).await else {
        panic!()
    };
    assert!(why.contains("no answer within"), "{why}");

    c.kill(0);
    let refused = support::eventually(
        "the killed proxy refuses connections",
        Duration::from_secs(10),
        || async {
            let fresh = probe_client(TIMEOUT);
            (probe_healthz(&fresh, addr, TIMEOUT).await == Outcome::Refused).then_some(())
        },
    );
    refused.await;
}

/// A "proxy" answering 200 with a body that never ends (chunked, 64 KiB a chunk), and
/// how many body bytes it managed to send.
async fn endless_body_proxy() -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = sent.clone();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 4096];
        let _ = tokio::io::AsyncReadExt::read(&mut conn, &mut buf).await;
        let _ = conn
            .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            .await;
        let chunk = vec![b's'; 64 * 1024];
        loop {
            let head = format!("{:x}\r\n", chunk.len());
            if conn.write_all(head.as_bytes()).await.is_err()
                || conn.write_all(&chunk).await.is_err()
                || conn.write_all(b"\r\n").await.is_err()
            {
                return;
            }
            counter.fetch_add(chunk.len(), std::sync::atomic::Ordering::Relaxed);
        }
    });
    (addr, sent)
}

/// Issue 13: probe bodies are read no further than their caps (64 KiB for `/-/healthz`,
/// 256 KiB for `/-/routes`: up to 256 probes and 16 route reads run at once).
#[tokio::test]
async fn an_endless_body_is_a_failure_read_no_further_than_the_cap() {
    let (addr, sent) = endless_body_proxy().await;
    let client = probe_client(Duration::from_secs(5));
    let outcome = probe_healthz(&client, addr, Duration::from_secs(5)).await;
    let Outcome::Failed(why) = outcome else {
        panic!("{outcome:?}")
    };
    assert!(why.contains("over 64 KiB"), "{why}");
    // It stopped reading at the cap (plus what the socket buffers hold).
    let read = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(read < 32 * 1024 * 1024, "read {read} bytes");

    let (addr, sent) = endless_body_proxy().await;
    let client = probe_client(Duration::from_secs(5));
    assert_eq!(
        read_routes(&client, addr, Duration::from_secs(5)).await,
        Ok(None),
        "an answer over the cap is an answer: routes unknown"
    );
    let read = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(read < 32 * 1024 * 1024, "read {read} bytes");
}

/// A `/-/routes` body near its cap still reads whole through a probe connection whose
/// read buffer is capped (16 KiB: a kept-alive connection keeps its buffer, and big
/// bodies grew it to ~400 KiB each).
#[tokio::test]
async fn a_big_routes_body_streams_through_the_small_read_buffer() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let routes: serde_json::Map<String, serde_json::Value> = (0..900)
        .map(|i| (format!("/{i:0>200}"), serde_json::Value::from("app")))
        .collect();
    let body = serde_json::Value::Object(routes).to_string();
    assert!(
        body.len() > 10 * ray_xds::live::prober::PROBE_READ_BUFFER_BYTES
            && body.len() < ray_xds::live::prober::MAX_ROUTES_BODY_BYTES
    );
    let app = axum::Router::new().route(
        "/-/routes",
        axum::routing::get(move || {
            let body = body.clone();
            async move { body }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = probe_client(Duration::from_secs(5));
    for _ in 0..2 {
        let read = read_routes(&client, addr, Duration::from_secs(5)).await;
        assert_eq!(read.map(|r| r.map(|r| r.len())), Ok(Some(900)));
    }
}

#[tokio::test]
async fn a_wrong_body_is_a_failure() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().route("/-/healthz", axum::routing::get(|| async { "ok" }));
    tokio::spawn(async move { axum::serve(listener, app).await });
    let Outcome::Failed(why) = probe_healthz(&probe_client(TIMEOUT), addr, TIMEOUT).await else {
        panic!()
    };
    assert!(why.contains("200") && why.contains("\"ok\""), "{why}");
}

struct Running {
    states: watch::Receiver<Arc<ProbeStates>>,
    metrics: Arc<Metrics>,
    _models: watch::Sender<Arc<Model>>,
    shutdown: CancellationToken,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

fn run_prober(cluster: &SimCluster) -> Running {
    let text = services_yaml_with("c", &[cluster], "    head_proxy: include\n");
    run_prober_on(
        &text,
        ProbePolicy {
            interval: Duration::from_millis(100),
            ..Default::default()
        },
    )
}

fn run_prober_on(text: &str, policy: ProbePolicy) -> Running {
    let model = ray_xds::source::file::parse(std::path::Path::new("s.yaml"), text).unwrap();
    let (models_tx, models_rx) = watch::channel(Arc::new(model));
    let (tx, rx) = watch::channel(Arc::new(ProbeStates::default()));
    let metrics = Arc::new(Metrics::new());
    let shutdown = CancellationToken::new();
    let prober = Prober {
        routes_budget: ray_xds::live::route_tables::MEMORY_BUDGET_BYTES,
        policy,
        metrics: metrics.clone(),
        heartbeat: Default::default(),
    };
    tokio::spawn(prober.run(models_rx, tx, shutdown.clone()));
    Running {
        states: rx,
        metrics,
        _models: models_tx,
        shutdown,
    }
}

async fn wait_state(r: &Running, addr: std::net::SocketAddr, want: ProbeState) -> String {
    let mut rx = r.states.clone();
    let s = tokio::time::timeout(
        Duration::from_secs(20),
        rx.wait_for(|s| s.proxies.get(&addr).is_some_and(|p| p.state == want)),
    )
    .await
    .unwrap_or_else(|_| {
        panic!(
            "{addr} never became {want:?}: {:?}",
            r.states.borrow().proxies.get(&addr)
        )
    })
    .unwrap();
    s.proxies[&addr].reason.to_string()
}

/// A proxy whose `/-/routes` does not answer in time (a busy proxy) keeps the table it
/// last answered: a read that got no answer says nothing of its routes, and dropping the
/// table would drain a healthy proxy wherever routes are enforced. One that answers
/// something that is not a table has unknown routes.
#[tokio::test]
async fn a_routes_read_without_an_answer_keeps_the_last_table() {
    use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
    const TABLE: u8 = 0;
    const STALL: u8 = 1;
    const GARBAGE: u8 = 2;
    let mode = Arc::new(AtomicU8::new(TABLE));
    let reads = Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route("/-/healthz", axum::routing::get(|| async { "success" }))
        .route(
            "/-/routes",
            axum::routing::get({
                let (mode, reads) = (mode.clone(), reads.clone());
                move || {
                    let (mode, reads) = (mode.clone(), reads.clone());
                    async move {
                        reads.fetch_add(1, Ordering::Relaxed);
                        match mode.load(Ordering::Relaxed) {
                            STALL => {
                                tokio::time::sleep(Duration::from_secs(3600)).await;
                                String::new()
                            }
                            GARBAGE => "not a table".to_string(),
                            _ => r#"{"/a": "app"}"#.to_string(),
                        }
                    }
                }
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await });
    let text = format!(
        "rayservices:\n  - name: c\n    namespace: default\n    active_cluster: c\n    clusters:\n      - name: c\n        proxies:\n          - {{ address: \"{addr}\", node_type: worker }}\n"
    );
    let r = run_prober_on(
        &text,
        ProbePolicy {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(250),
            routes_interval: Duration::from_millis(100),
            ..Default::default()
        },
    );
    let table = |r: &Running| {
        r.states.borrow().proxies.get(&addr).and_then(|p| {
            p.routes
                .as_ref()
                .map(|t| t.iter().cloned().collect::<Vec<_>>())
        })
    };
    wait_state(&r, addr, ProbeState::Healthy).await;
    eventually("the table read", Duration::from_secs(20), || async {
        (table(&r) == Some(vec!["/a".to_string()])).then_some(())
    })
    .await;

    mode.store(STALL, Ordering::Relaxed);
    let before = reads.load(Ordering::Relaxed);
    eventually(
        "reads that get no answer",
        Duration::from_secs(20),
        || async { (reads.load(Ordering::Relaxed) >= before + 3).then_some(()) },
    )
    .await;
    assert_eq!(
        table(&r),
        Some(vec!["/a".to_string()]),
        "the last table stays"
    );
    assert_eq!(r.states.borrow().proxies[&addr].state, ProbeState::Healthy);

    mode.store(GARBAGE, Ordering::Relaxed);
    eventually(
        "an answer that is no table",
        Duration::from_secs(20),
        || async { table(&r).is_none().then_some(()) },
    )
    .await;
    assert_eq!(r.states.borrow().proxies[&addr].state, ProbeState::Healthy);
}

#[tokio::test]
async fn the_prober_follows_faults_and_ignores_flapping() {
    let c = SimCluster::start("c", &[NodeType::Head, NodeType::Worker, NodeType::Worker]).await;
    let (a, b, d) = (c.proxies[0].0, c.proxies[1].0, c.proxies[2].0);
    let r = run_prober(&c);
    for addr in [a, b, d] {
        wait_state(&r, addr, ProbeState::Healthy).await;
    }
    assert!(r.states.borrow().complete);
    assert_eq!(
        r.states.borrow().proxies[&a].routes.as_ref().unwrap().len(),
        1,
        "routes read on turning healthy"
    );

    c.set_mode(1, ProxyMode::Hang);
    let why = wait_state(&r, b, ProbeState::Unhealthy).await;
    assert!(why.contains("no answer within"), "{why}");
    c.set_mode(2, ProxyMode::Draining);
    wait_state(&r, d, ProbeState::Draining).await;
    c.set_mode(1, ProxyMode::Serving);
    c.set_mode(2, ProxyMode::Serving);
    wait_state(&r, b, ProbeState::Healthy).await;
    wait_state(&r, d, ProbeState::Healthy).await;

    // Flapping: every other probe fails; two failures in a row never happen.
    let before = ray_xds_transitions(&r.metrics, "unhealthy");
    c.set_mode(0, ProxyMode::Flapping);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(r.states.borrow().proxies[&a].state, ProbeState::Healthy);
    assert_eq!(
        ray_xds_transitions(&r.metrics, "unhealthy"),
        before,
        "no transition while flapping"
    );

    // Back to serving, then killed: gone at once (refused), or after the pooled
    // connection's close counted as a first failure.
    c.set_mode(0, ProxyMode::Serving);
    // A few probe intervals (100 ms here) so the last probes before the kill succeeded.
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.kill(0);
    let why = wait_state(&r, a, ProbeState::Unhealthy).await;
    assert!(why.contains("refused") || why.contains("closed"), "{why}");
    let text = r.metrics.render();
    assert!(
        text.contains("ray_xds_probe_duration_seconds_count"),
        "{text}"
    );
}

fn ray_xds_transitions(metrics: &Metrics, state: &str) -> f64 {
    metric(
        &metrics.render(),
        &format!("ray_xds_proxy_health_transitions_total{{state=\"{state}\"}}"),
    )
}

#[tokio::test]
async fn the_dashboard_poller_keeps_the_last_known_state() {
    let dashboard = SimDashboard::new();
    dashboard.set_app("hello", "/", "RUNNING");
    dashboard.set_proxy("127.0.0.1", "HEALTHY");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    tokio::spawn(dashboard.clone().serve(listener, shutdown.clone()));
    let c = SimCluster::start("c", &[NodeType::Head]).await;
    let text = services_yaml("c", &[&c]).replace(
        "      - name: c\n",
        &format!("      - name: c\n        dashboard: {url}\n"),
    );
    let model = ray_xds::source::file::parse(std::path::Path::new("s.yaml"), &text).unwrap();
    let (_models_tx, models_rx) = watch::channel(Arc::new(model));
    let (tx, mut rx) = watch::channel(Arc::new(DashboardStates::default()));
    let metrics = Arc::new(Metrics::new());
    let answered = Arc::new(ray_xds::live::dashboards::AnsweredAt::default());
    let poller = DashboardPoller {
        answered: answered.clone(),
        interval: Duration::from_millis(100),
        timeout: Duration::from_millis(300),
        misses_tolerated: 1,
        metrics: metrics.clone(),
        memory_budget: ray_xds::live::dashboards::MEMORY_BUDGET_BYTES,
    };
    let (_refresh_tx, refresh_rx) = tokio::sync::mpsc::unbounded_channel();
    let token = shutdown.clone();
    tokio::spawn(async move {
        let mut refresh_rx = refresh_rx;
        poller.run(models_rx, tx, &mut refresh_rx, token).await
    });
    let cluster = "default/demo/c";
    let wait = |rx: &mut watch::Receiver<Arc<DashboardStates>>,
                f: fn(&ray_xds::live::dashboards::ClusterDashboard) -> bool| {
        let mut rx = rx.clone();
        async move {
            tokio::time::timeout(
                Duration::from_secs(20),
                rx.wait_for(|s| s.clusters.get(cluster).is_some_and(f)),
            )
            .await
            .expect("in time")
            .unwrap()
            .clusters[cluster]
                .clone()
        }
    };
    let d = wait(&mut rx, |d| {
        d.status.as_ref().is_some_and(|s| s.all_running())
    })
    .await;
    assert!(!d.stale);
    // Answers that change nothing are not published, but each one is recorded (for
    // `/debug/state`'s `last_success_unix`): the record moves on while the states stay.
    let first = answered.get(cluster).expect("an answer is recorded");
    let published = rx.borrow().clone();
    eventually(
        "another answer is recorded",
        Duration::from_secs(20),
        || async { answered.get(cluster).filter(|t| *t > first) },
    )
    .await;
    assert_eq!(
        rx.borrow().clusters[cluster].last_success_unix,
        published.clusters[cluster].last_success_unix,
        "an unchanged answer is not published"
    );

    for mode in [
        DashboardMode::Unavailable,
        DashboardMode::Garbage,
        DashboardMode::Hang,
    ] {
        dashboard.set_mode(mode);
        let d = wait(&mut rx, |d| d.stale).await;
        // The last known state is kept, and is stale only from the second miss.
        let kept = d.status.as_ref().unwrap().all_running();
        assert!(kept && d.misses >= 2, "{mode:?}: {d:?}");
        dashboard.set_mode(DashboardMode::Normal);
        wait(&mut rx, |d| !d.stale).await;
    }
    dashboard.deploy_app("slow", "/slow", Duration::from_millis(300), "RUNNING");
    wait(&mut rx, |d| {
        d.applications
            .get("slow")
            .is_some_and(|(s, _)| s == "DEPLOYING")
    })
    .await;
    wait(&mut rx, |d| {
        d.status.as_ref().is_some_and(|s| s.all_running()) && d.applications.len() == 2
    })
    .await;
    let text = metrics.render();
    for reason in ["status", "malformed", "timeout"] {
        assert!(
            metric(
                &text,
                &format!("ray_xds_dashboard_poll_errors_total{{reason=\"{reason}\"}}")
            ) >= 1.0,
            "{reason}: {text}"
        );
    }
    shutdown.cancel();
}

/// Issue 13: what dashboards' answers hold is bounded in all and shared fairly. A cluster
/// whose dashboard lists hundreds of proxies holds most of a (small, for the test)
/// budget; a second cluster's small answer still gets in, and the hog's status is the
/// one dropped (unknown and stale, counted `over_budget`), not the neighbour's.
#[tokio::test]
async fn one_clusters_big_dashboard_answer_cannot_crowd_out_another() {
    let shutdown = CancellationToken::new();
    let serve = |d: &SimDashboard| {
        let d = d.clone();
        let token = shutdown.clone();
        async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", listener.local_addr().unwrap());
            tokio::spawn(d.serve(listener, token));
            url
        }
    };
    let hog = SimDashboard::new();
    hog.set_app("hello", "/", "RUNNING");
    for i in 0..400 {
        hog.set_proxy(&format!("127.0.{}.{}", i / 200, 1 + i % 200), "HEALTHY");
    }
    let small = SimDashboard::new();
    small.set_app("hello", "/", "RUNNING");
    small.set_proxy("127.0.0.1", "HEALTHY");
    let (hog_url, small_url) = (serve(&hog).await, serve(&small).await);

    // The budget: the hog alone fits, both do not, the small one is within half.
    let client = ray_xds::live::dashboard::DashboardClient::new(Duration::from_secs(5));
    let hog_bytes = client.fetch(&hog_url).await.unwrap().estimated_bytes();
    let small_bytes = client.fetch(&small_url).await.unwrap().estimated_bytes();
    assert!(small_bytes * 2 < hog_bytes, "{small_bytes} {hog_bytes}");
    let budget = hog_bytes + small_bytes - 1;

    let c = SimCluster::start("c", &[NodeType::Head]).await;
    let d = SimCluster::start("d", &[NodeType::Head]).await;
    let text = services_yaml("c", &[&c, &d])
        .replace(
            "      - name: c\n",
            &format!("      - name: c\n        dashboard: {hog_url}\n"),
        )
        .replace(
            "      - name: d\n",
            &format!("      - name: d\n        dashboard: {small_url}\n"),
        );
    let model = ray_xds::source::file::parse(std::path::Path::new("s.yaml"), &text).unwrap();
    let (_models_tx, models_rx) = watch::channel(Arc::new(model));
    let (tx, mut rx) = watch::channel(Arc::new(DashboardStates::default()));
    let metrics = Arc::new(Metrics::new());
    let poller = DashboardPoller {
        answered: Default::default(),
        interval: Duration::from_millis(100),
        timeout: Duration::from_secs(5),
        misses_tolerated: 0,
        metrics: metrics.clone(),
        memory_budget: budget,
    };
    let (_refresh_tx, refresh_rx) = tokio::sync::mpsc::unbounded_channel();
    let token = shutdown.clone();
    tokio::spawn(async move {
        let mut refresh_rx = refresh_rx;
        poller.run(models_rx, tx, &mut refresh_rx, token).await
    });
    // Whichever answered first, the end is the same: the small one holds its status,
    // the hog is refused (or dropped) as over its share.
    let states = tokio::time::timeout(
        Duration::from_secs(20),
        rx.wait_for(|s| {
            let small = s.clusters.get("default/demo/d");
            let hog = s.clusters.get("default/demo/c");
            small.is_some_and(|d| d.status.as_ref().is_some_and(|s| s.all_running()) && !d.stale)
                && hog.is_some_and(|d| {
                    d.status.is_none()
                        && d.stale
                        && d.last_error
                            .as_deref()
                            .is_some_and(|e| e.contains("fair share"))
                })
        }),
    )
    .await
    .expect("the small cluster's status in, the hog's out, in time")
    .unwrap()
    .clone();
    assert!(states.clusters["default/demo/c"].applications.is_empty());
    // And it stays so: the hog's next answers are refused while the small one holds.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let now = rx.borrow().clone();
    assert!(now.clusters["default/demo/c"].status.is_none());
    assert!(now.clusters["default/demo/d"].status.is_some());
    let text = metrics.render();
    assert!(
        metric(
            &text,
            "ray_xds_dashboard_poll_errors_total{reason=\"over_budget\"}"
        ) >= 1.0,
        "{text}"
    );
    shutdown.cancel();
}

/// Issue 17: a live proxy answering every request in 200 ms, with the default timeout
/// (300 ms) and hedge delay (100 ms), stays healthy across many probes: each probe is
/// joined by a hedged one (it has not answered within the hedge delay), and the first
/// answer settles the round, so no failure is ever counted.
#[tokio::test]
async fn a_200ms_slow_proxy_stays_healthy_across_many_probes() {
    let c = SimCluster::start("c", &[NodeType::Head]).await;
    let a = c.proxies[0].0;
    let r = run_prober(&c);
    let defaults = ProbePolicy::default();
    assert_eq!(defaults.timeout, Duration::from_millis(300));
    assert!(defaults.hedge_after() < Duration::from_millis(200));
    wait_state(&r, a, ProbeState::Healthy).await;
    c.set_mode(0, ProxyMode::Slow(Duration::from_millis(200)));
    // The only proxy: every probe counted is one of its.
    let probes = || metric(&r.metrics.render(), "ray_xds_probe_duration_seconds_count");
    let before = probes();
    eventually(
        "30 more probes of the slow proxy",
        Duration::from_secs(120),
        || async {
            assert_eq!(r.states.borrow().proxies[&a].state, ProbeState::Healthy);
            (probes() >= before + 30.0).then_some(())
        },
    )
    .await;
    assert_eq!(r.states.borrow().proxies[&a].state, ProbeState::Healthy);
    assert_eq!(ray_xds_transitions(&r.metrics, "unhealthy"), 0.0);
}

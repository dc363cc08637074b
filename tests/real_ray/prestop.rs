//! The pre-stop handshake with a real Ray worker node: the node's pod is deleted under
//! load, its preStop hook (`GET /prestop`, then a drain as long as the longest request)
//! runs before kubelet's SIGTERM, and nothing fails. What only real Ray can show: Ray's
//! proxy stops at SIGTERM whatever it is serving, a proxy serves only on a node that runs
//! a replica (Serve drains the others), and a node's stop leaves the proxies and replicas
//! of the other nodes serving (each proxy prefers its own node's replicas, Ray's default).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::real_ray::{App, RealRayCluster};
use support::*;

use crate::serve::{cluster_yaml, gateway, services_yaml};

const DEADLINE: Duration = Duration::from_secs(60);

/// Each call takes this long in its replica: what is in flight on a proxy when it stops
/// fails (it may have run), so a stop that came too early shows.
const CALL: Duration = Duration::from_millis(300);

/// Requests through Envoy, `clients` at a time, back to back: each one's outcome.
struct Load {
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<Result<u16, String>>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(port: u16, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..clients)
            .map(|_| {
                let (stop, outcomes) = (stop.clone(), outcomes.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let outcome =
                            post_through_envoy(port, "/slowcall", Duration::from_secs(30)).await;
                        outcomes
                            .lock()
                            .unwrap()
                            .push(outcome.map(|(status, _)| status));
                    }
                })
            })
            .collect();
        Load {
            stop,
            outcomes,
            tasks,
        }
    }

    async fn stop(self) -> Vec<Result<u16, String>> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        Arc::try_unwrap(self.outcomes)
            .unwrap()
            .into_inner()
            .unwrap()
    }
}

/// What Envoy's `/clusters` says of one endpoint of the `demo` service: `stat` (e.g.
/// `rq_total`), or `None` once the endpoint has left.
async fn endpoint_stat(envoy: &Envoy, addr: SocketAddr, stat: &str) -> Option<u64> {
    let needle = format!("::{addr}::{stat}::");
    envoy.admin("/clusters").await.lines().find_map(|l| {
        l.split_once(&needle)
            .filter(|(prefix, _)| prefix.starts_with("default/demo/"))
            .and_then(|(_, n)| n.trim().parse().ok())
    })
}

/// The worker node's pod is deleted while four clients call through Envoy, spread over
/// both nodes' proxies (a replica on each node, each proxy calling its own node's). Its
/// hook calls `/prestop` (answered once Envoy holds endpoints
/// without it), waits out the longest call, and only then is the node SIGTERMed: no
/// request fails, and the worker's proxy had carried calls until its deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ray_a_deleted_worker_pod_leaves_envoy_before_its_proxy_stops_and_nothing_fails() {
    let mut a = RealRayCluster::start("a", 1).await;
    // Two replicas, spread over both nodes: a proxy on a node without one is drained.
    a.deploy(&[App {
        name: "slowcall",
        route_prefix: "/slowcall",
        import_path: "apps:slow_call",
        extra: "args: { call_s: 0.3 }\n    deployments: [ { name: SlowCall, num_replicas: 2 } ]",
    }]);
    a.wait_for_app("slowcall", "RUNNING").await;
    let (head, worker) = (a.head_proxy(), a.worker_proxy());
    let services = |worker_draining: bool| {
        let worker_type = if worker_draining {
            "worker, draining: true"
        } else {
            "worker"
        };
        services_yaml(
            "a",
            None,
            "",
            &[cluster_yaml(&a, &[(head, "head"), (worker, worker_type)])],
        )
    };
    let gw = gateway(&services(false)).await;
    eventually("both proxies serve through Envoy", DEADLINE, || async {
        let both = endpoint_stat(&gw.envoy, head, "rq_total").await.is_some()
            && endpoint_stat(&gw.envoy, worker, "rq_total").await.is_some();
        let answered = matches!(
            post_through_envoy(gw.port, "/slowcall", Duration::from_secs(10)).await,
            Ok((200, _))
        );
        (both && answered).then_some(())
    })
    .await;
    let load = Load::start(gw.port, 4);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let worker_calls = endpoint_stat(&gw.envoy, worker, "rq_total")
        .await
        .unwrap_or(0);
    assert!(
        worker_calls > 0,
        "the worker's proxy took no calls: the test would prove nothing"
    );

    // The pod is deleted: its endpoint is terminating (the source marks it draining),
    // and kubelet runs the preStop hook.
    std::fs::write(gw.xds_services_path(), services(true)).unwrap();
    let asked = Instant::now();
    let (status, body) = http_get(&format!(
        "http://{}/prestop?address={}&grace=20s",
        gw.xds.admin_addr,
        worker.ip()
    ))
    .await
    .unwrap();
    assert_eq!(status, 200, "the pre-stop call: {body}");
    let answered = asked.elapsed();
    // The hook's drain: the longest call, and some.
    tokio::time::sleep(CALL * 4).await;
    // kubelet's SIGTERM, then SIGKILL after the grace period.
    let stopped_in = a.terminate_worker(Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let outcomes = load.stop().await;
    eprintln!(
        "pre-stop answered in {answered:?}; the worker's proxy had taken {worker_calls} calls; \
         the node stopped in {stopped_in:?}; {} calls",
        outcomes.len()
    );
    let failed: Vec<_> = outcomes.iter().filter(|o| !matches!(o, Ok(200))).collect();
    assert!(outcomes.len() > 20, "{} calls", outcomes.len());
    assert!(
        failed.is_empty(),
        "{} calls failed: {failed:?}",
        failed.len()
    );
    assert!(
        endpoint_stat(&gw.envoy, worker, "rq_total").await.is_none(),
        "Envoy still lists the stopped proxy"
    );
}

//! Ray 2.60's direct ingress on real clusters (`RAY_SERVE_ENABLE_DIRECT_INGRESS=1` on every
//! node): ray-xds reads each application's target groups from the real dashboard and
//! sends its requests straight to its ingress replicas, a real Envoy in front.
//!
//! Every test here is named `real_ray_direct_ingress_*` (`scripts/test.sh` runs them one at
//! a time with the other real-Ray tests). The clusters are given by their dashboard alone;
//! Ray's nodes are on 198.18.0.0/15 while the dashboard answers on 127.0.0.1, so
//! `proxies.networks` allows that range.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ray_serve_sim::grpc::pb::demo::echo_client::EchoClient;
use ray_serve_sim::grpc::pb::demo::SayRequest;
use support::real_ray::{App, RealRayCluster};
use support::*;

const DEADLINE: Duration = Duration::from_secs(90);

/// What `apps:hello` answers.
#[derive(Debug, Clone, serde::Deserialize)]
struct Reply {
    cluster: String,
    app: String,
    replica: String,
    pid: u32,
}

async fn ask(port: u16, path: &str) -> Result<Reply, String> {
    let (status, body) = http("POST", &format!("http://127.0.0.1:{port}{path}"), "{}").await?;
    if status != 200 {
        return Err(format!("{status}: {body}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))
}

/// `echo` at `/` and `work` at `/work`, both `apps:hello`, `work` with `replicas` replicas.
fn two_apps(work_replicas: &'static str) -> [App; 2] {
    [
        App {
            name: "echo",
            route_prefix: "/",
            import_path: "apps:hello",
            extra: "",
        },
        App {
            name: "work",
            route_prefix: "/work",
            import_path: "apps:hello",
            extra: work_replicas,
        },
    ]
}

/// ray-xds over `clusters` (given by their dashboards; `active` serving, `pending` the
/// one an upgrade brings), a real Envoy in front, Ray's networks allowed.
async fn gateway(clusters: &[&RealRayCluster], active: &str, pending: Option<&str>) -> Stack {
    let mut yaml = format!(
        "rayservices:\n  - name: demo\n    hosts: ['*']\n    head_proxy: include\n    active_cluster: {active}\n"
    );
    if let Some(p) = pending {
        yaml += &format!("    pending_cluster: {p}\n");
    }
    yaml += "    clusters:\n";
    for c in clusters {
        yaml += &format!(
            "      - name: {}\n        dashboard: {}\n",
            c.name,
            c.dashboard_url()
        );
    }
    let s = Stack::with(yaml)
        .config(|c| {
            c.addresses.networks = vec!["198.18.0.0/15".parse().unwrap()];
            c.policies.dashboard.poll_interval = Duration::from_millis(500);
        })
        .envoy_without_waiting(Bootstrap::Sotw)
        .start()
        .await;
    let port = s.gateway_port;
    eventually("traffic flows through Envoy", DEADLINE, || async {
        ask(port, "/").await.ok()
    })
    .await;
    s
}

/// Requests Envoy sent to each of its clusters so far (`rq_total` summed over hosts).
async fn requests_by_cluster(envoy: &Envoy) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in envoy.admin("/clusters").await.lines() {
        let parts: Vec<&str> = line.split("::").collect();
        if parts.len() == 4 && parts[2] == "rq_total" {
            *out.entry(parts[0].to_string()).or_default() += parts[3].parse().unwrap_or(0);
        }
    }
    out
}

/// Waits until every one of `n` requests to `path` is answered by application `app`
/// through Envoy cluster `via` (no request to another cluster meanwhile).
async fn wait_direct(s: &Stack, path: &str, app: &str, via: &str) {
    eventually(
        &format!("{path} answered by {app} via {via}"),
        DEADLINE,
        || async {
            let before = requests_by_cluster(s.envoy()).await;
            for _ in 0..6 {
                let r = ask(s.gateway_port, path).await.ok()?;
                (r.app == app).then_some(())?;
            }
            let after = requests_by_cluster(s.envoy()).await;
            let moved: Vec<&String> = after
                .iter()
                .filter(|(c, n)| before.get(*c) != Some(n))
                .map(|(c, _)| c)
                .collect();
            (moved == [via]).then_some(())
        },
    )
    .await;
}

/// With direct ingress, each application's requests reach only its own replicas, over
/// HTTP (Ray's prefix matching: `/workers` is `echo`'s) and gRPC (by the `application`
/// metadata), none through the Serve proxy; the routing is the same through the proxies
/// when direct ingress is off.
async fn each_application_is_answered_by_its_own_replicas(direct: bool) {
    let a = if direct {
        RealRayCluster::start_direct_ingress("a", 1, true).await
    } else {
        RealRayCluster::start_grpc("a", 1).await
    };
    let mut apps = two_apps("deployments: [ { name: Hello, num_replicas: 2 } ]").to_vec();
    apps.push(App {
        name: "chat",
        route_prefix: "/chat",
        import_path: "grpc_apps:echo",
        extra: "",
    });
    a.deploy(&apps);
    for app in ["echo", "work", "chat"] {
        a.wait_for_app(app, "RUNNING").await;
    }
    if direct {
        a.wait_for_replicas("work", "HTTP", 2).await;
        a.wait_for_replicas("chat", "gRPC", 1).await;
    }
    let s = gateway(&[&a], "a", None).await;
    let port = s.gateway_port;
    let (work_via, echo_via) = if direct {
        ("default/demo/a/app/work", "default/demo/a/app/echo")
    } else {
        ("default/demo/a", "default/demo/a")
    };
    wait_direct(&s, "/work", "work", work_via).await;
    wait_direct(&s, "/", "echo", echo_via).await;

    let mut replicas = BTreeSet::new();
    for _ in 0..40 {
        let r = ask(port, "/work").await.unwrap();
        assert_eq!(r.app, "work", "{r:?}");
        assert_eq!(r.cluster, "a");
        replicas.insert(r.replica);
    }
    if direct {
        // (Through the proxies, a proxy prefers the replicas on its own node.)
        assert_eq!(
            replicas.len(),
            2,
            "both replicas of work answer: {replicas:?}"
        );
    }
    for path in ["/work/x/y", "/work/"] {
        assert_eq!(ask(port, path).await.unwrap().app, "work", "{path}");
    }
    for path in ["/", "/workers", "/chat-room", "/hello"] {
        assert_eq!(ask(port, path).await.unwrap().app, "echo", "{path}");
    }

    // gRPC, by the application metadata.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect_lazy();
    let mut client = EchoClient::new(channel);
    let before = requests_by_cluster(s.envoy()).await;
    for i in 0..10 {
        let mut request = tonic::Request::new(SayRequest {
            text: format!("hi {i}"),
        });
        request
            .metadata_mut()
            .insert("application", "chat".parse().unwrap());
        let served = client.say(request).await.expect("a gRPC call").into_inner();
        assert_eq!(served.app, "chat");
    }
    let after = requests_by_cluster(s.envoy()).await;
    let grpc_via = if direct {
        "default/demo/a/app/chat/grpc"
    } else {
        "default/demo/a/grpc"
    };
    assert_eq!(
        after.get(grpc_via).copied().unwrap_or(0) - before.get(grpc_via).copied().unwrap_or(0),
        10,
        "{after:?}"
    );
    if direct {
        // The Serve proxy (on the head) saw none of it.
        assert_eq!(
            after.get("default/demo/a").copied().unwrap_or(0),
            0,
            "{after:?}"
        );
    }
    // Ray matches the percent-decoded path (`/wor%6B` is `work`'s); Envoy sends a path
    // with an escape to the Serve proxy, which matches as Ray does.
    for path in ["/wor%6B", "/%77ork/x"] {
        assert_eq!(ask(port, path).await.unwrap().app, "work", "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ray_direct_ingress_each_application_is_answered_by_its_own_replicas() {
    each_application_is_answered_by_its_own_replicas(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ray_direct_ingress_off_each_application_is_still_answered_by_its_own() {
    each_application_is_answered_by_its_own_replicas(false).await;
}

/// Requests to `path` through Envoy, `concurrency` at a time, until stopped: each reply
/// or failure.
struct Load {
    stop: Arc<std::sync::atomic::AtomicBool>,
    log: Arc<Mutex<Vec<Result<Reply, String>>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(port: u16, path: &'static str, concurrency: usize) -> Load {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..concurrency)
            .map(|_| {
                let (stop, log) = (stop.clone(), log.clone());
                tokio::spawn(async move {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let reply = ask(port, path).await;
                        log.lock().unwrap().push(reply);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
            })
            .collect();
        Load { stop, log, tasks }
    }

    async fn stop(self) -> Vec<Result<Reply, String>> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        Arc::try_unwrap(self.log).unwrap().into_inner().unwrap()
    }
}

fn failures(log: &[Result<Reply, String>]) -> Vec<&String> {
    log.iter().filter_map(|r| r.as_ref().err()).collect()
}

/// An ingress replica's process SIGKILLed under load: at most the requests in flight on it
/// fail (each may have run, so none is retried), everything else is answered, by `work`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ray_direct_ingress_a_killed_replica_costs_at_most_what_it_held() {
    let a = RealRayCluster::start_direct_ingress("a", 1, false).await;
    a.deploy(&two_apps(
        "deployments: [ { name: Hello, num_replicas: 2 } ]",
    ));
    a.wait_for_app("work", "RUNNING").await;
    a.wait_for_replicas("work", "HTTP", 2).await;
    let s = gateway(&[&a], "a", None).await;
    wait_direct(&s, "/work", "work", "default/demo/a/app/work").await;
    const CONCURRENCY: usize = 4;
    let load = Load::start(s.gateway_port, "/work", CONCURRENCY);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let victim = ask(s.gateway_port, "/work").await.unwrap();
    // SAFETY: kill(2) on a pid of the Ray cluster this test started.
    assert_eq!(unsafe { libc::kill(victim.pid as i32, libc::SIGKILL) }, 0);
    tokio::time::sleep(Duration::from_secs(8)).await;
    let log = load.stop().await;
    let failed = failures(&log);
    assert!(log.len() > 100, "the load ran: {}", log.len());
    assert!(
        failed.len() <= CONCURRENCY,
        "at most what was in flight on the killed replica: {failed:?} of {}",
        log.len()
    );
    let wrong: Vec<&Reply> = log
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .filter(|r| r.app != "work")
        .collect();
    assert!(
        wrong.is_empty(),
        "answered by another application (killed {victim:?}): {wrong:?}"
    );
}

/// `work` scaled from 1 replica to 3 and back to 1 under load (Ray adds replicas on new
/// ports, and drains the ones it stops for its draining period): nothing fails, and every
/// answer is `work`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ray_direct_ingress_replicas_scaled_up_and_down_under_load_fail_nothing() {
    let a = RealRayCluster::start_direct_ingress("a", 1, false).await;
    let one = "deployments: [ { name: Hello, num_replicas: 1 } ]";
    a.deploy(&two_apps(one));
    a.wait_for_app("work", "RUNNING").await;
    a.wait_for_replicas("work", "HTTP", 1).await;
    let s = gateway(&[&a], "a", None).await;
    wait_direct(&s, "/work", "work", "default/demo/a/app/work").await;
    let load = Load::start(s.gateway_port, "/work", 3);
    a.deploy(&two_apps(
        "deployments: [ { name: Hello, num_replicas: 3 } ]",
    ));
    a.wait_for_replicas("work", "HTTP", 3).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    a.deploy(&two_apps(one));
    a.wait_for_replicas("work", "HTTP", 1).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let log = load.stop().await;
    assert!(log.len() > 100, "the load ran: {}", log.len());
    assert_eq!(failures(&log), Vec::<&String>::new(), "of {}", log.len());
    let replicas: BTreeSet<&str> = log
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .inspect(|r| assert_eq!(r.app, "work"))
        .map(|r| r.replica.as_str())
        .collect();
    assert!(
        replicas.len() >= 3,
        "the added replicas served: {replicas:?}"
    );
}

/// A request's path, when it was sent (unix seconds), and what came back.
type Answered = (&'static str, f64, Result<Reply, String>);

/// An upgrade to a second direct-ingress cluster, gated per application: `echo` runs on
/// the new cluster at once, `work` takes 25 s to start there. `echo`'s traffic moves as
/// soon as it runs and every Envoy has warmed it; `work`'s stays on the old cluster until
/// `work` runs on the new one; nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ray_direct_ingress_an_upgrade_moves_each_application_once_it_runs() {
    let a = RealRayCluster::start_direct_ingress("a", 0, false).await;
    a.deploy(&two_apps(""));
    a.wait_for_app("work", "RUNNING").await;
    let b = RealRayCluster::start_direct_ingress("b", 0, false).await;
    let s = gateway(&[&a, &b], "a", Some("b")).await;
    wait_direct(&s, "/work", "work", "default/demo/a/app/work").await;

    let log: Arc<Mutex<Vec<Answered>>> = Default::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let port = s.gateway_port;
    let load = tokio::spawn({
        let (log, stop) = (log.clone(), stop.clone());
        async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for path in ["/", "/work"] {
                    let sent = unix_now();
                    let r = ask(port, path).await;
                    log.lock().unwrap().push((path, sent, r));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    b.deploy(&[
        App {
            name: "echo",
            route_prefix: "/",
            import_path: "apps:hello",
            extra: "",
        },
        App {
            name: "work",
            route_prefix: "/work",
            import_path: "apps:slow",
            extra: "args: { delay_s: 25 }",
        },
    ]);
    // echo moves while work still deploys on b.
    eventually(
        "echo answered by b while work deploys there",
        DEADLINE,
        || async {
            let r = ask(port, "/").await.ok()?;
            (r.cluster == "b").then_some(())
        },
    )
    .await;
    assert_eq!(b.app_status("work").await.as_deref(), Some("DEPLOYING"));
    let work_on_a = ask(port, "/work").await.unwrap();
    assert_eq!(work_on_a.cluster, "a", "work stays where it runs");
    b.wait_for_app("work", "RUNNING").await;
    let work_running = unix_now();
    eventually("work answered by b", DEADLINE, || async {
        let r = ask(port, "/work").await.ok()?;
        (r.cluster == "b").then_some(())
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.unwrap();
    let log = log.lock().unwrap();
    let failed: Vec<String> = log
        .iter()
        .filter_map(|(p, _, r)| r.as_ref().err().map(|e| format!("{p}: {e}")))
        .collect();
    assert_eq!(failed, Vec::<String>::new(), "of {}", log.len());
    // No request for work reached b before work ran there.
    let early: Vec<f64> = log
        .iter()
        .filter(|(p, sent, r)| {
            *p == "/work"
                && r.as_ref().is_ok_and(|r| r.cluster == "b")
                && *sent < work_running - 5.0
        })
        .map(|(_, sent, _)| *sent)
        .collect();
    assert!(
        early.is_empty(),
        "work answered by b before it ran there: {early:?}"
    );
    // Each answer came from its own application.
    for (p, _, r) in log.iter() {
        let want = if *p == "/" { "echo" } else { "work" };
        assert_eq!(r.as_ref().unwrap().app, want);
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

//! gRPC through a real Envoy to simulated Ray Serve gRPC proxies (issue 15): unary,
//! server-streaming and bidirectional calls pass through; a gRPC status from Ray reaches
//! the client as Ray sent it (in trailers after an empty message, for unary calls, as
//! Ray 2.60 frames them: Envoy cannot retry those); a gRPC proxy killed, draining or hung costs no call that
//! started after ray-xds took it out (and none at all when killed or draining); an
//! upgrade moves gRPC calls only once the new cluster's gRPC proxies are ready.
//!
//! Each simulated node runs an HTTP and a gRPC proxy that share one mode, one ledger and
//! one shutdown, as Ray's proxy actor serves both.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ray_serve_sim::grpc::pb::demo::echo_client::EchoClient;
use ray_serve_sim::grpc::pb::demo::{SayManyRequest, SayRequest};
use ray_serve_sim::{NodeType, ProxyMode};
use support::grpc::*;
use support::*;
use tonic::transport::Channel;

const DEADLINE: Duration = Duration::from_secs(30);
const GRPC_CLUSTER: &str = "default/demo/demo-a/grpc";

/// A stack over one simulated cluster `demo-a` whose nodes run gRPC proxies, with Envoy
/// carrying gRPC calls.
async fn start(node_types: &[NodeType], extra: &str) -> (Stack, SimCluster, EchoClient<Channel>) {
    start_with(Bootstrap::Sotw, node_types, extra).await
}

async fn start_with(
    bootstrap: Bootstrap,
    node_types: &[NodeType],
    extra: &str,
) -> (Stack, SimCluster, EchoClient<Channel>) {
    let sim = SimCluster::start_grpc("demo-a", node_types).await;
    let stack = Stack::with(services_yaml_with("demo-a", &[&sim], extra))
        .envoy(bootstrap)
        .start()
        .await;
    let client = echo(stack.gateway_port);
    eventually("gRPC calls flow through Envoy", DEADLINE, || async {
        say(&client, Duration::from_secs(2)).await.ok()
    })
    .await;
    sim.ledger.clear();
    (stack, sim, client)
}

async fn wait_gone(envoy: &Envoy, address: SocketAddr, what: &str) {
    eventually(what, DEADLINE, || async {
        let hosts = envoy_hosts(envoy, GRPC_CLUSTER).await;
        (!hosts.is_empty() && !hosts.contains(&address.to_string())).then_some(())
    })
    .await;
}

/// Calls Envoy one after another until told to stop; counts the failed ones.
struct Caller {
    stop: Arc<AtomicBool>,
    failed: Arc<AtomicUsize>,
    ok: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Caller {
    fn start(client: &EchoClient<Channel>) -> Caller {
        let stop = Arc::new(AtomicBool::new(false));
        let (failed, ok) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (s, f, o, client) = (
            Arc::clone(&stop),
            Arc::clone(&failed),
            Arc::clone(&ok),
            client.clone(),
        );
        let task = tokio::spawn(async move {
            let mut errors = Vec::new();
            while !s.load(Ordering::Relaxed) {
                match say(&client, Duration::from_secs(10)).await {
                    Ok(_) => {
                        o.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        f.fetch_add(1, Ordering::Relaxed);
                        errors.push(format!("{:?}: {}", e.code(), e.message()));
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            errors
        });
        Caller {
            stop,
            failed,
            ok,
            task,
        }
    }

    /// Stops; (calls that succeeded, the errors of those that failed).
    async fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let errors = self.task.await.unwrap();
        assert_eq!(errors.len(), self.failed.load(Ordering::Relaxed));
        (self.ok.load(Ordering::Relaxed), errors)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unary_streaming_and_bidirectional_calls_pass_through_envoy() {
    let (s, sim, client) = start(&[NodeType::Worker, NodeType::Worker], "").await;
    let grpc: Vec<String> = sim.grpc.iter().map(|a| a.to_string()).collect();
    let by = served_by(&client, 20, Duration::from_secs(5)).await;
    assert!(
        by.keys().all(|p| grpc.contains(p)) && by.len() == 2,
        "every call on a gRPC proxy, both used: {by:?}"
    );

    // Server streaming: every message, in order.
    let mut stream = client
        .clone()
        .say_many(SayManyRequest {
            text: "many".into(),
            count: 5,
            every_ms: 20,
        })
        .await
        .unwrap()
        .into_inner();
    let mut indexes = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        assert_eq!(m.text, "many");
        indexes.push(m.index);
    }
    assert_eq!(indexes, [0, 1, 2, 3, 4]);

    // Bidirectional: each answer as its request arrives, on one proxy.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut answers = client
        .clone()
        .chat(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut proxies = std::collections::BTreeSet::new();
    for i in 0..3 {
        tx.send(SayRequest {
            text: format!("m{i}"),
        })
        .await
        .unwrap();
        let m = answers
            .message()
            .await
            .unwrap()
            .expect("an answer per message");
        assert_eq!(m.text, format!("m{i}"));
        proxies.insert(m.proxy);
    }
    drop(tx);
    assert!(
        answers.message().await.unwrap().is_none(),
        "ends with the client"
    );
    assert_eq!(proxies.len(), 1, "one stream, one proxy: {proxies:?}");

    // HTTP goes on to the HTTP proxies beside it.
    let served = through_envoy(s.gateway_port)
        .await
        .expect("HTTP still served");
    assert!(
        sim.proxies
            .iter()
            .any(|(a, _, _)| a.to_string() == served.proxy),
        "{served:?}"
    );
}

/// The same over delta xDS: the gRPC cluster and route reach an Envoy that subscribes
/// incrementally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_grpc_calls_pass_through_envoy() {
    let (_s, sim, client) =
        start_with(Bootstrap::Delta, &[NodeType::Worker, NodeType::Worker], "").await;
    let by = served_by(&client, 10, Duration::from_secs(5)).await;
    let grpc: Vec<String> = sim.grpc.iter().map(|a| a.to_string()).collect();
    assert!(by.keys().all(|p| grpc.contains(p)), "{by:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ray_s_grpc_status_reaches_the_client_untouched() {
    let (_s, sim, client) = start(&[NodeType::Worker, NodeType::Worker], "").await;
    sim.set_mode(0, ProxyMode::Overloaded);
    sim.set_mode(1, ProxyMode::Overloaded);
    let e = say(&client, Duration::from_secs(5)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert_eq!(
        e.message(),
        ray_serve_sim::grpc::BACKPRESSURE_MESSAGE,
        "Ray's text, not Envoy's"
    );
    assert_eq!(sim.ledger.total(), 0, "backpressure: nothing ran");

    // One proxy overloaded. Ray answers a unary call's error after headers and an empty
    // message (captured, tests/fixtures/ray-serve-2.60/grpc/23-resource-exhausted-unary.txt),
    // where Envoy's retry policy cannot see it: the calls that land there fail with Ray's
    // status (nothing ran), the others are served, and nothing runs twice.
    sim.set_mode(1, ProxyMode::Serving);
    let by = served_by(&client, 40, Duration::from_secs(5)).await;
    let served = by.get(&sim.grpc[1].to_string()).copied().unwrap_or(0);
    let refused: usize = by
        .iter()
        .filter(|(k, _)| k.starts_with("FAILED: ResourceExhausted"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(served + refused, 40, "{by:?}");
    assert!(served > 0 && refused > 0, "both proxies take calls: {by:?}");
    assert_eq!(sim.ledger.more_than_once(), BTreeMap::new());
    assert_eq!(sim.ledger.total(), served, "only the served calls ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_grpc_proxy_fails_no_call() {
    let (s, sim, client) = start(&[NodeType::Worker, NodeType::Worker], "").await;
    let caller = Caller::start(&client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    sim.kill(0);
    wait_gone(s.envoy(), sim.grpc[0], "Envoy drops the killed gRPC proxy").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (ok, errors) = caller.stop().await;
    assert!(ok > 0);
    assert_eq!(errors, Vec::<String>::new(), "{ok} calls succeeded");
    let by = served_by(&client, 10, Duration::from_secs(5)).await;
    assert_eq!(by.get(&sim.grpc[1].to_string()), Some(&10), "{by:?}");
    // What ray-xds says about it.
    let state = s.state().await;
    let text = state.to_string();
    assert!(text.contains(GRPC_CLUSTER), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_grpc_proxy_takes_no_new_calls_and_fails_none() {
    let (s, sim, client) = start(&[NodeType::Worker, NodeType::Worker], "").await;
    let caller = Caller::start(&client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    sim.set_mode(0, ProxyMode::Draining);
    wait_gone(
        s.envoy(),
        sim.grpc[0],
        "Envoy stops sending the draining gRPC proxy calls",
    )
    .await;
    let (ok, errors) = caller.stop().await;
    assert!(ok > 0);
    assert_eq!(errors, Vec::<String>::new(), "{ok} calls succeeded");
    let by = served_by(&client, 10, Duration::from_secs(5)).await;
    assert_eq!(by.get(&sim.grpc[1].to_string()), Some(&10), "{by:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_grpc_proxy_is_taken_out() {
    let (s, sim, client) = start(&[NodeType::Worker, NodeType::Worker], "").await;
    sim.set_mode(0, ProxyMode::Hang);
    wait_gone(s.envoy(), sim.grpc[0], "Envoy drops the hung gRPC proxy").await;
    // Calls that start once it is out all succeed.
    let by = served_by(&client, 20, Duration::from_secs(5)).await;
    assert_eq!(by.get(&sim.grpc[1].to_string()), Some(&20), "{by:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_service_loses_no_call_to_a_hung_grpc_proxy() {
    let extra = "    traffic: { idempotent: true, per_try_timeout: 500ms }\n";
    let (s, sim, client) = start(&[NodeType::Worker, NodeType::Worker], extra).await;
    let caller = Caller::start(&client);
    tokio::time::sleep(Duration::from_millis(300)).await;
    sim.set_mode(0, ProxyMode::Hang);
    wait_gone(s.envoy(), sim.grpc[0], "Envoy drops the hung gRPC proxy").await;
    let (ok, errors) = caller.stop().await;
    assert!(ok > 0);
    assert_eq!(
        errors,
        Vec::<String>::new(),
        "a try on the hung proxy ends at the per-try timeout and goes to the other ({ok} ok)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_moves_grpc_calls_only_once_the_new_cluster_s_grpc_proxies_are_ready() {
    let a = SimCluster::start_grpc("demo-a", &[NodeType::Worker]).await;
    let b = SimCluster::start_grpc("demo-b", &[NodeType::Worker]).await;
    // b's HTTP proxy is ready, its gRPC proxy not yet listening: b is not ready.
    let nothing_there = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let b_without_grpc = b
        .yaml()
        .replace(&b.grpc[0].to_string(), &nothing_there.to_string());
    let yaml = |b_yaml: &str| {
        format!(
            "rayservices:\n  - name: demo\n    namespace: default\n    hosts: [\"*\"]\n    active_cluster: demo-a\n    pending_cluster: demo-b\n    clusters:\n{}{}",
            a.yaml(),
            b_yaml
        )
    };
    let s = Stack::with(yaml(&b_without_grpc))
        .envoy(Bootstrap::Sotw)
        .start()
        .await;
    let client = echo(s.gateway_port);
    eventually("gRPC calls flow", DEADLINE, || async {
        say(&client, Duration::from_secs(2)).await.ok()
    })
    .await;
    // Long enough for b's HTTP proxy to be probed healthy many times over.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let by = served_by(&client, 10, Duration::from_secs(5)).await;
    assert_eq!(by.get(&a.grpc[0].to_string()), Some(&10), "{by:?}");
    let http = through_envoy(s.gateway_port).await.unwrap();
    assert_eq!(http.cluster, "demo-a", "HTTP waits with gRPC: one weight");
    let state = s.state().await.to_string();
    assert!(state.contains("gRPC proxies healthy"), "{state}");

    // b's gRPC proxy appears: the switch happens, for gRPC and HTTP alike.
    s.edit(&yaml(&b.yaml()));
    eventually("gRPC calls move to b", DEADLINE, || async {
        say(&client, Duration::from_secs(2))
            .await
            .ok()
            .filter(|m| m.cluster == "demo-b")
    })
    .await;
    let by = served_by(&client, 10, Duration::from_secs(5)).await;
    assert_eq!(by.get(&b.grpc[0].to_string()), Some(&10), "{by:?}");
    assert_eq!(
        through_envoy(s.gateway_port).await.unwrap().cluster,
        "demo-b"
    );
}

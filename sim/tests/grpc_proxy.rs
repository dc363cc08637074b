//! The simulated Ray Serve gRPC proxy, called with tonic clients over h2c: Ray's
//! `Healthz`/`ListApplications` in every mode, the demo application's three kinds of
//! call, application selection, the ledger, hanging, shutdown, the handle it shares with
//! the node's HTTP proxy, the dashboard's gRPC report and the binary's `--grpc`.

// A test is a scenario read top to bottom: its steps stay in one function.
#![allow(clippy::too_many_lines)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use futures_util::StreamExt;
use ray_serve_sim::dashboard::SimDashboard;
use ray_serve_sim::grpc::pb::demo::echo_client::EchoClient;
use ray_serve_sim::grpc::pb::demo::{SayManyRequest, SayRequest, Served};
use ray_serve_sim::grpc::pb::ray_serve::ray_serve_api_service_client::RayServeApiServiceClient;
use ray_serve_sim::grpc::pb::ray_serve::{
    HealthzRequest, HealthzResponse, ListApplicationsRequest,
};
use ray_serve_sim::grpc::serve_grpc_proxy_with;
use ray_serve_sim::{serve_proxy_with, NodeType, ProxyConfig, ProxyHandle, ProxyMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

/// Long enough for any call here that is meant to be answered.
const DEADLINE: Duration = Duration::from_secs(10);

const NOT_SET: &str = "Application metadata not set. Ping /ray.serve.RayServeAPIService/ListApplications for available applications.";

fn config(cluster: &str, node_type: NodeType, apps: &[(&str, &str)]) -> ProxyConfig {
    ProxyConfig {
        cluster: cluster.into(),
        node_type,
        routes: apps
            .iter()
            .map(|(prefix, app)| (prefix.to_string(), app.to_string()))
            .collect(),
    }
}

/// A gRPC proxy on a port of its own.
struct Proxy {
    address: SocketAddr,
    handle: ProxyHandle,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(config: ProxyConfig, handle: ProxyHandle) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve_grpc_proxy_with(
        listener,
        config,
        handle.clone(),
        shutdown.clone(),
    ));
    Proxy {
        address,
        handle,
        shutdown,
        task,
    }
}

impl Proxy {
    /// A channel whose every call gives up after `timeout` (connecting included).
    fn channel(&self, timeout: Duration) -> Channel {
        Endpoint::from_shared(format!("http://{}", self.address))
            .unwrap()
            .timeout(timeout)
            .connect_lazy()
    }

    fn api(&self) -> RayServeApiServiceClient<Channel> {
        RayServeApiServiceClient::new(self.channel(DEADLINE))
    }

    fn echo(&self) -> EchoClient<Channel> {
        EchoClient::new(self.channel(DEADLINE))
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("the proxy stops")
            .unwrap()
            .unwrap();
    }
}

/// `message` with metadata `application` (if given) and `x-request-id` (if given).
fn request<T>(message: T, app: Option<&str>, id: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(app) = app {
        request
            .metadata_mut()
            .insert("application", app.parse().unwrap());
    }
    if let Some(id) = id {
        request
            .metadata_mut()
            .insert("x-request-id", id.parse().unwrap());
    }
    request
}

fn say(text: &str) -> SayRequest {
    SayRequest { text: text.into() }
}

/// `Healthz`: the message, or the error's code and details.
async fn healthz(api: &mut RayServeApiServiceClient<Channel>) -> Result<String, (Code, String)> {
    tokio::time::timeout(DEADLINE, api.healthz(HealthzRequest {}))
        .await
        .expect("Healthz answers")
        .map(|r| r.into_inner().message)
        .map_err(|s| (s.code(), s.message().to_string()))
}

/// `ListApplications`: the names, or the error's code and details.
async fn list(api: &mut RayServeApiServiceClient<Channel>) -> Result<Vec<String>, (Code, String)> {
    tokio::time::timeout(DEADLINE, api.list_applications(ListApplicationsRequest {}))
        .await
        .expect("ListApplications answers")
        .map(|r| r.into_inner().application_names)
        .map_err(|s| (s.code(), s.message().to_string()))
}

/// `Say`: the answer, or the error's code and details.
async fn call_say(
    echo: &mut EchoClient<Channel>,
    text: &str,
    app: Option<&str>,
    id: Option<&str>,
) -> Result<Served, (Code, String)> {
    tokio::time::timeout(DEADLINE, echo.say(request(say(text), app, id)))
        .await
        .expect("Say answers")
        .map(tonic::Response::into_inner)
        .map_err(|s| (s.code(), s.message().to_string()))
}

fn served(
    proxy: &Proxy,
    cluster: &str,
    node_type: &str,
    app: &str,
    text: &str,
    index: u32,
) -> Served {
    Served {
        cluster: cluster.into(),
        proxy: proxy.address.to_string(),
        node_type: node_type.into(),
        app: app.into(),
        text: text.into(),
        index,
    }
}

fn unavailable(message: &str) -> (Code, String) {
    (Code::Unavailable, message.to_string())
}

#[tokio::test]
async fn healthz_and_list_applications_follow_the_mode() {
    let proxy = start(
        config(
            "c1",
            NodeType::Worker,
            &[("/a", "a"), ("/b", "b"), ("/b2", "b")],
        ),
        ProxyHandle::default(),
    )
    .await;
    let mut api = proxy.api();
    let apps = vec!["a".to_string(), "b".to_string()];
    // Healthy, and every mode that leaves health alone.
    for mode in [
        ProxyMode::Serving,
        ProxyMode::Overloaded,
        ProxyMode::ResetAfterRead,
        ProxyMode::Slow(Duration::from_millis(100)),
    ] {
        proxy.handle.set(mode.clone());
        assert_eq!(healthz(&mut api).await, Ok("success".into()), "{mode:?}");
        assert_eq!(list(&mut api).await, Ok(apps.clone()), "{mode:?}");
    }
    proxy.handle.set(ProxyMode::Draining);
    assert_eq!(
        healthz(&mut api).await,
        Err(unavailable("This node is being drained."))
    );
    assert_eq!(
        list(&mut api).await,
        Err(unavailable("This node is being drained."))
    );
    proxy.handle.set(ProxyMode::NotReady);
    assert_eq!(
        healthz(&mut api).await,
        Err(unavailable("Route table is not populated yet."))
    );
    assert_eq!(
        list(&mut api).await,
        Err(unavailable("Route table is not populated yet."))
    );
    proxy.handle.set(ProxyMode::NoReplicas);
    assert_eq!(
        healthz(&mut api).await,
        Err(unavailable("No replicas are available yet."))
    );
    assert_eq!(
        list(&mut api).await,
        Err(unavailable("No replicas are available yet."))
    );
    proxy.handle.set(ProxyMode::Flapping);
    let mut answers = Vec::new();
    for _ in 0..4 {
        answers.push(healthz(&mut api).await.map_err(|(code, _)| code));
        assert_eq!(
            list(&mut api).await,
            Ok(apps.clone()),
            "ListApplications does not flap"
        );
    }
    assert_eq!(
        answers,
        [
            Ok("success".into()),
            Err(Code::Internal),
            Ok("success".into()),
            Err(Code::Internal)
        ]
    );
    proxy.handle.set(ProxyMode::Serving);
    assert_eq!(healthz(&mut api).await, Ok("success".into()));
    assert_eq!(
        proxy.handle.received(),
        0,
        "health calls are not application calls"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn unary_server_streaming_and_bidirectional_answers_say_who_served() {
    let proxy = start(
        config("c1", NodeType::Head, &[("/", "hello")]),
        ProxyHandle::default(),
    )
    .await;
    let mut echo = proxy.echo();

    assert_eq!(
        call_say(&mut echo, "hi", None, None).await,
        Ok(served(&proxy, "c1", "head", "hello", "hi", 0))
    );

    let many = tokio::time::timeout(DEADLINE, async {
        let mut stream = echo
            .say_many(SayManyRequest {
                text: "again".into(),
                count: 3,
                every_ms: 20,
            })
            .await
            .unwrap()
            .into_inner();
        let mut all = Vec::new();
        while let Some(answer) = stream.message().await.unwrap() {
            all.push(answer);
        }
        all
    })
    .await
    .expect("SayMany ends");
    assert_eq!(
        many,
        (0..3)
            .map(|i| served(&proxy, "c1", "head", "hello", "again", i))
            .collect::<Vec<_>>()
    );

    // Each message is answered as it arrives: the next is sent only after the answer.
    tokio::time::timeout(DEADLINE, async {
        let (tx, rx) = tokio::sync::mpsc::channel::<SayRequest>(1);
        let outbound =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        tx.send(say("one")).await.unwrap();
        let mut answers = echo.chat(outbound).await.unwrap().into_inner();
        assert_eq!(
            answers.message().await.unwrap(),
            Some(served(&proxy, "c1", "head", "hello", "one", 0))
        );
        tx.send(say("two")).await.unwrap();
        assert_eq!(
            answers.message().await.unwrap(),
            Some(served(&proxy, "c1", "head", "hello", "two", 1))
        );
        drop(tx);
        assert_eq!(
            answers.message().await.unwrap(),
            None,
            "ends with the client's stream"
        );
    })
    .await
    .expect("Chat answers");
    assert_eq!(proxy.handle.received(), 3);
    proxy.stop().await;
}

#[tokio::test]
async fn one_application_takes_every_call_whatever_its_name() {
    let proxy = start(
        config("c1", NodeType::Worker, &[("/hello", "hello")]),
        ProxyHandle::default(),
    )
    .await;
    let mut echo = proxy.echo();
    for app in [None, Some("hello"), Some("nope"), Some("")] {
        let answer = call_say(&mut echo, "x", app, None).await.unwrap();
        assert_eq!(answer.app, "hello", "application metadata {app:?}");
        assert_eq!(answer.node_type, "worker");
    }
    proxy.stop().await;
}

#[tokio::test]
async fn several_applications_need_the_right_name() {
    let proxy = start(
        config("c1", NodeType::Worker, &[("/a", "alpha"), ("/b", "beta")]),
        ProxyHandle::default(),
    )
    .await;
    let mut echo = proxy.echo();
    assert_eq!(
        call_say(&mut echo, "x", Some("alpha"), Some("r1"))
            .await
            .unwrap()
            .app,
        "alpha"
    );
    assert_eq!(
        call_say(&mut echo, "x", Some("beta"), Some("r2"))
            .await
            .unwrap()
            .app,
        "beta"
    );
    assert_eq!(
        call_say(&mut echo, "x", Some("gamma"), Some("r3")).await,
        Err((
            Code::NotFound,
            "Application 'gamma' not found. Ping /ray.serve.RayServeAPIService/ListApplications for available applications.".into()
        ))
    );
    assert_eq!(
        call_say(&mut echo, "x", None, Some("r4")).await,
        Err((Code::NotFound, NOT_SET.into()))
    );
    // Streaming calls are routed the same way.
    let status = echo
        .say_many(request(
            SayManyRequest {
                text: "x".into(),
                count: 1,
                every_ms: 0,
            },
            Some("gamma"),
            None,
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let runs = proxy.handle.executions().all();
    assert_eq!(
        runs.keys().collect::<Vec<_>>(),
        ["r1", "r2"],
        "an unknown application ran nothing"
    );
    assert_eq!(proxy.handle.received(), 5, "turned away, but received");
    proxy.stop().await;
}

#[tokio::test]
async fn calls_that_ran_are_recorded_under_their_request_id() {
    let proxy = start(
        config("c1", NodeType::Worker, &[("/", "hello")]),
        ProxyHandle::default(),
    )
    .await;
    let mut echo = proxy.echo();
    let at = |id: &str| {
        proxy
            .handle
            .executions()
            .all()
            .get(id)
            .cloned()
            .unwrap_or_default()
    };

    assert!(call_say(&mut echo, "x", None, Some("served")).await.is_ok());
    assert_eq!(at("served"), [proxy.address]);

    proxy.handle.set(ProxyMode::Draining);
    assert!(
        call_say(&mut echo, "x", None, Some("draining"))
            .await
            .is_ok(),
        "a draining proxy serves"
    );
    assert_eq!(at("draining"), [proxy.address]);

    proxy.handle.set(ProxyMode::Flapping);
    assert!(call_say(&mut echo, "x", None, Some("flapping"))
        .await
        .is_ok());
    assert_eq!(at("flapping"), [proxy.address]);

    proxy
        .handle
        .set(ProxyMode::Slow(Duration::from_millis(100)));
    assert!(call_say(&mut echo, "x", None, Some("slow")).await.is_ok());
    assert_eq!(at("slow"), [proxy.address]);

    proxy.handle.set(ProxyMode::Overloaded);
    let (code, message) = call_say(&mut echo, "x", None, Some("overloaded"))
        .await
        .unwrap_err();
    assert_eq!(code, Code::ResourceExhausted);
    assert!(message.contains("backpressure"), "{message}");
    assert_eq!(at("overloaded"), [], "backpressure: nothing ran");

    // No route table: no application, not even the only one (Ray's NOT_FOUND, capture 28).
    proxy.handle.set(ProxyMode::NotReady);
    assert_eq!(
        call_say(&mut echo, "x", None, Some("not-ready")).await,
        Err((Code::NotFound, NOT_SET.into()))
    );
    assert_eq!(
        call_say(&mut echo, "x", Some("hello"), Some("not-ready")).await,
        Err((
            Code::NotFound,
            "Application 'hello' not found. Ping /ray.serve.RayServeAPIService/ListApplications for available applications.".into()
        ))
    );
    assert_eq!(at("not-ready"), [], "no route table: nothing ran");

    proxy.handle.set(ProxyMode::Serving);
    assert!(call_say(&mut echo, "x", None, Some("served")).await.is_ok());
    assert_eq!(
        at("served"),
        [proxy.address, proxy.address],
        "a retry runs again"
    );
    assert!(
        call_say(&mut echo, "x", None, None).await.is_ok(),
        "no request id: served, not recorded"
    );
    assert_eq!(proxy.handle.executions().total(), 5);
    assert_eq!(proxy.handle.received(), 9);
    proxy.stop().await;
}

#[tokio::test]
async fn reset_after_read_runs_the_call_and_answers_nothing() {
    let proxy = start(
        config("c1", NodeType::Worker, &[("/", "hello")]),
        ProxyHandle::default(),
    )
    .await;
    proxy.handle.set(ProxyMode::ResetAfterRead);
    let mut api = proxy.api();
    assert_eq!(
        healthz(&mut api).await,
        Ok("success".into()),
        "health is untouched"
    );
    assert_eq!(list(&mut api).await, Ok(vec!["hello".to_string()]));

    let mut echo = proxy.echo();
    let result = call_say(&mut echo, "x", None, Some("unary")).await;
    // RST_STREAM INTERNAL_ERROR, which tonic reports as INTERNAL (a closed connection
    // would be UNAVAILABLE or UNKNOWN).
    assert!(
        matches!(result, Err((Code::Internal, _))),
        "a reset is a client error: {result:?}"
    );
    assert_eq!(proxy.handle.executions().count("unary"), 1, "it ran");

    // A client stream is read to its end first.
    let messages = futures_util::stream::iter([say("1"), say("2"), say("3")]);
    let mut chat = tonic::Request::new(messages);
    chat.metadata_mut()
        .insert("x-request-id", "chat".parse().unwrap());
    let outcome = tokio::time::timeout(DEADLINE, async {
        match echo.chat(chat).await {
            Err(status) => Err(status.code()),
            Ok(answers) => {
                let answers: Vec<_> = answers.into_inner().collect().await;
                Ok(answers)
            }
        }
    })
    .await
    .expect("the reset arrives");
    match outcome {
        Err(code) => assert_eq!(code, Code::Internal),
        Ok(answers) => panic!("answered {answers:?}"),
    }
    assert_eq!(proxy.handle.executions().count("chat"), 1, "it ran");

    // The connection is still good for the next call.
    proxy.handle.set(ProxyMode::Serving);
    assert!(call_say(&mut echo, "x", None, Some("after")).await.is_ok());
    proxy.stop().await;
}

/// An HTTP/2 client's connection preface and an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// The client's own timeout ended the call: nothing was answered.
fn timed_out<T: std::fmt::Debug>(result: Result<T, (Code, String)>) {
    match result {
        Err((code, _)) => assert!(
            matches!(code, Code::Cancelled | Code::DeadlineExceeded),
            "{code:?}"
        ),
        Ok(answer) => panic!("a hung proxy answered {answer:?}"),
    }
}

#[tokio::test]
async fn a_hung_proxy_answers_nothing_until_it_resumes() {
    let proxy = start(
        config("c1", NodeType::Worker, &[("/", "hello")]),
        ProxyHandle::default(),
    )
    .await;
    let timeout = Duration::from_millis(300);
    // A connection opened before the hang.
    let mut open = RayServeApiServiceClient::new(proxy.channel(timeout));
    assert_eq!(healthz(&mut open).await, Ok("success".into()));
    let mut open_echo = EchoClient::new(proxy.channel(timeout));
    assert!(call_say(&mut open_echo, "x", None, None).await.is_ok());
    proxy.handle.set(ProxyMode::Hang);

    timed_out(healthz(&mut open).await);
    timed_out(list(&mut open).await);
    timed_out(call_say(&mut open_echo, "x", None, Some("hung")).await);
    // A connection opened during the hang.
    let mut fresh = RayServeApiServiceClient::new(proxy.channel(timeout));
    timed_out(healthz(&mut fresh).await);
    let mut fresh_echo = EchoClient::new(proxy.channel(timeout));
    // Not even HTTP/2: the server sends no SETTINGS to a client's preface.
    let mut raw = tokio::net::TcpStream::connect(proxy.address).await.unwrap();
    raw.write_all(H2_PREFACE).await.unwrap();
    let mut buffer = [0u8; 64];
    assert!(
        tokio::time::timeout(timeout, raw.read(&mut buffer))
            .await
            .is_err(),
        "a hung proxy sent HTTP/2 frames"
    );
    timed_out(call_say(&mut fresh_echo, "x", None, Some("hung")).await);
    assert_eq!(
        proxy.handle.executions().count("hung"),
        0,
        "nothing reached the proxy"
    );
    assert_eq!(proxy.handle.received(), 1);

    proxy.handle.set(ProxyMode::Serving);
    let read = tokio::time::timeout(DEADLINE, raw.read(&mut buffer)).await;
    assert!(
        matches!(read, Ok(Ok(n)) if n > 0),
        "resumed, the held connection gets the server's SETTINGS: {read:?}"
    );
    // (It would not answer the PING of a graceful shutdown, which would then wait 30 s.)
    drop(raw);
    assert_eq!(healthz(&mut open).await, Ok("success".into()));
    assert_eq!(healthz(&mut fresh).await, Ok("success".into()));
    assert!(call_say(&mut fresh_echo, "x", None, None).await.is_ok());
    proxy.stop().await;
}

#[tokio::test]
async fn shutdown_refuses_new_connections_and_finishes_calls_in_flight() {
    let proxy = start(
        config("c1", NodeType::Worker, &[("/", "hello")]),
        ProxyHandle::default(),
    )
    .await;
    proxy.handle.set(ProxyMode::Slow(Duration::from_secs(1)));
    let mut echo = proxy.echo();
    let in_flight =
        tokio::spawn(async move { call_say(&mut echo, "late", None, Some("slow")).await });
    let handle = proxy.handle.clone();
    eventually("the call reaches the proxy", DEADLINE, || async {
        (handle.received() == 1).then_some(())
    })
    .await;
    proxy.shutdown.cancel();
    let address = proxy.address;
    eventually("new connections are refused", DEADLINE, || async {
        tokio::net::TcpStream::connect(address).await.err()
    })
    .await;
    let answer = tokio::time::timeout(DEADLINE, in_flight)
        .await
        .expect("the call in flight finishes")
        .unwrap()
        .expect("the call in flight is answered");
    assert_eq!(answer.text, "late");
    assert_eq!(proxy.handle.executions().count("slow"), 1);
    tokio::time::timeout(DEADLINE, proxy.task)
        .await
        .expect("the proxy stops")
        .unwrap()
        .unwrap();
}

/// One node: its HTTP and gRPC proxies share a handle, so one mode and one ledger.
#[tokio::test]
async fn the_node_s_http_and_grpc_proxies_share_one_handle() {
    let config = config("c1", NodeType::Worker, &[("/", "hello")]);
    let handle = ProxyHandle::default();
    let http_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = http_listener.local_addr().unwrap();
    let http_shutdown = CancellationToken::new();
    let http_task = tokio::spawn(serve_proxy_with(
        http_listener,
        config.clone(),
        handle.clone(),
        http_shutdown.clone(),
    ));
    let grpc = start(config, handle.clone()).await;
    let mut api = grpc.api();
    let mut echo = grpc.echo();
    let http_healthz =
        || async move { http_get(&format!("http://{http}/-/healthz")).await.unwrap() };

    assert_eq!(http_healthz().await, (200, "success".to_string()));
    assert_eq!(healthz(&mut api).await, Ok("success".into()));
    handle.set(ProxyMode::Draining);
    assert_eq!(
        http_healthz().await,
        (503, "This node is being drained.".to_string())
    );
    assert_eq!(
        healthz(&mut api).await,
        Err(unavailable("This node is being drained."))
    );
    handle.set(ProxyMode::Serving);

    // One request id, run over HTTP and then over gRPC: one ledger has both.
    let (status, _) = {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>();
        let request = hyper::Request::post(format!("http://{http}/infer"))
            .header("x-request-id", "both")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        let response = client.request(request).await.unwrap();
        (response.status().as_u16(), ())
    };
    assert_eq!(status, 200);
    assert!(call_say(&mut echo, "x", None, Some("both")).await.is_ok());
    assert_eq!(
        handle
            .executions()
            .all()
            .get("both")
            .cloned()
            .unwrap_or_default(),
        [http, grpc.address]
    );
    assert_eq!(handle.received(), 2);

    // HTTP's flapping count is its own: each protocol alternates.
    handle.set(ProxyMode::Flapping);
    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.push(http_healthz().await.0);
        seen.push(match healthz(&mut api).await {
            Ok(_) => 200,
            Err(_) => 500,
        });
    }
    assert_eq!(seen, [200, 200, 500, 500]);

    http_shutdown.cancel();
    tokio::time::timeout(DEADLINE, http_task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    grpc.stop().await;
}

/// `/api/serve/applications/` as the simulated dashboard answers it now.
async fn render(dashboard: &SimDashboard) -> serde_json::Value {
    use tower::ServiceExt;
    let response = dashboard
        .router()
        .oneshot(
            axum::http::Request::get("/api/serve/applications/")
                .body(axum::body::Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    serde_json::from_slice(&body).unwrap()
}

#[tokio::test]
async fn the_dashboard_reports_grpc_only_when_it_is_on() {
    let dashboard = SimDashboard::new();
    dashboard.set_app("hello", "/", "RUNNING");
    let head: SocketAddr = "127.0.0.1:8000".parse().unwrap();
    let worker: SocketAddr = "127.0.0.1:8001".parse().unwrap();
    dashboard.add_proxy(head, NodeType::Head, "HEALTHY");
    dashboard.add_proxy(worker, NodeType::Worker, "HEALTHY");
    let off = render(&dashboard).await;
    assert_eq!(
        off["grpc_options"],
        serde_json::json!({"port": 9000, "grpc_servicer_functions": [], "request_timeout_s": null, "enable_reflection": true})
    );
    assert_eq!(off["target_groups"].as_array().unwrap().len(), 1);
    assert_eq!(off["target_groups"][0]["protocol"], "HTTP");

    // Ports set before gRPC is on change nothing yet.
    assert!(dashboard.set_proxy_grpc_port(worker, 9001));
    assert!(!dashboard.set_proxy_grpc_port("127.0.0.1:1".parse().unwrap(), 9002));
    assert_eq!(
        render(&dashboard).await["target_groups"],
        off["target_groups"]
    );

    dashboard.set_grpc_options(9000, &["echo_pb2_grpc.add_EchoServicer_to_server"]);
    dashboard.set_proxy_status(head, "DRAINING");
    let on = render(&dashboard).await;
    assert_eq!(on["grpc_options"]["port"], 9000);
    assert_eq!(
        on["grpc_options"]["grpc_servicer_functions"],
        serde_json::json!(["echo_pb2_grpc.add_EchoServicer_to_server"])
    );
    let groups = on["target_groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0]["protocol"], "HTTP");
    assert_eq!(groups[1]["protocol"], "gRPC");
    assert_eq!(groups[1]["route_prefix"], "/");
    let ports = |group: &serde_json::Value| -> Vec<u64> {
        group["targets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["port"].as_u64().unwrap())
            .collect()
    };
    // Only HEALTHY proxies are targets, in both groups.
    assert_eq!(ports(&groups[0]), [8001]);
    assert_eq!(ports(&groups[1]), [9001]);
    assert_eq!(
        groups[0]["targets"][0]["name"],
        groups[1]["targets"][0]["name"]
    );
    dashboard.set_proxy_status(head, "HEALTHY");
    assert_eq!(
        ports(&render(&dashboard).await["target_groups"][1]),
        [9000, 9001]
    );
    // ray-xds reads the HTTP proxies as before.
    let status = ray_xds::live::dashboard::parse(on.to_string().as_bytes()).unwrap();
    assert_eq!(status.http_proxies.len(), 2);

    // No servicer functions, or port 0: off again (Ray's `is_grpc_enabled`).
    dashboard.set_grpc_options(0, &["f"]);
    assert_eq!(
        render(&dashboard).await["target_groups"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    dashboard.set_grpc_options(9000, &[]);
    assert_eq!(
        render(&dashboard).await["target_groups"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

/// `ray-serve-sim --grpc`: a gRPC proxy beside each HTTP proxy, one node each.
#[tokio::test]
async fn the_binary_runs_a_grpc_proxy_beside_each_http_proxy() {
    let (p1, p2, g1, g2, dash, ctl) = (
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
    );
    let dir = tempfile::tempdir().unwrap();
    let stdout = dir.path().join("stdout");
    let _sim = spawn(
        Command::new(env!("CARGO_BIN_EXE_ray-serve-sim"))
            .args(["--cluster", "c1", "--app", "/hello=hello"])
            .args(["--proxy", &format!("127.0.0.1:{p1}=head")])
            .args(["--proxy", &format!("127.0.0.1:{p2}=worker")])
            .args(["--grpc", &format!("127.0.0.1:{p1}=127.0.0.1:{g1}")])
            .args(["--grpc", &format!("127.0.0.1:{p2}=127.0.0.1:{g2}")])
            .args(["--dashboard", &format!("127.0.0.1:{dash}")])
            .args(["--control", &format!("127.0.0.1:{ctl}")])
            .stdout(Stdio::from(std::fs::File::create(&stdout).unwrap())),
    );
    let healthz_at = |port: u16| async move {
        let channel = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .timeout(Duration::from_secs(5))
            .connect_lazy();
        RayServeApiServiceClient::new(channel)
            .healthz(HealthzRequest {})
            .await
            .map(|r| r.into_inner().message)
            .map_err(|s| (s.code(), s.message().to_string()))
    };
    eventually(
        "the gRPC proxies are up",
        Duration::from_secs(30),
        || async {
            match (healthz_at(g1).await, healthz_at(g2).await) {
                (Ok(_), Ok(_)) => Some(()),
                _ => None,
            }
        },
    )
    .await;
    eventually("control is up", Duration::from_secs(20), || async {
        http_get(&format!("http://127.0.0.1:{ctl}/executions"))
            .await
            .ok()
    })
    .await;

    let printed = std::fs::read_to_string(&stdout).unwrap();
    assert!(
        printed.contains(&format!(
            "{{ address: 127.0.0.1:{p1}, node_type: head, grpc: 127.0.0.1:{g1} }}"
        )),
        "{printed}"
    );
    assert!(
        printed.contains(&format!(
            "{{ address: 127.0.0.1:{p2}, node_type: worker, grpc: 127.0.0.1:{g2} }}"
        )),
        "{printed}"
    );

    // A call to the worker's gRPC proxy, recorded in the process's ledger.
    let mut echo = EchoClient::new(
        Endpoint::from_shared(format!("http://127.0.0.1:{g2}"))
            .unwrap()
            .connect_lazy(),
    );
    let answer = echo
        .say(request(say("hi"), None, Some("via-grpc")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            answer.cluster.as_str(),
            answer.node_type.as_str(),
            answer.app.as_str()
        ),
        ("c1", "worker", "hello")
    );
    assert_eq!(answer.proxy, format!("127.0.0.1:{g2}"));
    let (_, body) = http_get(&format!("http://127.0.0.1:{ctl}/executions"))
        .await
        .unwrap();
    let runs: BTreeMap<String, Vec<String>> = serde_json::from_str(&body).unwrap();
    assert_eq!(runs["via-grpc"], [format!("127.0.0.1:{g2}")]);

    // The mode is the node's: set through either port, seen on both.
    let control = |method: &'static str, path: String, body: &'static str| async move {
        http(method, &format!("http://127.0.0.1:{ctl}{path}"), body)
            .await
            .unwrap()
            .0
    };
    assert_eq!(
        control("PUT", format!("/proxies/{g2}/mode"), "draining").await,
        200
    );
    assert_eq!(
        healthz_at(g2).await,
        Err(unavailable("This node is being drained."))
    );
    let (status, _) = http_get(&format!("http://127.0.0.1:{p2}/-/healthz"))
        .await
        .unwrap();
    assert_eq!(status, 503);
    assert_eq!(
        control("PUT", format!("/proxies/{p2}/mode"), "serving").await,
        200
    );
    assert_eq!(healthz_at(g2).await, Ok("success".into()));

    // The dashboard reports gRPC: the head's port, and each proxy's own.
    let (_, body) = http_get(&format!("http://127.0.0.1:{dash}/api/serve/applications/"))
        .await
        .unwrap();
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["grpc_options"]["port"], g1);
    let grpc_group = &status["target_groups"][1];
    assert_eq!(grpc_group["protocol"], "gRPC");
    let mut ports: Vec<u64> = grpc_group["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["port"].as_u64().unwrap())
        .collect();
    ports.sort();
    let mut want = vec![u64::from(g1), u64::from(g2)];
    want.sort();
    assert_eq!(ports, want);

    // Killing the node stops both proxies; starting it brings both back.
    assert_eq!(
        control("POST", format!("/proxies/{p2}/kill"), "").await,
        200
    );
    eventually("both ports refuse", Duration::from_secs(10), || async {
        let grpc = tokio::net::TcpStream::connect(("127.0.0.1", g2)).await;
        let http = tokio::net::TcpStream::connect(("127.0.0.1", p2)).await;
        (grpc.is_err() && http.is_err()).then_some(())
    })
    .await;
    assert_eq!(
        control("POST", format!("/proxies/{g2}/start"), "").await,
        200
    );
    assert_eq!(healthz_at(g2).await, Ok("success".into()));
    assert_eq!(
        http_get(&format!("http://127.0.0.1:{p2}/-/healthz"))
            .await
            .unwrap()
            .0,
        200
    );
}

/// `--grpc` must name a `--proxy` on the same IP.
#[test]
fn the_binary_refuses_a_grpc_proxy_without_its_node() {
    let run = |grpc: &str| {
        Command::new(env!("CARGO_BIN_EXE_ray-serve-sim"))
            .args([
                "--cluster",
                "c1",
                "--proxy",
                "127.0.0.1:1=head",
                "--grpc",
                grpc,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .unwrap()
    };
    let other_node = run("127.0.0.1:2=127.0.0.1:3");
    assert!(!other_node.status.success());
    assert!(String::from_utf8_lossy(&other_node.stderr).contains("no --proxy 127.0.0.1:2"));
    let other_ip = run("127.0.0.1:1=127.0.0.2:3");
    assert!(!other_ip.status.success());
    assert!(String::from_utf8_lossy(&other_ip.stderr).contains("on its node's IP"));
}

/// One call's answer as HTTP/2 carried it.
#[derive(Debug, PartialEq, Eq)]
struct Wire {
    status: u16,
    /// The response headers (the first HEADERS frame).
    headers: BTreeMap<String, String>,
    /// Each DATA frame's bytes, in order.
    data: Vec<Vec<u8>>,
    /// The trailing HEADERS frame; `None` when the first one ended the stream
    /// (trailers-only).
    trailers: Option<BTreeMap<String, String>>,
}

impl Wire {
    /// The gRPC messages in the DATA frames (each a 5-byte prefix and its bytes).
    fn messages(&self) -> Vec<Vec<u8>> {
        let mut all: &[u8] = &self.data.concat();
        let mut messages = Vec::new();
        while all.len() >= 5 {
            let len = u32::from_be_bytes(all[1..5].try_into().unwrap()) as usize;
            messages.push(all[5..5 + len].to_vec());
            all = &all[5 + len..];
        }
        assert!(all.is_empty(), "a partial message: {self:?}");
        messages
    }
}

fn header_map(headers: &hyper::HeaderMap) -> BTreeMap<String, String> {
    headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_string()))
        .collect()
}

fn pairs(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Calls `path` on `address` over h2c with `metadata` and the gRPC `messages`, then the
/// end of the request stream, and reads the answer frame by frame.
async fn wire(
    address: SocketAddr,
    path: &str,
    metadata: &[(&str, &str)],
    messages: &[&[u8]],
) -> Wire {
    use http_body_util::BodyExt;

    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let mut framed = Vec::new();
    for message in messages {
        framed.push(0u8);
        framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
        framed.extend_from_slice(message);
    }
    let mut request = hyper::Request::post(format!("http://{address}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (key, value) in metadata {
        request = request.header(*key, *value);
    }
    let request = request
        .body(http_body_util::Full::new(bytes::Bytes::from(framed)))
        .unwrap();
    tokio::time::timeout(DEADLINE, async {
        let response = client.request(request).await.unwrap();
        let (parts, mut body) = response.into_parts();
        let mut answer = Wire {
            status: parts.status.as_u16(),
            headers: header_map(&parts.headers),
            data: Vec::new(),
            trailers: None,
        };
        while let Some(frame) = body.frame().await {
            let frame = frame.unwrap();
            match frame.into_data() {
                Ok(data) => answer.data.push(data.to_vec()),
                Err(frame) => {
                    let trailers = frame.into_trailers().unwrap();
                    assert!(answer.trailers.is_none(), "two trailing HEADERS frames");
                    answer.trailers = Some(header_map(&trailers));
                }
            }
        }
        answer
    })
    .await
    .expect("answered")
}

/// The response headers of every answer of Ray's that is not trailers-only.
fn ray_headers() -> BTreeMap<String, String> {
    pairs(&[
        ("content-type", "application/grpc"),
        ("grpc-accept-encoding", "identity, deflate, gzip"),
    ])
}

/// A unary method's error as Ray sends it: headers, the empty message, trailers.
fn unary_error(code: Code, message: &str) -> Wire {
    let code = (code as i32).to_string();
    Wire {
        status: 200,
        headers: ray_headers(),
        data: vec![vec![0; 5]],
        trailers: Some(pairs(&[("grpc-status", &code), ("grpc-message", message)])),
    }
}

/// A trailers-only error: the status in the only HEADERS frame.
fn trailers_only(code: Code, message: &str) -> Wire {
    let code = (code as i32).to_string();
    Wire {
        status: 200,
        headers: pairs(&[
            ("content-type", "application/grpc"),
            ("grpc-status", &code),
            ("grpc-message", message),
        ]),
        data: Vec::new(),
        trailers: None,
    }
}

/// An `OK` answer's trailers.
fn ok_trailers(message: &str) -> Option<BTreeMap<String, String>> {
    Some(pairs(&[("grpc-status", "0"), ("grpc-message", message)]))
}

const HEALTHZ: &str = "/ray.serve.RayServeAPIService/Healthz";
const LIST: &str = "/ray.serve.RayServeAPIService/ListApplications";
const SAY: &str = "/ray_xds.demo.Echo/Say";
const SAY_MANY: &str = "/ray_xds.demo.Echo/SayMany";
const CHAT: &str = "/ray_xds.demo.Echo/Chat";

/// Captured from Ray 2.60 (`tests/fixtures/ray-serve-2.60/grpc/`, 10-34): every answer to a
/// unary method, error or not, is response headers, one DATA frame and trailers (an error's
/// message is the empty one); a streaming method's error before its first message is
/// trailers-only, and its answers end with trailers.
#[tokio::test]
async fn unary_errors_come_after_an_empty_message_and_stream_errors_before_answers_are_trailers_only(
) {
    use prost::Message;

    let proxy = start(
        config("c1", NodeType::Worker, &[("/a", "a"), ("/b", "b")]),
        ProxyHandle::default(),
    )
    .await;
    let at = proxy.address;
    let say = SayRequest { text: "x".into() }.encode_to_vec();
    let many = SayManyRequest {
        text: "x".into(),
        count: 2,
        every_ms: 0,
    }
    .encode_to_vec();
    let not_found = "Application 'c' not found. Ping /ray.serve.RayServeAPIService/ListApplications for available applications.";

    // OK from Ray's own API: `grpc-message: success` (10, 11).
    let ok = wire(at, HEALTHZ, &[], &[&[]]).await;
    assert_eq!(
        (ok.status, &ok.headers, ok.data.len(), &ok.trailers),
        (200, &ray_headers(), 1, &ok_trailers("success")),
        "{ok:?}"
    );
    assert_eq!(
        ok.messages(),
        [HealthzResponse {
            message: "success".into()
        }
        .encode_to_vec()]
    );
    let ok = wire(at, LIST, &[], &[&[]]).await;
    assert_eq!(
        (ok.status, &ok.headers, ok.data.len(), &ok.trailers),
        (200, &ray_headers(), 1, &ok_trailers("success")),
        "{ok:?}"
    );
    // OK from an application: an empty `grpc-message` (12).
    let ok = wire(at, SAY, &[("application", "a")], &[&say]).await;
    assert_eq!(
        (ok.status, &ok.headers, ok.data.len(), &ok.trailers),
        (200, &ray_headers(), 1, &ok_trailers("")),
        "{ok:?}"
    );
    assert_eq!(Served::decode(&ok.messages()[0][..]).unwrap().app, "a");
    let ok = wire(at, SAY_MANY, &[("application", "b")], &[&many]).await;
    assert_eq!(
        (&ok.headers, ok.messages().len(), &ok.trailers),
        (&ray_headers(), 2, &ok_trailers("")),
        "{ok:?}"
    );
    let ok = wire(at, CHAT, &[("application", "b")], &[&say, &say]).await;
    assert_eq!(
        (&ok.headers, ok.messages().len(), &ok.trailers),
        (&ray_headers(), 2, &ok_trailers("")),
        "{ok:?}"
    );

    // The proxy's own errors: unary after an empty message, streaming trailers-only (21).
    assert_eq!(
        wire(at, SAY, &[("application", "c")], &[&say]).await,
        unary_error(Code::NotFound, not_found)
    );
    assert_eq!(
        wire(at, SAY, &[], &[&say]).await,
        unary_error(Code::NotFound, NOT_SET)
    );
    assert_eq!(
        wire(at, SAY_MANY, &[("application", "c")], &[&many]).await,
        trailers_only(Code::NotFound, not_found)
    );
    assert_eq!(
        wire(at, CHAT, &[("application", "c")], &[&say]).await,
        trailers_only(Code::NotFound, not_found)
    );

    // Backpressure (23, 24).
    proxy.handle.set(ProxyMode::Overloaded);
    let backpressure = ray_serve_sim::grpc::BACKPRESSURE_MESSAGE;
    assert_eq!(
        wire(at, SAY, &[("application", "a")], &[&say]).await,
        unary_error(Code::ResourceExhausted, backpressure)
    );
    assert_eq!(
        wire(at, SAY_MANY, &[("application", "a")], &[&many]).await,
        trailers_only(Code::ResourceExhausted, backpressure)
    );

    // Healthz and ListApplications refusing (32, 34), and flapping.
    for (mode, text) in [
        (ProxyMode::Draining, "This node is being drained."),
        (ProxyMode::NotReady, "Route table is not populated yet."),
        (ProxyMode::NoReplicas, "No replicas are available yet."),
    ] {
        proxy.handle.set(mode);
        for path in [HEALTHZ, LIST] {
            assert_eq!(
                wire(at, path, &[], &[&[]]).await,
                unary_error(Code::Unavailable, text),
                "{path}"
            );
        }
    }
    proxy.handle.set(ProxyMode::Flapping);
    let flaps = [
        wire(at, HEALTHZ, &[], &[&[]]).await,
        wire(at, HEALTHZ, &[], &[&[]]).await,
    ];
    assert!(
        flaps.contains(&unary_error(Code::Internal, "flapping")),
        "{flaps:?}"
    );

    // No route table: NOT_FOUND, framed the same way (28).
    proxy.handle.set(ProxyMode::NotReady);
    assert_eq!(
        wire(at, SAY, &[("application", "c")], &[&say]).await,
        unary_error(Code::NotFound, not_found)
    );
    assert_eq!(
        wire(at, SAY_MANY, &[("application", "c")], &[&many]).await,
        trailers_only(Code::NotFound, not_found)
    );
    proxy.stop().await;
}

/// grpc core's own errors are trailers-only whatever the method (19, 25, 26), and a method
/// the server lacks never reaches Ray's proxy: not counted, not recorded.
#[tokio::test]
async fn grpc_core_s_errors_are_trailers_only_for_every_method() {
    use prost::Message;

    let proxy = start(
        config("c1", NodeType::Worker, &[("/a", "a"), ("/b", "b")]),
        ProxyHandle::default(),
    )
    .await;
    let at = proxy.address;
    let say = SayRequest { text: "x".into() }.encode_to_vec();
    let unknown = [
        "/ray_xds.demo.Echo/Nope",
        "/no.such.Service/Say",
        "/grpc.health.v1.Health/Check",
        "/ray.serve.RayServeAPIService/Nope",
    ];
    for path in unknown {
        assert_eq!(
            wire(at, path, &[("x-request-id", "unknown")], &[&say]).await,
            trailers_only(Code::Unimplemented, "Method not found!"),
            "{path}"
        );
    }
    // Unknown even with no `application` among several: grpc core answers first.
    assert_eq!(
        wire(at, "/ray_xds.demo.Echo/Nope", &[], &[&say]).await,
        trailers_only(Code::Unimplemented, "Method not found!")
    );
    assert_eq!(proxy.handle.received(), 0, "Ray's proxy saw none");
    assert_eq!(proxy.handle.executions().total(), 0);

    // A client's `grpc-timeout` that runs out before the answer (25).
    proxy.handle.set(ProxyMode::Slow(Duration::from_secs(2)));
    let many = SayManyRequest {
        text: "x".into(),
        count: 2,
        every_ms: 0,
    }
    .encode_to_vec();
    for (path, message) in [(SAY, say.clone()), (SAY_MANY, many), (HEALTHZ, Vec::new())] {
        let started = std::time::Instant::now();
        let metadata = [
            ("application", "a"),
            ("grpc-timeout", "200m"),
            ("x-request-id", path),
        ];
        assert_eq!(
            wire(at, path, &metadata, &[&message]).await,
            trailers_only(Code::DeadlineExceeded, "Deadline Exceeded"),
            "{path}"
        );
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_millis(1500),
            "{path}: {took:?}"
        );
    }
    assert_eq!(
        proxy.handle.executions().count(SAY),
        1,
        "slow: recorded on arrival, before the deadline"
    );
    // A deadline long enough: answered.
    proxy
        .handle
        .set(ProxyMode::Slow(Duration::from_millis(100)));
    let ok = wire(
        at,
        SAY,
        &[("application", "a"), ("grpc-timeout", "5S")],
        &[&say],
    )
    .await;
    assert_eq!(ok.trailers, ok_trailers(""), "{ok:?}");
    proxy.stop().await;
}

/// `NoReplicas` (a worker node's proxy before its node's replica is up, capture 32): both
/// proxies' health says so; application calls wait for a replica (the mode to change), on
/// either protocol, then run.
#[tokio::test]
async fn no_replicas_refuses_health_and_holds_calls_until_a_replica_is_up() {
    let config = config("c1", NodeType::Worker, &[("/", "hello")]);
    let handle = ProxyHandle::default();
    let http_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = http_listener.local_addr().unwrap();
    let http_shutdown = CancellationToken::new();
    let http_task = tokio::spawn(serve_proxy_with(
        http_listener,
        config.clone(),
        handle.clone(),
        http_shutdown.clone(),
    ));
    let grpc = start(config, handle.clone()).await;
    let mut api = grpc.api();
    let mut echo = grpc.echo();
    assert_eq!("no-replicas".parse(), Ok(ProxyMode::NoReplicas));

    handle.set(ProxyMode::NoReplicas);
    let text = "No replicas are available yet.";
    assert_eq!(healthz(&mut api).await, Err(unavailable(text)));
    assert_eq!(list(&mut api).await, Err(unavailable(text)));
    for path in ["/-/healthz", "/-/routes"] {
        assert_eq!(
            http_get(&format!("http://{http}{path}")).await.unwrap(),
            (503, text.to_string()),
            "{path}"
        );
    }
    let grpc_call = tokio::spawn(async move { call_say(&mut echo, "held", None, Some("g")).await });
    let http_call = tokio::spawn(async move {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>();
        let request = hyper::Request::post(format!("http://{http}/infer"))
            .header("x-request-id", "h")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        client.request(request).await.unwrap().status().as_u16()
    });
    let counted = handle.clone();
    eventually("both calls reach their proxy", DEADLINE, || async {
        (counted.received() == 2).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!grpc_call.is_finished() && !http_call.is_finished(), "held");
    assert_eq!(handle.executions().total(), 0, "nothing ran yet");

    handle.set(ProxyMode::Serving);
    let answer = tokio::time::timeout(DEADLINE, grpc_call)
        .await
        .expect("answered once a replica is up")
        .unwrap()
        .unwrap();
    assert_eq!(answer.text, "held");
    let status = tokio::time::timeout(DEADLINE, http_call)
        .await
        .expect("answered once a replica is up")
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(handle.executions().count("g"), 1);
    assert_eq!(handle.executions().count("h"), 1);
    assert_eq!(handle.received(), 2);

    http_shutdown.cancel();
    tokio::time::timeout(DEADLINE, http_task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    grpc.stop().await;
}

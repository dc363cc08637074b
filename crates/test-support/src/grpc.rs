//! gRPC clients of Envoy's listener for the tests that send calls through it: the demo
//! `Echo` service the simulator serves on each node's gRPC proxy.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use ray_serve_sim::grpc::pb::demo::echo_client::EchoClient;
use ray_serve_sim::grpc::pb::demo::{SayRequest, Served};
use tonic::transport::Channel;

use super::Envoy;

/// A gRPC client of Envoy's listener (h2c, one connection, opened lazily; messages up to
/// 64 MiB).
pub fn echo(gateway_port: u16) -> EchoClient<Channel> {
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{gateway_port}"))
            .unwrap()
            .connect_lazy();
    EchoClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

/// One unary call with `grpc-timeout: timeout` (None: no header), given up by the client
/// two seconds after (as `CANCELLED`, "CLIENT GAVE UP").
pub async fn say_with(
    client: &EchoClient<Channel>,
    text: String,
    timeout: Option<Duration>,
) -> Result<Served, tonic::Status> {
    let mut request = tonic::Request::new(SayRequest { text });
    if let Some(t) = timeout {
        request.set_timeout(t);
    }
    let give_up = timeout.unwrap_or(Duration::from_secs(60)) + Duration::from_secs(2);
    let mut client = client.clone();
    match tokio::time::timeout(give_up, client.say(request)).await {
        Ok(answer) => answer.map(tonic::Response::into_inner),
        Err(_) => Err(tonic::Status::cancelled("CLIENT GAVE UP (no answer)")),
    }
}

/// One unary call with a client deadline.
pub async fn say(client: &EchoClient<Channel>, timeout: Duration) -> Result<Served, tonic::Status> {
    say_with(client, "hi".into(), Some(timeout)).await
}

/// Which gRPC proxies serve `n` calls, each with deadline `t` ("FAILED: <code>: <message>"
/// for the others).
pub async fn served_by(
    client: &EchoClient<Channel>,
    n: usize,
    t: Duration,
) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let who = match say(client, t).await {
            Ok(s) => s.proxy,
            Err(e) => format!("FAILED: {:?}: {}", e.code(), e.message()),
        };
        *out.entry(who).or_default() += 1;
    }
    out
}

/// How many calls of a [`served_by`] count failed.
pub fn failures(by: &BTreeMap<String, usize>) -> usize {
    by.iter()
        .filter(|(k, _)| k.starts_with("FAILED"))
        .map(|(_, v)| v)
        .sum()
}

/// Hosts Envoy lists in one of its clusters, from its admin `/clusters`.
pub async fn envoy_hosts(envoy: &Envoy, cluster: &str) -> Vec<String> {
    let text = envoy.admin("/clusters").await;
    let prefix = format!("{cluster}::");
    let mut hosts: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| rest.split_once("::").map(|(host, _)| host.to_string()))
        .filter(|h| h.parse::<SocketAddr>().is_ok())
        .collect();
    hosts.sort();
    hosts.dedup();
    hosts
}

//! Bare ADS clients for tests: envoy-types' own gRPC client, driven request by request, so
//! a test can play an Envoy that ACKs late, NACKs, reconnects elsewhere or misbehaves.

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

/// How long a test waits for one response.
const RESPONSE_DEADLINE: Duration = Duration::from_secs(20);

pub async fn client(
    xds: SocketAddr,
) -> AggregatedDiscoveryServiceClient<tonic::transport::Channel> {
    try_client(xds).await.unwrap()
}

pub async fn try_client(
    xds: SocketAddr,
) -> Result<AggregatedDiscoveryServiceClient<tonic::transport::Channel>, tonic::transport::Error> {
    AggregatedDiscoveryServiceClient::connect(format!("http://{xds}")).await
}

pub fn node(id: &str) -> Option<Node> {
    Some(Node {
        id: id.into(),
        cluster: "test".into(),
        ..Default::default()
    })
}

/// A state-of-the-world stream: requests go in through the sender.
pub async fn sotw_stream(
    xds: SocketAddr,
) -> (mpsc::Sender<DiscoveryRequest>, Streaming<DiscoveryResponse>) {
    let (tx, rx) = mpsc::channel(16);
    let responses = client(xds)
        .await
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, responses)
}

/// A delta stream: requests go in through the sender.
pub async fn delta_stream(
    xds: SocketAddr,
) -> (
    mpsc::Sender<DeltaDiscoveryRequest>,
    Streaming<DeltaDiscoveryResponse>,
) {
    let (tx, rx) = mpsc::channel(16);
    let responses = client(xds)
        .await
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, responses)
}

/// The next response; panics if none comes in time or the stream ends.
pub async fn next<T>(responses: &mut Streaming<T>) -> T {
    tokio::time::timeout(RESPONSE_DEADLINE, responses.message())
        .await
        .expect("a response in time")
        .unwrap()
        .expect("stream open")
}

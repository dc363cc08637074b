//! An ADS man-in-the-middle that breaks chosen clusters on their way to a real Envoy.
//!
//! ray-xds validates everything it is given, so it never sends a cluster Envoy rejects;
//! this proxy makes one (a negative connect timeout, which Envoy's validation refuses),
//! so a test can watch a real Envoy NACK a real invalid cluster and see what ray-xds does
//! about it. Everything else passes through untouched, in both directions, on both
//! protocols; a stream to the proxy is a stream to ray-xds.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::{Any, Duration as ProtoDuration};
use prost::Message;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

type Breaks = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// A running proxy; it stops when dropped.
pub struct Tamper {
    /// Where Envoy should connect instead of ray-xds.
    pub addr: SocketAddr,
    stop: CancellationToken,
}

impl Drop for Tamper {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts a proxy in front of the ADS server at `upstream` that breaks every cluster
/// whose name `breaks` picks.
pub async fn start(
    upstream: SocketAddr,
    breaks: impl Fn(&str) -> bool + Send + Sync + 'static,
) -> Tamper {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let proxy = Proxy {
        upstream,
        breaks: Arc::new(breaks),
    };
    let until = stop.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(AggregatedDiscoveryServiceServer::new(proxy))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                until.cancelled_owned(),
            )
            .await
            .unwrap();
    });
    Tamper { addr, stop }
}

#[derive(Clone)]
struct Proxy {
    upstream: SocketAddr,
    breaks: Breaks,
}

type Responses<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A broken copy of `any` if it is a cluster `breaks` picks.
fn tamper(any: &mut Any, breaks: &Breaks) {
    if !any.type_url.ends_with("envoy.config.cluster.v3.Cluster") {
        return;
    }
    let mut cluster = Cluster::decode(&*any.value).expect("a cluster");
    if breaks(&cluster.name) {
        cluster.connect_timeout = Some(ProtoDuration {
            seconds: -1,
            nanos: 0,
        });
        any.value = cluster.encode_to_vec();
    }
}

impl Proxy {
    async fn client(
        &self,
    ) -> Result<
        envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient<tonic::transport::Channel>,
        Status,
    >{
        super::ads::try_client(self.upstream)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Proxy {
    type StreamAggregatedResourcesStream = Responses<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = Responses<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let requests = request
            .into_inner()
            .take_while(Result::is_ok)
            .map(Result::unwrap);
        let responses = self
            .client()
            .await?
            .stream_aggregated_resources(requests)
            .await?
            .into_inner();
        let breaks = self.breaks.clone();
        Ok(Response::new(Box::pin(responses.map(move |r| {
            r.map(|mut response| {
                for any in &mut response.resources {
                    tamper(any, &breaks);
                }
                response
            })
        }))))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let requests = request
            .into_inner()
            .take_while(Result::is_ok)
            .map(Result::unwrap);
        let responses = self
            .client()
            .await?
            .delta_aggregated_resources(requests)
            .await?
            .into_inner();
        let breaks = self.breaks.clone();
        Ok(Response::new(Box::pin(responses.map(move |r| {
            r.map(|mut response| {
                for resource in &mut response.resources {
                    if let Some(any) = &mut resource.resource {
                        tamper(any, &breaks);
                    }
                }
                response
            })
        }))))
    }
}

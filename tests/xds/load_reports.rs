//! Envoy's Load Reporting Service on the xDS port, driven by envoy-types' own LRS client:
//! what a well-behaved Envoy gets, and what a misbehaving client cannot do (no node, a
//! flood of clusters, a stream cut mid-way), with the server still answering.

use std::time::Duration;

use envoy_types::pb::envoy::config::endpoint::v3::{ClusterStats, UpstreamLocalityStats};
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::envoy::service::load_stats::v3::load_reporting_service_client::LoadReportingServiceClient;
use envoy_types::pb::envoy::service::load_stats::v3::LoadStatsRequest;
use ray_serve_sim::NodeType;
use ray_xds::xds::snapshot::{CLUSTER_TYPE_URL, ENDPOINTS_TYPE_URL};
use support::ads::node;
use support::*;

use crate::{server_with, Server};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const DEADLINE: Duration = Duration::from_secs(20);

async fn server() -> Server {
    server_with(&[NodeType::Head], |_| {}).await
}

async fn lrs_stream(
    xds: std::net::SocketAddr,
) -> (
    mpsc::Sender<LoadStatsRequest>,
    tonic::Streaming<envoy_types::pb::envoy::service::load_stats::v3::LoadStatsResponse>,
) {
    let mut client = LoadReportingServiceClient::connect(format!("http://{xds}"))
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(16);
    let responses = client
        .stream_load_stats(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, responses)
}

fn report(clusters: usize) -> LoadStatsRequest {
    named_report((0..clusters).map(|i| format!("nobody/has/{i}")))
}

fn named_report(names: impl Iterator<Item = String>) -> LoadStatsRequest {
    LoadStatsRequest {
        node: None,
        cluster_stats: names
            .map(|cluster_name| ClusterStats {
                cluster_name,
                upstream_locality_stats: vec![UpstreamLocalityStats {
                    total_successful_requests: u64::MAX,
                    total_error_requests: u64::MAX,
                    total_requests_in_progress: u64::MAX,
                    ..Default::default()
                }],
                ..Default::default()
            })
            .collect(),
    }
}

/// An ADS stream of node `id` that has ACKed the clusters and `cluster`'s endpoints.
async fn warmed_envoy(
    xds: std::net::SocketAddr,
    id: &str,
    cluster: &str,
) -> (
    mpsc::Sender<DiscoveryRequest>,
    tonic::Streaming<envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse>,
) {
    let (tx, mut rx) = support::ads::sotw_stream(xds).await;
    let request =
        |type_url: &str, names: Vec<String>, version: &str, nonce: &str| DiscoveryRequest {
            node: node(id),
            type_url: type_url.into(),
            resource_names: names,
            version_info: version.into(),
            response_nonce: nonce.into(),
            ..Default::default()
        };
    tx.send(request(CLUSTER_TYPE_URL, vec![], "", ""))
        .await
        .unwrap();
    let cds = support::ads::next(&mut rx).await;
    tx.send(request(
        CLUSTER_TYPE_URL,
        vec![],
        &cds.version_info,
        &cds.nonce,
    ))
    .await
    .unwrap();
    let names = vec![cluster.to_string()];
    tx.send(request(ENDPOINTS_TYPE_URL, names.clone(), "", ""))
        .await
        .unwrap();
    let eds = support::ads::next(&mut rx).await;
    tx.send(request(
        ENDPOINTS_TYPE_URL,
        names,
        &eds.version_info,
        &eds.nonce,
    ))
    .await
    .unwrap();
    (tx, rx)
}

async fn metric_now(admin: std::net::SocketAddr, series: &str) -> f64 {
    metric(&admin_get(admin, "/metrics").await, series)
}

#[tokio::test]
async fn an_envoy_is_asked_for_every_cluster_and_what_no_switch_tracks_is_skipped() {
    let s = server().await;
    // gw-1's ADS stream holds the one cluster there is (and its endpoints).
    let _gw1 = warmed_envoy(s.running.xds_addr, "gw-1", "default/demo/demo-a").await;
    let (tx, mut rx) = lrs_stream(s.running.xds_addr).await;
    tx.send(LoadStatsRequest {
        node: node("gw-1"),
        cluster_stats: Vec::new(),
    })
    .await
    .unwrap();
    let first = tokio::time::timeout(DEADLINE, rx.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(first.send_all_clusters, "{first:?}");
    assert_eq!(
        first.load_reporting_interval.map(|d| (d.seconds, d.nanos)),
        Some((2, 0)),
        "switchover.load_report_interval's default"
    );
    let admin = s.running.admin_addr;
    assert_eq!(metric_now(admin, "ray_xds_load_streams").await, 1.0);
    // No switch under way: nothing is tracked, so the cluster gw-1 takes is skipped
    // (garbage numbers included); entries on clusters it was never given are refused;
    // the stream goes on.
    let names = [
        "default/demo/demo-a",
        "default/demo/demo-a/grpc",
        "other/s/b",
    ];
    tx.send(named_report(names.iter().map(|n| n.to_string())))
        .await
        .unwrap();
    tx.send(report(2)).await.unwrap();
    eventually("the reports are counted", DEADLINE, || async {
        let untracked = r#"ray_xds_load_report_clusters_total{result="untracked"}"#;
        let not_held = r#"ray_xds_load_report_clusters_total{result="not_held"}"#;
        let counted = (
            metric_now(admin, untracked).await,
            metric_now(admin, not_held).await,
        );
        (counted == (1.0, 4.0)).then_some(())
    })
    .await;
    drop(tx);
    eventually("the stream ends", DEADLINE, || async {
        (metric_now(admin, "ray_xds_load_streams").await == 0.0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_stream_that_names_no_node_is_refused_and_a_flood_of_clusters_costs_nothing() {
    let s = server().await;
    let (tx, mut rx) = lrs_stream(s.running.xds_addr).await;
    tx.send(report(1)).await.unwrap();
    let refused = tokio::time::timeout(DEADLINE, rx.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    let admin = s.running.admin_addr;
    assert_eq!(
        metric_now(
            admin,
            "ray_xds_xds_stream_errors_total{protocol=\"lrs\",reason=\"no_node\"}"
        )
        .await,
        1.0
    );

    // 20,000 clusters in one report (about 1 MiB): skipped, counted, and the server
    // still serves ADS and load reports.
    let (tx, mut rx) = lrs_stream(s.running.xds_addr).await;
    let mut flood = report(20_000);
    flood.node = node("gw-2");
    tx.send(flood).await.unwrap();
    tokio::time::timeout(DEADLINE, rx.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    eventually("the flood is refused", DEADLINE, || async {
        let not_held = r#"ray_xds_load_report_clusters_total{result="not_held"}"#;
        (metric_now(admin, not_held).await == 20_000.0).then_some(())
    })
    .await;
    // A stream cut mid-message ends alone.
    drop(tx);
    drop(rx);
    let (ads_tx, mut ads_rx) = support::ads::sotw_stream(s.running.xds_addr).await;
    ads_tx
        .send(
            envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest {
                node: node("gw-3"),
                type_url: ray_xds::xds::snapshot::CLUSTER_TYPE_URL.into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(support::ads::next(&mut ads_rx).await.resources.len(), 1);
}

/// A stream that says nothing after its first message is closed after five report
/// intervals; one address holds at most 64 streams, and a place comes back when one ends.
#[tokio::test]
async fn a_silent_stream_is_closed_and_one_address_cannot_take_every_place() {
    let s = server_with(&[NodeType::Head], |config| {
        config.policies.switchover.load_report_interval = Duration::from_secs(1);
    })
    .await;
    let running = &s.running;
    let hello = || LoadStatsRequest {
        node: node("gw-1"),
        cluster_stats: Vec::new(),
    };
    let (silent_tx, mut silent) = lrs_stream(running.xds_addr).await;
    silent_tx.send(hello()).await.unwrap();
    silent.message().await.unwrap().unwrap();
    let started = std::time::Instant::now();
    let closed = tokio::time::timeout(DEADLINE, silent.message())
        .await
        .expect("closed within the deadline")
        .unwrap_err();
    assert_eq!(closed.code(), tonic::Code::DeadlineExceeded, "{closed:?}");
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "not before five intervals"
    );

    let mut held = Vec::new();
    for _ in 0..ray_xds::xds::lrs::MAX_STREAMS_PER_PEER {
        let (tx, mut rx) = lrs_stream(running.xds_addr).await;
        tx.send(hello()).await.unwrap();
        rx.message().await.unwrap().unwrap();
        held.push((tx, rx));
    }
    let (tx, mut rx) = lrs_stream(running.xds_addr).await;
    // (Refused at once: the send may find the stream closed already.)
    let _ = tx.send(hello()).await;
    let refused = rx.message().await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    drop(held.pop());
    eventually("a place comes back", DEADLINE, || async {
        let (tx, mut rx) = lrs_stream(running.xds_addr).await;
        tx.send(hello()).await.ok()?;
        let answer = rx.message().await.ok()??;
        Some(answer).map(|_| ())
    })
    .await;
}

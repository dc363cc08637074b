//! Envoy's Load Reporting Service on the xDS port, driven by envoy-types' own LRS client:
//! what a well-behaved Envoy gets, and what a misbehaving client cannot do (no node, a
//! flood of clusters, a stream cut mid-way), with the server still answering.

use std::time::Duration;

use envoy_types::pb::envoy::config::endpoint::v3::{ClusterStats, UpstreamLocalityStats};
use envoy_types::pb::envoy::service::load_stats::v3::load_reporting_service_client::LoadReportingServiceClient;
use envoy_types::pb::envoy::service::load_stats::v3::LoadStatsRequest;
use ray_serve_sim::NodeType;
use support::ads::node;
use support::*;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const DEADLINE: Duration = Duration::from_secs(20);

struct Server {
    _dir: tempfile::TempDir,
    running: ray_xds::runtime::Running,
    _cluster: SimCluster,
}

async fn server() -> Server {
    let cluster = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&cluster])).unwrap();
    let running = ray_xds::runtime::start(test_config(&services, free_port()), Default::default())
        .await
        .unwrap();
    Server {
        _dir: dir,
        running,
        _cluster: cluster,
    }
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
    LoadStatsRequest {
        node: None,
        cluster_stats: (0..clusters)
            .map(|i| ClusterStats {
                cluster_name: format!("nobody/tracks/{i}"),
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

async fn metric_now(admin: std::net::SocketAddr, series: &str) -> f64 {
    metric(&admin_get(admin, "/metrics").await, series)
}

#[tokio::test]
async fn an_envoy_is_asked_for_every_cluster_and_what_no_switch_tracks_is_skipped() {
    let s = server().await;
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
    // No switch under way: nothing is tracked, every entry is skipped (garbage numbers
    // included), and the stream goes on.
    tx.send(report(3)).await.unwrap();
    tx.send(report(2)).await.unwrap();
    eventually("the reports are counted", DEADLINE, || async {
        let skipped = metric_now(
            admin,
            "ray_xds_load_report_clusters_total{result=\"untracked\"}",
        )
        .await;
        (skipped == 5.0).then_some(())
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
    eventually("the flood is skipped", DEADLINE, || async {
        let skipped = metric_now(
            admin,
            "ray_xds_load_report_clusters_total{result=\"untracked\"}",
        )
        .await;
        (skipped == 20_000.0).then_some(())
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

//! The tonic server on port 0, driven by envoy-types' own ADS client, both protocols,
//! including misbehaving clients.

use std::time::Duration;

use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DiscoveryRequest, DiscoveryResponse,
};
use ray_serve_sim::NodeType;
use ray_xds::xds::snapshot::{CLUSTER_TYPE_URL, ENDPOINTS_TYPE_URL};
use support::ads::{delta_stream, next, node, sotw_stream};
use support::*;

use crate::{server_with, Server};

const DEADLINE: Duration = Duration::from_secs(20);

async fn server() -> Server {
    server_with(&[NodeType::Head, NodeType::Worker], |_| {}).await
}

#[tokio::test]
async fn sotw_client_gets_clusters_acks_and_follows_changes() {
    let s = server().await;
    let (tx, mut rx) = sotw_stream(s.running.xds_addr).await;
    tx.send(DiscoveryRequest {
        node: node("sotw-1"),
        type_url: CLUSTER_TYPE_URL.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let cds = next(&mut rx).await;
    assert_eq!(cds.type_url, CLUSTER_TYPE_URL);
    assert_eq!(cds.resources.len(), 1);
    tx.send(DiscoveryRequest {
        type_url: CLUSTER_TYPE_URL.into(),
        version_info: cds.version_info.clone(),
        response_nonce: cds.nonce.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let eds_name = "default/demo/demo-a".to_string();
    tx.send(DiscoveryRequest {
        type_url: ENDPOINTS_TYPE_URL.into(),
        resource_names: vec![eds_name.clone()],
        ..Default::default()
    })
    .await
    .unwrap();
    let eds = next(&mut rx).await;
    assert_eq!(eds.type_url, ENDPOINTS_TYPE_URL);
    tx.send(DiscoveryRequest {
        type_url: ENDPOINTS_TYPE_URL.into(),
        resource_names: vec![eds_name.clone()],
        version_info: eds.version_info.clone(),
        response_nonce: eds.nonce.clone(),
        ..Default::default()
    })
    .await
    .unwrap();

    let clients = eventually(
        "the client shows in /debug/clients with its ACKs",
        DEADLINE,
        || async {
            // The node's streams whole (the list shows each in brief).
            let text = admin_get(s.running.admin_addr, "/debug/clients?node=sotw-1").await;
            let v: serde_json::Value = serde_json::from_str(&text).ok()?;
            let c = v["clients"]
                .as_array()?
                .iter()
                .find(|c| c["node"]["id"] == "sotw-1")?
                .clone();
            (c["types"]["eds"]["acks"] == 1 && c["types"]["cds"]["acks"] == 1).then_some(c)
        },
    )
    .await;
    assert_eq!(clients["types"]["eds"]["subscribed"][0], eds_name);
    assert_eq!(clients["types"]["cds"]["subscribed"][0], "*");
    assert_eq!(
        clients["types"]["eds"]["last_acked_version"],
        eds.version_info
    );

    // A new proxy: only the endpoints change.
    let other = SimCluster::start("demo-a", &[NodeType::Worker]).await;
    let mut text = services_yaml("demo-a", &[&s._cluster]);
    text += &other
        .yaml()
        .lines()
        .skip(2)
        .map(|l| format!("{l}\n"))
        .collect::<String>();
    write_atomic(&s.services, &text);
    let update = next(&mut rx).await;
    assert_eq!(update.type_url, ENDPOINTS_TYPE_URL, "only EDS changes");
    assert_ne!(update.version_info, eds.version_info);
    let metrics = admin_get(s.running.admin_addr, "/metrics").await;
    assert_eq!(
        metric(&metrics, "ray_xds_xds_streams{protocol=\"sotw\"}"),
        1.0,
        "{metrics}"
    );
}

#[tokio::test]
async fn delta_client_gets_only_changes() {
    let s = server().await;
    let (tx, mut rx) = delta_stream(s.running.xds_addr).await;
    tx.send(DeltaDiscoveryRequest {
        node: node("delta-1"),
        type_url: ENDPOINTS_TYPE_URL.into(),
        resource_names_subscribe: vec!["default/demo/demo-a".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let first = next(&mut rx).await;
    assert_eq!(first.resources.len(), 1);
    assert_eq!(first.resources[0].name, "default/demo/demo-a");
    tx.send(DeltaDiscoveryRequest {
        type_url: ENDPOINTS_TYPE_URL.into(),
        response_nonce: first.nonce.clone(),
        ..Default::default()
    })
    .await
    .unwrap();

    // A reconnecting client that already holds the current version is sent its
    // endpoints once more, unchanged (a cluster it was warming when its stream broke
    // waits for an assignment sent after it), then only changes.
    let (tx2, mut rx2) = delta_stream(s.running.xds_addr).await;
    let mut req = DeltaDiscoveryRequest {
        node: node("delta-2"),
        type_url: ENDPOINTS_TYPE_URL.into(),
        resource_names_subscribe: vec!["default/demo/demo-a".into()],
        ..Default::default()
    };
    req.initial_resource_versions.insert(
        "default/demo/demo-a".into(),
        first.resources[0].version.clone(),
    );
    tx2.send(req).await.unwrap();
    let again = next(&mut rx2).await;
    assert_eq!(again.resources.len(), 1);
    assert_eq!(again.resources[0].version, first.resources[0].version);
    tx2.send(DeltaDiscoveryRequest {
        type_url: ENDPOINTS_TYPE_URL.into(),
        response_nonce: again.nonce.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), rx2.message())
            .await
            .is_err(),
        "nothing more until something changes"
    );

    write_atomic(
        &s.services,
        &services_yaml(
            "demo-a",
            &[&SimCluster::start("demo-a", &[NodeType::Head]).await],
        ),
    );
    let update = next(&mut rx).await;
    assert_eq!(update.resources.len(), 1);
    assert_ne!(update.resources[0].version, first.resources[0].version);
    let update2 = next(&mut rx2).await;
    assert_eq!(update2.resources[0].version, update.resources[0].version);
}

#[tokio::test]
async fn an_unknown_type_url_ends_only_that_stream() {
    let s = server().await;
    let (good_tx, mut good_rx) = sotw_stream(s.running.xds_addr).await;
    good_tx
        .send(DiscoveryRequest {
            node: node("good"),
            type_url: CLUSTER_TYPE_URL.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let cds = next(&mut good_rx).await;

    let (bad_tx, mut bad_rx) = sotw_stream(s.running.xds_addr).await;
    bad_tx
        .send(DiscoveryRequest {
            type_url: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let err = tokio::time::timeout(DEADLINE, bad_rx.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("unknown type_url"), "{err}");

    // The good stream still works: ACK and get an update.
    good_tx
        .send(DiscoveryRequest {
            type_url: CLUSTER_TYPE_URL.into(),
            version_info: cds.version_info.clone(),
            response_nonce: cds.nonce.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let b = SimCluster::start("demo-b", &[NodeType::Head]).await;
    write_atomic(&s.services, &services_yaml("demo-a", &[&s._cluster, &b]));
    let update = next(&mut good_rx).await;
    assert_eq!(update.resources.len(), 2);
    let m = admin_get(s.running.admin_addr, "/metrics").await;
    assert_eq!(
        metric(
            &m,
            "ray_xds_xds_stream_errors_total{protocol=\"sotw\",reason=\"unknown_type\"}"
        ),
        1.0,
        "{m}"
    );
}

/// A message that is not a DiscoveryRequest: field 2 (`node`, a message) as a fixed64.
#[derive(Clone, PartialEq, prost::Message)]
struct Garbage {
    #[prost(fixed64, tag = "2")]
    x: u64,
}

#[tokio::test]
async fn garbage_and_oversized_messages_end_only_that_stream() {
    let s = server().await;
    let (good_tx, mut good_rx) = delta_stream(s.running.xds_addr).await;
    good_tx
        .send(DeltaDiscoveryRequest {
            node: node("good"),
            type_url: CLUSTER_TYPE_URL.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let first = next(&mut good_rx).await;

    // Garbage bytes, through tonic's generic client with our own codec.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", s.running.xds_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
    );
    let garbage = tokio_stream::iter(vec![Garbage { x: 42 }]).chain(tokio_stream::pending());
    let result = grpc
        .streaming::<_, Garbage, DiscoveryResponse, _>(
            tonic::Request::new(garbage),
            path,
            tonic_prost::ProstCodec::default(),
        )
        .await;
    let err = match result {
        Ok(resp) => tokio::time::timeout(DEADLINE, resp.into_inner().message())
            .await
            .unwrap()
            .unwrap_err(),
        Err(e) => e,
    };
    assert_eq!(err.code(), tonic::Code::Internal, "{err}");

    // An oversized request (more than the 4 MiB limit).
    let (big_tx, mut big_rx) = sotw_stream(s.running.xds_addr).await;
    big_tx
        .send(DiscoveryRequest {
            type_url: ENDPOINTS_TYPE_URL.into(),
            resource_names: (0..50_000).map(|i| format!("{i:0>100}")).collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    let err = tokio::time::timeout(DEADLINE, big_rx.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::OutOfRange, "{err}");

    // The good stream is unaffected.
    good_tx
        .send(DeltaDiscoveryRequest {
            type_url: CLUSTER_TYPE_URL.into(),
            response_nonce: first.nonce.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let b = SimCluster::start("demo-b", &[NodeType::Head]).await;
    write_atomic(&s.services, &services_yaml("demo-a", &[&s._cluster, &b]));
    let update = next(&mut good_rx).await;
    assert_eq!(update.resources.len(), 1);
    assert_eq!(update.resources[0].name, "default/demo/demo-b");
    let m = admin_get(s.running.admin_addr, "/metrics").await;
    assert_eq!(
        metric(
            &m,
            "ray_xds_xds_stream_errors_total{protocol=\"sotw\",reason=\"bad_message\"}"
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "ray_xds_xds_stream_errors_total{protocol=\"sotw\",reason=\"too_large\"}"
        ),
        1.0,
        "{m}"
    );
}

use tokio_stream::StreamExt;

#[tokio::test]
async fn a_stuck_client_does_not_delay_others() {
    let s = server().await;
    // The stuck client subscribes and then never reads or ACKs anything.
    let mut stuck = Vec::new();
    for i in 0..5 {
        let (tx, rx) = sotw_stream(s.running.xds_addr).await;
        tx.send(DiscoveryRequest {
            node: node(&format!("stuck-{i}")),
            type_url: ENDPOINTS_TYPE_URL.into(),
            resource_names: vec!["default/demo/demo-a".into()],
            ..Default::default()
        })
        .await
        .unwrap();
        stuck.push((tx, rx));
    }
    let (tx, mut rx) = sotw_stream(s.running.xds_addr).await;
    let eds = "default/demo/demo-a".to_string();
    tx.send(DiscoveryRequest {
        node: node("live"),
        type_url: ENDPOINTS_TYPE_URL.into(),
        resource_names: vec![eds.clone()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut last = next(&mut rx).await;
    // Many changes in a row: the live client follows each one it ACKs, ending on the latest.
    let clusters: Vec<SimCluster> = {
        let mut v = Vec::new();
        for _ in 0..20 {
            v.push(SimCluster::start("demo-a", &[NodeType::Head]).await);
        }
        v
    };
    for c in &clusters {
        write_atomic(&s.services, &services_yaml("demo-a", &[c]));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let want = format!("{}", clusters.last().unwrap().proxies[0].0.port());
    loop {
        tx.send(DiscoveryRequest {
            type_url: ENDPOINTS_TYPE_URL.into(),
            resource_names: vec![eds.clone()],
            version_info: last.version_info.clone(),
            response_nonce: last.nonce.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        let cla =
            <ClusterLoadAssignment as prost::Message>::decode(&*last.resources[0].value).unwrap();
        if format!("{cla:?}").contains(&want) {
            break;
        }
        last = next(&mut rx).await;
    }
    // Each stuck stream holds at most one response per type.
    let clients: serde_json::Value =
        serde_json::from_str(&admin_get(s.running.admin_addr, "/debug/clients").await).unwrap();
    for c in clients["clients"].as_array().unwrap() {
        if c["node"]["id"].as_str().unwrap().starts_with("stuck") {
            assert_eq!(c["types"]["eds"]["pushes"], 1, "{c}");
        }
    }
}

#[tokio::test]
async fn silent_sockets_on_the_xds_port_are_closed_and_clients_still_served() {
    use tokio::io::AsyncReadExt;
    let s = server().await;
    // Sockets that never send the HTTP/2 preface.
    let mut silent = Vec::new();
    for _ in 0..50 {
        silent.push(
            tokio::net::TcpStream::connect(s.running.xds_addr)
                .await
                .unwrap(),
        );
    }
    // A real client is served meanwhile.
    let (tx, mut rx) = sotw_stream(s.running.xds_addr).await;
    tx.send(DiscoveryRequest {
        node: node("live"),
        type_url: CLUSTER_TYPE_URL.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(!next(&mut rx).await.resources.is_empty());
    // Every silent socket is closed by the server (after its handshake timeout, 10 s).
    for mut conn in silent {
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {} // an HTTP/2 server preface (SETTINGS) may come first
                }
            }
        })
        .await;
        assert!(read.is_ok(), "a silent socket was held past its deadline");
    }
    let metrics = admin_get(s.running.admin_addr, "/metrics").await;
    assert!(
        metrics.contains(
            "ray_xds_xds_stream_errors_total{protocol=\"connection\",reason=\"silent\"} 50"
        ),
        "{metrics}"
    );
}

/// Issue 13: streams are bounded in total (`xds.max_streams`): one more is refused with
/// RESOURCE_EXHAUSTED before it costs anything, the streams already open are served, and
/// a stream that ends gives its place back.
#[tokio::test]
async fn streams_over_the_limit_are_refused_and_places_come_back() {
    let cluster = SimCluster::start("demo-a", &[NodeType::Head, NodeType::Worker]).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&cluster])).unwrap();
    let mut config = test_config(&services, free_port());
    config.xds_max_streams = 2;
    let running = ray_xds::runtime::start(config, Default::default())
        .await
        .unwrap();
    let xds = running.xds_addr;
    let ask = DiscoveryRequest {
        node: node("capped"),
        type_url: CLUSTER_TYPE_URL.into(),
        ..Default::default()
    };
    let (tx1, mut rx1) = sotw_stream(xds).await;
    tx1.send(ask.clone()).await.unwrap();
    next(&mut rx1).await;
    let (tx2, mut rx2) = delta_stream(xds).await;
    tx2.send(DeltaDiscoveryRequest {
        node: node("capped"),
        type_url: CLUSTER_TYPE_URL.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    next(&mut rx2).await;
    // The third: refused.
    let (tx3, mut rx3) = sotw_stream(xds).await;
    let _ = tx3.send(ask.clone()).await;
    let refused = tokio::time::timeout(DEADLINE, rx3.message())
        .await
        .expect("an answer in time");
    let status = refused.expect_err("the third stream is refused");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let metrics = admin_get(running.admin_addr, "/metrics").await;
    assert!(
        metrics.contains("reason=\"over_stream_limit\""),
        "{metrics}"
    );
    // The first two are still served.
    assert_eq!(
        metric(&metrics, "ray_xds_xds_streams{protocol=\"sotw\"}"),
        1.0
    );
    // One ends: a new stream gets its place.
    drop((tx1, rx1));
    eventually("a freed place is given again", DEADLINE, || async {
        let (tx, mut rx) = sotw_stream(xds).await;
        tx.send(ask.clone()).await.ok()?;
        tokio::time::timeout(Duration::from_secs(2), rx.message())
            .await
            .ok()?
            .ok()?
            .map(|_| ())
    })
    .await;
    drop((tx2, rx2));
    running.stop().await.unwrap();
}

/// With a bound on response bytes far below what the streams' first responses need at
/// once (`memory.xds_responses`), streams wait their turn and every one syncs; once they
/// have, nothing is held and nobody waits.
#[tokio::test]
async fn streams_over_the_response_bound_wait_their_turn_and_every_one_syncs() {
    let s = server_with(&[NodeType::Head, NodeType::Worker], |config| {
        config.memory.xds_responses = 2048;
    })
    .await;
    let eds = "default/demo/demo-a".to_string();
    let mut clients = Vec::new();
    for i in 0..40 {
        let addr = s.running.xds_addr;
        let eds = eds.clone();
        clients.push(tokio::spawn(async move {
            let (tx, mut rx) = sotw_stream(addr).await;
            let mut request = DiscoveryRequest {
                node: node(&format!("bounded-{i}")),
                type_url: CLUSTER_TYPE_URL.into(),
                ..Default::default()
            };
            for ty in [CLUSTER_TYPE_URL, ENDPOINTS_TYPE_URL] {
                request.type_url = ty.into();
                request.resource_names = match ty {
                    ENDPOINTS_TYPE_URL => vec![eds.clone()],
                    _ => vec![],
                };
                tx.send(request.clone()).await.unwrap();
                let response = next(&mut rx).await;
                assert_eq!(response.type_url, ty);
                assert_eq!(response.resources.len(), 1);
                request.version_info = response.version_info;
                request.response_nonce = response.nonce;
                request.node = None;
                tx.send(request.clone()).await.unwrap();
                request.version_info.clear();
                request.response_nonce.clear();
            }
            (tx, rx)
        }));
    }
    let mut streams = Vec::new();
    for client in clients {
        streams.push(
            tokio::time::timeout(DEADLINE, client)
                .await
                .expect("every stream syncs under the bound")
                .unwrap(),
        );
    }
    eventually("the responses' room is given back", DEADLINE, || async {
        let metrics = admin_get(s.running.admin_addr, "/metrics").await;
        (metric(&metrics, "ray_xds_xds_response_bytes") == 0.0
            && metric(&metrics, "ray_xds_xds_responses_waiting") == 0.0)
            .then_some(())
    })
    .await;
}

/// A client that reads none of a response (its HTTP/2 window stays shut, as when an
/// application stops reading its stream) holds its room of the shared response bound
/// only until the write deadline: then its connection is closed, what it held comes
/// back, and other clients are served after. It is closed even while its stream waits
/// for room that its own unwritten response keeps taken (a second request makes it
/// try to build again, under a bound its first response fills).
#[tokio::test]
async fn a_client_that_reads_nothing_loses_its_connection_and_gives_its_room_back() {
    use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
    let s = server_with(&[NodeType::Head, NodeType::Worker], |config| {
        config.xds_limits.write_deadline = Duration::from_millis(500);
        config.memory.xds_responses = 2048;
    })
    .await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", s.running.xds_addr))
        .unwrap()
        .initial_stream_window_size(Some(1))
        .connect()
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(DiscoveryRequest {
        node: node("reads-nothing"),
        type_url: CLUSTER_TYPE_URL.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.send(DiscoveryRequest {
        type_url: ENDPOINTS_TYPE_URL.into(),
        resource_names: vec!["default/demo/demo-a".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut unread = AggregatedDiscoveryServiceClient::new(channel)
        .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    eventually(
        "its connection closed for not reading",
        DEADLINE,
        || async {
            let metrics = admin_get(s.running.admin_addr, "/metrics").await;
            (metric(
                &metrics,
                "ray_xds_xds_stream_errors_total{protocol=\"sotw\",reason=\"not_reading\"}",
            ) == 1.0
                && metric(&metrics, "ray_xds_xds_response_bytes") == 0.0)
                .then_some(())
        },
    )
    .await;
    let ended = tokio::time::timeout(DEADLINE, async {
        loop {
            match unread.message().await {
                Ok(Some(_)) => continue, // what had arrived before the close
                other => return other,
            }
        }
    })
    .await
    .expect("the unread stream ends");
    assert!(matches!(ended, Err(_) | Ok(None)), "{ended:?}");
    // Another client is served as before.
    let (tx, mut rx) = sotw_stream(s.running.xds_addr).await;
    tx.send(DiscoveryRequest {
        node: node("reads"),
        type_url: CLUSTER_TYPE_URL.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(next(&mut rx).await.type_url, CLUSTER_TYPE_URL);
}

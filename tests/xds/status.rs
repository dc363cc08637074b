//! `/debug/clients` in brief and whole, and `ray-xds status` reading it from a running
//! server: each Envoy's ACKed versions, and what one NACKed with its message.

use std::process::Command;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use envoy_types::pb::google::rpc::Status;
use ray_serve_sim::NodeType;
use ray_xds::xds::snapshot::CLUSTER_TYPE_URL;
use support::ads::{next, node, sotw_stream};
use support::*;

use crate::server_with;

const DEADLINE: Duration = Duration::from_secs(20);

#[tokio::test]
async fn status_shows_each_envoy_s_versions_and_what_one_nacked() {
    let s = server_with(&[NodeType::Head, NodeType::Worker], |_| {}).await;
    // One Envoy ACKs the clusters, another NACKs them.
    let (_acking, version) = answer_clusters(s.running.xds_addr, "status-acks", false).await;
    let (_nacking, _) = answer_clusters(s.running.xds_addr, "status-nacks", true).await;
    let admin = s.running.admin_addr;
    let page: serde_json::Value = eventually("both Envoys answered", DEADLINE, || async {
        let v: serde_json::Value =
            serde_json::from_str(&admin_get(admin, "/debug/clients").await).ok()?;
        let answered = v["clients"]
            .as_array()?
            .iter()
            .all(|c| c["types"]["cds"]["acks"] == 1 || c["types"]["cds"]["nacks"] == 1);
        (v["total"] == 2 && answered).then_some(v)
    })
    .await;
    // In brief: counts, no lists, no per-resource view.
    let brief = &page["clients"][0];
    assert_eq!(brief["types"]["cds"]["subscribed"], serde_json::Value::Null);
    assert!(brief.get("client_config").is_none(), "{brief}");
    assert_eq!(page["shown"], 2);
    assert_eq!(page["truncated"], false);
    // Whole, by node and by stream.
    let whole: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/clients?node=status-nacks").await).unwrap();
    let nacker = &whole["clients"][0];
    assert_eq!(whole["total"], 1, "{whole}");
    assert!(nacker["client_config"].is_object(), "{nacker}");
    let by_stream: serde_json::Value = serde_json::from_str(
        &admin_get(
            admin,
            &format!("/debug/clients?stream={}", nacker["stream_id"]),
        )
        .await,
    )
    .unwrap();
    assert_eq!(by_stream["node"]["id"], "status-nacks");
    let (status, _) = http_get(&format!("http://{admin}/debug/clients?stream=999999"))
        .await
        .unwrap();
    assert_eq!(status, 404);
    let (status, _) = http_get(&format!("http://{admin}/debug/clients?stream=1&node=x"))
        .await
        .unwrap();
    assert_eq!(status, 400);

    let table = ray_xds_status(admin, "table");
    let line = |node: &str| {
        table
            .lines()
            .find(|l| l.starts_with(node))
            .unwrap_or_else(|| panic!("{node} not in\n{table}"))
            .to_string()
    };
    assert!(
        table.lines().any(|l| l.starts_with("default/demo")
            && l.contains("stable")
            && l.ends_with("demo-a=100%")),
        "{table}"
    );
    let acks = line("status-acks");
    assert!(
        acks.contains(&version[..12]) && acks.ends_with('-'),
        "{table}"
    );
    let nacks = line("status-nacks");
    assert!(
        nacks.contains("STALE")
            && nacks.contains("cds")
            && nacks.contains("cluster default/demo/demo-a: bad lb policy"),
        "{table}"
    );
    let json: serde_json::Value = serde_json::from_str(&ray_xds_status(admin, "json")).unwrap();
    let acker = json["envoys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["node"] == "status-acks")
        .unwrap();
    assert_eq!(acker["acked"]["cds"], version.as_str());
    assert_eq!(acker["in_sync"], true);
    assert_eq!(json["services"][0]["serving"], "demo-a");
}

/// An ADS stream of node `id` that asks for clusters and ACKs (or NACKs) the first
/// answer; the stream, and the version it was sent.
pub(crate) async fn answer_clusters(
    xds: std::net::SocketAddr,
    id: &str,
    nack: bool,
) -> (impl Sized, String) {
    let (tx, mut rx) = sotw_stream(xds).await;
    tx.send(DiscoveryRequest {
        node: node(id),
        type_url: CLUSTER_TYPE_URL.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let cds = next(&mut rx).await;
    tx.send(DiscoveryRequest {
        type_url: CLUSTER_TYPE_URL.into(),
        version_info: if nack {
            String::new()
        } else {
            cds.version_info.clone()
        },
        response_nonce: cds.nonce.clone(),
        error_detail: nack.then(|| Status {
            code: 3,
            message: "cluster default/demo/demo-a: bad lb policy".into(),
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    ((tx, rx), cds.version_info)
}

/// `ray-xds status --admin http://<admin> --output <output>`: its stdout (it succeeded).
fn ray_xds_status(admin: std::net::SocketAddr, output: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ray-xds"))
        .args([
            "status",
            "--admin",
            &format!("http://{admin}"),
            "--output",
            output,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// CSDS on the xDS port: every client, or those a node matcher picks, each with what it
/// holds (the NACKed cluster marked); a matcher it cannot evaluate is refused.
#[tokio::test]
async fn csds_answers_what_each_envoy_holds_on_the_xds_port() {
    use envoy_types::pb::envoy::admin::v3::ClientResourceStatus;
    use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
    use envoy_types::pb::envoy::r#type::matcher::v3::{NodeMatcher, StringMatcher};
    use envoy_types::pb::envoy::service::status::v3::client_status_discovery_service_client::ClientStatusDiscoveryServiceClient;
    use envoy_types::pb::envoy::service::status::v3::ClientStatusRequest;

    let s = server_with(&[NodeType::Head], |_| {}).await;
    let (_acking, _) = answer_clusters(s.running.xds_addr, "csds-acks", false).await;
    let (_nacking, _) = answer_clusters(s.running.xds_addr, "csds-nacks", true).await;
    let mut csds =
        ClientStatusDiscoveryServiceClient::connect(format!("http://{}", s.running.xds_addr))
            .await
            .unwrap();
    let matching = |pattern: MatchPattern| ClientStatusRequest {
        node_matchers: vec![NodeMatcher {
            node_id: Some(StringMatcher {
                ignore_case: false,
                match_pattern: Some(pattern),
            }),
            node_metadatas: vec![],
        }],
        ..Default::default()
    };
    let nacked = eventually("the NACK is seen", DEADLINE, || {
        let mut csds = csds.clone();
        let request = matching(MatchPattern::Exact("csds-nacks".into()));
        async move {
            let answer = csds.fetch_client_status(request).await.ok()?;
            let config = answer.into_inner().config.pop()?;
            config
                .generic_xds_configs
                .iter()
                .any(|c| c.client_status == ClientResourceStatus::Nacked as i32)
                .then_some(config)
        }
    })
    .await;
    assert_eq!(nacked.node.unwrap().id, "csds-nacks");
    let all = csds
        .fetch_client_status(ClientStatusRequest::default())
        .await
        .unwrap();
    assert_eq!(all.metadata().get("ray-xds-clients-matched").unwrap(), "2");
    assert_eq!(all.metadata().get("ray-xds-clients-shown").unwrap(), "2");
    assert_eq!(all.into_inner().config.len(), 2);
    let by_prefix = csds
        .fetch_client_status(matching(MatchPattern::Prefix("csds-a".into())))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_prefix.config.len(), 1);
    assert_eq!(by_prefix.config[0].node.as_ref().unwrap().id, "csds-acks");
    let refused = csds
        .fetch_client_status(matching(MatchPattern::SafeRegex(Default::default())))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    // The stream answers each request.
    let requests = tokio_stream::iter([
        matching(MatchPattern::Suffix("-acks".into())),
        ClientStatusRequest::default(),
    ]);
    let mut answers = csds
        .stream_client_status(requests)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answers.message().await.unwrap().unwrap().config.len(), 1);
    assert_eq!(answers.message().await.unwrap().unwrap().config.len(), 2);
}

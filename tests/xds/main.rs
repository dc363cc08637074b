//! The xDS server on its own: the gRPC protocol driven by envoy-types' client (both
//! protocols, misbehaving clients), mTLS on its port under attack, the golden resources
//! `translate` produces, the Envoy descriptors `/debug` prints with, and the fuzzers' corpus.

mod descriptors;
mod fuzz_corpus;
mod golden;
mod grpc;
mod load_reports;
mod monitoring;
mod status;
mod tls_hostile;

use ray_serve_sim::NodeType;
use support::*;

/// ray-xds on a services file of one simulated cluster `demo-a` of `nodes`, its config
/// as `test_config` gives it, changed by `tweak`.
pub(crate) struct Server {
    _dir: tempfile::TempDir,
    pub(crate) services: std::path::PathBuf,
    pub(crate) running: ray_xds::runtime::Running,
    _cluster: SimCluster,
}

pub(crate) async fn server_with(
    nodes: &[NodeType],
    tweak: impl FnOnce(&mut ray_xds::config::Config),
) -> Server {
    let cluster = SimCluster::start("demo-a", nodes).await;
    let dir = tempfile::tempdir().unwrap();
    let services = dir.path().join("services.yaml");
    std::fs::write(&services, services_yaml("demo-a", &[&cluster])).unwrap();
    let mut config = test_config(&services, free_port());
    tweak(&mut config);
    let running = ray_xds::runtime::start(config, Default::default())
        .await
        .unwrap();
    Server {
        _dir: dir,
        services,
        running,
        _cluster: cluster,
    }
}

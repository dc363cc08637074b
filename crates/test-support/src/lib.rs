//! Test harness: real Envoy processes, in-process ray-xds and simulated Ray Serve proxies,
//! free ports, and processes that die with the test.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use ray_serve_sim::NodeType;
use ray_serve_sim::{serve_proxy_with, Executions, ProxyConfig, ProxyHandle, ProxyMode, Served};
use ray_xds::config::{Config, GatewaySettings, SourceConfig};
use tokio_util::sync::CancellationToken;

mod envoy;
mod http;
mod ports;

pub use envoy::*;
pub use http::*;
pub use ports::free_port;

pub mod ads;
pub mod conformance;
pub mod fake_apiserver;
pub mod grpc;
pub mod kuberay;
pub mod real_ray;
pub mod stack;
pub mod tamper;
pub mod tls;

#[allow(unused_imports)]
pub use stack::Stack;

/// The project's root folder (this crate is `crates/test-support` in it).
pub fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Simulated Ray Serve proxies of one cluster, in-process.
pub struct SimCluster {
    pub name: String,
    pub proxies: Vec<(SocketAddr, NodeType, CancellationToken)>,
    pub handles: Vec<ProxyHandle>,
    /// Each proxy's gRPC proxy (same handle, same shutdown), when started with gRPC.
    pub grpc: Vec<SocketAddr>,
    /// What ran on this cluster's proxies, by request id.
    pub ledger: Executions,
}

impl SimCluster {
    pub async fn start(name: &str, node_types: &[NodeType]) -> SimCluster {
        SimCluster::start_with_ledger(name, node_types, Executions::default()).await
    }

    /// Like [`SimCluster::start`], recording into `ledger` (share one between clusters
    /// to count the runs of a request wherever they happen).
    pub async fn start_with_ledger(
        name: &str,
        node_types: &[NodeType],
        ledger: Executions,
    ) -> SimCluster {
        SimCluster::start_with(name, node_types, ledger, false).await
    }

    /// Like [`SimCluster::start`], each node also running a gRPC proxy (Ray's
    /// `RayServeAPIService` and the demo `Echo` application) that shares its HTTP proxy's
    /// mode, ledger and shutdown.
    pub async fn start_grpc(name: &str, node_types: &[NodeType]) -> SimCluster {
        SimCluster::start_with(name, node_types, Executions::default(), true).await
    }

    pub async fn start_with(
        name: &str,
        node_types: &[NodeType],
        ledger: Executions,
        grpc: bool,
    ) -> SimCluster {
        let (mut proxies, mut handles, mut grpc_addrs) = (Vec::new(), Vec::new(), Vec::new());
        for node_type in node_types {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let token = CancellationToken::new();
            let config = ProxyConfig {
                cluster: name.into(),
                node_type: *node_type,
                routes: BTreeMap::from([("/".to_string(), "hello".to_string())]),
            };
            let handle = ProxyHandle::with_ledger(ledger.clone());
            if grpc {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                grpc_addrs.push(listener.local_addr().unwrap());
                tokio::spawn(ray_serve_sim::grpc::serve_grpc_proxy_with(
                    listener,
                    config.clone(),
                    handle.clone(),
                    token.clone(),
                ));
            }
            tokio::spawn(serve_proxy_with(
                listener,
                config,
                handle.clone(),
                token.clone(),
            ));
            proxies.push((addr, *node_type, token));
            handles.push(handle);
        }
        SimCluster {
            name: name.into(),
            proxies,
            handles,
            grpc: grpc_addrs,
            ledger,
        }
    }

    pub fn set_mode(&self, i: usize, mode: ProxyMode) {
        self.handles[i].set(mode);
    }

    /// Kills proxy `i`: its listener closes and later connections are refused.
    pub fn kill(&self, i: usize) {
        self.proxies[i].2.cancel();
    }

    /// The cluster as `services.yaml` lists it.
    pub fn yaml(&self) -> String {
        let mut s = format!("      - name: {}\n        proxies:\n", self.name);
        for (i, (addr, node_type, _)) in self.proxies.iter().enumerate() {
            match self.grpc.get(i) {
                Some(grpc) => {
                    s += &format!(
                        "          - {{ address: {addr}, node_type: {node_type}, grpc: {grpc} }}\n"
                    )
                }
                None => {
                    s += &format!("          - {{ address: {addr}, node_type: {node_type} }}\n")
                }
            }
        }
        s
    }
}

impl Drop for SimCluster {
    fn drop(&mut self) {
        for (_, _, token) in &self.proxies {
            token.cancel();
        }
    }
}

/// A `services.yaml` with one RayService `demo` over the given clusters.
pub fn services_yaml(active: &str, clusters: &[&SimCluster]) -> String {
    services_yaml_with(active, clusters, "")
}

/// Like [`services_yaml`], with extra per-service lines (e.g. `head_proxy: include`).
pub fn services_yaml_with(active: &str, clusters: &[&SimCluster], extra: &str) -> String {
    let mut s = format!(
        "rayservices:\n  - name: demo\n    namespace: default\n    hosts: [\"*\"]\n    active_cluster: {active}\n{extra}    clusters:\n"
    );
    for c in clusters {
        s += &c.yaml();
    }
    s
}

/// Writes a file atomically (write + rename), as editors and ConfigMaps do.
pub fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

pub fn test_config(services: &Path, gateway_port: u16) -> Config {
    Config {
        xds_listen: "127.0.0.1:0".parse().unwrap(),
        xds_max_message_bytes: 4 * 1024 * 1024,
        xds_limits: Default::default(),
        xds_max_streams: ray_xds::xds::server::DEFAULT_MAX_STREAMS,
        xds_tls: None,
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        admin_debug_listen: None,
        replica_peers: Vec::new(),
        replica_poll_interval: Duration::from_millis(500),
        replica_state: None,
        gateway: GatewaySettings {
            listener_address: "127.0.0.1".parse().unwrap(),
            listener_port: gateway_port,
            ..Default::default()
        },
        source: SourceConfig::File {
            path: services.to_path_buf(),
            poll_interval: Duration::from_millis(500),
        },
        addresses: Default::default(),
        memory: Default::default(),
        policies: Default::default(),
    }
}

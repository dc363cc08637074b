//! Test harness: real Envoy processes, in-process ray-xds and simulated Ray Serve proxies,
//! free ports, and processes that die with the test.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use ray_xds::config::{Config, GatewaySettings, SourceConfig};
use ray_xds::model::NodeType;
use ray_xds::sim::{serve_proxy_with, ProxyConfig, ProxyHandle, ProxyMode, Served};
use tokio_util::sync::CancellationToken;

pub fn project_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A port that was free a moment ago (for processes that cannot bind port 0 themselves).
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The real Envoy binary, installed by `scripts/install-envoy.sh` on first use.
pub fn envoy_binary() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(p) = std::env::var("RAY_XDS_ENVOY") {
            return PathBuf::from(p);
        }
        let out = Command::new("bash")
            .arg(project_root().join("scripts/install-envoy.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("running scripts/install-envoy.sh");
        assert!(out.status.success(), "installing Envoy failed");
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

/// A child process killed when dropped, and (through PR_SET_PDEATHSIG) when the test
/// process dies.
pub struct ChildGuard {
    pub child: Child,
    pub name: String,
}

pub fn spawn(name: &str, cmd: &mut Command) -> ChildGuard {
    use std::os::unix::process::CommandExt;
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    ChildGuard {
        child,
        name: name.into(),
    }
}

impl ChildGuard {
    pub fn signal(&self, sig: i32) {
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Which bootstrap from `envoy/` an Envoy runs.
#[derive(Clone, Copy, Debug)]
pub enum Bootstrap {
    Sotw,
    Delta,
}

impl Bootstrap {
    pub fn file(self) -> &'static str {
        match self {
            Bootstrap::Sotw => "bootstrap.yaml",
            Bootstrap::Delta => "bootstrap-delta.yaml",
        }
    }

    pub fn protocol(self) -> &'static str {
        match self {
            Bootstrap::Sotw => "sotw",
            Bootstrap::Delta => "delta",
        }
    }
}

pub struct Envoy {
    pub process: ChildGuard,
    pub admin_port: u16,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy from `envoy/<bootstrap>`, rendered with its own admin port, the given
    /// xDS port and a unique base id.
    pub fn start(bootstrap: Bootstrap, xds_port: u16) -> Envoy {
        let dir = tempfile::tempdir().unwrap();
        let template =
            std::fs::read_to_string(project_root().join("envoy").join(bootstrap.file())).unwrap();
        let admin_port = free_port();
        assert!(template.contains("port_value: 18000") && template.contains("port_value: 9901"));
        let rendered = template
            .replace("port_value: 18000", &format!("port_value: {xds_port}"))
            .replace("port_value: 9901", &format!("port_value: {admin_port}"));
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, rendered).unwrap();
        let log = dir.path().join("envoy.log");
        let process = spawn(
            "envoy",
            Command::new(envoy_binary())
                .arg("-c")
                .arg(&config)
                .args(["--base-id", &admin_port.to_string()])
                .args(["--log-level", "info", "--log-path"])
                .arg(&log)
                .args(["--concurrency", "1"])
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        Envoy {
            process,
            admin_port,
            log,
            _dir: dir,
        }
    }

    pub async fn admin(&self, path: &str) -> String {
        let (status, body) = http_get(&format!("http://127.0.0.1:{}{path}", self.admin_port))
            .await
            .unwrap_or((0, String::new()));
        assert!(status == 200 || status == 0, "envoy admin {path}: {status}");
        body
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Simulated Ray Serve proxies of one cluster, in-process.
pub struct SimCluster {
    pub name: String,
    pub proxies: Vec<(SocketAddr, NodeType, CancellationToken)>,
    pub handles: Vec<ProxyHandle>,
}

impl SimCluster {
    pub async fn start(name: &str, node_types: &[NodeType]) -> SimCluster {
        let (mut proxies, mut handles) = (Vec::new(), Vec::new());
        for node_type in node_types {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let token = CancellationToken::new();
            let config = ProxyConfig {
                cluster: name.into(),
                node_type: *node_type,
                routes: BTreeMap::from([("/".to_string(), "hello".to_string())]),
            };
            let handle = ProxyHandle::default();
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
        for (addr, node_type, _) in &self.proxies {
            s += &format!("          - {{ address: {addr}, node_type: {node_type} }}\n");
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
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        gateway: GatewaySettings {
            listener_address: "127.0.0.1".parse().unwrap(),
            listener_port: gateway_port,
            ..Default::default()
        },
        source: SourceConfig::File {
            path: services.to_path_buf(),
            poll_interval: Duration::from_millis(500),
        },
        prober: Default::default(),
        dashboard: Default::default(),
    }
}

fn client() -> &'static Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    static CLIENT: OnceLock<
        Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    > = OnceLock::new();
    CLIENT.get_or_init(|| Client::builder(TokioExecutor::new()).build_http())
}

/// One HTTP request; `Err` for a connection-level failure.
pub async fn http(method: &str, url: &str, body: &str) -> Result<(u16, String), String> {
    let request = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("host", "demo.example")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let response = tokio::time::timeout(Duration::from_secs(10), client().request(request))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}

pub async fn http_get(url: &str) -> Result<(u16, String), String> {
    http("GET", url, "").await
}

/// A request through Envoy's listener; `Some(served)` when a simulated proxy answered.
pub async fn through_envoy(gateway_port: u16) -> Option<Served> {
    match http(
        "POST",
        &format!("http://127.0.0.1:{gateway_port}/hello"),
        "{\"x\":1}",
    )
    .await
    {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// Polls `check` until it returns `Some`, or panics with `what` after `deadline`.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if start.elapsed() > deadline {
            panic!("timed out after {deadline:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of one Prometheus sample, e.g. `ray_xds_xds_nacks_total{protocol="sotw",type="lds"}`.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

pub async fn admin_get(admin: SocketAddr, path: &str) -> String {
    http_get(&format!("http://{admin}{path}"))
        .await
        .map(|(_, b)| b)
        .unwrap_or_default()
}

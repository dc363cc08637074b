//! Test harness: real Envoy processes, in-process ray-xds and simulated Ray Serve proxies,
//! free ports, and processes that die with the test.

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
use ray_serve_sim::NodeType;
use ray_serve_sim::{serve_proxy_with, Executions, ProxyConfig, ProxyHandle, ProxyMode, Served};
use ray_xds::config::{Config, GatewaySettings, SourceConfig};
use tokio_util::sync::CancellationToken;

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

/// A port that was free a moment ago (for processes that cannot bind port 0 themselves),
/// never one this process handed out before: the kernel may give the same free port to
/// two calls in a row, and a simulator given it twice would fail to bind.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    loop {
        let port = StdListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if GIVEN.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return port;
        }
    }
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

impl Drop for Envoy {
    /// A failing test shows what Envoy said.
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = self.log_text();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("--- last lines of Envoy's log ---");
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
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
    /// State of the world over mTLS (`envoy/bootstrap-tls.yaml`): render it with
    /// [`Bootstrap::with_tls_files`].
    SotwTls,
}

impl Bootstrap {
    pub fn file(self) -> &'static str {
        match self {
            Bootstrap::Sotw => "bootstrap.yaml",
            Bootstrap::Delta => "bootstrap-delta.yaml",
            Bootstrap::SotwTls => "bootstrap-tls.yaml",
        }
    }

    pub fn protocol(self) -> &'static str {
        match self {
            Bootstrap::Sotw => "sotw",
            Bootstrap::Delta => "delta",
            Bootstrap::SotwTls => "sotw",
        }
    }

    /// An edit for [`Envoy::start_with`]: the TLS bootstrap's certificate files are
    /// `cert`, `key` and `ca` instead of `/etc/envoy/xds-tls/*`.
    pub fn with_tls_files(cert: &Path, key: &Path, ca: &Path) -> impl FnOnce(String) -> String {
        let (cert, key, ca) = (
            cert.display().to_string(),
            key.display().to_string(),
            ca.display().to_string(),
        );
        move |bootstrap: String| {
            assert!(bootstrap.contains("/etc/envoy/xds-tls/tls.crt"));
            bootstrap
                .replace("/etc/envoy/xds-tls/tls.crt", &cert)
                .replace("/etc/envoy/xds-tls/tls.key", &key)
                .replace("/etc/envoy/xds-tls/ca.crt", &ca)
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
    /// Starts Envoy from `envoy/<bootstrap>`, rendered with the given xDS port, its admin on
    /// a port Envoy picks itself (read back from `--admin-address-path`, so no other test
    /// can take it in between) and a base id unique to this process and Envoy.
    pub fn start(bootstrap: Bootstrap, xds_port: u16) -> Envoy {
        Envoy::start_with(bootstrap, xds_port, |b| b)
    }

    /// Like [`Envoy::start`], with the rendered bootstrap passed through `edit` first.
    pub fn start_with(
        bootstrap: Bootstrap,
        xds_port: u16,
        edit: impl FnOnce(String) -> String,
    ) -> Envoy {
        static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = tempfile::tempdir().unwrap();
        let template =
            std::fs::read_to_string(project_root().join("envoy").join(bootstrap.file())).unwrap();
        assert!(template.contains("port_value: 18000") && template.contains("port_value: 9901"));
        let rendered = template
            .replace("port_value: 18000", &format!("port_value: {xds_port}"))
            .replace("port_value: 9901", "port_value: 0");
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, edit(rendered)).unwrap();
        let log = dir.path().join("envoy.log");
        let admin_file = dir.path().join("admin-address");
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 64;
        let base_id = std::process::id() * 64 + n;
        let mut process = spawn(
            "envoy",
            Command::new(envoy_binary())
                .arg("-c")
                .arg(&config)
                .args(["--base-id", &base_id.to_string()])
                .arg("--admin-address-path")
                .arg(&admin_file)
                .args([
                    "--log-level",
                    &std::env::var("TEST_ENVOY_LOG_LEVEL").unwrap_or_else(|_| "info".into()),
                    "--log-path",
                ])
                .arg(&log)
                .args(["--concurrency", "1", "--file-flush-interval-msec", "200"])
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        let started = Instant::now();
        let admin_port = loop {
            let text = std::fs::read_to_string(&admin_file).unwrap_or_default();
            if let Some(port) = text
                .trim()
                .rsplit(':')
                .next()
                .and_then(|p| p.parse::<u16>().ok())
                .filter(|p| *p != 0)
            {
                break port;
            }
            if !process.is_running() || started.elapsed() > Duration::from_secs(60) {
                let log_text = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("Envoy did not start its admin: {log_text}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Envoy {
            process,
            admin_port,
            log,
            _dir: dir,
        }
    }

    /// The port Envoy's `ray-serve-http` listener bound (ray-xds gives it port 0 in tests).
    pub async fn gateway_port(&self) -> u16 {
        eventually(
            "Envoy binds the ray-serve-http listener",
            Duration::from_secs(30),
            || async {
                let text = self.admin("/listeners?format=json").await;
                let v: serde_json::Value = serde_json::from_str(&text).ok()?;
                v["listener_statuses"]
                    .as_array()?
                    .iter()
                    .find_map(|l| {
                        (l["name"] == "ray-serve-http")
                            .then(|| l["local_address"]["socket_address"]["port_value"].as_u64())?
                    })
                    .map(|p| p as u16)
                    .filter(|p| *p != 0)
            },
        )
        .await
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

    /// One of Envoy's stats (a counter or gauge), 0 when Envoy has none by that name.
    pub async fn stat(&self, name: &str) -> u64 {
        let text = self.admin("/stats").await;
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(": ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    }

    /// Envoy's `/config_dump` as JSON.
    pub async fn config_dump(&self) -> serde_json::Value {
        serde_json::from_str(&self.admin("/config_dump").await).unwrap_or_default()
    }
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

fn client() -> &'static Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    static CLIENT: OnceLock<
        Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    > = OnceLock::new();
    CLIENT.get_or_init(|| Client::builder(TokioExecutor::new()).build_http())
}

/// One HTTP request; `Err` for a connection-level failure.
pub async fn http(method: &str, url: &str, body: &str) -> Result<(u16, String), String> {
    http_to_host(method, url, "demo.example", body).await
}

/// A request through Envoy's listener for `host`; `Some(served)` when a simulated proxy
/// answered.
pub async fn through_envoy_to(gateway_port: u16, host: &str) -> Option<Served> {
    let url = format!("http://127.0.0.1:{gateway_port}/hello");
    match http_to_host("POST", &url, host, "{\"x\":1}").await {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// One HTTP request with the given Host; `Err` for a connection-level failure.
pub async fn http_to_host(
    method: &str,
    url: &str,
    host: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let request = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("host", host)
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

/// A POST through Envoy's listener to `path`, given up after `timeout`.
pub async fn post_through_envoy(
    gateway_port: u16,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String), String> {
    let request = hyper::Request::builder()
        .method("POST")
        .uri(format!("http://127.0.0.1:{gateway_port}{path}"))
        .header("host", "demo.example")
        .body(Full::new(Bytes::from_static(b"{\"prompt\": \"hello\"}")))
        .map_err(|e| e.to_string())?;
    let response = tokio::time::timeout(timeout, async {
        let response = client().request(request).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, String::from_utf8_lossy(&bytes).into_owned()))
    })
    .await
    .map_err(|_| "timed out".to_string())??;
    Ok(response)
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

/// Starts Envoy against ray-xds's xDS port and waits until a request through it reaches
/// a proxy; returns Envoy and its listener port.
pub async fn envoy_carrying_traffic(xds_port: u16, bootstrap: Bootstrap) -> (Envoy, u16) {
    let envoy = Envoy::start(bootstrap, xds_port);
    let port = envoy.gateway_port().await;
    eventually(
        "traffic flows through Envoy",
        Duration::from_secs(30),
        || async { through_envoy(port).await },
    )
    .await;
    (envoy, port)
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

/// Whether every Envoy connected to the ray-xds whose admin is `admin` holds what it
/// serves now (`/debug/clients`, `in_sync`): what ray-xds's state says has reached them.
pub async fn every_envoy_in_sync(admin: SocketAddr) -> bool {
    let clients: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/clients").await).unwrap_or_default();
    clients["clients"]
        .as_array()
        .is_some_and(|c| !c.is_empty() && c.iter().all(|c| c["in_sync"] == true))
}

/// The refused proxies and replicas `/debug/state` shows, as `(address, reason label)`,
/// sorted.
pub async fn refused_proxies(admin: SocketAddr) -> Vec<(String, String)> {
    let state: serde_json::Value =
        serde_json::from_str(&admin_get(admin, "/debug/state").await).unwrap_or_default();
    let mut out: Vec<(String, String)> = state["refused_proxies"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let field = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (field("address"), field("label"))
        })
        .collect();
    out.sort();
    out
}

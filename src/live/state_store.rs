//! Where each replica keeps its switchover view, so that a restart of every replica at
//! once finds what no input can give again: when a shift started, a rollback decision, a
//! move completed that the source has not caught up with, the clusters still draining.
//!
//! The store is a directory (a file per replica; any source) or one ConfigMap of ray-xds's
//! own namespace (a key per replica; the Kubernetes source's client). What is kept is the
//! view a replica answers its peers ([`ReplicaView`]) less what derives from inputs
//! ([`kept`]). A replica reads the store once, at start, before its first build
//! ([`read_at_start`]), and the peer poller takes each entry that counts as one more
//! peer's view, with a peer's limits: a kept view never opens a gate, it can give an
//! earlier start of the same shift, a move done (followed only once this replica's own
//! gates pass), a rollback on the same known version, or a drain's end.
//!
//! A replica writes its own entry only after its first build, so the entry carries what it
//! took in; each entry names the entries (key and write time) its replica read at start,
//! which it *supersedes*. A reader leaves out a superseded entry: an older incarnation's
//! decision that a newer one took in and then changed (a rollback the operator's promote
//! cleared, a shift that completed) does not come back. An entry rewritten since it was
//! read (its replica lives on) is not superseded.
//!
//! Invariants: a replica writes only its own entry (replica ids are random per start) and
//! removes only entries last written more than `ttl` ago, unreadable ones, or its own; an
//! entry is at most [`MAX_ENTRY_BYTES`], the newest [`MAX_ENTRIES`] are read, and of a
//! directory only regular files, never waiting on one (a FIFO, a device or a link is
//! unreadable); an entry written more than [`MAX_FUTURE`] ahead of this replica's clock is
//! unreadable, and none counts longer than `ttl` from now; garbage in the store is logged
//! and skipped; a store that cannot be read or written costs only this memory (logged,
//! counted), never serving.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::peers::{from_unix, to_unix, ReplicaView};
use crate::config::{ReplicaStateConfig, ReplicaStateStore, SourceConfig};
use crate::metrics::{Metrics, StoreLabels};

/// The largest entry written or read (a ConfigMap holds 1 MiB in all: about 7 of them).
pub const MAX_ENTRY_BYTES: usize = 128 * 1024;

/// The most entries read, the newest (replicas × incarnations within the ttl).
pub const MAX_ENTRIES: usize = 64;

/// The most names of a directory looked at (their times only) to find the newest.
pub const MAX_LISTED: usize = 1024;

/// How far ahead of this replica's clock an entry may say it was written (the clocks of
/// nodes running NTP agree far better); further, it is unreadable.
pub const MAX_FUTURE: Duration = Duration::from_secs(60);

/// The least time between two writes of a replica's entry (changes in between fold into
/// the next write).
pub const WRITE_EVERY: Duration = Duration::from_secs(1);

/// How soon a write that failed is tried again.
pub const RETRY_AFTER: Duration = Duration::from_secs(5);

/// How long a read or a write of the store may take.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(2);

/// One replica's entry: its view, when it was written (unix seconds, by its clock), and
/// the entries it read at start (key, their `written_unix`), which it supersedes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeptView {
    pub written_unix: f64,
    pub view: ReplicaView,
    #[serde(default)]
    pub supersedes: Vec<(String, f64)>,
}

/// The store: a directory or a ConfigMap.
#[derive(Clone)]
pub enum StateStore {
    Dir(PathBuf),
    ConfigMap { api: Api<ConfigMap>, name: String },
}

impl std::fmt::Display for StateStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateStore::Dir(dir) => write!(f, "directory {}", dir.display()),
            StateStore::ConfigMap { name, .. } => write!(f, "ConfigMap {name}"),
        }
    }
}

/// An entry's key (a file name, a ConfigMap data key) for a replica id.
pub fn entry_key(replica_id: &str) -> String {
    format!("replica-{replica_id}.json")
}

/// Entries read: each key with its entry, or why it cannot be read.
pub type Entries = Vec<(String, Result<KeptView, String>)>;

/// Entries' texts: each key with its text, or why it cannot be read.
type RawEntries = Vec<(String, Result<String, String>)>;

impl StateStore {
    /// The store `config` names; a ConfigMap through the Kubernetes source's client.
    pub async fn connect(
        config: &ReplicaStateConfig,
        source: &SourceConfig,
    ) -> anyhow::Result<StateStore> {
        Ok(match (&config.store, source) {
            (ReplicaStateStore::Dir(dir), _) => StateStore::Dir(dir.clone()),
            (ReplicaStateStore::ConfigMap { namespace, name }, SourceConfig::Kubernetes(k)) => {
                let client = crate::source::kubernetes::client(k).await?;
                StateStore::ConfigMap {
                    api: Api::namespaced(client, namespace),
                    name: name.clone(),
                }
            }
            (ReplicaStateStore::ConfigMap { .. }, _) => {
                anyhow::bail!("replicas.state.configmap needs the Kubernetes source")
            }
        })
    }

    /// Every entry by key (of a directory, the newest [`MAX_ENTRIES`] files).
    pub async fn read(&self) -> Result<Entries, String> {
        let raw = match tokio::time::timeout(STORE_TIMEOUT, self.read_raw()).await {
            Ok(raw) => raw?,
            Err(_) => return Err(format!("no answer within {STORE_TIMEOUT:?}")),
        };
        Ok(raw
            .into_iter()
            .map(|(key, text)| {
                let entry = text.and_then(|text| {
                    if text.len() > MAX_ENTRY_BYTES {
                        Err(format!("over {MAX_ENTRY_BYTES} bytes"))
                    } else {
                        serde_json::from_str::<KeptView>(&text).map_err(|e| e.to_string())
                    }
                });
                (key, entry)
            })
            .collect())
    }

    async fn read_raw(&self) -> Result<RawEntries, String> {
        match self {
            StateStore::Dir(dir) => {
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || read_dir(&dir))
                    .await
                    .map_err(|e| e.to_string())?
            }
            StateStore::ConfigMap { api, name } => {
                let map = api
                    .get_opt(name)
                    .await
                    .map_err(|e| format!("reading ConfigMap {name}: {e}"))?
                    .ok_or_else(|| {
                        format!("ConfigMap {name} does not exist (deploy/ creates it)")
                    })?;
                Ok(map
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|(key, _)| key.starts_with("replica-"))
                    .map(|(key, text)| (key, Ok(text)))
                    .collect())
            }
        }
    }

    /// Writes `key`'s entry (none: nothing written) and removes the entries `remove`
    /// names, at once where the store can (a ConfigMap's merge patch touches only those
    /// keys).
    pub async fn write(
        &self,
        key: &str,
        entry: Option<&KeptView>,
        remove: &[String],
    ) -> Result<(), String> {
        let text = match entry {
            Some(entry) => Some(serde_json::to_string(entry).map_err(|e| e.to_string())?),
            None => None,
        };
        if let Some(len) = text.as_ref().map(String::len) {
            if len > MAX_ENTRY_BYTES {
                return Err(format!(
                    "this replica's entry is {len} bytes, over {MAX_ENTRY_BYTES}: not written"
                ));
            }
        }
        let write = async {
            match self {
                StateStore::Dir(dir) => {
                    let (dir, key, remove) = (dir.clone(), key.to_string(), remove.to_vec());
                    tokio::task::spawn_blocking(move || {
                        write_dir(&dir, &key, text.as_deref(), &remove)
                    })
                    .await
                    .map_err(|e| e.to_string())?
                }
                StateStore::ConfigMap { api, name } => {
                    let mut data = serde_json::Map::new();
                    if let Some(text) = text {
                        data.insert(key.to_string(), text.into());
                    }
                    for gone in remove {
                        data.insert(gone.clone(), serde_json::Value::Null);
                    }
                    let patch = serde_json::json!({ "data": data });
                    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map(|_| ())
                        .map_err(|e| format!("patching ConfigMap {name}: {e}"))
                }
            }
        };
        tokio::time::timeout(STORE_TIMEOUT, write)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {STORE_TIMEOUT:?}")))
    }
}

/// The newest [`MAX_ENTRIES`] of the first [`MAX_LISTED`] entry files (by modification
/// time, links not followed), each read by [`read_entry`].
fn read_dir(dir: &Path) -> Result<RawEntries, String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("listing {}: {e}", dir.display())),
    };
    let mut names: Vec<(SystemTime, String)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("replica-") && n.ends_with(".json"))
        .take(MAX_LISTED)
        .map(|n| {
            let modified = std::fs::symlink_metadata(dir.join(&n))
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            (modified, n)
        })
        .collect();
    names.sort_by(|a, b| b.cmp(a));
    Ok(names
        .into_iter()
        .take(MAX_ENTRIES)
        .map(|(_, name)| {
            let text = read_entry(&dir.join(&name)).map_err(|e| format!("unreadable: {e}"));
            (name, text)
        })
        .collect())
}

/// A regular file's text, at most [`MAX_ENTRY_BYTES`] + 1 bytes of it: opened without
/// following a link and without blocking (a FIFO opens at once), and refused unless it is
/// a regular file.
fn read_entry(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut text = String::new();
    file.take(MAX_ENTRY_BYTES as u64 + 1)
        .read_to_string(&mut text)?;
    Ok(text)
}

fn write_dir(dir: &Path, key: &str, text: Option<&str>, remove: &[String]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    if let Some(text) = text {
        use std::io::Write;
        let path = dir.join(key);
        let tmp = dir.join(format!(".{key}.tmp"));
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(text.as_bytes())?;
            // Both nodes lost together is when an unsynced file comes back empty.
            file.sync_all()
        };
        write().map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &path).map_err(|e| format!("renaming to {}: {e}", path.display()))?;
    }
    for gone in remove {
        let _ = std::fs::remove_file(dir.join(gone));
    }
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// What of `view` is kept: switches under way, rollback decisions, moves completed within
/// `ttl`, and drains not ended; not the load reports (the outcome window is shorter than a
/// restart), nor the clock (an entry says when it was written).
pub fn kept(mut view: ReplicaView, now: SystemTime, ttl: Duration) -> ReplicaView {
    let recent = to_unix(now) - ttl.as_secs_f64();
    view.services.retain(|_, s| {
        s.target.is_some()
            || s.rollback.is_some()
            || (s.moved && s.serving_since_unix.is_some_and(|t| t >= recent))
    });
    let now_unix = to_unix(now);
    view.departed.retain(|d| d.until_unix > now_unix);
    view.loads.clear();
    view.now_unix = None;
    view
}

/// When `kept` stops counting: `ttl` after it was written, and never later than `ttl`
/// from `now`; `None` when it says it was written more than [`MAX_FUTURE`] from now (or
/// at no time at all): unreadable.
fn counts_until(kept: &KeptView, now: SystemTime, ttl: Duration) -> Option<SystemTime> {
    let written = from_unix(kept.written_unix)?;
    if written > now + MAX_FUTURE {
        return None;
    }
    Some(written.min(now) + ttl)
}

/// The entries read at start that count, newest first: readable, written within `ttl` of
/// `now`, not superseded by another that counts, at most [`MAX_ENTRIES`]; each view with
/// when it stops counting, and the (key, write time) of each, which the replica's own
/// entry will supersede. A rollback on an unknown version is left out of a kept view (a
/// live peer fills the version in; an entry never would, and would roll back the next
/// version too). The others are logged and skipped.
pub fn remembered(entries: Entries, now: SystemTime, ttl: Duration) -> ReadAtStart {
    let mut counting: Vec<(String, KeptView, SystemTime)> = Vec::new();
    for (key, entry) in entries {
        match entry.map(|kept| {
            let until = counts_until(&kept, now, ttl);
            (kept, until)
        }) {
            Ok((kept, Some(until))) if until > now => counting.push((key, kept, until)),
            Ok((_, Some(_))) => {
                tracing::info!(
                    entry = key,
                    "replica state: an entry older than the ttl is left out"
                )
            }
            Ok((_, None)) => tracing::warn!(
                entry = key,
                "replica state: an entry written in the future (or at no time) is left out"
            ),
            Err(why) => {
                tracing::warn!(entry = key, %why, "replica state: an unreadable entry is left out")
            }
        }
    }
    let superseded: Vec<(String, f64)> = counting
        .iter()
        .flat_map(|(_, kept, _)| kept.supersedes.iter().cloned())
        .collect();
    counting.retain(|(key, kept, _)| {
        let gone = superseded
            .iter()
            .any(|(k, w)| k == key && *w == kept.written_unix);
        if gone {
            tracing::info!(
                entry = key,
                "replica state: an entry a newer one took in is left out"
            );
        }
        !gone
    });
    counting.sort_by(|a, b| b.1.written_unix.total_cmp(&a.1.written_unix));
    counting.truncate(MAX_ENTRIES);
    let taken_in = counting
        .iter()
        .map(|(key, kept, _)| (key.clone(), kept.written_unix))
        .collect();
    let views = counting
        .into_iter()
        .map(|(_, kept, until)| {
            let mut view = kept.view;
            // Its times are absolute: no clock to move them by.
            view.now_unix = None;
            view.loads.clear();
            for switch in view.services.values_mut() {
                switch.rollback = switch.rollback.take().filter(|r| r.version.is_some());
            }
            (until, view)
        })
        .collect();
    ReadAtStart { views, taken_in }
}

/// What a replica read at start: the views that count (each until when), and the entries
/// its own will supersede.
#[derive(Clone, Debug, Default)]
pub struct ReadAtStart {
    pub views: Vec<(SystemTime, ReplicaView)>,
    pub taken_in: Vec<(String, f64)>,
}

/// Reads the store once at start ([`remembered`]); nothing when it cannot be read
/// (logged, counted).
pub async fn read_at_start(store: &StateStore, ttl: Duration, metrics: &Metrics) -> ReadAtStart {
    let read = store.read().await;
    let label = StoreLabels {
        op: "read",
        result: if read.is_ok() { "ok" } else { "error" },
    };
    metrics.state_store_ops.get_or_create(&label).inc();
    match read {
        Ok(entries) => {
            let read = remembered(entries, SystemTime::now(), ttl);
            tracing::info!(store = %store, entries = read.views.len(), "replica state: read what the replicas kept");
            read
        }
        Err(e) => {
            tracing::warn!(store = %store, error = %e, "replica state: not read; switches start from the source and the peers");
            ReadAtStart::default()
        }
    }
}

/// Writes this replica's entry from its first build on: whenever its view changes (at
/// most every [`WRITE_EVERY`]), and renewed every quarter of the `ttl`; a view with
/// nothing to keep removes the entry instead. At its first write and each renewal it
/// removes the entries that expired or cannot be read.
pub struct StateKeeper {
    pub store: StateStore,
    pub replica_id: String,
    pub ttl: Duration,
    pub metrics: Arc<Metrics>,
    /// The entries this replica read at start, which its own supersedes.
    pub taken_in: Vec<(String, f64)>,
}

impl StateKeeper {
    pub async fn run<T: Send + Sync + 'static>(
        self,
        mut views: watch::Receiver<T>,
        view_of: impl Fn(&T) -> ReplicaView,
        shutdown: CancellationToken,
    ) {
        // The first build: only from then does the view carry what was taken in.
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = views.changed() => if changed.is_err() { return },
        }
        let key = entry_key(&self.replica_id);
        let renew = self.ttl / 4;
        // What the store holds of this replica (`None`: nothing), and when it was written.
        let mut written: Option<(Option<ReplicaView>, SystemTime)> = None;
        let mut failing: Option<String> = None;
        let mut wait = renew;
        loop {
            let now = SystemTime::now();
            let mut view = kept(view_of(&views.borrow_and_update()), now, self.ttl);
            view.replica = Some(self.replica_id.clone());
            let view = (!view.services.is_empty() || !view.departed.is_empty()).then_some(view);
            let renewal = written.as_ref().is_none_or(|(_, at)| now >= *at + renew);
            let changed = written.as_ref().is_none_or(|(last, _)| *last != view);
            if renewal || changed {
                let mut remove = if renewal {
                    self.expired(&key, now).await
                } else {
                    Vec::new()
                };
                if view.is_none() {
                    remove.push(key.clone());
                }
                let entry = view.clone().map(|view| KeptView {
                    written_unix: to_unix(now),
                    view,
                    supersedes: self.taken_in.clone(),
                });
                let result = self.store.write(&key, entry.as_ref(), &remove).await;
                let label = StoreLabels {
                    op: "write",
                    result: if result.is_ok() { "ok" } else { "error" },
                };
                self.metrics.state_store_ops.get_or_create(&label).inc();
                match result {
                    Ok(()) => {
                        if failing.take().is_some() {
                            tracing::info!(store = %self.store, "replica state: written again");
                        }
                        written = Some((view, now));
                        wait = renew;
                    }
                    Err(e) => {
                        if failing.as_ref() != Some(&e) {
                            tracing::warn!(store = %self.store, error = %e, "replica state: this replica's view could not be kept; a restart of every replica would start its switches over");
                            failing = Some(e);
                        }
                        // Tried again at the next change, or soon.
                        written = Some((None, now - renew));
                        wait = RETRY_AFTER;
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(WRITE_EVERY) => {}
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = views.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// The entries of other replicas that no longer count (older than the `ttl`, written
    /// in the future) or cannot be read.
    async fn expired(&self, own: &str, now: SystemTime) -> Vec<String> {
        let Ok(entries) = self.store.read().await else {
            return Vec::new();
        };
        entries
            .into_iter()
            .filter(|(key, entry)| {
                key != own
                    && match entry {
                        Ok(kept) => counts_until(kept, now, self.ttl).is_none_or(|t| t <= now),
                        Err(_) => true,
                    }
            })
            .map(|(key, _)| key)
            .collect()
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::peers::{DepartedCluster, PeerSwitch, Rollback};

    fn switch(target: Option<&str>, moved_at: Option<f64>) -> PeerSwitch {
        PeerSwitch {
            serving: "a".into(),
            target: target.map(str::to_string),
            target_since_unix: None,
            shift_started_unix: None,
            serving_since_unix: moved_at,
            moved: moved_at.is_some(),
            moved_from: None,
            rollback: None,
            held_at: None,
        }
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    fn view(replica: &str) -> ReplicaView {
        ReplicaView {
            services: [("ns/shifting".to_string(), switch(Some("b"), None))].into(),
            replica: Some(replica.into()),
            ..Default::default()
        }
    }

    fn entry(replica: &str, written: SystemTime) -> KeptView {
        KeptView {
            written_unix: to_unix(written),
            view: view(replica),
            supersedes: Vec::new(),
        }
    }

    proptest::proptest! {
        /// An entry is superseded by its exact `written_unix` (read back from JSON by
        /// another replica, and written again in its `supersedes`): the time must survive
        /// any number of JSON round trips bit for bit (serde_json's `float_roundtrip`;
        /// without it a time near now was read back 1 ulp off now and then).
        #[test]
        fn a_written_time_survives_json_round_trips_exactly(micros in 0u64..4_102_444_800_000_000) {
            let written = SystemTime::UNIX_EPOCH + Duration::from_micros(micros);
            let kept = KeptView {
                supersedes: vec![("replica-x.json".into(), to_unix(written))],
                ..entry("r", written)
            };
            let once: KeptView = serde_json::from_str(&serde_json::to_string(&kept).unwrap()).unwrap();
            let twice: KeptView = serde_json::from_str(&serde_json::to_string(&once).unwrap()).unwrap();
            proptest::prop_assert_eq!(once.written_unix.to_bits(), kept.written_unix.to_bits());
            proptest::prop_assert_eq!(twice.supersedes[0].1.to_bits(), kept.written_unix.to_bits());
        }
    }

    fn keeper(store: &StateStore, ttl: Duration) -> StateKeeper {
        StateKeeper {
            store: store.clone(),
            replica_id: "me".into(),
            ttl,
            metrics: Arc::new(Metrics::new()),
            taken_in: Vec::new(),
        }
    }

    fn mkfifo(path: &Path) {
        let status = std::process::Command::new("mkfifo").arg(path).status();
        assert!(status.unwrap().success());
    }

    #[test]
    fn only_what_no_input_gives_again_is_kept() {
        let ttl = Duration::from_secs(600);
        let t = |secs| to_unix(at(secs));
        let mut rolled_back = switch(None, None);
        rolled_back.rollback = Some(Rollback {
            cluster: "b".into(),
            version: None,
            why: "failed".into(),
            at_unix: 1,
        });
        let full = ReplicaView {
            services: [
                ("ns/stable".to_string(), switch(None, None)),
                ("ns/shifting".to_string(), switch(Some("b"), None)),
                ("ns/moved-long-ago".to_string(), switch(None, Some(t(0)))),
                ("ns/moved".to_string(), switch(None, Some(t(500)))),
                ("ns/rolled-back".to_string(), rolled_back),
            ]
            .into(),
            departed: vec![
                DepartedCluster {
                    service: "ns/x".into(),
                    cluster: "ended".into(),
                    until_unix: t(900),
                    proxies: vec![],
                },
                DepartedCluster {
                    service: "ns/x".into(),
                    cluster: "draining".into(),
                    until_unix: t(1_100),
                    proxies: vec![],
                },
            ],
            now_unix: Some(t(1_000)),
            replica: Some("r1".into()),
            loads: [("ns/b".to_string(), Default::default())].into(),
        };
        let kept = kept(full, at(1_000), ttl);
        let services: Vec<&str> = kept.services.keys().map(String::as_str).collect();
        assert_eq!(services, ["ns/moved", "ns/rolled-back", "ns/shifting"]);
        assert_eq!(kept.departed.len(), 1);
        assert_eq!(kept.departed[0].cluster, "draining");
        assert!(kept.loads.is_empty());
        assert_eq!(kept.now_unix, None);
        assert_eq!(kept.replica.as_deref(), Some("r1"));
    }

    #[tokio::test]
    async fn a_directory_keeps_an_entry_per_replica_and_skips_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::Dir(dir.path().join("state"));
        // Nothing yet (the directory does not exist): nothing read, no error.
        assert!(store.read().await.unwrap().is_empty());
        let now = SystemTime::now();
        let r1 = entry("r1", now - Duration::from_secs(650));
        let r2 = entry("r2", now - Duration::from_secs(100));
        store.write(&entry_key("r1"), Some(&r1), &[]).await.unwrap();
        store.write(&entry_key("r2"), Some(&r2), &[]).await.unwrap();
        let state = dir.path().join("state");
        std::fs::write(state.join("replica-garbage.json"), "{not json").unwrap();
        let huge = "x".repeat(MAX_ENTRY_BYTES + 1);
        std::fs::write(state.join("replica-huge.json"), huge).unwrap();
        std::fs::write(state.join("unrelated.txt"), "ignored").unwrap();
        std::fs::create_dir(state.join("replica-dir.json")).unwrap();
        let mut read = store.read().await.unwrap();
        read.sort_by(|a, b| a.0.cmp(&b.0));
        let keys: Vec<&str> = read.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "replica-dir.json",
                "replica-garbage.json",
                "replica-huge.json",
                "replica-r1.json",
                "replica-r2.json"
            ]
        );
        assert!(read[..3].iter().all(|(_, e)| e.is_err()), "{read:?}");
        assert_eq!(read[3].1.as_ref().unwrap(), &r1);
        // With a ttl of 600 s: r1's entry (written 650 s ago) no longer counts.
        let ReadAtStart { views, taken_in } = remembered(read, now, Duration::from_secs(600));
        assert_eq!(views.len(), 1);
        assert_eq!(views[0].1.replica.as_deref(), Some("r2"));
        assert_eq!(taken_in, [(entry_key("r2"), r2.written_unix)]);
        // A write removes what it is told to, and an entry over the bound is refused.
        let r1_key = entry_key("r1");
        store
            .write(&entry_key("r2"), Some(&r2), std::slice::from_ref(&r1_key))
            .await
            .unwrap();
        assert!(!state.join(&r1_key).exists());
        let mut big = entry("r3", now);
        for i in 0..5_000 {
            big.view
                .services
                .insert(format!("ns/s{i}"), switch(Some("b"), None));
        }
        let refused = store
            .write(&entry_key("r3"), Some(&big), &[])
            .await
            .unwrap_err();
        assert!(refused.contains("over"), "{refused}");
        assert!(!state.join(entry_key("r3")).exists());
    }

    /// A FIFO, a link to a device, a link to a good entry: none is waited on or read
    /// (each unreadable, and pruned), and the good entries still count.
    #[tokio::test]
    async fn special_files_are_unreadable_and_never_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::Dir(dir.path().to_path_buf());
        let now = SystemTime::now();
        let good = entry("good", now);
        store
            .write(&entry_key("good"), Some(&good), &[])
            .await
            .unwrap();
        mkfifo(&dir.path().join("replica-fifo.json"));
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("replica-zero.json")).unwrap();
        std::os::unix::fs::symlink(
            dir.path().join(entry_key("good")),
            dir.path().join("replica-link.json"),
        )
        .unwrap();
        let started = std::time::Instant::now();
        let read = store.read().await.unwrap();
        assert!(started.elapsed() < STORE_TIMEOUT, "{:?}", started.elapsed());
        let readable: Vec<&str> = read
            .iter()
            .filter(|(_, e)| e.is_ok())
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(readable, [entry_key("good")], "{read:?}");
        let expired = keeper(&store, Duration::from_secs(900))
            .expired("replica-me.json", now)
            .await;
        let mut expired: Vec<&str> = expired.iter().map(String::as_str).collect();
        expired.sort();
        assert_eq!(
            expired,
            [
                "replica-fifo.json",
                "replica-link.json",
                "replica-zero.json"
            ]
        );
    }

    /// An entry that says it was written in the future: a little (clocks apart) counts
    /// no longer than the ttl from now; far (a crafted entry) is unreadable and pruned.
    #[tokio::test]
    async fn an_entry_from_the_future_counts_no_longer_than_the_ttl() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::Dir(dir.path().to_path_buf());
        let ttl = Duration::from_secs(900);
        let now = SystemTime::now();
        let skewed = entry("skewed", now + Duration::from_secs(30));
        let crafted = entry("crafted", now + Duration::from_secs(100 * 365 * 24 * 3600));
        for e in [&skewed, &crafted] {
            let key = entry_key(e.view.replica.as_deref().unwrap());
            store.write(&key, Some(e), &[]).await.unwrap();
        }
        let ReadAtStart { views, .. } = remembered(store.read().await.unwrap(), now, ttl);
        assert_eq!(views.len(), 1);
        assert_eq!(views[0].1.replica.as_deref(), Some("skewed"));
        assert_eq!(views[0].0, now + ttl);
        let expired = keeper(&store, ttl).expired("replica-me.json", now).await;
        assert_eq!(expired, [entry_key("crafted")]);
        // (The skewed one counts until the ttl after the time it gives.)
        let later = keeper(&store, ttl)
            .expired("replica-me.json", now + ttl + Duration::from_secs(31))
            .await;
        assert_eq!(later.len(), 2);
    }

    /// Past [`MAX_ENTRIES`] (a restart loop), the newest are read, whatever their names.
    #[tokio::test]
    async fn past_the_bound_the_newest_entries_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::Dir(dir.path().to_path_buf());
        let now = SystemTime::now();
        for i in 0..70u64 {
            let mut e = entry(&format!("{i:02x}"), now - Duration::from_secs(10 * (i + 1)));
            e.view.services.clear();
            store
                .write(&format!("replica-{i:02x}.json"), Some(&e), &[])
                .await
                .unwrap();
        }
        // The newest, whose name sorts last.
        store
            .write("replica-ff.json", Some(&entry("ff", now)), &[])
            .await
            .unwrap();
        let ReadAtStart { views, .. } =
            remembered(store.read().await.unwrap(), now, Duration::from_secs(900));
        assert_eq!(views.len(), MAX_ENTRIES);
        assert_eq!(views[0].1.replica.as_deref(), Some("ff"));
    }

    /// An entry a newer one read at start is left out (that one carries what it took in,
    /// and what it changed since); rewritten after it was read, it counts again. A kept
    /// rollback on an unknown version is left out.
    #[test]
    fn a_superseded_entry_and_a_rollback_on_no_version_are_left_out() {
        let now = at(1_000);
        let ttl = Duration::from_secs(900);
        let mut old = entry("old", at(100));
        old.view.services.get_mut("ns/shifting").unwrap().rollback = Some(Rollback {
            cluster: "b".into(),
            version: None,
            why: "failed".into(),
            at_unix: 1,
        });
        let mut newer = entry("newer", at(500));
        newer.supersedes = vec![(entry_key("old"), old.written_unix)];
        let entries = |old: &KeptView| {
            vec![
                (entry_key("old"), Ok(old.clone())),
                (entry_key("newer"), Ok(newer.clone())),
            ]
        };
        let ReadAtStart { views, taken_in } = remembered(entries(&old), now, ttl);
        let replicas: Vec<_> = views
            .iter()
            .map(|(_, v)| v.replica.clone().unwrap())
            .collect();
        assert_eq!(replicas, ["newer"]);
        assert_eq!(taken_in, [(entry_key("newer"), newer.written_unix)]);
        // Rewritten since (its replica lives on): it counts, without the rollback on no
        // version.
        old.written_unix = to_unix(at(600));
        let ReadAtStart { views, .. } = remembered(entries(&old), now, ttl);
        let replicas: Vec<_> = views
            .iter()
            .map(|(_, v)| v.replica.clone().unwrap())
            .collect();
        assert_eq!(replicas, ["old", "newer"]);
        assert!(views[0].1.services["ns/shifting"].rollback.is_none());
    }

    /// The keeper writes nothing before the first build; then its replica's view with what
    /// it took in, on change (folded into one write a second); it removes what expired or
    /// cannot be read, never a fresh entry of another replica; with nothing to keep, it
    /// removes its own entry.
    #[tokio::test(start_paused = true)]
    async fn the_keeper_writes_after_the_first_build_and_removes_only_expired_entries() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::Dir(dir.path().to_path_buf());
        let now = SystemTime::now();
        let ttl = Duration::from_secs(600);
        let written = |secs_ago: u64| KeptView {
            written_unix: to_unix(now - Duration::from_secs(secs_ago)),
            view: view("other"),
            supersedes: Vec::new(),
        };
        store
            .write("replica-fresh.json", Some(&written(10)), &[])
            .await
            .unwrap();
        store
            .write("replica-expired.json", Some(&written(700)), &[])
            .await
            .unwrap();
        std::fs::write(dir.path().join("replica-garbage.json"), "[]").unwrap();
        let (tx, rx) = watch::channel(view("ignored"));
        let mut keeper = keeper(&store, ttl);
        keeper.taken_in = vec![("replica-fresh.json".into(), written(10).written_unix)];
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(keeper.run(rx, |v: &ReplicaView| v.clone(), shutdown.clone()));
        let mine = || async {
            let read = store.read().await.unwrap();
            read.into_iter()
                .find(|(k, _)| k == "replica-me.json")
                .map(|(_, e)| e.unwrap())
        };
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert!(mine().await.is_none(), "nothing before the first build");
        let mut shifting = view("ignored");
        shifting
            .services
            .insert("ns/stable".into(), switch(None, None));
        tx.send(shifting).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let first = mine().await.expect("written after the first build");
        let services: Vec<&String> = first.view.services.keys().collect();
        assert_eq!(services, ["ns/shifting"], "a stable service is not kept");
        assert_eq!(first.view.replica.as_deref(), Some("me"), "its own id");
        assert_eq!(first.supersedes.len(), 1);
        let mut keys: Vec<String> = store
            .read()
            .await
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        keys.sort();
        assert_eq!(keys, ["replica-fresh.json", "replica-me.json"]);
        // Nothing left to keep: its entry goes.
        tx.send(ReplicaView::default()).unwrap();
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert!(mine().await.is_none());
        shutdown.cancel();
        task.await.unwrap();
    }
}
